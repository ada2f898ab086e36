"""The example plugin's own tests: what a plugin author writes (see docs/plugins.md, "Testing")."""

from __future__ import annotations

import json
from pathlib import Path

import rsagg_example_plugin

from aggregator.plugin_api import Resource
from aggregator.plugins.manager import Plugins


def resource(uri: str) -> Resource:
    return Resource(
        id=1, set_id=1, uri=uri, sha256="0" * 64, length=1, type="text/plain", encoding=None, hashes={},
        lastmod=None, upstream_datetime=None, links=[], md_extra={}, entry_extra=[], deleted=False,
        updated_at=None, generation=None,
    )  # fmt: skip


def test_hides_matching_resources_from_republishing() -> None:
    plugins = Plugins({"example": {"hide": "/drafts/"}})
    hidden = plugins.call("rsagg_filter_publish", set_name="s", resource=resource("http://x/drafts/1"))
    shown = plugins.call("rsagg_filter_publish", set_name="s", resource=resource("http://x/final/1"))
    assert hidden == [False]  # the only plugin with a say on republishing here
    assert shown == []


def test_events_go_to_the_file_of_the_source(tmp_path: Path) -> None:
    main, museum = tmp_path / "events.jsonl", tmp_path / "museum.jsonl"
    plugins = Plugins(
        {"example": {"events_file": str(main)}}, {"museum": {"example": {"events_file": str(museum)}}}
    )
    for source in ("museum", "library"):
        plugins.call(
            "rsagg_resource_stored", source=source, set_name=source, uri=f"http://{source}/a",
            change="created", sha256="ab" * 32,
        )  # fmt: skip
    plugins.call("rsagg_shutdown")
    assert [json.loads(x)["uri"] for x in museum.read_text().splitlines()] == ["http://museum/a"]
    events = [json.loads(x) for x in main.read_text().splitlines()]
    assert [(e["event"], e.get("uri")) for e in events] == [
        ("stored", "http://library/a"),
        ("shutdown", None),
    ]


def test_is_registered_as_a_module_of_hook_implementations() -> None:
    plugins = Plugins()
    assert plugins.pm.get_plugin("example") is rsagg_example_plugin
