"""Read each window's micro-batches ahead of its backward (GA-GUIDE section 5).

Where one division at the step cannot fix a window (a term added beside the mean, gradients
clipped after every micro-batch), the loop counts a window's valid targets before it runs it,
and each micro-batch backpropagates its mean times its share of that count: the window's
gradient is the token mean at every backward, in the original's magnitude.
"""

from __future__ import annotations

import re

import libcst as cst

from gaaudit.analysis.loops import cleared_around, raises_by_one, run_again, runs_once
from gaaudit.analysis.tree import (
    ATOMS,
    assigned_value,
    bound_afresh,
    code,
    dotted,
    last_name,
    parameter_names,
    positional,
    substituted,
    target_names,
    variables,
)
from gaaudit.checks.accumulation import Site
from gaaudit.checks.versions import admits
from gaaudit.discover.modules import imported_elsewhere
from gaaudit.fixes.edits import (
    Unfixable,
    atom,
    indented,
    parsed_statements,
    runs_again,
    statement_line,
    with_argument,
    with_parameter,
)
from gaaudit.vocabulary import MOVERS

AHEAD_NOTE = "# read ahead: each micro-batch's share of its window's valid targets, before backward"
SAME_ELEMENTS = {  # a rebinding that keeps each element where it was, so the count
    "to", "cuda", "cpu", "long", "int", "float", "double", "half", "bfloat16", "detach", "clone",
    "contiguous",
}  # fmt: skip
ACCELERATE_WINDOW = (  # accelerate#3630: DeepSpeed's boundary set from `sync_gradients`
    "assumes accelerate before 1.8, whose `backward` lets the DeepSpeed engine end each window "
    "of its `gradient_accumulation_steps` micro-batches; from 1.8 on, outside "
    "`accelerator.accumulate()`, every micro-batch is a step of its own"
)
ONLY_NOTE = "# read ahead: the count alone, for the window's share, before it runs"
COUNT_ONLY = "count_only"  # the helper's parameter that asks it for that count alone
READER, SHARE = "read_ahead", "window_share"  # the names it adds, suffixed where taken
LOCALS = ("items", "pending", "item", "count", "total")  # the read-ahead functions' own names


class _ReadAhead:
    """Part of `Planner`: the loop reads each window ahead and weights each micro-batch's mean
    by its share of the window's count; the user's names keep what they held."""

    def _read_ahead(self, site: Site, count: str, blocker: str, siblings: list[Site]) -> None:
        """Rewrite `site`'s loop to read its windows ahead (weighting the backward at `site`
        and at each of its `siblings`), or raise `blocker` and why not."""
        try:
            self._plan_read_ahead(site, count, siblings)
        except Unfixable as exc:
            raise Unfixable(f"{blocker}; reading the window ahead: {exc}") from None

    def _plan_read_ahead(self, site: Site, count: str, siblings: list[Site]) -> None:
        window, engine = site.window, self._engine(site)
        loop, last = self._engine_loop(site, engine) if engine else (window.loop, None)
        stepping = window.kind == "callable"  # `loss_scaler(loss, opt, update_grad=i % k == 0)`
        if not (engine or stepping) and not (
            window.kind == "modulo" and isinstance(window.anchor, cst.If) and not window.skips
        ):
            raise Unfixable("the step is not guarded by a test of the loop's own counter")
        if not (isinstance(loop, cst.For) and loop.asynchronous is None):
            raise Unfixable("the micro-batches are not drawn by a `for` loop")
        if window.anchor in self._prepared or window.anchor in self._ahead_windows:
            raise Unfixable("the window backpropagates more than one loss")
        if count == self.micro and self.asked is None:
            weigh = "" if engine else ", and backpropagate its mean times its share of their sum"
            raise Unfixable(
                f"the count is taken inside the loop: {self.counted_inside}; count each "
                f"micro-batch's valid targets from its batch before the window runs{weigh}"
            )
        if self._framework_factor(site) or self._backward_owner(site, "fabric"):
            raise Unfixable("the backward divides by the accumulation steps itself")
        if not _plain_target(loop.target):
            raise Unfixable(f"the loop's target `{code(loop.target)}` is not plain names")
        targets = target_names(loop.target)
        counters: list[cst.AugAssign] = []  # `step += 1` of the guard's counter, raised ahead
        if engine:  # DeepSpeed's own boundary test, written by the reader
            guard = None
        elif not self._every_item_reaches(statement_line(self.tree, window.anchor), loop):
            raise Unfixable("not every micro-batch reaches the step's guard")
        else:
            test = (
                self.auditor.structure.stepping_flag(window.anchor)
                if stepping
                else window.anchor.test
            )
            guard = self._ahead_of(test, loop, targets, False, window.anchor, counters)
            if isinstance(test, cst.Name):  # `if boundary:`, its value inlined
                guard = guard.with_changes(lpar=[], rpar=[])
        if count == self.micro:  # its loss helper builds the targets: asked, it counts them
            counted = self._counted_by_helper(site, loop, targets)
        else:
            counted = self._ahead_of(
                cst.parse_expression(count), loop, targets, True, site.backward.call
            ).visit(_Unmoved())
        divisor = site.division.divisor if site.division is not None else None
        if site.kind == "gradient-division":
            raise Unfixable("the gradients are divided, not the loss")
        if divisor is not None and self._bound_in(  # the backward undoes it as it stands there
            loop, variables(divisor), after=site.division.node, before=site.backward.call
        ):
            raise Unfixable(
                f"a name the divisor `{code(divisor)}` reads is bound again between the loss's "
                "division and its backward"
            )
        share = self._fresh(SHARE)
        term = self._weighted_term(site, share, loop)
        last = last or site.backward.call  # the engine counts a micro-batch at its step
        if self._skips_before(last, loop) and not self.unsafe:
            raise Unfixable(
                "unsafe fix (a micro-batch the loop skips with `continue` before "
                f"`{code(last.func)}(...)` still counts in its window); apply with --unsafe-fixes"
            )
        if engine and self._accelerator(site) and not self.unsafe and not self._older_accelerate():
            raise Unfixable(
                f"unsafe fix ({ACCELERATE_WINDOW}); apply with --unsafe-fixes, or pin "
                "`accelerate<1.8` in the project's requirements"
            )
        outer = None if engine else self._carried_into(site, loop, test)
        if outer is not None and not self.unsafe:
            raise Unfixable(
                f"unsafe fix ({runs_again(self.tree, outer, loop)} and does not clear the "
                "gradients between its passes, so a pass's last window, cut short, goes on into "
                "the next pass's first; reading ahead counts the two parts as two windows, right "
                "only where every pass holds whole windows (a loader whose length is a multiple "
                "of the accumulation steps)); apply with --unsafe-fixes, or step or clear the "
                "gradients after each pass"
            )
        counter = None if engine else self._spans_calls(site, loop, test)
        if counter is not None and not self.unsafe:
            raise Unfixable(
                f"unsafe fix ({self._spanning(loop, counter)}; reading ahead one call at a "
                "time counts the two parts of such a window as two windows); apply with "
                "--unsafe-fixes, or step or clear the gradients at the end of each pass"
            )
        self.edits.replace[site.backward.loss] = term
        for sibling in siblings:  # `if fp16: optimizer.backward(loss)` / `else: loss.backward()`
            self.edits.replace[sibling.backward.loss] = self._weighted_term(sibling, share, loop)
        reader = self._write_reader(site, loop, guard, counted, targets, counters)
        self.edits.replace[loop.target] = cst.parse_expression(f"{_packed(loop.target)}, {share}")
        self.edits.replace[loop.iter] = cst.parse_expression(
            f"{reader}({code(loop.iter)}{_handed(counters)})"
        )
        self._ahead_windows.add(window.anchor)

    def _counted_by_helper(self, site: Site, loop: cst.For, targets: set[str]) -> cst.Call:
        """The reader's count of a micro-batch whose loss the loop's call of a same-file helper
        makes from targets it builds itself (`compute_loss(model, batch)` tokenising the batch's
        texts): the helper gains `count_only=False` and, asked, returns the count just before
        its forward; the reader makes the loop's call so. Unsafe: what the helper does before
        its forward then runs twice for each micro-batch, once when the window is drawn."""
        call, count, edits = self.asked
        helper = self.auditor.tracer.helper(call.value.func)
        name, source = helper.name.value, site.origin.source
        if COUNT_ONLY in parameter_names(helper):
            raise Unfixable(f"`{name}` already takes a `{COUNT_ONLY}` parameter")
        counted = cst.parse_expression(count).visit(_Unmoved())
        loss = forward = self._top_statement(helper, source)
        for read in variables(source) - variables(cst.parse_expression(count)):  # `outputs`
            binding = self.auditor.tracer.binding(read, source)
            if binding is not None and self.tree.contains(helper.body, binding):
                forward = min(
                    forward, self._top_statement(helper, binding), key=self.tree.order.get
                )
        first, last = self.tree.order[forward], self.tree.order[loss]
        bound = self.tree.bindings(helper)
        for read in sorted(variables(counted)):  # complete before the forward, kept through it
            for statement in helper.body.body:
                at = self.tree.order[statement]
                sets = any(
                    self.tree.contains(statement, b) and at >= first for b in bound.get(read, ())
                )
                if sets or first < at < last and read in _mentioned(self.tree, statement):
                    raise Unfixable(
                        f"the count `{code(counted)}` reads `{read}`, which `{name}()` sets on "
                        f"line {self.tree.line(statement)}, not before its loss is made (line "
                        f"{self.tree.line(forward)}), so it cannot count a micro-batch ahead of "
                        "its window; count each micro-batch's valid targets from its batch"
                    )
        if not self.unsafe:
            raise Unfixable(
                f"unsafe fix (`{name}()` builds its targets itself: the window is counted by "
                f"calling it with `{COUNT_ONLY}=True` as each micro-batch is drawn, which runs its "
                f"statements before line {self.tree.line(forward)} once more per micro-batch, "
                "ahead of the window; right where they only read the batch and arguments the "
                "loop does not change in the window, and draw nothing at random); apply with "
                "--unsafe-fixes"
            )
        self.edits = edits  # the loop's own call stays as it was
        self.edits.replace[helper.params] = with_parameter(helper.params, COUNT_ONLY, "False")
        self.edits.insert_before(
            forward, f"{ONLY_NOTE}\nif {COUNT_ONLY}:\n    return {code(counted)}\n"
        )
        asked = with_argument(_one_line(call.value), COUNT_ONLY, "True")
        return self._ahead_of(asked, loop, targets, True, site.backward.call)

    def _top_statement(self, function: cst.FunctionDef, node: cst.CSTNode) -> cst.CSTNode:
        """The statement of `function`'s own body that holds `node`."""
        return next(
            a
            for a in (node, *self.tree.ancestors(node))
            if self.tree.parents.get(a) is function.body
        )

    def _older_accelerate(self) -> bool:
        """Whether the file's requirements keep its accelerate before 1.8 (`ACCELERATE_WINDOW`):
        a pin of accelerate, or of torch before 2.0 (accelerate's releases from 1.8 on require
        torch 2.0 or later)."""
        return self.path is not None and any(
            not admits(self.path, release, package)[0]
            for package, release in (("accelerate", "1.8"), ("torch", "2.0"))
        )

    def _write_reader(
        self,
        site: Site,
        loop: cst.For,
        guard: cst.BaseExpression | None,
        counted: cst.BaseExpression,
        targets: set[str],
        counters: list[cst.AugAssign],
    ) -> str:
        """Write the generator that reads the loop's windows ahead just above the loop, with a
        blank line on either side; its name. With no `guard`, a DeepSpeed engine's windows;
        the guard's `counters` are handed in as the loop starts and raised for each item."""
        reader, shares = self._fresh(READER), self._fresh(f"{SHARE}s")
        engine = self._engine(site)
        taken = variables(counted) | targets | (variables(guard) if guard else {engine})
        items, pending, item, each, total = (_free(name, taken) for name in LOCALS)
        target, packed = code(loop.target), _packed(loop.target)
        bound = ""  # an engine reached through attributes is named once, in the reader
        if engine:
            device, named = f"{engine}.device", engine
            if "." in engine:
                named = _free("engine", taken | {items, pending, item, each, total})
                bound = f"    {named} = {engine}\n"
            guard = cst.parse_expression(
                f"({named}.micro_steps + len({pending})) "
                f"% {named}.gradient_accumulation_steps() == 0"
            )
        else:
            device = self._device(self._optimizer(site.window))
        gather, world = self._gathering(site, device, [total])
        gather = indented(gather)
        per_process = f" / {world}" if world else ""  # the processes' gradients are averaged
        if engine:  # the engine divides by its steps: a window cut short by the epoch weighs less
            per_process += f" / len({pending})"
        functions = parsed_statements(
            f"{AHEAD_NOTE}\n"
            f"def {reader}({items}{_handed(counters)}):\n" + bound + f"    {pending} = []\n"
            f"    for {target} in {items}:\n"
            + "".join(f"        {code(c)}\n" for c in counters)
            + f"        {pending}.append(({packed}, {code(counted)}))\n"
            f"        if {code(guard)}:\n"
            f"            yield from {shares}({pending})\n"
            f"            {pending} = []\n"
            f"    if {pending}:\n"
            f"        yield from {shares}({pending})\n"
            f"def {shares}({pending}):\n"
            f"    {total} = sum({each} for _, {each} in {pending})\n"
            + gather
            + f"    {total} = max(float({total}), 1.0){per_process}\n"
            f"    return [({item}, {each} / {total}) for {item}, {each} in {pending}]\n"
        )
        blank = cst.EmptyLine(indent=False)
        last = functions[1]
        functions[1] = last.with_changes(
            leading_lines=[blank], body=last.body.with_changes(footer=[blank])
        )
        line = statement_line(self.tree, loop)
        opens = getattr(self.tree.parents.get(line), "body", (line,))[0] is line
        if not opens and not (line.leading_lines and line.leading_lines[0].comment is None):
            first = functions[0]
            functions[0] = first.with_changes(leading_lines=[blank, *first.leading_lines])
        self.edits.before.setdefault(line, []).extend(functions)
        return reader

    def _carried_into(
        self,
        site: Site,
        loop: cst.For | cst.While,
        test: cst.BaseExpression | None,
        start: cst.CSTNode | None = None,
    ) -> cst.For | cst.While | None:
        """The loop that runs `start` (by default `loop`) again (`run_again`: around it, or
        around a same-file call of its function) whose next pass goes on with the window a
        pass's end cut short, its gradients left in place; None if there is none or the step's
        `test` also holds at a pass's last micro-batch (`or i == len(loader) - 1`). (A DeepSpeed
        engine's window goes on by its own count of micro-steps, which the reader follows: each
        part then weighs as its micro-batches do in the original.)"""
        if _steps_at_end(test, loop):
            return None
        optimizer = self._optimizer(site.window)
        return run_again(self.tree, start or loop, lambda node: self._clears(node, optimizer))

    def _spans_calls(
        self,
        site: Site,
        loop: cst.For | cst.While,
        test: cst.BaseExpression | None,
        start: cst.CSTNode | None = None,
    ) -> str | None:
        """The counter the step's `test` reads that the loop raises and that outlives the loop's
        function (an attribute, a global, a parameter: nothing the function binds before
        `start`, by default `loop`), where a pass neither clears the gradients
        (`cleared_around`) nor ends on a step (`_steps_at_end`, by a test that reads no such
        counter: `self.step == len(loader) - 1` holds in the first call only): the windows then
        span calls of the function, whoever calls it, in this file or another; else None, also
        where the function runs once a process (`runs_once`, and no file of the project imports
        this one: FiD's `train(..., step, ...)` called from `__main__`)."""
        function, start = self.tree.scope_of(loop), start or loop
        optimizer = self._optimizer(site.window)
        if (
            test is None
            or not isinstance(function, cst.FunctionDef)
            or cleared_around(self.tree, start, lambda node: self._clears(node, optimizer))
            or self._runs_once(function)
        ):
            return None
        raised = {
            code(node.target)
            for node in self.tree.walk(loop.body, into_defs=False)
            if isinstance(node, cst.AugAssign)
        }
        reset = {
            name
            for node in self.tree.assignments
            if self.tree.contains(function, node) and self.tree.order[node] < self.tree.order[start]
            for name in bound_afresh(node)
        }

        def counters(expr: cst.BaseExpression) -> list[str]:
            return [
                code(node)
                for node in self.tree.walk(expr)
                if isinstance(node, (cst.Name, cst.Attribute)) and code(node) in raised - reset
            ]

        ends = [term for term in _disjuncts(test) if _steps_at_end(term, loop)]
        found = counters(test)
        return found[0] if found and all(counters(term) for term in ends) else None

    def _runs_once(self, function: cst.FunctionDef) -> bool:
        """Whether `function` runs once a process: once from the script's `__main__` block,
        in a file no other file of its project imports."""
        return (
            self.path is not None
            and runs_once(self.tree, function)
            and not imported_elsewhere(self.path)
        )

    def _spanning(self, loop: cst.CSTNode, counter: str) -> str:
        """Says that the step's counter (`_spans_calls`) carries windows across calls."""
        function = self.tree.scope_of(loop).name.value
        return (
            f"the step's guard reads `{counter}`, which `{function}()` raises and does not reset "
            "before its loop, and nothing clears the gradients at the end of a pass: a call's "
            f"last window, cut short, goes on into the next call of `{function}()`"
        )

    def _engine_loop(self, site: Site, engine: str) -> tuple[cst.For, cst.Call]:
        """The loop whose every micro-batch a DeepSpeed engine backpropagates and steps, and
        the call that steps it: `engine.step()`, or `accelerator.backward(loss)` itself."""
        call = site.backward.call
        scope = self.tree.scope_of(call)
        loop = next(
            (a for a in self.tree.ancestors(call) if a is scope or isinstance(a, cst.For)), None
        )
        if not isinstance(loop, cst.For):
            raise Unfixable("the backward is not in a `for` loop over the micro-batches")
        steps = [
            node
            for node in self.tree.walk(loop.body, into_defs=False)
            if isinstance(node, cst.Call) and code(node.func) == f"{engine}.step"
        ]
        if self._accelerator(site):  # its DeepSpeed wrapper steps the engine after the backward
            steps = [call, *steps]
        if len(steps) != 1:
            raise Unfixable(f"the loop calls `{engine}.step()` {len(steps)} times, not once")
        for node in (call, steps[0]):
            if not self._every_item_reaches(statement_line(self.tree, node), loop):
                raise Unfixable(f"not every micro-batch reaches `{code(node.func)}(...)`")
        return loop, steps[0]

    def _weighted_term(self, site: Site, share: str, loop: cst.For) -> cst.BaseExpression:
        """What the backward takes instead of the user's loss: the mean weighted by its share
        where it was divided by K, any other term of the sum divided as the user divided it."""
        loss = site.backward.loss
        divisor = site.division.divisor if site.division is not None else None
        if not site.origin.added and site.division is not None and site.division.node is loss:
            term = cst.parse_expression(f"{atom(loss.left)} * {share}")  # `(x / K).backward()`
        elif not site.origin.added:
            text = code(loss) if isinstance(loss, ATOMS) else f"({code(loss)})"
            undone = f" * {atom(divisor)}" if divisor is not None else ""
            term = cst.parse_expression(f"{text} * {share}{undone}")
        else:
            summed, mean = self._mean_term(site, loop)
            if self._bound_in(loop, variables(summed), after=summed, before=site.backward.call):
                raise Unfixable("the loss's terms are rebound before the backward")
            rest = _without(summed, mean, self.tree)
            divided = f"{_factor(rest)} / {atom(divisor)}" if divisor is not None else code(rest)
            term = cst.parse_expression(f"{_factor(mean)} * {share} + {divided}")
        if isinstance(self.tree.parents.get(loss), cst.Attribute):  # `(...).backward()`
            term = term.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return term

    def _mean_term(
        self, site: Site, loop: cst.For
    ) -> tuple[cst.BaseExpression, cst.BaseExpression]:
        """The sum that was divided by K, and its term that holds the mean: the mean itself
        (`res.loss` of `loss = res.loss + res.aux_loss; loss = loss / k`) or times a weight
        the loop leaves alone (`lm_loss * args.lm_coef`)."""
        division = site.division.node if site.division is not None else None
        if isinstance(division, cst.BinaryOperation):
            summed = division.left
        elif isinstance(division, cst.AugAssign):
            summed = division.target
        else:
            summed = site.backward.loss
        summed, source = self._value_of(summed), site.origin.source

        def mean(expr: cst.BaseExpression) -> bool:
            return expr is source or self._value_of(expr) is source

        for term in _added_terms(summed):
            if mean(term):
                return summed, term
            if isinstance(term, cst.BinaryOperation) and isinstance(term.operator, cst.Multiply):
                for factor, weight in ((term.left, term.right), (term.right, term.left)):
                    if mean(factor) and not self._bound_in(loop, variables(weight)):
                        return summed, term
        raise Unfixable("the mean enters the loss in a way other than a weighted term")

    def _value_of(self, expr: cst.BaseExpression) -> cst.BaseExpression:
        """What a name was bound to (`a + b` for `loss` of `loss = a + b`, `x` for `lm` of
        `lm, mc = x, y`), else `expr`."""
        if not isinstance(expr, cst.Name):
            return expr
        value = assigned_value(self.auditor.tracer.binding(expr.value, expr), expr.value)
        return expr if value is None else value

    def _ahead_of(
        self,
        expr: cst.BaseExpression,
        loop: cst.For,
        targets: set[str],
        counted: bool,
        before: cst.CSTNode,
        counters: list[cst.AugAssign] | None = None,
    ) -> cst.BaseExpression:
        """`expr` written in the loop's target and the names the loop leaves alone; a local
        every micro-batch binds once from them before `before` is inlined (its moves to a
        device dropped, for a count). A counter every micro-batch raises once before `before`
        (`step += 1`) is kept and its raise added to `counters`, where they are taken."""

        def replace(name: cst.Name) -> cst.BaseExpression | None:
            bound = self._bindings_in(loop, name.value)
            if not bound:
                return None
            if name.value in targets:
                if counted and all(_moves(b, name.value) for b in bound):
                    return None
                raise Unfixable(f"the loop rebinds `{name.value}`, which the {what} reads")
            (binding, *more) = bound
            if (
                counters is not None
                and not more
                and raises_by_one(binding, name.value)
                and self._every_item_reaches(binding, loop)
                and not self._skips_before(binding, loop)
                and self.tree.order[binding] < self.tree.order[before]
            ):
                counters.extend([] if binding in counters else [binding])
                return None
            index = _unpacked(binding, name.value)
            if (
                more
                or not (_single(binding, name.value) or index is not None)
                or not self._every_item_reaches(binding, loop)
                or self.tree.order[binding] > self.tree.order[before]
            ):
                raise Unfixable(f"the {what} reads `{name.value}`, which the loop computes")
            value = unmoved(binding.value) if counted else binding.value
            if index is not None:  # `ids, labels, *_ = batch`: `batch[1]`
                value = cst.parse_expression(f"{atom(value)}[{index}]")
            return self._ahead_of(value, loop, targets, counted, before)

        what = "count" if counted else "step's guard"
        computed = {  # `self.step += 1`: the reader, drawing ahead, would read it stale
            name for name in self.tree.assigned_in(loop.body) if "." in name
        }
        for node in self.tree.walk(expr):
            if isinstance(node, cst.Attribute) and code(node) in computed:
                raise Unfixable(f"the {what} reads `{code(node)}`, which the loop computes")
        return substituted(expr, replace)

    def _bindings_in(self, loop: cst.For, name: str) -> list[cst.CSTNode]:
        scope = self.tree.scope_of(loop)
        return [
            b for b in self.tree.bindings(scope).get(name, ()) if self.tree.contains(loop.body, b)
        ]

    def _bound_in(
        self,
        loop: cst.For,
        names: set[str],
        after: cst.CSTNode | None = None,
        before: cst.CSTNode | None = None,
    ) -> bool:
        """Whether the loop binds one of `names` (between `after` and `before`, if given)."""
        for name in names:
            for binding in self._bindings_in(loop, name):
                where = self.tree.order[binding]
                if after is not None and not (
                    self.tree.order[after] < where < self.tree.order[before]
                ):
                    continue
                return True
        return False

    def _every_item_reaches(self, statement: cst.CSTNode, loop: cst.For) -> bool:
        """Whether a statement sits in the loop's body but for `try` and `with` blocks."""
        for node in self.tree.ancestors(statement):
            if node is loop:
                return True
            if not isinstance(
                node, (cst.IndentedBlock, cst.Try, cst.With, cst.SimpleStatementLine)
            ):
                return False
        return False

    def _skips_before(self, statement: cst.CSTNode, loop: cst.For) -> bool:
        """A `continue` of this loop before `statement` (the backward, a counter's raise)."""
        for node in self.tree.walk(loop.body, into_defs=False):
            if (
                isinstance(node, cst.Continue)
                and self.tree.order[node] < self.tree.order[statement]
            ):
                inner = next(
                    a for a in self.tree.ancestors(node) if isinstance(a, (cst.For, cst.While))
                )
                if inner is loop:
                    return True
        return False


def _added_terms(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The terms a sum adds with weight 1: `a` and `b` of `a + b - c`."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        return [*_added_terms(expr.left), *_added_terms(expr.right)]
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract):
        return _added_terms(expr.left)
    return [expr]


def _without(summed: cst.BaseExpression, term: cst.BaseExpression, tree) -> cst.BaseExpression:
    """`summed` with one of its added terms left out: `b` of `a + b` for `a`, `-c` of
    `a - c`."""
    if not isinstance(summed, cst.BinaryOperation):
        return summed
    subtract = isinstance(summed.operator, cst.Subtract)
    if summed.left is term:
        return cst.UnaryOperation(cst.Minus(), summed.right) if subtract else summed.right
    if summed.right is term:
        return summed.left
    side = "left" if tree.contains(summed.left, term) else "right"
    return summed.with_changes(**{side: _without(getattr(summed, side), term, tree)})


def _disjuncts(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The operands of a test's `or`s: `a` and `b` of `a or b`."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        return [*_disjuncts(test.left), *_disjuncts(test.right)]
    return [test]


def _steps_at_end(test: cst.BaseExpression | None, loop: cst.For | cst.While) -> bool:
    """Whether the step's `test` also holds at a pass's last micro-batch (`or i ==
    len(loader) - 1`)."""
    return (
        test is not None
        and isinstance(loop, cst.For)
        and any(_at_length(term, loop) for term in _disjuncts(test))
    )


def _at_length(term: cst.BaseExpression, loop: cst.For) -> bool:
    """`i == len(loader) - 1` (an equality reading the length of what the loop draws from,
    also through a progress bar: `enumerate(tqdm(loader))`)."""
    items = loop.iter
    while (
        isinstance(items, cst.Call)
        and last_name(items.func) in ("enumerate", "tqdm")
        and items.args
    ):
        items = items.args[0].value
    return (
        isinstance(term, cst.Comparison)
        and all(isinstance(c.operator, cst.Equal) for c in term.comparisons)
        and f"len({code(items)})" in code(term)
    )


def _factor(term: cst.BaseExpression) -> str:
    """A term's code as the left factor of a product."""
    if isinstance(term, cst.BinaryOperation) and isinstance(term.operator, cst.Multiply):
        return code(term)
    return atom(term)


def _packed(target: cst.BaseExpression) -> str:
    """The loop's target as one value: `(step, batch)` for `step, batch`."""
    return f"({code(target)})" if isinstance(target, cst.Tuple) else code(target)


def _plain_target(target: cst.BaseExpression) -> bool:
    if isinstance(target, (cst.Tuple, cst.List)):
        return all(_plain_target(e.value) for e in target.elements)
    if isinstance(target, cst.StarredElement):
        return _plain_target(target.value)
    return isinstance(target, cst.Name)


def _handed(counters: list[cst.AugAssign]) -> str:
    """The counters the reader is handed after the items, as they stand when the loop starts."""
    return "".join(f", {code(c.target)}" for c in counters)


def _single(binding: cst.CSTNode, name: str) -> bool:
    """`name = value`, one plain target."""
    return (
        isinstance(binding, cst.Assign)
        and len(binding.targets) == 1
        and isinstance(binding.targets[0].target, cst.Name)
        and binding.targets[0].target.value == name
    )


def _unpacked(binding: cst.CSTNode, name: str) -> int | None:
    """`i` where `binding` unpacks one value into names and `name` is its `i`-th, before any
    starred one (`ids, labels, *_ = batch`: 1 for `labels`); else None."""
    if not (isinstance(binding, cst.Assign) and len(binding.targets) == 1):
        return None
    target = binding.targets[0].target
    if not isinstance(target, (cst.Tuple, cst.List)):
        return None
    for index, element in enumerate(target.elements):
        if not isinstance(element.value, cst.Name) or isinstance(element, cst.StarredElement):
            return None
        if element.value.value == name:
            return index
    return None


def _moves(binding: cst.CSTNode, name: str) -> bool:
    """`name = name.to(device)`, `name = to_device(name, device)`, or
    `name = {k: v.cuda() for k, v in name.items()}` or `name = tuple(t.cuda() for t in name)`:
    the same elements, moved or cast."""
    if not _single(binding, name):
        return False
    value = unmoved(binding.value)
    return isinstance(value, cst.Name) and value.value == name and value is not binding.value


def unmoved(value: cst.BaseExpression) -> cst.BaseExpression:
    """`value` without its outer moves and casts: `batch["labels"]` for
    `batch["labels"].to(device)`, `batch` for `to_device(batch, device)`, for
    `{k: v.cuda() for k, v in batch.items()}` and for `tuple(t.cuda() for t in batch)`."""
    while True:
        func = value.func if isinstance(value, cst.Call) else None
        if isinstance(func, cst.Attribute) and func.attr.value in SAME_ELEMENTS:
            value = func.value
        elif func is not None and (dotted(func) or "").rsplit(".", 1)[-1] in MOVERS:
            if not positional(value):
                return value
            value = positional(value)[0]
        elif _moved_dict(value) is not None:
            value = _moved_dict(value)
        elif _moved_sequence(value) is not None:
            value = _moved_sequence(value)
        else:
            return value


def _moved_dict(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """`batch` of `{k: v.cuda() for k, v in batch.items()}`, else None."""
    if not isinstance(value, cst.DictComp):
        return None
    loop, pair = value.for_in, value.for_in.target
    items = loop.iter
    if not (
        loop.inner_for_in is None
        and not loop.ifs
        and isinstance(pair, cst.Tuple)
        and len(pair.elements) == 2
        and code(value.key) == code(pair.elements[0].value)
        and code(unmoved(value.value)) == code(pair.elements[1].value)
        and value.value is not unmoved(value.value)
        and isinstance(items, cst.Call)
        and isinstance(items.func, cst.Attribute)
        and items.func.attr.value == "items"
        and not items.args
    ):
        return None
    return items.func.value


def _moved_sequence(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """`batch` of `tuple(t.cuda() for t in batch)` or `[t.cuda() for t in batch]`, else None."""
    if (
        isinstance(value, cst.Call)
        and code(value.func) in ("tuple", "list")
        and len(value.args) == 1
        and not value.args[0].keyword
        and not value.args[0].star
    ):
        value = value.args[0].value
    if not isinstance(value, (cst.GeneratorExp, cst.ListComp)):
        return None
    loop = value.for_in
    if (
        loop.inner_for_in is not None
        or loop.ifs
        or not isinstance(loop.target, cst.Name)
        or not isinstance(loop.iter, cst.Name)
        or code(unmoved(value.elt)) != loop.target.value
        or value.elt is unmoved(value.elt)
    ):
        return None
    return loop.iter


class _Unmoved(cst.CSTTransformer):
    """A count without the moves and casts inside it (`{k: v.cuda() ...}["labels"]` counts as
    `batch["labels"]`): the reader counts on the batch as drawn."""

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        return unmoved(updated)

    def leave_DictComp(self, original: cst.DictComp, updated: cst.DictComp):
        return _moved_dict(original) or updated  # judged before its moves were dropped


def _mentioned(tree, statement: cst.CSTNode) -> set[str]:
    """The variable names a statement mentions, read or set (`labels` of `labels[i] = -100`)."""
    return {
        n.value for n in tree.walk(statement) if isinstance(n, cst.Name) and tree.is_variable(n)
    }


def _one_line(call: cst.Call) -> cst.Call:
    """`call` written on one line, as the reader's copy of it starts (its comments dropped)."""
    args = ", ".join(
        f"{a.star}{f'{a.keyword.value}=' if a.keyword else ''}{code(a.value)}" for a in call.args
    )
    return cst.parse_expression(f"{code(call.func)}({args})")


def _free(name: str, taken: set[str]) -> str:
    """`name`, or with underscores appended: not one of the names `taken`."""
    while name in taken:
        name += "_"
    return name


def reads_ahead(text: str, header: str) -> bool:
    """Whether the line `text` opens the loop whose first line is `header` (`for T in I:`)
    rewritten to read its windows ahead (`for (T), window_share in read_ahead(I):`)."""
    match = re.fullmatch(r"for (.+?) in (.+?)(:?)", header)
    if match is None:
        return False
    target, items, colon = match.groups()
    pattern = (
        rf"for \(?{re.escape(target)}\)?, {SHARE}(_\d+)? in {READER}(_\d+)?\({re.escape(items)}"
        + (r"(, \w+)*\):" if colon else "")  # the guard's counters after the items
    )
    return re.fullmatch(pattern, text) is not None


def reads_ahead_call(name: str) -> bool:
    """Whether `name` is the read-ahead generator the fix writes (`read_ahead`, `read_ahead_2`)."""
    return re.fullmatch(rf"{READER}(_\d+)?", name) is not None
