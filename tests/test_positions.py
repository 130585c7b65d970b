"""`Tree.span`, computed per statement, against libcst's PositionProvider over the whole module."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from gaaudit.analysis.tree import TRIVIA, Tree
from gaaudit.catalogue import load
from gaaudit.checks.engine import check_file
from gaaudit.commands.verify import targets
from gaaudit.config import Settings
from gaaudit.discover.focus import focus
from gaaudit.discover.source import TRIGGERS, parse
from gaaudit.findings import Confidence, Span
from gaaudit.fixes.fixer import fix_source

LOW = Settings(min_confidence=Confidence.LOW)
ROOT = Path(__file__).resolve().parent.parent
# every fixture but the fixed twins, which are the fixer's rewrites of the same code
FIXTURES = sorted(p for p in (ROOT / "fixtures").rglob("*.py") if not p.name.endswith(".fixed.py"))

TRICKY = {
    "non_ascii_before_node": (
        "é, ß = 'ünïcode', \"日本語\"; total = é + loss.backward()\n"
        "x = {'ключ': 1}['ключ'] + f(ü=1)  # ü\n"
    ).encode(),
    "tabs": b"def f(x):\n\tif x:\n\t\treturn (x +\n\t\t\t1)\n\treturn\t0\n",
    "mixed_indents": b"class A:\n  def f(self):\n        return 1\n  x = 2\nif 1:\n\tpass\n",
    "backslash_continuations": (
        b"total = 1 + \\\n    2 + \\\n3\nif a and \\\n        b:\n    x = \\\n        y\n"
        b"assert \\\n    x, \\\n  'msg'\n"
    ),
    "multi_line_strings": (
        b'def f():\n    """Doc\n    string."""\n    s = """a\n  b\n""" + x; t = 1\n'
        b"    return '''\n''', r'''x\n'''\n"
    ),
    "f_strings": (
        b"name = 'n'\nmsg = f\"{name!r:>{10}} {f'{1 + 2}'}\" + f'''\n{name}\n  {name.upper()}\n'''\n"
        b"print(f'{x=}', rf'\\d{y}')\n"
    ),
    "decorators_with_comments": (
        b"import functools\n\n\n# before\n@functools.cache  # trailing\n# between\n\n"
        b"@(lambda f: f)\n# after\ndef f(\n    a,  # a\n    b=2,\n) -> int:  # header\n"
        b"    # inside\n    return a\n    # footer\n\n@dec\nclass C(Base, metaclass=M):\n"
        b"    @property\n    def p(self): return 1\n"
    ),
    "suites": b"if x: a; b\nelse: c = 1;\nwhile y: y -= 1; continue\nfor i in r: pass\n",
    "elif_chains": (
        b"if a:\n    pass\nelif b:  # b\n    x = 1\n\nelif c: y = 2\nelse:\n    if d:\n"
        b"        z = 3\n    elif e:\n        pass\n"
    ),
    "try_except_star_else_finally": (
        b"try:\n    f()\nexcept* ValueError as e:\n    g(e)\nexcept* (TypeError, KeyError):\n"
        b"    pass\nelse:\n    h()\nfinally:\n    i()\n"
        b"try:\n    pass\nexcept Exception:\n    raise\nexcept:\n    pass\nfinally: j()\n"
    ),
    "match": (
        b"match command.split():\n    case [action]:\n        go(action)\n"
        b"    case [Point(x=0, y=yy), *rest] if yy > 0:\n        pass\n"
        b"    case {'k': v, **kw} | (1 | 2) as w:\n        pass\n    case _:\n        stop()\n"
    ),
    "nested_definitions": (
        b"class Outer:\n    class Inner:\n        def m(self):\n            def inner():\n"
        b"                return lambda q: q\n            return inner\n"
        b"    async def am(self):\n        async for a in b:\n            async with c as d, e:\n"
        b"                await d\n        return [x async for x in y]\n"
    ),
    "crlf": b"import torch\r\n\r\ndef f(x):\r\n    if x:\r\n        return (1,\r\n   2)\r\n    y = 1\r\n",
    "lone_cr": b"import torch\r\rdef f(x):\r    # c\r    return x.backward()\r",
    "bom": b"\xef\xbb\xbf# comment\nx = '\xc3\xa9'; y = x\nif y:\n    z = 1\n",
    "latin1_cookie": b"# -*- coding: latin-1 -*-\nx = '\xe9\xe8'; y = len(x)\ndef f():\n    return '\xe9'\n",
    "no_trailing_newline": b"def f():\n    if a:\n        return 1\n    return (2 +\n 3)",
    "form_feed": b"\x0cx = 1\n\x0c\ndef f():\n\x0c    return 2\n",
    "semicolons_and_comments": b"a = 1;  # one\nb = 2 ; c = 3 ;\n",
    "global_del_walrus": b"def f():\n    global g; del g[0], h\n    if (n := len(a)) > 1:\n        nonlocal_ = n\n",
    "empty_lines_and_footer": b"\n\n# header comment\n\nx = 1\n\n# footer comment\n\n",
    "deep_expression": b"result = f(\n    g(\n        h(\n            [i for i in range(3) if i],\n        ),\n    ),\n)\n",
    "with_parenthesized_items": b"with (\n    open(a) as f,\n    open(b) as g,\n):\n    pass\n",
}

# A training script with helper definitions that `focus` blanks.
FOCUSED = b"""import torch


def unrelated(a, b):
    return a + b


class Model(torch.nn.Module):
    def forward(self, x):  # kept through its class
        return x

    def helper(self):
        return 'h\xc3\xa9'


def train(model, loader, optimizer, k):
    for step, batch in enumerate(loader):
        loss = model(**batch).loss / k
        loss.backward()
        if (step + 1) % k == 0:
            optimizer.step(); optimizer.zero_grad()
"""


def expected_spans(module: cst.Module) -> dict[cst.CSTNode, Span]:
    ranges = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    return {
        node: Span(r.start.line, r.start.column + 1, r.end.line, r.end.column + 1)
        for node, r in ranges.items()
    }


def assert_spans_match(data: bytes) -> None:
    """Every node's span and line equal PositionProvider's; nodes inside statements are
    served without generating the whole module."""
    module = parse(data)
    expected = expected_spans(module)
    tree = Tree(module, source=data)
    module_level = {tree.module} | {
        n for top in [*tree.module.header, *tree.module.footer] for n in tree.walk(top)
    }
    assert expected.keys() >= tree.order.keys()  # every node but trivia is indexed
    assert all(isinstance(node, TRIVIA) for node in expected.keys() - tree.order.keys())
    inside = [node for node in tree.order if node not in module_level]
    mismatched = [
        (type(node).__name__, tree.span(node), expected[node])
        for node in inside
        if tree.span(node) != expected[node] or tree.line(node) != expected[node].line
    ]
    assert not mismatched, mismatched[:5]
    assert tree._positions._whole is None, "a node inside a statement needed the whole module"
    assert all(tree.span(node) == expected[node] for node in module_level)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fixture_spans_match_position_provider(path: Path) -> None:
    assert_spans_match(path.read_bytes())


@pytest.mark.parametrize("code", sorted(load()))
def test_rule_example_spans_match_position_provider(code: str) -> None:
    rule = load()[code]
    for example in (rule.bad, rule.good, rule.fixed):
        if example:
            assert_spans_match(example.encode())


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_tricky_source_spans_match_position_provider(name: str) -> None:
    assert_spans_match(TRICKY[name])


def test_focused_copy_spans_match_and_keep_the_file_lines() -> None:
    focused = focus(FOCUSED, TRIGGERS)
    assert focused != FOCUSED and len(focused.splitlines()) == len(FOCUSED.splitlines())
    assert_spans_match(focused)
    tree = Tree(parse(focused), source=focused)
    backward = next(
        n
        for n in tree.calls
        if isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward"
    )
    assert tree.span(backward) == Span(19, 9, 19, 24)
    assert FOCUSED.splitlines()[18][8:23] == b"loss.backward()"


@pytest.mark.parametrize(
    "source",
    [
        None,  # not given
        b"x = 1\n",  # not the bytes parsed: the statements do not match
    ],
)
def test_without_the_parsed_bytes_spans_come_from_the_whole_module(source) -> None:
    data = TRICKY["decorators_with_comments"]
    module = parse(data)
    expected = expected_spans(module)
    tree = Tree(module, source=source)
    assert all(tree.span(node) == expected[node] for node in tree.order)
    assert tree._positions._whole is not None


def test_syntax_newer_than_python_falls_back_to_the_whole_module() -> None:
    data = b"def f[T](x: T) -> T:\n    return x\ntype Alias = list[int]\ny = f(1)\n"
    module = parse(data)  # libcst reads what this Python's `ast` may not
    expected = expected_spans(module)
    tree = Tree(module, source=data)
    assert all(tree.span(node) == expected[node] for node in tree.order)


def test_check_fix_and_verify_do_not_generate_the_whole_module(monkeypatch) -> None:
    """Check, fix and verify's targets give their trees the bytes they parsed."""

    def whole_module(*_):
        raise AssertionError("PositionProvider ran over the whole module")

    monkeypatch.setattr(MetadataWrapper, "resolve", whole_module)
    fixture = ROOT / "fixtures" / "ga001_hf_mlm_bert.py"
    report = check_file(fixture, Settings())
    assert report.error is None and report.findings
    fixed = fix_source(fixture.read_bytes(), fixture, LOW, unsafe=True)
    assert fixed.after == (ROOT / "fixtures" / "ga001_hf_mlm_bert.fixed.py").read_bytes()
    found = targets(fixture.read_bytes(), fixed.after, path=fixture)
    assert found and all(target.line for target in found)
