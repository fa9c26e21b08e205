"""The chained block hash shared by the router, the workers and the prefix index.

    h_i = H(h_{i-1} || tokens of full block i || extra)

`extra` binds the hash to the model, to the request's cache salt, which carries its tenant
(`scoped_salt`), and to its LoRA adapter (`hash_extra`): two requests share cached blocks
only when the model id, the tenant, the client's cache salt, the adapter and every token of
every block up to that point are equal. Only full blocks are hashed; the trailing partial
block of a prompt has no hash and is never shared.

`H` is one of two algorithms (`HashAlgorithm`), the same in every process and on every
machine (never Python's salted `hash`):

- xxh3: xxh3-128 with a fixed seed, 16 bytes. Fast, but not collision resistant: anyone who
  knows the code can craft two prefixes with one hash (and so read another's cached KV).
- sha256: SHA-256 over the same fields (the token count too), 32 bytes. Collision resistant;
  the default of a cluster that listens beyond loopback (deploy/control/launch.py).

The algorithm is a property of the cluster, not of a call: every process of one cluster must
use the same one (the router's lookups must find the hashes the workers publish). It is read
from `PDSERVE_BLOCK_HASH` when this module is imported (`pdserve up` sets it for every actor)
and can be set with `set_algorithm` (the router does, from its config).
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""Identifies a full block and, through the chain, every token before it (16 bytes with
xxh3, 32 with sha256)."""


class HashAlgorithm(enum.Enum):
    XXH3 = "xxh3"
    SHA256 = "sha256"


ALGORITHMS: tuple[str, ...] = tuple(a.value for a in HashAlgorithm)
BLOCK_HASH_ENV = "PDSERVE_BLOCK_HASH"
"""Environment variable naming the algorithm of this process (xxh3 when unset)."""

_SEED = 0x7064_7365_7276_6531  # "pdservE1": part of the on-wire format, never change
_ROOT = b"\x00" * 32
_SALT_SEPARATOR = "\x1e"  # neither a tenant name nor a validated cache salt may contain it
_LORA_SEPARATOR = "\x1d"  # nor this (nor a LoRA name: vocabulary.lora_names.check_lora_name)


def _from_env() -> HashAlgorithm:
    raw = os.environ.get(BLOCK_HASH_ENV, "") or HashAlgorithm.XXH3.value
    try:
        return HashAlgorithm(raw)
    except ValueError:
        raise ValueError(f"{BLOCK_HASH_ENV}: one of {', '.join(ALGORITHMS)}, got {raw!r}") from None


_algorithm = _from_env()


def set_algorithm(algorithm: HashAlgorithm | str) -> HashAlgorithm:
    """Make `algorithm` this process's block hash (also for child processes it starts)."""
    global _algorithm
    _algorithm = HashAlgorithm(algorithm)
    os.environ[BLOCK_HASH_ENV] = _algorithm.value
    return _algorithm


def current_algorithm() -> HashAlgorithm:
    return _algorithm


def scoped_salt(tenant: str, cache_salt: str = "") -> str:
    """The salt that scopes a request's prefix-cache entries: its tenant and the client's
    cache salt. The default tenant keeps the client's salt as it is (so a single-tenant
    cluster hashes as before); another tenant's never equals any other (tenant, salt)."""
    return f"{tenant}{_SALT_SEPARATOR}{cache_salt}" if tenant else cache_salt


def hash_extra(model_id: str, cache_salt: str = "", lora_name: str = "") -> bytes:
    """The `extra` bytes of every block of a request: model id, (scoped) cache salt and LoRA
    adapter. The base model ("") hashes exactly as before adapters existed; an adapter's name
    follows its own separator, so no adapter shares a block with the base model or with
    another adapter (a validated salt or adapter name never holds a control character)."""
    extra = f"{model_id}\x1f{cache_salt}"
    if lora_name:
        extra += f"{_LORA_SEPARATOR}{lora_name}"
    return extra.encode()


def _xxh3(parent: bytes, tokens: bytes, extra: bytes) -> BlockHash:
    h = xxhash.xxh3_128(seed=_SEED)
    h.update(parent)
    h.update(tokens)
    h.update(extra)
    return BlockHash(h.digest())


def _sha256(parent: bytes, tokens: bytes, extra: bytes) -> BlockHash:
    # parent and the token bytes have known lengths (32, 4 per token, the count first), so
    # no two inputs of different fields give the same bytes.
    h = hashlib.sha256(parent)
    h.update((len(tokens) // 4).to_bytes(4, "little"))
    h.update(tokens)
    h.update(extra)
    return BlockHash(h.digest())


_HASHERS = {HashAlgorithm.XXH3: _xxh3, HashAlgorithm.SHA256: _sha256}
_ROOTS = {HashAlgorithm.XXH3: _ROOT[:16], HashAlgorithm.SHA256: _ROOT}


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int] | np.ndarray,
    extra: bytes,
    algorithm: HashAlgorithm | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    alg = algorithm or _algorithm
    tokens = np.asarray(token_ids, dtype=np.uint32).tobytes()
    return _HASHERS[alg](parent if parent is not None else _ROOTS[alg], tokens, extra)


def hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: BlockHash | None = None,
    algorithm: HashAlgorithm | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (len(token_ids) // block_size of them).

    `parent` continues an existing chain (the hash of the block before token_ids[0]).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    alg = algorithm or _algorithm
    hasher = _HASHERS[alg]
    data = np.asarray(token_ids, dtype=np.uint32).tobytes()
    step = 4 * block_size
    prev: bytes = parent if parent is not None else _ROOTS[alg]
    hashes: list[BlockHash] = []
    for start in range(0, len(data) - step + 1, step):
        prev = hasher(prev, data[start : start + step], extra)
        hashes.append(BlockHash(prev))
    return hashes
