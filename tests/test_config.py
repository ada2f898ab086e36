"""Configuration: good files load; every kind of mistake names the file, the key and the problem."""

from pathlib import Path

import pytest

from aggregator.config import ConfigError, load_config

GOOD = """
[server]
listen = "127.0.0.1:8080"
base_url = "http://127.0.0.1:8080/"

[store]
path = "data"

[harvest]
interval = 60
workers = 4

[[sources]]
name = "museum"
url = "http://127.0.0.1:8000/.well-known/resourcesync"

[[sources]]
name = "library"
url = "https://example.org/"
interval = 5
use_dumps = false
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rsagg.toml"
    p.write_text(text)
    return p


def test_good_config_loads(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert [s.name for s in cfg.sources] == ["museum", "library"]
    assert cfg.server.base_url == "http://127.0.0.1:8080"  # trailing slash dropped
    assert cfg.store_path == tmp_path / "data"  # relative to the config file
    assert cfg.interval(cfg.source("museum")) == 60.0
    assert cfg.interval(cfg.source("library")) == 5.0
    assert cfg.use_dumps(cfg.source("museum")) is True
    assert cfg.use_dumps(cfg.source("library")) is False
    assert cfg.harvest.workers == 4


def test_example_config_loads():
    cfg = load_config(Path(__file__).parent.parent / "config" / "example.toml")
    assert cfg.sources


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[server]\nport = 1\n", "server.port", "unknown key"),
        ("[servr]\n", "servr", "unknown section"),
        ('[[sources]]\nname = "a"\nurl = "ftp://x/"\n', "sources[0].url", "not an http(s) URL"),
        ('[[sources]]\nname = "a"\nurl = "nonsense"\n', "sources[0].url", "not an http(s) URL"),
        ('[[sources]]\nname = "a"\n', "sources[0].url", "missing"),
        ('[[sources]]\nname = "A B"\nurl = "http://x/"\n', "sources[0].name", "URL-safe"),
        (
            '[[sources]]\nname = "a"\nurl = "http://x/"\n[[sources]]\nname = "a"\nurl = "http://y/"\n',
            "sources[1].name",
            "duplicate",
        ),
        ('[[sources]]\nname = "a"\nurl = "http://x/"\ncolour = 1\n', "sources[0].colour", "unknown key"),
        ('[harvest]\ninterval = "soon"\n', "harvest.interval", "must be float"),
        ("[harvest]\nworkers = 0\n", "harvest.workers", "at least 1"),
        ("[harvest]\ntimeout = -1\n", "harvest.timeout", "negative"),
        ('[server]\nlisten = "nowhere"\n', "server.listen", "HOST:PORT"),
        ('[store]\nsynchronous = "OFF"\n', "store.synchronous", "NORMAL or FULL"),
        ("this is = = not toml", "-", "not valid TOML"),
    ],
)
def test_config_errors_name_file_key_problem(tmp_path, text, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


def test_cli_reports_config_error(tmp_path, capsys):
    from aggregator.cli import main

    path = write(tmp_path, '[[sources]]\nname = "a"\nurl = "http://x/"\nbogus = 1\n')
    assert main(["status", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "sources[0].bogus" in err and "unknown key" in err and str(path) in err
