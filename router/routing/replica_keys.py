"""The model keys the live replicas of each deployment index their blocks under, as this
process's routers last saw them.

The ingress hashes prompts under the workers' identity, read once at start; when the workers are
redeployed with other weights, their ``model_key`` changes and every request digest stops
matching. The router sees the replicas' keys (their metadata and routing stats) and records them
here; the ingress, in the same process, compares its own key with them
(``cluster.worker_identity``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

DeploymentKey = tuple[str, str]
"""``(application name, deployment name)``."""


class ReplicaModelKeys:
    """Per deployment, the set of model keys its live replicas report. Thread-safe: routers may
    run on their own event loop thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[DeploymentKey, frozenset[str]] = {}

    def update(self, deployment: DeploymentKey, keys: Iterable[str]) -> None:
        """Replaces what is known of ``deployment``'s replicas by ``keys``."""
        frozen = frozenset(keys)
        with self._lock:
            self._keys[deployment] = frozen

    def keys(self, deployment: DeploymentKey) -> frozenset[str]:
        """The keys last reported for ``deployment``; empty when none are known."""
        with self._lock:
            return self._keys.get(deployment, frozenset())


REPLICA_MODEL_KEYS = ReplicaModelKeys()
"""This process's view (the ingress's router writes, the ingress reads)."""
