"""A PEFT LoRA adapter read from its directory, checked against the base model, and digested.

The directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and
``adapter_model.safetensors`` (``...layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight``
``[r, in_features]`` and ``lora_B.weight`` ``[out_features, r]``). Each targeted projection
computes ``base(x) + lora_B(lora_A(x)) * scaling`` with ``scaling = alpha / r``, or
``alpha / sqrt(r)`` under rsLoRA (Kalajdzievski, 2023), per module through ``rank_pattern`` and
``alpha_pattern`` as PEFT resolves them.

The decoder fuses q/k/v into one matmul and gate/up into another (``workers.models.llama``), so
an adapter is held per fused projection: its modules' ``A`` stacked ``[R, in]`` and their ``B``
block-diagonal and transposed ``[R, out]`` with each module's scaling folded in, so a row's
whole delta for the fused output is two matmuls. They are held in bf16 when the activations
are bf16, else in float32, and always computed in float32 (the native kernel widens them as it
reads; torch's CPU matmul at these sizes, a few rows and rank 8-64, is 3x faster in float32
than in bf16: 14 against 40 us for one [4, 576] row block through A [48, 576] and
B [960, 48]). At decode sizes the deltas are bound by reading these weights: at 16 rows over
4 rank-16 adapters on every projection of SmolLM2 they are 58 MB a step in bf16, more than the
Q4_1 model's own 92 MiB are to it.

Its :attr:`LoraAdapter.digest` covers the tensors' bytes, dtypes and shapes and the config that
changes what they compute (ranks, scalings, alpha, rsLoRA, target modules): the cache identity
takes the adapter by this digest, never by its name (``contract.identity``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from contract.identity import AdapterRef
from workers.lora.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
"""The decoder's matmuls (``workers.models.llama``) and the PEFT modules each computes, in the
order of their outputs."""

_MODULE_NAMES = frozenset(name for names in FUSED_PROJECTIONS.values() for name in names)

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<proj>[a-z_]+))\.lora_(?P<ab>[AB])\.weight$")


class _PeftLoraConfig(BaseModel):
    """The fields of PEFT's ``LoraConfig`` that change what an adapter computes; the rest
    (training settings, provenance) are ignored."""

    model_config = ConfigDict(extra="ignore")

    peft_type: str = "LORA"
    r: int
    lora_alpha: float
    target_modules: list[str] | str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the base model's decoder layers and, per PEFT module name
    (``q_proj`` ...), its ``(in_features, out_features)``."""

    num_layers: int
    modules: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> BaseShapes:
        """The shapes of a transformers Llama-style causal LM's projections (none for a
        model without ``model.layers``: no adapter fits it)."""
        layers = getattr(getattr(model, "model", None), "layers", [])
        if not layers:
            return cls(0, {})
        modules = {name.rsplit(".", 1)[-1]: (module.in_features, module.out_features)
                   for name, module in layers[0].named_modules()
                   if name.rsplit(".", 1)[-1] in _MODULE_NAMES}
        return cls(len(layers), modules)


@dataclass(frozen=True)
class LoraDelta:
    """One layer's delta for one fused projection: ``out += (x @ a.T) @ bt``, computed in
    float32.

    Attributes:
        a: ``[R, in_features]`` the targeted modules' ``lora_A`` stacked (R: their ranks' sum).
        bt: ``[R, out_features]`` their ``lora_B`` times their scaling, transposed and
            block-diagonal (zero for untargeted outputs).
    """

    a: torch.Tensor
    bt: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter.

    Attributes:
        name: the ``model`` name requests select it by.
        path: the directory it was read from.
        rank: its largest module rank.
        digest: hex sha256 of its content and config (the module docstring).
        deltas: ``(layer, fused projection)`` → delta; absent where it targets nothing.
        nbytes: bytes its held tensors take.
    """

    name: str
    path: Path
    rank: int
    digest: str
    deltas: dict[tuple[int, str], LoraDelta]
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        """What its weights are held in."""
        return next(iter(self.deltas.values())).a.dtype

    @property
    def ref(self) -> AdapterRef:
        """How requests and the cache identity name it, and where it is read from."""
        return AdapterRef(self.name, self.digest, str(self.path))

    def to(self, device: torch.device) -> LoraAdapter:
        """This adapter held on ``device`` (itself when it is there already): the move between
        the resident slots and the host tier (``workers.lora.registry``)."""
        if next(iter(self.deltas.values())).a.device == device:
            return self
        pin = device.type == "cpu" and torch.cuda.is_available()  # pinned: async copies back
        deltas = {key: LoraDelta(*(_moved(t, device, pin) for t in (delta.a, delta.bt)))
                  for key, delta in self.deltas.items()}
        return dataclasses.replace(self, deltas=deltas)


def _moved(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    moved = tensor.to(device)
    return moved.pin_memory() if pin else moved


def load_adapter(name: str, path: str | Path, shapes: BaseShapes, max_rank: int,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Read, check and digest a PEFT LoRA adapter directory.

    Args:
        name: the name requests will select it by.
        path: the adapter directory.
        shapes: the base model's (:meth:`BaseShapes.of`).
        device: where to hold it (the model's).
        max_rank: the largest rank accepted (``--max-lora-rank``).
        dtype: what to hold it in: ``torch.bfloat16`` or ``torch.float32``.

    Raises:
        AdapterError: a missing or malformed file, a PEFT feature not served (DoRA, trained
            biases, ``modules_to_save``, ``fan_in_fan_out``), a tensor for another module, a
            rank over ``max_rank``, or shapes that do not fit the base model.
    """
    directory = Path(path)
    config = _read_config(directory)
    tensors = _read_tensors(directory)
    modules = _pair_tensors(tensors, shapes, max_rank)
    scalings = {module: _scaling(config, module, a.shape[0])
                for module, (a, _b) in modules.items()}
    deltas = _fuse(modules, scalings, shapes, dtype, torch.device(device))
    nbytes = sum(t.numel() * t.element_size() for d in deltas.values() for t in (d.a, d.bt))
    rank = max(a.shape[0] for a, _b in modules.values())
    return LoraAdapter(name, directory, rank, _digest(config, modules, scalings), deltas, nbytes)


def _read_config(directory: Path) -> _PeftLoraConfig:
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
        config = _PeftLoraConfig.model_validate(raw)
    except (FileNotFoundError, NotADirectoryError) as exc:  # a missing path, or a file's
        raise AdapterError(f"no {CONFIG_FILE} in {directory}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as exc:
        raise AdapterError(f"malformed {CONFIG_FILE}: {exc}") from exc
    unsupported = {"peft_type is not LORA": config.peft_type != "LORA",
                   "DoRA (use_dora)": config.use_dora,
                   "fan_in_fan_out": config.fan_in_fan_out,
                   "trained biases (bias != 'none')": config.bias != "none",
                   "modules_to_save": bool(config.modules_to_save)}
    for reason, present in unsupported.items():
        if present:
            raise AdapterError(f"unsupported adapter: {reason}")
    if config.r < 1:
        raise AdapterError(f"rank r must be positive, got {config.r}")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(directory / WEIGHTS_FILE)
    except FileNotFoundError as exc:
        raise AdapterError(f"no {WEIGHTS_FILE} in {directory}") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"malformed {WEIGHTS_FILE}: {exc}") from exc


def _pair_tensors(tensors: dict[str, torch.Tensor], shapes: BaseShapes,
                  max_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full module name (``model.layers.0.self_attn.q_proj``) → its ``(lora_A, lora_B)``,
    each checked against the base model's shape."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None or match["proj"] not in shapes.modules:
            raise AdapterError(f"tensor {tensor_name!r} is not a LoRA weight of a q, k, v, o, "
                               "gate, up or down projection of this base model")
        if int(match["layer"]) >= shapes.num_layers:
            raise AdapterError(f"tensor {tensor_name!r}: the base model has "
                               f"{shapes.num_layers} layers")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor
    if not halves:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return {module: _checked_pair(module, pair, shapes, max_rank)
            for module, pair in sorted(halves.items())}


def _checked_pair(module: str, pair: dict[str, torch.Tensor], shapes: BaseShapes,
                  max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{module} has lora_{''.join(pair)} without its other half")
    a, b = pair["A"], pair["B"]
    in_features, out_features = shapes.modules[module.rsplit(".", 1)[-1]]
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (
            out_features, rank):
        raise AdapterError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                           f"not fit the base model's {in_features} -> {out_features} "
                           "projection")
    if rank > max_rank:
        raise AdapterError(f"{module}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{module}: LoRA weights must be floating point")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{module}: LoRA weights hold NaN or infinite values")
    return a, b


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern the module name ends with (as a regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _scaling(config: _PeftLoraConfig, module: str, rank: int) -> float:
    expected_rank = _pattern_value(config.rank_pattern, module, config.r)
    if rank != expected_rank:
        raise AdapterError(f"{module}: rank {rank} in {WEIGHTS_FILE}, {expected_rank} in "
                           f"{CONFIG_FILE}")
    alpha = _pattern_value(config.alpha_pattern, module, config.lora_alpha)
    scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    if not math.isfinite(scaling):  # JSON's parser takes Infinity and NaN; 1e309 is inf
        raise AdapterError(f"{module}: lora_alpha {alpha} gives a scaling of {scaling}")
    return scaling


def _fuse(modules: dict[str, tuple[torch.Tensor, torch.Tensor]], scalings: dict[str, float],
          shapes: BaseShapes, dtype: torch.dtype,
          device: torch.device) -> dict[tuple[int, str], LoraDelta]:
    deltas = {}
    for layer in range(shapes.num_layers):
        for fused, names in FUSED_PROJECTIONS.items():
            block = "mlp" if fused in ("gate_up", "down") else "self_attn"
            prefix = f"model.layers.{layer}.{block}"
            parts = [(name, modules.get(f"{prefix}.{name}"), scalings.get(f"{prefix}.{name}"))
                     for name in names]
            if any(pair is not None for _name, pair, _s in parts):
                deltas[(layer, fused)] = _fused_delta(parts, shapes, dtype, device)
    return deltas


def _fused_delta(parts: list[tuple[str, tuple[torch.Tensor, torch.Tensor] | None, float | None]],
                 shapes: BaseShapes, dtype: torch.dtype, device: torch.device) -> LoraDelta:
    outs = [shapes.modules[name][1] for name, _pair, _s in parts]
    ranks = [pair[0].shape[0] if pair is not None else 0 for _name, pair, _s in parts]
    in_features = shapes.modules[parts[0][0]][0]
    a = torch.zeros(sum(ranks), in_features, device=device)
    bt = torch.zeros(sum(ranks), sum(outs), device=device)
    row = col = 0
    for (_name, pair, scaling), out, rank in zip(parts, outs, ranks, strict=True):
        if pair is not None:
            a[col:col + rank] = pair[0]
            bt[col:col + rank, row:row + out] = pair[1].float().t() * scaling
        row, col = row + out, col + rank
    a, bt = a.to(dtype), bt.to(dtype)
    if not torch.isfinite(bt).all():
        raise AdapterError(f"the {'/'.join(name for name, _p, _s in parts)} deltas, scaled by "
                           f"lora_alpha / r, overflow {dtype}")
    return LoraDelta(a, bt)


def _digest(config: _PeftLoraConfig, modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
            scalings: dict[str, float]) -> str:
    """sha256 over length-prefixed fields: the config that changes the computation, then per
    module (sorted) its name, scaling and both tensors' dtype, shape and bytes."""
    hasher = hashlib.sha256()
    targets = config.target_modules
    fields = ["lora", str(config.r), float(config.lora_alpha).hex(), str(config.use_rslora),
              json.dumps(sorted(targets) if isinstance(targets, list) else targets)]
    for module, (a, b) in modules.items():
        fields += [module, float(scalings[module]).hex()]
        for tensor in (a, b):
            fields += [str(tensor.dtype), str(tuple(tensor.shape))]
            fields.append(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    for field in fields:
        data = field if isinstance(field, bytes) else field.encode()
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()
