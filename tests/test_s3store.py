"""S3BlobStore against a real SeaweedFS: the FileBlobStore behaviours, write-once, multipart, errors.

One ``weed mini`` serves the whole module (it takes ~1 s to start and a few to stop); each test gets a
fresh bucket, so tests do not see each other's blobs.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sqlite3
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from rsagg_s3 import MIN_PART_SIZE, S3BlobStore, S3StoreError, create_store

from aggregator.commands.gc import Garbage, collect_garbage
from aggregator.store.blobs import BlobInfo, BlobStore
from aggregator.store.state import State
from tests import harvesting, test_harvest, test_publish
from tests.blobtesting import temp_files
from tests.seaweedfs import SeaweedFS, run_seaweedfs

# Runs a real SeaweedFS S3 server.
pytestmark = pytest.mark.slow

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    # Module scope: one instance for every test here, stopped when they are done (not at session end).
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as sw:
        yield sw


@pytest.fixture
def s3(seaweed: SeaweedFS):
    """A plain boto3 client, to look at the bucket behind the store's back."""
    client = boto3.client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        aws_access_key_id=seaweed.access_key,
        aws_secret_access_key=seaweed.secret_key,
        region_name=seaweed.region,
        config=Config(s3={"addressing_style": "path"}),
    )
    yield client
    client.close()


def new_bucket() -> str:
    return f"rsagg-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def make_store(seaweed: SeaweedFS, tmp_path: Path):
    stores: list[S3BlobStore] = []

    def make(**extra) -> S3BlobStore:
        settings = seaweed.settings(extra.pop("bucket", None) or new_bucket(), create_bucket=True, **extra)
        store = create_store(settings, tmp_path / f"local{len(stores)}")
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store) -> S3BlobStore:
    return make_store(prefix="blobs/")


class Requests:
    """Counts the S3 operations a store's client sends, and the HTTP status of each answer."""

    def __init__(self, store: S3BlobStore) -> None:
        self.calls: Counter[str] = Counter()
        self.statuses: list[tuple[str, int]] = []
        events = store._client.meta.events
        events.register("before-call.s3", self._before)
        events.register("needs-retry.s3", self._after)

    def _before(self, model, **kw) -> None:
        self.calls[model.name] += 1

    def _after(self, response, operation, **kw) -> None:
        if response is not None:
            self.statuses.append((operation.name, response[1]["ResponseMetadata"]["HTTPStatusCode"]))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def keys(s3, bucket: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", ())]


def finished(store: S3BlobStore, data: bytes):
    w = store.begin()
    w.write(data)
    w.finish()
    return w


# -- the FileBlobStore behaviours ---------------------------------------------------------------


def test_round_trip(store: S3BlobStore) -> None:
    data = b"hello, resourcesync\n" * 100
    info = store.put_bytes(data)
    assert info == BlobInfo(sha(data), len(data), {"sha-256": sha(data)})
    assert store.exists(info.sha256)
    assert store.size(info.sha256) == len(data)
    with store.open(info.sha256) as f:
        assert f.read() == data
        f.seek(7)
        assert f.read(5) == b"resou"
        assert f.seekable() and f.readable() and not f.writable()
        assert f.mode == "rb"
    assert store.local_path(info.sha256) is None
    assert list(store.iter_hashes()) == [info.sha256]
    assert temp_files(store) == []


def test_blobs_are_in_the_bucket_under_their_sha256_key(store: S3BlobStore, s3) -> None:
    blobs = [os.urandom(100) for _ in range(3)]
    for data in blobs:
        store.put_bytes(data)
    expected = sorted(f"blobs/{sha(d)[:2]}/{sha(d)[2:4]}/{sha(d)}" for d in blobs)
    assert keys(s3, store.bucket) == expected
    for data in blobs:
        key = f"blobs/{sha(data)[:2]}/{sha(data)[2:4]}/{sha(data)}"
        assert s3.get_object(Bucket=store.bucket, Key=key)["Body"].read() == data


def test_streamed_write_with_extra_algorithms(store: S3BlobStore) -> None:
    chunks = [os.urandom(1000) for _ in range(10)] + [b""]
    data = b"".join(chunks)
    w = store.begin(frozenset({"md5", "sha-1"}))
    for c in chunks:
        w.write(c)
    info = w.finish()
    assert info.hashes == {
        "sha-256": sha(data),
        "md5": hashlib.md5(data).hexdigest(),
        "sha-1": hashlib.sha1(data).hexdigest(),
    }
    store.commit([w])
    with store.open(info.sha256) as f:
        assert f.read() == data


def test_empty_blob(store: S3BlobStore) -> None:
    info = store.put_bytes(b"")
    assert info.sha256 == sha(b"") and info.length == 0
    assert store.size(info.sha256) == 0
    with store.open(info.sha256) as f:
        assert f.read() == b""


def test_blob_visible_only_after_commit(store: S3BlobStore) -> None:
    w = finished(store, b"not yet")
    assert not store.exists(w.info.sha256)
    with pytest.raises(FileNotFoundError):
        store.open(w.info.sha256)
    with pytest.raises(FileNotFoundError):
        store.size(w.info.sha256)
    assert list(store.iter_hashes()) == []
    assert temp_files(store) == [w.tmp_path.name]  # the bytes are only in the local temp file
    store.commit([w])
    assert store.exists(w.info.sha256)
    assert temp_files(store) == []
    assert w.state == "committed"


def test_dedup_same_content_twice(store: S3BlobStore, s3) -> None:
    first = store.put_bytes(b"same bytes")
    w = finished(store, b"same bytes")
    assert w.info == first
    requests = Requests(store)
    store.commit([w])
    assert not w.tmp_path.exists() and w.state == "committed"
    assert ("PutObject", 412) in requests.statuses  # refused by If-None-Match: already there
    assert requests.calls["PutObject"] == 1
    assert list(store.iter_hashes()) == [first.sha256]
    assert len(keys(s3, store.bucket)) == 1


def test_write_once_second_put_leaves_the_object_unchanged(store: S3BlobStore, s3) -> None:
    info = store.put_bytes(b"0123456789")
    key = store.key(info.sha256)
    # Someone else changes the object behind our back (same length): a write-once store never overwrites it.
    s3.put_object(Bucket=store.bucket, Key=key, Body=b"ABCDEFGHIJ")
    requests = Requests(store)
    assert store.put_bytes(b"0123456789") == info
    assert requests.statuses[0] == ("PutObject", 412)
    assert requests.calls["PutObject"] == 1
    assert s3.get_object(Bucket=store.bucket, Key=key)["Body"].read() == b"ABCDEFGHIJ"


def test_damaged_existing_blob_is_replaced(store: S3BlobStore, s3) -> None:
    info = store.put_bytes(b"0123456789")
    key = store.key(info.sha256)
    s3.put_object(Bucket=store.bucket, Key=key, Body=b"01234")  # truncated by some accident
    store.put_bytes(b"0123456789")
    assert s3.get_object(Bucket=store.bucket, Key=key)["Body"].read() == b"0123456789"


def test_dedup_within_one_batch(store: S3BlobStore) -> None:
    ws = [finished(store, data) for data in (b"a", b"b", b"a", b"a")]
    requests = Requests(store)
    store.commit(ws)
    assert requests.calls["PutObject"] == 2
    assert sorted(store.iter_hashes()) == sorted({sha(b"a"), sha(b"b")})
    assert all(w.state == "committed" for w in ws)
    assert temp_files(store) == []
    store.commit(ws)  # committing again is harmless
    assert requests.calls["PutObject"] == 2


def test_batch_is_uploaded_before_commit_returns(make_store) -> None:
    store = make_store(upload_threads=4)
    blobs = [os.urandom(2000) for _ in range(40)]
    ws = [finished(store, d) for d in blobs]
    store.commit(ws)
    assert list(store.iter_hashes()) == sorted(sha(d) for d in blobs)
    assert temp_files(store) == []
    for d in blobs[:5]:
        with store.open(sha(d)) as f:
            assert f.read() == d


def test_failed_upload_leaves_the_writer_finished_and_raises(store: S3BlobStore, monkeypatch) -> None:
    good, bad = finished(store, b"good"), finished(store, b"bad")
    real_put = store._client.put_object

    def put_object(**kw):
        if kw["Key"].endswith(bad.info.sha256):
            raise ClientError({"Error": {"Code": "InternalError", "Message": "disk on fire"}}, "PutObject")
        return real_put(**kw)

    monkeypatch.setattr(store._client, "put_object", put_object)
    with pytest.raises(S3StoreError, match="InternalError") as exc_info:
        store.commit([good, bad])
    assert store.endpoint_url in str(exc_info.value) and bad.info.sha256 in str(exc_info.value)
    assert good.state == "committed" and store.exists(good.info.sha256)
    assert bad.state == "finished" and bad.tmp_path.exists() and not store.exists(bad.info.sha256)
    monkeypatch.undo()
    store.commit([bad])  # a retry of the same batch succeeds
    assert store.exists(bad.info.sha256) and temp_files(store) == []


def test_checksum_mismatch_is_refused_by_the_store(store: S3BlobStore) -> None:
    w = finished(store, b"what we hashed")
    os.chmod(w.tmp_path, 0o600)
    w.tmp_path.write_bytes(b"what got on disk")  # the temp file changed after hashing
    with pytest.raises(S3StoreError, match="BadDigest"):
        store.commit([w])
    assert not store.exists(w.info.sha256)
    w.abort()


def test_writer_states(store: S3BlobStore) -> None:
    w = store.begin()
    w.write(b"abc")
    with pytest.raises(ValueError, match="commit of a open"):
        store.commit([w])
    w.abort()
    assert not w.tmp_path.exists()
    with pytest.raises(ValueError):
        store.commit([w])
    w2 = finished(store, b"abc")
    store.commit([w2])
    w2.abort()  # no-op once committed
    assert store.exists(w2.info.sha256)


def test_writer_context_manager_aborts_on_error(store: S3BlobStore) -> None:
    with pytest.raises(RuntimeError), store.begin() as w:
        w.write(b"partial")
        raise RuntimeError("download failed")
    assert w.state == "aborted"
    assert temp_files(store) == []


@pytest.mark.parametrize(
    "bad",
    ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "../" + "a" * 61, "a" * 62 + "/a", "a" * 64 + "\n", "", None],
)
def test_sha256_argument_is_validated(store: S3BlobStore, bad) -> None:
    for call in (store.exists, store.open, store.size, store.delete, store.local_path, store.key):
        with pytest.raises(ValueError):
            call(bad)


def test_delete_and_iter_hashes_sorted_over_several_pages(store: S3BlobStore, s3) -> None:
    infos = [store.put_bytes(bytes([i]) * 10) for i in range(30)]
    for foreign in ("blobs/README", "blobs/ab/zz/ab" + "0" * 62, "blobs/ab/cd/" + "f" * 64, "other/x"):
        s3.put_object(Bucket=store.bucket, Key=foreign, Body=b"not a blob")
    leftover = finished(store, b"in tmp")
    store.list_page_size = 7  # several ListObjectsV2 pages
    assert list(store.iter_hashes()) == sorted(i.sha256 for i in infos)
    store.delete(infos[0].sha256)
    store.delete(infos[0].sha256)  # already gone: fine
    assert not store.exists(infos[0].sha256)
    assert list(store.iter_hashes()) == sorted(i.sha256 for i in infos[1:])
    leftover.abort()


def test_out_of_order_listing_is_refused(store: S3BlobStore, monkeypatch) -> None:
    # gc merges iter_hashes with sorted state hashes: a store listing out of order must not go unnoticed.
    a, b = "a" * 64, "b" * 64
    now = datetime.now(UTC)
    pages = [
        {"Contents": [{"Key": store.prefix + f"{h[:2]}/{h[2:4]}/{h}", "LastModified": now} for h in (b, a)]}
    ]

    class Paginator:
        def paginate(self, **kw):
            return iter(pages)

    monkeypatch.setattr(store._client, "get_paginator", lambda name: Paginator())
    hashes = store.iter_hashes()
    assert next(hashes) == b
    with pytest.raises(S3StoreError, match="ascending"):
        next(hashes)


def test_empty_prefix_lists_only_blob_keys(make_store, s3) -> None:
    store = make_store()
    info = store.put_bytes(b"at the top")
    assert keys(s3, store.bucket) == [f"{info.sha256[:2]}/{info.sha256[2:4]}/{info.sha256}"]
    s3.put_object(Bucket=store.bucket, Key="zz-notes.txt", Body=b"x")
    assert list(store.iter_hashes()) == [info.sha256]


def test_satisfies_protocol(store: S3BlobStore) -> None:
    assert isinstance(store, BlobStore)


def test_a_blob_stored_again_is_refreshed_and_kept_by_gc(store: S3BlobStore, tmp_path: Path) -> None:
    """Dedup copies the object onto itself (a new LastModified, bytes and checksum intact); gc's age
    is that LastModified, checked again by ``delete(stored_before=)``."""
    kept, old = store.put_bytes(b"stored again"), store.put_bytes(b"never again")
    requests = Requests(store)
    assert store.put_bytes(b"stored again") == kept
    assert requests.calls["CopyObject"] == 1 and ("PutObject", 412) in requests.statuses
    with store.open(kept.sha256) as f:
        assert f.read() == b"stored again"  # read whole: checked against the stored checksum
    stored = dict(store.iter_stored())
    head = store._client.head_object(Bucket=store.bucket, Key=store.key(kept.sha256))
    assert stored[kept.sha256] == head["LastModified"].timestamp()
    assert store.delete(kept.sha256, stored_before=stored[kept.sha256]) is False  # not before: stays
    assert store.exists(kept.sha256)
    with State(tmp_path / "state.db") as st:  # the clock set just past one blob's grace period
        now = stored[old.sha256] + 3600 + 1
        if stored[kept.sha256] > stored[old.sha256]:  # LastModified has whole seconds
            assert collect_garbage(st, store, grace=3600, now=now) == Garbage(1, old.length, 1)
            assert store.exists(kept.sha256)
        else:
            assert collect_garbage(st, store, grace=3600, now=now) == Garbage(2, old.length + kept.length, 0)
    assert not store.exists(old.sha256)
    assert store.delete(old.sha256, stored_before=now) is False  # gone: nothing to delete


# -- reading -------------------------------------------------------------------------------------


def test_reader_seeks_with_ranged_gets(store: S3BlobStore) -> None:
    data = os.urandom(600_000)
    info = store.put_bytes(data)
    requests = Requests(store)
    with store.open(info.sha256) as f:
        assert f.seek(0, io.SEEK_END) == len(data)
        assert f.read() == b""
        f.seek(500_000)
        assert f.read(10) == data[500_000:500_010]
        assert f.tell() == 500_010
        f.seek(-10, io.SEEK_END)
        assert f.read() == data[-10:]
        f.seek(0)
        assert f.read() == data
    # One GET at open, then one ranged GET per position read from after a seek; no HEAD.
    assert requests.calls["GetObject"] == 4 and requests.calls["HeadObject"] == 0
    assert f.closed


def test_whole_read_is_checked_against_the_stored_checksum(store: S3BlobStore) -> None:
    info = store.put_bytes(b"checked on the way back")
    with store.open(info.sha256) as f:
        assert f.read(7) == b"checked"
        assert f.read() == b" on the way back"  # reading to the end validates: no error
    with store.open(info.sha256) as f:
        # What botocore would see if the bytes served were not the ones stored under that checksum.
        f.raw._body._expected = base64.b64encode(hashlib.sha256(b"something else").digest()).decode()
        with pytest.raises(S3StoreError, match="checksum"):
            f.read()


# -- multipart -----------------------------------------------------------------------------------


def test_multipart_upload_above_threshold(make_store, s3) -> None:
    store = make_store(multipart_threshold=1 * MiB, multipart_part_size=1 * MiB)
    assert store.part_size == MIN_PART_SIZE  # S3 refuses smaller parts: clamped
    data = os.urandom(2 * MIN_PART_SIZE + 12345)
    w = store.begin(frozenset({"md5"}))
    for i in range(0, len(data), 1 * MiB):
        w.write(data[i : i + MiB])
    info = w.finish()
    requests = Requests(store)
    store.commit([w])
    assert requests.calls["CreateMultipartUpload"] == 1
    assert requests.calls["UploadPart"] == 3
    assert requests.calls["CompleteMultipartUpload"] == 1
    assert requests.calls["PutObject"] == 0
    key = store.key(info.sha256)
    assert keys(s3, store.bucket) == [key]
    assert s3.head_object(Bucket=store.bucket, Key=key)["ContentLength"] == len(data)
    with store.open(info.sha256) as f:
        f.seek(MIN_PART_SIZE - 3)
        assert f.read(6) == data[MIN_PART_SIZE - 3 : MIN_PART_SIZE + 3]  # across a part boundary
        f.seek(0)
        assert hashlib.sha256(f.read()).hexdigest() == info.sha256
    # Committing the same big blob again uploads nothing.
    store.commit([finished(store, data)])
    assert requests.calls["CreateMultipartUpload"] == 1
    assert not s3.list_multipart_uploads(Bucket=store.bucket).get("Uploads")


def test_small_blobs_stay_single_put(make_store) -> None:
    store = make_store(multipart_threshold=1 * MiB)
    requests = Requests(store)
    store.put_bytes(os.urandom(1 * MiB))  # exactly the threshold: one PUT
    assert requests.calls["PutObject"] == 1 and requests.calls["CreateMultipartUpload"] == 0


def test_spooled_blobs_are_uploaded_from_memory(store: S3BlobStore) -> None:
    """``begin(spool=N)`` (what the harvester asks for): small bodies never touch the local disk."""
    small = b"small body\n" * 100
    writers = []
    for data in (small, small, b"other"):
        w = store.begin(frozenset({"md5"}), spool=64 * 1024)
        w.write(data[:10])
        w.write(data[10:])
        w.finish()
        writers.append(w)
    assert temp_files(store) == []
    requests = Requests(store)
    store.commit(writers)
    assert [w.state for w in writers] == ["committed"] * 3
    assert requests.calls["PutObject"] == 2  # the same content twice in one batch: uploaded once
    assert temp_files(store) == []
    with store.open(sha(small)) as f:
        assert f.read() == small
    assert writers[0].info.hashes["md5"] == hashlib.md5(small).hexdigest()
    # Over the spool limit: on to a temp file while writing, uploaded from it, then removed.
    big = os.urandom(100_000)
    w = store.begin(spool=64 * 1024)
    w.write(big[:60_000])
    assert temp_files(store) == []
    w.write(big[60_000:])
    assert len(temp_files(store)) == 1
    w.finish()
    store.commit([w])
    assert temp_files(store) == []
    assert store.size(sha(big)) == len(big)


def test_spooled_blob_above_the_multipart_threshold(make_store) -> None:
    store = make_store(multipart_threshold=1 * MiB, multipart_part_size=1 * MiB)
    data = os.urandom(MIN_PART_SIZE + 1000)
    w = store.begin(spool=2 * MIN_PART_SIZE)  # held in memory: a multipart upload needs a file
    w.write(data)
    w.finish()
    requests = Requests(store)
    store.commit([w])
    assert requests.calls["CreateMultipartUpload"] == 1 and requests.calls["UploadPart"] == 2
    assert temp_files(store) == []
    with store.open(sha(data)) as f:
        assert f.read() == data


# -- configuration and errors --------------------------------------------------------------------


def test_wrong_secret_key_is_a_clear_error_naming_the_endpoint(seaweed: SeaweedFS, tmp_path: Path) -> None:
    bucket = new_bucket()
    create_store(seaweed.settings(bucket, create_bucket=True), tmp_path / "ok").close()
    settings = seaweed.settings(bucket) | {"secret_key": "not-the-secret"}
    with pytest.raises(S3StoreError) as exc_info:
        create_store(settings, tmp_path / "bad")
    message = str(exc_info.value)
    assert seaweed.endpoint_url in message and bucket in message
    assert "403" in message and "secret_key" in message


def test_missing_bucket_without_create_bucket(seaweed: SeaweedFS, tmp_path: Path) -> None:
    bucket = new_bucket()
    with pytest.raises(S3StoreError, match=bucket):
        create_store(seaweed.settings(bucket), tmp_path)


def test_settings_are_checked(seaweed: SeaweedFS, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown setting.*colour"):
        create_store(seaweed.settings("x-bucket", colour="blue"), tmp_path)
    with pytest.raises(ValueError, match="multipart_threshold"):
        create_store(seaweed.settings("x-bucket", multipart_threshold="8M"), tmp_path)
    with pytest.raises(ValueError, match="bucket"):
        create_store(seaweed.settings(""), tmp_path)
    with pytest.raises(ValueError, match="secret_key"):
        create_store({"bucket": "x-bucket", "access_key": "a"}, tmp_path)


def test_stale_temp_files_are_cleaned_at_start(make_store, tmp_path: Path) -> None:
    store = make_store()
    live = finished(store, b"in progress")
    stale_dir = tmp_path / "other" / "tmp"
    stale_dir.mkdir(parents=True)
    (stale_dir / "blob-stale").write_bytes(b"x")
    second = S3BlobStore(bucket=store.bucket, tmp_dir=store.tmp, **_conn(store))  # shares a live folder
    assert live.tmp_path.exists()  # a live store's temp file is left alone
    second.close()
    store.commit([live])
    third = S3BlobStore(bucket=store.bucket, tmp_dir=stale_dir, **_conn(store))
    assert [p.name for p in stale_dir.iterdir()] == [".lock"]
    third.close()


def _conn(store: S3BlobStore) -> dict:
    creds = store._client._request_signer._credentials
    return {
        "endpoint_url": store.endpoint_url,
        "access_key": creds.access_key,
        "secret_key": creds.secret_key,
    }


# --- the harvester and republisher scenarios, unchanged, on the S3 backend --------------------------


SCENARIOS = [
    test_harvest.test_baseline_then_incremental_in_sync,
    test_harvest.test_resource_list_index_and_dump_baselines,
    test_harvest.test_mirrors_patches_and_retry_after,
    test_harvest.test_gap_is_recovered_by_a_fresh_baseline,
    test_publish.test_every_document_validates_and_indexes_appear,
    test_publish.test_change_list_windows_give_the_changelog_exactly,
    test_publish.test_link_policy_end_to_end,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
async def test_scenarios_pass_unchanged_on_s3(scenario, seaweed: SeaweedFS, s3, tmp_path: Path, monkeypatch):
    """Same assertions as on the filesystem; afterwards every blob the state names is in the bucket
    under its SHA-256 key."""
    bucket = new_bucket()
    settings = seaweed.settings(bucket, create_bucket=True, prefix="blobs/")
    monkeypatch.setattr(harvesting, "STORE", {"backend": "s3", "settings": settings})
    kwargs = {"monkeypatch": monkeypatch} if "monkeypatch" in scenario.__code__.co_varnames else {}
    await scenario(tmp_path, **kwargs)
    named = set()
    for db in tmp_path.rglob("state.db"):
        with sqlite3.connect(db) as conn:
            named |= {
                row[0]
                for row in conn.execute("SELECT lower(hex(sha256)) FROM resources WHERE sha256 IS NOT NULL")
            }
    assert named, "the scenario stored something"
    keys = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="blobs/"):
        keys |= {obj["Key"] for obj in page.get("Contents", [])}
    assert {f"blobs/{sha[:2]}/{sha[2:4]}/{sha}" for sha in named} <= keys
    assert not list((tmp_path).rglob("blobs/??/??/*")), "no blob on the local filesystem"
