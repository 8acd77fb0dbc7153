"""The ingress's catalog of LoRA adapters recovers run-time loads from the worker replicas, so
a restarted ingress serves what was loaded before it started."""

from __future__ import annotations

from cluster.adapters import AdapterCatalog
from contract.identity import AdapterRef

START = AdapterRef("start", "aa" * 32, "/adapters/start")
SQL = AdapterRef("sql", "bb" * 32, "/adapters/sql")
CHAT_A = AdapterRef("chat", "cc" * 32, "/adapters/chat")
CHAT_B = AdapterRef("chat", "dd" * 32, "/adapters/chat")


class Replicas:
    """A worker deployment handle whose replicas answer ``lora_adapters`` with ``answers``."""

    def __init__(self, answers: list):
        self.answers = answers
        self.calls: list[str] = []

    def broadcast(self, method: str, *args):
        self.calls.append(method)
        answers = self.answers

        class Response:
            def results(self, timeout_s, return_exceptions):
                assert return_exceptions
                return answers

        return Response()


async def test_a_restarted_ingress_recovers_what_the_replicas_agree_on():
    # replica 1 started after the loads (knows only --lora-modules); replica 3 did not answer;
    # "chat" was left with other content on two replicas (an interrupted reload)
    replicas = Replicas([{"start": START},
                         {"start": START, "sql": SQL, "chat": CHAT_A},
                         TimeoutError("late"),
                         {"start": START, "sql": SQL, "chat": CHAT_B}])
    catalog = AdapterCatalog(replicas, {"start": START})
    await catalog.recover()
    assert replicas.calls == ["lora_adapters"]
    assert catalog.adapters == {"start": START, "sql": SQL}


async def test_the_start_time_adapters_win_over_what_replicas_report():
    moved = AdapterRef("start", "ee" * 32, "/elsewhere")
    catalog = AdapterCatalog(Replicas([{"start": moved}]), {"start": START})
    await catalog.recover()
    assert catalog.adapters == {"start": START}
