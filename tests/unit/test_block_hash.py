"""Chained block hashes: the contract that lets engines and the cluster index agree on prefixes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from pdmesh.engine.block_hash import (
    SCHEME_VERSION,
    HashScheme,
    hash_block,
    hash_token_blocks,
)

BS = 4
TOKENS = [17, 3, 99, 4, 250, 7, 7, 1, 0, 65535, 12, 8, 5, 6]  # 3 full blocks + 2 tokens

# Hashes computed in a child process; PYTHONHASHSEED differs so a dependency on `hash()` shows.
_CHILD = """
import json, sys
from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
args = json.loads(sys.argv[1])
out = {}
for algo in ("sha256", "blake2b"):
    scheme = HashScheme(block_size=args["bs"], algorithm=algo)
    out[algo] = [h.hex() for h in hash_token_blocks(scheme, args["tokens"], args["salt"])]
    out[algo + "-fp"] = scheme.fingerprint()
print(json.dumps(out))
"""


def _hashes_here(salt: str | None) -> dict[str, object]:
    out: dict[str, object] = {}
    for algo in ("sha256", "blake2b"):
        scheme = HashScheme(block_size=BS, algorithm=algo)
        out[algo] = [h.hex() for h in hash_token_blocks(scheme, TOKENS, salt)]
        out[algo + "-fp"] = scheme.fingerprint()
    return out


@pytest.mark.processes
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hashes_are_identical_in_another_process(salt: str | None) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    args = json.dumps({"bs": BS, "tokens": TOKENS, "salt": salt})
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    theirs = json.loads(child.stdout)
    ours = _hashes_here(salt)
    assert theirs == ours
    assert len(ours["sha256"]) == 3  # type: ignore[arg-type]


@pytest.mark.fast
def test_wire_format_is_pinned() -> None:
    """If this fails the hash bytes changed: bump SCHEME_VERSION so mismatches are detected."""
    scheme = HashScheme(block_size=16)
    assert SCHEME_VERSION == 1
    assert scheme.describe() == "pdmesh-block-hash/v1/sha256/bs=16/root=pdmesh"
    # An independent derivation of the documented layout: H(parent || int64 LE tokens || extras).
    root = hashlib.sha256(scheme.describe().encode()).digest()
    first = hashlib.sha256(root + struct.pack("<16q", *range(16))).digest()
    (got,) = hash_token_blocks(scheme, list(range(16)))
    assert got == first
    assert got.hex() == "42aa4633d76671508380d3748ed157c3983c9d22cabcd5c3fe1c46f0df1b258e"
    second = hashlib.sha256(first + struct.pack("<16q", *range(16, 32))).digest()
    assert hash_token_blocks(scheme, list(range(32)))[1] == second


@pytest.mark.fast
def test_only_full_blocks_are_hashed() -> None:
    scheme = HashScheme(block_size=BS)
    assert hash_token_blocks(scheme, TOKENS[:3]) == []
    assert len(hash_token_blocks(scheme, TOKENS[:4])) == 1
    assert len(hash_token_blocks(scheme, TOKENS[:7])) == 1
    assert len(hash_token_blocks(scheme, TOKENS)) == len(TOKENS) // BS
    # A trailing partial block does not change the full blocks' hashes.
    assert hash_token_blocks(scheme, TOKENS[:12]) == hash_token_blocks(scheme, TOKENS)
    with pytest.raises(ValueError, match="only full blocks"):
        hash_block(scheme, None, TOKENS[:3])
    with pytest.raises(ValueError, match="only full blocks"):
        hash_block(scheme, None, TOKENS[:5])


@pytest.mark.fast
@pytest.mark.parametrize("position", range(12))
def test_changing_one_token_changes_its_block_and_every_later_one(position: int) -> None:
    scheme = HashScheme(block_size=BS)
    base = hash_token_blocks(scheme, TOKENS)
    changed_tokens = list(TOKENS)
    changed_tokens[position] += 1
    changed = hash_token_blocks(scheme, changed_tokens)
    block = position // BS
    assert changed[:block] == base[:block]
    for i in range(block, len(base)):
        assert changed[i] != base[i], f"block {i} kept its hash after token {position} changed"


@pytest.mark.fast
def test_identical_blocks_at_different_positions_hash_differently() -> None:
    scheme = HashScheme(block_size=BS)
    hashes = hash_token_blocks(scheme, [5, 5, 5, 5] * 3)
    assert len(set(hashes)) == 3


@pytest.mark.fast
def test_incremental_hashing_matches_hashing_everything() -> None:
    scheme = HashScheme(block_size=BS)
    full = hash_token_blocks(scheme, TOKENS, "salt")
    head = hash_token_blocks(scheme, TOKENS[:8], "salt")
    tail = hash_token_blocks(scheme, TOKENS, "salt", parent=head[-1], start_block=len(head))
    assert head + tail == full


@pytest.mark.fast
def test_cache_salt_changes_the_first_block_and_so_everything_after() -> None:
    scheme = HashScheme(block_size=BS)
    plain = hash_token_blocks(scheme, TOKENS)
    salt_a = hash_token_blocks(scheme, TOKENS, "tenant-a")
    salt_b = hash_token_blocks(scheme, TOKENS, "tenant-b")
    for i in range(len(plain)):
        assert len({plain[i], salt_a[i], salt_b[i]}) == 3
    # The salt is an extra key of the first block only: later blocks chain from it unchanged.
    assert salt_a[1] == hash_block(scheme, salt_a[0], TOKENS[4:8])
    # An empty salt means "no salt".
    assert hash_token_blocks(scheme, TOKENS, "") == plain


@pytest.mark.fast
def test_extra_keys_are_typed_and_length_prefixed() -> None:
    scheme = HashScheme(block_size=BS)
    block = TOKENS[:4]
    variants = [(), (1,), ("1",), (b"1",), ("ab", "c"), ("a", "bc"), ("abc",)]
    hashes = {hash_block(scheme, None, block, extra) for extra in variants}
    assert len(hashes) == len(variants)


@pytest.mark.fast
def test_fingerprint_and_hashes_differ_when_the_scheme_differs() -> None:
    base = HashScheme(block_size=BS)
    others = [
        HashScheme(block_size=8),
        HashScheme(block_size=BS, algorithm="blake2b"),
        HashScheme(block_size=BS, root_seed="other"),
        HashScheme(block_size=BS, version=SCHEME_VERSION + 1),
    ]
    fingerprints = {base.fingerprint()} | {s.fingerprint() for s in others}
    assert len(fingerprints) == 1 + len(others)
    base_first = hash_token_blocks(base, TOKENS)[0]
    for scheme in others:
        assert hash_token_blocks(scheme, TOKENS)[0] != base_first, scheme.describe()
    # Equal schemes agree exactly.
    assert HashScheme(block_size=BS).fingerprint() == base.fingerprint()
    assert len(base.fingerprint()) == 16


@pytest.mark.fast
@pytest.mark.parametrize("algorithm", ["sha256", "blake2b"])
def test_digests_are_32_bytes(algorithm: str) -> None:
    scheme = HashScheme(block_size=BS, algorithm=algorithm)
    assert all(len(h) == 32 for h in hash_token_blocks(scheme, TOKENS))


@pytest.mark.fast
def test_invalid_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        HashScheme(block_size=BS, algorithm="md5")
    with pytest.raises(ValueError, match="block_size"):
        HashScheme(block_size=0)
