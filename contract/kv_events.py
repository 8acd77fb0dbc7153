"""KV cache events: which block digests a worker's cache gained or lost, and where it holds
them, on the msgpack wire.

The block pool emits events at digest level, never per physical block: ``stored`` when the
first block holding a digest becomes reusable, ``removed`` when the last one is evicted. So the
engine never reports one digest stored twice in one medium without a removal in between; the
index still treats events as sets (idempotent), so a duplicate delivered by a retry cannot
corrupt it.

Each event names its medium, as vLLM's ``BlockStored.medium`` and ``BlockRemoved.medium`` do:
``pool``, the working pool a hit is used from in place, or ``tier``, the second tier a hit is
first loaded from (``workers.kv_tier``). vLLM names the device ("GPU", "CPU"); ours names the
level, since a CPU worker's working pool and a GPU worker's second tier are both host memory,
and what the router weighs is whether a hit must be loaded. A block evicted into the second tier
is ``removed`` from the pool and ``stored`` in the tier; one loaded back is ``stored`` in the
pool while the tier keeps its copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgpack

EventKind = Literal["stored", "removed", "cleared"]
Medium = Literal["pool", "tier"]
MEDIA: tuple[Medium, ...] = ("pool", "tier")


@dataclass
class KVEvent:
    """One change to the set of digests a worker holds.

    Attributes:
        kind: ``stored`` (digests became reusable), ``removed`` (evicted), or ``cleared``
            (the whole cache, both media, was reset; ``digests`` is empty).
        digests: 32-byte block digests.
        medium: where they are stored or were removed from: ``pool`` or ``tier``.
    """

    kind: EventKind
    digests: list[bytes] = field(default_factory=list)
    medium: Medium = "pool"


def encode_events(events: list[KVEvent]) -> bytes:
    """msgpack-encode a batch: ``[[kind, [digest, ...], medium], ...]``."""
    return msgpack.packb([[event.kind, event.digests, event.medium] for event in events],
                         use_bin_type=True)


def decode_events(payload: bytes) -> list[KVEvent]:
    """Inverse of :func:`encode_events`. A row without a medium (``[kind, digests]``, as
    workers wrote before events carried one) is in the working pool.

    Raises:
        ValueError: the payload is not a batch of known events in known media.
    """
    try:
        events = [_event(row) for row in msgpack.unpackb(payload, raw=False)]
    except (ValueError, TypeError, msgpack.ExtraData) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc
    for event in events:
        if event.kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown KV event kind {event.kind!r}")
        if event.medium not in MEDIA:
            raise ValueError(f"unknown KV event medium {event.medium!r}")
    return events


def _event(row: object) -> KVEvent:
    if not isinstance(row, (list, tuple)) or len(row) not in (2, 3):
        raise ValueError(f"a row is not [kind, digests, medium]: {row!r:.80}")
    return KVEvent(row[0], list(row[1]), *row[2:])
