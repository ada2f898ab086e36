"""Every anonymous request that is not well formed gets a 4xx, never a 500, and logs no traceback.

Generated cases, not a list: every route the daemon serves (read from the app itself, so a new route is
covered the day it is added) with each path parameter replaced by hostile values (huge, negative,
non-ASCII, invalid UTF-8, encoded slashes and dots, NUL, overlong), plus whole targets no route has
(absolute-form, ``*``, fragments), sent as raw bytes to a real ``rsagg run`` with ``server.workers`` 1
and 2 (the second forwards what only the daemon answers).
"""

from __future__ import annotations

import random
import re
import signal
import socket
from pathlib import Path

import pytest
import trio

from aggregator.config import load_config
from aggregator.run.compose import open_assembly
from aggregator.testing.upstream import Upstream

from .harvesting import start_daemon

# Sends generated hostile requests to a real `rsagg run` process.
pytestmark = pytest.mark.slow

GUARD = 60
#: Values each path parameter is replaced with (as raw target bytes).
HOSTILE_VALUES = [
    b"9" * 19, b"9" * 40, str(2**63).encode(), str(2**64).encode(), b"-1", b"-9223372036854775809",
    b"0", b"00000000000000000000001", b"1e9", b"0x10", b"%C2%B2", b"\xc2\xb2", b"%C3%A9", b"\xc3\xa9",
    b"%FF", b"\xff", b"%00", b"a%2Fb", b"%2e%2e", b"..", b"%", b"%zz", b"a" * 4000, b"end", b"",
]  # fmt: skip
#: Whole targets: not origin-form, or with what no path has.
HOSTILE_TARGETS = [
    b"*", b"http://{host}/up/resourcelist.xml", b"http://{host}/status.json", b"https://evil.example/",
    b"http://{host}/up/resourcedump.xml", b"/up/changelist/1.xml#frag", b"/#", b"/metrics#x",
    b"//{host}/up/capabilitylist.xml", b"/%", b"/?%", b"/up/resourcedump/1.zip?#", b"/\xff", b"/a%00b",
    b"/up/resourcelist/" + b"9" * 30 + b"-end.xml", b"/up/changedump/" + b"9" * 30 + b"/manifest.xml",
]  # fmt: skip
METHODS = [b"GET", b"HEAD", b"POST", b"OPTIONS", b"PUT"]
_PARAM = re.compile(r"\{([a-z_]+)(?::[a-z]+)?\}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route_templates(app) -> list[str]:
    """Every route's path template of a starlette app (mounts included)."""
    out = []
    for route in app.routes:
        path = getattr(route, "path", None)
        if path is not None:
            out.append(path)
    return out


def targets(
    templates: list[str], host: bytes, set_name: bytes, rng: random.Random
) -> list[tuple[bytes, bytes]]:
    """(method, target): each parameter of each route given each hostile value (the others sane)."""
    sane = {"set": set_name, "rest": b"http/example.org/x", "token": b"abc", "number": b"1", "k": b"1",
            "lo": b"1", "hi": b"end"}  # fmt: skip
    out: set[tuple[bytes, bytes]] = set()
    for template in templates:
        names = _PARAM.findall(template)
        for name in names or [None]:
            for value in HOSTILE_VALUES:

                def fill(m: re.Match[str], name: str | None = name, value: bytes = value) -> str:
                    got = value if m.group(1) == name else sane.get(m.group(1), b"x")
                    return got.decode("latin-1")

                target = _PARAM.sub(fill, template).encode("latin-1")
                out.add((rng.choice(METHODS[:2]), target))
                out.add((rng.choice(METHODS), target))
    for t in HOSTILE_TARGETS:
        for method in METHODS:
            out.add((method, t.replace(b"{host}", host).replace(b"/up/", b"/" + set_name + b"/")))
    return sorted(out)


async def ask(port: int, method: bytes, target: bytes, *, whole: bool = False) -> bytes:
    """The raw status line of one request on a fresh connection (b"" when closed without an answer);
    ``whole``: the whole answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        body = b"x=1" if method in (b"POST", b"PUT") else b""
        await stream.send_all(
            method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
        )
        data = b""
        with trio.fail_after(GUARD):
            while whole or b"\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
        return data if whole else data.split(b"\r\n", 1)[0]
    finally:
        await stream.aclose()


@pytest.mark.parametrize("workers", [1, 2])
async def test_hostile_targets_get_4xx_never_500_and_no_traceback(tmp_path: Path, workers: int):
    up = Upstream()
    for i in range(6):
        up.create(f"r{i}.txt", f"resource {i}\n".encode(), "text/plain")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with up.serving() as ubase:
        config_path = tmp_path / "rsagg.toml"
        config_path.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\nworkers = {workers}\n'
            f'[store]\npath = "{tmp_path / "data"}"\n[publish]\nchangelist_size = 2\n'
            "[harvest]\njitter = 0\nretries = 1\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 3600\n'
        )
        config = load_config(config_path)
        async with open_assembly(config) as parts:  # the routes, as the daemon builds them
            templates = route_templates(parts.app(config))
        assert any("resourcedump" in t for t in templates) and any("_websub" in t for t in templates)
        log_path = tmp_path / "daemon.log"
        log = log_path.open("ab")
        daemon = await start_daemon(config_path, log)
        try:
            with trio.fail_after(GUARD):  # serving and harvested: a set is published
                while True:
                    try:
                        found = re.search(
                            rb"/([^/<]+)/capabilitylist\.xml</loc>",
                            await ask(port, b"GET", b"/.well-known/resourcesync", whole=True),
                        )
                        if found:
                            break
                    except OSError:
                        pass
                    await trio.sleep(0.2)
            set_name = found.group(1)
            cases = targets(templates, f"127.0.0.1:{port}".encode(), set_name, random.Random(workers))
            bad = []
            for method, target in cases:
                line = await ask(port, method, target)
                status = int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None
                if status is None or status >= 500:
                    bad.append((method, target[:80], line))
            assert not bad, bad[:20]
            assert (await ask(port, b"GET", b"/%s/resourcelist.xml" % set_name)).startswith(b"HTTP/1.1 200")
        finally:
            daemon.send_signal(signal.SIGTERM)
            with trio.move_on_after(GUARD):
                await daemon.wait()
            log.close()
        text = log_path.read_text(errors="replace")
        assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
        assert len(cases) > 300
