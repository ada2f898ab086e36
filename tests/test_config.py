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
        ('[server]\noffload = "sendfile"\n', "server.offload", "none, x-accel, redirect"),
        ('[server]\noffload_location = "blobs"\n', "server.offload_location", "a path like"),
        ('[server]\noffload_location = "/a b/"\n', "server.offload_location", "a path like"),
        ("[server]\nredirect_lifetime = 0\n", "server.redirect_lifetime", "7 days"),
        ("[server]\nredirect_lifetime = 700000\n", "server.redirect_lifetime", "7 days"),
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


PUBLISH = """
[[sources]]
name = "museum"
url = "http://127.0.0.1:8000/"

[[sources]]
name = "gallery"
url = "http://127.0.0.1:8001/"

[[sources]]
name = "library"
url = "http://127.0.0.1:8002/"
"""


def test_publish_and_sets_load(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.publish.changelist_size == 10_000 and cfg.publish.dump_interval == 86_400
    assert not cfg.publish.keep_collection_links and not cfg.publish.keep_canonical_links
    assert cfg.sets == ()
    text = (
        PUBLISH
        + """
[publish]
changelist_size = 500
dump_interval = 0
keep_collection_links = true

[[sets]]
name = "art"
sources = ["museum", "gallery"]
describedby = "https://example.org/about-art"

[[sets]]
name = "library"
sources = ["library"]
"""
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.publish.changelist_size == 500 and cfg.publish.dump_interval == 0.0
    assert cfg.publish.keep_collection_links and not cfg.publish.keep_canonical_links
    assert [(s.name, s.sources, s.describedby) for s in cfg.sets] == [
        ("art", ("museum", "gallery"), "https://example.org/about-art"),
        ("library", ("library",), None),
    ]


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[publish]\ncolour = 1\n", "publish.colour", "unknown key"),
        ("[publish]\nchangelist_size = 0\n", "publish.changelist_size", "at least 1"),
        ('[publish]\nchangelist_size = "many"\n', "publish.changelist_size", "must be int"),
        ("[publish]\ndump_interval = -5\n", "publish.dump_interval", "negative"),
        ('[publish]\nkeep_canonical_links = "yes"\n', "publish.keep_canonical_links", "must be bool"),
        ('[[sets]]\nname = "art"\nsources = ["nope"]\n', "sets[0].sources", "unknown source 'nope'"),
        ('[[sets]]\nname = "art"\n', "sets[0].sources", "missing"),
        ('[[sets]]\nname = "art"\nsources = []\n', "sets[0].sources", "non-empty"),
        ('[[sets]]\nname = "art"\nsources = "museum"\n', "sets[0].sources", "non-empty array"),
        ('[[sets]]\nname = "art"\nsources = [1]\n', "sets[0].sources", "source names"),
        ('[[sets]]\nname = "Art!"\nsources = ["museum"]\n', "sets[0].name", "URL-safe"),
        ('[[sets]]\nname = "art"\nsources = ["museum"]\ncolour = 1\n', "sets[0].colour", "unknown key"),
        (
            '[[sets]]\nname = "art"\nsources = ["museum"]\ndescribedby = "about"\n',
            "sets[0].describedby",
            "not an http(s) URL",
        ),
        (
            '[[sets]]\nname = "a"\nsources = ["museum"]\n[[sets]]\nname = "a"\nsources = ["gallery"]\n',
            "sets[1].name",
            "duplicate set name",
        ),
        (
            '[[sets]]\nname = "a"\nsources = ["museum"]\n[[sets]]\nname = "b"\nsources = ["museum"]\n',
            "sets[1].sources",
            "already in set 'a'",
        ),
        ('[[sets]]\nname = "library"\nsources = ["museum"]\n', "sets[0].name", "published name of source"),
        ('[sets]\nname = "art"\n', "sets", "array of tables"),
    ],
)
def test_publish_config_errors(tmp_path, text, key, problem):
    path = write(tmp_path, PUBLISH + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(path) in str(err.value)


def test_notifications_defaults_and_settings(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    n = cfg.notifications
    assert (n.enabled, n.hub, n.hub_path, n.lease_seconds) == (True, "", "/hub", 86_400)
    assert (n.accept_sha1, n.max_entries, n.notified_interval) == (False, 1000, 3600.0)
    museum = cfg.source("museum")
    assert cfg.notifications_on(museum) and cfg.notified_interval(museum) == 3600.0
    text = (
        PUBLISH
        + """
[notifications]
hub = "https://hub.example.org/websub"
hub_path = "/websub/hub"
lease_seconds = 600
accept_sha1 = true
max_entries = 50
notified_interval = 7200
"""
    )
    text = text.replace(
        'url = "http://127.0.0.1:8001/"', 'url = "http://127.0.0.1:8001/"\nnotifications = false'
    ).replace('url = "http://127.0.0.1:8002/"', 'url = "http://127.0.0.1:8002/"\nnotified_interval = 60')
    cfg = load_config(write(tmp_path, text))
    n = cfg.notifications
    assert (n.hub, n.hub_path, n.lease_seconds, n.accept_sha1, n.max_entries) == (
        "https://hub.example.org/websub", "/websub/hub", 600, True, 50
    )  # fmt: skip
    assert cfg.notifications_on(cfg.source("museum")) and not cfg.notifications_on(cfg.source("gallery"))
    assert cfg.notified_interval(cfg.source("museum")) == 7200.0
    assert cfg.notified_interval(cfg.source("library")) == 60.0
    off = load_config(write(tmp_path, PUBLISH + "[notifications]\nenabled = false\n"))
    assert not any(off.notifications_on(s) for s in off.sources)  # the master switch wins


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[notifications]\ncolour = 1\n", "notifications.colour", "unknown key"),
        ('[notifications]\nenabled = "yes"\n', "notifications.enabled", "must be bool"),
        ('[notifications]\nhub = "ftp://hub/"\n', "notifications.hub", "not an http(s) URL"),
        ('[notifications]\nhub_path = "hub"\n', "notifications.hub_path", "plain absolute path"),
        ('[notifications]\nhub_path = "/a b"\n', "notifications.hub_path", "plain absolute path"),
        ('[notifications]\nhub_path = "/.well-known/hub"\n', "notifications.hub_path", "plain absolute path"),
        ("[notifications]\nlease_seconds = 0\n", "notifications.lease_seconds", "at least 1"),
        ("[notifications]\nlease_seconds = 1.5\n", "notifications.lease_seconds", "must be int"),
        ("[notifications]\nmax_entries = 0\n", "notifications.max_entries", "at least 1"),
        ("[notifications]\nnotified_interval = 0\n", "notifications.notified_interval", "more than 0"),
        ('[notifications]\naccept_sha1 = "no"\n', "notifications.accept_sha1", "must be bool"),
        (
            '[[sources]]\nname = "x"\nurl = "http://x/"\nnotifications = 1\n',
            "sources[3].notifications",
            "bool",
        ),
        (
            '[[sources]]\nname = "x"\nurl = "http://x/"\nnotified_interval = 0\n',
            "sources[3].notified_interval",
            "more than 0",
        ),
    ],
)
def test_notifications_config_errors(tmp_path, text, key, problem):
    path = write(tmp_path, PUBLISH + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[store]\nsettings = 5\n", "store.settings", "must be a table, not 5"),
        (
            '[[sources]]\nname = "a"\nurl = "http://x/"\ninterval = "5"\n',
            "sources[0].interval",
            "must be float",
        ),
        ('[[sources]]\nname = "a"\nurl = "http://x/"\ninterval = -5\n', "sources[0].interval", "negative"),
        (
            '[[sources]]\nname = "a"\nurl = "http://x/"\n[sources.auth]\nbearer = "x"\n',
            "sources[0].auth.bearer",
            "unknown key",
        ),
        ("[store]\n[store.nested]\nx = 1\n", "store.nested", "unknown key (known: backend, cache_mib, path,"),
        ("[harvest]\nworkers = true\n", "harvest.workers", "must be int, not True"),
        ("[harvest]\ninterval = true\n", "harvest.interval", "must be float, not True"),
        ('[server]\nmax_readers = "5"\n', "server.max_readers", "must be int, not '5'"),
        ("[server]\nlisten = 8080\n", "server.listen", "must be str, not 8080"),
        ("[harvest]\ninterval = nan\n", "harvest.interval", "finite"),
        (
            '[[sources]]\nname = "a"\nurl = "http://x/"\nkind = "oai"\n',
            "sources[0].kind",
            "must be one of resourcesync, oai-pmh, not 'oai'",
        ),
        ('[sources]\nname = "a"\n', "sources", "array of tables ([[sources]])"),
        ("[plugins]\nresourcefilter = 5\n", "plugins.resourcefilter", "must be a table"),
        ('file = "other.toml"\n', "file", "unknown section"),
    ],
)
def test_types_and_ranges_are_named_by_key_path(tmp_path, text, key, problem):
    """Validation is pydantic's: a wrong type, range or key is a ConfigError naming the key path, in the
    project's own words (never pydantic's text and its documentation URLs)."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(err.value).startswith(f"{path}: {key}: ")
    assert "pydantic" not in str(err.value) and "http" not in str(err.value).replace("http://x/", "")


def test_every_problem_is_reported_one_per_line(tmp_path):
    path = write(tmp_path, "[harvest]\nworkers = 0\nretries = -1\n[publish]\ncolour = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (err.value.key, err.value.problem) == ("harvest.workers", "must be at least 1")
    assert str(err.value).splitlines() == [
        f"{path}: harvest.workers: must be at least 1",
        f"{path}: harvest.retries: must not be negative, not -1",
        f"{path}: publish.colour: unknown key (known: changelist_size, dump_interval, keep_canonical_links,"
        " keep_collection_links, versions)",
    ]


def test_auth_values_are_never_echoed():
    from aggregator.config import parse_config

    with pytest.raises(ConfigError) as err:
        parse_config({"sources": [{"name": "a", "url": "http://x/", "auth": "s3cret"}]}, "t.toml")
    assert err.value.key == "sources[0].auth" and "s3cret" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config({"plugins": {"s3": "s3cret"}}, "t.toml")  # a key where its table belongs
    assert err.value.key == "plugins.s3" and "s3cret" not in str(err.value)


def test_configs_stay_frozen_dataclasses_checked_on_replace():
    import dataclasses

    from pydantic import ValidationError

    from aggregator.config import parse_config

    cfg = parse_config({"sources": [{"name": "a", "url": "http://x/", "interval": 5}]})
    assert dataclasses.is_dataclass(cfg) and cfg.sources[0].interval == 5.0
    assert isinstance(cfg.sources[0].interval, float)  # ints are taken as the float they stand for
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.max_readers = 1  # type: ignore[misc]
    fewer = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_readers=1))
    assert fewer.server.max_readers == 1 and hash(fewer.server) != hash(cfg.server)
    with pytest.raises(ValidationError):
        dataclasses.replace(cfg.server, max_readers="1")


def test_cli_reports_every_problem_on_its_own_line(tmp_path, capsys):
    from aggregator.cli import main

    path = write(
        tmp_path, '[store]\nsettings = 5\n[[sources]]\nname = "a"\nurl = "http://x/"\ninterval = "5"\n'
    )
    assert main(["status", "-c", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rsagg status: config error: {path}: store.settings: must be a table, not 5",
        f"{path}: sources[0].interval: must be float, not '5'",
    ]


@pytest.mark.parametrize("seed", range(4))
def test_every_source_url_the_config_takes_is_one_httpx_reads(tmp_path, seed):
    """Generated: URLs of letters, digits, the URL delimiters, spaces, percent signs, non-ASCII letters
    and control characters. Any the configuration takes as a Source's URL, httpx reads too (it refused
    a control character at the Source's first request, after the start, with a traceback); any it
    refuses is refused naming the key."""
    import json
    import random

    import httpx

    rng = random.Random(seed)
    alphabet = "abcxyz019-._~:/?#[]@!$&'()*+,;=% é" + "".join(map(chr, [0, 9, 10, 13, 27, 31, 127]))
    taken = 0
    for _ in range(300):
        host = rng.choice(["x", "127.0.0.1", "[::1]", "exa mple", "h:80", "h:8a", "[::1"])
        url = "http://" + host + "/" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        path = tmp_path / "c.toml"
        path.write_text(f'[[sources]]\nname = "a"\nurl = {json.dumps(url)}\n', encoding="utf-8")
        try:
            load_config(path)
        except ConfigError as err:
            assert err.key == "sources[0].url", (url, err)
            continue
        taken += 1
        httpx.URL(url)  # raises for what the configuration should have refused
    assert taken > 30
