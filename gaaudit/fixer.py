"""`gaaudit fix` for one file: audit, plan, apply, verify the result parses."""

from __future__ import annotations

from pathlib import Path

from gaaudit.codemod import FileFix, apply
from gaaudit.config import Settings
from gaaudit.engine import audit, display_path
from gaaudit.notebook import load as load_notebook
from gaaudit.notebook import rebuild
from gaaudit.source import Source, SourceError, parse, read


def fix_source(data: bytes, path: Path, settings: Settings, unsafe: bool = False) -> FileFix:
    """Rewrite every reported, fixable finding of one file's bytes; raises `SourceError`."""
    from gaaudit.checks.accumulation import Auditor
    from gaaudit.fixes import Planner

    shown = display_path(path)
    if not Source(path, data).may_have_findings:
        return FileFix(shown, data, data)
    module = parse(data)
    text = data.decode(module.encoding)
    context, findings = audit(module, text, shown, display_path(path, settings.root), settings, path.parent)
    reported = {(f.code, f.span.line, f.span.column) for f in findings}
    tree = context.tree
    auditor = Auditor(tree, settings.accumulation_names, path.parent)
    sites = [site for site in auditor.sites() if (site.code, *_start(tree, site.node)) in reported]
    if not sites:
        return FileFix(shown, data, data)
    planner = Planner(tree, auditor, unsafe)
    outcomes = planner.plan(sites)
    if not any(o.applied for o in outcomes):
        return FileFix(shown, data, data, outcomes)
    fixed = apply(module, planner.edits).bytes
    try:
        parse(fixed)
        compile(fixed, shown, "exec")
    except (SourceError, SyntaxError, ValueError) as exc:
        raise SourceError(f"internal error: the fix would not parse ({exc}); file left unchanged") from None
    return FileFix(shown, data, fixed, outcomes)


def _start(tree, node) -> tuple[int, int]:
    span = tree.span(node)
    return span.line, span.column


def fix_file(path: Path, settings: Settings, unsafe: bool = False) -> FileFix:
    """Plan the fix of one file on disk (nothing is written here); notebooks cell by cell."""
    raw = read(path).data
    if path.suffix != ".ipynb":
        return fix_source(raw, path, settings, unsafe)
    notebook = load_notebook(raw)
    try:
        fixed = fix_source(notebook.text.encode("utf-8"), path, settings, unsafe)
    except SourceError as exc:
        raise notebook.relocate_error(exc) from None
    outcomes = [notebook.relocate_outcome(o) for o in fixed.outcomes]
    after = rebuild(notebook, fixed.after.decode("utf-8"), raw) if fixed.changed else raw
    return FileFix(fixed.path, raw, after, outcomes)
