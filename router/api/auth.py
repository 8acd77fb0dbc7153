"""API-key authentication of the HTTP API: which keys are accepted, and the guard that refuses
the rest.

Keys come from ``--api-key`` / ``$NALAR_API_KEY`` (fixed for the server's life) and from
``--api-keys-file`` (one key per line, ``#`` comment lines and blank lines ignored), which is
re-read when it changes, so keys are added and revoked without a restart. With no key
configured the server is open, as vLLM is without ``--api-key``.

Every route needs a key except :data:`PUBLIC_PATHS`: an allowlist rather than a list of guarded
prefixes, so a route added later is guarded until someone decides otherwise.

Raw keys are kept nowhere: only their SHA-256 digests are held, compared in constant time
(``hmac.compare_digest``), and the cache namespace is a keyed hash of the key
(:func:`contract.identity.tenant_from_api_key`). Nothing here logs a key or the
``Authorization`` header.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import APIError

logger = logging.getLogger(__name__)

ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""Paths that take the operator's admin key (:class:`AdminKey`), checked by their routes,
never a tenant's key."""

PUBLIC_PATHS = ("/health", "/ping", "/metrics", "/dashboard")
"""Paths (and their sub-paths) served without a key: probes and scrapers (a kubelet, Prometheus)
carry no key, and they reveal load figures, not prompts or answers. Keep them on a private
network all the same."""

RELOAD_PERIOD_S = 1.0
"""The keys file is checked for a change (``os.stat``) at most this often, in seconds."""

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header; ``None`` without a header.

    Raises:
        APIError: 401 ``invalid_api_key`` for a header in another form: it is refused rather
            than served in the shared anonymous namespace, which the client did not ask for.
    """
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("the Authorization header must be 'Bearer <api key>'")
    return key.strip()


def _unauthorized(message: str) -> APIError:
    """OpenAI's answer to a bad key: 401 ``invalid_request_error`` / ``invalid_api_key``."""
    return APIError(401, message, code="invalid_api_key", error_type="invalid_request_error",
                    headers=_CHALLENGE)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys_file(text: str) -> list[str]:
    """The keys of a keys file's text: one per line, surrounding whitespace stripped; blank
    lines and lines starting with ``#`` skipped."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class ApiKeys:
    """The set of accepted API keys.

    Args:
        keys: keys accepted for the server's life (``--api-key``, ``$NALAR_API_KEY``).
        path: a keys file, read now and again whenever its ``os.stat`` signature (mtime, size,
            inode) changes, checked at most once per ``reload_period_s`` seconds. A file that
            becomes unreadable keeps the last good set and is logged once, until it reads again.
        reload_period_s: seconds between two checks of the file.
        clock: monotonic time in seconds (tests pass their own).

    Raises:
        OSError, UnicodeDecodeError: the keys file cannot be read at start: a server told to
            require keys refuses to start rather than run open.
    """

    def __init__(self, keys: Iterable[str] = (), path: str | Path | None = None, *,
                 reload_period_s: float = RELOAD_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic):
        self._static = [_digest(key) for key in keys]
        self._path = Path(path) if path is not None else None
        self._reload_period_s = reload_period_s
        self._clock = clock
        self._from_file: list[bytes] = []
        self._signature: tuple[int, int, int] | None = None
        self._next_check = clock() + reload_period_s
        self._failing = False
        if self._path is not None:
            self._load(os.stat(self._path))
        # An open server is a warning: it is the line an operator must not miss.
        (logger.info if self.enabled else logger.warning)("API keys: %s", self.describe())

    @property
    def enabled(self) -> bool:
        """Whether keys are required: any key, or a keys file, was configured (an empty file
        then refuses every request rather than opening the server)."""
        return bool(self._static) or self._path is not None

    def describe(self) -> str:
        """One phrase for the start-up log: how many keys, from where (never the keys)."""
        if not self.enabled:
            return "none configured: every request is served (open server)"
        where = f"{len(self._static)} fixed"
        if self._path is not None:
            where += f" + {len(self._from_file)} from {self._path}"
        return f"required on every route but {', '.join(PUBLIC_PATHS)} ({where})"

    def authenticate(self, authorization: str | None) -> None:
        """Checks an ``Authorization`` header; returns when it carries an accepted key or when
        no key is required.

        Raises:
            APIError: 401 ``invalid_api_key`` with ``WWW-Authenticate: Bearer`` for a missing,
                malformed or unknown key.
        """
        if not self.enabled:
            return
        key = bearer_key(authorization)
        if key is None:
            raise _unauthorized("You didn't provide an API key. Send it in an Authorization "
                                "header: 'Authorization: Bearer <api key>'.")
        if not self.accepts(key):
            raise _unauthorized("Incorrect API key provided.")

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is accepted; every accepted digest is compared (no early exit), each
        in constant time, so the answer's timing says nothing about how close a guess was."""
        self._reload_if_changed()
        candidate = _digest(key)
        matched = False
        for accepted in (*self._static, *self._from_file):
            matched |= hmac.compare_digest(candidate, accepted)
        return matched

    def _reload_if_changed(self) -> None:
        if self._path is None or self._clock() < self._next_check:
            return
        self._next_check = self._clock() + self._reload_period_s
        try:
            status = os.stat(self._path)
            if _signature(status) != self._signature:
                self._load(status)
        except (OSError, UnicodeDecodeError) as exc:
            if not self._failing:
                logger.warning("API keys file %s cannot be read (%s); keeping the last %d "
                               "keys read from it", self._path, _reason(exc),
                               len(self._from_file))
            self._failing = True
            return
        if self._failing:
            logger.info("API keys file %s readable again", self._path)
        self._failing = False

    def _load(self, status: os.stat_result) -> None:
        """Reads the keys file (its state was ``status`` just before)."""
        assert self._path is not None
        keys = parse_keys_file(self._path.read_text(encoding="utf-8"))
        self._from_file = [_digest(key) for key in keys]
        self._signature = _signature(status)
        log = logger.warning if not keys else logger.info
        log("API keys file %s: %d keys", self._path, len(keys))


class AdminKey:
    """The operator's key for the :data:`ADMIN_PATHS` (``--admin-api-key``), held as its
    SHA-256 digest and compared in constant time.

    Args:
        key: the admin key; None turns the admin routes off.
    """

    def __init__(self, key: str | None):
        self._digest = _digest(key) if key else None

    def authorize(self, authorization: str | None) -> None:
        """Returns when ``authorization`` carries the admin key.

        Raises:
            APIError: 403 ``forbidden`` when no admin key is configured or the key is another
                (a tenant's); 401 ``invalid_api_key`` without a key.
        """
        if self._digest is None:
            raise _forbidden("loading and unloading adapters is off: start nalar serve with "
                             "--admin-api-key")
        key = bearer_key(authorization)
        if key is None:
            raise _unauthorized("this route needs the admin key: 'Authorization: Bearer "
                                "<admin key>'")
        if not hmac.compare_digest(_digest(key), self._digest):
            raise _forbidden("only the admin key may load or unload adapters")


def _forbidden(message: str) -> APIError:
    return APIError(403, message, code="forbidden", error_type="permission_error")


def _signature(status: os.stat_result) -> tuple[int, int, int]:
    # The inode too: a Kubernetes Secret volume swaps in a new file by renaming a symlink.
    return status.st_mtime_ns, status.st_size, status.st_ino


def _reason(exc: Exception) -> str:
    """Why a read failed, without the file's bytes (a decode error would quote one)."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return "not UTF-8"


def is_public(path: str) -> bool:
    """Whether ``path`` is one of :data:`PUBLIC_PATHS` or under one (on a segment boundary:
    ``/healthz`` is not ``/health``)."""
    return any(path == public or path.startswith(public + "/") for public in PUBLIC_PATHS)


class ApiKeyGuard:
    """ASGI middleware refusing every request to a non-public path without an accepted key
    (401 in OpenAI's error shape), before the body is read.

    Args:
        app: the wrapped application.
        keys: returns the :class:`ApiKeys` to check, or ``None`` for an open server. Called per
            request, because a Ray Serve ingress builds its app before its ``__init__`` runs.
    """

    def __init__(self, app: ASGIApp, keys: Callable[[], ApiKeys | None]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys() if scope["type"] == "http" else None
        if keys is not None:
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if not is_public(path) and path not in ADMIN_PATHS:
                try:
                    keys.authenticate(Headers(scope=scope).get("authorization"))
                except APIError as refusal:
                    await refusal.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
