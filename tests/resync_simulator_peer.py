"""Runs resync-simulator 1.1.0 (PyPI ``resync-simulator``, the ResourceSync team's changing Source) for tests.

Usage: ``python resync_simulator_peer.py SEED GATE SIMULATOR-ARGS...`` (without ``--port``/``--base-uri``).

The simulator itself is run unchanged; four things around it are the test's:

- it listens on every interface at a port given on its command line; here the socket is bound on
  127.0.0.1 at a port the kernel picks *before* the simulator starts (no race for the port), its number
  is printed as ``PORT n`` on stdout, and the simulator's server is handed that socket;
- on Python 3.11 ``random.sample`` no longer takes the dict views the simulator passes it for update
  and delete events (only creates would work): a sequence is made of them, as Python before 3.11 did;
- the random generator is seeded, so that a failing run can be replayed with the same events;
- its change loop (a ``time.sleep`` before each change) waits until the file GATE holds a number at
  least as large as the change about to be made: the test says how many changes may happen, and so
  when, without racing the clock.
"""

from __future__ import annotations

import random
import runpy
import shutil
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path

import tornado.netutil
import tornado.tcpserver


def _script() -> str:
    beside = Path(sys.executable).parent / "resync-simulator"
    found = str(beside) if beside.exists() else shutil.which("resync-simulator")
    if not found:
        raise SystemExit("resync-simulator is not installed (pip install resync-simulator==1.1.0)")
    return found


def _allowed(gate: Path) -> int:
    try:
        return int(gate.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _gate_changes(gate: Path) -> None:
    import simulator.source

    made = 0

    def sleep(seconds: float) -> None:
        nonlocal made
        time.sleep(seconds)
        made += 1
        while made > _allowed(gate):
            time.sleep(0.01)

    # Only the change loop's clock: the module reads time.time() too, which stays as it is.
    simulator.source.time = types.SimpleNamespace(time=time.time, sleep=sleep)  # type: ignore[attr-defined]


def main(argv: Sequence[str]) -> None:
    seed, gate, *args = argv
    random.seed(int(seed))
    _gate_changes(Path(gate))
    sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
    port = sockets[0].getsockname()[1]

    def listen(self: tornado.tcpserver.TCPServer, *_args: object, **_kw: object) -> None:
        self.add_sockets(sockets)

    tornado.tcpserver.TCPServer.listen = listen  # type: ignore[method-assign]

    sample = random.sample

    def sample_any(population: object, k: int, **kw: object) -> list:
        if not isinstance(population, Sequence):
            population = list(population)
        return sample(population, k, **kw)

    random.sample = sample_any  # type: ignore[assignment]
    script = _script()
    sys.argv = [script, *args, "--port", str(port), "--base-uri", f"http://127.0.0.1:{port}"]
    print(f"PORT {port}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
