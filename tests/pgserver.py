"""A private PostgreSQL 15 server for tests (Debian's ``postgresql-15``), shared by a test session.

``initdb`` refuses to run as root: as root the server runs as the ``postgres`` user (``runuser``), else as
the current user. Its data folder is a fresh temporary folder; it listens on 127.0.0.1 at a port picked
here and on a Unix socket in that folder, and stops (``pg_ctl stop -m fast``) when the session ends.

Clients log in over TCP with a password (``scram-sha-256``: the tests check that a wrong one is refused
with a clean message); over the socket, local users are trusted. Each test gets a schema of its own
(``fresh_url``): cheaper than a database per test, and as isolated for rsagg, which names no schema.
Fsync is off unless ``durable`` (benchmarks): the tests check rsagg's transactions, not the disk.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

BIN = Path("/usr/lib/postgresql/15/bin")
USER = "rsagg"  # the role rsagg logs in as (a superuser of the test cluster)


def available() -> bool:
    return (BIN / "initdb").exists() and (BIN / "pg_ctl").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """A running test cluster; ``url()`` names a database or schema in it."""

    def __init__(self, *, durable: bool = False) -> None:
        #: fsync and full-page writes on, as in production (benchmarks); off for tests, which check rsagg's
        #: transactions, not the disk.
        self.durable = durable
        self.root = Path(tempfile.mkdtemp(prefix="rsagg-pg-"))
        self.data = self.root / "data"
        self.password = secrets.token_urlsafe(16)
        self.port = 0
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o700)

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self._as, *argv], check=True, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )

    def start(self) -> PgServer:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self._as:
            shutil.chown(pwfile, "postgres", "postgres")
        self._run(
            str(BIN / "initdb"), "-D", str(self.data), "-U", USER, "--pwfile", str(pwfile),
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        pwfile.unlink()
        for attempt in range(5):  # the port picked may be taken by someone else meanwhile
            self.port = _free_port()
            try:
                self.resume()
                break
            except subprocess.CalledProcessError:
                if attempt == 4:
                    raise RuntimeError("PostgreSQL did not start:\n" + self.log()) from None
        return self

    def resume(self) -> None:
        """Start the server (again, after ``pause``) on its port."""
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200 "
            + ("-c shared_buffers=128MB" if self.durable else
               "-c shared_buffers=32MB -c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        )  # fmt: skip
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"),
                  "-w", "-t", "120", "start")  # fmt: skip

    def pause(self) -> None:
        """Stop the server (``-m fast``: its clients' connections are cut), keeping its data."""
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.pause()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres", *, password: bool = True, schema: str | None = None) -> str:
        """A ``postgresql://`` URL of the server (with the password unless told not to)."""
        auth = f"{USER}:{quote(self.password, safe='')}" if password else USER
        url = f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"
        if schema:
            url += f"?options=-csearch_path%3D{schema}"
        return url

    def sql(self, statement: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(statement)

    def fresh_url(self) -> str:
        """A URL of an empty schema made for the caller (rsagg creates its tables in it)."""
        schema = f"t_{secrets.token_hex(6)}"
        self.sql(f"CREATE SCHEMA {schema}")
        return self.url(schema=schema)

    def fresh_database(self) -> str:
        """A URL of an empty database made for the caller (for what must not share a database)."""
        name = f"d_{secrets.token_hex(6)}"
        self.sql(f"CREATE DATABASE {name}")
        return self.url(name)


@contextlib.contextmanager
def running(*, durable: bool = False) -> Iterator[PgServer]:
    server = PgServer(durable=durable)
    try:
        yield server.start()
    finally:
        server.stop()


__all__ = ["BIN", "USER", "PgServer", "available", "running"]
