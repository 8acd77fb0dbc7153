"""The Kubernetes manifests and Serve config parse and validate offline.

The RayService is checked against KubeRay's CRD schema, its embedded ``serveConfigV2`` against
Ray's ``ServeDeploySchema`` and the application's args against
:class:`~cluster.config.ClusterConfig`; built-in kinds with ``kubernetes-validate``.

The CRD is not in the repository: ``$NALAR_KUBERAY_CRD`` names its YAML file (``.ci/run`` sets
it). Unset, the CRD tests skip and say so; set to a file that is not there, they fail.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD_ENV = "NALAR_KUBERAY_CRD"
KUBERNETES_VERSION = "1.34"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in _documents(K8S / name)]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in _manifests() if doc["kind"] == kind]


def _rayservice() -> dict[str, Any]:
    (service,) = _of_kind("RayService")
    return service


def _crd_schema() -> dict[str, Any]:
    """The RayService CRD's v1 schema, from the file ``$NALAR_KUBERAY_CRD`` names.

    Skips the calling test when the variable is unset (or empty); fails it when the file is
    missing. Called from the test bodies rather than a fixture, so that a missing file is
    reported as a failed test, not a setup error.
    """
    path = os.environ.get(CRD_ENV)
    if not path:
        pytest.skip(f"set {CRD_ENV} to the KubeRay RayService CRD YAML (.ci/run sets it) to "
                    "validate the manifests against it")
    if not Path(path).is_file():
        pytest.fail(f"{CRD_ENV}={path}: no such file (the KubeRay RayService CRD YAML)")
    return _load_crd_schema(path)


@functools.cache
def _load_crd_schema(path: str) -> dict[str, Any]:
    crd = yaml.safe_load(Path(path).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def _crd_errors(schema: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


def test_every_yaml_file_parses_and_kustomization_names_existing_files() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert {f.name for f in files} >= {"kustomization.yaml", "rayservice.yaml", "redis.yaml",
                                         "serve-config.yaml", "namespace.yaml"}
    for path in files:
        assert _documents(path), path
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), name
    for generator in kustomization["configMapGenerator"]:
        for name in generator["files"]:
            assert (K8S / name).is_file(), name


def test_rayservice_validates_against_the_kuberay_crd() -> None:
    assert _crd_errors(_crd_schema(), _rayservice()) == []


def test_a_broken_rayservice_fails_the_crd_schema() -> None:
    crd_schema = _crd_schema()
    broken = copy.deepcopy(_rayservice())
    group = broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    del group["groupName"]                      # required
    group["maxReplicas"] = "eight"              # integer
    broken["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Eager"
    errors = _crd_errors(crd_schema, broken)
    assert any("groupName" in e for e in errors), errors
    assert any("maxReplicas" in e for e in errors), errors
    assert any("upscalingMode" in e for e in errors), errors


def _serve_config_v2() -> dict[str, Any]:
    return yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])


@pytest.mark.parametrize("source", ["rayservice", "serve-config"])
def test_serve_configs_validate_with_ray_and_the_cluster_config(source: str) -> None:
    raw = (_serve_config_v2() if source == "rayservice"
           else yaml.safe_load((K8S / "serve-config.yaml").read_text()))
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "cluster.serve_app:app_builder"
    config = ClusterConfig.model_validate(app.args)
    assert config.redis_url, "a config-file deployment names its Redis"


def test_a_broken_serve_config_fails_ray_validation() -> None:
    raw = _serve_config_v2()
    raw["applications"][0]["deployments"][0]["num_replicas"] = -1
    with pytest.raises(ValueError):
        ServeDeploySchema.model_validate(raw)
    raw = _serve_config_v2()
    raw["applications"][0]["args"]["block_size"] = 0
    with pytest.raises(ValueError, match="block_size"):
        ClusterConfig.model_validate(raw["applications"][0]["args"])


def test_builtin_kinds_validate_against_kubernetes() -> None:
    builtin = [doc for doc in _manifests() if doc["apiVersion"] in ("v1", "apps/v1")]
    assert {doc["kind"] for doc in builtin} >= {"Deployment", "Service", "Namespace"}
    for doc in builtin:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_builtin_kind_fails_kubernetes_validation() -> None:
    (redis,) = _of_kind("Deployment")
    broken = copy.deepcopy(redis)
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["template"]["spec"]["containers"]


def test_cluster_shape_gpu_targets_separate_drafts_idle_head() -> None:
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    targets, drafts = groups["targets"], groups["drafts"]
    for group in (targets, drafts):
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert _containers(targets)[0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in targets["template"]["spec"]["tolerations"])
    assert "nvidia.com/gpu" not in _containers(drafts)[0]["resources"]["limits"]
    deployments = {d["name"]: d for d in _serve_config_v2()["applications"][0]["deployments"]}
    assert deployments["NalarWorker"]["ray_actor_options"]["num_gpus"] == 1
    assert deployments["NalarWorker"]["ray_actor_options"]["resources"] == {"nalar_target": 1}
    assert "nalar_target" in targets["resources"]
    assert deployments["NalarDraft"]["ray_actor_options"]["resources"] == {"nalar_draft": 1}
    assert "nalar_draft" in drafts["resources"]
    assert deployments["NalarDraft"]["autoscaling_config"]["max_replicas"] > 1
    # the ingress on the head: losing a GPU or draft pod must not cut every stream
    assert deployments["NalarIngress"]["ray_actor_options"] == {
        "num_cpus": 0, "resources": {"nalar_ingress": 1}}
    assert cluster["headGroupSpec"]["resources"] == {"nalar_ingress": "1"}


def test_secrets_are_references_never_literals() -> None:
    assert _of_kind("Secret") == []
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in _containers(pod):
            refs = [src["secretRef"]["name"] for src in container.get("envFrom", [])]
            assert refs == ["nalar-secrets"], container["name"]
            assert not any("value" in env for env in container.get("env", [])
                           if "KEY" in env["name"] or "SECRET" in env["name"])


def test_redis_has_readiness_probe_limits_and_a_service() -> None:
    (redis,) = _of_kind("Deployment")
    (container,) = _containers(redis["spec"])
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}
    services = {s["metadata"]["name"] for s in _of_kind("Service")}
    assert "nalar-redis" in services
    assert _serve_config_v2()["applications"][0]["args"]["redis_url"].startswith(
        "redis://nalar-redis:")


def test_openai_service_is_scraped_for_metrics() -> None:
    serve_service = _rayservice()["spec"]["serveService"]
    annotations = serve_service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert serve_service["spec"]["ports"][0]["port"] == int(annotations["prometheus.io/port"])
