"""KV cache events: which block digests a worker's cache gained or lost, on the msgpack wire.

The block pool emits events at digest level, never per physical block: ``stored`` when the
first block holding a digest becomes reusable, ``removed`` when the last one is evicted. So the
engine never reports one digest stored twice without a removal in between; the index still
treats events as sets (idempotent), so a duplicate delivered by a retry cannot corrupt it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgpack

EventKind = Literal["stored", "removed", "cleared"]


@dataclass
class KVEvent:
    """One change to the set of digests a worker holds.

    Attributes:
        kind: ``stored`` (digests became reusable), ``removed`` (evicted), or ``cleared``
            (the whole cache was reset; ``digests`` is empty).
        digests: 32-byte block digests.
    """

    kind: EventKind
    digests: list[bytes] = field(default_factory=list)


def encode_events(events: list[KVEvent]) -> bytes:
    """msgpack-encode a batch: ``[[kind, [digest, ...]], ...]``."""
    return msgpack.packb([[event.kind, event.digests] for event in events], use_bin_type=True)


def decode_events(payload: bytes) -> list[KVEvent]:
    """Inverse of :func:`encode_events`.

    Raises:
        ValueError: the payload is not a batch of known events.
    """
    try:
        rows = msgpack.unpackb(payload, raw=False)
        events = [KVEvent(kind, list(digests)) for kind, digests in rows]
    except (ValueError, TypeError, msgpack.ExtraData) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc
    for event in events:
        if event.kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown KV event kind {event.kind!r}")
    return events
