"""Many small sources cost what one big source costs, per resource: the mechanisms, counted (never timed;
the speed is measured by benchmarks/bench_many_sources.py).

- the state calls of a harvest of K sources (and the rows they return) grow linearly with K: no step
  reads what every source holds (a pipeline once read every set of every source);
- a sync's status writes take one state write of their own (the final one), the others ride along;
- a document is read by one XML parser (a second, sniffing, parser only for a root that does not show
  in the first bytes);
- sources sharing an origin share its connections, while a connection opened under a pin serves only
  requesters with that same trust;
- a request finds its source by name, not by walking every configured source.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import math
import random
import threading
from collections import Counter
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio.testing
from lxml import etree
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.config import SourceConfig
from aggregator.harvest import admission, pipeline
from aggregator.harvest import context as context_mod
from aggregator.harvest import deviations as deviations_mod
from aggregator.harvest import fetch as fetch_mod
from aggregator.harvest import source as source_mod
from aggregator.harvest import writes as writes_mod
from aggregator.harvest.access import Access
from aggregator.harvest.context import HarvestContext
from aggregator.harvest.source import sync_source
from aggregator.net import lean, outbound
from aggregator.rs import parse
from aggregator.rs.model import RS_NS, SITEMAP_NS
from aggregator.rs.parse import DocumentError, DocumentReader
from aggregator.run.compose import open_context
from aggregator.scope import current_source
from aggregator.store.open import open_state
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream
from tests.harvesting import harvest, make_config
from tests.httpserver import serve_app

STATUS_WRITES = {"set_source_status", "upsert_source", "put_upstream_notes"}


# -- the state: calls and rows linear in the number of sources ----------------------------------------


class StateCalls:
    """Counts every call of a public ``State`` method, and the rows (items) each returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()
        self._lock = threading.Lock()
        for name in dir(State):
            fn = getattr(State, name)
            if name.startswith("_") or not callable(fn) or isinstance(fn, type):
                continue
            monkeypatch.setattr(State, name, self._counted(name, fn))

    def _counted(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            n = len(out) if isinstance(out, list | set | dict | tuple | frozenset) else 0
            with self._lock:
                self.calls[name] += 1
                self.rows[name] += n
            return out

        return counted

    def reset(self) -> None:
        self.calls.clear()
        self.rows.clear()

    @property
    def cost(self) -> int:
        return sum(self.calls.values()) + sum(self.rows.values())


def many_sources(k: int) -> tuple[Upstream, list[str]]:
    """An upstream with ``k`` sets of one resource each: ``k`` sources, by their Capability Lists."""
    names = [f"s{i}" for i in range(k)]
    up = Upstream(sets=names, resource_dump=False, change_dump=False, change_list=False)
    for name in names:
        up.create("r.txt", f"resource of {name}".encode(), set_name=name)
    return up, names


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every function a harvest hands to the writer thread (``HarvestContext.write``)."""
    names: list[str] = []
    real_write = HarvestContext.write

    async def write(self, fn, *args, **kwargs):
        names.append(getattr(fn, "__name__", ""))
        return await real_write(self, fn, *args, **kwargs)

    monkeypatch.setattr(HarvestContext, "write", write)
    return names


async def test_state_calls_and_rows_grow_linearly_with_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: list[str]
) -> None:
    monkeypatch.setattr(context_mod, "PROGRESS_SAVE_EVERY", 1e9)  # no progress saves on the clock
    counted = StateCalls(monkeypatch)
    costs: dict[int, int] = {}
    for k in (1, 4, 12):
        up, names = many_sources(k)
        async with up.serving():
            config = make_config(
                tmp_path / f"store{k}", {n: up.doc_url("capabilitylist.xml", n) for n in names}
            )
            counted.reset()
            writes.clear()
            results = await harvest(config)
        assert all(r.ok for r in results.values()) and len(results) == k
        costs[k] = counted.cost
        # No status write of its own: the first ones rode along with the sync's first write, the final
        # one with its baseline's end (its last step), and all of them happened.
        assert sum(1 for w in writes if w in STATUS_WRITES) == 0, writes
        assert counted.calls["upsert_source"] == k and counted.calls["put_upstream_notes"] == k
        assert counted.calls["set_source_status"] == 2 * k  # "syncing", then "ok"
        with open_state(config) as state:
            rows = {s.name: s for s in state.sources()}
        assert {n: (rows[n].state, rows[n].last_attempt is not None) for n in names} == {
            n: ("ok", True) for n in names
        }
    low, high = (costs[4] - costs[1]) / 3, (costs[12] - costs[4]) / 8
    # Linear: each more source adds the same calls and rows (a read of every source's sets per
    # pipeline added k rows per source: the marginal cost grew with k).
    assert high <= low + 1, costs


# -- one parser per document ------------------------------------------------------------------------


@pytest.fixture
def parsers(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The XMLPullParsers the document reader puts to work (their options), each document's made or
    taken from those kept (``parse._pull_parser``)."""
    made: list[dict] = []
    real, real_pull = etree.XMLPullParser, parse._pull_parser
    pulling = False

    def make(*args, **kwargs):
        if not pulling:
            made.append(kwargs)
        return real(*args, **kwargs)

    def pull():
        nonlocal pulling
        made.append({"events": ("start",), "tag": parse._ROOT_TAGS, **parse._HARDENED})
        pulling = True
        try:
            return real_pull()
        finally:
            pulling = False

    monkeypatch.setattr(parse.etree, "XMLPullParser", make)
    monkeypatch.setattr(parse, "_pull_parser", pull)
    return made


def _document(rng: random.Random, root: str, n: int) -> bytes:
    prolog = rng.choice(["", '<?xml version="1.0" encoding="UTF-8"?>\n', "<?xml version='1.0'?>"])
    for _ in range(rng.randrange(3)):
        prolog += rng.choice(["\n", "<!-- a comment <urlset> -->", "<?pi data?>", "  "])
    if rng.random() < 0.3:
        prolog += f"<!DOCTYPE {root}>"
    entry = "url" if root == "urlset" else "sitemap"
    entries = "".join(
        f'<{entry}><loc>http://example.org/{i}</loc><rs:md hash="md5:1B2M2Y8AsgTpgAmY7PhCfg=="/></{entry}>'
        for i in range(n)
    )
    return (
        f'{prolog}<{root} xmlns="{SITEMAP_NS}" xmlns:rs="{RS_NS}"><rs:md capability="resourcelist"/>'
        f"{entries}</{root}>"
    ).encode()


def _read(data: bytes, sizes: random.Random | None) -> list:
    reader = DocumentReader("http://example.org/doc")
    out: list = []
    i = 0
    while i < len(data):
        step = sizes.randrange(1, 3000) if sizes else len(data)
        out += reader.feed(data[i : i + step])
        i += step
    return out + reader.close()


def test_a_document_is_read_by_one_parser(parsers: list[dict]) -> None:
    rng = random.Random(28)
    for _ in range(200):
        data = _document(rng, rng.choice(["urlset", "sitemapindex"]), rng.randrange(40))
        parsers.clear()
        chunked = _read(data, rng)
        assert len(parsers) == 1, data[:200]
        assert chunked == _read(data, None)  # the same items, however the bytes arrive


def test_a_wrong_root_is_refused_early_whatever_its_shape(parsers: list[dict]) -> None:
    """A wrong root, also one that holds a <urlset> or comes after a long prolog, is refused within the
    first slices, not after the whole document is built."""
    rng = random.Random(2)
    filler = "<p>" + "x" * 200 + "</p>"
    shapes = [
        ("<html>", "</html>", "root element is <html>"),
        ('<x:urlset xmlns:x="http://example.org/ns">', "</x:urlset>", "expected 'http://www.sitemaps"),
        ("<urlset>", "</urlset>", "in namespace 'none'"),
        (f'<wrap><urlset xmlns="{SITEMAP_NS}">', "</urlset></wrap>", "root element is <wrap>"),
        (f"<!-- {'c' * 9000} --><feed>", "</feed>", "root element is <feed>"),
    ]
    for start, end, reason in shapes:
        data = (start + filler * 5000 + end).encode()  # about 1 MB
        reader = DocumentReader("http://example.org/doc")
        fed = 0
        with pytest.raises(DocumentError) as ei:
            while fed < len(data):
                step = rng.randrange(512, 8192)
                reader.feed(data[fed : fed + step])
                fed += step
            reader.close()
        assert reason in ei.value.reason, (start, ei.value.reason)
        assert fed < 64 * 1024 + 8192, (start, fed)  # refused early
    # A right root after a prolog longer than the first bytes: read, by the parser and a sniffer.
    parsers.clear()
    data = _document(rng, "urlset", 3)
    at = data.index(b"<urlset")
    data = data[:at] + f"<!-- {'c' * 9000} -->".encode() + data[at:]
    assert len([x for x in _read(data, rng) if hasattr(x, "loc")]) == 3
    assert len(parsers) == 2


# -- connections per origin -------------------------------------------------------------------------


async def test_sources_sharing_an_origin_share_its_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve sources on one (loopback, so pinned) origin: no more connections than the per-host
    limit allows at once, not one (or more) per source; and no more tasks than they have changes.
    Connections of both paths count: httpx's and the lean client's (documents and resources)."""
    opened: list[tuple[str, int]] = []
    real = outbound.PolicedBackend.connect_tcp
    real_lean = lean.LeanPool._connect

    async def connect_tcp(self, host, port, *args, **kwargs):
        opened.append((host, port))
        return await real(self, host, port, *args, **kwargs)

    async def lean_connect(self, url, port, *args, **kwargs):
        opened.append((url.host, port))
        return await real_lean(self, url, port, *args, **kwargs)

    monkeypatch.setattr(outbound.PolicedBackend, "connect_tcp", connect_tcp)
    monkeypatch.setattr(lean.LeanPool, "_connect", lean_connect)
    tasks: list[int] = []
    real_run = pipeline._Workers._run

    async def run(self, *args):
        tasks.append(1)
        return await real_run(self, *args)

    monkeypatch.setattr(pipeline._Workers, "_run", run)
    up, names = many_sources(12)
    async with up.serving():
        config = make_config(tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names})
        results = await harvest(config)
    assert all(r.ok for r in results.values())
    assert sum(up.counts.values()) >= 3 * 12  # a Capability List, a Resource List, a resource each
    assert 1 <= len(opened) <= config.harvest.per_host < len(names)
    # A set of one change starts one fetch task (and one filter task when a filter plugin is
    # installed), not ``harvest.workers`` of each.
    assert len(tasks) <= 2 * len(names) < config.harvest.workers * len(names)


async def test_a_pinned_connection_serves_only_requesters_of_the_same_trust() -> None:
    """Per (origin, trust): requesters pinned to the same networks share connections; a requester
    pinned elsewhere gets its own; one without a pin is refused (loopback), never handed a pinned one."""
    seen: list[int] = []  # the client port (the connection) of each request served

    async def res(request: Request) -> Response:
        assert request.client is not None
        seen.append(request.client.port)
        return Response(b"ok")

    async with serve_app(Starlette(routes=[Route("/res", res)])) as base:
        url = httpx.URL(f"{base}/res")
        here = outbound.parse_networks(["127.0.0.1/32"])
        wider = outbound.parse_networks(["127.0.0.0/8"])
        pins = {(url.host, url.port): {"a": here, "b": here, "c": wider}}
        transport = outbound.transport(outbound.AddressPolicy(pins=pins))  # type: ignore[arg-type]
        served: dict[str, set[int]] = {}
        try:
            for who in ("a", "b", "a", "c", "c", "b"):
                with outbound.acting_for(who):
                    response = await transport.handle_async_request(httpx.Request("GET", url))
                    await response.aread()
                    await response.aclose()
                served.setdefault(who, set()).add(seen[-1])
            with outbound.acting_for("d"), pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(httpx.Request("GET", url))
        finally:
            await transport.aclose()
    assert len(seen) == 6
    # a and b (the same trust): one connection between them, kept alive; c: its own, never theirs.
    assert served["a"] == served["b"] and len(served["a"]) == 1
    assert len(served["c"]) == 1 and not served["c"] & served["a"]


# -- per-request lookups of the source ----------------------------------------------------------------


class _CountedList(list):
    """A list that counts the times it is walked."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


async def test_a_request_finds_its_source_without_walking_every_source(tmp_path: Path) -> None:
    """The Fetcher's request hook looks its source up by name: requests for K sources walk the list
    of sources a bounded number of times, not once per request (quadratic in the sources)."""
    k = 50
    config = make_config(tmp_path / "store", {f"s{i}": f"http://127.0.0.{1 + i % 5}/s{i}/" for i in range(k)})
    object.__setattr__(config, "sources", _CountedList(config.sources))  # frozen: set underneath
    access = Access(config)
    _CountedList.walks = 0
    for round_ in range(3):
        for i in range(k):
            token = current_source.set(f"s{i}")
            try:
                request = httpx.Request("GET", f"http://127.0.0.{1 + i % 5}/s{i}/r{round_}")
                await access(request)
            finally:
                current_source.reset(token)
            assert request.headers["User-Agent"]
    assert _CountedList.walks <= 2, _CountedList.walks


# -- fetch tasks only where a host has a free slot -----------------------------------------------------


@pytest.mark.parametrize("free_after", [0, 1, 5, 1000])
async def test_a_change_whose_host_is_busy_starts_no_task_of_its_own(free_after: int) -> None:
    """``_Workers`` with ``ready``: while it says no (the host's slots are all taken), the items wait for
    the task already running instead of each starting one; once it says yes, tasks start again, up to
    the bound. Every item is handled, once."""
    handled: list[int] = []
    calls = [0]

    def ready(item: object) -> bool:
        calls[0] += 1
        return calls[0] > free_after

    async def handle(item: int) -> None:
        await trio.sleep(0)
        handled.append(item)

    async with trio.open_nursery() as nursery:
        with pipeline._Workers(nursery, handle, 16, 4, ready=ready) as workers:
            for i in range(40):
                await workers.send(i)
    assert sorted(handled) == list(range(40))
    if free_after >= 1000:  # never free: the first task alone took them all
        assert workers.started == 1
    else:
        assert 1 < workers.started <= 16


async def test_sources_on_a_busy_host_start_fewer_fetch_tasks_than_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve sources of six resources on one host of two slots: the fetch tasks started are bounded by
    what the host could serve, not one per change (each source's ``harvest.workers``)."""
    started: list[int] = []
    real_init = pipeline._Workers.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(id(self))
        self.__dict__["_ready_seen"] = kwargs.get("ready") is not None

    tasks = [0]
    real_run = pipeline._Workers._run

    async def run(self, *args):
        if self.__dict__.get("_ready_seen"):
            tasks[0] += 1
        return await real_run(self, *args)

    monkeypatch.setattr(pipeline._Workers, "__init__", init)
    monkeypatch.setattr(pipeline._Workers, "_run", run)
    names = [f"s{i}" for i in range(12)]
    up = Upstream(sets=names, resource_dump=False, change_dump=False, change_list=False)
    for name in names:
        for j in range(6):
            up.create(f"r{j}.txt", f"resource {j} of {name}".encode(), set_name=name)
    async with up.serving():
        config = make_config(
            tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names}, per_host=2
        )
        results = await harvest(config)
    assert all(r.ok for r in results.values()) and sum(r.stats[0].fetched for r in results.values()) == 72
    # Each pipeline starts its first task; more only while the host had a free slot.
    assert len(names) <= tasks[0] < 72 * 2 // 3, tasks[0]


@pytest.mark.parametrize("seed", range(5))
async def test_syncs_sharing_a_host_start_fetch_tasks_within_their_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Generated: Sources of one host (random count, sizes, ``per_host``). A pipeline starts a fetch
    task beyond its first only while its sync's share of the host's slots (the slots over the syncs of
    the host admitted then) has room; every resource is fetched, every Source ok; a Source alone on
    its host still grows past one task."""
    rng = random.Random(seed)
    per_host = rng.randrange(1, 5) if seed else 4
    names = [f"s{i}" for i in range(rng.randrange(2, 9))] if seed else ["s0"]
    sizes = {n: rng.randrange(1, 3 * per_host + 8) if seed else 4 * per_host + 8 for n in names}
    grown: list[tuple[int, int, int]] = []  # (syncs of the host, its slots, tasks before) at a growth
    most: Counter[int] = Counter()
    real_grow = pipeline._Workers._grow

    def grow(self: pipeline._Workers, item: object) -> None:
        before = self._started
        real_grow(self, item)
        if self._ready is not None and self._started > before:
            most[id(self)] = self._started
            if before >= 1:
                p = self._ready.__self__  # type: ignore[attr-defined]
                host = "127.0.0.1"
                grown.append((p.ctx.admissions.syncs_of(host), p.ctx.fetcher.host_limit(host), before))

    monkeypatch.setattr(pipeline._Workers, "_grow", grow)
    up = Upstream(sets=names, resource_dump=False, change_dump=False, change_list=False)
    for name in names:
        for j in range(sizes[name]):
            up.create(f"r{j}.txt", f"resource {j} of {name}".encode(), set_name=name)
    async with up.serving():
        config = make_config(
            tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names}, per_host=per_host
        )
        results = await harvest(config)
    assert all(r.ok for r in results.values())
    assert {n: r.stats[0].fetched for n, r in results.items()} == sizes
    assert all(syncs < 2 or before < slots // syncs for syncs, slots, before in grown), grown
    if len(names) == 1 and per_host > 1:
        assert max(most.values()) > 1  # alone on its host: no share to keep to


@pytest.mark.parametrize("per_host", [1, 2, 3])
async def test_one_source_starts_no_more_fetch_tasks_than_its_host_has_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_host: int
) -> None:
    """A list of 40 changes arrives at once, ``harvest.workers`` is 16: tasks started but not yet at
    their request count as taking a slot, so the pipeline starts about as many fetch tasks as the host
    has slots (each extra one would wait for a slot on every request it makes), and all are fetched."""
    tasks = [0]
    real_run = pipeline._Workers._run

    async def run(self, *args):
        if self._ready is not None:  # the fetch tasks (the filter tasks have no ``ready``)
            tasks[0] += 1
        return await real_run(self, *args)

    monkeypatch.setattr(pipeline._Workers, "_run", run)
    up = Upstream(resource_dump=False, change_dump=False, change_list=False)
    for j in range(40):
        up.create(f"r{j}.txt", f"resource {j}".encode())
    async with up.serving():
        config = make_config(
            tmp_path / "store", {"s": up.doc_url("capabilitylist.xml")}, per_host=per_host, workers=16
        )
        results = await harvest(config)
    assert results["s"].ok and results["s"].stats[0].fetched == 40
    # One more than the slots at most: a task between its item and its request holds neither.
    assert 1 <= tasks[0] <= per_host + 1, tasks[0]


# -- state writes share thread hops ----------------------------------------------------------------------


async def _writes_at_once(k: int, failing: set[int], cancelled: set[int]) -> tuple[int, int]:
    """``k`` writes asked at once through one ``SharedHops`` (those in ``failing`` raise, the callers
    in ``cancelled`` are cancelled just after asking); checks each ran once, in order, with its own
    answer. Returns (hops made, writes dropped by a cancellation)."""
    ran: list[int] = []
    asked: list[int] = []
    hops: list[int] = []
    got: dict[int, object] = {}

    async def hop(fn) -> None:
        hops.append(1)
        await trio.to_thread.run_sync(fn)

    shared = writes_mod.SharedHops(hop)

    def call(i: int) -> int:
        ran.append(i)
        if i in failing:
            raise ValueError(f"write {i} refused")
        return i * 10

    async def one(i: int, scope: trio.CancelScope) -> None:
        with scope:
            try:
                asked.append(i)  # no checkpoint between this and the write's place in line
                got[i] = await shared.run(functools.partial(call, i))
            except ValueError as exc:
                got[i] = str(exc)

    scopes = {i: trio.CancelScope() for i in range(k)}
    async with trio.open_nursery() as nursery:
        for i in range(k):
            nursery.start_soon(one, i, scopes[i])
        await trio.sleep(0)  # all of them asked (the first one's hop is under way)
        for i in cancelled:
            scopes[i].cancel()
    assert ran == [i for i in asked if i in ran] and len(set(ran)) == len(ran)  # in order, each once
    for i in ran:
        if i in got:  # ran and its caller had the answer (a cancelled caller may not)
            assert got[i] == (f"write {i} refused" if i in failing else i * 10)
    assert set(range(k)) - cancelled <= set(ran)  # nothing lost but what was cancelled
    assert all(i in got for i in set(range(k)) - cancelled)
    assert len(hops) == shared.hops
    return shared.hops, len(cancelled - set(ran))


async def test_writes_asked_while_a_hop_runs_share_the_next_hop() -> None:
    """Writes from many tasks at once: each runs once, in the order asked, with its own result or its
    own error; those that waited for a hop went together (a few hops, not one each); a write whose caller
    is cancelled before a hop took it never runs."""
    rng = random.Random(7)
    dropped = 0
    for _round in range(20):
        k = rng.randrange(1, 40)
        failing = {i for i in range(k) if rng.random() < 0.2}
        cancelled = {i for i in range(k) if rng.random() < 0.15}
        hops, lost = await _writes_at_once(k, failing, cancelled)
        assert hops <= 3, (k, hops)
        dropped += lost
    assert dropped > 0  # the cancellations did reach writes still waiting


async def test_a_harvest_of_many_sources_makes_fewer_write_hops_than_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve sources syncing at once: their state writes share the writer thread's hops (and
    transactions) instead of taking one each, and every source ends "ok"."""
    made: list[writes_mod.SharedHops] = []
    real_init = writes_mod.SharedHops.__init__

    def init(self, hop, **kwargs):
        real_init(self, hop, **kwargs)
        made.append(self)

    monkeypatch.setattr(writes_mod.SharedHops, "__init__", init)
    up, names = many_sources(12)
    async with up.serving():
        config = make_config(tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names})
        results = await harvest(config)
    assert all(r.ok for r in results.values())
    assert len(made) == 1
    shared = made[0]
    assert shared.calls >= 2 * len(names)  # a set and its baseline begun; a batch, its end, the status
    assert shared.hops < shared.calls * 3 // 4, (shared.hops, shared.calls)
    assert shared.shared >= 1  # and, on SQLite, their transactions (harvest/writes.py)
    with open_state(config) as state:
        assert {s.name: s.state for s in state.sources()} == {n: "ok" for n in names}


# -- an unchanged poll: nothing read or written again but what says so ------------------------------------


async def test_an_unchanged_poll_parses_no_document_and_writes_little(
    tmp_path: Path, parsers: list[dict], writes: list[str]
) -> None:
    """A daemon's second poll of a Source that did not change: its Capability List and Resource List are
    asked for conditionally and answered 304, so no document is parsed again; its state writes are
    three, whatever the Source holds. A changed Resource List is read again; the Capability List is not."""
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    for j in range(3):
        up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a")
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        src = config.sources[0]
        async with open_context(config) as ctx:
            first = await sync_source(ctx, src)
            assert first.ok and len(parsers) == 2  # the Capability List, the Resource List
            for _poll in range(2):
                parsers.clear()
                writes.clear()
                again = await sync_source(ctx, src)
                assert again.ok and again.sets == 1
                assert parsers == []  # both answered 304: nothing parsed
                # The set (the "syncing" status rides along), the baseline opened before its list is
                # asked for (changes applied meanwhile are never swept), the final status.
                assert len(writes) <= 3, writes
            up.update("r1.txt", b"resource 1, changed", set_name="a")
            parsers.clear()
            changed = await sync_source(ctx, src)
            assert changed.ok and sum(s.fetched for s in changed.stats) == 1
            assert len(parsers) == 1  # the Resource List only
    with open_state(config) as state:
        assert [(s.name, s.state) for s in state.sources()] == [("a", "ok")]


@pytest.mark.parametrize("events", [False, True])
async def test_a_pipeline_reads_its_set_name_only_for_event_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: bool
) -> None:
    """The set's name is what the event hooks are told: without any, a pipeline does not read the sets."""
    counted = StateCalls(monkeypatch)
    real_init = pipeline.Pipeline.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._events = events

    monkeypatch.setattr(pipeline.Pipeline, "__init__", init)
    up, names = many_sources(3)
    async with up.serving():
        config = make_config(tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names})
        results = await harvest(config)
    assert all(r.ok for r in results.values())
    assert (counted.calls["sets"] > 0) == events, counted.calls


async def test_a_batch_and_its_validators_take_one_write(tmp_path: Path, writes: list[str]) -> None:
    """A batch's changes and the upstream's validators of what it fetched are one write call (one wait
    for the writer thread) and one transaction: both are stored."""
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    uris = [up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a") for j in range(5)]
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        results = await harvest(config)
        urls = [up.url(f"r{j}.txt", "a") for j in range(len(uris))]
    assert results["a"].ok
    assert "put_resource_validators" not in writes and writes.count("_apply_batch") == 1, writes
    with open_state(config) as state:
        set_id = state.sets("a")[0].id
        kept = state.resource_validators(set_id, urls)
    assert sorted(kept) == sorted(urls) and all(v.etag for v in kept.values())


async def test_a_small_batch_commits_its_blobs_in_the_hop_of_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random batches through ``write_after_blobs``: the write runs only once every blob of its batch is
    durable (found by the store from the writer thread); a batch of small blobs held in memory takes one
    thread hop, its blobs' commit and the write together, while one with a bigger blob commits it as
    before, in hops of its own; a blob commit that fails runs no write and its error is the caller's."""
    hops: list[str] = []
    real_run_sync = trio.to_thread.run_sync

    async def counted(fn, *args, **kwargs):
        hops.append(getattr(fn, "__name__", type(fn).__name__))
        return await real_run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    rng = random.Random(3)
    config = make_config(tmp_path / "store", {})
    async with open_context(config) as ctx:
        limit = ctx.blobs.inline_bytes  # type: ignore[attr-defined]
        for round_ in range(25):
            sizes = [rng.choice([10, 100, limit, limit + 1, 3 * limit]) for _ in range(rng.randrange(1, 6))]
            datas = [f"{round_}.{i}.".encode().ljust(n, b"x") for i, n in enumerate(sizes)]
            writers = []
            for data in datas:
                w = ctx.blobs.begin(spool=limit * 4)
                w.write(data)
                w.finish()
                writers.append(w)
            shas = [hashlib.sha256(d).hexdigest() for d in datas]
            seen: list[bool] = []

            def write(shas: list[str] = shas, seen: list[bool] = seen) -> int:
                seen.extend(ctx.blobs.exists(s) for s in shas)
                return len(shas)

            hops.clear()
            assert await ctx.write_after_blobs(writers, write) == len(datas)
            assert seen == [True] * len(datas)  # every blob durable before the write ran
            small = all(n <= limit for n in sizes)
            assert (len(hops) == 1) is small, (sizes, hops)
        # The blobs fail to commit: the write does not run; the caller gets the error.
        w = ctx.blobs.begin(spool=limit)
        w.write(b"small")
        w.finish()

        def failing(writers: list) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ctx.blobs, "commit", failing)
        ran: list[int] = []
        with pytest.raises(OSError, match="No space"):
            await ctx.write_after_blobs([w], ran.append, 1)
        assert ran == []


async def test_sources_of_random_sizes_harvested_together_hold_what_each_alone_would(tmp_path: Path) -> None:
    """Sources of random sizes (a few resources or more than a lookup batch; bodies held inline or as
    files) harvested at once into one store hold exactly what each harvested alone holds: the same rows
    (URI, content, length), every blob readable, every source "ok"; whatever their batches shared (a
    thread hop, a lookup on the event loop) changed nothing of what was stored."""
    rng = random.Random(23)
    names = [f"s{i}" for i in range(7)]
    up = Upstream(sets=names, resource_dump=False, change_dump=False, change_list=False)
    for name in names:
        for j in range(rng.choice([1, 3, 20, 33, 70])):
            size = rng.choice([20, 900, 20_000])
            up.create(f"r{j}.txt", f"{name} {j} ".encode().ljust(size, b"."), set_name=name)

    def held(config) -> dict[str, list[tuple]]:
        with open_state(config) as state:
            rows = {
                s.source: sorted((r.uri, r.sha256, r.length, r.deleted) for r in state.iter_resources(s.id))
                for s in state.sets()
            }
            assert {s.name: s.state for s in state.sources()} == {n: "ok" for n in rows}
        return rows

    async with up.serving():
        urls = {n: up.doc_url("capabilitylist.xml", n) for n in names}
        together = make_config(tmp_path / "together", urls)
        assert all(r.ok for r in (await harvest(together)).values())
        alone: dict[str, list[tuple]] = {}
        for n in names:
            config = make_config(tmp_path / f"alone-{n}", {n: urls[n]})
            assert (await harvest(config))[n].ok
            alone.update(held(config))
    got = held(together)
    assert got == alone
    assert sum(len(rows) for rows in got.values()) > 100
    async with open_context(together) as ctx:
        for rows in got.values():
            for _uri, sha, length, _deleted in rows:
                assert ctx.blobs.size(sha) == length


async def test_a_set_holding_no_row_looks_nothing_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new set's first baseline looks up no stored row (it holds none: one read says so, no lookup per
    batch); once it holds rows, its changes are looked up again and what is unchanged is not fetched."""
    looked_up: list[int] = []
    real_stored = pipeline.Pipeline._stored

    def stored(self, batch):
        looked_up.append(len(batch))
        return real_stored(self, batch)

    monkeypatch.setattr(pipeline.Pipeline, "_stored", stored)
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    n = pipeline.DIRECT_LOOKUP + 9  # more than a direct lookup takes at once
    for j in range(n):
        up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a")
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        first = (await harvest(config))["a"]
        assert first.ok and sum(s.fetched for s in first.stats) == n
        assert looked_up == []
        up.update("r0.txt", b"resource 0, changed", set_name="a")
        again = (await harvest(config))["a"]
    assert again.ok and sum(looked_up) == n
    assert sum(s.fetched for s in again.stats) == 1 and sum(s.unchanged for s in again.stats) == n - 1


async def test_a_set_seen_for_the_first_time_reads_nothing_at_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new set holds no row and no retry (one question in its first write's hop says so): its sync
    reads neither its retries nor its rows. Once it holds a retry (a resource that failed), the next
    sync reads them and tries the resource again."""
    reads: list[str] = []
    for name in ("pending_retries", "retry_uris", "iter_resources"):
        real = getattr(State, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(State, name, counted)
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    for j in range(4):
        up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a")
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        up.serve_503 = {"/a/res/r2.txt": 10}  # outlasts the retries of the first run
        first = (await harvest(config))["a"]
        assert [f.uri for f in first.failures] == [up.url("r2.txt", "a")]
        assert reads == []
        up.serve_503 = {}
        again = (await harvest(config))["a"]
    assert again.ok, again.error
    assert "pending_retries" in reads and "retry_uris" in reads
    with open_state(config) as state:
        set_id = state.sets("a")[0].id
        assert state.pending_retries(set_id) == [] and not state.holds_nothing(set_id)


@pytest.mark.parametrize("seed", range(3))
async def test_the_state_holds_the_status_each_sync_reported(tmp_path: Path, seed: int) -> None:
    """A sync's final status is written ahead with its last baseline's end when nothing after it can
    change it, else at its end: generated Sources (with and without Change List, empty, with resources
    that fail or announce a wrong hash, emptied later so that their snapshot is refused) harvested twice;
    each time the state holds exactly what each sync reported: its state, its error, its upstream notes,
    a success time only for "ok"."""
    rng = random.Random(seed)
    ups = [
        Upstream(sets=[f"p{i}" for i in range(6)], resource_dump=False, change_dump=False, change_list=False),
        Upstream(sets=[f"c{i}" for i in range(3)], resource_dump=False, change_dump=False),
    ]
    sources = {}
    # p0 is emptied later (its snapshot refused: degraded), p1 has a resource that keeps failing; the
    # others are drawn.
    for up in ups:
        for name in up.set_names:
            count = 3 if name in ("p0", "p1") else rng.choice([0, 1, 3])
            for j in range(count):
                path = f"{name}-r{j}.txt"
                up.create(path, f"{name} {j}".encode(), set_name=name)
                if (name == "p1" and j == 0) or (name != "p0" and rng.random() < 0.1):
                    up.serve_503[f"/{name}/res/{path}"] = 10
                elif name not in ("p0", "p1") and rng.random() < 0.1:
                    up.wrong_hash.add(path)
            sources[name] = (up, name)
    async with contextlib.AsyncExitStack() as stack:
        for up in ups:
            await stack.enter_async_context(up.serving())
        config = make_config(
            tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n, (up, _) in sources.items()}
        )
        succeeded: dict[str, datetime | None] = {}
        seen: set[tuple[bool, bool, bool]] = set()
        for round_ in range(2):
            if round_:  # some lose every resource (a refused snapshot where rows are held), some change
                for name, (up, _) in sources.items():
                    held = list(up.resources(set_name=name))
                    if held and (name == "p0" or (name != "p1" and rng.random() < 0.3)):
                        for path in held:
                            up.delete(path, set_name=name)
                    elif held:
                        up.update(held[0], f"{name} again".encode(), set_name=name)
            results = await harvest(config)
            with open_state(config) as state:
                rows = {row.name: row for row in state.sources()}
                for name, r in results.items():
                    row, notes = rows[name], state.upstream_notes(name)
                    want = "ok" if r.ok else "degraded" if r.skipped and not r.failures else "error"
                    assert (row.state, row.last_error) == (want, r.error), (round_, name)
                    assert {x["url"]: x["reason"] for x in notes["skipped"]} == r.skipped
                    assert [(x["rule"], x["count"]) for x in notes["deviations"]] == [
                        (d["rule"], d["count"]) for d in r.deviations
                    ]
                    if r.ok:  # a success time of this sync's own
                        assert row.last_success is not None and row.last_success != succeeded.get(name)
                    else:
                        assert row.last_success == succeeded.get(name)
                    succeeded[name] = row.last_success
            seen |= {(r.ok, bool(r.skipped), bool(r.failures)) for r in results.values()}
    assert {(True, False, False), (False, False, True), (False, True, False)} <= seen  # ok, failed, degraded


async def test_a_status_written_ahead_and_overtaken_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Were anything to change a sync's outcome after its status was written with its last baseline's
    end (here a list named unread once the baseline is over), the end of the sync writes the status it
    ends with: the state never keeps an "ok" the sync did not report."""
    real_announce = pipeline.Pipeline.announce

    async def announce(self, applied):
        await real_announce(self, applied)
        if applied and applied[0].change == "deleted":  # the baseline's end (its sweep), after its write
            deviations_mod.skip("http://example.org/late.xml", "named unread after the end")

    monkeypatch.setattr(pipeline.Pipeline, "announce", announce)
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    for j in range(3):
        up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a")
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        assert (await harvest(config))["a"].ok
        up.delete("r2.txt", set_name="a")
        with caplog.at_level(logging.WARNING, logger="rsagg.harvest"):
            result = (await harvest(config))["a"]
    assert not result.ok and result.skipped == {"http://example.org/late.xml": "named unread after the end"}
    assert "was overtaken" in caplog.text
    with open_state(config) as state:
        (row,) = state.sources()
        notes = state.upstream_notes("a")
    assert (row.state, row.last_error) == ("degraded", result.error)
    assert [x["url"] for x in notes["skipped"]] == ["http://example.org/late.xml"]


# -- a few syncs of one host at once (harvest/admission.py) ---------------------------------------------


def _admissions_run(rng: random.Random) -> tuple[list[dict], admission.Admissions, float]:
    """Syncs of a few hosts arriving at random times, each running a random time (some far longer than
    the lease), some cancelled while they wait; in virtual time. Returns each sync's record."""
    lease = 10.0
    adm = admission.Admissions(lease=lease)
    slots = {f"h{i}": rng.randrange(1, 4) for i in range(3)}
    syncs = [
        {"i": i, "host": rng.choice(list(slots)), "arrive": rng.uniform(0, 40), "hold": rng.choice(
            [rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(20, 60)]), "cancel_after": (
            rng.uniform(0.1, 15) if rng.random() < 0.15 else None), "admitted": None, "left": None}
        for i in range(rng.randrange(5, 60))
    ]  # fmt: skip

    async def one(s: dict) -> None:
        await trio.sleep(s["arrive"])
        url = f"http://{s['host']}.example:8080/caps.xml"
        with trio.move_on_after(s["cancel_after"] if s["cancel_after"] is not None else math.inf) as scope:
            async with adm.admitted(url, lambda host: slots[host.split(".")[0]]):
                scope.deadline = math.inf  # admitted: it runs to its end
                s["admitted"] = trio.current_time()
                await trio.sleep(s["hold"])
                s["left"] = trio.current_time()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for s in syncs:
                nursery.start_soon(one, s)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for s in syncs:
        s["most"] = admission.PER_SLOT * slots[s["host"]]
    return syncs, adm, lease


def test_syncs_of_a_host_are_admitted_a_few_at_a_time_first_come_first_served() -> None:
    """Whatever the arrivals, durations and cancellations: a host never has more than its share of syncs
    counted at once (admitted less than a lease ago, not ended); those that waited are admitted in the
    order they came; a sync waits only while its host is full; every sync not cancelled runs; nothing
    is left held or waiting; a long sync holds up the others for one lease at most."""
    rng = random.Random(2028)
    waited = expired_room = 0
    for _round in range(60):
        syncs, adm, lease = _admissions_run(rng)
        for s in syncs:
            if s["cancel_after"] is None:
                assert s["admitted"] is not None and s["left"] is not None, s
        ran = [s for s in syncs if s["admitted"] is not None]
        for s in ran:
            t, host = s["admitted"], s["host"]
            counted = [o for o in ran if o["host"] == host and o["admitted"] <= t
                       and o["admitted"] + lease > t and (o["left"] is None or o["left"] > t)]  # fmt: skip
            assert len(counted) <= s["most"], (s, counted)
            if t > s["arrive"] + 1e-9:  # it waited: its host was full (counting those ahead of it)
                waited += 1
                full = [o for o in ran if o["host"] == host and o["admitted"] <= s["arrive"]
                        and o["admitted"] + lease > s["arrive"]
                        and (o["left"] is None or o["left"] > s["arrive"])]  # fmt: skip
                ahead = [o for o in syncs if o["host"] == host and o["arrive"] < s["arrive"]
                         and (o["admitted"] or math.inf) > s["arrive"]]  # fmt: skip
                assert len(full) >= s["most"] or ahead, s
                # ...and it was let in when a place came free: one left, or a lease ended
                freed = [o for o in ran if o["host"] == host and (
                    abs((o["left"] or -1) - t) < 1e-9 or abs(o["admitted"] + lease - t) < 1e-9)]  # fmt: skip
                cancelled_then = [o for o in syncs if o["host"] == host and o["admitted"] is None
                                  and abs(o["arrive"] + o["cancel_after"] - t) < 1e-9]  # fmt: skip
                assert freed or cancelled_then, s
                expired_room += any(abs(o["admitted"] + lease - t) < 1e-9 for o in freed)
        by_host: dict[str, list[dict]] = {}
        for s in sorted(ran, key=lambda s: s["arrive"]):
            by_host.setdefault(s["host"], []).append(s)
        for host, order in by_host.items():
            admitted = [s["admitted"] for s in order]
            assert admitted == sorted(admitted), host  # first come, first served
        assert adm._hosts == {}
    assert waited > 100 and expired_room > 10  # the cases did reach full hosts and expired leases


async def test_a_url_without_a_host_is_never_held_back() -> None:
    adm = admission.Admissions()
    entered = 0
    async with trio.open_nursery() as nursery:
        for _ in range(10):

            async def one() -> None:
                nonlocal entered
                async with adm.admitted("file:///sources/caps.xml", lambda host: 1):
                    entered += 1
                    await trio.sleep_forever()

            nursery.start_soon(one)
        await wait_until(lambda: entered == 10)
        nursery.cancel_scope.cancel()


async def wait_until(condition, bound: float = 30.0) -> None:
    with trio.fail_after(bound):
        while not condition():
            await trio.sleep(0.01)


async def test_a_harvest_runs_a_few_syncs_of_one_host_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve Sources of one host, one request slot: at most two syncs run at once (``PER_SLOT`` per
    slot), and every Source ends "ok"."""
    running = most = 0
    real = source_mod._sync_admitted

    async def counted(ctx, src):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return await real(ctx, src)
        finally:
            running -= 1

    monkeypatch.setattr(source_mod, "_sync_admitted", counted)
    up, names = many_sources(12)
    async with up.serving():
        config = make_config(
            tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names}, per_host=1
        )
        results = await harvest(config)
    assert all(r.ok for r in results.values()) and len(results) == 12
    assert most == admission.PER_SLOT
    with open_state(config) as state:
        assert {s.name: s.state for s in state.sources()} == {n: "ok" for n in names}


# -- the garbage collector of the commands' processes (run/heap.py) ---------------------------------------


def test_settle_freezes_start_up_and_collects_the_young_less_often() -> None:
    """What start-up built leaves the collector's walks; the youngest generation is collected after
    ``YOUNG_THRESHOLD`` allocations, the older ones as before. (Restored after: the test process keeps
    its own settings, as any process that is not a command's.)"""
    import gc

    from aggregator.run import heap

    before = gc.get_threshold()
    try:
        gc.unfreeze()
        heap.settle()
        assert gc.get_freeze_count() > 1000
        assert gc.get_threshold() == (max(heap.YOUNG_THRESHOLD, before[0]), before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.parametrize("seed", range(6))
async def test_status_updates_waiting_in_a_row_are_one_write(tmp_path: Path, seed: int) -> None:
    """Generated: status updates (random fields) queued with ``write_later``, other writes between
    some of them. Updates in a row of one Source become one write of their fields (the later's win),
    and the Sources' rows end as when each update is written on its own."""
    rng = random.Random(seed)
    texts = ["ok", "error", "syncing", None, "x" * 3]
    steps: list[tuple] = []
    for _ in range(rng.randrange(1, 30)):
        name = rng.choice(["a", "b"])
        if rng.random() < 0.2:
            steps.append(("notes", name))
        else:
            fields = {
                f: rng.choice([1, 2, 7, None]) if f.startswith("progress_d") else rng.choice(texts)
                for f in rng.sample(
                    ["state", "last_error", "progress_done", "using_url"], rng.randrange(1, 4)
                )
            }
            steps.append(("status", name, fields))
    rows = []
    for merged in (True, False):
        config = make_config(
            tmp_path / f"store-{merged}", {"a": "http://127.0.0.1:1/a", "b": "http://127.0.0.1:1/b"}
        )
        async with open_context(config) as ctx:
            for name in ("a", "b"):
                ctx.writer.upsert_source(name, f"http://127.0.0.1:1/{name}")
            for step in steps:
                if merged:
                    if step[0] == "notes":
                        ctx.write_later(step[1], ctx.writer.put_upstream_notes, step[1], [], {})
                    else:
                        ctx.write_later(step[1], ctx.writer.set_source_status, step[1], **step[2])
                elif step[0] == "notes":
                    ctx.writer.put_upstream_notes(step[1], [], {})
                else:
                    ctx.writer.set_source_status(step[1], **step[2])
            if merged:
                for name in ("a", "b"):
                    queued = len(ctx._later.get(name, []))
                    runs = sum(1 for i, s in enumerate(steps) if s[1] == name and
                               (s[0] == "notes" or not any(p[1] == name for p in steps[:i]) or
                                [p for p in steps[:i] if p[1] == name][-1][0] == "notes"))  # fmt: skip
                    assert queued == runs
                    token = current_source.set(name)
                    try:
                        await ctx.write(lambda: None)
                    finally:
                        current_source.reset(token)
            rows.append([(s.name, s.state, s.last_error, s.progress_done, s.using_url)
                         for s in ctx.writer.sources()])  # fmt: skip
    assert rows[0] == rows[1]


def _one_limiter(limiter: trio.CapacityLimiter, reader: object) -> trio.CapacityLimiter:
    return limiter


@pytest.mark.parametrize("seed", range(4))
async def test_a_new_set_holds_the_same_with_or_without_its_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Generated: a new set's changes go straight to the fetch tasks (``pipeline._Unlooked``: nothing to
    look up). From a Resource List or a Resource Dump, with resources of random sizes, the store
    holds what the lookup task's way gives it (forced here by a reader that looks like a server's),
    and the second harvest's (a set with rows) finds everything unchanged."""
    rng = random.Random(seed)
    dump = rng.random() < 0.5
    up = Upstream(sets=["a"], resource_dump=dump, change_dump=False, change_list=False)
    for j in range(rng.choice([1, 5, 40, 130])):
        up.create(f"r{j}.txt", f"{seed} {j} ".encode().ljust(rng.choice([5, 700, 9000]), b"."), set_name="a")
    held = []
    async with up.serving():
        for looked_up in (False, True):
            if looked_up:  # a limiter: the reader is used off the event loop, so the set is not probed
                monkeypatch.setattr(
                    pipeline, "limiter_of", functools.partial(_one_limiter, trio.CapacityLimiter(1))
                )
            config = make_config(
                tmp_path / f"store-{looked_up}", {"a": up.doc_url("capabilitylist.xml", "a")}
            )
            first = await harvest(config)
            again = await harvest(config)
            assert first["a"].ok and again["a"].ok
            assert sum(s.fetched for s in again["a"].stats) == 0
            with open_state(config) as state:
                held.append(sorted((r.uri, r.sha256, r.length, r.deleted)
                                   for s in state.sets() for r in state.iter_resources(s.id)))  # fmt: skip
            monkeypatch.undo()
    assert held[0] == held[1] and held[0]


# -- what a sync made is freed when it ends -----------------------------------------------------------


#: Where what a sync makes comes from. Not connections (``aggregator.net``: a closed connection's
#: parser and its callbacks are a cycle, once per connection, not per sync) nor the test upstream's
#: server (``aggregator.run``, ``aggregator.testing``).
SYNC_MODULES = ("aggregator.harvest.", "aggregator.rs.", "aggregator.store.")


def _sync_garbage() -> Counter[str]:
    """Objects of a sync's making the collector found in reference cycles since ``gc.DEBUG_SAVEALL``
    was set."""
    gc.collect()
    kinds: Counter[str] = Counter()
    for o in gc.garbage:
        module = getattr(type(o), "__module__", "") or ""
        if module.startswith(SYNC_MODULES):
            kinds[f"{module}.{type(o).__qualname__}"] += 1
    return kinds


@pytest.mark.parametrize("seed", range(4))
async def test_what_a_sync_made_is_freed_without_the_garbage_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Sources of random sizes, with or without Change Lists, their documents read whole or streamed
    by a download task, some resources and one Resource List failing, harvested together, then changed
    and harvested again in the same context (lists unchanged since answer 304): no object made for a
    sync (its pipeline, its documents, their readers, spools and entries) is left in a reference cycle.
    Why: each sync of a small Source left about a hundred objects for the collector (a pipeline held by
    its fetch tasks' methods and its last write; a document by its end callback; an unchanged list's
    NotModified by trio's cancellation of the pipeline's tasks; a failed sync by its error's traceback),
    so the collector's work grew with the Sources synced, a daemon's all day."""
    rng = random.Random(seed)
    if seed % 2:  # every document streamed (the download task's path), not read whole
        monkeypatch.setattr(fetch_mod, "INLINE_DOCUMENT", 0)
    names = [f"s{i}" for i in range(rng.randrange(3, 8))]
    up = Upstream(sets=names, resource_dump=False, change_dump=False, change_list=seed >= 2)
    for name in names:
        for j in range(rng.choice([1, 4, 20, 60])):
            up.create(f"r{j}.txt", f"{name} {j} ".encode().ljust(rng.choice([30, 900, 20_000]), b"."),
                      set_name=name)  # fmt: skip

    failing = [n for n in names[:-1] if rng.random() < 0.4]

    async def sync_all(ctx: HarvestContext) -> None:
        results = {}

        async def one(src: SourceConfig) -> None:
            results[src.name] = await sync_source(ctx, src)

        async with trio.open_nursery() as nursery:
            for src in config.sources:
                nursery.start_soon(one, src)
        assert {n for n, r in results.items() if not r.ok} == {*failing, names[-1]}

    async with up.serving():
        # Some resources, and the last Source's Resource List, answer 503 past the retries.
        faults = {urlsplit(up.url("r0.txt", n)).path: 100 for n in failing}
        up.serve_503 = {**faults, urlsplit(up.doc_url("resourcelist.xml", names[-1])).path: 100}
        config = make_config(tmp_path / "store", {n: up.doc_url("capabilitylist.xml", n) for n in names})
        async with open_context(config) as ctx:  # one context for both harvests, as the daemon's
            gc.collect()
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                await sync_all(ctx)
                for name in names:
                    up.create("new.txt", f"{name} new".encode(), set_name=name)
                    up.update("r0.txt", f"{name} changed".encode(), set_name=name)
                await sync_all(ctx)
                left = _sync_garbage()
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert not left, "; ".join(f"{k} {v}" for k, v in sorted(left.items()))
