"""The systemd units in ``systemd/``: lint-clean, hardened, in step with each other and with the CLI.

``systemd-analyze verify`` wants ``ExecStart=`` to name an existing executable; the units name the
installed ``/usr/local/bin/rsagg``, so the checks run on a copy whose ExecStart points at the ``rsagg``
of the Python running the tests (the file is otherwise unchanged). The template is checked as an
instance (``rsagg@test.service``) so that its specifiers are resolved.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.cli import build_parser

UNITS = Path(__file__).resolve().parent.parent / "systemd"
INSTALLED = "/usr/local/bin/rsagg"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")

#: (unit file, name of the copy that is checked)
CASES = [
    ("rsagg.service", "rsagg.service"),
    ("rsagg@.service", "rsagg@test.service"),
    ("rsagg-node@.service", "rsagg-node@1.service"),
]

HARDENING = {
    "Type": "notify",
    "NotifyAccess": "main",
    "ExecReload": "/bin/kill -HUP $MAINPID",
    "TimeoutStopSec": "15",
    "DynamicUser": "yes",
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


def verifiable_copy(tmp_path: Path, unit: str, name: str) -> Path:
    text = (UNITS / unit).read_text()
    assert f"ExecStart={INSTALLED} " in text
    here = shutil.which("rsagg", path=str(Path(sys.executable).parent)) or sys.executable
    copy = tmp_path / name
    copy.write_text(text.replace(f"ExecStart={INSTALLED} ", f"ExecStart={here} "))
    return copy


@needs_analyze
@pytest.mark.parametrize(("unit", "name"), CASES)
def test_verify_says_nothing(tmp_path: Path, unit: str, name: str) -> None:
    # An unknown key is only a warning with exit status 0: any output at all is a failure.
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(verifiable_copy(tmp_path, unit, name))],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


@needs_analyze
def test_verify_is_not_blind(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key is reported."""
    copy = verifiable_copy(tmp_path, "rsagg.service", "rsagg.service")
    copy.write_text(copy.read_text().replace("ProtectHome=yes", "ProtectHomes=yes"))
    r = subprocess.run([ANALYZE, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    assert "ProtectHomes" in r.stdout + r.stderr


@needs_analyze
@pytest.mark.parametrize(("unit", "name"), CASES)
def test_security_exposure_is_low(tmp_path: Path, unit: str, name: str) -> None:
    copy = verifiable_copy(tmp_path, unit, name)
    r = subprocess.run([ANALYZE, "--offline=true", "security", "--no-pager", str(copy)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
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
    assert node["Service"].pop("User") == ["rsagg-node"]  # the instances share the store
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
    assert argv[0] == INSTALLED
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config) == ("run", config)
