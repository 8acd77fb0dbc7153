"""LoRA adapters in the engine: fp32 greedy ids equal transformers + peft ``generate`` with the
same adapter, a step mixing base rows and three adapters equals each run alone, chunked,
cached and speculative paths equal cold, KV never crosses adapters, and malformed adapters are
refused with the reason.

Adapters are made by peft at test time from fixed seeds with ``init_lora_weights=False``, so
``lora_B`` is non-zero and each adapter really changes the output (asserted).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from helpers import greedy, output_ids, random_prompt
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from test_speculative import OracleProposer
from tiny_models import build_tiny_qwen2, reference_attention

from contract.identity import AdapterRef, CacheNamespace
from contract.request import InvalidRequestError
from workers.lora.adapter import BaseShapes, load_adapter
from workers.lora.errors import AdapterError
from workers.model_loader import load_model
from workers.speculative.config import SpeculativeConfig

NEW_TOKENS = 12
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_ADAPTERS = {
    # every projection, plain alpha / r
    "all": dict(seed=1, r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS),
    # attention only, rsLoRA (alpha / sqrt(r))
    "attn-rs": dict(seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"],
                    use_rslora=True),
    # MLP only, a per-module rank and alpha (rank_pattern, alpha_pattern)
    "mlp-pattern": dict(seed=3, r=2, lora_alpha=2, target_modules=["gate_proj", "down_proj"],
                        rank_pattern={"down_proj": 6}, alpha_pattern={"gate_proj": 5}),
}


def make_peft_adapter(base: torch.nn.Module, directory: Path, seed: int,
                      **config) -> PeftModel:
    """peft's LoRA on ``base`` (modified in place) with seeded non-zero A and B, saved to
    ``directory``; returns the peft model (the reference)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    peft_model.save_pretrained(directory)
    return peft_model.eval()


def peft_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of ``model`` (a peft model or a plain one), EOS ignored."""
    outputs = []
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    with reference_attention(inner), torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@dataclasses.dataclass
class TinyCase:
    paths: dict[str, Path]
    prompts: list[list[int]]
    references: dict[str | None, list[list[int]]]  # adapter name (None: base) -> outputs


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory) -> TinyCase:
    root = tmp_path_factory.mktemp("tiny-adapters")
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((21, 35, 50))]
    references = {None: peft_greedy(build_tiny_qwen2(), prompts)}
    paths = {}
    for name, spec in TINY_ADAPTERS.items():
        spec = dict(spec)
        paths[name] = root / name
        peft_model = make_peft_adapter(build_tiny_qwen2(), paths[name], spec.pop("seed"), **spec)
        references[name] = peft_greedy(peft_model, prompts)
    return TinyCase(paths, prompts, references)


def adapter_request(engine, request_id: str, prompt: list[int], name: str | None, **kwargs):
    request = greedy(request_id, prompt, NEW_TOKENS, ignore_eos=True, **kwargs)
    if name is not None:
        request.adapter = engine.adapters.refs()[name]
    return request


def tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, case: TinyCase, **overrides):
    from workers.model_loader import LoadedModel, model_digest

    model = fresh_tiny_qwen()
    loaded = LoadedModel(model, smollm_tokenizer, model_digest(model), "tiny-qwen2",
                         Path("tiny-qwen2"))
    modules = {name: str(path) for name, path in case.paths.items()}
    return make_engine(loaded, num_blocks=96, lora_modules=modules, **overrides)


def test_each_adapter_changes_the_output(tiny_case):
    base = tiny_case.references[None]
    for name in TINY_ADAPTERS:
        assert tiny_case.references[name] != base, name


def test_greedy_through_each_adapter_alone_equals_peft(tiny_case, make_engine, fresh_tiny_qwen,
                                                       smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case)
    for name in [None, *TINY_ADAPTERS]:
        for i, prompt in enumerate(tiny_case.prompts):
            request_id = f"{name}-{i}"
            chunks = engine.generate([adapter_request(engine, request_id, prompt, name)])
            assert output_ids(chunks[request_id]) == tiny_case.references[name][i], request_id
    assert set(engine.counters.batch_sizes) == {1}
    assert engine.pool.num_in_use == 0


def test_step_mixing_base_rows_and_three_adapters_equals_each_alone(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case)
    names = [None, *TINY_ADAPTERS]
    requests = [adapter_request(engine, f"{name}-{i}", prompt, name)
                for i, prompt in enumerate(tiny_case.prompts) for name in names]
    results = engine.generate(requests)
    for request in requests:
        name, index = request.request_id.rsplit("-", 1)
        name = None if name == "None" else name
        assert output_ids(results[request.request_id]) == tiny_case.references[name][int(index)]
    # really mixed: all twelve sequences decoded in one step
    assert max(engine.counters.batch_sizes) == len(requests)


def test_chunked_cached_and_speculative_paths_equal_cold(tiny_case, make_engine,
                                                         fresh_tiny_qwen, smollm_tokenizer):
    name, prompt = "all", tiny_case.prompts[2]
    cold = tiny_case.references[name][2]
    # drafts are the true continuation with every third one wrong: accepted and rejected
    proposer = OracleProposer({tuple(prompt): cold}, wrong=(2,))
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_num_batched_tokens=16,  # the prompt prefills in chunks
                         speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                       adaptive=False), proposer=proposer)
    for attempt in ("cold", "warm"):
        chunks = engine.generate([adapter_request(engine, attempt, prompt, name)])[attempt]
        assert output_ids(chunks) == cold, attempt
    assert chunks[-1].cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    spec = engine.counters.spec
    assert 0 < spec.accepted_tokens < spec.proposed_tokens
    assert engine.pool.num_in_use == 0


def test_a_base_draft_model_proposes_and_the_adapter_verifies(tiny_case, make_engine,
                                                              fresh_tiny_qwen, smollm_tokenizer):
    """The ``model`` proposer drafts with the base model; verification runs the request's own
    adapter, so greedy output is the adapter's (peft's), with drafts both accepted and
    rejected, base and adapter rows in the same steps."""
    from workers.config import EngineConfig
    from workers.model_loader import LoadedModel, model_digest
    from workers.speculative.draft_model import DraftModelProposer

    base = fresh_tiny_qwen()
    draft = LoadedModel(base, smollm_tokenizer, model_digest(base), "tiny-qwen2",
                        Path("tiny-qwen2"))
    proposer = DraftModelProposer.for_target(
        draft, draft, EngineConfig(dtype="float32", device="cpu", kv_cache_bytes=1 << 20))
    spec = SpeculativeConfig(method="model", draft_model="tiny-qwen2", num_speculative_tokens=3,
                             adaptive=False)
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         speculative=spec, proposer=proposer)
    names = ["all", None, "attn-rs"]
    requests = [adapter_request(engine, f"r{i}", tiny_case.prompts[i], name)
                for i, name in enumerate(names)]
    chunks = engine.generate(requests)
    for i, name in enumerate(names):
        assert output_ids(chunks[f"r{i}"]) == tiny_case.references[name][i], name
    counters = engine.counters.spec
    assert 0 < counters.accepted_tokens < counters.proposed_tokens
    assert engine.pool.num_in_use == 0 and proposer.engine.pool.num_in_use == 0


def test_kv_is_never_reused_across_adapters_or_with_the_base_model(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer, tmp_path):
    # the same content under a second name computes the same, so it may share KV
    twin = tmp_path / "twin"
    twin.mkdir()
    for file in tiny_case.paths["all"].iterdir():
        (twin / file.name).write_bytes(file.read_bytes())
    case = dataclasses.replace(tiny_case, paths={**tiny_case.paths, "twin": twin})
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, case)
    prompt = tiny_case.prompts[2]
    full = (len(prompt) - 1) // 16 * 16

    def cached(request_id: str, name: str | None) -> int:
        chunks = engine.generate([adapter_request(engine, request_id, prompt, name)])
        return chunks[request_id][-1].cached_tokens

    assert cached("base", None) == 0
    assert cached("all", "all") == 0  # not the base model's blocks
    assert cached("attn", "attn-rs") == 0  # nor another adapter's
    assert cached("all-again", "all") == full
    assert cached("twin", "twin") == full  # same content and config: same computation
    assert cached("base-again", None) == full
    assert engine.adapters.refs()["twin"].weights_digest == engine.adapters.refs()[
        "all"].weights_digest


def test_a_request_naming_other_content_than_the_loaded_adapter_is_refused(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case)
    request = adapter_request(engine, "stale", tiny_case.prompts[0], "all")
    request.adapter = AdapterRef("all", "00" * 32)  # hashed for weights since replaced
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(request)
    assert refused.value.code == "model_not_found"
    request.adapter = AdapterRef("missing", "00" * 32)
    with pytest.raises(InvalidRequestError, match="'missing' does not exist"):
        engine.add_request(request)
    assert engine.pool.num_in_use == 0 and not engine.has_work()


def test_prompt_digests_differ_per_adapter_content_not_per_name(tiny_case, make_engine,
                                                                fresh_tiny_qwen,
                                                                smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case)
    refs = engine.adapters.refs()
    namespace = CacheNamespace()
    roots = {engine.identity.root_for(namespace, ref) for ref in refs.values()}
    roots.add(engine.identity.root_for(namespace))
    assert len(roots) == len(refs) + 1
    renamed = AdapterRef("another-name", refs["all"].weights_digest)
    assert engine.identity.root_for(namespace, renamed) == engine.identity.root_for(
        namespace, refs["all"])


# --- the adapter files --------------------------------------------------------------------

@pytest.fixture
def adapter_dir(tiny_case, tmp_path) -> Path:
    """A writable copy of the ``all`` adapter."""
    directory = tmp_path / "copy"
    directory.mkdir()
    for file in tiny_case.paths["all"].iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


def tiny_shapes() -> BaseShapes:
    return BaseShapes.of(build_tiny_qwen2())


def load(directory: Path, max_rank: int = 64):
    return load_adapter("x", directory, tiny_shapes(), max_rank)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_digest_covers_content_and_config_not_the_path(adapter_dir, tiny_case):
    digest = load(adapter_dir).digest
    assert digest == load(tiny_case.paths["all"]).digest
    edit_config(adapter_dir, lora_alpha=9)
    assert load(adapter_dir).digest != digest
    edit_config(adapter_dir, lora_alpha=8)
    assert load(adapter_dir).digest == digest
    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name][0, 0] = torch.nextafter(tensors[name][0, 0], torch.tensor(1.0))  # one ulp
    save_file(tensors, weights)
    assert load(adapter_dir).digest != digest


@pytest.mark.parametrize("change, reason", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "trained biases"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(r=5), "rank 4 in adapter_model.safetensors, 5 in adapter_config.json"),
    (dict(lora_alpha="many"), "malformed adapter_config.json"),
    (dict(lora_alpha=float("inf")), "gives a scaling of inf"),  # written as Infinity
    (dict(lora_alpha=float("nan")), "gives a scaling of nan"),
])
def test_unsupported_or_inconsistent_configs_are_refused(adapter_dir, change, reason):
    edit_config(adapter_dir, **change)
    with pytest.raises(AdapterError, match=reason):
        load(adapter_dir)


def test_weights_that_are_not_finite_or_overflow_when_scaled_are_refused(adapter_dir):
    """Such an adapter loaded, and its requests sampled from NaN logits (a user's trial saw
    every token at -ln V)."""
    edit_config(adapter_dir, lora_alpha=1e300)  # finite, but its deltas overflow
    with pytest.raises(AdapterError, match="scaled by lora_alpha / r, overflow torch.bfloat16"):
        load_adapter("x", adapter_dir, tiny_shapes(), 64, torch.bfloat16)
    edit_config(adapter_dir, lora_alpha=8)
    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match="NaN or infinite"):
        load(adapter_dir)


def test_rank_over_the_limit_is_refused(adapter_dir):
    with pytest.raises(AdapterError, match="rank 4 exceeds --max-lora-rank 2"):
        load(adapter_dir, max_rank=2)


def test_shapes_of_another_model_are_refused(adapter_dir):
    other = BaseShapes(2, {**tiny_shapes().modules, "q_proj": (64, 32)})
    with pytest.raises(AdapterError, match=r"do not fit the base model's 64 -> 32"):
        load_adapter("x", adapter_dir, other, 64)
    with pytest.raises(AdapterError, match="the base model has 1 layers"):
        load_adapter("x", adapter_dir, BaseShapes(1, tiny_shapes().modules), 64)


def test_missing_files_foreign_tensors_and_half_pairs_are_refused(adapter_dir):
    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
              weights)
    with pytest.raises(AdapterError, match="lm_head.* is not a LoRA weight"):
        load(adapter_dir)
    half = {k: v for k, v in tensors.items()
            if k != "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}
    save_file(half, weights)
    with pytest.raises(AdapterError, match="q_proj has lora_A without its other half"):
        load(adapter_dir)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="malformed adapter_model.safetensors"):
        load(adapter_dir)
    weights.unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load(adapter_dir)


# --- SmolLM2 ------------------------------------------------------------------------------

def test_smollm_greedy_through_an_adapter_equals_peft(smollm, make_engine, tmp_path):
    prompts = [smollm.tokenizer.encode(text) for text in (
        "The history of the printing press begins in the fifteenth century, when",
        "Photosynthesis is the process by which green plants use sunlight to")]
    fresh = load_model("embedded", dtype="float32", device="cpu").model
    base_references = peft_greedy(fresh, prompts)
    peft_model = make_peft_adapter(fresh, tmp_path / "smol", seed=7, r=8, lora_alpha=2,
                                   target_modules=ALL_PROJECTIONS)
    references = peft_greedy(peft_model, prompts)
    assert references != base_references
    engine = make_engine(smollm, num_blocks=32, lora_modules={"smol": str(tmp_path / "smol")})
    requests = [adapter_request(engine, f"r{i}", p, "smol") for i, p in enumerate(prompts)]
    requests.append(adapter_request(engine, "base", prompts[0], None))
    results = engine.generate(requests)
    assert [output_ids(results[f"r{i}"]) for i in range(len(prompts))] == references
    assert output_ids(results["base"]) == base_references[0]


# --- loading at run time: allowed directories, LRU slots, reading again from the source ----

def test_runtime_paths_must_stay_under_the_allowed_directories(tiny_case, tmp_path):
    from workers.lora.paths import checked_adapter_dir

    allowed = tmp_path / "adapters"
    inside = allowed / "all"
    inside.mkdir(parents=True)
    for file in tiny_case.paths["all"].iterdir():
        (inside / file.name).write_bytes(file.read_bytes())
    assert checked_adapter_dir(str(inside), [str(allowed)]) == inside.resolve()
    escape = allowed / "escape"
    escape.symlink_to(tiny_case.paths["all"])  # a symlink leading out
    leaky = allowed / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").symlink_to(tiny_case.paths["all"] / "adapter_config.json")
    refused = {
        str(tiny_case.paths["all"]): "outside the allowed",
        str(escape): "outside the allowed",
        str(leaky): "outside the allowed",
        f"{allowed}/../{inside.name}": "without '..'",
        "all": "absolute path",
        f"{inside}\x00x": "NUL",  # os.path.realpath raised ValueError on it (a 500)
    }
    for path, reason in refused.items():
        with pytest.raises(AdapterError, match=reason):
            checked_adapter_dir(path, [str(allowed)])
    with pytest.raises(AdapterError, match="--lora-dir"):
        checked_adapter_dir(str(inside), [])
    # A file given as the adapter's directory: reading it raised NotADirectoryError (a 500).
    config_file = checked_adapter_dir(str(inside / "adapter_config.json"), [str(allowed)])
    with pytest.raises(AdapterError, match="no adapter_config.json in"):
        load_adapter("file", config_file, tiny_shapes(), 64)



def test_least_recently_used_idle_adapter_is_evicted_and_read_again(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=2)
    registry = engine.adapters
    # three start-time adapters in two slots: the first was evicted for the third
    assert registry.held() == ["attn-rs", "mlp-pattern"] and len(registry.refs()) == 3
    assert (registry.loads, registry.evictions) == (3, 1)
    prompt = tiny_case.prompts[0]
    chunks = engine.generate([adapter_request(engine, "r", prompt, "all")])["r"]
    assert output_ids(chunks) == tiny_case.references["all"][0]  # read again from its source
    assert registry.held() == ["mlp-pattern", "all"] and registry.evictions == 2
    engine.generate([adapter_request(engine, "s", prompt, "mlp-pattern")])
    assert registry.held() == ["all", "mlp-pattern"]  # used: now most recent


def test_a_busy_adapter_is_never_evicted(tiny_case, make_engine, fresh_tiny_qwen,
                                         smollm_tokenizer):
    from workers.lora.registry import AdapterSlotsFull

    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=1)
    assert engine.adapters.held() == ["mlp-pattern"]
    engine.add_request(adapter_request(engine, "busy", tiny_case.prompts[0], "mlp-pattern"))
    with pytest.raises(AdapterSlotsFull, match="in use"):
        engine.adapters.ensure(engine.adapters.refs()["all"])
    while engine.has_work():
        engine.step()
    engine.adapters.ensure(engine.adapters.refs()["all"])  # idle now: evicted for it
    assert engine.adapters.held() == ["all"]


def test_an_evicted_adapter_waits_in_the_host_tier_and_comes_back_without_a_read(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    """One resident slot, two places in all: eviction moves the least recently used idle
    adapter to the host tier and drops the tier's own oldest; a request for a hosted adapter
    moves it back (a swap, no disk read) and its output is unchanged."""
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=1, max_cpu_loras=2)
    registry = engine.adapters
    assert (registry.held(), registry.hosted()) == (["mlp-pattern"], ["attn-rs"])
    assert (registry.loads, registry.evictions, registry.host_evictions) == (3, 2, 1)
    prompt = tiny_case.prompts[1]
    chunks = engine.generate([adapter_request(engine, "r", prompt, "attn-rs")])["r"]
    assert output_ids(chunks) == tiny_case.references["attn-rs"][1]
    assert (registry.held(), registry.hosted()) == (["attn-rs"], ["mlp-pattern"])
    assert (registry.loads, registry.swaps) == (3, 1)
    assert registry.held_digests("host") == [registry.refs()["mlp-pattern"].weights_digest]
    chunks = engine.generate([adapter_request(engine, "s", prompt, "all")])["s"]
    assert output_ids(chunks) == tiny_case.references["all"][1]  # read from disk again
    assert (registry.held(), registry.hosted()) == (["all"], ["attn-rs"])
    assert (registry.loads, registry.host_evictions) == (4, 2)
    registry.unload("attn-rs")
    assert registry.hosted() == [] and engine.pool.num_in_use == 0


def test_an_ensured_adapter_is_reserved_until_its_request_is_admitted(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    """Between making a request's adapter resident (off the engine thread) and admitting the
    request, a read for another request must not evict it: it would be refused as unknown."""
    from workers.lora.registry import AdapterSlotsFull

    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=1)
    registry = engine.adapters
    first = adapter_request(engine, "first", tiny_case.prompts[0], "mlp-pattern")
    registry.ensure(first.adapter)  # resident already: now reserved for "first"
    with pytest.raises(AdapterSlotsFull):
        registry.ensure(registry.refs()["all"])
    engine.validate(first)
    engine.admit(first)  # its sequence holds the adapter from here; the reservation ends
    while engine.has_work():
        engine.step()
    registry.ensure(registry.refs()["all"])
    assert registry.held() == ["all"]
    refused = adapter_request(engine, "refused", [10**9], "all")  # outside the vocabulary
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(refused)  # a refusal ends its reservation too ...
    registry.release(registry.refs()["all"])  # ... and so does this, for the ensure above
    registry.ensure(registry.refs()["mlp-pattern"])
    assert registry.held() == ["mlp-pattern"]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_slot_wait_is_the_work_until_the_first_busy_adapter_frees(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer, max_loras):
    """A new adapter waits until the busy adapter whose last sequence ends first is free; the
    running sequences (base ones too) share those steps. Slots busy: those some sequence
    uses."""
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=max_loras)
    name = engine.adapters.held()[-1]
    assert engine.adapter_slots_busy() == (0, 0)
    for i in range(2):
        engine.add_request(adapter_request(engine, f"r{i}", tiny_case.prompts[i], name))
    engine.add_request(adapter_request(engine, "base", tiny_case.prompts[2], None))
    engine.step()  # prefills all three: each has its first token, not yet in the KV cache
    assert engine.adapter_slots_busy() == (1, (1 + NEW_TOKENS - 1) * 3)
    while engine.has_work():
        engine.step()
    assert engine.adapter_slots_busy() == (0, 0)


async def test_a_request_waits_for_a_free_slot_then_counts_its_wait(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    """Every slot busy: the request waits (the engine keeps stepping) until one frees, and is
    counted with its wait; one that outwaits ``wait_s`` is refused; a cancelled one leaves no
    reservation behind."""
    import asyncio

    from workers.lora.admission import AdapterAdmission
    from workers.lora.registry import AdapterSlotsFull

    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=1)
    registry = engine.adapters
    admission = AdapterAdmission(registry, wait_s=5.0, poll_s=0.01)
    busy = registry.refs()["mlp-pattern"]
    assert await admission.ensure(busy) == "resident"  # reserved: the one slot is busy
    loads = registry.loads
    waiting = asyncio.ensure_future(admission.ensure(registry.refs()["all"]))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    registry.release(busy)
    assert await waiting == "slot" and registry.held() == ["all"]
    assert registry.loads == loads + 1  # read once a slot was free, not at every try
    assert admission.mean_slot_wait_s() >= 0.2
    assert (admission.requests, dict(admission.by_source)) == (
        2, {"resident": 1, "host": 0, "read": 0, "slot": 1})
    admission.wait_s = 0.1
    with pytest.raises(AdapterSlotsFull):
        await admission.ensure(busy)  # "all" is still reserved
    admission.wait_s = 5.0
    cancelled = asyncio.ensure_future(admission.ensure(busy))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    registry.release(registry.refs()["all"])
    await asyncio.sleep(0.1)
    assert await admission.ensure(busy) == "read"  # "all" was evicted: nothing held it
    assert await admission.ensure(None) is None


def test_concurrent_requests_for_an_evicted_adapter_read_it_once(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from workers.lora import registry as registry_module

    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         max_loras=2)
    registry = engine.adapters
    ref = registry.refs()["all"]  # evicted at start: two slots, three adapters
    slow_load = registry_module.load_adapter

    def load_adapter(*args, **kwargs):
        time.sleep(0.2)  # long enough for every caller to arrive during the read
        return slow_load(*args, **kwargs)

    monkeypatch.setattr(registry_module, "load_adapter", load_adapter)
    loads = registry.loads
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(registry.ensure, [ref] * 4))
    assert found == ["read"] * 4 and registry.loads == loads + 1
    assert registry.ensure(ref) == "resident"
    for _ in range(5):
        registry.release(ref)
    registry.ensure(registry.refs()["attn-rs"])  # nothing stays reserved: "all" is idle
    registry.ensure(registry.refs()["mlp-pattern"])
    assert registry.held() == ["attn-rs", "mlp-pattern"]


def test_unloading_lets_running_requests_finish_and_refuses_new_ones(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case)
    stale = engine.adapters.refs()["all"]
    engine.add_request(adapter_request(engine, "running", tiny_case.prompts[0], "all"))
    chunks = engine.step()  # prefilled: its first token
    engine.adapters.unload("all")
    while engine.has_work():
        chunks += engine.step()
    assert output_ids(chunks) == tiny_case.references["all"][0]
    late = adapter_request(engine, "late", tiny_case.prompts[1], None)
    late.adapter = dataclasses.replace(stale, source="")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        engine.add_request(late)
    assert engine.pool.num_in_use == 0


def test_a_source_changed_on_disk_or_outside_the_allowed_dirs_is_refused(
        tiny_case, make_engine, fresh_tiny_qwen, smollm_tokenizer, adapter_dir):
    engine = tiny_engine(make_engine, fresh_tiny_qwen, smollm_tokenizer, tiny_case,
                         lora_dirs=[str(adapter_dir.parent)])
    ref = engine.adapters.load("copy", str(adapter_dir), runtime=True).ref
    engine.adapters.unload("copy")
    edit_config(adapter_dir, lora_alpha=9)  # other content under the same path
    with pytest.raises(InvalidRequestError, match="changed since it was loaded; unload it"):
        engine.adapters.ensure(ref)
    outside = dataclasses.replace(engine.adapters.refs()["all"], adapter_id="elsewhere")
    with pytest.raises(InvalidRequestError, match="outside the allowed"):
        engine.adapters.ensure(outside)
    with pytest.raises(AdapterError, match="already loaded"):
        engine.adapters.load("all", str(adapter_dir), runtime=True)
    assert engine.adapters.held() == ["all", "attn-rs", "mlp-pattern"]


def test_a_model_on_transformers_modules_refuses_adapters(tiny_case, make_engine,
                                                          smollm_tokenizer):
    """Phi-3 runs on transformers' own modules, which apply no deltas: an adapter there would
    be served as the base model under the adapter's digests, so every load is refused."""
    from test_architectures import build_phi3

    from workers.model_loader import LoadedModel, model_digest

    model = build_phi3()
    loaded = LoadedModel(model, smollm_tokenizer, model_digest(model), "tiny-phi3",
                         Path("tiny-phi3"))
    engine = make_engine(loaded, num_blocks=32)
    assert engine.runner.implementation == "transformers"
    with pytest.raises(AdapterError, match="need a Llama-style model; Phi3ForCausalLM"):
        engine.adapters.load("all", str(tiny_case.paths["all"]))
    with pytest.raises(AdapterError, match="need a Llama-style model"):
        make_engine(loaded, num_blocks=32, lora_modules={"all": str(tiny_case.paths["all"])})
    ref = AdapterRef("all", "00" * 32, str(tiny_case.paths["all"]))
    with pytest.raises(InvalidRequestError, match="need a Llama-style model"):
        engine.adapters.ensure(ref)
