"""Resource List entries written straight from state rows: the bytes ``resource_entry`` + ``rs.write`` give.

A Resource List of a million entries is mostly rows without links or extras, whose entry is always
the same shape (§10.1, §14.8)::

    <url><loc>OUR URI</loc><lastmod>UPDATED</lastmod><rs:md hash=".." length=".." type=".."/>
    <rs:ln rel="via" href="UPSTREAM URI" modified=".." hash=".." length=".." type=".."/></url>

(on one line). Building a ``Resource``, an ``Entry``, its ``Md`` and ``Link`` and calling the link policy
per row cost five times what writing that line does, so for such rows (``StateStore.iter_live_listing``
gives them as tuples) the line is written here from the row's values: the times copied from their
stored text, the URI mapped without ``quote`` when it needs no escape, one escape check per value.
Everything else (a row with links or extras, a value to escape, an unusual time) goes through the
ordinary writer. Used only when the link policy is the built-in one (a plugin's could say anything);
with a publish filter plugin every row is a ``Resource`` for the filter, and the plain ones are still
written here. ``tests/test_listing.py`` holds both writers to the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar, cast

from ..rs.write import _dt, _esc, _special
from ..store.interface import ListingRow, StateStore
from ..store.rows import Resource, parse_dt
from ..store.sets import PublishedSet
from .links import LinkPolicy, PluginLinks
from .uris import _SCHEME, RESOURCES, SAFE, rsagg_path
from .versions import stamp, stamp_text

T = TypeVar("T")
#: Lines joined into one string before they go on (about 50 KB).
_BATCH = 128
#: Attribute text per distinct type/encoding value (a list has few), bounded.
_ATTR_CACHE = 1024


def _text_time(text: str) -> str:
    """A stored time as ``rs.write`` prints it (``_dt(parse_dt(text))``), from the text when it is
    the fixed form ``YYYY-MM-DDThh:mm:ss.ffffffZ``."""
    if len(text) == 27 and text[26] == "Z" and text[19] == ".":
        t = text[:26].rstrip("0")
        return (t[:-1] if t[-1] == "." else t) + "Z"
    dt = parse_dt(text)
    assert dt is not None
    return _dt(dt)


def _value(v: str) -> str:
    return v if _special(v) is None else _esc(v)


class ListingWriter:
    """Entry lines of one published set's Resource List (see the module docstring)."""

    def __init__(self, base_url: str, set_name: str) -> None:
        prefix = f"{base_url}/{set_name}/{RESOURCES}/"
        #: ``<url><loc>`` and our URI up to the mapped upstream URI, escaped once.
        self.head = f"<url><loc>{_value(prefix)}"
        # §14.6 (publish/versions.py): the memento of the row's version, its TimeGate and TimeMap.
        self.memento = f'<rs:ln rel="memento" href="{_value(f"{base_url}/{set_name}/memento/")}'
        self.timegate = f'<rs:ln rel="timegate" href="{_value(f"{base_url}/{set_name}/timegate/")}'
        self.timemap = f'<rs:ln rel="timemap" href="{_value(f"{base_url}/{set_name}/timemap/")}'
        self._types: dict[str | None, str] = {None: ""}
        self._encodings: dict[str | None, str] = {None: ""}

    def _type_attr(self, v: str) -> str:
        if len(self._types) >= _ATTR_CACHE:
            self._types = {None: ""}
        a = self._types[v] = f' type="{_value(v)}"'
        return a

    def _encoding_attr(self, v: str) -> str:
        if len(self._encodings) >= _ATTR_CACHE:
            self._encodings = {None: ""}
        a = self._encodings[v] = f' encoding="{_value(v)}"'
        return a

    def line(
        self,
        uri: str,
        sha256: str | None,
        length: int | None,
        type_: str | None,
        encoding: str | None,
        md5: str | None,
        sha1: str | None,
        modified: str | None,
        updated: str,
        stamp: str | None = None,
    ) -> str:
        """The entry of a row without links or extras; times already as ``rs.write`` prints them.
        Raises ValueError (as the writer does) for a value XML cannot hold. ``stamp``: the memento's
        (``versions.stamp``), else made from ``updated``."""
        if stamp is None:
            stamp = stamp_text(updated)
        if md5 is None and sha1 is None:
            h = "" if sha256 is None else f' hash="sha-256:{_value(sha256)}"'
        else:  # format_hash's order
            pairs = (("sha-256", sha256), ("sha-1", sha1), ("md5", md5))
            h = f' hash="{_value(" ".join(f"{a}:{d}" for a, d in pairs if d is not None))}"'
        lt = "" if length is None else f' length="{length}"'
        t = self._types.get(type_)
        if t is None:
            t = self._type_attr(type_)  # type: ignore[arg-type]
        lt += t
        e = self._encodings.get(encoding)
        if e is None:
            e = self._encoding_attr(encoding)  # type: ignore[arg-type]
        mod = "" if modified is None else f' modified="{modified}"'
        try:
            if _special(uri) is None:
                href = uri
                scheme, sep, rest = uri.partition("://")
                path = f"{scheme}/{rest}" if sep and _plain(scheme, rest) else rsagg_path(uri)
            else:
                href = _esc(uri)
                path = _value(rsagg_path(uri))
        except ValueError as exc:
            raise ValueError(f"entry for {uri!r}: {exc}") from None
        return (
            f"{self.head}{path}</loc><lastmod>{updated}</lastmod><rs:md{h}{lt}{e}/>"
            f'<rs:ln rel="via" href="{href}"{mod}{h}{lt}/>'
            f"{self.versions(path, stamp, updated, h + lt)}</url>\n"
        )

    def versions(self, path: str, stamp: str, when: str, attrs: str) -> str:
        """The §14.6 links of an entry (``versions.resource_entry_links``, as ``rs.write`` writes them)."""
        return (
            f'{self.memento}{stamp}/{path}" modified="{when}"{attrs}/>'
            f'{self.timegate}{path}"/>{self.timemap}{path}" type="application/link-format"/>'
        )

    def lines(
        self, rows: Iterable[ListingRow | Resource], general: Callable[[Resource], T]
    ) -> Iterator[str | T]:
        """The lines of ``iter_live_listing``'s rows, several joined in one string (``general`` for its
        ``Resource`` rows). The common rows (a sha-256 and a length, no encoding, a URI to copy as it is,
        a known type) are written inline, one f-string each; a run of rows stored at the same time
        converts that time once."""
        head, types, special, row, safe = self.head, self._types, _special, self.row, _SAFE_CHARS
        versions = self.versions
        schemes: dict[str, bool] = {}
        last: str | None = None
        when = ""
        out: list[str] = []  # lines go out joined, _BATCH at a time (a generator step per row costs)
        add = out.append
        for r in rows:
            if type(r) is not tuple:
                if out:
                    yield "".join(out)
                    out.clear()
                yield general(
                    cast(Resource, r)
                )  # `type(r) is tuple` is the fast test; mypy cannot narrow on it
                continue
            _, uri, sha256, length, type_, encoding, md5, sha1, lastmod, upstream, updated = r
            if sha256 is not None and length is not None and encoding is None and special(uri) is None:
                scheme, sep, rest = uri.partition("://")
                t = types.get(type_)
                ok = schemes.get(scheme)
                if ok is None:
                    ok = schemes[scheme] = _SCHEME.match(scheme) is not None
                if (
                    sep
                    and ok
                    and t is not None
                    and not rest.strip(safe)
                    and "/." not in rest
                    and rest[:1] != "."
                ):
                    if md5 is None and sha1 is None:
                        h = f"sha-256:{sha256}"
                    else:  # format_hash's order
                        pairs = (("sha-256", sha256), ("sha-1", sha1), ("md5", md5))
                        h = " ".join(f"{a}:{d}" for a, d in pairs if d is not None)
                    if special(h) is None:
                        if updated != last:
                            last, when = updated, _text_time(updated)
                        mod = lastmod or upstream
                        m = "" if mod is None else f' modified="{_text_time(mod)}"'
                        a = f' hash="{h}" length="{length}"{t}'
                        add(
                            f"{head}{scheme}/{rest}</loc><lastmod>{when}</lastmod><rs:md{a}/>"
                            f'<rs:ln rel="via" href="{uri}"{m}{a}/>'
                            f"{versions(f'{scheme}/{rest}', stamp_text(updated), when, a)}</url>\n"
                        )
                        if len(out) >= _BATCH:
                            yield "".join(out)
                            out.clear()
                        continue
            add(row(r))
        if out:
            yield "".join(out)

    def row(self, r: tuple) -> str:
        """``line`` for a ``ListingRow``."""
        _, uri, sha256, length, type_, encoding, md5, sha1, lastmod, upstream, updated = r
        modified = lastmod or upstream
        return self.line(
            uri, sha256, length, type_, encoding, md5, sha1,
            None if modified is None else _text_time(modified), _text_time(updated), stamp_text(updated),
        )  # fmt: skip

    def resource(self, r: Resource) -> str | None:
        """``line`` for a ``Resource`` without links or extras; None for one with them."""
        if r.links or r.md_extra or r.entry_extra:
            return None
        hashes = r.hashes
        if set(hashes) - {"sha-256", "sha-1", "md5"} or hashes.get("sha-256") != r.sha256:
            return None
        modified = r.lastmod or r.upstream_datetime
        return self.line(
            r.uri, r.sha256, r.length, r.type, r.encoding, hashes.get("md5"), hashes.get("sha-1"),
            None if modified is None else _dt(modified), _dt(r.updated_at), stamp(r.updated_at),
        )  # fmt: skip


def _plain(scheme: str, rest: str) -> bool:
    """True when ``rsagg_path`` gives ``scheme/rest`` unchanged: a scheme as RFC 3986 writes it, a rest
    of characters ``quote`` leaves alone and no ``.``/``..`` segment (checked loosely: any ``/.``)."""
    return (
        not rest.strip(_SAFE_CHARS)
        and "/." not in rest
        and rest[:1] != "."
        and _SCHEME.match(scheme) is not None
    )


_SAFE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789" + SAFE


def plain_policy(policy: object) -> bool:
    """Whether the link policy is the built-in one, which gives a row without links exactly one via."""
    if type(policy) is LinkPolicy:
        return True
    return isinstance(policy, PluginLinks) and policy.direct is not None


def listing(
    writer: ListingWriter,
    state: StateStore,
    set_ids: tuple[int, ...],
    lo: int,
    hi: int | None,
    general: Callable[[Resource], T],
) -> Iterator[str | T]:
    """Entry lines of the live rows ``lo < id <= hi`` with no publish filter: ``general(resource)``
    gives the entry of each row the writer leaves to the ordinary path."""
    return writer.lines(state.iter_live_listing(set_ids, after_id=lo, until_id=hi), general)


def filtered(
    writer: ListingWriter,
    state: StateStore,
    ps: PublishedSet,
    lo: int,
    hi: int | None,
    visible: Callable[[str, Resource], bool],
    general: Callable[[Resource], T],
) -> Iterator[str | T]:
    """``listing`` with a publish filter: every row a ``Resource`` the filter sees."""
    name = ps.name
    for r in state.iter_live(ps.set_ids, after_id=lo, until_id=hi):
        if visible(name, r):
            line = writer.resource(r)
            yield general(r) if line is None else line


__all__ = ["ListingWriter", "filtered", "listing", "plain_policy"]
