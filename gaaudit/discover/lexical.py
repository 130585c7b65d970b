"""Whether offsets of Python source stand in code or in strings and comments, told without
parsing.

Most files that pass the byte prefilter name their trigger only in docstrings and comments.
Python's rules for where strings and comments start and end are simple enough to follow
with one regular expression, several times faster than CPython's parser. The answer leans
to code wherever the scan is unsure (an encoding declaration, an unterminated string, an
f-string whose braces do not balance, as Python 3.12 lets a field hold the f-string's own
quote, or an offset inside an f-string, whose fields are code): the parser then decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_SINGLE = r"[^{q}\\\r\n]*(?:\\(?:\r\n|.)[^{q}\\\r\n]*)*{q}"
_TRIPLE = r"[^{q}\\]*(?:(?:\\.|{q}(?!{q}{q}))[^{q}\\]*)*{q}{q}{q}"
TOKEN = re.compile(
    (
        r"(?=[#'\"])"  # a charset first lets the search skip code quickly
        r"(?:(?P<comment>#[^\r\n]*)"
        r"|(?P<string>"
        rf'"""{_TRIPLE.format(q=chr(34))}'
        rf"|'''{_TRIPLE.format(q=chr(39))}"
        rf'|"{_SINGLE.format(q=chr(34))}'
        rf"|'{_SINGLE.format(q=chr(39))}"
        r")"
        r"|(?P<unsure>['\"]))"
    ).encode(),
    re.DOTALL,
)
COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=]", re.MULTILINE)
TEMPLATES = b"fFtT"  # prefixes of f-strings and t-strings, whose fields are code
PREFIX = re.compile(rb"(?:^|\W)([A-Za-z]{1,2})$")  # letters just before a quote
STRING_PREFIXES = {b"r", b"u", b"b", b"f", b"t", b"br", b"rb", b"fr", b"rf", b"tr", b"rt"}
ESCAPED_BRACES = re.compile(rb"\{\{|\}\}")


def any_in_code(data: bytes, offsets: list[int]) -> bool:
    """Whether one of `offsets` (sorted) into Python source `data` may lie in code, outside
    every string literal and comment."""
    pending = iter(offsets)
    offset = next(pending, None)
    if offset is None:
        return False
    if COOKIE.search(data, 0, _second_line_end(data)):
        return True  # another encoding may spell a quote or a backslash inside a character
    for token in TOKEN.finditer(data):
        start, end = token.span()
        if offset < start or token.lastgroup == "unsure":
            return True
        template = token.lastgroup == "string" and _template(data, start)
        if template and (offset < end or not _balanced(token.group())):
            return True
        while offset < end:
            offset = next(pending, None)
            if offset is None:
                return False
    return True


def literals(data: bytes) -> Iterator[re.Match[bytes]]:
    """The comments and string literals of Python source `data`, in order: matches whose
    `lastgroup` is "comment" or "string" (from its quote on, the prefix left out). A lone
    quote that opens no literal is passed over as code."""
    return (token for token in TOKEN.finditer(data) if token.lastgroup != "unsure")


def prefix(data: bytes, quote: int) -> bytes:
    """The prefix letters (`rb`, `f`) of the string literal whose quote is at `quote`."""
    found = PREFIX.search(data[max(quote - 3, 0) : quote])
    letters = found.group(1) if found else b""
    return letters if letters.lower() in STRING_PREFIXES else b""


def _template(data: bytes, quote: int) -> bool:
    """Whether the string whose quote is at `quote` is an f-string or a t-string."""
    return any(letter in TEMPLATES for letter in prefix(data, quote))


def _balanced(literal: bytes) -> bool:
    """Whether an f-string's replacement fields all close inside the literal the scan found."""
    text = ESCAPED_BRACES.sub(b"", literal)
    return text.count(b"{") == text.count(b"}")


def _second_line_end(data: bytes) -> int:
    """The offset where the second line ends: an encoding declaration must come before."""
    first = data.find(b"\n")
    second = data.find(b"\n", first + 1) if first >= 0 else -1
    return len(data) if second < 0 else second
