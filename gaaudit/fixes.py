"""Plan the sum-and-count rewrite of each finding (GA-GUIDE sections 4-5) as node-keyed edits."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from gaaudit.checks.accumulation import Auditor, Site
from gaaudit.loops import Window, is_step
from gaaudit.provenance import Origin
from gaaudit.tree import Tree, code, dotted, keyword, positional

CAUSAL = re.compile(r"ForCausalLM|LMHeadModel|CausalLM")
NO_SHIFT = re.compile(
    r"Seq2SeqLM|ForConditionalGeneration|MaskedLM|ForTokenClassification|MTModel|EncoderDecoderModel"
)
TOKEN_LOSSES = ("cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss")


@dataclass
class Edits:
    """Node-keyed changes for one file, applied in one pass (see `codemod`)."""

    replace: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict)
    before: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)

    def insert_before(self, anchor: cst.CSTNode, source: str) -> None:
        self.before.setdefault(anchor, []).extend(_statements(source))

    def insert_after(self, anchor: cst.CSTNode, source: str) -> None:
        self.after.setdefault(anchor, []).extend(_statements(source))


@dataclass(frozen=True)
class Outcome:
    """What happened to one finding: fixed (safe or unsafe) or skipped, and why."""

    site: Site
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


def _atom(expr: cst.BaseExpression) -> str:
    """An expression's code, parenthesised unless it already binds tighter than `.attr`."""
    text = code(expr)
    return text if isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) else f"({text})"


def _statements(source: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(source).body)


class Unfixable(Exception):
    """A finding the fixer cannot rewrite safely; the message says why."""


class Planner:
    """Turns the sites of one file into edits, one accumulation window at a time."""

    def __init__(self, tree: Tree, auditor: Auditor, unsafe: bool = False) -> None:
        self.tree, self.auditor, self.unsafe = tree, auditor, unsafe
        self.edits = Edits()
        self.text = tree.module.code
        self.micro = self._fresh("micro_tokens")
        self.window_total = self._fresh("window_tokens")
        self._prepared: set[cst.CSTNode] = set()

    def _fresh(self, name: str) -> str:
        taken = {n.value for n in self.tree.walk(self.tree.module) if isinstance(n, cst.Name)}
        candidate, suffix = name, 1
        while candidate in taken:
            suffix += 1
            candidate = f"{name}_{suffix}"
        return candidate

    def plan(self, sites: list[Site]) -> list[Outcome]:
        outcomes = []
        for site in sites:
            saved = self._snapshot()
            try:
                count, safe = self.count(site)
                if not safe and not self.unsafe:
                    raise Unfixable(f"unsafe fix ({count[1]}); apply with --unsafe-fixes")
                self._rewrite(site, count[0])
                outcomes.append(Outcome(site, *self._position(site), True))
            except (Unfixable, cst.ParserSyntaxError) as exc:
                self.edits, self._prepared = saved
                reason = str(exc) if isinstance(exc, Unfixable) else "gaaudit could not build a valid rewrite"
                outcomes.append(Outcome(site, *self._position(site), False, reason))
        return outcomes

    def _position(self, site: Site) -> tuple[int, int]:
        span = self.tree.span(site.node)
        return span.line, span.column

    def _snapshot(self) -> tuple[Edits, set[cst.CSTNode]]:
        """A copy to restore when a site turns out unfixable half-way through planning."""
        copy = Edits(
            dict(self.edits.replace),
            {k: list(v) for k, v in self.edits.before.items()},
            {k: list(v) for k, v in self.edits.after.items()},
        )
        return copy, set(self._prepared)

    # --- the count of valid targets in one micro-batch -------------------------------------

    def count(self, site: Site) -> tuple[tuple[str, str], bool]:
        """(count expression, caveat) and whether the fix is safe."""
        origin = site.origin
        source = origin.source
        if site.kind == "framework-division" and self._accelerator(site) is None:
            raise Unfixable(
                "the framework divides by the accumulation steps internally; gaaudit has no safe "
                "rewrite for it (see `gaaudit explain GA003`)"
            )
        if origin.kind != "mean" or source is None:
            raise Unfixable("gaaudit could not tell what the loss averages over")
        if self.tree.scope_of(source) is not self.tree.scope_of(site.backward.call):
            raise Unfixable("the loss is computed in another function; its targets are not visible here")
        if isinstance(source, (cst.Attribute, cst.Subscript)):
            return self._model_count(source), True
        if isinstance(source, cst.BinaryOperation):
            return (code(source.right), ""), True
        if isinstance(source, cst.Call):
            return self._call_count(source, origin)
        raise Unfixable("gaaudit could not tell what the loss averages over")

    def _model_count(self, source: cst.CSTNode) -> tuple[str, str]:
        call = self.auditor.tracer.origin_call(source.value)
        labels = None
        if call is not None:
            labels = keyword(call, "labels")
            if labels is not None:
                labels = code(labels)
            else:
                spread = next((a.value for a in call.args if a.star == "**"), None)
                if spread is not None:
                    labels = f'{code(spread)}["labels"]'
        if labels is None:
            raise Unfixable("the labels passed to the model are not visible at the loss")
        causal, plain = CAUSAL.search(self.text), NO_SHIFT.search(self.text)
        if bool(causal) == bool(plain):
            raise Unfixable("cannot tell whether the model shifts its labels (causal LM) or not")
        shifted = f"{labels}[..., 1:]" if causal else labels
        return f"({shifted} != -100).sum()", ""

    def _call_count(self, call: cst.Call, origin: Origin) -> tuple[tuple[str, str], bool]:
        func = call.func
        qualified = self.tree.qualified(func) or ""
        if qualified in ("torch.mean", "torch.nanmean"):
            return (f"{_atom(positional(call)[0])}.numel()", ""), True
        if isinstance(func, cst.Attribute) and func.attr.value in ("mean", "nanmean"):
            return (f"{_atom(func.value)}.numel()", ""), True
        if origin.from_model:
            return self._returned_count(call)
        configured = self.auditor.tracer.loss_instance(func) or call
        name = (self.tree.qualified(configured.func) or "").rsplit(".", 1)[-1]
        args = positional(call)
        target = keyword(call, "target") or keyword(call, "targets") or (args[1] if len(args) > 1 else None)
        if target is None:
            raise Unfixable("the target tensor of the loss is not visible")
        if name not in TOKEN_LOSSES:
            return (f"{_atom(target)}.numel()", ""), True
        ignore = keyword(configured, "ignore_index")
        return (f"({code(target)} != {code(ignore) if ignore else '-100'}).sum()", ""), True

    def _returned_count(self, call: cst.Call) -> tuple[tuple[str, str], bool]:
        args = positional(call)
        target = keyword(call, "targets") or keyword(call, "labels") or (args[1] if len(args) > 1 else None)
        if target is None:
            raise Unfixable("the targets passed to the model are not visible")
        ignore = re.search(r"ignore_index\s*=\s*(-?\d+)", self.text) or re.search(r"(-100)\b", self.text)
        if ignore:
            return (f"({code(target)} != {ignore.group(1)}).sum()", ""), True
        return (f"{_atom(target)}.numel()", "assumes every target counts: no ignore_index is visible"), False

    # --- the rewrite --------------------------------------------------------------------------

    def _rewrite(self, site: Site, count: str) -> None:
        """Weight the micro-batch's mean by its count, then prepare the window's one division."""
        factor = self.micro + self._framework_factor(site)
        if site.kind == "loss-division":
            node = site.division.node
            anchor = self._line(node)
            if isinstance(node, cst.AugAssign):
                new = node.with_changes(operator=cst.MultiplyAssign(), value=cst.parse_expression(factor))
            else:
                new = cst.parse_expression(f"{code(node.left)} * {factor}")
                new = new.with_changes(lpar=node.lpar, rpar=node.rpar)
        else:
            node = site.backward.loss
            anchor = self._line(site.backward.call)
            text = f"({code(node)})" if isinstance(node, cst.BinaryOperation) else code(node)
            new = cst.parse_expression(f"{text} * {factor}")
            if isinstance(self.tree.parents[node], cst.Attribute):  # `(loss * n).backward()`
                new = new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            if site.kind == "gradient-division":
                self._remove(site.division.node, site.window)
        if node not in self.edits.replace:
            self.edits.replace[node] = new
        if anchor not in self.edits.before:
            self.edits.insert_before(anchor, f"{self.micro} = {count}\n{self.window_total} += {self.micro}\n")
        self._prepare_window(site)

    def _framework_factor(self, site: Site) -> str:
        receiver = self._accelerator(site)
        if receiver and (site.window.kind == "accumulate" or "gradient_accumulation_steps=" in self.text):
            return f" * {receiver}.gradient_accumulation_steps"
        return ""

    def _accelerator(self, site: Site) -> str | None:
        if site.backward.call is None:
            return None
        func = site.backward.call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "backward" and positional(site.backward.call):
            name = dotted(func.value) or ""
            return name if "accelerator" in name.lower() else None
        return None

    def _remove(self, node: cst.CSTNode, window: Window) -> None:
        """Drop a `p.grad.div_(k)` statement, with the `for`/`if` left holding nothing else."""
        statement = self._line(node)
        while True:
            owner = self.tree.parents.get(self.tree.parents[statement])
            block = self.tree.parents[statement]
            if not isinstance(owner, (cst.For, cst.If, cst.With)) or owner is window.anchor:
                break
            if len(block.body) != 1 or (isinstance(owner, (cst.For, cst.If)) and owner.orelse):
                break
            statement = owner
        self.edits.replace[statement] = cst.RemovalSentinel.REMOVE

    def _prepare_window(self, site: Site) -> None:
        window = site.window
        if window.anchor in self._prepared:
            return
        self._prepared.add(window.anchor)
        optimizer = self._optimizer(window)
        normalize = self._normalization(site, optimizer)
        if window.kind == "modulo":
            self.edits.insert_before(self._line(window.loop), f"{self.window_total} = 0\n")
            first = window.anchor.body.body[0]
            self.edits.insert_before(first, normalize + f"{self.window_total} = 0\n")
        elif window.kind == "micro-loop":
            self.edits.insert_before(self._line(window.loop), f"{self.window_total} = 0\n")
            self.edits.insert_after(self._line(window.loop), normalize)
        elif window.kind == "accumulate":
            outer = next((a for a in self.tree.ancestors(window.anchor) if isinstance(a, (cst.For, cst.While))), None)
            receiver = self._accelerator(site)
            if outer is None or receiver is None:
                raise Unfixable("the accumulate() window has no accelerator.backward in a loop")
            self.edits.insert_before(self._line(outer), f"{self.window_total} = 0\n")
            body = "\n".join("    " + line for line in (normalize + f"{self.window_total} = 0").splitlines())
            self.edits.insert_after(self._line(site.backward.call), f"if {receiver}.sync_gradients:\n{body}\n")
        else:
            raise Unfixable("the optimizer step is not in this function; gaaudit cannot place the one division")

    def _optimizer(self, window: Window) -> str:
        regions = window.step_region if window.kind != "accumulate" else (window.anchor,)
        for region in regions:
            for call in self.auditor.structure.steps_in(region):
                if is_step(call):
                    args = positional(call)
                    return code(args[0]) if args else code(call.func.value)
        raise Unfixable(
            "no optimizer step is visible for this window; gaaudit cannot tell whose gradients to divide"
        )

    def _normalization(self, site: Site, optimizer: str) -> str:
        """Divide the window's gradients once by its token count (gathered across processes)."""
        total, scale = self.window_total, f"max({self.window_total}, 1)"
        gather = ""
        receiver = self._accelerator(site)
        dist = self._distributed()
        if receiver:
            gather = f"{total} = {receiver}.reduce({total}, reduction=\"sum\")\n"
            scale = f"{scale} / {receiver}.num_processes"
        elif dist:
            gather = (
                f"{total} = torch.as_tensor({total}, device={optimizer}.param_groups[0][\"params\"][0].device)\n"
                f"{dist}.all_reduce({total})\n"
            )
            scale = f"{scale} / {dist}.get_world_size()"
        return (
            gather
            + f"for group in {optimizer}.param_groups:\n"
            + "    for param in group[\"params\"]:\n"
            + "        if param.grad is not None:\n"
            + f"            param.grad.div_({scale})\n"
        )

    def _distributed(self) -> str | None:
        """The local name of torch.distributed when the file trains with it, else None."""
        if "DistributedDataParallel" not in self.text and "torch.distributed" not in self.text:
            return None
        for local, full in self.tree.imports.items():
            if full == "torch.distributed":
                return local
        return "torch.distributed" if "torch" in self.tree.imports else None

    def _line(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement holding `node` that sits directly in a block."""
        for candidate in (node, *self.tree.ancestors(node)):
            parent = self.tree.parents.get(candidate)
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                return candidate
            if isinstance(parent, cst.SimpleStatementSuite):
                raise Unfixable("the statement shares a line with its block header; put it on its own line")
        raise Unfixable("cannot find the statement to rewrite")
