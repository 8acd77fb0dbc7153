"""Making a request's adapter resident before the engine admits it, from an asyncio server.

``AdapterRegistry.ensure`` blocks (it may read from disk), so it runs in a thread while the
engine keeps stepping. While every resident slot is in use the request waits for one, as
vLLM's scheduler keeps such a request waiting, polling until a slot frees or the wait runs
out. Each request is counted by where its adapter was, and slot waits are timed: the worker
reports their mean to the router as what a full set of slots costs there.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from contract.identity import AdapterRef
from workers.lora.registry import AdapterRegistry, AdapterSlotsFull

SOURCES = ("resident", "host", "read", "slot")
"""Where a request found its adapter: resident, moved back from the host tier, read from
disk (or waited for another request's read), or waited for a free slot first."""


class AdapterAdmission:
    """Adapters made resident for requests, counted by source.

    Args:
        registry: the engine's adapters.
        wait_s: longest wait for a free slot, in seconds, before giving up.
        poll_s: how often a waiting request tries again (a slot frees when a sequence
            finishes: a step or more).

    Attributes:
        requests: adapter requests seen.
        by_source: those requests by ``SOURCES``.
        slot_wait_s: seconds requests waited for a free slot, in all.
    """

    def __init__(self, registry: AdapterRegistry, wait_s: float = 30.0, poll_s: float = 0.02):
        self.registry = registry
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.requests = 0
        self.by_source: Counter[str] = Counter(dict.fromkeys(SOURCES, 0))
        self.slot_wait_s = 0.0

    def mean_slot_wait_s(self) -> float:
        """Mean seconds a request that waited for a slot waited (0 before the first)."""
        waits = self.by_source["slot"]
        return self.slot_wait_s / waits if waits else 0.0

    async def ensure(self, ref: AdapterRef | None) -> str | None:
        """Make ``ref``'s adapter resident and reserved for its request
        (``AdapterRegistry.ensure``), waiting for a free slot while none is; returns its
        source (None for the base model). A cancelled call ends a reservation made anyway.

        Raises:
            AdapterSlotsFull: every slot stayed in use for ``wait_s``.
            InvalidRequestError: the adapter cannot be read or changed on disk.
        """
        if ref is None:
            return None
        self.requests += 1
        deadline = time.monotonic() + self.wait_s
        waited_since = None
        while True:
            ensured = asyncio.ensure_future(asyncio.to_thread(self.registry.ensure, ref))
            try:
                source = await asyncio.shield(ensured)
                break
            except AdapterSlotsFull:
                waited_since = waited_since or time.monotonic()
                if time.monotonic() >= deadline:
                    raise
            except asyncio.CancelledError:
                ensured.add_done_callback(lambda done: done.cancelled() or done.exception()
                                          or self.registry.release(ref))
                raise
            await asyncio.sleep(self.poll_s)
        if waited_since is not None:
            source = "slot"
            self.slot_wait_s += time.monotonic() - waited_since
        self.by_source[source] += 1
        return source
