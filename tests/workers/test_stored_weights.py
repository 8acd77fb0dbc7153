"""Weights served as stored: the embedded GGUF's Q4_1/Q8_0 tensors kept as their bytes, mapped
to the right modules (llama.cpp's q/k row order undone), in memory at about the file's size, in
a cache identity of their own; and per-channel int8 for dense models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import greedy, output_ids

from workers import kernels
from workers.model_loader import LoadedModel, load_model, model_digest
from workers.model_source import embedded_gguf_path
from workers.models.linear import (
    BF16_PAIR_PRODUCTS,
    FLOAT32_PRODUCTS,
    INT8_PRODUCTS,
    Linear,
    StoredLinear,
    stored_kernel,
    streamed_max_rows,
)
from workers.models.llama import _fuse
from workers.models.weight_formats import StoredWeight, WeightFormat, quantize_int8_per_channel
from workers.speculative.config import SpeculativeConfig
from workers.speculative.ngram import NgramProposer
from workers.step_time import (
    CPU_CAP_S,
    DENSE_CPU_TARGET_S,
    STORED_CPU_TARGET_S,
    auto_cap_s,
    auto_target_s,
)
from workers.stored_weights import (
    _attach,
    attach_int8_weights,
    resolve_quantization,
    stored_formats,
)

pytestmark = pytest.mark.skipif(kernels.weight_linear() is None,
                                reason="weight_linear kernel not built here")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stored_smollm():
    """The embedded model with its GGUF tensors as stored, activations in fp32."""
    return load_model("embedded", dtype="float32", device="cpu", quantization="gguf")


def stored_modules(model):
    return {name: module.stored_weight for name, module in model.named_modules()
            if getattr(module, "stored_weight", None) is not None}


def test_every_stored_weight_dequantizes_to_what_transformers_loads(stored_smollm, smollm):
    """Same values as transformers' own GGUF dequantization, module by module: the tensor
    names map to the right modules and the q/k rows are back in transformers' order."""
    dense = dict(smollm.model.named_modules())
    stored = stored_modules(stored_smollm.model)
    assert len(stored) == 30 * 7 + 2  # 7 projections a layer, the embedding, the tied head
    assert {w.fmt for w in stored.values()} == {WeightFormat.Q4_1, WeightFormat.Q8_0}
    for name, weight in stored.items():
        assert torch.equal(weight.dequantize(), dense[name].weight), name
    assert stored_smollm.model.lm_head.stored_weight is \
        stored_smollm.model.model.embed_tokens.stored_weight


def test_the_worker_holds_the_weights_at_about_the_files_size(stored_smollm):
    """Goal: at most 1.2x the GGUF file; the dense weights it replaced are freed."""
    held = {p.data_ptr(): p.numel() * p.element_size() for p in stored_smollm.model.parameters()}
    for weight in stored_modules(stored_smollm.model).values():
        held[weight.data.data_ptr()] = weight.nbytes
    file_bytes = os.path.getsize(embedded_gguf_path())
    assert sum(held.values()) <= 1.2 * file_bytes
    assert sum(held.values()) >= 0.95 * file_bytes  # the weights really are all there


def test_stored_weights_get_their_own_cache_identity(stored_smollm, smollm, make_engine):
    stored_engine = make_engine(stored_smollm, num_blocks=16)
    dense_engine = make_engine(smollm, num_blocks=16)
    assert stored_engine.runner.linear_kernel.startswith("weight-stream:Q4_1+Q8_0/")
    assert dense_engine.runner.linear_kernel.split("+")[-1] in ("onednn-prepacked", "aten")
    assert stored_engine.identity.numerics != dense_engine.identity.numerics
    assert stored_engine.identity.model_key != dense_engine.identity.model_key


def test_stored_weights_generate_what_the_dense_model_does(stored_smollm, smollm, make_engine,
                                                          smollm_tokenizer):
    """Steps of up to 31 rows use int8 activations (llama.cpp's rounding), so long greedy runs
    part from the float model's at near-ties; the first tokens of a clear answer agree."""
    prompt = smollm_tokenizer("The capital of France is").input_ids
    outputs = []
    for loaded in (stored_smollm, smollm):
        engine = make_engine(loaded, num_blocks=16)
        request = greedy("paris", prompt, 4, ignore_eos=True)
        outputs.append(output_ids(engine.generate([request])["paris"]))
    assert outputs[0] == outputs[1]
    assert smollm_tokenizer.decode(outputs[0]).startswith(" Paris")


def test_speculation_on_stored_weights_decodes_what_plain_decoding_does(stored_smollm,
                                                                       make_engine):
    """A verification step (a row per draft token) computes each row as a one-row decode step
    does, so speculation changes no greedy id on quantized weights either, whatever it
    accepts or rejects."""
    tokenizer = stored_smollm.tokenizer
    prompts = [tokenizer.encode(text, add_special_tokens=False)
               for text in ("one two three four " * 12, "The history of the printing press")]

    def requests():
        return [greedy(f"r{i}", p, 40, ignore_eos=True) for i, p in enumerate(prompts)]

    plain = make_engine(stored_smollm).generate(requests())
    engine = make_engine(stored_smollm, speculative=SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, adaptive=False), proposer=NgramProposer(1, 4))
    speculated = engine.generate(requests())
    assert [output_ids(speculated[f"r{i}"]) for i in range(2)] == \
        [output_ids(plain[f"r{i}"]) for i in range(2)]
    spec = engine.counters.spec
    assert 0 < spec.accepted_tokens < sum(spec.proposed_by_position)  # accepted and rejected


def test_int8_per_channel_serves_a_dense_model(smollm_tokenizer, make_engine, fresh_tiny_qwen):
    """Every decoder projection quantized per channel: each layer's output stays within what
    rounding each weight to its row's int8 step allows, and an engine serves the model."""
    model, dense = fresh_tiny_qwen(), fresh_tiny_qwen()  # one seed: the same weights
    assert attach_int8_weights(model) == 2 * 7
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for layer, dense_layer in zip(model.model.layers, dense.model.layers, strict=True):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            module, reference = (getattr(m.self_attn, name) for m in (layer, dense_layer))
            step = reference.weight.abs().amax(dim=1) / 127
            bound = x.abs().sum(dim=1, keepdim=True) * step / 2 + 1e-5
            got = Linear.of(module)(x)
            assert ((got - F.linear(x, reference.weight, reference.bias)).abs() <= bound).all()
    loaded = LoadedModel(model, smollm_tokenizer, model_digest(dense), "tiny-int8",
                         Path("tiny-int8"), "int8")
    engine = make_engine(loaded, num_blocks=16)
    assert "INT8_CHANNEL" in engine.runner.linear_kernel
    request = greedy("int8", [5, 6, 7, 8], 8, ignore_eos=True)
    assert len(output_ids(engine.generate([request])["int8"])) == 8


def test_auto_quantization_follows_the_source_and_device():
    gguf = str(embedded_gguf_path())
    assert resolve_quantization("auto", gguf, CPU) == "gguf"
    assert resolve_quantization("auto", "embedded", CPU) == "gguf"
    assert resolve_quantization("auto", "embedded", torch.device("cuda")) == "none"
    assert resolve_quantization("auto", "/models/llama", CPU) == "none"
    assert resolve_quantization("int8", "/models/llama", CPU) == "int8"
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quantization("gguf", "/models/llama", CPU)
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("q3_k", gguf, CPU)


def test_auto_serves_dense_weights_where_the_kernel_is_off(monkeypatch):
    monkeypatch.setattr(kernels, "weight_linear", lambda: None)
    assert resolve_quantization("auto", "embedded", CPU) == "none"


def test_stored_formats_are_empty_for_a_dense_model(smollm):
    assert stored_formats(smollm.model) == set()


def test_each_row_count_takes_the_measured_products(stored_smollm):
    """The rule of ``workers.models.linear``, checked value for value against the kernel's
    products: a GGUF weight takes int8 products up to 47 rows and a dequantized temporary from
    48, or int8 products at every row count where the kernel pairs groups through VNNI without
    AMX tiles (``streamed_max_rows``); the LM head streams at any row count; a per-channel
    int8 weight takes bf16 pairs (bf16 x, where the CPU has them) or float32 up to 47 rows."""
    native = kernels.weight_linear()
    model = stored_smollm.model
    down = model.model.layers[0].mlp.down_proj.stored_weight  # Q4_1, 576 x 1536
    layer = StoredLinear(down)
    g = torch.Generator().manual_seed(0)

    def products(x, weight, kind):
        return native.weight_linear(x, weight.data, int(weight.fmt), weight.out_features, None,
                                    0, kind)

    x = torch.randn(56, down.in_features, generator=g)
    for rows in (1, 4, 5, 31, 32, 47):
        assert torch.equal(layer(x[:rows]), products(x[:rows], down, INT8_PRODUCTS))
    pairs_without_tiles = native.int8_pair_min_rows() > 0 and not native.has_int8_tiles()
    assert streamed_max_rows(down.fmt) == (None if pairs_without_tiles else 48)
    dense_from_48 = (products(x[:48], down, INT8_PRODUCTS) if pairs_without_tiles
                     else F.linear(x[:48], down.dequantize()))
    assert torch.equal(layer(x[:48]), dense_from_48)
    assert streamed_max_rows(WeightFormat.INT8_CHANNEL) == 48
    head = model.lm_head.stored_weight  # Q8_0, 49,152 x 576: past DEQUANTIZED_MAX_WEIGHTS
    h = torch.randn(32, head.in_features, generator=g)
    assert torch.equal(StoredLinear(head)(h), products(h, head, INT8_PRODUCTS))
    int8 = quantize_int8_per_channel(torch.randn(64, 576, generator=g))
    channel = StoredLinear(int8)
    assert torch.equal(channel(h[:5]), products(h[:5], int8, FLOAT32_PRODUCTS))
    if native.has_bf16_pairs():
        h16 = h[:8].bfloat16()
        assert torch.equal(channel(h16), products(h16, int8, BF16_PAIR_PRODUCTS))


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN has bf16 kernels for this CPU")
def test_without_onednn_bf16_a_prompts_bf16_rows_multiply_in_float32(stored_smollm):
    """On an AVX2-only CPU a prompt's bf16 rows past the streaming threshold multiply the
    dequantized weight in float32 (a prefill over torch's own bf16 matmul was 5.8x slower) and
    round to bf16 once; the tag says so, so such KV is never shared with a worker whose
    dense path multiplies in bf16."""
    down = stored_smollm.model.model.layers[0].mlp.down_proj.stored_weight
    rows = streamed_max_rows(down.fmt)
    assert rows is not None
    x = torch.randn(rows, down.in_features, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x.bfloat16().float(), down.dequantize(dtype=torch.float32)).bfloat16()
    assert torch.equal(StoredLinear(down)(x.bfloat16()), expected)
    assert "/dense-in-float32>=" in stored_kernel({"Q4_1"}, torch.bfloat16)
    assert "/dense>=" in stored_kernel({"Q4_1"}, torch.float32)


def test_projections_of_mixed_formats_fuse_as_one_dense_weight(stored_smollm):
    """A q/k/v or gate/up group whose parts are stored in different formats cannot fuse as
    stored: it is dequantized into one plain weight, part by part in order."""
    q4_1 = StoredWeight.from_rows(stored_smollm.model.model.layers[0].self_attn.q_proj
                                  .stored_weight.rows()[:64], WeightFormat.Q4_1, 576)
    int8 = quantize_int8_per_channel(torch.randn(32, 576, generator=torch.Generator()
                                                 .manual_seed(1)))
    parts = [torch.nn.Linear(576, 64, bias=False), torch.nn.Linear(576, 32, bias=False)]
    for module, weight in zip(parts, (q4_1, int8), strict=True):
        _attach(module, weight)
    fused = _fuse(parts, small_batches=False)
    assert isinstance(fused, Linear)
    assert torch.equal(fused.weight, torch.cat([q4_1.dequantize(), int8.dequantize()]))
    assert all(module.stored_weight is None for module in parts)
    same = [torch.nn.Linear(576, 64, bias=False), torch.nn.Linear(576, 36, bias=False)]
    first36 = StoredWeight.from_rows(q4_1.rows()[:36], WeightFormat.Q4_1, 576)
    for module, weight in zip(same, (q4_1, first36), strict=True):
        _attach(module, weight)
    # 64 + 36 features: the second part starts mid-group once fused
    fused = _fuse(same, small_batches=False)
    assert isinstance(fused, StoredLinear)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fused(x), torch.cat([StoredLinear(q4_1)(x), StoredLinear(first36)(x)],
                                           dim=1))


def test_the_auto_step_time_target_covers_every_prompt_with_dense_weights_and_long_ones_stored(
        stored_smollm, tiny_qwen, make_engine):
    """The server's default: 250 ms on a CPU with dense weights, where it cost no throughput;
    500 ms for weights kept as stored, whose steps are bound by arithmetic, and only on the
    chunks of prompts longer than the token budget. A target asked for in seconds covers every
    prompt whatever the weights."""
    dense = make_engine(tiny_qwen, num_blocks=16, step_time_target_s="auto")
    stored = make_engine(stored_smollm, num_blocks=16, step_time_target_s="auto")
    assert dense.scheduler.step_target.seconds == DENSE_CPU_TARGET_S == 0.25
    assert not dense.scheduler.step_target.long_prompts_only
    assert dense.scheduler.step_target.cap_s is None
    assert stored.scheduler.step_target.seconds == STORED_CPU_TARGET_S == 0.5
    assert stored.scheduler.step_target.long_prompts_only
    asked = make_engine(stored_smollm, num_blocks=16, step_time_target_s=0.5)
    assert not asked.scheduler.step_target.long_prompts_only
    assert make_engine(tiny_qwen, num_blocks=16).scheduler.step_target is None  # engine: off
    assert auto_target_s("cuda", "none") is None and auto_target_s("cuda", "gguf") is None
    assert auto_target_s("cpu", "int8") == STORED_CPU_TARGET_S
    with pytest.raises(ValueError, match="step_time_target_s .*'fast'"):
        make_engine(tiny_qwen, num_blocks=16, step_time_target_s="fast")


def test_the_auto_step_time_cap_is_on_for_any_cpu_worker(stored_smollm, make_engine):
    """The server's default cap, 1 s on a CPU, applies to weights kept as stored too."""
    stored = make_engine(stored_smollm, num_blocks=16, step_time_target_s="auto",
                         max_step_time_s="auto")
    assert (stored.scheduler.step_target.seconds, stored.scheduler.step_target.cap_s) == (
        STORED_CPU_TARGET_S, CPU_CAP_S)
    assert CPU_CAP_S == 1.0 and auto_cap_s("cuda") is None
    with pytest.raises(ValueError, match="max_step_time_s .*'soon'"):
        make_engine(stored_smollm, num_blocks=16, max_step_time_s="soon")
