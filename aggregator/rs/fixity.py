"""Hash tokens of the ``hash`` attribute (§7): whitespace-separated ``algorithm:hexdigest`` pairs."""

from __future__ import annotations

import hashlib
import re

#: Token names used by ResourceSync (note the hyphens) mapped to hashlib names.
ALGORITHMS: dict[str, str] = {"md5": "md5", "sha-1": "sha1", "sha-256": "sha256", "sha-512": "sha512"}
_HEX_LEN = {"md5": 32, "sha-1": 40, "sha-256": 64, "sha-512": 128}
#: The constructors themselves: ``hashlib.new(name)`` looks the name up on every call (a Hasher is
#: made per resource, and per record of an OAI-PMH page).
_NEW = {"md5": hashlib.md5, "sha-1": hashlib.sha1, "sha-256": hashlib.sha256, "sha-512": hashlib.sha512}
_HEX = re.compile(r"[0-9a-fA-F]+\Z")


def parse_hash(value: str | None) -> dict[str, str]:
    """Return the usable ``{algorithm: lowercase hex}`` pairs of a hash attribute.

    Tokens of an unknown algorithm or with a digest that is not hex of the right length (some
    examples in the specification carry base64) are left out: they are "no usable hash", never a match.
    """
    out: dict[str, str] = {}
    if not value:
        return out
    for token in value.split():
        algo, sep, digest = token.partition(":")
        algo = algo.lower()
        if sep and algo in _HEX_LEN and len(digest) == _HEX_LEN[algo] and _HEX.match(digest):
            out[algo] = digest.lower()
    return out


def bad_hash_tokens(value: str) -> list[str]:
    """The tokens of a hash attribute that ``parse_hash`` would ignore (for the validator)."""
    good = parse_hash(value)
    return [t for t in value.split() if t.partition(":")[2].lower() not in good.values()]


def format_hash(hashes: dict[str, str]) -> str | None:
    """Write ``{algorithm: hex}`` as an attribute value, strongest first, or None when empty."""
    order = ("sha-512", "sha-256", "sha-1", "md5")
    tokens = [f"{a}:{hashes[a]}" for a in order if a in hashes]
    tokens += [f"{a}:{d}" for a, d in sorted(hashes.items()) if a not in order]
    return " ".join(tokens) or None


class Hasher:
    """Computes every hash we may need in one pass over a stream (SHA-256 always)."""

    __slots__ = ("_h", "length")

    def __init__(self, algorithms: set[str] | frozenset[str] = frozenset()) -> None:
        self._h = {"sha-256": hashlib.sha256()}
        for a in algorithms:
            if a in _NEW and a not in self._h:
                self._h[a] = _NEW[a]()
        self.length = 0

    def update(self, chunk: bytes) -> None:
        for h in self._h.values():
            h.update(chunk)
        self.length += len(chunk)

    def hexdigests(self) -> dict[str, str]:
        return {a: h.hexdigest() for a, h in self._h.items()}

    @property
    def sha256(self) -> str:
        return self._h["sha-256"].hexdigest()


def digests(data: bytes, algorithms: set[str] | frozenset[str] = frozenset()) -> dict[str, str]:
    """What ``Hasher(algorithms)`` gives for ``data`` held whole, without a Hasher (one per record of an
    OAI-PMH page was a measurable part of storing it): SHA-256 always."""
    out = {"sha-256": hashlib.sha256(data).hexdigest()}
    for a in algorithms:
        if a in _NEW and a not in out:
            out[a] = _NEW[a](data).hexdigest()
    return out


def mismatches(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Names of the algorithms whose announced digest differs from the computed one."""
    return [a for a, d in expected.items() if a in actual and actual[a] != d]
