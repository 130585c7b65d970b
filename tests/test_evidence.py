"""Evidence read without tokenizing equals what Python's tokenizer shows.

The reference below walks the tokens: a sign is a NAME, NUMBER, STRING or OP token in the
sequence the rules describe (comments and line breaks in between skipped), and a
suppression is a COMMENT token. f-strings count as one string, as Python 3.11 reads them.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_scripts

from gaaudit.evidence import FIXED, SUPPRESSION, VARIABLE, Evidence, scan

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT}


def tokens(text: str):
    """The tokens, each f-string as one STRING token."""
    lines = text.splitlines(keepends=True)
    stream = tokenize.generate_tokens(io.StringIO(text).readline)
    for token in stream:
        if token.type != getattr(tokenize, "FSTRING_START", None):
            yield token
            continue
        depth, end = 1, token.end
        while depth:
            inner = next(stream)
            depth += {"FSTRING_START": 1, "FSTRING_END": -1}.get(tokenize.tok_name[inner.type], 0)
            end = inner.end
        span = "".join(lines[token.start[0] - 1 : end[0]])
        tail = len(lines[end[0] - 1]) - end[1]
        string = span[token.start[1] : len(span) - tail]
        yield tokenize.TokenInfo(tokenize.STRING, string, token.start, end, token.line)


def reference(text: str) -> Evidence:
    found = Evidence()
    previous: list = []
    for token in tokens(text):
        line, string = token.start[0], token.string
        if token.type == tokenize.COMMENT:
            match = SUPPRESSION.search(string)
            if match:
                codes = match.group("codes")
                found.suppressions[line] = (
                    frozenset(re.findall(r"[A-Z]+[0-9]+", codes.upper())) if codes else None
                )
        elif found.variable is None and (what := variable(token, previous)):
            found.variable = (line, what)
        if (
            token.type != tokenize.COMMENT
            and found.fixed is None
            and (what := fixed(token, previous))
        ):
            found.fixed = (line, what)
        if token.type not in SKIPPED:
            previous = [*previous[-1:], token]
    return found


def variable(token, previous) -> str | None:
    last = previous[-1].string if previous else None
    if token.type == tokenize.NUMBER and token.string == "100" and last == "-":
        return "labels padded with -100"
    if token.type == tokenize.NAME and token.string in VARIABLE:
        return f"`{token.string}`"
    if token.type == tokenize.STRING and token.string.strip("\"'rbf") in VARIABLE:
        return f"`{token.string}`"
    if token.type == tokenize.OP and token.string == "=" and last == "padding":
        return "a `padding=` argument"
    return None


def fixed(token, previous) -> str | None:
    if token.type == tokenize.NAME and (token.string in FIXED or "packed" in token.string.lower()):
        return f"`{token.string}`"
    if (
        token.type == tokenize.NAME
        and token.string == "True"
        and [t.string for t in previous] == ["drop_last", "="]
    ):
        return "`drop_last=True`"
    return None


SNIPPETS = {
    "signs in strings and comments do not count": (
        '"""ignore_index=-100, padding=True"""\n# attention_mask, block_size\n'
        "x = 'packed'  # noqa: GA001\n"
    ),
    "string naming a sign": "mask = batch['attention_mask']\nother = f\"loss_mask\"\n",
    "prefixed strings": "a = rb'attention_mask' + U'loss_mask' + Rb'ignore_index'\n",
    "minus one hundred": "y[y == pad] = - 100\nz = -100.0\nw = -1000\nv -= 100\n",
    "padding and equality": "if padding == 'x':\n    f(padding = 'longest')\n",
    "drop_last across lines": "DataLoader(\n    ds,\n    drop_last=\n        True,\n)\n",
    "packed names": "PackedDataset(x)\nis_packed = True\nn_1packed = 2\n",
    "suppressions": "x = 1  # noqa\ny = 2  # gaaudit: ignore[GA001, GA002]\nz = '# noqa'\n",
    "fixed before variable": "block_size = 128\nattention_mask = None\n",
    "keyword before a string": 'if"attention_mask" in batch:\n    pass\n',
}


@pytest.mark.parametrize("text", SNIPPETS.values(), ids=SNIPPETS.keys())
def test_snippets(text):
    assert scan(text) == reference(text)


def test_scripts_and_sources():
    paths = [*fixture_scripts(), *FIXTURES.rglob("*.fixed.py"), *(ROOT / "gaaudit").rglob("*.py")]
    for path in paths:
        text = path.read_text(encoding="utf-8")
        assert scan(text) == reference(text), path


def test_the_reference_sees_something():
    """The comparisons above are not between two empty answers."""
    found = [reference(path.read_text()) for path in fixture_scripts()]
    assert sum(e.variable is not None for e in found) > 10
    assert sum(e.fixed is not None for e in found) > 3
    assert sum(bool(reference(text).suppressions) for text in SNIPPETS.values()) > 1
