"""The systemd units in ``systemd/``: lint-clean as shipped, hardened, in step with each other, with the
CLI and with docs/deploy.md.

``systemd-analyze verify`` wants ``ExecStart=`` to name an existing executable: the units name
``/opt/rsagg/bin/rsagg``, where docs/deploy.md installs rsagg, so the files are checked exactly as shipped
once rsagg is installed there (``.ci/run`` does it first; without it the check is skipped, and
``RSAGG_REQUIRE_SYSTEMD=1``, which ``.ci/run`` sets, makes that a failure). The templates are checked as
instances (``rsagg@test.service``: systemd-analyze finds the template beside it). The units under a real
systemd: tests/test_systemd_boot.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from aggregator.cli import build_parser
from tests.deploydocs import REPO, RSAGG, block

UNITS = REPO / "systemd"
ANALYZE = shutil.which("systemd-analyze")
REQUIRE = os.environ.get("RSAGG_REQUIRE_SYSTEMD") == "1"


def _why_not() -> str | None:
    if ANALYZE is None:
        return "systemd-analyze is not installed"
    if not Path(RSAGG).exists():
        return f"{RSAGG} is missing: install rsagg as docs/deploy.md section 1 says (.ci/run does)"
    return None


WHY_NOT = _why_not()
needs_analyze = pytest.mark.skipif(WHY_NOT is not None and not REQUIRE, reason=str(WHY_NOT))

#: The run units: (unit file, the name it is checked under)
CASES = [
    ("rsagg.service", "rsagg.service"),
    ("rsagg@.service", "rsagg@test.service"),
    ("rsagg-node@.service", "rsagg-node@1.service"),
]
#: Every unit shipped, as checked: the run units, the gc service and its timer.
SHIPPED = [name for _, name in CASES] + ["rsagg-gc.service", "rsagg-gc.timer"]

HARDENING = {
    "Type": "notify",
    "NotifyAccess": "main",
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "TimeoutStopSec": "15",
    "Restart": "on-failure",
    "RestartPreventExitStatus": "2",
    "User": "rsagg",
    "Group": "rsagg",
    "StateDirectoryMode": "0750",
    "ConfigurationDirectory": "rsagg",
    "UMask": "0077",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "SystemCallArchitectures": "native",
}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values in order (keys such as SystemCallFilter= may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"setting outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    if WHY_NOT is not None:
        pytest.fail(f"RSAGG_REQUIRE_SYSTEMD=1 but {WHY_NOT}")
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60, cwd=UNITS)


@needs_analyze
def test_verify_as_shipped_says_nothing() -> None:
    # An unknown key is only a warning with exit status 0: any output at all is a failure. The files are
    # the shipped ones, unchanged (the instance names resolve to the templates beside them).
    assert set(SHIPPED) - {n for n in SHIPPED if "@" in n} <= {p.name for p in UNITS.iterdir()}
    r = analyze("verify", "--man=no", *SHIPPED)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


@needs_analyze
def test_verify_is_not_blind(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key, and a command that is not installed, are reported."""
    copy = tmp_path / "rsagg.service"
    copy.write_text((UNITS / "rsagg.service").read_text().replace("ProtectHome=yes", "ProtectHomes=yes"))
    r = analyze("verify", "--man=no", str(copy))
    assert "ProtectHomes" in r.stdout + r.stderr
    copy.write_text((UNITS / "rsagg.service").read_text().replace(RSAGG, "/usr/local/bin/rsagg-absent"))
    r = analyze("verify", "--man=no", str(copy))
    assert r.returncode != 0 and "rsagg-absent" in r.stdout + r.stderr


@needs_analyze
@pytest.mark.parametrize("name", [n for n in SHIPPED if n.endswith(".service")])
def test_security_exposure_is_low(name: str) -> None:
    r = analyze("--offline=true", "security", "--no-pager", name)
    if "--offline" in r.stderr and ("unrecognized" in r.stderr or "Unknown" in r.stderr):
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    # 1.1 ("OK") with systemd 252; what is left is network access, which an aggregator needs.
    assert float(m.group(1)) <= 2.0, r.stdout


@pytest.mark.parametrize(("unit", "name"), CASES)
def test_hardening_and_protocol_settings(unit: str, name: str) -> None:
    service = parse_unit((UNITS / unit).read_text())["Service"]
    for key, value in HARDENING.items():
        assert service.get(key) == [value], key
    assert int(service["WatchdogSec"][0]) > 0
    assert service["SystemCallFilter"][0] == "@system-service"
    state_dir = {
        "rsagg.service": "rsagg",
        "rsagg@.service": "rsagg/%i",
        "rsagg-node@.service": "rsagg-cluster",
    }[unit]
    assert service["StateDirectory"] == [state_dir]


def test_units_differ_only_in_paths() -> None:
    single = parse_unit((UNITS / "rsagg.service").read_text())
    template = parse_unit((UNITS / "rsagg@.service").read_text())
    node = parse_unit((UNITS / "rsagg-node@.service").read_text())
    for unit in (single, template, node):
        for key in ("ExecStart", "StateDirectory"):
            unit["Service"].pop(key)
        unit["Unit"].pop("Description")
    assert single == template == node


EXEC_CONFIGS = [
    ("rsagg.service", "/etc/rsagg/rsagg.toml"),
    ("rsagg@.service", "/etc/rsagg/%i.toml"),
    ("rsagg-node@.service", "/etc/rsagg/node-%i.toml"),
]


@pytest.mark.parametrize(("unit", "config"), EXEC_CONFIGS)
def test_execstart_is_a_valid_rsagg_command(unit: str, config: str) -> None:
    (exec_start,) = parse_unit((UNITS / unit).read_text())["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == RSAGG
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config) == ("run", config)


#: What only the long-running units have: the notify protocol, the watchdog, restarts.
RUN_ONLY = {"Type", "NotifyAccess", "ExecReload", "WatchdogSec", "TimeoutStopSec", "Restart", "RestartSec",
            "RestartPreventExitStatus", "LimitNOFILE"}  # fmt: skip


def test_gc_service_has_the_same_user_store_and_sandbox() -> None:
    run = parse_unit((UNITS / "rsagg.service").read_text())["Service"]
    gc = parse_unit((UNITS / "rsagg-gc.service").read_text())["Service"]
    assert gc.pop("Type") == ["oneshot"]
    (exec_start,) = gc.pop("ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0] == RSAGG
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config) == ("gc", "/etc/rsagg/rsagg.toml")
    assert gc.pop("Nice") == ["10"] and gc.pop("IOSchedulingClass") == ["idle"]
    sandbox = {k: v for k, v in run.items() if k not in RUN_ONLY | {"ExecStart"}}
    assert gc == sandbox


def test_gc_timer_starts_the_gc_service_daily() -> None:
    timer = parse_unit((UNITS / "rsagg-gc.timer").read_text())
    assert timer["Timer"] == {"OnCalendar": ["daily"], "RandomizedDelaySec": ["1h"], "Persistent": ["true"]}
    assert "Unit" not in timer["Timer"]  # the service of the same name: rsagg-gc.service
    assert (UNITS / "rsagg-gc.service").exists()
    assert timer["Install"] == {"WantedBy": ["timers.target"]}


def test_sysusers_declares_the_units_user() -> None:
    lines = [ln.split() for ln in (UNITS / "rsagg.sysusers").read_text().splitlines() if ln and ln[0] != "#"]
    assert [ln[:3] for ln in lines] == [["u", "rsagg", "-"]]
    assert lines[0][-1] == "/var/lib/rsagg"  # home: the store


def test_ci_installs_as_documented() -> None:
    """.ci/run installs rsagg with docs/deploy.md's own lines (so verify runs on the units as shipped)."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for line in block("software"):
        assert any(c.strip().startswith(line) for c in ci), f".ci/run does not run {line!r}"
    assert any("systemd-analyze verify" in c for c in ci)


def test_documented_install_puts_rsagg_where_the_units_run_it() -> None:
    software = block("software")
    assert software[0].split()[-1] == str(Path(RSAGG).parent.parent)  # python -m venv /opt/rsagg
    assert software[0].startswith("/usr/bin/python3 ")  # not a Python under /root or /home (ProtectHome)
    units = " ".join(block("units"))
    for name in ("rsagg.service", "rsagg-gc.service", "rsagg-gc.timer", "rsagg.sysusers"):
        assert f"systemd/{name}" in units and (UNITS / name).exists()
    assert "/etc/rsagg/rsagg.toml" in " ".join(block("config"))
    assert "enable --now rsagg rsagg-gc.timer" in " ".join(block("start"))


@pytest.mark.parametrize("path", sorted(UNITS.iterdir()), ids=lambda p: p.name)
def test_no_dangling_references(path: Path) -> None:
    """Every file a unit's comments name (docs/..., systemd/..., config/..., tests/...) exists."""
    for ref in re.findall(r"\b((?:docs|systemd|config|tests)/[\w.@-]+\.\w+)", path.read_text()):
        assert (REPO / ref).exists(), f"{path.name} names {ref}, which does not exist"


def test_every_shipped_unit_is_verified() -> None:
    """A unit added to systemd/ is verified too (the list above, .ci/run and docs/deploy.md name them)."""
    files = {p.name for p in UNITS.iterdir() if p.suffix in (".service", ".timer", ".socket", ".path")}
    checked = {re.sub(r"@[^.]+\.", "@.", name) for name in SHIPPED}
    assert files == checked
    ci = (REPO / ".ci" / "run").read_text()
    assert all(f"systemd/{name}" in ci for name in SHIPPED)
