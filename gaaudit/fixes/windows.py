"""GA007 rewrites: a step test on a counter from 0 counts from 1, `(i + 1) % K == 0` (one on a
counter already raised for this micro-batch drops its `+ 1`), and so do the loop's other tests
of `i % K` after the backward (a `zero_grad` of its own); a conjunct that only delayed the
first step (`and i > 0`) goes."""

from __future__ import annotations

from gaaudit.analysis.tree import Tree
from gaaudit.checks.windows import Site
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.edits import Edits


class WindowPlanner:
    """Turns the GA007 sites of one file into edits (see `edits.Edits`)."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.edits = Edits()

    def plan(self, sites: list[Site]) -> list[Outcome]:
        outcomes = []
        for site in sites:
            counted = site.counted
            for other in site.others:
                self.edits.replace[other] = other.with_changes(left=counted)
            modulo = site.modulo.with_changes(left=counted)
            if site.conjunct is None:
                self.edits.replace[site.modulo] = modulo
            else:
                test = site.node.deep_replace(site.modulo, modulo)
                self.edits.replace[site.conjunct] = test.with_changes(
                    lpar=site.conjunct.lpar, rpar=site.conjunct.rpar
                )
            span = self.tree.span(site.conjunct or site.node)
            outcomes.append(Outcome(site, span.line, span.column, True))
        return outcomes
