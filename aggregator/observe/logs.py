"""Logging to stderr, one line per event (journald adds its own timestamps), text or JSON.

No credential reaches a log line, at any level (docs/security.md "Logs"): libraries that log what they
send (botocore's signed requests with the access key id and signature, urllib3, httpcore, hpack) are
held at WARNING even with ``--log-level debug`` (rsagg's debug is rsagg's), and every line, whichever
logger wrote it, is scrubbed on its way out: credentials in headers (``Authorization``, AWS signatures,
security tokens, ``Cookie``), passwords in URLs (``user:password@``), and the secret values rsagg itself
read (``add_secrets``: a source's tokens, the S3 keys of ``[store.settings]``, the hub publish token).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import environmental_leaf, operator_line

if TYPE_CHECKING:
    from ..config import Config

#: Libraries whose DEBUG (or INFO) output holds request headers or whole requests: kept at WARNING.
#: httpx logs every request at INFO (too chatty for a harvester fetching millions of resources).
QUIET_LOGGERS = (
    "httpx", "httpcore", "h11", "h2", "hpack", "urllib3", "botocore", "boto3", "s3transfer", "aiobotocore",
)  # fmt: skip

REDACTED = "[redacted]"
#: What a credential looks like in a log line, whoever wrote it (the secret is group "s").
_PATTERNS = [
    # A header in any spelling: "Authorization: Bearer x", "'Authorization': b'AWS4-HMAC-SHA256 ...'",
    # "authorization=...": everything up to the end of the quoted value or of the line.
    re.compile(
        r"""(?i)(?P<k>\b(?:proxy-)?authorization|\bx-amz-security-token|\bx-api-key|\bcookie|\bset-cookie"""
        r"""|\bx-hub-signature(?:-256)?)(?P<sep>['"]?\s*[:=]\s*(?:b(?=['"]))?['"]?)"""
        r"""(?P<s>[^'"\r\n]+)"""
    ),
    # AWS signature version 4 pieces, also in query strings (presigned URLs).
    re.compile(
        r"(?i)(?P<k>\bcredential|\bx-amz-credential|\bsignature|\bx-amz-signature)(?P<sep>=)(?P<s>[^&,\s'\"]+)"
    ),
    re.compile(
        r"(?i)(?P<k>\b(?:aws_)?(?:secret_access_key|secret_key|access_key_id|session_token))"
        r"(?P<sep>['\"]?\s*[:=]\s*['\"]?)(?P<s>[^'\",\s}]+)"
    ),
    re.compile(r"(?i)(?P<k>\bbearer)(?P<sep>\s+)(?P<s>[A-Za-z0-9._~+/=-]{8,})"),
    # user:password@ in a URL (not one rsagg already shows as ``***``, store.state's way).
    re.compile(
        r"(?P<k>[a-z][a-z0-9+.-]*://[^/@\s:'\"]+)(?P<sep>:)(?!\*\*\*@)(?P<s>[^/@\s'\"]+)(?=@)", re.IGNORECASE
    ),
    # An AWS access key id wherever it stands.
    re.compile(r"(?P<k>)(?P<sep>)(?P<s>\b(?:AKIA|ASIA)[A-Z0-9]{12,}\b)"),
]
_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_secrets_re: re.Pattern[str] | None = None


def add_secrets(values: Iterable[Any]) -> None:
    """Secret values rsagg read (tokens, keys, passwords): scrubbed from every log line from now on.
    Short values (under 6 characters) are not: they would blank out ordinary words."""
    global _secrets_re
    new = {v for v in values if isinstance(v, str) and len(v) >= 6}
    with _secrets_lock:
        if new <= _secrets:
            return
        _secrets.update(new)
        ordered = sorted(_secrets, key=len, reverse=True)
        _secrets_re = re.compile("|".join(re.escape(v) for v in ordered))


#: Keys of ``[store.settings]`` (and plugin tables) whose values are secrets.
_SECRET_KEY = re.compile(r"(?i)secret|password|passwd|token|credential|access_key|api_key|private")


def secret_settings(table: Mapping[str, Any]) -> list[str]:
    """The values of secret-looking keys in a settings table (nested tables too), for ``add_secrets``."""
    out: list[str] = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            out += secret_settings(value)
        elif isinstance(value, str) and _SECRET_KEY.search(str(key)):
            out.append(value)
    return out


def config_secrets(config: Config) -> list[str]:
    """The secret values a configuration holds itself (not the ``env:``/``file:`` references, read
    where they are used): secret-looking keys of ``[store.settings]`` and of the plugin tables."""
    return secret_settings(config.store.settings) + secret_settings(config.plugins)


def redact(text: str) -> str:
    """``text`` with every credential it holds replaced by ``[redacted]``."""
    pattern = _secrets_re
    if pattern is not None:
        text = pattern.sub(REDACTED, text)
    for rx in _PATTERNS:
        text = rx.sub(lambda m: f"{m['k']}{m['sep']}{REDACTED}", text)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line (message, arguments, traceback) is ``redact``-ed."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        line = _machine_failure(record)
        if line is not None:
            out["message"] += f": {redact(line)}"
        elif record.exc_info:
            out["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


def _machine_failure(record: logging.LogRecord) -> str | None:
    """The one line of a machine failure (errors.operator_line) a record logs with its traceback
    (``log.exception`` in a loop that survives it: the notifier, the hub, the dump schedule), else None:
    a full disk is said in one line wherever it is met, a bug keeps its traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    leaf = environmental_leaf(exc) if exc is not None else None
    return operator_line(leaf) if leaf is not None else None


class OneLineFormatter(logging.Formatter):
    """The text format, each event on one line: a driver's message that spans lines (libpq's "connection
    refused\n\tIs the server running...") is joined; a traceback (a bug, never an operator's mistake)
    stays as Python prints it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        return " ".join(text.split()) if "\n" in text else text

    def format(self, record: logging.LogRecord) -> str:
        line = _machine_failure(record)
        if line is None:
            return super().format(record)
        record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        record.msg, record.args = f"{record.getMessage()}: {line}", None
        return super().format(record)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Log to stderr at ``level``; libraries that log credentials stay at WARNING (module docstring)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())  # redacts its fields itself
    else:
        text = OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        handler.setFormatter(RedactingFormatter(text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    # psycopg's pool warns at every reconnection attempt while the state's server is away; rsagg says
    # the outage itself, once per sync that meets it, with the server's own reason (store/postgres.py).
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
