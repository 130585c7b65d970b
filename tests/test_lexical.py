"""The lexical scan: an offset it puts in a string or comment is in one, for Python's own
tokenizer; where it cannot tell, it says code."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest
from conftest import fixture_scripts

from gaaudit.discover.lexical import any_in_code

ROOT = Path(__file__).resolve().parent.parent
NOT_CODE = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}

TRICKY = {
    "quotes of each kind": "a = 'x#y' + \"it's\" + '''a \"\"\" b''' + \"\"\"c ''' d\"\"\"  # e\n",
    "escaped quotes": "a = 'it\\'s' + \"say \\\"hi\\\"\" + '\\\\' + 'b'  # c\n",
    "triple quotes ending in a quote": 'a = """x ""\\""""\nb = 1  # """\n',
    "continued single-quoted string": "a = 'one \\\ntwo'\nb = c  # 'd\n",
    "raw and byte prefixes": "a = rb'\\'' + Rb\"x\" + br'''y''' + u'z'\n",
    "comment holding quotes": "x = 1  # it's \"quoted\"\ny = 'not # a comment'\n",
    "strings in brackets across lines": "call(\n    'a',  # one\n    \"b\",\n)\n",
    "CRLF endings": 'a = \'x\'\r\n# c\r\nb = """y\r\nz"""\r\n',
    "f-strings": "name = f'{a!r:>{width}} {{literal}}' + F\"x\" + rf'{b}'\n",
}


def string_offsets(data: bytes) -> set[int]:
    """The byte offsets inside string and comment tokens, by Python's tokenizer, from the
    quote on (the scan takes a string's prefix letters for code, which errs towards code)."""
    text = data.decode("utf-8")
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line.encode("utf-8")))

    def offset(row: int, column: int) -> int:
        return starts[row - 1] + len(lines[row - 1][:column].encode("utf-8"))

    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in NOT_CODE:
            prefix = len(token.string) - len(token.string.lstrip("rRbBuUfFtT"))
            inside.update(range(offset(*token.start) + prefix, offset(*token.end)))
    return inside


def assert_sound(data: bytes, samples: int = 200) -> int:
    """Every offset the scan puts outside code (of about `samples` spread over the file) is
    inside a string or comment; the number of offsets it puts there."""
    inside = string_offsets(data)
    step = max(1, len(data) // samples)
    claimed = [o for o in range(0, len(data), step) if not any_in_code(data, [o])]
    assert [o for o in claimed if o not in inside] == []
    return len(claimed)


@pytest.mark.parametrize("text", TRICKY.values(), ids=TRICKY.keys())
def test_strings_and_comments_are_found_where_python_finds_them(text):
    data = text.encode("utf-8")
    inside = string_offsets(data)
    found = assert_sound(data)
    if "f'" not in text:  # f-strings are left to the parser
        assert found == len(inside)


def test_real_scripts():
    for path in [*fixture_scripts(), *sorted((ROOT / "gaaudit").rglob("*.py"))]:
        assert assert_sound(path.read_bytes()) > 0, path


def test_several_offsets_are_read_in_one_pass():
    data = b'"""Call x.backward() here."""\n# or x.backward()\nx.backward()\n'
    docstring, comment, code = (i for i in range(len(data)) if data.startswith(b".backward(", i))
    assert not any_in_code(data, [docstring, comment])
    assert any_in_code(data, [docstring, comment, code])
    assert not any_in_code(data, [])


UNSURE = {
    "an encoding declaration": b"# -*- coding: latin-1 -*-\n'''loss.backward()'''\n",
    "an unterminated string": b"x = 'loss.backward()\n",
    "inside an f-string": b"msg = f'{loss.backward()}'\n",
    "after an f-string whose braces do not balance": b"x = f'{d[\"k'\"]}'\n'loss.backward()'\n",
}


@pytest.mark.parametrize("data", UNSURE.values(), ids=UNSURE.keys())
def test_what_the_scan_cannot_tell_counts_as_code(data):
    assert any_in_code(data, [data.index(b".backward(")])
