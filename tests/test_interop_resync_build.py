"""Acceptance: a Source written entirely by ``resync-build`` 2.0.1 (the reference implementation).

Its documents carry the shapes of the 1.0 era that rsagg must read without losing anything:

- ``--write-resourcedump`` writes only the ZIP (``dump.zip00000.zip``), whose manifest paths lack the
  leading ``/`` (§11.2 wants it); the Resource Dump document that lists the ZIP is written here, as an
  operator publishing resync-build's output would.
- ``--write-changelist --reference OLD`` writes a Change List with no ``from``/``until`` and no
  ``rs:md datetime``: each entry has only ``lastmod``, the resource's modification time (§7), which for
  a deletion is the *old* resource's lastmod -- before the baseline.

Baseline from the dump (no resource fetched one by one), then a delete, an update and a create
published as resync-build's Change List: each must be applied, audit in sync, status ``ok``. Everything
runs as an operator would run it: ``python -m http.server``, ``resync-build``, ``rsagg`` commands.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.test_resync_upstream import (
    StaticSite,
    changelog_since,
    held,
    on_disk,
    resource_gets,
    resync_build,
    rsagg,
    site,  # noqa: F401  (the fixture)
)

# Runs the resync client's build and rsagg as processes.
pytestmark = pytest.mark.slow

SOURCE = "resync"


def write_dump_document(up: StaticSite, at: str) -> None:
    """The Resource Dump listing resync-build's ZIP (§11.1): resync-build does not write this one."""
    zips = sorted(up.root.glob("dump.zip*.zip"))
    assert zips, "resync-build wrote no dump package"
    urls = ""
    for z in zips:
        data = z.read_bytes()
        urls += (
            f"<url><loc>{up.base}/{z.name}</loc>"
            f'<rs:md type="application/zip" length="{len(data)}" hash="md5:{hashlib.md5(data).hexdigest()}"/>'
            "</url>"
        )
    (up.root / "resourcedump.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/">'
        f'<rs:ln rel="up" href="{up.base}/capabilitylist.xml"/>'
        f'<rs:md capability="resourcedump" at="{at}"/>{urls}</urlset>'
    )


def status_row(config: Path) -> dict:
    done = rsagg("status", "--json", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [r for r in json.loads(done.stdout)["sources"] if r["name"] == SOURCE]
    return row


def assert_in_sync_and_ok(config: Path) -> dict:
    done = rsagg("audit", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"{SOURCE}: in sync", done.stdout
    row = status_row(config)
    assert row["state"] == "ok" and row["last_error"] is None and row["skipped"] == [], row
    return row


def test_resync_build_source_baseline_from_its_dump_then_its_change_list(tmp_path: Path, site: StaticSite):  # noqa: F811
    base, root = site.base, site.root
    res = root / "res"
    res.mkdir()
    for name, body in (("a.txt", b"alpha\n"), ("b.txt", b"bravo\n"), ("c.txt", b"charlie\n")):
        (res / name).write_bytes(body)
    mapping = f"{base}={root}"
    resync_build("--write-resourcelist", "--outfile", str(root / "resourcelist.xml"), "--hash", "md5",
                 "--paths", str(res), mapping, cwd=tmp_path)  # fmt: skip
    resync_build("--write-resourcedump", "--outfile", str(root / "dump.zip"), "--hash", "md5",
                 "--paths", str(res), mapping, cwd=tmp_path)  # fmt: skip
    at = (root / "resourcelist.xml").read_text().split('at="', 1)[1].split('"', 1)[0]
    write_dump_document(site, at)
    # An empty Change List until something changes (resync-build --empty), so the Capability List can
    # name it from the start.
    resync_build("--write-changelist", "--empty", "--outfile", str(root / "changelist.xml"), cwd=tmp_path)
    resync_build(
        "--write-capabilitylist",
        f"resourcelist={base}/resourcelist.xml,resourcedump={base}/resourcedump.xml,"
        f"changelist={base}/changelist.xml",
        "--outfile", str(root / "capabilitylist.xml"), cwd=tmp_path,
    )  # fmt: skip
    config = tmp_path / "rsagg.toml"
    config.write_text(
        f'[store]\npath = "{tmp_path / "store"}"\n\n[harvest]\nper_host = 4\n\n'
        f'[[sources]]\nname = "{SOURCE}"\nurl = "{base}/capabilitylist.xml"\n'
    )
    db = tmp_path / "store" / "state.db"
    site.new_requests()

    # 1. Baseline from the dump: the resources arrive in the ZIP, none is fetched on its own.
    done = rsagg("harvest", "--once", config=config)
    assert done.returncode == 0 and f"{SOURCE}: ok:" in done.stdout, done.stdout + done.stderr
    requests = site.new_requests()
    assert resource_gets(requests) == {}, requests
    assert any(path.startswith("/dump.zip") for path, _ in requests), requests
    assert held(db) == on_disk(site)
    row = assert_in_sync_and_ok(config)
    # resync-build's manifest paths lack the leading '/': read, and shown as tolerated.
    assert {d["rule"] for d in row["deviations"]} >= {"dump-path-no-slash"}, row["deviations"]
    last, kinds = changelog_since(db, 0)
    assert kinds == {"created": 3}

    # 2. A delete, an update and a create, published with resync-build --write-changelist.
    shutil.copy(root / "resourcelist.xml", tmp_path / "old-resourcelist.xml")
    (res / "a.txt").unlink()
    (res / "b.txt").write_bytes(b"bravo, longer now\n")
    (res / "d.txt").write_bytes(b"delta\n")
    resync_build("--write-changelist", "--reference", str(tmp_path / "old-resourcelist.xml"),
                 "--outfile", str(root / "changelist.xml"), "--hash", "md5", "--paths", str(res), mapping,
                 cwd=tmp_path)  # fmt: skip
    text = (root / "changelist.xml").read_text()
    assert "datetime=" not in text and "from=" not in text  # the shape this test is about
    done = rsagg("harvest", "--once", config=config)
    assert done.returncode == 0 and f"{SOURCE}: ok:" in done.stdout, done.stdout + done.stderr
    assert held(db) == on_disk(site)
    assert sorted(resource_gets(site.new_requests())) == ["/res/b.txt", "/res/d.txt"]
    last, kinds = changelog_since(db, last)
    assert kinds == {"deleted": 1, "updated": 1, "created": 1}
    row = assert_in_sync_and_ok(config)
    assert "change-without-datetime" not in {d["rule"] for d in row["deviations"]}  # §12.1: *may*

    # 3. The same Change List read again: applied by content, nothing changes, nothing is refetched.
    done = rsagg("harvest", "--once", config=config)
    assert done.returncode == 0 and "no changes" in done.stdout, done.stdout + done.stderr
    assert resource_gets(site.new_requests()) == {}
    assert changelog_since(db, last)[1] == {}
    assert_in_sync_and_ok(config)


def test_harvest_once_exits_1_and_status_says_degraded_for_a_list_it_cannot_read(
    tmp_path: Path,
    site: StaticSite,  # noqa: F811
    capsys,
):
    """The operator's view of a skipped list: the commands, not only the library."""
    from aggregator.cli import main

    base, root = site.base, site.root
    (root / "r1").write_bytes(b"one")
    ns = (
        'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'
    )
    (root / "capabilitylist.xml").write_text(
        f'<urlset {ns}><rs:md capability="capabilitylist"/>'
        f'<url><loc>{base}/rl-1.xml</loc><rs:md capability="resourcelist"/></url>'
        f'<url><loc>{base}/rl-2.xml</loc><rs:md capability="resourcelist"/></url></urlset>'
    )
    (root / "rl-1.xml").write_text(
        f'<urlset {ns}><rs:md capability="resourcelist" at="2024-01-01T00:00:00Z"/>'
        f"<url><loc>{base}/r1</loc></url></urlset>"
    )
    (root / "rl-2.xml").write_text(f'<urlset {ns}><rs:md capability="resourcelist"/><url><loc>')  # truncated
    config = tmp_path / "rsagg.toml"
    config.write_text(
        f'[store]\npath = "{tmp_path / "store"}"\n\n'
        f'[[sources]]\nname = "{SOURCE}"\nurl = "{base}/capabilitylist.xml"\n'
    )
    assert main(["harvest", "--once", "-c", str(config)]) == 1
    out = capsys.readouterr().out
    assert f"{SOURCE}: DEGRADED:" in out and f"{base}/rl-2.xml" in out, out
    assert main(["status", "-c", str(config), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["sources"]
    assert row["state"] == "degraded" and row["skipped"][0]["url"] == f"{base}/rl-2.xml", row
    assert main(["audit", "-c", str(config)]) == 1
    out = capsys.readouterr().out
    assert "in sync" not in out.replace("NOT IN SYNC", "") and f"{base}/rl-2.xml" in out, out
