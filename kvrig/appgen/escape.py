"""Escapers for every value that lands in generated files: Swift literals, XML (plist) text, YAML scalars.

Templates are data and are rendered with autoescape off, so each value names its escaper explicitly.
"""

from __future__ import annotations

import json
import re
from typing import Any

import markupsafe

_SWIFT_SIMPLE = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}


def swift_string(value: Any) -> str:
    """A Swift string literal (quotes included) whose value is exactly `value`.

    Backslashes are doubled, so `\\(` cannot start an interpolation; quotes are escaped, so `\"\"\"` cannot
    open a multi-line literal; other control and line-separator characters become `\\u{...}`.
    """
    if not isinstance(value, str):
        raise TypeError(f"swift_string expects a str, got {type(value).__name__}")
    out = []
    for ch in value:
        if ch in _SWIFT_SIMPLE:
            out.append(_SWIFT_SIMPLE[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or ch in "\u2028\u2029\u0085":
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def swift_int(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"swift_int expects an int, got {type(value).__name__}")
    return str(value)


def swift_bool(value: Any) -> str:
    if not isinstance(value, bool):
        raise TypeError(f"swift_bool expects a bool, got {type(value).__name__}")
    return "true" if value else "false"


# XML 1.0's Char production leaves out these (and lone surrogates, which a str from JSON can hold)
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_chars(value: str) -> str:
    """`value` without the characters XML 1.0 cannot carry (a parser refuses the whole document for one)."""
    return _XML_INVALID.sub("", value)


def xml_text(value: Any) -> str:
    """Text for a plist <string>: XML-escaped; characters XML 1.0 cannot carry are dropped."""
    if not isinstance(value, str):
        raise TypeError(f"xml_text expects a str, got {type(value).__name__}")
    return str(markupsafe.escape(xml_chars(value)))


def yaml_string(value: Any) -> str:
    """A YAML double-quoted scalar: JSON string syntax is a subset of it."""
    if not isinstance(value, str):
        raise TypeError(f"yaml_string expects a str, got {type(value).__name__}")
    text = json.dumps(value, ensure_ascii=False)
    # JSON leaves these raw; YAML would read them as line breaks.
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\x85")


FILTERS = {
    "swift_string": swift_string,
    "swift_int": swift_int,
    "swift_bool": swift_bool,
    "xml_text": xml_text,
    "yaml_string": yaml_string,
}
