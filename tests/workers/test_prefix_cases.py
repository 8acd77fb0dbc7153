"""Acceptance cases P1–P8 (``shared/cases/prefix.md``) at the engine level.

P1–P3 run SmolLM2-135M (fp32), P4–P8 the tiny random Qwen2. A hit is proved by the engine's
prefilled-token counter and the request's ``cached_tokens``; a "cold" run is the same request
served on an empty cache.
"""

from __future__ import annotations

import re

import pytest
from helpers import cold, greedy, output_ids, random_prompt, serve

import workers.scheduler
import workers.sequence
from contract.identity import CacheNamespace, block_digest, block_digests, tenant_from_api_key
from contract.kv_events import KVEvent
from contract.request import GenerationRequest, SamplingParams

BLOCK = 16

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg, a goldsmith from Mainz, combined movable metal type, oil-based inks and a "
        "wooden screw press into a system that could produce books quickly and cheaply. Within "
        "fifty years, printing shops had spread to more than two hundred cities across Europe, "
        "and")


def stored_digests(events: list[KVEvent]) -> set[bytes]:
    return {d for event in events if event.kind == "stored" for d in event.digests}


# ---- P1–P3: SmolLM2 ------------------------------------------------------------------------


def test_p1_positions_after_a_hit(smollm, make_engine):
    tokens = smollm.tokenizer.encode(TEXT, add_special_tokens=False)
    prefix, question = tokens[:3 * BLOCK], tokens[3 * BLOCK:3 * BLOCK + 10]
    assert (len(prefix), len(question)) == (48, 10)
    engine = make_engine(smollm, num_blocks=32)
    reference = cold(engine, greedy("cold", prefix + question, ignore_eos=False))

    engine.reset_prefix_cache()
    serve(engine, greedy("p", prefix, max_tokens=4, ignore_eos=False))
    out, cached, prefilled = serve(engine, greedy("pq", prefix + question, ignore_eos=False))
    assert cached == 3 * BLOCK
    assert prefilled == len(question)  # only Q was computed; P's KV came from the cache
    assert out == reference


def test_p2_whole_prompt_cached_still_computes_its_last_token(smollm, make_engine):
    tokens = smollm.tokenizer.encode(TEXT, add_special_tokens=False)
    engine = make_engine(smollm, num_blocks=32)
    for blocks in (2, 3):
        prompt = tokens[:blocks * BLOCK]  # an exact multiple of the block size
        reference = cold(engine, greedy(f"cold-{blocks}", prompt, ignore_eos=False))
        out, cached, prefilled = serve(engine, greedy(f"again-{blocks}", prompt, ignore_eos=False))
        # the last block holds the last token, which must be recomputed for its logits
        assert cached == (blocks - 1) * BLOCK
        assert cached <= len(prompt) - 1
        assert prefilled == BLOCK
        assert out[0] == reference[0]
        assert out == reference


def test_p3_same_text_other_token_ids_reuse_only_the_agreeing_blocks(smollm, make_engine):
    tokenizer = smollm.tokenizer
    whole = tokenizer.encode(TEXT, add_special_tokens=False)[:40]
    split_at = 20  # inside block 1: blocks 0 agree, block 1 onwards differ
    word = tokenizer.convert_ids_to_tokens(whole[split_at])
    letters = tokenizer.convert_tokens_to_ids(list(word))
    assert len(letters) >= 3 and tokenizer.unk_token_id not in letters
    spelled = whole[:split_at] + letters + whole[split_at + 1:]
    assert tokenizer.decode(spelled) == tokenizer.decode(whole)  # the same visible text
    assert spelled != whole

    engine = make_engine(smollm, num_blocks=32)
    cold_whole = cold(engine, greedy("cold-whole", whole, ignore_eos=False))
    cold_spelled = cold(engine, greedy("cold-spelled", spelled, ignore_eos=False))

    engine.reset_prefix_cache()
    assert serve(engine, greedy("whole", whole, ignore_eos=False)) == (cold_whole, 0, len(whole))
    out, cached, prefilled = serve(engine, greedy("spelled", spelled, ignore_eos=False))
    assert cached == split_at // BLOCK * BLOCK == BLOCK  # only block 0's ids agree
    assert prefilled == len(spelled) - BLOCK
    assert out == cold_spelled
    # and the other way round: the whole-word ids are now cached, the spelled ones partly
    out, cached, _ = serve(engine, greedy("whole-again", whole, ignore_eos=False))
    assert (out, cached) == (cold_whole, (len(whole) - 1) // BLOCK * BLOCK)


# ---- P4–P8: the tiny Qwen2 ----------------------------------------------------------------


def test_p4_model_numerics_are_identity(tiny_qwen, tiny_qwen_bf16, make_engine):
    prompt = random_prompt(4, 3 * BLOCK + 5)
    fp32 = make_engine(tiny_qwen, num_blocks=16)
    bf16 = make_engine(tiny_qwen_bf16, num_blocks=16)
    assert tiny_qwen.model_digest != tiny_qwen_bf16.model_digest
    # only the dtype differs here (and, with it, possibly the kernels chosen for it)
    kernels = r"\|(linear|decode|norm)=[^|]*"
    assert (re.sub(kernels, "", fp32.identity.numerics)
            == re.sub(kernels, "", bf16.identity.numerics))
    assert fp32.identity.model_key != bf16.identity.model_key
    assert fp32.identity.root_digest != bf16.identity.root_digest

    for engine in (fp32, bf16):
        serve(engine, greedy("p", prompt, ignore_eos=False))
    fp32_digests = stored_digests(fp32.drain_events())
    bf16_digests = stored_digests(bf16.drain_events())
    assert fp32_digests >= set(block_digests(fp32.identity.root_digest, prompt, BLOCK))
    assert bf16_digests >= set(block_digests(bf16.identity.root_digest, prompt, BLOCK))
    assert len(fp32_digests) == len(bf16_digests) == 3
    assert not fp32_digests & bf16_digests  # the index can never credit one with the other's

    # neither engine finds the other's prefix, even for the very same tokens
    probe = workers.sequence.Sequence(greedy("probe", prompt, ignore_eos=False),
                                      fp32.identity.root_digest, BLOCK)
    assert bf16.block_manager.cached_prefix(probe) == []
    assert len(fp32.block_manager.cached_prefix(probe)) == 3
    # control: a second fp32 engine over the same weights computes the same digests
    twin = make_engine(tiny_qwen, num_blocks=16)
    assert twin.identity == fp32.identity
    serve(twin, greedy("p", prompt, ignore_eos=False))
    assert stored_digests(twin.drain_events()) == fp32_digests


def test_p5_tenant_isolation(tiny_qwen, make_engine):
    secret = b"cluster-secret"
    tenant_a = tenant_from_api_key("sk-tenant-a", secret)
    tenant_b = tenant_from_api_key("sk-tenant-b", secret)
    prompt = random_prompt(5, 3 * BLOCK + 7)
    full_hit = 3 * BLOCK
    engine = make_engine(tiny_qwen, num_blocks=64)

    def serve_as(request_id: str, namespace: CacheNamespace):
        result = serve(engine, greedy(request_id, prompt, namespace=namespace, ignore_eos=False))
        return result, stored_digests(engine.drain_events())

    (out_a, cached, prefilled), digests_a = serve_as("a", CacheNamespace(tenant_a))
    assert (cached, prefilled, len(digests_a)) == (0, len(prompt), 3)
    (out_b, cached, prefilled), digests_b = serve_as("b", CacheNamespace(tenant_b))
    assert (cached, prefilled) == (0, len(prompt))  # B really prefilled all of P
    assert out_b == out_a
    assert len(digests_b) == 3 and not digests_a & digests_b
    # control: A itself does hit
    (out, cached, prefilled), _ = serve_as("a-again", CacheNamespace(tenant_a))
    assert (out, cached, prefilled) == (out_a, full_hit, len(prompt) - full_hit)

    # two cache salts under one key
    (out_s1, cached, prefilled), digests_s1 = serve_as("s1", CacheNamespace(tenant_a, "salt-1"))
    assert (out_s1, cached, prefilled) == (out_a, 0, len(prompt))
    (out_s2, cached, prefilled), digests_s2 = serve_as("s2", CacheNamespace(tenant_a, "salt-2"))
    assert (out_s2, cached, prefilled) == (out_a, 0, len(prompt))
    assert len(digests_s1) == len(digests_s2) == 3
    assert not digests_s1 & digests_s2 and not (digests_s1 | digests_s2) & digests_a
    (_, cached, _), _ = serve_as("s1-again", CacheNamespace(tenant_a, "salt-1"))
    assert cached == full_hit
    assert engine.scheduler.counters.prefix_hit_tokens == 2 * full_hit


def test_p6_digest_collision_is_refused(tiny_qwen, make_engine, monkeypatch):
    p_block, q_block, shared_block, tail = (random_prompt(60 + i, BLOCK) for i in range(4))
    first = p_block + tail[:8]
    second = q_block + shared_block + tail[:5]  # block 0 collides with first's block 0
    third = p_block + shared_block + tail[:9]  # first's block 0, then second's block 1
    engine = make_engine(tiny_qwen, num_blocks=32)
    references = {name: cold(engine, greedy(f"cold-{name}", prompt, ignore_eos=False))
                  for name, prompt in (("second", second), ("third", third))}

    def colliding(parent: bytes, token_ids) -> bytes:
        if list(token_ids) == q_block:
            token_ids = p_block
        return block_digest(parent, token_ids)

    monkeypatch.setattr(workers.sequence, "block_digest", colliding)
    engine.reset_prefix_cache()
    engine.drain_events()
    serve(engine, greedy("first", first, ignore_eos=False))
    (collided,) = stored_digests(engine.drain_events())
    out, cached, prefilled = serve(engine, greedy("second", second, ignore_eos=False))
    assert engine.sequence("second") is None
    assert (out, cached, prefilled) == (references["second"], 0, len(second))  # refused
    # the colliding block was never published, nor anything computed after it
    assert stored_digests(engine.drain_events()) == set()
    root = engine.identity.with_namespace(CacheNamespace()).root_digest
    assert engine.pool.lookup(collided, p_block, root) is not None

    # a third request that matches the first's block 0 and the second's block 1 may reuse
    # block 0 only: the second's block 1 was computed after other tokens
    out, cached, prefilled = serve(engine, greedy("third", third, ignore_eos=False))
    assert (out, cached, prefilled) == (references["third"], BLOCK, len(third) - BLOCK)


def test_p6_chain_collision_after_other_tokens_is_refused(tiny_qwen, make_engine, monkeypatch):
    """Block 1 holds the same tokens in two contexts whose block 0 differ, and the two block 1
    digests collide: the cached block 1 was computed after the other block 0, so its stored
    parent digest refuses the hit."""
    p_block, q_block, shared, tail = (random_prompt(64 + i, BLOCK) for i in range(4))
    first = p_block + shared + tail[:3]
    other = q_block + tail[:5]  # caches q_block as the block 0 of another context
    victim = q_block + shared + tail[:6]
    engine = make_engine(tiny_qwen, num_blocks=32)
    reference = cold(engine, greedy("cold", victim, ignore_eos=False))
    root = engine.identity.with_namespace(CacheNamespace()).root_digest
    after_p, after_q = block_digest(root, p_block), block_digest(root, q_block)

    def chain_collision(parent: bytes, token_ids) -> bytes:
        return block_digest(after_p if parent == after_q else parent, token_ids)

    monkeypatch.setattr(workers.sequence, "block_digest", chain_collision)
    engine.reset_prefix_cache()
    serve(engine, greedy("first", first, ignore_eos=False))
    serve(engine, greedy("other", other, ignore_eos=False))
    engine.drain_events()
    out, cached, prefilled = serve(engine, greedy("victim", victim, ignore_eos=False))
    assert (out, cached, prefilled) == (reference, BLOCK, len(victim) - BLOCK)  # block 0 only
    # the victim's own block 1 collides with the first's: it stays private
    assert stored_digests(engine.drain_events()) == set()


def evict(pool, digest: bytes) -> None:
    """Take blocks from the pool (free ones first, then least recently used) until
    ``digest`` is no longer cached, then give them back."""
    taken = []
    while digest in pool.cached_digests():
        taken.append(pool.allocate().block_id)
    pool.release(taken)


def computed_twice(engine, p_block: list[int], shared: list[int], tail: list[int]) -> bytes:
    """Serve two requests that compute ``p_block`` in the same step: the shorter one's copy
    becomes the cached block 0, the longer one's stays private, and the longer one's
    ``shared`` block, computed after its private copy, becomes the cached block 1.

    The scheduler would make the longer prompt wait for the shorter one's block 0, so its wait
    is switched off here; two sequences decoding the same tokens (``n`` greedy choices) still
    compute a block twice at once.

    Returns the digest of that block 1.
    """
    root = engine.identity.with_namespace(CacheNamespace()).root_digest
    after_p = block_digest(root, p_block)
    shared_after_p = block_digest(after_p, shared)
    engine.reset_prefix_cache()
    engine.drain_events()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workers.scheduler, "_next_block", lambda seq, num_hits: None)
        chunks = engine.generate([
            greedy("short", p_block + tail[:3], max_tokens=2, ignore_eos=False),
            greedy("long", p_block + shared + tail[:5], ignore_eos=False)])
    assert [c.cached_tokens for c in chunks["long"]][-1] == 0  # computed at once, not reused
    assert stored_digests(engine.drain_events()) == {after_p, shared_after_p}
    return shared_after_p


def test_p6_blocks_computed_twice_at_once_are_still_reused(tiny_qwen, make_engine):
    """The parent checks cost no reuse: a block 1 computed after a private duplicate of the
    cached block 0 is found through that cached block 0."""
    p_block, shared, tail = (random_prompt(72 + i, BLOCK) for i in range(3))
    probe = p_block + shared + tail[:7]
    engine = make_engine(tiny_qwen, num_blocks=32)
    reference = cold(engine, greedy("cold", probe, ignore_eos=False))
    computed_twice(engine, p_block, shared, tail)
    out, cached, prefilled = serve(engine, greedy("probe", probe, ignore_eos=False))
    assert (out, cached, prefilled) == (reference, 2 * BLOCK, len(probe) - 2 * BLOCK)


def test_p6_collision_at_a_replaced_parent_is_refused(tiny_qwen, make_engine, monkeypatch):
    """The deeper case: the cached block 1 was computed after a private copy of block 0; the
    cached block 0 is evicted, and a colliding block 0 (other tokens, same digest) takes its
    digest. Block 1's parent digest still matches, but its parent copy is gone: no hit."""
    p_block, q_block, shared, tail = (random_prompt(68 + i, BLOCK) for i in range(4))
    collider = q_block + tail[:4]
    victim = q_block + shared + tail[:6]
    again = q_block + shared + tail[:7]
    engine = make_engine(tiny_qwen, num_blocks=32)
    references = {name: cold(engine, greedy(f"cold-{name}", prompt, ignore_eos=False))
                  for name, prompt in (("victim", victim), ("again", again))}

    def colliding(parent: bytes, token_ids) -> bytes:
        return block_digest(parent, p_block if list(token_ids) == q_block else token_ids)

    monkeypatch.setattr(workers.sequence, "block_digest", colliding)
    shared_after_p = computed_twice(engine, p_block, shared, tail)
    collided = block_digest(engine.identity.with_namespace(CacheNamespace()).root_digest,
                            p_block)
    evict(engine.pool, collided)
    assert engine.pool.cached_digests() == [shared_after_p]  # block 1 outlived its parent
    # q_block is cached under p_block's digest
    serve(engine, greedy("collider", collider, ignore_eos=False))
    assert set(engine.pool.cached_digests()) == {collided, shared_after_p}

    out, cached, prefilled = serve(engine, greedy("victim", victim, ignore_eos=False))
    assert (out, cached, prefilled) == (references["victim"], BLOCK, len(victim) - BLOCK)
    # the victim's own block 1 replaced the unreachable one, and is found from now on
    out, cached, prefilled = serve(engine, greedy("again", again, ignore_eos=False))
    assert (out, cached, prefilled) == (references["again"], 2 * BLOCK, len(again) - 2 * BLOCK)
    engine.pool.check_invariants()


def test_p7_honest_hit_accounting_under_pressure(tiny_qwen, make_engine):
    lengths = [20 + (7 * i) % 41 for i in range(40)]  # 20 .. 60 tokens
    prompts = [random_prompt(700 + i, n) for i, n in enumerate(lengths)]
    assert len({tuple(p[:BLOCK]) for p in prompts}) == 40  # no two share a block
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def requests():
        return [GenerationRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]

    roomy = make_engine(tiny_qwen, num_blocks=256)
    references = roomy.generate(requests())
    assert roomy.scheduler.counters.preemptions == 0

    engine = make_engine(tiny_qwen, num_blocks=32)
    chunks = engine.generate(requests())
    counters = engine.scheduler.counters
    assert counters.preemptions > 0  # the pool really ran out
    for i in range(40):
        outputs = chunks[f"r{i}"]
        assert outputs[-1].finish_reason == "length"
        assert output_ids(outputs) == output_ids(references[f"r{i}"]), f"request {i}"
        assert all(c.cached_tokens == 0 for c in outputs)
    # each request was looked up once; waiting and recomputation are never hits
    assert counters.prefix_query_tokens == sum(lengths)
    assert counters.prefix_hit_tokens == 0
    assert engine.counters.prefill_tokens >= sum(lengths)
    assert engine.pool.num_in_use == 0
    assert engine.pool.num_free + engine.pool.num_evictable == 32


def test_p8_block_accounting_at_rest(tiny_qwen, make_engine):
    shared = random_prompt(80, 40)
    prompts = [shared + random_prompt(800 + i, 3 + 5 * i) for i in range(10)]
    prompts += [shared[:BLOCK * 2], shared, prompts[3], prompts[3]]  # exact repeats too
    engine = make_engine(tiny_qwen, num_blocks=48, max_num_seqs=5)
    live: set[bytes] = set()

    def track(events: list[KVEvent]) -> None:
        for event in events:
            if event.kind == "stored":
                assert not live & set(event.digests)  # never stored twice
                live.update(event.digests)
            elif event.kind == "removed":
                assert set(event.digests) <= live
                live.difference_update(event.digests)

    requests = [greedy(f"burst-{i}", p, max_tokens=6 + i % 5, ignore_eos=False)
                for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
        track(engine.drain_events())
        pool = engine.pool
        assert pool.num_free + pool.num_evictable + pool.num_in_use == pool.num_blocks

    pool = engine.pool
    assert engine.scheduler.counters.prefix_hit_tokens > 0  # the burst did share prefixes
    assert pool.num_in_use == 0
    assert pool.num_free + pool.num_evictable == pool.num_blocks == 48
    assert all(block.ref_count == 0 for block in pool.blocks)
    cached = [block for block in pool.blocks if pool.is_evictable(block)]
    assert all(block.digest is not None for block in cached)
    assert all(block.digest is None for block in pool.blocks if not pool.is_evictable(block))
    assert {block.digest for block in cached} == live  # the index view equals the pool
    assert all(engine.sequence(r.request_id) is None for r in requests)
    assert engine.load_by_request() == {}
