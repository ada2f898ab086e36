"""No credential in any log line at any level (observe/logs.py): with ``--log-level debug``, botocore
(which logs every signed request it sends, the access key id and the signature in it) says nothing below
WARNING, and whatever a library or rsagg itself logs is scrubbed of credentials and of the secret values
rsagg read.

The S3 "server" is a plain HTTP server on 127.0.0.1 that accepts every PUT: enough for boto3 to sign and
send a real request (and for botocore to log it).
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from aggregator import redact as redaction
from aggregator.observe import logs

ACCESS_KEY = "AKIAZZTESTKEY0123456"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYsecretKEY"


class _S3(BaseHTTPRequestHandler):
    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("ETag", '"0"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _S3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in logs.QUIET_LOGGERS}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, lvl in levels.items():
            logging.getLogger(name).setLevel(lvl)


def _put(endpoint: str) -> None:
    """What the S3 blob store plugin does for a blob: a signed PUT."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )  # fmt: skip
    client.put_object(Bucket="b", Key="k", Body=b"blob")


def _leaks(text: str) -> list[str]:
    found = [s for s in (ACCESS_KEY, SECRET_KEY) if s in text]
    found += re.findall(r"Signature=[0-9a-f]{16,}", text)
    found += re.findall(r"AWS4-HMAC-SHA256 Credential=\w", text)
    return found


def test_botocore_logs_credentials_unless_tamed(s3_endpoint: str, restore_logging: None) -> None:
    """The premise, so that the next test can fail: botocore at DEBUG with a plain handler logs the access
    key id and the request's signature."""
    raw = io.StringIO()
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(raw)]
    root.setLevel(logging.DEBUG)
    for name in logs.QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    _put(s3_endpoint)
    assert ACCESS_KEY in raw.getvalue()
    assert _leaks(raw.getvalue())


@pytest.mark.slow  # about 2 s each: a whole harvest at debug level
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_debug_logging_leaks_no_credential(
    s3_endpoint: str, restore_logging: None, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    """``--log-level debug``: rsagg's own debug lines are there, no credential is, even when a plugin
    turns botocore's logger back to DEBUG (then the lines are scrubbed on their way out)."""
    logs.setup_logging("debug", fmt)
    redaction.add_secrets([SECRET_KEY, "source-token-0123456789"])
    log = logging.getLogger("rsagg.test")
    log.debug("rsagg debug line")
    _put(s3_endpoint)
    log.debug("sending Authorization: Bearer source-token-0123456789 to http://bob:pa55word@example.org/")
    log.error("S3 store failed with key %s and secret %s", ACCESS_KEY, SECRET_KEY)
    logging.getLogger("botocore").setLevel(logging.DEBUG)  # a plugin that wants botocore's debug
    _put(s3_endpoint)
    try:
        raise RuntimeError(f"headers {{'Authorization': b'AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/x'}}")
    except RuntimeError:
        log.exception("a traceback with a header in it")
    out = capsys.readouterr().err
    assert "rsagg debug line" in out
    assert "botocore" in out  # its (scrubbed) lines are there: the scrubbing was exercised
    assert _leaks(out) == []
    for secret in ("source-token-0123456789", "pa55word"):
        assert secret not in out
    assert redaction.REDACTED in out
    if fmt == "json":
        assert all(json.loads(line)["level"] for line in out.splitlines())


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("Authorization: Basic Ym9iOnNlY3JldA==", "Ym9iOnNlY3JldA=="),
        ("{'authorization': 'Bearer abcdefghijklmnop'}", "abcdefghijklmnop"),
        ("Proxy-Authorization: Digest x=y", "Digest x=y"),
        ('headers={"Cookie": "session=abcdef123456"}', "abcdef123456"),
        ("X-Amz-Security-Token: FQoGZXIvYXdzEJr", "FQoGZXIvYXdzEJr"),
        ("GET https://b.s3/k?X-Amz-Credential=AKIAXX%2F2026&X-Amz-Signature=deadbeef99", "deadbeef99"),
        ("aws_secret_access_key = 'wJalrXUtnFEMI'", "wJalrXUtnFEMI"),
        ("fetching ftp://alice:opensesame@host/x", "opensesame"),
        ("key ASIAABCDEFGHIJKLMNOP used", "ASIAABCDEFGHIJKLMNOP"),
        ("X-Hub-Signature: sha256=0123abcd", "sha256=0123abcd"),
    ],
)
def test_redact_table(line: str, secret: str) -> None:
    out = redaction.redact(line)
    assert secret not in out and redaction.REDACTED in out, out


def test_redact_keeps_ordinary_lines() -> None:
    for line in ("source=up synced 10 resources", "hub: subscribe for http://cb.example/x -> subscribed",
                 "a payload POST needs Authorization: Bearer <token>"[:26]):  # fmt: skip
        assert redaction.redact(line) == line


def test_secret_values_of_the_configuration_are_scrubbed() -> None:
    """``[store.settings]`` keys that look secret (the S3 plugin's ``secret_key``, ``access_key``) are
    registered by the composition and the serving workers (``config_secrets``): scrubbed wherever
    they appear, whatever logged them; ordinary settings are not."""
    from aggregator.config import parse_config

    config = parse_config(
        {
            "store": {
                "settings": {
                    "secret_key": "Zq8-not-an-aws-shape",
                    "access_key": "plainid42",
                    "bucket": "rsagg",
                }
            }
        }
    )
    assert sorted(redaction.config_secrets(config)) == ["Zq8-not-an-aws-shape", "plainid42"]
    redaction.add_secrets(redaction.config_secrets(config))
    out = redaction.redact("boto said key=plainid42 secret Zq8-not-an-aws-shape for bucket rsagg")
    assert "plainid42" not in out and "Zq8-not-an-aws-shape" not in out and "bucket rsagg" in out
