"""libcst building blocks of the rewrites (the planners of this package): the
node-keyed edits of a file, one more argument or parameter with the call's or signature's
layout kept, and a node's statement."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

import libcst as cst

from gaaudit.analysis.tree import Tree, code, keyword, string_value

# One line on each block a fix inserts, saying why it is there.
WEIGHT_NOTE = "# sum and count: each micro-batch's loss counts its valid targets"
DIVIDE_NOTE = "# one division per window, by the window's total count"


class Unfixable(Exception):
    """A finding the fixer cannot rewrite safely; the message says why."""


@dataclass
class Edits:
    """Node-keyed changes for one file, applied in one pass (see `codemod`)."""

    replace: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict)
    before: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    spaced: set[cst.CSTNode] = field(default_factory=set)  # two blank lines above (a def before)

    def insert_before(self, anchor: cst.CSTNode, source: str) -> None:
        self.before.setdefault(anchor, []).extend(parsed_statements(source))

    def insert_after(self, anchor: cst.CSTNode, source: str) -> None:
        self.after.setdefault(anchor, []).extend(parsed_statements(source))


def parsed_statements(source: str) -> list[cst.BaseStatement]:
    """The statements of `source`, a leading comment kept on the first (libcst gives it to
    the module's header)."""
    module = cst.parse_module(source)
    body = list(module.body)
    if module.header and body:
        body[0] = body[0].with_changes(leading_lines=[*module.header, *body[0].leading_lines])
    return body


NO_SPACE = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def indented(lines: str) -> str:
    """`lines`, each indented one level."""
    return "".join(f"    {line}\n" for line in lines.splitlines())


def with_argument(call: cst.Call, name: str | None, value: str) -> cst.Call:
    """`call` with one more argument, `name=value` or positional `value`; an existing `name=`
    is replaced. A one-per-line layout with a trailing comma stays one per line."""
    args = list(call.args)
    if name is not None:
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == name:
                args[i] = arg.with_changes(value=cst.parse_expression(value))
                return call.with_changes(args=args)
    added = cst.Arg(
        cst.parse_expression(value),
        keyword=cst.Name(name) if name else None,
        equal=NO_SPACE if name else cst.MaybeSentinel.DEFAULT,
    )
    return call.with_changes(args=_appended(args, added))


def with_parameter(params: cst.Parameters, name: str, default: str | None = None) -> cst.Parameters:
    """`params` plus `name` (`name=default` when given): the last positional parameter, or a
    keyword-only one after `*args` or a bare `*`. A one-per-line layout stays one per line."""
    new = cst.Param(cst.Name(name))
    if default is not None:
        new = new.with_changes(default=cst.parse_expression(default), equal=NO_SPACE)
    field = "params" if params.star_arg is cst.MaybeSentinel.DEFAULT else "kwonly_params"
    return params.with_changes(**{field: _appended(list(getattr(params, field)), new)})


def _appended(items: list, new):
    """`items + [new]`, commas arranged: after a trailing comma the new item takes the last
    one's comma (and its line break before the closing bracket); one item per line without a
    trailing comma, the new item gets a line of its own."""
    if items and isinstance(items[-1].comma, cst.Comma):
        before = (
            items[-2].comma if len(items) > 1 and isinstance(items[-2].comma, cst.Comma) else None
        )
        new = new.with_changes(comma=items[-1].comma)
        items[-1] = items[-1].with_changes(
            comma=before or cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        )
    elif items:  # the whitespace before the closing bracket moves behind the new item
        last, space = items[-1], _SPACE_AFTER[type(items[-1])]
        new = new.with_changes(**{space: getattr(last, space)})
        before = items[-2].comma if len(items) > 1 else None
        one_per_line = isinstance(before, cst.Comma) and isinstance(
            before.whitespace_after, cst.ParenthesizedWhitespace
        )
        items[-1] = last.with_changes(
            comma=before if one_per_line else cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
            **{space: cst.SimpleWhitespace("")},
        )
    return [*items, new]


_SPACE_AFTER = {cst.Arg: "whitespace_after_arg", cst.Param: "whitespace_after_param"}


def atom(expr: cst.BaseExpression) -> str:
    """An expression's code, parenthesised unless it already binds tighter than `.attr`."""
    text = code(expr)
    return (
        text
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
        or getattr(expr, "lpar", ())
        else f"({text})"
    )


def statement_line(tree: Tree, node: cst.CSTNode) -> cst.CSTNode:
    """The statement holding `node` that sits directly in a block."""
    for candidate in (node, *tree.ancestors(node)):
        parent = tree.parents.get(candidate)
        if isinstance(parent, (cst.IndentedBlock, cst.Module)):
            return candidate
        if isinstance(parent, cst.SimpleStatementSuite):
            raise Unfixable(
                "the statement shares a line with its block header; put it on its own line"
            )
    raise Unfixable("cannot find the statement to rewrite")


def runs_again(tree: Tree, outer: cst.CSTNode, loop: cst.CSTNode) -> str:
    """Says that the loop `outer` (`loops.run_again`) runs `loop` again, and through which
    call of `loop`'s function where it is in another function."""
    said = f"the loop on line {tree.line(outer)} runs this one again"
    function = tree.scope_of(loop)
    if isinstance(function, cst.FunctionDef) and not tree.contains(function, outer):
        said += f" by calling `{function.name.value}()`"
    return said


def copy_edits(edits: Edits) -> Edits:
    """A copy to restore when a finding turns out unfixable half-way through planning."""
    return Edits(
        dict(edits.replace),
        {k: list(v) for k, v in edits.before.items()},
        {k: list(v) for k, v in edits.after.items()},
        set(edits.spaced),
    )


def bound_torch(tree: Tree) -> str | None:
    """The name the file's top level binds to the torch module (`th` after `import torch as
    th`; `torch` after `import torch.distributed`), else None."""
    for statement in tree.module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            for alias in small.names if isinstance(small, cst.Import) else ():
                name = code(alias.name)
                if name == "torch" and alias.asname is not None:
                    return alias.asname.name.value
                if name == "torch" or (alias.asname is None and name.startswith("torch.")):
                    return "torch"
    return None


def torch_module(tree: Tree, edits: Edits) -> str:
    """The file's name for the torch module; where its top level binds none, `edits` gets an
    `import torch` among the file's third-party imports, in alphabetical order."""
    bound = bound_torch(tree)
    if bound is not None:
        return bound
    imports = [
        (statement, root)
        for statement in tree.module.body
        if isinstance(statement, cst.SimpleStatementLine)
        and (root := _imported_root(statement.body[0])) not in (None, "__future__")
    ]
    third_party = [(s, root) for s, root in imports if root not in sys.stdlib_module_names]
    later = next((s for s, root in third_party if root >= "torch"), None)
    if later is not None:
        anchor, before = later, True
    elif third_party or imports:
        anchor, before = (third_party or imports)[-1][0], False
    else:  # after the docstring and `from __future__` imports, else at the top
        heading = list(
            itertools.takewhile(
                lambda s: (
                    isinstance(s, cst.SimpleStatementLine)
                    and isinstance(s.body[0], (cst.Expr, cst.ImportFrom))
                ),
                tree.module.body,
            )
        )
        anchor, before = (heading[-1], False) if heading else (tree.module.body[0], True)
    placed = (edits.before if before else edits.after).get(anchor, ())
    if all(code(s).strip() != "import torch" for s in placed):
        (edits.insert_before if before else edits.insert_after)(anchor, "import torch\n")
    return "torch"


def _imported_root(statement: cst.BaseSmallStatement) -> str | None:
    """The top-level package an import statement reads (None for a relative import or another
    statement)."""
    if isinstance(statement, cst.Import):
        return code(statement.names[0].name).split(".")[0]
    if isinstance(statement, cst.ImportFrom) and not statement.relative and statement.module:
        return code(statement.module).split(".")[0]
    return None


# Whose backward runs a GradScaler in fp16: the class, its precision keyword, its fp16
# values (a Lightning Trainer's are Fabric's).
PRECISION = {
    "Accelerator": ("mixed_precision", ("fp16",)),
    "Fabric": ("precision", ("16", "16-mixed", "16-true")),
}


def may_be_fp16(built: cst.Call, setting: str, fp16: tuple[str, ...]) -> bool:
    """Whether an `Accelerator(...)`, `Fabric(...)` or Lightning `Trainer(...)` may train in
    fp16: its precision `setting` is one of the `fp16` values, or is known only at run time
    (`**options`)."""
    value = keyword(built, setting)
    if value is None:
        return any(arg.star == "**" for arg in built.args)
    if isinstance(value, cst.Integer):
        return value.value in fp16
    return not isinstance(value, cst.SimpleString) or string_value(value) in fp16
