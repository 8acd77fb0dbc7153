"""The identity contract of cached KV state.

A KV block is reusable only when the state it holds is exactly what a new request would compute:
same token ids at the same positions, same weights and numerics, same adapter, and an access
scope that allows sharing (see ``shared/seeds``). Every one of those inputs is folded into a
root digest; block digests chain from it, in the manner of vLLM v1's prefix-cache block hashes
(``vllm/v1/core/kv_cache_utils.py``), so a block digest names a whole prefix at fixed positions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_SIZE = 32
"""Bytes in one block digest (sha256)."""

ANONYMOUS_TENANT = "anonymous"


@dataclass(frozen=True)
class AdapterRef:
    """A weight adapter (e.g. LoRA) applied on top of the base model.

    Attributes:
        adapter_id: the name requests use to select it.
        weights_digest: hex sha256 of the adapter's weight content and of the config that
            changes what it computes (``workers.lora.adapter``). Block digests chain from it,
            never from the name: one name reloaded with other weights gets other digests, and
            two names of one content share KV, as they compute the same.
        source: the directory a worker that does not hold it reads it from (empty: none);
            not part of the identity.
    """

    adapter_id: str
    weights_digest: str
    source: str = ""


def adapter_name_fault(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None where it can: a name with surrounding
    whitespace or a control character would be listed beside a name it cannot be told from
    (``"m "`` beside the served model ``"m"``)."""
    if name != name.strip():
        return "an adapter name may not begin or end with whitespace"
    if any(not char.isprintable() for char in name.replace(" ", "")):
        return "an adapter name may not hold control characters"
    return None


@dataclass(frozen=True)
class CacheNamespace:
    """Who may share a cached prefix.

    The tenant and the salt are separate typed fields, hashed with a separator and a type tag, so
    no ``cache_salt`` can imitate another tenant's scope.

    Attributes:
        tenant: keyed hash of the API key (see :func:`tenant_from_api_key`), never the raw key.
        cache_salt: optional per-request salt from the request body, narrowing the scope further.
    """

    tenant: str = ANONYMOUS_TENANT
    cache_salt: str | None = None


@dataclass(frozen=True)
class CacheIdentity:
    """Everything besides token ids and positions that determines a KV block's content.

    Attributes:
        model_digest: hex digest of the weights' content and of the config fields that change
            hidden states (architecture, RoPE settings, dtype), see ``workers.model_loader``.
        numerics: tag of what else changes KV values: device type, attention implementation,
            and the versions of the libraries whose kernels compute them.
        block_size: tokens per KV block.
        namespace: the access scope (tenant and cache salt).

    The adapter a request runs under is not part of it: one worker serves the base model and
    many adapters, so the adapter enters each request's root (:meth:`root_for`) next to its
    namespace.
    """

    model_digest: str
    numerics: str
    block_size: int
    namespace: CacheNamespace = CacheNamespace()

    def with_namespace(self, namespace: CacheNamespace) -> CacheIdentity:
        """The same model identity under another access scope."""
        return dataclasses.replace(self, namespace=namespace)

    @functools.cached_property
    def model_key(self) -> str:
        """Hex digest of the identity without its namespace (computed once per instance).

        Workers whose blocks could ever be interchangeable share a model key; the digest index
        groups entries by it. Tenants and adapters are not part of it: their separation lives
        in the chained block digests themselves (see :meth:`root_for`).
        """
        fields = ("model", self.model_digest, self.numerics, str(self.block_size))
        return _hash_fields(fields).hex()

    def root_for(self, namespace: CacheNamespace, adapter: AdapterRef | None = None) -> bytes:
        """The 32-byte digest block 0's digest chains from, for a request in ``namespace``
        running under ``adapter`` (None: the base model). Each field is typed and
        length-prefixed, so no adapter digest, tenant or salt can imitate another's."""
        salt = namespace.cache_salt
        fields = ("root", self.model_key,
                  "adapter", "" if adapter is None else "1" + adapter.weights_digest,
                  "tenant", namespace.tenant, "salt", "" if salt is None else "1" + salt)
        return _hash_fields(fields)

    @property
    def root_digest(self) -> bytes:
        """:meth:`root_for` this identity's own namespace."""
        return self.root_for(self.namespace)


@dataclass(frozen=True)
class PromptDigests:
    """A prompt's chained block digests, as the ingress computed them once for the router and
    the worker.

    Attributes:
        model_key: :attr:`CacheIdentity.model_key` of the identity they chain under, so the
            ingress sees without hashing whether they are current after a redeploy.
        digests: one 32-byte digest per full block of the prompt (:func:`block_digests`).
    """

    model_key: str
    digests: list[bytes]

    def verified(self, root: bytes, token_ids: Sequence[int], block_size: int) -> bool:
        """Whether these are the digests of ``token_ids`` under ``root``, checked as cheaply
        as is sound: one digest per full block, and the first one recomputed.

        Every later digest chains from the first through :func:`block_digest`, so a chain
        made under another model, numerics, adapter or namespace (another root) fails here;
        a block found in the cache under any of them is still checked against its token ids
        and its parent's digest (``workers.block_pool``).
        """
        if len(self.digests) != len(token_ids) // block_size:
            return False
        return not self.digests or self.digests[0] == block_digest(root, token_ids[:block_size])


def _hash_fields(fields: Sequence[str]) -> bytes:
    """sha256 of length-prefixed fields, so no field boundary can be shifted by its content."""
    hasher = hashlib.sha256()
    for field in fields:
        encoded = field.encode()
        hasher.update(len(encoded).to_bytes(8, "little"))
        hasher.update(encoded)
    return hasher.digest()


def block_digest(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    """Digest of one full block: sha256(parent digest ‖ token ids as little-endian uint32).

    Args:
        parent: the previous block's digest, or the identity's root digest for block 0 (32 bytes).
        block_token_ids: exactly one block of token ids.
    """
    tokens = np.asarray(block_token_ids, dtype="<u4").tobytes()
    return hashlib.sha256(parent + tokens).digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained digests of every full block of ``token_ids``.

    Args:
        root: the identity's root digest (:meth:`CacheIdentity.root_for`).
        token_ids: the token sequence, ``len(token_ids) // block_size`` full blocks are hashed;
            a trailing partial block gets no digest.
        block_size: tokens per block.

    Returns:
        One 32-byte digest per full block; digest ``i`` covers tokens ``[0, (i+1)*block_size)``.
    """
    digests: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_digest(parent, token_ids[start:start + block_size])
        digests.append(parent)
    return digests


def tenant_from_api_key(api_key: str | None, secret: bytes) -> str:
    """The tenant scope of an API key: HMAC-SHA256(secret, key), hex.

    A keyed hash, so the namespace reaching Redis or logs reveals nothing about the raw key and
    cannot be recomputed without the cluster's secret. ``None`` or an empty key is the shared
    anonymous tenant.
    """
    if not api_key:
        return ANONYMOUS_TENANT
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


def prompt_digests(identity: CacheIdentity, namespace: CacheNamespace,
                   token_ids: Sequence[int], adapter: AdapterRef | None = None) -> PromptDigests:
    """The block digests of a prompt of ``namespace`` under ``identity``'s model and
    ``adapter`` (None: the base model)."""
    root = identity.root_for(namespace, adapter)
    return PromptDigests(identity.model_key, block_digests(root, token_ids, identity.block_size))
