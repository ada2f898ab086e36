"""A cluster of ``rsagg run`` nodes on one state and one blob store (cluster.py), as operators run it:
real processes, one shared store, upstream Sources changing while they run, a node killed with SIGKILL
in the middle of its work, another paused with SIGSTOP past its lease."""

from __future__ import annotations

import difflib
import json
import random
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.routing import Route

from aggregator.publish.uris import rsagg_uri
from aggregator.rs.w3cdt import utcnow
from aggregator.run.serving import serving
from aggregator.testing.upstream import Upstream

from .clustering import NodeProcess, SharedState, assert_no_overlap, sources_toml, wait_for
from .harvesting import rsagg
from .seaweedfs import SeaweedFS, run_seaweedfs
from .test_hub import Subscriber

# Runs rsagg nodes as processes (kill -9), PostgreSQL and SeaweedFS.
pytestmark = pytest.mark.slow

LEASE = 3.0  # seconds: a loaded machine's late heartbeats must not lose leases all the time


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def backend(request: pytest.FixtureRequest) -> str | None:
    """Where the nodes' shared state lives: None for the SQLite file in the shared store, else the URL
    of a fresh schema in the test PostgreSQL server (tests/pgserver.py)."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("pg_server").fresh_url()


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS (S3) for the module: only one may run on the machine at a time (tests/seaweedfs.py)."""
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as sw:
        yield sw


@pytest.fixture(params=["filesystem", "s3"])
def blobs(request: pytest.FixtureRequest) -> str:
    """The ``[store]`` lines of the blob store the nodes share: the filesystem store in the shared store
    folder, or a fresh bucket of the test SeaweedFS (the issue's acceptance: PostgreSQL + S3)."""
    if request.param == "filesystem":
        return ""
    sw: SeaweedFS = request.getfixturevalue("seaweed")
    settings = sw.settings(f"rsagg-{uuid.uuid4().hex[:12]}", create_bucket=True)
    return 'backend = "s3"\n[store.settings]\n' + "".join(
        f"{k} = {json.dumps(v)}\n" for k, v in settings.items()
    )


N_SOURCES = 20
PER_SET = 5

HARVEST = (
    "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
    "workers = 4\nbatch_size = 4\nuse_dumps = false\nmax_connections = 16\n"
)


def _upstreams() -> list[Upstream]:
    """One Source per server (as in the field: a failing Capability List makes discovery fall back to
    the server's well-known Source Description, which must name that Source's sets only)."""
    ups = []
    for i in range(N_SOURCES):
        name = f"set{i:02d}"
        up = Upstream(
            sets=(name,), changes_per_list=None, resource_dump=False, change_dump=False, latency=0.01
        )
        up.bulk_create(PER_SET, prefix=f"{name}-", set_name=name)
        ups.append(up)
    return ups


def _held_by(db: SharedState) -> dict[str, str]:
    with db.open() as st:
        now = utcnow()
        return {  # sources only: "@dumps" (a role, cluster.py) is not one
            le.source: le.node
            for le in st.leases()
            if le.node and le.expires_at and le.expires_at > now and not le.source.startswith("@")
        }


def _in_sync(db: SharedState, *ups: Upstream) -> bool:
    """Every set's live resources in the state are exactly the upstreams' (uri -> sha256)."""
    with db.open() as st:
        held = {r.uri: r.sha256 for r in st.iter_resources()}
    want = {up.url(p, s): v.sha256 for up in ups for s in up.set_names for p, v in up.resources(s).items()}
    return held == want


def _synced_once(db: SharedState) -> bool:
    with db.open() as st:
        rows = st.sources()
        return len(rows) == N_SOURCES and all(r.last_success for r in rows)


async def _documents(node: NodeProcess, names: list[str]) -> dict[str, bytes]:
    out = {}
    for path in ["/.well-known/resourcesync"] + [
        f"/{n}/{doc}" for n in names for doc in ("capabilitylist.xml", "resourcelist.xml", "changelist.xml")
    ]:
        r = await node.get(path)
        assert r.status_code == 200, (node.name, path, r.status_code)
        # A Resource List's ``at`` is when it was generated (§10.1): the one thing that differs.
        out[path] = re.sub(rb'(<rs:md capability="resourcelist") at="[^"]+"', rb"\1", r.content)
    return out


@pytest.mark.parametrize(
    ("backend", "blobs"),
    [("sqlite", "filesystem"), ("postgresql", "filesystem"), ("postgresql", "s3")],
    indirect=True,
)
async def test_three_nodes_one_killed_mid_batch(tmp_path: Path, backend: str | None, blobs: str) -> None:
    ups = _upstreams()
    store = tmp_path / "store"
    db = SharedState(store, backend)
    rng = random.Random(15)
    async with trio.open_nursery() as nursery, AsyncExitStack() as serving_ups:
        bases = [await serving_ups.enter_async_context(up.serving()) for up in ups]
        sources = {f"s{i:02d}": f"{b}/set{i:02d}/capabilitylist.xml" for i, b in enumerate(bases)}
        body = HARVEST + sources_toml(sources, interval=0.3)
        nodes = [NodeProcess(tmp_path, f"node{i}", store) for i in (1, 2, 3)]
        for n in nodes:  # node2 stands in for the load balancer: resync reads the URLs it publishes
            n.configure(body, base_url=nodes[1].url, lease_seconds=LEASE, store_extra=db.store_extra + blobs)
        try:
            for n in nodes:
                await n.start()
            for n in nodes:
                await n.wait_serving()
            # Every source harvested once, and the leases spread over the three nodes.
            await wait_for(lambda: db.exists() and _synced_once(db), "the first sync of every source")
            await wait_for(lambda: len(set(_held_by(db).values())) == 3, "leases on all three nodes")
            with db.open() as st:
                base_seq = st.last_seq()
            base_changes = [len(up.changes()) for up in ups]

            # Upstreams change while the nodes run; node1 is killed in the middle of its work.
            counter = 0

            async def change_upstreams(n: int) -> None:
                nonlocal counter
                for _ in range(n):
                    i = rng.randrange(N_SOURCES)
                    up, s = ups[i], f"set{i:02d}"
                    paths = sorted(up.resources(s))
                    roll = rng.random()
                    counter += 1
                    if roll < 0.5 and paths:
                        up.update(rng.choice(paths), f"version {counter}\n".encode(), set_name=s)
                    elif roll < 0.8 or not paths:
                        up.create(f"{s}-new{counter}", f"new {counter}\n".encode(), set_name=s)
                    else:
                        up.delete(rng.choice(paths), set_name=s)
                    await trio.sleep(0.02)

            await change_upstreams(30)
            victims = sorted(s for s, n in _held_by(db).items() if n == "node1")
            assert victims
            requests = sum(up.counts.total() for up in ups)
            await wait_for(lambda: sum(up.counts.total() for up in ups) > requests + 5, "node1 at work")
            killed_at = utcnow()
            await nodes[0].kill()  # SIGKILL: no clean-up, its leases stay until they expire
            await change_upstreams(30)

            # Its sources are taken over once its leases expire: within a lease time of the kill.
            await wait_for(
                lambda: all(_held_by(db).get(s) in ("node2", "node3") for s in victims), "takeover"
            )
            await wait_for(lambda: _in_sync(db, *ups), "every upstream change harvested", timeout=120)
            with db.open() as st:
                history = st.lease_history()
                log = list(st.iter_changelog(after_seq=base_seq))
            assert_no_overlap(history)
            for s in victims:
                grants = [g for g in history if g.source == s]
                dead = [g for g in grants if g.node == "node1"][-1]
                after = [g for g in grants if g.epoch > dead.epoch]
                assert dead.end_reason == "expired" and after and after[0].node in ("node2", "node3")
                assert dead.ended_at <= killed_at + timedelta(seconds=LEASE)  # renewed before the kill
                print(
                    f"{s}: takeover {(after[0].granted_at - killed_at).total_seconds():.2f} s after the kill"
                )

            # Every upstream change since the first syncs applied at most once, in order per resource, and
            # the state ends equal to the upstreams (_in_sync): nothing missed, nothing applied twice. (A
            # change superseded before a node read it is not fetchable any more: the next one stands for
            # it, so a resource's records are a subsequence of its upstream changes, not all of them; and
            # a resource first seen in a later version is logged "created" with that version's hash.)
            want: dict[str, list[tuple[str, str | None]]] = {}
            for up, before in zip(ups, base_changes, strict=True):
                for rec in up.changes()[before:]:
                    sha = rec.version.sha256 if rec.version else None
                    want.setdefault(up.url(rec.path), []).append((rec.change, sha))
            got: dict[str, list[tuple[str, str | None]]] = {}
            for rec in log:
                got.setdefault(rec.uri, []).append((rec.change, rec.sha256))
            assert set(got) <= set(want)
            for uri, records in got.items():
                shas = iter([sha for _, sha in want[uri]])
                assert all(sha in shas for _, sha in records), (
                    f"{uri}: logged {records}, upstream {want[uri]}"
                )

            # Status, on the command line and from any node: the nodes, and who holds which source.
            shown = await trio.to_thread.run_sync(
                lambda: rsagg("status", "--json", config=nodes[2].config, timeout=60)
            )
            status = json.loads(shown.stdout)
            assert "cluster" in status, shown.stdout[:3000] + shown.stderr
            alive = {n["name"]: n["alive"] for n in status["cluster"]["nodes"]}
            assert alive == {"node1": False, "node2": True, "node3": True}, status["cluster"]
            holders = {r["name"]: r["node"] for r in status["sources"]}
            assert set(holders.values()) == {"node2", "node3"} and len(holders) == N_SOURCES
            page = (await nodes[1].get("/status.json")).json()
            assert "cluster" in page, {k: v for k, v in page.items() if k != "sources"}
            assert {n["name"] for n in page["cluster"]["nodes"]} == {"node1", "node2", "node3"}
            text = await trio.to_thread.run_sync(lambda: rsagg("status", config=nodes[2].config, timeout=60))
            assert "NODE" in text.stdout and "node1" in text.stdout and "dead" in text.stdout, text.stdout
            metrics = (await nodes[1].get("/metrics")).text
            held2 = sum(1 for n in holders.values() if n == "node2")
            assert f'rsagg_cluster_leases_held{{node="node2"}} {held2}.0' in metrics

            # Every node serves the same republished Source; node1, restarted, too.
            nodes[0].proc = None
            await nodes[0].start()
            await nodes[0].wait_serving()
            names = [f"s{i:02d}" for i in range(N_SOURCES)]
            docs = [await _documents(n, names) for n in nodes]
            for i in (1, 2):
                differ = [p for p in docs[0] if docs[0][p] != docs[i][p]]
                assert not differ, "\n".join(
                    difflib.unified_diff(
                        docs[0][differ[0]].decode().splitlines(), docs[i][differ[0]].decode().splitlines(),
                        f"node1{differ[0]}", f"node{i + 1}{differ[0]}", lineterm="",
                    )
                )  # fmt: skip

            # The reference client syncs from node2 (what node1 harvested included); rsagg audit agrees.
            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            source = victims[0]
            published = f"{nodes[1].url}/{source}"
            done = await trio.run_process(
                [str(Path(sys.executable).parent / "resync-sync"), "--baseline", "--delete",
                 "--capabilitylist", f"{published}/capabilitylist.xml", published, str(dest)],
                cwd=cwd, capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
            out = (done.stdout + done.stderr).decode()
            assert done.returncode == 0 and "Error" not in out, out
            files = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
            assert files == {
                rsagg_uri(nodes[1].url, source, ups[int(source[1:])].url(p))[len(published) + 1 :]: v.data
                for p, v in ups[int(source[1:])].resources().items()
            }
            audit = await trio.to_thread.run_sync(lambda: rsagg("audit", config=nodes[1].config, timeout=120))
            assert audit.returncode == 0, audit.stdout + audit.stderr
        finally:
            for n in nodes:
                await n.kill()
            nursery.cancel_scope.cancel()


async def test_a_node_paused_past_its_lease_writes_nothing_when_it_resumes(
    tmp_path: Path, backend: str | None
) -> None:
    """SIGSTOP node A in the middle of a baseline; every upstream resource changes; node B takes the
    source over and harvests the new versions. SIGCONT A: whatever A had fetched (the old versions) is
    refused by the fence, so the state still holds exactly the new versions and nothing was logged."""
    up = Upstream(sets=("only",), changes_per_list=None, resource_dump=False, change_dump=False, latency=0.03)
    paths = up.bulk_create(60, set_name="only")
    store = tmp_path / "store"
    db = SharedState(store, backend)
    async with up.serving() as base:
        body = HARVEST.replace("workers = 4", "workers = 2").replace(
            "batch_size = 4", "batch_size = 2"
        ) + sources_toml({"s": f"{base}/only/capabilitylist.xml"}, interval=0.3)
        a, b = NodeProcess(tmp_path, "A", store), NodeProcess(tmp_path, "B", store)
        for n in (a, b):
            n.configure(body, base_url=a.url, lease_seconds=1.0, store_extra=db.store_extra)
        try:
            await a.start()

            def first_commit() -> bool:
                if not db.exists():
                    return False
                with db.open() as st:
                    return st.last_seq() > 0

            await wait_for(first_commit, "node A's first commit")
            a.signal(signal.SIGSTOP)
            for p in paths:
                up.update(p, f"second version of {p}\n".encode(), set_name="only")
            await b.start()
            await wait_for(lambda: _held_by(db).get("s") == "B", "node B's takeover")
            await wait_for(lambda: _in_sync(db, up), "node B in sync")
            with db.open() as st:
                seq = st.last_seq()
            a.signal(signal.SIGCONT)
            await wait_for(
                lambda: "lost its lease" in a.log_text() or "lease lost" in a.log_text(), "A's loss"
            )
            metrics = (await a.get("/metrics")).text
            assert 'rsagg_cluster_leases_lost_total{node="A"' in metrics, metrics
            await b.wait_serving()  # B still fine, and A can serve as well
            await a.wait_serving()
            assert _in_sync(db, up)
            with db.open() as st:
                assert st.last_seq() == seq  # nothing logged since B caught up: A wrote nothing
                history = st.lease_history("s")
                records = list(st.iter_changelog())
            assert_no_overlap(history)
            # A's grant ended at its expiry and B's came next (on a loaded machine B's may have lapsed and
            # been granted again since: later grants are free to follow, never to overlap).
            assert [(g.node, g.end_reason) for g in history[:1]] == [("A", "expired")]
            assert history[1].node == "B"
            created = [r.uri for r in records if r.change == "created"]
            assert sorted(created) == sorted(set(created)) and len(created) == len(paths)
        finally:
            for n in (a, b):
                await n.kill()


async def test_each_notification_is_delivered_by_one_node(tmp_path: Path) -> None:
    """Two nodes with the embedded hub: a subscription made through either node's hub endpoint is
    verified and served by the one node holding the "@hub" role, and every change harvested (by either
    node) reaches the subscriber once, in one notification, never twice."""
    up = Upstream(sets=("a", "b"), changes_per_list=None, resource_dump=False, change_dump=False)
    for name in ("a", "b"):
        up.bulk_create(3, prefix=f"{name}-", set_name=name)
    store = tmp_path / "store"
    db = SharedState(store)
    sub = Subscriber()
    callback_app = Starlette(routes=[
        Route("/cb/{name}", sub.callback_get, methods=["GET"]),
        Route("/cb/{name}", sub.callback_post, methods=["POST"]),
    ])  # fmt: skip
    async with up.serving() as base, serving(callback_app) as cb_base:
        sources = {"sa": f"{base}/a/capabilitylist.xml", "sb": f"{base}/b/capabilitylist.xml"}
        body = HARVEST + "[publish]\nchangelist_size = 100000\n" + sources_toml(sources, interval=0.3)
        nodes = [NodeProcess(tmp_path, f"node{i}", store) for i in (1, 2)]
        for n in nodes:
            n.configure(body, base_url=nodes[0].url, lease_seconds=2.0, notifications=True)
        try:
            for n in nodes:
                await n.start()
            for n in nodes:
                await n.wait_serving()
            await wait_for(lambda: len(set(_held_by(db).values())) == 2, "a source on each node")
            await wait_for(lambda: db.exists() and _in_sync(db, up), "the first syncs")
            topics = {s: f"{nodes[0].url}/{s}/change-notification.xml" for s in sources}
            for i, (s, topic) in enumerate(topics.items()):  # through the hub endpoint of each node
                async with httpx.AsyncClient() as client:
                    r = await client.post(f"{nodes[i].url}/hub", data={
                        "hub.mode": "subscribe", "hub.topic": topic, "hub.callback": f"{cb_base}/cb/{s}",
                    })  # fmt: skip
                assert r.status_code == 202, r.text
            await wait_for(lambda: len(sub.gets) == 2, "both subscriptions verified")
            changed = []
            for i in range(4):
                for name in ("a", "b"):
                    up.update(f"{name}-00000{i % 3}.txt", f"change {i} of {name}\n".encode(), set_name=name)
                    changed.append(name)
                await trio.sleep(0.2)
            await wait_for(lambda: _in_sync(db, up), "the changes harvested")

            def entries(name: str) -> list[tuple[str, str]]:
                out = []
                for post in sub.received(name):
                    out += re.findall(rb"<loc>([^<]+)</loc><lastmod>([^<]+)</lastmod>", post.body)
                return out

            with db.open() as st:
                logged = {s: [r for r in st.iter_changelog() if f"/{s[1]}/" in r.uri] for s in sources}
            for s in sources:
                want = [r for r in logged[s] if r.change == "updated"]
                await wait_for(lambda s=s, want=want: len(entries(s)) >= len(want), f"{s}'s notifications")
                got = entries(s)
                assert want and len(got) == len(set(got)) == len(want), (s, got)  # each once, by one node
            with db.open() as st:
                holders = [g.node for g in st.lease_history("@hub")]
            assert len(holders) == 1  # one node sent them all
        finally:
            for n in nodes:
                await n.kill()
