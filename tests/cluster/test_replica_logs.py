"""Our modules' INFO lines reach the Serve logger's handlers in a replica
(``cluster.replica_logs``), where only their warnings used to arrive."""

from __future__ import annotations

import logging

import pytest

from cluster.replica_logs import PACKAGES, SERVE_LOGGER, ToServeLogger, route_to_serve_logger


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def serve_file():
    """A handler on the Serve logger standing in for the replica's log file; our packages'
    loggers are restored afterwards."""
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
             for name in PACKAGES}
    handler = Collect()
    serve_logger = logging.getLogger(SERVE_LOGGER)
    serve_logger.addHandler(handler)
    yield handler
    serve_logger.removeHandler(handler)
    for name, (level, handlers) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).handlers = handlers


def test_info_lines_of_our_modules_reach_the_serve_logger_once(serve_file):
    log = logging.getLogger("cluster.worker_deployment")
    log.info("before: dropped")
    route_to_serve_logger()
    route_to_serve_logger()  # a second replica constructor in the process adds nothing
    log.info("worker %s ready", "w1")
    logging.getLogger("workers.kv_budget").debug("below INFO: dropped")
    assert serve_file.messages == ["worker w1 ready"]
    assert sum(isinstance(h, ToServeLogger) for h in logging.getLogger("cluster").handlers) == 1
