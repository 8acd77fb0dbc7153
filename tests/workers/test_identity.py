"""The identity contract: chained block digests, namespaces, keyed tenants, model keys."""

from __future__ import annotations

import hashlib
import hmac
import itertools

import numpy as np
import pytest

from contract.identity import (
    ANONYMOUS_TENANT,
    AdapterRef,
    CacheIdentity,
    CacheNamespace,
    block_digest,
    block_digests,
    tenant_from_api_key,
)

BLOCK = 4
SECRET = b"cluster-secret"


def identity(**changes) -> CacheIdentity:
    fields = {"model_digest": "ab" * 32, "numerics": "cpu:cpu|attn=nalar_paged",
              "block_size": BLOCK}
    fields.update(changes)
    return CacheIdentity(**fields)


def test_block_digest_is_sha256_of_parent_and_little_endian_uint32_tokens():
    parent = bytes(range(32))
    expected = hashlib.sha256(parent + np.array([1, 2, 70000], dtype="<u4").tobytes()).digest()
    assert block_digest(parent, [1, 2, 70000]) == expected
    assert len(expected) == 32


def test_block_digests_chain_from_the_root_and_skip_the_partial_tail():
    root = identity().root_digest
    tokens = list(range(10, 21))  # 11 tokens: two full blocks of 4, a partial tail of 3
    digests = block_digests(root, tokens, BLOCK)
    first = block_digest(root, tokens[0:4])
    second = block_digest(first, tokens[4:8])
    assert digests == [first, second]
    assert block_digests(root, tokens[:3], BLOCK) == []


def test_digest_i_depends_on_every_earlier_token():
    root = identity().root_digest
    tokens = list(range(100, 116))  # four full blocks
    reference = block_digests(root, tokens, BLOCK)
    for position in range(len(tokens)):
        changed = list(tokens)
        changed[position] += 1
        digests = block_digests(root, changed, BLOCK)
        changed_block = position // BLOCK
        # blocks before the change keep their digest, the changed block and all later differ
        assert digests[:changed_block] == reference[:changed_block]
        assert all(a != b for a, b in zip(digests[changed_block:], reference[changed_block:],
                                          strict=True))


def test_same_block_tokens_at_another_position_get_another_digest():
    root = identity().root_digest
    block = [7, 7, 7, 7]
    digests = block_digests(root, block * 3, BLOCK)
    assert len(set(digests)) == 3


def test_root_digest_changes_with_every_identity_field():
    base = identity()
    variants = [
        identity(model_digest="cd" * 32),
        identity(numerics="cuda:H100|attn=nalar_paged"),
        identity(block_size=BLOCK * 2),
        identity(namespace=CacheNamespace("tenant-b")),
        identity(namespace=CacheNamespace(ANONYMOUS_TENANT, "salt")),
    ]
    adapters = [AdapterRef("lora-a", "11" * 32),
                AdapterRef("lora-a", "22" * 32)]  # same name, other weights
    roots = ([base.root_digest] + [v.root_digest for v in variants]
             + [base.root_for(CacheNamespace(), adapter) for adapter in adapters])
    assert len(set(roots)) == len(roots)


def test_an_adapter_enters_the_root_by_content_never_by_name():
    base = identity()
    namespace = CacheNamespace("tenant-a")
    same_content = {base.root_for(namespace, AdapterRef(name, "11" * 32))
                    for name in ("lora-a", "renamed", "")}
    assert len(same_content) == 1
    assert base.root_for(namespace, AdapterRef("lora-a", "11" * 32)) != base.root_for(namespace)
    assert base.model_key == identity().model_key  # one worker serves every adapter


def test_adapter_tenant_and_salt_fields_cannot_imitate_each_other():
    base = identity()
    digest = "ab" * 32
    roots = [
        base.root_for(CacheNamespace("t", "s"), AdapterRef("x", digest)),
        base.root_for(CacheNamespace("t", "s"), None),
        base.root_for(CacheNamespace("t", "s"), AdapterRef("x", "")),
        base.root_for(CacheNamespace(digest + "t", "s"), None),
        base.root_for(CacheNamespace("1" + digest + "t", "s"), None),
        base.root_for(CacheNamespace("t", digest + "s"), None),
        base.root_for(CacheNamespace("t", None), AdapterRef("x", digest + "s")),
        base.root_for(CacheNamespace("", "s"), AdapterRef("x", digest + "t")),
    ]
    assert len(set(roots)) == len(roots)


def test_tenant_and_salt_cannot_imitate_each_other():
    splits = [
        CacheNamespace("a", "b"),
        CacheNamespace("ab", None),
        CacheNamespace("ab", ""),
        CacheNamespace("", "ab"),
        CacheNamespace("a", None),
        CacheNamespace("a", ""),
        CacheNamespace("a1", "b"),
        CacheNamespace("a", "1b"),
        CacheNamespace("asalt", "b"),
        CacheNamespace("a", "saltb"),
        CacheNamespace("a\x00", "b"),
        CacheNamespace("a", "\x00b"),
        CacheNamespace("b", "a"),
    ]
    roots = [identity(namespace=namespace).root_digest for namespace in splits]
    assert len(set(roots)) == len(splits)
    assert identity(namespace=CacheNamespace("a", "b")).root_digest == roots[0]  # deterministic


def test_no_salt_differs_from_empty_salt_and_from_the_anonymous_tenant():
    roots = {identity(namespace=n).root_digest for n in (
        CacheNamespace(), CacheNamespace(ANONYMOUS_TENANT, ""), CacheNamespace("", None))}
    assert len(roots) == 3


def test_model_key_excludes_the_namespace_but_root_digest_includes_it():
    base = identity()
    scoped = [base.with_namespace(CacheNamespace(t, s))
              for t, s in itertools.product(["x", "y"], [None, "s"])]
    assert {s.model_key for s in scoped} == {base.model_key}
    assert len({s.root_digest for s in scoped} | {base.root_digest}) == 5
    assert scoped[0].namespace == CacheNamespace("x", None)
    assert (scoped[0].model_digest, scoped[0].numerics, scoped[0].block_size) == (
        base.model_digest, base.numerics, base.block_size)


def test_model_key_covers_weights_numerics_and_block_size():
    keys = {identity().model_key, identity(model_digest="00" * 32).model_key,
            identity(numerics="other").model_key, identity(block_size=32).model_key}
    assert len(keys) == 4
    assert identity().model_key == identity().model_key  # deterministic


def test_tenant_from_api_key_is_a_keyed_hash_never_the_raw_key():
    key = "sk-live-0123456789"
    tenant = tenant_from_api_key(key, SECRET)
    assert tenant == hmac.new(SECRET, key.encode(), hashlib.sha256).hexdigest()
    assert key not in tenant
    assert tenant != hashlib.sha256(key.encode()).hexdigest()  # not recomputable without secret
    assert tenant_from_api_key(key, b"another-secret") != tenant
    assert tenant_from_api_key("sk-live-0123456788", SECRET) != tenant
    assert len(tenant) == 64


@pytest.mark.parametrize("key", [None, ""])
def test_missing_key_is_the_anonymous_tenant(key):
    assert tenant_from_api_key(key, SECRET) == ANONYMOUS_TENANT


def test_p3_identity_level_reuse_only_as_far_as_token_ids_agree():
    """P3: one visible text, two token splits: digests agree only over identical leading blocks."""
    root = identity().root_digest
    whole = [11, 12, 13, 14, 15, 16, 17, 18, 500, 19, 20, 21]  # 500 spells, say, " cat"
    split = [11, 12, 13, 14, 15, 16, 17, 18, 501, 502, 503, 19, 20, 21]  # " ", "c", "a", ...
    a = block_digests(root, whole, BLOCK)
    b = block_digests(root, split, BLOCK)
    assert a[:2] == b[:2]  # tokens 0..7 agree
    assert a[2] != b[2]
    assert not set(a[2:]) & set(b[2:])
