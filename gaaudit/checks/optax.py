"""GA005: JAX accumulation that averages the gradients of per-micro-batch mean losses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import libcst as cst

from gaaudit import catalogue
from gaaudit.analysis.domain import Domains
from gaaudit.analysis.evidence import Evidence
from gaaudit.analysis.jaxtrace import OPTAX_LOSSES, JaxTracer
from gaaudit.analysis.provenance import MASKED_MEAN, Origin, averaged_mean
from gaaudit.analysis.tree import (
    Tree,
    code,
    depends_on,
    dotted,
    keyword,
    last_name,
    positional,
    string_value,
)
from gaaudit.findings import Confidence, Finding
from gaaudit.vocabulary import matched_names

CODE = "GA005"
MEAN = "is a mean"
# Function transforms whose first argument is the loss function.
GRADS = {"grad", "value_and_grad", "filter_grad", "filter_value_and_grad"}
JAX_HOMES = ("jax", "flax", "equinox")
# One of optax's per-example losses called on what a mean reduces: `optax.l2_loss(pred, y).mean()`.
ELEMENTWISE = re.compile(rf"^(?:\w+\.)*(?:{'|'.join(sorted(OPTAX_LOSSES))})\(")
SUMS = ("multisteps-sum", "microbatch-sum")  # sites summing micro-gradients of means
STEPS = re.compile(r"accum|micro|(?:num|n)_?mini_?batches", re.IGNORECASE)
MASK = re.compile(r"mask|pad|ignore", re.IGNORECASE)
NO_LOSS = Origin("unknown", "no loss function gaaudit could find (passed to `jax.value_and_grad`)")


@dataclass(frozen=True)
class Site:
    """One reportable node, what GA005 says about it, and the accumulation it belongs to.

    `kind` is "multisteps" (`node` is the `MultiSteps(...)` call), "multisteps-sum" (the same,
    summing the micro-gradients of mean losses), "microbatch" and "microbatch-sum" (the same
    for `optax.microbatching.microbatch`), "average" (`node` is the `g / k` inside
    the lambda of `call`, a `tree_map`) or "combinator" (`node` is the call of another
    module's function that averages the micro-gradients for the caller).
    """

    node: cst.CSTNode
    message: str
    accumulation: str
    kind: str
    call: cst.Call

    @property
    def code(self) -> str:
        return CODE


class _Divisions:
    """Part of `OptaxAudit`: accumulation and the divisions of gradient trees by a count of
    micro-steps."""

    def _accumulates(self) -> bool:
        """A Python loop, or a `lax.scan` / `lax.fori_loop` / `lax.while_loop`, somewhere in the file."""
        return any(
            isinstance(node, (cst.For, cst.While))
            or (
                isinstance(node, cst.Call)
                and (self.tree.qualified(node.func) or "").endswith(
                    ("lax.scan", "lax.fori_loop", "lax.while_loop")
                )
            )
            for node in self.tree.walk(self.tree.module)
        )

    def _tree_divisions(self) -> Iterator[Site]:
        """`tree_map(lambda g: g / k, grads)`, `tree_map(lambda a, g: a + g / k, acc, grads)`."""
        for node, division in self._leaf_divisions():
            if self._is_steps(division.right):
                yield Site(
                    division,
                    f"Gradients divided by the number of micro-steps `{code(division.right)}` "
                    f"while each micro-step's loss {MEAN}: micro-batches are weighted equally "
                    "instead of by their valid tokens",
                    f"accumulation: `{code(node.func)}` averages the micro-gradients "
                    f"(line {self.tree.line(node)})",
                    "average",
                    node,
                )

    def _leaf_divisions(self) -> Iterator[tuple[cst.Call, cst.BinaryOperation]]:
        """Each `tree_map(lambda ...: ... g / d ...)` call and its division of a leaf by a
        value that is not a leaf."""
        for node in self.tree.calls:
            if not (self._is_tree_map(node.func) and positional(node)):
                continue
            function = positional(node)[0]
            if not isinstance(function, cst.Lambda):
                continue
            leaves = {p.name.value for p in function.params.params}
            for inner in self.tree.walk(function.body):
                if (
                    isinstance(inner, cst.BinaryOperation)
                    and isinstance(inner.operator, cst.Divide)
                    and depends_on(inner.left, leaves)
                    and not depends_on(inner.right, leaves)
                ):
                    yield node, inner

    def _is_tree_map(self, func: cst.BaseExpression) -> bool:
        qualified = self.tree.qualified(func) or ""
        return qualified.split(".")[0] in JAX_HOMES and qualified.endswith(("tree_map", "tree.map"))

    def _is_steps(self, expr: cst.BaseExpression, hops: int = 2) -> bool:
        """A count of micro-steps: an accumulation name, `len(micro_batches)`, or a name bound to one."""
        if (
            isinstance(expr, cst.Call)
            and dotted(expr.func) in ("len", "float", "int")
            and positional(expr)
        ):
            return self._is_steps(positional(expr)[0], hops)
        name = last_name(expr) or ""
        if name.lower() in self.names or STEPS.search(name):
            return True
        if hops and isinstance(expr, cst.Name):
            stmt = self.tracer.binding(name, expr)
            return isinstance(stmt, cst.Assign) and self._is_steps(stmt.value, hops - 1)
        return False


class OptaxAudit(_Divisions):
    """GA005 over one file: `optax.MultiSteps`, and hand-written averages of micro-gradients."""

    def __init__(self, tree: Tree, accumulation_names: frozenset[str], imports=None) -> None:
        self.tree = tree
        self.tracer = JaxTracer(tree, imports)
        self.names = matched_names(accumulation_names)
        self.imports = imports  # a `repository.Imports`, to read combinators of other modules

    @cached_property
    def loss(self) -> tuple[Origin, cst.CSTNode | None]:
        """The micro-step loss: a mean if any loss function returns one (a masked mean before
        the others: the one whose count varies), else a sum, else unknown."""
        origins = [
            (self._returned_loss(returned), function)
            for function in self._loss_functions()
            for returned in (
                self.tracer.returns(function)
                if isinstance(function, cst.FunctionDef)
                else [function.body]
            )
        ]
        origins.sort(key=lambda found: MASKED_MEAN not in found[0].what)  # stable
        for kind in ("mean", "sum"):
            for origin, function in origins:
                if origin.kind == kind == "sum" and (normalised := self.normalised_grads):
                    return normalised, function
                if origin.kind == kind:
                    return origin, function
        return origins[0] if origins else (NO_LOSS, None)

    def _returned_loss(self, returned: cst.BaseExpression) -> Origin:
        """The origin of the loss a loss function returns: the first element of `return loss,
        aux`, or of the tuple a helper returns (`return helper(...)` under `has_aux=True`, as
        a gradient of a function that returns a tuple takes its first element)."""
        first = _first(returned)
        found = self.tracer.origin(first)
        if found.kind == "unknown" and isinstance(first, cst.Call):
            element = self.tracer.element(first, 0)
            if element is not None and element.kind != "unknown":
                return element
        return found

    @cached_property
    def normalised_grads(self) -> Origin | None:
        """A summed loss whose gradients are then divided by the micro-batch's own count,
        returned beside the loss: `(loss, n), grads = grad_fn(...)`, then
        `tree_map(lambda g: g / n, grads)` (`n` perhaps `psum`-ed over devices first)."""
        for _, division in self._leaf_divisions():
            count = division.right
            if isinstance(count, cst.Name) and self._returned_count(count):
                return Origin(
                    "mean",
                    f"a summed loss whose gradients are divided by `{count.value}`, the count "
                    f"its own micro-batch returned beside it ({MASKED_MEAN})",
                    division,
                    tree=self.tree,
                )
        return None

    def _returned_count(self, name: cst.Name, hops: int = 3) -> bool:
        """Whether `name` was unpacked from a gradient call's output (`(loss, n), g = f(...)`),
        perhaps through `n = jax.lax.psum(n, ...)`."""
        stmt = self.tracer.binding(name.value, name)
        if not isinstance(stmt, cst.Assign) or hops == 0:
            return False
        value = stmt.value
        if isinstance(value, cst.Call) and last_name(value.func) in ("psum", "pmean"):
            inner = positional(value)[0] if positional(value) else None
            return isinstance(inner, cst.Name) and self._returned_count(inner, hops - 1)
        unpacked = isinstance(stmt.targets[0].target, (cst.Tuple, cst.List))
        return unpacked and isinstance(value, cst.Call)

    def _loss_functions(self) -> list[cst.FunctionDef | cst.Lambda]:
        """Functions given to `jax.value_and_grad` and kin, or decorated with them; else the
        file's `*loss*` functions."""
        found = []
        for node in self.tree.calls:
            if positional(node) and takes_gradient(self.tree, node.func):
                function = self._function_of(positional(node)[0])
                if function is not None:
                    found.append(function)
        found += [f for f in self.tree.functions.values() if decorated_with_gradient(self.tree, f)]
        return found or [f for name, f in self.tree.functions.items() if "loss" in name.lower()]

    def _function_of(self, expr: cst.BaseExpression) -> cst.FunctionDef | cst.Lambda | None:
        if isinstance(expr, cst.Lambda):
            return expr
        if (
            isinstance(expr, cst.Call)
            and (dotted(expr.func) or "").endswith("partial")
            and positional(expr)
        ):
            return self._function_of(positional(expr)[0])
        return self.tree.function_named(dotted(expr) or "", expr)

    def sites(self) -> Iterator[Site]:
        if self.loss[0].kind == "sum":
            return
        yield from self._multisteps()
        yield from self._microbatched()
        if self._accumulates():
            yield from self._tree_divisions()
        yield from self._combinators()

    def _combinators(self) -> Iterator[Site]:
        """A function of another module of the repository handed a gradient function
        (`minibatch_call(..., grad_fn=jax.value_and_grad(loss_fn))`) that runs it over
        micro-batches and divides the summed gradients by their number."""
        if self.imports is None:
            return
        for node in self.tree.calls:
            handed = any(
                isinstance(a.value, cst.Call) and takes_gradient(self.tree, a.value.func)
                for a in node.args
            )
            found = self.imports.averaging(node.func, averaged_steps) if handed else None
            if found is not None:
                where, divisor = found
                yield Site(
                    node,
                    f"`{code(node.func)}` divides the micro-gradients' sum by the number of "
                    f"micro-steps `{divisor}` while each micro-step's loss {MEAN}: micro-batches "
                    "are weighted equally instead of by their valid tokens",
                    f"accumulation: `{code(node.func)}` averages the micro-gradients ({where})",
                    "combinator",
                    node,
                )

    def _microbatched(self) -> Iterator[Site]:
        """`optax.microbatching.microbatch(jax.grad(loss_fn), ...)`: the gradient of each
        micro-batch's mean, summed (its default accumulator, SUM: about K times too large) or
        averaged with equal weight (MEAN, RUNNING_MEAN; exact where the loss counts every
        element, the slices sharing one shape)."""
        for node in self.tree.calls:
            qualified = self.tree.qualified(node.func) or ""
            if not (
                qualified.startswith("optax.") and qualified.endswith("microbatching.microbatch")
            ):
                continue
            args = positional(node)
            fun = keyword(node, "fun") or (args[0] if args else None)
            if not (isinstance(fun, cst.Call) and takes_gradient(self.tree, fun.func)):
                continue
            accumulator = keyword(node, "accumulator") or (args[3] if len(args) > 3 else None)
            how = "SUM" if accumulator is None else last_name(accumulator)
            line = self.tree.line(node)
            where = f"accumulation: `{code(node.func)}` over micro-batches (line {line})"
            if how == "SUM" and self.loss[0].kind == "mean":
                message = (
                    f"`{code(node.func)}` sums the micro-gradients (accumulator SUM, its default) "
                    f"while each micro-step's loss {MEAN}: the gradient is about K times too large"
                )
                yield Site(node, message, where, "microbatch-sum", node)
            elif how in ("MEAN", "RUNNING_MEAN") and not self.counts_every_element():
                message = (
                    f"`{code(node.func)}` averages the micro-gradients with equal weight "
                    f"(accumulator {how}) while each micro-step's loss {MEAN}: micro-batches "
                    "with fewer valid tokens are over-weighted"
                )
                yield Site(node, message, where, "microbatch", node)

    def _multisteps(self) -> Iterator[Site]:
        for node in self.tree.calls:
            qualified = self.tree.qualified(node.func) or ""
            if not (qualified.startswith("optax.") and qualified.endswith(".MultiSteps")):
                continue
            args = positional(node)
            every = keyword(node, "every_k_schedule") or (args[1] if len(args) > 1 else None)
            mean = keyword(node, "use_grad_mean") or (args[2] if len(args) > 2 else None)
            if every is not None and code(every) == "1":
                continue
            k = f"`{code(every)}`" if every is not None else "K"
            if mean is not None and code(mean) != "True":
                if code(mean) == "False" and self.loss[0].kind == "mean":
                    yield Site(
                        node,
                        "`optax.MultiSteps` sums the micro-gradients (use_grad_mean=False) while "
                        f"each micro-step's loss {MEAN}: the gradient is about K times too large",
                        f"accumulation: `{code(node.func)}` steps every {k} micro-steps "
                        f"(line {self.tree.line(node)})",
                        "multisteps-sum",
                        node,
                    )
                continue
            yield Site(
                node,
                "`optax.MultiSteps` averages the micro-gradients with equal weight (use_grad_mean=True) "
                f"while each micro-step's loss {MEAN}: micro-batches with fewer valid tokens are "
                "over-weighted",
                f"accumulation: `{code(node.func)}` steps every {k} micro-steps "
                f"(line {self.tree.line(node)})",
                "multisteps",
                node,
            )

    def confidence(self, evidence: Evidence, text: str) -> tuple[Confidence, str]:
        """High when a mean loss is masked, medium when a loss of unknown reduction is, low for
        fixed-length data, an unknown loss or an unmasked mean of an elementwise optax loss
        (jit's micro-batches share one shape, so it counts as many elements in each), else as
        the loss's domain says."""
        origin, function = self.loss
        # a mask spent within each row, or one that only zeroes terms of a mean over every
        # element (`(ce * mask).mean()`), leaves the count as the shape makes it
        over_all = origin.kind == "mean" and not origin.module
        over_all = over_all and _reduced(origin.source, self.tree) is not None
        masked = origin.kind in ("mean", "unknown") and not self.tracer.counts_rows(origin)
        masked = masked and not over_all
        mask = self._mask_sign(function) if masked else None
        if origin.kind == "unknown" and mask is not None:
            return Confidence.MEDIUM, (
                f"the micro-step loss is computed under a mask ({mask}), so counts can vary; "
                "its reduction is not visible here"
            )
        if origin.kind != "mean":
            return Confidence.LOW, "gaaudit could not tell whether the micro-step loss is a mean"
        if mask is not None:
            return Confidence.HIGH, f"the loss is masked, so valid-token counts vary: {mask}"
        domains = Domains(self.tree, self.tracer, evidence, text)
        domain = domains.of(origin)
        exact = domain.varies is False  # its own reason (fixed-length data) comes first
        if not exact and self.counts_every_element():
            return Confidence.LOW, (
                "the loss function reads no mask, padding or ignore label: its mean of an "
                "elementwise optax loss counts every element of micro-batches of one shape "
                "(jit's), so mean/K is exact"
            )
        return domain.confidence()

    def counts_every_element(self) -> bool:
        """The loss is an unmasked mean of an elementwise optax loss: it counts every element of
        its micro-batch, as many in each micro-batch of one shape."""
        origin, function = self.loss
        if origin.kind != "mean" or origin.module or self._mask_sign(function) is not None:
            return False
        reduced = _reduced(origin.source, self.tree)
        if reduced is None:
            return False
        spelled = Domains(self.tree, self.tracer, Evidence(), "").spelled(reduced)
        return ELEMENTWISE.search(spelled) is not None

    def per_row(self) -> cst.BaseExpression | None:
        """The per-row means the loss averages (`per_row / lengths` of `(per_row /
        lengths).mean()`): a mask it reads is spent within each row, and it counts rows."""
        return self.tracer.row_quotient(self.loss[0])

    def _mask_sign(self, function: cst.CSTNode) -> str | None:
        """A mask, padding or ignore label read by the loss function, or a `where=` reduction."""
        for node in self.tree.walk(function):
            if (
                isinstance(node, cst.Arg)
                and node.keyword is not None
                and node.keyword.value == "where"
            ):
                return f"a `where=` reduction (line {self.tree.line(node)})"
            text = last_name(node) or string_value(node) or ""
            if isinstance(node, (cst.Name, cst.Attribute, cst.SimpleString)) and MASK.search(text):
                return f"`{text}` (line {self.tree.line(node)})"
        return None


def averaged_steps(tree: Tree, name: str) -> tuple[int, str] | None:
    """Whether the top-level function `name` of `tree` runs the micro-steps (a loop or a
    `lax.scan`) and divides a tree of gradients by their number: the line and the divisor."""
    function = tree.functions.get(name)
    if function is None or tree.enclosing_function(function) is not None:
        return None
    audit = OptaxAudit(tree, frozenset())
    if not audit._accumulates():
        return None
    for _, division in audit._leaf_divisions():
        if tree.contains(function, division) and audit._is_steps(division.right):
            return tree.line(division), code(division.right)
    return None


def takes_gradient(tree: Tree, func: cst.BaseExpression) -> bool:
    """`jax.value_and_grad`, `eqx.filter_grad` and kin."""
    qualified = tree.qualified(func) or ""
    return qualified.split(".")[0] in JAX_HOMES and qualified.rsplit(".", 1)[-1] in GRADS


def decorated_with_gradient(tree: Tree, function: cst.FunctionDef) -> bool:
    """`@jax.value_and_grad def loss_fn(...)`: calling the function takes its gradient."""
    return any(takes_gradient(tree, _decorating(d.decorator)) for d in function.decorators)


def _decorating(decorator: cst.BaseExpression) -> cst.BaseExpression:
    """The function a decorator applies: `jax.value_and_grad` of `@jax.value_and_grad`,
    `@partial(jax.value_and_grad, has_aux=True)` or `@eqx.filter_value_and_grad(has_aux=True)`."""
    if not isinstance(decorator, cst.Call):
        return decorator
    if (dotted(decorator.func) or "").endswith("partial") and positional(decorator):
        return positional(decorator)[0]
    return decorator.func


def _first(expr: cst.BaseExpression) -> cst.BaseExpression:
    """The loss of `return loss, aux`."""
    if isinstance(expr, (cst.Tuple, cst.List)) and expr.elements:
        return _first(expr.elements[0].value)
    return expr


def findings(context) -> list[Finding]:
    """GA005 for one file."""
    if not any(q.split(".")[0] in (*JAX_HOMES, "optax") for q in context.tree.imports.values()):
        return []
    audit = OptaxAudit(context.tree, context.accumulation_names, context.imports)
    sites = list(audit.sites())
    if not sites:
        return []
    judged = audit.confidence(context.evidence, context.text)
    seen = audit.loss[0].kind == "mean"  # a message says "mean" only where gaaudit saw one
    hint = catalogue.load()[CODE].hint
    found = []
    for site in sites:
        confidence, why = judged
        if site.kind in SUMS and confidence < Confidence.MEDIUM:
            why = "summed micro-gradients of means are K times too large whatever the counts"
            confidence = Confidence.MEDIUM
        found.append(
            Finding(
                path=context.path,
                code=CODE,
                message=site.message if seen else site.message.replace(MEAN, "may be a mean"),
                span=context.tree.span(site.node),
                confidence=confidence,
                evidence=(
                    f"loss: {audit.loss[0].description}",
                    site.accumulation,
                    f"confidence {confidence}: {why}",
                ),
                hint=hint,
                fixable=site.kind not in ("multisteps-sum", "combinator", "microbatch"),
            )
        )
    return found


def _reduced(source: cst.CSTNode | None, tree: Tree) -> cst.BaseExpression | None:
    """What a `x.mean()` or `jnp.mean(x)` reduces, every element of it (None for anything
    else)."""
    return averaged_mean(source, tree) if isinstance(source, cst.Call) else None
