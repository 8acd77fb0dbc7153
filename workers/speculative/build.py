"""Builds the local draft proposer a :class:`SpeculativeConfig` names.

Only the proposers that need no model of their own are built here. The ``model`` proposer runs
an engine of its own (``workers.speculative.draft_model``), so the engine, which builds its
local proposer from this module, cannot build that one without importing itself: a draft
replica (``cluster.draft_deployment``) or a test builds it with
:meth:`~workers.speculative.draft_model.DraftModelProposer.load` and hands it over.
"""

from __future__ import annotations

from workers.speculative.config import SpeculativeConfig
from workers.speculative.ngram import NgramProposer
from workers.speculative.proposer import Proposer
from workers.speculative.suffix import ScopedSuffixProposer


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for ``config.method``: ``ngram`` (with the config's n-gram bounds) or
    ``suffix`` (default index settings, one index per adapter scope).

    Raises:
        ValueError: ``method`` is ``off`` (nothing to build), ``model`` (built with its draft
            model by :meth:`DraftModelProposer.load <workers.speculative.draft_model.
            DraftModelProposer.load>`, never here) or unknown.
    """
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.method == "suffix":
        return ScopedSuffixProposer()
    if config.method == "model":
        raise ValueError("the model proposer is built with its draft model "
                         "(DraftModelProposer.load, on a draft replica) and passed in")
    if config.method == "off":
        raise ValueError("speculative decoding is off: there is no proposer to build")
    raise ValueError(f"unknown speculative method {config.method!r}")
