"""Builds the local draft proposer a :class:`SpeculativeConfig` names."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from workers.spec.config import SpeculativeConfig
from workers.spec.ngram import NgramProposer
from workers.spec.proposer import Proposer
from workers.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from workers.config import EngineConfig
    from workers.model_loader import LoadedModel
    from workers.spec.draft_model import Vocabulary

DRAFT_KV_FRACTION = 4
"""The ``model`` draft's KV budget is the target's divided by this."""


def build_proposer(config: SpeculativeConfig, target: LoadedModel | Vocabulary | None = None,
                   engine_config: EngineConfig | None = None) -> Proposer:
    """The proposer for ``config.method``: ``ngram`` (with the config's n-gram bounds),
    ``suffix`` (default index settings) or ``model`` (``config.draft_model`` drafting for
    ``target`` on an engine like ``engine_config``, with a quarter of its KV budget).

    Raises:
        ValueError: ``method`` is ``off`` (nothing to build) or unknown, the n-gram bounds
            are out of range, or (``model``) no target is given or the draft's vocabulary or
            tokenizer differs from the target's.
    """
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.method == "suffix":
        return SuffixProposer()
    if config.method == "model":
        return _draft_model_proposer(config, target, engine_config)
    if config.method == "off":
        raise ValueError("speculative decoding is off: there is no proposer to build")
    raise ValueError(f"unknown speculative method {config.method!r}")


def _draft_model_proposer(config: SpeculativeConfig, target: LoadedModel | Vocabulary | None,
                          engine_config: EngineConfig | None) -> Proposer:
    # imported here: the draft runs an engine, and the engine builds proposers
    from workers.config import EngineConfig
    from workers.model_loader import load_model
    from workers.spec.draft_model import DraftModelProposer

    if target is None:
        raise ValueError("the model proposer needs the target model to check the draft against")
    base = engine_config or EngineConfig()
    draft = load_model(config.draft_model, base.dtype, base.device)
    draft_config = replace(base, model=config.draft_model, speculative=SpeculativeConfig(),
                           kv_cache_bytes=base.kv_cache_bytes // DRAFT_KV_FRACTION)
    return DraftModelProposer.for_target(draft, target, draft_config)
