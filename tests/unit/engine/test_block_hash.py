"""The block hash (vocabulary/block_hash.py): xxh3 output is the on-wire format (pinned), sha256
is the collision-resistant option, and a tenant's salt keeps its chain apart from every
other tenant's."""

from __future__ import annotations

import pytest

from vocabulary.block_hash import (
    HashAlgorithm,
    current_algorithm,
    hash_block,
    hash_chain,
    hash_extra,
    scoped_salt,
    set_algorithm,
)

TOKENS = list(range(40))
EXTRA = hash_extra("tiny", "")


def test_xxh3_chain_is_the_on_wire_format() -> None:
    chain = hash_chain(TOKENS, 16, EXTRA, algorithm=HashAlgorithm.XXH3)
    assert len(chain) == 2 and all(len(h) == 16 for h in chain)
    assert chain[0] == hash_block(None, TOKENS[:16], EXTRA, HashAlgorithm.XXH3)
    assert chain[1] == hash_block(chain[0], TOKENS[16:32], EXTRA, HashAlgorithm.XXH3)
    assert chain[0].hex() == "d24adc67d04fd3d748176574b67ba00b"  # never changes


def test_sha256_chain_is_32_bytes_and_differs_from_xxh3() -> None:
    chain = hash_chain(TOKENS, 16, EXTRA, algorithm=HashAlgorithm.SHA256)
    assert [len(h) for h in chain] == [32, 32]
    assert chain[1] == hash_block(chain[0], TOKENS[16:32], EXTRA, HashAlgorithm.SHA256)
    assert chain[0][:16] != hash_chain(TOKENS, 16, EXTRA, algorithm=HashAlgorithm.XXH3)[0]
    # a continued chain equals the whole one
    tail = hash_chain(TOKENS[16:], 16, EXTRA, chain[0], HashAlgorithm.SHA256)
    assert tail == chain[1:]


def test_the_process_algorithm_is_the_default_of_every_call() -> None:
    before = current_algorithm()
    try:
        set_algorithm("sha256")
        assert len(hash_chain(TOKENS, 16, EXTRA)[0]) == 32
        set_algorithm(HashAlgorithm.XXH3)
        assert len(hash_chain(TOKENS, 16, EXTRA)[0]) == 16
        with pytest.raises(ValueError):
            set_algorithm("md5")
    finally:
        set_algorithm(before)


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_tenants_never_share_a_chain_and_a_tenant_shares_its_own(
    algorithm: HashAlgorithm,
) -> None:
    def chain(tenant: str, salt: str = "") -> list[bytes]:
        return list(hash_chain(TOKENS, 16, hash_extra("tiny", scoped_salt(tenant, salt)),
                               algorithm=algorithm))  # fmt: skip

    assert chain("acme") == chain("acme")
    firsts = {chain(t, s)[0] for t, s in [("", ""), ("acme", ""), ("globex", ""),
                                          ("acme", "x"), ("", "acme"), ("", "x")]}  # fmt: skip
    assert len(firsts) == 6
    assert scoped_salt("", "s") == "s"  # the default tenant hashes as before


def test_the_base_model_hashes_as_before_and_every_lora_adapter_apart() -> None:
    assert hash_extra("tiny", "s") == hash_extra("tiny", "s", "") == b"tiny\x1fs"
    loras = ("", "sql", "chat", "s")
    extras = {hash_extra("tiny", salt, lora) for salt in ("", "s") for lora in loras}
    assert len(extras) == 8  # (salt "s" with no adapter is not adapter "s" with no salt)
    firsts = {hash_chain(TOKENS, 16, hash_extra("tiny", "", lora))[0] for lora in loras}
    assert len(firsts) == 4
