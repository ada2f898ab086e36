"""What an operator sees of the harvest: retries that end, a fallback that is named, hostile documents
named by rule and line, an honest lag for Sources without a Change List."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import trio
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from aggregator.cli import main
from aggregator.observe import report as status
from aggregator.rs import parse
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

from .harvesting import audit, harvest, make_config
from .httpserver import serve_app


@pytest.fixture(autouse=True)
def _keep_logging() -> Iterator[None]:
    """``main`` installs its own log handler on stderr; give the next tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _drop_silently(up: Upstream, path: str) -> None:
    """The upstream stops listing a resource without announcing a deletion (what a Source rebuilt from
    scratch by ``resync-build`` against another reference does)."""
    s = up._set(None)
    del s.resources[path]
    s.state_version += 1
    up.snapshot()


def _write_toml(tmp_path: Path, base: str) -> Path:
    path = tmp_path / "rsagg.toml"
    path.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[harvest]\nretries = 2\nbackoff_base = 0.01\n'
        f'backoff_max = 0.05\n[[sources]]\nname = "up"\nurl = "{base}"\n'
    )
    return path


async def test_retry_of_a_uri_no_longer_listed_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(5)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        up.create("new.txt", b"new")
        up.serve_503 = {"/default/res/new.txt": 10_000}  # it never comes
        r = (await harvest(cfg))["up"]
        assert not r.ok  # the change waits to be retried
        _drop_silently(up, "new.txt")
        assert await audit(cfg) == []  # the store matches what the upstream lists…
        caplog.set_level(logging.WARNING)
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error  # …and the source is no longer stuck in error
        assert "retries ended for 1 failed change(s)" in caplog.text and up.url("new.txt") in caplog.text
        r = (await harvest(cfg))["up"]
        assert r.ok and sum(s.seen for s in r.stats) == 0  # not tried again
        with State(cfg.store_path / "state.db") as state:
            row = status.collect(state, cfg)["sources"][0]
        assert row["state"] == "ok" and row["retries"] == {"waiting": 0, "ended": 1}
        assert "1 ended" in status.table({"sources": [row], "sets": []})

        path = _write_toml(tmp_path, base)
        capsys.readouterr()
        assert main(["retries", "-c", str(path), "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["retries"]
        assert [(r["uri"], r["state"]) for r in rows] == [(up.url("new.txt"), "ended")]
        assert rows[0]["message"].startswith("no longer listed upstream (last failure: http")
        assert main(["retries", "-c", str(path), "--clear"]) == 0
        assert "1 cleared" in capsys.readouterr().out
        assert main(["retries", "-c", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["retries"] == []


async def test_retry_of_a_listed_uri_goes_on(tmp_path: Path) -> None:
    """Still listed: the retry stays (the upstream should serve it), the source stays in error."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        up.update("r000001.txt", b"version two")
        up.serve_503 = {"/default/res/r000001.txt": 10_000}
        up.snapshot()
        for _ in range(3):
            assert not (await harvest(cfg))["up"].ok
        with State(cfg.store_path / "state.db") as state:
            assert status.collect(state, cfg)["sources"][0]["retries"] == {"waiting": 1, "ended": 0}


async def test_configured_url_answering_404_is_named_with_what_is_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    async with up.serving() as base:
        wrong = f"{base}/moved/capabilitylist.xml"
        cfg = make_config(tmp_path / "data", {"up": wrong})
        caplog.set_level(logging.WARNING)
        assert (await harvest(cfg))["up"].ok
        warning = next(r.getMessage() for r in caplog.records if "found by discovery" in r.getMessage())
        assert wrong in warning and "HTTP 404" in warning and up.doc_url("capabilitylist.xml") in warning
        path = _write_toml(tmp_path, wrong)
        capsys.readouterr()
        assert main(["status", "-c", str(path), "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["sources"][0]
        assert "HTTP 404" in row["using"] and up.doc_url("capabilitylist.xml") in row["using"]
        assert main(["status", "-c", str(path)]) == 0
        assert "configured URL not used" in capsys.readouterr().out
        # Configured right: nothing to say.
        cfg = make_config(tmp_path / "data", {"up": up.well_known_url})
        assert (await harvest(cfg))["up"].ok
        with State(cfg.store_path / "state.db") as state:
            assert status.collect(state, cfg)["sources"][0]["using"] is None


RL_HEAD = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    'xmlns:rs="http://www.openarchives.org/rs/terms/">\n'
    '<rs:md capability="resourcelist" at="2024-01-01T00:00:00Z"/>\n'
)
HOSTILE = {
    "url without loc": (
        RL_HEAD + "<url><lastmod>2024-01-01T00:00:00Z</lastmod></url>\n</urlset>\n",
        4,
        "<loc>",
    ),
    "rs:ln without href": (
        RL_HEAD + '<url><loc>LOC</loc>\n<rs:ln rel="describedby"/></url>\n</urlset>\n',
        5,
        "without href",
    ),
    "head rs:ln without href": (
        RL_HEAD + '<rs:ln rel="describedby"/>\n<url><loc>LOC</loc></url>\n</urlset>\n',
        4,
        "without href",
    ),
    "rs:ln without rel": (
        RL_HEAD + '<url><loc>LOC</loc><rs:ln href="LOC"/></url>\n</urlset>\n',
        4,
        "without rel",
    ),
}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pure-python"])
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_resource_list_is_named_by_rule_and_line(
    case: str, compiled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled and parse._speedups is None:
        pytest.skip("the compiled fast path is not built here")
    if not compiled:
        monkeypatch.setattr(parse, "_speedups", None)
    body, line, words = HOSTILE[case]
    holder: dict[str, str] = {}

    async def doc(request):
        return Response(body.replace("LOC", holder["base"] + "/r1"), media_type="application/xml")

    async def resource(request):
        return Response(b"r1", media_type="text/plain")

    app = Starlette(routes=[Route("/resourcelist.xml", doc), Route("/r1", resource)])
    async with serve_app(app) as base:
        holder["base"] = base
        cfg = make_config(tmp_path / "data", {"up": f"{base}/resourcelist.xml"})
        r = (await harvest(cfg))["up"]
    # The document is refused with the rule and its line (while listing entries, or while discovery reads
    # the head), never an AttributeError further on.
    assert not r.ok and "AttributeError" not in (r.error or "")
    assert f"resourcelist.xml:{line}: " in r.error or f"parse: line {line}: " in r.error, r.error
    assert words in r.error and "(§7: mandatory)" in r.error


async def test_lag_of_a_source_without_change_list_counts_from_its_last_read(tmp_path: Path) -> None:
    up = Upstream(resource_dump=False, change_dump=False, change_list=False)
    up.bulk_create(3)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        with State(cfg.store_path / "state.db") as state:
            first = state.source("up").last_success
            row = status.collect(state, cfg, now=first + timedelta(hours=1))["sources"][0]
        # The list's own `at` is in 2024 (the upstream's clock); the lag is the hour since the last read.
        assert row["lag_basis"] == "resource list" and row["lag_seconds"] == 3600.0
        assert (await harvest(cfg))["up"].ok  # unchanged upstream (a conditional GET): still a read
        with State(cfg.store_path / "state.db") as state:
            second = state.source("up").last_success
            row = status.collect(state, cfg, now=second + timedelta(seconds=5))["sources"][0]
        assert second > first and row["lag_seconds"] == 5.0
        # /metrics says the same (seconds since that read, not years since the upstream clock's `at`).
        from aggregator.observe.metrics import Metrics

        metrics = Metrics()
        with State(cfg.store_path / "state.db") as state:
            metrics.refresh_from_state(state)
        text = metrics.exposition().decode()
        lag = float(re.search(r'rsagg_sync_lag_seconds\{source="up"\} (\S+)', text).group(1))
        assert 0 <= lag < 600


async def test_plain_list_size_estimated_early_for_progress(tmp_path: Path) -> None:
    """A baseline from one big Resource List shows N/TOTAL with an ETA early on, not N/? to the end."""
    from aggregator.harvest.lists import Snapshot, resource_list_entries
    from aggregator.run.compose import open_context

    up = Upstream(resourcelist_page_size=50_000)
    up.bulk_create(3000)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        async with open_context(cfg) as ctx:
            counts: list[int] = []
            seen = 0
            entries = resource_list_entries(
                ctx.fetcher, up.doc_url("resourcelist.xml"), Snapshot(), on_count=counts.append
            )
            early: int | None = None
            async for _ in entries:
                await trio.sleep(0)  # a consumer (the pipeline) slower than the download
                seen += 1
                if counts and early is None:
                    early = seen
    # Estimated well before the end (once the document has arrived), within 1 %; exact at the end.
    assert early is not None and early <= 1500, early
    assert seen == 3000 and counts[-1] == 3000 and all(abs(c - 3000) <= 30 for c in counts)
