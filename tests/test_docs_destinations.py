"""docs/destinations.md's resync-sync commands, run as written against rsagg serving a set named ``demo``.

The page's shell blocks are read from the page itself, so a command that stops working (an option resync
refuses, a URL rsagg no longer serves) fails here: only the base URL is replaced by the test server's.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import trio

from aggregator.publish.uris import rsagg_uri
from aggregator.testing.upstream import Upstream

from .harvesting import harvest, make_config
from .test_publish import get_doc, local_files, publishing, with_publish

# Runs the documentation's resync commands as processes.
pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parent.parent / "docs" / "destinations.md"
DOC_BASE = "http://127.0.0.1:8080"
BIN = str(Path(sys.executable).parent)


def page_commands() -> list[str]:
    """Each ```sh block of the page that runs resync-sync, as one shell script."""
    blocks = re.findall(r"^```sh\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    return [b for b in blocks if "resync-sync" in b]


async def run(script: str, base: str, cwd: Path) -> str:
    script = script.replace(DOC_BASE, base)
    if shutil.which("curl") is None:  # the page's window loop reads the index with curl
        script = script.replace("curl -s", f"{sys.executable} -c 'import sys, urllib.request as u; "
                                "sys.stdout.write(u.urlopen(sys.argv[1]).read().decode())'")  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = await trio.run_process(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_stdout=True,
        capture_stderr=True, check=False,
    )  # fmt: skip
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == 0 and "FatalError" not in out, out  # resync exits 0 even after one
    return out


def expected(up: Upstream, base: str, prefix: str) -> dict[str, bytes]:
    """resync's files: the URI's rest after ``prefix`` (the mapped URL), under the folder."""
    return {rsagg_uri(base, "demo", up.url(p))[len(prefix) + 1 :]: v.data for p, v in up.resources().items()}


def change(up: Upstream, round_: int) -> None:
    up.update(f"r{round_:06d}.txt", f"changed in round {round_}\n".encode())
    up.delete(f"r{round_ + 5:06d}.txt")
    up.create(f"new-{round_}.txt", f"new in round {round_}\n".encode())


async def test_the_pages_resync_commands(tmp_path: Path):
    blocks = page_commands()
    baseline, incremental, windows, audit, per_set = blocks  # the page's order
    assert "--baseline" in baseline and "--incremental" in incremental and "for CL in" in windows
    assert "--audit" in audit and per_set.count("resync-sync") == 3
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(12)
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"demo": ubase})
        assert (await harvest(cfg))["demo"].ok
        # resync keeps changes at or after its baseline's newest lastmod: a later batch before the
        # baseline keeps the creations above out of that window (see test_publish's resync test).
        up.update("r000011.txt", b"touched before the baseline\n")
        assert (await harvest(cfg))["demo"].ok
        one, per = tmp_path / "one", tmp_path / "per-set"
        one.mkdir()
        per.mkdir()
        async with publishing(cfg) as (base, _client):
            out = await run(baseline, base, one)
            assert "SYNCED" in out, out
            assert local_files(one / "mirror") == expected(up, base, base)
            setup, inc, check = per_set.strip().splitlines()
            assert "SYNCED" in await run(setup, base, per)

            change(up, 1)
            assert (await harvest(cfg))["demo"].ok
            assert "CHANGES APPLIED" in await run(incremental, base, one)
            assert local_files(one / "mirror") == expected(up, base, base)
            out = await run(audit, base, one)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out
            assert "CHANGES APPLIED" in await run(inc, base, per)
            assert local_files(per / "demo") == expected(up, base, f"{base}/demo")
            out = await run(check, base, per)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out

        # Past publish.changelist_size the Change List is an index of windows: the page's loop. (A new
        # server has a new port, so a new base URL: resync, which keys its position by URL, starts over.)
        small = with_publish(cfg, changelist_size=10)
        looped = tmp_path / "windows"
        looped.mkdir()
        async with publishing(small) as (base, client):
            assert "SYNCED" in await run(baseline, base, looped)
            change(up, 2)
            assert (await harvest(small))["demo"].ok
            head, _ = await get_doc(client, f"{base}/demo/changelist.xml")
            assert head.is_index
            assert "CHANGES APPLIED" in await run(windows, base, looped)
            assert local_files(looped / "mirror") == expected(up, base, base)
            out = await run(audit, base, looped)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out
