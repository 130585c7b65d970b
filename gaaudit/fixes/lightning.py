"""The Lightning form of the sum-and-count rewrite. A Trainer with `accumulate_grad_batches`
divides what `training_step` returns by K, so the returned loss becomes the micro-batch's
token sum times K, the module counts its window in an attribute started in `__init__`, and
`on_before_optimizer_step` (which Lightning calls once per window, after unscaling and before
clipping) divides the gradients once by the window's count, summed over the processes. Where
the Trainer may train in fp16, each micro-batch's sum is taken over the window's first count,
so its GradScaler sees the original's magnitude."""

from __future__ import annotations

import libcst as cst

from gaaudit.analysis.tree import (
    assigned_value,
    code,
    dotted,
    keyword,
    last_name,
    methods_of,
    string_value,
    target_names,
)
from gaaudit.checks.accumulation import Site
from gaaudit.checks.versions import admits
from gaaudit.fixes.edits import (
    DIVIDE_NOTE,
    PRECISION,
    WEIGHT_NOTE,
    Unfixable,
    atom,
    may_be_fp16,
    statement_line,
    torch_module,
)

HOOK = "on_before_optimizer_step"
# `trainer.strategy`, which the hook reduces the window's count with, came in Lightning 1.6
# (the hook itself in 1.4): an older Trainer would never divide the returned sums
HOOKED = "1.6"
LIGHTNING = ("pytorch-lightning", "pytorch_lightning", "lightning")  # as requirements name it


class _LightningWindow:
    """Part of `Planner`: findings on a loss returned to a Lightning Trainer that divides it."""

    def lightning_module(self, site: Site) -> cst.ClassDef | None:
        """The LightningModule whose `training_step` returns the site's loss, if it is one."""
        step = site.window.anchor
        if site.kind != "framework-division" or not (
            isinstance(step, cst.FunctionDef) and step.name.value == "training_step"
        ):
            return None
        return next((a for a in self.tree.ancestors(step) if isinstance(a, cst.ClassDef)), None)

    def _rewrite_returned(self, site: Site, count: str) -> None:
        """`return loss` becomes `return loss * micro_tokens * <K>`, the count added to the
        module's window count just before; `__init__` and the hook are written once per class
        by `_finish_module`."""
        module = self.lightning_module(site)
        step = site.window.anchor
        this = step.params.params[0].name.value if step.params.params else "self"
        if self._distributed_engine():
            raise Unfixable(
                "the Trainer runs a DeepSpeed strategy, which keeps the gradients outside "
                "`param.grad` in `on_before_optimizer_step`; return `loss_sum * k * P / N` with N "
                "the window's valid tokens over the P processes, counted before the window runs "
                "(see `gaaudit explain GA003`)"
            )
        older = self._older_lightning()
        if older:
            raise Unfixable(
                f"the project requires {older}, a Lightning before {HOOKED}, whose Trainer "
                f"would not divide the window once in `{HOOK}` (it has no `trainer.strategy` "
                f"to reduce the count with): require `pytorch-lightning>={HOOKED}`, then fix again"
            )
        unknown = self._strategy_at_run_time()
        if unknown and not self.unsafe:
            raise Unfixable(
                f"unsafe fix (the Trainer's strategy `{unknown}` is chosen at run time: under "
                "DeepSpeed the gradients are not in `param.grad` where the hook divides them); "
                "apply with --unsafe-fixes"
            )
        if len(step.params.params) > 3 or "optimizer_idx" in code(step.params):
            raise Unfixable(
                "`training_step` runs once per optimizer (`optimizer_idx`), so one count per "
                "window cannot follow each optimizer's steps; count each optimizer's window apart"
            )
        caller = next(
            (call for call in self.tree.calls if last_name(call.func) == "training_step"), None
        )
        if caller is not None:
            raise Unfixable(
                f"`training_step` is also called on line {self.tree.line(caller)}, where the "
                "window's count would take those batches too; share the loss through a helper "
                "both call instead"
            )
        self._init_statement(module)  # refuses a module without one
        hook = methods_of(module).get(HOOK)
        if hook is not None and not isinstance(hook.body, cst.IndentedBlock):
            raise Unfixable(f"`{HOOK}` is written on one line; give it a block of its own")
        returned, micro, ref = site.backward.loss, self.micro, f"{this}.{self.reference}"
        scaled = self._fp16_trainer()
        weight = f"({micro} / {ref})" if scaled else micro
        self.edits.replace[returned] = cst.parse_expression(
            f"{atom(self._applied(returned))} * {weight} * {this}.trainer.accumulate_grad_batches"
        )
        counted = "" if count == micro else f"{micro} = {count}\n"
        lines = f"{WEIGHT_NOTE}\n{counted}{this}.{self.window_total} += {micro}\n"
        if scaled:  # one reference for every process, as in `_reference`
            torch = torch_module(self.tree, self.edits)
            lines += (
                f"if {ref} is None:\n"
                f"    {ref} = {this}.trainer.strategy.reduce(\n"
                f"        {torch}.as_tensor(max(float({micro}), 1.0), device={this}.device),\n"
                '        reduce_op="mean",\n'
                "    ).item()\n"
            )
        self.edits.insert_before(statement_line(self.tree, returned), lines)
        self._modules.setdefault(module, this)

    def _finish_module(self, module: cst.ClassDef, this: str) -> None:
        """Start the count in `__init__`, and divide once in `on_before_optimizer_step`."""
        total, ref, scaled = self.window_total, f"{this}.{self.reference}", self._fp16_trainer()
        start = f"{this}.{total} = 0\n" + (f"{ref} = None\n" if scaled else "")
        self.edits.insert_after(self._init_statement(module), start)
        hook = methods_of(module).get(HOOK)
        params = hook.params.params if hook is not None else ()
        optimizer = params[1].name.value if len(params) > 1 else "optimizer"
        torch = torch_module(self.tree, self.edits)
        body = (
            f"{DIVIDE_NOTE}\n"
            f"{total} = {this}.trainer.strategy.reduce(\n"
            f"    {torch}.as_tensor({this}.{total}, dtype={torch}.float32, device={this}.device),\n"
            '    reduce_op="sum",\n'
            ")\n"
            f"{total} = max(float({total}), 1.0) / {this}.trainer.world_size\n"
            f"for group in {optimizer}.param_groups:\n"
            '    for param in group["params"]:\n'
            "        if param.grad is not None:\n"
            f"            param.grad.div_({f'{total} / {ref}' if scaled else total})\n" + start
        )
        if hook is not None:  # at the top of its body, after its docstring
            statements = list(hook.body.body)
            documented = hook.get_docstring() is not None and len(statements) > 1
            if documented:
                self.edits.insert_after(statements[0], body)
            else:
                self.edits.insert_before(statements[0], body)
            return
        indented = "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())
        step = methods_of(module).get("training_step")
        if len(module.bases) > 1:  # a mixin's hook keeps running after the division
            indented += f"    super().{HOOK}({optimizer}, *args)\n"
        self.edits.insert_after(step, f"def {HOOK}({this}, {optimizer}, *args):\n{indented}")
        method = self.edits.after[step][-1]  # a blank line between methods, as around it
        self.edits.after[step][-1] = method.with_changes(
            leading_lines=[cst.EmptyLine(indent=False)]
        )

    def _init_statement(self, module: cst.ClassDef) -> cst.CSTNode:
        """The `super().__init__(...)` statement of the module's `__init__`."""
        init = methods_of(module).get("__init__")
        for node in self.tree.walk(init, into_defs=False) if init is not None else ():
            if isinstance(node, cst.Call) and last_name(node.func) == "__init__":
                return statement_line(self.tree, node)
        raise Unfixable(
            f"`{module.name.value}` has no `__init__` calling `super().__init__()`, where the "
            "window's count would start"
        )

    def _fp16_trainer(self) -> bool:
        """Whether a Lightning Trainer of the file may train in fp16 (then its GradScaler
        needs the original's magnitude: each micro-batch is weighted by its count over the
        window's first count, averaged over the processes)."""
        fp16 = PRECISION["Fabric"][1]
        return any(
            may_be_fp16(call, "precision", fp16)
            for call in self._trainers()
            if keyword(call, "precision") is not None
        )

    def _older_lightning(self) -> str:
        """A Lightning requirement of the file's project that admits no release from `HOOKED`
        on, as written with where; "" where there is none."""
        for package in LIGHTNING if self.path is not None else ():
            admitted, pin, _ = admits(self.path, HOOKED, package)
            if not admitted:
                return pin
        return ""

    def _strategy_at_run_time(self) -> str:
        """A Lightning Trainer's `strategy=` that the file does not spell out ("" where every
        one is a string or a strategy built in the file, directly or through a name)."""
        for call in self._trainers():
            strategy = keyword(call, "strategy")
            if strategy is None:
                continue
            values = [strategy]
            if isinstance(strategy, cst.Name):
                values = [
                    assigned_value(statement, strategy.value)
                    for statement in self.tree.assignments
                    if isinstance(statement, cst.Assign)
                    and any(strategy.value in target_names(t.target) for t in statement.targets)
                ]
            if not values or not all(
                isinstance(value, cst.SimpleString)
                or (isinstance(value, cst.Call) and dotted(value.func) is not None)
                for value in values
            ):
                return code(strategy)
        return ""

    def _trainers(self) -> list[cst.Call]:
        """The file's `Trainer(...)` calls."""
        return [c for c in self.tree.calls if (dotted(c.func) or "").split(".")[-1] == "Trainer"]

    def _distributed_engine(self) -> bool:
        """Whether the file hands Lightning a DeepSpeed strategy (`strategy="deepspeed..."`,
        `DeepSpeedStrategy(...)`); a docstring that names DeepSpeed is none."""
        return any(
            (isinstance(node, cst.Name) and node.value == "DeepSpeedStrategy")
            or (
                isinstance(node, cst.Arg)
                and node.keyword is not None
                and node.keyword.value == "strategy"
                and "deepspeed" in (string_value(node.value) or "")
            )
            for node in self.tree.walk(self.tree.module)
        )
