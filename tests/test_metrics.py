"""Operations: Prometheus metrics, the status page / ``status.json`` / ``rsagg status``, progress of a
long baseline, the Grafana dashboard, and ``rsagg demo`` as a user starts it.

The daemon runs in-process (``run_daemon``) against two demo Upstreams: "good" (with two resources of
identical content: one blob is deduplicated) and "bad" (one resource announces a wrong hash).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from aggregator import progress_text
from aggregator.cli import main
from aggregator.commands.harvest import harvest_once
from aggregator.config import load_config
from aggregator.harvest import context as harvest_context
from aggregator.harvest import progress as harvest_progress
from aggregator.harvest.progress import ProgressLine
from aggregator.harvest.source import sync_source
from aggregator.observe import report as status
from aggregator.observe.metrics import FAMILIES, Metrics, sample_names, status_class
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.validate import ERROR, validate_source
from aggregator.run.compose import open_context
from aggregator.run.daemon import run_daemon
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

REPO = Path(__file__).resolve().parent.parent
GUARD = 30  # seconds: a hung step fails the test instead of hanging the suite
DUP = b"the same bytes twice\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(folder: Path, sources: dict[str, str], port: int) -> Path:
    path = folder / "rsagg.toml"
    text = (
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "http://127.0.0.1:{port}"\n'
        '[store]\npath = "data"\n'
        "[harvest]\ninterval = 3600\njitter = 0\nretries = 1\nbackoff_base = 0.01\nbackoff_max = 0.05\n"
        "timeout = 10\nuse_dumps = false\n"
    )
    for name, url in sources.items():
        text += f'[[sources]]\nname = "{name}"\nurl = "{url}"\n'
    path.write_text(text)
    return path


def _samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted label pairs: value}."""
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for key, v in samples.get(name, {}).items() if want <= set(key))


def _check_conventions(text: str) -> None:
    """What promtool's linter checks, by the Prometheus naming conventions (also without promtool)."""
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("rsagg_")}
    assert families.keys() == FAMILIES.keys(), families.keys() ^ FAMILIES.keys()
    for name, fam in families.items():
        assert fam.type == FAMILIES[name], (name, fam.type)
        assert re.fullmatch(r"rsagg_[a-z0-9_]+", name) and fam.documentation, name
        assert not name.endswith("_total") and "_total_" not in name, name  # counters get _total added
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), name
        for unit in ("milliseconds", "microseconds", "kilobytes", "megabytes", "minutes", "hours"):
            assert unit not in name, name  # base units only
        for s in fam.samples:
            assert not {"host", "url", "uri", "path"} & s.labels.keys(), (name, s.labels)  # low cardinality


def _promtool(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # _check_conventions covers the naming rules
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    rsagg_problems = [ln for ln in done.stdout.decode().splitlines() if ln.startswith("rsagg_")]
    assert done.returncode == 0 and not rsagg_problems, done.stdout.decode() + done.stderr.decode()


async def _wait_synced(client: httpx.AsyncClient, base: str, names: set[str]) -> dict:
    """status.json once every source named has finished a sync."""
    with trio.fail_after(GUARD):
        while True:
            st = (await client.get(f"{base}/status.json")).json()
            rows = {r["name"]: r for r in st["sources"]}
            if all(rows[n]["state"] in ("ok", "error") and rows[n]["last_attempt"] for n in names):
                return st
            await trio.sleep(0.05)


async def test_metrics_status_and_page_of_a_running_daemon(tmp_path: Path, capsys: pytest.CaptureFixture):
    good = Upstream(resource_dump=False, change_dump=False)
    good.bulk_create(10)
    good.create("dup-a.txt", DUP, "text/plain")
    good.create("dup-b.txt", DUP, "text/plain")
    bad = Upstream(resource_dump=False, change_dump=False, wrong_hash=["b000002.txt"])
    bad.bulk_create(4, prefix="b")
    port = _free_port()
    async with good.serving() as gbase, bad.serving() as bbase:
        path = _write_config(
            tmp_path,
            {"good": f"{gbase}/.well-known/resourcesync", "bad": f"{bbase}/.well-known/resourcesync"},
            port,
        )
        config = load_config(path)
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as client:
            base = await nursery.start(lambda task_status: run_daemon(config, task_status=task_status))
            st = await _wait_synced(client, base, {"good", "bad"})
            good_set = {r["name"]: r for r in st["sources"]}["good"]["sets"][0]["set"]
            resource_url = rsagg_uri(config.server.base_url, good_set, f"{gbase}/default/res/r000001.txt")
            got = await client.get(resource_url)
            with trio.fail_after(GUARD):  # a request is counted when its handler returns, after the client
                while True:  # has the response: scrape until the resource request shows
                    r = await client.get(f"{base}/metrics")
                    if r.status_code != 200 or 'route="/{set}/r/{rest:path}"' in r.text:
                        break
                    await trio.sleep(0.02)
            text = r.text
            page = await client.get(f"{base}/")
            nursery.cancel_scope.cancel()

    assert got.status_code == 200 and got.content == b"resource r000001.txt\n"
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = _samples(text)
    # harvest: every good resource stored; the bad one with the wrong hash is a fixity error
    assert _value(m, "rsagg_resources_harvested_total", source="good") == 12
    assert _value(m, "rsagg_resources_harvested_total", source="bad") == 3
    assert _value(m, "rsagg_resources_deleted_total") == 0
    assert _value(m, "rsagg_errors_total", source="bad", kind="fixity") == 1
    assert _value(m, "rsagg_errors_total", source="good") == 0
    assert ("kind", "plugin") in {kv for key in m["rsagg_errors_total"] for kv in key}
    assert _value(m, "rsagg_syncs_total", source="good", result="ok") == 1
    assert _value(m, "rsagg_syncs_total", source="bad", result="error") == 1
    # upstream HTTP: bodies counted, by status class, labelled by source (never by host)
    assert _value(m, "rsagg_fetched_bytes_total", source="good") >= 10 * len(b"resource r000000.txt\n")
    ok_requests = _value(m, "rsagg_upstream_requests_total", source="good", status_class="2xx")
    assert ok_requests >= 12 + 3  # resources + well-known, Capability List, Resource List
    assert _value(m, "rsagg_fetch_duration_seconds_count", source="good") == _value(
        m, "rsagg_upstream_requests_total", source="good"
    )
    # the wrong hash was fetched again (fixity retry) before giving up
    assert _value(m, "rsagg_upstream_requests_total", source="bad", status_class="2xx") >= 4 + 3 + 1
    # sources, change stream
    assert _value(m, "rsagg_source_state", source="good", state="ok") == 1
    assert _value(m, "rsagg_source_state", source="bad", state="error") == 1
    assert _value(m, "rsagg_source_last_success_timestamp_seconds", source="good") > 1e9
    assert "bad" not in {dict(k).get("source") for k in m["rsagg_source_last_success_timestamp_seconds"]}
    assert _value(m, "rsagg_source_resources", source="good") == 12
    assert _value(m, "rsagg_sync_lag_seconds", source="good") >= 0
    assert set(m["rsagg_sync_lag_seconds"]) >= {(("source", "good"),)}
    assert _value(m, "rsagg_set_cursor_timestamp_seconds", source="good") > 1e9
    assert _value(m, "rsagg_changelog_last_seq") == 15
    # store: two resources with the same bytes are one blob (deduplicated in the commit)
    assert _value(m, "rsagg_store_dedup_objects_total") >= 1
    assert _value(m, "rsagg_store_dedup_saved_bytes_total") >= len(DUP)
    assert _value(m, "rsagg_store_written_objects_total") == 14  # 15 resources, one shared blob
    assert _value(m, "rsagg_store_objects") == 14
    assert _value(m, "rsagg_store_bytes") == _value(m, "rsagg_store_written_bytes_total")
    # served requests, by route template (never the raw path)
    served = m["rsagg_http_requests_total"]
    routes = {dict(k)["route"] for k in served}
    assert "/{set}/r/{rest:path}" in routes and "/status.json" in routes
    assert not any("r000001" in route for route in routes)
    assert _value(m, "rsagg_http_requests_total", route="/{set}/r/{rest:path}", method="GET", code="200") == 1
    assert _value(m, "rsagg_http_request_duration_seconds_count", route="/status.json") >= 1
    # notifications and hub: exposed (zero: the demo upstreams advertise no channels)
    assert _value(m, "rsagg_hub_deliveries_total", outcome="retry") == 0
    assert "rsagg_notifications_verified_total" in m and "rsagg_notifications_rejected_total" in m
    _check_conventions(text)
    _promtool(text)

    # status.json: each source and each published set
    rows = {r["name"]: r for r in st["sources"]}
    assert rows["good"]["state"] == "ok" and rows["good"]["resources"] == 12
    assert rows["good"]["last_success"] and rows["good"]["lag_seconds"] is not None
    assert rows["good"]["progress"] is None  # nothing running
    assert rows["bad"]["state"] == "error" and "b000002.txt" in rows["bad"]["last_error"]
    # The fixity mismatch is tried twice and fails the same way: said once, not the same block twice.
    assert rows["bad"]["last_error"].count("sha-256: expected") == 1, rows["bad"]["last_error"]
    assert rows["bad"]["resources"] == 3
    sets = {s["name"]: s for s in st["sets"]}
    assert {s["resources"] for s in sets.values()} == {12, 3}
    assert {tuple(s["sources"]) for s in sets.values()} == {("good",), ("bad",)}
    # the page: same rows, and the script that polls status.json
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, state, n in (("good", "ok", 12), ("bad", "error", 3)):
        row = re.search(rf'<tr data-source="{name}">(.*?)</tr>', page.text).group(1)
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[0].split("<")[0] == name and f">{state}</span>" in cells[1] and cells[2] == str(n)
    assert "retries: 1 waiting" in page.text  # the bad source's failed change waits to be retried
    assert "fetch(location.pathname" in page.text and "setInterval(refresh" in page.text
    for name, s in sets.items():
        assert f'<li data-set="{name}"><strong>{name}</strong>: {s["resources"]} resources' in page.text

    # rsagg status: the same rows (one function computes them), as JSON and as a table
    capsys.readouterr()
    assert main(["status", "-c", str(path), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)

    def stable(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ("lag_seconds", "lag")} for r in rows]

    assert stable(cli["sources"]) == stable(st["sources"]) and cli["sets"] == st["sets"]
    assert main(["status", "-c", str(path)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^good\s+ok\s+12\s", table, re.M) and re.search(r"^bad\s+error\s+3\s", table, re.M)
    assert "CAPABILITY LIST" in table


async def test_progress_of_a_long_baseline(tmp_path: Path, monkeypatch, caplog):
    """A Resource List Index of 6 parts, slow upstream: done/total shows in the state (rsagg status,
    the status page), in /metrics, in the log, and on the terminal line, while the baseline runs."""
    monkeypatch.setattr(harvest_context, "PROGRESS_SAVE_EVERY", 0.05)
    monkeypatch.setattr(harvest_progress, "LOG_EVERY", 0.2)
    caplog.set_level(logging.INFO, logger="rsagg.harvest")
    n = 120
    up = Upstream(resource_dump=False, change_dump=False, resourcelist_page_size=20, latency=0.02)
    up.bulk_create(n)
    async with up.serving() as ubase:
        path = _write_config(tmp_path, {"up": f"{ubase}/.well-known/resourcesync"}, _free_port())
        text = path.read_text().replace(
            "use_dumps = false\n", "use_dumps = false\nworkers = 2\nbatch_size = 5\n"
        )
        path.write_text(text)
        config = load_config(path)
        seen: list[tuple[int, int | None]] = []
        async with open_context(config) as ctx, trio.open_nursery() as nursery:
            nursery.start_soon(sync_source, ctx, config.sources[0])
            line = ProgressLine(io.StringIO(), ctx.progress)
            watcher = State(config.store_path / "state.db", readonly=True)  # takes no write lock
            try:
                with trio.fail_after(GUARD):
                    while True:
                        row = watcher.source("up")
                        if row and row.state == "syncing" and row.progress_done:
                            seen.append((row.progress_done, row.progress_total))
                            if row.progress_total == n and row.progress_done < n:
                                break
                        await trio.sleep(0.01)
                running = status.collect(watcher, config)["sources"][0]
                ctx.metrics.refresh_from_state(watcher)
                scraped = _samples(ctx.metrics.exposition().decode())
                line_text = line.text()
            finally:
                watcher.close()
        done = State(config.store_path / "state.db")
        try:
            final = done.source("up")
        finally:
            done.close()
    # while running: done/total, rate, ETA from the state; the same in /metrics and on the terminal
    prog = running["progress"]
    assert running["state"] == "syncing" and 0 < prog["done"] < n and prog["total"] == n
    assert prog["text"].startswith(f"{prog['done']}/{n} (")
    assert prog["rate"] is not None and prog["rate"] > 0 and prog["eta_seconds"] is not None
    assert 0 < _value(scraped, "rsagg_sync_progress_done", source="up") < n
    assert _value(scraped, "rsagg_sync_progress_expected", source="up") == n
    assert re.fullmatch(rf"up: \[[#.]{{12}}\] \d+/{n} \(\d+\.\d%\).*", line_text), line_text
    # the index of 6 parts first counts as 6 full lists (§10.2), then by the parts read
    assert seen[0][1] in (6 * 50_000, n) and seen[-1][1] == n
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    # in the log, every LOG_EVERY seconds
    assert any("baseline progress: " in r.getMessage() and f"/{n}" in r.getMessage() for r in caplog.records)
    # finished: the final figures
    assert final.state == "ok" and (final.progress_done, final.progress_total) == (n, n)


def test_progress_line_and_helpers():
    out = io.StringIO()
    line = ProgressLine(out, {"a": (5, 10), "b": (3, None)}, width=200)
    line.draw()
    assert out.getvalue().startswith("\r\x1b[K") and "a: [######......] 5/10 (50.0%)" in out.getvalue()
    assert "b: 3 so far (total not known yet)" in out.getvalue()
    line.clear()
    assert out.getvalue().endswith("\r\x1b[K")
    assert progress_text.format_duration(3725) == "1h02m" and progress_text.format_duration(65) == "1m05s"
    p = progress_text.figures(25, 100, 5.0)
    assert (p["percent"], p["rate"], p["eta_seconds"]) == (25.0, 5.0, 15.0)
    assert [status_class(s) for s in (200, 304, 404, 503, None)] == ["2xx", "3xx", "4xx", "5xx", "error"]


def test_progress_rate_is_what_arrives_now_not_the_average_since_the_start():
    """A dump baseline counts nothing while its package downloads: then ~1,000/s arrive. The rate says
    ~1,000/s (over RATE_WINDOW), not the whole run's average (which said 9.6/s)."""
    now = [0.0]
    reports: list[tuple] = []
    p = harvest_progress.Progress("a", lambda *r: reports.append(r), clock=lambda: now[0])
    now[0] = 100.0  # discovery, the download and the manifest's first pass: nothing counted
    p.set_total(10_000)
    p.add(256)
    assert p.rate() is None  # one batch spans no time
    for _ in range(8):
        now[0] += 0.256
        p.add(256)
    assert p.rate() == pytest.approx(1000.0)
    assert p.figures()["rate"] == pytest.approx(1000.0) and p.figures()["eta_seconds"] is not None
    assert reports[-1] == ("a", 9 * 256, 10_000, pytest.approx(1000.0))
    for _ in range(200):  # slower later: the window forgets the fast start
        now[0] += 1.0
        p.add(100)
    assert p.rate() == pytest.approx(100.0, rel=0.05)
    # what the harvester saves beside done/total, and what the status reads back
    assert progress_text.saved_rate(progress_text.progress_figures(123.456)) == 123.46
    assert progress_text.saved_rate(None) is None and progress_text.saved_rate("a URL") is None


async def test_a_dump_baseline_counts_towards_its_manifests(tmp_path: Path, monkeypatch):
    """The total of a baseline from a Resource Dump is known once its package's manifest is read."""
    n = 300
    up = Upstream(change_dump=False)
    up.bulk_create(n)
    reports: list[tuple] = []
    async with up.serving() as ubase:
        path = _write_config(tmp_path, {"up": f"{ubase}/.well-known/resourcesync"}, _free_port())
        path.write_text(
            path.read_text().replace("use_dumps = false\n", "use_dumps = true\nbatch_size = 10\n")
        )
        config = load_config(path)
        async with open_context(config) as ctx:
            update = ctx.progress_update
            monkeypatch.setattr(ctx, "progress_update", lambda *r: (reports.append(r), update(*r)))
            result = await sync_source(ctx, config.sources[0])
    assert result.ok and result.baselines == 1, result.error
    assert sum(s.seen for s in result.stats) == n and not any(s.fetched for s in result.stats)  # the dump
    early = [r for r in reports if r[1] < n]
    assert early and all(total == n for _, _, total, _ in early), reports[:5]
    assert any(rate for *_, rate in reports)


def test_metrics_objects_do_not_collide():
    """Each Metrics has its own registry: two in one process (tests, several apps) count apart."""
    a, b = Metrics(), Metrics()
    a.committed("x", [SimpleNamespace(change="created")] * 3, ())
    assert 'rsagg_resources_harvested_total{source="x"} 3.0' in a.exposition().decode()
    assert 'source="x"' not in b.exposition().decode()


@pytest.mark.parametrize("seed", range(8))
def test_fetch_families_expose_what_prometheus_objects_would(seed: int) -> None:
    """``fetch_hook`` keeps plain sums; its three families must read exactly as prometheus-client's own
    Counter and Histogram objects would after the same requests: generated requests (sources, every
    status class and none, durations on and around every bucket bound, zero and large bodies)."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from aggregator.observe.metrics import FETCH_BUCKETS
    from aggregator.scope import current_source

    rng = random.Random(seed)
    ours = Metrics()
    ref = CollectorRegistry()
    nbytes = Counter("rsagg_fetched_bytes", "b", ["source"], registry=ref)
    requests = Counter("rsagg_upstream_requests", "r", ["source", "status_class"], registry=ref)
    durations = Histogram(
        "rsagg_fetch_duration_seconds", "d", ["source"], buckets=FETCH_BUCKETS, registry=ref
    )
    edges = [b + d for b in FETCH_BUCKETS for d in (-1e-9, 0.0, 1e-9)] + [0.0, 1e6]
    for _ in range(rng.randrange(1, 300)):
        source = rng.choice(["", "a", "b", "c d"])
        status = rng.choice([None, 100, 200, 204, 304, 404, 410, 500, 503, 99, 600])
        seconds = rng.choice(edges) if rng.random() < 0.5 else rng.uniform(0, 200)
        size = rng.choice([0, 1, rng.randrange(10**9)])
        token = current_source.set(source)
        try:
            ours.fetch_hook("host", status, seconds, size)
        finally:
            current_source.reset(token)
        requests.labels(source, status_class(status)).inc()
        durations.labels(source).observe(seconds)
        nbytes.labels(source).inc(size)

    def samples(text: str) -> set[tuple[str, tuple, float]]:
        names = ("rsagg_fetched_bytes", "rsagg_upstream_requests", "rsagg_fetch_duration_seconds")
        return {
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text)
            if fam.name in names
            for s in fam.samples
            if not s.name.endswith("_created")
        }

    from prometheus_client import generate_latest

    got, want = samples(ours.exposition().decode()), samples(generate_latest(ref).decode())
    assert got == want and want


def _reference_harvest_registry() -> tuple[object, ...]:
    """prometheus-client's own objects for the harvest families, defined as rsagg defined them before it
    kept plain sums (names, help, labels and buckets copied, so that a drift of ours shows)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    r = CollectorRegistry()
    harvested = Counter(
        "rsagg_resources_harvested",
        "Resources stored (created or updated) by harvesting",
        ["source"],
        registry=r,
    )
    deleted = Counter("rsagg_resources_deleted", "Resources tombstoned by harvesting", ["source"], registry=r)
    syncs = Counter(
        "rsagg_syncs",
        "Syncs of a source finished, by result: ok, degraded, error",
        ["source", "result"],
        registry=r,
    )
    deviations = Counter(
        "rsagg_upstream_deviations",
        "Deviations from the specification tolerated in upstream documents, by rule "
        "(aggregator/harvest/deviations.py)",
        ["source", "rule"],
        registry=r,
    )
    reconciliations = Counter(
        "rsagg_reconciliations",
        "Reconciliations of a set with its Resource List (harvest/reconcile.py), by result: in_sync, "
        "repaired, unrepaired (a repair failed), incomplete (a list could not be read)",
        ["source", "result"],
        registry=r,
    )
    repairs = Counter(
        "rsagg_reconcile_repairs",
        "Differences from the Resource List repaired by reconciliation, by the change applied "
        "(created: missed creation, updated: missed update, deleted: held but not listed)",
        ["source", "kind"],
        registry=r,
    )
    duration = Histogram(
        "rsagg_sync_duration_seconds",
        "Duration of a sync of a source",
        ["source"],
        registry=r,
        buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 48 * 3600),
    )
    return r, harvested, deleted, syncs, deviations, reconciliations, repairs, duration


HARVEST_FAMILIES = ("rsagg_resources_harvested", "rsagg_resources_deleted", "rsagg_syncs",
                    "rsagg_upstream_deviations", "rsagg_reconciliations", "rsagg_reconcile_repairs",
                    "rsagg_sync_duration_seconds")  # fmt: skip
_HARVEST_LINE = re.compile(
    rf"(# (HELP|TYPE) )?({'|'.join(HARVEST_FAMILIES)})(_total|_bucket|_count|_sum|_created)?[{{ ]"
)


def _harvest_lines(text: str) -> str:
    """The lines of ``text`` (HELP, TYPE, samples, ``_created`` ones too) of the harvest families."""
    return "".join(ln for ln in text.splitlines(keepends=True) if _HARVEST_LINE.match(ln))


@pytest.mark.parametrize("seed", range(10))
def test_harvest_families_expose_what_prometheus_objects_would(seed: int) -> None:
    """``committed``, ``sync_finished``, ``reconciled`` and ``deviation`` keep plain sums; their families
    must read byte for byte as prometheus-client's Counter and Histogram objects would after the same
    events (family order, HELP and TYPE, series in the order they first happened, label escaping):
    generated events over many sources (syncs ok, degraded and error; durations on and around every
    bucket bound, 0, negative, infinite, NaN; batches of creations, updates and deletions, empty ones;
    reconciliations with and without repairs; deviations). The errors family exposes every kind of each
    source that synced or failed, 0 until it happens."""
    import random

    from prometheus_client import generate_latest

    from aggregator.observe.metrics import ERROR_KINDS, SYNC_BUCKETS

    rng = random.Random(seed)
    ours = Metrics(process=False)
    ref, harvested, deleted, syncs, deviations, reconciliations, repairs, duration = (
        _reference_harvest_registry()
    )
    sources = [f"s{i}" for i in range(rng.randrange(1, 60))] + ["", 'q"uo\\te\nnl', "é"]
    edges = [b + d for b in SYNC_BUCKETS for d in (-1e-9, 0.0, 1e-9)] + [0.0, -1.0, 1e9, float("inf")]
    if seed % 3 == 0:
        edges.append(float("nan"))
    expected_errors: dict[tuple[str, str], int] = {}
    exposed_sources: set[str] = set()
    for _ in range(0 if seed == 0 else rng.randrange(1, 600)):
        source = rng.choice(sources)
        event = rng.random()
        if event < 0.35:
            ok = rng.random() < 0.6
            degraded = not ok and rng.random() < 0.5
            exc = None if ok or degraded or rng.random() < 0.3 else ValueError("boom")
            seconds = rng.choice(edges) if rng.random() < 0.6 else rng.uniform(0, 200_000)
            ours.sync_finished(source, ok, seconds, exc, degraded=degraded)
            syncs.labels(source, "ok" if ok else "degraded" if degraded else "error").inc()
            duration.labels(source).observe(seconds)
            exposed_sources.add(source)
            if exc is not None:
                expected_errors[(source, "sync")] = expected_errors.get((source, "sync"), 0) + 1
        elif event < 0.75:
            changes = [
                rng.choice(["created", "updated", "deleted"]) for _ in range(rng.choice([0, 1, 3, 50]))
            ]
            if rng.random() < 0.2:
                changes = ["deleted"] * len(changes)
            kinds = [rng.choice(["fixity", "http", "parse"]) for _ in range(rng.choice([0, 0, 1, 2]))]
            ours.committed(
                source, [SimpleNamespace(change=c) for c in changes], [SimpleNamespace(kind=k) for k in kinds]
            )
            stored = sum(c != "deleted" for c in changes)
            if stored:
                harvested.labels(source).inc(stored)
            if len(changes) > stored:
                deleted.labels(source).inc(len(changes) - stored)
            for k in kinds:
                expected_errors[(source, k)] = expected_errors.get((source, k), 0) + 1
                exposed_sources.add(source)
        elif event < 0.9:
            result = rng.choice(["in_sync", "repaired", "unrepaired", "incomplete"])
            repaired = {k: rng.choice([0, 0, 1, 7]) for k in ("created", "updated", "deleted")}
            ours.reconciled(source, result, repaired)
            reconciliations.labels(source, result).inc()
            for kind, n in repaired.items():
                if n:
                    repairs.labels(source, kind).inc(n)
        else:
            rule = rng.choice(["relative-loc", "no-md", "bad-lastmod"])
            ours.deviation(source, rule)
            deviations.labels(source, rule).inc()

    text = ours.exposition().decode()
    want = generate_latest(ref).decode()
    assert _harvest_lines(text) == want
    assert want.count("# TYPE") == 7
    # rsagg_errors: each source that synced or failed, every kind (but "plugin": not by source)
    got_errors = {
        (s.labels["source"], s.labels["kind"]): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "rsagg_errors"
        for s in fam.samples
        if s.labels["source"] or s.labels["kind"] != "plugin"
    }
    kinds = [k for k in ERROR_KINDS if k != "plugin"]
    model = {(s, k): expected_errors.get((s, k), 0) for s in exposed_sources or {""} for k in kinds}
    assert got_errors == model


def test_notification_and_plugin_counters_are_exposed():
    """Counts kept by the notification parts (``Notifications.counters``) and ``Plugins.failures`` are
    read when scraped, under rsagg's names."""

    notes = SimpleNamespace(
        counters={"hub.delivery.ok": 5, "hub.delivery.retry": 2, "hub.verification.subscribed": 1,
                  "hub.publish.accepted": 4, "notifier.published.change": 3,
                  "subscriber.delivery.accepted": 6, "subscriber.delivery.parse_error": 1,
                  "subscriber.delivery.bad_signature": 2, "subscriber.delivery.unsigned": 1,
                  "subscriber.notice.applied": 5, "subscriber.notice.gap": 1,
                  "subscriber.subscribe.requested": 2, "subscriber.renewals": 1}
    )  # fmt: skip
    plugins = SimpleNamespace(failures={"broken": 3}, names=lambda: ["broken", "fine"])
    m = Metrics(process=False, notifications=lambda: notes, plugins=lambda: [plugins])
    got = _samples(m.exposition().decode())
    assert _value(got, "rsagg_hub_deliveries_total", outcome="ok") == 5
    assert _value(got, "rsagg_hub_deliveries_total", outcome="retry") == 2
    assert _value(got, "rsagg_hub_deliveries_total", outcome="gone") == 0
    assert _value(got, "rsagg_hub_verifications_total", outcome="subscribed") == 1
    assert _value(got, "rsagg_hub_publishes_total") == 4
    assert _value(got, "rsagg_notifications_published_total", kind="change") == 3
    assert _value(got, "rsagg_notifications_received_total") == 6 + 1 + 2 + 1
    assert _value(got, "rsagg_notifications_verified_total") == 6 + 1
    assert _value(got, "rsagg_notifications_rejected_total") == 3
    assert _value(got, "rsagg_notifications_rejected_total", reason="bad_signature") == 2
    assert _value(got, "rsagg_notifications_processed_total", outcome="applied") == 5
    assert _value(got, "rsagg_upstream_subscriptions_total", outcome="renewed") == 1
    assert _value(got, "rsagg_plugin_failures_total", plugin="broken") == 3
    assert _value(got, "rsagg_plugin_failures_total", plugin="fine") == 0
    assert _value(got, "rsagg_errors_total", kind="plugin") == 3


async def test_harvest_once_draws_a_progress_line(tmp_path: Path):
    """``harvest --once`` on a terminal: a line redrawn in place while a baseline runs, gone at the end."""
    up = Upstream(resource_dump=False, change_dump=False, latency=0.02)
    up.bulk_create(60)
    err = io.StringIO()
    async with up.serving() as ubase:
        path = _write_config(tmp_path, {"up": f"{ubase}/.well-known/resourcesync"}, _free_port())
        path.write_text(path.read_text().replace("use_dumps = false\n", "use_dumps = false\nworkers = 2\n"))
        (result,) = await harvest_once(load_config(path), [], progress_to=err)
    assert result.ok
    drawn = err.getvalue()
    assert re.search(r"\r\x1b\[Kup: (\[[#.]{12}\] )?\d+/", drawn), drawn
    assert drawn.endswith("\r\x1b[K")  # cleared before the results are printed


# --------------------------------------------------------------------------- Grafana

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "bool", "offset", "inf", "nan"}  # fmt: skip


def _metric_names(expr: str) -> set[str]:
    """Identifiers of a PromQL expression that name series (not functions, keywords, labels)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # label lists
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        word, rest = m.group(0), e[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue  # a function call or a keyword
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] in ".$"):
            continue  # 1e3, $var
        names.add(word)
    return names


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + [
            e for v in node.values() for e in _exprs(v)
        ]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_grafana_dashboard_uses_only_exposed_metrics():
    dashboard = json.loads((REPO / "config" / "grafana-dashboard.json").read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 15
    exposed = sample_names()
    used = set()
    for expr in exprs:
        names = _metric_names(expr)
        assert names, expr
        assert names <= exposed, (expr, names - exposed)
        used |= names
    titles = " ".join(p.get("title", "") for p in dashboard["panels"]).lower()
    for topic in ("harvest", "bytes", "errors", "lag", "last success", "status class", "latency",
                  "notifications", "hub", "store", "dedup", "served"):  # fmt: skip
        assert topic in titles, topic
    # every family shows somewhere, except a few that are for alerts and ad-hoc queries
    unused = {n for n in FAMILIES if not any(u == n or u.startswith(n + "_") for u in used)}
    assert unused <= {"rsagg_build_info", "rsagg_source_last_attempt_timestamp_seconds"}, unused
    assert _metric_names('histogram_quantile(0.99, sum by (le) (rate(x_bucket{a="b"}[5m])))') == {"x_bucket"}


# --------------------------------------------------------------------------- rsagg demo


async def test_demo_serves_a_valid_source(tmp_path: Path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "aggregator", "demo", "--port", "0", "--duration", "40", "--resources", "20",
           "--data", str(tmp_path / "demo"), "--log-level", "warning"]  # fmt: skip
    proc = await trio.lowlevel.open_process(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    output = b""
    try:
        with trio.fail_after(GUARD):
            while b"rsagg Source Description" not in output or not output.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, output.decode()
                output += chunk
            url = re.search(rb"rsagg Source Description\s+(\S+)", output).group(1).decode()
            async with httpx.AsyncClient(timeout=10) as client:
                while True:  # served at once; lists the set once the first sync has created it
                    r = await client.get(url)
                    assert r.status_code == 200, r.text
                    if b"capabilitylist.xml" in r.content:
                        break
                    await trio.sleep(0.1)
                cap_url = re.search(rb"<loc>([^<]+capabilitylist\.xml)</loc>", r.content).group(1).decode()
                cap = await client.get(cap_url)
                # The home page says why the demo holds twice --resources (each has a metadata record).
                home = await client.get(url.removesuffix("/.well-known/resourcesync") + "/")
                assert "20 resources, each with a metadata record" in home.text, home.text
                assert "40 resources at the start" in home.text
        assert b"40 resources at the start" in output  # and so does its start-up message
        issues = [i for i in validate_source(r.content, url) if i.severity == ERROR]
        assert issues == [], issues
        assert [i for i in validate_source(cap.content, cap_url) if i.severity == ERROR] == []
        assert url.startswith("http://127.0.0.1:") and url.endswith("/.well-known/resourcesync")
    finally:
        proc.send_signal(2)  # SIGINT: the demo stops its daemon and upstream
        with trio.move_on_after(15) as cs:
            await proc.wait()
        if cs.cancelled_caught:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
