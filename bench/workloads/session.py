"""Sessions: the unit a workload hands the load generator.

A session is a sequence of requests that must run one after another (a conversation's turns);
single-shot workloads make sessions of one request. The load generator starts sessions at the
arrival rate; a session asks for its next request once the previous one has finished.
"""

from __future__ import annotations

from typing import Protocol

from bench.records import BenchRequest, RequestRecord


class Session(Protocol):
    """A sequence of dependent requests.

    Attributes:
        max_requests: how many requests it makes at most.
        think_time_s: pause between one request's end and the next one's start, seconds.
    """

    max_requests: int
    think_time_s: float

    def next_request(self, previous: RequestRecord | None) -> BenchRequest | None:
        """The next request, given how the previous one went (None before the first); None
        when the session is over."""
        ...


class SingleRequest:
    """A session of one independent request."""

    max_requests = 1
    think_time_s = 0.0

    def __init__(self, request: BenchRequest):
        self.request = request

    def next_request(self, previous: RequestRecord | None) -> BenchRequest | None:
        """The request, once."""
        return self.request if previous is None else None
