"""Every request made on behalf of a source carries that source's context (harvest/access.py
``for_source``): its credentials, its rate, its address rules, its metrics label — whoever calls the work.

The upstreams here refuse any request without the source's bearer token (401). Each entry point of
harvest/ is called from a task that acts for no source (as ``rsagg audit``, a subscriber or a future
command would call it), and every request the Fetcher made is checked: made for the source, never refused.
A structural test holds every public entry point of harvest/ (now and later) to the wrapper, and the
acceptance test runs ``rsagg harvest --once`` and ``rsagg audit`` as an operator does.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import aggregator.harvest
from aggregator.config import Config, parse_config
from aggregator.harvest.audit import audit_source, expected_entries, still_listed
from aggregator.harvest.baseline import run_baseline
from aggregator.harvest.context import HarvestContext
from aggregator.harvest.discovery import SetInfo, discover
from aggregator.harvest.incremental import run_incremental
from aggregator.harvest.notices import NotifiedHarvest
from aggregator.harvest.oaipmh import OaiHarvest, set_key, sync_oaipmh
from aggregator.harvest.pipeline import Failure, Pipeline, PipelineStats, Work
from aggregator.harvest.source import end_unlisted_retries, poll_source, retry_failed, sync_source
from aggregator.rs.model import UPDATED, Entry, Md
from aggregator.run.compose import open_context
from aggregator.scope import current_source
from aggregator.testing.upstream import Upstream

from .harvesting import held, rsagg
from .httpserver import serve_app
from .oaiserver import OaiApp, Repository

TOKEN = "ctx-bearer-7c1d-SECRET"
NAME = "guarded"


class Guard:
    """ASGI: 401 for any request without the bearer token; counts what it saw and refused."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen = 0
        self.refused: list[str] = []
        self.agents: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.seen += 1
            self.agents.add(headers.get("user-agent", ""))
            if headers.get("authorization") != f"Bearer {TOKEN}":
                self.refused.append(scope["path"])
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"token required"})
                return
        await self.app(scope, receive, send)


def guarded_config(tmp_path: Path, url: str, kind: str = "resourcesync", **more) -> Config:
    source = {"name": NAME, "url": url, "auth": {"bearer_token_env": "CTX_TOKEN"}, **more}
    if kind != "resourcesync":
        source["kind"] = kind
    return parse_config(
        {
            "store": {"path": str(tmp_path / "data")},
            "harvest": {"retries": 1, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10,
                        "user_agent": "ctx-test-agent/1"},
            "sources": [source],
        },
        str(tmp_path / "t.toml"),
    )  # fmt: skip


@dataclass
class Env:
    ctx: HarvestContext
    up: Upstream
    made: list[tuple[str, str]]  # (the source a request was made for, its URL)
    info: SetInfo | None = None
    set_id: int = 0

    @property
    def src(self):
        return self.ctx.config.sources[0]

    def uri(self, path: str) -> str:
        return self.up.url(path)


@asynccontextmanager
async def guarded_source(tmp_path: Path, monkeypatch) -> AsyncGenerator[tuple[Env, Guard], None]:
    """A bearer-token ResourceSync Source with four resources, baselined; requests recorded."""
    monkeypatch.setenv("CTX_TOKEN", TOKEN)
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(4)
    guard = Guard(up.app())
    async with serve_app(guard) as base:
        up.public_url = base
        cfg = guarded_config(tmp_path, f"{base}/.well-known/resourcesync")
        async with open_context(cfg) as ctx:
            made: list[tuple[str, str]] = []
            hook = ctx.fetcher.request_hook
            assert hook is not None

            async def recorded(request) -> None:
                made.append((current_source.get(), str(request.url)))
                await hook(request)

            ctx.fetcher.request_hook = recorded
            env = Env(ctx, up, made)
            assert (await sync_source(ctx, env.src)).ok
            (env.info,) = await _bare(lambda: _discover(env))
            (s,) = await ctx.read(ctx.reader.sets, NAME)
            env.set_id = s.id
            made.clear()
            yield env, guard


async def _discover(env: Env) -> list[SetInfo]:
    token = current_source.set(NAME)  # a building block: discovery acts for whoever calls it
    try:
        return await discover(env.ctx.fetcher, env.src.url)
    finally:
        current_source.reset(token)


async def _bare(work: Callable[[], Awaitable]):
    """Run ``work`` in a task that acts for no source (as ``rsagg audit`` calls into harvest/)."""
    assert current_source.get() == ""
    out = []

    async def task() -> None:
        out.append(await work())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(task)
    assert current_source.get() == ""  # nothing leaked into the caller
    return out[0]


# -- the entry points, each with what it must achieve ---------------------------------------------------


async def case_sync_source(env: Env) -> None:
    env.up.update("r000001.txt", b"v2")
    result = await sync_source(env.ctx, env.src)
    assert result.ok, result.error
    assert held(env.ctx.config)[env.uri("r000001.txt")] is not None


async def case_poll_source(env: Env) -> None:
    env.up.update("r000002.txt", b"v2 polled")
    before = held(env.ctx.config)[env.uri("r000002.txt")]
    with trio.move_on_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_source, env.ctx, env.src)
            while held(env.ctx.config)[env.uri("r000002.txt")] == before:
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert held(env.ctx.config)[env.uri("r000002.txt")] != before


async def case_audit_source(env: Env) -> None:
    assert [d async for d in audit_source(env.ctx, env.src)] == []


async def case_expected_entries(env: Env) -> None:
    assert env.info is not None
    async with aclosing(expected_entries(env.ctx, env.info, NAME)) as entries:
        locs = {e.loc async for e in entries}
    assert locs == {env.uri(p) for p in env.up.resources()}


async def case_still_listed(env: Env) -> None:
    assert env.info is not None
    env.up.delete("r000000.txt")
    asked = {env.uri("r000000.txt"), env.uri("r000003.txt")}
    assert await still_listed(env.ctx, env.info, NAME, asked) == {env.uri("r000003.txt")}


async def case_run_baseline(env: Env) -> None:
    assert env.info is not None
    env.up.create("new.txt", b"new")
    assert await run_baseline(env.ctx, env.info, env.set_id, NAME) is not None
    assert env.uri("new.txt") in held(env.ctx.config)


async def case_run_incremental(env: Env) -> None:
    assert env.info is not None
    env.up.update("r000003.txt", b"v2 incremental")
    cursor = await env.ctx.read(env.ctx.reader.cursor, env.set_id)
    stats = await run_incremental(env.ctx, env.info, env.set_id, NAME, cursor)
    assert stats.applied.get(UPDATED) == 1, stats


async def case_pipeline_run(env: Env) -> None:
    env.up.create("piped.txt", b"piped")

    async def items() -> AsyncGenerator[Work, None]:
        yield Work(Entry(env.uri("piped.txt")))

    stats = await Pipeline(env.ctx, env.set_id, NAME).run(items())
    assert stats.fetched == 1 and not stats.failures


async def case_retry_failed(env: Env) -> None:
    env.up.update("r000001.txt", b"v2 after a failure")
    env.up.serve_503 = {"/default/res/r000001.txt": 1000}
    assert not (await sync_source(env.ctx, env.src)).ok
    env.up.serve_503 = {}
    env.made.clear()
    stats = await retry_failed(env.ctx, env.set_id, NAME, {env.uri("r000001.txt")})
    assert stats is not None and not stats.failures and stats.applied.get(UPDATED) == 1


async def case_end_unlisted_retries(env: Env) -> None:
    assert env.info is not None
    uri = env.uri("r000002.txt")
    env.up.delete("r000002.txt")
    stats = PipelineStats(failed={uri: Failure(uri, "http", "503")})
    assert await end_unlisted_retries(env.ctx, env.info, env.set_id, NAME, stats, {uri: 1}) == 1


async def case_notified_sync(env: Env) -> None:
    assert await NotifiedHarvest(env.ctx).sync(env.src)


async def case_apply_notice(env: Env) -> None:
    assert env.info is not None
    cursor = await env.ctx.read(env.ctx.reader.cursor, env.set_id)
    rec = env.up.update("r000003.txt", b"v3 notified")
    entry = Entry(env.uri("r000003.txt"), md=Md(change=UPDATED, datetime=rec.datetime))
    done = await NotifiedHarvest(env.ctx).apply_notice(
        env.src, env.info.capabilitylist_url, env.up.base() + "/topic", cursor.last_datetime, [entry]
    )
    assert done == (1, 1)


CASES: dict[str, Callable[[Env], Awaitable[None]]] = {
    "sync_source": case_sync_source,
    "poll_source": case_poll_source,
    "audit_source": case_audit_source,
    "expected_entries": case_expected_entries,
    "still_listed": case_still_listed,
    "run_baseline": case_run_baseline,
    "run_incremental": case_run_incremental,
    "Pipeline.run": case_pipeline_run,
    "retry_failed": case_retry_failed,
    "end_unlisted_retries": case_end_unlisted_retries,
    "NotifiedHarvest.sync": case_notified_sync,
    "NotifiedHarvest.apply_notice": case_apply_notice,
}


@pytest.mark.parametrize("name", list(CASES))
async def test_each_entry_point_requests_for_its_source(tmp_path: Path, monkeypatch, name: str) -> None:
    async with guarded_source(tmp_path, monkeypatch) as (env, guard):
        await _bare(lambda: CASES[name](env))
        assert env.made, "the entry point made no request: the case tests nothing"
        assert {who for who, _ in env.made} == {NAME}, [m for m in env.made if m[0] != NAME][:3]
    assert guard.refused == [], guard.refused
    assert guard.agents == {"ctx-test-agent/1"}


@pytest.mark.parametrize("name", ["sync_oaipmh", "OaiHarvest.records", "audit_source"])
async def test_each_oai_pmh_entry_point_requests_for_its_source(tmp_path: Path, monkeypatch, name: str):
    monkeypatch.setenv("CTX_TOKEN", TOKEN)
    repo = Repository()
    repo.bulk_add(0, 12)
    app = OaiApp(repo, page_size=5)
    guard = Guard(app)
    async with serve_app(guard) as base:
        cfg = guarded_config(tmp_path, f"{base}/oai", kind="oai-pmh")
        src = cfg.sources[0]
        async with open_context(cfg) as ctx:
            assert (await sync_source(ctx, src)).ok
            made: list[str] = []
            hook = ctx.fetcher.request_hook

            async def recorded(request) -> None:
                made.append(current_source.get())
                await hook(request)

            ctx.fetcher.request_hook = recorded
            set_id = await ctx.write(ctx.writer.ensure_set, NAME, set_key(src))

            async def work():
                if name == "sync_oaipmh":
                    return (await sync_oaipmh(ctx, src)).seen >= 0
                if name == "OaiHarvest.records":
                    async with aclosing(OaiHarvest(ctx, src, set_id).records()) as records:
                        return len([r async for r in records]) == 12
                return [d async for d in audit_source(ctx, src)] == []

            assert await _bare(work)
    assert made and set(made) == {NAME}
    assert guard.refused == []


# -- the class: every public entry point of harvest/ acts for its source ---------------------------------


def _entry_points() -> list[tuple[str, object]]:
    """Public coroutine and async generator functions of harvest/ that take a source (``src``, ``source``)
    or belong to an object made for one; building blocks that take a bare ``fetcher`` act for their
    caller and are left out."""
    found = []
    for mod in pkgutil.iter_modules(aggregator.harvest.__path__):
        module = importlib.import_module(f"aggregator.harvest.{mod.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) and not getattr(obj, "_is_protocol", False):  # a Protocol: done elsewhere
                init = inspect.signature(obj.__init__).parameters if "__init__" in vars(obj) else {}
                made_for_one = bool({"src", "source"} & set(init))
                for attr, fn in vars(obj).items():
                    if (attr.startswith("_") and attr != "__call__") or not _is_async(fn):
                        continue
                    params = set(inspect.signature(fn).parameters)
                    if (made_for_one or {"src", "source"} & params) and "fetcher" not in params:
                        found.append((f"{module.__name__}.{name}.{attr}", fn))
            elif inspect.isfunction(obj) and not name.startswith("_") and _is_async(obj):
                params = set(inspect.signature(obj).parameters)
                if {"src", "source"} & params and "fetcher" not in params:
                    found.append((f"{module.__name__}.{name}", obj))
    return found


def _is_async(fn: object) -> bool:
    fn = inspect.unwrap(fn) if callable(fn) else fn
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


#: Entry points that make no request of their own: each is a loop around wrapped ones.
DELEGATES = {
    # its syncs are sync_source (wrapped); a followed source is run by the subscriber, whose requests
    # to a hub are made for no source (outbound.py AddressPolicy.current_source)
    "poll_source": "sync_source",
}


def test_every_public_entry_point_of_harvest_acts_for_its_source() -> None:
    points = dict(_entry_points())
    # The table above exercises these; the rule below holds any new one to the same wrapper.
    for known in ("source.sync_source", "audit.audit_source", "audit.still_listed", "source.retry_failed",
                  "baseline.run_baseline", "pipeline.Pipeline.run", "notices.NotifiedHarvest.apply_notice",
                  "oaipmh.OaiHarvest.records"):  # fmt: skip
        assert f"aggregator.harvest.{known}" in points, known
    missing = [
        name
        for name, fn in points.items()
        if not getattr(fn, "__for_source__", False) and name.rsplit(".", 1)[1] not in DELEGATES
    ]
    assert missing == [], f"wrap these in access.for_source: {missing}"


async def test_for_source_sets_the_source_for_the_work_only() -> None:
    """Inside a wrapped async generator the source is set; its consumer, between items, is not moved;
    the wrapped generator is closed (its ``finally`` runs) in the source's context too."""
    from aggregator.harvest.access import for_source

    seen: list[str] = []

    @for_source
    async def gen(source: str) -> AsyncGenerator[int, None]:
        try:
            for i in range(3):
                seen.append(current_source.get())
                yield i
        finally:
            seen.append("closed as " + current_source.get())

    @for_source
    async def coro(src) -> str:
        return current_source.get()

    async with aclosing(gen("a")) as g:
        async for i in g:
            assert current_source.get() == ""
            if i == 1:
                break
    assert seen == ["a", "a", "closed as a"]
    assert await coro(type("S", (), {"name": "b"})()) == "b" and current_source.get() == ""


# -- acceptance: an operator harvests and audits a bearer-token Source ------------------------------------


async def test_a_bearer_token_source_is_harvested_and_audited_in_sync(tmp_path: Path) -> None:
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(5)
    guard = Guard(up.app())
    async with serve_app(guard) as base:
        up.public_url = base
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[store]\npath = "{tmp_path / "data"}"\n[harvest]\nretries = 1\nbackoff_base = 0.01\n'
            f'[[sources]]\nname = "{NAME}"\nurl = "{base}/.well-known/resourcesync"\n'
            '[sources.auth]\nbearer_token_env = "CTX_TOKEN"\n'
        )
        env = {"CTX_TOKEN": TOKEN}

        def run(*args: str):
            return trio.to_thread.run_sync(lambda: rsagg(*args, config=config, timeout=120, env=env))

        first = await run("harvest", "--once")
        assert first.returncode == 0, first.stderr
        up.update("r000001.txt", b"changed between harvest and audit")
        up.delete("r000004.txt")
        behind = await run("audit")
        assert behind.returncode == 1 and "NOT IN SYNC" in behind.stdout, behind.stdout + behind.stderr
        again = await run("harvest", "--once")
        assert again.returncode == 0, again.stderr
        audited = await run("audit")
        assert audited.returncode == 0 and f"{NAME}: in sync" in audited.stdout, (
            audited.stdout + audited.stderr
        )
    assert guard.refused == []
    cfg = parse_config(
        {"store": {"path": str(tmp_path / "data")}, "sources": [{"name": NAME, "url": "http://x/"}]}, "t.toml"
    )
    assert set(held(cfg)) == {up.url(p) for p in up.resources()}
    assert TOKEN not in audited.stdout + audited.stderr + again.stdout + again.stderr
