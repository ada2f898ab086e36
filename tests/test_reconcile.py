"""Reconciliation with the Resource List (harvest/reconcile.py), fetch only what changed, audit --repair.

The Sources here are tests/reconciling.py's (documents written as a real implementation writes them) and
the programmable Upstream; every scenario ends with the store compared entry by entry with what the
Source lists.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from aggregator.cli import main
from aggregator.observe import report as status
from aggregator.observe.metrics import Metrics
from aggregator.rs import model
from aggregator.run.serving import serving
from aggregator.store.open import open_state
from aggregator.testing.upstream import Upstream

from .harvesting import audit, harvest, held, make_config
from .httpserver import serve_app
from .reconciling import ListSource, Published, Work

pytestmark = pytest.mark.trio


def _status_row(cfg, name: str) -> dict:
    with open_state(cfg, readonly=True) as state:
        return next(r for r in status.collect(state, cfg)["sources"] if r["name"] == name)


def _hyrax(n: int) -> ListSource:
    src = ListSource()
    for i in range(n):
        src.create(f"w{i}", f"<html>work {i}</html>".encode())
    src.hyrax_changes()
    return src


async def test_hyrax_shaped_source_across_a_deletion_it_never_lists(tmp_path: Path) -> None:
    """Hyrax never lists a deletion; the Resource List (whose ``at`` moves at every request) does not
    list the work any more: the next reconciliation deletes it, and nothing else is fetched."""
    src = _hyrax(6)
    async with serve_app(src.app()) as base:
        src.base = base
        cfg = make_config(tmp_path / "data", {"hyrax": base + "/.well-known/resourcesync"})
        r = (await harvest(cfg))["hyrax"]
        assert r.ok, r.error
        assert held(cfg) == src.listed()
        src.update("w1", b"<html>work 1, edited</html>")
        src.create("w9", b"<html>work 9</html>")
        src.delete("w3")  # leaves both lists, as a deleted Hyrax work does
        src.hyrax_changes()
        src.counts.clear()
        r = (await harvest(cfg))["hyrax"]
        assert r.ok, r.error
        assert held(cfg) == src.listed()  # entry by entry: URI -> sha256 of what the Source serves
        assert [(x.cause, x.repaired, x.unrepaired) for x in r.reconciled] == [
            ("list moved", {"deleted": 1}, 0)
        ]
        # Fetch only what changed: the two works the Change List moved (one 301 + one 200 each); the
        # four unchanged entries carry the lastmod rsagg holds and are not fetched.
        assert src.gets("/works/") == 2 and src.gets("/concern/") == 2
        assert await audit(cfg) == []
        row = _status_row(cfg, "hyrax")
        assert row["state"] == "ok"
        assert row["reconciled"]["repaired"] == 1 and row["reconciled"]["unrepaired"] == 0
        assert any(n.startswith("reconciled at ") and n.endswith(", 1 repaired") for n in status.notes(row))
        assert row["sets"][0]["reconciliation"]["repaired_by_kind"] == {"deleted": 1}
        # Nothing changed, but Hyrax writes a new `at`: reconciled again, nothing fetched or repaired.
        src.counts.clear()
        r = (await harvest(cfg))["hyrax"]
        assert r.ok and [x.differences for x in r.reconciled] == [0]
        assert src.gets("/works/") == 0
        assert held(cfg) == src.listed()


async def test_a_recheck_is_conditional_and_a_304_keeps_what_is_held(tmp_path: Path) -> None:
    """A lastmod that moved while the content did not (Hyrax touches a work's metadata): rsagg asks
    with the ETag it got, the Source answers 304, the held version stays."""
    src = _hyrax(3)
    async with serve_app(src.app()) as base:
        src.base = base
        cfg = make_config(tmp_path / "data", {"hyrax": base + "/.well-known/resourcesync"})
        assert (await harvest(cfg))["hyrax"].ok
        before = held(cfg)
        w = src.works["w0"]
        src.works["w0"] = Work(w.body, w.created, src.tick())
        src.hyrax_changes()
        src.counts.clear()
        r = (await harvest(cfg))["hyrax"]
        assert r.ok, r.error
        assert src.gets("/works/") == 1  # one conditional GET; answered 304
        assert sum(s.fetched for s in r.stats) == 0 and sum(s.unchanged for s in r.stats) >= 1
        assert held(cfg) == before == src.listed()


@pytest.mark.slow  # ten thousand entries
async def test_one_changed_entry_of_10000_costs_one_get(tmp_path: Path) -> None:
    """A list-only Source without digests (lastmod and length): the baseline comes from its Resource
    Dump; then one resource changes and the next poll makes one resource GET, not 10,000."""
    up = Upstream(announce_hashes=False, change_list=False, change_dump=False)
    up.bulk_create(10_000)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert not [p for p in up.counts if "/res/" in p]  # all from the dump
        up.update("r000042.txt", b"a new version, longer than before")
        up.reset_counts()
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        fetched = {p: n for p, n in up.counts.items() if "/res/" in p}
        assert fetched == {"/default/res/r000042.txt": 1}
        assert held(cfg)[up.url("r000042.txt")] == up.resources()["r000042.txt"].sha256


async def test_audit_repair_is_the_one_command_for_not_in_sync(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rsagg audit`` says NOT IN SYNC (a deletion never listed, not yet reconciled); ``--repair``
    applies it through the pipeline and audits again: in sync, exit 0."""
    src = _hyrax(4)
    src.at = src.clock  # a Resource List whose `at` does not move by itself
    async with serve_app(src.app()) as base:
        src.base = base
        toml = tmp_path / "rsagg.toml"
        toml.write_text(
            f'[store]\npath = "data"\n[harvest]\nretries = 1\nbackoff_base = 0.01\n'
            f'reconcile_interval = 0\n[[sources]]\nname = "hyrax"\nurl = "{base}/.well-known/resourcesync"\n'
        )
        assert await trio_main(["harvest", "--once", "-c", str(toml)]) == 0
        src.delete("w2")
        src.hyrax_changes()  # `at` stays: the harvest has no reason to reconcile (interval 0)
        assert await trio_main(["audit", "-c", str(toml)]) == 1
        assert "extra" in capsys.readouterr().out
        assert await trio_main(["audit", "--repair", "-c", str(toml)]) == 0
        out = capsys.readouterr().out
        assert "repairing hyrax: extra:" in out and "repaired 1 deleted" in out
        assert out.rstrip().endswith("hyrax: in sync")
        cfg = make_config(tmp_path / "data", {"hyrax": base + "/.well-known/resourcesync"})
        assert held(cfg) == src.listed()


async def trio_main(argv: list[str]) -> int:
    """``rsagg ARGV`` in a worker thread (it runs its own trio loop), so the test's server keeps serving."""
    import trio

    return await trio.to_thread.run_sync(main, argv)


async def test_metrics_count_reconciliations_and_repairs_by_kind() -> None:
    m = Metrics(process=False)
    m.reconciled("s", "repaired", {"deleted": 2, "created": 1})
    m.reconciled("s", "in_sync", {})
    text = m.exposition().decode()
    assert 'rsagg_reconciliations_total{result="repaired",source="s"} 1.0' in text
    assert 'rsagg_reconciliations_total{result="in_sync",source="s"} 1.0' in text
    assert 'rsagg_reconcile_repairs_total{kind="deleted",source="s"} 2.0' in text


# -- the property: whatever the Change List says, one reconciliation makes the store the Resource List --


def _corrupt(changes: list[Published], rng: random.Random) -> list[Published]:
    """Drop, repeat (an older entry again, later) and reorder the entries of a Change List."""
    out = [c for c in changes if rng.random() > 0.3]
    for _ in range(rng.randint(0, 3)):
        if changes:
            out.insert(rng.randint(0, len(out)), rng.choice(changes))
    if len(out) > 1 and rng.random() < 0.5:
        i, j = sorted(rng.sample(range(len(out)), 2))
        out[i : j + 1] = reversed(out[i : j + 1])
    return out


CASES = 24


@pytest.mark.slow  # many generated Sources
async def test_property_one_reconciliation_makes_the_store_the_resource_list(tmp_path: Path) -> None:
    """Random Sources (digests or not, lengths or not, datetimes or not, 301s or not) whose Change Lists
    drop, reorder and repeat entries: after the sync that reconciles, the store equals the Resource List
    entry by entry; when a repair cannot succeed (a work answering 500), the store differs and the source
    is not "ok" — never "ok" while they differ."""
    rng = random.Random(20240601)
    failures_seen = repairs = 0
    src = ListSource()
    async with serving(src.app()) as base:
        for case in range(CASES):
            src.__init__(  # type: ignore[misc]
                hashes=rng.random() < 0.5,
                lengths=rng.random() < 0.5,
                datetimes=rng.random() < 0.5,
                redirect=rng.random() < 0.5,
                base=base,
            )
            shape = f"case {case}: hashes={src.hashes} lengths={src.lengths} datetimes={src.datetimes}"
            published = [src.create(f"w{i}", f"v0 of {i}".encode()) for i in range(rng.randint(2, 8))]
            src.changes = list(published)
            src.at = src.tick()
            cfg = make_config(tmp_path / f"data{case}", {"s": base + "/.well-known/resourcesync"})
            assert (await harvest(cfg))["s"].ok, shape
            assert held(cfg) == src.listed(), shape
            true: list[Published] = []
            for step in range(rng.randint(1, 8)):
                paths = list(src.works)
                roll = rng.random()
                if roll < 0.35 or not paths:
                    true.append(src.create(f"n{step}", f"new {step} of case {case}".encode()))
                elif roll < 0.7:
                    p = rng.choice(paths)
                    true.append(src.update(p, f"{p} at step {step}{'!' * rng.randint(0, 3)}".encode()))
                else:
                    true.append(src.delete(rng.choice(paths)))
            src.changes = published + _corrupt(true, rng)
            src.at = src.tick()  # the Resource List is newer than every change
            changed = [c.path for c in true if c.change != model.DELETED and c.path in src.works]
            broken = rng.random() < 0.25 and bool(changed)
            src.broken = {rng.choice(changed)} if broken else set()
            r = (await harvest(cfg))["s"]
            repairs += sum(sum(x.repaired.values()) for x in r.reconciled)
            row = _status_row(cfg, "s")
            same = held(cfg) == src.listed()
            if not src.broken:
                assert same, shape
                assert r.ok and row["state"] == "ok", (shape, r.error)
                assert await audit(cfg) == [], shape
            elif not same:
                failures_seen += 1
                assert not r.ok and row["state"] != "ok", shape
    assert failures_seen, "no case exercised a repair that fails"
    assert repairs, "no case needed a repair: the Change Lists were not corrupted enough"


# -- the order of trust, as a table of every combination ---------------------------------------------


async def test_compare_and_the_pipeline_agree_on_every_combination() -> None:
    """hash, then length, then lastmod: ``audit.compare`` (what reconciliation and audit find) and
    ``pipeline.unchanged`` (what a harvest does not fetch) give the same answer for every combination
    of what an entry announces against what is held, and the answer follows the order of trust."""
    import itertools
    from datetime import UTC, datetime

    from aggregator.harvest.audit import DECIDED, compare
    from aggregator.harvest.pipeline import told_apart, unchanged
    from aggregator.rs.fixity import format_hash
    from aggregator.rs.model import Entry, Md
    from aggregator.store.rows import Resource

    t0, t1 = datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 2, 1, tzinfo=UTC)
    held = Resource(1, 1, "u", "f" * 64, 10, None, None, {"md5": "a" * 32, "sha-256": "f" * 64}, t0, None,
                    [], {}, [], False, t0, None)  # fmt: skip
    hashes = {
        "same": {"md5": "a" * 32},
        "other": {"md5": "b" * 32},
        "unheld": {"sha-1": "c" * 40},
        "none": {},
    }
    lengths = {"same": 10, "other": 11, "none": None}
    lastmods = {"same": t0, "other": t1, "none": None}
    for h, n, m in itertools.product(hashes, lengths, lastmods):
        entry = Entry("u", lastmod=lastmods[m], md=Md(hash=format_hash(hashes[h]), length=lengths[n]))
        found = compare(entry, held)
        kind = found[0] if found else None
        if h == "other":
            expected = "hash"
        elif n == "other":
            expected = "length"
        elif h == "same":
            expected = None
        else:
            expected = {"same": None, "other": "lastmod", "none": "unverified"}[m]
        assert kind == expected, (h, n, m, found)
        assert unchanged(held, entry, lambda sha: True) == (kind is None), (h, n, m)
        assert told_apart(held, entry) == (kind in DECIDED), (h, n, m)  # else a fetch is conditional


async def test_reconcile_interval_default_and_per_source(tmp_path: Path) -> None:
    from aggregator.config import ConfigError, parse_config

    cfg = parse_config(
        {
            "store": {"path": str(tmp_path)},
            "harvest": {"reconcile_interval": 3600},
            "sources": [{"name": "a", "url": "http://127.0.0.1:1/"},
                        {"name": "b", "url": "http://127.0.0.1:2/", "reconcile_interval": 0}],
        },
        str(tmp_path / "t.toml"),
    )  # fmt: skip
    assert [cfg.reconcile_interval(s) for s in cfg.sources] == [3600, 0]
    assert make_config(tmp_path, {}).harvest.reconcile_interval == 86_400
    with pytest.raises(ConfigError, match=r"sources\[0\]\.reconcile_interval"):
        parse_config(
            {"store": {"path": str(tmp_path)},
             "sources": [{"name": "a", "url": "http://127.0.0.1:1/", "reconcile_interval": -1}]},
            str(tmp_path / "t.toml"),
        )  # fmt: skip


async def test_a_list_that_did_not_move_is_not_reconciled_and_its_head_is_asked_conditionally(
    tmp_path: Path,
) -> None:
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        for _ in range(2):  # the first poll learns the list's ETag, the second sends it
            r = (await harvest(cfg))["up"]
            assert r.ok and r.reconciled == []
        with open_state(cfg, readonly=True) as state:
            (rec,) = [state.reconciliation(s.id) for s in state.sets()]
        assert rec.cause == "baseline" and rec.lists[up.doc_url("resourcelist.xml")]["etag"]
        up.create(
            "new.txt", b"new"
        )  # the list moves: reconciled (nothing to repair: the Change List said it)
        r = (await harvest(cfg))["up"]
        assert r.ok and [(x.cause, x.repaired) for x in r.reconciled] == [("list moved", {})]
        assert held(cfg) == {up.url(p): v.sha256 for p, v in up.resources().items()}
