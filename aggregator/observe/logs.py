"""Logging to stderr, one line per event (journald adds its own timestamps), text or JSON.

No credential reaches a log line, at any level (docs/security.md "Logs"): libraries that log what they
send (botocore's signed requests with the access key id and signature, urllib3, httpcore, hpack) are
held at WARNING even with ``--log-level debug`` (rsagg's debug is rsagg's), and every line, whichever
logger wrote it, is scrubbed on its way out by ``aggregator/redact.py``.
"""

from __future__ import annotations

import json
import logging
import sys

from ..errors import environmental_leaf, operator_line

# Re-exported: run/compose.py and run/workers.py import them from here (their home is redact.py).
from ..redact import redact

#: Libraries whose DEBUG (or INFO) output holds request headers or whole requests: kept at WARNING.
#: httpx logs every request at INFO (too chatty for a harvester fetching millions of resources).
QUIET_LOGGERS = (
    "httpx", "httpcore", "h11", "h2", "hpack", "urllib3", "botocore", "boto3", "s3transfer", "aiobotocore",
)  # fmt: skip


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
