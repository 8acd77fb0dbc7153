"""The worker hashes a prompt once per process: it takes the digests the ingress computed when
they verify against its own identity, and hashes the prompt itself when they do not.

Hashing is counted by wrapping :func:`contract.identity.block_digest` where the engine reaches
it (the verification in ``contract.identity``, the chain's extension in ``workers.sequence``).
"""

from __future__ import annotations

import pytest
import torch

import contract.identity
import workers.sequence
from contract.identity import CacheNamespace, PromptDigests, block_digests, prompt_digests
from contract.request import GenerationRequest, SamplingParams

BLOCK = 16
PROMPT = torch.randint(3, 1000, (3 * BLOCK + 5,),
                       generator=torch.Generator().manual_seed(11)).tolist()
TENANT = CacheNamespace(tenant="t1")


@pytest.fixture
def hashed(monkeypatch) -> dict[str, int]:
    """Block digests computed, by where: ``verify`` (the check) and ``sequence`` (the chain)."""
    counts = {"verify": 0, "sequence": 0}
    original = contract.identity.block_digest

    def counted(where: str):
        def block_digest(parent: bytes, tokens) -> bytes:
            counts[where] += 1
            return original(parent, tokens)
        return block_digest

    monkeypatch.setattr(contract.identity, "block_digest", counted("verify"))
    monkeypatch.setattr(workers.sequence, "block_digest", counted("sequence"))
    return counts


def request(digests: PromptDigests | None, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest("r", list(PROMPT), SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True), TENANT, digests)


def stored(engine) -> list[bytes]:
    return [d for event in engine.drain_events() if event.kind == "stored"
            for d in event.digests]


def test_verified_ingress_digests_are_used_without_rehashing(tiny_qwen, make_engine, hashed):
    engine = make_engine(tiny_qwen, num_blocks=16)
    digests = prompt_digests(engine.identity, TENANT, PROMPT)
    hashed["verify"] = 0
    engine.generate([request(digests)])
    # One digest recomputed to check them; the prompt's three blocks are never hashed again,
    # and 4 output tokens complete no further block.
    assert hashed == {"verify": 1, "sequence": 0}
    assert stored(engine) == digests.digests
    root = engine.identity.root_for(TENANT)
    assert digests.digests == block_digests(root, PROMPT, BLOCK)


def test_digests_of_another_namespace_are_recomputed(tiny_qwen, make_engine, hashed):
    engine = make_engine(tiny_qwen, num_blocks=16)
    foreign = prompt_digests(engine.identity, CacheNamespace(tenant="t2"), PROMPT)
    engine.generate([request(foreign)])
    assert hashed["sequence"] == 3
    own = block_digests(engine.identity.root_for(TENANT), PROMPT, BLOCK)
    assert stored(engine) == own and not set(own) & set(foreign.digests)


def test_digests_of_a_wrong_length_are_recomputed(tiny_qwen, make_engine, hashed):
    engine = make_engine(tiny_qwen, num_blocks=16)
    digests = prompt_digests(engine.identity, TENANT, PROMPT)
    short = PromptDigests(digests.model_key, digests.digests[:2])
    engine.generate([request(short)])
    assert hashed["sequence"] == 3
    assert stored(engine) == digests.digests


def test_output_blocks_extend_the_ingress_chain(tiny_qwen, make_engine, hashed):
    """A request without digests hashes its prompt; one with them hashes only the blocks its
    output completes, and both chains agree."""
    plain = make_engine(tiny_qwen, num_blocks=16)
    plain.generate([request(None, max_tokens=30)])
    assert hashed["sequence"] == 5
    expected = stored(plain)
    seeded = make_engine(tiny_qwen, num_blocks=16)
    hashed["sequence"] = 0
    seeded.generate([request(prompt_digests(seeded.identity, TENANT, PROMPT), max_tokens=30)])
    assert hashed["sequence"] == 2
    assert stored(seeded) == expected
