"""rsagg URIs <-> upstream URIs: invertible, injective, valid URIs, stable (publish/uris.py)."""

from __future__ import annotations

import random
import re
from itertools import combinations

import httpx
import pytest

from aggregator.publish.uris import (
    NotAResourcePath,
    rsagg_path,
    rsagg_uri,
    split_resource_path,
    upstream_uri,
)

BASE = "http://agg.example:8080"

TRICKY = [
    "http://example.org/a/b.html",
    "http://example.org/a/b.html?x=1&y=2",
    "http://example.org/a/b.html%3Fx=1&y=2",  # an escaped "?" in the path is NOT a query
    "http://example.org/a/b.html?x=1#frag",
    "http://example.org/a/b.html%23frag",
    "http://example.org/a%2Fb",  # escaped slash vs a real one
    "http://example.org/a/b",
    "http://example.org/a%2fb",  # escapes are case-sensitive text in a URI string
    "http://example.org/a b",
    "http://example.org/a%20b",
    "http://example.org/a%2520b",
    "http://example.org/%",
    "http://example.org/%25",
    "http://example.org/caf\u00e9/\u6587\u5b57?q=\u00fc",
    "http://example.org/caf%C3%A9",
    "http://example.org",
    "http://example.org/",
    "http://example.org?",
    "http://example.org/?",
    "http://example.org/?q",
    "http://example.org?q",
    "http://user:pw@example.org:8080/x",
    "https://[::1]:8443/x",
    "https://EXAMPLE.org/X",
    "HTTPS://example.org/X",
    "http://example.org//double//slash/",
    "http://example.org/./a/../b",
    "http://example.org/a/..",
    "http://example.org/.../..a/a../.",
    "http://./..",
    "urn:x/../y",
    "http://example.org/~user/",
    "http://example.org/a;b,c=d@e:f!$&'()*+",
    'http://example.org/<>"{}|\\^`',
    "ftp://example.org/file.txt",
    "urn:isbn:0451450523",
    "mailto:someone@example.org",
    "urn://looks-hierarchical",
    "http:/one-slash",
    "http:relative",
    "a b://not-a-scheme",
    "1http://digit-first",
    "_/underscore",
]

# What may appear in a URI path unescaped (RFC 3986 pchar + "/"), plus complete %XX escapes.
_URI_PATH = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-F]{2})*\Z")


@pytest.mark.parametrize("uri", TRICKY)
def test_round_trip(uri: str):
    path = rsagg_path(uri)
    assert upstream_uri(path) == uri
    assert _URI_PATH.match(path), path
    assert split_resource_path(f"/museum/r/{path}") == ("museum", uri)


@pytest.mark.parametrize("uri", TRICKY)
def test_http_clients_send_the_path_unchanged(uri: str):
    # httpx normalises URLs (dot segments, for one): what it sends must still name the same resource.
    sent = httpx.URL(rsagg_uri(BASE, "museum", uri)).raw_path.decode("ascii")
    assert split_resource_path(sent) == ("museum", uri)


def test_injective_on_tricky_uris():
    paths = {u: rsagg_path(u) for u in TRICKY}
    for a, b in combinations(TRICKY, 2):
        assert paths[a] != paths[b], (a, b)


def test_injective_and_invertible_on_random_strings():
    rnd = random.Random(20240101)
    alphabet = "aZ09/?#%:@[]_-..~ &=+\u00e9\u6587\U0001f600" + "".join(chr(c) for c in range(0x21, 0x30))
    seen: dict[str, str] = {}
    for _ in range(3000):
        scheme = rnd.choice(["http://", "https://", "urn:", "x-y+z.w://", ""])
        uri = scheme + "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
        if not uri:
            continue
        path = rsagg_path(uri)
        assert upstream_uri(path) == uri
        assert _URI_PATH.match(path), path
        assert seen.setdefault(path, uri) == uri, f"{uri!r} and {seen[path]!r} share {path!r}"
        sent = httpx.URL(f"{BASE}/s/r/{path}").raw_path.decode("ascii")
        assert split_resource_path(sent) == ("s", uri)


def test_readable_layout():
    assert rsagg_uri(BASE, "art", "http://example.org/a/b.html?x=1") == (
        f"{BASE}/art/r/http/example.org/a/b.html%3Fx=1"
    )
    assert rsagg_path("https://[::1]:8443/\u00e9") == "https/%5B::1%5D:8443/%C3%A9"
    assert rsagg_path("http://example.org/a%20b") == "http/example.org/a%2520b"
    assert rsagg_path("urn:isbn:0451450523") == "_/urn:isbn:0451450523"
    assert rsagg_path("http://example.org/a/../b/.") == "http/example.org/a/%2E%2E/b/%2E"


def test_equivalent_escaping_is_accepted():
    # Clients that normalise escapes (lower-case hex, unescaped unreserved chars) still arrive.
    assert upstream_uri("http/example.org/a%3fx=1") == "http://example.org/a?x=1"
    assert upstream_uri("http/example.org/%7Euser") == "http://example.org/~user"


@pytest.mark.parametrize(
    "path",
    [
        "http",  # no scheme segment
        "1http/x",  # not a scheme
        "ht%20tp/x",
        "http/%FF%FE",  # not UTF-8
        "_/",  # empty URI
        "_/http://example.org/x",  # not the form rsagg writes for that URI (alias refused)
    ],
)
def test_rejects_what_rsagg_never_writes(path: str):
    with pytest.raises(NotAResourcePath):
        upstream_uri(path)


@pytest.mark.parametrize(
    "raw", ["/museum/x/http/example.org/", "/museum/r", "museum/r/http/x", "//r/http/x", "/m/r/bad/%FF"]
)
def test_split_resource_path_refuses_other_paths(raw: str):
    assert split_resource_path(raw) is None
