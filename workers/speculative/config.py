"""Speculative decoding configuration."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS: tuple[str, ...] = ("off", "ngram", "suffix", "model")


@dataclass
class SpeculativeConfig:
    """How a worker speculates.

    Attributes:
        method: ``off``, ``ngram`` (prompt lookup over the request's own tokens), ``suffix``
            (a suffix index over every prompt and output the draft replica has seen) or
            ``model`` (a smaller LM with the target's tokenizer, ``draft_model``).
        draft_model: the ``model`` method's draft (a path or cached hub id).
        num_speculative_tokens: k_max, the most draft tokens verified per step.
        ngram_min, ngram_max: the shortest and longest suffix (tokens) ``ngram`` matches.
        adaptive: choose k per request from measured acceptance and costs (else always k_max).
        remote: run the proposer on a draft replica (``cluster.draft_deployment``) instead of
            inside the worker.
        draft_replicas: draft replicas when ``remote``.
        deadline_s: a draft call slower than this gives zero proposals for that step.

    Raises:
        ValueError: (from :meth:`validate`) an unknown method or out-of-range value.
    """

    method: str = "off"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True
    remote: bool = False
    draft_replicas: int = 1
    deadline_s: float = 0.05
    draft_model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, "
                             f"not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.method == "model" and not self.draft_model:
            raise ValueError("speculative method 'model' needs a draft model")
        if self.draft_replicas < 1 or self.deadline_s <= 0:
            raise ValueError("draft_replicas must be >= 1 and deadline_s > 0")
