"""``benchmarks/bench_publish.py --floor`` measures the least an nginx answer cache can cost next to a
static file: its "smallest answer" must be what it says (the bytes of the static file under two header
lines, kept by nginx as such and answered from the cache once kept), else the floor it prints is not a
floor. The shipped configuration's variant must keep that answer too (it keeps what ``X-Accel-Expires``
says, as rsagg's answers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_publish

NGINX = bench_publish.nginx_binary()


def cached_answers(folder: Path) -> list[bytes]:
    """Each file of an nginx answer cache, from its ``KEY:`` line on (the binary header before it left
    out)."""
    return [f.read_bytes().split(b"\nKEY: ", 1)[1] for f in sorted(folder.rglob("*")) if f.is_file()]


def hit_after_upstream_stops(
    servers: bench_publish.Servers, conf: str, work: Path, port: int, path: str, upstream
) -> tuple[bytes, bytes]:
    """nginx with ``conf``: ``path`` fetched (kept), the upstream stopped, fetched again (a hit: no one
    else can answer it now); both bodies."""
    proc = bench_publish.start_nginx_with(servers, conf, work)
    assert proc is not None
    base = f"http://127.0.0.1:{port}"
    bench_publish.wait_until_up(base + "/", proc, 30)
    first = httpx.get(base + path, timeout=10)
    assert first.status_code == 200, first.text
    servers.stop(upstream)
    second = httpx.get(base + path, timeout=10)
    assert second.status_code == 200
    return first.content, second.content


@pytest.mark.slow  # starts nginx
@pytest.mark.skipif(NGINX is None or not os.path.exists(NGINX), reason="nginx is not installed")
def test_the_floor_keeps_the_smallest_answer_and_answers_from_it(tmp_path: Path) -> None:
    servers = bench_publish.Servers()
    try:
        for k in (7, 39):  # a short body and a long one
            static = tmp_path / f"static{k}"
            (path,) = bench_publish.write_static(static, [f"http://x/r/{k}.txt"])
            want = (static / path.lstrip("/")).read_bytes()
            upstream, up_base = bench_publish.start_answers(servers, 0)
            port = bench_publish.free_port()
            work = tmp_path / f"floor{k}"
            got = hit_after_upstream_stops(
                servers, bench_publish.floor_conf(up_base, port), work, port, path, upstream
            )
            assert got == (want, want)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(want)
            assert cached_answers(work / "floor") == [f"{path}\n".encode() + head + want]
    finally:
        servers.stop_all()


@pytest.mark.slow  # starts nginx
@pytest.mark.skipif(NGINX is None or not os.path.exists(NGINX), reason="nginx is not installed")
def test_the_shipped_configuration_keeps_the_smallest_answer_too(tmp_path: Path) -> None:
    servers = bench_publish.Servers()
    try:
        path = "/bench/r/http/upstream.example/r/12.txt"  # a resource's path, as rsagg's
        want = bench_publish.blob_bytes(12)
        upstream, up_base = bench_publish.start_answers(servers, 3600)
        port = bench_publish.free_port()
        conf = bench_publish.shipped_minimal_conf(up_base, tmp_path / "blobs", port)
        got = hit_after_upstream_stops(servers, conf, tmp_path / "shipped", port, path, upstream)
        assert got == (want, want)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(want)
        (answer,) = cached_answers(tmp_path / "shipped" / "answers")
        assert answer == f"{path}\n".encode() + head + b"X-Accel-Expires: 3600\r\n\r\n" + want
    finally:
        servers.stop_all()


def test_the_floor_table_gives_each_ratio_against_nginx_static() -> None:
    def case(rps: float, cpu: float, ir: float) -> dict:
        functions = dict.fromkeys(bench_publish.FLOOR_FUNCTIONS, ir / 2)
        return {"rps": rps, "cpu_us": cpu, "kernel": 0.6, "load": 1.0, "ir": ir, "functions": functions}

    results = {
        "nginx static": case(100_000, 10.0, 10_000),
        "hit, smallest answer": case(80_000, 12.5, 16_000),
        "hit, smallest answer, shipped conf": case(75_000, 13.0, 20_000),
        "hit, rsagg's answer, shipped conf": case(70_000, 14.0, 28_000),
    }
    table = bench_publish.floor_table(results, 32)
    assert "0.80x by req/s, 0.80x by CPU, 0.62x by nginx's instructions" in table
    rsagg = next(line for line in table.splitlines() if line.startswith("hit, rsagg's answer"))
    assert rsagg.split()[5:] == ["70,000", "0.70x", "1.00", "14.0", "60%", "0.71x", "28,000", "0.36x"]
    for what in bench_publish.FLOOR_FUNCTIONS.values():
        assert what.strip() in table


def test_a_body_of_a_given_size_is_its_blobs_bytes_repeated() -> None:
    for i in (0, 7, 299, 300):
        assert bench_publish.body_of(i) == bench_publish.blob_bytes(i % bench_publish.BLOBS)
        for size in (1, 100, 4096, 2_000_000):
            body = bench_publish.body_of(i, size)
            assert len(body) == size
            assert body == (bench_publish.blob_bytes(i % bench_publish.BLOBS) * size)[:size]
