"""One token pass over a file: confidence evidence (GA-GUIDE section 3) and suppression comments."""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field

from gaaudit.findings import Confidence

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
    """Tokenize once; a file that does not tokenize yields no evidence (the parser reports it)."""
    found = Evidence()
    previous: list[tokenize.TokenInfo] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            _inspect(found, token, previous)
            if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                previous = [*previous[-1:], token]
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def _inspect(found: Evidence, token: tokenize.TokenInfo, previous: list) -> None:
    line, text = token.start[0], token.string
    if token.type == tokenize.COMMENT:
        match = SUPPRESSION.search(text)
        if match:
            codes = match.group("codes")
            found.suppressions[line] = (
                frozenset(re.findall(r"[A-Z]+[0-9]+", codes.upper())) if codes else None
            )
        return
    if found.variable is None:
        what = _variable_sign(token, previous)
        if what:
            found.variable = (line, what)
    if found.fixed is None:
        what = _fixed_sign(token, previous)
        if what:
            found.fixed = (line, what)


def _variable_sign(token: tokenize.TokenInfo, previous: list) -> str | None:
    if (
        token.type == tokenize.NUMBER
        and token.string == "100"
        and previous[-1:]
        and previous[-1].string == "-"
    ):
        return "labels padded with -100"
    if token.type == tokenize.NAME and token.string in VARIABLE:
        return f"`{token.string}`"
    if token.type == tokenize.STRING and token.string.strip("\"'rbf") in VARIABLE:
        return f"`{token.string}`"
    if (
        token.type == tokenize.OP
        and token.string == "="
        and previous[-1:]
        and previous[-1].string == "padding"
    ):
        return "a `padding=` argument"
    return None


def _fixed_sign(token: tokenize.TokenInfo, previous: list) -> str | None:
    if token.type == tokenize.NAME and (token.string in FIXED or "packed" in token.string.lower()):
        return f"`{token.string}`"
    if (
        token.type == tokenize.NAME
        and token.string == "True"
        and len(previous) == 2
        and previous[0].string == "drop_last"
        and previous[1].string == "="
    ):
        return "`drop_last=True`"
    return None
