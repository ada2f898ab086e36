"""Validate ResourceSync documents (files or URLs) against the specification.

Prints one line per problem, ``PATH:LINE: severity: rule: message``, and a summary per document; with
``--json`` one JSON object instead. Exit status: 0 without errors, 1 when any document has an error,
2 when a document could not be read or fetched. URLs are streamed into the validator, so a large list
is checked while it downloads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import __version__
from ._common import add_global_arguments

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    from ..rs.validate import Issue, Report

#: Connect and read timeouts (seconds) for fetching a document (httpx is imported only to fetch a URL).
TIMEOUT, CONNECT_TIMEOUT = 30.0, 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_global_arguments(p)  # accepted for uniformity; validate reads no configuration
    p.add_argument("documents", nargs="+", metavar="FILE_OR_URL", help="document path or http(s) URL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    p.add_argument(
        "--max-bytes", type=int, default=None, metavar="N", help="refuse documents larger than N bytes"
    )


class FetchError(Exception):
    """The document could not be obtained (network, HTTP status, file system)."""


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _fetch(url: str, max_bytes: int | None, on_issue: Callable[[Issue], None]) -> Report:
    import httpx

    from ..rs.validate import Checker

    checker = Checker(url, max_bytes=max_bytes)
    headers = {
        "User-Agent": f"rsagg/{__version__} (validate)",
        "Accept": "application/xml, text/xml;q=0.9, */*;q=0.1",
    }
    try:
        with httpx.stream(
            "GET",
            url,
            timeout=httpx.Timeout(TIMEOUT, connect=CONNECT_TIMEOUT),
            follow_redirects=True,
            headers=headers,
        ) as resp:
            if resp.status_code != 200:
                raise FetchError(f"HTTP {resp.status_code} {resp.reason_phrase}".strip())
            for chunk in resp.iter_bytes():
                for issue in checker.feed(chunk):
                    on_issue(issue)
                if checker.done:  # refused (e.g. too big): stop downloading
                    break
    except httpx.HTTPError as exc:
        raise FetchError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    for issue in checker.close():
        on_issue(issue)
    return checker.report


def _check(target: str, max_bytes: int | None, on_issue: Callable[[Issue], None]) -> Report:
    if _is_url(target):
        return _fetch(target, max_bytes, on_issue)
    try:
        from ..rs.validate import check_source

        return check_source(target, max_bytes=max_bytes, on_issue=on_issue)
    except OSError as exc:
        raise FetchError(exc.strerror or str(exc)) from None


def format_issue(source: str, issue: Issue) -> str:
    where = f"{source}:{issue.line}" if issue.line is not None else source
    return f"{where}: {issue.severity}: {issue.rule}: {issue.message}"


def _summary(report: Report) -> str:
    what = report.kind or "unknown document"
    verdict = "valid" if report.valid else "invalid"
    return (
        f"{report.source}: {what}, {report.entries} entries: {verdict} "
        f"({report.errors} error(s), {report.warnings} warning(s))"
    )


def run(args: argparse.Namespace) -> int:
    if args.max_bytes is not None and args.max_bytes <= 0:
        print("rsagg validate: --max-bytes must be positive", file=sys.stderr)
        return 2
    status = 0
    documents: list[dict] = []
    for target in args.documents:

        def show(issue: Issue, target: str = target) -> None:
            if not args.json:
                print(format_issue(target, issue))

        try:
            report = _check(target, args.max_bytes, show)
        except FetchError as exc:
            print(f"{target}: error: fetch: {exc}", file=sys.stderr)
            documents.append({"source": target, "kind": None, "entries": 0, "valid": False,
                              "error": str(exc), "issues": []})  # fmt: skip
            status = 2
            continue
        report.source = target
        if args.json:
            documents.append(report.as_dict())
        else:
            print(_summary(report))
        if not report.valid and status == 0:
            status = 1
    if args.json:
        print(json.dumps({"documents": documents}, indent=2))
    return status
