"""How the ingress tells this process's routers that a request finished, as soon as its last
chunk arrives.

Ray Serve reports a streamed request's completion to its router (``on_request_completed``) when
the replica's generator task has ended, through Ray's completion callback: not ordered with the
chunks the ingress reads. Through ``nalar serve`` on an idle 2-core host it came about a
millisecond after the ingress had the last chunk (a throwaway instrumentation, 40 requests: p50
1.1 ms, the most 3.1 ms; one came before). Until then the router counts the request as work
still ahead on its worker, so a client that sends its next request at once, sharing the prompt,
could see it routed away from the only worker holding that prefix. That was not seen to happen
(the CI failures that led here had another cause: a fetch cost reported as 0 tokens, see
``NalarWorker._tier_tokens``), but nothing ordered it: the ingress knows first, so it says so
here.

Its own module because Ray Serve ships the router's module by value: a registry kept there
would be a separate copy in the router class's globals.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class FinishListener(Protocol):
    """A router that wants to hear of finished requests; called from any thread."""

    def request_finished(self, request_id: str) -> None: ...


class FinishedRequests:
    """The live listeners of this process (weakly held: a router that is dropped leaves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: weakref.WeakSet[FinishListener] = weakref.WeakSet()

    def listen(self, listener: FinishListener) -> None:
        """Adds ``listener``; it hears every later :meth:`finished`."""
        with self._lock:
            self._listeners.add(listener)

    def finished(self, request_id: str) -> None:
        """Tells every listener that the request ``request_id`` produced its last chunk."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.request_finished(request_id)


FINISHED_REQUESTS = FinishedRequests()
"""This process's registry (the routers listen, the ingress tells)."""
