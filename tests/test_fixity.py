"""Hash tokens (§7): every algorithm rsagg reads is verified, sha-512 included."""

from __future__ import annotations

import hashlib

from aggregator.rs.fixity import Hasher, bad_hash_tokens, format_hash, mismatches, parse_hash

DATA = b"some bytes\n"
SHA512 = hashlib.sha512(DATA).hexdigest()


def test_sha512_tokens_are_read_and_verified() -> None:
    announced = parse_hash(f"sha-512:{SHA512.upper()} md5:{hashlib.md5(DATA).hexdigest()}")
    assert announced["sha-512"] == SHA512 and "md5" in announced
    h = Hasher(set(announced))
    h.update(DATA)
    assert mismatches(announced, h.hexdigests()) == []
    wrong = {**announced, "sha-512": "0" * 128}
    assert mismatches(wrong, h.hexdigests()) == ["sha-512"]


def test_malformed_tokens_are_no_usable_hash() -> None:
    value = f"sha-512:{SHA512[:-2]} sha-256:{'a' * 64} crc32:1234"
    assert parse_hash(value) == {"sha-256": "a" * 64}
    assert bad_hash_tokens(value) == [f"sha-512:{SHA512[:-2]}", "crc32:1234"]


def test_strongest_first_when_written() -> None:
    assert format_hash({"md5": "m", "sha-512": "s5", "sha-256": "s2"}) == "sha-512:s5 sha-256:s2 md5:m"
