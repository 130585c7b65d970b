"""What every checker gets for one file (`Context`), and `run`, which applies every rule family."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from gaaudit.analysis.evidence import Evidence, scan
from gaaudit.findings import Finding

if TYPE_CHECKING:  # the repository-level GA006 pass imports this package without libcst
    from gaaudit.analysis.loops import Structure
    from gaaudit.analysis.repository import Imports
    from gaaudit.analysis.tree import Tree
    from gaaudit.discover.modules import Dependency


@dataclass
class Context:
    """What every checker gets for one file."""

    tree: Tree
    path: str
    text: str  # the whole file, even where the tree was focused
    accumulation_names: frozenset[str]
    directory: Path  # the file's folder, where config files it names are looked up

    @cached_property
    def evidence(self) -> Evidence:
        """Data-shape evidence and suppressions, tokenized only when a rule asks; where the
        file shows nothing of its data's shape, that of the data module it imports."""
        return self.imports.data_evidence(scan(self.text))

    @cached_property
    def imports(self) -> Imports:
        """Helpers imported from other modules of the repository, summarised when a rule asks."""
        from gaaudit.analysis.repository import Imports

        return Imports(self.tree, self.directory, name=Path(self.path).name)

    @cached_property
    def structure(self) -> Structure:
        """Backward calls, optimizer steps and their windows, shared by the rules that read them."""
        from gaaudit.analysis.loops import Structure

        return Structure(
            self.tree, self.accumulation_names, self.directory, self.imports.dependencies
        )

    @property
    def dependencies(self) -> frozenset[Dependency]:
        """The other files these findings depend on (see `repository.current`)."""
        imports = self.__dict__.get("imports")
        return frozenset(imports.dependencies) if imports is not None else frozenset()


Checker = Callable[[Context], Iterable[Finding]]

# Modules exposing `findings(context)`, imported only when a file reaches analysis.
CHECKERS = (
    "gaaudit.checks.accumulation",
    "gaaudit.checks.trainer",
    "gaaudit.checks.optax",
    "gaaudit.checks.versions",
    "gaaudit.checks.windows",
)


def run(context: Context) -> list[Finding]:
    found: list[Finding] = []
    for name in CHECKERS:
        found.extend(import_module(name).findings(context))
    return sorted(found, key=lambda f: f.sort_key)
