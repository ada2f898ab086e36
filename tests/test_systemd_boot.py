"""The units under a real systemd: docs/deploy.md followed verbatim in a booted container.

The container is the machine's own root under an overlay (a tmpfs upper layer, in a mount namespace of
its own: nothing on the machine changes, and the mounts vanish with the test), booted with
``systemd-nspawn --boot`` into a minimal target (sysinit only: no nginx, database or getty of the
machine's is started). It shares the machine's network, so the test's Source on 127.0.0.1 is reachable
and rsagg's HTTP server is asked from here. Commands run inside with ``nsenter`` (no machined needed).

rsagg itself must be installed in /opt/rsagg as docs/deploy.md section 1 says (``.ci/run`` does it; the
overlay shows it in the container); everything after that — the user, the units, the configuration,
``systemctl enable --now`` — is the documentation's own blocks, run as they stand.

What it shows: ``systemctl start`` returns once rsagg serves (READY=1); ``systemctl reload`` takes a new
source without a restart; the group rsagg (nginx's user joins it) reads a blob and not the state; the gc
timer starts ``rsagg gc`` (a missed daily run caught up, ``Persistent=true``); the watchdog restarts a
hung event loop (a test-only plugin blocks the loop on SIGUSR2, tests/hang_plugin); ``systemctl stop``
ends with exit status 0 within ``TimeoutStopSec`` (systemd records ``Result=timeout`` otherwise).

Skipped without root, systemd-nspawn or /opt/rsagg; ``RSAGG_REQUIRE_SYSTEMD=1`` (``.ci/run``) makes
those a failure instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploydocs import REPO, RSAGG, block

# Boots the shipped units under a real systemd (systemd-nspawn).
pytestmark = pytest.mark.slow

REQUIRE = os.environ.get("RSAGG_REQUIRE_SYSTEMD") == "1"
#: Generous bounds for conditions on a loaded machine (never an assertion about speed).
BOOT_BOUND = 120.0
BOUND = 90.0
#: The test's watchdog (a drop-in, as an operator would shorten it): the shipped 60 s is too long to wait.
WATCHDOG_SEC = 15


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts, systemd-nspawn)"
    for tool in ("systemd-nspawn", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: systemd-container, util-linux)"
    if not Path(RSAGG).exists():
        return f"{RSAGG} is missing: install rsagg as docs/deploy.md section 1 says (.ci/run does)"
    return None


@pytest.fixture(scope="module", autouse=True)
def _possible() -> None:
    why = missing()
    if why and REQUIRE:
        pytest.fail(f"RSAGG_REQUIRE_SYSTEMD=1 but {why}")
    if why:
        pytest.skip(why)


# -- the machine ------------------------------------------------------------------------------------

BOOT_SCRIPT = r"""
B="$1"; NAME="$2"; REPO="$3"
mount -t tmpfs -o mode=0755 tmpfs "$B"
mkdir "$B/upper" "$B/work" "$B/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$B/upper,workdir=$B/work" "$B/root"
mkdir -p "$B/root/etc/systemd/system"
printf '%s\n' '[Unit]' 'Description=rsagg test boot' 'Requires=sysinit.target' 'After=sysinit.target' \
    'AllowIsolate=yes' > "$B/root/etc/systemd/system/rsagg-test.target"
# The checkout at its own path, read-only (the overlay has it too unless it is on another file system).
exec systemd-nspawn -q -D "$B/root" --boot --register=no --keep-unit -M "$NAME" --bind-ro="$REPO" -- \
    systemd.unit=rsagg-test.target
"""


class Machine:
    """A booted container; ``sh`` runs a shell command in it as root."""

    def __init__(self, base: Path, log: Path) -> None:
        self.name = f"rsaggtest{os.getpid()}"
        base.mkdir()
        self._log = log.open("wb")
        # unshare: the tmpfs and the overlay live in a mount namespace of their own (gone with it).
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private",
             "bash", "-euc", BOOT_SCRIPT, "boot", str(base), self.name, str(REPO)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.leader = 0
        try:
            self.leader = int(wait_for(self._find_leader, BOOT_BOUND, "the container's PID 1", log))
            # Until systemd listens on its private socket, systemctl cannot connect ("Failed to connect").
            state = wait_for(self._booted, BOOT_BOUND, "the end of the boot", log)
            assert state in ("running", "degraded"), log.read_text(errors="replace")[-3000:]
        except BaseException:
            self.close()  # no machine left running when the boot fails
            raise

    def _booted(self) -> str | None:
        r = self.sh("systemctl is-system-running --wait", check=False, timeout=BOOT_BOUND)
        # "offline" (or "Failed to connect"): systemd does not answer on its socket yet.
        state = r.stdout.strip()
        return None if "Failed to connect" in r.stderr or state in ("", "offline") else state

    def _find_leader(self) -> int | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd-nspawn ended with {self.proc.returncode}")
        with contextlib.suppress(OSError):
            # unshare execs bash, bash execs systemd-nspawn: its child is the container's systemd.
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            for pid in children:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
        return None

    def sh(
        self, command: str, *, check: bool = True, timeout: float = BOUND, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", "--", "bash", "-euo", "pipefail", "-c", command],
            input=stdin, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check:
            assert r.returncode == 0, f"{command!r} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.sh(f"journalctl -u {unit} -o cat --no-pager", check=False).stdout

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                if self.leader:
                    self.sh("systemctl poweroff --no-block", check=False, timeout=30)
                else:
                    self.proc.terminate()  # systemd-nspawn halts its container on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()
        # systemd-nspawn leaves this empty folder behind when the machine's /run is not a tmpfs.
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)


def wait_for(probe: Callable[[], object], bound: float, what: str, log: Path | None = None) -> object:
    """Poll ``probe`` until it returns something truthy; fail after ``bound`` seconds (a generous bound)."""
    deadline = time.monotonic() + bound
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise AssertionError(f"no {what} within {bound:.0f} s\n{tail}")
        time.sleep(0.2)


# -- the Source and the configuration -----------------------------------------------------------------

NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'
#: The Sources: name -> number of resources. "b" is added by the reload.
SOURCES = {"a": 5, "b": 3}


def write_source(root: Path, base: str, name: str, n: int) -> None:
    """A static ResourceSync Source: a Capability List naming a Resource List of ``n`` text files."""
    folder = root / name
    folder.mkdir(parents=True)
    urls = []
    for i in range(n):
        data = f"source {name}, resource {i}\n".encode()
        (folder / f"r{i}.txt").write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        md = f'<rs:md hash="sha-256:{digest}" length="{len(data)}" type="text/plain"/>'
        urls.append(
            f"<url><loc>{base}/{name}/r{i}.txt</loc><lastmod>2026-01-01T00:00:00Z</lastmod>{md}</url>"
        )
    at = 'at="2026-01-01T00:00:00Z" completed="2026-01-01T00:00:00Z"'
    (folder / "resourcelist.xml").write_text(
        f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {NS}><rs:md capability="resourcelist" {at}/>'
        + "".join(urls)
        + "</urlset>\n"
    )
    (folder / "capabilitylist.xml").write_text(
        f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {NS}><rs:md capability="capabilitylist"/>'
        f'<url><loc>{base}/{name}/resourcelist.xml</loc><rs:md capability="resourcelist"/></url></urlset>\n'
    )


@contextlib.contextmanager
def source_server(root: Path) -> Iterator[str]:
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    for name, n in SOURCES.items():
        write_source(root, base, name, n)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield base
    finally:
        srv.shutdown()
        srv.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(port: int, upstream: str, names: list[str]) -> str:
    sources = "".join(
        f'\n[[sources]]\nname = "{n}"\nurl = "{upstream}/{n}/capabilitylist.xml"\n' for n in names
    )
    return (
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "http://127.0.0.1:{port}"\noffload = "x-accel"\n'
        f'\n[store]\npath = "/var/lib/rsagg"\n{sources}'
    )


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    """status, headers (names in lower case), body."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def resources_of(port: int) -> dict[str, int]:
    """Source name -> resources, from /status.json; {} while rsagg does not answer."""
    try:
        status, _, body = get(f"http://127.0.0.1:{port}/status.json")
    except OSError:
        return {}
    if status != 200:
        return {}
    return {r["name"]: r["resources"] for r in json.loads(body)["sources"]}


# -- the test ---------------------------------------------------------------------------------------


@pytest.fixture
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    """A freshly booted machine for each test (a boot takes a second or two)."""
    tmp = tmp_path_factory.mktemp("systemd-boot")
    m = Machine(tmp / "machine", tmp / "console.log")
    try:
        yield m
    finally:
        m.close()


def test_deploy_under_systemd(machine: Machine, tmp_path: Path) -> None:
    m = machine
    port = free_port()
    with source_server(tmp_path / "www") as upstream:
        # docs/deploy.md sections 2 and 3, as they stand, in a checkout (the overlay shows this one).
        m.sh(f"cd {shlex.quote(str(REPO))}\n" + "\n".join(block("units")))
        m.sh(f"cd {shlex.quote(str(REPO))}\n" + "\n".join(block("config")))
        # A configuration mistake: the start fails with rsagg's one line in the journal, and no restart
        # loop (exit status 2 is RestartPreventExitStatus=: the unit is "failed", not "auto-restart").
        bad = config(port, upstream, ["a"]).replace(f'listen = "127.0.0.1:{port}"', 'listen = "nonsense"')
        m.sh("cat > /etc/rsagg/rsagg.toml", stdin=bad)
        m.sh("systemctl daemon-reload")
        assert m.sh("systemctl start rsagg", check=False).returncode != 0
        failed = m.show("rsagg", "ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts")
        assert failed == {
            "ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "ExecMainStatus": "2",
            "NRestarts": "0",
        }  # fmt: skip
        said = [ln for ln in m.journal("rsagg").splitlines() if "rsagg run:" in ln]
        assert said == ["rsagg run: config error: /etc/rsagg/rsagg.toml: server.listen: must be HOST:PORT, "
                        "not 'nonsense'"], m.journal("rsagg")  # fmt: skip
        # "Then edit /etc/rsagg/rsagg.toml" (the file keeps its owner and mode).
        m.sh("cat > /etc/rsagg/rsagg.toml", stdin=config(port, upstream, ["a"]))
        assert m.sh("stat -c '%U:%G %a' /etc/rsagg/rsagg.toml").stdout.split() == ["root:rsagg", "640"]
        # Test-only: the plugin that hangs the loop on SIGUSR2, and a watchdog short enough to wait for.
        pip = "/opt/rsagg/bin/pip install -q --no-deps"
        m.sh(f"cp -r {REPO}/tests/hang_plugin /root/hang_plugin && {pip} /root/hang_plugin")
        m.sh(
            "mkdir -p /etc/systemd/system/rsagg.service.d && printf '[Service]\\nWatchdogSec=%d\\n' "
            f"{WATCHDOG_SEC} > /etc/systemd/system/rsagg.service.d/test-watchdog.conf"
        )

        # Section 4: enable --now. For Type=notify, start returns once READY=1 came: rsagg serves now.
        started = m.sh(
            f"cd {shlex.quote(str(REPO))}\n" + "\n".join(block("start")), check=False, timeout=BOOT_BOUND
        )
        assert started.returncode == 0, started.stderr + m.journal("rsagg")
        st = m.show("rsagg", "ActiveState", "SubState", "MainPID", "User", "NRestarts")
        assert (st["ActiveState"], st["SubState"], st["User"], st["NRestarts"]) == (
            "active",
            "running",
            "rsagg",
            "0",
        )
        status, _, _ = get(f"http://127.0.0.1:{port}/status.json")
        assert status == 200
        pid = st["MainPID"]
        assert m.sh(f"stat -c %U /proc/{pid}").stdout.strip() == "rsagg"
        wait_for(lambda: resources_of(port).get("a") == SOURCES["a"], BOUND, "harvest of source a")

        # Blobs: nginx in front reads them once its user is in the group rsagg; the state stays private.
        check_blob_permissions(m, port)

        # reload: the new source is taken without a restart.
        m.sh("cat > /etc/rsagg/rsagg.toml", stdin=config(port, upstream, ["a", "b"]))
        m.sh("systemctl reload rsagg")
        wait_for(lambda: resources_of(port).get("b") == SOURCES["b"], BOUND, "source b after the reload")
        assert m.show("rsagg", "MainPID", "NRestarts") == {"MainPID": pid, "NRestarts": "0"}

        # The gc timer: a daily run missed (the timer last fired two days ago) is caught up at start.
        # A drop-in takes the random delay (up to an hour, added to a catch-up too) away for the test.
        m.sh(
            "mkdir -p /etc/systemd/system/rsagg-gc.timer.d && printf '[Timer]\\nRandomizedDelaySec=0\\n' "
            "> /etc/systemd/system/rsagg-gc.timer.d/test-now.conf && systemctl daemon-reload"
        )
        m.sh("touch -d '2 days ago' /var/lib/systemd/timers/stamp-rsagg-gc.timer")
        m.sh("systemctl restart rsagg-gc.timer")
        exited = "ExecMainExitTimestampMonotonic"
        wait_for(
            lambda: m.show("rsagg-gc.service", exited)[exited] not in ("", "0"), BOUND, "a run of rsagg-gc"
        )
        gc = m.show("rsagg-gc.service", "Result", "ExecMainStatus")
        assert gc == {"Result": "success", "ExecMainStatus": "0"}
        gc_log = m.sh("journalctl -u rsagg-gc.service -o cat --no-pager").stdout
        assert re.search(r"removed \d+ unreferenced blob", gc_log), gc_log
        # The timer fired (it stamps its file when it triggers), not a start by hand.
        stamp = "/var/lib/systemd/timers/stamp-rsagg-gc.timer"
        assert m.sh(f"find {stamp} -mmin -60").stdout.strip() == stamp

        # The watchdog: SIGUSR2 blocks the event loop; its pings stop, systemd kills and restarts rsagg.
        m.sh("systemctl kill -s USR2 --kill-who=main rsagg")
        wait_for(
            lambda: (s := m.show("rsagg", "NRestarts", "SubState", "MainPID"))["NRestarts"] == "1"
            and s["SubState"] == "running" and s["MainPID"] not in (pid, "0"),
            BOUND + WATCHDOG_SEC, "a restart by the watchdog",
        )  # fmt: skip
        journal = m.sh("journalctl -u rsagg.service -o cat --no-pager").stdout
        assert "Watchdog timeout" in journal, journal[-3000:]
        wait_for(lambda: resources_of(port) == SOURCES, BOUND, "both sources served after the restart")

        # stop: SIGTERM, exit status 0 within TimeoutStopSec (systemd would say Result=timeout and SIGKILL).
        m.sh("systemctl stop rsagg")
        st = m.show("rsagg", "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
        assert st == {
            "ActiveState": "inactive",
            "Result": "success",
            "ExecMainCode": "1",
            "ExecMainStatus": "0",
        }, m.sh("journalctl -u rsagg.service -o cat --no-pager").stdout[-4000:]


def nginx_conf(rsagg_port: int, nginx_port: int) -> str:
    """config/nginx.conf as shipped (its user www-data, the blob root /var/lib/rsagg/blobs), with the
    marked ports set (nginx's own second server on the port after nginx's) and one worker."""
    text = (REPO / "config" / "nginx.conf").read_text()
    for old, new in (
        ("server 127.0.0.1:8080;", f"server 127.0.0.1:{rsagg_port};"),
        ("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{nginx_port};"),
        ("server 127.0.0.1:8001;", f"server 127.0.0.1:{nginx_port + 1};"),
        ("listen 127.0.0.1:8001;", f"listen 127.0.0.1:{nginx_port + 1};"),
        ("worker_processes auto;", "worker_processes 1;"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    assert "\nuser www-data;\n" in text and "alias /var/lib/rsagg/blobs/;" in text
    return text


def check_blob_permissions(m: Machine, port: int) -> None:
    """nginx (config/nginx.conf, workers as www-data) in front of rsagg with x-accel offload: it can send a
    blob file itself only once www-data is in the group rsagg; never can it read the state."""
    nginx = "nginx -p /var/lib/rsagg-nginx -c /etc/rsagg/nginx.conf"  # the README's command
    for _ in range(5):  # nginx binds its ports itself: one another process took meanwhile means new ones
        nport = free_port()  # (and nport + 1, its second server's)
        m.sh("cat > /etc/rsagg/nginx.conf", stdin=nginx_conf(port, nport))
        started = m.sh(f"mkdir -p /var/lib/rsagg-nginx && {nginx}", check=False)
        if started.returncode == 0 or "Address already in use" not in started.stderr:
            break
    assert started.returncode == 0, started.stderr
    url, blob = resource_and_blob(port)
    front = re.sub(r"^http://[^/]+", f"http://127.0.0.1:{nport}", url)
    assert m.sh("stat -c '%U:%G %a' /var/lib/rsagg").stdout.split() == ["rsagg:rsagg", "750"]
    modes = m.sh(f"stat -c %a {blob} $(dirname {blob}) $(dirname $(dirname {blob})) /var/lib/rsagg/blobs")
    assert modes.stdout.split() == ["444", "755", "755", "755"]

    def denials() -> int:
        return m.sh("cat /var/lib/rsagg-nginx/error.log").stdout.count("Permission denied")

    # Not in the group: nginx cannot open the blob file (its error log says so) and answers 403.
    status, _, _ = get(front)
    assert status == 403 and denials() > 0
    assert "Permission denied" in m.sh(f"runuser -u www-data -- cat {blob}", check=False).stderr

    # docs/deploy.md: www-data joins the group rsagg; nginx's new workers take it up (initgroups).
    m.sh(f"usermod -a -G rsagg www-data && {nginx} -s reload")

    def nginx_sends_it() -> bool:  # (an old worker may answer the first requests after the reload)
        status, _, body = get(front)
        return status == 200 and body.startswith(b"source a, resource ")

    wait_for(nginx_sends_it, BOUND, "nginx reading the blob file after the group change")
    before = denials()
    assert nginx_sends_it() and denials() == before
    assert m.sh(f"runuser -u www-data -- cat {blob}").stdout.startswith("source a, resource ")
    private = m.sh("runuser -u www-data -- cat /var/lib/rsagg/state.db", check=False)
    assert private.returncode != 0 and "Permission denied" in private.stderr
    m.sh(f"{nginx} -s quit")


def resource_and_blob(port: int) -> tuple[str, str]:
    """GET the first resource of set a from rsagg; it answers with its blob's name (x-accel) and writes
    the file of a blob kept as a row of small.db. Returns the resource's URL and the blob file's path."""
    _, _, capabilitylist = get(f"http://127.0.0.1:{port}/a/capabilitylist.xml")
    (listing,) = re.findall(r"<loc>([^<]*resourcelist[^<]*)</loc>", capabilitylist.decode())
    _, _, body = get(listing)
    first = re.findall(r"<loc>([^<]*)</loc>", body.decode())[0]
    status, headers, _ = get(first)
    assert status == 200 and headers.get("x-accel-redirect", "").startswith("/_rsagg_blobs/"), headers
    return first, "/var/lib/rsagg/blobs/" + headers["x-accel-redirect"].removeprefix("/_rsagg_blobs/")


def old_unit() -> str:
    """rsagg.service as it was before the user rsagg: a dynamic user, its state under /var/lib/private."""
    text = (REPO / "systemd" / "rsagg.service").read_text()
    for line in ("User=rsagg\n", "Group=rsagg\n", "StateDirectoryMode=0750\n"):
        assert line in text
        text = text.replace(line, "DynamicUser=yes\n" if line.startswith("User=") else "")
    return text


def test_upgrade_from_dynamic_user_units(machine: Machine, tmp_path: Path) -> None:
    """docs/deploy.md's upgrade from the DynamicUser units keeps the store and makes it the user rsagg's."""
    m = machine
    port = free_port()
    with source_server(tmp_path / "www") as upstream:
        m.sh("cat > /etc/systemd/system/rsagg.service && systemctl daemon-reload", stdin=old_unit())
        m.sh("mkdir -p /etc/rsagg && cat > /etc/rsagg/rsagg.toml", stdin=config(port, upstream, ["a"]))
        m.sh("systemctl start rsagg")
        wait_for(lambda: resources_of(port).get("a") == SOURCES["a"], BOUND, "harvest of source a")
        assert m.sh("readlink /var/lib/rsagg").stdout.strip() == "private/rsagg"
        blob = resource_and_blob(port)[1].replace("/var/lib/rsagg/", "/var/lib/private/rsagg/")
        m.sh("systemctl stop rsagg")
        # The blob folders as an older rsagg left them under UMask=0077.
        m.sh("find /var/lib/private/rsagg/blobs -maxdepth 2 -type d ! -name tmp -exec chmod 0700 {} +")

        upgraded = m.sh(f"cd {shlex.quote(str(REPO))}\n" + "\n".join(block("from-dynamic-user")), check=False)
        assert upgraded.returncode == 0, upgraded.stderr + m.journal("rsagg")
        assert m.show("rsagg", "ActiveState", "User") == {"ActiveState": "active", "User": "rsagg"}
        # The store moved back out of private/, now the user rsagg's, with everything in it.
        assert (
            m.sh("test ! -L /var/lib/rsagg && test ! -e /var/lib/private/rsagg && echo moved").stdout
            == "moved\n"
        )
        assert m.sh("stat -c '%U:%G %a' /var/lib/rsagg").stdout.split() == ["rsagg:rsagg", "750"]
        assert m.sh("find /var/lib/rsagg ! -user rsagg | wc -l").stdout.strip() == "0"
        assert resources_of(port) == {"a": SOURCES["a"]}  # the state came along: no harvest needed to say so
        folders = m.sh("find /var/lib/rsagg/blobs -maxdepth 2 -type d ! -name tmp -printf '%m\\n' | sort -u")
        assert folders.stdout.split() == ["755"]
        moved = blob.replace("/var/lib/private/rsagg/", "/var/lib/rsagg/")
        assert (
            m.sh(f"stat -c %a $(dirname {moved}) $(dirname $(dirname {moved}))").stdout.split() == ["755"] * 2
        )
        assert m.sh("stat -c '%G %a' /etc/rsagg/rsagg.toml").stdout.split() == ["rsagg", "640"]


def status_of(port: int) -> dict | None:
    try:
        status, _, body = get(f"http://127.0.0.1:{port}/status.json")
    except OSError:
        return None
    return json.loads(body) if status == 200 else None


def test_cluster_nodes_under_systemd(machine: Machine, tmp_path: Path) -> None:
    """Two rsagg-node@ instances (docs/cluster.md) share /var/lib/rsagg-cluster as the user rsagg, divide
    the sources, and a stopped node's sources go to the other at once (it releases its leases)."""
    m = machine
    ports = {1: free_port(), 2: free_port()}
    with source_server(tmp_path / "www") as upstream:
        m.sh(f"cd {shlex.quote(str(REPO))}\n" + "\n".join(block("units")))
        m.sh(f"install -m 0644 {shlex.quote(str(REPO))}/systemd/rsagg-node@.service /etc/systemd/system/")
        for n, port in ports.items():
            text = config(port, upstream, list(SOURCES)).replace(
                '"/var/lib/rsagg"', '"/var/lib/rsagg-cluster"'
            )
            text = text.replace(
                f'base_url = "http://127.0.0.1:{port}"', f'base_url = "http://127.0.0.1:{ports[1]}"'
            )
            text += f'\n[cluster]\nenabled = true\nnode = "n{n}"\n'
            m.sh(f"install -m 0640 -g rsagg /dev/stdin /etc/rsagg/node-{n}.toml", stdin=text)
        started = m.sh(
            "systemctl daemon-reload && systemctl enable --now rsagg-node@1 rsagg-node@2", check=False
        )
        assert started.returncode == 0, started.stderr + m.journal("rsagg-node@1") + m.journal("rsagg-node@2")
        for n in ports:
            st = m.show(f"rsagg-node@{n}", "ActiveState", "User", "MainPID")
            assert (st["ActiveState"], st["User"]) == ("active", "rsagg")
            assert m.sh(f"stat -c %U /proc/{st['MainPID']}").stdout.strip() == "rsagg"

        def everything_harvested(port: int, nodes: set[str]) -> bool:
            """Exactly ``nodes`` alive, every source harvested and held by one of them."""
            s = status_of(port)
            if not s or "cluster" not in s:
                return False
            alive = {n["name"] for n in s["cluster"]["nodes"] if n["alive"]}
            rows = {r["name"]: r for r in s["sources"]}
            return alive == nodes and all(
                name in rows and rows[name]["resources"] == count and rows[name].get("node") in nodes
                for name, count in SOURCES.items()
            )

        wait_for(lambda: everything_harvested(ports[1], {"n1", "n2"}), BOUND, "both nodes harvesting")
        assert m.sh("stat -c '%U:%G %a' /var/lib/rsagg-cluster").stdout.split() == ["rsagg:rsagg", "750"]

        m.sh("systemctl stop rsagg-node@1")
        assert m.show("rsagg-node@1", "Result", "ExecMainStatus") == {
            "Result": "success",
            "ExecMainStatus": "0",
        }
        wait_for(lambda: everything_harvested(ports[2], {"n2"}), BOUND, "node 2 holding every source")
        m.sh("systemctl stop rsagg-node@2")
        assert m.show("rsagg-node@2", "Result", "ExecMainStatus") == {
            "Result": "success",
            "ExecMainStatus": "0",
        }
