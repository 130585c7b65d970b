"""The rule catalogue: one TOML file per rule under `rules/`, shipped inside the wheel."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DOCS_URL = "https://github.com/gaaudit/gaaudit#rules"


@dataclass(frozen=True)
class Rule:
    """A rule's documentation and examples, as written in `rules/<CODE>.toml`."""

    code: str
    name: str
    severity: str
    summary: str
    what: str
    why: str
    hint: str
    bad: str
    good: str
    fixed: str = ""  # what `gaaudit fix` makes of `bad`; empty when the rule has no codemod

    @property
    def help_uri(self) -> str:
        return f"{DOCS_URL}-{self.code.lower()}"


def toml():
    """The TOML parser (tomli before Python 3.11), imported when first needed: a run that
    reads no TOML does not pay for it."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib


def catalogue_dir() -> Path:
    """`gaaudit/rules` in a wheel; the checkout's top-level `rules/` when run from source."""
    shipped = Path(__file__).resolve().parent / "rules"
    return shipped if shipped.is_dir() else Path(__file__).resolve().parent.parent / "rules"


@cache
def codes() -> tuple[str, ...]:
    """The catalogue's rule codes, in order, read from its file names (nothing parsed)."""
    return tuple(sorted(path.stem for path in catalogue_dir().glob("GA*.toml")))


@cache
def load() -> dict[str, Rule]:
    """Every rule of the catalogue, by code, in code order."""
    rules = {}
    for path in sorted(catalogue_dir().glob("GA*.toml")):
        data = toml().loads(path.read_text(encoding="utf-8"))
        rules[data["code"]] = Rule(**data)
    return rules
