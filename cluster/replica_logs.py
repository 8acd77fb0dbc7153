"""Our modules' log lines in a Serve replica's log.

Ray Serve configures one logger in a replica, ``ray.serve``: its file under the session's
``logs/serve/``, each line stamped with the replica and the request, and it sends the replica's
stderr there too. Our modules log under their own names, so only their warnings reached that
file (through Python's last-resort handler, which writes to stderr), and every INFO line was
dropped: a worker ready and its KV budget, a fetch that fell back to computing, an adapter
loaded, the index resynced.
"""

from __future__ import annotations

import logging

PACKAGES = ("cluster", "workers", "router", "contract")
SERVE_LOGGER = "ray.serve"


class ToServeLogger(logging.Handler):
    """Hands each record to the Serve logger's handlers, as they are when the record comes (a
    change of the application's logging config replaces them)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER).handle(record)


def route_to_serve_logger(level: int = logging.INFO) -> None:
    """Sends our packages' records at ``level`` and above through the Serve logger; a replica
    calls it as it starts (again: a no-op). Records still propagate, so nothing that listens
    on the root logger loses them."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, ToServeLogger) for handler in logger.handlers):
            logger.addHandler(ToServeLogger())
        logger.setLevel(level)
