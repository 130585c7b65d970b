"""What a file's code shows: confidence evidence (GA-GUIDE section 3) and suppression comments."""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from gaaudit.findings import Confidence
from gaaudit.lexical import literals, prefix

# Names that show valid-token counts varying between micro-batches.
VARIABLE = {
    "ignore_index",
    "DataCollatorForSeq2Seq",
    "DataCollatorForLanguageModeling",
    "DataCollatorWithPadding",
    "DataCollatorForTokenClassification",
    "pad_sequence",
    "attention_mask",
    "loss_mask",
    "label_pad_token_id",
    "mlm_probability",
}
# Names that show fixed-length, packed data, where mean/K is exact.
FIXED = {"memmap", "group_texts", "block_size"}
VARIABLE_SIGNS = (
    (re.compile(rb"-\s*(?P<sign>100)(?![\w.])"), lambda match: "labels padded with -100"),
    (
        re.compile(rb"\b(?P<sign>" + b"|".join(w.encode() for w in sorted(VARIABLE)) + rb")\b"),
        lambda match: f"`{match['sign'].decode()}`",
    ),
    (re.compile(rb"\bpadding\s*(?P<sign>=)(?!=)"), lambda match: "a `padding=` argument"),
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
    (re.compile(rb"\bdrop_last\s*=\s*(?P<sign>True)\b"), lambda match: "`drop_last=True`"),
)
NEWLINE = re.compile(rb"\n")
SUPPRESSION = re.compile(
    r"#\s*(?:noqa|gaaudit:\s*ignore)(?P<codes>(?::\s*|\[)[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*\]?)?",
    re.IGNORECASE,
)


@dataclass
class Evidence:
    """What the file's tokens say about data shape, and which lines suppress which codes."""

    variable: tuple[int, str] | None = None  # (line, what) of the first variable-length sign
    fixed: tuple[int, str] | None = None
    suppressions: dict[int, frozenset[str] | None] = field(default_factory=dict)

    def confidence(self) -> tuple[Confidence, str]:
        if self.variable is not None:
            line, what = self.variable
            return (
                Confidence.HIGH,
                f"the file shows variable valid-token counts: {what} (line {line})",
            )
        if self.fixed is not None:
            line, what = self.fixed
            return Confidence.LOW, (
                f"the file shows fixed-length data ({what}, line {line}), where mean/K is exact; "
                "it becomes wrong as soon as micro-batches hold different numbers of valid tokens"
            )
        return Confidence.MEDIUM, "the file shows neither padded nor fixed-length data"

    def suppressed(self, line: int, code: str) -> bool:
        if line not in self.suppressions:
            return False
        codes = self.suppressions[line]
        return codes is None or code in codes


def scan(text: str) -> Evidence:
    """The signs in a file's code (its strings and comments told apart without tokenizing,
    see `lexical`; the first sign of each kind wins) and its suppression comments."""
    data = text.encode("utf-8")
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

    strings = [_quoted_sign(data, t) for t in tokens if t.lastgroup == "string"]
    found = Evidence(
        variable=first(coded(VARIABLE_SIGNS) + [sign for sign in strings if sign]),
        fixed=first(coded(FIXED_SIGNS)),
    )
    for comment in (t for t in tokens if t.lastgroup == "comment"):
        match = SUPPRESSION.search(comment.group().decode("utf-8"))
        if match:
            codes = match.group("codes")
            found.suppressions[line(comment.start())] = (
                frozenset(re.findall(r"[A-Z]+[0-9]+", codes.upper())) if codes else None
            )
    return found


def _quoted_sign(data: bytes, string: re.Match[bytes]) -> tuple[int, str] | None:
    """Where a string literal naming a variable-length sign (`batch["attention_mask"]`)
    starts, prefix included, and what it shows."""
    start = string.start()
    letters = prefix(data, start)
    literal = (letters + string.group()).decode("utf-8")
    if literal.strip("\"'rbf") not in VARIABLE:
        return None
    return start - len(letters), f"`{literal}`"
