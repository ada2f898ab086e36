"""A command run for some sources (``--source``) needs only their secrets (compose.open_context's
``sources``): another source's missing token must not stop an operator from harvesting, auditing or
listing the retries of the one they name; without ``--source`` (or naming that other source) the missing
secret is still a config error naming its key and variable, never a traceback."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio

from aggregator.config import ConfigError, parse_config
from aggregator.harvest.access import Access
from aggregator.testing.upstream import Upstream

from .harvesting import rsagg
from .httpserver import serve_app
from .test_source_context import TOKEN, Guard

SOURCES = ("a", "b", "c")

#: (command line, exit code, text the output must hold): in order, on one store.
TABLE = [
    (("harvest", "--once", "--source", "mine", "--source", "off"), 0, "mine: ok"),  # off: disabled
    (("audit", "--source", "mine"), 0, "mine: in sync"),
    (("retries",), 0, "0 waiting, 0 ended"),  # the state only: no secret is read at all
    (("harvest", "--once"), 2, "sources[1].auth.bearer_token_env: environment variable OTHER_TOKEN"),
    (("audit", "--source", "mine", "--source", "other"), 2, "OTHER_TOKEN is not set"),
]


async def test_only_the_selected_sources_secrets_are_needed(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    guard = Guard(up.app())
    async with serve_app(guard) as base:
        up.public_url = base
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[store]\npath = "{tmp_path / "data"}"\n[harvest]\nretries = 1\nbackoff_base = 0.01\n'
            f'[[sources]]\nname = "mine"\nurl = "{base}/.well-known/resourcesync"\n'
            '[sources.auth]\nbearer_token_env = "MINE_TOKEN"\n'
            '[[sources]]\nname = "other"\nurl = "http://192.0.2.1/.well-known/resourcesync"\n'
            '[sources.auth]\nbearer_token_env = "OTHER_TOKEN"\n'
            '[[sources]]\nname = "off"\nurl = "http://192.0.2.2/"\nenabled = false\n'
            '[sources.auth]\nbearer_token_env = "OFF_TOKEN"\n'
        )
        for args, code, text in TABLE:
            done = await trio.to_thread.run_sync(
                lambda args=args: rsagg(*args, config=config, timeout=120, env={"MINE_TOKEN": TOKEN})
            )
            out = done.stdout + done.stderr
            assert done.returncode == code, (args, out)
            assert text in out, (args, out)
            assert "Traceback" not in out and TOKEN not in out, (args, out)
    assert guard.refused == []
    assert guard.seen > 0


@pytest.mark.parametrize(
    "selected", [s for n in range(4) for s in itertools.combinations(SOURCES, n)] + [None]
)
def test_access_reads_exactly_the_selected_secrets(tmp_path: Path, monkeypatch, selected) -> None:
    """Every selection of sources, each with or without its secret: starting fails (naming the first
    selected source whose secret is missing) exactly when a selected source lacks its secret."""
    for present in itertools.product([False, True], repeat=len(SOURCES)):
        cfg = parse_config(
            {"store": {"path": str(tmp_path)},
             "sources": [{"name": n, "url": f"https://{n}.example/", "auth": {"bearer_token_env": f"T_{n}"}}
                         for n in SOURCES]},
            str(tmp_path / "t.toml"),
        )  # fmt: skip
        for name, there in zip(SOURCES, present, strict=True):
            if there:
                monkeypatch.setenv(f"T_{name}", "token")
            else:
                monkeypatch.delenv(f"T_{name}", raising=False)
        chosen = SOURCES if selected is None else selected
        lacking = [i for i, name in enumerate(SOURCES) if name in chosen and not present[i]]
        if lacking:
            with pytest.raises(ConfigError, match=rf"sources\[{lacking[0]}\]\.auth\.bearer_token_env"):
                Access(cfg, selected)
        else:
            Access(cfg, selected)
