"""Start a sample upstream Source on loopback and an rsagg harvesting and republishing it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._common import add_global_arguments

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    import random

    from ..config import Config
    from ..run.compose import Assembly
    from ..run.daemon import ListenError
    from ..testing.upstream import Upstream


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_global_arguments(p)  # --log-level, --log-format (the demo writes its own configuration)
    p.add_argument("--port", type=int, default=8080, help="rsagg's port (0: any free port)")
    p.add_argument("--upstream-port", type=int, default=0, help="the sample upstream's port (0: any)")
    p.add_argument("--resources", type=int, default=300, help="resources in the sample upstream")
    p.add_argument("--change-every", type=float, default=3.0, help="seconds between upstream changes")
    p.add_argument("--interval", type=float, default=5.0, help="rsagg's poll interval in seconds")
    p.add_argument("--data", type=Path, default=None, help="store folder (default: a temporary one)")
    p.add_argument("--duration", type=float, default=0, help="stop after this many seconds (0: run until ^C)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_note(resources: int) -> str:
    """Why the demo's source holds about twice ``--resources``: said on its home page and status."""
    return (
        f"the sample Source publishes {resources} resources, each with a metadata record "
        f'(<path>.meta.xml, linked rel="describedby"): {2 * resources} resources at the start; every '
        "--change-every seconds it creates one more and may update two and delete one (each with its record)"
    )


def demo_config(data: Path, port: int, upstream_url: str, interval: float, resources: int = 300) -> Config:
    from ..config import parse_config

    return parse_config(
        {
            "server": {"listen": f"127.0.0.1:{port}", "base_url": f"http://127.0.0.1:{port}"},
            "store": {"path": str(data)},
            "harvest": {"interval": interval, "jitter": 0.0},
            "sources": [{"name": "demo", "url": upstream_url, "note": demo_note(resources)}],
        },
        str(data / "demo.toml"),
    )


async def _keep_changing(up: Upstream, every: float, rng: random.Random) -> None:
    import trio

    """A living Source: every few seconds some resources change, one appears, one goes."""
    serial = 0
    while True:
        await trio.sleep(every)
        paths = sorted(up.resources())
        if not paths:
            continue
        for path in rng.sample(paths, min(2, len(paths))):
            if path.endswith(".txt"):
                up.update(path, f"{path} updated at change {serial}\n".encode())
        victim = rng.choice(paths)
        if victim.endswith(".txt"):
            up.delete(victim)
        up.create(f"new-{serial:05d}.txt", f"created at change {serial}\n".encode())
        serial += 1


async def run_demo(args: argparse.Namespace, data: Path) -> None:
    import random

    import trio

    from ..run.daemon import run_daemon
    from ..testing.notify import UpstreamNotifier
    from ..testing.upstream import Upstream

    up = Upstream(metadata=True, changes_per_list=50, resourcelist_page_size=50_000)
    notifier = UpstreamNotifier(up)
    up.bulk_create(args.resources)
    rng = random.Random(1)
    port = args.port or _free_port()
    async with trio.open_nursery() as nursery:
        upstream = await nursery.start(up.serve, "127.0.0.1", args.upstream_port)
        await nursery.start(notifier.run)  # change + framework notifications through its own hub
        well_known = f"{upstream}/.well-known/resourcesync"
        config = demo_config(data, port, well_known, args.interval, args.resources)

        async def ready(parts: Assembly, bound: str) -> None:
            base = config.server.base_url
            print(
                f"rsagg demo running (store: {data})\n"
                f"  sample upstream Source:  {upstream}/.well-known/resourcesync\n"
                f"  rsagg home page:         {base}/\n"
                f"  rsagg Source Description {base}/.well-known/resourcesync\n"
                f"  status:                  rsagg status -c {data / 'demo.toml'}\n"
                f"  counts: {demo_note(args.resources)}\n"
                "Press Ctrl-C to stop.",
                flush=True,
            )

        (data / "demo.toml").write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "http://127.0.0.1:{port}"\n'
            f'[store]\npath = "."\n[[sources]]\nname = "demo"\nurl = "{upstream}/.well-known/resourcesync"\n'
            f"note = {json.dumps(demo_note(args.resources))}\n"  # a TOML basic string is a JSON string
        )

        async def daemon(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
            await run_daemon(config, on_ready=ready, task_status=task_status)
            nursery.cancel_scope.cancel()  # the daemon stopped on a signal: stop the upstream too

        await nursery.start(daemon)
        nursery.start_soon(_keep_changing, up, args.change_every, rng)
        if args.duration:
            await trio.sleep(args.duration)
            nursery.cancel_scope.cancel()


def _listen_error(exc: BaseException) -> ListenError | None:
    from ..run.daemon import ListenError

    if isinstance(exc, ListenError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((e for e in map(_listen_error, exc.exceptions) if e is not None), None)
    return None


def _run(args: argparse.Namespace, data: Path) -> None:
    import trio

    from ..store.lock import store_lock

    with store_lock(data, "rsagg demo"):
        trio.run(run_demo, args, data)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from ..observe.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        if args.data is not None:
            try:
                args.data.mkdir(parents=True, exist_ok=True)
                probe = tempfile.TemporaryFile(dir=args.data)
            except OSError as exc:
                print(f"rsagg demo: --data {args.data}: cannot use it as the store folder: "
                      f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
                return 2
            probe.close()
            _run(args, args.data.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="rsagg-demo-") as tmp:
                _run(args, Path(tmp))
    except BaseException as exc:
        listen = _listen_error(exc)
        if listen is None:
            raise
        print(
            f"rsagg demo: cannot listen on 127.0.0.1:{args.port}: {str(listen).rsplit(': ', 1)[-1]}; "
            "choose another port with --port N (--port 0: any free port)",
            file=sys.stderr,
        )
        return 1
    return 0
