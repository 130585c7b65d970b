"""The rule catalogue: one TOML file per rule under `rules/`, shipped inside the wheel."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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


def _catalogue_dir() -> Path:
    """`gaaudit/rules` in a wheel; the checkout's top-level `rules/` when run from source."""
    shipped = Path(str(resources.files("gaaudit"))) / "rules"
    return shipped if shipped.is_dir() else Path(__file__).resolve().parent.parent / "rules"


@cache
def load() -> dict[str, Rule]:
    """Every rule of the catalogue, by code, in code order."""
    rules = {}
    for path in sorted(_catalogue_dir().glob("GA*.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        rules[data["code"]] = Rule(**data)
    return rules
