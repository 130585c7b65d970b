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

from gaaudit.analysis.evidence import (
    CHUNKED_DATASET,
    FIXED,
    MASKED,
    PADDED,
    SUPPRESSION,
    Evidence,
    scan,
)

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
    one_length, ragged = None, False
    stream = list(tokens(text))
    for index, token in enumerate(stream):
        line, string = token.start[0], token.string
        if token.type == tokenize.COMMENT:
            match = SUPPRESSION.search(string)
            if match:
                codes = match.group("codes")
                found.suppressions[line] = (
                    frozenset(re.findall(r"[A-Z]+[0-9]+", codes.upper())) if codes else None
                )
        else:
            if found.padded is None and (what := padded(token, previous)):
                found.padded = (line, what)
            if (
                found.masked is None
                and (what := named(token, MASKED))
                and not _set_to_ones(stream[index + 1 :], token.type == tokenize.STRING)
            ):
                found.masked = (line, what)
        if (
            token.type != tokenize.COMMENT
            and found.fixed is None
            and (what := fixed(token, previous))
        ):
            found.fixed = (line, what)
        if token.type not in SKIPPED:
            strings = [t.string for t in previous[-2:]]
            if strings == ["padding", "="] and token.string in ('"max_length"', "'max_length'"):
                one_length = one_length or (line, f"`padding={token.string}`")
            ragged = ragged or (
                (strings == ["padding", "="] and token.string in ("True", '"longest"', "'longest'"))
                or (token.type == tokenize.NAME and token.string == "pad_sequence")
                or (token.type == tokenize.NAME and token.string.startswith("DataCollator"))
            )
            previous = [*previous[-15:], token]
    found.one_length = None if ragged else one_length
    return found


def _set_to_ones(following, key: bool) -> bool:
    """Whether the tokens go on with `= ones(` or `= torch.ones_like(` (after the `]` that
    closes a `key`'s subscript): a mask of ones."""
    strings = [t.string for t in following if t.type not in SKIPPED][:6]
    if key:
        if strings[:1] != ["]"]:
            return False
        strings = strings[1:]
    if strings[:2] == ["=", "torch"] and strings[2:3] == ["."]:
        strings = ["=", *strings[3:]]
    return (
        strings[:1] == ["="] and strings[1:2] in (["ones"], ["ones_like"]) and strings[2:3] == ["("]
    )


def padded(token, previous) -> str | None:
    strings = [t.string for t in previous]
    if token.type == tokenize.NUMBER and strings[-1:] == ["-"]:
        if strings[-3:-1] == ["]", "="] and "[" in strings:
            opening = len(strings) - 1 - strings[::-1].index("[")
            inside = strings[opening + 1 : -3]
            name = previous[opening - 1] if opening else None
            if (
                name is not None
                and name.type == tokenize.NAME
                and re.fullmatch(r"(?:y|tgt|labels?|targets?)\w*", name.string)
                and "]" not in inside
                and previous[opening].start[0] == token.start[0]
            ):
                return f"`{name.string}[...] = -N` writes ignored targets"
        if (
            strings[-3:-1] not in (["ignore_index", "="], ["default", "="])
            and token.string == "100"
        ):
            return "labels set to -100"
    if what := named(token, PADDED):
        return what
    if what := _length_mask(token, strings):
        return what
    value = token.string in ("True", '"longest"', "'longest'", '"max_length"', "'max_length'")
    if value and strings[-2:] == ["padding", "="]:
        return "a tokenizer's `padding=`"
    return None


def _length_mask(token, strings: list[str]) -> str | None:
    """`< lengths.unsqueeze(` or `>= (length - 1)[:, None`: a mask of each row's length."""
    if token.string == "unsqueeze" and strings[-1:] == ["."]:
        before = strings[:-1]
    elif token.string == "None" and strings[-3:] == ["[", ":", ","]:
        before = strings[:-3]
    else:
        return None
    if before[-5:-4] == ["("] and before[-3:] == ["-", "1", ")"]:
        before = before[:-3]
    name = before[-1] if before else ""
    if before[-2:-1] == ["("]:
        before = [*before[:-2], name]
    if before[-2:-1] in (["<"], [">"], ["<="], [">="]) and re.fullmatch(
        r"\w*(?:length|lens?)\w*", name
    ):
        return f"a mask of the positions within each row's `{name}`"
    return None


def named(token, names: set[str]) -> str | None:
    if token.type == tokenize.NAME and token.string in names:
        return f"`{token.string}`"
    if token.type == tokenize.STRING and token.string.strip("\"'rbf") in names:
        return f"`{token.string}`"
    return None


def fixed(token, previous) -> str | None:
    if token.type == tokenize.NAME and (token.string in FIXED or "packed" in token.string.lower()):
        return f"`{token.string}`"
    value = token.string.strip("\"'")
    if token.type == tokenize.STRING and CHUNKED_DATASET.fullmatch(value):
        return f"`{value}`, a dataset of chunked or packed rows"
    strings = [t.string for t in previous]
    if token.type == tokenize.NAME and not token.string[0].isdigit() and _window_start(strings):
        return "random fixed-length windows drawn with `randint` over the data's length"
    if token.string in ("[", "(") and _asserted_shape([t.string for t in previous]):
        return "an `assert` that every batch of inputs has one shape"
    if token.string == ")" and _viewed_blocks(previous):
        return "inputs and targets viewed as B x T blocks of one token buffer"
    if token.string in ('"input_ids"', "'input_ids'") and _stacked_rows(strings):
        return "a collator's `torch.stack` of its rows' `input_ids`, as they are"
    if token.string == ")" and _stacked_as_inputs(strings):
        return "a collator's `torch.stack` of its rows as `input_ids`, as they are"
    return None


def _stacked_as_inputs(strings: list[str]) -> bool:
    """Whether the tokens end with `(input_ids=torch.stack(rows` (or `,` before it)."""
    head, tail = strings[:-5], strings[-5:]
    if len(tail) < 5 or tail[:4] != ["torch", ".", "stack", "("] or not tail[4].isidentifier():
        return False
    return head[-2:] == ["input_ids", "="] and head[-3:-2] in (["("], [","])


def _asserted_shape(strings: list[str]) -> bool:
    """Whether the tokens end with `assert <inputs>.shape ==` (then `torch.Size(`), where
    <inputs> is a dotted name whose last part names inputs, ids or tokens (or is `x`), or such
    a key of a subscript (`batch["input_ids"]`)."""
    if strings[-4:] == ["torch", ".", "Size", "("]:
        strings = strings[:-4]
    if strings[-3:] != [".", "shape", "=="] or "assert" not in strings:
        return False
    subject = strings[len(strings) - strings[::-1].index("assert") : -3]
    inputs = r"\w*(?:input|ids|tokens)\w*"
    if subject[-3:-2] == ["["] and subject[-1:] == ["]"]:
        key, subject = subject[-2], subject[:-3]
        if not re.fullmatch(f"[\"']{inputs}[\"']", key) or not subject:
            return False
    elif not subject or not re.fullmatch(rf"{inputs}|\w*idx\w*|x", subject[-1]):
        return False
    dotted = subject[:-1]
    return (
        all(part == "." if i % 2 else part.isidentifier() for i, part in enumerate(dotted))
        and len(dotted) % 2 == 0
    )


def _stacked_rows(strings: list[str]) -> bool:
    """Whether the tokens end with `torch.stack([row[` or `torch.stack([torch.T(row[`."""
    if strings[-1:] != ["["] or not strings[-2:-1] or not strings[-2].isidentifier():
        return False
    before = strings[:-2]
    if before[-4:-2] == ["torch", "."] and before[-2].isidentifier() and before[-1] == "(":
        before = before[:-4]
    return before[-5:] == ["torch", ".", "stack", "(", "["]


def _viewed_blocks(previous) -> bool:
    """Whether the tokens end with `[:-1]).view(B, T` (the closing parenthesis optional)."""
    strings = [t.string for t in previous]
    names = [t.type == tokenize.NAME for t in previous]
    head = ["[", ":", "-", "1", "]"]
    for tail in ([")", ".", "view", "("], [".", "view", "("]):
        n = len(head) + len(tail) + 3
        if strings[-n:-3] == head + tail and names[-3] and strings[-2] == "," and names[-1]:
            return True
    return False


def _window_start(strings: list[str]) -> bool:
    """Whether the tokens end with `randint(len(x) -`, `randint(0, a.b.size(0) -` or
    `randint(0, a.shape[0] -` (at most one level of brackets inside `len(` or `size(`)."""
    if strings[-1:] != ["-"] or strings[-2:-1] not in ([")"], ["]"]):
        return False
    depth, i = 0, len(strings) - 2
    while i >= 0:
        depth += {")": 1, "]": 1, "(": -1, "[": -1}.get(strings[i], 0)
        if depth > 2:
            return False
        if depth == 0:
            break
        i -= 1
    head = strings[:i]
    if strings[-2] == ")" and head[-1:] == ["len"]:
        return _after_randint(head[:-1])
    if (strings[-2], head[-1:]) not in ((")", ["size"]), ("]", ["shape"])):
        return False
    if head[-2:-1] != ["."] or not head[-3:-2] or not head[-3].isidentifier():
        return False
    head = head[:-3]  # back over `a.b.` before `size(` / `shape[`
    while len(head) >= 2 and head[-1] == "." and head[-2].isidentifier():
        head = head[:-2]
    return _after_randint(head)


def _after_randint(strings: list[str]) -> bool:
    """Whether the tokens end with `randint(` or `randint(0,`."""
    return strings[-2:] == ["randint", "("] or strings[-4:] == ["randint", "(", "0", ","]


SNIPPETS = {
    "signs in strings and comments do not count": (
        '"""ignore_index=-100, padding=True"""\n# attention_mask, block_size\n'
        "x = 'packed'  # noqa: GA001\n"
    ),
    "string naming a sign": "mask = batch['attention_mask']\nother = f\"loss_mask\"\n",
    "prefixed strings": "a = rb'attention_mask' + U'loss_mask' + Rb'ignore_index'\n",
    "minus one hundred": "y[y == pad] = - 100\nz = -100.0\nw = -1000\nv -= 100\n",
    "a loss's ignore_index is not a data sign": "f(x, ignore_index=-100)\ng(ignore_index = -100)\n",
    "an option's default is not a data sign": 'parser.add_argument("--ignore", default=-100)\n',
    "targets written with an ignore value": "y[row, n - 1 :] = -1\nlabels[:, :p] = -3\n",
    "other subscripts": "x[0] = -1\ny[a[0]] = -1\nlabels[i] = 1\n",
    "random windows": "i = torch.randint(len(data) - T, (B,))\nj = randint(0, n)\n",
    "random examples": (
        "i = torch.randint(len(data), (B,))\nj = random.randint(0, len(rows) - 1)\n"
        "k = randint(len(tok), labels.shape)\nm = randint(0, len(f(x)) - cut - 1)\n"
    ),
    "random crops over a size": "s = torch.randint(0, self.data.size(0) - n, (1,))\n",
    "random crops over a shape": "s = randint(0, data.shape[0] - n)\n",
    "token buffer views": "x = (buf[:-1]).view(B, T)\ny = buf[1:].view(B, T)\n",
    "stacked rows": 'ids = torch.stack(\n    [torch.LongTensor(f["input_ids"]) for f in rows]\n)\n',
    "stacked rows as they are": "ids = torch.stack([row['input_ids'] for row in rows])\n",
    "rows stacked as the inputs": "b = dict(input_ids=torch.stack(batch), labels=x)\n",
    "rows stacked as the inputs, spaced": "b = f(x, input_ids = torch.stack( rows )\n)\n",
    "other stacks of rows": (
        "input_ids = torch.stack(rows)\nb = dict(ids=torch.stack(rows))\n"
        "c = {'input_ids': torch.stack(rows)}\n"
    ),
    "other stacks": 'a = torch.stack([pad(f["input_ids"]) for f in rows])\nb = torch.stack(x["input_ids"])\n',
    "other views": "a = buf[:-1].view(-1)\nb = x[:, :-1].view(B, T)\nc = buf[: -1 ].view(n, m)\n",
    "random tokens are no crop": "x = torch.randint(0, vocab.size, (4, 8))\ny = randint(0, n.size)\n",
    "tokenizer padding only": "tok(t, padding='max_length')\nnn.Conv2d(3, 8, 3, padding=1)\n",
    "padding and equality": "if padding == 'x':\n    f(padding = 'longest')\n",
    "drop_last across lines": "DataLoader(\n    ds,\n    drop_last=\n        True,\n)\n",
    "packed names": "PackedDataset(x)\nis_packed = True\nn_1packed = 2\n",
    "suppressions": "x = 1  # noqa\ny = 2  # gaaudit: ignore[GA001, GA002]\nz = '# noqa'\n",
    "fixed before variable": "block_size = 128\nattention_mask = None\n",
    "hub datasets of chunked rows": (
        'load_dataset("org/books-tokenized-chunked-4096")\nb = "o/Packed_Chat"\n'
        'c = "someone/repacked-gguf"\nd = "data/chunk_index"\ne = "x/packed/y"\n'
    ),
    "rows of one length": "tok(t, padding='max_length')\ntok(u, padding = \"max_length\")\n",
    "rows of one length and ragged rows": (
        "tok(t, padding='max_length')\nc = DataCollatorForSeq2Seq(tok)\n"
    ),
    "ragged rows by their padding": "tok(t, padding='max_length')\ntok(u, padding=True)\n",
    "an asserted shape of ids": "assert input_ids.shape == torch.Size([b, t])\n",
    "an asserted shape of x": "assert x.shape == (4, 8)\n",
    "an asserted shape of a key": 'assert batch["input_ids"].shape == [2, 3]\n',
    "an asserted shape of an attribute": "assert self.a.tokens.shape == (1,)\n",
    "other asserted shapes": (
        "assert x.shape == y.shape\nassert logits.shape == (b, t)\nassert xs.shape == (1,)\n"
        'assert b["mask"].shape == (1,)\nif x.shape == (1,): pass\n'
    ),
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
    assert sum(e.padded is not None for e in found) > 10
    assert sum(e.fixed is not None for e in found) > 3
    shapes = [reference(text).fixed for name, text in SNIPPETS.items() if "asserted" in name]
    assert sum(bool(fixed and "assert" in fixed[1]) for fixed in shapes) == 4
    assert sum(bool(reference(text).suppressions) for text in SNIPPETS.values()) > 1
    assert sum(reference(text).one_length is not None for text in SNIPPETS.values()) > 1


def test_lightnings_demo_dataset_is_fixed_length_blocks():
    """`lightning.pytorch.demos.WikiText2` cuts one token stream into 35-token blocks."""
    text = "from lightning.pytorch.demos import WikiText2\nloader = DataLoader(WikiText2())\n"
    assert scan(text).masked is None
    assert scan(text).blocks == (1, "`WikiText2`")


def test_a_hub_dataset_of_chunked_rows_is_fixed_length_blocks():
    """A pre-tokenized dataset named for its chunks (yarn's fine-tuning script) holds rows of one
    length; a mask of ones added to it shows no padding."""
    text = (
        'parser.add_argument("--dataset", default="org/books-tokenized-chunked-4096")\n'
        'sample["attention_mask"] = torch.ones(len(sample["input_ids"]))\n'
    )
    assert scan(text).masked is None
    assert scan(text).blocks == (
        1,
        "`org/books-tokenized-chunked-4096`, a dataset of chunked or packed rows",
    )
    assert scan(text) == reference(text)


@pytest.mark.parametrize(
    "call, masked",
    [
        ('model(ids, attention_mask=batch["attention_mask"], labels=ids)', True),
        ("model(ids, attention_mask=torch.ones_like(ids), labels=ids)", False),
        ("model(ids, attention_mask = ones(ids.shape), labels=ids)", False),
        ('row[\n  "attention_mask" ] = torch.ones_like(ids)', False),
    ],
)
def test_a_mask_of_ones_is_no_sign_of_padding(call, masked):
    """A mask of ones hides no position (minimal-llama's `compute_loss`): no padding shown."""
    text = f"out = {call}\n"
    assert (scan(text).masked is not None) is masked
    assert scan(text) == reference(text)


def test_a_mask_of_each_rows_length_shows_varying_counts():
    """Positions compared with each row's length (`< lengths.unsqueeze(1)`, `>= (prompt_length
    - 1)[:, None]`) select a different number of targets in each row; a plain comparison with a
    length does not."""
    for line in (
        "keep = positions < lengths.unsqueeze(1)",
        "answer = positions >= (prompt_length - 1)[:, None]",
    ):
        assert scan(line + "\n").padded is not None, line
    assert scan("if step < max_length:\n    pass\n").padded is None
