"""Accumulation structure: backward calls, optimizer steps, and the windows that join them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import libcst as cst

from gaaudit.analysis.tree import (
    DEFS,
    LOOPS,
    Parameter,
    Tree,
    argument_for,
    call_parameters,
    code,
    dotted,
    keyword,
    last_name,
    positional,
    string_value,
)
from gaaudit.discover.modules import Dependency, configured_accumulation, shown
from gaaudit.vocabulary import (
    BACKWARDS,
    LOOP_RUNNERS,
    OPTIMIZER,
    STEPS,
    TORCH_SCHEDULES,
    matched_names,
    steps_optimizer,
)

WindowKind = Literal[
    "modulo", "micro-loop", "accumulate", "framework", "pipeline", "calls", "callable", "named"
]
DEEPSPEED_ACCUMULATION = "gradient_accumulation_steps"  # the DeepSpeed config key


@dataclass(frozen=True)
class Backward:
    """A call that differentiates a loss: `loss.backward()`, `accelerator.backward(loss)`, ..."""

    call: cst.Call | None  # None for a loss returned to a framework that calls backward itself
    loss: cst.BaseExpression


@dataclass(frozen=True)
class Window:
    """The micro-steps whose gradients one optimizer step consumes."""

    kind: WindowKind
    loop: cst.For | cst.While | None
    size: cst.BaseExpression | None  # K, when the code names it
    anchor: cst.CSTNode  # the step guard, the micro-step loop, or the `with` statement
    # where the optimizer step (and gradient scaling) sits: the guard itself, or the statements
    # after an `if <a % k>: continue` guard
    step_region: tuple[cst.CSTNode, ...]

    @property
    def skips(self) -> bool:
        """Whether the step follows a guard that skips to the next micro-step until K is reached."""
        return self.kind == "modulo" and self.step_region != (self.anchor,)


@dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule, or a DeepSpeed `PipelineModule`, and the loss function it is given."""

    call: cst.Call
    loss_fn: cst.BaseExpression
    micro_batches: cst.BaseExpression | None  # the number of micro-batches, when the code names it
    framework: str  # what divides, in words
    divides: bool | None  # whether it divides by the number of micro-batches (None: cannot tell)


def is_step(call: cst.Call) -> bool:
    """`optimizer.step()`, `opt.step()`, `scaler.step(optimizer)`,
    `optimizer.step_and_update_lr()`."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in STEPS):
        return False
    return steps_optimizer(last_name(func.value) or "", len(positional(call)))


def backward_of(call: cst.Call) -> cst.BaseExpression | None:
    """The loss a `backward` (or Lightning `manual_backward`) call differentiates, else None;
    never a tensor's `backward(gradient=...)`, which passes a gradient on (a pipeline stage)."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in BACKWARDS):
        return None
    if keyword(call, "gradient") is not None:
        return None
    args = positional(call)
    if args:
        return args[0]
    named = keyword(call, "loss")  # `booster.backward(loss=loss, optimizer=opt)`
    if named is not None:
        return named
    receiver = func.value
    if (
        isinstance(receiver, cst.Call)
        and isinstance(receiver.func, cst.Attribute)
        and receiver.func.attr.value == "scale"
        and len(receiver.args) == 1
    ):
        return receiver.args[0].value
    return receiver


class _WindowFinding:
    """Part of `Structure`: which window a backward belongs to: a loop with a step, a modulo guard,
    a micro-step loop, a function that steps, an accelerate `accumulate()` block."""

    def _window(self, backward: Backward) -> Window | None:
        if self.deepspeed_engine(backward) and self.deepspeed_accumulation():
            return Window("framework", None, None, backward.call, ())
        flag = self.stepping_callable(backward.call) if backward.call is not None else None
        if flag is not None:
            loop = next(
                (a for a in self.tree.ancestors(backward.call) if isinstance(a, LOOPS)), None
            )
            return Window("callable", loop, flag.right, backward.call, ())
        scope = self.tree.scope_of(backward.call)
        ancestors = []
        for node in self.tree.ancestors(backward.call):
            if node is scope:
                break
            ancestors.append(node)
        accumulate = next((w for w in ancestors if self._is_accumulate(w)), None)
        loop = next((a for a in ancestors if isinstance(a, LOOPS)), None)
        if loop is not None:
            if self.steps_in(loop):
                found = self._modulo_window(loop, backward.call)
            elif not self._zeroes_gradients(loop):
                found = self._micro_window(loop)
            else:
                found = None
            if found is not None:
                return found
        if accumulate is None and loop is None and isinstance(scope, cst.FunctionDef):
            accumulate = self._accumulating_call(scope)  # `with acc.accumulate(m): run(...)`
        if accumulate is not None:
            return Window("accumulate", loop, None, accumulate, (accumulate,))
        helpers, _ = self._helpers  # a helper's window is judged where it is called
        if loop is None and isinstance(scope, cst.FunctionDef) and scope.name.value not in helpers:
            found = self._calls_window(scope) or self._caller_window(scope)
            if found is not None:
                return found
        if self.accelerate_deepspeed(backward):  # the engine accumulates behind `optimizer.step()`
            return Window("framework", None, None, backward.call, ())
        return None

    def _zeroes_gradients(self, loop: cst.CSTNode) -> bool:
        return any(
            isinstance(n, cst.Call) and last_name(n.func) == "zero_grad"
            for n in self.tree.walk(loop, into_defs=False)
        )

    def _micro_window(self, loop: cst.For | cst.While) -> Window | None:
        """A loop of backward calls whose summed gradient is used after it (a step, a `.grad`),
        in its function or, past the function's end, after a same-file call of it."""
        if self._reads_grad(loop, activations=False):
            return None
        after = tuple(self._after(loop))
        if not any(self.steps_in(s) or self._reads_grad(s) for s in after):
            after = self._after_calls(loop)
            if not any(self.steps_in(s) for s in after):
                return None
        size = None
        iterated = loop.iter if isinstance(loop, cst.For) else None
        if isinstance(iterated, cst.Call) and dotted(iterated.func) == "range":
            size = _range_length(positional(iterated))
        if size is None and isinstance(loop, cst.For) and dotted(loop.iter) is not None:
            size = cst.parse_expression(f"len({code(loop.iter)})")
        return Window("micro-loop", loop, size, loop, after)

    def _after_calls(self, node: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
        """The statements after each same-file call of the function holding `node` (its
        caller steps once the micro-step loop has run)."""
        function = self.tree.scope_of(node)
        if not isinstance(function, cst.FunctionDef):
            return ()
        return tuple(s for call in calls_of(self.tree, function) for s in self._after(call))

    def _reads_grad(self, region: cst.CSTNode, activations: bool = True) -> bool:
        """Whether `region` reads a `.grad`; not `activations`: leave out a micro-batch's
        input gradient (`inputs[i].grad`, sent on by a pipeline stage)."""
        return any(
            isinstance(n, cst.Attribute)
            and n.attr.value == "grad"
            and (activations or not isinstance(n.value, cst.Subscript))
            for n in self.tree.walk(region, into_defs=False)
        )

    def _after(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        """The statements following `node` in its block, and after its enclosing blocks."""
        while node in self.tree.parents:
            parent = self.tree.parents[node]
            body = getattr(parent, "body", None)
            if isinstance(body, (list, tuple)) and node in body:
                yield from body[body.index(node) + 1 :]
            if isinstance(parent, (cst.FunctionDef, cst.Module) + LOOPS):
                return
            node = parent

    def _modulo_window(self, loop: cst.For | cst.While, backward: cst.Call) -> Window | None:
        """A step under `if <a % k>:`, or after `if <a % k>: continue` that follows the backward;
        none when a step follows the backward on every pass (its gradient is used at once, as
        a critic's is where the actor steps every k passes), but for the last micro-batch's
        backward in the `else` of the step's guard (`if a % k != 0:` backpropagates under
        `no_sync`, `else:` backpropagates and steps), which closes that guard's window."""
        steps = self.steps_in(loop)
        for step in steps:
            guarded = self._guard(step, loop)
            last = self.stepping_else(guarded[0]) if guarded else None
            if last is not None and self.tree.contains(last, backward):
                return Window("modulo", loop, guarded[1], guarded[0], (guarded[0],))
        if any(self._follows_every_time(step, backward, loop) for step in steps):
            return None
        for step in steps:
            guarded = self._guard(step, loop)
            if guarded is not None:
                guard, size = guarded
                return Window("modulo", loop, size, guard, (guard,))
            skipping = self._skipping_guard(step, loop)
            if skipping is not None and self.tree.order[backward] < self.tree.order[skipping[0]]:
                guard, modulo, after = skipping
                return Window("modulo", loop, modulo.right, guard, after)
        return None

    def stepping_else(self, guard: cst.CSTNode) -> cst.Else | None:
        """The `else` of a step guard that closes the window its body backpropagates (`if a %
        k != 0:` backpropagates under `no_sync`, `else:` backpropagates the last micro-batch
        and steps), else None; not a GAN's turns, where each branch steps."""
        if not isinstance(guard, cst.If) or not isinstance(guard.orelse, cst.Else):
            return None
        if self.steps_in(guard.body) or not self.steps_in(guard.orelse):
            return None
        if not any(self.tree.contains(guard.body, b.call) for b in self.backwards()):
            return None
        return guard.orelse

    def window_else(self, window: Window) -> cst.Else | None:
        """The stepping `else` (`stepping_else`) of a modulo window's guard, else None."""
        if window.kind != "modulo" or window.skips:
            return None
        return self.stepping_else(window.anchor)

    def _follows_every_time(self, step: cst.Call, backward: cst.Call, loop: cst.CSTNode) -> bool:
        """Whether `step` runs after `backward` on every pass that runs the backward."""
        if self.tree.order[step] < self.tree.order[backward]:
            return False
        between = range(self.tree.order[backward], self.tree.order[step])
        if any(
            isinstance(node, (cst.Continue, cst.Break, cst.Return))
            and self.tree.order[node] in between
            for node in self.tree.walk(loop, into_defs=False)
        ):
            return False  # `if <a % k>: continue` skips it
        for node in self.tree.ancestors(step):
            if node is loop:
                return True
            if isinstance(node, (cst.If, *LOOPS, cst.Try)) and not self.tree.contains(
                node, backward
            ):
                return False
            if isinstance(node, cst.If) and self.tree.contains(node.body, step) != (
                self.tree.contains(node.body, backward)
            ):
                return False  # `if a % k != 0: <backward>` / `else: <backward>, <step>`
        return False

    def _calls_window(self, function: cst.FunctionDef, hops: int = 1) -> Window | None:
        """A function that calls backward and steps under `if <a % k>:` (Lightning's manual
        optimisation in `training_step`), itself or in a same-file helper it calls (XLM's
        `self.optimize(loss)`): its window spans K calls, unless every call zeroes that
        optimizer's gradients (on the step's path: not in the other arm of an `if`)."""
        clearing = [
            n
            for n in self.tree.walk(function, into_defs=False)
            if isinstance(n, cst.Call)
            and last_name(n.func) == "zero_grad"
            and self._guard(n, function, modulo=False) is None
        ]
        for step in self.steps_in(function):
            helper = None if is_step(step) else self.tree.functions.get(_helper_name(step.func))
            if hops and helper is not None and helper is not function:
                found = self._calls_window(helper, hops - 1)  # the helper's own guard
                if found is not None:
                    return found
            guarded = self._guard(step, function)
            cleared = {_optimizer_of(n) for n in clearing if not _apart(self.tree, n, step)}
            if guarded is not None and not cleared & {None, _optimizer_of(step)}:
                guard, size = guarded
                return Window("calls", None, size, guard, (guard,))
        return None

    def _caller_window(self, function: cst.FunctionDef) -> Window | None:
        """The window of a loop of the file that calls `function`, a function that
        backpropagates and does not step, once per micro-batch and steps under `if <a % k>:`
        (`train_step(model, batch, K)`, then `if i % K == 0: update_step(...)`), or steps once
        after the loop (`for micro in micro_batches: loss = self.backward_step(micro)`)."""
        if self.steps_in(function):
            return None
        for call in calls_of(self.tree, function):
            scope = self.tree.scope_of(call)
            loop = next((a for a in self.tree.ancestors(call) if isinstance(a, LOOPS)), None)
            if loop is None or not self._inside(loop, scope):
                continue
            if self.steps_in(loop):
                found = self._modulo_window(loop, call)
            elif not self._zeroes_gradients(loop):
                found = self._micro_window(loop)
            else:
                found = None
            if found is not None:
                return found
        return None

    def _accumulating_call(self, function: cst.FunctionDef) -> cst.With | None:
        """The `with accelerator.accumulate(...)` block holding a call of `function`, a
        same-file function that computes the loss and calls backward itself."""
        for call in calls_of(self.tree, function):
            block = next((a for a in self.tree.ancestors(call) if self._is_accumulate(a)), None)
            if block is not None:
                return block
        return None

    @staticmethod
    def _is_accumulate(node: cst.CSTNode) -> bool:
        return isinstance(node, cst.With) and any(
            isinstance(item.item, cst.Call)
            and isinstance(item.item.func, cst.Attribute)
            and item.item.func.attr.value == "accumulate"
            for item in node.items
        )


class _Guards:
    """Part of `Structure`: step guards: the `if` testing `a % k` that holds a step, an earlier
    skipping guard, and the modulo they test."""

    def _guard(
        self, call: cst.Call, region: cst.CSTNode, modulo: bool = True
    ) -> tuple[cst.If, cst.BaseExpression | None] | None:
        """The `if` inside `region` that holds the call and tests `a % k`, or a window's last
        index (`a == k - 1`) or count (`n == k`), with its `k` (any `if` when not `modulo`)."""
        for guard in self.tree.ancestors(call):
            if guard is region:
                return None
            if isinstance(guard, cst.If):
                found = self._modulo(guard.test)
                size = found.right if found is not None else self._last_index(guard)
                if size is not None or not modulo:
                    return guard, size
        return None

    def _last_index(self, guard: cst.If) -> cst.BaseExpression | None:
        """The accumulation name `k` of a test for a window's last index, `a == k - 1` or
        `a + 1 == k` (minimal-llama's `batch_metadata["grad_accum_index"] == k - 1`), or for
        its count of micro-batches, `n == k` with `n += 1` earlier in the guard's loop (a
        `while True` that runs micro-batches until its counter reaches K); any `k` there when
        the guard sets `n` back to 0, so that it holds every k passes (BRIO's `step_cnt ==
        args.accumulate_step`)."""
        test = guard.test
        if not (
            isinstance(test, cst.Comparison)
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)
        ):
            return None
        sides = (test.left, test.comparisons[0].comparator)
        for side, other in (sides, sides[::-1]):
            one = isinstance(side, cst.BinaryOperation) and code(side.right) == "1"
            if one and isinstance(side.operator, cst.Subtract):
                size = side.left
            elif one and isinstance(side.operator, cst.Add) or self._counts_passes(side, guard):
                size = other
            else:
                continue
            if self.is_accumulation_name(size) or _resets(guard, side):
                return size
        return None

    def _counts_passes(self, counter: cst.BaseExpression, guard: cst.If) -> bool:
        """Whether the innermost loop holding `guard` raises the name `counter` by one
        before the guard."""
        loop = next((a for a in self.tree.ancestors(guard) if isinstance(a, LOOPS)), None)
        if not isinstance(counter, cst.Name) or loop is None:
            return False
        return any(
            raises_by_one(node, counter.value) and self.tree.order[node] < self.tree.order[guard]
            for node in self.tree.walk(loop.body, into_defs=False)
        )

    def _skipping_guard(
        self, step: cst.Call, loop: cst.For | cst.While
    ) -> tuple[cst.If, cst.BinaryOperation, tuple[cst.BaseStatement, ...]] | None:
        """An earlier `if <a % k>: continue` in a block of the loop that holds the step, with the
        statements after it."""
        for node in (step, *self.tree.ancestors(step)):
            if node is loop or isinstance(node, LOOPS):
                return None
            body = getattr(self.tree.parents.get(node), "body", None)
            if not (isinstance(body, (list, tuple)) and node in body):
                continue
            position = body.index(node)
            for index in range(position - 1, -1, -1):
                guard = body[index]
                if isinstance(guard, cst.If) and _skips(guard):
                    modulo = self._modulo(guard.test)
                    if modulo is not None:
                        return guard, modulo, tuple(body[index + 1 :])
        return None

    def _modulo(self, test: cst.BaseExpression) -> cst.BinaryOperation | None:
        """The `a % k` a step guard tests, directly or through a name assigned from it, or set
        true under a test of it (`elif step % k == 0: update = True`)."""
        for node in self.tree.walk(test):
            if _is_modulo(node):
                return node
            if isinstance(node, cst.Name):
                for stmt in self.tree.bindings(self.tree.scope_of(test)).get(node.value, ()):
                    inner = (
                        self._first_modulo(stmt.value) or self._set_true_under_modulo(stmt)
                        if isinstance(stmt, cst.Assign)
                        else None
                    )
                    if inner is not None:
                        return inner
        return None

    def _set_true_under_modulo(self, assign: cst.Assign) -> cst.BinaryOperation | None:
        """The `a % k` of the `if` (or `elif`) in whose body `assign` sets a name `True`."""
        if not (isinstance(assign.value, cst.Name) and assign.value.value == "True"):
            return None
        for node in self.tree.ancestors(assign):
            if isinstance(node, cst.If) and self.tree.contains(node.body, assign):
                return self._first_modulo(node.test)
            if isinstance(node, (cst.FunctionDef, *LOOPS)):
                return None
        return None

    def _first_modulo(self, expr: cst.CSTNode) -> cst.BinaryOperation | None:
        return next((n for n in self.tree.walk(expr) if _is_modulo(n)), None)


class _Frameworks:
    """Part of `Structure`: frameworks that divide the loss by K themselves: accelerate, DeepSpeed,
    Lightning, pipeline schedules, and where their K is configured."""

    def dividing_framework(self, backward: Backward, window: Window) -> str | None:
        """Which framework divides this backward's loss by the accumulation steps, if any."""
        if self.deepspeed_engine(backward):
            where = self.deepspeed_accumulation()
            return f"DeepSpeed, gradient_accumulation_steps in {where}" if where else None
        if window.kind == "framework" and self.accelerate_deepspeed(backward):
            return "accelerate with DeepSpeed, gradient_accumulation_steps in the config given at launch"
        receiver = self._receiver(backward)
        if receiver is None or not self.is_accelerator(receiver):
            return None
        if window.kind == "accumulate":  # named as the window's `with` calls it
            items = window.anchor.items if isinstance(window.anchor, cst.With) else ()
            called = [dotted(i.item.func) for i in items if isinstance(i.item, cst.Call)]
            named = next((c for c in called if c and c.endswith(".accumulate")), None)
            return f"accelerate's `{named or receiver + '.accumulate'}()`"
        if self._configured_accelerator():
            return "accelerate, `Accelerator(gradient_accumulation_steps=...)`"
        return None

    @staticmethod
    def _receiver(backward: Backward) -> str | None:
        call = backward.call
        if call is None or not positional(call) or not isinstance(call.func, cst.Attribute):
            return None
        return dotted(call.func.value)

    @cached_property
    def _constructors(self) -> dict[str, list[cst.Call]]:
        """Calls by qualified callee name (for framework configuration lookups)."""
        calls: dict[str, list[cst.Call]] = {}
        for node in self.tree.calls:
            calls.setdefault(self.tree.qualified(node.func) or "", []).append(node)
        return calls

    def is_accelerator(self, name: str) -> bool:
        """`accelerator`, or a name bound to an `Accelerator(...)` in the file (`acc`)."""
        return "accelerator" in name.lower() or any(
            isinstance(value, cst.Call)
            and (self.tree.qualified(value.func) or "").endswith("Accelerator")
            for value in self.tree.assigned_values.get(name, ())
        )

    def _configured_accelerator(self) -> bool:
        accelerators = [
            c
            for name, calls in self._constructors.items()
            if name.endswith("Accelerator")
            for c in calls
        ]
        plugins = any(name.endswith("GradientAccumulationPlugin") for name in self._constructors)
        return plugins or any(
            keyword(c, "gradient_accumulation_steps") is not None for c in accelerators
        )

    def accelerate_deepspeed(self, backward: Backward) -> bool:
        """An accelerator's backward in a file that runs it with DeepSpeed configured at launch
        (`accelerator.state.deepspeed_plugin`), K set nowhere in the file."""
        receiver = self._receiver(backward)
        return (
            receiver is not None
            and self.is_accelerator(receiver)
            and self._deepspeed_plugin_at_launch
        )

    @cached_property
    def may_run_deepspeed(self) -> str:
        """Why the file may train under DeepSpeed, whose ZeRO keeps the gradients outside
        `param.grad`, in words ("" if it shows no sign): it reads an accelerator's
        `deepspeed_plugin` or hands it one (`Accelerator(deepspeed_plugin=DeepSpeedPlugin(
        zero_stage=3))`), tests for `DistributedType.DEEPSPEED`, makes an engine, or hands
        Lightning (Fabric or its Trainer) a DeepSpeed strategy."""
        if self._reads_plugin:
            return "it reads `deepspeed_plugin`"
        for node in self.tree.calls:
            name = dotted(node.func) or ""
            if name.endswith(("DeepSpeedStrategy", "DeepSpeedPlugin")):
                return f"it makes a `{name.rsplit('.', 1)[-1]}`"
            if keyword(node, "deepspeed_plugin") is not None:
                return f"it hands `{name}` a `deepspeed_plugin`"
            strategy = keyword(node, "strategy")
            if isinstance(strategy, cst.SimpleString) and "deepspeed" in strategy.value:
                return f"it hands `{dotted(node.func)}` the strategy {strategy.value}"
        if any(
            isinstance(node, cst.Attribute)
            and node.attr.value == "DEEPSPEED"
            and last_name(node.value) == "DistributedType"
            for node in self.tree.walk(self.tree.module)
        ):
            return "it tests for `DistributedType.DEEPSPEED`"
        return "it makes an engine" if self._deepspeed_engines else ""

    @cached_property
    def _reads_plugin(self) -> bool:
        return any(
            isinstance(node, cst.Attribute) and node.attr.value == "deepspeed_plugin"
            for node in self.tree.walk(self.tree.module)
        )

    @cached_property
    def _deepspeed_plugin_at_launch(self) -> bool:
        return (
            self._reads_plugin
            and not self._configured_accelerator()
            and not self._deepspeed_config[0]
        )

    def deepspeed_engine(self, backward: Backward) -> bool:
        """Whether the backward's receiver was unpacked from `deepspeed.initialize(...)`, or is
        a parameter of its function that every call of it in the file hands such an engine
        (`train(loader, model_engine, ...)` running `model.backward(loss)`)."""
        receiver = self._receiver(backward)
        if receiver is None or receiver in self._deepspeed_engines:
            return receiver is not None
        function = self.tree.enclosing_function(backward.call)
        parameter = call_parameters(function).get(receiver) if function else None
        if parameter is None:
            return False
        calls = [
            c
            for c in self.tree.calls
            if isinstance(c.func, cst.Name) and c.func.value == function.name.value
        ]
        handed = [argument_for(c, parameter) for c in calls]
        return bool(handed) and all(
            isinstance(a, cst.Name) and a.value in self._deepspeed_engines for a in handed
        )

    @cached_property
    def _deepspeed_engines(self) -> set[str]:
        engines: set[str] = set()
        for node in self.tree.assignments:
            if not (isinstance(node, cst.Assign) and isinstance(node.value, cst.Call)):
                continue
            if (self.tree.qualified(node.value.func) or "").endswith("deepspeed.initialize"):
                for target in node.targets:
                    elements = (
                        target.target.elements if isinstance(target.target, cst.Tuple) else ()
                    )
                    engines |= {dotted(e.value) for e in elements} | {dotted(target.target)}
        return engines - {None}

    @cached_property
    def _deepspeed_config(self) -> tuple[str | None, bool]:
        """Where the file's DeepSpeed config sets gradient_accumulation_steps above 1, and
        whether that config is only given at run time (K not visible in the file)."""
        sizes_set = False  # the file fixes K itself, or the batch sizes that imply it
        for node in self.tree.walk(self.tree.module):
            sizes_set = sizes_set or _config_setting(node)[0] in (
                DEEPSPEED_ACCUMULATION,
                "train_batch_size",
            )
            if (value := self._config_accumulation(node)) is not None and accumulates(value):
                return f"a config dict (line {self.tree.line(node)})", False
            if isinstance(node, cst.SimpleString) and (string_value(node) or "").endswith(".json"):
                steps = _json_accumulation(self.directory / string_value(node))
                if steps:
                    return f"{string_value(node)} (gradient_accumulation_steps={steps})", False
        for call in self._constructors.get("deepspeed.initialize", []):
            if keyword(call, "gradient_accumulation_steps") is not None:
                return f"deepspeed.initialize(...) (line {self.tree.line(call)})", False
            for name in ("config", "config_params", "args"):
                value = keyword(call, name)  # a dict or a JSON file named here was read above
                shown = isinstance(value, (cst.Dict, cst.SimpleString))
                if value is not None and not shown and not sizes_set:
                    line = self.tree.line(call)
                    return (
                        f"the config given at run time (`{name}={code(value)}`, line {line})",
                        True,
                    )
        return None, False

    def deepspeed_accumulation(self) -> str | None:
        return self._deepspeed_config[0]

    def deepspeed_at_run_time(self) -> bool:
        """Whether DeepSpeed's K comes from a config the file does not show (it may be 1)."""
        return self._deepspeed_config[1] or self._deepspeed_plugin_at_launch

    def pipelines(self) -> Iterator[Pipeline]:
        """Pipeline schedules given a loss function: torch.distributed.pipelining's divide the
        gradients by `n_microbatches` (unless `scale_grads=False`); DeepSpeed's
        PipelineEngine runs `gradient_accumulation_steps` micro-batches and divides each loss
        by that number, like `engine.backward`."""
        for name, calls in self._constructors.items():
            home, _, last = name.rpartition(".")
            for call in calls:
                if last in TORCH_SCHEDULES and "pipelining" in home:
                    loss_fn = keyword(call, "loss_fn") or _argument(call, 2)
                    scale = keyword(call, "scale_grads")
                    divides = (
                        True if scale is None else {"True": True, "False": False}.get(code(scale))
                    )
                    micro = keyword(call, "n_microbatches") or _argument(call, 1)
                    framework = f"`{last}` divides the gradients by `n_microbatches`"
                elif last == "PipelineModule" and home.startswith("deepspeed"):
                    loss_fn, micro, divides = (
                        keyword(call, "loss_fn") or _argument(call, 3),
                        None,
                        True,
                    )
                    steps = self.deepspeed_accumulation()
                    framework = "DeepSpeed's PipelineEngine divides each micro-batch's loss by " + (
                        f"gradient_accumulation_steps ({steps})"
                        if steps
                        else "gradient_accumulation_steps"
                    )
                elif last in LOOP_RUNNERS and _runs_loop(home, last):
                    loss_fn, micro, divides = self._forward_step_loss(call, last), None, True
                    framework = (
                        "Megatron's schedule divides each micro-batch's loss by the number of "
                        "micro-batches"
                        if last == "pretrain"
                        else "SwissArmyTransformer hands each micro-batch's loss to DeepSpeed's "
                        "`engine.backward`, which divides it by gradient_accumulation_steps"
                    )
                else:
                    continue
                if loss_fn is not None and code(loss_fn) != "None":
                    yield Pipeline(call, loss_fn, micro, framework, divides)

    def _forward_step_loss(self, call: cst.Call, runner: str) -> cst.BaseExpression | None:
        """The loss function of the forward step a loop runner is handed (a function of the
        file, by keyword or among its arguments): Megatron's forward step returns the output
        and the loss function (`return output, partial(loss_func, loss_mask)`);
        SwissArmyTransformer's returns the loss itself (`return loss, {"loss": loss}`)."""
        given = keyword(call, "forward_step_func") or keyword(call, "forward_step_function")
        names = [given] if given is not None else [a.value for a in call.args]
        for name in names:
            function = self.tree.functions.get(code(name)) if isinstance(name, cst.Name) else None
            if function is None or len(function.params.params) < 2:
                continue
            returned = [
                node.value
                for node in self.tree.in_scope(function)
                if isinstance(node, cst.Return) and isinstance(node.value, cst.Tuple)
            ]
            if runner == "training_main":
                return name if returned else None
            for value in returned:
                loss_fn = value.elements[-1].value
                if isinstance(loss_fn, cst.Call) and last_name(loss_fn.func) == "partial":
                    loss_fn = _argument(loss_fn, 0)
                if isinstance(loss_fn, cst.Name):
                    return loss_fn
        return None

    @cached_property
    def lightning_accumulation(self) -> tuple[cst.BaseExpression, str, bool] | None:
        """The accumulation factor of a Lightning `Trainer(accumulate_grad_batches=k)` or of a
        `GradientAccumulationScheduler(scheduling={epoch: k})` in the file, unless always 1,
        else of the project's YAML configs (`trainer = hydra.utils.instantiate(cfg.trainer)`
        elsewhere) or launch scripts (`--accumulate_grad_batches 16` for
        `Trainer.from_argparse_args`), with how it is set and whether a config file sets it."""
        for name, calls in self._constructors.items():
            if name.endswith("GradientAccumulationScheduler"):
                factors = [keyword(c, "scheduling") or _argument(c, 0) for c in calls]
                label = "`GradientAccumulationScheduler(scheduling={})`"
            elif name.endswith("Trainer") and (
                "lightning" in name or "pl." in name or name == "Trainer"
            ):
                factors = [keyword(c, "accumulate_grad_batches") for c in calls]
                label = "`accumulate_grad_batches={}`"
            else:
                continue
            for factor in factors:
                if factor is not None and accumulates(factor):
                    return factor, label.format(code(factor)), False
        found = configured_accumulation(self.directory, self.seen)
        if found is None:
            return None
        path, line, value = found
        factor = cst.Integer(value) if value.isdigit() else cst.Name("accumulate_grad_batches")
        setting = (
            f"--accumulate_grad_batches {value}"
            if path.suffix == ".sh"
            else f"accumulate_grad_batches: {value}"
        )
        return factor, f"`{setting}` in {shown(path)} line {line}", True

    def _config_accumulation(self, node: cst.CSTNode) -> cst.BaseExpression | None:
        """K as a DeepSpeed config dict sets it: `gradient_accumulation_steps`, or the
        accumulation factor of a `train_batch_size` product (micro-batch x world x K)."""
        key, value = _config_setting(node)
        if key == DEEPSPEED_ACCUMULATION:
            return value
        if key == "train_batch_size" and value is not None:
            return next((f for f in _factors(value) if self.is_accumulation_name(f)), None)
        return None

    def is_accumulation_name(self, expr: cst.CSTNode) -> bool:
        """`k`, `args.k`, or a config's entry `cfg["k"]` whose name is an accumulation name,
        in any case (a module constant `ACCUMULATION_STEPS`)."""
        if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
            index = expr.slice[0].slice
            key = string_value(index.value) if isinstance(index, cst.Index) else None
            return (key or "").lower() in self.names
        return (last_name(expr) or "").lower() in self.names


class Structure(_WindowFinding, _Guards, _Frameworks):
    """Backward calls, steps and windows of one file, same-file helpers included."""

    def __init__(
        self,
        tree: Tree,
        accumulation_names: frozenset[str],
        directory: Path = Path("."),
        seen: set[Dependency] | None = None,
    ) -> None:
        self.tree = tree
        self.names = matched_names(accumulation_names)
        self.directory = directory  # where config files named in the source are looked up
        self.seen = seen if seen is not None else set()  # the config files read
        self._windows: dict[Backward, Window | None] = {}  # each backward's, found once

    @cached_property
    def _helpers(self) -> tuple[dict[str, Parameter | None], set[str]]:
        """Same-file functions that call backward on one of their parameters (that parameter)
        or on what a parameter's flag chooses (`(loss * count if return_count else
        loss).backward()`: None, no argument is the loss), judged where called; and those that
        step."""
        backward: dict[str, Parameter | None] = {}
        stepping: set[str] = set()
        for node in self.tree.calls:
            function = self.tree.enclosing_function(node)
            if function is None or self.tree.functions.get(function.name.value) is not function:
                continue
            name = function.name.value
            if is_step(node):
                stepping.add(name)
            loss = backward_of(node)
            if isinstance(loss, cst.BaseExpression):
                parameters = call_parameters(function)
                tests = [n.test for n in self.tree.walk(loss) if isinstance(n, cst.IfExp)]
                names = [
                    n.value
                    for n in self.tree.walk(loss)
                    if isinstance(n, cst.Name) and not any(self.tree.contains(t, n) for t in tests)
                ]
                root = self._alias(function, names[0] if names else None)
                if root in parameters:
                    backward[name] = parameters[root]
                elif any(
                    isinstance(n, cst.Name) and n.value in parameters
                    for test in tests
                    for n in self.tree.walk(test)
                ):
                    backward[name] = None
        return backward, stepping

    def _alias(self, function: cst.FunctionDef, name: str | None) -> str | None:
        """The name `name` stands for in `function` when its one binding there copies another
        name (`loss = lm_loss`), else `name`."""
        bound = self.tree.bindings(function).get(name or "", ())
        if len(bound) == 1 and isinstance(bound[0], cst.Assign):
            value = bound[0].value
            if isinstance(value, cst.Name) and len(bound[0].targets) == 1:
                return value.value
        return name

    def backwards(self) -> Iterator[Backward]:
        helpers, _ = self._helpers
        for node in self.tree.calls:
            loss = backward_of(node)
            if isinstance(loss, cst.BaseExpression):
                yield Backward(node, loss)
                continue
            name = _helper_name(node.func)
            if name in helpers and not self._inside(node, self.tree.functions[name]):
                parameter = helpers[name]
                argument = argument_for(node, parameter) if parameter is not None else None
                if argument is not None:
                    yield Backward(node, argument)
            elif self.stepping_callable(node) is not None:
                yield Backward(node, positional(node)[0])

    def stepping_flag(self, call: cst.Call) -> cst.BaseExpression | None:
        """For a call handed the loss first, an optimizer, and a flag computed from `a % k`
        (MAE's and timm's `loss_scaler(loss, optimizer, update_grad=(i + 1) % k == 0)`, an
        `amp_step(loss, opt, update=...)` of another module): the flag it is handed. Such a
        callable backpropagates the loss and steps the optimizer when the flag holds."""
        if self.stepping_optimizer(call) is None:
            return None
        return next((a.value for a in call.args[1:] if self._modulo(a.value) is not None), None)

    def stepping_optimizer(self, call: cst.Call) -> cst.BaseExpression | None:
        """The optimizer a call handed the loss first also hands (`stepping_flag`), else None;
        never a scheduler's maker (`get_scheduler(name, optimizer, total % k ...)`)."""
        if not positional(call) or backward_of(call) is not None:
            return None
        if "sched" in (last_name(call.func) or "").lower():
            return None
        return next(
            (a.value for a in call.args[1:] if OPTIMIZER.search(last_name(a.value) or "")), None
        )

    def stepping_callable(self, call: cst.Call) -> cst.BinaryOperation | None:
        """The `a % k` of a stepping callable's flag (`stepping_flag`)."""
        flag = self.stepping_flag(call)
        return None if flag is None else self._modulo(flag)

    def _inside(self, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
        return self.tree.contains(outer, node)

    def steps_in(self, region: cst.CSTNode) -> list[cst.Call]:
        """Optimizer steps inside a region, calls to same-file stepping helpers included."""
        _, stepping = self._helpers
        return [
            node
            for node in self.tree.walk(region, into_defs=False)
            if isinstance(node, cst.Call) and (is_step(node) or _helper_name(node.func) in stepping)
        ]

    def window(self, backward: Backward) -> Window | None:
        """The accumulation window a backward call belongs to, if the code shows one (the
        accumulation rules, GA007 and verify each ask)."""
        if backward not in self._windows:
            self._windows[backward] = self._window(backward)
        return self._windows[backward]


def _resets(guard: cst.If, counter: cst.BaseExpression) -> bool:
    """Whether the body of `guard` sets the name `counter` back to 0 (`n = 0`)."""
    return isinstance(counter, cst.Name) and any(
        isinstance(stmt, cst.Assign)
        and code(stmt.value) == "0"
        and any(code(target.target) == counter.value for target in stmt.targets)
        for line in guard.body.body
        if isinstance(line, cst.SimpleStatementLine)
        for stmt in line.body
    )


def raises_by_one(node: cst.CSTNode, name: str) -> bool:
    """`name += 1`."""
    return (
        isinstance(node, cst.AugAssign)
        and isinstance(node.operator, cst.AddAssign)
        and isinstance(node.target, cst.Name)
        and node.target.value == name
        and code(node.value) == "1"
    )


def _optimizer_of(call: cst.Call) -> str | None:
    """The optimizer of `opt.step()`, `scaler.step(opt)` or `opt.zero_grad()`; None for a call
    that may clear every optimizer's gradients (`model.zero_grad()`, a helper)."""
    args = positional(call)
    if is_step(call) and args:
        return dotted(args[0])
    receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
    name = dotted(receiver) if receiver is not None else None
    return name if name and OPTIMIZER.search(last_name(receiver).lower()) else None


def _is_modulo(node: cst.CSTNode) -> bool:
    """`a % k`; never a string's formatting (`"O%i" % level`)."""
    return (
        isinstance(node, cst.BinaryOperation)
        and isinstance(node.operator, cst.Modulo)
        and not isinstance(
            node.left, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)
        )
    )


def _skips(guard: cst.If) -> bool:
    """`if ...: continue`, with no `else`."""
    last = guard.body.body[-1] if guard.body.body else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1]
    return guard.orelse is None and isinstance(last, cst.Continue)


def _argument(call: cst.Call, index: int) -> cst.BaseExpression | None:
    """The `index`-th positional argument, when no `*args` comes before it."""
    for arg in call.args[: index + 1]:
        if arg.star or arg.keyword is not None:
            return None
    return call.args[index].value if index < len(call.args) else None


def runner(window: Window) -> str:
    """The loop runner that forms a pipeline window (`pretrain`, `training_main`), else ""."""
    if window.kind != "pipeline":
        return ""
    name = last_name(window.anchor.func) or ""
    return name if name in LOOP_RUNNERS else ""


def _runs_loop(home: str, runner: str) -> bool:
    """`pretrain` of a Megatron `training` module (`megatron.training`, a vendored
    `codegeex.megatron.training`), `training_main` of SwissArmyTransformer (`sat`)."""
    if runner == "pretrain":
        return "megatron" in home.split(".") and "training" in home.split(".")
    return home.split(".")[0] == "sat"


def accumulates(factor: cst.BaseExpression) -> bool:
    """Whether an accumulation factor (or a `{epoch: factor}` schedule) can be above 1."""
    factors = [e.value for e in factor.elements] if isinstance(factor, cst.Dict) else [factor]
    return not all(isinstance(f, cst.Integer) and int(f.value) <= 1 for f in factors)


def _config_setting(node: cst.CSTNode) -> tuple[str | None, cst.BaseExpression | None]:
    """The key and value a config dict sets: `{"key": value}` or `config["key"] = value`."""
    if isinstance(node, cst.DictElement):
        return string_value(node.key), node.value
    if isinstance(node, cst.Assign):
        for target in node.targets:
            key = target.target.slice if isinstance(target.target, cst.Subscript) else ()
            if len(key) == 1 and isinstance(key[0].slice, cst.Index):
                return string_value(key[0].slice.value), node.value
    return None, None


def _factors(expr: cst.BaseExpression) -> Iterator[cst.BaseExpression]:
    """The factors of a product (`a * b * c`), or the expression itself."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        yield from _factors(expr.left)
        yield from _factors(expr.right)
    else:
        yield expr


def _json_accumulation(path: Path) -> int | str | None:
    """gradient_accumulation_steps from a JSON config file next to the source, when above 1."""
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("gradient_accumulation_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return value if value == "auto" or (isinstance(value, int) and value > 1) else None


def _range_length(args: list[cst.BaseExpression]) -> cst.BaseExpression | None:
    """How many values `range(...)` gives, where the code spells it: `range(k)`,
    `range(0, k)`, `range(1, k + 1)`."""
    if len(args) == 1:
        return args[0]
    if len(args) != 2:
        return None
    start, stop = args
    if isinstance(start, cst.Integer) and start.value == "0":
        return stop
    if (
        isinstance(stop, cst.BinaryOperation)
        and isinstance(stop.operator, cst.Add)
        and code(stop.right) == code(start)
    ):
        return stop.left
    return None


def calls_of(tree: Tree, function: cst.FunctionDef) -> list[cst.Call]:
    """The calls of the file, outside `function`, of that function (`helper(...)`,
    `self.helper(...)`) where the file defines it once."""
    name = function.name.value
    if tree.functions.get(name) is not function:
        return []
    return [
        call
        for call in tree.calls
        if _helper_name(call.func) == name and not tree.contains(function, call)
    ]


def runs_once(tree: Tree, function: cst.FunctionDef, hops: int = 3) -> bool:
    """Whether `function` runs once when the file runs as a script: a module-level function
    the file calls once, outside any loop, in its `if __name__ == "__main__":` block, itself or
    through a module-level function that block so calls (`main()` calling `train(...)`)."""
    calls = calls_of(tree, function)
    if tree.scope_of(function) is not tree.module or len(calls) != 1:
        return False
    (call,) = calls
    if any(isinstance(a, (*LOOPS, cst.CompFor)) for a in tree.ancestors(call)):
        return False
    caller = tree.scope_of(call)
    if caller is tree.module:
        return any(
            isinstance(a, cst.If) and code(a.test).replace("'", '"') == '__name__ == "__main__"'
            for a in tree.ancestors(call)
        )
    return isinstance(caller, cst.FunctionDef) and hops > 0 and runs_once(tree, caller, hops - 1)


def run_again(
    tree: Tree, loop: cst.CSTNode, clears: Callable[[cst.CSTNode], bool]
) -> cst.For | cst.While | None:
    """The loop that runs `loop` again with nothing between two passes that `clears` (the
    gradients, the accumulator's state): the loop around it in its function or, where there is
    none, a loop around a same-file call of that function (`for epoch in range(E):
    train_epoch(model, loader, optimizer)`), as far up the callers as they go; None where
    every pass starts anew."""
    return _run_again(tree, loop, clears, set())


def _run_again(
    tree: Tree,
    inner: cst.CSTNode,
    clears: Callable[[cst.CSTNode], bool],
    seen: set[cst.FunctionDef],
) -> cst.For | cst.While | None:
    outer = next((a for a in tree.ancestors(inner) if isinstance(a, (*LOOPS, *DEFS))), None)
    if not isinstance(outer, (*LOOPS, cst.FunctionDef)) or cleared_around(tree, inner, clears):
        return None
    if isinstance(outer, LOOPS):
        return outer
    if outer in seen:
        return None
    seen.add(outer)
    return next(
        (
            found
            for call in calls_of(tree, outer)
            if (found := _run_again(tree, call, clears, seen))
        ),
        None,
    )


def cleared_around(tree: Tree, inner: cst.CSTNode, clears: Callable[[cst.CSTNode], bool]) -> bool:
    """Whether the loop or function right around `inner` does what `clears` outside it, on a
    path that runs with it: never on the other branch of an `if` (a pipeline's `zero_grad()`
    beside the window's loop)."""
    outer = next((a for a in tree.ancestors(inner) if isinstance(a, (*LOOPS, *DEFS))), None)
    return outer is not None and any(
        clears(node) and not tree.contains(inner, node) and not _apart(tree, node, inner)
        for node in tree.walk(outer, into_defs=False)
    )


def _apart(tree: Tree, one: cst.CSTNode, other: cst.CSTNode) -> bool:
    """Whether `one` and `other` sit on different branches of one `if`."""
    return any(
        isinstance(branch, cst.If)
        and branch.orelse is not None
        and tree.contains(branch, other)
        and tree.contains(branch.body, one) != tree.contains(branch.body, other)
        and tree.contains(branch.orelse, one) != tree.contains(branch.orelse, other)
        for branch in tree.ancestors(one)
    )


def _helper_name(func: cst.BaseExpression) -> str | None:
    """The same-file function a callee can name: `helper` or `self.helper`, never
    `model.train` (another object's method of the same name)."""
    name = dotted(func) or ""
    if name.count(".") == 0 or (name.count(".") == 1 and name.startswith("self.")):
        return name.rsplit(".", 1)[-1] or None
    return None
