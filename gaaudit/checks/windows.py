"""GA007: an optimizer step guarded by `i % K == 0` on a counter that starts at 0 and is
tested after the backward, so the first window closes after one micro-batch (or after K + 1,
with `and i > 0`) and every later window is shifted; or by `(i + 1) % K == 0` on a counter
already raised for this micro-batch, so the first window closes after K - 1. Also a step in
the `else` of `if i % K != 0:`, whose branches each backpropagate (the stepping else)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from gaaudit import catalogue
from gaaudit.analysis.loops import Structure, Window, raises_by_one
from gaaudit.analysis.tree import Tree, assigned_value, code, keyword, last_name, positional
from gaaudit.findings import Confidence, Finding

CODE = "GA007"


@dataclass(frozen=True)
class Site:
    """A step test `i % K == 0` whose counter `i` is 0 at the first backward, or
    `(i + 1) % K == 0` whose counter is already 1 there (`ahead`); or `i % K != 0` whose
    `else` steps (`in_else`)."""

    # `i % K == 0` or `not i % K`; `i % K != 0` or `i % K` alone in_else
    node: cst.Comparison | cst.UnaryOperation | cst.BinaryOperation
    modulo: cst.BinaryOperation
    counter: cst.Name
    origin: str  # where the counter starts, in words
    confidence: Confidence
    conjunct: cst.BooleanOperation | None  # `<test> and i > 0`, which delays the first step
    window: Window
    # the loop's other tests of `i % K` after the backward (a `zero_grad` under its own `if`),
    # which must move with the step
    others: tuple[cst.BinaryOperation, ...]
    ahead: bool = False  # `(i + 1) % K` on a counter raised before the test: one ahead
    in_else: bool = False  # the step is in the `else` of `if i % K != 0:`

    code = CODE

    @property
    def first(self) -> str:
        """The number of micro-batches in the first window, in words."""
        size = code(self.modulo.right)
        if self.ahead:
            return f"{size} - 1 micro-batches"
        return f"{size} + 1 micro-batches" if self.conjunct is not None else "1 micro-batch"

    @property
    def counted(self) -> cst.BaseExpression:
        """What the test should take the modulo of: the micro-batches so far, from 1."""
        if self.ahead:
            return cst.Name(self.counter.value)
        return cst.parse_expression(f"({self.counter.value} + 1)")


class Windows:
    """The GA007 sites of one file."""

    def __init__(self, tree: Tree, structure: Structure) -> None:
        self.tree, self.structure = tree, structure

    def sites(self) -> Iterator[Site]:
        seen: set[cst.CSTNode] = set()
        for backward in self.structure.backwards():
            window = self.structure.window(backward) if backward.call is not None else None
            if window is None or window.kind not in ("modulo", "callable") or window.skips:
                continue
            site = self._site(window, backward.call)
            if site is not None and site.node not in seen:
                seen.add(site.node)
                yield site

    def _site(self, window: Window, backward: cst.Call) -> Site | None:
        modulo = self.tree.parents.get(window.size) if window.size is not None else None
        if not (
            isinstance(modulo, cst.BinaryOperation) and isinstance(modulo.operator, cst.Modulo)
        ):
            return None  # a window's last index tested (`index == K - 1`) counts from nothing
        counter, plus_one = _counter(modulo.left)
        if counter is None:
            return None
        if isinstance(window.size, cst.Integer) and window.size.evaluated_value <= 1:
            return None
        test = self.tree.parents.get(modulo)
        in_else = self.structure.window_else(window) is not None
        if in_else:
            test = window.anchor.test  # `i % K != 0`, or `i % K` alone
            if not _is_nonzero_test(test, modulo):
                return None  # the `else` steps on passes this test does not name
        elif not _is_zero_test(test, modulo):
            return None
        elif window.kind == "modulo":
            if not self.tree.contains(window.anchor.test, modulo):
                return None  # the guard tests a name assigned elsewhere
            if self.tree.order[window.anchor] < self.tree.order[backward]:
                return None  # tested before the backward: the window closes on the next pass
            orelse = window.anchor.orelse
            if orelse is not None and self.structure.steps_in(orelse):
                return None  # a step on every pass, alternating optimizers
        loop = window.loop
        if loop is None:
            return None
        started = self._start(counter, loop, window)
        if started is None:
            return None
        origin, confidence, raised = started
        if raised != plus_one:  # `i % K` from 1, or `(i + 1) % K` from 0: K in each window
            return None
        conjunct = None if raised or in_else else self._conjunct(test, counter.value)
        shown = code(modulo)
        others = tuple(
            node
            for node in self.tree.walk(loop)
            if node is not modulo
            and isinstance(node, cst.BinaryOperation)
            and isinstance(node.operator, cst.Modulo)
            and code(node) == shown
            and _is_zero_test(self.tree.parents.get(node), node)
            and self.tree.order[node] > self.tree.order[backward]
        )
        found = (test, modulo, counter, origin, confidence, conjunct, window, others)
        return Site(*found, ahead=raised, in_else=in_else)

    def _start(
        self, counter: cst.Name, loop: cst.For | cst.While, window: Window
    ) -> tuple[str, Confidence, bool] | None:
        """Where `counter` starts at 0 for the loop's first pass, if it does, and whether it is
        raised before the step test (so that it is 1 there on the first pass): the loop's own
        index (`enumerate(...)`, `range(n)`), or a name set to 0 before the loop and raised by
        1 inside it, all before or all after the step test (and maybe set to 0 again inside
        it, an evaluation starting its count over: each window after it is the first)."""
        name = counter.value
        bindings = self.tree.bindings(self.tree.scope_of(loop)).get(name, [])
        inside = [b for b in bindings if self.tree.contains(loop, b)]
        if isinstance(loop, cst.For) and _index_of(loop) == name:
            if inside:
                return None
            origin = f"`{name}` is the loop's index, from 0 ({code(loop.iter)})"
            return origin, Confidence.HIGH, False
        before = [b for b in bindings if self.tree.order[b] < self.tree.order[loop]]
        if not before or not _sets_zero(before[-1], name):
            return None
        resets = [b for b in inside if _sets_zero(b, name)]  # each starts the count again
        raises = [b for b in inside if b not in resets]
        if not raises or not all(raises_by_one(b, name) for b in raises):
            return None
        if any(self.tree.contains(window.anchor, b) for b in raises):
            return None  # raised only when the optimizer steps
        raised = {self.tree.order[b] < self.tree.order[window.anchor] for b in raises}
        if len(raised) != 1:
            return None  # raised both before and after the test
        ahead = raised.pop()
        line = self.tree.line(before[-1])
        when = "before" if ahead else "after"
        again = "".join(
            f" (set to 0 again on line {self.tree.line(reset)}, where the count starts over)"
            for reset in resets[:1]
        )
        origin = f"`{name}` is set to 0 on line {line} and raised {when} the test{again}"
        return origin, Confidence.MEDIUM, ahead

    def _conjunct(self, test: cst.BaseExpression, name: str) -> cst.BooleanOperation | None:
        """`<test> and i > 0` (or `i != 0`, `i >= 1`, `i`): what delays the first step."""
        parent = self.tree.parents.get(test)
        if not (isinstance(parent, cst.BooleanOperation) and isinstance(parent.operator, cst.And)):
            return None
        other = parent.right if parent.left is test else parent.left
        return parent if _nonzero(other, name) else None


def _counter(left: cst.BaseExpression) -> tuple[cst.Name | None, bool]:
    """The counter of a step test's `i % K` or `(i + 1) % K`, and whether it adds one."""
    if isinstance(left, cst.Name):
        return left, False
    if (
        isinstance(left, cst.BinaryOperation)
        and isinstance(left.operator, cst.Add)
        and isinstance(left.left, cst.Name)
        and isinstance(left.right, cst.Integer)
        and left.right.evaluated_value == 1
    ):
        return left.left, True
    return None, False


def _index_of(loop: cst.For) -> str | None:
    """The name of a loop's index that starts at 0: `for i, x in enumerate(xs)` (also inside
    `tqdm(enumerate(xs))`), `for i in range(n)` or `range(0, n)`."""
    iterable = loop.iter
    if isinstance(iterable, cst.Call) and last_name(iterable.func) != "enumerate":
        args = positional(iterable)
        if last_name(iterable.func) != "range" and args and isinstance(args[0], cst.Call):
            iterable = args[0]  # a progress bar around enumerate
    if not isinstance(iterable, cst.Call):
        return None
    args, function = positional(iterable), last_name(iterable.func)
    if function == "enumerate":
        start = keyword(iterable, "start") or (args[1] if len(args) > 1 else None)
        if start is not None and not _is_zero(start):
            return None
        target = loop.target
        if isinstance(target, cst.Tuple) and target.elements:
            first = target.elements[0].value
            return first.value if isinstance(first, cst.Name) else None
        return None
    if function == "range" and (len(args) == 1 or (len(args) >= 2 and _is_zero(args[0]))):
        return loop.target.value if isinstance(loop.target, cst.Name) else None
    return None


def _is_zero(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Integer) and node.evaluated_value == 0


def _is_zero_test(test: cst.CSTNode | None, modulo: cst.BinaryOperation) -> bool:
    """`i % K == 0`, `0 == i % K` or `not i % K`: true when `i` is a multiple of K."""
    if isinstance(test, cst.UnaryOperation):
        return isinstance(test.operator, cst.Not)
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    target = test.comparisons[0]
    other = target.comparator if test.left is modulo else test.left
    return isinstance(target.operator, cst.Equal) and _is_zero(other)


def _is_nonzero_test(test: cst.CSTNode, modulo: cst.BinaryOperation) -> bool:
    """`i % K != 0`, `0 != i % K` or `i % K` alone: true when `i` is not a multiple of K."""
    if test is modulo:
        return True
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    target = test.comparisons[0]
    sides = (test.left, target.comparator)
    return (
        any(side is modulo for side in sides)
        and isinstance(target.operator, cst.NotEqual)
        and any(_is_zero(side) for side in sides)
    )


def _nonzero(node: cst.BaseExpression, name: str) -> bool:
    """`i`, `i > 0`, `i != 0`, `i >= 1` or `0 < i`."""
    if isinstance(node, cst.Name):
        return node.value == name
    if not (isinstance(node, cst.Comparison) and len(node.comparisons) == 1):
        return False
    target = node.comparisons[0]
    left, operator, right = node.left, target.operator, target.comparator
    if isinstance(left, cst.Name) and left.value == name:
        bound = right
    elif isinstance(right, cst.Name) and right.value == name and isinstance(operator, cst.LessThan):
        return _is_zero(left)
    else:
        return False
    if isinstance(operator, (cst.GreaterThan, cst.NotEqual)):
        return _is_zero(bound)
    return (
        isinstance(operator, cst.GreaterThanEqual)
        and isinstance(bound, cst.Integer)
        and bound.evaluated_value == 1
    )


def _sets_zero(statement: cst.CSTNode, name: str) -> bool:
    """`name = 0`, also among others: `steps, total = 0, 0.0`."""
    return _is_zero(assigned_value(statement, name))


def findings(context) -> list[Finding]:
    """GA007 for one file."""
    rule = catalogue.load()[CODE]
    found = []
    for site in Windows(context.tree, context.structure).sites():
        test, counter = code(site.conjunct or site.node), site.counter.value
        size = code(site.modulo.right)
        line = context.tree.line(site.node)
        steps = (
            f"the `else` of `if {test}:` steps the optimizer"
            if site.in_else
            else f"`{test}` steps the optimizer after the backward"
        )
        message = (
            f"{steps} while `{counter}` already counts this micro-batch: the first window "
            f"holds {site.first} instead of {size}"
            if site.ahead
            else f"{steps} while `{counter}` counts micro-batches from 0: the first window "
            f"holds {site.first} instead of {size}, and every later window is shifted"
        )
        window = (
            f"window: the optimizer steps in the `else` of the test on line {line}, after that "
            "branch's backward"
            if site.in_else
            else f"window: the step test on line {line} follows the backward"
        )
        why = (
            "the loop's index is 0 on its first pass"
            if site.confidence is Confidence.HIGH
            else "the counter could also change out of sight"
        )
        found.append(
            Finding(
                path=context.path,
                code=CODE,
                message=message,
                span=context.tree.span(site.conjunct or site.node),
                confidence=site.confidence,
                evidence=(
                    f"counter: {site.origin}",
                    window,
                    f"confidence {site.confidence}: {why}",
                ),
                hint=rule.hint,
                fixable=True,
            )
        )
    return found
