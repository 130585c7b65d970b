"""What a file's code shows: confidence evidence (GA-GUIDE section 3) and suppression comments."""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from gaaudit.discover.lexical import literals, prefix

# Names in the data path that show valid-target counts varying between micro-batches: padding
# collators, masks, ignored labels. (A loss's `ignore_index` alone is not one: packed blocks never
# hold the ignored value.)
PADDED = {
    "DataCollatorForSeq2Seq",
    "DataCollatorForLanguageModeling",
    "DataCollatorForTokenClassification",
    "DataCollatorForCompletionOnlyLM",
    "pad_sequence",
    "loss_mask",
    "label_pad_token_id",
    "mlm_probability",
}
# Names that show padded inputs: weaker, since packed blocks carry an attention mask too.
MASKED = {"attention_mask", "DataCollatorWithPadding"}
# Names that show fixed-length, packed data, where mean/K is exact.
# (`WikiText2`: Lightning's demo dataset, `lightning.pytorch.demos`, of fixed-length blocks)
FIXED = {"memmap", "group_texts", "block_size", "ConstantLengthDataset", "WikiText2"}
# A tokenizer's padding: to each batch's longest (`True`, "longest") or to one length.
PADDING = re.compile(rb"\bpadding\s*=\s*(?P<sign>True\b|[\"'](?:longest|max_length)[\"'])")
PADDED_SIGNS = (
    (
        re.compile(
            rb"(?<!ignore_index=)(?<!ignore_index = )(?<!default=)(?<!default = )"
            rb"-\s*(?P<sign>100)(?![\w.])"
        ),
        lambda match: "labels set to -100",
    ),
    (
        re.compile(rb"\b(?P<sign>" + b"|".join(w.encode() for w in sorted(PADDED)) + rb")\b"),
        lambda match: f"`{match['sign'].decode()}`",
    ),
    (
        re.compile(
            rb"\b(?P<sign>(?:y|tgt|labels?|targets?)\w*)\[[^\]\n]*\]\s*=\s*-\s*\d+(?![\w.])"
        ),
        lambda match: f"`{match['sign'].decode()}[...] = -N` writes ignored targets",
    ),
    (PADDING, lambda match: "a tokenizer's `padding=`"),
    (  # `positions < lengths.unsqueeze(1)`: a mask of each row's own length
        re.compile(
            rb"[<>]=?\s*\(?\s*(?P<sign>\w*(?:length|lens?)\w*)(?:\s*-\s*1\s*\))?"
            rb"\s*(?:\.unsqueeze\(|\[\s*:\s*,\s*None)"
        ),
        lambda match: f"a mask of the positions within each row's `{match['sign'].decode()}`",
    ),
)
# what follows a mask of ones, which hides no position: `attention_mask=torch.ones_like(ids)`
SET_TO_ONES = rb"\s*=\s*(?:torch\.)?ones(?:_like)?\("
MASKED_SIGNS = (
    (
        re.compile(
            rb"\b(?P<sign>"
            + b"|".join(w.encode() for w in sorted(MASKED))
            + rb")\b(?!"
            + SET_TO_ONES
            + rb")"
        ),
        lambda match: f"`{match['sign'].decode()}`",
    ),
)
FIXED_SIGNS = (
    (
        re.compile(
            rb"\b(?P<sign>"
            + b"|".join(w.encode() for w in sorted(FIXED))
            + rb"|(?![0-9])\w*(?i:packed)\w*)\b"
        ),
        lambda match: f"`{match['sign'].decode()}`",
    ),
    (  # `randint(len(data) - block_size, ...)`: a window's start, short of the end by its
        # length (not `randint(0, len(rows) - 1)`, an example drawn at random)
        re.compile(
            rb"\brandint\(\s*(?:0\s*,\s*)?"
            rb"(?:len\((?:[^()\n]|\([^()\n]*\))*\)|[\w.]+\.(?:size\([^()\n]*\)|shape\[[^\]\n]*\]))"
            rb"\s*-\s*(?P<sign>(?![0-9])\w+)"
        ),
        lambda match: "random fixed-length windows drawn with `randint` over the data's length",
    ),
    (  # a collator that stacks its rows' ids as they are: rows of one length
        re.compile(
            rb"\btorch\.stack\(\s*\[\s*(?:torch\.\w+\(\s*)?\w+\[\s*(?P<sign>[\"']input_ids[\"'])"
        ),
        lambda match: "a collator's `torch.stack` of its rows' `input_ids`, as they are",
    ),
    (  # `dict(input_ids=torch.stack(batch))`: the rows themselves stacked as a batch's
        # inputs, so of one length
        re.compile(rb"[(,]\s*input_ids\s*=\s*torch\.stack\(\s*\w+\s*(?P<sign>\))"),
        lambda match: "a collator's `torch.stack` of its rows as `input_ids`, as they are",
    ),
    (  # `assert input_ids.shape == torch.Size([B, T])`: every batch of inputs has one shape
        re.compile(
            rb"\bassert\s+(?:[\w.]+\.)?(?:\w*(?:input|ids|tokens|idx)\w*|x"
            rb"|\w+\[\s*[\"']\w*(?:input|ids|tokens)\w*[\"']\s*\])"
            rb"\.(?P<sign>shape)\s*==\s*(?:torch\.Size\(\s*)?[\[(]"
        ),
        lambda match: "an `assert` that every batch of inputs has one shape",
    ),
    (  # llm.c's loaders: `x = (buf[:-1]).view(B, T)`, `y = (buf[1:]).view(B, T)`
        re.compile(rb"\[\s*(?P<sign>:\s*-\s*1)\s*\]\s*\)?\.view\(\s*\w+\s*,\s*\w+\s*\)"),
        lambda match: "inputs and targets viewed as B x T blocks of one token buffer",
    ),
)
# Rows padded to one length (`padding="max_length"`), unless others are padded to their batch's
# longest (`PADDING` to it, or these): a mean over every element then counts the same number
# in each micro-batch.
RAGGED = re.compile(rb"\b(?P<sign>pad_sequence|DataCollator\w*)(?!\w)")
# a hub dataset's id that names its rows chunked or packed to one length:
# "emozilla/pg_books-tokenized-bos-eos-chunked-65536"
CHUNKED_DATASET = re.compile(
    r"[\w.-]+/[\w.-]*(?<![a-z])(?:chunked|packed)(?![a-z])[\w.-]*", re.IGNORECASE
)
KEY_SET_TO_ONES = re.compile(rb"\s*\]" + SET_TO_ONES)  # `sample["attention_mask"] = ones(`
NEWLINE = re.compile(rb"\n")
SUPPRESSION = re.compile(
    r"#\s*(?:noqa|gaaudit:\s*ignore)(?P<codes>(?::\s*|\[)[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*\]?)?",
    re.IGNORECASE,
)


@dataclass
class Evidence:
    """What the file's tokens say about data shape, and which lines suppress which codes."""

    padded: tuple[int, str] | None = None  # (line, what) of the first sign of varying counts
    masked: tuple[int, str] | None = None  # of padded inputs (an attention mask)
    fixed: tuple[int, str] | None = None
    one_length: tuple[int, str] | None = None  # of rows padded to one length, none ragged
    module: str = ""  # the data module these signs were read in, when not the file itself
    suppressions: dict[int, frozenset[str] | None] = field(default_factory=dict)

    @property
    def shows_shape(self) -> bool:
        """Whether the code shows any sign of its data's shape: padded, masked or fixed."""
        return bool(self.padded or self.masked or self.fixed)

    @property
    def blocks(self) -> tuple[int, str] | None:
        """The sign of fixed-length blocks, where the file shows no sign of varying counts."""
        return self.fixed if self.padded is None else None

    def suppressed(self, line: int, code: str) -> bool:
        if line not in self.suppressions:
            return False
        codes = self.suppressions[line]
        return codes is None or code in codes


def scan(text: str) -> Evidence:
    """The signs in a file's code (its strings and comments told apart without tokenizing,
    see `lexical`; the first sign of each kind wins) and its suppression comments; a leading
    byte-order mark is not code."""
    data = text.removeprefix("\ufeff").encode("utf-8")
    tokens = list(literals(data))
    starts = [token.start() for token in tokens]
    newlines = [match.start() for match in NEWLINE.finditer(data)]

    def line(offset: int) -> int:
        return bisect_left(newlines, offset) + 1

    def in_code(offset: int) -> bool:
        index = bisect_right(starts, offset) - 1
        return index < 0 or offset >= tokens[index].end()

    def first(signs: list[tuple[int, str]]) -> tuple[int, str] | None:
        if not signs:
            return None
        offset, what = min(signs, key=lambda sign: sign[0])
        return line(offset), what

    def coded(patterns) -> list[tuple[int, str]]:
        return [
            (match.start("sign"), describe(match))
            for pattern, describe in patterns
            for match in pattern.finditer(data)
            if in_code(match.start())
        ]

    strings = [t for t in tokens if t.lastgroup == "string"]
    found = Evidence(
        padded=first(coded(PADDED_SIGNS) + _quoted(data, strings, PADDED)),
        masked=first(coded(MASKED_SIGNS) + _quoted(data, strings, MASKED, KEY_SET_TO_ONES)),
        fixed=first(coded(FIXED_SIGNS) + _chunked_datasets(data, strings)),
    )
    paddings = [m for m in PADDING.finditer(data) if in_code(m.start())]
    lengths = [(m.start("sign"), f"`padding={m['sign'].decode()}`") for m in paddings]
    if all(b"max_length" in m["sign"] for m in paddings) and not coded([(RAGGED, str)]):
        found.one_length = first(lengths)
    for comment in (t for t in tokens if t.lastgroup == "comment"):
        match = SUPPRESSION.search(comment.group().decode("utf-8"))
        if match:
            codes = match.group("codes")
            found.suppressions[line(comment.start())] = (
                frozenset(re.findall(r"[A-Z]+[0-9]+", codes.upper())) if codes else None
            )
    return found


def _quoted(
    data: bytes, strings: list[re.Match[bytes]], names: set[str], unless: re.Pattern | None = None
) -> list[tuple[int, str]]:
    """Where string literals naming one of `names` (`batch["loss_mask"]`) start, prefix
    included, and what they show; not those that `unless` matches right after."""
    found = []
    for string in strings:
        start = string.start()
        letters = prefix(data, start)
        literal = (letters + string.group()).decode("utf-8")
        if literal.strip("\"'rbf") in names and not (unless and unless.match(data, string.end())):
            found.append((start - len(letters), f"`{literal}`"))
    return found


def _chunked_datasets(data: bytes, strings: list[re.Match[bytes]]) -> list[tuple[int, str]]:
    """Where string literals naming a hub dataset of chunked or packed rows start, and what
    they show."""
    found = []
    for string in strings:
        literal = string.group().decode("utf-8", "replace").strip("\"'")
        if CHUNKED_DATASET.fullmatch(literal):
            found.append((string.start(), f"`{literal}`, a dataset of chunked or packed rows"))
    return found
