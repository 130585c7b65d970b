"""libcst building blocks of the rewrites (the planners of this package): the
node-keyed edits of a file, one more argument or parameter with the call's or signature's
layout kept, and a node's statement."""

from __future__ import annotations

import configparser
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import libcst as cst

from gaaudit.analysis.tree import Tree, code, keyword, string_value, walk
from gaaudit.catalogue import toml
from gaaudit.discover.modules import search_root

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
        _insert_once(self.before.setdefault(anchor, []), source)

    def insert_after(self, anchor: cst.CSTNode, source: str) -> None:
        _insert_once(self.after.setdefault(anchor, []), source)


def _insert_once(placed: list[cst.BaseStatement], source: str) -> None:
    """Adds `source`'s statements to those `placed` at an anchor, unless they hold them
    already: two findings of one loss (a helper's result backpropagated on two branches) ask
    for the same lines at the same place."""
    statements = parsed_statements(source)
    held, new = [code(s) for s in placed], [code(s) for s in statements]
    if not any(held[i : i + len(new)] == new for i in range(len(held) - len(new) + 1)):
        placed.extend(statements)


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


def with_argument(call: cst.Call, name: str | None, value: str, star: str = "") -> cst.Call:
    """`call` with one more argument, `name=value`, positional `value` or `**value` (`star`);
    an existing `name=` is replaced. A one-per-line layout with a trailing comma stays one per
    line."""
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
        star=star,
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


# The line length of black and ruff, for a project that configures none.
DEFAULT_WIDTH = 88
# Where a project configures its line length: a TOML file and the tables read in it, or an
# INI file read in its `[flake8]` section.
WIDTH_TOML = {
    "pyproject.toml": (("tool", "ruff"), ("tool", "black")),
    "ruff.toml": ((),),
    ".ruff.toml": ((),),
}
WIDTH_INI = ("setup.cfg", "tox.ini", ".flake8")


def line_length(path: Path) -> int:
    """The line length configured for `path` in the nearest folder, from its own up to its
    repository (`search_root`), that sets one: `line-length` in a pyproject.toml's
    `[tool.ruff]` or `[tool.black]` or in a ruff.toml, `max-line-length` in the `[flake8]` of
    a setup.cfg, tox.ini or .flake8; else 88. A file that cannot be read counts as silent."""
    here = path.resolve()
    root = search_root(path).resolve()
    for folder in (f for f in here.parents if f.is_relative_to(root)):
        for name, tables in WIDTH_TOML.items():
            if (folder / name).is_file() and (width := _toml_width(folder / name, tables)):
                return width
        for name in WIDTH_INI:
            if (folder / name).is_file() and (width := _ini_width(folder / name)):
                return width
    return DEFAULT_WIDTH


def _toml_width(path: Path, tables: tuple[tuple[str, ...], ...]) -> int | None:
    tomllib = toml()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    for keys in tables:
        table = data
        for key in keys:
            table = table.get(key) if isinstance(table, dict) else None
        width = table.get("line-length") if isinstance(table, dict) else None
        if isinstance(width, int) and width > 0:
            return width
    return None


def _ini_width(path: Path) -> int | None:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text(encoding="utf-8"))
        width = parser.get("flake8", "max-line-length", fallback=None) or parser.get(
            "flake8", "max_line_length", fallback=None
        )
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    return int(width) if width and width.strip().isdigit() and int(width) > 0 else None


def wrapped(
    statement: cst.CSTNode,
    column: int,
    width: int,
    indent: str = "    ",
    kept=frozenset(),
    rewritten: bool = False,
) -> cst.CSTNode:
    """`statement`, written by a fix at `column` in a file indented by `indent`, with each of
    its lines longer than `width` split as black splits it: at the brackets that end the line,
    else in parentheses added around its value, one operand or argument a line where the
    content still does not fit; comments above it broken between words. Its blocks' statements
    are wrapped too, except those in `kept` (the user's, which a rewrite carries over). Of a
    `rewritten` statement of the user's, only its line (a block statement's header) is."""
    room = _Room(column, width, indent)
    if not rewritten and isinstance(
        statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement)
    ):
        lines = [_comment_lines(line, room) for line in statement.leading_lines]
        statement = statement.with_changes(leading_lines=[e for each in lines for e in each])
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        small = statement.body[0]
        slot = _SLOTS.get(type(small))
        if slot and getattr(small, slot) is not None and not _fits(statement, room):
            small = small.with_changes(**{slot: _split_value(small, slot, room)})
            statement = statement.with_changes(body=[small])
    elif isinstance(statement, (cst.BaseCompoundStatement, cst.Else)):
        if not isinstance(statement, cst.Else):
            statement = _header_wrapped(statement, room)
        body = statement.body
        if not rewritten and isinstance(body, cst.IndentedBlock):
            inner = column + len(indent if body.indent is None else body.indent)
            lines = [s if s in kept else wrapped(s, inner, width, indent, kept) for s in body.body]
            statement = statement.with_changes(body=body.with_changes(body=lines))
        if not rewritten and getattr(statement, "orelse", None) is not None:
            orelse = wrapped(statement.orelse, column, width, indent, kept)
            statement = statement.with_changes(orelse=orelse)
    return statement


class _Room(NamedTuple):
    """Where a statement is wrapped: its column, the line length, the file's indentation."""

    column: int
    width: int
    indent: str


# The expression a one-statement line holds, which its split lays out.
_SLOTS = {
    cst.Assign: "value",
    cst.AugAssign: "value",
    cst.AnnAssign: "value",
    cst.Expr: "value",
    cst.Return: "value",
}
# ... and a block header's: an `if` or `while` test. A `for` header stays on one line:
# `verify` finds the patched loop by it (`for x, window_share in read_ahead(xs):`).
_HEADER_SLOTS = {cst.If: "test", cst.While: "test"}


def _fits(node: cst.CSTNode, room: _Room) -> bool:
    """Whether every line of `node`'s code (a statement's, without its comments above; a
    block statement's header) stays within the line length at its `room`."""
    if isinstance(node, cst.BaseCompoundStatement):  # its header, written as `...: pass`
        node = node.with_changes(body=cst.SimpleStatementSuite([cst.Pass()]))
        if hasattr(node, "orelse"):
            node = node.with_changes(orelse=None)
    if hasattr(node, "leading_lines"):
        node = node.with_changes(leading_lines=[])
    *lines, last = _code(node).splitlines()
    if isinstance(node, cst.BaseCompoundStatement):
        last = last.removesuffix(" pass")
    return all(room.column + len(line) <= room.width for line in (*lines, last))


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _header_wrapped(statement: cst.BaseCompoundStatement, room: _Room):
    """A block statement whose header is too long: a `def`'s parameters split, else the
    header's expression as a statement's value."""
    if _fits(statement, room):
        return statement
    if isinstance(statement, cst.FunctionDef):
        return statement.with_changes(**_bracketed_items(statement, "params", 0, room))
    slot = _HEADER_SLOTS.get(type(statement))
    if slot is None:
        return statement
    return statement.with_changes(**{slot: _split_value(statement, slot, room)})


def _split_value(owner: cst.CSTNode, slot: str, room: _Room) -> cst.BaseExpression:
    """The expression in `owner`'s `slot`, split as black splits a statement: at the last
    brackets that hold something (`_at_trailer`) where the part before them fits on the
    first line and the expression has at most one operator of least precedence, ending in
    them; else in parentheses around it."""
    value = getattr(owner, slot)
    operands = _operands(value)
    opened = _inside_leading(value, room) if len(operands) == 2 else None
    if opened is not None:
        return opened
    candidate = None
    if len(operands) == 1:
        candidate = _at_trailer(value, 0, room)
    elif len(operands) == 2 and (last := _at_trailer(operands[1][1], 0, room)):
        candidate = _with_last_operand(value, last)
    if candidate is not None:
        laid = owner.with_changes(**{slot: candidate}, **_no_body(owner))
        if room.column + len(_code(laid).splitlines()[0]) <= room.width:
            return candidate
    return _parenthesised(value, 0, room)


def _inside_leading(value: cst.BaseExpression, room: _Room) -> cst.BaseExpression | None:
    """`value`, of one operator of least precedence, split inside the parentheses it starts
    with where nothing after them holds brackets to split at and the rest fits on the closing
    line (black: `if (\n    a + b\n) % k == 0:`, not parentheses around it all); else None."""
    leading = value
    while not leading.lpar:
        field = _LEFTMOST.get(type(leading))
        if field is None:
            return None
        leading = getattr(leading, field)
    rest = _code(value)[len(_code(leading)) :]
    if room.column + 4 + 1 + len(rest) > room.width or any(
        _holds_brackets(node) for node in _after(value, leading)
    ):
        return None
    return value.deep_replace(leading, _parenthesised(leading, 0, room))


# The child an expression's code starts with (`(a + b) % k == 0` starts with `(a + b)`).
_LEFTMOST = {
    cst.BinaryOperation: "left",
    cst.BooleanOperation: "left",
    cst.Comparison: "left",
    cst.Call: "func",
    cst.Attribute: "value",
    cst.Subscript: "value",
}


def _after(value: cst.CSTNode, leading: cst.CSTNode):
    """The expressions of `value` that follow `leading`, its leftmost part."""
    if value is leading:
        return
    first = getattr(value, _LEFTMOST[type(value)])
    yield value
    yield from _after(first, leading)
    for child in value.children:
        if child is not first:
            yield from walk(child)


def _holds_brackets(node: cst.CSTNode) -> bool:
    """Whether `node` has brackets of its own with something inside (`f(x)`, `[x]`, `(x)`)."""
    if isinstance(node, cst.BaseExpression) and node.lpar:
        return True
    if isinstance(node, cst.Call):
        return bool(node.args)
    return isinstance(node, (cst.Subscript, cst.List, cst.Tuple, cst.Set, cst.Dict, cst.BaseComp))


def _at_trailer(value: cst.BaseExpression, level: int, room: _Room):
    """`value` split at its last brackets that hold something: a call's arguments, its own
    parentheses' content (`x.f(a)()` at `(a)`, `(a + b).item()` inside the parentheses);
    None where it ends in none."""
    if value.lpar:
        return _parenthesised(value, level, room)
    if isinstance(value, cst.Call) and value.args:
        return value.with_changes(**_bracketed_items(value, "args", level, room))
    field = "func" if isinstance(value, cst.Call) else "value"
    if isinstance(value, (cst.Call, cst.Attribute)):
        inner = _at_trailer(getattr(value, field), level, room)
        return inner and value.with_changes(**{field: inner})
    return None


def _no_body(node: cst.CSTNode) -> dict:
    if isinstance(node, cst.BaseCompoundStatement):
        return {"body": cst.SimpleStatementSuite([cst.Pass()]), "leading_lines": []}
    return {}


def _newline(level: int, room: _Room) -> cst.ParenthesizedWhitespace:
    """A line break inside brackets, the next line `level` columns (a level of indentation
    each four) in from the statement."""
    last = cst.SimpleWhitespace(room.indent * (level // 4))
    return cst.ParenthesizedWhitespace(indent=True, last_line=last)


def _parenthesised(value: cst.BaseExpression, level: int, room: _Room):
    """`value` in parentheses (its own, else added), its content on lines of its own."""
    inner = level + 4
    bare = value.with_changes(lpar=[], rpar=[])
    content = _laid(bare, inner, 0, 0, room)
    return content.with_changes(
        lpar=[cst.LeftParen(whitespace_after=_newline(inner, room))],
        rpar=[cst.RightParen(whitespace_before=_newline(level, room))],
    )


def _laid(value: cst.BaseExpression, level: int, head: int, tail: int, room: _Room):
    """`value` inside brackets, starting a line at `level` after `head` characters and
    followed by `tail` ones: as it is where it fits, else one operand a line (at the
    operators of least precedence), else split at its own closing brackets."""
    text = _code(value)
    if "\n" not in text and room.column + level + head + len(text) + tail <= room.width:
        return value
    operands = _operands(value)
    if len(operands) > 1:
        return _broken(value, level, tail, room)
    if isinstance(value, cst.Tuple) and not value.lpar and value.elements:
        return _elements_laid(value, level, room)
    return _at_trailer(value, level, room) or value


def _elements_laid(value: cst.Tuple, level: int, room: _Room) -> cst.Tuple:
    """A tuple's elements inside its brackets, one a line at `level`, with a trailing comma."""
    last = len(value.elements) - 1
    return value.with_changes(
        elements=[
            element.with_changes(
                value=_laid(element.value, level, len(getattr(element, "star", "")), 1, room),
                comma=cst.Comma(
                    whitespace_after=_newline(level, room) if i < last else cst.SimpleWhitespace("")
                ),
            )
            for i, element in enumerate(value.elements)
        ]
    )


def _bracketed_items(node: cst.CSTNode, field: str, level: int, room: _Room):
    """The changes that put the arguments (`args` of a call) or parameters (`params` of a
    `def`) of `node`, a line at `level`, on lines of their own: all on one where they fit,
    else one a line with a trailing comma."""
    inner = level + 4
    if field == "args":
        items, opening = list(node.args), "whitespace_before_args"
        space = "whitespace_after_arg"
    else:
        items, opening = list(node.params.params), "whitespace_before_params"
        space = "whitespace_after_param"
        if not items or _other_parameters(node.params):
            return {}
    if not items:
        return {}
    last = items[-1]
    one_line = [*items[:-1], last.with_changes(comma=cst.MaybeSentinel.DEFAULT)]
    plain = [i.with_changes(**{space: cst.SimpleWhitespace("")}) for i in one_line]
    text = _code(cst.Parameters(plain)) if field == "params" else _code(cst.Call(_F, plain))[2:-1]
    if (
        "\n" not in text
        and room.column + inner + len(text) <= room.width
        and not _trailing_comma(last)
    ):
        laid = [*items[:-1], last.with_changes(**{space: _newline(level, room)})]
    elif len(items) == 1 and not _trailing_comma(last):
        laid = [_item_laid(last, inner, 0, room).with_changes(**{space: _newline(level, room)})]
    else:
        laid = [
            _item_laid(item, inner, 1, room).with_changes(
                comma=cst.Comma(
                    whitespace_after=_newline(inner if i < len(items) - 1 else level, room)
                ),
                **{space: cst.SimpleWhitespace("")},
            )
            for i, item in enumerate(items)
        ]
    if field == "args":
        return {opening: _newline(inner, room), "args": laid}
    return {opening: _newline(inner, room), "params": node.params.with_changes(params=laid)}


_F = cst.Name("f")  # a call's name, to measure its arguments


def _other_parameters(params: cst.Parameters) -> bool:
    """Whether a signature has parameters besides plain positional ones (`*`, `/`, ...)."""
    return bool(
        params.posonly_params
        or params.kwonly_params
        or params.star_kwarg
        or not isinstance(params.star_arg, cst.MaybeSentinel)
    )


def _trailing_comma(item) -> bool:
    return isinstance(item.comma, cst.Comma)


def _item_laid(item, level: int, tail: int, room: _Room):
    """An argument, or a parameter's default, laid out on its line (`_laid`) after its
    `name=`, `*` or `**`."""
    if isinstance(item, cst.Param):
        if item.default is None:
            return item
        bare = item.with_changes(
            default=None, equal=cst.MaybeSentinel.DEFAULT, comma=cst.MaybeSentinel.DEFAULT
        )
        head = len(_code(cst.Parameters([bare]))) + 1
        return item.with_changes(default=_laid(item.default, level, head, tail, room))
    head = len(item.star) + (len(item.keyword.value) + 1 if item.keyword is not None else 0)
    return item.with_changes(value=_laid(item.value, level, head, tail, room))


def _operands(value: cst.BaseExpression) -> list[tuple[cst.CSTNode | None, cst.BaseExpression]]:
    """The operands of `value`'s operators of least precedence, each with the operator before
    it (None for the first): a chain of `+`/`-` or `*`/`/`..., of `and`/`or`, of comparisons,
    a conditional expression's parts; `[(None, value)]` for anything else."""
    if value.lpar:
        return [(None, value)]
    if isinstance(value, cst.BinaryOperation) and type(value.operator) in _PRECEDENCE:
        level = _PRECEDENCE[type(value.operator)]
        left = value.left
        same = (
            isinstance(left, cst.BinaryOperation) and _PRECEDENCE.get(type(left.operator)) == level
        )
        chain = _operands(left) if same else [(None, left)]
        return [*chain, (value.operator, value.right)]
    if isinstance(value, cst.BooleanOperation):
        left = _operands(value.left) if isinstance(value.left, cst.BooleanOperation) else None
        return [*(left or [(None, value.left)]), (value.operator, value.right)]
    if isinstance(value, cst.Comparison):
        return [(None, value.left), *((c.operator, c.comparator) for c in value.comparisons)]
    if isinstance(value, cst.IfExp):
        return [(None, value.body), ("if", value.test), ("else", value.orelse)]
    return [(None, value)]


# Binary operators black splits at, by precedence (those of a level chain together).
_PRECEDENCE = {
    cst.BitOr: 9,
    cst.BitXor: 8,
    cst.BitAnd: 7,
    cst.LeftShift: 6,
    cst.RightShift: 6,
    cst.Add: 5,
    cst.Subtract: 5,
    cst.Multiply: 4,
    cst.Divide: 4,
    cst.FloorDivide: 4,
    cst.Modulo: 4,
    cst.MatrixMultiply: 4,
}


def _broken(value: cst.BaseExpression, level: int, tail: int, room: _Room):
    """`value` with a line break before each operator of least precedence (`_operands`), each
    operand laid out on its line."""

    def operand(expr, operator_text: str, last: bool):
        return _laid(expr, level, len(operator_text), tail if last else 0, room)

    if isinstance(value, cst.IfExp):
        return value.with_changes(
            body=operand(value.body, "", False),
            whitespace_before_if=_newline(level, room),
            test=operand(value.test, "if ", False),
            whitespace_before_else=_newline(level, room),
            orelse=operand(value.orelse, "else ", True),
        )
    if isinstance(value, cst.Comparison):
        comparisons = value.comparisons
        return value.with_changes(
            left=operand(value.left, "", False),
            comparisons=[
                c.with_changes(
                    operator=c.operator.with_changes(whitespace_before=_newline(level, room)),
                    comparator=operand(
                        c.comparator,
                        _code(c.operator).strip() + " ",
                        i == len(comparisons) - 1,
                    ),
                )
                for i, c in enumerate(comparisons)
            ],
        )
    return _broken_chain(value, level, tail, room)


def _broken_chain(value, level: int, tail: int, room: _Room):
    """A chain of binary or boolean operations broken before each of its operators."""
    operator = value.operator.with_changes(whitespace_before=_newline(level, room))
    right = _laid(value.right, level, len(_code(operator).strip()) + 1, tail, room)
    if len(_operands(value)) > 2:  # the left operand continues the chain
        left = _broken_chain(value.left, level, 0, room)
    else:
        left = _laid(value.left, level, 0, 0, room)
    return value.with_changes(left=left, operator=operator, right=right)


def _with_last_operand(value: cst.BaseExpression, last: cst.BaseExpression):
    """`value` (a chain of two operands, `_operands`) with its second operand replaced."""
    if isinstance(value, cst.Comparison):
        *rest, final = value.comparisons
        return value.with_changes(comparisons=[*rest, final.with_changes(comparator=last)])
    if isinstance(value, cst.IfExp):
        return value.with_changes(orelse=last)
    return value.with_changes(right=last)


def _comment_lines(line: cst.EmptyLine, room: _Room) -> list[cst.EmptyLine]:
    """A comment line longer than the line length at `room` broken between words."""
    comment = line.comment
    if comment is None or room.column + len(comment.value) <= room.width:
        return [line]
    words, lines, current = comment.value[1:].split(), [], "#"
    for word in words:
        if len(current) > 1 and room.column + len(current) + 1 + len(word) > room.width:
            lines.append(current)
            current = "#"
        current += " " + word
    lines.append(current)
    return [line.with_changes(comment=cst.Comment(text)) for text in lines]
