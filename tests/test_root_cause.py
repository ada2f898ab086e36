"""An error is recorded (status, the home page, logs) with its root cause first: the first error in its
chain that is not a wrapper (errors.root_cause). A table of leaves, each under every combination of the
wrappers rsagg raises: nursery groups (nested, with cancellations beside), discovery's "nothing found",
``raise ... from``."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import httpx
import pytest
import trio

from aggregator.errors import leading_line, root_cause
from aggregator.harvest.discovery import DiscoveryError
from aggregator.harvest.dumps import DumpError
from aggregator.harvest.fetch import FetchError
from aggregator.harvest.lists import SyncError

URL = "http://127.0.0.1:9/.well-known/resourcesync"

#: Leaves: (the error, the text its root cause line must start with).
LEAVES: dict[str, tuple[Callable[[], BaseException], str]] = {
    "connection refused": (
        lambda: FetchError(URL, "network", "ConnectError: all attempts to connect to 127.0.0.1:9 failed"),
        "FetchError: " + URL,
    ),
    "disk full": (
        lambda: OSError(28, "No space left on device", "/srv/rsagg/blobs/x"),
        "OSError: [Errno 28]",
    ),
    "bad package": (lambda: DumpError("http://u/dump.zip", "not a ZIP file"), "DumpError: http://u/dump.zip"),
    "httpx error": (
        lambda: httpx.ConnectError("[Errno 111] Connection refused"),
        "ConnectError: [Errno 111]",
    ),
}


def _group(inner: BaseException) -> BaseException:
    return BaseExceptionGroup("Exceptions from Trio nursery (1 sub-exception)", [inner])


def _group_with_cancelled(inner: BaseException) -> BaseException:
    cancelled = trio.Cancelled._create()  # what trio puts beside the error that stopped the nursery
    return BaseExceptionGroup("Exceptions from Trio nursery (2 sub-exceptions)", [cancelled, inner])


_WRAPS = itertools.count(1)


def _raised_from(inner: BaseException) -> BaseException:
    outer = SyncError(f"http://u/capabilitylist.xml: the set could not be synchronized ({next(_WRAPS)})")
    outer.__cause__ = inner
    return outer


#: Wrappers: how each turns an error into the one that reaches the recorder.
WRAPPERS: dict[str, Callable[[BaseException], BaseException]] = {
    "group": _group,
    "group with cancelled": _group_with_cancelled,
    "raised from": _raised_from,
}


def _discovery(leaf_text: str) -> DiscoveryError:
    tried = [(URL, leaf_text), ("http://127.0.0.1:9/robots.txt", "http: 404 Not Found")]
    return DiscoveryError(URL, tried)


CHAINS = [
    (leaf, wrappers)
    for leaf in LEAVES
    for n in range(0, 3)
    for wrappers in itertools.product(WRAPPERS, repeat=n)
]


@pytest.mark.parametrize(("leaf", "wrappers"), CHAINS)
def test_the_root_cause_leads(leaf: str, wrappers: tuple[str, ...]) -> None:
    make, starts = LEAVES[leaf]
    exc = error = make()
    for w in wrappers:
        exc = WRAPPERS[w](exc)
    assert root_cause(exc) is error
    line = leading_line(exc)
    assert line.startswith(starts), line
    assert "\n" not in line
    if "raised from" in wrappers:  # the wrapper's own words follow the cause
        assert "the set could not be synchronized" in line, line
    assert "Exceptions from Trio nursery" not in line  # a group says nothing of its own


@pytest.mark.parametrize("wrappers", [w for n in range(3) for w in itertools.product(WRAPPERS, repeat=n)])
def test_discovery_leads_with_why_the_configured_url_failed(wrappers: tuple[str, ...]) -> None:
    """Upstream down: "connection refused" first, "no Capability List found" after it."""
    why = "network: ConnectError: all attempts to connect to 127.0.0.1:9 failed"
    exc: BaseException = _discovery(why)
    for w in wrappers:
        exc = WRAPPERS[w](exc)
    line = leading_line(exc)
    assert line.startswith(f"{URL}: {why}"), line
    assert "DiscoveryError: " in line and "no ResourceSync Capability List" in line, line


def test_a_self_describing_wrapper_is_the_root() -> None:
    """``raise FetchError(url, ..., str(exc)) from exc``: the FetchError says its cause and names the URL,
    so it is the root cause (the bare httpx error would lose the URL)."""
    cause = httpx.ConnectError("all attempts to connect to 127.0.0.1:9 failed")
    outer = FetchError(URL, "network", f"ConnectError: {cause}")
    outer.__cause__ = cause
    assert root_cause(outer) is outer
    assert leading_line(outer).startswith(f"FetchError: {URL}")
