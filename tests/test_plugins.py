"""The plugin manager (aggregator/plugins/manager.py), the shipped plugins (plugins/) and ``rsagg plugins``.

End-to-end behaviour of each hook inside rsagg is in test_hooks.py; here: loading, configuration,
isolation, and the filter plugins' own rules.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import rsagg_metadatafilter as metadatafilter
import rsagg_resourcefilter as resourcefilter
import rsagg_s3 as s3store
import rsagg_xmlpatch as xmlpatch

from aggregator.cli import main
from aggregator.config import ConfigError, parse_config
from aggregator.hookspecs import hookimpl
from aggregator.plugins.manager import DEFAULT_PLUGINS, PluginError, Plugins
from aggregator.publish.links import LinkPolicy, PluginLinks
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.model import Entry, Link, Md
from aggregator.store import defaults as filesystem
from aggregator.store.rows import Resource
from aggregator.testing.upstream import Upstream

from .harvesting import harvest, held
from .plugintesting import PUBLIC, add_plugin, listed, published

SHIPPED = {
    "s3": s3store,
    "xmlpatch": xmlpatch,
    "resourcefilter": resourcefilter,
    "metadatafilter": metadatafilter,
}
DC = "http://purl.org/dc/elements/1.1/"


def resource(uri: str = "http://up.example/a.txt") -> Resource:
    return Resource(
        id=1, set_id=1, uri=uri, sha256="ab" * 32, length=3, type="text/plain", encoding=None,
        hashes={"sha-256": "ab" * 32}, lastmod=None, upstream_datetime=None, links=[], md_extra={},
        entry_extra=[], deleted=False, updated_at=None, generation=None,
    )  # fmt: skip


def entry(loc: str, type: str | None = None, length: int | None = None, record: str | None = None) -> Entry:
    links = [Link("describedby", record, type="application/xml")] if record else []
    return Entry(loc, md=Md(type=type, length=length), links=links)


def config(**tables) -> object:
    return parse_config(tables, "/etc/rsagg/test.toml")


class LinksFirst:
    """A third-party link policy: answers ``rsagg_republish_links`` for every resource."""

    @hookimpl
    def rsagg_republish_links(self, plugin, set_name, resource, uri_of, record):
        return [Link("via", "http://elsewhere.example/" + set_name)]


# ---------------------------------------------------------------------------------------------------
# loading


def test_defaults_first_then_entry_points_and_a_third_party_answer_wins(monkeypatch: pytest.MonkeyPatch):
    add_plugin(monkeypatch, "links", LinksFirst())
    plugins = Plugins()
    names = plugins.names()
    assert names[: len(DEFAULT_PLUGINS)] == list(DEFAULT_PLUGINS)
    installed = [ep.name for ep in entry_points(group="rsagg")]
    assert names[len(DEFAULT_PLUGINS) :] == [*installed, "links"]
    assert all(plugins.versions[n] == "builtin" for n in DEFAULT_PLUGINS)
    # pluggy calls the most recently registered first: the third party before the default policy.
    order = [impl.plugin_name for impl in reversed(plugins.pm.hook.rsagg_republish_links.get_hookimpls())]
    assert order == ["links", "linkpolicy"]
    assert PluginLinks(plugins).links(resource(), uri_of=lambda u: None, set_name="s") == [
        Link("via", "http://elsewhere.example/s")
    ]


def test_without_a_third_party_the_default_link_policy_answers():
    plugins = Plugins(entry_point_plugins=False)
    assert plugins.names() == list(DEFAULT_PLUGINS)
    r = resource()
    assert PluginLinks(plugins).links(r, uri_of=lambda u: None) == LinkPolicy().links(
        r, uri_of=lambda u: None
    )


def test_shipped_plugins_load_through_their_entry_points():
    eps = {ep.name: ep for ep in entry_points(group="rsagg")}
    plugins = Plugins()
    for name, module in SHIPPED.items():
        assert eps[name].value == module.__name__ and eps[name].dist.name == f"rsagg-{name}"
        assert plugins.pm.get_plugin(name) is module
        assert plugins.versions[name] == version(f"rsagg-{name}")  # shown by rsagg plugins
    stores = plugins.merged("rsagg_blob_stores")
    assert stores["s3"] is s3store.create_store and stores["filesystem"] is filesystem.create_store
    formats = plugins.merged("rsagg_patch_formats")
    assert formats[xmlpatch.MEDIA_TYPE] is xmlpatch.apply_xml_patch
    assert formats[xmlpatch.SPEC_MEDIA_TYPE] is xmlpatch.apply_xml_patch
    assert "application/json-patch+json" in formats  # the default plugin's
    assert plugins.hooks_of("resourcefilter") == ["rsagg_filter_harvest", "rsagg_startup"]


def test_the_example_plugin_is_discovered_through_its_entry_point():
    (ep,) = [ep for ep in entry_points(group="rsagg") if ep.name == "example"]
    assert ep.dist.name == "rsagg-example-plugin" and ep.value == "rsagg_example_plugin"
    plugins = Plugins()
    assert plugins.pm.get_plugin("example") is ep.load()
    assert plugins.versions["example"] == version("rsagg-example-plugin")
    assert "rsagg_filter_publish" in plugins.hooks_of("example")


def test_enabled_false_unregisters_a_plugin_and_the_builtin_link_policy_still_answers():
    plugins = Plugins.from_config(
        config(plugins={"xmlpatch": {"enabled": False}, "linkpolicy": {"enabled": False}})
    )
    assert "xmlpatch" not in plugins.names() and "linkpolicy" not in plugins.names()
    assert plugins.disabled == ["xmlpatch", "linkpolicy"]
    assert xmlpatch.MEDIA_TYPE not in plugins.merged("rsagg_patch_formats")
    r = resource()
    assert (
        plugins.first("rsagg_republish_links", set_name="s", resource=r, uri_of=lambda u: None, record=None)
        is None
    )
    # exactly one via link is an invariant of republishing (§14.8): the built-in policy is the fallback
    assert PluginLinks(plugins).links(r, uri_of=lambda u: None) == LinkPolicy().links(
        r, uri_of=lambda u: None
    )


@pytest.mark.parametrize(
    ("tables", "key"),
    [
        ({"plugins": {"nosuch": {"x": 1}}}, "plugins.nosuch"),
        (
            {"sources": [{"name": "a", "url": "http://a.example/", "plugins": {"nosuch": {}}}]},
            "sources[0].plugins.nosuch",
        ),
    ],
)
def test_an_unknown_plugin_in_the_config_is_a_config_error(tables, key):
    with pytest.raises(ConfigError) as exc:
        Plugins.from_config(config(**tables))
    assert exc.value.key == key and exc.value.file == "/etc/rsagg/test.toml"
    assert "no such plugin" in exc.value.problem and "resourcefilter" in exc.value.problem  # lists installed


def test_per_source_settings_overlay_the_global_table():
    cfg = config(
        plugins={"resourcefilter": {"types": ["text/*"], "max_length": 100, "enabled": True}},
        sources=[
            {"name": "a", "url": "http://a.example/"},
            {"name": "b", "url": "http://b.example/", "plugins": {"resourcefilter": {"max_length": 5}}},
        ],
    )
    plugins = Plugins.from_config(cfg)
    ctx = plugins.context
    assert ctx.settings("resourcefilter") == {"types": ["text/*"], "max_length": 100}
    assert ctx.settings("resourcefilter", "a") == {"types": ["text/*"], "max_length": 100}
    assert ctx.settings("resourcefilter", "b") == {"types": ["text/*"], "max_length": 5}
    assert ctx.settings("example", "b") == {}

    def keep(source: str, e: Entry) -> list:
        return plugins.call("rsagg_filter_harvest", source=source, entry=e, metadata=None)

    assert keep("a", entry("http://a.example/x", "text/plain", 50)) == [True]
    assert keep("b", entry("http://b.example/x", "text/plain", 50)) == [False]
    assert keep("b", entry("http://b.example/x", "text/plain", 5)) == [True]


class Broken:
    @hookimpl
    def rsagg_filter_publish(self, plugin, set_name, resource):
        raise RuntimeError("boom")

    @hookimpl
    def rsagg_filter_harvest(self, plugin, source, entry, metadata):
        async def later():
            raise OSError("async boom")

        return later()

    @hookimpl
    def rsagg_republish_links(self, plugin, set_name, resource, uri_of, record):
        raise KeyError("no links")


async def test_a_plugin_that_raises_is_logged_with_its_name_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    add_plugin(monkeypatch, "broken", Broken())
    plugins = Plugins({"example": {"hide": "secret"}, "resourcefilter": {"types": ["text/*"]}})
    caplog.set_level(logging.ERROR, logger="rsagg.plugins")
    answers = plugins.call("rsagg_filter_publish", set_name="s", resource=resource("http://x/secret"))
    assert answers == [False]  # the others still answer
    assert plugins.failures["broken"] == 1
    assert "plugin broken raised in rsagg_filter_publish: RuntimeError: boom" in caplog.text

    answers = await plugins.acall("rsagg_filter_harvest", source="s", entry=entry("http://x/a", "image/png"),
                                  metadata=None)  # fmt: skip
    assert answers == [False]
    assert plugins.failures["broken"] == 2
    assert "plugin broken raised in rsagg_filter_harvest: OSError: async boom" in caplog.text

    r = resource()  # a failing firstresult answer: the next plugin (the default policy) answers
    assert PluginLinks(plugins).links(r, uri_of=lambda u: None) == LinkPolicy().links(
        r, uri_of=lambda u: None
    )
    assert plugins.failures["broken"] == 3


# ---------------------------------------------------------------------------------------------------
# pluggy's semantics hold: every call goes through pluggy's own call loop


class Calls:
    """Records which of its implementations ran."""

    def __init__(self, answer: object = None) -> None:
        self.answer, self.ran = answer, 0

    @hookimpl
    def rsagg_republish_links(self, plugin, set_name, resource, uri_of, record):
        self.ran += 1
        return self.answer


def test_a_firstresult_hook_stops_at_the_first_non_none_answer(monkeypatch: pytest.MonkeyPatch):
    earlier, silent, answering = Calls([Link("via", "http://never.example/")]), Calls(None), LinksFirst()
    for name, obj in [("earlier", earlier), ("silent", silent), ("answering", answering)]:
        add_plugin(monkeypatch, name, obj)
    plugins = Plugins()
    links = plugins.first("rsagg_republish_links", set_name="s", resource=resource(), uri_of=lambda u: None,
                          record=None)  # fmt: skip
    assert links == [Link("via", "http://elsewhere.example/s")]  # "answering" was registered last
    assert silent.ran == 0 and earlier.ran == 0  # neither was called: pluggy stopped at the first answer
    with pytest.raises(TypeError, match="not a firstresult hook"):
        plugins.first("rsagg_filter_publish", set_name="s", resource=resource())


class Wrapper:
    """A ``wrapper=True`` implementation: sees the answers of the others and may change them."""

    def __init__(self) -> None:
        self.seen: list = []

    @hookimpl(wrapper=True)
    def rsagg_filter_publish(self, plugin, set_name, resource):
        answers = yield
        self.seen.append(list(answers))
        return [*answers, "wrapped"]


class OldStyleWrapper:
    def __init__(self) -> None:
        self.seen: list = []

    @hookimpl(hookwrapper=True)
    def rsagg_filter_publish(self, plugin, set_name, resource):
        outcome = yield
        self.seen.append(list(outcome.get_result()))
        outcome.force_result([*outcome.get_result(), "old"])


def test_a_wrapper_wraps_the_call_and_can_change_its_result(monkeypatch: pytest.MonkeyPatch):
    wrapper, old = Wrapper(), OldStyleWrapper()
    add_plugin(monkeypatch, "wrapper", wrapper)
    add_plugin(monkeypatch, "old", old)
    plugins = Plugins({"example": {"hide": "secret"}})
    answers = plugins.call("rsagg_filter_publish", set_name="s", resource=resource("http://x/secret"))
    # the old-style wrapper (registered last) is outermost: it sees the new-style wrapper's result
    assert wrapper.seen == [[False]] and old.seen == [[False, "wrapped"]]
    assert answers == [False, "wrapped", "old"]


class Ordered:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def rsagg_resource_deleted(self, plugin, source, set_name, uri):
        self.log.append(self.name)


def test_tryfirst_and_trylast_order_the_implementations(monkeypatch: pytest.MonkeyPatch):
    log: list[str] = []
    kinds = {"first": hookimpl(tryfirst=True), "plain": hookimpl, "last": hookimpl(trylast=True)}
    for name, marker in kinds.items():  # without the marks pluggy would call them last, plain, first
        cls = type(name, (Ordered,), {"rsagg_resource_deleted": marker(Ordered.rsagg_resource_deleted)})
        add_plugin(monkeypatch, name, cls(name, log))
    plugins = Plugins()
    plugins.call("rsagg_resource_deleted", source="s", set_name="s", uri="http://x/a")
    assert log == ["first", "plain", "last"]


class FailingWrapper:
    @hookimpl(wrapper=True)
    def rsagg_filter_publish(self, plugin, set_name, resource):
        yield
        raise RuntimeError("wrapper boom")

    @hookimpl(wrapper=True)
    def rsagg_republish_links(self, plugin, set_name, resource, uri_of, record):
        raise RuntimeError("before yield")
        yield  # pragma: no cover


def test_a_failing_wrapper_is_isolated_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    add_plugin(monkeypatch, "badwrapper", FailingWrapper())
    add_plugin(monkeypatch, "broken", Broken())
    plugins = Plugins({"example": {"hide": "secret"}})
    caplog.set_level(logging.ERROR, logger="rsagg.plugins")
    answers = plugins.call("rsagg_filter_publish", set_name="s", resource=resource("http://x/secret"))
    assert answers == [False]  # the answer as it would be without the failing wrapper and plugin
    assert plugins.failures == {"badwrapper": 1, "broken": 1}
    assert "plugin badwrapper raised in rsagg_filter_publish: RuntimeError: wrapper boom" in caplog.text
    r = resource()
    policy = LinkPolicy().links(r, uri_of=lambda u: None)
    assert PluginLinks(plugins).links(r, uri_of=lambda u: None) == policy
    assert plugins.failures == {"badwrapper": 2, "broken": 2}


class _Misspelt:
    @hookimpl
    def rsagg_filter_published(self, set_name, resource):  # the hook is rsagg_filter_publish
        return False


class _Undecorated:
    def rsagg_filter_publish(self, set_name, resource):  # no @hookimpl: pluggy never calls it
        return False


class _WrongArgs:
    @hookimpl
    def rsagg_filter_publish(self, set_name, resource, colour):  # no such argument
        return False


#: (plugin object, load error, what the one line must name): each must stop every command.
_REFUSED = [
    (None, ImportError("No module named 'missing_dependency'"), ["failed to load", "missing_dependency"]),
    (None, SyntaxError("invalid syntax"), ["failed to load", "SyntaxError"]),
    (_Misspelt(), None, ["rsagg_filter_published", "no rsagg hook"]),
    (_Undecorated(), None, ["rsagg_filter_publish", "@hookimpl"]),
    (_WrongArgs(), None, ["rsagg_filter_publish"]),
]


@pytest.mark.parametrize("obj,error,named", _REFUSED)
@pytest.mark.parametrize(
    "command", [["plugins"], ["plugins", "--json"], ["run"], ["harvest"], ["status"], ["gc", "--dry-run"]]
)
def test_a_plugin_that_does_not_load_or_names_no_hook_stops_every_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path, obj, error, named, command
):
    """Fail closed: exit 2 with one line naming the plugin and the hook, never a traceback, never a
    start without the plugin."""
    add_plugin(monkeypatch, "privacy", obj, error=error)
    cfg = tmp_path / "rsagg.toml"
    cfg.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[[sources]]\nname = "up"\nurl = "http://127.0.0.1:9/"\n'
    )
    argv = [*command[:1], "-c", str(cfg), *command[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "config error" in err and "plugins.privacy" in err and "plugin privacy" in err, err
    for word in named:
        assert word in err, (word, err)
    assert not (tmp_path / "data" / "state.db").exists() or command[0] in ("status", "gc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "module,named",
    [
        ("import missing_dependency_of_privacy\n", ["failed to load", "missing_dependency_of_privacy"]),
        (
            "from aggregator.plugin_api import hookimpl\n\n@hookimpl\n"
            "def rsagg_filter_published(set_name, resource):\n    return False\n",
            ["rsagg_filter_published", "no rsagg hook"],
        ),
    ],
)
def test_an_installed_broken_filter_stops_rsagg_run(tmp_path: Path, module: str, named: list[str]):
    """End to end: a plugin installed as a distribution (entry point of the ``rsagg`` group), broken or
    misspelt, and ``rsagg run`` in a process of its own refuses to start: exit 2, one line."""
    site = tmp_path / "site"
    (site / "privacy-1.0.dist-info").mkdir(parents=True)
    (site / "privacy-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: privacy\nVersion: 1.0\n"
    )
    (site / "privacy-1.0.dist-info" / "entry_points.txt").write_text("[rsagg]\nprivacy = rsagg_privacy\n")
    (site / "rsagg_privacy.py").write_text(module)
    cfg = tmp_path / "rsagg.toml"
    cfg.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
        '[[sources]]\nname = "up"\nurl = "http://127.0.0.1:9/"\n'
    )
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(repo)])}
    done = subprocess.run(
        [sys.executable, "-m", "aggregator", "run", "-c", str(cfg)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "config error" in done.stderr and "plugin privacy" in done.stderr
    for word in named:
        assert word in done.stderr, (word, done.stderr)


def test_a_refused_plugin_disabled_by_configuration_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
):
    """``[plugins.NAME] enabled = false``: the operator's way to start without a broken plugin."""
    add_plugin(monkeypatch, "privacy", None, error=ImportError("No module named 'missing_dependency'"))
    cfg = tmp_path / "rsagg.toml"
    cfg.write_text("[plugins.privacy]\nenabled = false\n")
    assert main(["plugins", "-c", str(cfg), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["privacy"]["enabled"] is False
    with pytest.raises(PluginError, match="privacy"):
        Plugins()


# ---------------------------------------------------------------------------------------------------
# rsagg plugins


def test_rsagg_plugins_lists_name_version_origin_enabled_and_hooks(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    cfg = tmp_path / "rsagg.toml"
    cfg.write_text('[plugins.xmlpatch]\nenabled = false\n[plugins.example]\nhide = "x"\n')
    assert main(["plugins", "-c", str(cfg), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plugins"]
    assert [r["name"] for r in rows[: len(DEFAULT_PLUGINS)]] == list(DEFAULT_PLUGINS)
    by_name = {r["name"]: r for r in rows}
    assert by_name["linkpolicy"] == {
        "name": "linkpolicy", "version": "builtin", "origin": "builtin",
        "module": "aggregator.publish.defaults", "distribution": None, "enabled": True,
        "loaded": True, "hooks": ["rsagg_republish_links"],
    }  # fmt: skip
    assert by_name["xmlpatch"]["enabled"] is False and by_name["xmlpatch"]["hooks"] == ["rsagg_patch_formats"]
    example = by_name["example"]
    assert example["origin"] == "entry point" and example["distribution"] == "rsagg-example-plugin"
    assert example["version"] == version("rsagg-example-plugin") and example["enabled"] is True
    assert "rsagg_resource_stored" in example["hooks"]

    assert main(["plugins", "-c", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["PLUGIN", "VERSION", "ORIGIN", "ENABLED", "HOOKS"]
    xml = next(line for line in lines if line.startswith("xmlpatch "))
    assert " no " in xml and "entry point: rsagg" in xml and xml.endswith("rsagg_patch_formats")
    assert next(line for line in lines if line.startswith("filesystem ")).split()[1:4] == [
        "builtin",
        "builtin",
        "yes",
    ]

    cfg.write_text("[plugins.nosuch]\nx = 1\n")
    assert main(["plugins", "-c", str(cfg)]) == 2
    assert "plugins.nosuch: no such plugin" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# plugins/rsagg-resourcefilter


def _resourcefilter(settings: dict, e: Entry) -> list:
    return Plugins({"resourcefilter": settings}).call(
        "rsagg_filter_harvest", source="s", entry=e, metadata=None
    )


@pytest.mark.parametrize(
    ("settings", "loc", "type", "length", "keep"),
    [
        ({"types": ["text/*"]}, "http://x/a", "text/plain", 1, True),
        ({"types": ["text/*"]}, "http://x/a", "TEXT/HTML; charset=utf-8", 1, True),
        ({"types": ["text/*"]}, "http://x/a", "image/png", 1, False),
        ({"types": ["text/*"]}, "http://x/a", None, 1, True),
        ({"types": ["text/*"], "keep_untyped": False}, "http://x/a", None, 1, False),
        ({"types": ["text/*"], "exclude_types": ["text/html"]}, "http://x/a", "text/html", 1, False),
        ({"exclude_types": ["application/*"]}, "http://x/a", "text/csv", 1, True),
        ({"include": [r"/data/"]}, "http://x/data/1", None, None, True),
        ({"include": [r"/data/"]}, "http://x/other/1", None, None, False),
        ({"include": [r"/data/"], "exclude": [r"\.tmp$"]}, "http://x/data/1.tmp", None, None, False),
        ({"exclude": "secret"}, "http://x/secret/1", None, None, False),
        ({"max_length": 10}, "http://x/a", None, 10, True),
        ({"max_length": 10}, "http://x/a", None, 11, False),
        ({"min_length": 1}, "http://x/a", None, 0, False),
        ({"max_length": 10}, "http://x/a", None, None, True),
        ({"max_length": 10, "keep_unsized": False}, "http://x/a", None, None, False),
    ],
)
def test_resourcefilter_rules(settings, loc, type, length, keep):
    assert _resourcefilter(settings, entry(loc, type, length)) == [keep]


def test_resourcefilter_has_no_say_unless_configured_for_the_source():
    assert _resourcefilter({}, entry("http://x/a", "image/png")) == []
    assert _resourcefilter({"keep_untyped": False}, entry("http://x/a")) == []  # no test named
    plugins = Plugins({}, {"s": {"resourcefilter": {"types": ["text/*"]}}})
    e = entry("http://x/a", "image/png")
    assert plugins.call("rsagg_filter_harvest", source="other", entry=e, metadata=None) == []
    assert plugins.call("rsagg_filter_harvest", source="s", entry=e, metadata=None) == [False]
    off = Plugins({"resourcefilter": {"types": ["text/*"]}}, {"s": {"resourcefilter": {"enabled": False}}})
    assert off.call("rsagg_filter_harvest", source="s", entry=e, metadata=None) == []


def test_resourcefilter_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="include: bad regular expression"):
        resourcefilter.rules_from({"include": ["("]})
    with pytest.raises(ValueError, match="unknown setting"):
        resourcefilter.rules_from({"type": ["text/*"]})
    with pytest.raises(ValueError, match="max_length must be a non-negative integer"):
        resourcefilter.rules_from({"max_length": "1 GB"})
    plugins = Plugins({"resourcefilter": {"include": ["("]}})
    assert plugins.call("rsagg_filter_harvest", source="s", entry=entry("http://x/a"), metadata=None) == []
    assert plugins.failures["resourcefilter"] == 1


def test_filter_plugins_check_every_sources_settings_at_startup(caplog: pytest.LogCaptureFixture):
    cfg = config(
        sources=[
            {"name": "a", "url": "http://a.example/"},
            {"name": "b", "url": "http://b.example/", "plugins": {"resourcefilter": {"max_length": -1},
                                                                   "metadatafilter": {"xpath": "]["}}},
        ]
    )  # fmt: skip
    plugins = Plugins.from_config(cfg)
    caplog.set_level(logging.ERROR, logger="rsagg.plugins")
    plugins.call("rsagg_startup", config=cfg)
    assert plugins.failures["resourcefilter"] == 1 and plugins.failures["metadatafilter"] == 1
    assert "resourcefilter: max_length must be a non-negative integer" in caplog.text
    assert "metadatafilter: bad xpath" in caplog.text


# ---------------------------------------------------------------------------------------------------
# plugins/rsagg-metadatafilter


def dc_record(*elements: tuple[str, str], ns: str = DC) -> bytes:
    body = "".join(f"<dc:{name}>{value}</dc:{name}>" for name, value in elements)
    return (
        f'<?xml version="1.0"?><oai_dc:dc xmlns:oai_dc="http://www.openarchives.org/OAI/2.0/oai_dc/" '
        f'xmlns:dc="{ns}">{body}</oai_dc:dc>'
    ).encode()


class Records:
    """The ``metadata`` callable the harvester passes: records by URL, counting requests."""

    def __init__(self, records: dict[str, bytes | None]) -> None:
        self.records = records
        self.asked: list[str] = []

    async def __call__(self, e: Entry) -> bytes | None:
        href = e.links_by_rel("describedby")[0].href
        self.asked.append(href)
        record = self.records[href]
        if isinstance(record, Exception):
            raise record
        return record


async def _metadatafilter(settings: dict, e: Entry, records: Records) -> list:
    plugins = Plugins({"metadatafilter": settings})
    return await plugins.acall("rsagg_filter_harvest", source="s", entry=e, metadata=records)


@pytest.mark.parametrize(
    ("settings", "record", "keep"),
    [
        ({"field": "type", "values": ["Text"]}, dc_record(("type", "Text")), True),
        ({"field": "type", "values": ["Text"]}, dc_record(("type", "  text\n")), True),
        ({"field": "type", "values": ["Text"]}, dc_record(("type", "Image"), ("type", "TEXT")), True),
        ({"field": "type", "values": ["Text"]}, dc_record(("type", "Image")), False),
        ({"field": "type", "values": ["Text"]}, dc_record(("subject", "Text")), False),
        (
            {"field": "type", "values": ["Text"]},
            dc_record(("type", "Text"), ns="http://purl.org/dc/terms/"),
            True,
        ),
        ({"field": "type", "values": ["Text"]}, dc_record(("type", "Text"), ns="urn:not-dc"), False),
        ({"xpath": "dc:type = 'Text'", "namespaces": {"dc": DC}}, dc_record(("type", "Text")), True),
        ({"xpath": "dc:type = 'Text'", "namespaces": {"dc": DC}}, dc_record(("type", "Sound")), False),
        ({"xpath": "//dc:rights", "namespaces": {"dc": DC}}, dc_record(("rights", "CC0")), True),
        ({"xpath": "//dc:rights", "namespaces": {"dc": DC}}, dc_record(("type", "Text")), False),
        ({"xpath": "count(dc:type)", "namespaces": {"dc": DC}}, dc_record(("type", "a")), True),
        ({"xpath": "count(dc:type)", "namespaces": {"dc": DC}}, dc_record(), False),
        ({"xpath": "string(dc:type)", "namespaces": {"dc": DC}}, dc_record(), False),
        (
            {"field": "type", "values": ["Text"], "xpath": "not(dc:rights)", "namespaces": {"dc": DC}},
            dc_record(("type", "Text"), ("rights", "closed")),
            False,
        ),
        (
            {"xpath": "dc:type = 'Text'", "namespaces": {"x": DC}},
            dc_record(("type", "Text")),
            False,
        ),  # bad prefix
        ({"field": "type", "values": ["Text"]}, b"<not-well-formed", False),
        ({"field": "type", "values": ["Text"], "max_record_bytes": 50}, dc_record(("type", "Text")), False),
        (
            {"field": "type", "values": ["Text"]},
            b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY t "Text">]>'
            b'<d xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:type>&t;</dc:type></d>',
            False,
        ),
    ],
)
async def test_metadatafilter_matches_records(settings, record, keep):
    records = Records({"http://x/a.meta.xml": record})
    e = entry("http://x/a", record="http://x/a.meta.xml")
    assert await _metadatafilter(settings, e, records) == [keep]
    assert records.asked == ["http://x/a.meta.xml"]


async def test_metadatafilter_entries_without_a_record():
    settings = {"field": "type", "values": ["Text"]}
    records = Records({"http://x/gone.meta.xml": None})
    assert await _metadatafilter(settings, entry("http://x/a.meta.xml"), records) == [False]
    assert await _metadatafilter(settings, entry("http://x/a", record="http://x/gone.meta.xml"), records) == [
        False
    ]
    keep = {**settings, "keep_without_record": True}
    assert await _metadatafilter(keep, entry("http://x/a.meta.xml"), records) == [True]
    assert records.asked == ["http://x/gone.meta.xml"]  # no link, no request


async def test_metadatafilter_has_no_say_unless_configured_or_when_the_record_cannot_be_fetched():
    records = Records({"http://x/a.meta.xml": OSError("connection reset")})
    e = entry("http://x/a", record="http://x/a.meta.xml")
    assert await _metadatafilter({}, e, records) == []
    assert await _metadatafilter({"keep_without_record": True}, e, records) == []
    assert records.asked == []
    plugins = Plugins({"metadatafilter": {"field": "type", "values": ["Text"]}})
    assert await plugins.acall("rsagg_filter_harvest", source="s", entry=e, metadata=records) == []
    assert plugins.failures["metadatafilter"] == 0


def test_metadatafilter_answers_synchronously_when_it_needs_no_record():
    plugins = Plugins({"metadatafilter": {"field": "type", "values": ["Text"]}})
    assert plugins.call("rsagg_filter_harvest", source="s", entry=entry("http://x/a"), metadata=None) == [
        False
    ]


def test_metadatafilter_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="bad xpath"):
        metadatafilter.Criteria({"xpath": "dc:type[", "namespaces": {"dc": DC}})
    with pytest.raises(ValueError, match="needs values"):
        metadatafilter.Criteria({"field": "type"})
    with pytest.raises(ValueError, match="unknown setting"):
        metadatafilter.Criteria({"fields": "type"})


# ---------------------------------------------------------------------------------------------------
# acceptance: the metadata filter end to end (harvester wiring + demo Upstream records, §14.5)


def _filtered_config(folder: Path, url: str, **settings) -> object:
    return parse_config(
        {
            "store": {"path": str(folder)},
            "harvest": {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
            "sources": [{"name": "up", "url": url}],
            "plugins": {"metadatafilter": {"field": "type", "values": ["Text"], **settings}},
        },
        str(folder.parent / "test.toml"),
    )


async def _published_locs(cfg) -> tuple[list[str], list[str]]:
    async with published(cfg) as client:
        resources = [e.loc for e in await listed(client, "up", "resourcelist.xml")]
        changes = [e.loc for e in await listed(client, "up", "changelist.xml")]
    return sorted(resources), sorted(set(changes))


async def test_metadata_filter_keeps_exactly_the_matching_resources_and_republishes_only_those(
    tmp_path: Path,
):
    up = Upstream(metadata=True, resource_dump=False, change_dump=False)
    types = {"a.txt": "Text", "b.txt": "Image", "c.txt": "  text ", "d.txt": ["Sound", "Dataset"],
             "e.txt": ["Image", "Text"], "f.txt": None}  # fmt: skip
    for path, dc_type in types.items():
        if dc_type is not None:
            up.dc_elements[path] = {"type": dc_type}
        up.create(path, path.encode())
    assert b"<dc:type>Image</dc:type>" in up.resources()["b.txt.meta.xml"].data
    matching = ["a.txt", "c.txt", "e.txt"]
    async with up.serving() as base:
        cfg = _filtered_config(tmp_path / "data", base)
        assert (await harvest(cfg))["up"].ok
        assert held(cfg) == {up.url(p): up.resources()[p].sha256 for p in matching}
        for path in types:  # each record read once; resources fetched only when they match
            assert up.counts[f"/default/res/{path}.meta.xml"] == 1, path
            assert up.counts[f"/default/res/{path}"] == (1 if path in matching else 0), path
    resources, changes = await _published_locs(cfg)
    assert resources == changes == sorted(rsagg_uri(PUBLIC, "up", up.url(p)) for p in matching)


async def test_metadata_filter_follows_record_changes_in_incremental_sync(tmp_path: Path):
    up = Upstream(metadata=True, resource_dump=False, change_dump=False)
    up.dc_elements.update({"a.txt": {"type": "Text"}, "b.txt": {"type": "Image"}})
    up.create("a.txt", b"a")
    up.create("b.txt", b"b")
    async with up.serving() as base:
        cfg = _filtered_config(tmp_path / "data", base)
        assert (await harvest(cfg))["up"].ok
        assert set(held(cfg)) == {up.url("a.txt")}
        # reclassified upstream: a becomes an Image (its held copy goes), b a Text (harvested now)
        up.dc_elements.update({"a.txt": {"type": "Image"}, "b.txt": {"type": "Text"}})
        up.update("a.txt", b"a v2")
        up.update("b.txt", b"b v2")
        assert (await harvest(cfg))["up"].ok
        assert held(cfg) == {up.url("b.txt"): up.resources()["b.txt"].sha256}
    resources, _ = await _published_locs(cfg)
    assert resources == [rsagg_uri(PUBLIC, "up", up.url("b.txt"))]


# ---------------------------------------------------------------------------------------------------
# the public plugin API


def test_the_plugin_api_exports_exactly_its_names():
    import aggregator.plugin_api as api

    public = {n for n in dir(api) if not n.startswith("_") and n != "annotations"}  # with those loaded lazily
    assert set(api.__all__) == public and len(api.__all__) == len(set(api.__all__))
    assert api.hookimpl is hookimpl and api.Resource is Resource and api.Entry is Entry


def test_shipped_plugins_and_the_example_import_nothing_of_rsagg_but_the_plugin_api():
    import ast

    root = Path(__file__).parent.parent
    files = [Path(m.__file__) for m in SHIPPED.values()]
    files.append(root / "tests" / "example_plugin" / "rsagg_example_plugin.py")
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] == "aggregator":
                    assert name == "aggregator.plugin_api", f"{file.name} imports {name}"


def test_lazy_module_imports_on_first_use_and_takes_its_place(tmp_path: Path, monkeypatch) -> None:
    from aggregator.plugin_api import lazy_module

    (tmp_path / "rsagg_lazy_probe.py").write_text("VALUE = 42\ndef twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rsagg_lazy_probe", raising=False)
    namespace: dict[str, object] = {}
    namespace["probe"] = lazy_module("rsagg_lazy_probe", namespace, "probe")
    assert "rsagg_lazy_probe" not in sys.modules  # nothing imported until asked
    assert namespace["probe"].VALUE == 42  # type: ignore[attr-defined]
    assert namespace["probe"] is sys.modules["rsagg_lazy_probe"]  # the module itself from then on
    assert namespace["probe"].twice(2) == 4  # type: ignore[attr-defined]
    missing = lazy_module("rsagg_no_such_module", {}, "x")
    with pytest.raises(ModuleNotFoundError):
        getattr(missing, "anything")  # noqa: B009
