"""The ``model`` proposer: a smaller causal LM with the target's tokenizer drafts greedily.

The draft runs its own :class:`~workers.engine.LLMEngine`, so it has its own paged KV cache
with identity-checked prefix reuse. That is also how it rolls back: each call admits the
sequence's committed tokens as a prompt; the blocks of the committed prefix are prefix-cache
hits, while blocks holding drafts the target rejected chain from other tokens and are never
hit again (they age out of the draft's LRU). Only the committed tail since the last full block
is recomputed per call, then ``k - 1`` decode steps run, batched over every sequence of the call.

Drafting is greedy, so each proposal is one token (a one-hot draft distribution) and the
target's verification (``workers.speculative.verify``) keeps the target's output distribution
exactly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from transformers import AutoConfig

from contract.request import GenerationRequest, InvalidRequestError, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_budget import CPU_KV_CACHE_BYTES
from workers.model_loader import LoadedModel, load_model
from workers.model_source import load_tokenizer, resolve_source
from workers.speculative.config import SpeculativeConfig
from workers.speculative.proposer import ProposalRequest

DRAFT_KV_FRACTION = 4
"""The draft's KV budget is the target's divided by this."""


@dataclass
class Vocabulary:
    """What a draft must share with its target: the meaning of every token id.

    Attributes:
        name: the model's name, for error messages.
        tokenizer: its tokenizer (``get_vocab()`` maps token text to id).
        size: the model's vocabulary size (logit rows).
    """

    name: str
    tokenizer: Any
    size: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> Vocabulary:
        return cls(loaded.served_name, loaded.tokenizer, loaded.model.config.vocab_size)

    @classmethod
    def load(cls, model: str) -> Vocabulary:
        """A model's vocabulary without its weights (a draft replica checks its target)."""
        path, _ = resolve_source(model)
        return cls(model, load_tokenizer(model), AutoConfig.from_pretrained(path).vocab_size)


def check_draft_compatible(target: Vocabulary, draft: Vocabulary) -> None:
    """Refuse a draft whose token ids mean something else than the target's (case S5).

    Raises:
        ValueError: the vocabulary sizes or the tokenizers' vocabularies differ; the message
            names both models and both sizes.
    """
    if target.size != draft.size:
        raise ValueError(f"draft model {draft.name!r} has a vocabulary of {draft.size} tokens "
                         f"but target {target.name!r} has {target.size}: speculative decoding "
                         "needs the same vocabulary and tokenizer")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"draft model {draft.name!r} and target {target.name!r} have "
                         "different tokenizers (same vocabulary size, different token ids)")


class DraftModelProposer:
    """Greedy drafts from a smaller model on its own engine.

    Args:
        engine: the draft's engine (speculation off).

    Use :meth:`for_target` to build one that is checked against the target.
    """

    name = "model"

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def for_target(cls, draft: LoadedModel, target: LoadedModel | Vocabulary,
                   config: EngineConfig) -> DraftModelProposer:
        """A proposer for ``target`` drafting with ``draft`` on an engine built from
        ``config`` (its KV budget, block size and threads; speculation must be off there).

        Raises:
            ValueError: the draft's vocabulary or tokenizer differs from the target's.
        """
        if isinstance(target, LoadedModel):
            target = Vocabulary.of(target)
        check_draft_compatible(target, Vocabulary.of(draft))
        return cls(LLMEngine(config, loaded=draft))

    @classmethod
    def load(cls, config: SpeculativeConfig, target: LoadedModel | Vocabulary,
             engine_config: EngineConfig) -> DraftModelProposer:
        """Loads ``config.draft_model`` and drafts for ``target`` on an engine like
        ``engine_config`` (the target's), with a quarter of its KV budget (of 512 MiB when
        the target's is automatic).

        Raises:
            ValueError: no draft model is configured, or its vocabulary or tokenizer differs
                from the target's.
        """
        if not config.draft_model:
            raise ValueError("the model proposer needs a draft model (--draft-model)")
        draft = load_model(config.draft_model, engine_config.dtype, engine_config.device)
        # An automatic target budget counts as the CPU's: a fixed draft budget, never sized
        # from a device's free memory (the draft may share its device with the target).
        target_kv = engine_config.kv_cache_bytes or CPU_KV_CACHE_BYTES
        draft_config = replace(engine_config, model=config.draft_model,
                               speculative=SpeculativeConfig(),
                               kv_cache_bytes=target_kv // DRAFT_KV_FRACTION)
        return cls.for_target(draft, target, draft_config)

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens per request, all requests batched in the draft's
        steps. A request the draft cannot take (longer than its context) gets none."""
        ids = {}
        for request in requests:
            draft_id = f"draft-{next(self._ids)}"
            try:
                self.engine.add_request(GenerationRequest(
                    draft_id, list(request.token_ids),
                    SamplingParams(temperature=0.0, max_tokens=request.k, ignore_eos=True)))
            except InvalidRequestError:
                continue
            ids[request.request_id] = draft_id
        drafted: dict[str, list[int]] = {draft_id: [] for draft_id in ids.values()}
        while self.engine.has_work():
            for chunk in self.engine.step():
                drafted[chunk.request_id] += chunk.token_ids
        return [drafted.get(ids.get(r.request_id, ""), []) for r in requests]

    def finish(self, request_ids: list[str]) -> None:
        """Nothing to drop: a draft request ends with its call; its blocks stay cached."""
