"""Draft replicas: a Ray Serve deployment whose replicas each hold one proposer.

Workers reach it through :class:`workers.speculative.remote.RemoteProposer`: one batched call per
engine step, token ids only. ``suffix`` lives here because its index is shared by every worker
that calls this replica (each replica keeps its own index); ``ngram`` may run here too
(``--speculative-remote``), though by default it runs inside the worker.
"""

from __future__ import annotations

import threading

from cluster.replica_logs import route_to_serve_logger
from workers.config import EngineConfig
from workers.speculative.config import SpeculativeConfig
from workers.speculative.proposer import ProposalRequest, Proposer

DRAFT_DEPLOYMENT = "NalarDraft"


class DraftProposer:
    """One proposer behind a Serve replica.

    Calls from several workers may run at once (Serve runs sync methods concurrently), so a
    lock serialises them: a shared suffix index must not be read while it is being extended.

    Args:
        config: the speculative configuration; ``remote`` is ignored here (this is the remote
            end), the rest builds the proposer.
        engine_config: the workers' engine configuration (``model``: the target); the
            ``model`` proposer's engine is built like it and checked against the target.

    Raises:
        ValueError: ``config`` names no proposer (``method`` ``off``) or is invalid, or a
            draft model's vocabulary differs from the target's.
    """

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig | None = None):
        route_to_serve_logger()
        config.validate()
        if not config.enabled:
            raise ValueError("a draft replica needs a speculative method, not 'off'")
        self.proposer = _load_proposer(config, engine_config or EngineConfig())
        self._lock = threading.Lock()

    def propose(self, items: list[tuple[str, list[int], int, int, str]]) -> list[list[int]]:
        """Draft token ids for each ``(request_id, token_ids, num_prompt_tokens, k, scope)``
        (``workers.speculative.remote.WireItem``), in order: at most ``k`` each, possibly
        none."""
        requests = [ProposalRequest(rid, list(tokens), prompt, k, scope)
                    for rid, tokens, prompt, k, scope in items]
        with self._lock:
            drafts = self.proposer.propose(requests)
        return [[int(t) for t in tokens] for tokens in drafts]

    def finish(self, request_ids: list[str]) -> None:
        """The sequences ended: the proposer drops their per-sequence state."""
        with self._lock:
            self.proposer.finish(list(request_ids))

    def describe(self) -> dict:
        """This replica's id and its proposer's name (for tests and start-up logs)."""
        from ray import serve

        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "proposer": self.proposer.name}


def _load_proposer(config: SpeculativeConfig, engine_config: EngineConfig) -> Proposer:
    """The proposer ``config`` names, loaded here: proposers load only on draft replicas."""
    if config.method == "model":
        from workers.speculative.draft_model import DraftModelProposer, Vocabulary

        return DraftModelProposer.load(config, Vocabulary.load(engine_config.model),
                                       engine_config)
    from workers.speculative.build import build_proposer

    return build_proposer(config)
