"""Builds the local draft proposer a :class:`SpeculativeConfig` names."""

from __future__ import annotations

from workers.spec.config import SpeculativeConfig
from workers.spec.ngram import NgramProposer
from workers.spec.proposer import Proposer
from workers.spec.suffix import SuffixProposer


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for ``config.method``: ``ngram`` (with the config's n-gram bounds) or
    ``suffix`` (default index settings).

    Raises:
        ValueError: ``method`` is ``off`` (nothing to build) or unknown, or the n-gram bounds
            are out of range.
    """
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.method == "suffix":
        return SuffixProposer()
    if config.method == "off":
        raise ValueError("speculative decoding is off: there is no proposer to build")
    raise ValueError(f"unknown speculative method {config.method!r}")
