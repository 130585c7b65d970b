"""GA005 rewrites: sum and count for JAX accumulation (GA-GUIDE section 4).

The loss function's masked mean `S / count` becomes its sum `S`, and the window is divided
once by the total count of its micro-batches, read from their data:

- a hand-written average (`tree_map(lambda g: g / k, grads)`) after a Python loop: the loss
  returns its sum, the loop adds up each micro-batch's count, and `k` becomes that total;
- the same after a `lax.scan` over stacked micro-batches: the total is counted over the stack;
- `optax.MultiSteps`: its inner optimizer sees the summed gradient only, so the window count
  must be known first. The loop reads each window of K micro-batches ahead and counts it (as
  the HF Trainer does), the loss divides its sum by that count, and MultiSteps sums the
  micro-gradients (`use_grad_mean=False`);
- `optax.microbatching.microbatch` summing its slices' gradients (accumulator SUM): the loss
  divides its masked sum by the whole batch's count, counted before the batch is split and
  passed in beside it; a loss that counts every element of its slice (the slices share one
  shape) is averaged instead (accumulator MEAN).

A fix is offered only where the loss function, its mask and the window's data are visible.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

from gaaudit.analysis.loops import run_again
from gaaudit.analysis.provenance import Origin
from gaaudit.analysis.tree import (
    BINDS_VALUE,
    DEFS,
    Tree,
    argument_for,
    call_parameters,
    code,
    depends_on,
    dotted,
    keyword,
    parameter_names,
    positional,
    string_value,
)
from gaaudit.checks.optax import OptaxAudit, Site, decorated_with_gradient, takes_gradient
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.edits import (
    Edits,
    Unfixable,
    copy_edits,
    parsed_statements,
    runs_again,
    statement_line,
    with_argument,
    with_parameter,
)

BUILTINS = set(dir(builtins))


@dataclass(frozen=True)
class MaskedMean:
    """A loss function's masked mean: the expression, its sum, its count and the divisor as
    written (a count kept from zero, `jnp.maximum(n, 1.0)`), in the function's parameters,
    locals inlined; `aux`: the function returns it first beside auxiliary data; `unpacked`:
    the names the fix unpacks a helper's `(mean, aux)` into, where `node` is that call."""

    function: cst.FunctionDef
    node: cst.BaseExpression
    summed: cst.BaseExpression
    count: cst.BaseExpression
    divisor: cst.BaseExpression
    aux: bool = False  # returned first beside auxiliary data (`return loss, metrics`)
    unpacked: tuple[str, str] | None = None


class _LossFunction:
    """Part of `OptaxPlanner`: the loss function's masked mean, made a sum, and its count at each
    call of its gradient."""

    # --- the loss ------------------------------------------------------------------------------

    def _masked_mean(self) -> MaskedMean:
        origin, function = self.audit.loss
        source = origin.source
        if origin.kind == "mean" and isinstance(function, cst.FunctionDef) and origin.module:
            return self._imported_mean(function)
        if origin.kind != "mean" or not isinstance(function, cst.FunctionDef) or source is None:
            raise Unfixable("gaaudit could not find the mean that the loss function returns")
        jnp = self._jnp()
        mask = keyword(source, "where") if isinstance(source, cst.Call) else None
        if isinstance(source, cst.BinaryOperation) and isinstance(source.operator, cst.Divide):
            summed, count = source.left, self._inline(_unclamped(source.right), function)
            divisor = self._inline(source.right, function)
        elif mask is not None and positional(source):
            summed = cst.parse_expression(
                f"{jnp}.sum({code(positional(source)[0])}, where={code(mask)})"
            )
            count = divisor = cst.Call(
                cst.parse_expression(f"{jnp}.sum"), [cst.Arg(self._inline(mask, function))]
            )
        else:
            raise Unfixable(
                "the loss is a plain mean over every element, no mask in its count: gaaudit "
                "cannot tell what each micro-batch counts (with equal micro-batch shapes the "
                "average is exact)"
            )
        returns = self.tracer.returns(function)
        returned = returns[0] if len(returns) == 1 else None
        aux = isinstance(returned, cst.Tuple) and len(returned.elements) > 1
        if aux and not any(isinstance(e, cst.StarredElement) for e in returned.elements):
            first, others = returned.elements[0].value, returned.elements[1:]
            if any(self._reads(e.value, source, function) for e in others):
                raise Unfixable(
                    "the loss function's auxiliary outputs read its masked mean, which the fix "
                    "makes the window's share: return them from the mean kept apart"
                )
            returned = first
        if returned is None or self._resolve(returned, function) is not source:
            raise Unfixable(
                "the loss function returns more than its masked mean (auxiliary outputs)"
            )
        return MaskedMean(function, source, summed, count, divisor, aux)

    def _reads(
        self,
        expr: cst.BaseExpression,
        source: cst.CSTNode,
        function: cst.FunctionDef,
        depth: int = 0,
    ) -> bool:
        """Whether `expr` holds `source` or reads a local of `function` bound to what does."""
        if expr in self.tree.order and self.tree.contains(expr, source):
            return True
        for name in _names(expr):
            stmt = self.tracer.binding(name.value, name)
            if (
                stmt is None
                or isinstance(stmt, cst.Param)
                or self.tree.scope_of(stmt) is not function
            ):
                continue
            if not isinstance(stmt, BINDS_VALUE) or stmt.value is None or depth > 8:
                return True  # a binding gaaudit does not read through is taken to read it
            if self._reads(stmt.value, source, function, depth + 1):
                return True
        return False

    def _imported_mean(self, function: cst.FunctionDef) -> MaskedMean:
        """The mean a helper of another module returns, called in the loss function: its sum is
        the mean times the count the helper divides by, read at the call. Where the helper
        returns its mean first beside auxiliary data (`return helper(...)` under
        `has_aux=True`), the fix unpacks the two and returns the sum beside the data."""
        origin = self.audit.loss[0]
        returns = self.tracer.returns(function)
        call = self._resolve(returns[0], function) if len(returns) == 1 else None
        pair = isinstance(call, cst.Call) and self.tracer.origin(call).kind != "mean"
        if not isinstance(call, cst.Call) or pair and not _mean(self.tracer.element(call, 0)):
            raise Unfixable(
                "the loss function returns more than the mean of "
                f"`{origin.callee}()` (auxiliary outputs)"
            )
        if origin.count is None or origin.divisions:
            raise Unfixable(
                f"gaaudit cannot tell what `{origin.callee}()` ({origin.module}) divides its "
                "loss by: make it return the masked sum and its count"
            )
        count = self._inline(origin.count, function, at=call)
        if not pair:
            summed = cst.BinaryOperation(_atom(call), cst.Multiply(), _atom(origin.count))
            return MaskedMean(function, call, summed, count, count)
        mean = _fresh("mean_loss", self._taken)
        unpacked = (mean, _fresh("aux", self._taken | {mean}))
        summed = cst.BinaryOperation(cst.Name(mean), cst.Multiply(), _atom(origin.count))
        return MaskedMean(function, call, summed, count, count, aux=True, unpacked=unpacked)

    def _resolve(self, expr: cst.BaseExpression, function: cst.FunctionDef) -> cst.BaseExpression:
        """`loss` -> the value of its one binding in `function`."""
        if isinstance(expr, cst.Name):
            stmt = self.tracer.binding(expr.value, expr)
            if isinstance(stmt, cst.Assign) and self.tree.scope_of(stmt) is function:
                return stmt.value
        return expr

    def _inline(
        self,
        expr: cst.BaseExpression,
        function: cst.FunctionDef,
        depth: int = 0,
        at: cst.CSTNode | None = None,
    ) -> cst.BaseExpression:
        """`expr` with the function's locals replaced by their (single) values; `at`, for an
        expression built apart from the file (another module's count), is where it is read."""
        if depth > 8:
            raise Unfixable("the loss's count goes through too many assignments")
        values: dict[str, cst.BaseExpression] = {}
        for node in _names(expr):
            if node.value in values:
                continue
            stmt = self.tracer.binding(node.value, node if node in self.tree.order else at)
            if (
                stmt is None
                or isinstance(stmt, cst.Param)
                or self.tree.scope_of(stmt) is not function
            ):
                continue
            value = _bound_value(stmt, node.value)
            if value is None:
                raise Unfixable(
                    f"the loss's count reads `{node.value}`, which gaaudit cannot follow"
                )
            if len(self.tree.bindings(function).get(node.value, ())) != 1:
                raise Unfixable(
                    f"the loss's count reads `{node.value}`, which is assigned more than once"
                )
            values[node.value] = self._inline(value, function, depth + 1)
        return _renamed(expr, values)

    def _invocations(self, function: cst.FunctionDef, aux: bool = False) -> list[cst.Call]:
        """The calls that evaluate the gradient of `function`: `value_and_grad(f)(...)`, or
        `grad_fn(...)` after `grad_fn = jax.jit(jax.value_and_grad(f))`; `has_aux=True` where
        the function returns `aux`iliary data beside its loss, else none."""
        name = function.name.value
        if decorated_with_gradient(self.tree, function):
            return self._decorated_calls(function, aux)
        transforms, found = [], []
        for call in self.tree.calls:
            if (
                takes_gradient(self.tree, call.func)
                and positional(call)
                and dotted(positional(call)[0]) == name
                and self.tree.function_named(name, call) is function
            ):
                _has_aux(keyword(call, "has_aux"), aux)
                transforms.append(call)
                found.extend(self._called(call))
        return self._only(function, transforms, found, "its gradient")

    def _decorated_calls(self, function: cst.FunctionDef, aux: bool) -> list[cst.Call]:
        """The calls of a loss function decorated with its gradient (`@jax.value_and_grad`):
        each evaluates the gradient."""
        name = function.name.value
        given = (
            keyword(d.decorator, "has_aux")
            for d in function.decorators
            if isinstance(d.decorator, cst.Call)
        )
        _has_aux(next((g for g in given if g is not None), None), aux)
        found = [
            c
            for c in self.tree.calls
            if dotted(c.func) == name and self.tree.function_named(name, c) is function
        ]
        return self._only(function, found, found, "its calls")

    def _only(
        self, function: cst.FunctionDef, uses: list[cst.Call], found: list[cst.Call], where: str
    ) -> list[cst.Call]:
        """`found`, the one evaluation of the loss gradient, when `function` is named nowhere
        but in its definition and `uses`."""
        self._used_only_in(function, len(uses), where)
        if len(found) != 1:
            raise Unfixable(
                "the loss gradient is evaluated in more than one place (or in none gaaudit can follow)"
            )
        return found

    def _used_only_in(self, function: cst.FunctionDef, uses: int, where: str) -> None:
        """Refuse when the loss function is named elsewhere than in its definition and its
        `uses` (its gradient's transforms or calls); not a function of the same name that
        another function defines."""
        name = function.name.value
        named = [
            n
            for n in self.tree.walk(self.tree.module)
            if isinstance(n, cst.Name)
            and n.value == name
            and self.tree.function_named(name, n) is function
        ]
        if len(named) != 1 + uses:
            raise Unfixable(
                f"`{name}` is also used outside {where}; making it a sum would change that use"
            )

    def _called(self, transform: cst.Call) -> list[cst.Call]:
        parent = self.tree.parents.get(transform)
        if isinstance(parent, cst.Call) and parent.func is transform:
            return [parent]
        holder: cst.CSTNode = transform
        if isinstance(parent, cst.Arg) and (dotted(self.tree.parents[parent].func) or "").endswith(
            "jit"
        ):
            holder = self.tree.parents[parent]
        statement = self.tree.parents.get(holder)
        if not (
            isinstance(statement, cst.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0].target, cst.Name)
        ):
            raise Unfixable("gaaudit cannot follow where the gradient function is called")
        bound = statement.targets[0].target.value
        return [
            c
            for c in self.tree.calls
            if isinstance(c.func, cst.Name)
            and c.func.value == bound
            and self.tracer.binding(bound, c.func) is statement
        ]

    def _arguments(
        self, function: cst.FunctionDef, call: cst.Call
    ) -> dict[str, cst.BaseExpression]:
        if any(a.star for a in call.args):
            raise Unfixable(
                "the loss is called with `*args`/`**kwargs`; gaaudit cannot map its parameters"
            )
        return {
            name: argument
            for name, parameter in call_parameters(function).items()
            if (argument := argument_for(call, parameter)) is not None
        }

    def _count_at(
        self, count: cst.BaseExpression, function: cst.FunctionDef, call: cst.Call
    ) -> cst.BaseExpression:
        """The count with the function's parameters replaced by the call's arguments."""
        values = self._arguments(function, call)
        needed = {n.value for n in _names(count)} & parameter_names(function)
        for name in needed:
            if name not in values:
                raise Unfixable(f"the call does not pass `{name}`, which the loss's count reads")
            if not _pure(values[name]):
                raise Unfixable(
                    f"`{code(values[name])}` (passed as `{name}`) is not a plain expression to count on"
                )
        return _renamed(count, {n: values[n] for n in needed})

    def _sum_loss(self, mean: MaskedMean, divisor: str | None = None) -> None:
        """The loss's masked mean becomes its sum (over `divisor` when given)."""
        summed = mean.summed
        if divisor is not None:
            product = isinstance(summed, cst.BinaryOperation) and isinstance(
                summed.operator, (cst.Multiply, cst.Divide)
            )  # `a * n / w` reads as `(a * n) / w`
            left = summed if product else _atom(summed)
            summed = cst.BinaryOperation(left, cst.Divide(), cst.Name(divisor))
        if mean.unpacked is not None:  # `mean_loss, aux = helper(...)`; `return sum, aux`
            first, rest = mean.unpacked
            self.edits.insert_before(
                statement_line(self.tree, mean.node),
                "# the helper's mean, made a sum below; its auxiliary data as it was\n"
                f"{first}, {rest} = {code(mean.node)}\n",
            )
            summed = cst.Tuple([cst.Element(summed), cst.Element(cst.Name(rest))], lpar=[], rpar=[])
        self.edits.replace[mean.node] = summed.with_changes(
            lpar=mean.node.lpar, rpar=mean.node.rpar
        )


class _Averages:
    """Part of `OptaxPlanner`: a hand-written average of micro-gradients (a loop or a `lax.scan`)
    made a division by the window's total count."""

    # --- hand-written averages -----------------------------------------------------------------

    def _loop_average(self, site: Site, mean: MaskedMean, call: cst.Call) -> str:
        loop = next((a for a in self.tree.ancestors(call) if isinstance(a, (cst.For, *DEFS))), None)
        if not isinstance(loop, cst.For):
            raise Unfixable(
                "the micro-steps are not a Python loop or a `lax.scan` gaaudit can follow (e.g. a "
                "`lax.fori_loop`); sum the micro-gradients and the mask counts, and divide once"
            )
        scope = self.tree.scope_of(loop)
        if (
            self.tree.scope_of(site.call) is not scope
            or self.tree.order[site.call] < self.tree.last[loop]
        ):
            raise Unfixable(
                "the average is not taken after the loop that accumulates the micro-gradients"
            )
        count = self._count_at(mean.count, mean.function, call)
        self._sum_loss(mean)
        if loop not in self._counted:
            self._counted.add(loop)
            self.edits.insert_before(statement_line(self.tree, loop), f"{self.weight} = 0.0\n")
            self.edits.insert_after(
                statement_line(self.tree, call), f"{self.weight} += {code(count)}\n"
            )
        self._divide_by_weight(site, scope, loop)
        return (
            "the loss returns its masked sum, the loop adds up the mask counts, and the summed "
            "micro-gradients are divided once by their total"
        )

    def _scan_of(self, body: cst.FunctionDef) -> cst.Call | None:
        """The `lax.scan(body, init, xs)` call that runs `body` over the micro-batches."""
        for call in self.tree.calls:
            runs = (self.tree.qualified(call.func) or "").endswith("lax.scan") and positional(call)
            if runs and dotted(positional(call)[0]) == body.name.value:
                return call
        return None

    def _scan_average(
        self, site: Site, mean: MaskedMean, call: cst.Call, body: cst.FunctionDef, scan: cst.Call
    ) -> str:
        args = positional(scan)
        xs = keyword(scan, "xs") or (args[2] if len(args) > 2 else None)
        params = body.params.params
        if xs is None or not _pure(xs) or len(params) != 2:
            raise Unfixable(
                "gaaudit cannot tell which stacked micro-batches the `lax.scan` runs over"
            )
        micro = params[1].name.value
        count = self._count_at(mean.count, mean.function, call)
        if {n.value for n in _names(count)} - {micro} - self._global_names():
            raise Unfixable("the loss's count reads more than the scanned micro-batch")
        if not _stackable(count):
            raise Unfixable(
                "the loss's count is not a sum over elementwise data (it slices or reshapes the "
                "micro-batch), so gaaudit cannot count the whole stack at once"
            )
        scope = self.tree.scope_of(scan)
        statement = statement_line(self.tree, scan)
        if (
            self.tree.scope_of(site.call) is not scope
            or self.tree.order[site.call] < self.tree.last[statement]
        ):
            raise Unfixable(
                "the average is not taken after the `lax.scan` that accumulates the micro-gradients"
            )
        self._sum_loss(mean)
        if scan not in self._counted:
            self._counted.add(scan)
            total = _renamed(count, {micro: xs})
            self.edits.insert_after(statement, f"{self.weight} = {code(total)}\n")
        self._divide_by_weight(site, scope, statement)
        return (
            "the loss returns its masked sum, and the scanned micro-gradients are divided once by "
            "the mask count of the whole stack"
        )

    def _divide_by_weight(self, site: Site, scope: cst.CSTNode, accumulation: cst.CSTNode) -> None:
        """`g / k` -> `g / max(total, 1)`, and so every later division by `k` of something the
        accumulation computed (the window's logged loss)."""
        steps = code(site.node.right)
        divisor = cst.parse_expression(f"{self._jnp()}.maximum({self.weight}, 1)")
        self.edits.replace[site.node.right] = divisor
        accumulated = self.tree.assigned_in(accumulation)
        body = scope if isinstance(scope, cst.Module) else scope.body
        for node in self.tree.walk(body, into_defs=False):
            if (
                isinstance(node, cst.BinaryOperation)
                and isinstance(node.operator, cst.Divide)
                and code(node.right) == steps
                and self.tree.order[node] > self.tree.last[accumulation]
                and depends_on(node.left, accumulated)
            ):
                self.edits.replace[node.right] = divisor


class _MultiSteps:
    """Part of `OptaxPlanner`: `optax.MultiSteps`: windows read ahead and counted, the step handed
    their weight."""

    # --- optax.MultiSteps ----------------------------------------------------------------------

    def _multisteps(self, site: Site, mean: MaskedMean, call: cst.Call) -> str:
        step = self.tree.enclosing_function(call)
        if step is None:
            raise Unfixable("the loss gradient is not taken inside a step function")
        uses = [c for c in self.tree.calls if dotted(c.func) == step.name.value]
        if len(uses) != 1:
            raise Unfixable(
                f"`{step.name.value}` is called in {len(uses)} places; gaaudit needs the one loop"
            )
        (step_call,) = uses
        loop = self.tree.parents.get(self.tree.parents.get(statement_line(self.tree, step_call)))
        if not (isinstance(loop, cst.For) and loop.orelse is None and loop.asynchronous is None):
            raise Unfixable(
                f"`{step.name.value}(...)` is not called directly in a `for` loop over the micro-batches"
            )
        if any(isinstance(n, cst.Break) for n in _loop_level(loop.body)):
            raise Unfixable(
                "the loop breaks out early; reading windows ahead would change what it trains"
            )
        outer = run_again(self.tree, loop, self._fresh_state(site.node))
        if outer is not None and not self.unsafe:
            raise Unfixable(
                f"unsafe fix ({runs_again(self.tree, outer, loop)}, and MultiSteps carries a "
                "pass's last window, cut short, into the next pass's first; reading ahead counts "
                "the two parts as two windows, right only where every pass holds whole windows "
                "(a loader whose length is a multiple of the accumulation steps)); apply with "
                "--unsafe-fixes"
            )
        for function in (mean.function, step):
            _plain_signature(function)
        steps = self._steps_at(site.node, loop)
        count = self._count_at(self._count_at(mean.count, mean.function, call), step, step_call)
        visible = self._visible(loop)
        unknown = {n.value for n in _names(count)} - visible - self._global_names()
        if unknown:
            raise Unfixable(
                f"the loss's count reads {', '.join(sorted(unknown))}, not visible in the loop"
            )
        self.edits.replace[site.node] = with_argument(site.node, "use_grad_mean", "False")
        if loop not in self._counted:  # another MultiSteps of the same loop already did this
            self._counted.add(loop)
            weight = self.weight
            self._sum_loss(mean, weight)
            self.edits.replace[mean.function.params] = with_parameter(mean.function.params, weight)
            self.edits.replace[step.params] = with_parameter(step.params, weight)
            self.edits.replace[call] = with_argument(call, weight, weight)
            self.edits.replace[step_call] = with_argument(step_call, weight, weight)
            self._keep_value(mean, call, weight)
            self._read_ahead(loop, steps, count)
        return (
            "the loop reads each window of micro-batches ahead and counts its mask, the loss divides "
            "its masked sum by that count, and MultiSteps sums (`use_grad_mean=False`); a last "
            "window cut short is counted alone"
        )

    def _fresh_state(self, multisteps: cst.Call) -> Callable[[cst.CSTNode], bool]:
        """Whether a node starts the MultiSteps state anew (`state = tx.init(params)` of
        `tx = optax.MultiSteps(...)`), dropping a window a pass's end cut short."""
        statement = self.tree.parents.get(multisteps)
        names = (
            {code(t.target) for t in statement.targets}
            if isinstance(statement, cst.Assign)
            else set()
        )
        return lambda node: (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "init"
            and code(node.func.value) in names
        )

    def _keep_value(self, mean: MaskedMean, call: cst.Call, weight: str) -> None:
        """The loss value the gradient call returns (`loss, grads = ...`), now the micro-batch's
        share of its window, is made its masked mean again, as the step returns or logs it."""
        statement = self.tree.parents.get(call)
        if not (isinstance(statement, cst.Assign) and len(statement.targets) == 1):
            return
        target = statement.targets[0].target
        value = target.elements[0].value if isinstance(target, cst.Tuple) else None
        if mean.aux:  # `(loss, aux), grads = ...`
            value = value.elements[0].value if isinstance(value, cst.Tuple) else None
        if not isinstance(value, cst.Name) or value.value == "_":
            return
        divisor = _atom(self._count_at(mean.divisor, mean.function, call))
        name = value.value
        self.edits.insert_after(
            statement_line(self.tree, call),
            "# the returned loss: the micro-batch's mean again, as before the fix\n"
            f"{name} = {name} * {weight} / {code(divisor)}\n",
        )

    def _steps_at(self, multisteps: cst.Call, loop: cst.For) -> str:
        """The accumulation steps of `MultiSteps(...)` as an expression valid at `loop`."""
        args = positional(multisteps)
        every = keyword(multisteps, "every_k_schedule") or (args[1] if len(args) > 1 else None)
        if isinstance(every, cst.Integer):
            return code(every)
        if not isinstance(every, (cst.Name, cst.Attribute)) or dotted(every) in self.tree.functions:
            raise Unfixable(
                "the accumulation steps are not a plain value gaaudit can use in the loop"
            )
        holder = self.tree.scope_of(multisteps)
        loop_scope = self.tree.scope_of(loop)
        root = dotted(every).split(".")[0]
        if holder is loop_scope or holder is self.tree.module:
            if root in self._visible(loop) | self._global_names():
                return code(every)
        elif isinstance(every, cst.Name) and isinstance(holder, cst.FunctionDef):
            calls = [c for c in self.tree.calls if dotted(c.func) == holder.name.value]
            parameter = call_parameters(holder).get(every.value)
            if (
                len(calls) == 1
                and self.tree.scope_of(calls[0]) is loop_scope
                and parameter is not None
            ):
                given = argument_for(calls[0], parameter)
                if given is not None and _pure(given):
                    return code(given)
        raise Unfixable("gaaudit cannot tell the accumulation steps where the training loop runs")

    def _read_ahead(self, loop: cst.For, steps: str, count: cst.BaseExpression) -> None:
        """`for x in xs:` -> `for x, weight in read_ahead(xs):`, a generator above the loop that
        reads each window of `steps` items ahead and hands each item its window's count; a last
        window cut short is counted alone, as MultiSteps accumulates it."""
        target = code(loop.target)
        item = f"({target})" if isinstance(loop.target, cst.Tuple) else target
        reader, counted = _fresh("read_ahead", self._taken), _fresh("counted", self._taken)
        items, each, total = (_fresh(name, self._taken) for name in ("items", "item", "total"))
        window, weight, jnp = self.window, self.weight, self._jnp()
        functions = parsed_statements(
            "# read ahead: each window's valid count, so each micro-batch's sum weighs by it\n"
            f"def {reader}({items}):\n"
            f"    {window} = []\n"
            f"    for {each} in {items}:\n"
            f"        {window}.append({each})\n"
            f"        if len({window}) == {steps}:\n"
            f"            yield from {counted}({window})\n"
            f"            {window} = []\n"
            f"    if {window}:\n"
            f"        yield from {counted}({window})\n"
            f"def {counted}({window}):\n"
            f"    {total} = {jnp}.maximum(sum({code(count)} for {target} in {window}), 1)\n"
            f"    return [({each}, {total}) for {each} in {window}]\n"
        )
        blank = cst.EmptyLine(indent=False)  # a blank line between the two and after them
        functions[1] = functions[1].with_changes(
            leading_lines=[blank], body=functions[1].body.with_changes(footer=[blank])
        )
        self.edits.before.setdefault(statement_line(self.tree, loop), []).extend(functions)
        self.edits.replace[loop.target] = cst.parse_expression(f"{item}, {weight}")
        self.edits.replace[loop.iter] = cst.parse_expression(f"{reader}({code(loop.iter)})")

    def _visible(self, loop: cst.For) -> set[str]:
        """Names the loop's body may read: its target, and its function's parameters and locals."""
        scope = self.tree.scope_of(loop)
        names = {n.value for n in _names(loop.target)}
        if isinstance(scope, cst.FunctionDef):
            names |= parameter_names(scope)
            names |= set(self.tree.bindings(scope))
        return names

    def _global_names(self) -> set[str]:
        return (
            set(self.tree.bindings(self.tree.module))
            | set(self.tree.imports)
            | set(self.tree.functions)
            | BUILTINS
        )


class _Microbatched:
    """Part of `OptaxPlanner`: `optax.microbatching.microbatch` summing the gradients of its
    slices' means."""

    def _microbatched(self, site: Site) -> str:
        if keyword(site.call, "num_real_microbatches") is not None:
            raise Unfixable(
                "`num_real_microbatches` may run fewer slices than the batch holds, so gaaudit "
                "cannot tell the slices' count from the batch"
            )
        if self.audit.counts_every_element():
            return self._microbatch_mean(site)
        return self._microbatch_count(site, self._masked_mean())

    def _microbatch_mean(self, site: Site) -> str:
        """The slices share one shape and the loss counts every element of its slice, so the
        average of their gradients (accumulator MEAN) is the whole batch's, and so is the
        average of their loss values; auxiliary data stays summed, as before."""
        call = site.call
        args = positional(call)
        fun = keyword(call, "fun") or args[0]
        aux = keyword(fun, "has_aux") or (positional(fun)[2] if len(positional(fun)) > 2 else None)
        if aux is not None and code(aux) not in ("True", "False"):
            raise Unfixable(
                f"gaaudit cannot tell whether the gradient function returns auxiliary data "
                f"(`has_aux={code(aux)}`), so which of its outputs to average"
            )
        kind = self._accumulation_type(call)
        value = f"{kind}.MEAN"
        if aux is not None and code(aux) == "True":  # (gradients or loss value, aux)
            value = f"({kind}.MEAN, {kind}.SUM)"
            if "value" in (self.tree.qualified(fun.func) or "").rsplit(".", 1)[-1]:
                value = f"({value}, {kind}.MEAN)"  # ((loss value, aux), gradients)
        if keyword(call, "accumulator") is None and len(args) > 3:
            self.edits.replace[args[3]] = cst.parse_expression(value)
        else:
            self.edits.replace[call] = with_argument(call, "accumulator", value)
        return (
            "the loss counts every element of slices of one shape: `microbatch` averages their "
            "gradients and loss values (accumulator MEAN), the whole batch's"
        )

    def _microbatch_count(self, site: Site, mean: MaskedMean) -> str:
        """A masked mean: the loss divides its slice's sum by the whole batch's count, counted
        before `microbatch` splits the batch and passed in beside it, and SUM adds the slices'
        shares up to the whole batch's mean (the loss value too)."""
        call, function = site.call, mean.function
        name = function.name.value
        args = positional(call)
        fun = keyword(call, "fun") or args[0]
        if not (positional(fun) and dotted(positional(fun)[0]) == name) or (
            keyword(fun, "has_aux") or len(positional(fun)) > 2
        ):
            raise Unfixable(f"`microbatch` is not handed the plain gradient of `{name}`")
        self._used_only_in(function, 1, "its gradient")
        _plain_signature(function)
        called = self._called(call)
        if len(called) != 1:
            raise Unfixable("the microbatched gradient is called in more than one place (or none)")
        parameters = [
            p.name.value for p in (*function.params.posonly_params, *function.params.params)
        ]
        read = {n.value for n in _names(mean.count)}
        unsplit = (read & set(parameters)) - self._split(call, parameters)
        if unsplit or read - set(parameters) - self._global_names():
            raise Unfixable(
                f"the loss's count reads {', '.join(sorted(unsplit or read))}, not only what "
                "`microbatch` splits, so gaaudit cannot count the whole batch at once"
            )
        count = self._count_at(mean.count, function, called[0])
        if not _stackable(count):
            raise Unfixable(
                "the loss's count is not a sum over elementwise data (it slices or reshapes the "
                "batch), so gaaudit cannot count the whole batch at once"
            )
        weight = self.weight
        self._sum_loss(mean, weight)
        self.edits.replace[function.params] = with_parameter(function.params, weight)
        self.edits.replace[called[0]] = with_argument(called[0], weight, weight)
        self.edits.insert_before(
            statement_line(self.tree, called[0]),
            "# the whole batch's count, taken before `microbatch` splits it\n"
            f"{weight} = {self._jnp()}.maximum({code(count)}, 1)\n",
        )
        return (
            "the loss divides its masked sum by the whole batch's mask count, counted before "
            "`microbatch` splits the batch, and the slices' shares add up to the batch's mean"
        )

    def _split(self, call: cst.Call, parameters: list[str]) -> set[str]:
        """The loss function's parameters that `microbatch(..., argnums, argnames=...)` splits."""
        args = positional(call)
        argnums = keyword(call, "argnums") or (args[1] if len(args) > 1 else None)
        items = [e.value for e in argnums.elements] if isinstance(argnums, cst.Tuple) else [argnums]
        names = keyword(call, "argnames")
        named = [names] if isinstance(names, cst.SimpleString) else []
        if not all(isinstance(i, cst.Integer) for i in items) or (names is not None and not named):
            raise Unfixable("gaaudit cannot tell which arguments `microbatch` splits")
        split = {parameters[int(i.value)] for i in items if int(i.value) < len(parameters)}
        return split | {string_value(n) for n in named}

    def _accumulation_type(self, call: cst.Call) -> str:
        """`optax.microbatching.AccumulationType` as this file can name it."""
        if isinstance(call.func, cst.Attribute):
            return f"{code(call.func.value)}.AccumulationType"
        for local, full in self.tree.imports.items():
            if full.endswith("microbatching.AccumulationType"):
                return local
            if full in ("optax", "optax.microbatching"):
                return f"{local}{'.microbatching' * (full == 'optax')}.AccumulationType"
        raise Unfixable(
            "`microbatch` is imported by name and `optax` is not: import "
            "`optax.microbatching.AccumulationType` to average the slices' gradients (MEAN)"
        )


class OptaxPlanner(_LossFunction, _Averages, _MultiSteps, _Microbatched):
    """Turns the GA005 sites of one file into edits (see `edits.Edits`)."""

    def __init__(self, tree: Tree, audit: OptaxAudit, unsafe: bool = False) -> None:
        self.tree, self.audit, self.unsafe = tree, audit, unsafe
        self.tracer = audit.tracer
        self.edits = Edits()
        self._taken = {n.value for n in tree.walk(tree.module) if isinstance(n, cst.Name)}
        self.weight = _fresh("window_weight", self._taken)
        self.window = _fresh("window", self._taken)
        self._counted: set[cst.CSTNode] = set()  # accumulations that already count their window

    def plan(self, sites: list[Site]) -> list[Outcome]:
        outcomes = []
        for site in sites:
            saved = (copy_edits(self.edits), set(self._counted))
            span = self.tree.span(site.node)
            try:
                chosen = self._fix(site)
                outcomes.append(Outcome(site, span.line, span.column, True, chosen))
            except (Unfixable, cst.ParserSyntaxError) as exc:
                self.edits, self._counted = saved
                reason = (
                    str(exc)
                    if isinstance(exc, Unfixable)
                    else "gaaudit could not build a valid rewrite"
                )
                outcomes.append(Outcome(site, span.line, span.column, False, reason))
        return outcomes

    def _fix(self, site: Site) -> str:
        if site.kind == "combinator":
            where = site.accumulation.removeprefix("accumulation: ")
            raise Unfixable(
                f"{where}, another module gaaudit does not rewrite: make it sum the "
                "micro-gradients, and return each micro-batch's loss sum divided by the "
                "window's total count (counted over the whole batch before it is split)"
            )
        if site.kind == "microbatch-sum":
            return self._microbatched(site)
        if site.kind == "microbatch":
            raise Unfixable(
                "`microbatch` calls the gradient function on each slice of the batch: with "
                "accumulator SUM, make the loss each slice's sum divided by the whole batch's "
                "count (counted before the batch is split and passed in beside it)"
            )
        if site.kind == "multisteps-sum" and (rows := self.audit.per_row()) is not None:
            raise Unfixable(
                f"the loss averages per-row means (`{code(rows)}`, line {self.tree.line(rows)}), "
                "so each micro-batch counts its rows: pass `use_grad_mean=True`, exact while the "
                "micro-batches hold as many rows (gaaudit cannot see that a last one is not shorter)"
            )
        if site.kind == "multisteps-sum":
            raise Unfixable(
                "MultiSteps already sums the micro-gradients: return each micro-batch's loss sum "
                "divided by the window's total count (counted before the window runs)"
            )
        if (normalised := self.audit.loss[0]) is self.audit.normalised_grads:
            count = code(normalised.source.right)
            raise Unfixable(
                f"the gradients are divided by `{count}` (line {self.tree.line(normalised.source)}), "
                "the count each micro-batch returns beside its summed loss: divide them by the "
                "window's total count instead, counted over its micro-batches before they run "
                "(for MultiSteps, passed to the step, with `use_grad_mean=False`)"
            )
        mean = self._masked_mean()
        (call,) = self._invocations(mean.function, mean.aux)
        if site.kind == "multisteps":
            return self._multisteps(site, mean, call)
        if mean.aux:
            raise Unfixable(
                "the loss function already returns auxiliary data, where the fix would return "
                "each micro-batch's count"
            )
        body = self.tree.enclosing_function(call)
        scan = self._scan_of(body) if body is not None else None
        if scan is not None:
            return self._scan_average(site, mean, call, body, scan)
        return self._loop_average(site, mean, call)

    def _jnp(self) -> str:
        for local, full in self.tree.imports.items():
            if full == "jax.numpy":
                return local
        if "jax" in self.tree.imports:
            return "jax.numpy"
        raise Unfixable("`jax.numpy` is not imported in this file")


class _Rename(cst.CSTTransformer):
    """Replaces variable names (not attribute or keyword names) by expressions."""

    def __init__(self, values: dict[str, cst.BaseExpression]) -> None:
        self.values = values

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return False

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.Attribute:
        return updated_node.with_changes(value=updated_node.value.visit(self))

    def visit_Arg(self, node: cst.Arg) -> bool:
        return False

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        return updated_node.with_changes(value=updated_node.value.visit(self))

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        value = self.values.get(updated_node.value)
        return _atom(value) if value is not None else updated_node


def _renamed(expr: cst.BaseExpression, values: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    return expr.visit(_Rename(values)) if values else expr


def _names(expr: cst.CSTNode) -> list[cst.Name]:
    """Variable names an expression reads (attribute and keyword names left out)."""
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

        def visit_Arg(self, node: cst.Arg) -> bool:
            node.value.visit(self)
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.append(node)

    expr.visit(Collect())
    return found


def _atom(expr: cst.BaseExpression) -> cst.BaseExpression:
    if (
        isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float))
        or expr.lpar
    ):
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _unclamped(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`jnp.maximum(n, 1.0)` / `max(n, 1)` -> `n`: the count, without the guard against zero."""
    if (
        isinstance(expr, cst.Call)
        and len(expr.args) == 2
        and (code(expr.func).endswith("maximum") or code(expr.func) == "max")
    ):
        numbers = [a.value for a in expr.args if isinstance(a.value, (cst.Integer, cst.Float))]
        others = [a.value for a in expr.args if not isinstance(a.value, (cst.Integer, cst.Float))]
        if len(numbers) == 1 and len(others) == 1:
            return others[0]
    return expr


def _has_aux(given: cst.BaseExpression | None, aux: bool) -> None:
    """Refuse a gradient whose `has_aux=` (`given`, None where absent) does not say what the
    loss function returns: its loss alone, or its loss first beside `aux`iliary data."""
    if given is not None and code(given) not in ("True", "False"):
        raise Unfixable(
            f"gaaudit cannot tell whether the gradient takes auxiliary data (`has_aux={code(given)}`)"
        )
    if (given is not None and code(given) == "True") != aux:
        raise Unfixable(
            "the gradient's `has_aux=` does not match what the loss function returns "
            "(its masked mean alone, or first beside auxiliary data)"
        )


def _bound_value(stmt: cst.CSTNode, name: str) -> cst.BaseExpression | None:
    """What `name = value` binds, or `a, name = batch`: `batch[1]` (a sequence unpacked; read
    by index so the count can be taken from the batch itself); None for anything else."""
    if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
        return None
    target = stmt.targets[0].target
    if isinstance(target, cst.Name):
        return stmt.value
    if not (isinstance(target, (cst.Tuple, cst.List)) and _pure(stmt.value)):
        return None
    names = [e.value.value if isinstance(e.value, cst.Name) else None for e in target.elements]
    if any(isinstance(e, cst.StarredElement) for e in target.elements) or names.count(name) != 1:
        return None
    index = cst.Index(cst.Integer(str(names.index(name))))
    return cst.Subscript(stmt.value, [cst.SubscriptElement(index)])


def _plain_signature(function: cst.FunctionDef) -> None:
    """Refuses a function with defaults or `*args`: a parameter is added to plain ones only (a
    keyword-only one after a bare `*`)."""
    params = function.params
    if (
        isinstance(params.star_arg, cst.Param)
        or params.star_kwarg is not None
        or any(p.default is not None for p in params.params)
    ):
        raise Unfixable(
            f"`{function.name.value}` has defaults or `*args`; gaaudit adds a parameter only to plain signatures"
        )


def _pure(expr: cst.BaseExpression) -> bool:
    """A plain data expression: names, attributes and subscripts by constants."""
    if isinstance(expr, (cst.Name, cst.Attribute)):
        return dotted(expr) is not None
    if isinstance(expr, cst.Subscript):
        return _pure(expr.value) and all(
            isinstance(e.slice, cst.Index)
            and isinstance(e.slice.value, (cst.SimpleString, cst.Integer))
            for e in expr.slice
        )
    return False


def _stackable(count: cst.BaseExpression) -> bool:
    """`jnp.sum(E)` / `E.sum()` over elementwise data: counting the stack of micro-batches at
    once gives the sum of their counts."""
    if not isinstance(count, cst.Call) or keyword(count, "axis") is not None:
        return False
    if isinstance(count.func, cst.Attribute) and count.func.attr.value == "sum" and not count.args:
        data = count.func.value
    elif code(count.func).endswith(".sum") and len(count.args) == 1:
        data = count.args[0].value
    else:
        return False
    for node in _walk(data):
        if isinstance(node, cst.Slice) or (
            isinstance(node, cst.Call)
            and not (isinstance(node.func, cst.Attribute) and node.func.attr.value == "astype")
        ):
            return False
    return True


def _walk(node: cst.CSTNode):
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children)


def _loop_level(block: cst.CSTNode):
    """Nodes of a loop body, not entering nested loops or definitions."""
    stack = list(block.children)
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, (cst.For, cst.While, *DEFS)):
            stack.extend(current.children)


def _mean(origin: Origin | None) -> bool:
    return origin is not None and origin.kind == "mean"


def _fresh(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 1
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    return candidate
