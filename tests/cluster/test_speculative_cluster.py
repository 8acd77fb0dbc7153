"""Draft replicas on the session's Ray cluster (the side application's, ``side_app`` in
conftest.py): exact ngram proposals through a handle and through
:class:`~workers.speculative.remote.RemoteProposer`; a worker's engine drafting through them;
a killed replica means no drafts within the deadline (plain decoding) until Serve's
replacement answers, then drafts again. Also the ``nalar serve`` flags and configuration that
select and place the proposer (no Ray)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.deployment import Application

from cluster.app import SHUTDOWN_POLL_S, WORKER_DEPLOYMENT, build_app
from cluster.cli import build_parser, serve_config
from cluster.config import ClusterConfig
from cluster.draft_deployment import DRAFT_DEPLOYMENT
from contract.request import GenerationRequest, SamplingParams
from workers.engine import LLMEngine
from workers.speculative.ngram import NgramProposer
from workers.speculative.proposer import ProposalRequest
from workers.speculative.remote import RemoteProposer

RECOVERY_S = 30.0

# (request_id, token_ids, num_prompt_tokens, k, scope): a copy to find, a longer one (under
# an adapter's scope; ngram looks only at the request's own tokens), none at all.
ITEMS = [
    ("copy", [7, 8, 9, 10, 11, 7, 8], 5, 3, ""),
    ("long", [1, 2, 3, 4, 5, 6, 1, 2, 3], 9, 2, "adapter-digest"),
    ("none", [40, 41, 42, 43], 4, 4, ""),
]
EXPECTED = [[9, 10, 11], [4, 5], []]


def requests() -> list[ProposalRequest]:
    return [ProposalRequest(*item) for item in ITEMS]


@pytest.fixture(scope="module")
def draft_handle(side_app):
    """The side application's draft deployment (one ngram replica, n-grams of 1 to 3)."""
    return serve.get_deployment_handle(DRAFT_DEPLOYMENT, side_app.name)


def test_expected_proposals_are_the_local_ngram_ones():
    assert NgramProposer(1, 3).propose(requests()) == EXPECTED


def test_draft_replica_proposes_exactly(draft_handle):
    assert draft_handle.describe.remote().result(timeout_s=30)["proposer"] == "ngram"
    assert draft_handle.propose.remote(ITEMS).result(timeout_s=30) == EXPECTED
    draft_handle.finish.remote(["copy", "long", "none"]).result(timeout_s=30)


def test_remote_proposer_one_call_per_step(draft_handle):
    proposer = RemoteProposer(draft_handle, deadline_s=5.0)
    for _ in range(3):
        assert proposer.propose(requests()) == EXPECTED
    assert (proposer.calls, proposer.timeouts, proposer.failures) == (3, 0, 0)


async def test_worker_engine_drafts_through_the_draft_replica(side_app, draft_handle):
    """The engine thread inside a worker replica calls the draft deployment: drafts are
    proposed and verified, and the greedy output equals the model's without speculation
    (an engine in this process, on the same weights)."""
    prompt = list(range(2324, 2336)) * 4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    worker = serve.get_deployment_handle(WORKER_DEPLOYMENT, side_app.name)
    request = GenerationRequest("spec-remote", prompt, params)
    chunks = [chunk async for chunk in worker.options(stream=True).generate.remote(request)]
    plain = LLMEngine(side_app.config.model_copy(update={"speculative": "off"}).engine_config())
    expected = plain.generate([GenerationRequest("plain", prompt, params)])["plain"]
    spec = chunks[-1].spec
    assert [t for c in chunks for t in c.token_ids] == [t for c in expected for t in c.token_ids]
    assert chunks[-1].completion_tokens == 24
    assert spec is not None and spec.proposed_tokens > 0 and spec.verification_steps > 0
    stats = await asyncio.to_thread(
        lambda: worker.broadcast("engine_stats").results(timeout_s=30))
    assert sum(s["draft_calls"] for s in stats) > 0
    assert all((s["draft_timeouts"], s["draft_failures"]) == (0, 0) for s in stats)


def test_killed_replica_means_no_drafts_then_recovery(side_app, draft_handle):
    deadline_s = 0.3
    proposer = RemoteProposer(draft_handle, deadline_s=deadline_s)
    assert proposer.propose(requests()) == EXPECTED
    replica = draft_handle.describe.remote().result(timeout_s=30)["replica_id"]
    actor = ray.get_actor(f"SERVE_REPLICA::{side_app.name}#{DRAFT_DEPLOYMENT}#{replica}",
                          namespace="serve")
    ray.kill(actor, no_restart=True)
    _wait_until_dead(actor)  # ray.kill returns before the actor is gone

    empty_steps, slowest_s, recovered = 0, 0.0, False
    stop = time.monotonic() + RECOVERY_S
    while time.monotonic() < stop:
        started = time.monotonic()
        drafts = proposer.propose(requests())
        slowest_s = max(slowest_s, time.monotonic() - started)
        if drafts == EXPECTED:
            recovered = True
            break
        assert drafts == [[], [], []]  # plain decoding, never different drafts
        empty_steps += 1
        time.sleep(0.05)  # an engine step
    assert empty_steps > 0 and proposer.timeouts + proposer.failures > 0
    assert proposer.skipped > 0  # backed off instead of waiting out a deadline every step
    assert slowest_s < deadline_s + 0.5
    assert recovered, f"no drafts {RECOVERY_S} s after the kill"
    new_replica = draft_handle.describe.remote().result(timeout_s=30)["replica_id"]
    assert new_replica != replica


def _wait_until_dead(actor, timeout_s: float = 10.0) -> None:
    """Returns once a call to ``actor`` fails (or after ``timeout_s``)."""
    stop = time.monotonic() + timeout_s
    while time.monotonic() < stop:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1.0)
        except Exception:  # noqa: BLE001 - any failure means the actor is gone
            return
        time.sleep(0.05)


# -- configuration and flags (no Ray) ---------------------------------------------------------


def test_serve_defaults_to_ngram_in_the_worker():
    config = serve_config(build_parser().parse_args(["serve"]))
    spec = config.engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive, spec.remote) == (
        "ngram", 4, True, False)
    assert not config.draft_is_remote


def test_serve_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--speculative", "ngram", "--num-speculative-tokens", "6", "--ngram-min", "2",
        "--ngram-max", "5", "--draft-replicas", "3", "--draft-deadline-ms", "20",
        "--speculative-remote", "--no-adaptive-speculation"])
    config = serve_config(args)
    spec = config.engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == (
        "ngram", 6, 2, 5)
    assert (spec.remote, spec.adaptive, spec.draft_replicas) == (True, False, 3)
    assert spec.deadline_s == pytest.approx(0.02)
    assert config.draft_is_remote


def test_suffix_always_runs_on_draft_replicas_and_off_on_none():
    assert ClusterConfig(speculative="suffix").draft_is_remote
    off = ClusterConfig(speculative="off", speculative_remote=True)
    assert not off.draft_is_remote and not off.engine_config().speculative.enabled


@pytest.mark.parametrize("options", [{"ngram_min": 3, "ngram_max": 2},
                                     {"num_speculative_tokens": 0},
                                     {"draft_deadline_s": 0}, {"speculative": "model"}])
def test_bad_speculative_settings_are_refused(options):
    with pytest.raises(ValueError):
        ClusterConfig(**options)


def deployments(config: ClusterConfig) -> dict[str, Any]:
    """Deployment name -> the deployment, over the bound application graph."""
    seen, todo = {}, [build_app(config)]
    while todo:
        deployment = todo.pop()._bound_deployment
        seen[deployment.name] = deployment
        todo.extend(a for a in deployment.init_args if isinstance(a, Application))
    return seen


def test_every_deployment_counts_its_drain_often():
    graph = deployments(ClusterConfig(speculative="suffix", worker_gpus=0))
    assert len(graph) == 3
    for deployment in graph.values():
        assert deployment._deployment_config.graceful_shutdown_wait_loop_s == SHUTDOWN_POLL_S


def test_app_binds_draft_replicas_only_when_remote():
    remote = ClusterConfig(speculative="suffix", worker_gpus=0)
    local = ClusterConfig(speculative="ngram", worker_gpus=0)
    graph = {name: d.init_args for name, d in deployments(remote).items()}
    assert graph[DRAFT_DEPLOYMENT] == (remote.speculative_config(), remote.engine_config())
    assert graph[WORKER_DEPLOYMENT][1]._bound_deployment.name == DRAFT_DEPLOYMENT
    graph = {name: d.init_args for name, d in deployments(local).items()}
    assert DRAFT_DEPLOYMENT not in graph and len(graph[WORKER_DEPLOYMENT]) == 1
