"""``serve run`` on k8s/serve-config.yaml serves the Nalar application.

The file is run as a user would, by Ray's own CLI in a separate process (its own local Ray
instance), with only the model, port and Redis key prefix changed: the model is a tiny random
Llama saved with the embedded model's tokenizer, and its greedy output through HTTP must equal
transformers ``generate`` on the same weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from helpers import free_port
from transformers import AutoModelForCausalLM

from router.index.redis_index import delete_key_prefix
from workers.model_source import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SERVE_CLI = Path(sys.executable).with_name("serve")
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 20
PROMPT = "The capital of France is"


def _config_file(tmp_path: Path, model_dir: Path, port: int, redis_url: str,
                 prefix: str) -> Path:
    config = yaml.safe_load((ROOT / "k8s" / "serve-config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args.update(model=str(model_dir), dtype="float32", num_workers=1, redis_url=redis_url,
                key_prefix=prefix, kv_cache_mib=16, speculative="off", worker_threads=1)
    path = tmp_path / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def served(tmp_path, tiny_model_dir, redis_url) -> Iterator[str]:
    port = free_port()
    prefix = f"nalar-serve-run-{uuid.uuid4().hex[:8]}"
    config = _config_file(tmp_path, tiny_model_dir, port, redis_url, prefix)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = (tmp_path / "serve-run.log").open("wb")
    process = subprocess.Popen([str(SERVE_CLI), "run", str(config)], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(base_url, process, tmp_path / "serve-run.log")
        yield base_url
    finally:
        _stop(process)
        delete_key_prefix(redis_url, prefix)


def _wait_until_healthy(base_url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"serve run exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"serve run did not become healthy in {START_TIMEOUT_S} s:\n"
                f"{log.read_text()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops ``serve run``; it shuts its Serve and Ray instance down. Alone
    that takes about 7 s; in the full suite it once waited out a minute (its controller's
    graceful shutdown retried against a killed actor), so after :data:`STOP_TIMEOUT_S` the
    whole process group (its Ray instance's processes too) is killed."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _reference(model_dir: Path, max_new_tokens: int) -> str:
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_serve_run_on_the_config_file_serves_the_application(served, tiny_model_dir) -> None:
    models = httpx.get(f"{served}/v1/models", timeout=10).json()["data"]
    assert len(models) == 1
    body = {"model": models[0]["id"], "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    first = httpx.post(f"{served}/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == _reference(tiny_model_dir, 8)
    assert first.json()["usage"]["completion_tokens"] == 8
    assert first.headers["x-nalar-worker"]
