"""RemoteProposer against fake draft handles (no Ray): one batched call per step, a deadline,
zero proposals on a late or failed call, back-off and recovery."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from workers.speculative.proposer import ProposalRequest
from workers.speculative.remote import BACKOFF_INITIAL_S, BACKOFF_MAX_S, RemoteProposer


class FakeResponse:
    """A ``DeploymentResponse`` stand-in: resolves after ``delay_s`` on a timer thread."""

    def __init__(self, reply, delay_s: float):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = False
        timer = threading.Timer(delay_s, self._resolve, args=(reply,))
        timer.daemon = True
        timer.start()

    def _resolve(self, reply) -> None:
        if isinstance(reply, BaseException):
            self.future.set_exception(reply)
        else:
            self.future.set_result(reply)

    def result(self, timeout_s: float | None = None):
        try:
            return self.future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("Timed out waiting for result.") from None

    def cancel(self) -> None:
        self.cancelled = True


class FakeMethod:
    def __init__(self, answer):
        self.answer = answer
        self.calls: list = []
        self.responses: list[FakeResponse] = []

    def remote(self, arg):
        self.calls.append(arg)
        reply, delay_s = self.answer(arg)
        response = FakeResponse(reply, delay_s)
        self.responses.append(response)
        return response


class FakeHandle:
    """Answers ``propose`` with ``mode``: ``work`` (echo the last token k times), ``slow``
    (the same, after ``slow_s``), ``fail`` (raises), ``garbage`` (a malformed reply)."""

    def __init__(self, mode: str = "work", slow_s: float = 1.0):
        self.mode = mode
        self.slow_s = slow_s
        self.propose = FakeMethod(self._propose)
        self.finish = FakeMethod(lambda ids: (None, 0.0))

    def _propose(self, items):
        drafts = [[tokens[-1]] * (k + 2) for _, tokens, _, k, _ in items]  # over-long on purpose
        if self.mode == "fail":
            return RuntimeError("replica died"), 0.0
        if self.mode == "garbage":
            return drafts[:-1], 0.0
        return drafts, self.slow_s if self.mode == "slow" else 0.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch(n: int = 3, k: int = 2) -> list[ProposalRequest]:
    return [ProposalRequest(f"r{i}", [1, 2, 10 + i], 2, k) for i in range(n)]


def test_one_batched_call_per_step_token_ids_only():
    handle = FakeHandle()
    proposer = RemoteProposer(handle, deadline_s=1.0)
    assert proposer.propose(batch(3, k=2)) == [[10, 10], [11, 11], [12, 12]]
    assert proposer.propose(batch(2, k=1)) == [[10], [11]]
    assert len(handle.propose.calls) == proposer.calls == 2
    assert handle.propose.calls[0] == [("r0", [1, 2, 10], 2, 2, ""), ("r1", [1, 2, 11], 2, 2, ""),
                                       ("r2", [1, 2, 12], 2, 2, "")]
    assert proposer.propose([]) == [] and proposer.calls == 2


def test_late_call_gives_no_drafts_within_the_deadline():
    handle = FakeHandle("slow", slow_s=2.0)
    proposer = RemoteProposer(handle, deadline_s=0.05)
    started = time.monotonic()
    assert proposer.propose(batch(3)) == [[], [], []]
    assert time.monotonic() - started < 0.5
    assert (proposer.calls, proposer.timeouts, proposer.failures) == (1, 1, 0)
    assert handle.propose.responses[0].cancelled


@pytest.mark.parametrize("mode", ["fail", "garbage"])
def test_failed_or_malformed_call_gives_no_drafts(mode):
    proposer = RemoteProposer(FakeHandle(mode), deadline_s=1.0)
    assert proposer.propose(batch(3)) == [[], [], []]
    assert (proposer.calls, proposer.timeouts, proposer.failures) == (1, 0, 1)


def test_a_handle_that_raises_on_call_gives_no_drafts():
    class Broken:
        class propose:  # noqa: N801 - mimics handle.propose.remote
            @staticmethod
            def remote(items):
                raise RuntimeError("no such deployment")

    proposer = RemoteProposer(Broken(), deadline_s=1.0)
    assert proposer.propose(batch(1)) == [[]] and proposer.failures == 1


def test_backs_off_growing_then_recovers():
    clock = Clock()
    handle = FakeHandle("fail")
    proposer = RemoteProposer(handle, deadline_s=1.0, clock=clock)
    assert proposer.propose(batch()) == [[], [], []]
    assert proposer.backing_off
    assert proposer.propose(batch()) == [[], [], []]  # skipped: no call during the back-off
    assert (proposer.calls, proposer.skipped) == (1, 1)

    clock.now += BACKOFF_INITIAL_S
    proposer.propose(batch())  # still failing: the interval doubles
    assert proposer.calls == 2
    clock.now += BACKOFF_INITIAL_S
    proposer.propose(batch())
    assert (proposer.calls, proposer.skipped) == (2, 2)
    clock.now += BACKOFF_INITIAL_S

    handle.mode = "work"  # the replica is back
    assert proposer.propose(batch(1, k=2)) == [[10, 10]]
    assert not proposer.backing_off and proposer.calls == 3
    handle.mode = "fail"  # a success resets the interval
    proposer.propose(batch())
    clock.now += BACKOFF_INITIAL_S
    assert not proposer.backing_off


def test_backoff_is_capped():
    clock = Clock()
    proposer = RemoteProposer(FakeHandle("fail"), deadline_s=1.0, clock=clock)
    for _ in range(10):
        proposer.propose(batch(1))
        clock.now += BACKOFF_MAX_S
    assert proposer.calls == 10 and proposer.skipped == 0


def test_finish_is_forwarded_and_held_while_backing_off():
    clock = Clock()
    handle = FakeHandle()
    proposer = RemoteProposer(handle, deadline_s=1.0, clock=clock)
    proposer.finish(["a"])
    assert handle.finish.calls == [["a"]]
    handle.mode = "fail"
    proposer.propose(batch(1))
    proposer.finish(["b", "c"])
    assert handle.finish.calls == [["a"]]  # held: the replicas are not answering
    handle.mode = "work"
    clock.now += BACKOFF_INITIAL_S
    proposer.propose(batch(1))
    assert handle.finish.calls == [["a"], ["b", "c"]]


def test_rejects_a_nonpositive_deadline():
    with pytest.raises(ValueError):
        RemoteProposer(FakeHandle(), deadline_s=0)
