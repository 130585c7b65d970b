"""Loss helpers defined in other modules of the repository, summarised on demand.

A training script often takes its loss from a helper of its own package
(`from .losses import masked_lm_loss`). When the tracer meets a call to an imported
name, the module is located next to the file (relative imports) or under the folders
holding its package or project (absolute ones), parsed with only that helper kept (see
`focus`), and the helper's return value is summarised: a mean, a sum, elementwise or
unknown, with its description and the divisions on its way. Nothing is imported or run.
Summaries, not trees, are kept, once per process and module content: each worker of a
run builds each summary it needs once.

Every file read (or looked for) on the way is recorded as a `Dependency` of the file
being checked: its findings stay current as long as those files are unchanged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import libcst as cst

from gaaudit.analysis.evidence import Evidence, scan
from gaaudit.analysis.jaxtrace import tracer_for
from gaaudit.analysis.provenance import Division, Kind, Origin, Tracer, unguarded
from gaaudit.analysis.tree import (
    Parameter,
    Tree,
    argument_for,
    call_parameters,
    code,
    dotted,
    positional,
    spread,
    substituted,
    variables,
    walk,
)
from gaaudit.discover.focus import focus
from gaaudit.discover.modules import MAX_HOPS, Dependency, file_digest, locate, shown
from gaaudit.discover.source import SourceError, parse

LOSS_METHODS = ("forward", "__call__")
# A module of the repository that builds the data, by its name: `data`, `custom_dataset`,
# `data_loader`, `collators`, `data_utils` (not `data_parallel` or `metadata`).
DATA_MODULE = re.compile(
    r"(?i)(?<![a-z])(?:data(?:sets?|_?loaders?|_?modules?)?|collat\w*)(?:_?utils?)?$"
)

# How a function of a tree averages the gradients of the micro-steps it runs: line, divisor.
Averaging = Callable[[Tree, str], "tuple[int, str] | None"]
MOVES = ("cuda", "cpu", "to", "half", "float", "bfloat16", "train", "eval")  # return the module
LOSS_METHOD_DEFS = tuple(f"def {m}(".encode() for m in LOSS_METHODS)  # kept by `focus`


@dataclass(frozen=True)
class Returned:
    """One value a helper returns, as a loss."""

    kind: Kind
    what: str
    line: int | None  # where the loss is made in the helper's module
    via: str
    divisors: tuple[tuple[str, int | None], ...]  # each divisor's code, and which parameter it is
    variable: str  # a sign of variable valid-token counts where a further module computes it
    count: str = ""  # what a mean divides by, in the helper's parameters ("" when not shown)
    reduces: str = ""  # what a mean of a further helper's parameter averages (Origin.reduces)
    ignored: str = ""  # what its count leaves out (Origin.ignored)
    rows: bool = False  # a mean of per-row means (Origin.rows)


@dataclass(frozen=True)
class Summary:
    """What a function, or a loss class's `forward`, of another module returns."""

    path: Path
    name: str  # `masked_lm_loss`, or `MaskedLoss.forward`
    is_class: bool
    value: Returned | None  # the first return value that is a loss
    items: tuple[Returned, ...]  # the elements of a returned tuple
    parameters: tuple[Parameter, ...]  # those a call passes, in order
    variable: str  # a sign of variable valid-token counts in the helper's code, and where
    passes: int | None = None  # the parameter it returns as it came (`return model`)
    bases: str = ""  # a class's bases as written (`MiniMindForCausalLM`)


@dataclass(frozen=True)
class Reference:
    """A name imported from a module: `from ..pkg.losses import masked_lm_loss`."""

    level: int  # the dots of a relative import
    module: str  # dotted, below the level; "" for the package itself
    name: str  # "" when the local name is the module itself (`import pkg.losses as L`)

    @property
    def spelled(self) -> str:
        return "." * self.level + self.module


class Repository:
    """Helper summaries by module content, kept for the life of the process."""

    def __init__(self) -> None:
        self._summaries: dict[
            tuple[str, str, str], tuple[Summary | None, frozenset[Dependency]]
        ] = {}
        self._visiting: set[tuple[str, str]] = set()
        self._averaging: dict[tuple[str, str, str], tuple[int, str] | None] = {}
        self._callers: dict[tuple[str, str, str], Tree | None] = {}

    def summary(
        self, path: Path, name: str, seen: set[Dependency], hops: int = 0
    ) -> Summary | None:
        """What `name`, defined in (or re-exported by) the module at `path`, returns; the
        files read for it are added to `seen`."""
        key = (str(path), file_digest(path), name)
        if key not in self._summaries:
            pending = (str(path), name)
            if hops > MAX_HOPS or pending in self._visiting:  # too far, or an import cycle
                return None
            self._visiting.add(pending)
            try:
                self._summaries[key] = self._summarise(path, name, hops)
            finally:
                self._visiting.discard(pending)
        found, dependencies = self._summaries[key]
        seen |= dependencies
        return found

    def averaging(self, path: Path, name: str, averaged_steps: Averaging) -> tuple[int, str] | None:
        """`averaged_steps` (the check's reading) of the function `name` of the module at
        `path`, once per file version."""
        key = (str(path), file_digest(path), name)
        if key not in self._averaging:
            try:
                data = focus(path.read_bytes(), (b"def " + name.encode() + b"(",))
                self._averaging[key] = averaged_steps(Tree(parse(data), data), name)
            except (OSError, SourceError, RecursionError, UnicodeEncodeError):
                self._averaging[key] = None
        return self._averaging[key]

    def caller(self, path: Path, digest: str, function: str) -> Tree | None:
        """The module at `path` (of that `digest`) with only the definitions that call
        `function` kept, parsed once per file version; None when it does not parse."""
        key = (str(path), digest, function)
        if key not in self._callers:
            try:
                data = focus(path.read_bytes(), (function.encode() + b"(",))
                self._callers[key] = Tree(parse(data), data)
            except (OSError, SourceError, RecursionError, UnicodeEncodeError):
                self._callers[key] = None
        return self._callers[key]

    def _summarise(
        self, path: Path, name: str, hops: int
    ) -> tuple[Summary | None, frozenset[Dependency]]:
        imports = Imports(None, path.parent, self, hops + 1)
        imports.dependencies.add(Dependency(str(path), file_digest(path)))
        try:
            wanted = (b"def " + name.encode() + b"(", b"class " + name.encode(), *LOSS_METHOD_DEFS)
            focused = focus(path.read_bytes(), wanted)
            tree = Tree(parse(focused), focused)
        except (OSError, SourceError, RecursionError, UnicodeEncodeError):
            return None, frozenset(imports.dependencies)
        imports.tree = tree
        definition = _top_level(tree, name)
        if definition is None:  # perhaps re-exported: `from .impl import masked_lm_loss`
            reference = imports.reference(cst.Name(name))
            found = imports.summary(reference) if reference is not None else None
            return found, frozenset(imports.dependencies)
        is_class = isinstance(definition, cst.ClassDef)
        function = _loss_method(definition) if is_class else definition
        if function is None:
            return None, frozenset(imports.dependencies)
        tracer = tracer_for(tree, imports)
        parameters = tuple(call_parameters(function).values())
        values = [_tupled(tracer, value) for value in tracer.returns(function)]
        returned = [_returned(tracer, value, function, parameters) for value in values]
        tuples = [v for v in values if isinstance(v, (cst.Tuple, cst.List))]
        items = (
            tuple(_returned(tracer, e.value, function, parameters) for e in tuples[0].elements)
            if tuples
            else ()
        )
        label = f"{name}.{function.name.value}" if is_class else name
        value = next((r for r in returned if r.kind != "unknown"), None)
        if (
            value is not None
            and len({_averaged_over(tracer, v, function) for v in values} - {None}) > 1
        ):
            value = replace(value, count="")  # means over different counts: none to lift
        variable = _variable_sign(tree, function, label, path) or (value.variable if value else "")
        passes = next(
            (i for v in values if (i := _passed_through(tracer, v, parameters)) is not None),
            None,
        )
        bases = ", ".join(code(b.value) for b in definition.bases) if is_class else ""
        summary = Summary(path, label, is_class, value, items, parameters, variable, passes, bases)
        return summary, frozenset(imports.dependencies)


def _top_level(tree: Tree, name: str) -> cst.FunctionDef | cst.ClassDef | None:
    for statement in tree.module.body:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and statement.name.value == name:
            return statement
    return None


def _loss_method(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """The `forward` (or `__call__`) of a loss class."""
    methods = {m.name.value: m for m in cls.body.body if isinstance(m, cst.FunctionDef)}
    return next((methods[n] for n in LOSS_METHODS if n in methods), None)


def _passed_through(
    tracer: Tracer, value: cst.BaseExpression, parameters: tuple[Parameter, ...], hops: int = 4
) -> int | None:
    """The parameter a returned value is, through the names it is bound to and wrappers that
    take it first (`model = DataParallel(model)`; `return model`)."""
    if hops < 0:
        return None
    if isinstance(value, cst.Call):
        first = positional(value)[:1]
        return _passed_through(tracer, first[0], parameters, hops - 1) if first else None
    if not isinstance(value, cst.Name):
        return None
    bound = tracer.binding(value.value, value)
    if isinstance(bound, cst.Param):
        return _parameter_index(value, parameters)
    if isinstance(bound, cst.Assign) and len(bound.targets) == 1:
        return _passed_through(tracer, bound.value, parameters, hops - 1)
    return None


def _tupled(tracer: Tracer, value: cst.BaseExpression) -> cst.BaseExpression:
    """A returned name bound to a tuple is that tuple: `outputs = loss, n; return outputs`."""
    if isinstance(value, cst.Name):
        bound = tracer.binding(value.value, value)
        if isinstance(bound, cst.Assign) and isinstance(bound.value, (cst.Tuple, cst.List)):
            return bound.value
    return value


def _returned(
    tracer: Tracer,
    expr: cst.BaseExpression,
    function: cst.FunctionDef,
    parameters: tuple[Parameter, ...],
) -> Returned:
    origin = tracer.origin(expr)
    count = tracer.valid_count(origin)
    if isinstance(expr, cst.Name) and tracer.bypassed(expr) is not None:
        count = None  # the mean on one path, another value on the other: no one count
    lifted = tracer.inlined(count, function) if count is not None else None
    line = tracer.tree.line(origin.source) if origin.source is not None and origin.tree else None
    divisors = tuple(
        (code(d.divisor), _parameter_index(d.divisor, parameters)) for d in origin.divisions
    )
    return Returned(
        origin.kind,
        origin.what,
        line,
        origin.via,
        divisors,
        origin.variable,
        code(lifted) if lifted is not None else "",
        origin.reduces,
        origin.ignored,
        tracer.counts_rows(origin),
    )


def _averaged_over(
    tracer: Tracer, value: cst.BaseExpression, function: cst.FunctionDef
) -> str | None:
    """What a returned loss is divided by, in `function`'s parameters ("?" where not shown):
    a mean's count, or the divisor of a sum (`pieces.sum() / max(1, kept)`); None for a
    value that is neither."""
    origin = tracer.origin(value)
    if origin.kind == "mean":
        count = tracer.valid_count(origin)
    elif origin.kind == "sum" and origin.divisions:
        count = unguarded(origin.divisions[-1].divisor)
    else:
        return None
    lifted = tracer.inlined(unguarded(count), function) if count is not None else None
    return code(lifted) if lifted is not None else "?"


def _parameter_index(expr: cst.BaseExpression, parameters: tuple[Parameter, ...]) -> int | None:
    """Which of `parameters` the name `expr` is, if any."""
    names = [p.name for p in parameters]
    return names.index(expr.value) if isinstance(expr, cst.Name) and expr.value in names else None


def _variable_sign(tree: Tree, function: cst.FunctionDef, label: str, path: Path) -> str:
    """The first sign of variable valid-token counts in the helper's own code, if any."""
    evidence = scan(tree.module.code_for_node(function))
    found = evidence.padded or evidence.masked
    if found is None:
        return ""
    return f"{found[1]} in `{label}()` ({shown(path)} line {tree.line(function)})"


SHARED = Repository()


class _Callers:
    """Part of `Imports`: what the callers of this file, and the factories of the repository, hand
    it."""

    def passed_origin(
        self, function: str, parameter: Parameter, call: cst.Call, index: int | None
    ) -> Origin | None:
        """What calling the instance that callers of this file's `function` pass for its
        `parameter` returns (element `index` of a returned tuple): callers are the modules
        beside this file that import `function` and call it with an instance of a class of
        the repository, through wrappers that take it first (`FSDP(model, ...)`). Every
        file beside this one is a dependency: a caller edited re-judges this file."""
        if not self.name or self.hops > MAX_HOPS:
            return None
        # a caller names the function, and this module where it imports it
        needles = (function.encode() + b"(", Path(self.name).stem.encode())
        for path in sorted(self.directory.glob("*.py")):
            digest = file_digest(path)
            self.dependencies.add(Dependency(str(path), digest))
            if path.name == self.name or not digest:
                continue
            try:
                if not all(needle in path.read_bytes() for needle in needles):
                    continue
            except OSError:
                continue
            tree = self.repository.caller(path, digest, function)
            if tree is None:
                continue
            caller = Imports(tree, path.parent, self.repository, self.hops + 1, path.name)
            found = caller._passed(function, parameter, self, call, index)
            self.dependencies |= caller.dependencies
            if found is not None:
                return found
        return None

    def _passed(
        self,
        function: str,
        parameter: Parameter,
        callee: Imports,
        call: cst.Call,
        index: int | None,
    ) -> Origin | None:
        """In a caller's file: the origin of the instance its calls of `function` (imported
        from `callee`'s file) pass for `parameter`."""
        tracer = Tracer(self.tree, self)
        target = callee.directory / callee.name
        for site in self.tree.calls:
            reference = self.reference(site.func)
            if reference is None or reference.name != function:
                continue
            module = locate(self.directory, reference.level, reference.module, self.dependencies)
            if module is None or module.resolve() != target.resolve():
                continue
            argument = argument_for(site, parameter)
            if argument is None:
                continue
            built = _constructor(tracer, argument, self)
            if built is not None:
                maker, reference, constructor = built
                found = maker._instance(reference, constructor, call, index)
                self.dependencies |= maker.dependencies
                return found
            found = self._function_origin(argument, call, index)
            if found is not None:
                return found
        return None

    def built_by(self, factory: Summary, hops: int, index: int | None = None) -> Built | None:
        """The class instance a factory function of the repository returns (element `index`
        of a returned tuple), with the imports of the factory's module."""
        path = factory.path
        try:
            data = path.read_bytes()
            tree = Tree(parse(data), data)
        except (OSError, SourceError, RecursionError):
            return None
        function = _top_level(tree, factory.name)
        if not isinstance(function, cst.FunctionDef):
            return None
        maker = Imports(tree, path.parent, self.repository, self.hops + 1, path.name)
        tracer = Tracer(tree, maker)
        for returned in tracer.returns(function):
            built = _constructor(tracer, returned, maker, hops, index)
            if built is not None:
                return built
        return None

    def _function_origin(
        self, argument: cst.BaseExpression, call: cst.Call, index: int | None
    ) -> Origin | None:
        """What calling a function passed as `argument` returns: one this file defines at
        its top level, or imports from the repository."""
        if not isinstance(argument, cst.Name):
            return None
        defined = _top_level(self.tree, argument.value)
        if not isinstance(defined, cst.FunctionDef):
            return self.origin(argument, call, index)
        path = self.directory / self.name
        found = self.repository.summary(path, argument.value, self.dependencies, self.hops)
        if found is None:
            return None
        reference = Reference(0, path.stem, argument.value)
        via = f", returned by `{found.name}()` that `{self.name}` passes"
        return self._origin(_item(found, index), found, reference, argument, call, via)


class Imports(_Callers):
    """The names one file imports from other modules of its repository, resolved on demand.

    `dependencies` collects every file read (or looked for) while resolving them.
    """

    def __init__(
        self,
        tree: Tree | None,
        directory: Path,
        repository: Repository = SHARED,
        hops: int = 0,
        name: str = "",
    ) -> None:
        self.tree = tree
        self.directory = Path(os.path.abspath(directory))  # relative folders have no parents
        self.repository = repository
        self.hops = hops
        self.name = name  # the file's own name in `directory`, when it is a file of its own
        self.dependencies: set[Dependency] = set()
        self._bindings: dict[str, Reference] | None = None

    @property
    def bindings(self) -> dict[str, Reference]:
        """Local name -> what it imports (the last import of a name wins)."""
        if self._bindings is None:
            self._bindings = {}
            for statement in _import_statements(self.tree.module):
                self._bindings.update(_bound(statement))
        return self._bindings

    def data_evidence(self, own: Evidence) -> Evidence:
        """`own`, the file's evidence; where it shows nothing of the data's shape, the signs of
        the first data module of the repository it imports (`from .data import Loader`) that
        shows some, each naming that module; not a package's `__init__`, which lists what its
        modules define, not what the file uses."""
        if own.shows_shape:
            return own
        modules = (
            r for r in self.bindings.values() if DATA_MODULE.search(r.module.rpartition(".")[2])
        )
        for reference in dict.fromkeys(replace(r, name="") for r in modules):
            path = locate(self.directory, reference.level, reference.module, self.dependencies)
            if path is None or path.name == "__init__.py":
                continue
            found = _scanned(path, file_digest(path))
            if found.shows_shape:
                where = f" in `{reference.spelled}`"
                named = {
                    kind: (sign[0], sign[1] + where) if sign else None
                    for kind in ("padded", "masked", "fixed", "one_length")
                    for sign in [getattr(found, kind)]
                }
                return replace(own, module=reference.spelled, **named)
        return own

    def reference(self, func: cst.BaseExpression) -> Reference | None:
        """What a callee names when it was imported: `helper`, `L.helper`, `pkg.losses.helper`."""
        name = dotted(func)
        if name is None:
            return None
        head, *rest = name.split(".")
        bound = self.bindings.get(head)
        if bound is None or (not rest and not bound.name):
            return None
        if not rest:
            return bound
        module = ".".join(p for p in (bound.module, bound.name, *rest[:-1]) if p)
        return Reference(bound.level, module, rest[-1])

    def summary(self, reference: Reference) -> Summary | None:
        """The summary of an imported function or class, when its module is in the repository."""
        path = locate(self.directory, reference.level, reference.module, self.dependencies)
        if path is None:
            return None
        return self.repository.summary(path, reference.name, self.dependencies, self.hops)

    def origin(
        self, func: cst.BaseExpression, call: cst.Call | None = None, index: int | None = None
    ) -> Origin | None:
        """What calling an imported function returns (element `index` of a returned tuple);
        `call`, when there is one, tells which arguments the helper divides by."""
        reference = self.reference(func)
        found = self.summary(reference) if reference is not None else None
        if found is None or found.is_class:
            return None
        return self._origin(_item(found, index), found, reference, func, call)

    def instance_origin(
        self, constructor: cst.Call, call: cst.Call | None, index: int | None = None
    ) -> Origin | None:
        """What calling an instance of an imported loss class returns (its `forward`;
        element `index` of a returned tuple)."""
        reference = self.reference(constructor.func)
        return self._instance(reference, constructor, call, index) if reference else None

    def _instance(
        self, reference: Reference, constructor: cst.Call, call: cst.Call | None, index: int | None
    ) -> Origin | None:
        found = self.summary(reference)
        if found is None or not found.is_class:
            return None
        return self._origin(_item(found, index), found, reference, constructor, call)

    def averaging(
        self, func: cst.BaseExpression, averaged_steps: Averaging
    ) -> tuple[str, str] | None:
        """Where a function of the repository that `func` names averages the gradients of
        the micro-steps it runs (as `averaged_steps` reads a function of a tree), and by what."""
        reference = self.reference(func)
        if reference is None:
            return None
        path = locate(self.directory, reference.level, reference.module, self.dependencies)
        if path is None:
            return None
        found = self.repository.averaging(path, reference.name, averaged_steps)
        if found is None:
            return None
        line, divisor = found
        return f"{shown(path)} line {line}", divisor

    def called(self, tracer: Tracer, call: cst.Call, index: int | None = None) -> Origin | None:
        """What calling an instance of a repository class returns (element `index` of a
        returned tuple), the instance found through its bindings, wrappers and factories (see
        `_constructor`): `model = load_model(Seq2Seq(cfg)); loss, _ = model(x, y)`."""
        built = _constructor(tracer, call.func, self)
        if built is None:
            return None
        maker, reference, constructor = built
        found = maker._instance(reference, constructor, call, index)
        self.dependencies |= maker.dependencies
        return found

    def class_of(self, tracer: Tracer, instance: cst.BaseExpression) -> str:
        """The name of the repository class `instance` was built from, with its bases as
        written ("" when not found): `MiniMindForCausalLM(PreTrainedModel, GenerationMixin)`
        for `model` of `model, tok = init_model(cfg); model(x)`."""
        built = _constructor(tracer, instance, self)
        if built is None:
            return ""
        maker, reference, _ = built
        found = maker.summary(reference)
        return f"{reference.name}({found.bases})" if found is not None else reference.name

    def _origin(
        self,
        returned: Returned | None,
        found: Summary,
        reference: Reference,
        func,
        call,
        via: str = "",
    ) -> Origin | None:
        if returned is None or returned.kind == "unknown":
            return None
        where = f" ({shown(found.path)} line {returned.line})" if returned.line else ""
        return Origin(
            returned.kind,
            f"{returned.what}{where}{returned.via}",
            divisions=tuple(_division(d, found, func, call) for d in returned.divisors),
            via=via or f", returned by `{found.name}()` {_whence(reference, self.name)}",
            module=shown(found.path),
            path=found.path,
            callee=found.name,
            variable=found.variable,
            count=lifted_count(found, returned, call),
            reduces=returned.reduces,
            ignored=returned.ignored,
            rows=returned.rows,
        )


def _whence(reference: Reference, name: str) -> str:
    """Where a class or function comes from, in words: this file, or the module it is imported
    from."""
    if name and reference.level == 1 and reference.module == Path(name).stem:
        return "of this file"
    return f"imported from `{reference.spelled}`"


Built = tuple["Imports", Reference, cst.Call]  # whose imports, which class, which call


def _constructor(
    tracer: Tracer,
    value: cst.BaseExpression,
    imports: Imports,
    hops: int = 4,
    index: int | None = None,
) -> Built | None:
    """The call that built the instance `value` names, the class it names and the imports
    of the file that makes it: a class of the repository, found through the names it is
    bound to (a function's global, where the module binds it), the wrappers that take it
    first (`model = DDP(model, ...)`, `torch.compile(model)`) and the factory functions of
    the repository that return it (`model = build_model(args)`; element `index` of what
    `model, tokenizer = init_model(cfg)` unpacks)."""
    if hops < 0:
        return None
    if isinstance(value, cst.Name) and value in tracer.tree.order:
        bound = _global_binding(tracer, value)
        if not isinstance(bound, cst.Assign) or len(bound.targets) != 1:
            return None
        index = _unpacked_at(bound.targets[0].target, value.value)
        if index == -1:
            return None
        value = bound.value
    if isinstance(value, cst.Tuple) and index is not None:  # `return model, tokenizer`
        if index >= len(value.elements):
            return None
        return _constructor(tracer, value.elements[index].value, imports, hops)
    if not isinstance(value, cst.Call):
        return None
    if isinstance(value.func, cst.Attribute) and value.func.attr.value in MOVES:
        return _constructor(tracer, value.func.value, imports, hops - 1)  # `Model(...).cuda()`
    reference = imports.reference(value.func)
    own = isinstance(value.func, cst.Name) and _top_level(tracer.tree, value.func.value)
    if reference is None and imports.name and isinstance(own, cst.ClassDef):
        reference = Reference(1, Path(imports.name).stem, own.name.value)  # the file's own
    found = imports.summary(reference) if reference is not None else None
    if found is not None and found.is_class:
        return imports, reference, value
    if found is not None and found.passes is not None:  # `load_model(Model(cfg), path)`
        passed = argument_for(value, found.parameters[found.passes])
        return _constructor(tracer, passed, imports, hops - 1) if passed is not None else None
    if found is not None:
        return imports.built_by(found, hops - 1, index)
    first = positional(value)[:1]
    return _constructor(tracer, first[0], imports, hops - 1) if first else None


def _global_binding(tracer: Tracer, name: cst.Name) -> cst.CSTNode | None:
    """The statement that binds `name` where it is read: the last before it in its scope, or,
    for a function's global, the module's last binding of it (under `if __name__ ==
    "__main__":`, say, after the function)."""
    bound = tracer.binding(name.value, name)
    if bound is not None or tracer.tree.scope_of(name) is tracer.tree.module:
        return bound
    later = tracer.tree.bindings(tracer.tree.module).get(name.value)
    return later[-1] if later else None


def _unpacked_at(target: cst.BaseExpression, name: str) -> int | None:
    """Where a flat tuple target unpacks `name` (None for a plain name target; -1 when the
    target is neither)."""
    if isinstance(target, cst.Name):
        return None if target.value == name else -1
    if isinstance(target, cst.Tuple) and all(
        isinstance(e.value, cst.Name) for e in target.elements
    ):
        names = [e.value.value for e in target.elements]
        return names.index(name) if name in names else -1
    return -1


def lifted_count(
    found: Summary, returned: Returned, call: cst.Call | None
) -> cst.BaseExpression | None:
    """The count a summarised callable divides `returned` by, written in the arguments of
    `call`: each parameter it reads swapped for what the call passes (`batch["labels"]` for
    `**batch`); None unless each is a name, attribute or subscript, safe to read again."""
    if call is None or not returned.count:
        return None
    unpacked = spread(call)
    passed = {}
    for parameter in found.parameters:
        argument = argument_for(call, parameter)
        if argument is None and unpacked is not None and parameter.keyword:  # `model(**batch)`
            argument = cst.parse_expression(f'{code(unpacked)}["{parameter.name}"]')
        elif argument is None and parameter.default is not None and _literal(parameter.default):
            argument = parameter.default  # `ignore_index=-100`, not passed
        if argument is not None and not any(isinstance(n, cst.Call) for n in walk(argument)):
            passed[parameter.name] = argument
    count = cst.parse_expression(returned.count)
    if not variables(count) - {"torch"} <= passed.keys():
        return None
    return substituted(count, lambda name: passed.get(name.value))


def _literal(expr: cst.BaseExpression) -> bool:
    """A number, string or constant name, perhaps negated: safe to write at a call."""
    if isinstance(expr, cst.UnaryOperation):
        expr = expr.expression
    return isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)) or (
        isinstance(expr, cst.Name) and expr.value in ("None", "True", "False")
    )


def _item(found: Summary, index: int | None) -> Returned | None:
    """What a summarised callable returns, or element `index` of its returned tuple."""
    if index is None:
        return found.value
    return found.items[index] if index < len(found.items) else None


def _division(
    divisor: tuple[str, int | None], found: Summary, func, call: cst.Call | None
) -> Division:
    """A division inside the helper, seen from this file (at the call, else at the callee):
    by the argument passed when it divides by a parameter, else by the helper's own
    expression, detached from this file."""
    text, parameter = divisor
    node = call if call is not None else func
    if call is not None and parameter is not None:
        argument = argument_for(call, found.parameters[parameter])
        if argument is not None:
            return Division(node, argument)
    return Division(node, cst.parse_expression(text))


@lru_cache(maxsize=64)
def _scanned(path: Path, digest: str) -> Evidence:
    """The evidence of the module at `path` (`digest`: its version)."""
    return scan(path.read_text("utf-8", "replace"))


def _bound(statement: cst.Import | cst.ImportFrom) -> Iterator[tuple[str, Reference]]:
    """The local names an import statement binds, and what each refers to."""
    if isinstance(statement, cst.Import):
        for alias in statement.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                yield alias.asname.name.value, Reference(0, full, "")
            else:
                yield full.split(".")[0], Reference(0, full.split(".")[0], "")
        return
    if isinstance(statement.names, cst.ImportStar):
        return
    level = len(statement.relative)
    module = dotted(statement.module) if statement.module is not None else ""
    if module is None:
        return
    for alias in statement.names:
        imported = dotted(alias.name)
        local = alias.asname.name if alias.asname is not None else alias.name
        if imported and isinstance(local, cst.Name):
            yield local.value, Reference(level, module, imported)


SUITES = (cst.IndentedBlock, cst.SimpleStatementSuite, cst.SimpleStatementLine)
CLAUSES = (
    cst.BaseCompoundStatement,
    cst.Else,
    cst.Finally,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
)


def _import_statements(module: cst.Module) -> Iterator[cst.Import | cst.ImportFrom]:
    """Import statements in document order, at any depth of statements (never in expressions)."""
    stack: list[cst.CSTNode] = list(reversed(module.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.Import, cst.ImportFrom)):
            yield node
        elif isinstance(node, SUITES):
            stack.extend(reversed(node.body))
        elif isinstance(node, CLAUSES):
            stack.extend(reversed([c for c in node.children if isinstance(c, SUITES + CLAUSES)]))
