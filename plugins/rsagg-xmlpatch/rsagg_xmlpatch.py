"""XML patches (RFC 5261 operations, RFC 7351 media type) for §14.4 patch links, on lxml.

§14.4 lets a Change List entry point at a description of the change (``rs:ln rel=".../patch"``) whose
media type "allows the unambiguous application of the described changes"; for XML it names RFC 5261.
RFC 7351 registers the media type of such a patch document, ``application/xml-patch+xml``. §14.4 itself
writes ``application/patch-ops-error+xml``, which RFC 5261 registers for *error reports*, not patches;
a Source following the specification's text literally will use it, so both names select this applier
(harmless: ``fetch_by_patch`` keeps a result only when it matches the announced hash).

A patch document is ``<diff>`` (RFC 5261's examples) or ``<p:patch xmlns:p="urn:ietf:rfc:7351">`` (RFC
7351) holding ``<add>``, ``<replace>`` and ``<remove>`` in the root's namespace, applied in order:

- ``sel`` is an XPath 1.0 selector evaluated from the document node (``doc/foo`` selects the root
  ``doc``'s ``foo`` children); it must select exactly one node, else ``XmlPatchError`` (a ValueError)
  naming the selector. Prefixes resolve against the namespaces in scope on the operation element, and
  unprefixed element names against its default namespace when it has one (RFC 5261 §4.2.2).
- ``add``: new content (every child node of ``<add>``, whitespace text included) appended to the
  selected element, or ``pos="prepend"``, or ``pos="before"``/``"after"`` the selected node (next to the
  root element only comments and processing instructions); ``type="@name"`` adds an attribute,
  ``type="namespace::prefix"`` a namespace declaration (the text content is the value / URI).
- ``replace``: an element, comment or processing instruction by one node of the same kind (the root
  element too); a text node, attribute value or namespace URI (RFC 5261 errata 3478: every name in that
  declaration's scope follows) by the text content.
- ``remove``: an element (not the root), comment, processing instruction, text node, attribute, or an
  unused namespace declaration; ``ws="before|after|both"`` also removes the adjacent whitespace text.
- Namespaces of added content follow the target: a namespace already in scope there keeps the target's
  prefix (RFC 5261 §4.2.3); unused declarations of the patch document are not carried over.

Not supported (``XmlPatchError``, so the harvester fetches ``loc``): ``msel`` and other extensions,
replacing or removing comments/PIs outside the root element, a no-namespace element added where a
default namespace is in scope (libxml2 cannot write ``xmlns=""``).

Bytes: the result must hash like the Source's new version, so the document is written the way it was
read as far as lxml allows: the original XML declaration, prolog and epilog bytes (unless the patch
changed them), comments, PIs and CDATA sections are kept, and the root element is serialized by libxml2
(attributes in document order, double quotes, ``<a/>`` for an empty element, ``&gt;`` escaped, character
references written as characters). A Source whose serializer writes otherwise gets a result that does
not match its announced hash; ``fetch_by_patch`` then fetches the resource itself.

Hardening as in ``aggregator/rs/parse.py``: no entity expansion (a DOCTYPE declaring entities, or any
entity reference, is refused), no network, no DTD loading, libxml2's size limits.

As an rsagg plugin (entry point ``xmlpatch`` in the ``rsagg`` group) it registers both media types
through ``rsagg_patch_formats``; it has no settings and is on once installed. To turn it off::

    [plugins.xmlpatch]
    enabled = false
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aggregator.plugin_api import hookimpl, lazy_module

if TYPE_CHECKING:
    from lxml import etree
else:  # imported when a hook first uses it: ``rsagg status`` loads this module and calls no hook
    etree = lazy_module("lxml.etree", globals(), "etree")

PatchApplier = Callable[[bytes, bytes], bytes]  # same shape as aggregator.harvest.patch.PatchApplier

#: RFC 7351's media type of an XML patch document.
MEDIA_TYPE = "application/xml-patch+xml"
#: What §14.4 names (RFC 5261's error document type, used by Sources that follow the text literally).
SPEC_MEDIA_TYPE = "application/patch-ops-error+xml"
RFC7351_NS = "urn:ietf:rfc:7351"

_ROOTS = ("diff", "patch")
_OPERATIONS = ("add", "replace", "remove")
_XML_WS = " \t\r\n"
_NCNAME = r"[^\W\d][\w.\-]*"
_NCNAME_RE = re.compile(_NCNAME + r"\Z")
_NS_STEP = re.compile(r"(?P<path>.+)/\s*namespace\s*::\s*(?P<prefix>" + _NCNAME + r")\s*\Z", re.S)
_DEFAULT_PREFIX = "_rfc5261_default"

_HARDENED = {
    "resolve_entities": False,
    "no_network": True,
    "load_dtd": False,
    "huge_tree": False,
    "strip_cdata": False,  # CDATA sections are written back as they were (byte fidelity)
    "remove_blank_text": False,
    "remove_comments": False,
    "remove_pis": False,
}


class XmlPatchError(ValueError):
    """A patch that cannot be applied: malformed, hostile, unsupported, or a selector that misses."""


def patch_formats() -> dict[str, PatchApplier]:
    """This plugin's appliers by media type (see the module docstring for the second name)."""
    return {MEDIA_TYPE: apply_xml_patch, SPEC_MEDIA_TYPE: apply_xml_patch}


@hookimpl
def rsagg_patch_formats():
    return patch_formats()


def apply_xml_patch(current: bytes, patch: bytes) -> bytes:
    """Apply the RFC 5261 / RFC 7351 patch document ``patch`` to the XML document ``current``."""
    doc = _Document(_parse(current, "document"), current)
    patch_root = _parse(patch, "patch").getroot()
    for op in _operations(patch_root):
        _apply(doc, op)
    return doc.serialize()


# -- parsing -------------------------------------------------------------------------------------


def _parse(data: bytes, what: str) -> etree._ElementTree:
    parser = etree.XMLParser(**_HARDENED)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        raise XmlPatchError(f"the {what} is not well-formed XML: {exc}") from None
    tree = root.getroottree()
    dtd = tree.docinfo.internalDTD
    if dtd is not None and any(True for _ in dtd.iterentities()):
        raise XmlPatchError(f"the {what} declares entities in its DOCTYPE (refused)")
    for entry in parser.error_log:
        if "ENTITY" in entry.type_name:
            raise XmlPatchError(f"the {what} uses an entity (refused): {entry.message}")
    if next(root.iter(etree.Entity), None) is not None:
        raise XmlPatchError(f"the {what} contains an entity reference (refused)")
    return tree


def _operations(root: etree._Element) -> list[etree._Element]:
    qname = etree.QName(root)
    if qname.localname not in _ROOTS:
        raise XmlPatchError(f"a patch document's root is <diff> or <patch>, not <{qname.localname}>")
    ops = []
    for child in root:
        if not isinstance(child.tag, str):
            continue  # comments and processing instructions between operations
        q = etree.QName(child)
        if q.namespace != qname.namespace or q.localname not in _OPERATIONS:
            raise XmlPatchError(f"unknown patch operation <{q.localname}> (line {child.sourceline})")
        ops.append(child)
    return ops


# -- the document being patched ------------------------------------------------------------------


class _Document:
    """The target tree plus what is needed to write it back byte-faithfully."""

    def __init__(self, tree: etree._ElementTree, data: bytes) -> None:
        self.tree = tree
        self.data = data
        self.encoding = tree.docinfo.encoding or "UTF-8"
        self.doctype = tree.docinfo.doctype
        self.top_level_changed = False  # comments/PIs around the root: the original bytes are stale

    @property
    def root(self) -> etree._Element:
        return self.tree.getroot()

    def replace_root(self, new: etree._Element) -> None:
        """A new root element in a new tree; comments and PIs around the old root are kept."""
        if self.tree.docinfo.internalDTD is not None:
            raise XmlPatchError("cannot replace the root element of a document with an internal DTD subset")
        old = self.root
        before = list(old.itersiblings(preceding=True))  # nearest first
        after = list(old.itersiblings())
        new.tail = None
        self.tree = etree.ElementTree(new)
        for node in reversed(before):
            new.addprevious(copy.copy(node))
        for node in reversed(after):
            new.addnext(copy.copy(node))

    def serialize(self) -> bytes:
        split = _split_document(self.data, self.encoding)
        if split is None:  # not an ASCII-based encoding: libxml2 writes the whole document
            return etree.tostring(self.tree, encoding=self.encoding, xml_declaration=True)
        root = self.root
        body = etree.tostring(root, encoding=self.encoding, xml_declaration=False, with_tail=False)
        if not self.top_level_changed:
            return self.data[: split[0]] + body + self.data[split[1] :]
        prolog = _declaration(self.data)
        if self.doctype:
            prolog += self.doctype.encode(self.encoding) + b"\n"
        prolog += b"".join(self._node(n) + b"\n" for n in reversed(list(root.itersiblings(preceding=True))))
        trailing = self.data[len(self.data.rstrip(b" \t\r\n")) :]
        epilog = b"".join(b"\n" + self._node(n) for n in root.itersiblings()) + trailing
        return prolog + body + epilog

    def _node(self, node: etree._Element) -> bytes:
        return etree.tostring(node, encoding=self.encoding, xml_declaration=False, with_tail=False)


_PROLOG_ITEM = re.compile(rb"[ \t\r\n]+|<\?.*?\?>|<!--.*?-->|<!DOCTYPE(?:[^\[>]|\[.*?\])*>", re.S)


def _split_document(data: bytes, encoding: str) -> tuple[int, int] | None:
    """Byte offsets where the root element starts and ends, or None when the bytes are not ASCII-based."""
    if encoding.lower().replace("-", "").replace("_", "") in ("utf16", "utf32", "ucs2", "ucs4"):
        return None
    pos = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    while (m := _PROLOG_ITEM.match(data, pos)) is not None:
        pos = m.end()
    if data[pos : pos + 1] != b"<":
        return None
    end = len(data)
    while True:
        stripped = data[:end].rstrip(b" \t\r\n")
        if stripped.endswith(b"-->"):
            end = stripped.rfind(b"<!--")
        elif stripped.endswith(b"?>"):
            end = stripped.rfind(b"<?")
        else:
            end = len(stripped)
            break
        if end < pos:
            return None
    return pos, end


def _declaration(data: bytes) -> bytes:
    m = re.match(rb"(\xef\xbb\xbf)?<\?xml\b.*?\?>[ \t\r\n]*", data, re.S)
    return m.group(0) if m else b""


# -- selecting -----------------------------------------------------------------------------------


@dataclass
class _Text:
    """A text node: ``host.text`` (attr "text") or ``host.tail`` (attr "tail")."""

    host: etree._Element
    attr: str


@dataclass
class _Attribute:
    element: etree._Element
    name: str  # Clark notation


@dataclass
class _Namespace:
    element: etree._Element
    prefix: str


def _select(doc: _Document, op: etree._Element) -> Any:
    sel = op.get("sel")
    if not sel:
        raise XmlPatchError(f"<{etree.QName(op).localname}> without a sel attribute (line {op.sourceline})")
    if op.get("msel") is not None:
        raise XmlPatchError(f"sel {sel!r}: msel is not part of RFC 5261 (unsupported)")
    namespaces = {p: u for p, u in op.nsmap.items() if p}
    default = op.nsmap.get(None)
    if default:
        namespaces[_DEFAULT_PREFIX] = default
    m = _NS_STEP.match(sel)
    expr = m.group("path") if m else sel
    try:
        path = rewrite_selector(expr, _DEFAULT_PREFIX if default else None)
        found = doc.tree.xpath(path, namespaces=namespaces)
    except (etree.XPathError, ValueError) as exc:
        raise XmlPatchError(f"sel {sel!r}: not a usable XPath selector ({exc})") from None
    if not isinstance(found, list):
        raise XmlPatchError(f"sel {sel!r} selects a value ({found!r}), not a node")
    if len(found) != 1:
        what = "no node" if not found else f"{len(found)} nodes"
        raise XmlPatchError(f"sel {sel!r} matches {what}; it must match exactly one")
    node = found[0]
    if m:
        if not _is_element(node):
            raise XmlPatchError(f"sel {sel!r}: a namespace belongs to an element")
        prefix = m.group("prefix")
        if prefix not in node.nsmap:
            raise XmlPatchError(f"sel {sel!r} matches no node: no namespace prefix {prefix!r} in scope")
        return _Namespace(node, prefix)
    if isinstance(node, etree._Element):
        return node
    if isinstance(node, str) and hasattr(node, "getparent"):
        parent = node.getparent()
        if node.is_attribute:
            return _Attribute(parent, node.attrname)
        if node.is_text or node.is_tail:
            return _Text(parent, "text" if node.is_text else "tail")
    raise XmlPatchError(f"sel {sel!r} selects a node that cannot be patched ({node!r})")


def _is_element(node: Any) -> bool:
    return isinstance(node, etree._Element) and isinstance(node.tag, str)


def _kind(node: Any) -> str:
    if isinstance(node, etree._Comment):
        return "comment"
    if isinstance(node, etree._ProcessingInstruction):
        return "processing instruction"
    if _is_element(node):
        return "element"
    return {_Text: "text node", _Attribute: "attribute", _Namespace: "namespace"}.get(type(node), "node")


_TOKEN = re.compile(
    r"""(?P<ws>\s+)
      |(?P<literal>"[^"]*"|'[^']*')
      |(?P<number>\d+(?:\.\d*)?|\.\d+)
      |(?P<op>\.\.|::|//|!=|<=|>=|[()\[\].@,/|+\-=<>*])
      |(?P<var>\$NC(?::NC)?)
      |(?P<name>NC(?::(?:NC|\*))?)
    """.replace("NC", _NCNAME),
    re.X,
)
_OPERATOR_NAMES = frozenset({"and", "or", "mod", "div"})
_OPERATORS = frozenset({"/", "//", "|", "+", "-", "=", "!=", "<", "<=", ">", ">="})
_NO_OPERAND_BEFORE = frozenset({"@", "::", "(", "[", ","})
_PATH_CONTINUES = frozenset({"/", "//", "::", "@"})


def rewrite_selector(expr: str, default_prefix: str | None) -> str:
    """``expr`` made absolute, with unprefixed element names qualified by ``default_prefix``.

    Why: RFC 5261 evaluates ``sel`` from the document node (``doc`` is the root element), while lxml
    evaluates from the root element, so every top-level relative location path gets a leading ``/``;
    and RFC 5261 §4.2.2 applies the patch's default namespace to unprefixed element names, which XPath
    1.0 cannot express. Tokens are classified by the lexical rules of XPath 1.0 §3.7.
    """
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected character {expr[pos]!r} at {pos}")
        tokens.append((m.lastgroup or "", m.group()))
        pos = m.end()
    significant = [i for i, (kind, _) in enumerate(tokens) if kind != "ws"]
    out: list[str] = [text for _, text in tokens]
    prev: tuple[str, str] | None = None  # (role, text) of the previous significant token
    depth = 0  # predicate nesting: relative paths inside [...] keep their own context
    axis = "child"
    for n, i in enumerate(significant):
        kind, text = tokens[i]
        nxt = tokens[significant[n + 1]][1] if n + 1 < len(significant) else None
        operand_may_start = prev is None or prev[1] in _NO_OPERAND_BEFORE or prev[0] == "operator"
        role = "other"
        if kind == "op":
            if text == "*" and not operand_may_start:
                role = "operator"
            elif text == "*":
                role = "nametest"
            elif text in _OPERATORS:
                role = "operator"
            elif text in (".", ".."):
                role = "step"
        elif kind == "name":
            if not operand_may_start and text in _OPERATOR_NAMES:
                role = "operator"
            elif nxt == "(":
                role = "function"  # or a node type test: node(), text(), comment(), processing-instruction()
                if text in ("node", "text", "comment", "processing-instruction"):
                    role = "nodetype"
            elif nxt == "::":
                role = "axis"
            else:
                role = "nametest"
        starts_step = role in ("nametest", "nodetype", "axis", "step") or text == "@"
        starts_path = starts_step and (prev is None or prev[1] not in _PATH_CONTINUES)
        if starts_path and depth == 0:
            out[i] = "/" + out[i]
        if role == "axis":
            axis = text
        elif text == "@":
            axis = "attribute"
        elif role == "nametest":
            if default_prefix and text != "*" and ":" not in text and axis not in ("attribute", "namespace"):
                out[i] = out[i][: len(out[i]) - len(text)] + f"{default_prefix}:{text}"
            axis = "child"
        elif role in ("nodetype", "step"):
            axis = "child"
        if text == "[":
            depth += 1
        elif text == "]":
            depth -= 1
        prev = (role if role == "operator" else kind, text)
    return "".join(out)


# -- applying ------------------------------------------------------------------------------------


def _apply(doc: _Document, op: etree._Element) -> None:
    name = etree.QName(op).localname
    node = _select(doc, op)
    sel = op.get("sel")
    if name == "add":
        _add(doc, op, node, sel)
    elif name == "replace":
        _replace(doc, op, node, sel)
    else:
        _remove(doc, op, node, sel)


def _content(op: etree._Element) -> list[Any]:
    """The new nodes of an operation in order: str for text, deep copies for the other nodes."""
    items: list[Any] = []
    if op.text:
        items.append(op.text)
    for child in op:
        if isinstance(child, etree._Entity):
            raise XmlPatchError("entity references are not allowed in patch content")
        node = copy.deepcopy(child)
        node.tail = None
        items.append(node)
        if child.tail:
            items.append(child.tail)
    return items


def _text_content(op: etree._Element, sel: str | None) -> str:
    if len(op):
        raise XmlPatchError(f"sel {sel!r}: the new value must be text only")
    return op.text or ""


def _blank(text: str | None) -> bool:
    return not (text or "").strip(_XML_WS)


def _add(doc: _Document, op: etree._Element, node: Any, sel: str | None) -> None:
    typ, pos = op.get("type"), op.get("pos")
    if typ is not None:
        if pos is not None:
            raise XmlPatchError(f"sel {sel!r}: pos cannot be combined with type")
        if not _is_element(node):
            raise XmlPatchError(f"sel {sel!r}: type={typ!r} needs an element, not a {_kind(node)}")
        value = _text_content(op, sel)
        if typ.startswith("@"):
            name = _attribute_name(typ[1:], op, sel)
            if name in node.attrib:
                raise XmlPatchError(f"sel {sel!r}: attribute {typ[1:]!r} exists already")
            _set_attribute(doc, node, name, value, typ[1:])
        elif typ.startswith("namespace::"):
            prefix = typ[len("namespace::") :]
            if not _NCNAME_RE.match(prefix) or not value:
                raise XmlPatchError(f"sel {sel!r}: type={typ!r} needs a prefix and a namespace URI")
            if prefix in _own_nsmap(node):
                raise XmlPatchError(f"sel {sel!r}: prefix {prefix!r} is declared there already")
            _rebuild(doc, node, declare={prefix: value})
        else:
            raise XmlPatchError(f"sel {sel!r}: unknown type {typ!r} (expected @name or namespace::prefix)")
        return
    items = _content(op)
    if pos in (None, "append", "prepend"):
        if not _is_element(node):
            raise XmlPatchError(f"sel {sel!r}: cannot add children to a {_kind(node)}")
        if pos == "prepend":
            point = (node, "text", 0)
        elif len(node):
            point = (node[-1], "tail", len(node[-1].tail or ""))
        else:
            point = (node, "text", len(node.text or ""))
    elif pos in ("before", "after"):
        if isinstance(node, _Text):
            point = (node.host, node.attr, 0 if pos == "before" else len(getattr(node.host, node.attr) or ""))
        elif isinstance(node, etree._Element):
            if node.getparent() is None:
                _add_top_level(doc, node, items, pos, sel)
                return
            point = _point_before(node) if pos == "before" else (node, "tail", 0)
        else:
            raise XmlPatchError(f"sel {sel!r}: cannot add before or after a {_kind(node)}")
    else:
        raise XmlPatchError(f"sel {sel!r}: unknown pos {pos!r} (expected before, after, prepend or append)")
    _insert(point, items, sel)


def _point_before(node: etree._Element) -> tuple[etree._Element, str, int]:
    prev = node.getprevious()
    if prev is not None:
        return prev, "tail", len(prev.tail or "")
    parent = node.getparent()
    return parent, "text", len(parent.text or "")


def _insert(point: tuple[etree._Element, str, int], items: list[Any], sel: str | None) -> None:
    host, attr, offset = point
    text = getattr(host, attr) or ""
    left, right = text[:offset], text[offset:]
    lead = ""
    i = 0
    while i < len(items) and isinstance(items[i], str):
        lead += items[i]
        i += 1
    if i == len(items):
        setattr(host, attr, (left + lead + right) or None)
        return
    setattr(host, attr, (left + lead) or None)
    parent, index = (host, 0) if attr == "text" else (host.getparent(), host.getparent().index(host) + 1)
    last: etree._Element | None = None
    for item in items[i:]:
        if isinstance(item, str):
            assert last is not None
            last.tail = (last.tail or "") + item
            continue
        parent.insert(index, item)
        _check_default_namespace(item, sel)
        index += 1
        last = item
    assert last is not None
    last.tail = ((last.tail or "") + right) or None


def _check_default_namespace(node: etree._Element, sel: str | None) -> None:
    """libxml2 writes a no-namespace element under a default namespace without ``xmlns=""``: refuse."""
    if not _is_element(node):
        return
    for el in node.iter():
        if isinstance(el.tag, str) and not el.tag.startswith("{") and el.nsmap.get(None):
            raise XmlPatchError(
                f"sel {sel!r}: cannot add the no-namespace element <{el.tag}> where a default namespace"
                " is in scope"
            )


def _add_top_level(doc: _Document, node: etree._Element, items: list[Any], pos: str, sel: str | None) -> None:
    nodes = []
    for item in items:
        if isinstance(item, str):
            if not _blank(item):
                raise XmlPatchError(f"sel {sel!r}: no text can be added outside the root element")
            continue  # whitespace between top-level nodes is not part of the tree
        if _is_element(item):
            raise XmlPatchError(f"sel {sel!r}: a document has one root element; cannot add another")
        nodes.append(item)
    for item in nodes if pos == "before" else reversed(nodes):
        if pos == "before":
            node.addprevious(item)
        else:
            node.addnext(item)
    doc.top_level_changed = True


def _replace(doc: _Document, op: etree._Element, node: Any, sel: str | None) -> None:
    if isinstance(node, _Text):
        setattr(node.host, node.attr, _text_content(op, sel) or None)
        return
    if isinstance(node, _Attribute):
        node.element.set(node.name, _text_content(op, sel))
        return
    if isinstance(node, _Namespace):
        uri = _text_content(op, sel)
        if not uri:
            raise XmlPatchError(f"sel {sel!r}: a namespace URI cannot be empty")
        if node.prefix not in _own_nsmap(node.element):
            raise XmlPatchError(f"sel {sel!r}: prefix {node.prefix!r} is not declared on that element")
        _rebuild(doc, node.element, declare={node.prefix: uri}, rename=node.prefix)
        return
    new = [item for item in _content(op) if not (isinstance(item, str) and _blank(item))]
    if len(new) != 1 or isinstance(new[0], str) or _kind(new[0]) != _kind(node):
        raise XmlPatchError(f"sel {sel!r}: a {_kind(node)} is replaced by exactly one {_kind(node)}")
    replacement = new[0]
    parent = node.getparent()
    if node is doc.root:
        doc.replace_root(replacement)
        return
    if parent is None:
        raise XmlPatchError(f"sel {sel!r}: replacing a {_kind(node)} outside the root element is unsupported")
    replacement.tail = node.tail
    parent.replace(node, replacement)
    _check_default_namespace(replacement, sel)


def _remove(doc: _Document, op: etree._Element, node: Any, sel: str | None) -> None:
    ws = op.get("ws")
    if ws is not None and ws not in ("before", "after", "both"):
        raise XmlPatchError(f"sel {sel!r}: unknown ws {ws!r} (expected before, after or both)")
    if not isinstance(node, etree._Element):
        if ws is not None:
            raise XmlPatchError(f"sel {sel!r}: ws applies to elements, comments and PIs, not a {_kind(node)}")
        if isinstance(node, _Text):
            setattr(node.host, node.attr, None)
        elif isinstance(node, _Attribute):
            del node.element.attrib[node.name]
        else:
            _remove_namespace(doc, node, sel)
        return
    parent = node.getparent()
    if parent is None:
        if node is doc.root:
            raise XmlPatchError(f"sel {sel!r}: the root element cannot be removed")
        raise XmlPatchError(f"sel {sel!r}: removing a {_kind(node)} outside the root element is unsupported")
    host, attr, _ = _point_before(node)
    tail = node.tail
    if ws in ("before", "both"):
        before = getattr(host, attr)
        if not before or not _blank(before):
            raise XmlPatchError(f"sel {sel!r}: ws={ws!r} but no whitespace text node before it")
        setattr(host, attr, None)
    if ws in ("after", "both"):
        if not tail or not _blank(tail):
            raise XmlPatchError(f"sel {sel!r}: ws={ws!r} but no whitespace text node after it")
        tail = None
    parent.remove(node)  # lxml drops the tail with the node: put it back where it was
    if tail:
        setattr(host, attr, (getattr(host, attr) or "") + tail)


# -- attributes and namespaces -------------------------------------------------------------------


def _attribute_name(qname: str, op: etree._Element, sel: str | None) -> str:
    prefix, _, local = qname.rpartition(":")
    if not _NCNAME_RE.match(local) or (prefix and not _NCNAME_RE.match(prefix)):
        raise XmlPatchError(f"sel {sel!r}: {qname!r} is not an attribute name")
    if not prefix:
        return local  # unprefixed attributes are in no namespace (Namespaces in XML §6.2)
    uri = op.nsmap.get(prefix)
    if uri is None:
        raise XmlPatchError(f"sel {sel!r}: prefix {prefix!r} of {qname!r} is not declared in the patch")
    return f"{{{uri}}}{local}"


def _set_attribute(doc: _Document, el: etree._Element, name: str, value: str, qname: str) -> None:
    if name.startswith("{"):
        uri = name[1:].partition("}")[0]
        if not any(p and u == uri for p, u in el.nsmap.items()):
            # Declare the patch's prefix rather than let libxml2 invent "ns0".
            el = _rebuild(doc, el, declare={qname.partition(":")[0]: uri})
    el.set(name, value)


def _own_nsmap(el: etree._Element) -> dict[str | None, str]:
    """The namespace declarations written on ``el`` itself (lxml only exposes the in-scope map)."""
    parent = el.getparent()
    inherited = parent.nsmap if parent is not None else {}
    return {p: u for p, u in el.nsmap.items() if inherited.get(p) != u}


def _remove_namespace(doc: _Document, node: _Namespace, sel: str | None) -> None:
    el, prefix = node.element, node.prefix
    own = _own_nsmap(el)
    if prefix not in own:
        raise XmlPatchError(f"sel {sel!r}: prefix {prefix!r} is not declared on that element")
    uri = own[prefix]
    for sub in el.iter():
        if not isinstance(sub.tag, str) or sub.nsmap.get(prefix) != uri:
            continue
        used = sub.prefix == prefix or any(
            k.startswith(f"{{{uri}}}") and sub.nsmap.get(prefix) == uri for k in sub.attrib
        )
        if used:
            raise XmlPatchError(f"sel {sel!r}: namespace prefix {prefix!r} is still in use")
    _rebuild(doc, el, declare={prefix: None})


def _rebuild(
    doc: _Document,
    el: etree._Element,
    declare: dict[str, str | None],
    rename: str | None = None,
) -> etree._Element:
    """Replace ``el`` by a copy whose own declarations are changed by ``declare`` (None removes one).

    Why a copy: lxml cannot change an existing element's namespace declarations. With ``rename``, the
    names bound through that prefix's old declaration move to its new URI (RFC 5261 errata 3478).
    """
    own = _own_nsmap(el)
    old_uri = own.get(rename) if rename else None
    nsmap = {p: u for p, u in own.items() if p not in declare}
    nsmap.update({p: u for p, u in declare.items() if u is not None})
    new_uri = declare.get(rename) if rename else None

    def clark(name: str, prefix: str | None, bound: bool) -> str:
        if bound and old_uri and new_uri and name.startswith(f"{{{old_uri}}}") and prefix == rename:
            return f"{{{new_uri}}}{name[len(old_uri) + 2 :]}"
        return name

    def copy_into(src: etree._Element, parent: etree._Element | None, own_map: dict, bound: bool) -> Any:
        if not isinstance(src.tag, str):
            node = copy.copy(src)
            node.tail = None
            if parent is not None:
                parent.append(node)
            return node
        attrib = {}
        for key, value in src.attrib.items():
            # Attributes carry no prefix in lxml: an attribute in the old URI went through the prefix.
            attrib[clark(key, rename, bound)] = value
        tag = clark(src.tag, src.prefix, bound)
        if parent is None:
            node = etree.Element(tag, attrib, nsmap=own_map)
        else:
            node = etree.SubElement(parent, tag, attrib, nsmap=own_map)
        node.text = src.text
        for child in src:
            child_own = _own_nsmap(child) if isinstance(child.tag, str) else {}
            still = bound and rename not in child_own
            c = copy_into(child, node, child_own, still)
            c.tail = child.tail
        return node

    # Built under the real parent, so names bound by the ancestors' declarations keep their prefixes.
    parent = el.getparent()
    new = copy_into(el, parent, nsmap, rename is not None)
    if parent is None:
        doc.replace_root(new)
    else:
        tail = el.tail
        parent.insert(parent.index(el), new)
        parent.remove(el)
        new.tail = tail
    return new
