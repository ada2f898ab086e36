"""Helpers for harvest tests: a config pointing at an upstream, a one-shot harvest, an audit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

import trio

from aggregator.commands.harvest import harvest_once
from aggregator.config import Config, parse_config
from aggregator.harvest.audit import Difference, audit_source
from aggregator.harvest.source import SourceResult
from aggregator.run.compose import open_context
from aggregator.store.open import open_state

REPO = Path(__file__).resolve().parent.parent


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        **(extra or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def rsagg(
    *args: str, config: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``rsagg ARGS -c CONFIG`` as an operator runs it: its own process, in the config's folder (with
    ``env`` added to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "aggregator", *args, "-c", str(config)],
        cwd=config.parent, env=_env(env), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


async def start_daemon(config: Path, log: BinaryIO) -> trio.Process:
    """``rsagg run -c CONFIG`` in a process of its own (the caller stops it), output to ``log``."""
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "aggregator", "run", "-c", str(config)], env=_env(), stdout=log, stderr=log
    )


#: Extra ``[store]`` keys for every config the tests make: the S3 tests set a backend here to run the
#: harvester and publisher scenarios unchanged on another blob store (tests/test_s3store.py), the
#: PostgreSQL tests a state (tests/test_state_postgres.py). A callable value is called for each config
#: (a fresh database each).
STORE: dict[str, Any] = {}


def make_config(store: Path, sources: dict[str, str], **harvest: Any) -> Config:
    """A config with fast retries (tests must not sleep through real backoff)."""
    settings = {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10, **harvest}
    return parse_config(
        {
            "store": {"path": str(store), **{k: v() if callable(v) else v for k, v in STORE.items()}},
            "harvest": settings,
            "sources": [{"name": n, "url": u} for n, u in sources.items()],
        },
        str(store.parent / "test.toml"),
    )


async def harvest(config: Config) -> dict[str, SourceResult]:
    return {r.name: r for r in await harvest_once(config, [])}


async def audit(config: Config) -> list[Difference]:
    out: list[Difference] = []
    async with open_context(config) as ctx:
        for src in config.sources:
            out.extend([d async for d in audit_source(ctx, src)])
    return out


def changelog(config: Config) -> list[tuple[str, str, str | None]]:
    """(uri, change, sha256) of every record rsagg logged, in order."""
    with open_state(config) as state:
        return [(r.uri, r.change, r.sha256) for r in state.iter_changelog()]


def held(config: Config) -> dict[str, str]:
    """uri -> sha256 of every live resource in the store."""
    with open_state(config) as state:
        return {r.uri: r.sha256 for r in state.iter_resources()}
