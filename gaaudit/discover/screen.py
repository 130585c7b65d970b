"""Which definitions of a file can hold a finding, judged on CPython's `ast` before libcst.

The byte prefilter passes every file that mentions `.backward(`: autograd code, tests,
docstrings. By the rules of `loops.py` (this is a superset of them), a backward call can
belong to an accumulation window only
- in a loop holding no optimizer step (a micro-step loop), or whose step is guarded by
  `a % k` or follows an `if a % k:` in the loop;
- in an `accumulate()` context;
- outside loops, in a function that steps under an `a % k` guard;
- anywhere, when the file names an accumulation divisor, mentions DeepSpeed, or imports a
  module of its repository (whose loss helper may divide by one).
A call handed the loss, an optimizer and a flag computed from `a % k` (a loss scaler) is a
backward and a step of its own.
A pipeline schedule matters where it is built; a Trainer override in a class deriving from
a transformers or trl Trainer (here, or through a class of another module of the
repository), and a Trainer where it is called; the other triggers (a JAX
tree map, ...) where code spells them, in a file that gives their rule what it needs.
Definitions holding none of these are blanked by `focus`; a file left with nothing is
answered without libcst.
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate
from keyword import iskeyword
from pathlib import Path

from gaaudit.discover.focus import blank, units, with_members
from gaaudit.discover.lexical import any_in_code
from gaaudit.discover.modules import (
    MAX_HOPS,
    Dependency,
    bases,
    configured_accumulation,
    derives_from_trainer,
    file_digest,
)
from gaaudit.discover.source import TRIGGERS
from gaaudit.vocabulary import (
    ACCUMULATION_NAMES,
    BACKWARDS,
    OPTIMIZER,
    PIPELINE_CLASSES,
    STEPS,
    TRAINER_MODULES,
    steps_optimizer,
    window_guards,
)

# The other rule families, each with the triggers that mark the definitions it reads. A
# family fires only where `checks/*.findings` finds what it needs: GA004 an import of
# transformers or trl, GA005 one of JAX or optax, Lightning's GA003 a
# `Trainer(accumulate_grad_batches=...)` or a `GradientAccumulationScheduler`, mmengine's GA003
# an import of mmengine. GA004 is
# judged by the classes and calls it reads (`_Judge.trainer_units`), its words by bytes.
TRAINER_WORDS = (b"compute_loss", b"training_step", b"Trainer(", b"Trainer)", b"Trainer as")
TRAINER_HOMES = {"transformers", "trl"}
JAX_WORDS = (
    b"MultiSteps",
    b"microbatching",
    b"jax.tree",
    b"tree_util",
    b"tree_map",
    b"tree.map",
    b"value_and_grad",
    b"jax.grad",
)
JAX_HOMES = {"jax", "flax", "equinox", "optax"}
LOSS_FUNCTION = "compute_loss_func"  # a Trainer argument and attribute
# The transformers heads GA004 reads where a Trainer is handed one (`trainer.TOKEN_HEADS`,
# `trainer.EXAMPLE_HEADS`).
HEADS = re.compile(
    rb"For(?:TokenClassification|MaskedLM|Seq2SeqLM|SpeechSeq2Seq|ConditionalGeneration"
    rb"|SequenceClassification|MultipleChoice)\b|MarianMTModel"
)
LIGHTNING_WORDS = (b"accumulate_grad_batches", b"GradientAccumulationScheduler")
LIGHTNING_KEPT = (*LIGHTNING_WORDS, b"training_step", b"Trainer(", b"Trainer)")
MMENGINE_WORDS = (b"accumulative_counts",)  # `OptimWrapper(accumulative_counts=k)`
MMENGINE_HOMES = {"mmengine"}
SCRIPT = b"/// script"  # GA006 reads a PEP 723 block: a comment
# What a file's bytes must hold besides a family's words for its rule to fire: the name of
# a module that imports its home, or a Lightning accumulation setting.
FAMILY_SIGNS = (
    # a class deriving from a `...Trainer` of another module: `class Corrector(BaseTrainer):`
    (TRAINER_WORDS, (*(h.encode() for h in TRAINER_HOMES), *LIGHTNING_WORDS, b"Trainer):")),
    (JAX_WORDS, tuple(h.encode() for h in JAX_HOMES)),
    (MMENGINE_WORDS, tuple(h.encode() for h in MMENGINE_HOMES)),
)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
NESTED = (*FUNCTIONS, ast.ClassDef, ast.Lambda)
LOOPS = (ast.For, ast.AsyncFor, ast.While)
BLOCKS = ("body", "orelse", "finalbody")
ASSIGNMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)
# An argument named like an optimizer (`vocabulary.OPTIMIZER`) before a comma or a bracket:
# `optimizer,`, `opt)`, not `Optional[`.
PASSED = re.compile(rb"opt\w*\s*[,)]")
RELATIVE = re.compile(rb"\bfrom\s+(\.+)\s*(?!import\b)([A-Za-z_][\w.]*)?")
DOTTED = re.compile(rb"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
# Nodes with nothing below them worth visiting (shared singletons such as `ast.Load()`).
LEAVES = (ast.expr_context, ast.operator, ast.boolop, ast.unaryop, ast.cmpop)


@dataclass(frozen=True)
class Screened:
    """What libcst should parse (None: no finding is possible), the files looked for, and
    CPython's tree of the whole file (for `source.parse`)."""

    data: bytes | None
    dependencies: frozenset[Dependency] = frozenset()
    tree: ast.Module | None = None


def screen(data: bytes, names: frozenset[str], directory: Path) -> Screened:
    """`data` focused on what can hold a finding; `names` are the configured accumulation
    names, `directory` the file's folder (for the modules it imports)."""
    read: set[Dependency] = set()
    configured = b"LightningModule" in data and configured_accumulation(directory, read)
    if SCRIPT not in data and not any_in_code(data, _trigger_offsets(data, bool(configured))):
        return Screened(None, frozenset(read))  # triggers only in strings and comments: no parse
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Screened(data)  # libcst reports the problem with its position
    lines = data.splitlines(keepends=True)
    found = units(tree)
    judge = _Judge(tree, data, lines, ACCUMULATION_NAMES | names, directory)
    owners = judge.owners(found)

    # The other triggers count for the rule families that can fire here, where code spells
    # them (not in strings or comments).
    words = judge.family_words(bool(configured))
    kept = judge.naming(words, found) if words else set()
    if judge.imports_any(TRAINER_HOMES) or judge.imports_trainer():
        kept |= judge.trainer_units(found)

    def matters(unit) -> bool:
        return unit in owners or unit in kept

    dependencies = judge.dependencies | judge.bases_read | read
    if not (owners or kept) and SCRIPT not in data:
        return Screened(None, dependencies)
    return Screened(blank(data, lines, tree, found, matters), dependencies, tree)


def _trigger_offsets(data: bytes, lightning: bool = False) -> list[int]:
    """Where the prefilter's triggers that can matter in this file start, in order: a rule
    family's words count only when the bytes also show what the family needs (`lightning`:
    the project's YAML configs set Lightning's accumulation)."""
    silent = {
        w
        for words, signs in FAMILY_SIGNS
        if not any(s in data for s in signs) and not (lightning and words is TRAINER_WORDS)
        for w in words
    }
    found = window_guards(data)
    for trigger in TRIGGERS:
        if trigger not in silent:
            at = data.find(trigger)
            while at >= 0:
                found.append(at)
                at = data.find(trigger, at + 1)
    return sorted(found)


class _TrainerUnits:
    """Part of `_Judge`: what GA004 reads, on the `ast`: classes deriving from a Trainer, and calls
    handing one a model."""

    def trainer_units(self, members: dict) -> set:
        """What GA004 reads (`checks/trainer.py`): every class deriving from a transformers
        or trl `...Trainer` (through same-file classes too), whole, and the definitions
        that call such a class, when the file has a model class (with a `forward`) to hand
        to it."""
        trainers: set[str] = set()
        grown = True
        while grown:
            found = {
                c.name
                for c in self.classes
                if any(self._is_trainer(base, trainers) for base in c.bases)
            }
            grown = not found <= trainers
            trainers |= found
        classes = {self._owner(c, members) for c in self.classes if c.name in trainers}
        kept = with_members(classes, members)
        spelled = trainers | {n for n, q in self._qualified.items() if any(map(_trainer_home, q))}
        calls = [c for c in self._calls_on(spelled) if self._is_trainer(c.func, trainers)]
        if HEADS.search(self.data) or any(
            isinstance(s, FUNCTIONS) and s.name == "forward" for c in self.classes for s in c.body
        ):  # a model to hand to a Trainer: a class of the file, or a transformers head
            kept |= {self._owner(c, members) for c in calls}
        # A `compute_loss_func` handed to a Trainer call or set in a subclass, and the call.
        given = [(c, k.value) for c in calls for k in c.keywords if k.arg == LOSS_FUNCTION]
        given += [
            (node, node.value)
            for cls in self.classes
            if cls.name in trainers
            for node in ast.walk(cls)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == LOSS_FUNCTION for t in node.targets)
        ]
        for where, value in given:
            named = self.functions.get(value.id, ()) if isinstance(value, ast.Name) else ()
            if named:
                kept |= {self._owner(where, members)} | {self._owner(f, members) for f in named}
        return kept

    def _is_trainer(self, expr: ast.expr, trainers: set[str]) -> bool:
        """`TrainerAudit._is_trainer` on the `ast`, for any import that binds the name."""
        name = _dotted(expr)
        if name is None:
            return False
        head, dot, rest = name.partition(".")
        qualified = {f"{full}{dot}{rest}" for full in self._qualified.get(head, {head})}
        return (
            name in trainers
            or any(q.startswith(TRAINER_MODULES) and q.endswith("Trainer") for q in qualified)
            or self._derived(name)
        )

    def _derived(self, name: str) -> bool:
        """Whether `name` is a `...Trainer` class the file imports from a module of its
        repository, deriving from a transformers or trl Trainer there (`derives_from_trainer`;
        the files read join `bases_read`)."""
        if not name.endswith("Trainer"):
            return False
        return any(
            derives_from_trainer(
                self.directory, node.level, node.module or "", alias.name, self.bases_read
            )
            for node in self.imports
            if isinstance(node, ast.ImportFrom) and not _trainer_home(node.module or "")
            for alias in node.names
            if (alias.asname or alias.name) == name
        )

    def imports_trainer(self) -> bool:
        """Whether the file subclasses a `...Trainer` it imports from its repository that
        derives from a transformers or trl Trainer."""
        return any(self._derived(_dotted(b) or "") for c in self.classes for b in c.bases)

    @cached_property
    def _qualified(self) -> dict[str, set[str]]:
        """Local name -> the qualified names imports bind it to (`Tree.imports`, each
        binding kept)."""
        table: dict[str, set[str]] = {}
        for node in self.imports:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    head = alias.name.split(".")[0]
                    local, full = (alias.asname, alias.name) if alias.asname else (head, head)
                    table.setdefault(local, set()).add(full)
            elif all(alias.name != "*" for alias in node.names):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}" if node.module else alias.name
                    table.setdefault(alias.asname or alias.name, set()).add(full)
        return table


class _Lines:
    """Part of `_Judge`: nodes found by line: searches of the text mapped to the `ast` nodes on
    those lines."""

    def _lines_with(self, words) -> list[int]:
        """The numbers of the lines holding one of `words` (str), in order: a search per
        word runs at memory speed, where one alternation of them crawls."""
        data, starts, numbers = self.data, self._starts, set()
        for word in filter(None, words):
            needle = word.encode()
            at = data.find(needle)
            while at >= 0:
                numbers.add(bisect_right(starts, at))
                at = data.find(needle, at + len(needle))
        return sorted(numbers)

    @cached_property
    def _starts(self) -> list[int]:
        """The offset where each line starts."""
        return list(accumulate(map(len, self.lines[:-1]), initial=0))

    def _nodes_on(self, numbers: list[int]) -> Iterator[ast.AST]:
        """The nodes whose lines include one of `numbers` (sorted), with their parents."""
        stack = [self.tree] if numbers else []
        while stack:
            node = stack.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                if isinstance(child, LEAVES):
                    continue
                start = getattr(child, "lineno", None)
                if start is not None:
                    decorators = getattr(child, "decorator_list", None)
                    start = decorators[0].lineno if decorators else start  # `@jax.grad` above
                    index = bisect_left(numbers, start)
                    if index == len(numbers) or numbers[index] > child.end_lineno:
                        continue
                self.parents[child] = node
                stack.append(child)

    def _calls_on(self, words) -> list[ast.Call]:
        """Calls on the lines holding one of `words`."""
        return [n for n in self._nodes_on(self._lines_with(words)) if isinstance(n, ast.Call)]

    def _own_nodes(self, region: ast.AST) -> Iterator[ast.AST]:
        """The nodes inside `region` (itself included), not entering nested definitions,
        with their parents."""
        stack = [region]
        while stack:
            node = stack.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (*NESTED, *LEAVES)):
                    self.parents[child] = node
                    stack.append(child)

    def _ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def _owner(self, node: ast.AST, members) -> ast.AST | None:
        """The innermost of `members` that is or holds `node`."""
        return next((a for a in (node, *self._ancestors(node)) if a in members), None)

    def _statement(self, node: ast.AST) -> ast.AST:
        """The statement holding `node`."""
        return next((a for a in (node, *self._ancestors(node)) if isinstance(a, ast.stmt)), node)

    def _after(self, node: ast.AST) -> Iterator[ast.AST]:
        """The statements following `node` in its block, and after its enclosing blocks, up
        to the function, module or loop holding them (`loops.Structure._after`)."""
        while node in self.parents:
            parent = self.parents[node]
            block, index = _place(parent, node)
            yield from block[index + 1 :]
            if isinstance(parent, (*FUNCTIONS, ast.Module, *LOOPS)):
                return
            node = parent


class _Windows:
    """Part of `_Judge`: whether a backward call may be in an accumulation window: loops, modulo
    guards, stepping helpers and callables, pipeline schedules, the repository's modules."""

    def _enclosing_names(self, calls: list[ast.Call]) -> set[str]:
        """Names of the functions of the file holding one of `calls`."""
        return {a.name for c in calls for a in self._ancestors(c) if isinstance(a, FUNCTIONS)}

    @cached_property
    def _step_names(self) -> set[str]:
        """The `STEPS`, and functions of the file that call one (`.step(...)`)."""
        steps = [c for c in self._calls_on(STEPS) if _last(c.func) in STEPS]
        return STEPS | self._enclosing_names(steps)

    def _steps(self, call: ast.Call) -> bool:
        """Whether a call certainly steps an optimizer: `loops.is_step`, or a call of a function
        of the file every definition of which makes such a call itself."""
        return _is_step(call) or _last(call.func) in self._stepping_helpers

    @cached_property
    def _stepping_helpers(self) -> set[str]:
        return {
            name
            for name in self._step_names - STEPS
            if all(
                any(isinstance(n, ast.Call) and _is_step(n) for n in self._own_nodes(function))
                for function in self.functions.get(name, ())
            )
        }

    def _open(self) -> bool:
        """Whether every backward call may be judged by the loss alone: the file names an
        accumulation divisor, uses DeepSpeed, or imports a module of its repository."""
        return self._names_divisor() or b"deepspeed" in self.data or self._imports_repository()

    def _names_divisor(self) -> bool:
        numbers = self._lines_with(self.names)
        return any(
            (isinstance(n, ast.Name) and n.id in self.names)
            or (isinstance(n, ast.Attribute) and n.attr in self.names)
            for n in self._nodes_on(numbers)
        )

    def _in_window(self, call: ast.Call) -> bool:
        loop, scope = None, self.tree
        for node in self._ancestors(call):
            if isinstance(node, (*FUNCTIONS, ast.Module)):
                scope = node
                break
            if isinstance(node, (ast.With, ast.AsyncWith)) and any(
                _is_accumulate(item.context_expr) for item in node.items
            ):
                return True
            if loop is None and isinstance(node, LOOPS):
                loop = node
        if loop is not None:
            return self._loop_window(loop)
        if isinstance(scope, FUNCTIONS):
            return any(
                self._guarded(s, scope, skipping=False) or self._steps_guarded_in(s)
                for s in self._steps_in(scope)
            )
        return False

    def _steps_guarded_in(self, call: ast.Call) -> bool:
        """Whether `call` calls a function of the file that steps under a test of `a % k`
        (`loops.Structure._calls_window`, one hop)."""
        return any(
            self._guarded(s, function, skipping=False)
            for function in self.functions.get(_last(call.func) or "", ())
            for s in self._steps_in(function)
            if _is_step(s)
        )

    def _loop_window(self, loop: ast.AST) -> bool:
        """Whether a loop holding backward calls may be an accumulation window (each loop
        judged once: its backward calls all ask)."""
        if loop not in self._windows:
            steps = self._steps_in(loop)
            self._windows[loop] = any(self._guarded(s, loop, skipping=True) for s in steps) or (
                not any(self._steps(s) for s in steps) and self._micro_loop(loop)
            )
        return self._windows[loop]

    def _micro_loop(self, loop: ast.AST) -> bool:
        """Whether a loop of backward calls may be a micro-step loop: it neither clears nor
        reads the gradients, and a step or a gradient read may follow it, in its function or
        after a call of that function (`loops.Structure._micro_window`)."""
        if any(
            _reads_grad(n, activations=False)
            or (isinstance(n, ast.Call) and _last(n.func) == "zero_grad")
            for n in self._own_nodes(loop)
        ):
            return False
        if any(
            _reads_grad(n) or self._may_step(n)
            for statement in self._after(loop)
            for n in self._own_nodes(statement)
        ):
            return True
        function = next((a for a in self._ancestors(loop) if isinstance(a, FUNCTIONS)), None)
        if function is None:
            return False
        callers = [
            c
            for c in self._calls_on({function.name})
            if _last(c.func) == function.name
            and function not in self._ancestors(c)
            and any(
                self._may_step(n)
                for statement in self._after(self._statement(c))
                for n in self._own_nodes(statement)
            )
        ]
        self._callers += callers
        return bool(callers)

    def _stepping_callables(self) -> list[ast.Call]:
        """Calls handed the loss, an optimizer and a flag computed from `a % k`
        (`loops.Structure.stepping_callable`), on the lines that pass an argument named like
        an optimizer."""
        if b"%" not in self.data:
            return []
        starts = self._starts
        numbers = sorted({bisect_right(starts, m.start()) for m in PASSED.finditer(self.data)})
        return [
            call
            for call in self._nodes_on(numbers)
            if isinstance(call, ast.Call)
            and call.args
            and any(OPTIMIZER.search(_last(a) or "") for a in _arguments(call))
            and any(self._modular(a) for a in _arguments(call)[1:])
        ]

    def _may_step(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and _last(node.func) in self._step_names

    def _steps_in(self, region: ast.AST) -> list[ast.Call]:
        """Calls in `region` (not in nested definitions) that may step an optimizer (each
        region walked once: its backward calls all ask)."""
        if region not in self._region_steps:
            found = [n for n in self._own_nodes(region) if self._may_step(n)]
            self._region_steps[region] = found
        return self._region_steps[region]

    def _guarded(self, step: ast.Call, region: ast.AST, skipping: bool) -> bool:
        """Whether an `if` inside `region` testing `a % k` (or `n == k` where it sets `n` back
        to 0) holds the step or, with `skipping`, comes before it in one of the blocks holding
        it."""
        node = step
        while node is not region and node in self.parents:
            parent = self.parents[node]
            if isinstance(parent, ast.If) and (self._modular(parent.test) or _resets(parent)):
                return True
            if skipping:
                block, index = _place(parent, node)
                if any(isinstance(s, ast.If) and self._modular(s.test) for s in block[:index]):
                    return True
            node = parent
        return False

    def _modular(self, test: ast.expr) -> bool:
        """Whether a test computes `a % k`, or reads a name assigned from such a value, or
        tests a window's last index (`a == k - 1`, `loops.Structure._last_index`)."""
        return (
            bool(self._modular_names)
            and any(
                _is_modulo(n) or (isinstance(n, ast.Name) and n.id in self._modular_names)
                for n in ast.walk(test)
            )
        ) or self._last_index(test)

    def _last_index(self, test: ast.expr) -> bool:
        if not (isinstance(test, ast.Compare) and [type(o) for o in test.ops] == [ast.Eq]):
            return False
        sides = (test.left, test.comparators[0])
        for side, other in (sides, sides[::-1]):
            one = (
                isinstance(side, ast.BinOp)
                and isinstance(side.right, ast.Constant)
                and side.right.value == 1
            )
            size = side.left if one and isinstance(side.op, ast.Sub) else None
            size = other if one and isinstance(side.op, ast.Add) else size
            if size is not None and (_last(size) or "") in self.names:
                return True
        return False

    @cached_property
    def _modular_names(self) -> set[str]:
        """Names assigned anywhere from a value holding `a % b` (and "%" when the file
        computes one at all)."""
        found = set()
        for node in self._nodes_on(self._lines_with({"%"})):
            if _is_modulo(node):
                found.add("%")
                for holder in self._ancestors(node):
                    if isinstance(holder, ASSIGNMENTS):
                        targets = (
                            holder.targets if isinstance(holder, ast.Assign) else [holder.target]
                        )
                        found |= {
                            n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)
                        }
        return found

    @cached_property
    def _pipeline_aliases(self) -> set[str]:
        return {
            alias.asname
            for node in self.imports
            for alias in node.names
            if alias.asname and alias.name.rpartition(".")[2] in PIPELINE_CLASSES
        }

    def _imports_repository(self) -> bool:
        seen: set[Dependency] = set()
        modules = [m for node in self.imports for m in _imported(node)]
        found = _reaches_divisor(modules, self.directory, _pattern(self.names), seen, set())
        self.dependencies = frozenset(seen)
        return found


class _Judge(_TrainerUnits, _Lines, _Windows):
    """The calls of one tree that can start a finding: backward calls that can belong to a
    window, and pipeline schedules. Only the lines that mention what is looked for are
    descended into, and the parents of the nodes visited are recorded on the way."""

    def __init__(self, tree: ast.Module, data: bytes, lines: list[bytes], names, directory):
        self.tree, self.data, self.lines = tree, data, lines
        self.names, self.directory = names, directory
        self.dependencies: frozenset[Dependency] = frozenset()
        self.bases_read: set[Dependency] = set()  # read for classes' bases (`_derived`)
        self.parents: dict[ast.AST, ast.AST] = {}
        self._region_steps: dict[ast.AST, list[ast.Call]] = {}
        self._windows: dict[ast.AST, bool] = {}
        self._callers: list[ast.Call] = []  # calls of a micro-step loop's function that step after
        self.functions: dict[str, list[ast.AST]] = {}
        self.classes: list[ast.ClassDef] = []
        self.imports: list[ast.Import | ast.ImportFrom] = []
        for holder, node in _statements(tree):
            self.parents[node] = holder
            if isinstance(node, FUNCTIONS):
                self.functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes.append(node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.append(node)

    def owners(self, members: dict) -> set:
        """The `members` (from `focus.units`) holding a call that can start a finding, and
        None when module-level code holds one."""
        classes = PIPELINE_CLASSES | self._pipeline_aliases
        sites = [c for c in self._calls_on(classes) if _last(c.func) in classes]
        backwards = [c for c in self._calls_on(BACKWARDS) if _last(c.func) in BACKWARDS]
        helpers = self._enclosing_names(backwards)
        backwards += [c for c in self._calls_on(helpers) if _last(c.func) in helpers]
        if backwards and self._open():
            sites += backwards
        else:
            sites += [c for c in backwards if self._in_window(c)]
        sites += self._stepping_callables()
        return {self._owner(site, members) for site in (*sites, *self._callers)}

    def family_words(self, configured: bool = False) -> tuple[bytes, ...]:
        """The triggers of the rule families, but GA004's, that can fire in this file
        (`configured`: the project's YAML configs set Lightning's accumulation)."""
        words: tuple[bytes, ...] = ()
        if self.imports_any(JAX_HOMES):
            words += JAX_WORDS
        if configured or self.naming(LIGHTNING_WORDS, {}):
            words += LIGHTNING_KEPT
        if self.imports_any(MMENGINE_HOMES):
            words += MMENGINE_WORDS
        return words

    def imports_any(self, homes: set[str]) -> bool:
        """Whether the file imports a module whose first part is one of `homes`."""
        return bool(self._tops & homes)

    @cached_property
    def _tops(self) -> set[str]:
        """The first parts of the modules the file imports."""
        tops = set()
        for node in self.imports:
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif node.module:
                tops.add(node.module.split(".")[0])
            else:
                tops |= {alias.name for alias in node.names}
        return tops

    def naming(self, triggers: tuple[bytes, ...], members: dict) -> set:
        """The `members` whose code names one of `triggers` (None for module-level code)."""
        words = {t.decode().strip("()") for t in triggers}
        return {
            self._owner(node, members)
            for node in self._nodes_on(self._lines_with(words))
            if any(_spells(node, word) for word in words)
        }


def _reaches_divisor(modules, directory: Path, pattern, seen: set, visited: set, hops=0) -> bool:
    """Whether a module of the repository among `modules` ((dots, parts) imported by a file
    in `directory`) may divide a loss by an accumulation name: its bytes name one, it is a
    package folder, or a module it imports does (a few modules deeper than the analysis
    follows). Every file looked for is added to `seen`."""
    for level, parts in modules:
        for base in bases(directory, level, parts):
            for path in _candidates(base, parts):
                digest = file_digest(path)
                if not digest and path.is_dir():
                    return True
                seen.add(Dependency(str(path), digest))
                if digest and path not in visited:
                    visited.add(path)
                    if _divides(path, pattern, seen, visited, hops):
                        return True
    return False


def _divides(path: Path, pattern, seen: set, visited: set, hops: int) -> bool:
    """Whether a module file names an accumulation divisor, or one of its imports may."""
    try:
        data = path.read_bytes()
    except OSError:
        return False  # the analysis cannot summarise it either
    if pattern.search(data):
        return True
    if hops > MAX_HOPS:
        return False
    return _reaches_divisor(_referenced(data), path.parent, pattern, seen, visited, hops + 1)


def _referenced(data: bytes) -> Iterator[tuple[int, list[str]]]:
    """A superset of the modules a file's import statements name, read from its lines
    without parsing: every dotted name on a line that says `import`, absolute and below
    each `from .x` of the line."""
    for line in data.replace(b"\\\n", b" ").splitlines():
        if b"import" not in line:
            continue
        words = [w.decode("ascii") for w in DOTTED.findall(line)]
        words = [w.split(".") for w in words if not iskeyword(w)]
        for dots, module in RELATIVE.findall(line):
            parts = module.decode("ascii").split(".") if module else []
            yield len(dots), parts
            yield from ((len(dots), [*parts, *word]) for word in words)
        yield from ((0, word) for word in words)


@lru_cache(maxsize=8)
def _pattern(names: frozenset[str]) -> re.Pattern[bytes]:
    """The accumulation names as whole words."""
    words = b"|".join(re.escape(n.encode()) for n in sorted(names))
    return re.compile(rb"\b(?:" + words + rb")\b")


def _imported(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[int, list[str]]]:
    """The modules an import statement may reach, as (dots, parts): for `from m import n`,
    both `m` and `m.n` (n may be a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield 0, alias.name.split(".")
        return
    module = [p for p in (node.module or "").split(".") if p]
    yield node.level, module
    for alias in node.names:
        if alias.name != "*":
            yield node.level, [*module, alias.name]


def _candidates(base: Path, parts: list[str]) -> tuple[Path, ...]:
    """Where a module's first part would be under `base`: a module file or a package folder."""
    if not parts:
        return (base / "__init__.py",)
    return (base / f"{parts[0]}.py", base / parts[0])


def _resets(guard: ast.If) -> bool:
    """`if n == k:` whose body sets `n` back to 0 (`loops.Structure._last_index`)."""
    test = guard.test
    if not (isinstance(test, ast.Compare) and [type(o) for o in test.ops] == [ast.Eq]):
        return False
    counters = {side.id for side in (test.left, test.comparators[0]) if isinstance(side, ast.Name)}
    return any(
        isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Constant)
        and stmt.value.value == 0
        and any(isinstance(t, ast.Name) and t.id in counters for t in stmt.targets)
        for stmt in guard.body
    )


def _statements(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.AST]]:
    """Every statement (and `except` clause, `case`) of a tree, not entering expressions,
    with the node holding it."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                for statement in block:
                    yield node, statement
                    stack.append(statement)


def _place(parent: ast.AST, node: ast.AST) -> tuple[list, int]:
    """The block of `parent` holding `node`, and its index there (an empty block when
    `node` is no statement of one)."""
    for field in BLOCKS:
        block = getattr(parent, field, None)
        if isinstance(block, list):
            for index, statement in enumerate(block):
                if statement is node:
                    return block, index
    return [], 0


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _trainer_home(qualified: str) -> bool:
    """Whether a qualified name is in a module a Trainer comes from, or is one of them."""
    return qualified.startswith(TRAINER_MODULES) or f"{qualified}." in TRAINER_MODULES


def _identifiers(node: ast.AST) -> tuple[str, ...]:
    """The identifiers a node spells itself (not those of its children)."""
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        return (node.attr,)
    if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
        return (node.name,)
    if isinstance(node, (ast.arg, ast.keyword)):
        return (node.arg or "",)
    if isinstance(node, ast.alias):
        return (node.name, node.asname or "")
    if isinstance(node, ast.ImportFrom):
        return (node.module or "",)
    return ()


def _spells(node: ast.AST, word: str) -> bool:
    """Whether one of a node's own identifiers ends with `word` (`Seq2SeqTrainer` for
    `Trainer`: the rules match names so, or exactly); a dotted word (`jax.tree`) must be an
    attribute of that name or part of an imported name."""
    head, dot, last = word.rpartition(".")
    if not dot:
        return any(name.endswith(word) for name in _identifiers(node))
    if isinstance(node, ast.Attribute):
        return node.attr.startswith(last) and _last(node.value) == head.rpartition(".")[2]
    return isinstance(node, (ast.alias, ast.ImportFrom)) and any(
        word in name for name in _identifiers(node)
    )


def _is_modulo(node: ast.AST) -> bool:
    """`loops._is_modulo` on the `ast`."""
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mod)
        and not isinstance(node.left, ast.JoinedStr)
        and not (isinstance(node.left, ast.Constant) and isinstance(node.left.value, str))
    )


def _reads_grad(node: ast.AST, activations: bool = True) -> bool:
    """`loops.Structure._reads_grad` on one node."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "grad"
        and (activations or not isinstance(node.value, ast.Subscript))
    )


def _arguments(call: ast.Call) -> list[ast.expr]:
    """A call's argument values, positional first."""
    return [*call.args, *(k.value for k in call.keywords)]


def _last(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_step(call: ast.Call) -> bool:
    """`loops.is_step` on the `ast`."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in STEPS):
        return False
    positional = sum(not isinstance(a, ast.Starred) for a in call.args)
    return steps_optimizer(_last(func.value) or "", positional)


def _is_accumulate(item: ast.expr) -> bool:
    return (
        isinstance(item, ast.Call)
        and isinstance(item.func, ast.Attribute)
        and item.func.attr == "accumulate"
    )
