"""Per-source access (aggregator/harvest/access.py): bearer, basic and custom-header credentials read from
files or the environment, sent only to the source's own origin; the User-Agent; a request rate.

Each scheme is required by a real OAI-PMH server (tests/oaiserver.py); a second server on another origin
records every header it receives; the secrets are looked for in the logs, the status and the metrics."""

from __future__ import annotations

import base64
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.config import ConfigError, parse_config
from aggregator.harvest.access import DEFAULT_USER_AGENT, _Pace
from aggregator.harvest.source import sync_source
from aggregator.run.compose import open_context
from aggregator.store.state import State

from .harvesting import held
from .httpserver import serve_app
from .oaiserver import OaiApp, Repository

TOKEN = "tok-9f8e7d6c5b4a-SECRET"
PASSWORD = "pw-correct-horse-SECRET"
API_KEY = "key-0a1b2c3d-SECRET"
SECRETS = (TOKEN, PASSWORD, API_KEY, base64.b64encode(f"harvester:{PASSWORD}".encode()).decode())


def config_for(tmp_path: Path, url: str, auth: dict, **harvest):
    return parse_config(
        {
            "store": {"path": str(tmp_path / "data")},
            "harvest": {"retries": 1, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10, **harvest},
            "sources": [{"name": "oai", "url": url, "kind": "oai-pmh", "auth": auth}],
        },
        str(tmp_path / "test.toml"),
    )


async def sync(cfg) -> tuple[bool, str | None, str, dict]:
    """One sync in process: (ok, error, the metrics exposition, the status row)."""
    async with open_context(cfg) as ctx:
        src = cfg.sources[0]
        result = await sync_source(ctx, src)
        ctx.metrics.refresh_from_state(ctx.reader)
        metrics = ctx.metrics.exposition().decode()
        status = ctx.reader.source(src.name)
    return result.ok, result.error, metrics, status


def assert_no_secret(*texts: object) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in str(text), f"a secret leaked into: {str(text)[:300]}"


def repository(n: int = 30) -> Repository:
    repo = Repository()
    repo.bulk_add(0, n)
    return repo


@pytest.mark.parametrize("scheme", ["bearer", "basic", "header"])
async def test_each_scheme_required_and_never_leaked(tmp_path: Path, monkeypatch, caplog, scheme: str):
    caplog.set_level(logging.DEBUG)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("OAI_PASSWORD", PASSWORD)
    monkeypatch.setenv("OAI_KEY", API_KEY)
    auth, wanted = {
        "bearer": ({"bearer_token_file": str(tmp_path / "token")}, ("authorization", f"Bearer {TOKEN}")),
        "basic": (
            {"basic_username": "harvester", "basic_password_env": "OAI_PASSWORD"},
            ("authorization", "Basic " + SECRETS[3]),
        ),
        "header": ({"headers": {"X-Api-Key": "env:OAI_KEY"}}, ("x-api-key", API_KEY)),
    }[scheme]
    repo = repository()
    app = OaiApp(repo, page_size=7, check=lambda h: h.get(wanted[0]) == wanted[1])
    async with serve_app(app) as base:
        # Without the credentials: refused, and said so.
        ok, error, _, _ = await sync(config_for(tmp_path / "none", f"{base}/oai", {}))
        assert not ok and "401" in error
        # With them: every request carries them, and the harvest is complete.
        cfg = config_for(tmp_path, f"{base}/oai", auth)
        ok, error, metrics, status = await sync(cfg)
        assert ok, error
        assert set(held(cfg)) == set(repo.live())
        assert all(s.headers.get(wanted[0]) == wanted[1] for s in app.seen[1:])
        # A wrong secret: the error names the URL and the status, never the secret.
        monkeypatch.setenv("OAI_PASSWORD", "wrong-" + PASSWORD)
        monkeypatch.setenv("OAI_KEY", "wrong-" + API_KEY)
        (tmp_path / "token").write_text("wrong-" + TOKEN)
        ok2, error2, metrics2, status2 = await sync(config_for(tmp_path / "wrong", f"{base}/oai", auth))
        assert not ok2 and "401" in error2
    assert_no_secret(error, metrics, status, error2, metrics2, status2, caplog.text)


async def test_credentials_never_sent_to_another_origin(tmp_path: Path, monkeypatch, caplog):
    """A redirect to another origin (another port is another origin) carries neither Authorization nor
    the custom header; the harvest still completes there."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OAI_TOKEN", TOKEN)
    monkeypatch.setenv("OAI_KEY", API_KEY)
    repo = repository(12)
    spy = OaiApp(repo, page_size=5)
    async with serve_app(spy) as elsewhere:
        protected = OaiApp(repo, check=lambda h: h.get("authorization") == f"Bearer {TOKEN}",
                           redirect=f"{elsewhere}/oai")  # fmt: skip
        async with serve_app(protected) as base:
            auth = {"bearer_token_env": "OAI_TOKEN", "headers": {"X-Api-Key": "env:OAI_KEY"}}
            cfg = config_for(tmp_path, f"{base}/oai", auth)
            ok, error, metrics, status = await sync(cfg)
    assert ok, error
    assert protected.seen and all(s.headers.get("x-api-key") == API_KEY for s in protected.seen)
    assert len(spy.list_requests()) >= 3  # the walk went on there
    for seen in spy.seen:
        assert "authorization" not in seen.headers and "x-api-key" not in seen.headers, seen.headers
        assert_no_secret(seen.headers, seen.args)
    assert_no_secret(error, metrics, status, caplog.text)


async def test_missing_secret_is_a_config_error_naming_the_key(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OAI_NOT_SET", raising=False)
    cfg = config_for(tmp_path, "http://127.0.0.1:9/oai", {"bearer_token_env": "OAI_NOT_SET"})
    with pytest.raises(ConfigError) as err:
        async with open_context(cfg):
            pass
    assert err.value.key == "sources[0].auth.bearer_token_env" and "OAI_NOT_SET" in str(err.value)
    # The command says so and exits 2 (no traceback).
    path = tmp_path / "rsagg.toml"
    path.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[[sources]]\nname = "oai"\nkind = "oai-pmh"\n'
        f'url = "http://127.0.0.1:9/oai"\n[sources.auth]\nbasic_username = "u"\n'
        f'basic_password_file = "missing-secret"\n'
    )
    done = await trio.run_process(
        [str(Path(sys.executable).parent / "rsagg"), "harvest", "-c", str(path), "--once"],
        capture_stdout=True, capture_stderr=True, check=False,
    )  # fmt: skip
    err_text = done.stderr.decode()
    assert done.returncode == 2 and "basic_password_file" in err_text and "Traceback" not in err_text, (
        err_text
    )


async def test_user_agent_and_max_rate(tmp_path: Path):
    repo = repository(40)
    app = OaiApp(repo, page_size=5)
    async with serve_app(app) as base:
        cfg = config_for(tmp_path, f"{base}/oai", {})
        ok, error, _, _ = await sync(cfg)
        assert ok, error
        assert {s.headers["user-agent"] for s in app.seen} == {DEFAULT_USER_AGENT}
        assert DEFAULT_USER_AGENT.startswith("rsagg/") and "(+http" in DEFAULT_USER_AGENT

        # max_rate: 9 requests at 20/s span at least 8/20 s (a lower bound: a slow machine only widens it;
        # less 10 ms for the first and last request's own delivery).
        stamps: list[float] = []
        app.check = lambda h: stamps.append(trio.current_time()) or True
        cfg = parse_config(
            {"store": {"path": str(tmp_path / "b" / "data")},
             "harvest": {"user_agent": "mirror-bot/2 (+mailto:ops@example.org)"},
             "sources": [{"name": "oai", "url": f"{base}/oai", "kind": "oai-pmh", "max_rate": 20}]},
            str(tmp_path / "b" / "t.toml"),
        )  # fmt: skip
        ok, error, _, _ = await sync(cfg)
        assert ok, error
        assert len(stamps) == 9  # Identify + 8 pages
        assert stamps[-1] - stamps[0] >= 8 / 20 - 0.01, stamps
        assert {s.headers["user-agent"] for s in app.seen[-9:]} == {"mirror-bot/2 (+mailto:ops@example.org)"}


def test_rsagg_status_shows_no_secret(tmp_path: Path, monkeypatch):
    """``rsagg status --json`` after a failed authenticated sync: the error is there, the secret is not."""
    monkeypatch.setenv("OAI_TOKEN", TOKEN)
    path = tmp_path / "rsagg.toml"
    path.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[harvest]\nretries = 0\ntimeout = 2\n[[sources]]\n'
        f'name = "oai"\nkind = "oai-pmh"\nurl = "http://127.0.0.1:9/oai"\n'
        f'[sources.auth]\nbearer_token_env = "OAI_TOKEN"\n'
    )
    rsagg = str(Path(sys.executable).parent / "rsagg")
    harvest = subprocess.run([rsagg, "harvest", "-c", str(path), "--once", "--log-level", "debug"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert harvest.returncode == 1, harvest.stderr
    status = subprocess.run([rsagg, "status", "-c", str(path), "--json"], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert "127.0.0.1:9" in status.stdout  # the error is shown
    assert_no_secret(harvest.stdout, harvest.stderr, status.stdout, status.stderr)
    with State(tmp_path / "data" / "state.db") as st:
        assert_no_secret(st.sources())


async def test_pace_spaces_request_starts_evenly(autojump_clock):
    """The pacer itself, on trio's virtual clock (pytest-trio's ``autojump_clock``): request starts
    of concurrent tasks are exactly 1/rate apart, and an idle pacer lets the next one go at once."""
    pace = _Pace(4.0)
    starts: list[float] = []

    async def one() -> None:
        await pace.wait()
        starts.append(trio.current_time())

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(one)
    assert [round(t - t0, 6) for t in sorted(starts)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    await trio.sleep(10)
    before = trio.current_time()
    await pace.wait()
    assert trio.current_time() == before


def recording(app, seen: list[dict[str, str]], check=None):
    """ASGI middleware: record each request's headers; answer 401 when ``check(headers)`` is false."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            seen.append(headers)
            if check is not None and not check(headers):
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
        await app(scope, receive, send)

    return wrapped


async def test_resourcesync_source_credentials_stay_on_its_origin(tmp_path: Path, monkeypatch, caplog):
    """A ResourceSync source behind a bearer token whose documents point at another origin (its
    resources and their mirrors, §14.2, are there): that origin never sees the token or the header."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RS_TOKEN", TOKEN)
    monkeypatch.setenv("RS_KEY", API_KEY)
    from aggregator.testing.upstream import Upstream

    up = Upstream(mirror="ok", resource_dump=False, change_dump=False)
    up.bulk_create(6)
    main_seen: list[dict[str, str]] = []
    other_seen: list[dict[str, str]] = []
    async with serve_app(recording(up.app(), other_seen)) as elsewhere:
        up.public_url = elsewhere  # every link in the documents names the other origin
        protected = recording(
            up.app(), main_seen, check=lambda h: h.get("authorization") == f"Bearer {TOKEN}"
        )
        async with serve_app(protected) as base:
            auth = {"bearer_token_env": "RS_TOKEN", "headers": {"X-Api-Key": "env:RS_KEY"}}
            cfg = parse_config(
                {"store": {"path": str(tmp_path / "data")},
                 "harvest": {"retries": 1, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
                 "sources": [{"name": "rs", "url": f"{base}/.well-known/resourcesync", "auth": auth}]},
                str(tmp_path / "t.toml"),
            )  # fmt: skip
            ok, error, metrics, status = await sync(cfg)
    assert ok, error
    assert len(held(cfg)) == 6
    assert main_seen and all(h.get("x-api-key") == API_KEY for h in main_seen)
    assert len(other_seen) >= 8  # capability list, resource list, the resources (or their mirrors)
    for headers in other_seen:
        assert "authorization" not in headers and "x-api-key" not in headers, headers
    assert_no_secret(error, metrics, status, caplog.text, other_seen)


async def test_access_hook_origin_and_reload(tmp_path: Path, monkeypatch):
    """The hook on its own: credentials for the source's origin only (scheme, host and port), none for
    requests made for no source, and a reload reads a rotated secret."""
    from aggregator.harvest.access import Access
    from aggregator.scope import current_source

    def config():
        return config_for(tmp_path, "https://repo.example/oai", {"bearer_token_env": "OAI_TOKEN"})

    monkeypatch.setenv("OAI_TOKEN", TOKEN)
    running = [config()]
    access = Access(running[0], running=lambda: running[0])

    async def sent(url: str, source: str = "oai") -> str | None:
        request = httpx.Request("GET", url, headers={"Authorization": "Bearer stale-copied-by-a-redirect"})
        token = current_source.set(source)
        try:
            await access(request)
        finally:
            current_source.reset(token)
        return request.headers.get("authorization")

    assert await sent("https://repo.example/oai?verb=Identify") == f"Bearer {TOKEN}"
    assert await sent("https://repo.example:443/other") == f"Bearer {TOKEN}"
    for elsewhere in ("http://repo.example/oai", "https://repo.example:8443/oai", "https://cdn.example/x"):
        assert await sent(elsewhere) is None, elsewhere
    assert (
        await sent("https://repo.example/oai", source="") == "Bearer stale-copied-by-a-redirect"
    )  # untouched
    monkeypatch.setenv("OAI_TOKEN", "rotated-token")
    assert await sent("https://repo.example/oai") == f"Bearer {TOKEN}"  # same configuration: read once
    running[0] = config()  # a reload
    assert await sent("https://repo.example/oai") == "Bearer rotated-token"
