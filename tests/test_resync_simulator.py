"""Acceptance: rsagg keeps in sync with resync-simulator 1.1.0, a changing Source nobody here wrote.

resync-simulator (PyPI, by the ResourceSync team) serves a Source Description, a Capability List, a
Resource List made at request time and a Change List kept in memory, while a thread creates, updates
and deletes resources. Its two modes publish different Change Lists:

- ``--spec-version 1.0``: no ``rs:md datetime``; ``<lastmod>`` on creates and updates only, a deletion
  carries neither;
- ``--spec-version 1.1``: ``datetime`` on every change, ``<lastmod>`` on creates and updates.

In both, the list's ``from`` is the oldest change's lastmod (so it is missing whenever that change is a
deletion), ``until`` is "now" on every request although the list keeps growing, and the list keeps only
the last ``MAX_CHANGES`` changes: a Destination that polls too slowly finds a gap.

The test harvests at the start of each round of changes (so while the Source changes; in this process,
with what ``rsagg harvest --once`` runs, to keep the test short), once after a round longer than the
list's memory (a gap), then runs ``rsagg harvest --once`` after the changes stopped: it must be ok, and
``rsagg audit`` must say in sync and ``rsagg status`` ``ok`` with as many resources as the Source's
Resource List; and ``rsagg validate``'s checks must find no error in its documents but a missing
``from``. The simulator runs through ``resync_simulator_peer.py``:
loopback only, a port the kernel picks, seeded events (the seed is in every failure message; set
RSAGG_SIMULATOR_SEED to replay one), and changes let through in rounds by the test, so that what happens
between two harvests does not depend on the machine's speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.commands.harvest import harvest_once
from aggregator.config import load_config
from aggregator.harvest.pipeline import Failure
from aggregator.rs.parse import parse_bytes
from aggregator.rs.validate import ERROR, check_source

from .harvesting import rsagg as run_rsagg

# Runs the resync-simulator and the resync client as real peers.
pytestmark = pytest.mark.slow

pytest.importorskip("simulator", reason="resync-simulator is a test dependency (pyproject [test])")

PEER = Path(__file__).resolve().parent / "resync_simulator_peer.py"
SOURCE = "sim"
RESOURCES = 20  # at the start
DELAY = 0.05  # seconds between changes within a round
MAX_CHANGES = 16  # the Change List keeps only the last 16 changes
GAP = "gap"
#: Changes per round; a harvest starts with each round, except that the GAP round (more changes than
#: the list keeps) is harvested only once it is over.
ROUNDS: list[tuple[int, str | None]] = [(5, None), (5, None), (MAX_CHANGES + 4, GAP), (5, None), (5, None)]
EVENTS = 1 + sum(n for n, _ in ROUNDS)  # the first change comes before the baseline
#: (--spec-version, seed). The seeds were not chosen for passing: each replays one sequence of events,
#: and "1.1, from missing at the gap" is the one that (with seed 3) makes the Change List read after the
#: GAP round start with a deletion, so that it has no ``from`` to show the gap.
RUNS = {"1.0": ("1.0", 10), "1.1": ("1.1", 11), "1.1-gap-list-without-from": ("1.1", 3)}
#: Generous limits: a hang fails the test instead of wedging the suite (never asserted as speed).
DEADLINE = 120.0
COMMAND_TIMEOUT = 120

SIMULATION = f"""\
source:
    name: rsagg acceptance
    number_of_resources: {RESOURCES}
    change_delay: {DELAY}
    event_types: [create, update, delete]
    average_payload: 300
    max_events: {EVENTS}
    stats_interval: 10
resource_list_builder:
    class: DynamicResourceListBuilder
    uri_path: resourcelist.xml
changememory:
    class: DynamicChangeList
    uri_path: changelist.xml
    max_changes: {MAX_CHANGES}
"""
LOGGING = """\
version: 1
formatters:
  plain: {format: "%(asctime)s %(name)s %(levelname)s %(message)s"}
handlers:
  stderr: {class: logging.StreamHandler, stream: ext://sys.stderr, formatter: plain}
root: {level: INFO, handlers: [stderr]}
"""


@dataclass
class Simulator:
    base: str
    log: Path
    gate: Path
    seed: int
    harvests: list[str] = field(default_factory=list)  # rsagg's summary line of each harvest
    allowed: int = 0

    def allow(self, more: int) -> None:
        """Let ``more`` changes happen (the simulator waits for them between its changes)."""
        self.allowed += more
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(self.allowed))
        tmp.replace(self.gate)

    def events(self) -> int:
        """Changes made so far (its change memory logs each one)."""
        return self.log.read_text().count("changememory INFO Event:")

    def caught_up(self) -> bool:
        """Every change allowed so far has been made (or the simulation is over)."""
        return self.events() >= self.allowed or self.finished()

    def finished(self) -> bool:
        return "Finished change simulation" in self.log.read_text()

    def why(self) -> str:
        log = "\n".join(ln for ln in self.log.read_text().splitlines() if "INFO Event:" not in ln)
        done = "\n".join(self.harvests)
        return f"seed {self.seed}; harvests:\n{done}\nsimulator log:\n{log[-2000:]}"


def start_simulator(tmp_path: Path, spec_version: str, seed: int) -> tuple[subprocess.Popen, Simulator]:
    (tmp_path / "simulation.yaml").write_text(SIMULATION)
    (tmp_path / "logging.yaml").write_text(LOGGING)
    log, gate = tmp_path / "simulator.log", tmp_path / "gate"
    gate.write_text("0")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(PEER), str(seed), str(gate),
             "--config-file", str(tmp_path / "simulation.yaml"),
             "--log-config", str(tmp_path / "logging.yaml"), "--spec-version", spec_version],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    assert banner.startswith("PORT "), f"simulator did not start: {banner!r} {log.read_text()[-3000:]}"
    return proc, Simulator(f"http://127.0.0.1:{int(banner.split()[1])}", log, gate, seed)


@pytest.fixture
def simulator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Simulator]:
    spec_version, seed = request.param
    seed = int(os.environ.get("RSAGG_SIMULATOR_SEED") or seed)
    proc, sim = start_simulator(tmp_path, spec_version, seed)
    try:
        yield sim
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def wait_for(what: str, condition: Callable[[], object], sim: Simulator) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"waited {DEADLINE} s for {what}; {sim.why()}"
        await trio.sleep(0.02)


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None


def rsagg(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return run_rsagg(*args, config=config, timeout=COMMAND_TIMEOUT)


def raced(failure: Failure) -> bool:
    """A resource that changed between the list and its fetch: the list's hash no longer matches, or it
    is gone. rsagg reports it (the harvest is not ok) and a later sync makes up for it."""
    return failure.kind == "fixity" or (failure.kind == "http" and "HTTP 404" in failure.message)


async def harvest(config: Path, sim: Simulator) -> None:
    """One harvest while the Source changes, in this process (what ``rsagg harvest --once`` runs):
    ok, or failed only for resources that changed under it."""
    (result,) = await harvest_once(load_config(config), [SOURCE])
    stats = result.stats
    sim.harvests.append(
        f"{'ok' if result.ok else 'failed'}: {sum(s.seen for s in stats)} entries, "
        f"{sum(s.fetched for s in stats)} fetched, {result.baselines} baseline(s), {result.gaps} gap(s)"
        + (f" — {result.error}" if result.error else "")
    )
    if not result.ok:
        assert result.failures and all(raced(f) for f in result.failures), sim.why()


def harvest_cli(config: Path, sim: Simulator) -> None:
    """``rsagg harvest --once`` once the Source has stopped changing: it must catch up completely."""
    done = rsagg("harvest", "--once", config=config)
    sim.harvests.append(done.stdout.strip())
    assert done.returncode == 0 and f"{SOURCE}: ok:" in done.stdout, done.stdout + done.stderr + sim.why()


@pytest.mark.parametrize("simulator", list(RUNS.values()), ids=list(RUNS), indirect=True)
async def test_harvest_resync_simulator_while_it_changes(tmp_path: Path, simulator: Simulator) -> None:
    sim = simulator
    # Its Change List answers 500 until the first change (it reads the first entry's time for from).
    sim.allow(1)
    await wait_for(
        "the first change", lambda: (r := get(f"{sim.base}/changelist.xml")) and r.status_code == 200, sim
    )
    config = tmp_path / "rsagg.toml"
    config.write_text(
        f'[store]\npath = "{tmp_path / "store"}"\n\n'
        f'[[sources]]\nname = "{SOURCE}"\nurl = "{sim.base}/"\n'  # the bare site root: discovery
    )
    await harvest(config, sim)  # the baseline, from the Resource List

    for changes, kind in ROUNDS:
        sim.allow(changes)
        if kind != GAP:
            await harvest(config, sim)  # while this round's changes are being made
        await wait_for(f"{changes} changes", sim.caught_up, sim)
        if kind == GAP:  # more changes than the list keeps since the last harvest
            await harvest(config, sim)
    await wait_for("the end of the simulation", sim.finished, sim)

    harvest_cli(config, sim)
    done = rsagg("audit", config=config)
    assert done.returncode == 0, done.stdout + done.stderr + sim.why()
    assert done.stdout.strip().splitlines()[-1] == f"{SOURCE}: in sync", done.stdout + sim.why()

    upstream = get(f"{sim.base}/resourcelist.xml")
    assert upstream is not None and upstream.status_code == 200
    _head, entries = parse_bytes(upstream.content)
    done = rsagg("status", "--json", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [r for r in json.loads(done.stdout)["sources"] if r["name"] == SOURCE]
    assert row["state"] == "ok" and row["last_error"] is None, row
    assert row["resources"] == len(entries), (row, len(entries), sim.why())

    # The validator on what the simulator serves: no error, except a Change List whose oldest change
    # kept is a deletion, which has no from (mandatory, §12.1, Appendix A).
    for doc in (".well-known/resourcesync", "capabilitylist.xml", "resourcelist.xml", "changelist.xml"):
        got = get(f"{sim.base}/{doc}")
        assert got is not None and got.status_code == 200, doc
        report = check_source(got.content, f"{sim.base}/{doc}")
        errors = {i.rule for i in report.issues if i.severity == ERROR}
        if doc == "changelist.xml":
            head, _ = parse_bytes(got.content)
            assert errors == ({"from-required"} if head.md.from_ is None else set()), report.issues
        else:
            assert errors == set() and report.entries > 0, report.issues
