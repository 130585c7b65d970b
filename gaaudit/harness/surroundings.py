"""What the code around a replayed statement provides: the class whose method holds it (and
the subclass that fills in the hooks it leaves abstract), the methods it calls on its
instance, module-level constants, and the assignments to its free names that run before it
(`criterion = nn.CrossEntropyLoss()`, `params = list(...)`)."""

from __future__ import annotations

import ast
import contextlib
import copy
from dataclasses import dataclass, replace

Chain = tuple[str, ...]
# Packages whose classes run the loss, the accumulation and the optimizer step themselves.
FRAMEWORKS = ("transformers", "trl", "lightning", "pytorch_lightning")
LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


@dataclass(frozen=True)
class Owner:
    """The module-level class whose method holds the statement, and the name its instance
    goes by there (`self`); `subclass`: the module's class derived from it whose instance
    runs the statement, where the owner leaves a method it calls abstract (see implemented)."""

    node: ast.ClassDef
    instance: str
    subclass: ast.ClassDef | None = None

    @property
    def classes(self) -> list[ast.ClassDef]:
        """The owner's class, then the subclass its instance is made of, if any."""
        return [self.node, *([self.subclass] if self.subclass else [])]


@dataclass(frozen=True)
class Derived:
    """An assignment to a free name (or an attribute of the instance, in `__init__`) that runs
    before the statement; replay evaluates `value` where its names are all known.
    `reads_model`: the value is computed from a model the harness binds."""

    chain: Chain
    value: ast.expr
    statement: ast.stmt
    reads_model: bool = False


def literal(node: ast.expr) -> tuple[bool, object]:
    """(True, value) for a literal expression, else (False, None)."""
    with contextlib.suppress(*LITERAL_ERRORS):
        return True, ast.literal_eval(node)
    return False, None


def constants(body: list[ast.stmt]) -> dict[str, object]:
    """Literal values assigned to names in `body`, tuples unpacked (`PAD, BOS = 0, 1`); the
    last assignment wins (`bar = None` then `bar = tqdm(...)`: unknown)."""
    found = {}
    for node in body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if (
                isinstance(target, (ast.Tuple, ast.List))
                and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)
            ):
                pairs = list(zip(target.elts, node.value.elts))
            for bound, value in pairs:
                ok, result = literal(value)
                if isinstance(bound, ast.Name) and ok:
                    found[bound.id] = result
                else:
                    for name in ast.walk(bound):
                        if isinstance(name, ast.Name):
                            found.pop(name.id, None)
    return found


def enclosing_owner(tree: ast.Module, target: ast.stmt) -> Owner | None:
    """The module-level class one of whose methods is or encloses `target`."""
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for method in node.body:
            if (
                isinstance(method, ast.FunctionDef)
                and method.args.args
                and method.lineno <= target.lineno <= method.end_lineno
                and not _static(method)
            ):
                return Owner(node, method.args.args[0].arg)
    return None


def implemented(tree: ast.Module, owner: Owner, nodes: list[ast.AST]) -> Owner:
    """The owner with its subclass: where a method that `nodes` call on the instance raises
    NotImplementedError (a base trainer's `self.forward_step(batch)`, a hook its subclasses
    fill in), the first module-level class derived from the owner that implements them all."""
    abstract = {m.name for m in methods_called(owner, nodes) if _abstract(m)}
    if not abstract:
        return owner
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == owner.node.name for b in node.bases
        ):
            defined = {
                m.name for m in node.body if isinstance(m, ast.FunctionDef) and not _abstract(m)
            }
            if abstract <= defined:
                return replace(owner, subclass=node)
    return owner


def _abstract(method: ast.FunctionDef) -> bool:
    """A method whose body (after its docstring) only raises NotImplementedError."""
    body = method.body[1:] if ast.get_docstring(method) else method.body
    raised = body[0].exc if len(body) == 1 and isinstance(body[0], ast.Raise) else None
    raised = raised.func if isinstance(raised, ast.Call) else raised
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def _static(method: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod")
        for d in method.decorator_list
    )


def framework_base(tree: ast.Module, owner: Owner) -> tuple[str, str] | None:
    """A base class of the owner imported from one of FRAMEWORKS: (its name, the package)."""
    origins = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            origins.update({a.asname or a.name: node.module.split(".")[0] for a in node.names})
        elif isinstance(node, ast.Import):
            origins.update(
                {(a.asname or a.name).split(".")[0]: a.name.split(".")[0] for a in node.names}
            )
    for base in owner.node.bases:
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and origins.get(root.id) in FRAMEWORKS:
            return ast.unparse(base), origins[root.id]
    return None


def methods_called(
    owner: Owner, nodes: list[ast.AST], calls_itself: bool = False
) -> list[ast.FunctionDef]:
    """The owner's methods (its subclass's, where it has one) that `nodes` call on the
    instance (`self._forward(batch)`), and those they call in turn; with `calls_itself`,
    `self(...)` calls its `forward`."""
    methods = {m.name: m for c in owner.classes for m in c.body if isinstance(m, ast.FunctionDef)}
    found: list[ast.FunctionDef] = []
    pending = list(nodes)
    while pending:
        node = pending.pop()
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            func, name = call.func, None
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == owner.instance
            ):
                name = func.attr
            elif calls_itself and isinstance(func, ast.Name) and func.id == owner.instance:
                name = "forward"
            if name in methods and methods[name] not in found:
                found.append(methods[name])
                pending.append(methods[name])
    return found


def functions_around(tree: ast.Module, target: ast.stmt) -> list[ast.FunctionDef]:
    """The functions whose bodies hold `target`, outermost first."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.lineno < target.lineno <= n.end_lineno
    ]


def parameter_defaults(args: ast.arguments) -> list[tuple[str, ast.expr]]:
    """The parameters that have a default, with it (positional, then keyword-only)."""
    positional = args.posonlyargs + args.args
    return [
        *(
            (a.arg, d)
            for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults)
        ),
        *((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None),
    ]


def option_defaults(tree: ast.Module) -> dict[str, object]:
    """The literal defaults of the fields of the module's classes that extend a
    `TrainingArguments`, and of the module's mixins they combine (`use_lora: bool = False`,
    `vision_lr: float = field(default=None)`): the options a project adds to the Trainer's
    arguments, which its Trainer subclass reads."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    pending = [
        cls
        for cls in classes.values()
        if any(ast.unparse(base).endswith("TrainingArguments") for base in cls.bases)
    ]
    extending: list[ast.ClassDef] = []  # with the module's mixins they combine
    while pending:
        cls = pending.pop(0)
        if cls not in extending:
            extending.append(cls)
            pending += [classes[n] for b in cls.bases if (n := ast.unparse(b)) in classes]
    found: dict[str, object] = {}
    for cls in extending:
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
                value = next((k.value for k in value.keywords if k.arg == "default"), None)
            known, default = literal(value) if value is not None else (False, None)
            if known:
                found.setdefault(node.target.id, default)
    return found


def assignments_before(
    tree: ast.Module, target: ast.stmt, free: list[str], owner: Owner | None
) -> list[Derived]:
    """The last non-literal assignment before `target` to each of its free names, in the
    functions that enclose it (literals are Plan.initial); with an owner, the last
    `self.attr = ...` of its `__init__`, literal or not, where a statement of its body reads
    a parameter never reassigned there, with the parameter's literal default other than None
    (`self.criterion = nn.CrossEntropyLoss(ignore_index=pad_id)`, `pad_id=-100`)."""
    enclosing = functions_around(tree, target)
    found: dict[Chain, Derived] = {}
    statements = sorted(
        (
            s
            for f in enclosing
            for s in ast.walk(f)
            if isinstance(s, ast.Assign) and s.lineno < target.lineno
        ),
        key=lambda s: s.lineno,
    )
    for statement in statements:
        for target_node in statement.targets:
            if isinstance(target_node, ast.Name) and target_node.id in free:
                found.pop((target_node.id,), None)
                if not literal(statement.value)[0]:
                    found[(target_node.id,)] = Derived(
                        (target_node.id,), statement.value, statement
                    )
    init = _init(owner)
    assigned = sorted(
        (s for s in ast.walk(init) if isinstance(s, ast.Assign)) if init else (),
        key=lambda s: s.lineno,
    )
    given = init_defaults(owner)
    for statement in assigned:
        for node in statement.targets:
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == owner.instance
            ):
                chain = (owner.instance, node.attr)
                found.pop(chain, None)
                value = statement.value
                if statement in init.body:
                    value = _Defaults(given).visit(copy.deepcopy(value))
                found[chain] = Derived(chain, value, statement)
    return list(found.values())


def _init(owner: Owner | None) -> ast.FunctionDef | None:
    if owner is None:
        return None
    return next(
        (m for m in owner.node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"),
        None,
    )


def init_defaults(owner: Owner | None) -> dict[str, ast.expr]:
    """The parameters of the owner's `__init__` that it never reassigns, with their literal
    defaults other than None: what its body reads them as when the harness makes the instance."""
    init = _init(owner)
    if init is None:
        return {}
    rebound = {
        n.id
        for s in ast.walk(init)
        if isinstance(s, ast.Assign)
        for t in s.targets
        for n in ast.walk(t)
        if isinstance(n, ast.Name)
    }
    return {
        name: default
        for name, default in parameter_defaults(init.args)
        if name not in rebound and literal(default)[0] and literal(default)[1] is not None
    }


class _Defaults(ast.NodeTransformer):
    """Each read of a parameter by its literal default (a name a lambda or comprehension of
    the value binds itself is left as it is)."""

    def __init__(self, given: dict[str, ast.expr]) -> None:
        self.given = given

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.given:
            return ast.copy_location(copy.deepcopy(self.given[node.id]), node)
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.expr:
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda
