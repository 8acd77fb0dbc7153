"""Redis digest index: a SET of binary digests per (model key, worker, medium), with a TTL.

Layout, under ``{key_prefix}:{model_key}``:

* ``:w:{worker_id}`` and ``:t:{worker_id}``: SETs of the 32-byte digests held in the worker's
  working pool and in its second tier, whose expiry is pushed to ``worker_ttl_s`` on every
  publish and heartbeat, so a dead worker's keys vanish on their own within one TTL (case R2)
  and Redis memory stays bounded by the live workers.
* ``:workers``: a ZSET of the workers with entries, scored by their last write (ms, Redis
  server time); pruned of silent ones at every write, so :meth:`RedisIndex.stats` visits only
  the live workers (O(workers), never a SCAN of the keyspace).
* ``:last``: the time (ms, Redis server time) of the model's last publish or heartbeat, for
  ``last_event_age_s``; server time, so workers' and readers' clocks never need to agree.

A publish is one EVALSHA: the script decodes the msgpack batch with Redis's bundled ``cmsgpack``,
validates all of it, then applies it (stored→SADD, removed→SREM on the event's medium's SET,
cleared→DEL of both) and sets the TTL, atomically. Redis's ``cmsgpack`` predates the msgpack *bin*
types (0xc4-0xc6) and rejects them ("Bad data format in input."), while
:func:`contract.kv_events.encode_events` writes digests as bin; so the batch is validated here
first (same rules as every backend) and re-packed in the legacy raw format, in which bytes travel
as msgpack *str* and reach Lua as binary-safe strings.

A match is one EVALSHA: for each worker, SMISMEMBER of the chain against its two SETs, a chunk
at a time until the first block held in neither, returning only the two counts of
:class:`~router.index.base.HeldPrefix`. The chain crosses the network once, and a short match
of a long prompt stops early.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgpack
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from contract.identity import DIGEST_SIZE
from contract.kv_events import MEDIA, Medium
from router.index.base import (
    DigestIndex,
    HeldPrefix,
    IndexStats,
    IndexUnavailableError,
    decode_batch,
)

_BAD_BATCH = "BADBATCH"
_MEDIUM_TAGS: dict[Medium, str] = {"pool": "w", "tier": "t"}

LAST_EVENT_TTL_MS = 24 * 3600 * 1000
"""How long a model's ``:last`` key outlives its last write: a day of silence reads as never."""

# Shared by both scripts: refresh the worker's TTL, registry score and the model's last-event
# time; returns 1 when either of the worker's SETs exists. KEYS[1]: the worker's working-pool
# SET, KEYS[2]: the model's worker registry, KEYS[3]: the model's last-event time, KEYS[4]: the
# worker's second-tier SET.
_TOUCH_LUA = f"""
local function touch(worker, ttl)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local exists = math.max(redis.call('PEXPIRE', KEYS[1], ttl), redis.call('PEXPIRE', KEYS[4], ttl))
  if exists == 1 then
    redis.call('ZADD', KEYS[2], now, worker)
  else
    redis.call('ZREM', KEYS[2], worker)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  redis.call('SET', KEYS[3], now, 'PX', {LAST_EVENT_TTL_MS})
  return exists
end
"""

# ARGV[1]: worker id, ARGV[2]: TTL in ms. Returns 1 when the worker had an entry (now
# refreshed), else 0.
_HEARTBEAT_LUA = _TOUCH_LUA + """
return touch(ARGV[1], tonumber(ARGV[2]))
"""

# ARGV[1]: msgpack batch (raw format), ARGV[2]: TTL in ms, ARGV[3]: digest size in bytes,
# ARGV[4]: worker id. Validates the whole batch before the first write, so a bad batch leaves
# the SET as it was. Returns 1 when the worker had an entry before the batch, else 0.
_APPLY_LUA = _TOUCH_LUA + """
local function is_array(t)
  if type(t) ~= 'table' then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end
local function bad(msg) return redis.error_reply('BADBATCH ' .. msg) end
local function count(...) return select('#', ...), {...} end

local n, decoded = count(pcall(cmsgpack.unpack, ARGV[1]))
if not decoded[1] then return bad('undecodable msgpack: ' .. tostring(decoded[2])) end
if n ~= 2 then return bad('expected exactly one msgpack object, got ' .. (n - 1)) end
local batch, size = decoded[2], tonumber(ARGV[3])
if not is_array(batch) then return bad('batch is not an array') end
for i = 1, #batch do
  local row = batch[i]
  if not is_array(row) or #row ~= 3 then
    return bad('event ' .. i .. ' is not [kind, digests, medium]')
  end
  local kind, digests, medium = row[1], row[2], row[3]
  if kind ~= 'stored' and kind ~= 'removed' and kind ~= 'cleared' then
    return bad('event ' .. i .. ' has an unknown kind')
  end
  if medium ~= 'pool' and medium ~= 'tier' then
    return bad('event ' .. i .. ' has an unknown medium')
  end
  if not is_array(digests) then return bad('event ' .. i .. ' digests is not an array') end
  for j = 1, #digests do
    if type(digests[j]) ~= 'string' or #digests[j] ~= size then
      return bad('event ' .. i .. ' digest ' .. j .. ' is not ' .. size .. ' bytes')
    end
  end
end

local chunk = 1000  -- chunked: Lua's unpack() is limited to a few thousand values
local existed = math.min(1, redis.call('EXISTS', KEYS[1], KEYS[4]))
for i = 1, #batch do
  local kind, digests = batch[i][1], batch[i][2]
  if kind == 'cleared' then
    redis.call('DEL', KEYS[1], KEYS[4])
  else
    local key = (batch[i][3] == 'tier') and KEYS[4] or KEYS[1]
    local command = (kind == 'stored') and 'SADD' or 'SREM'
    for first = 1, #digests, chunk do
      redis.call(command, key, unpack(digests, first, math.min(first + chunk - 1, #digests)))
    end
  end
end
touch(ARGV[4], tonumber(ARGV[2]))
return existed
"""


# KEYS: each worker's pool SET, then its tier SET; ARGV: the chain's digests. Returns
# {blocks, tier_blocks} per worker: the leading run held in either SET, and of it the blocks only
# in the tier. Chunked: Lua's unpack() is limited to a few thousand values.
_MATCH_LUA = """
local chunk, result = 256, {}
for w = 1, #KEYS, 2 do
  local blocks, tier_blocks, missed = 0, 0, false
  for first = 1, #ARGV, chunk do
    local last = math.min(first + chunk - 1, #ARGV)
    local pool = redis.call('SMISMEMBER', KEYS[w], unpack(ARGV, first, last))
    local tier = redis.call('SMISMEMBER', KEYS[w + 1], unpack(ARGV, first, last))
    for i = 1, last - first + 1 do
      if pool[i] == 0 and tier[i] == 0 then missed = true; break end
      blocks = blocks + 1
      if pool[i] == 0 then tier_blocks = tier_blocks + 1 end
    end
    if missed then break end
  end
  result[#result + 1] = {blocks, tier_blocks}
end
return result
"""


class RedisIndex(DigestIndex):
    """The Redis backend, shared by every process that uses the same URL and key prefix.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        key_prefix: per-cluster prefix of every key (tests use a unique one per run).
        worker_ttl_s: seconds a worker's SET lives after its last publish or heartbeat.
        timeout_s: socket connect and read timeout in seconds, so a stopped Redis fails a call
            fast (:class:`IndexUnavailableError`) instead of stalling routing.

    Raises:
        ValueError: empty ``key_prefix`` or non-positive ``worker_ttl_s``.
    """

    def __init__(
        self, url: str, key_prefix: str, worker_ttl_s: float = 30.0, timeout_s: float = 1.0
    ) -> None:
        if not key_prefix:
            raise ValueError("key_prefix must be non-empty")
        if not worker_ttl_s > 0:
            raise ValueError(f"worker_ttl_s must be positive, got {worker_ttl_s}")
        self._prefix = key_prefix
        self._ttl_ms = max(1, round(worker_ttl_s * 1000))
        # One quick retry, on a lost connection only, replaces a pooled connection that died
        # while Redis restarted; the library's default (several retries with seconds of
        # backoff) would stall the router, and a timeout retried would double the stall. It
        # must be redis.asyncio's Retry: the synchronous one "retries" by returning the
        # coroutine, so a dead connection failed the first call after every restart.
        self._client = aioredis.from_url(
            url,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._apply_script = self._client.register_script(_APPLY_LUA)
        self._heartbeat_script = self._client.register_script(_HEARTBEAT_LUA)
        self._match_script = self._client.register_script(_MATCH_LUA)

    def worker_key(self, model_key: str, worker_id: str, medium: Medium = "pool") -> str:
        """Redis key of a worker's digest SET for ``medium``."""
        return f"{self._prefix}:{model_key}:{_MEDIUM_TAGS[medium]}:{worker_id}"

    def _model_keys(self, model_key: str, worker_id: str) -> list[str]:
        """KEYS of both scripts: the worker's pool SET, the model's registry and last-event
        time, the worker's tier SET."""
        model = f"{self._prefix}:{model_key}"
        return [self.worker_key(model_key, worker_id), f"{model}:workers", f"{model}:last",
                self.worker_key(model_key, worker_id, "tier")]

    async def publish(self, model_key: str, worker_id: str, payload: bytes) -> bool:
        """See :meth:`DigestIndex.publish`. Raises ValueError on a malformed payload."""
        events = decode_batch(payload)
        raw = msgpack.packb([[e.kind, e.digests, e.medium] for e in events], use_bin_type=False)
        return await self._apply(model_key, worker_id, raw)

    async def heartbeat(self, model_key: str, worker_id: str) -> bool:
        """See :meth:`DigestIndex.heartbeat` (PEXPIRE; a missing key stays missing)."""
        async with _redis_errors():
            existed = await self._heartbeat_script(
                keys=self._model_keys(model_key, worker_id), args=[worker_id, self._ttl_ms])
        return existed == 1

    async def match(
        self, model_key: str, digests: list[bytes], worker_ids: list[str]
    ) -> dict[str, HeldPrefix]:
        """See :meth:`DigestIndex.match`: one script call for all workers."""
        if not digests or not worker_ids:  # SMISMEMBER needs at least one member
            return dict.fromkeys(worker_ids, HeldPrefix(0))
        keys = [self.worker_key(model_key, worker_id, medium)
                for worker_id in worker_ids for medium in MEDIA]
        async with _redis_errors():
            replies = await self._match_script(keys=keys, args=digests)
        return {worker_id: HeldPrefix(int(blocks), int(tier_blocks))
                for worker_id, (blocks, tier_blocks) in zip(worker_ids, replies, strict=True)}

    async def stats(self, model_key: str) -> IndexStats:
        """See :meth:`DigestIndex.stats`: two round trips, the second one SCARD per worker."""
        _, registry, last, _ = self._model_keys(model_key, "")
        async with _redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.time()
            pipe.get(last)
            pipe.zrange(registry, 0, -1)
            (seconds, micros), last_ms, workers = await pipe.execute()
            pipe = self._client.pipeline(transaction=False)
            for worker in workers:
                for medium in MEDIA:
                    pipe.scard(self.worker_key(model_key, worker.decode(), medium))
            sizes = await pipe.execute()
        pool, tier = sizes[0::2], sizes[1::2]
        live = sum(1 for held in zip(pool, tier, strict=True) if any(held))
        age = None if last_ms is None else max(0.0, seconds + micros / 1e6 - int(last_ms) / 1000)
        return IndexStats("redis", live, sum(pool), age, sum(tier))

    async def forget(self, model_key: str, worker_id: str) -> None:
        """See :meth:`DigestIndex.forget`."""
        pool, registry, _, tier = self._model_keys(model_key, worker_id)
        async with _redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(pool, tier)
            pipe.zrem(registry, worker_id)
            await pipe.execute()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def _apply(self, model_key: str, worker_id: str, raw_batch: bytes) -> bool:
        """Run the apply script on a raw-format msgpack batch (validated again in Lua);
        returns whether the worker had an entry before it.

        Raises:
            ValueError: the script rejected the batch; nothing was written.
        """
        async with _redis_errors():
            existed = await self._apply_script(
                keys=self._model_keys(model_key, worker_id),
                args=[raw_batch, self._ttl_ms, DIGEST_SIZE, worker_id])
        return existed == 1


@contextlib.asynccontextmanager
async def _redis_errors() -> AsyncIterator[None]:
    """Map Redis errors to the index contract: a batch the script rejected is a ValueError;
    anything else (connection refused, timeout, OOM, ...) means the index is unavailable."""
    try:
        yield
    except ResponseError as exc:
        if str(exc).startswith(_BAD_BATCH):
            raise ValueError(f"malformed KV event batch: {exc}") from exc
        raise IndexUnavailableError(f"Redis index error: {exc}") from exc
    except (RedisError, OSError) as exc:
        raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc


def delete_key_prefix(url: str, key_prefix: str) -> int:
    """Deletes every key whose name starts with ``key_prefix`` (one run's own keys, after a test
    or benchmark; nothing else is flushed) and returns how many went.

    ``key_prefix`` should hold no glob characters (``*?[``): it is used as a SCAN pattern.

    Raises:
        redis.exceptions.RedisError: the server could not be reached or refused a command.
    """
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{key_prefix}*", count=1000))
        return client.delete(*keys) if keys else 0
    finally:
        client.close()
