"""A set whose Capability List offers only a Resource Dump (§11.1 requires no Resource List beside it),
shaped like the documents of the CDL resync-client's captures (CDLUC3/resync-client ``spec/data/
resourcedump``): a ``<urlset>`` Resource Dump whose package entries carry ``type``, ``length``, ``at`` and a
``completed`` earlier than their ``at``, no hash and no ``rel="contents"`` link; a ZIP whose manifest gives
each resource an md5 ``hash``, a ``lastmod`` and a ``path`` under ``/resources/``, no ``length``.

Such a set is polled any number of times (each poll a new baseline from the dump), and a baseline that
saw nothing (an empty or failed snapshot, of a dump or of a list) never deletes what is held.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from aggregator.config import Config
from aggregator.rs.model import DELETED
from tests.harvesting import audit, changelog, harvest, held, make_config
from tests.httpserver import serve_app
from tests.test_interop import Site, doc, ln, md5, package, sha256, status_of, url

AT = ["2015-05-22T16:06:04Z", "2015-06-01T10:00:00Z", "2015-06-09T08:30:00Z", "2015-07-01T00:00:00Z"]


def cdl_dump(site: Site, version: int, files: dict[str, bytes]) -> None:
    """Publish ``files`` (name -> bytes) as the set's one Resource Dump, package ``resourcedump-V.zip``."""
    at = AT[version]
    manifest = doc(
        f'capability="resourcedump-manifest" at="{at}"',
        "".join(
            url(site.url(f"/{name}"), f'hash="md5:{md5(data)}" path="/resources/{name}"', lastmod=at)
            for name, data in files.items()
        ),
    )
    zipped = package(manifest, {f"resources/{name}": data for name, data in files.items()})
    site.pages[f"/resourcedump-{version}.zip"] = zipped
    site.pages["/resourcedump.xml"] = doc(
        f'capability="resourcedump" at="{at}" completed="2015-05-05T16:23:20Z"',
        url(
            f"BASE/resourcedump-{version}.zip",
            f'type="application/zip" length="{len(zipped)}" at="{at}" completed="2015-05-05T16:23:20Z"',
        ),
        links=ln("up", "BASE/capabilitylist.xml"),
    )
    site.pages["/capabilitylist.xml"] = doc(
        'capability="capabilitylist"',
        url("BASE/resourcedump.xml", 'capability="resourcedump"'),
        links=ln("up", "BASE/.well-known/resourcesync"),
    )


async def poll_ok(cfg: Config, site: Site, files: dict[str, bytes]) -> None:
    result = (await harvest(cfg))["dump"]
    assert result.ok, result.error
    assert held(cfg) == {site.url(f"/{n}"): sha256(d) for n, d in files.items()}  # entry by entry
    row = status_of(cfg, "dump")
    assert row["state"] == "ok" and row["skipped"] == [], row


@pytest.mark.parametrize("use_dumps", [True, False])
async def test_a_dump_only_set_polls_any_number_of_times(tmp_path: Path, use_dumps: bool) -> None:
    """Three polls with changes between them (an update, a creation, a deletion) and one without: the
    store equals the dump's contents after each, audit is in sync, the status ok. ``use_dumps = false``
    (prefer the lists) does not stop a set that has nothing but a dump."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        cfg = make_config(tmp_path / "data", {"dump": site.url("/capabilitylist.xml")}, use_dumps=use_dumps)
        files = {"res1": b"first resource", "res2": b"second resource"}
        cdl_dump(site, 0, files)
        await poll_ok(cfg, site, files)
        files = {"res2": b"second resource, revised", "res3": b"third resource"}  # res1 gone
        cdl_dump(site, 1, files)
        await poll_ok(cfg, site, files)
        files = {**files, "res4": b"fourth"}
        cdl_dump(site, 2, files)
        await poll_ok(cfg, site, files)
        before = changelog(cfg)
        await poll_ok(cfg, site, files)  # nothing changed upstream: nothing logged
        assert changelog(cfg) == before
        assert await audit(cfg) == []
        assert status_of(cfg, "dump")["state"] == "ok"
    log = [(uri.rsplit("/", 1)[1], change) for uri, change, _ in changelog(cfg)]
    assert log == [("res1", "created"), ("res2", "created"), ("res2", "updated"), ("res3", "created"),
                   ("res1", "deleted"), ("res4", "created")]  # fmt: skip


# -- an empty or failed snapshot never deletes everything held -----------------------------------------


def list_only(site: Site, files: dict[str, bytes], *, entries: str | None = None, at: str = AT[1]) -> None:
    site.pages["/rl.xml"] = doc(
        f'capability="resourcelist" at="{at}"',
        "".join(url(site.url(f"/{n}"), f'hash="md5:{md5(d)}"') for n, d in files.items())
        if entries is None
        else entries,
    )
    for name, data in files.items():
        site.pages[f"/{name}"] = data
    site.pages["/capabilitylist.xml"] = doc(
        'capability="capabilitylist"', url("BASE/rl.xml", 'capability="resourcelist"')
    )


def _remove(path: str) -> Callable[[Site], None]:
    return lambda site: site.pages.pop(path)


def _replace(path: str, body: str | bytes) -> Callable[[Site], None]:
    return lambda site: site.pages.__setitem__(path, body)


#: How a snapshot can come out empty or broken, per shape of set.
FAULTS: dict[str, dict[str, Callable[[Site], None]]] = {
    "dump": {
        "the dump is gone": _remove("/resourcedump.xml"),
        "the dump names no package": _replace(
            "/resourcedump.xml", doc(f'capability="resourcedump" at="{AT[3]}"')
        ),
        "the package is gone": _remove("/resourcedump-0.zip"),
        "the package is not a ZIP": _replace("/resourcedump-0.zip", b"<html>maintenance</html>"),
        "the manifest lists nothing": lambda site: cdl_dump(site, 3, {}),
        "the dump is a resource list": _replace(
            "/resourcedump.xml", doc(f'capability="resourcelist" at="{AT[3]}"')
        ),
        "nothing is advertised": _replace("/capabilitylist.xml", doc('capability="capabilitylist"')),
    },
    "list": {
        "the list is gone": _remove("/rl.xml"),
        "the list is empty": lambda site: list_only(site, {}, at=AT[3]),
        "the list is another document": _replace("/rl.xml", doc(f'capability="changelist" from="{AT[3]}"')),
        "the list is not XML": _replace("/rl.xml", "<html><body>maintenance"),
        "nothing is advertised": _replace("/capabilitylist.xml", doc('capability="capabilitylist"')),
    },
}
CASES = [(shape, fault) for shape, faults in FAULTS.items() for fault in faults]


@pytest.mark.parametrize(("shape", "fault"), CASES)
async def test_an_empty_or_failed_snapshot_deletes_nothing(tmp_path: Path, shape: str, fault: str) -> None:
    site = Site()
    files = {"a": b"alpha", "b": b"beta", "c": b"gamma"}
    async with serve_app(site.app) as base:
        site.base = base
        if shape == "dump":
            cdl_dump(site, 0, files)
        else:
            list_only(site, files)
        cfg = make_config(tmp_path / "data", {"dump": site.url("/capabilitylist.xml")})
        await poll_ok(cfg, site, files)
        kept = held(cfg)
        FAULTS[shape][fault](site)
        result = (await harvest(cfg))["dump"]
        assert not result.ok  # never "ok" on a snapshot that could not be used
        assert held(cfg) == kept, f"{fault}: something held was deleted"
        assert DELETED not in {change for _, change, _ in changelog(cfg)}
        assert status_of(cfg, "dump")["state"] in ("degraded", "error")
        # The Source repaired: the next poll is ok and applies what it says.
        if shape == "dump":
            cdl_dump(site, 1, {"a": b"alpha"})
        else:
            list_only(site, {"a": b"alpha"}, at=AT[2])
        await poll_ok(cfg, site, {"a": b"alpha"})


async def test_a_full_oai_pmh_walk_that_lists_nothing_deletes_nothing(tmp_path: Path) -> None:
    """The same rule for an OAI-PMH source's full walk (its baseline): a repository that suddenly lists
    no record (``noRecordsMatch``) while records are held deletes nothing and is not "ok"; once it lists
    records again, the walk sweeps what it no longer has."""
    from tests.oaiserver import OaiApp, Repository
    from tests.test_oaipmh import oai_config

    repo = Repository(deleted_record="no")
    repo.bulk_add(0, 6)
    async with serve_app(OaiApp(repo, page_size=4)) as base:
        cfg = oai_config(tmp_path, f"{base}/oai", full_harvest_interval=0.001)  # every walk is full
        assert (await harvest(cfg))["oai"].ok and len(held(cfg)) == 6
        kept = held(cfg)
        hidden = dict(repo.items)
        repo.items.clear()
        repo._order = None
        result = (await harvest(cfg))["oai"]
        assert not result.ok and "listed no record" in (result.error or ""), result.error
        assert held(cfg) == kept
        assert status_of(cfg, "oai")["state"] == "degraded"
        repo.items.update({k: v for k, v in hidden.items() if k != repo.ident(2)})
        repo._order = None
        assert (await harvest(cfg))["oai"].ok
        assert set(held(cfg)) == set(repo.live())
