"""Plan the sum-and-count rewrite of each finding (GA-GUIDE sections 4-5) as node-keyed edits."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from pathlib import Path

import libcst as cst

from gaaudit.analysis.domain import Domain, Domains, shifts_labels
from gaaudit.analysis.loops import Window, calls_of, is_step, run_again, runner
from gaaudit.analysis.provenance import (
    TOKEN_LOSSES,
    Origin,
    Tracer,
    averaged_mean,
    loss_target,
    same_count,
    scale_loss_call,
    valid_targets,
)
from gaaudit.analysis.tree import (
    LOOPS,
    Tree,
    abstract,
    argument_for,
    assigned_value,
    call_parameters,
    code,
    depends_on,
    dotted,
    keyword,
    last_name,
    methods_of,
    parameter_names,
    positional,
    spread,
    substituted,
    target_names,
    variables,
    walk,
)
from gaaudit.checks.accumulation import Auditor, Site
from gaaudit.discover.modules import shown
from gaaudit.discover.source import SourceError, parse
from gaaudit.findings import Finding
from gaaudit.fixes.edits import (
    DIVIDE_NOTE,
    PRECISION,
    WEIGHT_NOTE,
    Edits,
    Unfixable,
    atom,
    bound_torch,
    copy_edits,
    indented,
    may_be_fp16,
    runs_again,
    statement_line,
    torch_module,
    with_argument,
    with_parameter,
)
from gaaudit.fixes.lightning import _LightningWindow
from gaaudit.fixes.read_ahead import _ReadAhead, unmoved
from gaaudit.vocabulary import CLIPPERS, DISTRIBUTED_STARTS, GATHERED_PACKAGES, RETURN_COUNT

COUNT_NOTE = "# the caller weights this mean by its count: sum and count per micro-batch"
# why a model that takes its targets out of what it is handed is not fixed, and what to do
COUNTED_INSIDE = (
    "where gaaudit cannot count them: have the model return its count of valid targets beside "
    "the loss, backpropagate the loss times that count and divide the gradients once by the "
    "window's total"
)
PATH_NOTE = "# sum and count: the count this path's mean averages over"
SKIPPED_NOTE = "# sum and count: a micro-batch whose backward is skipped adds no count"
HELPER_NOTE = (
    "# sum and count: asked for its count, backpropagate the micro-batch's sum; "
    "the caller divides once"
)
RETURNED_NOTE = "# sum and count: the caller adds this count to its window's"
ADDED_NOTE = "# sum and count: the window's total, to divide its gradients once at the step"
MAX_REBINDINGS = 8  # how far back `labels = labels.to(device)` chains are followed


@dataclass(frozen=True)
class Outcome:
    """What happened to one finding: fixed (safe or unsafe) or skipped, and why."""

    site: Site | Finding  # a finding where no planner took it
    line: int
    column: int
    applied: bool
    reason: str = ""
    cell: int | None = None  # in a notebook: the cell `line` counts within

    @property
    def location(self) -> str:
        if self.cell is None:
            return f"{self.line}:{self.column}"
        return f"cell {self.cell}:line {self.line}:col {self.column}"


FRAMEWORK_ONLY = {  # why a framework's own division has no mechanical rewrite, by "loss is returned"
    False: "DeepSpeed divides inside `engine.backward` and ZeRO keeps gradients outside `param.grad`, "
    "so they cannot be divided once after the window; read the window's micro-batches ahead, count "
    "their valid tokens N over the P data-parallel processes, and pass "
    "`loss_sum * gradient_accumulation_steps * P / N` to `backward` "
    "(see `gaaudit explain GA003`)",
    True: "the framework divides the returned loss by the accumulation steps, and the window's "
    "count is not known where the loss is returned; read the window's micro-batches ahead, count "
    "their valid tokens N over the P data-parallel processes, and return `loss_sum * k * P / N` "
    "(see `gaaudit explain GA003`)",
}
MEGATRON = (  # Megatron's schedule divides by the micro-batches; megatron-core can count tokens
    "Megatron's schedule divides the loss by the number of micro-batches; with megatron-core, "
    "return the micro-batch's loss sum and its valid-token count (`return loss_sum, num_tokens, "
    "{...}`) and train with `--calculate-per-token-loss`, which divides the window's gradients "
    "once by the sum of its micro-batches' counts (see `gaaudit explain GA003`)"
)
ACROSS_CALLS = (
    "the window spans calls of `{function}` (as in Lightning manual optimisation), so its "
    "count must outlive each call{clipped}: {first}keep the window's valid-token count {holder} "
    "(add each micro-batch's count and pass `loss * count` to backward), divide the gradients "
    "once by it before `{optimizer}.step()`, then reset it (see `gaaudit explain {code}`)"
)
CLIPPED_CALLS = (  # what ACROSS_CALLS says where each call clips, before what to do
    ", and each call clips the gradients (`{clip}`, line {line}) before the window is "
    "complete, which would clip a count-weighted sum far harder than the mean it replaces (nor "
    "does a loop of the file draw the calls' micro-batches, to count them ahead)"
)
SUMMABLE = ("torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss")
SUMMABLE_MODULES = ("CrossEntropyLoss", "NLLLoss")
CLIPS = (*CLIPPERS, "clip_gradients")  # torch's, and Lightning Fabric's
LOGGING_METHODS = ("item", "detach", "float", "cpu", "clone")
EXITS = (cst.Continue, cst.Break, cst.Return, cst.Raise)


@dataclass(frozen=True)
class Weighted:
    """`loss = loss / k` rewritten in a window: its name, `k`, the statement, whether now a sum."""

    name: str
    divisor: str
    statement: cst.CSTNode
    summed: bool


def fresh(tree: Tree, name: str) -> str:
    """`name`, or `name_2`, ... : one no name of the module already uses."""
    taken = {n.value for n in tree.walk(tree.module) if isinstance(n, cst.Name)}
    candidate, suffix = name, 1
    while candidate in taken:
        suffix += 1
        candidate = f"{name}_{suffix}"
    return candidate


def count_names(tree: Tree, domains: list[Domain]) -> tuple[str, str]:
    """Fresh names for a micro-batch's count and its window's total: `micro_tokens` and
    `window_tokens` only where every loss is known to average over tokens, else the neutral
    `micro_count` and `window_count` (examples, elements, or a count gaaudit cannot name)."""
    noun = "tokens" if domains and all(d.kind == "tokens" for d in domains) else "count"
    return fresh(tree, f"micro_{noun}"), fresh(tree, f"window_{noun}")


def returns_count(
    tree: Tree,
    edits: Edits,
    function: cst.FunctionDef,
    returned: cst.Return,
    count: str,
    note: str = COUNT_NOTE,
) -> None:
    """`function` also returns the count beside its mean at `returned` when its caller asks
    (`return_count=True`); its other callers get the mean as before."""
    edits.replace[function.params] = with_parameter(function.params, RETURN_COUNT, "False")
    line = statement_line(tree, returned)
    value = returned.value
    if isinstance(value, cst.Tuple):  # `return loss, aux`: the count goes last
        elements = ", ".join(
            f"*{code(e.value)}" if isinstance(e, cst.StarredElement) else code(e.value)
            for e in value.elements
        )
        edits.insert_before(line, f"{note}\nif {RETURN_COUNT}:\n    return {elements}, {count}")
        return
    names = isinstance(value, cst.List) and all(
        isinstance(e.value, cst.Name) for e in value.elements
    )
    if not isinstance(value, cst.Name) and not names:  # `return [loss]` is read twice as it is
        mean = cst.Name(fresh(tree, "mean_loss"))
        bind = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(mean)], value)])
        edits.before.setdefault(line, []).append(bind)  # the value's layout kept
        edits.replace[value] = value = mean
    edits.insert_before(line, f"{note}\nif {RETURN_COUNT}:\n    return {code(value)}, {count}")


def _clips(call: cst.Call) -> bool:
    """`clip_grad_norm_(...)`, `fabric.clip_gradients(...)`, ..."""
    return (dotted(call.func) or "").rsplit(".", 1)[-1] in CLIPS


def _takes_return_count(tree: Tree, function: cst.FunctionDef) -> bool:
    """Whether `function` already has a `return_count` parameter."""
    return any(
        isinstance(p, cst.Param) and p.name.value == RETURN_COUNT
        for p in tree.walk(function.params)
    )


def _element(
    value: cst.BaseExpression | None, index: int | None, arity: int | None
) -> cst.BaseExpression | None:
    """A returned value, or its element `index` when it is a tuple of `arity` elements."""
    if index is None or value is None:
        return value
    if isinstance(value, cst.Tuple) and len(value.elements) == arity:
        return value.elements[index].value
    return None


def _loss_returns(
    tree: Tree, tracer: Tracer, function: cst.FunctionDef, index: int | None, arity: int | None
) -> list[tuple[cst.Return, Origin]]:
    """The `return`s of `function` whose value (its element `index` of `arity`) is a mean
    loss, with what that mean is."""
    return [
        (node, found)
        for node in tree.in_scope(function)
        if isinstance(node, cst.Return)
        and (value := _element(node.value, index, arity)) is not None
        and (found := tracer.origin(value)).kind == "mean"
    ]


def _passed_on(
    tree: Tree,
    tracer: Tracer,
    function: cst.FunctionDef,
    losses: list[tuple[cst.Return, Origin]],
) -> cst.Call | None:
    """The call of another function of the module that `function` returns as it is
    (`return self._loss(logits, labels)`) where that is its one loss and made there."""
    if len(losses) != 1:
        return None
    returned, found = losses[0]
    value = returned.value
    inner = tracer.helper(value.func) if isinstance(value, cst.Call) else None
    if (
        not isinstance(inner, cst.FunctionDef)
        or inner is function
        or found.source is None
        or not tree.contains(inner, found.source)
    ):
        return None
    return value


def _made_on_every_path(tree: Tree, tracer: Tracer, value: cst.BaseExpression, named: str) -> None:
    """Refuse a returned name bound to its mean in an `if` without `else`, which a placeholder
    bound before it (no mean, so no counted targets) bypasses on the other path."""
    other = tracer.bypassed(value) if isinstance(value, cst.Name) else None
    if other is None:
        return
    made = tracer.binding(value.value, value)
    branch = next(a for a in tree.ancestors(made) if isinstance(a, cst.If))
    raise Unfixable(
        f"{named} returns `{value.value}` as a mean (line {tree.line(made)}) only on one path "
        f"of the `if` on line {tree.line(branch)}; on the other it is what line "
        f"{tree.line(other)} binds, over no counted targets: return beside the loss the count "
        "of valid targets it averages over on each path (0 where it makes no mean)"
    )


def _wrapped(tree: Tree, functions: set[cst.FunctionDef], module: str) -> str:
    """Why a fix that has `functions` return a count when asked is unsafe: a decorator wraps
    one, which gaaudit does not read; else ""."""
    for function in sorted(functions, key=tree.order.__getitem__):
        if function.decorators:
            name = function.name.value
            return (
                f"`@{code(function.decorators[0].decorator)}` wraps `{name}` ({module}), which "
                f"gaaudit does not read: assumes it passes `{RETURN_COUNT}` on and returns what "
                f"`{name}` returns"
            )
    return ""


def _defined(tree: Tree, name: str) -> cst.FunctionDef | None:
    """The top-level function `name`, or the method of `Class.method`."""
    owner, _, method = name.rpartition(".")
    for statement in tree.module.body:
        if not owner and isinstance(statement, cst.FunctionDef) and statement.name.value == name:
            return statement
        if owner and isinstance(statement, cst.ClassDef) and statement.name.value == owner:
            return next(
                (
                    m
                    for m in statement.body.body
                    if isinstance(m, cst.FunctionDef) and m.name.value == method
                ),
                None,
            )
    return None


def _assigns_to_itself(statement: cst.CSTNode, division: cst.CSTNode) -> bool:
    """`loss = loss / k`: one name target, the same name divided."""
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Assign)
        and statement.body[0].value is division
        and len(statement.body[0].targets) == 1
        and isinstance(statement.body[0].targets[0].target, cst.Name)
        and isinstance(division, cst.BinaryOperation)
        and code(division.left) == statement.body[0].targets[0].target.value
    )


class _Counting:
    """Part of `Planner`: where a micro-batch's count comes from: the loss's own targets, or a
    same-file helper that returns it when asked; and the windows no count can fix (clipped per
    micro-batch, pipeline stages)."""

    # --- the count of valid targets in one micro-batch -------------------------------------

    def count(self, site: Site) -> tuple[tuple[str, str], bool]:
        """(count expression, caveat) and whether the fix is safe: not where the loss's
        function is handed in (`train(..., step_fn)`), whose other callers may hand others."""
        self.asked = None
        (count, caveat), safe = self._own_count(site)
        callee = site.origin.callee
        if not safe or not callee or "." in callee:  # no function, or a model's `forward`
            return (count, caveat), safe
        bound = self._binding_call(self._loss_use(site), lambda call, _: True, unpacked=True)
        func = bound[0].value.func if bound else None
        if not (
            isinstance(func, cst.Name) and func.value in parameter_names(self.tree.scope_of(func))
        ):
            return (count, caveat), safe  # the loss's own call, not one that feeds it (`model`)
        name = func.value
        function = self.tree.scope_of(bound[0]).name.value
        where = f" ({site.origin.module})" if site.origin.module else ""
        caveat = (
            f"`{name}` is a parameter of `{function}()`: assumes every caller hands "
            f"`{callee}`{where}, whose count this is"
        )
        return (count, caveat), False

    def one_mean(self, site: Site) -> Site:
        """`site` with a loss that adds means over its own mean's count (`0.8 * ce + w * kl`,
        `kl` masked over the same targets) seen as one mean, weighted as a whole by that
        count; else `site` as it is."""
        origin = site.origin
        if not origin.terms or origin.source is None:
            return site
        try:
            (count, _), safe = self._mean_count(origin, site)
        except Unfixable:
            return site
        for term in origin.terms:
            other = self._term_count(term, origin, site) if safe else None
            if other is None or not same_count(count, other, targets=origin.count is None):
                return site
        return replace(site, origin=replace(origin, added="", terms=()))

    def _term_count(self, term: Origin, mean: Origin, site: Site) -> str | None:
        """What a mean added to `mean` divides by, as the code beside `mean` reads it: made
        there, or a masked mean of a same-file function called there once (written in the
        call's arguments); None where gaaudit cannot tell, or its names are bound again."""
        if (
            term.kind != "mean"
            or term.source is None
            or term.divisions
            or term.through
            or term.beside
            or term.branch is not None
        ):
            return None
        tracer, scope = self.auditor.tracer, self.tree.scope_of(mean.source)
        made = self.tree.scope_of(term.source)
        if made is scope:
            try:
                (count, _), safe = self._mean_count(term, site)
            except Unfixable:
                return None
            at = term.source
        else:
            calls = [
                c
                for c in self.tree.calls
                if tracer.helper(c.func) is made and self.tree.scope_of(c) is scope
            ]
            if term.count is None or len(calls) != 1:
                return None
            lifted = tracer.at_call(term.count, made, calls[0])
            if lifted is None:
                return None
            count, safe, at = code(lifted), True, calls[0]
        read = variables(cst.parse_expression(count))
        if not safe or any(
            tracer.binding(n, at) is not tracer.binding(n, mean.source) for n in read
        ):
            return None
        return count

    def _own_count(self, site: Site) -> tuple[tuple[str, str], bool]:
        origin = site.origin
        source = origin.source
        if runner(site.window) == "pretrain":
            raise Unfixable(MEGATRON)
        if (
            site.kind == "framework-division"
            and (self._accelerator(site) is None or site.window.kind == "framework")
            and self._engine(site) is None
            and self.lightning_module(site) is None
        ):  # a framework's returned loss, or accelerate handing the loss to DeepSpeed
            raise Unfixable(FRAMEWORK_ONLY[site.backward.call is None])
        if site.window.kind == "calls":
            raise Unfixable(self._across_calls(site))
        if self._passes_gradients(site.window):
            raise Unfixable(
                "a pipeline stage: the other stages get their gradients through "
                "`backward(gradient=...)`, so weighting the last stage's loss would scale theirs "
                "too; make the last stage's loss `loss_sum / N` with N the step's valid-token "
                "count, counted before the schedule runs (see `gaaudit explain GA002`)"
            )
        if site.window.kind == "pipeline":
            raise Unfixable(
                "the pipeline schedule calls the loss function per micro-batch and the window's "
                "count is not known there; count the step's valid tokens N before the "
                "schedule runs and make the loss `loss_sum / N` (see `gaaudit explain GA003`)"
            )
        if origin.module and origin.count is None and not self.reach:
            raise Unfixable(
                f"the loss is computed in {origin.module}, which a fix of standard input or of "
                "a notebook leaves as it is: run `gaaudit fix` on the files of the repository"
            )
        if origin.kind != "mean" or (source is None and origin.count is None and not origin.module):
            raise Unfixable(self._untraced(site))
        if origin.beside:
            raise Unfixable(
                f"`{code(source.func)}(...)` returns the count `{origin.beside}` beside the loss, "
                "which may then be the sum over it; if it is a mean, backpropagate "
                f"`loss * {origin.beside}` and divide the gradients once by the window's total "
                f"of `{origin.beside}`"
            )
        branch = origin.branch or self._bound_in_if(site)
        if branch is not None:
            return self._count_on_each_path(site, branch)
        kept = [
            d for d in origin.divisions if site.division is None or d.node is not site.division.node
        ]
        if kept:
            raise Unfixable(
                f"the loss is also divided by `{code(kept[0].divisor)}` (line "
                f"{self.tree.line(kept[0].node)}), which the count-weighted sum would keep; "
                "weight each micro-batch by its valid-target count instead of that factor"
            )
        chain = self._helper_call(site) if source is not None else ()
        self.counted_inside = ""
        if origin.module and origin.count is None:  # its function returns its count too
            caveat = self._companion_count(site)
            return (self.micro, caveat), not caveat
        counted = self._mean_count(origin, site)
        if not chain:
            return counted
        (count, caveat), safe = counted
        name = self.auditor.tracer.helper(chain[0].value.func).name.value
        self.counted_inside = (
            f"`{name}()` (line {self.tree.line(chain[0])}) makes the loss and returns its count "
            "when asked"
        )
        if len(chain) == 1:
            self.asked = (chain[0], count, copy_edits(self.edits))  # a read-ahead asks otherwise
        else:  # the relay asks the helper, and returns the count it gets when asked itself
            relay = self.auditor.tracer.helper(chain[0].value.func)
            self._return_count(chain[1], count, self._return_of(relay))
            count = self.micro
        self._return_count(chain[0], count, self._loss_use(site))
        return (self.micro, caveat), safe

    def _across_calls(self, site: Site) -> str:
        """Why a window spanning calls of one function is not fixed, and what to do: its count
        kept on `self`, or in the enclosing function (a closure an engine calls per batch)."""
        function = self.tree.scope_of(site.window.anchor)
        outer = self.tree.scope_of(function)
        holder = (
            f"in a variable of `{outer.name.value}()` that `{function.name.value}` declares "
            "`nonlocal`"
            if isinstance(outer, cst.FunctionDef)
            else "on `self`"
        )
        clip = self._clips_each_micro_batch(site.window)
        return ACROSS_CALLS.format(
            function=function.name.value,
            clipped=CLIPPED_CALLS.format(clip=code(clip.func), line=self.tree.line(clip))
            if clip is not None
            else "",
            first="clip once, at the step, then " if clip is not None else "",
            holder=holder,
            optimizer=self._optimizer(site.window),
            code=site.code,
        )

    def _mean_count(self, origin: Origin, site: Site) -> tuple[tuple[str, str], bool]:
        """What a mean made in this file divides by: (count expression, caveat), and
        whether that is certain."""
        source = origin.source
        inner = self._pass_loop(source, site)
        if inner is not None:
            raise Unfixable(
                f"the loss adds up the means line {self.tree.line(source)} makes on each pass "
                f"of the loop on line {self.tree.line(inner)}, each over a count of its own: "
                "have each pass add its loss sum and its valid-target count, backpropagate the "
                "sums' total and divide the gradients once by the window's count"
            )
        if origin.count is not None:  # a masked mean: the count it divides by
            return (code(origin.count), ""), True
        if isinstance(source, (cst.Attribute, cst.Subscript)):
            return self._model_count(source), True
        if isinstance(source, cst.Call):
            return self._call_count(source, origin)
        raise Unfixable(self._untraced(site))

    def _pass_loop(self, source: cst.CSTNode | None, site: Site) -> cst.CSTNode | None:
        """A loop of the function that makes the mean `source` which does not hold the
        loss's use (`for head in range(n): loss += ce(...)`): the mean is one of a pass."""
        if source is None or source not in self.tree.order:
            return None
        use = self._loss_use(site)
        for node in self.tree.ancestors(source):
            if isinstance(node, (cst.FunctionDef, cst.Lambda)) or self.tree.contains(node, use):
                return None
            if isinstance(node, LOOPS):
                return node
        return None

    def _bound_in_if(self, site: Site) -> cst.If | None:
        """The innermost `if` not holding the loss's use (in the loop, or the `return` of the
        helper that makes it) whose arm binds the mean the loss is (`if c: loss = masked mean`
        / `elif d: loss = x.mean()`): other paths to the use may bind it otherwise."""
        source, use = site.origin.source, self._loss_use(site)
        if source is not None and self.tree.scope_of(source) is not self.tree.scope_of(use):
            use = self._return_of(self.tree.scope_of(source)) or use  # a helper's `return loss`
        for name in self.tree.walk(use):
            binding = (
                self.auditor.tracer.binding(name.value, name)
                if isinstance(name, cst.Name)
                else None
            )
            if binding is None or source is None or not self.tree.contains(binding, source):
                continue
            for node in self.tree.ancestors(binding):
                if isinstance(node, (cst.FunctionDef, cst.Lambda)) or self.tree.contains(node, use):
                    break
                if isinstance(node, cst.If):
                    return node
        return None

    def _count_on_each_path(self, site: Site, branch: cst.If) -> tuple[tuple[str, str], bool]:
        """A loss bound on the paths of an `if` (nested ones, `elif`s), each a mean over a count
        of its own (`if mask is not None: loss = masked mean` / `else: loss = x.mean()`): each
        path binds its count just before its loss; the loop weights by that name, which a helper
        of this file that makes the loss (`loss = helper(...)`) returns beside it when asked."""
        tracer = self.auditor.tracer
        use = looped = self._loss_use(site)
        call = None
        if self.tree.scope_of(branch) is not self.tree.scope_of(use):
            call = next(iter(self._helper_call(site)), None)
            helper = self.auditor.tracer.helper(call.value.func) if call is not None else None
            if helper is self.tree.scope_of(branch):
                use = self._return_of(helper)
        bound = [
            (name.value, binding)
            for name in self.tree.walk(use)
            if isinstance(name, cst.Name)
            and (binding := tracer.binding(name.value, name)) is not None
            and self.tree.contains(branch, binding)
        ]
        line, scope = self.tree.line(branch), self.tree.scope_of(branch)
        if isinstance(scope, cst.FunctionDef) and scope is not self.tree.scope_of(looped):
            line = f"{line} of `{scope.name.value}()`"
        refusal = (
            f"the loss is defined otherwise on a path of the `if` on line {line}, over a "
            "count of its own, {}: bind each path's valid-target count beside its loss, then "
            "backpropagate the loss times that count"
        )
        top = self._arms_holding(branch, use) if len(bound) == 1 else None
        if (
            len(bound) != 1
            or scope is not self.tree.scope_of(use)
            or (site.division is not None and self.tree.contains(top or branch, site.division.node))
        ):
            raise Unfixable(refusal.format("which gaaudit cannot follow to the backward"))
        if top is None:
            raise Unfixable(refusal.format("and the `if` does not run on every path to it"))
        name, binding = bound[0]
        statements = list(self.tree.parents[top].body)
        bindings = self.tree.bindings(self.tree.scope_of(use)).get(name, [])
        paths = list(dict.fromkeys(self._paths(bindings, statements[: statements.index(top) + 1])))
        if binding not in paths:
            raise Unfixable(refusal.format("which gaaudit cannot follow to the backward"))
        origins = [
            self.one_mean(replace(site, origin=self._path_origin(path, name))).origin
            if isinstance(path, cst.Assign) and len(path.targets) == 1
            else None
            for path in paths
        ]
        added = [o.added for o in origins if o is not None and o.kind == "mean"]
        if any(added) and not all(added):
            raise Unfixable(
                f"the loss adds `{next(a for a in added if a)}` to its mean on one path of the "
                f"`if` on line {self.tree.line(branch)} only: weighting the loss by the mean's "
                "count would weight that term too; add the term on every path (zero where it is "
                "absent), so the mean's term can be weighted alone"
            )
        counts, asked = [], []
        for path, origin in zip(paths, origins):
            made = self.tree.scope_of(origin.source) if origin and origin.source else None
            helper = tracer.helper(path.value.func) if self._calls(path) else None
            here = made is self.tree.scope_of(path) and isinstance(path.targets[0].target, cst.Name)
            asking = made is helper and helper is not None and self._asks(helper)
            if (
                origin is None
                or origin.kind != "mean"
                or origin.divisions
                or origin.added
                or origin.beside
                or origin.branch is not None
                or not (here or asking)
            ):
                raise Unfixable(
                    refusal.format(
                        f"and on line {self.tree.line(path)} no mean gaaudit can count"
                        if path is not None
                        else "and a path reaches the backward with no loss bound in sight"
                    )
                )
            counts.append(self._mean_count(origin, site))
            asked.append(asking)
        for path, ((count, _), _), ask in zip(paths, counts, asked):
            if ask:  # `loss, nll = helper(...)`, a function of the file that returns its count
                self._return_count(path, count, None)  # each other path binds its own
                continue
            self.edits.insert_before(
                statement_line(self.tree, path), f"{PATH_NOTE}\n{self.micro} = {count}\n"
            )
        self.counted_inside = f"each path of the `if` on line {line} binds its count"
        if call is not None:
            self._return_count(call, self.micro, looped)
        caveat = next((caveat for (_, caveat), _ in counts if caveat), "")
        return (self.micro, caveat), all(safe for _, safe in counts)

    def _path_origin(self, path: cst.Assign, name: str) -> Origin:
        """Where the loss `path` binds comes from: its value (`loss = loss.mean()`), or the
        element of it that an unpacking binds (`loss, nll = helper(...)`)."""
        if isinstance(path.targets[0].target, cst.Name):
            return self.auditor.tracer.origin(path.value)
        return self.auditor.tracer.bound(name, path)

    @staticmethod
    def _calls(statement: cst.CSTNode) -> bool:
        """`x = f(...)` or `x, y = f(...)`."""
        return isinstance(statement, cst.Assign) and isinstance(statement.value, cst.Call)

    def _asks(self, helper: cst.FunctionDef) -> bool:
        """Whether `helper`, a function of the file, can be asked for its count: one
        `return`, and no `return_count` parameter of its own."""
        return self._return_of(helper) is not None and not _takes_return_count(self.tree, helper)

    def _arms_holding(self, branch: cst.If, use: cst.CSTNode) -> cst.CSTNode | None:
        """The statement of the block holding `use` that holds `branch` through `if` arms and
        `with` blocks only, and runs before `use`; None when a loop or a `try` lies between,
        or `use` is inside it."""
        node = branch
        while not self.tree.contains(self.tree.parents[node], use):
            node = self.tree.parents[node]
            if not isinstance(node, (cst.If, cst.Else, cst.IndentedBlock, cst.With)):
                return None
        if isinstance(node, (cst.If, cst.With)) and not self.tree.contains(node, use):
            return node
        return None

    def _paths(
        self, bindings: list[cst.CSTNode], statements: list[cst.CSTNode], before: tuple = (None,)
    ) -> list[cst.CSTNode | None]:
        """Of `bindings` (a name's), the last on each path through `statements` (nested `if`
        arms, `elif`s and `with` blocks followed; an arm that leaves the step skipped); the
        statement holding it when that is another block, None when a path binds none in sight;
        `before`: the paths that reach `statements` without binding the name there."""
        for index in range(len(statements) - 1, -1, -1):
            statement = statements[index]
            inside = [node for node in bindings if self.tree.contains(statement, node)]
            if not inside:
                continue
            earlier = tuple(self._paths(bindings, statements[:index], before))
            if isinstance(statement, cst.If):
                orelse = statement.orelse
                arms = [statement.body.body]
                arms.append(
                    [orelse] if isinstance(orelse, cst.If) else orelse.body.body if orelse else []
                )
                return [
                    path
                    for arm in arms
                    if not _ends_in_exit(arm)
                    for path in self._paths(bindings, list(arm), earlier)
                ]
            if isinstance(statement, cst.With):
                return self._paths(bindings, list(statement.body.body), earlier)
            return [inside[-1] if isinstance(statement, cst.SimpleStatementLine) else statement]
        return list(before)

    @staticmethod
    def _untraced(site: Site) -> str:
        return (
            f"gaaudit could not tell what the loss averages over: it is "
            f"{site.origin.description}; backpropagate each micro-batch's loss sum and divide "
            f"the gradients once by the window's count (see `gaaudit explain {site.code}`)"
        )

    def _window_blocker(self, site: Site) -> str:
        """Why one division at the step cannot fix the window ("" when it can): the window's
        count must then be read ahead, before the backward."""
        if self._engine(site) is not None:
            return FRAMEWORK_ONLY[False]
        if site.window.kind == "callable":
            return (
                f"`{code(site.window.anchor.func)}(...)` backpropagates the loss and steps the "
                "optimizer out of sight, so the gradients cannot be divided once before that step"
            )
        if site.origin.added:
            return (
                f"the loss adds `{site.origin.added}` to its mean: weighting the sum by the "
                "mean's count would weight that term too; weight only the mean's term by its count"
            )
        if site.origin.through:
            return (
                f"the loss passes through `{site.origin.through}(...)`, a torch.autograd.Function "
                "whose `backward` may add gradients of its own, which one division at the step "
                "would divide too"
            )
        wrapper = self._backward_outside_grads(site.window)
        if wrapper is not None:
            return wrapper
        clip = self._clips_each_micro_batch(site.window)
        if clip is not None:
            return (
                f"the gradients are clipped after every micro-batch (`{code(clip.func)}`, line "
                f"{self.tree.line(clip)}), before the window is complete: a count-weighted sum "
                "would be clipped far harder than the mean it replaces; clip once, at the step"
            )
        return ""

    def _clips_each_micro_batch(self, window: Window) -> cst.Call | None:
        """A gradient clipping the loop runs on every micro-batch, outside the step: itself, or
        in a same-file function it calls there (a `backward_step(...)` that also clips)."""
        body = window.loop if window.kind in ("modulo", "micro-loop") else window.anchor
        if window.kind == "calls":  # each call of the function holding the step's guard
            body = self.tree.scope_of(window.anchor)
        for node in self.tree.walk(body) if body is not None else ():
            if not isinstance(node, cst.Call) or self._at_step(window, node):
                continue
            if _clips(node):
                return node
            helper = self.auditor.tracer.helper(node.func)
            if helper is not None and not self.tree.contains(helper, node):
                called = (n for n in self.tree.walk(helper.body) if isinstance(n, cst.Call))
                clip = next((n for n in called if _clips(n) and not self._at_step(window, n)), None)
                if clip is not None:
                    return clip
        return None

    def _at_step(self, window: Window, node: cst.CSTNode) -> bool:
        """Whether `node` runs once per window, with its step."""
        if window.kind in ("modulo", "calls"):
            return any(self.tree.contains(region, node) for region in window.step_region)
        return window.kind == "accumulate" and any(
            isinstance(a, cst.If) and "sync_gradients" in code(a.test)
            for a in self.tree.ancestors(node)
        )

    def _passes_gradients(self, window: Window) -> bool:
        """Whether the window also backpropagates a gradient handed in (a pipeline stage)."""
        return any(
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "backward"
            and keyword(node, "gradient") is not None
            for node in self.tree.walk(window.loop or window.anchor)
        )

    def _helper_call(self, site: Site) -> tuple[cst.Assign, ...]:
        """`loss = helper(...)` in the loop when the mean is made in `helper`, a function of
        this file that returns it from its one `return`; where the loop calls another function
        of the file for it (`loss = self.shared_step(...)`, whose `loss, nll = helper(...)` it
        returns), that call, then the call of `helper`; `()` when the loop makes the mean."""
        source = site.origin.source
        helper = self.tree.scope_of(source)
        loop = self.tree.scope_of(site.backward.call or site.backward.loss)
        if helper is loop:
            return ()
        tracer = self.auditor.tracer
        found = self._binding_call(
            self._loss_use(site), lambda c, _: tracer.helper(c.func) is helper, unpacked=True
        )
        chain = (found[0],) if found is not None else self._relayed(site, helper)
        if not isinstance(helper, cst.FunctionDef) or not chain:
            if not isinstance(helper, cst.FunctionDef):
                raise Unfixable(
                    "the loss is made at the module's top level, outside the function of its "
                    "window; make it in that function"
                )
            name = helper.name.value
            raise Unfixable(
                f"the loss is made in `{name}()` (line {self.tree.line(helper)}) and reaches "
                f"the loop other than as `loss = {name}(...)` or `loss, ... = {name}(...)`, "
                "so the loop cannot ask it for its count; call it so"
            )
        for function in (tracer.helper(call.value.func) for call in chain):
            if self._return_of(function) is None:
                raise Unfixable(
                    f"`{function.name.value}` has more than one `return`; make it return its "
                    "loss from one place, or return the loss's valid-target count beside it"
                )
            if _takes_return_count(self.tree, function):
                raise Unfixable(
                    f"`{function.name.value}` already takes a `{RETURN_COUNT}` parameter"
                )
        return chain

    def _relayed(self, site: Site, helper: cst.CSTNode) -> tuple[cst.Assign, ...]:
        """(`loss = relay(...)` in the loop, `loss, ... = helper(...)` in `relay`): the loop
        gets the loss from a function of this file that gets it from `helper` and returns it
        from its one `return`; `()` where it does not."""
        tracer = self.auditor.tracer

        def relays(call: cst.Call, _) -> bool:
            relay = tracer.helper(call.func)
            return relay not in (None, helper) and self._return_of(relay) is not None

        outer = self._binding_call(self._loss_use(site), relays)
        if outer is None or outer[1] is not None:
            return ()
        returned = self._return_of(tracer.helper(outer[0].value.func))
        inner = self._binding_call(
            returned, lambda call, _: tracer.helper(call.func) is helper, unpacked=True
        )
        return (outer[0], inner[0]) if inner is not None else ()

    def _return_of(self, function: cst.CSTNode) -> cst.Return | None:
        """The one `return` of `function`, when it has one and it returns a value."""
        returns = [n for n in self.tree.in_scope(function) if isinstance(n, cst.Return)]
        return returns[0] if len(returns) == 1 and returns[0].value is not None else None

    @staticmethod
    def _loss_use(site: Site) -> cst.CSTNode:
        """Where the loop uses the loss: its division by K, else its backward."""
        return site.division.node if site.kind == "loss-division" else site.backward.loss

    def _binding_call(
        self, use: cst.CSTNode, matches, unpacked: bool = False, depth: int = 0
    ) -> tuple[cst.Assign, int | None] | None:
        """The `name = f(...)` whose value reaches `use` (through a few assignments) with a
        call that `matches(call, name)`; with `unpacked`, also `a, name, b = f(...)`: then
        which element."""
        for name in self.tree.walk(use):
            if not (isinstance(name, cst.Name) and self.tree.is_variable(name)):
                continue
            bound = self.auditor.tracer.binding(name.value, use)
            if not isinstance(bound, cst.Assign) or len(bound.targets) != 1:
                continue
            target = bound.targets[0].target
            if isinstance(bound.value, cst.Call) and matches(bound.value, name):
                if isinstance(target, cst.Name):
                    return bound, None
                names = [
                    e.value.value
                    for e in getattr(target, "elements", ())
                    if isinstance(e.value, cst.Name)
                ]
                if unpacked and len(names) == len(target.elements) and name.value in names:
                    return bound, names.index(name.value)
            if depth < 3:
                found = self._binding_call(bound.value, matches, unpacked, depth + 1)
                if found is not None:
                    return found
        return None

    def _return_count(self, call: cst.Assign, count: str, use: cst.CSTNode | None) -> None:
        """`helper` also returns the micro-batch's count when the loop asks for it (at `call`,
        and at `use`'s other bindings by it; `use` None: at `call` alone)."""
        helper = self.auditor.tracer.helper(call.value.func)
        if helper.params not in self.edits.replace:  # else done for another backward of it
            returns_count(self.tree, self.edits, helper, self._return_of(helper), count)
        self._ask_count(call, use)

    def _ask_count(self, call: cst.Assign, use: cst.CSTNode | None) -> None:
        """`loss = f(...)` becomes `loss, micro_tokens = f(..., return_count=True)` (and
        `loss, aux = f(...)`, `loss, aux, micro_tokens = ...`), also where another branch of
        an `if` binds the loss that reaches `use` instead (`if fp16: loss = f(...)` /
        `else: loss = f(...)`)."""
        for each in (call, *(self._other_branches(call, use) if use is not None else ())):
            target = each.targets[0].target
            names = code(target.with_changes(lpar=[], rpar=[]))
            self.edits.replace[each] = each.with_changes(
                targets=[cst.AssignTarget(cst.parse_expression(f"{names}, {self.micro}"))],
                value=with_argument(each.value, RETURN_COUNT, "True"),
            )

    def _other_branches(self, call: cst.Assign, use: cst.CSTNode) -> list[cst.Assign]:
        """The bindings of `call`'s names that may reach `use` instead of it: for each `if`
        around `call` but not `use`, the last one in its body when `call` is in its `else`, or
        the last one before the `if` when `call` is in its body. Each must be the same call,
        or the count would be missing on that path."""
        target = call.targets[0].target
        names = {n.value for n in self.tree.walk(target) if isinstance(n, cst.Name)}
        bindings = [
            node
            for name in names
            for node in self.tree.bindings(self.tree.scope_of(call)).get(name, ())
        ]
        found = []
        for branch in self.tree.ancestors(call):
            if isinstance(branch, cst.FunctionDef):
                break
            if not isinstance(branch, cst.If) or self.tree.contains(branch, use):
                continue
            if branch.orelse is not None and self.tree.contains(branch.orelse, call):
                instead = [n for n in bindings if self.tree.contains(branch.body, n)]
            elif self.tree.contains(branch.body, call):
                before = self.tree.order[branch]
                instead = [n for n in bindings if self.tree.order[n] < before]
            else:
                continue
            if not instead:
                continue
            other = max(instead, key=self.tree.order.__getitem__)
            if not (
                isinstance(other, cst.Assign)
                and len(other.targets) == 1
                and code(other.targets[0].target) == code(target)
                and isinstance(other.value, cst.Call)
                and code(other.value.func) == code(call.value.func)
            ):
                raise Unfixable(
                    f"`{code(target)}` is also bound on line {self.tree.line(other)} other "
                    f"than by `{code(call.value.func)}(...)`, which the `if` on line "
                    f"{self.tree.line(branch)} may leave in place of line "
                    f"{self.tree.line(call)}; its count would be missing on that path: bind "
                    "the loss the same way on every path"
                )
            found.append(other)
        return found


class _CompanionCounts:
    """Part of `Planner`: a count made by a model or function of another module: written at the call
    in its arguments, or returned by that function when the loop asks."""

    def _companion_count(self, site: Site) -> str:
        """The loss comes from a function (or a model's `forward`) of another module of the
        repository: that function also returns the count its mean divides by when the loop
        asks for it (`return_count=True`, planned in `companions`); the loop binds it. Where
        it returns the call of a function of its module as it is (`return self._loss(...)`),
        that function returns the count and the caller passes the request on. Returns a
        caveat where the fix is unsafe, else ""."""
        origin, use = site.origin, self._loss_use(site)
        bound = self._binding_call(
            use,
            lambda _, name: (
                (found := self.auditor.tracer.origin(name)).path == origin.path
                and found.callee == origin.callee
            ),
            unpacked=True,
        )
        if bound is None or origin.path is None:
            raise Unfixable(
                f"the loss is computed in {origin.module} and reaches the loop other than as "
                "`loss = f(...)` or `loss, ... = f(...)`; its count is not visible here"
            )
        call, index = bound
        self.counted_inside = f"`{origin.callee}` ({origin.module}) counts the loss's targets"
        if origin.path not in self.companions:
            try:
                data = origin.path.read_bytes()
                self.companions[origin.path] = (Tree(parse(data), data), Edits())
            except (OSError, SourceError) as exc:
                raise Unfixable(f"cannot read {origin.module}: {exc}") from None
        tree, edits = self.companions[origin.path]
        function = _defined(tree, origin.callee)
        if function is None:
            raise Unfixable(f"cannot find `{origin.callee}` in {origin.module}")
        tracer = Tracer(tree)
        arity = None if index is None else len(call.targets[0].target.elements)
        losses = _loss_returns(tree, tracer, function, index, arity)
        passed = _passed_on(tree, tracer, function, losses)
        counter = function if passed is None else tracer.helper(passed.func)
        if passed is not None:
            losses = _loss_returns(tree, tracer, counter, index, arity)
        owner = origin.callee.rpartition(".")[0]
        named = f"`{owner + '.' if owner else ''}{counter.name.value}` ({origin.module})"
        caveat = _wrapped(tree, {function, counter}, origin.module)
        if _takes_return_count(tree, function) or _takes_return_count(tree, counter):
            if f"if {RETURN_COUNT}:" not in tree.module.code_for_node(counter) or (
                passed is not None and keyword(passed, RETURN_COUNT) is None
            ):
                raise Unfixable(f"{named} already takes a `{RETURN_COUNT}` parameter")
            self._ask_count(call, use)  # fixed for another caller already
            return caveat
        if not losses:
            raise Unfixable(
                f"{named} returns its loss from no place gaaudit can trace; return the loss's "
                "valid-target count beside it"
            )
        for returned, _ in losses:
            _made_on_every_path(tree, tracer, _element(returned.value, index, arity), named)
        counts = [self._count_at_return(tree, tracer, counter, each, named) for each in losses]
        if counter.params in edits.replace:
            self._ask_count(call, use)  # this run already changed it, for an earlier call
            return caveat
        for (returned, _), count in zip(losses, counts):
            returns_count(tree, edits, counter, returned, code(count))
        if passed is not None:  # the caller passes the request on to `counter`
            edits.replace[function.params] = with_parameter(function.params, RETURN_COUNT, "False")
            edits.replace[passed] = with_argument(passed, RETURN_COUNT, RETURN_COUNT)
        self._ask_count(call, use)
        return caveat

    def _count_at_return(
        self,
        tree: Tree,
        tracer: Tracer,
        function: cst.FunctionDef,
        loss: tuple[cst.Return, Origin],
        named: str,
    ) -> cst.BaseExpression:
        """The count of the mean that `function` returns at one `return`, in the names it has
        there; refused where a term of another count is added to it, or the count is not
        visible or its names are bound again before that `return`."""
        returned, found = loss
        line = tree.line(returned)
        if found.added:
            raise Unfixable(
                f"{named} returns on line {line} a loss that adds `{found.added}` to a mean, "
                "each term over a count of its own as far as gaaudit can tell; return each "
                "term's valid count beside it and weight each term by its own"
            )
        count = tracer.valid_count(found)
        if count is None or found.divisions:
            raise Unfixable(
                f"gaaudit cannot tell what the loss {named} returns on line {line} averages "
                "over; return the loss's valid-target count beside it"
            )
        moved = [
            n.value
            for n in walk(count)  # `count` is new: its children are not in the tree's index
            if isinstance(n, cst.Name)
            and n in tree.order
            and tree.is_variable(n)
            and (
                not tree.contains(function, n)
                or tracer.binding(n.value, n) is not tracer.binding(n.value, returned)
            )
        ]
        if moved:
            raise Unfixable(
                f"`{moved[0]}`, which the loss's count reads, is not what it was at the "
                f"`return` of {named} (line {line}); return the loss's valid-target count "
                "beside it"
            )
        read = tracer.uninlined(count, function)
        if read is not None and read in tree.order:  # why the loop cannot count it ahead
            at = tree.line(tracer.binding(read.value, read) or read)
            self.counted_inside += f" with `{read.value}` as line {at} there binds it"
        return count

    def _model_count(self, source: cst.CSTNode) -> tuple[str, str]:
        call = self.auditor.tracer.origin_call(source.value)
        either = self.tree.parents.get(call) if call is not None else None
        if isinstance(either, cst.IfExp):
            raise Unfixable(
                f"`{code(source)}` is the loss of one of two calls of `{code(call.func)}` (line "
                f"{self.tree.line(call)}), chosen by `{code(either.test)}`, each counting its "
                "targets its own way: bind each call's loss in an `if` statement of its own"
            )
        labels = None
        if call is not None:
            labels = keyword(call, "labels")
            if labels is not None:  # `(a if mask else b)[..., 1:]`, not `a if mask else b[...]`
                labels = atom(labels)
            elif (unpacked := spread(call)) is not None:
                labels = f'{code(unpacked)}["labels"]'
        if labels is None and call is not None and len(call.args) == len(positional(call)) == 1:
            raise Unfixable(
                f"`{code(source)}` is the loss of `{code(call)}` (line {self.tree.line(call)}), "
                f"which finds its targets in `{code(call.args[0].value)}` itself, {COUNTED_INSIDE}"
            )
        if labels is None:
            made = (
                f"`{code(call.func)}(...)` (line {self.tree.line(call)})" if call else "the model"
            )
            raise Unfixable(
                f"`{code(source)}` is the loss of {made}, which is handed no `labels=` that "
                "gaaudit can count: pass them by that name"
            )
        causal = self._causal(call)
        if causal is None:
            raise Unfixable(
                f"cannot tell whether `{code(call.func)}` (line {self.tree.line(call)}) shifts "
                "its labels before its loss (a causal LM) or not; its count is "
                f"`({labels}[..., 1:] != -100).sum()` if it does, `({labels} != -100).sum()` "
                "if not"
            )
        shifted = f"{labels}[..., 1:]" if causal else labels
        return f"({shifted} != -100).sum()", ""

    def _causal(self, call: cst.Call | None) -> bool | None:
        """Whether the transformers model `call` calls shifts its labels (a causal LM), as the
        file's model class, one built in another module, or labels that copy its inputs say;
        None when gaaudit cannot tell, or the model is no transformers one."""
        causal = shifts_labels(self.text)
        tracer = self.auditor.tracer
        if causal is None and call is not None and tracer.imports is not None:
            causal = shifts_labels(tracer.imports.class_of(tracer, call.func))  # built elsewhere
        if causal is None and call is not None and self._copies_inputs(call):
            causal = True
        return causal

    def _copies_inputs(self, call: cst.Call) -> bool:
        """Whether the `labels=` a model is handed copy the token ids the same call hands it
        (`labels = input_ids.clone()`, its padding then set to -100): scoring a sequence
        against itself, the model shifts it (a causal LM)."""
        labels = keyword(call, "labels")
        fed = {
            base.value
            for a in call.args
            if a.value is not labels and isinstance(base := unmoved(a.value), cst.Name)
        }
        node = labels
        for _ in range(MAX_REBINDINGS):
            node = unmoved(node)
            if not isinstance(node, cst.Name):
                return False
            if node is not labels and node.value in fed:
                return True
            node = assigned_value(self.auditor.tracer.binding(node.value, node), node.value)
        return False

    def _call_count(self, call: cst.Call, origin: Origin) -> tuple[tuple[str, str], bool]:
        func = call.func
        averaged = averaged_mean(call, self.tree)
        if averaged is not None:
            along = self.auditor.tracer.mean_along(averaged)
            if along is not None:
                raise Unfixable(
                    f"the loss averages means along a dimension (`{code(along)}`, line "
                    f"{self.tree.line(along)}), each over a count of its own, which weighting "
                    "the loss by its elements would keep: make that mean a sum, and count "
                    "what it sums"
                )
            return (f"{atom(averaged)}.numel()", ""), True
        qualified = self.tree.qualified(func) or ""
        if qualified in ("torch.mean", "torch.nanmean"):
            return (f"{atom(positional(call)[0])}.numel()", ""), True
        if isinstance(func, cst.Attribute) and func.attr.value in ("mean", "nanmean"):
            return (f"{atom(func.value)}.numel()", ""), True
        if origin.from_model:
            return self._returned_count(call)
        configured = self.auditor.tracer.loss_instance(func) or call
        named = (
            self.auditor.tracer.default(configured.func) or configured.func
        )  # `loss_fn=F.nll_loss`
        name = (self.tree.qualified(named) or "").rsplit(".", 1)[-1]
        target = loss_target(call)
        if target is None:
            raise Unfixable(
                f"`{code(func)}(...)` (line {self.tree.line(call)}) is handed no target gaaudit "
                "can count: pass it as the second argument or as `target=`"
            )
        if name not in TOKEN_LOSSES:
            caveat = (
                f"assumes `{code(func)}` is its default" if named is not configured.func else ""
            )
            return (f"{atom(target)}.numel()", caveat), not caveat
        if keyword(configured, "weight") is not None or (
            configured is not call and keyword(call, "weight")
        ):
            raise Unfixable(
                "the loss has class weights: its mean divides by the targets' summed weights"
            )
        count = code(valid_targets(target, self._ignore_here(configured, call)))
        if named is not configured.func:
            return (count, f"assumes `{code(func)}` is its default, `{code(named)}`"), False
        return (count, ""), True

    def _ignore_here(self, configured: cst.Call, call: cst.Call) -> cst.Call:
        """`configured` (the loss's constructor) with its `ignore_index=` read as `call`'s
        function can: a local of another method (`__init__`'s `pad_id`) read through the
        attribute that method keeps it in (`self.pad_id`); refused where none keeps it."""
        ignore = keyword(configured, "ignore_index")
        made, used = self.tree.scope_of(configured), self.tree.scope_of(call)
        if ignore is None or made is used or not isinstance(made, cst.FunctionDef):
            return configured
        local = parameter_names(made) | set(self.tree.bindings(made))
        kept = {  # `self.pad_id = pad_id` in the method that builds the loss, set only there
            stmt.value.value: code(stmt.targets[0].target)
            for stmt in self.tree.assignments
            if isinstance(stmt, cst.Assign)
            and self.tree.scope_of(stmt) is made
            and len(stmt.targets) == 1
            and isinstance(stmt.value, cst.Name)
            and (dotted(stmt.targets[0].target) or "").startswith("self.")
            and len(self.tree.assigned_values.get(code(stmt.targets[0].target), ())) == 1
        }
        owner, user = (
            next((a for a in self.tree.ancestors(f) if isinstance(a, cst.ClassDef)), None)
            for f in (made, used)
        )
        same_class = owner is not None and owner is user
        if same_class and made.params.params and used.params.params:  # the instance (`self`)
            instance, there = (f.params.params[0].name.value for f in (made, used))
            kept[instance] = there  # is the loop's too, by its own name there
        missing = sorted(
            name
            for name in variables(ignore)
            if name in local and not (same_class and name in kept)
        )
        if missing:
            raise Unfixable(
                f"the loss's ignore value `{code(ignore)}` is read in `{made.name.value}()` "
                f"(line {self.tree.line(configured)}), where the loop cannot see "
                f"`{missing[0]}`: keep it on the instance or pass it, and count the targets "
                "that are not it"
            )
        renamed = substituted(
            ignore,
            lambda name: (
                cst.parse_expression(kept[name.value])
                if name.value in local and name.value in kept
                else None
            ),
        )
        return with_argument(configured, "ignore_index", code(renamed))

    def _spread_labels(self, call: cst.Call) -> cst.BaseExpression | None:
        """`batch["labels"]` of a transformers model handed `**batch` (whose own loss reads its
        `labels`), where the file shows the model's kind; else None."""
        unpacked = spread(call)
        if unpacked is None or self._causal(call) is None:
            return None
        return cst.parse_expression(f'{code(unpacked)}["labels"]')

    def _uncounted(self, call: cst.Call) -> str:
        """Why a model's own loss has no count here: the repository class it is annotated
        with makes it out of sight, it picks its targets out of a spread dict, or none of its
        arguments is named as its targets."""
        made = f"`{code(call.func)}(...)` (line {self.tree.line(call)})"
        tracer = self.auditor.tracer
        annotated = tracer.annotated_class(call.func)
        reference = tracer.imports.reference(annotated) if annotated and tracer.imports else None
        found = tracer.imports.summary(reference) if reference is not None else None
        if found is not None and found.is_class:
            return (
                f"{made} runs `{found.name}` ({shown(found.path)}), which makes a loss "
                "gaaudit cannot trace to a count: have it return the loss's valid count beside "
                "it (one per mean term if it adds means over different counts), backpropagate "
                "the loss times that count and divide the gradients once by the window's total"
            )
        unpacked = spread(call)
        if unpacked is not None:  # `model(**inputs)`: the model picks its targets out
            return f"{made} finds its targets in `**{code(unpacked)}`, {COUNTED_INSIDE}"
        return (
            f"{made} computes its own loss, and none of its arguments is named as its targets: "
            "pass them as `labels=` or `targets=`"
        )

    def _own_method(self, call: cst.Call) -> cst.FunctionDef | None:
        """The method of the class around `call` that a `self.name(...)` call runs."""
        name = dotted(call.func) or ""
        owner = next((a for a in self.tree.ancestors(call) if isinstance(a, cst.ClassDef)), None)
        if owner is None or not name.startswith("self.") or name.count(".") != 1:
            return None
        return methods_of(owner).get(name.removeprefix("self."))

    def _returned_count(self, call: cst.Call) -> tuple[tuple[str, str], bool]:
        method = self._own_method(call)
        if method is not None and abstract(method):
            raise Unfixable(
                f"`{code(call.func)}(...)` (line {self.tree.line(call)}) is left to subclasses "
                f"(`def {method.name.value}`, line {self.tree.line(method)}), each making its loss "
                "over a count of its own that this loop cannot see: have each return its "
                "micro-batch's valid-target count beside the mean, backpropagate the mean times "
                "that count and divide the gradients once by the window's total"
            )
        args = positional(call)
        named = [arg for arg in args if re.search(r"(?i)label|target", code(arg))]
        labels = keyword(call, "labels") or self._spread_labels(call)
        target = (
            keyword(call, "targets")
            or labels
            or (named[0] if len(named) == 1 else None)  # `model(ids, pos, types, label_ids)`
            or (args[1] if len(args) == 2 else None)  # `model(x, y)`
        )
        if target is None:
            raise Unfixable(self._uncounted(call))
        ignore = re.search(r"ignore_index\s*=\s*(-?\d+)", self.text) or re.search(
            r"(-100)\b", self.text
        )
        causal = self._causal(call) if target is labels else None
        if causal is not None:  # a transformers model's `labels=`: -100 unless set otherwise
            shifted = f"{atom(target)}[..., 1:]" if causal else atom(target)
            return (f"({shifted} != {ignore.group(1) if ignore else -100}).sum()", ""), True
        if ignore:
            return (f"({atom(target)} != {ignore.group(1)}).sum()", ""), True
        return (
            f"{atom(target)}.numel()",
            "assumes every target counts: no ignore_index is visible",
        ), False


class _LossRewrite:
    """Part of `Planner`: the micro-batch's loss made its token sum: the division by K undone, the
    backward weighted, a user's read of the divided loss left as it was."""

    # --- the rewrite --------------------------------------------------------------------------

    def _rewrite(self, site: Site, count: str) -> None:
        """Make the micro-batch's loss its token sum, then prepare the window's one division."""
        if site.window.anchor in self._ahead_windows:
            raise Unfixable("the window is read ahead for another loss of it")
        call, loop = site.backward.call, site.window.loop
        if call is not None and loop is not None and not self.tree.contains(loop, call):
            self._rewrite_in_helper(site, count)
            return
        kept = self._kept_for_reads(site)
        scaled = self._scaled(site)
        first = self._prepared.get(site.window.anchor)
        if first is not None and self._scaled(first[0]) != scaled:
            scaled_line, plain_line = (
                self.tree.line(s.backward.call or s.backward.loss)
                for s in ((site, first[0]) if scaled else (first[0], site))
            )
            raise Unfixable(
                f"the window backpropagates through the GradScaler on line {scaled_line} and "
                f"without it on line {plain_line}; one division at the step would meet "
                "gradients of two scales: scale both backward passes, or neither"
            )
        # `sum / (count * k)` or `sum / k / count` rewritten: the divisions make the mean and
        # divide it by K, so the micro-batch's sum is in sight (a kept name is weighted as any
        # mean/K)
        source = site.origin.source
        own = site.kind == "loss-division" and not kept
        own = own and (
            site.division.node is source
            or isinstance(source, cst.BinaryOperation)
            and isinstance(source.operator, cst.Divide)
            and source.left is site.division.node
        )
        if own and scaled:
            raise Unfixable(
                f"`{code(site.division.node)}` divides the loss's sum by its count and K at once "
                "before the GradScaler: backpropagate the scaled sum and divide the gradients "
                "once by the window's count"
            )
        summed = None if kept or scaled or own else self._summed(site)
        factor = self._framework_factor(site)
        if own:
            factor = factor.removeprefix(" * ")
        elif summed is None:
            weight = f"({self.micro} / {self.reference})" if scaled else self.micro
            factor = weight + factor
        else:
            self.edits.replace[summed] = with_argument(summed, "reduction", '"sum"')
            factor = factor.removeprefix(" * ")
        guard = None
        if site.kind == "loss-division" and not kept:
            node = site.division.node
            anchor = statement_line(self.tree, node)
            new = self._undivided(node, anchor, factor)
            if own:  # `sum / k / count`: the sum alone
                node = source
            guard = self._divisor_guard(anchor, site.division.divisor)
            self._note_logged_reads(site, node, anchor, summed is not None or own, guard or anchor)
        else:
            node = site.backward.loss
            anchor = statement_line(self.tree, site.backward.call)
            if kept:  # the name keeps the divided mean its readers log; the backward undoes `/ k`
                anchor = statement_line(self.tree, site.division.node)
                factor = f"{code(site.division.divisor)} * {factor}"
            applied = self._applied(node)
            text = code(applied)
            if isinstance(applied, cst.BinaryOperation):  # `(loss * scale)`: `loss * scale * n`
                product = isinstance(applied.operator, cst.Multiply)
                text = code(applied.with_changes(lpar=[], rpar=[])) if product else f"({text})"
            new = cst.parse_expression(f"{text} * {factor}") if factor else node
            if factor and isinstance(
                self.tree.parents[node], cst.Attribute
            ):  # `(loss * n).backward()`
                new = new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            if site.kind == "gradient-division":
                self._remove(site.division.node, site.window)
        if node not in self.edits.replace and new is not node:
            self.edits.replace[node] = new
        if guard is not None:  # `if k > 1: loss = loss / k`: count at every k, K = 1 included
            REMOVE = cst.RemovalSentinel.REMOVE
            dropped = (self.edits.replace.pop(anchor, None), self.edits.replace.pop(node, None))
            if any(edit is REMOVE for edit in dropped):
                self.edits.replace[guard] = REMOVE
            else:
                rewritten = anchor.deep_replace(node, new)
                self.edits.replace[guard] = rewritten.with_changes(
                    leading_lines=guard.leading_lines
                )
            anchor = guard
        place = self._counted_at(site, count, anchor)
        placed = self.edits.before if place is anchor else self.edits.after
        if place not in placed:
            reference = self._reference(site) if scaled else ""
            counted = "" if count == self.micro else f"{self.micro} = {count}\n"
            added = f"{self.window_total} += {self.micro}\n"
            backward = self._backward_when(site, place)
            if backward is not None:  # counted only where its gradient is
                self.edits.insert_before(backward, f"{SKIPPED_NOTE}\n{added}")
                added = ""
            lines = f"{WEIGHT_NOTE}\n{counted}{added}" + reference
            if place is anchor:
                self.edits.insert_before(anchor, lines)
            else:
                self.edits.insert_after(place, lines)
        self._prepare_window(site)

    def _backward_when(self, site: Site, place: cst.CSTNode) -> cst.CSTNode | None:
        """The statement of the window's one backward where an `if` that does not hold
        `place` runs it (`if torch.isfinite(loss): loss.backward()`): a micro-batch it skips
        adds no gradient, so its count joins the window's there; else None."""
        backwards = list(self._window_backwards(site.window))
        if len(backwards) != 1 or site.backward.call is None:
            return None
        statement = statement_line(self.tree, site.backward.call)
        if self.tree.scope_of(statement) is not self.tree.scope_of(place):
            return None
        for ancestor in self.tree.ancestors(statement):
            if self.tree.contains(ancestor, place):
                return None
            if isinstance(ancestor, cst.If):
                return statement
        return None

    def _counted_at(self, site: Site, count: str, anchor: cst.CSTNode) -> cst.CSTNode:
        """Where the count is taken: before `anchor`, unless a name it reads is bound again
        between the loss and `anchor` (the next batch fetched before the backward, as nanoGPT
        does): then right after the loss's statement, which must run whenever `anchor` does."""
        source = site.origin.source
        if source is None or count == self.micro or source not in self.tree.order:
            return anchor
        made = statement_line(self.tree, source)
        tracer = self.auditor.tracer
        rebound = [  # bound at the loss (not first bound after it), and bound again since
            name.value
            for name in walk(cst.parse_expression(count))
            if isinstance(name, cst.Name)
            and (before := tracer.binding(name.value, source)) is not None
            and tracer.binding(name.value, anchor) not in (made, before)
        ]
        if not rebound:
            return anchor
        around = set(self.tree.ancestors(anchor))
        order = self.tree.order
        scope = self.tree.scope_of(anchor)
        exits = any(  # a micro-batch counted, then skipped before its backward
            isinstance(node, EXITS) and order[made] < order[node] < order[anchor]
            for node in self.tree.walk(scope, into_defs=False)
        )
        for node in self.tree.ancestors(made):
            if node in around and not exits:
                return made
            if not isinstance(node, (cst.With, cst.IndentedBlock)):
                break
        raise Unfixable(
            f"`{rebound[0]}`, which the count reads, is bound again between the loss (line "
            f"{self.tree.line(made)}) and its backward; count the targets where the loss is "
            "computed"
        )

    def _reference(self, site: Site) -> str:
        """Lines setting the window's reference count, its first micro-batch's, once per
        window: averaged over the processes that average the gradients, since a reference
        that differed between them would weight their sums at different scales."""
        ref = self.reference
        gather, world = self._gathering(site, self._grads_device(site), [ref])
        shared = f"{gather}{ref} = float({ref}) / {world}\n" if world else ""
        return f"if {ref} is None:\n    {ref} = max(float({self.micro}), 1.0)\n{indented(shared)}"

    def _scaled(self, site: Site) -> bool:
        """Whether the backward goes through a GradScaler: `scaler.scale(loss).backward()`
        (or apex's `amp.scale_loss`), or
        `accelerator.backward(loss)` / `fabric.backward(loss)` of an Accelerator or Fabric
        built with fp16 precision (or with a precision chosen at run time), or on a branch
        of its window times a loss scale of its own (`(loss * loss_scale).backward()`). Its fp16
        gradients must stay near the original's magnitude, so each micro-batch is weighted by
        its count over the window's first count (a constant of the window), not by its
        count, which would be thousands of times the original."""
        if any(
            (scaled := self._loss_scale(backward.loss, site.window))
            and "scale" in (last_name(scaled[1]) or "").lower()
            for backward in self._window_backwards(site.window)
        ):
            return True
        call = site.backward.call
        receiver = (
            call.func.value if call is not None and isinstance(call.func, cst.Attribute) else None
        )
        if (
            isinstance(receiver, cst.Call)
            and isinstance(receiver.func, cst.Attribute)
            and receiver.func.attr.value == "scale"
        ):
            return True
        if isinstance(receiver, cst.Name) and scale_loss_call(self.tree, receiver) is not None:
            return True  # apex's `with amp.scale_loss(loss, optimizer) as scaled_loss:`
        owner = next((kind for kind in PRECISION if self._backward_owner(site, kind.lower())), None)
        return owner is not None and any(
            may_be_fp16(call, *PRECISION[owner])
            for call in self.tree.calls
            if (dotted(call.func) or "").endswith(owner)
        )

    def _kept_for_reads(self, site: Site) -> bool:
        """`loss = out.loss / k` whose `loss` something besides the backward reads (a running
        total, a log, a returned value): the name keeps its value, and the backward gets the
        weighted term instead."""
        if site.kind != "loss-division" or not isinstance(site.backward.loss, cst.Name):
            return False
        statement = statement_line(self.tree, site.division.node)
        assign = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not (
            isinstance(assign, cst.Assign)
            and assign.value is site.division.node
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
            and not _assigns_to_itself(statement, site.division.node)
        ):
            return False
        name = assign.targets[0].target
        if site.backward.loss.value != name.value:
            return False
        uses = self.tree.uses(self.tree.scope_of(statement), name.value)
        return any(node is not name and node is not site.backward.loss for node in uses)

    def _divisor_guard(self, statement: cst.CSTNode, divisor: cst.CSTNode) -> cst.If | None:
        """The `if k > 1:` that holds only this division by `k`, when there is one: the
        count must be taken on every path, since the loss is a sum (or weighted) at every k."""
        guard = self.tree.parents.get(self.tree.parents.get(statement))
        if (
            isinstance(guard, cst.If)
            and guard.orelse is None
            and list(guard.body.body) == [statement]
            and code(divisor) in code(guard.test)
        ):
            return guard
        return None

    def _undivided(self, node: cst.CSTNode, statement: cst.CSTNode, factor: str):
        """`loss / k` (or `loss /= k`) times `factor`; REMOVE when nothing is left of the statement."""
        if isinstance(node, cst.AugAssign):
            if not factor:
                return cst.RemovalSentinel.REMOVE
            return node.with_changes(
                operator=cst.MultiplyAssign(), value=cst.parse_expression(factor)
            )
        left = self._applied(node.left)
        if not factor:
            if _assigns_to_itself(statement, node):
                self.edits.replace[statement] = cst.RemovalSentinel.REMOVE
                return node
            bare = isinstance(left, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
            return (
                left.with_changes(lpar=node.lpar, rpar=node.rpar)
                if node.lpar and not bare
                else left
            )
        new = cst.parse_expression(f"{code(left)} * {factor}")
        return new.with_changes(lpar=node.lpar, rpar=node.rpar)

    def _applied(self, node: cst.CSTNode) -> cst.CSTNode:
        """`node` with the replacements already planned inside it (a replacement replaces them)."""
        original = node
        for old, new in self.edits.replace.items():
            if new is not cst.RemovalSentinel.REMOVE and self.tree.contains(original, old):
                node = new if old is original else node.deep_replace(old, new)
        return node

    def _remove(self, node: cst.CSTNode, window: Window) -> None:
        """Drop a `p.grad.div_(k)` statement, with the `for`/`if` left holding nothing else."""
        statement = statement_line(self.tree, node)
        while True:
            owner = self.tree.parents.get(self.tree.parents[statement])
            block = self.tree.parents[statement]
            if not isinstance(owner, (cst.For, cst.If, cst.With)) or owner is window.anchor:
                break
            if len(block.body) != 1 or (isinstance(owner, (cst.For, cst.If)) and owner.orelse):
                break
            statement = owner
        self.edits.replace[statement] = cst.RemovalSentinel.REMOVE


class _HelperWindow:
    """Part of `Planner`: a backward in a same-file function that the window's loop calls once
    per micro-batch (`for micro in micro_batches: loss = self.backward_step(micro)`): asked for
    its count, the function backpropagates its micro-batch's sum and returns that count, which
    the loop adds to the window's."""

    def _rewrite_in_helper(self, site: Site, count: str) -> None:
        """Weight the backward in the function by the count when the loop asks for it
        (`return_count=True`; its other calls backpropagate as before), return the count
        beside what it returns, and add it to the window's after the loop's call."""
        helper = self.tree.scope_of(site.backward.call)
        name, loop = helper.name.value, site.window.loop
        where = f"`{name}()` (line {self.tree.line(helper)}), which the loop of line "
        where += f"{self.tree.line(loop)} calls once per micro-batch"
        calls = [c for c in calls_of(self.tree, helper) if self.tree.contains(loop, c)]
        returned = self._return_of(helper)
        if len(calls) != 1:
            raise Unfixable(
                f"the loop of line {self.tree.line(loop)} calls `{name}()` (line "
                f"{self.tree.line(helper)}) {len(calls)} times; call it once per micro-batch"
            )
        if returned is None:
            raise Unfixable(
                f"the backward is in {where}, and returns from other than one `return` of a "
                "value; return its loss from one place so that it can return its count beside"
            )
        if _takes_return_count(self.tree, helper):
            raise Unfixable(f"`{name}` already takes a `{RETURN_COUNT}` parameter")
        if self._scaled(site):
            raise Unfixable(
                f"the backward in {where} goes through a GradScaler, whose fp16 gradients a "
                "micro-batch's sum would scale up: weight each micro-batch by its count over a "
                "reference count of the window, and divide once by the window's total over it"
            )
        weighted = self._weighted_in_helper(site, helper, calls[0])
        place = self._count_binding(site, helper, returned)
        statement = statement_line(self.tree, calls[0])
        if helper.params not in self.edits.replace:  # else done for another backward of it
            bare = code(cst.parse_expression(count).with_changes(lpar=[], rpar=[]))
            self.edits.insert_before(place, f"{HELPER_NOTE}\n{self.micro} = {bare}\n")
            returns_count(self.tree, self.edits, helper, returned, self.micro, RETURNED_NOTE)
            self._ask_in_loop(statement, calls[0])
            self.edits.insert_after(
                statement, f"{ADDED_NOTE}\n{self.window_total} += {self.micro}\n"
            )
        node = site.backward.loss
        new = cst.parse_expression(f"{weighted} if {RETURN_COUNT} else {code(node)}")
        if isinstance(self.tree.parents[node], cst.Attribute):  # `(... else loss).backward()`
            new = new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self.edits.replace[node] = new
        if site.kind == "gradient-division":
            self._remove(site.division.node, site.window)
        self._prepare_window(site)

    def _weighted_in_helper(self, site: Site, helper: cst.FunctionDef, call: cst.Call) -> str:
        """The micro-batch's sum the function backpropagates when asked: its loss divided by
        K, times K and its count, or its undivided mean times its count; refused where the
        backward may not run on a pass that adds the count (an `if` other than on a parameter
        the loop's call leaves at a true default)."""
        backward = site.backward.call
        for guard in self.tree.ancestors(backward):
            if guard is helper:
                break
            if isinstance(guard, cst.If) and not self._runs_when_called(guard, helper, call):
                raise Unfixable(
                    f"the backward in `{helper.name.value}()` runs only when `{code(guard.test)}` "
                    f"(line {self.tree.line(guard)}): a micro-batch it skips would still add its "
                    "count to the window's; count each micro-batch where its backward runs"
                )
        loss = site.backward.loss
        factor = self.micro + self._framework_factor(site)
        if site.kind != "loss-division":
            return f"{atom(loss)} * {factor}"
        division = site.division
        if not self.tree.contains(helper, division.node) or not self._unchanged(
            division.divisor, division.node, backward
        ):
            raise Unfixable(
                f"the loss is divided by `{code(division.divisor)}` (line "
                f"{self.tree.line(division.node)}) other than in `{helper.name.value}()` as it "
                "stands at the backward; divide by it where the backward is, or not at all"
            )
        if division.node is loss and isinstance(loss, cst.BinaryOperation):  # `(loss / k)`
            return f"{atom(loss.left)} * {factor}"
        return f"{atom(loss)} * {atom(division.divisor)} * {factor}"

    def _runs_when_called(self, guard: cst.If, helper: cst.FunctionDef, call: cst.Call) -> bool:
        """Whether `guard` tests a parameter of `helper` that `call` leaves at a true
        constant default (`if do_backward:` with `do_backward=True`), or passes as True."""
        test = guard.test
        parameter = call_parameters(helper).get(test.value) if isinstance(test, cst.Name) else None
        if parameter is None:
            return False
        passed = argument_for(call, parameter)
        if passed is None and any(arg.star for arg in call.args):
            return False  # `**options` may pass it
        value = passed if passed is not None else parameter.default
        return isinstance(value, cst.Name) and value.value == "True"

    def _count_binding(
        self, site: Site, helper: cst.FunctionDef, returned: cst.Return
    ) -> cst.CSTNode:
        """The statement of `helper` before which its count is bound: the one holding the
        loss's division by K (else its backward) that runs whenever its `return` does, where
        the names the count reads are what they were at the loss."""
        node = site.division.node if site.kind == "loss-division" else site.backward.call
        statement = statement_line(self.tree, node)
        while not self.tree.contains(self.tree.parents[statement], returned):
            statement = statement_line(self.tree, self.tree.parents[statement])
        source = site.origin.source
        count = site.origin.count
        if (
            count is not None
            and source in self.tree.order
            and not self._unchanged(count, source, statement)
        ):
            raise Unfixable(
                f"a name the count `{code(count)}` reads is bound again between the loss (line "
                f"{self.tree.line(source)}) and line {self.tree.line(statement)} in "
                f"`{helper.name.value}()`; count the targets where the loss is computed"
            )
        return statement

    def _unchanged(self, expr: cst.BaseExpression, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Whether each variable `expr` reads has the same binding at `a` and at `b`."""
        tracer = self.auditor.tracer
        return all(
            tracer.binding(n.value, a) is tracer.binding(n.value, b)
            for n in walk(expr)
            if isinstance(n, cst.Name)
        )

    def _ask_in_loop(self, statement: cst.CSTNode, call: cst.Call) -> None:
        """The loop's `loss = f(...)` (or a bare `f(...)`) also binds the micro-batch's count."""
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1:
            self._ask_count(small, small)
        elif isinstance(small, cst.Expr) and small.value is call:
            self.edits.replace[small] = cst.Assign(
                [cst.AssignTarget(cst.parse_expression(f"_, {self.micro}"))],
                with_argument(call, RETURN_COUNT, "True"),
            )
        else:
            raise Unfixable(
                f"`{code(call.func)}(...)` is called inside a larger statement (line "
                f"{self.tree.line(call)}); bind what it returns (`loss = {code(call.func)}(...)`) "
                "so that the loop can ask it for its count"
            )


class _SumReduction:
    """Part of `Planner`: where a loss call can switch to `reduction="sum"`: its mean is read
    nowhere else."""

    def _summed(self, site: Site) -> cst.Call | None:
        """The call to give reduction="sum" (the loss, or the loss module's constructor), when
        nothing else reads the mean: `F.cross_entropy(...)`/`F.nll_loss(...)` in the loop, or an
        `nn.CrossEntropyLoss` instance called only here (one shared with evaluation stays a mean,
        weighted by its count)."""
        source = site.origin.source
        if not isinstance(source, cst.Call) or site.origin.from_model or site.origin.branch:
            return None  # (on another path, the loss stays a mean, weighted by its count)
        if self.tree.scope_of(source) is not self.tree.scope_of(site.backward.call):
            return None  # a helper's mean: its other callers still read it
        qualified = self.tree.qualified(source.func) or ""
        configured = source
        if qualified not in SUMMABLE:
            configured = self.auditor.tracer.loss_instance(source.func)
            if configured is None or configured not in self.tree.order:  # built by a config
                return None
            if not self._called_once(source.func):
                return None
            if (self.tree.qualified(configured.func) or "").rsplit(".", 1)[
                -1
            ] not in SUMMABLE_MODULES:
                return None
        if keyword(configured, "reduction") is not None:
            return None
        if self._mean_read_elsewhere(site, source):
            return None
        return configured

    def _called_once(self, func: cst.BaseExpression) -> bool:
        """Whether the loss module is used at this call only (its binding aside)."""
        name, last = code(func), last_name(func)
        bound = {
            t.target for a in self.tree.assignments if isinstance(a, cst.Assign) for t in a.targets
        }
        uses = [
            n
            for n in self.tree.order  # every node of the module, read from the tree's index
            if last_name(n) == last  # a cheap test first: `code` renders the node
            and isinstance(n, (cst.Name, cst.Attribute))
            and n not in bound
            and not isinstance(self.tree.parents.get(n), cst.Attribute)
            and code(n) == name
        ]
        return len(uses) == 1

    def _mean_read_elsewhere(self, site: Site, source: cst.Call) -> bool:
        """Whether code other than the division (or backward) reads the loss `source` computes."""
        statement = self.tree.statement_of(source)
        used = self.tree.statement_of(
            site.division.node if site.kind == "loss-division" else site.backward.call
        )
        if statement is used:
            return False
        if not (isinstance(statement, cst.Assign) and len(statement.targets) == 1):
            return True
        target = statement.targets[0].target
        if not isinstance(target, cst.Name):
            return True
        # Later reads see a sum either way only after `loss = loss / k`; any other read needs the mean.
        later_ok = site.kind == "loss-division" and _assigns_to_itself(
            statement_line(self.tree, used), site.division.node
        )
        for node in self.tree.uses(self.tree.scope_of(statement), target.value):
            if node is not target:
                inside = self.tree.contains(used, node)
                if not inside and not (later_ok and self.tree.order[node] > self.tree.last[used]):
                    return True
        return False


class _Owners:
    """Part of `Planner`: who runs the backward (an Accelerator, Fabric, torch.distributed), and
    what it divides by."""

    def _framework_factor(self, site: Site) -> str:
        receiver = self._accelerator(site)
        if receiver is None or self._engine(site):  # under DeepSpeed, its engine divides
            return ""
        if site.window.kind == "accumulate" or "gradient_accumulation_steps=" in self.text:
            return f" * {receiver}.gradient_accumulation_steps"
        return ""

    def _accelerator(self, site: Site) -> str | None:
        """The `accelerator` of `accelerator.backward(loss)`, else None."""
        return self._backward_owner(site, "accelerator")

    def _engine(self, site: Site) -> str | None:
        """The DeepSpeed engine that backpropagates the loss: `engine` of `engine.backward(loss)`,
        or the one an accelerator launched with DeepSpeed hands it to (`accelerator.backward`
        runs `accelerator.deepspeed_engine_wrapped.engine`'s backward and step); else None."""
        structure = self.auditor.structure
        if site.backward.call is None:
            return None
        if structure.deepspeed_engine(site.backward):
            return dotted(site.backward.call.func.value)
        if site.window.kind == "framework" and structure.accelerate_deepspeed(site.backward):
            return f"{self._accelerator(site)}.deepspeed_engine_wrapped.engine"
        return None

    @staticmethod
    def _device(optimizer: str) -> str:
        """Where the optimizer's parameters live."""
        return f'{optimizer}.param_groups[0]["params"][0].device'

    def _booster(self, site: Site) -> str | None:
        """The ColossalAI booster of `booster.backward(loss=..., optimizer=...)`, else None;
        None too where the file boosts with the TorchDDP plugin alone, whose gradients stay
        in `param.grad`."""
        call = site.backward.call
        if call is None or not isinstance(call.func, cst.Attribute):
            return None
        name = dotted(call.func.value) or ""
        built = {
            (self.tree.qualified(n.func) or dotted(n.func) or "").rsplit(".", 1)[-1]
            for n in self.tree.calls
        }
        if "booster" not in name.lower() and not (
            "Booster" in built and keyword(call, "optimizer") is not None
        ):
            return None
        plugins = {b for b in built if b.endswith("Plugin")}
        return None if plugins == {"TorchDDPPlugin"} else name

    def _backward_owner(self, site: Site, kind: str) -> str | None:
        """The receiver of `<kind>.backward(loss)` (an Accelerator or a Fabric), else None."""
        if site.backward.call is None:
            return None
        func = site.backward.call.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "backward"
            and positional(site.backward.call)
        ):
            name = dotted(func.value) or ""
            if kind in name.lower() or (  # or `acc = Accelerator(...)`
                kind == "accelerator" and self.auditor.structure.is_accelerator(name)
            ):
                return name
        return None

    def _gathering(self, site: Site, device: str, names: list[str]) -> tuple[str, str]:
        """Lines that sum each of `names` over the processes that average the gradients
        (Fabric, accelerate, DeepSpeed, torch.distributed: guarded, since the same loop may run
        in a single process), and the expression of their number ("" when none does); `device`
        is where torch.distributed reduces."""
        receiver = self._accelerator(site)
        fabric = self._backward_owner(site, "fabric")
        dist = self._distributed()
        if self._engine(site) is not None and dist is None:  # DeepSpeed runs on torch.distributed
            dist = f"{torch_module(self.tree, self.edits)}.distributed"
        if fabric:  # Fabric averages gradients over its processes, like DDP
            gather = "".join(
                f'{name} = {fabric}.all_reduce({name}, reduce_op="sum")\n' for name in names
            )
            return gather, f"{fabric}.world_size"
        if receiver:
            torch = torch_module(self.tree, self.edits)
            gather = "".join(  # a count of elements may be a Python number: reduce takes tensors
                f"{name} = {receiver}.reduce(\n"
                f'    {torch}.as_tensor({name}, device={receiver}.device), reduction="sum"\n)\n'
                for name in names
            )
            return gather, f"{receiver}.num_processes"
        if dist:
            torch = torch_module(self.tree, self.edits)
            gather = f"if {dist}.is_initialized():\n" + "".join(
                f"    {name} = {torch}.as_tensor({name}, device={device})\n"
                f"    {dist}.all_reduce({name})\n"
                for name in names
            )
            return gather, f"({dist}.get_world_size() if {dist}.is_initialized() else 1)"
        return "", ""

    def _other_runtime(self) -> tuple[str, int] | None:
        """The imported module and line of a distributed runtime the file starts, other than
        those whose collectives the fixes write (`bmt.init_distributed(...)`); None if none."""
        for call in self.tree.calls:
            func = call.func
            if not (
                isinstance(func, cst.Attribute)
                and func.attr.value in DISTRIBUTED_STARTS
                and isinstance(func.value, cst.Name)
            ):
                continue
            package = self.tree.imports.get(func.value.value, "").split(".")[0]
            if package and package not in GATHERED_PACKAGES:
                return func.value.value, self.tree.line(call)
        return None

    def _distributed(self) -> str | None:
        """The local name of torch.distributed when the file trains with it, else None."""
        if "DistributedDataParallel" not in self.text and "torch.distributed" not in self.text:
            return None
        for local, full in self.tree.imports.items():
            if full == "torch.distributed":
                return local
        torch = bound_torch(self.tree)
        return f"{torch}.distributed" if torch else None


class _LoggedReads:
    """Part of `Planner`: logging reads of a loss that was divided by K, rewritten to keep their
    meaning."""

    # --- the logged loss: the window's sum / count, not a mean of means ---------------------

    def _note_logged_reads(
        self, site: Site, node: cst.CSTNode, statement: cst.CSTNode, summed: bool, at: cst.CSTNode
    ) -> None:
        """Remember `loss = loss / k` (rewritten at `at`): logging reads of `loss` at the step
        get the window's mean."""
        if site.window.kind not in ("modulo", "micro-loop"):
            return
        if isinstance(node, cst.AugAssign):
            name = node.target
        elif _assigns_to_itself(statement, node):
            name = statement.body[0].targets[0].target
        else:
            return
        if isinstance(name, cst.Name):
            weighted = Weighted(name.value, code(site.division.divisor), at, summed)
            self._weighted.setdefault(site.window.anchor, []).append(weighted)

    def _logged_reads(self, window: Window) -> tuple[list, list]:
        """(read, replacement) pairs for logging reads of a loss that was divided by K: at the
        step, the window's mean; in the micro-step after the rewrite, the micro-batch's mean."""
        at_step, in_micro_step = [], []
        window_mean = f"({self.window_loss} / {self.window_total})"  # clamped by then
        first = self._prepared.get(window.anchor)
        scaled = first is not None and self._scaled(first[0])  # weighted by micro / reference
        for weighted in self._weighted.get(window.anchor, ()):
            value = f"{weighted.name} * {self.reference}" if scaled else weighted.name
            micro_mean = f"({value} / max({self.micro}, 1))"
            after = self.tree.last[weighted.statement]
            for node in self.tree.walk(window.loop, into_defs=False):
                if not (isinstance(node, cst.Name) and node.value == weighted.name):
                    continue
                stepping = any(self.tree.contains(region, node) for region in window.step_region)
                if stepping:
                    read = self._logging_read(node, weighted.divisor, window_mean)
                elif self.tree.order[node] > after:
                    read = self._logging_read(node, weighted.divisor, micro_mean)
                else:
                    read = None
                if read is not None:
                    (at_step if stepping else in_micro_step).append(read)
            if window.kind == "micro-loop":
                for region in window.step_region:
                    for node in self.tree.walk(region, into_defs=False):
                        if isinstance(node, cst.Name) and node.value == weighted.name:
                            read = self._logging_read(node, weighted.divisor, window_mean)
                            if read is not None:
                                at_step.append(read)
        return at_step, in_micro_step

    def _logging_read(self, name: cst.Name, divisor: str, mean: str):
        """The expression around `name` that reads it for logging, and its window-mean twin."""
        read: cst.BaseExpression = name
        while True:  # loss.detach().float().item()
            attribute = self.tree.parents.get(read)
            call = self.tree.parents.get(attribute)
            if not (
                isinstance(attribute, cst.Attribute)
                and attribute.value is read
                and attribute.attr.value in LOGGING_METHODS
                and isinstance(call, cst.Call)
                and call.func is attribute
                and not call.args
            ):
                break
            read = call
        text = code(read)
        if not text.startswith(name.value):
            return None
        rest = text[len(name.value) :]
        arg = self.tree.parents.get(read)
        wrapper = self.tree.parents.get(arg)
        wrapped = (
            isinstance(arg, cst.Arg)
            and isinstance(wrapper, cst.Call)
            and code(wrapper.func) == "float"
        )
        outer = wrapper if wrapped else read
        product = self.tree.parents.get(outer)
        if (
            isinstance(product, cst.BinaryOperation)
            and isinstance(product.operator, cst.Multiply)
            and code(product.right if product.left is outer else product.left) == divisor
        ):  # `loss.item() * k`: the mean itself
            outer = product
        else:  # the mean over k, as the original read it
            mean = f"({mean[1:-1]} / {divisor})"
        text = mean + rest
        if wrapped:
            text = f"float({text if rest else mean[1:-1]})"
        return (outer, text) if outer is not name else None


class _Window:
    """Part of `Planner`: the window's one division: where it goes, its count started, normalised
    and reset, and the optimizer it precedes."""

    def _prepare_window(self, site: Site) -> None:
        """Check that the window's one division has a place; `_finish_window` writes it."""
        window = site.window
        if window.anchor in self._prepared:
            return
        deepspeed = self.auditor.structure.may_run_deepspeed
        launched = self._accelerator(site) or self._backward_owner(site, "fabric")
        if launched and deepspeed and not self.unsafe:
            raise Unfixable(
                f"unsafe fix (the file may train under DeepSpeed ({deepspeed}), whose ZeRO "
                "keeps the gradients outside `param.grad`, where the one division before the "
                "step would not reach them: assumes a run without DeepSpeed); apply with "
                "--unsafe-fixes"
            )
        booster = self._booster(site)
        if booster and not self.unsafe:
            raise Unfixable(
                f"unsafe fix (`{booster}.backward(...)` runs a ColossalAI booster, whose "
                "sharding plugins (Gemini, LowLevelZero, HybridParallel) keep the gradients "
                "outside `param.grad`, where the one division before the step would not reach "
                "them: assumes its TorchDDP plugin); apply with --unsafe-fixes"
            )
        if window.kind == "accumulate":
            outer = next(
                (
                    a
                    for a in self.tree.ancestors(window.anchor)
                    if isinstance(a, (cst.For, cst.While))
                ),
                None,
            )
            if outer is None or self._accelerator(site) is None:
                raise Unfixable("the accumulate() window has no accelerator.backward in a loop")
            function = self.tree.scope_of(site.backward.call)
            if function is not self.tree.scope_of(window.anchor):
                raise Unfixable(
                    f"the backward is in `{function.name.value}()`, which the `accumulate()` "
                    f"block of line {self.tree.line(window.anchor)} calls once per micro-batch, "
                    "so the window's count must outlive each call: keep it where every call "
                    "sees it (on `self`, say), add each micro-batch's count to it and "
                    "backpropagate `loss * count * gradient_accumulation_steps`, then divide the "
                    "gradients once by it where `sync_gradients` is true and reset it"
                    + self._under_deepspeed()
                )
            after = self._after_backwards(window, statement_line(self.tree, site.backward.call))
            if self.auditor.structure.steps_in(after):
                raise Unfixable(
                    f"the statement on line {self.tree.line(after)} backpropagates and steps on "
                    "each of its paths: the one division must come between the window's last "
                    "backward and its step; backpropagate on the branches and step once after them"
                )
        elif window.kind not in ("modulo", "micro-loop"):
            function = self.tree.scope_of(window.anchor)
            region = function.body if isinstance(function, cst.FunctionDef) else function
            steps = [c for c in self.auditor.structure.steps_in(region) if is_step(c)]
            if steps:
                raise Unfixable(
                    "gaaudit cannot tell which micro-batches the step of line "
                    f"{self.tree.line(steps[0])} closes: the loss is divided by "
                    f"`{code(window.size)}`, but no guard it reads (`(step + 1) % "
                    f"{code(window.size)} == 0`, say) leads to that step, so it cannot place "
                    "the one division there"
                )
            name = (
                f"`{function.name.value}()`"
                if isinstance(function, cst.FunctionDef)
                else "the module's top level"
            )
            raise Unfixable(
                f"gaaudit sees no optimizer step in {name}, where the window's loss is "
                "backpropagated (it knows a step by its optimizer's name: `optimizer.step()`, "
                "`opt_g.step()`, `adam.step()`, `scaler.step(optimizer)`), so it cannot place "
                "the one division after the window: sum the window's valid-target count where "
                "it steps and divide the gradients there" + self._under_deepspeed()
            )
        if window.kind == "micro-loop":
            self._cleared_before(window)
        if window.kind == "modulo":
            self._last_backward(window)
        if window.kind == "modulo" and not self.unsafe:
            self._count_restarted(site)
        self._prepared[window.anchor] = (site, self._optimizer(window))

    def _last_backward(self, window: Window) -> cst.CSTNode | None:
        """The statement of a stepping `else` (`Structure.window_else`) after which its
        backward has run and before its step, where the one division goes (None: the window's
        guard has no such `else`, or it only steps); refused where the `else` steps before it."""
        last = self.auditor.structure.window_else(window)
        if last is None:
            return None
        body = last.body.body
        calls = [b.call for b in self._window_backwards(window) if b.call is not None]
        ran = [s for s in body if any(self.tree.contains(s, call) for call in calls)]
        steps = self.auditor.structure.steps_in(last)
        if ran and any(
            self.tree.contains(statement, s)
            for s in steps
            for statement in body[: body.index(ran[-1]) + 1]
        ):
            raise Unfixable(
                f"the `else` of the `if` on line {self.tree.line(window.anchor)} steps before "
                "its last backward: the one division must come between the window's last "
                "backward and its step"
            )
        return ran[-1] if ran else None

    def _count_restarted(self, site: Site) -> None:
        """Refuse, as unsafe, a window whose count starts in its function (`_count_home`)
        while a caller's loop runs that function again with the gradients left in place, or
        while the step's counter outlives it (`_spans_calls`): a pass's short last window goes
        on into the next call, whose count starts at 0."""
        window = site.window
        guarded = isinstance(window.anchor, cst.If) and not window.skips
        test = window.anchor.test if guarded else None
        home = self._count_home(window, self._optimizer(window))
        outer = self._carried_into(site, window.loop, test, home)
        if outer is not None:
            raise Unfixable(
                f"unsafe fix ({runs_again(self.tree, outer, window.loop)} and does not clear "
                "the gradients between its passes, so a pass's last window, cut short, goes on "
                "into the next pass's first, while the window's count starts anew at each call: "
                "the first division of the next pass counts only its own part, right only where "
                "every pass holds whole windows (a loader whose length is a multiple of the "
                "accumulation steps)); apply with --unsafe-fixes, or step or clear the gradients "
                "after each pass"
            )
        counter = self._spans_calls(site, window.loop, test, home)
        if counter is not None:
            raise Unfixable(
                f"unsafe fix ({self._spanning(window.loop, counter)}, while the window's "
                "count starts anew at each call: the first division of the next call counts only "
                "its own part); apply with --unsafe-fixes, or keep the window's count beside "
                f"`{counter}`, where every call sees it (on `self`, say), or step or clear the "
                "gradients at the end of each pass"
            )

    def _under_deepspeed(self) -> str:
        """What a refusal that says to divide the gradients at the step adds where the file may
        train under DeepSpeed, whose ZeRO keeps the gradients outside `param.grad`."""
        if not self.auditor.structure.may_run_deepspeed:
            return ""
        return (
            "; but under DeepSpeed, which this file may train with, ZeRO keeps the gradients "
            "outside `param.grad`, where no division reaches them: count the window's valid "
            "targets before it runs instead, and backpropagate each micro-batch's loss sum "
            "divided by that count, times the accumulation steps (DeepSpeed's backward divides "
            "by them)"
        )

    def _cleared_before(self, window: Window) -> None:
        """Refuse a micro-step loop whose gradients its function's caller steps (`_after_calls`)
        where the function does not clear them before the loop: the caller may have
        accumulated gradients of its own there (InstructLLaMA's PPO update adds a pretraining
        loss's micro-steps to the policy's), which the one division would divide too."""
        function = self.tree.scope_of(window.loop)
        stepped = [s for s in window.step_region if not self.tree.contains(function, s)]
        if not stepped or not isinstance(function, cst.FunctionDef):
            return
        start = self.tree.order[window.loop]
        if any(
            isinstance(n, cst.Call)
            and last_name(n.func) == "zero_grad"
            and self.tree.order[n] < start
            for n in self.tree.walk(function, into_defs=False)
        ):
            return
        raise Unfixable(
            f"`{function.name.value}()` backpropagates into gradients its caller steps (line "
            f"{self.tree.line(stepped[0])}) and does not clear them before its loop: one division "
            "after the loop would also divide what the caller accumulated before calling it; "
            "clear the gradients in the function, or weight each micro-batch by its share of the "
            "window's count"
        )

    def _finish_window(self, site: Site, optimizer: str) -> None:
        """Start, normalise and reset the window's count (and its loss sum when a log reads it)."""
        window, total = site.window, self.window_total
        reads, micro_reads = self._logged_reads(window)
        tracked = [total, self.window_loss] if reads else [total]
        start = "".join(f"{name} = 0\n" for name in tracked)
        if self._scaled(site):
            start += f"{self.reference} = None\n"
        normalize = self._normalization(site, optimizer, tracked)
        if window.kind == "modulo":
            self.edits.insert_before(
                statement_line(self.tree, self._count_home(window, optimizer)), start
            )
            last = self.auditor.structure.window_else(window)
            body = window.step_region if window.skips else (last or window.anchor).body.body
            ran = self._last_backward(window)
            if ran is None:
                self.edits.insert_before(body[0], normalize if reads else normalize + start)
            else:
                self.edits.insert_after(ran, normalize if reads else normalize + start)
            if reads:
                if _ends_in_exit(body):
                    self.edits.insert_before(body[-1], start)
                else:
                    self.edits.insert_after(body[-1], start)
        elif window.kind == "micro-loop":
            self.edits.insert_before(statement_line(self.tree, window.loop), start)
            self.edits.insert_after(statement_line(self.tree, window.loop), normalize)
        else:  # accumulate: checked in `_prepare_window`
            outer = next(
                a for a in self.tree.ancestors(window.anchor) if isinstance(a, (cst.For, cst.While))
            )
            receiver = self._accelerator(site)
            self.edits.insert_before(statement_line(self.tree, outer), start)
            backward = self._after_backwards(window, statement_line(self.tree, site.backward.call))
            following = self._following(backward)
            if (  # the user's own `if accelerator.sync_gradients:` block, at its top
                isinstance(following, cst.If)
                and following.orelse is None
                and code(following.test) == f"{receiver}.sync_gradients"
                and isinstance(following.body, cst.IndentedBlock)
            ):
                self.edits.insert_before(following.body.body[0], normalize + start)
            else:
                body = "\n".join("    " + line for line in (normalize + start).splitlines())
                self.edits.insert_after(backward, f"if {receiver}.sync_gradients:\n{body}\n")
        for read, replacement in micro_reads:
            self.edits.replace[read] = cst.parse_expression(replacement).with_changes(
                lpar=read.lpar, rpar=read.rpar
            )
        if not reads:
            return
        for read, replacement in reads:
            new = cst.parse_expression(replacement)
            self.edits.replace[read] = new.with_changes(lpar=read.lpar, rpar=read.rpar)
        for weighted in self._weighted[window.anchor]:
            value = f"{weighted.name}.detach()" + ("" if weighted.summed else f" * {self.micro}")
            self.edits.insert_before(weighted.statement, f"{self.window_loss} += {value}\n")

    def _after_backwards(self, window: Window, backward: cst.CSTNode) -> cst.CSTNode:
        """The statement of an `accumulate()` block after which every backward of the window
        has run: `backward`'s own, or the `if` whose branches hold the others (`if fp16:
        accelerator.backward(loss.float())` / `else: accelerator.backward(loss)`)."""
        calls = [b.call for b in self._window_backwards(window) if b.call is not None]
        statement = backward
        while not all(self.tree.contains(statement, call) for call in calls):
            statement = next(
                a
                for a in self.tree.ancestors(statement)
                if isinstance(self.tree.parents.get(a), cst.IndentedBlock)
            )
        return statement

    def _count_home(self, window: Window, optimizer: str) -> cst.CSTNode:
        """The loop before which a counted window's count starts: its batch loop, or the loops
        around it (epochs) whose turns leave a short last window's gradients in place (no
        `zero_grad`, no new optimizer), where that window goes on into the next turn and so
        must its count."""
        home, scope = window.loop, self.tree.scope_of(window.loop)
        while (
            outer := run_again(self.tree, home, lambda node: self._clears(node, optimizer))
        ) is not None and self.tree.scope_of(outer) is scope:
            home = outer
        return home

    @staticmethod
    def _clears(node: cst.CSTNode, optimizer: str) -> bool:
        """Whether `node` clears gradients (`zero_grad()`) or binds the optimizer anew."""
        if isinstance(node, cst.Call):
            return last_name(node.func) == "zero_grad"
        return isinstance(node, cst.AssignTarget) and (
            code(node.target) == optimizer or optimizer in target_names(node.target)
        )

    def _following(self, statement: cst.CSTNode) -> cst.CSTNode | None:
        """The statement after `statement` in its block, if any."""
        block = self.tree.parents.get(statement)
        body = getattr(block, "body", ())
        if isinstance(body, (list, tuple)) and statement in body:
            index = body.index(statement) + 1
            return body[index] if index < len(body) else None
        return None

    def _optimizer(self, window: Window) -> str:
        if window.kind == "callable":  # `loss_scaler(loss, optimizer, ...)`: the one it is handed
            return code(self.auditor.structure.stepping_optimizer(window.anchor))
        regions = window.step_region if window.kind != "accumulate" else (window.anchor,)
        helpers, stepped = [], {}
        for region in regions:
            for call in self.auditor.structure.steps_in(region):
                if is_step(call):
                    args = positional(call)
                    optimizer = args[0] if args else call.func.value
                    stepped.setdefault(code(optimizer), (optimizer, call, region))
                else:
                    helpers.append(call)
        if len(stepped) > 1:
            names = " and ".join(f"`{name}`" for name in stepped)
            raise Unfixable(
                f"the window steps {len(stepped)} optimizers, {names}: divide the gradients "
                "of each once, before their steps, by the window's count" + self._under_deepspeed()
            )
        if stepped:
            name, (optimizer, call, region) = next(iter(stepped.items()))
            self._bound_before(optimizer, call, region)
            return name
        for call in helpers:
            optimizer = self._stepped_by(call)
            if optimizer is not None:
                return optimizer
        if helpers:
            raise Unfixable(
                f"the optimizer steps inside `{code(helpers[0].func)}()` (line "
                f"{self.tree.line(helpers[0])}); gaaudit rewrites a window whose step it sees "
                "in the same function: divide the gradients there by the window's valid-token count"
                + self._under_deepspeed()
            )
        raise Unfixable(
            f"no optimizer step is visible in the window of line {self.tree.line(window.anchor)}, "
            "so gaaudit cannot tell whose gradients to divide: call the optimizer's `step()` "
            "there"
        )

    def _backward_outside_grads(self, window: Window) -> str | None:
        """Why a window whose stepping object also backpropagates (`optimizer.backward(loss)`)
        cannot be divided at its step, else None: a loss-scaling wrapper such as apex's
        `FP16_Optimizer` (its `param_groups` hold fp32 master copies whose gradients it fills
        only inside `step()`) or BMTrain's `OptimManager` (no `param_groups` at all)."""
        try:
            optimizer = self._optimizer(window)
        except Unfixable:
            return None  # the division at the step says why it cannot be written
        scope = window.loop or self.tree.scope_of(window.anchor)
        for node in self.tree.walk(scope):
            if (
                isinstance(node, cst.Call)
                and isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "backward"
                and code(node.func.value) == optimizer
            ):
                return (
                    f"`{optimizer}.backward(...)` (line {self.tree.line(node)}): what steps "
                    "also backpropagates, a loss-scaling wrapper (apex's `FP16_Optimizer`, "
                    "BMTrain's `OptimManager`) whose gradients are not the `param_groups`' "
                    "before its `step()`, so each micro-batch's loss must be weighted before "
                    "its backward: count the window's valid tokens N before it runs and "
                    "backpropagate each micro-batch's loss sum divided by N"
                )
        return None

    def _bound_before(self, optimizer: cst.BaseExpression, step: cst.Call, region) -> None:
        """Refuse an optimizer the step reaches as a loop's target (`for opt, sched in
        zip(optimizers, schedulers): opt.step()`): the one division, written before that loop,
        would read a name not yet bound, and divide one optimizer's gradients of several."""
        root = (dotted(optimizer) or "").split(".")[0]
        for loop in self.tree.ancestors(step):
            if isinstance(loop, cst.For) and root in target_names(loop.target):
                raise Unfixable(
                    f"the optimizer steps as `{root}` of `for {code(loop.target)} in "
                    f"{code(loop.iter)}` (line {self.tree.line(loop)}); divide the gradients of "
                    "each of them once, before that loop, by the window's count"
                )
            if loop is region:
                return

    def _stepped_by(self, call: cst.Call) -> str | None:
        """The optimizer a same-file helper steps (`self.optimizers_step()`, `step(opt)`),
        spelled as the caller sees it: the helper's parameter replaced by the argument, or a
        `self.` attribute when the caller is a method of the same instance."""
        helper = self.auditor.tracer.helper(call.func)
        if helper is None:
            return None
        steps = [n for n in self.tree.in_scope(helper) if isinstance(n, cst.Call) and is_step(n)]
        # one optimizer, stepped once or on each path (`scaler.step(opt)` else `opt.step()`)
        stepped = {dotted(args[0] if (args := positional(s)) else s.func.value) for s in steps}
        if len(stepped) != 1 or None in stepped:
            return None
        root = stepped.pop()
        first, _, rest = root.partition(".")
        if first == "self":
            return root if dotted(call.func).startswith("self.") else None
        parameter = call_parameters(helper).get(first)
        passed = argument_for(call, parameter) if parameter is not None else None
        return None if passed is None else code(passed) + (f".{rest}" if rest else "")

    def _normalization(self, site: Site, optimizer: str, tracked: list[str]) -> str:
        """Divide the window's gradients once by its token count (gathered across processes),
        read into a Python number once: a tensor compared per parameter would synchronise
        the device once per parameter."""
        total = self.window_total
        count = f"{total} / {self.reference}" if self._scaled(site) else total
        cleared = self._cleared_params(site.window)
        gather, world = self._gathering(site, self._grads_device(site), tracked)
        scale = f"{count} / {world}" if world else count
        divide = f"if param.grad is not None:\n    param.grad.div_({scale})\n"
        if cleared:
            params = f"for param in {cleared}:\n" + indented(divide)
        else:
            params = (
                f"for group in {optimizer}.param_groups:\n"
                + '    for param in group["params"]:\n'
                + indented(indented(divide))
            )
        return f"{DIVIDE_NOTE}\n" + gather + f"{total} = max(float({total}), 1.0)\n" + params

    def _grads_device(self, site: Site) -> str:
        """Where the gradients the window divides live."""
        cleared = self._cleared_params(site.window)
        return f"{cleared}[0].device" if cleared else self._device(self._optimizer(site.window))

    def _cleared_params(self, window: Window) -> str:
        """`params` of the `zero_grad(params)` function that clears the gradients of a
        micro-step loop before it, in its function: the parameters the window accumulates
        into, which the stepped optimizer may not hold (fp16 master copies that the step fills
        from them); "" where an optimizer or a model clears them (`opt.zero_grad()`)."""
        if window.kind != "micro-loop":
            return ""
        start = self.tree.order[window.loop]
        for node in self.tree.walk(self.tree.scope_of(window.loop), into_defs=False):
            if (
                isinstance(node, cst.Call)
                and isinstance(node.func, cst.Name)
                and node.func.value == "zero_grad"
                and len(node.args) == 1
                and node.args[0].keyword is None
                and self.tree.order[node] < start
            ):
                return code(node.args[0].value)
        return ""


class Planner(
    _ReadAhead,
    _Counting,
    _CompanionCounts,
    _LossRewrite,
    _HelperWindow,
    _SumReduction,
    _Owners,
    _LoggedReads,
    _Window,
    _LightningWindow,
):
    """Turns the sites of one file into edits, one accumulation window at a time."""

    def __init__(
        self,
        tree: Tree,
        auditor: Auditor,
        unsafe: bool = False,
        domains: Domains | None = None,
        reach: bool = False,
        path: Path | None = None,
    ) -> None:
        self.tree, self.auditor, self.unsafe, self.domains = tree, auditor, unsafe, domains
        self.reach = reach  # whether other files of the repository may change too
        self.path = path  # the file's, whose requirements govern what its fix may assume
        self.edits = Edits()
        self.companions: dict[Path, tuple[Tree, Edits]] = {}  # other files' edits
        self.text = tree.module.code
        self.micro, self.window_total = count_names(tree, [])  # `plan` names them by domain
        self.counted_inside = ""  # who counts a micro-batch only the loop's body can count
        # the loop's call of the helper that counts its loss, that count, the edits before it
        self.asked: tuple[cst.Assign, str, Edits] | None = None
        self.window_loss = self._fresh("window_loss")
        self.reference = self._fresh("window_reference")  # under a GradScaler
        self._prepared: dict[
            cst.CSTNode, tuple[Site, str]
        ] = {}  # window -> (first site, optimizer)
        self._weighted: dict[cst.CSTNode, list[Weighted]] = {}  # window -> losses divided by K
        self._ahead_windows: set[cst.CSTNode] = set()  # windows the loop now reads ahead
        self._modules: dict[cst.ClassDef, str] = {}  # LightningModules -> their `self`

    def _fresh(self, name: str) -> str:
        return fresh(self.tree, name)

    def plan(self, sites: list[Site]) -> list[Outcome]:
        domains = [self.domains.of(site.origin) for site in sites] if self.domains else []
        self.micro, self.window_total = count_names(self.tree, domains)
        outcomes: dict[int, Outcome] = {}
        for window in dict.fromkeys(site.window.anchor for site in sites):
            group = [site for site in sites if site.window.anchor is window]
            together = _backpropagated_together(self.tree, group)
            if together:
                reason = _several_losses(self.tree, together)
                outcomes.update(
                    (id(site), Outcome(site, *self._position(site), False, reason))
                    for site in group
                )
                continue
            saved = self._snapshot()
            planned = [self._planned(site, sites) for site in group]
            refused = next((o for o in planned if not o.applied), None)
            if refused is not None and any(o.applied for o in planned):
                # one division at the step serves the whole window: all of it, or none
                self._restore(saved)
                reason = (
                    "another backward of its window is not fixed (line "
                    f"{refused.line}: {refused.reason})"
                )
                planned = [replace(o, applied=False, reason=o.reason or reason) for o in planned]
            outcomes.update((id(o.site), o) for o in planned)
        for site, optimizer in self._prepared.values():
            self._finish_window(site, optimizer)
        for module, this in self._modules.items():
            self._finish_module(module, this)
        said = [outcomes[id(site)] for site in sites]
        if domains:  # what the count counts, in the words of the loss's domain
            said = [replace(o, reason=d.worded(o.reason)) for o, d in zip(said, domains)]
        return said

    def _planned(self, site: Site, sites: list[Site]) -> Outcome:
        """Plan the rewrite of one site, or restore what was planned before it and say why
        it cannot be fixed."""
        saved = self._snapshot()
        try:
            seen = self.one_mean(site)  # the finding stays `site`
            count, safe = self.count(seen)
            if not safe and not self.unsafe:
                raise Unfixable(f"unsafe fix ({count[1]}); apply with --unsafe-fixes")
            runtime = self._other_runtime()
            if runtime and not self.unsafe:
                raise Unfixable(
                    f"unsafe fix (the file runs on the processes of `{runtime[0]}` (line "
                    f"{runtime[1]}), whose reduction of the gradients gaaudit does not know: "
                    "each process would count only its own window, so the processes would weigh "
                    "equally, not by their counts); apply with --unsafe-fixes, or sum the "
                    f"window's count over the processes with `{runtime[0]}`'s all-reduce before "
                    "the division (and divide by their number where the gradients are averaged)"
                )
            blocker = self._window_blocker(seen)
            siblings = self._siblings(seen, sites, ahead=bool(blocker))
            if self.lightning_module(seen) is not None:
                if blocker:
                    raise Unfixable(
                        f"{blocker}; the Trainer draws the batches, so the window cannot be read "
                        "ahead to weight each micro-batch before its backward"
                    )
                self._rewrite_returned(seen, count[0])
            elif blocker:
                self._read_ahead(seen, count[0], blocker, siblings)
            else:
                for each in (seen, *siblings):
                    self._rewrite(each, count[0])
            return Outcome(site, *self._position(site), True)
        except (Unfixable, cst.ParserSyntaxError) as exc:
            self._restore(saved)
            reason = (
                str(exc)
                if isinstance(exc, Unfixable)
                else "gaaudit could not build a valid rewrite"
            )
            return Outcome(site, *self._position(site), False, reason)

    def _siblings(self, site: Site, sites: list[Site], ahead: bool = False) -> list[Site]:
        """The site again at each other backward call of its window that backpropagates the
        same loss (`with model.no_sync(): loss.backward()` / `else: loss.backward()`), where
        the rewrite weights each backward call (read `ahead`, also each backward of the divided
        loss, which stays a mean); a window with a backward of another loss is refused: the one
        division at the step would divide its gradients too."""
        if site.backward.call is None:
            return []
        fixed = {s.backward.call for s in sites}
        rewritten = {s.division.node for s in sites if s.kind == "loss-division"}
        siblings = []
        for backward in self._window_backwards(site.window):
            if backward.call in fixed:
                continue
            scaled = self._loss_scale(backward.loss, site.window)
            origin = self.auditor.tracer.origin(scaled[0] if scaled else backward.loss)
            divided = {d.node for d in origin.divisions}
            if ahead and site.division is not None and site.division.node in divided:
                siblings.append(replace(site, backward=backward))
                continue
            if divided & rewritten:
                continue  # the loss the rewrite made a sum, read on another branch
            if site.kind != "loss-division" and (origin.source, origin.divisions) == (
                site.origin.source,
                site.origin.divisions,
            ):
                siblings.append(replace(site, backward=backward))
                continue
            raise Unfixable(
                f"the window also backpropagates `{code(backward.loss)}` (line "
                f"{self.tree.line(backward.call)}), which the rewrite would not weight; the "
                "one division at the step would divide its gradients too"
            )
        return siblings

    def _loss_scale(
        self, loss: cst.BaseExpression, window: Window
    ) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
        """(the loss, the factor) of a backpropagated `loss * factor` whose factor the window
        leaves as it is (a loss scale set before it: `2 ** self.lg_loss_scale`): that loss is
        weighted as the loss itself; else None."""
        if not (isinstance(loss, cst.BinaryOperation) and isinstance(loss.operator, cst.Multiply)):
            return None
        assigned = self.tree.assigned_in(window.loop or window.anchor)
        for scaled, factor in ((loss.left, loss.right), (loss.right, loss.left)):
            value = factor
            bound = (
                self.auditor.tracer.binding(factor.value, factor)
                if isinstance(factor, cst.Name)
                else None
            )
            if isinstance(bound, cst.Assign) and len(bound.targets) == 1:
                value = bound.value  # `loss_scale = 2 ** self.lg_loss_scale` in the micro-step
            if not depends_on(value, assigned):
                return scaled, factor
        return None

    def _window_backwards(self, window: Window):
        """The backward calls of `window`."""
        structure = self.auditor.structure
        for backward in structure.backwards():
            found = structure.window(backward)
            if found is not None and found.anchor is window.anchor:
                yield backward

    def _position(self, site: Site) -> tuple[int, int]:
        span = self.tree.span(site.node)
        return span.line, span.column

    def _restore(self, saved: tuple) -> None:
        (
            self.edits,
            self._prepared,
            self._weighted,
            self.companions,
            self._ahead_windows,
            self._modules,
        ) = saved

    def _snapshot(self) -> tuple:
        """A copy to restore when a site turns out unfixable half-way through planning."""
        weighted = {k: list(v) for k, v in self._weighted.items()}
        companions = {p: (t, copy_edits(e)) for p, (t, e) in self.companions.items()}
        return (
            copy_edits(self.edits),
            dict(self._prepared),
            weighted,
            companions,
            set(self._ahead_windows),
            dict(self._modules),
        )


def _backpropagated_together(tree: Tree, sites: list[Site]) -> list[Site]:
    """Two sites of one window that backpropagate different losses (made in different places)
    on one path through the micro-step, not on the two branches of an `if`; none if there
    are no such two."""
    for a, b in itertools.combinations(sites, 2):
        if _made(a) != _made(b) and not _apart(tree, a.backward.loss, b.backward.loss):
            return [a, b]
    return []


def _made(site: Site) -> object:
    """Where a site's loss is made: its node, or the function of another module."""
    origin = site.origin
    return origin.source if origin.source is not None else (origin.path, origin.callee)


def _apart(tree: Tree, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Whether at most one of `a` and `b` runs in a micro-step: they lie on the two branches
    of one `if`, or one lies in a branch that leaves the step (`return`, `continue`, ...)
    before the other is reached."""
    return _leaves_before(tree, a, b) or _leaves_before(tree, b, a)


def _leaves_before(tree: Tree, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    for node in tree.ancestors(a):
        if not isinstance(node, cst.If):
            continue
        body, other = node.body, node.orelse
        if tree.contains(node, b):  # the two branches of this `if`
            return other is not None and tree.contains(body, a) and tree.contains(other, b)
        branch = body if tree.contains(body, a) else other  # None: `a` is in the test
        if isinstance(branch, cst.Else):
            branch = branch.body
        if (
            isinstance(branch, cst.IndentedBlock)
            and _ends_in_exit(branch.body)
            and tree.order[b] > tree.order[node]
        ):
            return True
    return False


def _ends_in_exit(statements) -> bool:
    """Whether a block's statements end in `continue`, `break`, `return` or `raise`."""
    return (
        bool(statements)
        and isinstance(statements[-1], cst.SimpleStatementLine)
        and isinstance(statements[-1].body[-1], EXITS)
    )


def _several_losses(tree: Tree, sites: list[Site]) -> str:
    """Why a window that backpropagates several losses, each a mean, is not fixed."""
    named = [
        f"`{code(site.backward.loss)}` (line {tree.line(site.backward.call or site.backward.loss)})"
        for site in sites
    ]
    return (
        f"the window backpropagates {len(sites)} losses, {', '.join(named[:-1])} and "
        f"{named[-1]}, each a mean over a count of its own: one division at the step cannot "
        "weight them apart; backpropagate each loss's sum divided by its own window's count"
    )
