"""The ``nalar`` CLI without a cluster."""

from __future__ import annotations

import threading

import pydantic
import pytest

from cluster.cli import _api_base, build_parser, main, serve_config


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_chat_accepts_the_url_serve_prints(url):
    assert _api_base(url) == "http://h:1/v1"


def test_chat_says_plainly_when_no_server_answers(capsys):
    assert main(["chat", "hi", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_serve_refuses_a_taken_port(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    assert f"127.0.0.1:{port} is already in use" in capsys.readouterr().err


def test_max_queue_delay_reaches_the_config_and_a_bad_one_is_refused():
    def config(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv]))

    assert config().max_queue_delay_s is None  # off by default: only the token bound
    assert config("--max-queue-delay", "60").max_queue_delay_s == 60.0
    with pytest.raises(pydantic.ValidationError, match="max_queue_delay_s"):
        config("--max-queue-delay", "0")


@pytest.mark.parametrize(("argv", "line"), [
    (["--gpu-memory-utilization", "1.5"],
     "nalar: cannot serve: --gpu-memory-utilization: Input should be less than or equal to 1"),
    (["--workers", "0"], "nalar: cannot serve: --workers: Input should be greater than or equal "
                         "to 1"),
    (["--max-queue-delay", "0"], "nalar: cannot serve: --max-queue-delay: Input should be "
                                 "greater than 0"),
    (["--lora-modules", "dupe=/a1", "dupe=/a2"],
     "nalar: cannot serve: --lora-modules: adapter name 'dupe' is given twice"),
    # The embedded model's served name: the adapter could never be reached.
    (["--lora-modules", "SmolLM2-135M-Instruct=/a1"],
     "nalar: cannot serve: adapter name 'SmolLM2-135M-Instruct' is the served model's name"),
    (["--gpus-per-worker", "0.5"], "nalar: cannot serve: --gpus-per-worker 0.5 puts 2 workers "
     "on a GPU, and each may use gpu_memory_utilization 0.9 of its memory (1.8 of it in all): "
     "pass --gpu-memory-utilization 0.45 (or less), or a fixed --kv-memory-mib"),
])
def test_a_flag_out_of_range_is_one_line_naming_the_flag(capsys, argv, line):
    """No traceback and no internal field name: the flag as the user typed it (exit code 2,
    argparse's for bad usage); nothing is started."""
    assert main(["serve", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line]
    assert "starting" not in captured.out


def test_the_cli_starts_without_importing_torch():
    """`nalar chat` and `nalar bench` talk HTTP only: loading the CLI (and the configuration
    defaults it reads) must not cost torch's import (seconds)."""
    import subprocess
    import sys

    probe = "import cluster.cli, sys; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_quantization_flag_reaches_the_config():
    def config(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv]))

    assert config().quantization == "auto"
    assert config("--quantization", "none").engine_config().quantization == "none"
    with pytest.raises(SystemExit):  # argparse's choices: exit 2 with a usage line
        config("--quantization", "q3_k")


def test_kv_tier_medium_flag_reaches_the_engine():
    def engine(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv])).engine_config()

    assert engine().kv_tier_medium == "auto"
    assert engine("--kv-tier-medium", "host").kv_tier_medium == "host"
    with pytest.raises(SystemExit):
        engine("--kv-tier-medium", "tape")


def test_step_time_target_flag_reaches_the_engine_in_seconds():
    def engine(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv])).engine_config()

    assert engine().step_time_target_s == "auto"  # chosen by the worker's weights
    assert engine("--step-time-target-ms", "0").step_time_target_s is None
    assert engine("--step-time-target-ms", "250").step_time_target_s == 0.25
    with pytest.raises(pydantic.ValidationError):
        engine("--step-time-target-ms", "-5")
    assert engine().max_step_time_s == "auto"  # chosen by the worker's device
    assert engine("--max-step-time-ms", "0").max_step_time_s is None
    assert engine("--max-step-time-ms", "500").max_step_time_s == 0.5
    with pytest.raises(pydantic.ValidationError):
        engine("--max-step-time-ms", "-1")


def test_idle_cores_are_borrowed_unless_the_flag_says_not():
    def engine(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv])).engine_config()

    assert engine().borrow_idle_cores is True
    assert engine("--no-borrow-idle-cores").borrow_idle_cores is False


def test_a_signal_during_the_start_asks_to_stop_once_it_is_done(capsys):
    """Ray and Serve swallow a KeyboardInterrupt while they start, so SIGINT only sets the
    event ``nalar serve`` checks when the start returns; it says so at once, and only then."""
    from cluster.cli import _ask_to_stop

    stop, started = threading.Event(), threading.Event()
    _ask_to_stop(stop, started)
    _ask_to_stop(stop, started)
    assert stop.is_set()
    assert capsys.readouterr().out == "stopping once the start is done ...\n"
    stop.clear()
    started.set()
    _ask_to_stop(stop, started)
    assert stop.is_set() and capsys.readouterr().out == ""
