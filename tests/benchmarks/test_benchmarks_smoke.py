"""Smoke tests of the benchmark scripts: each ``main()`` runs with ``--quick`` on the tiny
random Llama and one thread, and its JSON must hold exact token counts and consistent figures.
The HTTP row runs against a scripted SSE server (httpx's mock transport)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import sysconfig
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import (  # noqa: E402
    arrival_wait,
    batch_invariance,
    common,
    gpu_first_start,
    interference,
    kernel_choices,
    lora,
    memory_growth,
    prefill,
    spec_paper_check,
    speculative,
    step_profile,
    throughput,
)
from workers import kernels  # noqa: E402
from workers.kernels import prefill_attention  # noqa: E402

QUICK = ["--quick", "--model", common.TINY_MODEL, "--threads", "1"]


def run_main(module, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{module.__name__.rsplit('.', 1)[-1]}.json"
    result = module.main([*QUICK, "--out", str(out), *extra])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["machine"]["torch_threads"] == 1
    assert result["machine"]["dtype"] in ("bfloat16", "float32")
    assert result["machine"]["cpu"]["model"]
    assert set(result["machine"]["cpu"]["flags"]) >= {"avx512_bf16", "amx_bf16"}
    return result


def test_percentile_matches_numpy():
    values = [random.Random(3).uniform(0, 10) for _ in range(37)]
    values = [v * (i + 1) for i, v in enumerate(values)]
    for q in (0, 1, 50, 90, 99, 100):
        assert common.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert common.percentile([], 50) is None


def test_text_prompts_are_exact_distinct_windows_of_stdlib_source():
    from workers.model_source import load_tokenizer
    tokenizer = load_tokenizer("embedded")
    prompts = common.text_prompts(tokenizer, 3, 50)
    assert [len(p) for p in prompts] == [50, 50, 50]
    assert len({tuple(p) for p in prompts}) == 3
    assert common.text_prompts(tokenizer, 3, 50) == prompts
    source = (Path(sysconfig.get_paths()["stdlib"]) / common.STDLIB_SOURCES[0]).read_text()
    assert tokenizer.decode(prompts[0] + prompts[1]) in source
    with pytest.raises(ValueError, match="at least 1"):
        common.text_prompts(tokenizer, 1, 0)


def test_parse_rows_expands_hf_and_rejects_unknown_rows():
    assert throughput.parse_rows("hf,engine") == ["engine", "hf_generate", "hf_generate_batch",
                                                  "hf_single"]
    with pytest.raises(SystemExit, match="unknown row 'vllm'"):
        throughput.parse_rows("engine,vllm")


def test_throughput_quick(tmp_path):
    result = run_main(throughput, tmp_path, "--dtype", "float32")
    rows = result["rows"]
    engine = rows["engine"]
    assert engine["batched"]["output_tokens"] == 2 * 4
    assert engine["single"]["output_tokens"] == 4
    assert engine["batched"]["ttft"]["count"] == 2
    assert engine["batched"]["itl"]["count"] == 2 * 3
    assert 2 in engine["batch_sizes"]  # the two requests really shared steps
    if result["machine"]["torch_default_threads"] != 1:  # the default configuration's figure
        assert engine["single_default_threads"]["output_tokens"] == 4
        assert engine["single_default_threads"]["threads"] == (
            result["machine"]["torch_default_threads"])
    for name, batch in (("hf_generate", 2), ("hf_generate_batch", 2), ("hf_single", 1)):
        assert rows[name]["output_tokens"] == batch * 4, name
        assert rows[name]["output_tokens_per_s"] > 0
    assert rows["hf_generate_batch"]["errors"] == []
    # fp32: our engine and transformers produce the same greedy tokens on the same prompts
    assert [(a["theirs"], a["identical_requests"], a["requests"])
            for a in result["token_agreement"]] == [
        ("hf_generate", 2, 2), ("hf_generate_batch", 2, 2), ("hf_single", 1, 1)]
    assert "token_ids" not in json.dumps(result)
    assert [g["goal"] for g in result["goals"]] == [">= 2.5", ">= 1.2", ">= 1.0"]
    assert all(g["value"] > 0 for g in result["goals"])


def sse_server(tokens: int, seen: list[dict]) -> httpx.MockTransport:
    """A /v1/completions stand-in that streams ``tokens`` one-token chunks, then usage."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if not body["prompt"]:
            return httpx.Response(400, json={"error": {"message": "empty"}})
        count = min(tokens, body["max_tokens"])
        events = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                  for i in range(count)]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": count}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"x-nalar-worker": "w1"})

    return httpx.MockTransport(handle)


def test_http_rows_parse_the_stream():
    seen: list[dict] = []
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    rows = asyncio.run(throughput.http_rows("http://test", prompts, 5, sse_server(5, seen)))
    assert rows["batched"]["output_tokens"] == 15
    assert rows["batched"]["ttft"]["count"] == 3
    assert rows["batched"]["itl"]["count"] == 3 * 4
    assert rows["single"]["output_tokens"] == 5
    assert rows["batched"]["workers"] == ["w1"]
    assert {tuple(b["prompt"]) for b in seen[1:4]} == {tuple(p) for p in prompts}
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["stream"] for b in seen)
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(throughput.http_rows("http://test", [[]], 5, sse_server(5, seen)))


def test_prefill_quick(tmp_path):
    result = run_main(prefill, tmp_path)
    assert result["settings"] == {"unchunked": 128, "chunk_32": 32}
    for setting in result["engine"].values():
        for length in (64, 128):
            assert setting[length]["cached_tokens"] == 0
            assert setting[length]["tokens_per_s"] > 0
    assert result["engine"]["chunk_32"][128]["steps"] == 4  # 128 tokens in chunks of 32
    assert result["engine"]["unchunked"][128]["steps"] == 1
    assert set(result["transformers"]) == {64, 128}
    assert result["goals"][0]["value"] > 0


def test_interference_quick(tmp_path):
    result = run_main(interference, tmp_path)
    settings = result["settings"]
    assert list(settings) == ["16", "32", "32@0.001ms", "off"]
    for name, s in settings.items():
        assert s["output_tokens"] == 2 * 12 + 2, name
        assert s["streams_itl"]["count"] == 2 * 11
        assert s["long_prompt_cached_tokens"] == 0
        assert s["streams_itl"]["p50_ms"] <= s["streams_itl"]["p99_ms"] <= s["longest_stall_ms"]
        prefill_per_step = [step[2] for step in s["steps"]]
        assert sum(prefill_per_step) == 2 * 8 + 64  # the streams and the long prompt
        assert max(prefill_per_step) <= s["token_budget"]
    assert 64 in [step[2] for step in settings["off"]["steps"]]  # unchunked: one step
    # beside the 2 decodes, the target (far below any step) leaves the long prompt one block
    # (16 tokens) a step, where the budget alone leaves it 30
    for name, chunk in (("32@0.001ms", 16), ("32", 30)):
        after_arrival = settings[name]["steps"][settings[name]["long_arrival_step"]:]
        assert max(step[2] for step in after_arrival) == chunk, name
    assert result["goal"]["best"] in ("16", "32", "32@0.001ms")
    assert len(result["goal"]["checks"]) == 2


def test_arrival_wait_quick(tmp_path):
    result = run_main(arrival_wait, tmp_path)
    off, capped = result["settings"]["off"][0], result["settings"]["0.001"][0]
    for row in (off, capped):
        prefill_per_step = [step[2] for step in row["steps"]]
        assert sum(prefill_per_step) == 96 + 8 * row["short_requests"]
        assert max(prefill_per_step) <= 48  # the token budget
        assert row["short_ttft"]["p50_ms"] <= row["short_ttft_max_ms"]
    # the same arrivals; a cap far below any step leaves the long prompt at most a block (16
    # tokens) a step, where the budget alone leaves it at least half of 48
    assert capped["short_requests"] == off["short_requests"] == 31  # over 30 ms, one a ms
    assert off["long_prefill_steps"] <= 4 and capped["long_prefill_steps"] >= 6
    assert result["goal"] == {"checks": [], "met": None}  # no 1,000 ms row in --quick


def test_step_profile_quick(tmp_path):
    result = run_main(step_profile, tmp_path)
    for batch in (1, 2):
        decode = result["decode"][batch]
        assert len(decode["step_ms"]) == 3
        assert decode["step_ms_median"] > 0 and decode["linear_layers_ms"] > 0
    for size in ("weights_size", "large"):
        assert result["memory_bandwidth"][size]["read_bytes_per_s"] > 1e8
    assert result["memory_bandwidth"]["weights_size"]["tensor_bytes"] == (
        result["weights_bytes"] // 4 * 4)
    assert result["matmul"]["flops_per_s"] > 1e8
    tiny = common.tiny_model("auto").model
    assert result["weights_bytes"] == sum(p.numel() * p.element_size()
                                          for p in tiny.parameters())
    assert 0 < result["prefill"]["fraction_of_matmul_limit"] < 1


def test_memory_growth_quick(tmp_path):
    result = run_main(memory_growth, tmp_path)
    assert result["requests"] >= 4 and result["steps"] > 0
    samples = result["samples"]
    assert samples[0]["t_s"] == 0 and len(samples) >= 3
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert (result["rss_first_mib"], result["rss_last_mib"]) == (
        samples[0]["rss_mib"], samples[-1]["rss_mib"])
    assert result["slope_second_half_mib_per_min"] is not None


def test_second_half_slope_is_least_squares_in_mib_per_minute():
    samples = [{"t_s": t, "rss_mib": 100 + (0 if t < 50 else 0.5 * t)} for t in range(0, 101, 10)]
    assert memory_growth.second_half_slope(samples) == pytest.approx(30.0)
    assert memory_growth.second_half_slope(samples[:1]) is None


def test_prefill_flops_of_the_tiny_llama():
    model = common.tiny_model("float32").model
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64
    decoder = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    tokens = 10
    attention = 2 * 2 * 2 * 4 * 16 * tokens * (tokens + 1) / 2
    head = 2 * 64 * model.config.vocab_size
    assert step_profile.prefill_flops(model, tokens) == 2 * decoder * tokens + attention + head


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="prepacked bf16 weights need a CPU with native bf16")
def test_kernel_choices_quick(tmp_path):
    result = run_main(kernel_choices, tmp_path)
    assert set(result["linear"]) == {f"{name}/{rows}" for name in kernel_choices.LINEAR_SHAPES
                                     for rows in (1, 8, 300)}
    assert all(row["plain_ms"] > 0 and row["prepacked_ms"] > 0 and row["bit_identical"]
               for row in result["linear"].values())
    small = kernels.packed_linear()
    runs = {"torch.bfloat16": "runs_bf16", "torch.float32": "runs_f32"}[result["dtype"]]
    timed_small = small is not None and getattr(small, runs)()
    assert all(("packed_small_ms" in row) == timed_small for row in result["linear"].values())
    assert all(row["packed_small_ms"] > 0 for row in result["linear"].values() if timed_small)
    assert result["flash"]["tokens"] == 64
    cases = result["decode_attention"]
    assert set(cases) == {"float32/2x40", "bfloat16/2x40"}
    assert cases["float32/2x40"]["max_abs_difference"] < 1e-5
    assert cases["bfloat16/2x40"]["max_abs_difference"] < 0.05
    decodes, verification = result["decode_attention_from_dram"]
    assert (decodes["batch"], decodes["drafts"], verification["drafts"]) == (2, 0, 2)
    # 2 layers x 2 sequences (then 1) x 3 blocks of 16 tokens x 3 KV heads x 64 dims, K and V,
    # in the dtype's bytes: a verification block reads its sequence's blocks as a decode does
    size = torch.empty(0, dtype=getattr(torch, result["dtype"].removeprefix("torch."))).itemsize
    assert decodes["kv_bytes"] == 2 * 2 * 2 * 3 * 16 * 3 * 64 * size
    assert verification["kv_bytes"] == decodes["kv_bytes"] // 2
    assert all(min(case["native_step_ms"], case["in_order_step_ms"],
                   case["read_floor_step_ms"]) > 0 for case in (decodes, verification))
    if kernels.weight_linear() is not None:
        steps = result["stored_q4_1_from_dram"]
        assert set(steps) == {"1", "5"}
        # 2 layers of SmolLM2's four projections in Q4_1: 20 bytes a block of 32 weights
        params = sum(n * k for n, k in kernel_choices.LINEAR_SHAPES.values())
        assert all(step["weight_bytes"] == 2 * params * 20 // 32 and step["step_ms"] > 0
                   for step in steps.values())
    if prefill_attention() is not None:
        spans = result["prefill_attention"]
        assert set(spans) == {"40+0", "20+30"}
        assert all(0 < span["native_min_ms"] <= span["native_median_ms"]
                   and span["max_abs_difference"] < 0.05 for span in spans.values())


def test_stdlib_functions_are_real_functions_of_15_to_60_lines():
    functions = speculative.stdlib_functions(6)
    assert functions == speculative.stdlib_functions(6)
    assert len({name for name, _ in functions}) == 6
    assert len({name.split(".")[0] for name, _ in functions}) == 6  # modules taken in turn
    for name, source in functions:
        assert 15 <= source.count("\n") <= 60, name
        assert source.startswith("def "), name
        compile(source, name, "exec")


def test_speculative_quick(tmp_path):
    result = run_main(speculative, tmp_path, "--dtype", "float32")
    rows = result["rows"]
    engines = ["engine_off", "engine_ngram_adaptive", "engine_ngram_k4"]
    assert list(rows["batch_1"]) == [*engines, "hf_plain", "hf_prompt_lookup"]
    assert list(rows["concurrent_2"]) == engines
    assert list(rows["general_chat"]) == engines[:2]
    for section in ("batch_1", "concurrent_2"):
        tokens = {row["output_tokens"] for row in rows[section].values()}
        assert len(tokens) == 1 and 0 < tokens.pop() <= 2 * 12, section  # greedy: same length
        assert all(row["decode_tokens_per_s"] > 0 for row in rows[section].values())
    assert rows["batch_1"]["engine_off"]["speedup_vs_engine_off"] == 1.0
    assert rows["batch_1"]["engine_off"]["spec"] is None
    fixed = rows["batch_1"]["engine_ngram_k4"]["spec"]
    assert fixed["requests"] == 2 and set(fixed["k_decisions"]) <= {0, 1, 2, 3, 4}
    assert fixed["accepted_tokens"] <= fixed["proposed_tokens"]
    # fp32: speculation never changes greedy output; nor does transformers' prompt lookup here
    for name, check in result["greedy_equality"].items():
        assert check["identical"] == check["prompts"] and check["parted"] == [], name
    assert all(result["deterministic_repeats"].values())
    assert [g["goal"] for g in result["goals"]] == [">= 2.0", ">= 2.0", ">= 1.3", ">= 1.3",
                                                    ">= 0.95", ">= 1.0"]
    assert result["goals"][-1]["met"] is True
    assert "token_ids" not in json.dumps(result)


def test_speculative_compare_reports_where_outputs_part():
    check = speculative.compare([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]], [[0], [0]],
                                ["a", "b"])
    assert check["identical"] == 1
    assert check["parted"] == [{"prompt": "a", "position": 2, "tokens": [[3], [9]],
                                "lengths": [3, 3]}]
    assert speculative.compare([[1, 2]], [[1, 2, 3]], [[0]], ["c"])["parted"][0][
        "position"] == 2


def test_batch_invariance_compares_logprobs_up_to_the_first_different_token():
    reference = ([5, 6, 7, 8], [-1.0, -0.5, -2.0, -0.25])
    parted = batch_invariance.compare(([5, 6, 9, 8], [-1.25, -0.5, -0.125, -0.25]), reference)
    assert parted == (False, 2, [0.25, 0.0])
    assert batch_invariance.compare(reference, reference) == (True, 4, [0.0] * 4)
    row = batch_invariance.summarize([parted, (True, 4, [0.0, 0.5, 0.0, 0.0])])
    assert row == {"identical_outputs": 0.5, "mean_tokens_before_first_difference": 3.0,
                   "max_abs_logprob_difference": 0.5, "median_abs_logprob_difference": 0.0}


def test_paper_formula_and_controlled_proposer():
    from workers.speculative.proposer import ProposalRequest
    assert spec_paper_check.predicted_speedup(0.0, 4, 0.0) == 1.0
    assert spec_paper_check.predicted_speedup(1.0, 4, 0.0) == 5.0
    assert spec_paper_check.predicted_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    proposer = spec_paper_check.ControlledProposer(vocab_size=100)
    proposer.truth = {"r": [7, 8, 9, 10, 11]}
    ask = ProposalRequest("r", [1, 2, 7, 8], num_prompt_tokens=2, k=3)
    proposer.reset(1.0, 0.0, seed=0)
    assert proposer.propose([ask]) == [[9, 10, 11]]
    proposer.reset(0.0, 0.0, seed=0)
    assert all(t != s for t, s in zip(proposer.propose([ask])[0], [9, 10, 11], strict=True))
    proposer.reset(0.6, 0.0, seed=1)
    kept = sum(t == s for _ in range(500)
               for t, s in zip(proposer.propose([ask])[0], [9, 10, 11], strict=True))
    assert 0.5 < kept / 1500 < 0.7
    assert proposer.calls[-1][0] == 3


def test_spec_paper_check_quick(tmp_path):
    result = run_main(spec_paper_check, tmp_path, "--dtype", "float32")
    rows = result["rows"]
    assert [(r["alpha_set"], r["gamma"], r["c_set"]) for r in rows] == [
        (0.5, 1, 0.0), (0.5, 3, 0.0), (0.9, 1, 0.0), (0.9, 3, 0.0), (0.9, 3, 0.5)]
    assert result["plain"]["outputs_identical_to_reference"]
    for row in rows:
        assert 0 <= row["alpha_measured"] <= 1 and row["reached_positions"] > 0
        assert 1 <= row["tokens_per_step_measured"] <= row["gamma"] + 1
        assert row["speedup_measured"] > 0 and row["predicted_c_total"] > 0
    assert rows[-1]["c_draft"] > 0.3  # the proposer sleeps half a plain step per draft token
    assert rows[0]["c_draft"] < 0.3
    if result["png"] is not None:
        assert Path(result["png"]).stat().st_size > 0
    assert len(result["goals"]) == 3


def test_gpu_first_start_says_plainly_without_cuda(tmp_path, monkeypatch):
    from workers import devices

    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    out = tmp_path / "gpu_first_start.json"
    with pytest.raises(SystemExit, match="needs a CUDA device and torch sees none"):
        gpu_first_start.main(["--quick", "--out", str(out)])
    assert not out.exists()


def test_gpu_first_start_checks_on_the_cpu(tmp_path):
    """The script's three checks, run on the CPU (its CUDA run is for a GPU host)."""
    out = tmp_path / "gpu_first_start.json"
    args = gpu_first_start.parse_args([*QUICK, "--dtype", "float32", "--kv-cache-mib", "16",
                                       "--out", str(out)])
    result = gpu_first_start.measure(args, "cpu")
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["machine"]["dtype"] == "float32" and result["device"] == "cpu"
    assert result["kv_cache"]["derivation"] == ["KV cache budget 16 MiB (explicit): 16 MiB as "
                                                "configured"]
    equality = result["greedy_equality"]
    assert list(equality) == ["float32"]  # fp32 already: no rerun
    assert equality["float32"]["all_identical"]
    assert [(row["identical"], row["tokens"]) for row in equality["float32"]["prompts"]] == [
        (True, 8), (True, 8)]
    prefix = result["prefix_ttft"]
    assert [(s["miss_cached_tokens"], s["hit_cached_tokens"]) for s in prefix["samples"]] == [
        (0, 992)]
    assert prefix["hit_ttft_median_ms"] > 0 and prefix["miss_ttft_median_ms"] > 0
    concurrent = result["concurrent"]
    assert concurrent["output_tokens"] == 4 * 8 and concurrent["output_tokens_per_s"] > 0
    assert concurrent["ttft"]["count"] == 4
    assert "token_ids" not in json.dumps(result)


def test_lora_balance_report_takes_the_measured_runs_differences():
    before = {"w1": {"work": 1000.0, "requests": 10.0, "source_resident": 8.0,
                     "source_read": 2.0},
              "w2": {"work": 500.0, "requests": 5.0, "source_resident": 5.0}}
    after = {"w1": {"work": 3000.0, "requests": 30.0, "source_resident": 25.0,
                    "source_read": 3.0, "source_slot": 2.0, "slot_wait_s": 0.5},
             "w2": {"work": 3000.0, "requests": 25.0, "source_resident": 20.0,
                    "source_host": 5.0}}
    report = lora.balance_report(before, after)
    assert report["adapter_requests"] == 40
    assert report["by_source"] == {"resident": 32, "host": 5, "read": 1, "slot": 2}
    assert report["waited_share"] == 3 / 40  # a read or a slot wait; a swap is not a wait
    assert report["work_busiest_over_least"] == 2500 / 2000
    assert report["mean_slot_wait_s"] == 0.25
