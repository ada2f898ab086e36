"""The shell blocks of docs/deploy.md, by name: the tests run them as the documentation shows them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "docs" / "deploy.md"
#: Where docs/deploy.md installs rsagg, and the command every unit's ExecStart= names.
RSAGG = "/opt/rsagg/bin/rsagg"


def block(name: str) -> list[str]:
    """The command lines of the ```sh block after the ``<!-- deploy:NAME`` marker (comments dropped)."""
    text = DEPLOY.read_text()
    m = re.search(rf"<!-- deploy:{re.escape(name)}\b[^\n]*-->\n```sh\n(.*?)\n```", text, re.S)
    assert m, f"docs/deploy.md has no block <!-- deploy:{name} -->"
    lines = [line for line in m.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines, f"docs/deploy.md: block {name} is empty"
    return lines
