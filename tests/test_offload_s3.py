"""``server.offload = "redirect"`` on the S3 blob store, against a real SeaweedFS (and the harvest's
worker processes storing OAI-PMH records into it).

rsagg still answers 304, 404 (a resource hidden by a publish filter) and 410 itself; a resource's GET
or HEAD is a 307 to a presigned URL of its blob, which SeaweedFS serves with the type rsagg publishes.
resync, the reference Destination, follows the redirects: baseline and audit in sync.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
from lxml import etree

from aggregator.config import ConfigError, parse_config
from aggregator.harvest.context import open_blob_store
from aggregator.plugins.manager import Plugins
from aggregator.publish.uris import rsagg_uri
from aggregator.publish.versions import timegate_uri
from aggregator.run.compose import open_context
from aggregator.testing.upstream import Upstream
from tests.seaweedfs import SeaweedFS, run_seaweedfs

from .harvesting import harvest, held
from .httpserver import serve_app
from .oaiserver import OaiApp, Repository
from .test_publish import local_files, publishing, resync

# Runs a real SeaweedFS S3 server.
pytestmark = pytest.mark.slow

pytest.importorskip("boto3")

FILES = {
    "a.txt": (b"plain text\n", "text/plain"),
    "b.json": (b'{"b": 1}\n', "application/json"),
    "c.bin": (bytes(range(256)) * 5, "application/octet-stream"),
    "drafts/hidden.txt": (b"not published\n", "text/plain"),
    "gone.txt": (b"deleted later\n", "text/plain"),
}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    """One SeaweedFS for the module (only one may run on the machine at a time)."""
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as sw:
        yield sw


def s3_config(tmp_path: Path, seaweed: SeaweedFS, upstream: str, **store: object):
    settings = seaweed.settings(f"rsagg-{uuid.uuid4().hex[:12]}", create_bucket=True, **store)
    return parse_config(
        {
            "server": {"offload": "redirect", "redirect_lifetime": 600},
            "store": {"path": str(tmp_path / "data"), "backend": "s3", "settings": settings},
            "harvest": {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
            "plugins": {"example": {"hide": "/drafts/"}},
            "sources": [{"name": "up", "url": upstream}],
        },
        str(tmp_path / "rsagg.toml"),
    )


async def test_redirects_to_presigned_urls_and_resync_follows(tmp_path: Path, seaweed: SeaweedFS):
    up = Upstream(resource_dump=False, change_dump=False)
    for name, (data, type_) in FILES.items():
        up.create(name, data, type_)
    async with up.serving() as ubase:
        cfg = s3_config(tmp_path, seaweed, ubase)
        assert (await harvest(cfg))["up"].ok
        async with publishing(cfg) as (base, client):

            def url(name: str) -> str:
                return rsagg_uri(base, "up", up.url(name))

            for name, (data, type_) in FILES.items():
                if name.startswith("drafts/"):
                    continue
                for method in ("GET", "HEAD"):
                    r = await client.request(method, url(name))
                    assert r.status_code == 307, (name, method)
                    assert r.headers["link"].startswith(
                        f'<{base}/up/capabilitylist.xml>; rel="resourcesync", '
                    )
                    target = r.headers["location"]
                    assert target.startswith(seaweed.endpoint_url + "/") and "Signature=" in target
                # its memento (the current version, through the TimeGate) is redirected the same way
                gate = (await client.get(timegate_uri(base, "up", up.url(name)))).headers["location"]
                r = await client.get(gate)
                assert r.status_code == 307 and "Signature=" in r.headers["location"]
                assert 'rel="original"' in r.headers["link"] and "immutable" not in r.headers.get(
                    "cache-control", ""
                )
                assert (await client.get(gate, follow_redirects=True)).content == data
                r = await client.get(url(name), follow_redirects=True)
                assert r.status_code == 200 and r.content == data, name
                assert r.headers["content-type"] == type_  # S3 answers with the type rsagg publishes
                ranged = await client.get(url(name), headers={"range": "bytes=1-3"}, follow_redirects=True)
                assert ranged.status_code == 206 and ranged.content == data[1:4]
                # the validators are still rsagg's: 304 without a redirect
                etag = f'"{hashlib.sha256(data).hexdigest()}"'
                for headers in (
                    {"if-none-match": etag},
                    {"if-modified-since": "Fri, 01 Jan 2100 00:00:00 GMT"},
                ):
                    r = await client.get(url(name), headers=headers)
                    assert r.status_code == 304 and r.headers["etag"] == etag, headers
                # preconditions are judged by rsagg, which then sends the bytes itself (no redirect)
                r = await client.get(url(name), headers={"if-match": etag})
                assert r.status_code == 200 and r.content == data
                assert (await client.get(url(name), headers={"if-match": '"x"'})).status_code == 412
            assert (await client.get(url("drafts/hidden.txt"))).status_code == 404
            assert (await client.get(url("never.txt"))).status_code == 404

            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            out = await resync("--baseline", "--delete", base, str(dest), cwd=cwd)
            assert "SYNCED" in out or "IN SYNC" in out, out
            want = {url(n)[len(base) + 1 :]: d for n, (d, _) in FILES.items() if not n.startswith("drafts/")}
            assert local_files(dest) == want
            out = await resync("--audit", "--hash", "md5", base, str(dest), cwd=cwd)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out

            up.delete("gone.txt")
            assert (await harvest(cfg))["up"].ok
            assert (await client.get(url("gone.txt"))).status_code == 410
            assert (await client.head(url("gone.txt"))).status_code == 410


async def test_public_url_gives_unsigned_urls(tmp_path: Path, seaweed: SeaweedFS):
    cfg = s3_config(tmp_path, seaweed, "http://upstream.invalid/", public_url="https://cdn.example/blobs")
    with open_blob_store(cfg, Plugins.from_config(cfg)) as store:
        sha = "ab" * 32
        assert store.url(sha, 600) == f"https://cdn.example/blobs/ab/ab/{sha}"
        assert store.blob_name(sha) == f"ab/ab/{sha}"
    bad = s3_config(tmp_path / "x", seaweed, "http://upstream.invalid/", public_url="ftp://nope")
    with pytest.raises(ConfigError, match=r"store\.settings: .*public_url is not an http"):
        open_blob_store(bad, Plugins.from_config(bad))


async def test_oai_records_are_stored_in_s3_by_the_harvests_worker_processes(
    tmp_path: Path, seaweed: SeaweedFS
):
    """An OAI-PMH page's records are stored by a worker process (``harvest.processes``), which opens the
    S3 store from the plugin's factory: every record the state names is in the bucket, its bytes
    the record's metadata."""
    repo = Repository()
    repo.bulk_add(0, 300)
    app = OaiApp(repo, page_size=100)
    async with serve_app(app) as base:
        repo.base_url = f"{base}/oai"
        settings = seaweed.settings(f"rsagg-{uuid.uuid4().hex[:12]}", create_bucket=True)
        cfg = parse_config(
            {
                "store": {"path": str(tmp_path / "data"), "backend": "s3", "settings": settings},
                "harvest": {"processes": 2, "retries": 2, "backoff_base": 0.01, "timeout": 10},
                "sources": [{"name": "oai", "url": f"{base}/oai", "kind": "oai-pmh"}],
            },
            str(tmp_path / "rsagg.toml"),
        )
        async with open_context(cfg) as ctx:
            assert ctx.offload is not None and ctx.offload.processes == 2  # the S3 factory travels
        result = (await harvest(cfg))["oai"]
        assert result.ok, result.error
        assert result.stats[0].applied == {"created": 300}
    names = held(cfg)
    assert len(names) == 300
    blobs = open_blob_store(cfg, Plugins.from_config(cfg))
    try:
        titles = {}
        for uri, sha in names.items():
            with blobs.open(sha) as f:
                data = f.read()
            assert hashlib.sha256(data).hexdigest() == sha
            titles[uri] = etree.fromstring(data).findtext("{http://purl.org/dc/elements/1.1/}title")
        assert titles == repo.live()
    finally:
        getattr(blobs, "close", lambda: None)()
