"""Where a loss comes from: a per-micro-batch mean, a sum, or unknown (GA-GUIDE section 2)."""

from __future__ import annotations

import re
from ast import literal_eval
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Literal

import libcst as cst

from gaaudit.analysis.loops import is_step
from gaaudit.analysis.tree import (
    BINDS_VALUE,
    LOOPS,
    Tree,
    argument_for,
    assigned_value,
    call_parameters,
    code,
    depends_on,
    dotted,
    keyword,
    last_name,
    methods_of,
    positional,
    reads,
    string_value,
    substituted,
    variables,
    walk,
)
from gaaudit.discover.modules import configured_target

Kind = Literal["mean", "sum", "elementwise", "unknown"]

# torch losses whose default reduction is a mean over the elements (or valid targets).
# fmt: off
TORCH_LOSSES = {
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "CrossEntropyLoss", "NLLLoss", "BCELoss", "BCEWithLogitsLoss", "MSELoss", "L1Loss",
    "SmoothL1Loss", "HuberLoss", "KLDivLoss",
}
PASS_THROUGH = {
    "float", "to", "clone", "contiguous", "squeeze", "unsqueeze", "double", "half", "bfloat16",
}
# fmt: on
MAX_DEPTH = 16
# The keywords a model takes its targets by (`masked_lm_labels`, `lm_labels`: transformers 2)
LABEL_KEYWORDS = ("labels", "targets", "masked_lm_labels", "lm_labels")
WEIGHT = re.compile(
    r"(?i)weight|multiplier|coef|lambda|alpha|beta|temperature|^temp(?:_sq)?$"
    r"|(?:^|_)eps(?:ilon)?(?:_\w)?$|smoothing$"  # label smoothing's share: `(1 - eps) * nll`
    r"|(?:^|_)scale$"  # a term's configured scale: `ce_loss * args.cap_loss_scale`
)
PROCESSES = re.compile(
    r"(?i)(?:get_)?world_size|dp_size|dp_world_size|data_parallel_size|num_processes|n_gpus?|num_gpus"
    r"|num_replicas"  # `DistributedSampler`'s name for it
)
MODEL = re.compile(r"(?i)^(?:model|net|network|transformer|gpt|llm|lm|module)$|_model$|_wrapper$")
# A count a call returns beside its loss (fairseq's `loss, sample_size, logging_output =
# criterion(model, sample)`), whose loss is then often the sum over it; and loss names that say
# a mean whatever is returned beside them.
COUNT_BESIDE = re.compile(
    r"(?i)^(?:sample_size|n_?tok(?:en)?s|ntok(?:en)?s"
    r"|num_\w*(?:tokens?|targets?|labels?|items|frames|elements))$"
)
SAYS_MEAN = re.compile(r"(?i)mean|avg|average|per_token")
RESHAPES = {"reshape", "view", "flatten", "contiguous", "unsqueeze", "squeeze"}
# casts that keep the count of a boolean mask: `(labels >= 0).float().sum()`
MASK_CASTS = {"float", "double", "half", "bfloat16", "long", "int", "bool", "to", "type", "detach"}
# Functions that average every element of the one argument they are handed.
MEANS_OF_ALL = ("torch.mean", "torch.nanmean", "jax.numpy.mean", "jax.numpy.nanmean", "numpy.mean")
GUARDS = {"clamp", "clamp_min", "clamp_", "clamp_min_", "float", "double", "to", "item", "detach"}


@dataclass(frozen=True)
class Division:
    """A `value / divisor` on the path from the loss source to `backward`."""

    node: cst.CSTNode  # the BinaryOperation, or the AugAssign statement for `/=`
    divisor: cst.BaseExpression


@dataclass(frozen=True)
class Origin:
    """What a loss expression is, where it was made, and what divided it on the way."""

    kind: Kind
    what: str
    source: cst.CSTNode | None = None
    divisions: tuple[Division, ...] = field(default=())
    via: str = ""  # ", returned by `helper()`" when it came out of a same-file function
    from_model: bool = False  # unpacked from a model call: `logits, loss = model(x, y)`
    tree: Tree | None = field(default=None, compare=False, repr=False)
    module: str = ""  # the file of another module that computes it (then `source` is None)
    path: Path | None = None  # that file, to read
    callee: str = ""  # there, the function or `Class.forward` that returns it
    # the `if` on one of whose paths the loss is defined otherwise, over a count of its own
    branch: cst.If | None = field(default=None, compare=False, repr=False)
    count: cst.BaseExpression | None = field(
        default=None, compare=False, repr=False
    )  # of a masked mean
    ignored: str = ""  # what a masked mean's count leaves out: `-100` of `(t != -100).sum()`
    rows: bool = False  # another module's mean of per-row means (`Tracer.counts_rows`)
    variable: str = ""  # a sign of variable valid-token counts where that module computes it
    configured: cst.Call | None = field(default=None, compare=False, repr=False)  # a torch loss
    added: str = ""  # another term added to (or subtracted from) it: `aux_loss * coef`
    through: str = ""  # an autograd Function it passed through as it is: `L2Wrap.apply`
    beside: str = ""  # a count its call returns beside it: `loss, sample_size, log = ...`
    # what a helper's mean of its parameter averages, as the call hands it: `(out - y) ** 2`
    # of `mean_flat((out - y) ** 2)`
    reduces: str = ""
    # the origins of the terms `added` names, each alone: `kl_weight * kl_loss`
    terms: tuple[Origin, ...] = field(default=(), compare=False, repr=False)

    @property
    def description(self) -> str:
        """What it is and where, with the line looked up only when someone reads it."""
        where = f" (line {self.tree.line(self.source)})" if self.tree and self.source else ""
        return f"{self.what}{where}{self.via}"

    def divided(self, division: Division) -> Origin:
        return replace(self, divisions=(*self.divisions, division))


UNKNOWN = Origin("unknown", "an expression gaaudit cannot trace")
MASKED_MEAN = "a masked mean"  # how `what` names a sum divided by its own per-micro-batch count
# How a function counts its tensors' elements: `(~mask).sum()`, `x.numel()`, `len(ids)`.
TENSOR_COUNTS = frozenset({"sum", "numel", "nelement", "count_nonzero", "size", "len"})


def _handed(found: Origin, parameters: dict, call: cst.Call) -> Origin:
    """A mean of one of a helper's parameters (`torch.mean(x, dim=...)`, `x.mean()`) with the
    code the call hands that parameter, as what it averages."""
    source = found.source
    if not (isinstance(source, cst.Call) and last_name(source.func) in ("mean", "nanmean")):
        return found
    reduced = source.func.value if isinstance(source.func, cst.Attribute) else None
    if not (isinstance(reduced, cst.Name) and reduced.value in parameters):
        reduced = next(iter(positional(source)), None)
    parameter = parameters.get(reduced.value) if isinstance(reduced, cst.Name) else None
    passed = argument_for(call, parameter) if parameter is not None else None
    return replace(found, reduces=code(passed)) if passed is not None else found


def _uncast(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` without the casts and copies that leave a count unchanged: `m.ne(0).float()`."""

    class Uncast(cst.CSTTransformer):
        def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
            func = updated.func
            if isinstance(func, cst.Attribute) and func.attr.value in CASTS:
                return func.value
            return updated

    return expr.visit(Uncast())


def _reshaped(statement: cst.CSTNode | None, name: str) -> bool:
    """`name = name.reshape(-1)` (or `.view`, `.flatten`, `.contiguous`): the same elements,
    so the same count of valid ones."""
    if not (
        isinstance(statement, cst.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0].target, cst.Name)
        and statement.targets[0].target.value == name
    ):
        return False
    value = statement.value
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
        if value.func.attr.value not in RESHAPES:
            return False
        value = value.func.value
    return isinstance(value, cst.Name) and value.value == name and value is not statement.value


def unguarded(count: cst.BaseExpression) -> cst.BaseExpression:
    """A count without its guard against zero or its cast: `n` for `n.clamp(min=1)`,
    `max(n, 1)`, `n.float()`."""
    while isinstance(count, cst.Call):
        func, args = count.func, positional(count)
        if dotted(func) in ("max", "torch.clamp", "torch.clamp_min") and args:
            bounds = [a for a in args if not isinstance(a, (cst.Integer, cst.Float))]
            if len(bounds) != 1:
                return count
            count = bounds[0]
        elif isinstance(func, cst.Attribute) and func.attr.value in GUARDS:
            count = func.value
        else:
            return count
    return count


def ignored_value(count: cst.BaseExpression) -> str:
    """The value a count leaves out where it counts the targets unequal to it
    (`(target != self.ignore_index).sum()`, `labels.ne(-100).sum()`), else ""."""
    count = unguarded(count)
    if not (isinstance(count, cst.Call) and code(count.func).endswith(".sum") and not count.args):
        return ""
    summed = count.func.value
    if isinstance(summed, cst.Comparison) and len(summed.comparisons) == 1:
        compared = summed.comparisons[0]
        return code(compared.comparator) if isinstance(compared.operator, cst.NotEqual) else ""
    if isinstance(summed, cst.Call) and code(summed.func).endswith(".ne") and len(summed.args) == 1:
        return code(summed.args[0].value)
    return ""


def same_count(count: str, other: str, targets: bool) -> bool:
    """Whether two count expressions count the same: alike up to the casts and reshapes of
    what they sum (`mask.unsqueeze(-1).sum()`), and, where `count` counts the `targets` of a
    token loss (`(t != -100).sum()`: any other negative target fails that loss),
    `(t >= 0).sum()` as that count."""
    first = cst.parse_expression(count)
    ignore = None
    summed = first.func.value if _sums(first) else None
    if targets and isinstance(summed, cst.Comparison) and len(summed.comparisons) == 1:
        compared = summed.comparisons[0]
        value = compared.comparator
        if (
            isinstance(compared.operator, cst.NotEqual)
            and isinstance(value, cst.UnaryOperation)
            and isinstance(value.operator, cst.Minus)
            and isinstance(value.expression, cst.Integer)
        ):
            ignore = compared

    class Alike(cst.CSTTransformer):
        def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
            if not _sums(updated):
                return updated
            summed, cast = updated.func.value, False
            while (
                isinstance(summed, cst.Call)
                and isinstance(summed.func, cst.Attribute)
                and summed.func.attr.value in MASK_CASTS | RESHAPES
            ):
                cast = cast or summed.func.attr.value in MASK_CASTS
                summed = summed.func.value
            if cast and not isinstance(summed, cst.Comparison):  # a value cast of a non-mask
                return updated
            return updated.with_changes(func=updated.func.with_changes(value=summed))

        def leave_Comparison(self, original, updated: cst.Comparison) -> cst.Comparison:
            (compared, *more) = updated.comparisons
            if (
                ignore is not None
                and not more
                and isinstance(compared.operator, cst.GreaterThanEqual)
                and code(compared.comparator) == "0"
            ):
                return updated.with_changes(comparisons=[ignore])
            return updated

    def spelled(expr: cst.BaseExpression) -> str:
        return re.sub(r"\s+", "", code(expr.visit(Alike())))

    return spelled(first) == spelled(cst.parse_expression(other))


def _sums(expr: cst.BaseExpression) -> bool:
    """`x.sum()`: every element of `x`."""
    return (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value == "sum"
        and not expr.args
    )


def _per_window(count: cst.Subscript) -> bool:
    """Whether a subscript reads one entry per window: its index is a floor division
    (`totals[step // accum_iter]`), the same for the K micro-steps of a window."""
    index = count.slice[0].slice if len(count.slice) == 1 else None
    value = index.value if isinstance(index, cst.Index) else None
    return isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.FloorDivide)


def _is_weight(factor: cst.BaseExpression) -> bool:
    """A number, a configured loss weight (`args.loss_multiplier`, `self.aux_weight`, or a
    power of one: distillation's `temperature ** 2`) or the process count (`dp_size`,
    `dist.get_world_size()`, undoing data parallelism's average): a factor that keeps a mean a
    mean, unlike a count."""
    if isinstance(factor, (cst.Integer, cst.Float)):
        return True
    if isinstance(factor, cst.BinaryOperation) and isinstance(factor.operator, cst.Power):
        return isinstance(factor.right, (cst.Integer, cst.Float)) and _is_weight(factor.left)
    if isinstance(factor, cst.BinaryOperation) and isinstance(factor.operator, cst.Subtract):
        return _is_weight(factor.left) and _is_weight(factor.right)  # `1.0 - epsilon`
    if isinstance(factor, cst.Subscript):  # one of several weights: `loss_weights[dataset_idx]`
        factor = factor.value
    name = last_name(factor.func if isinstance(factor, cst.Call) else factor) or ""
    return bool(WEIGHT.search(name) or PROCESSES.fullmatch(name))


def _zero(value: cst.BaseExpression | None) -> bool:
    """`0` or `0.0`: where a sum of losses starts."""
    return isinstance(value, (cst.Integer, cst.Float)) and float(value.value) == 0


def _averages_itself(name: str, value: cst.BaseExpression) -> bool:
    """`loss.mean()` assigned back to `loss`: the average of DataParallel's per-device losses."""
    return (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "mean"
        and not value.args
        and isinstance(value.func.value, cst.Name)
        and value.func.value.value == name
    )


def _calls_a_model(value: cst.BaseExpression) -> bool:
    """`model(x, return_loss=True)`, `self.net(**batch)`: a call of a model that returns its loss."""
    if not isinstance(value, cst.Call):
        return False
    asks = any(
        (a.keyword is not None and a.keyword.value in ("return_loss", "labels", "targets"))
        for a in value.args
    )
    return asks or bool(MODEL.search(last_name(value.func) or ""))


def _settled(
    helper: cst.FunctionDef, call: cst.Call | None, rebound: Iterable[str]
) -> tuple[cst.FunctionDef | None, dict[str, object]]:
    """The helper and the literals (strings, numbers, booleans, None) its parameters hold at
    `call`: passed there, or their defaults; not those it `rebound`s. Nothing without a call."""
    if call is None:
        return None, {}
    values = {}
    for name, parameter in call_parameters(helper).items():
        passed = argument_for(call, parameter)
        if passed is None and any(a.star for a in call.args):
            continue  # perhaps in `*args` or `**kwargs`
        value = passed or parameter.default
        if value is not None and name not in rebound and (literal := _evaluated(value)):
            values[name] = literal[0]
    return helper, values


def _evaluated(expr: cst.BaseExpression) -> tuple[object] | None:
    """`(value,)` for a literal expression, else None."""
    try:
        return (literal_eval(code(expr)),)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _decided(test: cst.BaseExpression, values: dict[str, object]) -> bool | None:
    """The value of an `if` test on settled parameters (`mode == "sum"`, `not flag`, `flag`),
    or None when it reads anything else."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _decided(test.expression, values)
        return None if inner is None else not inner
    if isinstance(test, cst.Name) and test.value in values:
        return bool(values[test.value])
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        (target,) = test.comparisons
        right = _evaluated(target.comparator)
        if not (isinstance(test.left, cst.Name) and test.left.value in values and right):
            return None
        if isinstance(target.operator, cst.Equal):
            return values[test.left.value] == right[0]
        if isinstance(target.operator, cst.NotEqual):
            return values[test.left.value] != right[0]
    return None


TOKEN_LOSSES = ("cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss")
CASTS = GUARDS | {"type", "half"}  # no effect on a count (integer, bool and view casts may)


def loss_target(call: cst.Call) -> cst.BaseExpression | None:
    """The target a torch loss call is given: `target=`, `targets=`, or its second argument."""
    args = positional(call)
    return (
        keyword(call, "target") or keyword(call, "targets") or (args[1] if len(args) > 1 else None)
    )


def valid_targets(target: cst.BaseExpression, configured: cst.Call) -> cst.Call:
    """`(target != ignore).sum()`: a token loss's targets that are not its ignore value
    (torch's -100 unless `configured`, the call that sets it, says otherwise), built around
    the nodes themselves."""
    ignore = keyword(configured, "ignore_index") or cst.parse_expression("-100")
    differs = cst.Comparison(
        target,
        [cst.ComparisonTarget(cst.NotEqual(), ignore)],
        lpar=[cst.LeftParen()],
        rpar=[cst.RightParen()],
    )
    return cst.Call(cst.Attribute(differs, cst.Name("sum")))


def averaged_mean(call: cst.Call, tree: Tree) -> cst.BaseExpression | None:
    """What `x.mean()`, `torch.mean(x)` or `jnp.mean(x)` averages (every element), else None."""
    if tree.qualified(call.func) in MEANS_OF_ALL:
        return call.args[0].value if len(call.args) == 1 else None
    if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("mean", "nanmean"):
        return None if call.args else call.func.value
    return None


def _along_a_dimension(call: cst.Call, tree: Tree, names=("mean", "nanmean")) -> bool:
    """Whether `call` is a mean (or another reduction of `names`) along a dimension:
    `x.mean(1)`, `torch.mean(x, dim=-1)`, `jnp.sum(x, axis=-1)`."""
    qualified = tree.qualified(call.func) or ""
    if qualified.split(".")[0] in ("torch", "jax", "numpy") and last_name(call.func) in names:
        return len(positional(call)) > 1 or any(
            keyword(call, k) is not None for k in ("dim", "axis")
        )
    return (
        isinstance(call.func, cst.Attribute)
        and call.func.attr.value in names
        and (bool(positional(call)) or any(keyword(call, k) is not None for k in ("dim", "axis")))
    )


class _Foreign(Exception):
    """An expression reads a name (the exception's argument) its function's caller cannot
    name."""


class _Calls:
    """Part of `Tracer`: what a call returns: a lambda, a same-file helper seen from its call, a
    loss module, an imported or passed callable, an annotated parameter's class."""

    def origin_call(self, expr: cst.BaseExpression) -> cst.Call | None:
        """The call an expression (or the name it is bound to) evaluates; of two calls of
        one function on the arms of an `if` expression, the first."""
        if isinstance(expr, cst.Name):
            stmt = self.binding(expr.value, expr)
            expr = stmt.value if isinstance(stmt, BINDS_VALUE) else None
        if (
            isinstance(expr, cst.IfExp)
            and isinstance(expr.orelse, cst.Call)
            and isinstance(expr.body, cst.Call)
            and code(expr.body.func) == code(expr.orelse.func)
        ):
            expr = expr.body  # `model(x, masked_lm_labels=y) if mlm else model(x, labels=y)`
        return expr if isinstance(expr, cst.Call) else None

    @staticmethod
    def _passes_labels(call: cst.Call) -> bool:
        return any(
            (a.keyword is not None and a.keyword.value in LABEL_KEYWORDS) or a.star == "**"
            for a in call.args
        )

    def _call(self, call: cst.Call, depth: int) -> Origin:
        func = call.func
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            if (
                method in ("mean", "nanmean")
                and not positional(call)
                and keyword(call, "dim") is None
            ):
                # the mean of a mean (DataParallel's per-device means) is that mean; the mean of
                # a product is over its elements (`(losses["loss"] * weights).mean()`)
                product = isinstance(func.value, cst.BinaryOperation) and isinstance(
                    func.value.operator, cst.Multiply
                )
                if not product:
                    inner = self.origin(func.value, depth + 1)
                    if inner.kind == "mean":
                        return inner
                return self._mean(call, f"`{code(call)}`")
            if (
                method in ("sum", "nansum")
                and not positional(call)
                and keyword(call, "dim") is None
            ):
                return self._sum(call, f"`{code(call)}`")
            if method in ("mul", "multiply") and len(call.args) == 1 and not call.args[0].keyword:
                # `loss.sum().mul(scale / total)`: the tensor method of `*`
                return self._times(call, self.origin(func.value, depth + 1), call.args[0].value)
            if method in PASS_THROUGH or (method == "scale" and len(call.args) == 1):
                target = func.value if method in PASS_THROUGH else call.args[0].value
                return self.origin(target, depth + 1)
            handed = self._handed_on(func.value, call) if method == "apply" else None
            if handed is not None:
                found = self.origin(handed, depth + 1)
                return replace(found, through=found.through or code(func))
        default = self.default(func)
        qualified = self.tree.qualified(default or func) or ""
        if qualified in ("torch.mean", "torch.nanmean"):
            return self._mean(call, f"`{code(call)}`")
        if qualified in ("torch.sum", "torch.nansum"):
            return self._sum(call, f"`{code(call)}`")
        if qualified.startswith("torch.") and qualified.rsplit(".", 1)[-1] in TORCH_LOSSES:
            what = f"`{qualified.rsplit('.', 1)[-1]}`"
            if default is not None:
                what = f"`{code(func)}`, by default {what}"
            return self._reduction(call, call, what)
        constructor = self.loss_instance(func)
        if constructor is not None:
            return self._reduction(constructor, call, f"a `{code(constructor.func)}` instance")
        for _, found in self.called(func, call, depth):
            if found.kind != "unknown":
                return found
        return Origin("unknown", f"`{code(func)}(...)`, a call gaaudit cannot see into")

    def called(
        self, func: cst.BaseExpression, call: cst.Call | None = None, depth: int = 0
    ) -> list[tuple[cst.BaseExpression | None, Origin]]:
        """What calling `func` returns when it is (or names) a lambda, an instance of a
        same-file loss class, or a helper or loss class imported from another module: each
        returned expression of this file (None for another module's) with its origin.
        `call` is the call site, when there is one."""
        helper = self.helper(func)
        if helper is not None:
            label = f"`{helper.name.value}()`"
            settled = _settled(helper, call, self.tree.bindings(helper))
            saved, self._settled = self._settled, settled
            self._calls.append((helper, call))
            try:
                return [
                    (r, self._at_call(self._returned(r, depth, label), helper, call))
                    for r in self.returns(helper)
                    if not self._ruled_out(r)
                ]
            finally:
                self._settled = saved
                self._calls.pop()
        value = self.bound_value(func) if isinstance(func, (cst.Name, cst.Attribute)) else func
        if isinstance(value, cst.Lambda):
            return [(value.body, self._returned(value.body, depth, "the lambda"))]
        if not isinstance(value, cst.Call):
            imported = self._imported(func, call)
            return [(None, imported)] if imported is not None else []
        if self._is_torch_loss(value):  # `loss_fn=nn.CrossEntropyLoss()`
            return [(value, self._reduction(value, value, f"a `{code(value.func)}` instance"))]
        method = self.loss_method(value.func)  # an instance: `criterion = MaskedLoss(...)`
        if method is not None:
            label = f"`{dotted(value.func)}.{method.name.value}()`"
            return [(r, self._returned(r, depth, label)) for r in self.returns(method)]
        if self.imports is None:
            return []
        imported = self.imports.instance_origin(value, call)
        if imported is None and call is not None:  # `Model(...).cuda()`, `wrap(Model(...))`
            imported = self.imports.called(self, call)
        return [(None, imported)] if imported is not None else []

    def _at_call(self, found: Origin, helper: cst.FunctionDef, call: cst.Call | None) -> Origin:
        """A same-file helper's loss seen from its call: a division by one of its parameters
        is a division by the argument passed; a sum divided by a count the caller takes from
        its micro-batch (`masked_nll(lp, m, m.sum())`) is a mean."""
        if call is None:
            return found
        parameters = call_parameters(helper)
        if found.kind == "mean" and not found.reduces:
            found = _handed(found, parameters, call)
        if not found.divisions:
            return found
        divisions = []
        for division in found.divisions:
            name = division.divisor.value if isinstance(division.divisor, cst.Name) else None
            parameter = parameters.get(name)
            passed = argument_for(call, parameter) if parameter is not None else None
            if passed is None:
                divisions.append(division)
            elif found.kind == "sum" and self._per_micro_batch(call, passed):
                what = f"`{code(call)}`, a sum over the count it is handed ({MASKED_MEAN})"
                return replace(self._mean(call, what), via=found.via, count=passed)
            else:
                divisions.append(Division(call, passed))
        return replace(found, divisions=tuple(divisions))

    def _returned(self, expr: cst.BaseExpression, depth: int, by: str) -> Origin:
        found = self.origin(expr, depth + 1)
        return replace(found, via=f", returned by {by}") if found.kind != "unknown" else found

    def _handed_on(self, owner: cst.BaseExpression, call: cst.Call) -> cst.BaseExpression | None:
        """The argument of `Fn.apply(...)` that a torch.autograd.Function of this file returns
        from its `forward` as it is (RWKV's `L2Wrap.apply(loss, logits)`, whose `backward`
        adds a penalty's gradient on `logits`): the value is that argument's."""
        cls = self._classes.get(owner.value) if isinstance(owner, cst.Name) else None
        if cls is None or not any(last_name(b.value) == "Function" for b in cls.bases):
            return None
        methods = methods_of(cls)
        forward = methods.get("forward")
        returned = self.returns(forward) if forward is not None else []
        ctx = 0 if "setup_context" in methods else 1  # `forward(ctx, ...)`, unless set up apart
        inputs = [p.name.value for p in forward.params.params[ctx:]] if forward else []
        if len(returned) != 1 or not isinstance(returned[0], cst.Name):
            return None
        index = inputs.index(returned[0].value) if returned[0].value in inputs else None
        args = positional(call)
        return args[index] if index is not None and index < len(args) else None

    @cached_property
    def _classes(self) -> dict[str, cst.ClassDef]:
        return {s.name.value: s for s in self.tree.module.body if isinstance(s, cst.ClassDef)}

    def _imported(
        self, func: cst.BaseExpression, call: cst.Call | None, index: int | None = None
    ) -> Origin | None:
        """What calling `func` returns (element `index` of a returned tuple) when it is a
        function imported from the repository, or an instance of an imported class handed in
        as an annotated parameter (`model: SoundStorm`: its `forward`)."""
        if self.imports is None:
            return None
        found = self.imports.origin(func, call, index)
        annotated = self.annotated_class(func) if found is None else None
        if annotated is not None:
            found = self.imports.instance_origin(cst.Call(func=annotated), call, index)
        if found is None and call is not None:
            found = self._passed(func, call, index)
        return found

    def _passed(self, func: cst.BaseExpression, call: cst.Call, index: int | None) -> Origin | None:
        """What a parameter of a top-level function returns when called: the instance the
        function's callers in other modules pass for it (`train_one_epoch(model, ...)` with
        `model = MetaModel(...)`; see `repository.Imports.passed_origin`)."""
        if not isinstance(func, cst.Name) or func not in self.tree.order:
            return None
        param = self.binding(func.value, func)
        function = self.tree.scope_of(func)
        if not isinstance(param, cst.Param) or not isinstance(function, cst.FunctionDef):
            return None
        if self.tree.module.body.count(function) == 0:  # a method or a nested function
            return None
        parameter = call_parameters(function).get(func.value)
        if parameter is None:  # `*args`, `**kwargs`
            return None
        return self.imports.passed_origin(function.name.value, parameter, call, index)

    def annotated_class(self, func: cst.BaseExpression) -> cst.BaseExpression | None:
        """The class a callee's parameter is annotated with (`model: SoundStorm`), followed
        through `self.model = model` in the same class."""
        name = dotted(func)
        if name is None:
            return None
        if "." not in name:
            params = [self.binding(name, func)]
        else:
            params = [
                self.binding(v.value, v)
                for v in self.assigned(name, func)
                if isinstance(v, cst.Name)
            ]
        for param in map(self._unwrapped, params):
            if isinstance(param, cst.Param) and param.annotation is not None:
                annotation = param.annotation.annotation
                if isinstance(annotation, (cst.Name, cst.Attribute)):
                    return annotation
        return None

    def _unwrapped(self, bound: cst.CSTNode | None, hops: int = 4) -> cst.CSTNode | None:
        """The parameter a name rebound by wrappers that take it first was bound to
        (`model = torch.compile(model)`), else `bound`."""
        while hops and isinstance(bound, cst.Assign) and len(bound.targets) == 1:
            name, value = bound.targets[0].target, bound.value
            first = positional(value)[:1] if isinstance(value, cst.Call) else []
            if not (isinstance(name, cst.Name) and first and code(first[0]) == name.value):
                break
            bound, hops = self.binding(name.value, first[0]), hops - 1
        return bound


class _Callees:
    """Part of `Tracer`: where a callee is defined: its bindings, the methods of the class it
    builds, torch loss instances and their reduction, parameter defaults, same-file helpers."""

    def assigned(self, name: str, use: cst.CSTNode) -> list[cst.BaseExpression]:
        """The values the file assigns to a dotted `name`; for `self.x`, those of the class
        that holds `use` (each trainer class of a file has its own `self.model`)."""
        values = self.tree.assigned_values.get(name, [])
        if name.split(".", 1)[0] != "self":
            return values
        owner = _class_of(self.tree, use)
        return [v for v in values if _class_of(self.tree, v) is owner]

    def bound_value(self, func: cst.Name | cst.Attribute) -> cst.BaseExpression | None:
        """The lambda or call a callee name was assigned (`loss_fn = lambda ...`), else None."""
        name = dotted(func)
        if name is None:
            return None
        if "." in name:
            values = self.assigned(name, func)
        else:
            stmt = self.binding(name, func)
            values = [stmt.value] if isinstance(stmt, BINDS_VALUE) else []
        return next((v for v in values if isinstance(v, (cst.Lambda, cst.Call))), None)

    def loss_method(self, func: cst.BaseExpression) -> cst.FunctionDef | None:
        """The `forward` (or `__call__`) of the same-file class a constructor call names."""
        return self.method(func, "forward") or self.method(func, "__call__")

    def method(self, func: cst.BaseExpression, name: str) -> cst.FunctionDef | None:
        """A method of the same-file class a constructor call names."""
        cls = self._classes.get(dotted(func) or "")
        return methods_of(cls).get(name) if cls is not None else None

    def _reduction(self, configured: cst.Call, call: cst.Call, what: str) -> Origin:
        """A torch loss's origin by its `reduction=`; `configured` is the call that sets it."""
        given = keyword(configured, "reduction")
        reduction = "mean" if given is None else string_value(given)
        if reduction == "sum":
            found = self._sum(call, f"{what} with reduction='sum'")
        elif reduction == "none":
            found = Origin("elementwise", f"{what} with reduction='none'", call, tree=self.tree)
        elif reduction is None:  # handed in (`reduction=reduction`): a factory's caller says
            found = Origin(
                "unknown", f"{what} with `reduction={code(given)}`", call, tree=self.tree
            )
        else:
            found = self._mean(call, f"{what} with the default reduction='mean'")
        return replace(found, configured=configured)

    def loss_instance(self, func: cst.BaseExpression) -> cst.Call | None:
        """The `nn.CrossEntropyLoss(...)` call a callee was bound to, or is (called at once:
        `nn.CrossEntropyLoss(ignore_index=-1)(logits, labels)`), if any."""
        if isinstance(func, cst.Call) and self._is_torch_loss(func):
            return func
        name = dotted(func)
        if name is None:
            return None
        candidates = self.assigned(name, func) if "." in name else []
        if not candidates:
            stmt = self.binding(name, func)
            candidates = [stmt.value] if isinstance(stmt, BINDS_VALUE) else []
        calls = [v for v in candidates if isinstance(v, cst.Call)]
        built = next((v for v in calls if self._is_torch_loss(v)), None)
        return built or next((b for v in calls if (b := self._configured_loss(v))), None)

    def _configured_loss(self, call: cst.Call) -> cst.Call | None:
        """The torch loss `hydra.utils.instantiate(cfg.criterion)` builds, as the project's
        YAML configs name it (`_target_: torch.nn.CrossEntropyLoss`, its arguments)."""
        args = positional(call)
        if self.imports is None or last_name(call.func) != "instantiate" or not args:
            return None
        key = string_value(args[0].slice[0].slice.value) if _subscript(args[0]) else None
        key = key or last_name(args[0])
        found = configured_target(self.imports.directory, key or "", self.imports.dependencies)
        if found is None or not found[0].startswith("torch."):
            return None
        target, arguments, _, _ = found
        spelled = ", ".join(f"{k}={_literal(v)}" for k, v in arguments.items())
        try:
            built = cst.parse_expression(f"{target}({spelled})")
        except cst.ParserSyntaxError:
            return None
        return built if isinstance(built, cst.Call) and self._is_torch_loss(built) else None

    def _is_torch_loss(self, call: cst.Call) -> bool:
        qualified = self.tree.qualified(call.func) or ""
        return qualified.startswith("torch.") and qualified.rsplit(".", 1)[-1] in TORCH_LOSSES

    def default(self, func: cst.BaseExpression) -> cst.BaseExpression | None:
        """The default of the parameter a callee names (`loss_func=F.cross_entropy`): what
        runs unless the caller hands in another function."""
        if not isinstance(func, cst.Name) or func not in self.tree.order:
            return None
        param = self.binding(func.value, func)
        if isinstance(param, cst.Param) and isinstance(param.default, (cst.Name, cst.Attribute)):
            return param.default
        return None

    def helper(self, func: cst.BaseExpression) -> cst.FunctionDef | None:
        """The same-file function (or `self.` method) a callee names."""
        name = dotted(func)
        if (
            name is None
            or name.count(".") > 1
            or (name.count(".") == 1 and not name.startswith("self."))
        ):
            return None
        return self.tree.functions.get(name.rsplit(".", 1)[-1])

    def returns(self, function: cst.FunctionDef) -> list[cst.BaseExpression]:
        return [
            node.value
            for node in self.tree.in_scope(function)
            if isinstance(node, cst.Return) and node.value is not None
        ]

    def binding(self, name: str, use: cst.CSTNode) -> cst.CSTNode | None:
        """The last statement before `use` in its scope (then the module) that binds `name`."""
        tree = self.tree
        scope = tree.scope_of(use)
        where = tree.order[use]
        for region in (scope, tree.module) if scope is not tree.module else (scope,):
            earlier = [
                node
                for node in tree.bindings(region).get(name, ())
                if node is not use
                and tree.order[node] <= where
                and not tree.contains(node, use)
                and not self._apart(node, use)
                and not self._ruled_out(node)
            ]
            if earlier:
                return earlier[-1]
            if isinstance(region, cst.FunctionDef):
                params = region.params
                for param in (*params.posonly_params, *params.params, *params.kwonly_params):
                    if param.name.value == name:
                        return param
        return None

    def _apart(self, binding: cst.CSTNode, use: cst.CSTNode) -> bool:
        """Whether `binding` and `use` lie in two arms of one `if` (`if m: loss = a` / `else:
        loss = loss.mean()`): the one never reaches the other, whatever their order."""
        for branch in self.tree.ancestors(binding):
            if isinstance(branch, (cst.FunctionDef, cst.Lambda)):
                return False
            if isinstance(branch, cst.If) and self.tree.contains(branch, use):
                return not any(
                    arm is not None
                    and self.tree.contains(arm, binding)
                    and self.tree.contains(arm, use)
                    for arm in (branch.body, branch.orelse)
                )
        return False

    def _ruled_out(self, node: cst.CSTNode) -> bool:
        """Whether `node` lies in an arm of an `if` that the helper's call being traced rules
        out (`if reduction == "sum": ...` when the call passes `reduction="mean"`)."""
        function, values = self._settled
        if not values or self.tree.scope_of(node) is not function:
            return False
        for branch in self.tree.ancestors(node):
            if branch is function:
                break
            if isinstance(branch, cst.If):
                taken = _decided(branch.test, values)
                arm = branch.body if taken is False else branch.orelse if taken else None
                if arm is not None and self.tree.contains(arm, node):
                    return True
        return False


class _Counts:
    """Part of `Tracer`: what a mean divides by, where the code shows it, in the terms of a
    function's parameters."""

    def valid_count(self, origin: Origin) -> cst.BaseExpression | None:
        """What a mean loss divides by, where the code shows it: a masked mean's own count,
        or the targets of a torch token loss (no class weights) that are not its ignore value."""
        if origin.kind != "mean" or origin.count is not None:
            return origin.count
        call = origin.source
        if not isinstance(call, cst.Call):
            return None
        averaged = averaged_mean(call, self.tree)
        if averaged is not None:  # `x.mean()`: every element counts, unless each is a mean
            if self.mean_along(averaged) is not None:
                return None
            return cst.Call(cst.Attribute(averaged, cst.Name("numel")))
        configured = origin.configured or self.loss_instance(call.func) or call
        name = (self.tree.qualified(configured.func) or "").rsplit(".", 1)[-1]
        target = loss_target(call)
        weighted = keyword(configured, "weight") or keyword(call, "weight")
        if name not in TOKEN_LOSSES or target is None or weighted is not None:
            return None
        return valid_targets(target, configured)

    def mean_along(self, expr: cst.BaseExpression, depth: int = 0) -> cst.Call | None:
        """The mean along a dimension that `expr` is, or a same-file helper it calls returns
        (`losses.mean(1)`): the elements of `expr` are then means, each over its own count."""
        if depth > MAX_DEPTH:
            return None
        if isinstance(expr, cst.Name) and expr in self.tree.order:
            value = self._value(expr)
            return self.mean_along(value, depth + 1) if value is not None else None
        if not isinstance(expr, cst.Call):
            return None
        if _along_a_dimension(expr, self.tree):
            return expr
        helper = self.helper(expr.func)
        if helper is None:
            return None
        found = (self.mean_along(r, depth + 1) for r in self.returns(helper))
        return next((f for f in found if f is not None), None)

    def per_row(self, expr: cst.BaseExpression, depth: int = 0) -> cst.BinaryOperation | None:
        """The quotient by a count per row that `expr` is (`per_row / lengths`, `lengths` being
        `mask.sum(-1)`): each of its elements is a row normalised by its own count, so a mean of
        them counts rows."""
        if isinstance(expr, cst.Name) and expr in self.tree.order and depth <= MAX_DEPTH:
            value = self._value(expr)
            return self.per_row(value, depth + 1) if value is not None else None
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
            return expr if self._counted_along(expr.right, depth + 1) else None
        return None

    def counts_rows(self, origin: Origin) -> bool:
        """Whether a loss is a mean of per-row means (`(per_row / lengths).mean()`, each row
        normalised by its own count): it counts rows, not their tokens."""
        return origin.rows or (origin.kind == "mean" and self.row_quotient(origin) is not None)

    def row_quotient(self, origin: Origin) -> cst.BinaryOperation | None:
        """The per-row quotient (`per_row / lengths`) that the `x.mean()` a loss made in this
        file is averages."""
        source = None if origin.module else origin.source
        reduced = averaged_mean(source, self.tree) if isinstance(source, cst.Call) else None
        return self.per_row(reduced) if reduced is not None else None

    def summed_along(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """Whether `expr` sums along a dimension (`jnp.sum(logp * labels, axis=1)`, or a
        name bound to that): one element per row, so a mean of it counts rows."""
        if isinstance(expr, cst.Name) and expr in self.tree.order and depth <= MAX_DEPTH:
            value = self._value(expr)
            return value is not None and self.summed_along(value, depth + 1)
        return isinstance(expr, cst.Call) and _along_a_dimension(expr, self.tree, ("sum",))

    def _counted_along(self, divisor: cst.BaseExpression, depth: int) -> bool:
        """Whether a divisor is a count per row: it sums along a dimension (`mask.sum(-1)`,
        `width - paddings.sum(axis=-1)`), here or in a value one of its names is bound to."""
        if depth > MAX_DEPTH:
            return False
        for node in walk(divisor):
            if isinstance(node, cst.Call) and _along_a_dimension(node, self.tree, ("sum",)):
                return True
            if isinstance(node, cst.Name) and node in self.tree.order:
                value = self._value(node)
                if value is not None and self._counted_along(value, depth + 1):
                    return True
        return False

    def _value(self, name: cst.Name) -> cst.BaseExpression | None:
        """The value `name = value` binds where `name` is read, else None."""
        stmt = self.binding(name.value, name)
        return assigned_value(stmt, name.value)

    def inlined(
        self, expr: cst.BaseExpression, function: cst.FunctionDef
    ) -> cst.BaseExpression | None:
        """`expr` in the terms of `function`'s parameters (and `torch`): each local name
        replaced by the one value it is bound to, a module constant (`IGNORE_INDEX = -100`) by
        its literal, casts dropped; None when it reads anything else (`self`, a name bound
        twice, another module global)."""
        try:
            return self._inlined(expr, function, 0)
        except _Foreign:
            return None

    def at_call(
        self, expr: cst.BaseExpression, function: cst.FunctionDef, call: cst.Call
    ) -> cst.BaseExpression | None:
        """`expr`, read in `function`, as `call` of it sees it: `inlined`, then each parameter
        swapped for the argument passed (`(labels >= 0).sum()` for `f(x, batch["labels"])`);
        None unless each is passed as a name, attribute or subscript, safe to read again."""
        inner = self.inlined(expr, function)
        if inner is None:
            return None
        passed = {
            name: argument
            for name, parameter in call_parameters(function).items()
            if (argument := argument_for(call, parameter)) is not None
            and not any(isinstance(n, cst.Call) for n in walk(argument))
        }
        if not variables(inner) - {"torch"} <= passed.keys():
            return None
        return substituted(inner, lambda name: passed.get(name.value))

    def uninlined(self, expr: cst.BaseExpression, function: cst.FunctionDef) -> cst.Name | None:
        """The name that keeps `expr` from being written in `function`'s parameters (None
        when it can be): the innermost of its locals `inlined` cannot follow to one value."""
        try:
            self._inlined(expr, function, 0)
        except _Foreign as exc:
            return exc.args[0]
        return None

    def _inlined(
        self, expr: cst.BaseExpression, function: cst.FunctionDef, depth: int
    ) -> cst.BaseExpression:
        """`inlined`, raising `_Foreign` with the name it cannot follow."""
        bindings = self.tree.bindings(function)

        def local(name: cst.Name) -> cst.BaseExpression | None:
            if name.value in ("None", "True", "False"):
                return None
            if name not in self.tree.order:  # substituted from another module's function
                raise _Foreign(name)
            bound = self.binding(name.value, name)
            while _reshaped(bound, name.value):  # `targets = targets.reshape(-1)`: same count
                bound = self.binding(name.value, bound)
            if name.value == "torch" or self._cast_argument(name, expr):  # kept, or dropped
                return None
            if isinstance(bound, cst.Param) and name.value != "self":
                return None
            constant = self._constant(name.value, bound)
            if constant is not None:
                return constant
            if (
                depth >= MAX_DEPTH // 4
                or not isinstance(bound, cst.Assign)
                or len(bound.targets) != 1
                or not isinstance(bound.targets[0].target, cst.Name)
                or (
                    len(bindings.get(name.value, ())) != 1
                    and not (self.tree.contains(function, bound) and self._reaches(bound, name))
                )
            ):
                raise _Foreign(name)
            try:
                return self._inlined(bound.value, function, depth + 1)
            except _Foreign as inner:  # named by the innermost local it cannot follow
                read = inner.args[0]
                found = self.binding(read.value, read) if read in self.tree.order else None
                local = isinstance(found, (cst.Assign, cst.AugAssign, cst.AnnAssign))
                raise inner if local and self.tree.contains(function, found) else _Foreign(name)

        return _uncast(substituted(expr, local))

    def _constant(self, name: str, bound: cst.CSTNode | None) -> cst.BaseExpression | None:
        """The literal a module binds `name` to, once and at its top level (`IGNORE_INDEX =
        -100`): the same wherever it is read."""
        module = self.tree.module
        if not (
            isinstance(bound, cst.Assign)
            and self.tree.parents.get(self.tree.parents.get(bound)) is module
            and len(self.tree.bindings(module).get(name, ())) == 1
        ):
            return None
        value = bound.value
        number = value.expression if isinstance(value, cst.UnaryOperation) else value
        if isinstance(number, (cst.Integer, cst.Float)) and (
            number is value or isinstance(value.operator, cst.Minus)
        ):
            return value
        return None

    def _reaches(self, binding: cst.CSTNode, use: cst.CSTNode) -> bool:
        """Whether `binding`, the last before `use`, is the one `use` reads whichever way the
        code ran: the block that holds `binding` also holds `use`."""
        line = self.tree.parents.get(binding)
        block = self.tree.parents.get(line) if line is not None else None
        return block is not None and self.tree.contains(block, use)

    def _cast_argument(self, node: cst.CSTNode, within: cst.CSTNode) -> bool:
        """Whether `node` is inside the arguments of a cast (`x.type(y.type())`) in `within`."""
        for outer in self.tree.ancestors(node):
            if (
                isinstance(outer, cst.Call)
                and isinstance(outer.func, cst.Attribute)
                and outer.func.attr.value in CASTS
                and not self.tree.contains(outer.func, node)
            ):
                return True
            if outer is within:
                return False
        return False


def scale_loss_call(tree: Tree, name: cst.Name) -> cst.Call | None:
    """The `amp.scale_loss(loss, optimizer)` of apex whose `with` binds `name` (`as
    scaled_loss`) around it: the loss times a constant loss scale, which apex removes from the
    gradients before the step; else None."""
    for outer in tree.ancestors(name):
        if not isinstance(outer, cst.With):
            continue
        for item in outer.items:
            bound = item.asname.name if item.asname is not None else None
            if (
                isinstance(bound, cst.Name)
                and bound.value == name.value
                and isinstance(item.item, cst.Call)
                and last_name(item.item.func) == "scale_loss"
                and positional(item.item)
            ):
                return item.item
    return None


class Tracer(_Calls, _Callees, _Counts):
    """Traces loss expressions back through assignments, same-file helpers, lambdas, loss
    classes, and (given `imports`, a `repository.Imports`) helpers of other modules."""

    def __init__(self, tree: Tree, imports=None) -> None:
        self.tree = tree
        self.imports = imports
        # the helper being traced from a call, and the literals its parameters hold there
        self._settled: tuple[cst.FunctionDef | None, dict[str, object]] = (None, {})
        # the same-file helpers being traced from their calls, innermost last
        self._calls: list[tuple[cst.FunctionDef, cst.Call]] = []

    def origin(self, expr: cst.BaseExpression, depth: int = 0) -> Origin:
        if depth > MAX_DEPTH:
            return UNKNOWN
        if isinstance(expr, cst.BinaryOperation):
            return self._binary(expr, depth)
        if isinstance(expr, cst.Name):
            return self._name(expr, depth)
        if isinstance(expr, cst.Attribute):
            packed = self._packed_loss(expr) if expr.attr.value == "loss" else None
            if packed is not None:  # `metrics = LossMetrics(loss=losses.mean())`
                return self.origin(packed, depth + 1)
            if expr.attr.value == "loss":
                return self._mean(
                    expr, f"`{code(expr)}`, the mean loss a model returns for its labels"
                )
            return Origin("unknown", f"`{code(expr)}`, whose origin is not visible here")
        if isinstance(expr, cst.Subscript):
            return self._subscript(expr, depth)
        if isinstance(expr, cst.Call):
            return self._call(expr, depth)
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            return self.origin(expr.expression, depth + 1)  # `-log_likelihood.mean()`
        return UNKNOWN

    def _packed_loss(self, expr: cst.Attribute) -> cst.BaseExpression | None:
        """For `x.loss` where `x` is bound to a call handed `loss=...` in this file (a metrics
        record): the value handed."""
        if not isinstance(expr.value, cst.Name) or expr.value not in self.tree.order:
            return None
        stmt = self.binding(expr.value.value, expr.value)
        if isinstance(stmt, BINDS_VALUE) and isinstance(stmt.value, cst.Call):
            return keyword(stmt.value, "loss")
        return None

    def _mean(self, node: cst.CSTNode, what: str) -> Origin:
        return Origin("mean", what, node, tree=self.tree)

    def _sum(self, node: cst.CSTNode, what: str) -> Origin:
        return Origin("sum", what, node, tree=self.tree)

    def _binary(self, expr: cst.BinaryOperation, depth: int) -> Origin:
        left = self.origin(expr.left, depth + 1)
        if isinstance(expr.operator, cst.Divide):
            if left.kind == "sum" and self._kept_for_the_window(expr.right, expr):
                return left  # `loss * tokens / reference`: a sum over the window's first count
            count, constant = self._count_of(expr) if left.kind == "sum" else (None, None)
            if count is not None:
                what = f"`{code(expr)}`, a sum over its own count ({MASKED_MEAN})"
                # what divided the sum divides the mean (`loss_sum / k / n_tokens`)
                mean = replace(
                    self._mean(expr, what),
                    count=count,
                    ignored=ignored_value(count),
                    divisions=left.divisions,
                )
                return mean.divided(Division(expr, constant)) if constant is not None else mean
            return left.divided(Division(expr, expr.right))
        right = self.origin(expr.right, depth + 1)
        if isinstance(expr.operator, cst.Multiply):
            known = left.kind != "unknown" or right.kind == "unknown"  # else the left, as read
            loss, other = (left, expr.right) if known else (right, expr.left)
            return self._times(expr, loss, other)
        if isinstance(expr.operator, (cst.Add, cst.Subtract)):
            for kind in ("mean", "sum", "elementwise"):
                for side, other, term in ((left, expr.right, right), (right, expr.left, left)):
                    if side.kind == kind:
                        alone = replace(term, added="", terms=())
                        terms = (*side.terms, alone, *term.terms)
                        return replace(side, added=side.added or code(other), terms=terms)
        return UNKNOWN

    def _times(self, node: cst.CSTNode, loss: Origin, factor: cst.BaseExpression) -> Origin:
        """A loss times a factor (`node`): a mean times a count is a sum; times a weight, or
        anything else times a factor, the loss as it was."""
        if loss.kind == "mean" and not _is_weight(factor) and code(factor) not in self._unscaled:
            return self._sum(node, f"`{code(node)}`, a mean times a count")
        return loss

    @cached_property
    def _unscaled(self) -> frozenset[str]:
        """What the file's optimizer steps are handed to undo (atlas's fp16 loss scale,
        `optimizer.step(scale=scale)`): loss scales, which keep a mean a mean."""
        return frozenset(
            code(arg.value) for call in self.tree.calls if is_step(call) for arg in call.args
        )

    def _count_of(self, expr: cst.BinaryOperation):
        """For `sum / divisor`: (the micro-batch's count, a constant factor beside it or None)
        when the divisor is computed per micro-batch (`sum / (n_tokens * k)`: (`n_tokens`,
        `k`)), else (None, None)."""
        divisor = unguarded(expr.right)
        if isinstance(divisor, cst.BinaryOperation) and isinstance(divisor.operator, cst.Multiply):
            for count, constant in ((divisor.left, divisor.right), (divisor.right, divisor.left)):
                if self._per_micro_batch(expr, count) and not self._per_micro_batch(expr, constant):
                    return count, constant
        return (expr.right, None) if self._per_micro_batch(expr, expr.right) else (None, None)

    def _kept_for_the_window(self, divisor: cst.BaseExpression, expr: cst.CSTNode) -> bool:
        """Whether a divisor is a name the loop around `expr` sets once a window and keeps
        (`reference = reference or max(tokens, 1)`, or bound under `if reference is None:`),
        reset only to a constant (`reference = None` at the step): a window's constant, by
        which a sum stays a sum, unlike the micro-batch's own count."""
        name = unguarded(divisor)
        loop = next((a for a in self.tree.ancestors(expr) if isinstance(a, LOOPS)), None)
        if not isinstance(name, cst.Name) or loop is None:
            return False
        kept = False
        for binding in self.tree.bindings(self.tree.scope_of(expr)).get(name.value, ()):
            if not self.tree.contains(loop, binding):
                continue
            value = assigned_value(binding, name.value)
            if value is None:
                return False
            if isinstance(value, (cst.Integer, cst.Float)) or dotted(value) == "None":
                continue  # reset
            guarded = any(
                isinstance(a, cst.If)
                and self.tree.contains(a.body, binding)
                and code(a.test) in (f"{name.value} is None", f"not {name.value}")
                for a in self.tree.ancestors(binding)
            )
            if not (guarded or name.value in reads(value)):
                return False
            kept = True
        return kept

    def _per_micro_batch(self, expr: cst.CSTNode, divisor: cst.BaseExpression) -> bool:
        """Whether a divisor is computed inside the loop that holds `expr` (a micro-batch count)."""
        loop = next((a for a in self.tree.ancestors(expr) if isinstance(a, LOOPS)), None)
        if loop is None:
            count = unguarded(divisor)
            if isinstance(count, cst.Name):
                return self._counted_here(count, expr)
            return not isinstance(count, (cst.Attribute, cst.Integer, cst.Float))
        assigned = self.tree.assigned_in(loop)
        count = unguarded(divisor)
        if isinstance(count, cst.Subscript) and _per_window(count):  # `totals[step // k]`
            return depends_on(count.value, assigned)
        return depends_on(divisor, assigned)

    def _counted_here(self, count: cst.Name, expr: cst.CSTNode) -> bool:
        """Whether a named divisor outside any loop is a count the same function takes of its
        tensors (`count = (~pad_mask).sum()`, `n = x.numel()`): a helper's own count."""
        binding = self.binding(count.value, expr)
        scope = self.tree.scope_of(expr)
        if not isinstance(binding, cst.Assign) or not isinstance(scope, cst.FunctionDef):
            return False
        if self.tree.scope_of(binding) is not scope:
            return False
        value = unguarded(binding.value)
        return any(
            isinstance(node, cst.Call) and last_name(node.func) in TENSOR_COUNTS
            for node in self.tree.walk(value)
        )

    def _name(self, expr: cst.Name, depth: int) -> Origin:
        binding = self.binding(expr.value, expr)
        if binding is None:
            scaling = scale_loss_call(self.tree, expr)
            if scaling is not None:  # apex's `with amp.scale_loss(loss, opt) as scaled_loss:`
                return self.origin(positional(scaling)[0], depth + 1)
            return Origin("unknown", f"`{expr.value}`, whose origin is not visible here")
        found = self._from_binding(expr.value, binding, depth)
        earlier = self._bypassed(expr.value, binding, expr)
        if found.kind == "unknown" and not found.divisions and earlier is not None:
            untaken = self._from_binding(expr.value, earlier, depth)  # the branch not taken
            if untaken.kind == "unknown":
                return found
            taken = next(a for a in self.tree.ancestors(binding) if isinstance(a, cst.If))
            return replace(untaken, branch=taken)  # `if loss_fct: loss = loss_fct(...)`
        rival = self._rival(expr.value, binding) if found.kind in ("mean", "unknown") else None
        if rival is not None:  # `if mask: loss = masked mean / else: loss = x.mean()`
            other = self._from_binding(expr.value, rival, depth)
            block = next(a for a in self.tree.ancestors(binding) if isinstance(a, cst.Else))
            branch = self.tree.parents[block]  # `if labels: ce(...) / else: out.loss`
            if found.kind == "unknown":  # `else: loss = scst_train_iter(...)`: the path in sight
                return replace(other, branch=branch) if other.kind == "mean" else found
            if other.kind == "mean" and bool(other.added) != bool(found.added):
                # `if moe: loss = lm + aux / else: loss = lm`: a term added on one path only
                return replace(found if found.added else other, branch=branch)
            if other.kind == "mean" and (
                (MASKED_MEAN in other.what and MASKED_MEAN not in found.what)
                or (other.configured is not None and found.configured is None)
            ):  # the one over its own count can vary, or the one whose loss is in sight:
                return replace(other, branch=branch)
        return found

    def _rival(self, name: str, binding: cst.CSTNode) -> cst.CSTNode | None:
        """The last binding of `name` in the `if` body whose `else` holds `binding`."""
        block = next((a for a in self.tree.ancestors(binding) if isinstance(a, cst.Else)), None)
        branch = self.tree.parents.get(block) if block is not None else None
        if not isinstance(branch, cst.If) or self.tree.scope_of(branch) is not self.tree.scope_of(
            binding
        ):
            return None
        bound = [
            node
            for node in self.tree.bindings(self.tree.scope_of(binding)).get(name, ())
            if self.tree.contains(branch.body, node)
        ]
        return bound[-1] if bound else None

    def bypassed(self, name: cst.Name) -> cst.CSTNode | None:
        """The earlier binding that reaches the read `name` when its last one sits in an `if`
        with neither `else` nor `elif` that the read lies outside (`loss = zero` / `if mode ==
        "lm": loss = ce(...)`), else None; never a `None`, which no backward takes."""
        binding = self.binding(name.value, name)
        if binding is None:
            return None
        branch = next(
            (a for a in self.tree.ancestors(binding) if isinstance(a, (cst.If, cst.FunctionDef))),
            None,
        )
        if not isinstance(branch, cst.If) or branch.orelse is not None:
            return None
        if isinstance(self.tree.parents.get(branch), cst.If):  # an `elif`
            return None
        if name.value in variables(getattr(binding, "value", None) or cst.Name("_")):
            return None  # `if k > 1: loss = loss / k`: the one value on both paths
        earlier = self._bypassed(name.value, binding, name)
        none = earlier is not None and code(earlier.value) == "None"  # no loss to backpropagate
        return None if none else earlier

    def _bypassed(self, name: str, binding: cst.CSTNode, use: cst.CSTNode) -> cst.CSTNode | None:
        """The binding before `binding` that also reaches `use`, when `binding` sits in an `if`
        that does not hold `use` (`loss = out[0]` / `if loss_fct: loss = loss_fct(...)`)."""
        branch = next(
            (a for a in self.tree.ancestors(binding) if isinstance(a, (cst.If, cst.FunctionDef))),
            None,
        )
        if not isinstance(branch, cst.If) or self.tree.contains(branch, use):
            return None
        earlier = self.binding(name, branch)
        return earlier if isinstance(earlier, BINDS_VALUE) else None

    def bound(self, name: str, statement: cst.CSTNode) -> Origin:
        """Where `name` comes from as `statement` binds it (`loss, nll = helper(...)`)."""
        return self._from_binding(name, statement, 0)

    def _from_binding(self, name: str, stmt: cst.CSTNode, depth: int) -> Origin:
        if isinstance(stmt, cst.Param):
            return self._handed_in(name, stmt, depth)
        if isinstance(stmt, cst.AugAssign):
            previous = self.binding(name, stmt)
            before = self._from_binding(name, previous, depth + 1) if previous else UNKNOWN
            if isinstance(stmt.operator, cst.DivideAssign):
                return before.divided(Division(stmt, stmt.value))
            if isinstance(stmt.operator, cst.AddAssign) and _zero(assigned_value(previous, name)):
                return self.origin(stmt.value, depth + 1)  # `loss = 0`, then `loss += head_loss`
            multiplied = isinstance(stmt.operator, cst.MultiplyAssign) and before.kind == "mean"
            if multiplied and not _is_weight(stmt.value):  # `loss *= weights[i]` stays a mean
                return self._sum(stmt, f"`{name}` multiplied by a count")
            return before
        value = stmt.value if isinstance(stmt, BINDS_VALUE) else None
        if value is None:
            return UNKNOWN
        targets = (
            [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
        )
        for target in targets:
            if isinstance(target, (cst.Tuple, cst.List)):
                return self._unpacked(name, target, value, depth)
        if _averages_itself(name, value):  # DataParallel's `loss = loss.mean()`
            previous = self.binding(name, stmt)
            averaged = self._from_binding(name, previous, depth + 1) if previous else UNKNOWN
            if averaged.kind != "elementwise":  # else the mean of its elements: `x.mean()`
                return averaged
        found = self.origin(value, depth + 1)
        if found.kind == "unknown" and "loss" in name and _calls_a_model(value):
            what = f"`{name}` returned by `{code(value.func)}(...)`, a model's mean loss"
            return replace(self._mean(value, what), from_model=True)
        return found

    def _handed_in(self, name: str, param: cst.Param, depth: int) -> Origin:
        """A parameter of the helper being traced from its call is what the call hands it
        (`combine(kd, out.loss)` returning `alpha * kd + (1 - alpha) * original_loss`)."""
        helper, call = self._calls[-1] if self._calls else (None, None)
        parameter = call_parameters(helper).get(name) if helper is not None else None
        passed = argument_for(call, parameter) if parameter is not None else None
        if passed is None or self.tree.scope_of(param) is not helper:
            return Origin("unknown", f"`{name}`, a parameter of the function")
        frame = self._calls.pop()  # the argument is read where the call stands
        try:
            return self.origin(passed, depth + 1)
        finally:
            self._calls.append(frame)

    def _unpacked(self, name: str, target, value, depth: int) -> Origin:
        index = next((i for i, e in enumerate(target.elements) if _unpacks_to(e.value, name)), None)
        if index is None:
            return UNKNOWN
        if _leading(value):  # `loss, logits = outputs[:2]`: the call's first elements
            value = self.origin_call(value.value) or value
        literal = isinstance(value, (cst.Tuple, cst.List)) and index < len(value.elements)
        inner = target.elements[index].value
        if isinstance(inner, (cst.Tuple, cst.List)):  # `(quantized, codes), loss = ...`
            if not literal:
                return UNKNOWN
            return self._unpacked(name, inner, value.elements[index].value, depth)
        if literal:
            return self.origin(value.elements[index].value, depth + 1)
        if isinstance(value, cst.Call):
            element = self.element(value, index, depth)
            if element is not None:
                return element
            if "loss" in name:
                names = (last_name(e.value) or "" for e in target.elements)
                counts = (n for n in names if COUNT_BESIDE.match(n))
                beside = "" if SAYS_MEAN.search(name) else next(counts, "")
                what = f"`{name}` returned by `{code(value.func)}(...)`, " + (
                    f"beside the count `{beside}`" if beside else "a model's mean loss"
                )
                return replace(self._mean(value, what), from_model=True, beside=beside)
        return UNKNOWN

    def element(self, call: cst.Call, index: int, depth: int = 0) -> Origin | None:
        """The origin of element `index` of what `call` returns, where gaaudit reads the
        function called: a helper of the file, an imported function or a module's `forward`."""
        if (element := self._returned_element(call, index)) is not None:
            return self.origin(element, depth + 1)
        imported = self._imported(call.func, call, index)
        if imported is None and self.imports is not None:
            imported = self.imports.called(self, call, index)
        return imported

    def _returned_element(self, call: cst.Call, index: int) -> cst.BaseExpression | None:
        """Element `index` of the tuple or list that the helper of the file `call` calls
        returns (its first such `return`), if it has one."""
        helper = self.helper(call.func)
        if helper is None:
            return None
        returned = [r for r in self.returns(helper) if isinstance(r, (cst.Tuple, cst.List))]
        if returned and index < len(returned[0].elements):
            return returned[0].elements[index].value
        return None

    def _subscript(self, expr: cst.Subscript, depth: int) -> Origin:
        key = expr.slice[0].slice if len(expr.slice) == 1 else None
        index = key.value if isinstance(key, cst.Index) else None
        item = self._item_binding(expr) if string_value(index) is not None else None
        if item is not None:  # `outputs["loss"] = outputs["loss"] / k`: what it holds now
            return self.origin(item.value, depth + 1)
        if string_value(index) == "loss":
            return self._mean(expr, f"`{code(expr)}`, the mean loss a model returns for its labels")
        if isinstance(index, cst.Integer):
            outputs = self.origin_call(expr.value)
            # `outputs = self.forward(...)`, which returns `[loss]` or `(loss, logits)`
            position = literal_eval(index.value)  # `0`, `0x1`, `1_0`
            found = self.element(outputs, position, depth) if outputs is not None else None
            if found is not None and found.kind != "unknown":
                return found
            if index.value == "0" and outputs is not None and self._passes_labels(outputs):
                return self._mean(expr, f"`{code(expr)}`, the loss of a model called with labels")
            return found or UNKNOWN
        return UNKNOWN

    def _item_binding(self, expr: cst.Subscript) -> cst.Assign | None:
        """The last assignment before `expr`, in its scope, to the item it reads (`outputs[
        "loss"] = ...`), on a path that reaches it."""
        if expr not in self.tree.order:  # an expression gaaudit wrote, in no statement
            return None
        spelled, scope = code(expr), self.tree.scope_of(expr)
        found = [
            node
            for node in self.tree.assignments
            if isinstance(node, cst.Assign)
            and self.tree.scope_of(node) is scope
            and self.tree.order[node] < self.tree.order[expr]
            and any(
                isinstance(t.target, cst.Subscript) and code(t.target) == spelled
                for t in node.targets
            )
            and not self.tree.contains(node, expr)
            and not self._apart(node, expr)
        ]
        return found[-1] if found else None


def _leading(expr: cst.BaseExpression) -> bool:
    """`x[:n]` or `x[0:n]`: the first elements of `x`, each where it was."""
    if not (isinstance(expr, cst.Subscript) and len(expr.slice) == 1):
        return False
    part = expr.slice[0].slice
    return (
        isinstance(part, cst.Slice)
        and (part.lower is None or code(part.lower) == "0")
        and part.step is None
    )


def _unpacks_to(target: cst.BaseExpression, name: str) -> bool:
    """Whether an unpacking target binds `name`, nested targets included."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return any(_unpacks_to(e.value, name) for e in target.elements)
    return last_name(target) == name


def _subscript(expr: cst.BaseExpression) -> bool:
    """`cfg["criterion"]`: one index."""
    return (
        isinstance(expr, cst.Subscript)
        and len(expr.slice) == 1
        and isinstance(expr.slice[0].slice, cst.Index)
    )


def _literal(value: str) -> str:
    """A YAML scalar as Python code: numbers and booleans as they are, the rest quoted."""
    lowered = value.lower()
    if lowered in ("true", "false", "null", "none"):
        return {"true": "True", "false": "False"}.get(lowered, "None")
    try:
        float(value)
        return value
    except ValueError:
        return repr(value.strip("'\""))


def _class_of(tree: Tree, node: cst.CSTNode) -> cst.ClassDef | None:
    """The class whose body holds `node`, if any."""
    return next((a for a in tree.ancestors(node) if isinstance(a, cst.ClassDef)), None)
