"""GA004 rewrites: make a Trainer override use `num_items_in_batch`, or opt out of it.

transformers >= 4.46 counts the valid labels of the whole accumulation window
(`num_items_in_batch`) and, when the model accepts loss kwargs, expects the loss to be the
micro-batch's token sum divided by that count; it then skips its own division by K. Each
finding gets one of these, the first that applies (GA-GUIDE sections 2, 4 and 7):

- a token sum: an explicit `F.cross_entropy` / `nn.CrossEntropyLoss` loss on the labels
  becomes `reduction="sum"` divided by `num_items_in_batch` (the mean as before without it);
- a hand-over: `model(**inputs)` whose `.loss` is returned gets the count, as the stock
  `compute_loss` passes it;
- an opt-out where the loss cannot be a sum: `self.model_accepts_loss_kwargs = False` after
  `super().__init__()` (a class attribute would be overwritten by `Trainer.__init__`), or
  `accepts_loss_kwargs = False` on a model class; the Trainer then divides the mean by K;
- in `training_step`: the count is accepted and handed to `compute_loss`, and a division by
  `gradient_accumulation_steps` of that window-normalised loss (a double division) is removed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import libcst as cst

from gaaudit.analysis.domain import shifts_labels
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
from gaaudit.checks.trainer import (
    COUNT,
    MODEL_OPT_OUT,
    OPT_OUT,
    Site,
    TrainerAudit,
    class_attribute,
    detached,
    divided_by_steps,
    division_of,
    hands_count,
    head_kind,
    is_super,
    is_super_init,
    loss_parts,
    model_name,
    parameters,
)
from gaaudit.checks.versions import SHIFTED_COUNT
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.edits import (
    Edits,
    Unfixable,
    atom,
    copy_edits,
    statement_line,
    torch_module,
    with_argument,
    with_parameter,
)

# The `compute_loss_func` a stock head's Trainer gets (`_library_head`): the heads' loss is a
# cross-entropy over the labels that are not -100, with nothing shifted.
LIBRARY_LOSS = """\
# sum and count: each micro-batch's token-loss sum over the Trainer's count of the window's labels
def {name}(outputs, labels, num_items_in_batch=None):
    logits = outputs["logits"]
    total = {torch}.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    if num_items_in_batch is None:  # evaluation: the batch's own count
        num_items_in_batch = (labels != -100).sum()
    return total / num_items_in_batch
"""
# The stock `compute_loss`'s factor for a count gathered over every process.
ACROSS, PROCESSES = "self.args.average_tokens_across_devices", "self.accelerator.num_processes"
# When the stock `training_step` divides the loss by the accumulation steps (4.46 and later).
STOCK_DIVIDES = f"({COUNT} is None or not self.{OPT_OUT}) and self.compute_loss_func is None"
# What the stock `training_step` hands `accelerator.backward` under DeepSpeed (4.49 and later):
# the engine would otherwise divide the loss by its accumulation steps once more.
DEEPSPEED_ONCE = '{"scale_wrt_gas": False}'
TOKEN_LOSSES = {"cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss"}
SHAPERS = {"view", "reshape", "flatten", "contiguous", "long"}  # keep which targets count
MEAN_OVER_K = (
    "the Trainer then divides each micro-batch's mean by the accumulation steps, exact only when "
    "every micro-batch holds the same number of valid targets"
)


@dataclass(frozen=True)
class Choice:
    """The rewrite a finding got, and why it is unsafe ("" when it is safe)."""

    what: str
    caveat: str = ""


@dataclass(frozen=True)
class TokenLoss:
    """An explicit token loss that can become a sum: the call, its configuration, its targets."""

    call: cst.Call
    configured: cst.Call  # the call itself, or the `nn.CrossEntropyLoss(...)` it was bound to
    targets: cst.BaseExpression
    caveat: str  # why it may not match the Trainer's count; "" when it does


class _ComputeLoss:
    """Part of `TrainerPlanner`: `compute_loss` and `compute_loss_func` rewrites: the token loss
    summed over the Trainer's count, or the count handed to the model."""

    # --- compute_loss -------------------------------------------------------------------------

    def _compute_loss(self, site: Site) -> Choice:
        step = self._hand_count_in_step(site.owner)
        choice = self._compute_loss_rewrite(site)
        return replace(choice, what=f"{choice.what}; {step}") if step else choice

    def _compute_loss_rewrite(self, site: Site) -> Choice:
        function = site.function
        divided = divided_by_steps(self.audit.returned_mean(function))
        if divided is not None:  # every rewrite below would leave that division standing
            raise Unfixable(
                f"`compute_loss` divides its loss by `{code(divided.divisor)}` (line "
                f"{self.tree.line(divided.node)}): a token sum over the Trainer's count would "
                "still be divided by it, and a Trainer told to divide would divide again; remove "
                f"that division, then return the loss's token sum divided by `{COUNT}`"
            )
        self._accept(function)
        dropped = self.audit.count_dropped(function)
        if dropped is not None:
            self._under_pin("`Trainer.compute_loss` takes no `num_items_in_batch`")
            self._add_argument(dropped, COUNT, keyword_name=COUNT)
            return Choice("`compute_loss` passes `num_items_in_batch` on to `super().compute_loss`")
        returned = self._returned(function)
        loss = self._token_loss(returned, function, labels="inputs")
        if isinstance(loss, TokenLoss):
            self._sum(loss, processes=True)
            return Choice(
                f"`compute_loss` sums its `{_name(loss.configured)}` and divides by "
                "`num_items_in_batch`, or by its own count when the Trainer passes none",
                loss.caveat,
            )
        spread = self._model_spread(returned, function)
        # A model whose `forward` cannot take the count would raise a TypeError if handed it.
        if spread is not None and not self._forward_refuses_count():
            statement, inputs = spread
            self.edits.insert_before(
                statement,
                f'if {COUNT} is not None:\n    {inputs} = {{**{inputs}, "{COUNT}": {COUNT}}}\n',
            )
            return Choice(
                "`compute_loss` hands `num_items_in_batch` to the model, as the stock one does"
            )
        self._opt_out(site.owner)
        return Choice(
            f"the loss cannot be made a token sum ({loss}): `self.{OPT_OUT} = False` is set after "
            "`super().__init__()`",
            MEAN_OVER_K,
        )

    def _hand_count_in_step(self, owner: cst.ClassDef) -> str:
        """Where the class's own `training_step` withholds the count (`count_withheld`), make it
        the stock step of 4.46 and later, and say so ("" where nothing is done): the count
        handed to `compute_loss`, the loss divided by the accumulation steps only where the
        stock step divides (`STOCK_DIVIDES`), DeepSpeed told not to divide again, as the stock
        step tells it, and the logged loss no longer divided a second time. Otherwise no
        rewrite of `compute_loss` would reach the backward: a sum over the count falls back to
        the micro-batch's own (the mean), and the opt-out is read by the stock step only; the
        Trainer's accelerator has no accumulation plugin since 4.46, so its `backward` divides
        by nothing (DeepSpeed's by its accumulation steps)."""
        withheld = self.audit.count_withheld(owner)
        if withheld is None:
            return ""
        cls, step, calls = withheld
        return self._stock_step(
            step, calls, f"`{cls.name.value}.training_step` (line {self.tree.line(step)})"
        )

    def _stock_step(self, step: cst.FunctionDef, calls: list[cst.Call], where: str) -> str:
        """`_hand_count_in_step`'s edits of `step`, or Unfixable saying what stands in the way."""
        self._under_pin("Trainer has no `compute_loss_func` or `model_accepts_loss_kwargs` to test")
        advice = (
            f"hand it `{COUNT}={COUNT}` and divide by the accumulation steps only when no count "
            "is given, as the stock `training_step` does, or remove the override"
        )
        bound = self.tree.parents.get(calls[0])
        if len(calls) > 1 or not (
            isinstance(bound, cst.Assign)
            and len(bound.targets) == 1
            and isinstance(bound.targets[0].target, cst.Name)
        ):
            raise Unfixable(
                f"{where} does not bind one `self.compute_loss(...)` to a name, so gaaudit cannot "
                f"follow its loss to the backward: {advice}"
            )
        loss = bound.targets[0].target.value
        backwards = [
            n
            for n in self.tree.walk(step.body)
            if isinstance(n, cst.Call) and dotted(n.func) == "self.accelerator.backward"
        ]
        if len(backwards) != 1 or dotted(next(iter(positional(backwards[0])), None)) != loss:
            raise Unfixable(
                f"{where} does not backpropagate `{loss}` through one "
                f"`self.accelerator.backward({loss})`, as the stock step does: {advice}"
            )
        (backward,) = backwards
        self._accept(step)
        self._add_argument(calls[0], COUNT, keyword_name=COUNT)
        self.edits.insert_before(
            statement_line(self.tree, backward),
            f"if {STOCK_DIVIDES}:\n    {loss} = {loss} / self.args.gradient_accumulation_steps\n",
        )
        self._deepspeed_once(step, backward)
        for node in self.tree.walk(step.body):
            parts = division_of(node.value) if isinstance(node, cst.Return) and node.value else None
            if (
                parts is not None
                and detached(parts[0])
                and dotted(parts[0].func.value) == loss
                and last_name(parts[1]) == "gradient_accumulation_steps"
            ):
                self.edits.replace[node.value] = parts[0]
        return (
            f"{where} hands `compute_loss` the count and divides by the accumulation steps only "
            "where the stock step does"
        )

    def _loss_function(self, site: Site) -> Choice:
        """A `compute_loss_func` returning a token mean: summed over the Trainer's count."""
        function = site.function
        loss = self._token_loss(self._returned(function), function, labels="labels")
        if not isinstance(loss, TokenLoss):
            raise Unfixable(f"the loss cannot be made a token sum: {loss}")
        self._accept(function)
        self._sum(loss)
        return Choice(
            f"`{function.name.value}` sums its `{_name(loss.configured)}` and divides by "
            "`num_items_in_batch`, or by its own count when the Trainer passes none",
            loss.caveat,
        )

    def _forward_refuses_count(self) -> bool:
        """Whether this file defines model classes and none of their `forward`s can take
        `num_items_in_batch` (the model is then most likely one of them)."""
        forwards = [
            method
            for cls in self.tree.classes
            for method in cls.body.body
            if isinstance(method, cst.FunctionDef) and method.name.value == "forward"
        ]
        return bool(forwards) and not any(
            isinstance(f.params.star_kwarg, cst.Param)
            or any(p.name.value == COUNT for p in (*f.params.params, *f.params.kwonly_params))
            for f in forwards
        )

    def _returned(self, function: cst.FunctionDef) -> cst.CSTNode | None:
        """The one expression every returned loss resolves to, through plain name bindings."""
        found = None
        for value in self.audit.tracer.returns(function):
            for part in loss_parts(value):
                resolved = self._resolve(part)
                if found is not None and resolved is not found:
                    return None
                found = resolved
        return found

    def _resolve(self, expr: cst.BaseExpression, hops: int = 8) -> cst.BaseExpression:
        """`loss` -> the value of its `loss = value` binding, repeatedly."""
        while hops and isinstance(expr, cst.Name):
            hops -= 1
            stmt = self.audit.tracer.binding(expr.value, expr)
            if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
                break
            if not isinstance(stmt.targets[0].target, cst.Name):
                break
            expr = stmt.value
        return expr

    def _sum(self, loss: TokenLoss, processes: bool = False) -> None:
        """`loss_fn(x, y)` -> `loss_fn(x, y) / (n if n is not None else (y != -100).sum())`, the
        loss summed; the count is the Trainer's when it passes one. `processes`: the loss
        replaces the stock `compute_loss`, which multiplies by the process count when the
        Trainer's count covers every process (`average_tokens_across_devices`), as DDP then
        averages the gradients."""
        ignore = keyword(loss.configured, "ignore_index")
        fallback = (
            f"({atom(loss.targets)} != {code(ignore) if ignore is not None else '-100'}).sum()"
        )
        summed = with_argument(loss.configured, "reduction", '"sum"')
        if loss.configured is loss.call:
            call = summed
        else:
            self.edits.replace[loss.configured] = summed
            call = loss.call
        statement = statement_line(self.tree, loss.call)
        assign = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if (
            isinstance(assign, cst.Assign)
            and assign.value is loss.call
            and len(assign.targets) == 1
        ):
            name = code(assign.targets[0].target)  # `loss = f(...)`: count and divide below it
            if call is not loss.call:
                self.edits.replace[loss.call] = call
            scaled = f"elif {ACROSS}:\n    {name} = {name} * {PROCESSES}\n" if processes else ""
            self.edits.insert_after(
                statement,
                f"if {COUNT} is None:\n    {COUNT} = {fallback}\n{scaled}{name} = {name} / {COUNT}\n",
            )
            return
        left = call.with_changes(lpar=(), rpar=())
        if processes:
            factor = f"({PROCESSES} if {COUNT} is not None and {ACROSS} else 1)"
            left = cst.parse_expression(f"{code(left)} * {factor}")
        divided = cst.BinaryOperation(
            left=left,
            operator=cst.Divide(),
            right=cst.parse_expression(f"({COUNT} if {COUNT} is not None else {fallback})"),
        )
        parent = self.tree.parents.get(loss.call)
        if not isinstance(parent, (cst.Assign, cst.Return, cst.Arg, cst.Element, cst.DictElement)):
            divided = divided.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self.edits.replace[loss.call] = divided

    def _model_spread(
        self, returned: cst.CSTNode | None, function: cst.FunctionDef
    ) -> tuple[cst.CSTNode, str] | None:
        """(the statement, `inputs`) for a returned `model(**inputs).loss` (or `["loss"]`, `[0]`)."""
        if isinstance(returned, cst.Attribute) and returned.attr.value == "loss":
            outputs = returned.value
        elif isinstance(returned, cst.Subscript) and len(returned.slice) == 1:
            key = returned.slice[0].slice
            index = key.value if isinstance(key, cst.Index) else None
            if string_value(index) != "loss" and not (
                isinstance(index, cst.Integer) and index.value == "0"
            ):
                return None
            outputs = returned.value
        else:
            return None
        call = self._resolve(outputs)
        names = parameters_in_order(function)
        if not (isinstance(call, cst.Call) and len(names) > 1 and dotted(call.func) == names[1]):
            return None
        spread = [a.value for a in call.args if a.star == "**"]
        if (
            len(spread) != 1
            or not isinstance(spread[0], cst.Name)
            or keyword(call, COUNT) is not None
        ):
            return None
        return statement_line(self.tree, call), spread[0].value


class _TokenLosses:
    """Part of `TrainerPlanner`: whether a loss is a token loss gaaudit can sum, on the labels the
    Trainer counts."""

    def _token_loss(
        self, expr: cst.CSTNode | None, function: cst.FunctionDef, labels: str
    ) -> TokenLoss | str:
        """The token loss `expr` is, or why it is not one gaaudit can sum. `labels` says
        where `function` takes the labels the Trainer counts: from its `inputs` (a
        `compute_loss`), as its second parameter (a `compute_loss_func`), or as its `labels`
        parameter (a custom model's `forward`, whose count the Trainer does not shift)."""
        if not isinstance(expr, cst.Call):
            return "it is not one explicit token loss" if expr is not None else "its returns differ"
        configured = self._configured(expr, function)
        if configured is None:
            return f"`{code(expr.func)}` is not a cross-entropy or NLL loss made here"
        reduction = string_value(keyword(configured, "reduction"))
        if keyword(configured, "weight") is not None or (
            configured is expr and len(positional(expr)) > 2
        ):
            return "it weights its classes, so its mean divides by the summed weights, not a count"
        if keyword(configured, "reduction") is not None and reduction != "mean":
            return "its reduction is not a plain mean"
        args = positional(expr)
        targets = keyword(expr, "target") or (args[1] if len(args) > 1 else None)
        if targets is None or not _pure(targets):
            return "its targets are not a plain tensor expression"
        ignore = keyword(configured, "ignore_index")
        caveat = ""
        if ignore is not None and code(ignore) != "-100":
            caveat = f"the Trainer counts labels != -100 but this loss ignores `{code(ignore)}`"
        root, shifted = self._labels(targets, function, labels)
        if not caveat and not root:
            caveat = "its targets do not visibly come from the batch's `labels`, which the Trainer counts"
        elif not caveat and labels != "forward" and self.every_label and shifted:
            caveat = (
                f"the Trainer of {self.every_label} counts every label, but this loss shifts them"
            )
        elif (
            not caveat
            and labels != "forward"
            and not self.every_label
            and shifted != self._causal()
        ):
            caveat = (
                "cannot tell whether the Trainer counts the same positions (`labels[..., 1:]` for a "
                f"causal LM from transformers {SHIFTED_COUNT} on, `labels` otherwise)"
            )
        elif not caveat and labels == "forward" and shifted:
            caveat = "the Trainer counts every label of a custom model, but this loss shifts them"
        return TokenLoss(expr, configured, targets, caveat)

    def _configured(self, call: cst.Call, function: cst.FunctionDef) -> cst.Call | None:
        """The call itself for `F.cross_entropy(...)`; the constructor for a local loss instance."""
        qualified = self.tree.qualified(call.func) or ""
        if qualified.startswith("torch.") and qualified.rsplit(".", 1)[-1] in TOKEN_LOSSES:
            return call
        if not isinstance(call.func, cst.Name):
            return None
        stmt = self.audit.tracer.binding(call.func.value, call)
        if not (isinstance(stmt, cst.Assign) and isinstance(stmt.value, cst.Call)):
            return None
        if self.tree.scope_of(stmt) is not function:
            return None
        constructor = stmt.value
        qualified = self.tree.qualified(constructor.func) or ""
        if not (qualified.startswith("torch.") and qualified.rsplit(".", 1)[-1] in TOKEN_LOSSES):
            return None
        uses = [
            n
            for n in self.tree.walk(function.body)
            if isinstance(n, cst.Name) and n.value == call.func.value
        ]
        return constructor if len(uses) == 2 else None  # bound once, called once

    def _labels(
        self, targets: cst.BaseExpression, function: cst.FunctionDef, labels: str
    ) -> tuple[bool, bool]:
        """Whether the targets are the labels the Trainer counts (`_token_loss`), and whether
        they were shifted (`[:, 1:]`)."""
        names = parameters_in_order(function)
        in_inputs = labels == "inputs"
        own = names[1:] if names[:1] == ["self"] else names
        parameter = "labels" if labels == "forward" else next(iter(own[1:2]), None)
        shifted, expr = False, targets
        for _ in range(12):
            if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
                expr = expr.func.value
            elif isinstance(expr, cst.Subscript):
                shifted = shifted or _drops_first(expr)
                expr = expr.value
            elif isinstance(expr, cst.Name):
                stmt = self.audit.tracer.binding(expr.value, expr)
                if isinstance(stmt, cst.Param):
                    return (not in_inputs and expr.value == parameter), shifted
                if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
                    return False, shifted
                if in_inputs and _reads_labels(stmt.value, names[2:3]):
                    return True, shifted
                expr = stmt.value
            else:
                return in_inputs and _reads_labels(expr, names[2:3]), shifted
        return False, shifted

    def _causal(self) -> bool:
        return bool(shifts_labels(self.text))


class _Signatures:
    """Part of `TrainerPlanner`: opting out, `training_step`, and signatures that accept
    `num_items_in_batch` and pass it on."""

    def _opt_out(self, owner: cst.ClassDef) -> None:
        """`self.model_accepts_loss_kwargs = False` after `super().__init__()`, in a new
        `__init__` if the class has none; a class attribute of that name is removed."""
        for statement in owner.body.body:
            if class_attribute(statement, OPT_OUT) is not None and len(statement.body) == 1:
                self.edits.replace[statement] = cst.RemovalSentinel.REMOVE
        line = f"self.{OPT_OUT} = False  # the loss is a per-micro-batch mean\n"
        init = methods_of(owner).get("__init__")
        if init is None:
            body = list(owner.body.body)
            first = next((i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef)), None)
            if first is None:
                raise Unfixable("the Trainer class defines no method to place `__init__` before")
            source = (
                "def __init__(self, *args, **kwargs):\n    super().__init__(*args, **kwargs)\n    "
                + line
            )
            (new,) = cst.parse_module(source).body
            if first == 0:  # a blank line closes it, before the method that was first
                footer = [cst.EmptyLine(indent=False)]
                self.edits.before.setdefault(body[0], []).append(
                    new.with_changes(body=new.body.with_changes(footer=footer))
                )
            else:  # after what precedes the first method, which keeps its blank line above
                blank = cst.EmptyLine(indent=False)
                self.edits.after.setdefault(body[first - 1], []).append(
                    new.with_changes(leading_lines=[blank])
                )
            return
        call = next((c for c in self.tree.walk(init.body) if is_super_init(c)), None)
        if call is None:
            raise Unfixable(
                "`__init__` does not call `super().__init__()`; set the opt-out after it"
            )
        self.edits.insert_after(statement_line(self.tree, call), line)

    # --- training_step ------------------------------------------------------------------------

    def _training_step_division(self, site: Site) -> Choice:
        function = site.function
        if function.name.value != "training_step":
            raise Unfixable(
                f"`{function.name.value}` is the hook of a transformers before 3.1, whose Trainer "
                "has no count of the window's tokens to hand it: require a transformers >= 4.46 "
                "and override `training_step` or `compute_loss` instead"
            )
        division = site.node
        value = division.left if isinstance(division, cst.BinaryOperation) else division.target
        call = self.audit.compute_loss_call(value)
        if call is None:
            raise Unfixable(
                "the divided loss does not come from `self.compute_loss(...)` in this method; gaaudit "
                "cannot hand it the window's token count"
            )
        self._under_pin("Trainer has no `compute_loss_func` or `model_accepts_loss_kwargs` to test")
        self._accept(function)
        if not hands_count(call):
            self._add_argument(call, COUNT, keyword_name=COUNT)
        self._guard(division)
        what = (
            "`compute_loss` gets `num_items_in_batch`, so its loss is already normalised over the "
            "window; the division by the accumulation steps is kept only where the stock Trainer "
            "divides (no count, a model without loss kwargs, no `compute_loss_func`)"
        )
        caveat = self._override_ignores_count(site.owner)
        backward = self._backward_of(function, division)
        if "scale_wrt_gas" in code(function):  # the step tells DeepSpeed itself
            return Choice(what, caveat)
        if backward is None:
            return Choice(
                what,
                caveat
                or "the guarded loss reaches no `self.accelerator.backward(...)` gaaudit can "
                "follow, so under DeepSpeed the engine divides it by the accumulation steps again: "
                f"hand that backward `**({DEEPSPEED_ONCE} if self.is_deepspeed_enabled else {{}})`",
            )
        self._deepspeed_once(function, backward)
        return Choice(f"{what}, and DeepSpeed is told not to divide it again", caveat)

    def _backward_of(self, step: cst.FunctionDef, division: cst.CSTNode) -> cst.Call | None:
        """The `self.accelerator.backward(...)` of `step` that backpropagates `division`'s
        loss: the name it binds (`loss = loss / k`, `loss /= k`) or the division itself."""
        small = self.tree.parents.get(division)
        if isinstance(division, cst.AugAssign):
            bound = division.target
        elif isinstance(small, cst.Assign) and len(small.targets) == 1:
            bound = small.targets[0].target
        else:
            bound = None
        for node in self.tree.walk(step.body):
            if isinstance(node, cst.Call) and dotted(node.func) == "self.accelerator.backward":
                first = next(iter(positional(node)), None)
                if first is division or (
                    isinstance(bound, cst.Name) and dotted(first) == bound.value
                ):
                    return node
        return None

    def _deepspeed_once(self, step: cst.FunctionDef, backward: cst.Call) -> None:
        """`backward`, `step`'s `self.accelerator.backward(...)` of a loss divided by the
        accumulation steps only where the stock step divides, tells DeepSpeed not to divide it
        again (`DEEPSPEED_ONCE`), as the stock step of 4.49 and later does; the flag reaches the
        engine through accelerate (0.26 on, which 4.46 requires) whatever the Trainer's version.
        A step that sets `scale_wrt_gas` itself is left as it is."""
        if "scale_wrt_gas" in code(step):
            return
        current = self.edits.replace.get(backward, backward)
        self.edits.replace[backward] = with_argument(
            current, None, f"({DEEPSPEED_ONCE} if self.is_deepspeed_enabled else {{}})", "**"
        )

    def _override_ignores_count(self, owner: cst.ClassDef) -> str:
        for cls in self.audit.lineage(owner):
            override = methods_of(cls).get("compute_loss")
            if override is not None:
                _, kwargs = parameters(override)
                read = {n.value for n in self.tree.walk(override.body) if isinstance(n, cst.Name)}
                if read & {COUNT, kwargs}:
                    return ""
                return f"`{cls.name.value}.compute_loss` does not use `num_items_in_batch`"
        return ""

    def _guard(self, division: cst.CSTNode) -> None:
        """`loss = loss / k` (or `loss /= k`) under the stock Trainer's condition for dividing;
        `f(loss / k)` -> `f(loss / k if <condition> else loss)`, and so `x = loss / k`."""
        statement = statement_line(self.tree, division)
        if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) > 1:
            raise Unfixable("the division shares its line with other statements; split the line")
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        whole = isinstance(division, cst.AugAssign) or (  # `loss = loss / k`, not `x = loss / k`
            isinstance(small, cst.Assign)
            and small.value is division
            and len(small.targets) == 1
            and code(small.targets[0].target) == code(division.left)
        )
        if whole:
            self.edits.replace[statement] = cst.If(
                test=cst.parse_expression(STOCK_DIVIDES),
                body=cst.IndentedBlock([statement.with_changes(leading_lines=())]),
                leading_lines=statement.leading_lines,
            )
            return
        kept = cst.parse_expression(
            f"{code(division)} if {STOCK_DIVIDES} else {code(division.left)}"
        )
        if not isinstance(self.tree.parents.get(division), (cst.Arg, cst.Assign, cst.Return)):
            kept = kept.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        call = self.tree.parents.get(self.tree.parents.get(division))
        if isinstance(call, cst.Call):  # `backward(loss / k)`: the call is rewritten whole
            self.edits.replace[call] = self.edits.replace.get(call, call).deep_replace(
                division, kept
            )
        else:
            self.edits.replace[division] = kept

    # --- a model's forward ----------------------------------------------------------------------

    def _forward(self, site: Site) -> Choice:
        forward, model = site.function, site.owner
        returned = self._returned(forward)
        loss = self._token_loss(returned, forward, labels="forward")
        _, kwargs = parameters(forward)
        if isinstance(loss, TokenLoss):
            self._accept(forward, var_keyword=True)
            self._sum(loss)
            return Choice(
                f"`forward` takes the Trainer's loss kwargs, sums its `{_name(loss.configured)}` and "
                "divides by `num_items_in_batch`",
                loss.caveat,
            )
        if kwargs is None:
            raise Unfixable(
                f"the model's loss cannot be made a token sum ({loss}); without `**kwargs` the Trainer "
                "already divides its mean by the accumulation steps"
            )
        first = model.body.body[0]
        line = f"{MODEL_OPT_OUT} = False  # forward returns a per-batch mean loss\n"
        if _is_docstring(first):
            self.edits.insert_after(first, line)
        else:
            self.edits.insert_before(first, line)
        return Choice(
            f"the loss cannot be made a token sum ({loss}): `{MODEL_OPT_OUT} = False` is set on "
            f"`{model.name.value}`",
            MEAN_OVER_K,
        )

    # --- shared edits ---------------------------------------------------------------------------

    def _under_pin(self, lacks: str) -> None:
        """Refuse a rewrite that needs the Trainer of transformers 4.46 or later where the
        project pins an older one, which `lacks` what it calls: it would fail there."""
        if self.pinned:
            raise Unfixable(
                f"the project pins {self.pinned}, whose {lacks}: require "
                "transformers>=4.46.2 first (GA006), then fix again"
            )

    def _accept(self, function: cst.FunctionDef, var_keyword: bool = False) -> None:
        """Give `function` a `num_items_in_batch=None` parameter (and `**kwargs` when asked)."""
        names, kwargs = parameters(function)
        current = self.edits.replace.get(function.params, function.params)
        if COUNT not in names and COUNT not in {p.name.value for p in _all_params(current)}:
            current = with_parameter(current, COUNT, "None")
        if var_keyword and kwargs is None and current.star_kwarg is None:
            current = current.with_changes(star_kwarg=cst.Param(cst.Name("kwargs"), star="**"))
        if current is not function.params:
            self.edits.replace[function.params] = current

    def _add_argument(self, call: cst.Call, value: str, keyword_name: str | None) -> None:
        current = self.edits.replace.get(call, call)
        self.edits.replace[call] = with_argument(current, keyword_name, value)

    def _super_calls(self, function: cst.FunctionDef, method: str) -> list[cst.Call]:
        return [
            n
            for n in self.tree.walk(function.body)
            if isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == method
            and is_super(n.func.value)
        ]


class TrainerPlanner(_ComputeLoss, _TokenLosses, _Signatures):
    """Turns the GA004 sites of one file into edits (see `edits.Edits`)."""

    def __init__(
        self,
        tree: Tree,
        audit: TrainerAudit,
        unsafe: bool = False,
        pinned: str = "",
        every_label: str = "",
    ) -> None:
        self.tree, self.audit, self.unsafe = tree, audit, unsafe
        self.pinned = pinned  # the project's transformers pin before 4.46, if any (GA006)
        # the project's pin before `SHIFTED_COUNT`, whose Trainer counts every label, if any
        self.every_label = every_label
        self.text = tree.module.code
        self.edits = Edits()

    def plan(self, sites: list[Site]) -> list[Outcome]:
        outcomes = []
        for site in sites:
            saved = copy_edits(self.edits)
            line, column = self.tree.span(site.node).line, self.tree.span(site.node).column
            try:
                choice = self._fix(site)
                if choice.caveat and not self.unsafe:
                    raise Unfixable(
                        f"unsafe fix ({choice.what}; {choice.caveat}); apply with --unsafe-fixes"
                    )
                outcomes.append(Outcome(site, line, column, True, choice.what))
            except (Unfixable, cst.ParserSyntaxError) as exc:
                self.edits = saved
                reason = (
                    str(exc)
                    if isinstance(exc, Unfixable)
                    else "gaaudit could not build a valid rewrite"
                )
                outcomes.append(Outcome(site, line, column, False, reason))
        return outcomes

    def _fix(self, site: Site) -> Choice:
        """Plan one site."""
        if site.kind == "compute-loss":
            return self._compute_loss(site)
        if site.kind == "training-step-signature":
            self._under_pin("`Trainer.training_step` takes no `num_items_in_batch`")
            self._accept(site.function)
            for call in self._super_calls(site.function, "training_step"):
                if len(positional(call)) == 2 and keyword(call, COUNT) is None:
                    self._add_argument(call, COUNT, keyword_name=None)
            return Choice("`training_step` accepts `num_items_in_batch` and passes it on")
        if site.kind == "training-step-division":
            return self._training_step_division(site)
        if site.kind == "loss-function":
            return self._loss_function(site)
        if site.kind == "library-head":
            return self._library_head(site)
        return self._forward(site)

    def _library_head(self, site: Site) -> Choice:
        """A transformers head's Trainer gets a `compute_loss_func` of the file: the micro-batch's
        cross-entropy sum over the labels that are not -100 (the heads' own loss, summed),
        divided by the Trainer's count of the window's labels (the batch's own where it passes
        none, as in evaluation)."""
        call = self.tree.parents[site.node]
        if head_kind(site.head) == "classify":
            return self._head_opt_out(call)
        unpacked = [arg for arg in call.args if arg.star]
        mappings = self.audit.unpacked(call)
        if unpacked and not (len(unpacked) == len(mappings) == 1):
            raise Unfixable(
                "the Trainer's arguments come partly from an unpacked mapping, which may set "
                "`compute_loss_func` already"
            )
        if "label_smoothing_factor" in self.text:
            raise Unfixable(
                "the arguments may set `label_smoothing_factor`, which a `compute_loss_func` "
                "replaces; smooth the loss in the function instead"
            )
        if head_kind(site.head) == "seq2seq" and not self._decoder_inputs(call):
            raise Unfixable(
                "with a `compute_loss_func` the Trainer hands the model no labels, so an "
                "encoder-decoder needs `decoder_input_ids` from its collator: give the Trainer "
                "`DataCollatorForSeq2Seq(tokenizer, model=model)`"
            )
        self._under_pin("Trainer takes no `compute_loss_func`")
        name = "window_token_loss"
        if name in self.tree.functions or name in self.text:
            raise Unfixable(f"the file already uses the name `{name}`")
        torch = torch_module(self.tree, self.edits)
        body = list(self.tree.module.body)
        at = next(body.index(a) for a in (call, *self.tree.ancestors(call)) if a in body)
        function = LIBRARY_LOSS.format(name=name, torch=torch)
        if at:  # after the statement above the one holding the Trainer, blank lines kept
            self.edits.insert_after(body[at - 1], "\n\n" + function)
        else:
            self.edits.insert_before(body[at], function)
        self.edits.spaced.add(body[at])
        # into the one `dict(...)` the call unpacks, where its other arguments are
        self._add_argument(
            mappings[0] if unpacked else call, name, keyword_name="compute_loss_func"
        )
        caveat = (
            "transformers 4.46 to 4.49 gather the count under `average_tokens_across_devices` "
            "without scaling a `compute_loss_func`'s loss by the process count: require "
            "transformers>=4.50"
            if "average_tokens_across_devices" in self.text
            else ""
        )
        return Choice(
            f"`{code(call.func)}` gets `compute_loss_func={name}`: the micro-batch's token-loss "
            "sum over the window's count",
            caveat,
        )

    def _head_opt_out(self, call: cst.Call) -> Choice:
        """`model.accepts_loss_kwargs = False` above the Trainer's statement, for a head with one
        label per example: the Trainer then divides its mean by K, as before transformers 5."""
        given = model_name(self.audit.given(call))
        built = self.audit.tracer.origin_call(given) if given is not None else None
        if built is None or (self.tree.qualified(built.func) or "").startswith("peft."):
            raise Unfixable(
                "the Trainer is not given a name bound to the transformers model; set "
                f"`{MODEL_OPT_OUT} = False` on the model itself before building the Trainer"
            )
        self.edits.insert_before(
            statement_line(self.tree, call),
            "# the head ignores num_items_in_batch: the Trainer then divides its loss by K\n"
            f"{given.value}.{MODEL_OPT_OUT} = False\n",
        )
        return Choice(
            f"`{given.value}.{MODEL_OPT_OUT} = False` before the Trainer is built: it divides "
            "each micro-batch's mean by the accumulation steps"
        )

    def _decoder_inputs(self, call: cst.Call) -> bool:
        """The Trainer's collator makes `decoder_input_ids` from the labels:
        `DataCollatorForSeq2Seq(..., model=...)`, given here or bound to the name given."""
        collator = keyword(call, "data_collator")
        built = self.audit.tracer.origin_call(collator) if collator is not None else None
        return (
            built is not None
            and (self.tree.qualified(built.func) or "").endswith("DataCollatorForSeq2Seq")
            and keyword(built, "model") is not None
        )


def parameters_in_order(function: cst.FunctionDef) -> list[str]:
    params = function.params
    return [p.name.value for p in (*params.posonly_params, *params.params)]


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    return [*params.posonly_params, *params.params, *params.kwonly_params]


def _pure(expr: cst.BaseExpression) -> bool:
    """A tensor expression safe to evaluate twice: names, attributes, subscripts, reshapes."""
    if isinstance(expr, (cst.Name, cst.Attribute)):
        return dotted(expr) is not None
    if isinstance(expr, cst.Subscript):
        return _pure(expr.value)
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        return expr.func.attr.value in SHAPERS and _pure(expr.func.value)
    return False


def _drops_first(subscript: cst.Subscript) -> bool:
    """`x[:, 1:]` or `x[..., 1:]`: a causal shift of the targets."""
    last = subscript.slice[-1].slice
    return (
        isinstance(last, cst.Slice)
        and code(last.lower or cst.Name("None")) == "1"
        and last.upper is None
    )


def _reads_labels(expr: cst.BaseExpression, inputs: list[str]) -> bool:
    """`inputs.pop("labels")`, `inputs["labels"]` or `inputs.get("labels")`."""
    if not inputs:
        return False
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        return (
            expr.func.attr.value in ("pop", "get")
            and dotted(expr.func.value) == inputs[0]
            and bool(expr.args)
            and string_value(expr.args[0].value) == "labels"
        )
    if isinstance(expr, cst.Subscript) and dotted(expr.value) == inputs[0] and len(expr.slice) == 1:
        key = expr.slice[0].slice
        return isinstance(key, cst.Index) and string_value(key.value) == "labels"
    return False


def _is_docstring(statement: cst.CSTNode) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _name(call: cst.Call) -> str:
    return code(call.func).rsplit(".", 1)[-1]
