"""GA001 and GA002: judge each backward call against its accumulation window."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import libcst as cst

from gaaudit import catalogue
from gaaudit.analysis.domain import Domains
from gaaudit.analysis.evidence import Evidence
from gaaudit.analysis.loops import (
    Backward,
    Pipeline,
    Structure,
    Window,
    accumulates,
    calls_of,
    runner,
)
from gaaudit.analysis.provenance import Division, Origin, Tracer
from gaaudit.analysis.repository import Imports
from gaaudit.analysis.tree import (
    Tree,
    argument_for,
    call_parameters,
    code,
    depends_on,
    dotted,
    keyword,
    last_name,
    string_value,
)
from gaaudit.discover.modules import evaluation_only, shown
from gaaudit.findings import Confidence, Finding

SiteKind = Literal["loss-division", "gradient-division", "no-division", "framework-division"]
CODES = {
    "loss-division": "GA001",
    "gradient-division": "GA001",
    "no-division": "GA002",
    "framework-division": "GA003",
}


@dataclass(frozen=True)
class Site:
    """A backward call in an accumulation window, with what the rules concluded about it."""

    kind: SiteKind
    node: cst.CSTNode  # what the finding points at
    backward: Backward
    window: Window
    origin: Origin
    division: Division | None  # the constant division, for GA001
    message: str

    @property
    def code(self) -> str:
        return CODES[self.kind]


class _Frameworks:
    """Part of `Auditor`: losses a framework divides: Lightning's returned loss, pipeline schedules'
    loss functions."""

    def _lightning(self) -> Iterator[Site]:
        """`training_step` returning a mean loss under `Trainer(accumulate_grad_batches=k)`, a
        `GradientAccumulationScheduler`, or the project's YAML configs setting K."""
        modules = [cls for cls in self.tree.classes if _is_lightning_module(cls)]
        accumulation = self.structure.lightning_accumulation if modules else None
        if accumulation is None:  # (the project's configs and scripts are read only here)
            return
        factor, setting, _ = accumulation
        size = None if isinstance(factor, cst.Dict) else factor  # a schedule: K varies by epoch
        for cls in modules:
            for node in self.tree.walk(cls.body):
                if isinstance(node, cst.FunctionDef) and node.name.value == "training_step":
                    for returned in self.tracer.returns(node):
                        loss = _returned_loss(returned)
                        origin = self.tracer.origin(loss)
                        if origin.kind == "mean":
                            window = Window("framework", None, size, node, ())
                            yield Site(
                                "framework-division",
                                loss,
                                Backward(None, loss),
                                window,
                                origin,
                                None,
                                "Mean loss returned to a Lightning Trainer that divides it by "
                                f"its accumulation factor ({setting}): micro-batches with fewer "
                                "valid tokens are over-weighted",
                            )

    def _mmengine(self) -> Iterator[Site]:
        """The configured model's mean loss under mmengine's optimizer wrapper, which divides
        each micro-batch's loss by its `accumulative_counts`: `AmpOptimWrapper(...)` or, in an
        OpenMMLab config, `dict(type=AmpOptimWrapper, ...)` beside `model = dict(type=...)`."""
        models = [v for v in self.tree.assigned_values.get("model", ()) if isinstance(v, cst.Call)]
        if not models:
            return
        for call in self.tree.calls:
            built = keyword(call, "type") if dotted(call.func) == "dict" else call.func
            counts = keyword(call, "accumulative_counts")
            if counts is None or not (last_name(built) or "").endswith("OptimWrapper"):
                continue
            named = (
                self.tree.assigned_values.get(code(counts))
                if isinstance(counts, cst.Name)
                else None
            )
            if not any(accumulates(value) for value in named or [counts]):
                continue
            model = models[-1]
            kind = keyword(model, "type") if dotted(model.func) == "dict" else model.func
            what = f"the loss of the configured model, `{code(kind or model.func)}`"
            origin = Origin("mean", what, model, from_model=True, tree=self.tree)
            yield Site(
                "framework-division",
                counts,
                Backward(None, counts),
                Window("framework", None, counts, call, ()),
                origin,
                None,
                f"Mean loss handed to mmengine's `{last_name(built)}`, which divides it by its "
                f"`accumulative_counts={code(counts)}`: micro-batches with fewer valid tokens "
                "are over-weighted",
            )

    def _pipelines(self) -> Iterator[Site]:
        """Loss functions given to a pipeline schedule that returns a per-micro-batch mean:
        divided by the number of micro-batches (GA001), left to a schedule that divides
        (GA003), or to one that sums the micro-batches' gradients (GA002)."""
        for pipeline in self.structure.pipelines():
            window = Window("pipeline", None, pipeline.micro_batches, pipeline.call, ())
            for returned, origin in self.tracer.called(pipeline.loss_fn):
                tupled = isinstance(returned, cst.Tuple)  # `return loss, {"lm loss": reported}`
                if tupled:
                    if len(returned.elements) != 2:  # megatron-core's (sum, count, report)
                        continue
                    returned = returned.elements[0].value
                    origin = self.tracer.origin(returned)
                if origin.kind == "mean":
                    node = returned if returned is not None else pipeline.loss_fn
                    yield from self._pipeline_site(pipeline, window, node, origin)
                    if tupled:  # one finding for a loss function's several returns
                        break

    def _pipeline_site(
        self, pipeline: Pipeline, window: Window, node: cst.CSTNode, origin: Origin
    ) -> Iterator[Site]:
        backward = Backward(None, node)
        division = next(
            (d for d in origin.divisions if self._counts_micro_batches(d, pipeline)), None
        )
        if division is not None:
            again = f"; {pipeline.framework} as well: K times too small" if pipeline.divides else ""
            message = (
                f"Mean loss divided by the number of micro-batches `{code(division.divisor)}` in "
                "a pipeline loss function: micro-batches with fewer valid tokens are over-weighted"
            )
            yield Site(
                "loss-division", division.node, backward, window, origin, division, message + again
            )
        elif origin.divisions or pipeline.divides is None:
            return
        elif pipeline.divides:
            message = (
                f"Mean loss returned to the training loop of `{runner(window)}(...)`: "
                f"{pipeline.framework}, so micro-batches with fewer valid tokens are over-weighted"
                if runner(window)
                else "Mean loss returned to a pipeline schedule that divides by the number of "
                f"micro-batches ({pipeline.framework}): micro-batches with fewer valid tokens are "
                "over-weighted"
            )
            yield Site("framework-division", node, backward, window, origin, None, message)
        else:
            message = (
                "Mean loss returned to a pipeline schedule with `scale_grads=False`, which sums "
                "the micro-batches' gradients: the gradient is about K times too large and "
                "wrongly weighted per token"
            )
            yield Site("no-division", node, backward, window, origin, None, message)

    def _counts_micro_batches(self, division: Division, pipeline: Pipeline) -> bool:
        """A divisor that is the schedule's number of micro-batches: an accumulation name, the
        value given to the schedule, or a loss class's `self.n` set from either."""
        argument = self._constructor_argument(division.divisor, pipeline.loss_fn)
        return any(
            self.structure.is_accumulation_name(divisor)
            or (
                pipeline.micro_batches is not None
                and self._same_value(divisor, pipeline.micro_batches)
            )
            for divisor in (division.divisor, argument)
            if divisor is not None
        )

    def _constructor_argument(self, divisor: cst.BaseExpression, loss_fn: cst.BaseExpression):
        """For `self.n` in a loss class's method: the argument its constructor call passed for
        the `__init__` parameter that `self.n` was set from."""
        name = dotted(divisor) or ""
        if not name.startswith("self.") or name.count(".") != 1:
            return None
        constructor = loss_fn if isinstance(loss_fn, cst.Call) else self.tracer.bound_value(loss_fn)
        if (
            not isinstance(constructor, cst.Call)
            or self.tracer.loss_method(constructor.func) is None
        ):
            return None
        init = self.tracer.method(constructor.func, "__init__")
        if init is None:
            return None
        parameters = call_parameters(init)
        for stmt in self.tree.walk(init.body, into_defs=False):
            if isinstance(stmt, cst.Assign) and any(dotted(t.target) == name for t in stmt.targets):
                source = stmt.value.value if isinstance(stmt.value, cst.Name) else None
                if source in parameters:
                    return argument_for(constructor, parameters[source])
        return None


class _Divisors:
    """Part of `Auditor`: which divisors are the window's constant K, and how a site is
    described."""

    def _stock_guarded(self, node: cst.CSTNode) -> bool:
        """Under the stock Trainer's own guard, `if not self.model_accepts_loss_kwargs ...:`,
        where transformers divides by K too: the division copies the stock behaviour."""
        return any(
            isinstance(guard, cst.If) and "model_accepts_loss_kwargs" in code(guard.test)
            for guard in self.tree.ancestors(node)
        )

    def _constant_divisor(self, division: Division, window: Window) -> bool:
        """A divisor that is the window size K, an accumulation name, or loop-invariant."""
        divisor = division.divisor
        if self.structure.is_accumulation_name(divisor) or _example_share(divisor):
            return True
        if window.size is not None:
            return self._same_value(divisor, window.size) or self._given(divisor, window)
        if window.loop is None:
            return False
        return not depends_on(divisor, self.tree.assigned_in(window.loop))

    def _same_value(self, a: cst.BaseExpression, b: cst.BaseExpression) -> bool:
        """Equal code, or one is a name bound to the other (`k = args.accum`)."""
        return bool({_canonical(a), self._alias(a)} & {_canonical(b), self._alias(b)} - {""})

    def _given(self, divisor: cst.BaseExpression, window: Window) -> bool:
        """A parameter of the function holding the division that every call of the file
        passes K (`train_step(model, batch, args.accum)` dividing by its `accum`): every call
        in the window's loop, where there is one (an evaluation's call may keep the default)."""
        function = self.tree.scope_of(divisor) if divisor in self.tree.order else None
        if not isinstance(divisor, cst.Name) or not isinstance(function, cst.FunctionDef):
            return False
        parameter = call_parameters(function).get(divisor.value)
        if parameter is None:
            return False
        calls = calls_of(self.tree, function)
        loop = window.loop
        calls = [c for c in calls if loop is not None and self.tree.contains(loop, c)] or calls
        given = [argument_for(c, parameter) for c in calls]
        return bool(given) and all(
            a is not None and self._same_value(a, window.size) for a in given
        )

    def _alias(self, expr: cst.BaseExpression) -> str:
        if (
            not isinstance(expr, cst.Name) or expr not in self.tree.order
        ):  # detached: another module's
            return ""
        stmt = self.tracer.binding(expr.value, expr)
        if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
            return _canonical(stmt.value)
        return ""

    def _gradient_divisions(
        self, window: Window
    ) -> Iterator[tuple[cst.CSTNode, cst.BaseExpression]]:
        """`p.grad.div_(k)`, `p.grad /= k`, `p.grad = p.grad / k` at the window's step."""
        for region in window.step_region:
            for node in self.tree.walk(region, into_defs=False):
                divisor = _grad_divisor(node)
                if divisor is not None and self._constant_divisor(Division(node, divisor), window):
                    yield node, divisor

    def _describe(self, window: Window) -> str:
        line = self.tree.line(window.anchor)
        if window.skips:
            return f"optimizer step after `if {code(window.anchor.test)}: continue` (line {line})"
        if self.structure.window_else(window) is not None:
            return f"optimizer step in the `else` of `if {code(window.anchor.test)}:` (line {line})"
        if window.kind == "modulo":
            return f"optimizer step guarded by `{code(window.anchor.test)}` (line {line})"
        if window.kind == "calls":
            function = self.tree.scope_of(window.anchor)
            return (
                f"optimizer step guarded by `{code(window.anchor.test)}` (line {line}): the window "
                f"spans calls of `{function.name.value}`"
            )
        if window.kind == "micro-loop":
            head = code(window.anchor.iter) if isinstance(window.anchor, cst.For) else "while"
            return f"micro-step loop over `{head}` (line {line}) before one optimizer step"
        if window.kind == "accumulate":
            return f"`accumulate()` context (line {line})"
        if window.kind == "callable":
            flag = self.structure.stepping_callable(window.anchor)
            return (
                f"`{code(window.anchor.func)}(...)` (line {line}) is handed the loss and the "
                f"optimizer, and steps every `{code(flag.right)}` calls (`{code(flag)}`)"
            )
        if window.kind == "framework":
            return f"the framework accumulates gradients for you (line {line})"
        if window.kind == "pipeline":
            schedule = f"`{code(window.anchor.func)}(...)`"
            return (
                f"{schedule} runs the micro-batches and accumulates their gradients (line {line})"
            )
        return f"`{code(window.size)}` names an accumulation divisor"


class Auditor(_Frameworks, _Divisors):
    """Runs the accumulation rules over one parsed file."""

    def __init__(
        self,
        tree: Tree,
        accumulation_names: frozenset[str] = frozenset(),
        directory: Path = Path("."),
        imports: Imports | None = None,
        structure: Structure | None = None,
    ) -> None:
        self.tree = tree
        self.imports = imports if imports is not None else Imports(tree, directory)
        self.structure = structure or Structure(
            tree, accumulation_names, directory, self.imports.dependencies
        )
        self.tracer = Tracer(tree, self.imports)

    def sites(self) -> Iterator[Site]:
        """One site per reportable node, in source order."""
        seen: set[cst.CSTNode] = set()
        judged = (site for backward in self.structure.backwards() for site in self._judge(backward))
        for site in (*judged, *self._lightning(), *self._pipelines(), *self._mmengine()):
            if site.node not in seen:
                seen.add(site.node)
                yield site

    def findings(self, path: str, evidence: Callable[[], Evidence], text: str) -> list[Finding]:
        """The findings of the file at `path` (whose code is `text`); `evidence` tokenizes it,
        when a site asks."""
        rules = catalogue.load()
        found = []
        domains = None
        for site in self.sites():
            domains = domains or Domains(self.tree, self.tracer, evidence(), text)
            domain = domains.of(site.origin)
            confidence, why = domain.confidence()
            if (
                site.kind == "no-division"
                and site.origin.kind == "mean"
                and confidence < Confidence.MEDIUM
            ):
                confidence, why = (
                    Confidence.MEDIUM,
                    (f"the gradient is K times too large whatever the counts; {why}"),
                )
            if (
                site.window.kind == "framework"
                and self.structure.deepspeed_at_run_time()
                and confidence > Confidence.MEDIUM
            ):
                confidence, why = (
                    Confidence.MEDIUM,
                    f"{why}; DeepSpeed's K is set in a config given at run time and may be 1",
                )
            runs = runner(site.window)
            evaluating = runs and evaluation_only(
                self.structure.directory, self.imports.name, self.structure.seen
            )
            if evaluating:
                script, line = evaluating
                confidence, why = (
                    Confidence.LOW,
                    (
                        f"the project's launch script {shown(script)} (line {line}) runs this "
                        "file with `--train-iters 0`: it evaluates and trains nothing"
                    ),
                )
            elif runs and confidence > Confidence.MEDIUM:
                confidence, why = (
                    Confidence.MEDIUM,
                    (
                        f"{why}; K is chosen at run time (the batch sizes or the DeepSpeed "
                        "config given to the launch) and may be 1"
                    ),
                )
            lightning = self.structure.lightning_accumulation
            if (
                site.window.kind == "framework"
                and site.backward.call is None
                and lightning is not None
                and lightning[2]
                and confidence > Confidence.MEDIUM
            ):
                confidence, why = (
                    Confidence.MEDIUM,
                    f"{why}; K is set in a config file, which the run may not choose",
                )
            found.append(
                Finding(
                    path=path,
                    code=site.code,
                    message=domain.worded(site.message),
                    span=self.tree.span(site.node),
                    confidence=confidence,
                    evidence=(
                        f"loss: {site.origin.description}",
                        f"window: {self._describe(site.window)}",
                        f"confidence {confidence}: {why}",
                    ),
                    hint=domain.worded(rules[site.code].hint),
                    fixable=True,
                )
            )
        return found

    def _judge(self, backward: Backward) -> Iterator[Site]:
        window = self.structure.window(backward)
        origin = self.tracer.origin(backward.loss)
        if window is None:
            division = next(
                (d for d in origin.divisions if self.structure.is_accumulation_name(d.divisor)),
                None,
            )
            if division is None or origin.kind not in ("mean", "unknown"):
                return
            window = Window("named", None, division.divisor, backward.call, ())
        if origin.kind not in ("mean", "unknown"):
            return
        constant = [
            d
            for d in origin.divisions
            if self._constant_divisor(d, window) and not self._stock_guarded(d.node)
        ]
        division = next(  # an accumulation name before another constant (`world_size`)
            (d for d in constant if self.structure.is_accumulation_name(d.divisor)),
            next(iter(constant), None),
        )
        if division is not None:
            yield Site(
                "loss-division",
                division.node,
                backward,
                window,
                origin,
                division,
                (
                    f"{_subject(origin)} divided by `{code(division.divisor)}`, the number of "
                    "micro-batches of its size in a batch: it is weighted by its share of the "
                    "examples, so micro-batches with fewer valid tokens are over-weighted"
                    if _example_share(division.divisor)
                    else f"{_subject(origin)} divided by the constant accumulation divisor "
                    f"`{code(division.divisor)}`: micro-batches with fewer valid tokens are "
                    "over-weighted"
                ),
            )
            return
        framework = self.structure.dividing_framework(backward, window)
        scaled = list(self._gradient_divisions(window))
        if framework is not None and not scaled:
            yield Site(
                "framework-division",
                backward.call,
                backward,
                window,
                origin,
                None,
                f"{_subject(origin)} passed to a backward that divides by the accumulation steps for you "
                f"({framework}): micro-batches with fewer valid tokens are over-weighted",
            )
            return
        for node, divisor in scaled:
            yield Site(
                "gradient-division",
                node,
                backward,
                window,
                origin,
                Division(node, divisor),
                f"Gradients divided by the constant accumulation divisor `{code(divisor)}` "
                "after backward on per-micro-batch mean losses",
            )
        if not scaled and window.kind in ("modulo", "micro-loop", "calls", "callable"):
            yield Site(
                "no-division",
                backward.call,
                backward,
                window,
                origin,
                None,
                f"{_subject(origin)} accumulated over micro-batches with no normalization: the gradient is "
                "about K times too large and wrongly weighted per token",
            )


def _subject(origin: Origin) -> str:
    """How a message names the loss: a mean only where gaaudit saw one."""
    return "Mean loss" if origin.kind == "mean" else "Loss"


def _canonical(expr: cst.BaseExpression) -> str:
    """An expression as Python reads it, whatever its parentheses, layout or quotes:
    `(args.k)` is `args.k`, and `cfg['k']` spread over three lines is `cfg["k"]`."""
    try:
        return ast.dump(ast.parse(code(expr).strip(), mode="eval"))
    except SyntaxError:
        return code(expr)


def _is_lightning_module(cls: cst.ClassDef) -> bool:
    return any((dotted(base.value) or "").endswith("LightningModule") for base in cls.bases)


def _returned_loss(returned: cst.BaseExpression) -> cst.BaseExpression:
    """`loss`, or the value under "loss" in a returned dict."""
    if isinstance(returned, cst.Dict):
        for element in returned.elements:
            if isinstance(element, cst.DictElement) and string_value(element.key) == "loss":
                return element.value
    return returned


def _is_grad(node: cst.CSTNode) -> bool:
    name = dotted(node) or ""
    return name.endswith((".grad", ".grad.data"))


def _grad_divisor(node: cst.CSTNode) -> cst.BaseExpression | None:
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "div_"
        and _is_grad(node.func.value)
        and len(node.args) == 1
    ):
        return node.args[0].value
    if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
        return node.value if _is_grad(node.target) else None
    if isinstance(node, cst.Assign) and len(node.targets) == 1 and _is_grad(node.targets[0].target):
        value = node.value
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide):
            return value.right if _is_grad(value.left) else None
    return None


def findings(context) -> list[Finding]:
    """GA001/GA002 (and, in accumulate() windows, GA003) for one file."""
    auditor = Auditor(
        context.tree,
        context.accumulation_names,
        context.directory,
        context.imports,
        context.structure,
    )
    return auditor.findings(context.path, lambda: context.evidence, context.text)


def _example_share(divisor: cst.BaseExpression) -> bool:
    """`batch_size / input_ids.shape[0]`: how many micro-batches of this one's size make a
    batch (K, when every micro-batch is full)."""
    if not (isinstance(divisor, cst.BinaryOperation) and isinstance(divisor.operator, cst.Divide)):
        return False
    size = divisor.right
    if isinstance(size, cst.Subscript) and isinstance(size.value, cst.Attribute):
        index = size.slice[0].slice
        return (
            size.value.attr.value == "shape"
            and isinstance(index, cst.Index)
            and code(index.value) == "0"
        )
    if isinstance(size, cst.Call) and isinstance(size.func, cst.Attribute):
        args = size.args
        return size.func.attr.value == "size" and len(args) == 1 and code(args[0].value) == "0"
    return False
