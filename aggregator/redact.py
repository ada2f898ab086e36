"""Scrubbing credentials out of text on its way to a log line or an error message.

What is scrubbed: credentials in headers (``Authorization``, AWS signatures, security tokens,
``Cookie``), passwords in URLs (``user:password@``), and the secret values rsagg itself read
(``add_secrets``: a source's tokens, the S3 keys of ``[store.settings]``, the hub publish token). The
log formatters (``observe/logs.py``) pass every line through ``redact``; whoever reads a secret
registers it here.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config

REDACTED = "[redacted]"


@functools.cache
def _patterns() -> tuple[re.Pattern[str], ...]:
    """What a credential looks like in a log line, whoever wrote it (the secret is group "s"): compiled
    on the first line scrubbed, not at start-up (a one-shot command that logs nothing never needs them)."""
    return (
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
            r"(?P<k>[a-z][a-z0-9+.-]*://[^/@\s:'\"]+)(?P<sep>:)(?!\*\*\*@)(?P<s>[^/@\s'\"]+)(?=@)",
            re.IGNORECASE,
        ),
        # An AWS access key id wherever it stands.
        re.compile(r"(?P<k>)(?P<sep>)(?P<s>\b(?:AKIA|ASIA)[A-Z0-9]{12,}\b)"),
    )


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
    for rx in _patterns():
        text = rx.sub(lambda m: f"{m['k']}{m['sep']}{REDACTED}", text)
    return text


__all__ = ["REDACTED", "add_secrets", "config_secrets", "redact", "secret_settings"]
