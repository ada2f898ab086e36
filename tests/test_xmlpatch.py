"""RFC 5261 / RFC 7351 XML patches: the RFC's Appendix A examples, byte fidelity, selectors, errors.

The examples follow RFC 5261 Appendix A (target, patch, operation); results are compared byte for byte,
because §14.4 keeps a patched resource only when its hash matches the Source's new version.
"""

from __future__ import annotations

import pytest
from lxml import etree
from rsagg_xmlpatch import MEDIA_TYPE, XmlPatchError, apply_xml_patch, patch_formats, rewrite_selector

DECL = b'<?xml version="1.0" encoding="UTF-8"?>\n'


def patched(target: bytes, diff: bytes) -> bytes:
    return apply_xml_patch(DECL + target, DECL + b"<diff>" + diff + b"</diff>\n")


def c14n(data: bytes) -> bytes:
    return etree.tostring(etree.fromstring(data), method="c14n")


NOTE = b"<doc>\n  <note>This is a sample document</note>\n</doc>\n"
FOO = b'<doc>\n  <foo id="ert4773">This is a new child</foo>\n</doc>\n'
SAMPLE = b'<doc>\n  <foo a="1">This is a sample document</foo>\n</doc>\n'


# -- RFC 5261 Appendix A -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "diff", "result"),
    [
        pytest.param(
            NOTE,
            b'<add sel="doc"><foo id="ert4773">This is a new child</foo></add>',
            b"<doc>\n  <note>This is a sample document</note>\n"
            b'<foo id="ert4773">This is a new child</foo></doc>\n',
            id="A.1 adding an element",
        ),
        pytest.param(
            FOO,
            b'<add sel="doc/foo[@id=\'ert4773\']" type="@user">Bob</add>',
            b'<doc>\n  <foo id="ert4773" user="Bob">This is a new child</foo>\n</doc>\n',
            id="A.2 adding an attribute",
        ),
        pytest.param(
            FOO,
            b'<add sel="doc" type="namespace::pref">urn:ns:xxx</add>',
            b'<doc xmlns:pref="urn:ns:xxx">\n  <foo id="ert4773">This is a new child</foo>\n</doc>\n',
            id="A.3 adding a prefixed namespace declaration",
        ),
        pytest.param(
            FOO,
            b'<add sel="doc/foo[@id=\'ert4773\']" pos="before"><!-- comment --></add>',
            b'<doc>\n  <!-- comment --><foo id="ert4773">This is a new child</foo>\n</doc>\n',
            id="A.4 adding a comment node with pos",
        ),
        pytest.param(
            b"<doc>\n  <foo/>\n</doc>\n",
            b'<add sel="doc" pos="prepend">\n  <bar/>\n  <!-- new -->\n  <baz>text</baz></add>',
            b"<doc>\n  <bar/>\n  <!-- new -->\n  <baz>text</baz>\n  <foo/>\n</doc>\n",
            id="A.5 adding multiple nodes, whitespace text included",
        ),
        pytest.param(
            SAMPLE,
            b'<replace sel="doc/foo[@a=\'1\']"><bar a="2">This is a new element</bar></replace>',
            b'<doc>\n  <bar a="2">This is a new element</bar>\n</doc>\n',
            id="A.6 replacing an element",
        ),
        pytest.param(
            SAMPLE,
            b'<replace sel="doc/foo/@a">2</replace>',
            b'<doc>\n  <foo a="2">This is a sample document</foo>\n</doc>\n',
            id="A.7 replacing an attribute value",
        ),
        pytest.param(
            b'<doc xmlns:pref="urn:test">\n  <foo a="1">This is a sample document</foo>\n</doc>\n',
            b'<replace sel="doc/namespace::pref">urn:new:xxx</replace>',
            b'<doc xmlns:pref="urn:new:xxx">\n  <foo a="1">This is a sample document</foo>\n</doc>\n',
            id="A.8 replacing a namespace declaration URI",
        ),
        pytest.param(
            b"<doc>\n  <!-- This is a sample document -->\n</doc>\n",
            b'<replace sel="doc/comment()[1]"><!-- This is the new content --></replace>',
            b"<doc>\n  <!-- This is the new content -->\n</doc>\n",
            id="A.9 replacing a comment node",
        ),
        pytest.param(
            b'<doc>\n  <foo a="1">This is a sample document</foo>\n  <?test foo="bar"?>\n</doc>\n',
            b'<replace sel=\'doc/processing-instruction("test")\'><?test bar="foobar"?></replace>',
            b'<doc>\n  <foo a="1">This is a sample document</foo>\n  <?test bar="foobar"?>\n</doc>\n',
            id="A.10 replacing a processing instruction node",
        ),
        pytest.param(
            SAMPLE,
            b'<replace sel="doc/foo/text()[1]">This is the new text content</replace>',
            b'<doc>\n  <foo a="1">This is the new text content</foo>\n</doc>\n',
            id="A.11 replacing a text node",
        ),
        pytest.param(
            SAMPLE,
            b'<remove sel="doc/foo[@a=\'1\']" ws="after"/>',
            b"<doc>\n  </doc>\n",
            id="A.12 removing an element",
        ),
        pytest.param(
            SAMPLE,
            b'<remove sel="doc/foo/@a"/>',
            b"<doc>\n  <foo>This is a sample document</foo>\n</doc>\n",
            id="A.13 removing an attribute",
        ),
        pytest.param(
            b'<doc>\n  <foo a="1" xmlns:pref="urn:test">This is a sample document</foo>\n'
            b"  <!-- comment -->\n</doc>\n",
            b'<remove sel="doc/foo/namespace::pref"/>',
            b'<doc>\n  <foo a="1">This is a sample document</foo>\n  <!-- comment -->\n</doc>\n',
            id="A.14 removing a prefixed namespace declaration",
        ),
        pytest.param(
            b"<doc>\n  <!-- comment -->\n  <foo/>\n</doc>\n",
            b'<remove sel="doc/comment()[1]"/>',
            b"<doc>\n  \n  <foo/>\n</doc>\n",
            id="A.15 removing a comment node",
        ),
        pytest.param(
            b'<doc>\n  <?test foo="bar"?>\n  <foo/>\n</doc>\n',
            b'<remove sel="doc/processing-instruction(\'test\')" ws="before"/>',
            b"<doc>\n  <foo/>\n</doc>\n",
            id="A.16 removing a processing instruction node",
        ),
        pytest.param(
            SAMPLE,
            b'<remove sel="doc/foo/text()[1]"/>',
            b'<doc>\n  <foo a="1"/>\n</doc>\n',
            id="A.17 removing a text node",
        ),
    ],
)
def test_rfc5261_appendix_a(target: bytes, diff: bytes, result: bytes) -> None:
    assert patched(target, diff) == DECL + result


A18_TARGET = b"""<?xml version="1.0" encoding="UTF-8"?>
<doc xmlns="urn:ietf:params:xml:ns:xxx"
     xmlns:z="urn:ietf:params:xml:ns:yyy">
  <note>This is a sample document</note>
  <elem a="foo">
    <child/>
  </elem>
  <elem a="bar">
    <z:child/>
  </elem>
</doc>
"""
A18_PATCH = b"""<?xml version="1.0" encoding="UTF-8"?>
<p:diff xmlns="urn:ietf:params:xml:ns:xxx"
        xmlns:y="urn:ietf:params:xml:ns:yyy"
        xmlns:p="urn:ietf:params:xml:ns:diff">

  <p:add sel="doc/elem[@a='foo']">  <!-- This is a new child -->
    <child id="ert4773">
      <y:node/>
    </child>
  </p:add>

  <p:replace sel="doc/note/text()">Patched doc</p:replace>

  <p:remove sel="*/elem[@a='bar']/y:child" ws="both"/>

  <p:add sel="*/elem[@a='bar']" type="@b">new attr</p:add>

</p:diff>
"""
A18_RESULT = b"""<?xml version="1.0" encoding="UTF-8"?>
<doc xmlns="urn:ietf:params:xml:ns:xxx" xmlns:z="urn:ietf:params:xml:ns:yyy">
  <note>Patched doc</note>
  <elem a="foo">
    <child/>
    <!-- This is a new child -->
    <child id="ert4773">
      <z:node/>
    </child>
  </elem>
  <elem a="bar" b="new attr"/>
</doc>
"""


def test_rfc5261_a18_several_patches() -> None:
    # Default namespace in selectors, prefix y: mapped to the target's z:, whitespace removal, attribute.
    result = apply_xml_patch(A18_TARGET, A18_PATCH)
    # libxml2 writes the root's start tag on one line (the RFC's line break inside it is not kept).
    assert result == A18_RESULT
    assert apply_xml_patch(A18_TARGET.replace(b'"\n     xmlns:z', b'" xmlns:z'), A18_PATCH) == A18_RESULT


def test_rfc7351_patch_document() -> None:
    patch = b"""<p:patch xmlns:p="urn:ietf:rfc:7351" xmlns="urn:x" xmlns:y="urn:y">
  <p:add sel="doc/elem[@a='foo']"><child id="ert4773"><y:node/></child></p:add>
  <p:replace sel="doc/note/text()">Patched doc</p:replace>
  <p:remove sel="*/elem[@a='bar']"/>
</p:patch>"""
    target = b'<doc xmlns="urn:x" xmlns:z="urn:y"><note>old</note><elem a="foo"/><elem a="bar"/></doc>'
    assert apply_xml_patch(target, patch) == (
        b'<doc xmlns="urn:x" xmlns:z="urn:y"><note>Patched doc</note>'
        b'<elem a="foo"><child id="ert4773"><z:node/></child></elem></doc>'
    )  # the patch's own namespace (p:) is not carried into the document


def test_media_types() -> None:
    formats = patch_formats()
    assert MEDIA_TYPE == "application/xml-patch+xml"  # RFC 7351
    assert formats[MEDIA_TYPE] is apply_xml_patch
    assert formats["application/patch-ops-error+xml"] is apply_xml_patch  # as §14.4 words it


# -- byte fidelity -------------------------------------------------------------------------------

TYPICAL = b"""<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<!DOCTYPE record>
<!-- exported 2024-06-01 -->
<?xml-stylesheet type="text/xsl" href="record.xsl"?>
<record xmlns="http://www.loc.gov/MARC21/slim" xmlns:dc="http://purl.org/dc/elements/1.1/">
  <dc:title lang="en">Caf\xc3\xa9 &amp; bar</dc:title>
  <script><![CDATA[if (a < b) {}]]></script>
  <empty/>
</record>
<!-- end -->
"""


def test_empty_patch_reproduces_the_document_byte_for_byte() -> None:
    assert apply_xml_patch(TYPICAL, b"<diff/>") == TYPICAL


def test_patch_keeps_prolog_epilog_cdata_and_encoding() -> None:
    diff = (
        b'<diff xmlns:m="http://www.loc.gov/MARC21/slim" xmlns:dc="http://purl.org/dc/elements/1.1/">'
        b'<replace sel="m:record/dc:title/@lang">fr</replace></diff>'
    )
    assert apply_xml_patch(TYPICAL, diff) == TYPICAL.replace(b'lang="en"', b'lang="fr"')
    latin = b'<?xml version="1.0" encoding="ISO-8859-1"?>\n<a>caf\xe9</a>\n'
    diff = b'<diff><add sel="a" type="@x">\xc3\xa9</add></diff>'
    assert (
        apply_xml_patch(latin, diff)
        == b'<?xml version="1.0" encoding="ISO-8859-1"?>\n<a x="\xe9">caf\xe9</a>\n'
    )


def test_adding_next_to_the_root_element() -> None:
    diff = (
        b'<diff><add sel="doc" pos="before"><!-- first --><?pi x?></add>'
        b'<add sel="doc" pos="after"><!-- last --></add></diff>'
    )
    assert (
        apply_xml_patch(DECL + b"<doc/>\n", diff)
        == DECL + b"<!-- first -->\n<?pi x?>\n<doc/>\n<!-- last -->\n"
    )
    with pytest.raises(XmlPatchError, match="one root element"):
        apply_xml_patch(b"<doc/>", b'<diff><add sel="doc" pos="after"><other/></add></diff>')
    with pytest.raises(XmlPatchError, match="no text"):
        apply_xml_patch(b"<doc/>", b'<diff><add sel="doc" pos="before">hello</add></diff>')


def test_replacing_the_root_element_keeps_what_surrounds_it() -> None:
    target = DECL + b"<!-- c -->\n<doc><foo a='1'>sample</foo></doc>\n"
    diff = b'<diff><replace sel="doc"><cod><foo a="2">replacement</foo></cod></replace></diff>'
    assert apply_xml_patch(target, diff) == DECL + b'<!-- c -->\n<cod><foo a="2">replacement</foo></cod>\n'


# -- namespaces ----------------------------------------------------------------------------------


def test_added_content_takes_the_targets_prefix_for_a_known_namespace() -> None:
    target = b'<doc xmlns:b="urn:test"><foo a="1">sample</foo></doc>'
    diff = (
        b'<diff><replace xmlns:a="urn:test" sel="*/foo"><a:bar><a:foo a:size="2"/></a:bar></replace></diff>'
    )
    assert (
        apply_xml_patch(target, diff) == b'<doc xmlns:b="urn:test"><b:bar><b:foo b:size="2"/></b:bar></doc>'
    )


def test_added_content_declares_a_new_namespace_once() -> None:
    diff = b'<diff xmlns:x="ns:test" xmlns:unused="urn:u"><add sel="doc"><x:foo><x:bar/></x:foo></add></diff>'
    assert apply_xml_patch(b"<doc/>", diff) == b'<doc><x:foo xmlns:x="ns:test"><x:bar/></x:foo></doc>'


def test_unprefixed_selector_names_are_in_no_namespace_without_a_default() -> None:
    target = b'<doc><bar><foo xmlns="urn:test"><bar/></foo></bar></doc>'
    diff = b'<diff><add sel="//bar" pos="prepend"><child/></add></diff>'
    assert (
        apply_xml_patch(target, diff) == b'<doc><bar><child/><foo xmlns="urn:test"><bar/></foo></bar></doc>'
    )


def test_replacing_a_namespace_uri_moves_the_names_bound_to_it() -> None:
    inner = b'<pref:foo pref:a="1"><x xmlns:pref="urn:other"><pref:y/></x></pref:foo>'
    target = b'<doc xmlns:pref="urn:test">' + inner + b"</doc>"
    diff = b'<diff><replace sel="doc/namespace::pref">urn:new</replace></diff>'
    result = apply_xml_patch(target, diff)
    assert result == b'<doc xmlns:pref="urn:new">' + inner + b"</doc>"
    root = etree.fromstring(result)
    assert root[0].tag == "{urn:new}foo" and root[0].get("{urn:new}a") == "1"
    assert root[0][0][0].tag == "{urn:other}y"  # redeclared below: not moved


def test_adding_a_namespaced_attribute_uses_the_patch_prefix() -> None:
    diff = b'<diff xmlns:q="urn:q"><add sel="doc/a" type="@q:flag">on</add></diff>'
    assert apply_xml_patch(b"<doc><a/>\n</doc>", diff) == b'<doc><a xmlns:q="urn:q" q:flag="on"/>\n</doc>'


def test_namespace_in_use_cannot_be_removed() -> None:
    with pytest.raises(XmlPatchError, match="still in use"):
        apply_xml_patch(
            b'<doc xmlns:p="urn:p"><p:a/></doc>', b'<diff><remove sel="doc/namespace::p"/></diff>'
        )


def test_no_namespace_element_under_a_default_namespace_is_refused() -> None:
    # libxml2 would write <foo/> without xmlns="", which reads back in the default namespace.
    with pytest.raises(XmlPatchError, match="default namespace"):
        apply_xml_patch(b'<doc xmlns="urn:x"/>', b'<diff><add sel="/*"><foo/></add></diff>')


# -- selectors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "default", "rewritten"),
    [
        ("doc", None, "/doc"),
        ("doc/foo[@id='x']/@a", "d", "/d:doc/d:foo[@id='x']/@a"),
        ("*/elem[@a='bar']/y:child", "d", "/*/d:elem[@a='bar']/y:child"),
        ("/doc//x | a", "d", "/d:doc//d:x | /d:a"),
        ("(a/b)[1]", None, "(/a/b)[1]"),
        ("doc/processing-instruction('t')", "d", "/d:doc/processing-instruction('t')"),
        ("a * b", None, "/a * /b"),  # multiplication, not a wildcard
        ("a[b/c = 'd and e'] or x", "d", "/d:a[d:b/d:c = 'd and e'] or /d:x"),
        ("child::a/attribute::b", "d", "/child::d:a/attribute::b"),
        ("id('x')/a", None, "id('x')/a"),
        ("doc/text()", None, "/doc/text()"),
    ],
)
def test_rewrite_selector(expr: str, default: str | None, rewritten: str) -> None:
    assert rewrite_selector(expr, default) == rewritten


def test_selector_matching_nothing_names_the_selector() -> None:
    with pytest.raises(ValueError, match=r"sel 'doc3' matches no node"):
        apply_xml_patch(b"<doc/>", b'<diff><add sel="doc3"><foo/></add></diff>')


def test_selector_matching_several_nodes_names_the_selector() -> None:
    with pytest.raises(XmlPatchError, match=r"sel 'doc/note' matches 2 nodes"):
        apply_xml_patch(b"<doc><note/><note/></doc>", b'<diff><add sel="doc/note"><child/></add></diff>')


@pytest.mark.parametrize(
    ("target", "diff", "message"),
    [
        (b"<doc/>", b'<diff><add sel="doc["><a/></add></diff>', "not a usable XPath"),
        (b"<doc/>", b'<diff><add sel="count(doc)"><a/></add></diff>', "selects a value"),
        (b"<doc/>", b"<diff><add><a/></add></diff>", "without a sel"),
        (b"<doc/>", b'<diff><move sel="doc"/></diff>', "unknown patch operation <move>"),
        (b"<doc/>", b'<patches><add sel="doc"/></patches>', "root is <diff> or <patch>"),
        (b"<doc/>", b'<diff><remove sel="doc"/></diff>', "root element cannot be removed"),
        (
            b"<doc><foo/> </doc>",
            b'<diff><remove sel="doc/foo" ws="before"/></diff>',
            "no whitespace text node before",
        ),
        (
            b"<doc> <foo/></doc>",
            b'<diff><remove sel="doc/foo" ws="after"/></diff>',
            "no whitespace text node after",
        ),
        (b'<doc a="1"/>', b'<diff><remove sel="doc/@a" ws="both"/></diff>', "ws applies to elements"),
        (
            b"<doc><foo/></doc>",
            b'<diff><replace sel="doc/foo"><a/><b/></replace></diff>',
            "exactly one element",
        ),
        (
            b"<doc><foo/></doc>",
            b'<diff><replace sel="doc/foo"><?pi?></replace></diff>',
            "exactly one element",
        ),
        (b'<doc a="1"/>', b'<diff><replace sel="doc/@a"><one/></replace></diff>', "text only"),
        (b'<doc a="1"/>', b'<diff><add sel="doc" type="@a">2</add></diff>', "exists already"),
        (
            b"<doc/>",
            b'<diff><add sel="doc" type="namespace::p"></add></diff>',
            "needs a prefix and a namespace URI",
        ),
        (b"<doc/>", b'<diff><add sel="doc" pos="inside"><a/></add></diff>', "unknown pos"),
        (b"<doc/>", b'<diff><add msel="doc"><a/></add></diff>', "without a sel"),
        (b"<doc/>", b'<diff><add sel="doc" msel="doc"><a/></add></diff>', "msel"),
        (
            b"<doc>x</doc>",
            b'<diff><add sel="doc/text()"><a/></add></diff>',
            "cannot add children to a text node",
        ),
    ],
)
def test_errors(target: bytes, diff: bytes, message: str) -> None:
    with pytest.raises(XmlPatchError, match=message):
        apply_xml_patch(target, diff)


# -- hardening -----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["target", "patch"])
@pytest.mark.parametrize(
    "hostile",
    [
        b'<!DOCTYPE d [<!ENTITY e "boom">]><d>&e;</d>',
        b'<!DOCTYPE d [<!ENTITY e SYSTEM "file:///etc/passwd">]><d>&e;</d>',
        b'<!DOCTYPE d [<!ENTITY a "x"><!ENTITY b "&a;&a;&a;&a;">]><d>&b;</d>',
        b'<!DOCTYPE d SYSTEM "http://127.0.0.1:9/evil.dtd"><d>&undeclared;</d>',
        b"<d>&undeclared;</d>",
        b"<d><unclosed></d>",
    ],
)
def test_hostile_or_broken_xml_is_refused(which: str, hostile: bytes) -> None:
    target, patch = (hostile, b"<diff/>") if which == "target" else (b"<d/>", hostile)
    with pytest.raises(XmlPatchError) as exc_info:
        apply_xml_patch(target, patch)
    assert "root:x:" not in str(exc_info.value)  # nothing of /etc/passwd leaks into the message


def test_result_hash_matches_the_sources_new_version() -> None:
    # The §14.4 use: the Source writes version 2 with a libxml2-like serializer and publishes the patch.
    import hashlib

    v1 = DECL + b'<record id="1">\n  <title>Old title</title>\n  <year>2001</year>\n</record>\n'
    v2 = (
        DECL
        + b'<record id="1">\n  <title>New title</title>\n  <year>2001</year>\n'
        + b"  <note>added</note>\n</record>\n"
    )
    patch = (
        b'<p:patch xmlns:p="urn:ietf:rfc:7351"><p:replace sel="record/title/text()">New title</p:replace>'
        b'<p:add sel="record/year" pos="after">\n  <note>added</note></p:add></p:patch>'
    )
    assert hashlib.sha256(apply_xml_patch(v1, patch)).hexdigest() == hashlib.sha256(v2).hexdigest()
    assert c14n(apply_xml_patch(v1, patch)) == c14n(v2)
