"""GA004: transformers Trainer overrides that defeat its `num_items_in_batch` normalisation."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from gaaudit import catalogue
from gaaudit.analysis.domain import Domain, Domains
from gaaudit.analysis.provenance import PASS_THROUGH, Division, Origin, Tracer
from gaaudit.analysis.tree import (
    Tree,
    code,
    dotted,
    keyword,
    last_name,
    methods_of,
    positional,
    string_value,
)
from gaaudit.discover.modules import derives_from_trainer
from gaaudit.findings import Confidence, Finding
from gaaudit.vocabulary import TRAINER_MODULES

if TYPE_CHECKING:
    from gaaudit.analysis.repository import Imports

CODE = "GA004"
COUNT = "num_items_in_batch"
# Tests under which a division by K is the Trainer's own fallback for models without loss kwargs.
FALLBACK_GUARDS = {COUNT, "model_accepts_loss_kwargs", "compute_loss_func"}
OPT_OUT = "model_accepts_loss_kwargs"  # a Trainer attribute; `Trainer.__init__` sets it
MODEL_OPT_OUT = "accepts_loss_kwargs"  # a model class attribute the Trainer reads
SCALED = "loss_is_scaled_for_ga"  # a Trainer class attribute (transformers 5.x)
OWN_LOSS = ("compute-loss", "loss-function")  # sites whose function computes the loss
# transformers heads whose loss is a mean over a count that varies per micro-batch (labels
# padded or ignored with -100, masked tokens) and that never use `num_items_in_batch`: without
# `**kwargs` (4.x) the Trainer divides their mean by K; with `**kwargs` they drop the count
# (transformers 5, issue 47688) and the Trainer does not divide at all. An `Auto` class
# stands for its checkpoint's architecture, of which a few count (ModernBERT, T5Gemma).
TOKEN_HEADS = re.compile(
    r"(?:\w+ForTokenClassification|\w+ForMaskedLM|MarianMTModel"
    r"|AutoModelFor(?:Seq2SeqLM|SpeechSeq2Seq)"
    r"|(?:Bart|BigBirdPegasus|Blenderbot|BlenderbotSmall|FSMT|LED|LongT5|M2M100|MBart|MT5|Mvp"
    r"|NllbMoe|Pegasus|PegasusX|PLBart|ProphetNet|Speech2Text|SwitchTransformers|T5|UMT5"
    r"|Whisper)ForConditionalGeneration)"
)
# Heads with one label per example: their mean is exact under the Trainer's mean/K of 4.x; in
# 5.x they take `**kwargs` and drop the count, and the Trainer skips its division by K.
# (Question answering heads read `start_positions`, no `labels`: the Trainer counts nothing.)
EXAMPLE_HEADS = re.compile(r"\w+For(?:SequenceClassification|MultipleChoice)")
STOCK_TRAINERS = {  # those that compute the loss the stock way, as they are imported
    "transformers.Trainer",
    "transformers.trainer.Trainer",
    "transformers.Seq2SeqTrainer",
    "transformers.trainer_seq2seq.Seq2SeqTrainer",
}
FIVE = "5.0.0"  # the first release whose `EXAMPLE_HEADS` take `**kwargs` and drop the count
COUNTING_HEADS = {  # masked-LM heads of transformers 5 that hand the count to their loss
    f"{name}ForMaskedLM" for name in ("ModernBert", "EuroBert", "Esmc", "NeoMME", "Ultrabert")
}
AUTO_MIXED = ("AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq")
BUILDERS = ("from_pretrained", "from_config")
MOVES = ("to", "cuda", "half", "bfloat16", "float", "train")  # `model.to(device)`: still the model
KEEPS_LOSS = PASS_THROUGH | {"mean"}  # methods whose result is still the loss


@dataclass(frozen=True)
class Site:
    """One reportable node, what GA004 says about it, and where it sits for the fixer.

    `kind` is "compute-loss", "training-step-signature", "training-step-division",
    "forward" or "loss-function"; `function` is the function holding `node`, `owner` its
    class (None for a module-level `compute_loss_func`).
    """

    node: cst.CSTNode
    message: str
    facts: tuple[str, ...]
    kind: str
    function: cst.FunctionDef | None  # None for a library head handed to a Trainer
    owner: cst.ClassDef | None
    crashes: bool = False  # a TypeError on every call, whatever the data
    scaled: bool = False  # the loss is K times too large, whatever the data
    hint: str = ""  # what to do, where the catalogue's hint does not fit
    head: str = ""  # the transformers head class a "library-head" site's Trainer is given

    @property
    def code(self) -> str:
        return CODE


class _Tracer(Tracer):
    """A Tracer that also follows both branches of `a if cond else b`."""

    def origin(self, expr: cst.BaseExpression, depth: int = 0) -> Origin:
        if isinstance(expr, cst.IfExp):
            body = super().origin(expr.body, depth + 1)
            return body if body.kind != "unknown" else super().origin(expr.orelse, depth + 1)
        return super().origin(expr, depth)


class _LossKwargs:
    """Part of `TrainerAudit`: what a class does with the count: opt-outs through its lineage, and
    the `compute_loss` calls that drop it."""

    def lineage(self, cls: cst.ClassDef) -> Iterator[cst.ClassDef]:
        """The class and its same-file Trainer bases, nearest first."""
        pending, seen = [cls], set()
        while pending:
            current = pending.pop(0)
            if current in seen:
                continue
            seen.add(current)
            yield current
            bases = (self.trainers.get(dotted(base.value) or "") for base in current.bases)
            pending.extend(b for b in bases if b is not None)

    def opts_out(self, cls: cst.ClassDef) -> bool:
        """The class or a same-file base sets `self.model_accepts_loss_kwargs = False` in a method
        (after `super().__init__()` in `__init__`), or `loss_is_scaled_for_ga = False`.

        A class attribute `model_accepts_loss_kwargs = False` does not count:
        `Trainer.__init__` assigns the instance attribute from the model's signature.
        """
        for current in self.lineage(cls):
            for statement in current.body.body:
                if isinstance(statement, cst.FunctionDef) and self._sets_false(statement):
                    return True
                if class_attribute(statement, SCALED) == "False":
                    return True
        return False

    def _sets_false(self, method: cst.FunctionDef) -> bool:
        """`self.model_accepts_loss_kwargs = False` in `method`, after `super().__init__()` there."""
        base_init = next((c for c in self.tree.walk(method.body) if is_super_init(c)), None)
        after = method.name.value != "__init__" or base_init is not None
        for node in self.tree.walk(method.body):
            opts_out = (
                isinstance(node, cst.Assign)
                and code(node.value) == "False"
                and any(
                    isinstance(t.target, cst.Attribute) and last_name(t.target) == OPT_OUT
                    for t in node.targets
                )
            )
            if (
                opts_out
                and after
                and (base_init is None or self.tree.order[base_init] < self.tree.order[node])
            ):
                return True
        return False

    def _class_level_opt_out(self, cls: cst.ClassDef) -> str | None:
        """A fact about a class attribute `model_accepts_loss_kwargs = False`, which has no effect."""
        for current in self.lineage(cls):
            for statement in current.body.body:
                if class_attribute(statement, OPT_OUT) == "False":
                    return (
                        f"opt-out: `{OPT_OUT} = False` at line {self.tree.line(statement)} is a class "
                        "attribute, which `Trainer.__init__` overwrites; set it on the instance after "
                        "`super().__init__()`"
                    )
        return None

    def count_dropped(self, function: cst.FunctionDef) -> cst.Call | None:
        """A `super().compute_loss(...)` call of a `compute_loss` override that never reads
        `num_items_in_batch`: the call goes without the count."""
        for node in self.tree.walk(function.body):
            if (
                isinstance(node, cst.Call)
                and isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "compute_loss"
                and is_super(node.func.value)
                and len(positional(node)) < 4
                and not any(a.star == "**" for a in node.args)
            ):
                return node
        return None

    def count_withheld(
        self, cls: cst.ClassDef
    ) -> tuple[cst.ClassDef, cst.FunctionDef, list[cst.Call]] | None:
        """The nearest `training_step` of the class's lineage, with its class and its
        `self.compute_loss(...)` calls, where none of them hands on the count and the step
        neither divides the loss by the accumulation steps outside the stock guard (GA004's
        own site, whose fix hands the count on) nor reads the opt-out; else None."""
        for current in self.lineage(cls):
            step = methods_of(current).get("training_step")
            if step is None:
                continue
            calls = [
                n
                for n in self.tree.walk(step.body)
                if isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value == "compute_loss"
                and dotted(n.func.value) == "self"
            ]
            divides = any(
                (parts := division_of(n)) is not None
                and last_name(parts[1]) == "gradient_accumulation_steps"
                and not detached(parts[0])
                and not self._guarded(n, step)
                for n in self.tree.walk(step.body)
            )
            reads_opt_out = any(
                isinstance(n, cst.Attribute) and n.attr.value == OPT_OUT
                for n in self.tree.walk(step.body)
            )
            if not calls or divides or reads_opt_out or any(map(hands_count, calls)):
                return None
            return current, step, calls
        return None

    def compute_loss_call(self, expr: cst.BaseExpression) -> cst.Call | None:
        """The `self.compute_loss(...)` / `super().compute_loss(...)` call a value comes from."""
        for _ in range(12):
            if isinstance(expr, cst.Name):
                stmt = self.tracer.binding(expr.value, expr)
                if not isinstance(stmt, cst.Assign) or len(stmt.targets) != 1:
                    return None
                expr = stmt.value
            elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
                if expr.func.attr.value == "compute_loss" and (
                    dotted(expr.func.value) == "self" or is_super(expr.func.value)
                ):
                    return expr
                if expr.func.attr.value not in KEEPS_LOSS:
                    return None
                expr = expr.func.value
            else:
                return None
        return None

    def _reads(self, function: cst.FunctionDef, names: set[str | None]) -> bool:
        return any(
            isinstance(n, cst.Name) and n.value in names for n in self.tree.walk(function.body)
        )

    def returned_mean(self, function: cst.FunctionDef) -> Origin | None:
        """The first returned loss that traces to a mean, looking through tuples, dicts and outputs."""
        for returned in self.tracer.returns(function):
            for expr in loss_parts(returned):
                origin = self.tracer.origin(expr)
                if origin.kind == "mean":
                    return origin
        return None


class _Models:
    """Part of `TrainerAudit`: same-file models and loss functions handed to a Trainer."""

    def _models(self) -> Iterator[Site]:
        """Same-file models passed to a Trainer whose `forward` returns a mean loss."""
        seen: set[str] = set()
        for node in self.tree.calls:
            if not self._is_trainer(node.func):
                continue
            given = self.given(node)
            cls = self._model_class(given)
            if cls is None:
                yield from self._library_head(node, given)
                continue
            forward = methods_of(cls).get("forward")
            if forward is None or cls.name.value in seen:
                continue
            seen.add(cls.name.value)
            if any(class_attribute(s, MODEL_OPT_OUT) == "False" for s in cls.body.body):
                continue
            passed = f"model: `{cls.name.value}` is trained by `{code(node.func)}` (line {self.tree.line(node)})"
            yield from self._forward(cls, forward, passed)

    def given(self, trainer: cst.Call, name: str = "model") -> cst.BaseExpression | None:
        """What a Trainer call is given as `name`: its keyword (the model also its first
        positional argument), else that keyword of a `dict(...)` it unpacks
        (`Trainer(**trainer_args)` with `trainer_args = dict(model=m)`)."""
        found = keyword(trainer, name)
        if found is None and name == "model":
            found = next(iter(positional(trainer)), None)
        for mapping in self.unpacked(trainer) if found is None else ():
            found = keyword(mapping, name) or found
        return found

    def unpacked(self, trainer: cst.Call) -> list[cst.Call]:
        """The `dict(...)` calls, bound to names, whose items a Trainer call unpacks (`**`)."""
        calls = (self.tracer.origin_call(a.value) for a in trainer.args if a.star == "**")
        return [c for c in calls if c is not None and code(c.func) == "dict"]

    def _library_head(self, trainer: cst.Call, given: cst.BaseExpression | None) -> Iterator[Site]:
        """A transformers head whose loss ignores the window's count (`TOKEN_HEADS`, or
        `EXAMPLE_HEADS` where the model was not opted out), handed to a Trainer that computes
        the loss the stock way: no `compute_loss_func`, no same-file `compute_loss` or
        `training_step` override."""
        head = self.head_of(given)
        if head is None or self.given(trainer, "compute_loss_func") is not None:
            return
        own = self.trainers.get(dotted(trainer.func) or "")
        lineage = list(self.lineage(own)) if own is not None else []
        if any(
            {"compute_loss", "training_step"} & set(methods_of(c)) or self.opts_out(c)
            for c in lineage
        ):
            return
        roots = [b.value for c in lineage for b in c.bases] if lineage else [trainer.func]
        if not any(self.tree.qualified(r) in STOCK_TRAINERS for r in roots):
            return  # trl's trainers compute losses of their own
        name = head.rsplit(".", 1)[-1]
        per_example = head_kind(name) == "classify"
        if per_example and self.opted_out(given):
            return
        facts = [
            f"model: `{name}` is trained by `{code(trainer.func)}` (line {self.tree.line(trainer)})"
        ]
        if per_example:
            message = (
                f"`{name}` takes `**kwargs` in transformers 5 but drops `num_items_in_batch`: the "
                "Trainer passes the count and skips its division by the accumulation steps, so the "
                "loss and its gradient are K times too large"
            )
            hint = (
                "Set model.accepts_loss_kwargs = False before building the Trainer: it then "
                "divides each micro-batch's mean by K, exact with one label per example."
            )
        else:
            message = (
                f"`{name}` computes a mean loss over its micro-batch's valid targets and never "
                "uses `num_items_in_batch`: the Trainer either divides that mean by the "
                "accumulation steps (transformers 4.x, whose heads take no `**kwargs`) or skips it "
                "while the head drops the count (transformers 5: the loss is K times too large); "
                "either way each micro-batch weighs the same, whatever its number of targets"
            )
            hint = (
                "Give the Trainer a compute_loss_func returning the micro-batch's token-loss sum "
                "(cross-entropy, reduction='sum', over labels != -100) divided by "
                "num_items_in_batch (an encoder-decoder then needs decoder_input_ids from its "
                "collator)."
            )
            if name in AUTO_MIXED:
                facts.append(
                    f"architecture: `{name}` stands for the checkpoint's class; most (BERT, "
                    "RoBERTa, T5, BART, Whisper) ignore the count, a few (ModernBERT, T5Gemma) "
                    "use it"
                )
        function = self.tree.enclosing_function(trainer)
        yield Site(
            trainer.func,
            message,
            tuple(facts),
            "library-head",
            function,
            None,
            hint=hint,
            head=name,
        )

    def opted_out(self, given: cst.BaseExpression | None) -> bool:
        """`model.accepts_loss_kwargs = False` in the file, for the name the Trainer is given."""
        name = model_name(given)
        return name is not None and any(
            isinstance(node, cst.Assign)
            and code(node.value) == "False"
            and any(code(t.target) == f"{name.value}.{MODEL_OPT_OUT}" for t in node.targets)
            for node in self.tree.walk(self.tree.module)
        )

    def head_of(self, expr: cst.BaseExpression | None) -> str | None:
        """The transformers head an expression builds (`AutoModelForTokenClassification
        .from_pretrained(...)`, `T5ForConditionalGeneration(config)`, a name bound to one,
        moved with `.to(device)` or wrapped by peft's `get_peft_model`), when it is one of
        `TOKEN_HEADS` or `EXAMPLE_HEADS`."""
        for _ in range(8):
            if isinstance(expr, cst.Name):
                stmt = self.tracer.binding(expr.value, expr)
                expr = stmt.value if isinstance(stmt, cst.Assign) else None
            elif isinstance(expr, cst.Call):
                func = expr.func
                if self.tree.qualified(func) == "peft.get_peft_model" and expr.args:
                    expr = expr.args[0].value
                elif isinstance(func, cst.Attribute) and func.attr.value in (*BUILDERS, *MOVES):
                    if func.attr.value in MOVES:
                        expr = func.value
                        continue
                    return self._head(func.value)
                else:
                    return self._head(func)
            else:
                return None
        return None

    def _head(self, cls: cst.BaseExpression) -> str | None:
        qualified = self.tree.qualified(cls) or ""
        name = qualified.rsplit(".", 1)[-1]
        if not qualified.startswith("transformers.") or name in COUNTING_HEADS:
            return None
        return qualified if TOKEN_HEADS.fullmatch(name) or EXAMPLE_HEADS.fullmatch(name) else None

    def _model_class(self, expr: cst.BaseExpression | None) -> cst.ClassDef | None:
        """The same-file class an expression instantiates: `M(...)`, `M(...).to(d)`, a name bound to one."""
        for _ in range(8):
            if isinstance(expr, cst.Name) and expr.value not in self.classes:
                stmt = self.tracer.binding(expr.value, expr)
                expr = stmt.value if isinstance(stmt, cst.Assign) else None
            elif isinstance(expr, cst.Call):
                if dotted(expr.func) in self.classes:
                    return self.classes[dotted(expr.func)]
                expr = expr.func.value if isinstance(expr.func, cst.Attribute) else None
            else:
                return None
        return None

    def _forward(self, cls: cst.ClassDef, forward: cst.FunctionDef, passed: str) -> Iterator[Site]:
        _, kwargs = parameters(forward)
        if kwargs is not None and self._reads(forward, {COUNT, kwargs}):
            return
        origin = self.returned_mean(forward)
        if origin is None:
            return
        if kwargs is None:
            message = (
                "`forward` returns a per-batch mean loss and takes no `**kwargs`: the Trainer cannot "
                "pass `num_items_in_batch` and divides the mean by the accumulation steps instead"
            )
        else:
            message = (
                f"`forward` takes `**{kwargs}` but ignores `num_items_in_batch` while returning a mean "
                "loss: the Trainer passes the count and skips its own division, so the loss is "
                "K times too large"
            )
        facts = (passed, f"loss: {origin.description}")
        yield Site(forward.name, message, facts, "forward", forward, cls, scaled=kwargs is not None)

    def _loss_functions(self) -> Iterator[Site]:
        """Same-file functions handed to a Trainer as `compute_loss_func` that take
        `num_items_in_batch` but return a mean without it: with such a function set, the
        Trainer skips its division by the accumulation steps."""
        seen: set[cst.FunctionDef] = set()
        for function, where in self.loss_functions():
            names, kwargs = parameters(function)
            if function in seen or (COUNT not in names and kwargs is None):
                continue  # one that cannot take the count raises TypeError on the first step
            seen.add(function)
            if self._reads(function, {COUNT, kwargs}):
                continue
            origin = self.returned_mean(function)
            if origin is None:
                continue
            message = (
                f"`{function.name.value}` is the Trainer's `compute_loss_func` and returns a mean "
                "loss without using `num_items_in_batch`: with a `compute_loss_func` set, the "
                "Trainer skips its division by the accumulation steps, so the loss is K times too "
                "large and still weighted per micro-batch"
            )
            facts = (where, f"loss: {origin.description}")
            owner = self._class_of(function)
            hint = (
                "Return the micro-batch's token-loss sum divided by num_items_in_batch, the "
                "Trainer's count of valid targets in the whole window."
            )
            yield Site(
                function.name,
                message,
                facts,
                "loss-function",
                function,
                owner,
                scaled=True,
                hint=hint,
            )

    def loss_functions(self) -> Iterator[tuple[cst.FunctionDef, str]]:
        """The same-file functions a Trainer is given as `compute_loss_func`, by
        `Trainer(..., compute_loss_func=f)` or `self.compute_loss_func = f` in a subclass, and
        where."""
        for call in self.tree.calls:
            given = self.given(call, "compute_loss_func") if self._is_trainer(call.func) else None
            function = self._function(given, None)
            if function is not None:
                where = f"trainer: `{code(call.func)}(..., compute_loss_func={code(given)})` (line {self.tree.line(call)})"
                yield function, where
        for cls in self.trainers.values():
            for node in self.tree.walk(cls.body):
                if not (isinstance(node, cst.Assign) and len(node.targets) == 1):
                    continue
                target = node.targets[0].target
                if code(target) == "self.compute_loss_func":
                    function = self._function(node.value, cls)
                    if function is not None:
                        where = f"trainer: `class {cls.name.value}` sets `{code(node)}` (line {self.tree.line(node)})"
                        yield function, where

    def _function(
        self, expr: cst.BaseExpression | None, cls: cst.ClassDef | None
    ) -> cst.FunctionDef | None:
        """The same-file function `f` or method `self.f` an expression names."""
        if isinstance(expr, cst.Name):
            function = self.tree.functions.get(expr.value)
            return function if function is not None and self._class_of(function) is None else None
        if cls is not None and isinstance(expr, cst.Attribute) and code(expr.value) == "self":
            return methods_of(cls).get(expr.attr.value)
        return None

    def _class_of(self, function: cst.FunctionDef) -> cst.ClassDef | None:
        """The class a function is a method of."""
        holder = self.tree.parents.get(self.tree.parents.get(function))
        return holder if isinstance(holder, cst.ClassDef) else None


class TrainerAudit(_LossKwargs, _Models):
    """GA004 over one file: Trainer subclasses, and models handed to a Trainer."""

    def __init__(self, tree: Tree, imports: Imports | None = None) -> None:
        self.tree = tree
        self.imports = imports  # where a base class imported from the repository is read
        self.tracer = _Tracer(tree)
        self.classes = {node.name.value: node for node in tree.classes}
        self.trainers: dict[str, cst.ClassDef] = {}
        for name, cls in self.classes.items():  # source order: a base precedes its subclasses
            if any(self._is_trainer(base.value) for base in cls.bases):
                self.trainers[name] = cls

    def sites(self) -> Iterator[Site]:
        for name, cls in self.trainers.items():
            methods = methods_of(cls)
            base = next(filter(None, (self._imported_trainer(b.value) for b in cls.bases)), None)
            via = f" through {base}" if base is not None else ""
            line = self.tree.line(cls)
            where = f"trainer: `class {name}` subclasses a transformers Trainer{via} (line {line})"
            if "compute_loss" in methods:
                yield from self._compute_loss(cls, methods["compute_loss"], where)
            if "training_step" in methods:
                yield from self._training_step(cls, methods["training_step"], where)
            elif "_training_step" in methods:  # its name before transformers 3.1
                yield from self._training_step(cls, methods["_training_step"], where)
        yield from self._models()
        yield from self._loss_functions()

    def _is_trainer(self, expr: cst.BaseExpression) -> bool:
        """A Trainer class from transformers or trl, a same-file subclass of one, or a
        `...Trainer` imported from a module of the repository that derives from one."""
        qualified = self.tree.qualified(expr) or ""
        if qualified.startswith(TRAINER_MODULES) and qualified.endswith("Trainer"):
            return True
        return dotted(expr) in self.trainers or self._imported_trainer(expr) is not None

    def _imported_trainer(self, expr: cst.BaseExpression) -> str | None:
        """`BaseTrainer` of `.base`, when `expr` names a `...Trainer` imported from a module of
        the repository that derives from a transformers or trl Trainer there."""
        found = self.imports
        named = found is not None and (self.tree.qualified(expr) or "").endswith("Trainer")
        reference = found.reference(expr) if named else None
        if reference is None or not derives_from_trainer(
            found.directory, reference.level, reference.module, reference.name, found.dependencies
        ):
            return None
        return f"`{code(expr)}` of `{reference.spelled}`"

    def _compute_loss(
        self, cls: cst.ClassDef, function: cst.FunctionDef, where: str
    ) -> Iterator[Site]:
        names, kwargs = parameters(function)
        overwritten = self._class_level_opt_out(cls)
        facts = (where,) if overwritten is None else (where, overwritten)
        withheld = self.count_withheld(cls)
        if COUNT not in names and kwargs is None and withheld is not None:
            owner, step, call = withheld[0], withheld[1], withheld[2][0]
            yield Site(
                function.name,
                f"`compute_loss` takes no `num_items_in_batch` and `{owner.name.value}."
                "training_step` calls it without one, as a Trainer before 4.46 did: since 4.46 "
                "the Trainer's accelerator divides by nothing in `backward`, so each micro-batch's "
                "mean is summed over the window, K times too large (under DeepSpeed divided by K), "
                "weighting micro-batches equally whatever their number of targets",
                (
                    *facts,
                    (
                        f"step: `{code(call)}` (line {self.tree.line(call)}) in `training_step` "
                        f"(line {self.tree.line(step)})"
                    ),
                ),
                "compute-loss",
                function,
                cls,
                hint=(
                    "Make training_step the stock one: hand compute_loss "
                    "num_items_in_batch=num_items_in_batch, divide by the accumulation steps only "
                    "where the stock step does (or remove the override); then return the token-loss "
                    "sum divided by num_items_in_batch from compute_loss."
                ),
            )
            return
        if COUNT not in names and kwargs is None:
            yield Site(
                function.name,
                "`compute_loss` does not accept `num_items_in_batch`: transformers >= 4.46 passes it "
                "on every call, which raises TypeError",
                (*facts, f"signature: `def compute_loss({code(function.params)})`"),
                "compute-loss",
                function,
                cls,
                crashes=True,
            )
            return
        if self._reads(function, {COUNT, kwargs}) or self.opts_out(cls):
            return
        dropped = self.count_dropped(function)
        if dropped is not None:
            yield Site(
                function.name,
                "`compute_loss` accepts `num_items_in_batch` but calls `super().compute_loss` "
                "without it: the model averages over its own micro-batch, and the Trainer, which "
                "passed a count, skips its division by the accumulation steps for a model that "
                "takes loss kwargs, so the loss is K times too large",
                (*facts, f"loss: `{code(dropped)}` (line {self.tree.line(dropped)})"),
                "compute-loss",
                function,
                cls,
                hint="Pass num_items_in_batch=num_items_in_batch on to super().compute_loss(...).",
            )
            return
        origin = self.returned_mean(function)
        if origin is not None:
            effect = (
                "divides by the accumulation steps itself, so each micro-batch still weighs "
                "the same whatever its count"
                if divided_by_steps(origin) is not None
                else "is K times too large and still weighted per micro-batch"
            )
            yield Site(
                function.name,
                "`compute_loss` accepts `num_items_in_batch` but never uses it while returning a mean "
                "loss: the Trainer then skips its division by the accumulation steps, and the loss "
                f"{effect}",
                (*facts, f"loss: {origin.description}"),
                "compute-loss",
                function,
                cls,
            )

    def _training_step(
        self, cls: cst.ClassDef, function: cst.FunctionDef, where: str
    ) -> Iterator[Site]:
        params = function.params
        positional_count = len(params.posonly_params) + len(params.params)
        name = function.name.value
        if (
            name == "training_step"
            and positional_count < 4
            and not isinstance(params.star_arg, cst.Param)
            and params.star_kwarg is None
        ):
            yield Site(
                function.name,
                "`training_step` takes no `num_items_in_batch`: transformers >= 4.46 passes it as a "
                "third argument, which raises TypeError",
                (where, f"signature: `def training_step({code(params)})`"),
                "training-step-signature",
                function,
                cls,
                crashes=True,
            )
        for node in self.tree.walk(function.body):
            division = division_of(node)
            if division is None:
                continue
            value, divisor = division
            if last_name(divisor) != "gradient_accumulation_steps" or detached(value):
                continue
            if self._guarded(node, function) or self.opts_out(cls):
                continue
            yield Site(
                node,
                f"`{name}` divides the loss by `{code(divisor)}`: a per-micro-batch mean divided "
                "by K weights micro-batches equally instead of by their valid tokens",
                (where, f"loss: {self.tracer.origin(value).description}"),
                "training-step-division",
                function,
                cls,
            )

    def _guarded(self, node: cst.CSTNode, function: cst.FunctionDef) -> bool:
        """Inside an `if` on `num_items_in_batch` / `model_accepts_loss_kwargs` (the Trainer's fallback)."""
        for parent in self.tree.ancestors(node):
            if parent is function:
                return False
            if isinstance(parent, (cst.If, cst.IfExp)) and any(
                last_name(n) in FALLBACK_GUARDS for n in self.tree.walk(parent.test)
            ):
                return isinstance(parent, cst.If) or self.tree.contains(parent.body, node)
        return False


def divided_by_steps(origin: Origin | None) -> Division | None:
    """Where a returned mean is divided by `gradient_accumulation_steps` on its way out (`loss
    / self.args.gradient_accumulation_steps`, as the Trainer did before 4.46), if it is."""
    divisions = origin.divisions if origin is not None else ()
    steps = (d for d in divisions if last_name(d.divisor) == "gradient_accumulation_steps")
    return next(steps, None)


def class_attribute(statement: cst.CSTNode, name: str) -> str | None:
    """The value's code of a class-body statement `name = value`, else None."""
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign) and any(
                isinstance(t.target, cst.Name) and t.target.value == name for t in small.targets
            ):
                return code(small.value)
    return None


def is_super_init(node: cst.CSTNode) -> bool:
    """`super().__init__(...)`."""
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "__init__"
        and is_super(node.func.value)
    )


def parameters(function: cst.FunctionDef) -> tuple[set[str], str | None]:
    """Named parameters, and the name of `**kwargs` if any."""
    params = function.params
    names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    kwargs = params.star_kwarg.name.value if isinstance(params.star_kwarg, cst.Param) else None
    return names, kwargs


def loss_parts(expr: cst.BaseExpression) -> Iterator[cst.BaseExpression]:
    """`(loss, outputs) if flag else loss`, `loss, logits`, `{"loss": loss}`, `Output(loss=loss)`."""
    if isinstance(expr, cst.IfExp):
        yield from loss_parts(expr.body)
        yield from loss_parts(expr.orelse)
    elif isinstance(expr, (cst.Tuple, cst.List)) and expr.elements:
        yield from loss_parts(expr.elements[0].value)
    elif isinstance(expr, cst.Dict):
        for element in expr.elements:
            if isinstance(element, cst.DictElement) and string_value(element.key) == "loss":
                yield element.value
    elif isinstance(expr, cst.Call) and keyword(expr, "loss") is not None:
        yield keyword(expr, "loss")
    else:
        yield expr


def division_of(node: cst.CSTNode) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(value, divisor) of `a / b` or `a /= b`."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide):
        return node.left, node.right
    if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
        return node.target, node.value
    return None


def hands_count(call: cst.Call) -> bool:
    """A `compute_loss(...)` call that passes `num_items_in_batch` (by name, fourth, or `**`)."""
    return (
        keyword(call, COUNT) is not None
        or len(positional(call)) >= 4
        or any(a.star == "**" for a in call.args)
    )


def is_super(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Call) and dotted(expr.func) == "super"


def detached(value: cst.BaseExpression) -> bool:
    """`loss.detach() / k` or `loss.item() / k`: a value for logging, not for backward."""
    return (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value in ("detach", "item")
    )


def findings(context) -> list[Finding]:
    """GA004 for one file."""
    tree = context.tree
    if not any(
        q.split(".")[0] in ("transformers", "trl") or q.endswith("Trainer")
        for q in tree.imports.values()
    ):
        return []
    hint = catalogue.load()[CODE].hint
    found = []
    audit = TrainerAudit(tree, context.imports)
    domains = Domains(tree, audit.tracer, context.evidence, context.text)
    for site in audit.sites():
        if site.kind == "library-head":
            found.extend(_library_head(context, site, domains))
            continue
        returned = audit.returned_mean(site.function) if site.kind in OWN_LOSS else None
        if returned is not None:
            domain = domains.of(returned, returned=True)
        elif site.kind in OWN_LOSS and audit.count_dropped(site.function) is None:
            domain = Domain("unknown", None, "the loss it returns is not a mean gaaudit can see")
        else:  # the model's loss: through the Trainer, or `super().compute_loss` without the count
            domain = domains.model_loss(returned=True)
        confidence, why = domain.confidence()
        if site.crashes:
            why = (
                "before transformers 4.46 the Trainer divides this loss by K instead of raising; "
                + why
            )
        elif site.scaled and confidence < Confidence.MEDIUM:
            confidence, why = (
                Confidence.MEDIUM,
                f"the loss is K times too large whatever the counts; {why}",
            )
        found.append(
            Finding(
                path=context.path,
                code=CODE,
                message=site.message,
                span=tree.span(site.node),
                confidence=confidence,
                evidence=(*site.facts, f"confidence {confidence}: {why}"),
                hint=site.hint or hint,
                fixable=True,
            )
        )
    return found


def model_name(given: cst.BaseExpression | None) -> cst.Name | None:
    """The name a Trainer's model expression reads: `model`, `model.to(device)`."""
    while (
        isinstance(given, cst.Call)
        and isinstance(given.func, cst.Attribute)
        and given.func.attr.value in MOVES
    ):
        given = given.func.value
    return given if isinstance(given, cst.Name) else None


def head_kind(name: str) -> str:
    """The harness's stand-in for a head of `TOKEN_HEADS` or `EXAMPLE_HEADS`
    (`harness.models.head`): "tag" for a token classifier, "mlm" for a masked LM, "seq2seq"
    for an encoder-decoder, "classify" for one label per example."""
    if name.endswith("ForTokenClassification"):
        return "tag"
    if EXAMPLE_HEADS.fullmatch(name):
        return "classify"
    return "mlm" if name.endswith("ForMaskedLM") else "seq2seq"


def _library_head(context, site: Site, domains: Domains) -> list[Finding]:
    """A library head's finding, where the file accumulates (`gradient_accumulation_steps`
    above 1, or set at run time: K may be 1). A head of `TOKEN_HEADS` is at least medium (the
    counts of its targets vary: padding, ignored sub-words, random masking) and at most medium
    for an `Auto` class whose checkpoint may count; one of `EXAMPLE_HEADS` is medium where the
    project's transformers requirement admits 5.x (none: the newest releases), else exact."""
    from gaaudit.checks.versions import accumulation_in, admits
    from gaaudit.discover.modules import Dependency, file_digest

    accumulations = accumulation_in(context.text)
    if not accumulations:
        return []
    line, where, _, run_time = min(accumulations, key=lambda a: (a[3], a[0]))
    facts = [*site.facts, f"accumulation: {where} (line {line})"]
    if head_kind(site.head) == "classify":
        later, pin, read = admits(context.directory / Path(context.path).name, FIVE)
        context.imports.dependencies.update(Dependency(str(p), file_digest(p)) for p in read)
        if not later:
            return []
        facts.append(
            f"transformers: {pin} admits {FIVE} and later"
            if pin
            else "transformers: no requirement names it, so the newest releases (5.x) are assumed"
        )
        confidence = Confidence.MEDIUM
        why = "K times too large whatever the counts under transformers 5; exact under 4.x"
    else:
        confidence, why = domains.model_loss(returned=True).confidence()
        if confidence < Confidence.MEDIUM:
            confidence, why = Confidence.MEDIUM, f"the head's targets vary per micro-batch; {why}"
    capped = (
        "K may be 1"
        if run_time
        else "the checkpoint's architecture decides"
        if any(f.startswith("architecture:") for f in site.facts)
        else ""
    )
    if capped and confidence > Confidence.MEDIUM:
        confidence, why = Confidence.MEDIUM, f"{why}; {capped}"
    return [
        Finding(
            path=context.path,
            code=CODE,
            message=site.message,
            span=context.tree.span(site.node),
            confidence=confidence,
            evidence=(*facts, f"confidence {confidence}: {why}"),
            hint=site.hint,
            fixable=True,
        )
    ]
