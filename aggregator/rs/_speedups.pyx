# cython: language_level=3, boundscheck=False, wraparound=False
"""C fast path of ``parse.DocumentReader``: reads the plain entries of a parsed slice without lxml proxies.

Why: building a Python proxy for every element and reading it through lxml's API costs about twice what
libxml2 needs to parse the bytes, so the pure-Python walk tops out near 200,000 entries/s. Here the
libxml2 nodes are read directly (through lxml's public C API, the same tree the Python code sees).

Contract: an entry is read here only when the Python path would read it *without a single problem*:
a ``<url>``/``<sitemap>`` (§7) whose children are the first ``loc``/``lastmod``/``changefreq``/``rs:md``
and any ``rs:ln``, each text one plain text node, every attribute known, unprefixed and well-formed
(W3C Datetime, non-negative integer). Anything else -- head elements, extensions, repeated or empty
elements, entity nodes, odd values -- goes to ``reader._read_child`` (the Python path), which reports
problems with their lines. Both paths give equal results; tests/test_parse_speedups.py compares them.
"""

cimport lxml.includes.etreepublic as cetree
from cpython cimport datetime as cdt
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport strcmp, strlen
from lxml.includes cimport tree
from lxml.includes.tree cimport const_xmlChar, xmlAttr, xmlNode

import dataclasses
from datetime import timezone

from .model import DATETIME_ATTRS, INT_ATTRS, LN_ATTRS, MD_ATTRS, Entry, Link, Md
from .w3cdt import parse_w3c

from lxml import etree as _etree

# The C API reads lxml's structures directly: only the lxml these speedups were compiled against will do.
if (<bytes>cetree.LXML_VERSION_STRING).decode() != _etree.__version__:
    raise ImportError(
        f"compiled against lxml {(<bytes>cetree.LXML_VERSION_STRING).decode()}, running with lxml"
        f" {_etree.__version__}: reinstall rsagg to recompile them"
    )
cetree.import_lxml__etree()
cdt.import_datetime()

cdef extern from *:
    """
    /* libxml2 keeps line numbers above 65534 of text nodes in ``psvi`` (XML_PARSE_BIG_LINES, set by lxml). */
    static long rsagg_psvi_line(xmlNode *node) { return (long)(ptrdiff_t) node->psvi; }
    """
    long rsagg_psvi_line(xmlNode* node)

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    object PyType_GenericAlloc(type cls, Py_ssize_t nitems)

cdef object UTC = timezone.utc
cdef const char* SM = b"http://www.sitemaps.org/schemas/sitemap/0.9"
cdef const char* RS = b"http://www.openarchives.org/rs/terms/"

# Where the fields of the model's slots dataclasses live in their objects, in field order.
cdef Py_ssize_t[16] MD_AT
cdef Py_ssize_t[16] ENTRY_AT
cdef Py_ssize_t[16] LINK_AT


cdef void _offsets(cls, Py_ssize_t* at) except *:
    """Where each field of a slots dataclass lives in its objects (member descriptors, in field order)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if len(names) > 16:
        raise ImportError(f"{cls.__name__} has more fields than the speedups know")
    for i, name in enumerate(names):
        descr = cls.__dict__[name]
        if type(descr).__name__ != "member_descriptor":
            raise ImportError(f"{cls.__name__}.{name} is not a slot")
        at[i] = (<PyMemberDescrObject*><PyObject*>descr).d_member.offset


_offsets(Md, MD_AT)
_offsets(Entry, ENTRY_AT)
_offsets(Link, LINK_AT)


cdef inline object _build(type cls, Py_ssize_t* at, tuple values):
    """An instance of a slots dataclass without running its Python ``__init__`` (values in field order)."""
    obj = PyType_GenericAlloc(cls, 0)  # zeroed and tracked by the GC, as object.__new__ does
    cdef char* base = <char*><PyObject*>obj
    cdef Py_ssize_t i
    for i in range(len(values)):
        v = values[i]
        Py_INCREF(v)
        (<PyObject**>(base + at[i]))[0] = <PyObject*>v
    return obj


cdef class _Miss:
    """The value of a field the fast path cannot read: the entry goes to the Python path."""


cdef object MISS = _Miss()


cdef inline bint _eq(const_xmlChar* a, const char* b) noexcept:
    return strcmp(<const char*>a, b) == 0


cdef inline str _str(const char* s):
    return PyUnicode_DecodeUTF8(s, strlen(s), NULL)


cdef const char* _text(xmlNode* node) noexcept:
    """The content of an element whose only child is one text node, else NULL."""
    cdef xmlNode* c = node.children
    if c is NULL or c.next is not NULL or c.type != tree.XML_TEXT_NODE:
        return NULL
    return <const char*>c.content


cdef const char* _value(xmlAttr* a) noexcept:
    """The value of an unprefixed attribute held in one text node (or empty), else NULL."""
    cdef xmlNode* c = a.children
    if a.ns is not NULL:
        return NULL
    if c is NULL:
        return b""
    if c.next is not NULL or c.type != tree.XML_TEXT_NODE:
        return NULL
    return <const char*>c.content


cdef inline int _two(const char* s) noexcept:
    if s[0] < 48 or s[0] > 57 or s[1] < 48 or s[1] > 57:
        return -1
    return (s[0] - 48) * 10 + (s[1] - 48)


cdef object _datetime(const char* s):
    """A W3C Datetime (§7): ``YYYY-MM-DDThh:mm:ssZ`` in C, every other form through ``parse_w3c``."""
    cdef int c1, c2, mo, d, h, mi, se
    if strlen(s) == 20 and s[4] == 45 and s[7] == 45 and s[10] == 84 and s[13] == 58 and s[16] == 58 \
            and s[19] == 90:
        c1 = _two(s); c2 = _two(s + 2); mo = _two(s + 5); d = _two(s + 8)
        h = _two(s + 11); mi = _two(s + 14); se = _two(s + 17)
        if c1 >= 0 and c2 >= 0 and mo >= 0 and d >= 0 and h >= 0 and mi >= 0 and se >= 0:
            try:
                return cdt.datetime_new(c1 * 100 + c2, mo, d, h, mi, se, 0, UTC)
            except ValueError:
                return MISS
    try:
        return parse_w3c(_str(s))
    except Exception:
        return MISS


cdef object _integer(const char* s):
    """ASCII digits only (what the Python path accepts without a problem); long ones go to Python."""
    cdef long long v = 0
    cdef int i = 0
    while s[i]:
        if s[i] < 48 or s[i] > 57 or i >= 18:
            return MISS
        v = v * 10 + (s[i] - 48)
        i += 1
    return v if i else MISS


# The attributes of rs:md and rs:ln (§7, Table 3) in model field order, and how each is read.
cdef enum Kind:
    TEXT, INTEGER, DATETIME

cdef const char* MD_NAMES[12]
cdef Kind MD_KINDS[12]
cdef const char* LN_NAMES[9]
cdef Kind LN_KINDS[9]


cdef list _NAMES = []  # keeps the bytes the C tables point into


cdef void _table(cls, names, const char** c_names, Kind* kinds, int size) except *:
    cdef bytes encoded
    fields = [("from_" if name == "from" else name) for name in names] + ["extra"]
    if len(names) != size or [f.name for f in dataclasses.fields(cls)] != fields:
        raise ImportError(f"{cls.__name__} is not what the speedups were written for: update _speedups.pyx")
    for i, name in enumerate(names):
        encoded = name.encode("ascii")
        _NAMES.append(encoded)
        c_names[i] = encoded
        kinds[i] = DATETIME if name in DATETIME_ATTRS else INTEGER if name in INT_ATTRS else TEXT


_table(Md, MD_ATTRS, MD_NAMES, MD_KINDS, 12)
_table(Link, LN_ATTRS, LN_NAMES, LN_KINDS, 9)


cdef object _attributes(type cls, Py_ssize_t* at, xmlNode* node, const char** names, Kind* kinds, int n,
                        bint link):
    """An Md or Link of an element with known attributes only (and rel + href for a link), ``extra``
    empty; MISS for an unknown, prefixed or malformed attribute. Values go straight into the slots."""
    cdef PyObject* held[16]  # new references in field order, NULL when absent
    cdef xmlAttr* a = node.properties
    cdef const char* v
    cdef char* base
    cdef int i
    for i in range(n):
        held[i] = NULL
    try:
        while a is not NULL:
            v = _value(a)
            if v is NULL:
                return MISS
            for i in range(n):
                if strcmp(<const char*>a.name, names[i]) == 0:
                    break
            else:
                return MISS
            if kinds[i] == TEXT:
                value = _str(v)
            elif kinds[i] == INTEGER:
                value = _integer(v)
            else:
                value = _datetime(v)
            if value is MISS:
                return MISS
            Py_INCREF(value)
            Py_XDECREF(held[i])
            held[i] = <PyObject*>value
            a = a.next
        if link and (held[0] is NULL or held[1] is NULL):  # rel and href are mandatory
            return MISS
        extra = {}
        obj = PyType_GenericAlloc(cls, 0)  # zeroed and tracked by the GC, as object.__new__ does
        base = <char*><PyObject*>obj  # no allocation from here on: the GC never sees it half-filled
        for i in range(n):
            if held[i] is NULL:
                Py_INCREF(None)
                (<PyObject**>(base + at[i]))[0] = <PyObject*>None
            else:  # the reference moves into the slot
                (<PyObject**>(base + at[i]))[0] = held[i]
                held[i] = NULL
        Py_INCREF(extra)
        (<PyObject**>(base + at[n]))[0] = <PyObject*>extra
        return obj
    finally:
        for i in range(n):
            Py_XDECREF(held[i])


cdef inline object _md(xmlNode* node):
    return _attributes(Md, MD_AT, node, MD_NAMES, MD_KINDS, 12, False)


cdef inline object _ln(xmlNode* node):
    return _attributes(Link, LINK_AT, node, LN_NAMES, LN_KINDS, 9, True)


cdef long _line(xmlNode* node, int depth) noexcept:
    """``xmlGetLineNo`` (what lxml's ``sourceline`` reads), which lxml does not export to C extensions.

    Lines up to 65534 are in the node; above, libxml2 keeps the line in the ``psvi`` of text nodes, so an
    element's line is found at its first child, else at a sibling (a few levels deep at most).
    """
    cdef long found = -1
    if node.line != 65535 or depth >= 5:
        return node.line
    if node.type == tree.XML_TEXT_NODE and rsagg_psvi_line(node) != 0:
        found = rsagg_psvi_line(node)
    elif node.type == tree.XML_ELEMENT_NODE and node.children is not NULL:
        found = _line(node.children, depth + 1)
    elif node.next is not NULL:
        found = _line(node.next, depth + 1)
    elif node.prev is not NULL:
        found = _line(node.prev, depth + 1)
    return node.line if found == -1 or found == 65535 else found


cdef object _entry(xmlNode* node, bint* md_first):
    """The Entry of a plain ``<url>``/``<sitemap>``, or MISS; ``md_first``: its <rs:md> came before its
    <loc> (POD, 2020), which the caller notes as the Python path does."""
    cdef xmlNode* c = node.children
    cdef const char* t
    loc = lastmod = changefreq = md = MISS
    links = []
    while c is not NULL:
        if c.type == tree.XML_ELEMENT_NODE:
            if c.ns is NULL:
                return MISS
            if _eq(c.ns.href, SM):
                if _eq(c.name, b"loc") and loc is MISS:
                    t = _text(c)
                    if t is NULL:
                        return MISS
                    loc = _str(t).strip()
                    if not loc:
                        return MISS
                elif _eq(c.name, b"lastmod") and lastmod is MISS:
                    t = _text(c)
                    if t is NULL:
                        return MISS
                    lastmod = _datetime(t)
                    if lastmod is MISS:
                        return MISS
                elif _eq(c.name, b"changefreq") and changefreq is MISS:
                    if c.children is NULL:
                        changefreq = None
                    else:
                        t = _text(c)
                        if t is NULL:
                            return MISS
                        changefreq = _str(t).strip() or None
                else:
                    return MISS
            elif _eq(c.ns.href, RS):
                if _eq(c.name, b"md") and md is MISS:
                    if loc is MISS:
                        md_first[0] = True
                    md = _md(c)
                    if md is MISS:
                        return MISS
                elif _eq(c.name, b"ln"):
                    ln = _ln(c)
                    if ln is MISS:
                        return MISS
                    links.append(ln)
                else:
                    return MISS
            else:
                return MISS
        elif c.type != tree.XML_TEXT_NODE and c.type != tree.XML_CDATA_SECTION_NODE:
            return MISS  # entity reference, comment, processing instruction: the Python path decides
        c = c.next
    if loc is MISS:
        return MISS
    cdef long line = _line(node, 0)
    return _build(Entry, ENTRY_AT, (
        loc,
        None if lastmod is MISS else lastmod,
        None if changefreq is MISS else changefreq,
        None if md is MISS else md,
        links,
        [],
        line if line > 0 else None,  # as lxml's sourceline
    ))


def read_children(reader, cetree._Element root not None, Py_ssize_t count, list out not None, str entry_name):
    """Read the first ``count`` children of the root into ``out``, as ``reader._read_child`` would."""
    cdef xmlNode* c = root._c_node.children
    cdef Py_ssize_t seen = 0
    cdef bytes name = entry_name.encode("ascii")
    cdef const char* c_name = name
    cdef bint head_out = reader._head_emitted
    cdef bint md_first
    while c is not NULL and seen < count:
        if cetree._isElement(c):
            seen += 1
            entry = MISS
            if c.type == tree.XML_ELEMENT_NODE and c.ns is not NULL and _eq(c.ns.href, SM) \
                    and _eq(c.name, c_name):
                md_first = False
                entry = _entry(c, &md_first)
                if md_first and entry is not MISS:
                    reader._tolerated("md-before-loc", entry.line, f"<rs:md> before <loc> in <{entry_name}> "
                                      "(§7, sitemap schema: <loc> comes first); read in any order")
            if entry is MISS:
                reader._read_child(cetree.elementFactory(root._doc, c), out)
                head_out = reader._head_emitted
            else:
                if not head_out:  # the head is complete once the first entry is read (§7)
                    out.append(reader._emit_head())
                    head_out = True
                out.append(entry)
        c = c.next
