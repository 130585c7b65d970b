"""A parsed file with the indexes the analysis needs: parents, positions, imports, bindings."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import cached_property
from typing import NamedTuple

import libcst as cst

from gaaudit.analysis.positions import Positions
from gaaudit.findings import Span

Scope = cst.Module | cst.FunctionDef
LOOPS = (cst.For, cst.While)


def code(node: cst.CSTNode) -> str:
    """The source text of an expression, on one line."""
    return " ".join(cst.Module([]).code_for_node(node).split())


def dotted(node: cst.CSTNode) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_name(node: cst.CSTNode) -> str | None:
    """The last component of a Name/Attribute chain: `args.k` -> `k`."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def reads(node: cst.CSTNode) -> set[str]:
    """The longest dotted chains an expression reads: `a.b / len(c)` -> {"a.b", "len", "c"}."""
    chains: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        name = dotted(current)
        if name is not None:
            chains.add(name)
        else:
            stack.extend(current.children)
    return chains


def depends_on(node: cst.CSTNode, bound: set[str]) -> bool:
    """Whether an expression reads any of the `bound` chains (or something inside one)."""
    return any(chain == b or chain.startswith(b + ".") for chain in reads(node) for b in bound)


ATOMS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float, cst.SimpleString)


def substituted(expr: cst.BaseExpression, replace) -> cst.BaseExpression:
    """`expr` with each variable `Name` (not `x.name`, nor the keyword of `f(name=...)`)
    swapped for `replace(name)` (None keeps it), parenthesised where it would bind looser."""

    def bare(before: cst.BaseExpression, after: cst.BaseExpression) -> cst.BaseExpression:
        """A swapped name standing alone (an argument, an index) needs no parentheses."""
        if not isinstance(before, cst.Name) or isinstance(after, (cst.Tuple, cst.GeneratorExp)):
            return after
        return after.with_changes(lpar=[], rpar=[])

    class Swap(cst.CSTTransformer):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            return False

        def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
            return updated.with_changes(value=original.value.visit(self))

        def visit_Arg(self, node: cst.Arg) -> bool:
            return False

        def leave_Arg(self, original: cst.Arg, updated: cst.Arg):
            return updated.with_changes(value=bare(original.value, original.value.visit(self)))

        def leave_Index(self, original: cst.Index, updated: cst.Index):
            return updated.with_changes(value=bare(original.value, updated.value))

        def leave_ComparisonTarget(self, original, updated: cst.ComparisonTarget):
            """`labels != -100`: a negative number compared needs no parentheses."""
            value = updated.comparator
            if isinstance(value, cst.UnaryOperation) and isinstance(
                value.expression, (cst.Integer, cst.Float)
            ):
                return updated.with_changes(comparator=value.with_changes(lpar=[], rpar=[]))
            return updated

        def leave_Name(self, original: cst.Name, updated: cst.Name):
            value = replace(original)
            if value is None:
                return updated
            if isinstance(value, ATOMS) or value.lpar:
                return value
            return value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])

    return expr.visit(Swap())


def variables(expr: cst.BaseExpression) -> set[str]:
    """The variable names an expression reads (see `substituted`)."""
    seen: set[str] = set()
    substituted(expr, lambda name: seen.add(name.value))
    return seen


DEFS = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def walk(node: cst.CSTNode, children=None, *, into_defs: bool = True) -> Iterator[cst.CSTNode]:
    """Every node below `node` (itself included), optionally not entering nested defs.

    `children` maps a node to its children (a `Tree` keeps one); without it, libcst's
    slower `node.children` is used, which suits small detached expressions.
    """
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not into_defs and current is not node and isinstance(current, DEFS):
            continue
        below = children.get(current, ()) if children is not None else current.children
        stack.extend(reversed(below))


_FIELDS: dict[type, tuple[str, ...]] = {}
_IS_NODE: dict[type, bool] = {}
ASSIGNMENTS = (cst.Assign, cst.AugAssign, cst.AnnAssign)
BINDS_VALUE = (cst.Assign, cst.AnnAssign)  # `x = v` and `x: T = v` (whose `v` may be None)
# Whitespace, comments, brackets, separators and operators: read through their parents'
# fields (`node.operator`), never looked up in the index, which leaves them out.
# fmt: off
TRIVIA = (
    cst.BaseParenthesizableWhitespace, cst.EmptyLine, cst.TrailingWhitespace, cst.Newline,
    cst.Comment, cst.LeftParen, cst.RightParen, cst.LeftSquareBracket, cst.RightSquareBracket,
    cst.LeftCurlyBrace, cst.RightCurlyBrace, cst.Comma, cst.Colon, cst.Dot, cst.Semicolon,
    cst.AssignEqual, cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseUnaryOp,
    cst.BaseAugOp,
)
# fmt: on


def _is_node(value) -> bool:
    """Whether a field value is a node the index records."""
    kind = type(value)
    known = _IS_NODE.get(kind)
    if known is None:
        ancestry = kind.__mro__  # not `issubclass`: libcst's bases are ABCs, slow to check
        known = cst.CSTNode in ancestry and not any(base in TRIVIA for base in ancestry)
        _IS_NODE[kind] = known
    return known


def _kids(node: cst.CSTNode) -> list[cst.CSTNode]:
    """A node's children but trivia, read from its dataclass fields (much faster than libcst's
    visitors)."""
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    kids = []
    for name in names:
        value = getattr(node, name)
        if type(value) in (list, tuple):
            kids.extend(v for v in value if _is_node(v))
        elif _is_node(value):
            kids.append(value)
    return kids


class _Index:
    """One traversal recording every node's parent, children and document order."""

    def __init__(self, module: cst.Module) -> None:
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self.children: dict[cst.CSTNode, list[cst.CSTNode]] = {}
        self.order: dict[cst.CSTNode, int] = {}
        self.last: dict[cst.CSTNode, int] = {}  # the highest order inside a node's subtree
        self.calls: list[cst.Call] = []
        self.assignments: list[cst.CSTNode] = []
        self.scopes: dict[cst.CSTNode, cst.CSTNode] = {}  # call or assignment -> module or function
        self.functions: list[cst.FunctionDef] = []
        self.classes: list[cst.ClassDef] = []
        self.imports: list[cst.Import | cst.ImportFrom] = []
        stack: list[tuple[cst.CSTNode, bool, cst.CSTNode]] = [(module, False, module)]
        while stack:
            node, left, scope = stack.pop()
            if left:
                self.last[node] = len(self.order) - 1
                continue
            self.order[node] = len(self.order)
            kind = type(node)
            if kind is cst.Call:
                self.calls.append(node)
                self.scopes[node] = scope
            elif kind in ASSIGNMENTS:
                self.assignments.append(node)
                self.scopes[node] = scope
            elif kind is cst.FunctionDef:
                self.functions.append(node)
                scope = node
            elif kind is cst.ClassDef:
                self.classes.append(node)
            elif kind is cst.Import or kind is cst.ImportFrom:
                self.imports.append(node)
            kids = _kids(node)
            if kids:
                self.children[node] = kids
                for kid in kids:
                    self.parents[kid] = node
            stack.append((node, True, scope))
            stack.extend((kid, False, scope) for kid in reversed(kids))


def abstract(function: cst.FunctionDef) -> bool:
    """A method left to subclasses: `@abstractmethod`, or a body (after its docstring) of
    nothing, or only `pass`, `...` or `raise NotImplementedError`."""
    if any(last_name(d.decorator) == "abstractmethod" for d in function.decorators):
        return True
    lines = function.body.body if isinstance(function.body, cst.IndentedBlock) else [function.body]
    if not all(
        isinstance(line, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) for line in lines
    ):
        return False
    small = [s for line in lines for s in line.body]
    if small and isinstance(small[0], cst.Expr) and isinstance(small[0].value, cst.SimpleString):
        small = small[1:]  # the docstring
    raised = small[0].exc if len(small) == 1 and isinstance(small[0], cst.Raise) else None
    raised = raised.func if isinstance(raised, cst.Call) else raised
    return (
        not small
        or len(small) == 1
        and (
            isinstance(small[0], cst.Pass)
            or isinstance(small[0], cst.Expr)
            and isinstance(small[0].value, cst.Ellipsis)
            or last_name(raised) == "NotImplementedError"
        )
    )


def parameter_names(scope: cst.CSTNode) -> set[str]:
    """The names a function's parameters bind, `self`, `*args` and `**kwargs` included (none
    for another scope)."""
    if not isinstance(scope, cst.FunctionDef):
        return set()
    params = scope.params
    stars = [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    every = (*params.posonly_params, *params.params, *params.kwonly_params, *stars)
    return {p.name.value for p in every}


class Parameter(NamedTuple):
    """A parameter as a call passes it: `position` among the call's positional arguments (None
    for a keyword-only one); `keyword` False for a positional-only one."""

    name: str
    position: int | None
    keyword: bool
    default: cst.BaseExpression | None


def call_parameters(function: cst.FunctionDef) -> dict[str, Parameter]:
    """The parameters a call of `function` passes, by name in order: not the `self` or `cls`
    the call's receiver passes (of a method or classmethod; a staticmethod has none), nor
    `*args` and `**kwargs`; those after `*` or `*args` keyword-only."""
    params = function.params
    named = [(p, False) for p in params.posonly_params] + [(p, True) for p in params.params]
    decorators = {last_name(d.decorator) for d in function.decorators}
    receiver = named and (named[0][0].name.value in ("self", "cls") or "classmethod" in decorators)
    if receiver and "staticmethod" not in decorators:
        named = named[1:]
    found = [
        Parameter(p.name.value, index, by_keyword, p.default)
        for index, (p, by_keyword) in enumerate(named)
    ]
    found += [Parameter(p.name.value, None, True, p.default) for p in params.kwonly_params]
    return {p.name: p for p in found}


def argument_for(call: cst.Call, parameter: Parameter) -> cst.BaseExpression | None:
    """The argument `call` passes for `parameter`, when it can be told (not past a `*args` or
    `**kwargs` of the call, which may hold it)."""
    by_name = keyword(call, parameter.name) if parameter.keyword else None
    if by_name is not None or parameter.position is None or any(a.star for a in call.args):
        return by_name
    args = positional(call)
    return args[parameter.position] if parameter.position < len(args) else None


def methods_of(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """The methods a class body defines, by name."""
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


def keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    return None


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    return [a.value for a in call.args if a.keyword is None and not a.star]


def spread(call: cst.Call) -> cst.BaseExpression | None:
    """The dict a call unpacks into keywords: `batch` of `model(**batch)`, else None."""
    return next((a.value for a in call.args if a.star == "**"), None)


def string_value(node: cst.CSTNode | None) -> str | None:
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value if isinstance(node.evaluated_value, str) else None
    return None


class Tree:
    """One module and its indexes, built once per file."""

    def __init__(self, module: cst.Module, source: bytes | None = None) -> None:
        """`source`: the bytes libcst parsed into `module`; without them, asking a node's
        position generates the code of the whole module (slow)."""
        self.module = module
        indexer = _Index(module)
        self.parents, self.children = indexer.parents, indexer.children
        self.order, self.last = indexer.order, indexer.last
        self.calls, self.assignments, self._scopes = (
            indexer.calls,
            indexer.assignments,
            indexer.scopes,
        )
        self._functions, self._imports = indexer.functions, indexer.imports
        self.classes = indexer.classes  # in document order
        self._bindings: dict[cst.CSTNode, dict[str, list[cst.CSTNode]]] = {}
        self._positions = Positions(module, self.parents, source)

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        """Whether `inner` lies inside `outer` (or is it)."""
        return self.order[outer] <= self.order[inner] <= self.last[outer]

    def bindings(self, scope: Scope) -> dict[str, list[cst.CSTNode]]:
        """Assignment statements of one scope by the names they bind, in document order."""
        if scope not in self._bindings:
            table: dict[str, list[cst.CSTNode]] = {}
            for node in self.assignments:
                if self._scopes[node] is scope:
                    targets = (
                        [t.target for t in node.targets]
                        if isinstance(node, cst.Assign)
                        else [node.target]
                    )
                    for name in set().union(*(target_names(t) for t in targets)):
                        table.setdefault(name, []).append(node)
            self._bindings[scope] = table
        return self._bindings[scope]

    @cached_property
    def assigned_values(self) -> dict[str, list[cst.BaseExpression]]:
        """Values assigned to each dotted target anywhere in the file (`self.loss_fn = ...`)."""
        table: dict[str, list[cst.BaseExpression]] = {}
        for node in self.assignments:
            if isinstance(node, cst.Assign):
                for target in node.targets:
                    name = dotted(target.target)
                    if name:
                        table.setdefault(name, []).append(node.value)
        return table

    def walk(self, node: cst.CSTNode, *, into_defs: bool = True) -> Iterator[cst.CSTNode]:
        return walk(node, self.children, into_defs=into_defs)

    def span(self, node: cst.CSTNode) -> Span:
        """Where `node` lies (libcst's syntactic range: comments and indentation excluded)."""
        line, column, end_line, end_column = self._positions[node]
        return Span(line, column + 1, end_line, end_column + 1)

    def line(self, node: cst.CSTNode) -> int:
        return self._positions[node][0]

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope_of(self, node: cst.CSTNode) -> Scope:
        for parent in self.ancestors(node):
            if isinstance(parent, (cst.FunctionDef, cst.Module)):
                return parent
        return self.module

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost statement (simple or compound) holding `node`."""
        for candidate in (node, *self.ancestors(node)):
            if isinstance(candidate, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                return candidate
        return node

    def in_scope(self, scope: Scope) -> Iterator[cst.CSTNode]:
        """Nodes of one scope, not entering nested functions or classes."""
        body = scope if isinstance(scope, cst.Module) else scope.body
        return self.walk(body, into_defs=False)

    def is_variable(self, node: cst.Name) -> bool:
        """Whether a `Name` is a variable: not the `name` of `x.name`, nor the keyword of
        `f(name=...)`."""
        parent = self.parents.get(node)
        return not (
            (isinstance(parent, cst.Attribute) and parent.attr is node)
            or (isinstance(parent, cst.Arg) and parent.keyword is node)
        )

    def uses(self, scope: Scope, name: str) -> Iterator[cst.Name]:
        """The `Name` nodes of one scope that are the variable `name`."""
        for node in self.in_scope(scope):
            if isinstance(node, cst.Name) and node.value == name and self.is_variable(node):
                yield node

    @cached_property
    def functions(self) -> dict[str, cst.FunctionDef]:
        """Functions and methods defined in the file, by name (first definition wins)."""
        found: dict[str, cst.FunctionDef] = {}
        for node in self._functions:
            found.setdefault(node.name.value, node)
        return found

    def function_named(self, name: str, use: cst.CSTNode) -> cst.FunctionDef | None:
        """The function `name` names where `use` reads it: the one the innermost enclosing
        function (or the module) defines, else the first of that name (`functions`)."""
        defined = [
            node
            for node in self._functions
            if node.name.value == name and self.contains(self.scope_of(node), use)
        ]
        if defined:
            return max(defined, key=lambda node: self.order[self.scope_of(node)])
        return self.functions.get(name)

    def enclosing_function(self, node: cst.Call | cst.CSTNode) -> cst.FunctionDef | None:
        """The function a call or assignment sits in directly, if any (indexed, no walk)."""
        scope = self._scopes.get(node)
        return scope if isinstance(scope, cst.FunctionDef) else None

    @cached_property
    def imports(self) -> dict[str, str]:
        """Local name -> qualified name, from the file's import statements."""
        table: dict[str, str] = {}
        for node in self._imports:
            if isinstance(node, cst.Import):
                for alias in node.names:
                    full = dotted(alias.name) or ""
                    if alias.asname is not None:
                        table[alias.asname.name.value] = full
                    else:
                        table[full.split(".")[0]] = full.split(".")[0]
            elif isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
                base = dotted(node.module) if node.module is not None else ""
                for alias in node.names:
                    local = alias.asname.name.value if alias.asname else alias.name.value
                    table[local] = f"{base}.{alias.name.value}" if base else alias.name.value
        return table

    def qualified(self, node: cst.CSTNode) -> str | None:
        """`F.cross_entropy` -> `torch.nn.functional.cross_entropy` through import aliases."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        full = self.imports.get(head, head)
        return f"{full}.{rest}" if rest else full

    def assigned_in(self, region: cst.CSTNode) -> set[str]:
        """Names bound anywhere inside `region` (assignments, loop targets, `as` names)."""
        bound: set[str] = set()
        for node in self.walk(region, into_defs=False):
            targets: list[cst.CSTNode] = []
            if isinstance(node, cst.Assign):
                targets = [t.target for t in node.targets]
            elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.For)):
                targets = [node.target]
            elif isinstance(node, (cst.AsName, cst.NamedExpr)):
                targets = [node.name if isinstance(node, cst.AsName) else node.target]
            for target in targets:
                bound |= _target_chains(target)
        return bound


def target_names(target: cst.CSTNode) -> set[str]:
    """Plain names a target binds: `a`, `a, (b, c)`, `*rest`."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(target_names(e.value) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return {target.value} if isinstance(target, cst.Name) else set()


def assigned_value(statement: cst.CSTNode | None, name: str) -> cst.BaseExpression | None:
    """What `statement` binds `name` to: `x` of `name = x` (or `name: T = x`), and of `a, name
    = y, x`; None where it binds it otherwise (unpacking a call, augmenting) or not at all."""
    if isinstance(statement, cst.AnnAssign):
        return statement.value if code(statement.target) == name else None
    if not (isinstance(statement, cst.Assign) and len(statement.targets) == 1):
        return None
    target, value = statement.targets[0].target, statement.value
    if isinstance(target, cst.Name):
        return value if target.value == name else None
    if not (
        isinstance(target, cst.Tuple)
        and isinstance(value, cst.Tuple)
        and len(target.elements) == len(value.elements)
    ):
        return None
    found = None
    for element, bound in zip(target.elements, value.elements, strict=True):
        if isinstance(element.value, cst.Name) and element.value.value == name:
            found = bound.value  # the last one wins, as in Python
    return found


def bound_afresh(statement: cst.CSTNode) -> set[str]:
    """The dotted names an assignment statement binds whole: `step` and `self.step` of
    `step, self.step = 0, 0`; none of `step += 1` or `steps[i] = 0`."""
    if isinstance(statement, cst.Assign):
        targets = [target.target for target in statement.targets]
    else:
        targets = [statement.target] if isinstance(statement, cst.AnnAssign) else []
    return set().union(*(_target_chains(t, into_items=False) for t in targets))


def _target_chains(target: cst.CSTNode, into_items: bool = True) -> set[str]:
    """The dotted names a target binds (and, `into_items`, those whose items it sets)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_target_chains(e.value, into_items) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return _target_chains(target.value, into_items)
    if isinstance(target, cst.Subscript):
        return _target_chains(target.value) if into_items else set()
    name = dotted(target)
    return {name} if name else set()
