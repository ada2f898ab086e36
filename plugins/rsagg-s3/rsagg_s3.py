"""Blobs in an S3-compatible object store: the ``BlobStore`` protocol of ``aggregator.store.blobs`` on S3.

Why: a big aggregation outgrows one disk; an object store (AWS S3, SeaweedFS, MinIO, Ceph RGW ...)
gives capacity and durability elsewhere, while state (SQLite) stays local. Same content addressing as
``FileBlobStore``: the object key of a blob is ``<prefix><sha[0:2]>/<sha[2:4]>/<sha256>``.

Semantics mirrored from ``FileBlobStore``:

- ``begin`` returns an ordinary ``BlobWriter`` writing into a local temp file (``root/tmp``) while hashing
  (or a ``SpooledBlobWriter`` holding a small body in memory, when asked for ``spool``); the temp folder
  is the same ``TempArea`` as ``FileBlobStore``'s: stale files of a crashed process removed at start-up.
- ``commit`` uploads the batch concurrently (``upload_threads``) and returns only once S3 has
  acknowledged every object: S3's acknowledgement is the durability point, so docs/architecture.md invariant 2
  ("blob before state") holds. Objects are written once: ``If-None-Match: *``, and ``PreconditionFailed``
  means the blob is already stored (dedup, not an error). A stored object of the wrong size (damage, or
  a foreign writer) is overwritten, as ``FileBlobStore`` replaces a damaged file.
- Single PUTs carry ``x-amz-checksum-sha256`` (the SHA-256 we computed while writing), so the store
  itself refuses bytes that differ from the name; blobs above ``multipart_threshold`` go up as multipart
  uploads, streamed part by part from the temp file (parts of ``multipart_part_size``, at least the
  5 MiB S3 minimum), each part checksummed by botocore; the completion is conditional too.
- ``open`` returns a seekable, read-only, buffered reader over ranged GETs (``_RangeReader``): the GET
  is sent at open (FileNotFoundError when missing, size for ``SEEK_END``) and streamed while reading;
  a seek elsewhere drops it for a new ranged GET from there. Chosen over downloading to a spooled temp
  file because serving a Range of a big blob then costs that range, not the whole object, and a whole
  read costs one request. A whole read of a blob stored by a single PUT is checked by botocore against
  the SHA-256 checksum stored with it.
- ``iter_hashes`` lists keys in ascending order (S3 lists keys in UTF-8 binary order, and the fan-out
  prefix is derived from the hash, so key order is hash order); an out-of-order listing raises instead
  of feeding gc's sorted merge a wrong stream.
- ``iter_stored`` gives each blob's ``LastModified`` from the same listing; a commit that finds a blob
  stored already (dedup) copies the object onto itself, so that ``LastModified`` says it was stored again
  (``rsagg gc``'s grace period, ``commands/gc.py``); ``delete(stored_before=)`` checks it by a HEAD.
- ``local_path`` is None: callers stream from ``open``; ``url`` gives clients a presigned GET URL, or
  ``public_url`` + key for a public bucket (``server.offload = "redirect"``).

Errors from S3 other than "not found" raise ``S3StoreError`` (an ``OSError``) naming the endpoint, the
bucket and the key; a wrong access or secret key is detected when the store is created.

As an rsagg plugin (entry point ``s3`` in the ``rsagg`` group; ``pip install ./plugins/rsagg-s3``) it
registers the blob store backend ``s3`` (hook ``rsagg_blob_stores``); the settings are those of
``create_store``::

    [store]
    path = "/var/lib/rsagg"          # state.db, and root/tmp for blobs being written
    backend = "s3"

    [store.settings]
    endpoint_url = "http://127.0.0.1:8333"
    bucket = "rsagg-blobs"
    prefix = "blobs/"
    access_key = "..."
    secret_key = "..."
"""

from __future__ import annotations

import base64
import errno
import io
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit

from aggregator.plugin_api import (
    BlobInfo,
    BlobWriter,
    SpooledBlobWriter,
    TempArea,
    blob_name,
    check_sha256,
    hookimpl,
    pending_writers,
    put_bytes,
)

# boto3 (a dependency of this distribution) is imported by the first store made, not when rsagg loads
# the plugin: every rsagg command loads the plugins and most never make an S3 store, and importing boto3
# costs more than a one-shot command's whole start-up (aggregator/cli.py). Until then the names below
# are placeholders: no botocore error can be raised before a store (its client) exists.
_NOT_LOADED: Any = object()
boto3: Any = _NOT_LOADED  # None: not installed (the plugin loads but cannot create a store)
Config: Any = None


class BotoCoreError(Exception):  # replaced by botocore's by _load_boto3(); never raised before
    pass


class ClientError(Exception):  # replaced by botocore's by _load_boto3(); never raised before
    pass


def _load_boto3() -> bool:
    """Import boto3 and botocore's config and errors into this module once; False without boto3."""
    global boto3, Config, BotoCoreError, ClientError
    if boto3 is _NOT_LOADED:
        try:
            import boto3 as loaded
            from botocore.config import Config as config
            from botocore.exceptions import BotoCoreError as core_error
            from botocore.exceptions import ClientError as client_error
        except ImportError:  # pragma: no cover - exercised only where boto3 is not installed
            boto3 = None
        else:
            boto3, Config, BotoCoreError, ClientError = loaded, config, core_error, client_error
    return boto3 is not None


log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_MULTIPART_THRESHOLD = 8 * MiB
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last (SeaweedFS enforces it too)
MAX_PARTS = 10_000  # S3's maximum part count: the part size grows for huge blobs
MAX_COPY_BYTES = 5 * 1024 * MiB  # the largest object one CopyObject request may copy
DEFAULT_UPLOAD_THREADS = 8
READ_BUFFER = 256 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")

#: Settings understood by ``create_store`` (anything else is refused, like the rest of the config).
SETTINGS = frozenset(
    {
        "endpoint_url", "bucket", "prefix", "access_key", "secret_key", "region", "multipart_threshold",
        "multipart_part_size", "upload_threads", "create_bucket", "max_attempts", "connect_timeout",
        "read_timeout", "public_url",
    }
)  # fmt: skip
_AUTH_CODES = frozenset(
    {"403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken"}
)
_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})


class S3StoreError(OSError):
    """An S3 request failed; the message names the endpoint, bucket, key and S3's error code."""


class S3BlobStore:
    """Content-addressed blobs as write-once objects ``<prefix>ab/cd/<sha256>`` in one bucket.

    All methods block (boto3); async callers use ``trio.to_thread``. The boto3 client is thread-safe
    and shared by the upload threads and readers.
    """

    list_page_size = 1000  # keys per ListObjectsV2 request (S3's maximum)

    def __init__(
        self,
        *,
        bucket: str,
        tmp_dir: Path | str,
        endpoint_url: str | None = None,
        prefix: str = "",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_part_size: int = DEFAULT_PART_SIZE,
        upload_threads: int = DEFAULT_UPLOAD_THREADS,
        create_bucket: bool = False,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        public_url: str | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("S3 blob store: 'bucket' is required")
        if (access_key is None) != (secret_key is None):
            raise ValueError("S3 blob store: give both access_key and secret_key, or neither")
        if prefix.startswith("/"):
            raise ValueError(f"S3 blob store: prefix must not start with '/': {prefix!r}")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if multipart_threshold < 1:
            raise ValueError("S3 blob store: multipart_threshold must be positive")
        if public_url is not None:
            parts = urlsplit(public_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"S3 blob store: public_url is not an http(s) URL: {public_url!r}")
            if not public_url.endswith("/"):
                public_url += "/"
        #: Where clients read objects without signing (a public bucket, a CDN): ``public_url`` + key.
        self.public_url = public_url
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.multipart_threshold = multipart_threshold
        self.part_size = max(MIN_PART_SIZE, multipart_part_size)
        self._threads = max(1, upload_threads)
        self._where = f"S3 endpoint {endpoint_url or 'AWS default'}, bucket {bucket!r}"
        if not _load_boto3():  # made directly, not by create_store
            raise ValueError("S3 blob store: boto3 is not installed (pip install boto3)")
        self._client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
            config=Config(
                # SigV4 for presigned URLs too (botocore presigns with SigV2 otherwise, which S3 retired
                # and SeaweedFS refuses once a response-content-type is signed); at most 7 days.
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "max_attempts": max_attempts},
                max_pool_connections=max(10, 2 * self._threads),
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            ),
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.tmp = Path(tmp_dir)
        self._temp: TempArea | None = None
        try:
            self._check_bucket(create_bucket)
            self._temp = TempArea(self.tmp)
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------

    def _check_bucket(self, create: bool) -> None:
        """Fail fast (wrong keys, wrong endpoint, missing bucket) rather than at the first commit."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if _code(exc) not in _NOT_FOUND or not create:
                raise self._error(exc, "checking the bucket") from exc
        except BotoCoreError as exc:
            raise self._error(exc, "checking the bucket") from exc
        try:
            self._client.create_bucket(Bucket=self.bucket)
            log.info("created bucket %s at %s", self.bucket, self.endpoint_url)
        except ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error(exc, "creating the bucket") from exc

    def close(self) -> None:
        """Stop the upload threads, close the HTTP connections, release the temp folder lock."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._client.close()
        if self._temp is not None:
            self._temp.close()

    def __enter__(self) -> S3BlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names -----------------------------------------------------------------------------------

    def key(self, sha256: str) -> str:
        """The object key of a blob (the hash is validated: it becomes part of a URL path)."""
        check_sha256(sha256)
        return f"{self.prefix}{sha256[0:2]}/{sha256[2:4]}/{sha256}"

    def local_path(self, sha256: str) -> Path | None:
        check_sha256(sha256)
        return None

    def read_inline(self, sha256: str) -> bytes | None:
        check_sha256(sha256)
        return None  # every blob is an object of its own

    def blob_name(self, sha256: str) -> str:
        return blob_name(sha256)

    def url(self, sha256: str, lifetime: float, content_type: str | None = None) -> str | None:
        """``public_url`` + key when the bucket is public (never expires), else a presigned GET URL valid
        ``lifetime`` seconds that makes S3 answer with ``content_type`` (signed locally: no request)."""
        key = self.key(sha256)
        if self.public_url is not None:
            return self.public_url + quote(key)
        params = {"Bucket": self.bucket, "Key": key}
        if content_type:
            params["ResponseContentType"] = content_type
        try:
            return self._client.generate_presigned_url("get_object", Params=params, ExpiresIn=int(lifetime))
        except BotoCoreError as exc:  # no credentials to sign with
            raise self._error(exc, "presigning a GET", key) from exc

    def _error(self, exc: Exception, doing: str, key: str | None = None) -> S3StoreError:
        where = self._where + (f", key {key!r}" if key else "")
        if isinstance(exc, ClientError):
            code = _code(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = exc.response.get("Error", {}).get("Message") or ""
            hint = (
                " (check access_key/secret_key and the bucket's permissions)" if code in _AUTH_CODES else ""
            )
            http = "" if code == str(status) else f" (HTTP {status})"
            if code in _NOT_FOUND and doing == "checking the bucket":
                hint = " (no such bucket: create it, or set create_bucket = true)"
            text = f"{where}: {doing} failed: {code}{http} {message}{hint}".rstrip()
            return S3StoreError(errno.EACCES if code in _AUTH_CODES else errno.EIO, text)
        return S3StoreError(errno.EIO, f"{where}: {doing} failed: {exc}")

    # -- writing ---------------------------------------------------------------------------------

    def begin(self, algorithms: frozenset[str] = frozenset(), *, spool: int = 0) -> BlobWriter:
        """Start a blob; ``algorithms`` are extra hash tokens ("md5", "sha-1").

        ``spool``: keep up to that many bytes in memory and upload them from there (no temp file at
        all); bigger blobs go to a private temp file. The caller bounds how many are alive at once.
        """
        assert self._temp is not None
        return self._temp.begin(algorithms, spool)

    def put_bytes(self, data: bytes) -> BlobInfo:
        return put_bytes(self, data)

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        """Upload every finished writer's blob; return once S3 acknowledged all of them.

        Uploads run concurrently; when one fails, the others still complete (or fail) before the first
        error is raised, and the failed writers stay "finished" (temp file kept: commit again or abort).
        The same content twice in one batch is uploaded once.
        """
        todo, first = pending_writers(writers)
        if not todo:
            return
        uploads = list(first.values())
        if len(uploads) == 1 or self._threads == 1:
            results = [_capture(self._upload, w) for w in uploads]
        else:
            results = list(self._executor().map(lambda w: _capture(self._upload, w), uploads))
        failed = {w.info.sha256: exc for w, exc in zip(uploads, results, strict=True) if exc is not None}
        for w, info in todo:
            if info.sha256 not in failed:
                if w.tmp_path is not None:
                    w.tmp_path.unlink(missing_ok=True)
                w._committed()
        if failed:
            raise next(iter(failed.values()))

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="s3-upload")
            return self._pool

    def _upload(self, w: BlobWriter) -> None:
        info = w.info
        assert info is not None
        key = self.key(info.sha256)
        held = w.held() if isinstance(w, SpooledBlobWriter) else None
        if held is not None and info.length > self.multipart_threshold:  # a tiny threshold: via a file
            assert self._temp is not None
            w._write_temp(self._temp.next_name())
            held = None
        source: Path | bytes = held if held is not None else w.tmp_path  # type: ignore[assignment]
        if info.length > self.multipart_threshold:
            stored = self._head_length(key)  # skip sending a big blob that is already there
            if stored == info.length:
                if self._touch(key, stored):
                    return
                stored = None  # removed (gc) since the HEAD: store it anew
            if stored is not None:
                log.warning("%s: object %s has %d bytes, expected %d: replacing it",
                            self._where, key, stored, info.length)  # fmt: skip
            self._multipart(w.tmp_path, key, info, write_once=stored is None)  # type: ignore[arg-type]
            return
        checksum = base64.b64encode(bytes.fromhex(info.sha256)).decode("ascii")
        if self._put(source, key, checksum, write_once=True):
            return
        stored = self._head_length(key)  # there already: dedup, unless it is damaged
        if stored == info.length and self._touch(key, stored):
            return
        if stored is not None and stored != info.length:
            log.warning("%s: object %s has %s bytes, expected %d: replacing it",
                        self._where, key, stored, info.length)  # fmt: skip
        self._put(source, key, checksum, write_once=False)  # damaged, or removed (gc) meanwhile

    def _touch(self, key: str, size: int) -> bool:
        """Give an object a new ``LastModified`` (copied onto itself), as a blob stored again (dedup) that
        the caller is about to name: gc's grace period starts again. False when it is gone (gc).

        S3 copies an object onto itself only with something changed: its metadata, replaced by the same.
        The copy gets a new whole-object SHA-256 checksum (S3 computes it: the same as a single PUT's).
        """
        source = {"Bucket": self.bucket, "Key": key}
        extra = {"MetadataDirective": "REPLACE", "ContentType": "application/octet-stream"}
        try:
            if size <= MAX_COPY_BYTES:
                self._client.copy_object(
                    Bucket=self.bucket, Key=key, CopySource=source, ChecksumAlgorithm="SHA256", **extra
                )
            else:  # CopyObject's limit: a multipart copy (boto3's managed transfer)
                self._client.copy(source, self.bucket, key, ExtraArgs=extra)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise self._error(exc, "refreshing a blob", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "refreshing a blob", key) from exc
        return True

    def _put(self, source: Path | bytes, key: str, checksum: str, *, write_once: bool) -> bool:
        """One PUT from the temp file or from memory; False when ``write_once`` and the key exists."""
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if write_once else {}
        try:
            with io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb") as body:
                self._client.put_object(
                    Bucket=self.bucket, Key=key, Body=body, ChecksumSHA256=checksum,
                    ContentType="application/octet-stream", **extra,
                )  # fmt: skip
        except ClientError as exc:
            if write_once and _code(exc) == "PreconditionFailed":
                return False
            raise self._error(exc, "uploading a blob", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "uploading a blob", key) from exc
        return True

    def _multipart(self, path: Path, key: str, info: BlobInfo, *, write_once: bool) -> None:
        size = info.length
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        try:
            upload_id = self._client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ContentType="application/octet-stream"
            )["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "starting a multipart upload", key) from exc
        try:
            parts = []
            with open(path, "rb") as f:
                for number, offset in enumerate(range(0, size, part_size), start=1):
                    body = _FileSlice(f, offset, min(part_size, size - offset))
                    r = self._client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                    )
                    parts.append({"PartNumber": number, "ETag": r["ETag"]})
            extra: dict[str, Any] = {"IfNoneMatch": "*"} if write_once else {}
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **extra
            )
        except BaseException as exc:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except (ClientError, BotoCoreError) as abort_exc:
                log.warning("%s: cannot abort multipart upload of %s: %s", self._where, key, abort_exc)
            if isinstance(exc, ClientError) and write_once and _code(exc) == "PreconditionFailed":
                return  # stored meanwhile by someone else: dedup
            if isinstance(exc, ClientError | BotoCoreError):
                raise self._error(exc, "multipart upload", key) from exc
            raise
        # Multipart objects carry no whole-object SHA-256 checksum: check at least the size S3 stored.
        stored = self._head_length(key)
        if stored != size:
            raise S3StoreError(
                errno.EIO, f"{self._where}: {key} has {stored} bytes after upload, sent {size}"
            )

    # -- reading ---------------------------------------------------------------------------------

    def _head_length(self, key: str) -> int | None:
        """ContentLength of the object, or None when there is none."""
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return None
            raise self._error(exc, "looking up a blob", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "looking up a blob", key) from exc

    def exists(self, sha256: str) -> bool:
        return self._head_length(self.key(sha256)) is not None

    def size(self, sha256: str) -> int:
        key = self.key(sha256)
        length = self._head_length(key)
        if length is None:
            raise FileNotFoundError(errno.ENOENT, "no such blob", f"s3://{self.bucket}/{key}")
        return length

    def open(self, sha256: str) -> BinaryIO:
        """A seekable read-only buffered reader; FileNotFoundError when the blob is not stored.

        The GET is sent here (its answer says whether the blob exists and how big it is), so reading a
        blob whole costs one request; a seek elsewhere drops that stream for a ranged GET.
        """
        key = self.key(sha256)
        response = self._get(key, 0)
        raw = _RangeReader(self, key, int(response["ContentLength"]), response["Body"])
        return io.BufferedReader(raw, buffer_size=READ_BUFFER)  # type: ignore[return-value]

    def delete(self, sha256: str, stored_before: float | None = None) -> bool:
        """Remove a blob; deleting one that is not there is not an error (gc may run twice).

        ``stored_before``: only if its ``LastModified`` (refreshed on dedup, ``_touch``) is before then,
        read by a HEAD just before the DELETE. S3 has no delete conditional on the date, so a commit
        refreshing the object between those two requests (milliseconds) is not seen; the filesystem
        store closes that window. True when the blob went (S3 does not say whether an unconditional
        DELETE found the object: True).
        """
        key = self.key(sha256)
        if stored_before is not None:
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _code(exc) in _NOT_FOUND:
                    return False
                raise self._error(exc, "looking up a blob", key) from exc
            except BotoCoreError as exc:
                raise self._error(exc, "looking up a blob", key) from exc
            if head["LastModified"].timestamp() >= stored_before:
                return False
        try:
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) not in _NOT_FOUND:
                raise self._error(exc, "deleting a blob", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "deleting a blob", key) from exc
        return True

    def iter_hashes(self) -> Iterator[str]:
        """Every stored blob's SHA-256 in ascending order (keys not shaped like blobs are skipped)."""
        return (sha for sha, _ in self.iter_stored())

    def iter_stored(self) -> Iterator[tuple[str, float]]:
        """Every stored blob's SHA-256 and ``LastModified`` (UNIX time, S3's clock; in the listing,
        free), ascending."""
        paginator = self._client.get_paginator("list_objects_v2")
        n = len(self.prefix)
        previous = ""
        try:
            pages = paginator.paginate(
                Bucket=self.bucket, Prefix=self.prefix, PaginationConfig={"PageSize": self.list_page_size}
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    key: str = obj["Key"]
                    rest = key[n:]
                    sha = rest[6:]
                    if len(rest) != 70 or rest[2] != "/" or rest[5] != "/" or not _SHA256.match(sha):
                        continue
                    if rest[0:2] != sha[0:2] or rest[3:5] != sha[2:4]:
                        continue
                    if sha <= previous:
                        raise S3StoreError(
                            errno.EIO, f"{self._where}: listing not in ascending key order at {key!r}"
                        )
                    previous = sha
                    yield sha, obj["LastModified"].timestamp()
        except ClientError as exc:
            raise self._error(exc, "listing blobs") from exc
        except BotoCoreError as exc:
            raise self._error(exc, "listing blobs") from exc

    def _get(self, key: str, start: int) -> dict[str, Any]:
        """A streamed GET of ``key`` from byte ``start`` (0, or a position before the end)."""
        try:
            kw = {"Range": f"bytes={start}-"} if start else {}
            return self._client.get_object(Bucket=self.bucket, Key=key, **kw)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                raise FileNotFoundError(errno.ENOENT, "no such blob", f"s3://{self.bucket}/{key}") from exc
            raise self._error(exc, "reading a blob", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "reading a blob", key) from exc


class _RangeReader(io.RawIOBase):
    """Raw, seekable reader of one object: one streamed GET, a new ranged GET after each real seek."""

    mode = "rb"

    def __init__(self, store: S3BlobStore, key: str, size: int, body: Any) -> None:
        super().__init__()
        self.name = f"s3://{store.bucket}/{key}"
        self._store = store
        self._key = key
        self._size = size
        self._pos = 0
        self._body: Any = body  # botocore StreamingBody positioned at self._pos, or None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        if pos != self._pos:
            self._drop_body()
            self._pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("read of a closed blob reader")
        want = min(len(b), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._read(want)
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        chunks = []
        while self._pos < self._size:
            chunks.append(self._read(min(self._size - self._pos, 8 * MiB)))
        return b"".join(chunks)

    def _read(self, n: int) -> bytes:
        """Up to ``n`` (> 0) bytes from the current stream, opening one at ``_pos`` when needed."""
        if self._body is None:
            self._body = self._store._get(self._key, self._pos)["Body"]
        try:
            data = self._body.read(n)
            if not data:
                raise OSError(errno.EIO, f"{self.name}: stream ended at {self._pos} of {self._size} bytes")
            self._pos += len(data)
            if self._pos >= self._size:
                # One more read at the end makes botocore check the length and, for a GET of the whole
                # object, the x-amz-checksum-sha256 stored with it: a whole read is verified end to end.
                if self._body.read(1):
                    raise OSError(errno.EIO, f"{self.name}: longer than its {self._size} bytes")
                self._drop_body()
        except BotoCoreError as exc:
            self._drop_body()
            raise self._store._error(exc, "reading a blob", self._key) from exc
        return data

    def _drop_body(self) -> None:
        if self._body is not None:
            body, self._body = self._body, None
            body.close()

    def close(self) -> None:
        if not self.closed:
            self._drop_body()
        super().close()


class _FileSlice(io.RawIOBase):
    """``length`` bytes of an open file from ``offset``: a part body streamed from the temp file.

    botocore reads it (to checksum, then to send) and seeks back, so it needs tell/seek relative to the
    slice; reads use ``os.pread`` so slices of one file never disturb each other's position.
    """

    def __init__(self, f: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._fd = f.fileno()
        self._offset = offset
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def read(self, size: int = -1) -> bytes:
        left = self._length - self._pos
        if size is None or size < 0 or size > left:
            size = left
        if size <= 0:
            return b""
        data = os.pread(self._fd, size, self._offset + self._pos)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)

    def __len__(self) -> int:
        return self._length


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _capture(fn: Any, *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def create_store(settings: Mapping[str, Any], root: Path) -> S3BlobStore:
    """The S3 blob store described by ``settings``; ``root`` is a local folder for temp files (root/tmp).

    Settings: ``bucket`` (required), ``endpoint_url`` (omit for AWS), ``prefix`` ("" by default; a "/"
    is appended when missing), ``access_key`` + ``secret_key`` (omit both for boto3's default credential
    chain), ``region`` ("us-east-1"), ``multipart_threshold`` (bytes, 8 MiB), ``multipart_part_size``
    (bytes, 8 MiB, at least 5 MiB), ``upload_threads`` (8), ``create_bucket`` (false),
    ``max_attempts`` (5, botocore "standard" retries), ``connect_timeout`` / ``read_timeout`` (seconds),
    ``public_url`` (the bucket's URL as clients reach it without signing, e.g.
    ``https://cdn.example/blobs/``: redirects then point there instead of to presigned URLs).
    """
    if not _load_boto3():
        raise ValueError("S3 blob store: boto3 is not installed (pip install boto3)")
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise ValueError(f"S3 blob store: unknown setting(s) {', '.join(unknown)}")
    if not settings.get("bucket"):
        raise ValueError('S3 blob store: the setting bucket is required ([store.settings] bucket = "...")')
    kwargs = dict(settings)
    for name in ("multipart_threshold", "multipart_part_size", "upload_threads", "max_attempts"):
        if name in kwargs and (not isinstance(kwargs[name], int) or isinstance(kwargs[name], bool)):
            raise ValueError(f"S3 blob store: {name} must be an integer, not {kwargs[name]!r}")
    if "create_bucket" in kwargs and not isinstance(kwargs["create_bucket"], bool):
        raise ValueError("S3 blob store: create_bucket must be true or false")
    return S3BlobStore(tmp_dir=Path(root) / "tmp", **kwargs)


@hookimpl
def rsagg_blob_stores():
    """``[store] backend = "s3"``, with the settings above in ``[store.settings]``."""
    return {"s3": create_store}
