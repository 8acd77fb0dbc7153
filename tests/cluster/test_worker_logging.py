"""A request the worker refuses is the client's error: Ray Serve's record of it is one INFO line."""

import logging
import sys

from cluster.worker_deployment import ClientErrorLogFilter
from contract.request import InvalidRequestError
from router.errors import OverloadedError
from workers.lora.errors import AdapterError


def failed_record(exc: BaseException) -> logging.LogRecord:
    """The record Serve's replica makes with ``logger.exception("Request failed.")``."""
    try:
        raise exc
    except BaseException:
        return logging.getLogger("ray.serve").makeRecord(
            "ray.serve", logging.ERROR, "replica.py", 1465, "Request failed.", (), sys.exc_info())


def test_a_refused_request_is_logged_as_one_info_line_without_traceback():
    for exc in (InvalidRequestError("Invalid type: objekt", "response_format"),
                OverloadedError("queue full"), AdapterError("DoRA (use_dora) is not supported")):
        record = failed_record(exc)
        assert ClientErrorLogFilter().filter(record)
        assert record.levelno == logging.INFO and record.exc_info is None
        assert record.getMessage() == f"Request refused ({type(exc).__name__}): {exc}"
        assert "Traceback" not in logging.Formatter().format(record)


def test_any_other_failure_keeps_its_level_and_traceback():
    record = failed_record(RuntimeError("engine died"))
    assert ClientErrorLogFilter().filter(record)
    assert record.levelno == logging.ERROR and record.getMessage() == "Request failed."
    assert "RuntimeError: engine died" in logging.Formatter().format(record)


def test_the_filter_is_installed_once_per_logger():
    logger = logging.getLogger("nalar-test-filter-once")
    ClientErrorLogFilter.install(logger)
    ClientErrorLogFilter.install(logger)
    assert sum(isinstance(f, ClientErrorLogFilter) for f in logger.filters) == 1
