"""The PostgreSQL state (aggregator/store/postgres.py) against a real server (tests/pgserver.py).

Every behaviour test of tests/test_state.py runs here again, unchanged, on PostgreSQL: this module
imports them and overrides the one fixture that opens the state (``reopen``). The tests of SQLite's own
mechanics (pragmas, its migration of an old file, its text times) stay there; their PostgreSQL
counterparts, and what only a server has (several processes, passwords, an unreachable host), are here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import pytest
import trio

from aggregator.config import ConfigError, load_config
from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.postgres import MIGRATIONS, PostgresState, StateUnavailable, redact
from aggregator.store.rows import Change, Cursor, RetryChanges
from aggregator.store.sql import codec
from aggregator.store.state import MIGRATIONS as SQLITE_MIGRATIONS
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

from . import (
    harvesting,
    pgserver,
    test_harvest,
    test_publish,
    test_reconcile,
    test_state,
    test_state_interface,
    test_state_websub,
)
from .notifying import free_port
from .pgserver import PgServer
from .test_state import A, B, C, ch, table_names

# Every test talks to a real PostgreSQL server (the pg_server fixture or one of its own).
pytestmark = pytest.mark.slow

#: The tests of SQLite itself in those modules (its pragmas, files, text form and upgrades of old files),
#: not of the StateStore.
SQLITE_ONLY = {
    "test_migrations_idempotent_and_pragmas",
    "test_dump_tables_made_before_they_were_a_migration_are_kept",
    "test_newer_schema_is_refused",
    "test_datetime_text_form",
    "test_a_store_of_the_previous_release_upgrades_in_place",
    "test_a_fresh_store_has_the_same_tables_as_an_upgraded_one",
}
#: test_state.py's fixtures used as they are (``reopen``, ``fail_changelog_insert``, and test_state_websub's
#: ``location`` and ``count_rows`` are overridden below; its ``st`` is test_state's, on ``reopen``).
SHARED_FIXTURES = ("clock", "st", "set_id")
for _module in (test_state, test_state_websub):
    globals().update(
        {
            name: obj
            for name, obj in vars(_module).items()
            if (name in SHARED_FIXTURES and _module is test_state)
            or (name.startswith("test_") and name not in SQLITE_ONLY)
        }
    )


@pytest.fixture
def url(pg_server: PgServer) -> str:
    return pg_server.fresh_url()


@pytest.fixture
def reopen(url: str) -> Callable[..., StateStore]:
    return lambda **kw: connect(url, **kw)


@pytest.fixture
def location(url: str) -> str:
    return url


@pytest.fixture
def count_rows(url: str) -> Callable[[str], int]:
    def count(table: str) -> int:
        with psycopg.connect(url) as conn:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    return count


@pytest.fixture
def fail_changelog_insert(url: str) -> Callable[[str], None]:
    def install(uri: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE FUNCTION fail_log() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF (SELECT uri FROM resources WHERE id = NEW.resource_id) = '{uri}' "
                "THEN RAISE EXCEPTION 'disk says no'; END IF; RETURN NEW; END $$"
            )
            conn.execute(
                "CREATE TRIGGER fail_log BEFORE INSERT ON changelog FOR EACH ROW EXECUTE FUNCTION fail_log()"
            )

    return install


# -- the seam ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", test_state_interface.PROTOCOL_METHODS)
def test_postgres_implements_every_protocol_method_alike(name: str) -> None:
    test_state_interface.assert_implements(PostgresState, name)


def test_the_factory_opens_postgresql_urls(url: str) -> None:
    with connect(url) as st:
        assert isinstance(st, PostgresState) and st.sources() == []
    with connect(url.replace("postgresql://", "postgres://", 1)) as st:
        assert isinstance(st, PostgresState)


def test_state_reads_for_publishing(url: str) -> None:
    test_publish.check_state_reads_for_publishing(lambda **kw: connect(url, **kw))


# -- schema ---------------------------------------------------------------------------------------


def test_same_migration_steps_as_sqlite(url: str, tmp_path: Path) -> None:
    """Step i here is step i there: a version number means the same tables in either backend."""
    assert len(MIGRATIONS) == len(SQLITE_MIGRATIONS)
    with State(tmp_path / "state.db") as lite:
        sqlite_tables = set(table_names(lite)) - {"sqlite_sequence"}
    with connect(url) as st:
        assert st.schema_version == len(MIGRATIONS)
        with st.pool.connection() as c:
            tables = {
                r[0] for r in c.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
            }
    assert tables - sqlite_tables == {"schema_version", "changelog_head"}  # its own bookkeeping
    assert sqlite_tables - tables == set()


def test_processes_starting_at_once_migrate_once(pg_server: PgServer) -> None:
    """Four processes open a new database at the same instant: the advisory lock lets one migrate, the
    others find it done; no error, one version row."""
    db = pg_server.fresh_database()
    code = (
        "import sys; from aggregator.store.open import connect\n"
        "st = connect(sys.argv[1]); print(st.schema_version); st.close()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert [o.strip() for o, _ in outs] == [str(len(MIGRATIONS))] * 4
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*), max(version) FROM schema_version").fetchone() == (
            1,
            len(MIGRATIONS),
        )


def test_newer_schema_is_refused_and_reader_needs_a_migrated_one(url: str, pg_server: PgServer) -> None:
    with pytest.raises(RuntimeError, match="schema version 0"):
        connect(url, readonly=True)
    connect(url).close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (len(MIGRATIONS) + 1,))
    with pytest.raises(RuntimeError, match="schema version"):
        connect(url)


def test_a_reader_refuses_writes(url: str) -> None:
    with connect(url) as w:
        w.upsert_source("src", "https://example.org/")
    with connect(url, readonly=True) as ro:
        assert [s.name for s in ro.sources()] == ["src"]
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            ro.upsert_source("other", "https://other.example/")


def test_synchronous_maps_to_synchronous_commit(url: str) -> None:
    for mode, expected in (("NORMAL", "off"), ("FULL", "on")):
        with connect(url, synchronous=mode) as st, st.pool.connection() as c:
            assert c.execute("SHOW synchronous_commit").fetchone()[0] == expected
    with pytest.raises(ValueError):
        connect(url, synchronous="OFF")


# -- several writers -------------------------------------------------------------------------------


def test_writers_in_two_processes_keep_one_dense_changelog(url: str) -> None:
    """Two stores (as two processes would) apply at once: seq is dense and in commit order, datetimes
    never go back, every change is logged once."""
    a, b = connect(url), connect(url)
    try:
        a.upsert_source("src", "https://example.org/")
        sids = [
            a.ensure_set("src", "https://example.org/cl1.xml"),
            b.ensure_set("src", "https://example.org/cl2.xml"),
        ]
        errors: list[BaseException] = []

        def work(st: StateStore, sid: int, n: int) -> None:
            try:
                for i in range(25):
                    st.apply(sid, [ch(f"w{n}-{i}-{k}", "created", A) for k in range(4)])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [
            threading.Thread(target=work, args=(st, sid, n))
            for n, (st, sid) in enumerate(zip((a, b), sids, strict=True))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        log = list(a.iter_changelog())
        assert [r.seq for r in log] == list(range(1, 201)) and a.last_seq() == 200
        assert [r.datetime for r in log] == sorted(r.datetime for r in log)
        assert len({r.uri for r in log}) == 200
        assert len({r.resource_id for r in log}) == 200
    finally:
        a.close()
        b.close()


def test_a_rolled_back_batch_leaves_no_gap(
    st: PostgresState, set_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    st.apply(set_id, [ch("a", "created", A)])

    def boom(*_: object) -> None:
        raise RuntimeError("after the log was written")

    monkeypatch.setattr(st, "_put_retries", boom)
    with pytest.raises(RuntimeError):
        st.apply(set_id, [ch("b", "created", B)], retries=RetryChanges(cleared=["b"]))
    monkeypatch.undo()
    st.apply(set_id, [ch("c", "created", C)])
    assert [(r.seq, r.uri) for r in st.iter_changelog()] == [(1, "a"), (2, "c")]


def test_a_batch_writes_its_new_rows_and_their_validators_once(
    url: str, st: PostgresState, set_id: int
) -> None:
    """A fetched version's validators ride in the batch's COPY of its new rows (schema step 18): an
    UPDATE after it would leave a dead version of every row a baseline creates, and of its index
    entries. A row already holding the version gets its validators by one UPDATE (a 304's)."""
    from aggregator.store.rows import ResourceValidators

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE updated (id BIGINT)")
        conn.execute(
            "CREATE FUNCTION note_update() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN INSERT INTO updated VALUES (NEW.id); RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER note BEFORE UPDATE ON resources FOR EACH ROW EXECUTE FUNCTION note_update()"
        )
        shas = [A, B, C]
        kept = [
            ResourceValidators(u, sha, f'"{u}"', "Mon, 01 Jan 2024 00:00:00 GMT")
            for u, sha in zip("abc", shas, strict=True)
        ]
        st.apply(set_id, [ch(u, "created", sha) for u, sha in zip("abc", shas, strict=True)], validators=kept)
        assert conn.execute("SELECT count(*) FROM updated").fetchone() == (0,)
        assert set(st.resource_validators(set_id, ["a", "b", "c"])) == {"a", "b", "c"}
        st.apply(set_id, [ch("a", "created", A)], validators=[ResourceValidators("a", A, '"again"', None)])
        assert conn.execute("SELECT count(*) FROM updated").fetchone() == (1,)
        assert st.resource_validators(set_id, ["a"])["a"].etag == '"again"'


def test_iterators_hold_no_connection_between_pages(
    st: PostgresState,
    set_id: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow consumer of a keyset iterator never keeps a pooled connection: writers go on."""
    monkeypatch.setattr(codec, "PAGE_SIZE", 2)
    st.apply(set_id, [ch(f"r{i}", "created", A) for i in range(5)])
    it = st.iter_resources(set_id)
    next(it)
    with contextlib.ExitStack() as stack:  # every pooled connection can be had: the iterator holds none
        for _ in range(st.pool.max_size):
            stack.enter_context(st.pool.connection(timeout=30))
    st.apply(set_id, [ch("while-reading", "created", B)])
    assert len(list(it)) == 5  # the rest, and the row written meanwhile (ids grow)
    assert sorted(st.referenced_hashes()) == [A, B]


# -- secrets and errors ---------------------------------------------------------------------------


def test_redact() -> None:
    assert redact("postgresql://u:s3cret@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert redact("postgresql://u@db/x") == "postgresql://u@db/x"
    assert redact("postgresql://db/x?sslmode=require") == "postgresql://db/x?sslmode=require"


def test_wrong_password_is_one_clean_line_without_the_secret(pg_server: PgServer) -> None:
    bad = pg_server.url().replace(pg_server.password, "not-the-password-42")
    with pytest.raises(StateUnavailable) as info:
        connect(bad)
    message = str(info.value)
    assert "\n" not in message and "password authentication failed" in message
    assert "not-the-password-42" not in message and pg_server.password not in message
    assert message.startswith(f"state {redact(bad)}: cannot open")


def test_password_from_the_environment(pg_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", pg_server.password)
    with connect(pg_server.url(password=False)) as st:
        assert st.location == pg_server.url(password=False)
    monkeypatch.setenv("PGPASSWORD", "wrong")
    with pytest.raises(StateUnavailable, match="password authentication failed"):
        connect(pg_server.url(password=False))


def test_password_from_a_passfile(
    pg_server: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{pg_server.port}:*:rsagg:{pg_server.password}\n")
    passfile.chmod(0o600)  # libpq ignores a passfile others can read
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    with connect(pg_server.url(password=False)) as st:
        assert st.sources() == []


def test_unreachable_server(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StateUnavailable) as info:
        connect(f"postgresql://rsagg:hunter2@127.0.0.1:{port}/x", connect_timeout=2)
    assert "hunter2" not in str(info.value) and "\n" not in str(info.value)
    assert f"postgresql://rsagg:***@127.0.0.1:{port}/x" in str(info.value)


def test_without_psycopg_a_postgresql_state_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aggregator.store.postgres", None)  # as if psycopg were missing
    with pytest.raises(StateUnavailable, match=r"needs psycopg \(pip install 'rsagg\[postgresql\]'\)"):
        connect("postgresql://rsagg:secret@db.example.org/rsagg")


def test_sqlite_is_still_the_default(tmp_path: Path) -> None:
    with connect(tmp_path / "state.db") as st:
        assert isinstance(st, State)
    with pytest.raises(ValueError, match="no state backend for mysql://"):
        connect("mysql://db/x")


def test_change_and_cursor_types_survive(st: PostgresState, set_id: int) -> None:
    cur = Cursor(changelist_url="https://example.org/cl.xml", list_index=3)
    (out,) = st.apply(set_id, [Change("u", "updated", A, length=2**40)], cur)
    assert out.change == "created" and st.resource(set_id, "u").length == 2**40
    assert st.cursor(set_id) == cur


# -- end to end: the harvester on a PostgreSQL state ---------------------------------------------

HARVEST_SCENARIOS = [
    test_harvest.test_baseline_then_incremental_in_sync,
    test_harvest.test_resource_list_index_and_dump_baselines,
    test_harvest.test_mirrors_patches_and_retry_after,
    test_harvest.test_gap_is_recovered_by_a_fresh_baseline,
    test_harvest.test_failed_changes_are_retried_at_the_next_sync,
    test_harvest.test_a_baseline_ends_the_retries_of_resources_it_no_longer_lists,
    test_reconcile.test_hyrax_shaped_source_across_a_deletion_it_never_lists,
    test_reconcile.test_a_recheck_is_conditional_and_a_304_keeps_what_is_held,
]


#: The publisher's end-to-end tests: rsagg's Source read from a PostgreSQL state, resync 2.0.1 syncing from
#: it (baseline, incremental, audit), every document valid, Change List windows equal to the changelog.
PUBLISH_SCENARIOS = [
    test_publish.test_resync_baseline_incremental_audit,
    test_publish.test_change_list_windows_give_the_changelog_exactly,
    test_publish.test_every_document_validates_and_indexes_appear,
]


@pytest.mark.parametrize("scenario", HARVEST_SCENARIOS + PUBLISH_SCENARIOS, ids=lambda f: f.__name__)
async def test_scenarios_pass_unchanged_on_postgres(
    scenario, pg_server: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harvester's and the publisher's own end-to-end tests, same assertions, with every config's
    state in PostgreSQL (a fresh schema each); afterwards no SQLite state file exists anywhere."""
    monkeypatch.setattr(harvesting, "STORE", {"state": pg_server.fresh_url})
    kwargs = {"monkeypatch": monkeypatch} if "monkeypatch" in scenario.__code__.co_varnames else {}
    await scenario(tmp_path, **kwargs)
    assert not list(tmp_path.rglob("state.db*")), "the state went to SQLite"


def _config_file(tmp_path: Path, state: str, source_url: str) -> Path:
    cfg = tmp_path / "rsagg.toml"
    cfg.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\nstate = "{state}"\n\n'
        f"[harvest]\nretries = 1\nbackoff_base = 0.01\ntimeout = 10\n\n"
        f'[[sources]]\nname = "up"\nurl = "{source_url}"\n'
    )
    return cfg


async def test_rsagg_harvest_once_with_state_in_postgres(pg_server: PgServer, tmp_path: Path) -> None:
    """``rsagg harvest --once`` as an operator runs it, the password in PGPASSWORD, not in the file."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(30)
    with_password = pg_server.fresh_url()
    url = with_password.replace(f":{pg_server.password}@", "@")
    async with up.serving() as base:
        cfg = _config_file(tmp_path, url, base)
        env = {"PGPASSWORD": pg_server.password}
        done = await trio.to_thread.run_sync(
            lambda: harvesting.rsagg("harvest", "--once", config=cfg, timeout=300, env=env)
        )
    assert done.returncode == 0, done.stderr
    assert pg_server.password not in done.stdout + done.stderr
    for command in ("status", "retries"):  # the commands that read the state find it there too
        shown = harvesting.rsagg(command, "--json", config=cfg, timeout=120, env=env)
        assert shown.returncode == 0 and pg_server.password not in shown.stdout + shown.stderr, shown.stderr
        if command == "status":
            (source,) = json.loads(shown.stdout)["sources"]
            assert (source["name"], source["resources"], source["state"]) == ("up", 30, "ok")
        else:
            assert json.loads(shown.stdout) == {"retries": [], "cleared": 0}
    with connect(with_password) as st:
        assert {r.uri: r.sha256 for r in st.iter_resources()} == {
            up.url(p): v.sha256 for p, v in up.resources().items()
        }
        assert st.last_seq() == 30
    assert not list(tmp_path.rglob("state.db*"))


def test_rsagg_with_a_wrong_password_says_so_in_one_line(pg_server: PgServer, tmp_path: Path) -> None:
    secret = "wrong-secret-7"
    cfg = _config_file(tmp_path, pg_server.url().replace(pg_server.password, secret), "http://127.0.0.1:9/")
    done = harvesting.rsagg("harvest", "--once", config=cfg, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        "password authentication failed" in lines[0] and f"rsagg:***@127.0.0.1:{pg_server.port}" in lines[0]
    )
    assert secret not in done.stderr + done.stdout and pg_server.password not in done.stderr


def test_a_state_url_of_another_kind_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(str(_config_file(tmp_path, "mysql://u:pw@db/x", "http://127.0.0.1:9/")))
    assert info.value.key == "store.state" and "pw@" not in str(info.value)


async def test_rsagg_run_republishes_from_postgres_to_resync(pg_server: PgServer, tmp_path: Path) -> None:
    """``rsagg run`` with its state in PostgreSQL harvests an upstream and republishes it; resync 2.0.1
    (``resync-sync --baseline``) copies rsagg's Source and its audit finds it in sync; ``rsagg audit``
    finds rsagg in sync with the upstream; the password (in PGPASSWORD) shows nowhere."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(12)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with_password = pg_server.fresh_url()
    state = with_password.replace(f":{pg_server.password}@", "@")
    env = {
        **os.environ,
        "PGPASSWORD": pg_server.password,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(harvesting.REPO), os.environ.get("PYTHONPATH")])),
    }
    log_path = tmp_path / "daemon.log"
    async with up.serving() as ubase:
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\n'
            f'[store]\npath = "{tmp_path / "data"}"\nstate = "{state}"\n'
            "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 1\n'
        )
        with log_path.open("ab") as log:
            daemon = await trio.lowlevel.open_process(
                [sys.executable, "-m", "aggregator", "run", "-c", str(config)],
                env=env,
                stdout=log,
                stderr=log,
            )
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                with trio.fail_after(120):
                    while True:  # the daemon's first harvest is complete when every resource is listed
                        with contextlib.suppress(httpx.TransportError):
                            r = await client.get(f"{base}/up/resourcelist.xml")
                            if r.status_code == 200 and r.text.count("<url>") == 12:
                                break
                        assert daemon.returncode is None, log_path.read_text()
                        await trio.sleep(0.2)
            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            out = await test_publish.resync("--baseline", "--delete", base, str(dest), cwd=cwd)
            assert "SYNCED" in out or "IN SYNC" in out, out
            assert test_publish.local_files(dest) == test_publish.expected_files(up, base)
            out = await test_publish.resync("--audit", "--hash", "md5", base, str(dest), cwd=cwd)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out
            audit = await trio.to_thread.run_sync(
                lambda: harvesting.rsagg(
                    "audit", config=config, timeout=300, env={"PGPASSWORD": pg_server.password}
                )
            )
            assert audit.returncode == 0, audit.stdout + audit.stderr
            assert "in sync" in (audit.stdout + audit.stderr).lower(), audit.stdout + audit.stderr
        finally:
            daemon.terminate()
            with trio.move_on_after(60):
                await daemon.wait()
            if daemon.returncode is None:
                daemon.kill()
    with connect(with_password) as st:
        assert st.count_resources() == 12
    assert pg_server.password not in log_path.read_text()
    assert not list(tmp_path.rglob("state.db*"))


async def test_the_daemon_outlives_a_restart_of_its_state_server(tmp_path: Path) -> None:
    """The server goes away under ``rsagg run`` and comes back: the daemon keeps running (a sync that
    meets the outage fails with one redacted line, a request gets 503), then catches up by itself."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(5)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with pgserver.running() as pg:  # a server of its own: this test stops it
        state = pg.fresh_url()
        log_path = tmp_path / "daemon.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(harvesting.REPO), os.environ.get("PYTHONPATH")])),
        }
        async with up.serving() as ubase, httpx.AsyncClient(timeout=30) as client:
            config = tmp_path / "rsagg.toml"
            config.write_text(
                f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\n'
                f'[store]\npath = "{tmp_path / "data"}"\nstate = "{state}"\n'
                "[harvest]\njitter = 0\nretries = 1\nbackoff_base = 0.01\ntimeout = 10\n"
                f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 0.5\n'
            )

            async def listed() -> int:
                with contextlib.suppress(httpx.TransportError):
                    r = await client.get(f"{base}/up/resourcelist.xml")
                    return r.text.count("<url>") if r.status_code == 200 else -r.status_code
                return -1

            with log_path.open("ab") as log:
                daemon = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "aggregator", "run", "-c", str(config)],
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            try:
                with trio.fail_after(120):
                    while await listed() != 5:
                        await trio.sleep(0.2)
                await trio.to_thread.run_sync(pg.pause)
                with trio.fail_after(120):  # a sync meets the outage
                    while "unavailable" not in log_path.read_text():
                        await trio.sleep(0.2)
                assert await listed() == -503
                up.create("while-away.txt", b"written while the state's server was down\n")
                await trio.to_thread.run_sync(pg.resume)
                with trio.fail_after(120):
                    while await listed() != 6:
                        assert daemon.returncode is None, log_path.read_text()
                        await trio.sleep(0.2)
                assert daemon.returncode is None
            finally:
                daemon.terminate()
                with trio.move_on_after(60):
                    await daemon.wait()
                if daemon.returncode is None:
                    daemon.kill()
        text = log_path.read_text()
        assert pg.password not in text and "rsagg:***@" in text
