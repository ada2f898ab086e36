"""Logging to stderr, one line per event (journald adds its own timestamps), text or JSON."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class OneLineFormatter(logging.Formatter):
    """The text format, each event on one line: a driver's message that spans lines (libpq's "connection
    refused\n\tIs the server running...") is joined; a traceback (a bug, never an operator's mistake)
    stays as Python prints it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        return " ".join(text.split()) if "\n" in text else text


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: too chatty for a harvester fetching millions of resources.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # psycopg's pool warns at every reconnection attempt while the state's server is away; rsagg says
    # the outage itself, once per sync that meets it, with the server's own reason (store/postgres.py).
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
