"""`gaaudit fix` for one file: audit, plan, apply, verify the result parses."""

from __future__ import annotations

from pathlib import Path

from gaaudit.checks.engine import Audited, audit, display_path
from gaaudit.config import Settings
from gaaudit.discover.notebook import load as load_notebook
from gaaudit.discover.notebook import rebuild
from gaaudit.discover.screen import screen
from gaaudit.discover.source import Source, SourceError, parse, read
from gaaudit.fixes.codemod import FileFix, apply
from gaaudit.fixes.edits import line_length
from gaaudit.fixes.pins import fix_script_pins

# Why a GA001-GA003 finding needs no rewrite of its own: a framework fix changed its line.
COVERED = "by the GA004/GA005 rewrite of the same code"
# Why a finding no planner took is left as it is.
NO_REWRITE = "gaaudit has no rewrite for this shape; follow the hint (`gaaudit explain {code}`)"


def fix_source(
    data: bytes,
    path: Path,
    settings: Settings,
    unsafe: bool = False,
    reach: bool = False,
    audited: Audited | None = None,
) -> FileFix:
    """Rewrite every reported, fixable finding of one file's bytes; raises `SourceError`.
    With `reach`, a fix may change another module of the repository too (a loss function
    there returns its count): those files are the result's `companions`. `audited`: `check`'s
    analysis of the whole file, planned on where it is of these bytes."""
    from gaaudit.analysis.domain import Domains
    from gaaudit.checks.accumulation import Auditor
    from gaaudit.fixes.accumulation import Outcome, Planner

    shown = display_path(path)
    if audited is not None and audited.data == data:
        module, context, findings = audited.module, audited.context, audited.findings
        text = data.decode(module.encoding)
    else:
        if not Source(path, data).may_have_findings:
            return FileFix(shown, data, data)
        screened = screen(data, settings.accumulation_names, path.parent)
        if screened.data is None:  # no finding possible
            return FileFix(shown, data, data)
        # Otherwise the whole module is analysed: the rewrite edits it, not a focused copy.
        module = parse(data, screened.tree)
        text = data.decode(module.encoding)
        relative = display_path(path, settings.root)
        context, findings, _ = audit(
            module, text, shown, relative, settings, path.parent, source=data
        )
    reported = {(f.code, f.span.line, f.span.column) for f in findings}
    tree = context.tree
    edits, outcomes = _framework_fixes(context, reported, unsafe, path)
    if any(code == "GA007" for code, _, _ in reported):
        edits, outcomes = _window_fixes(context, reported, edits, outcomes)
    touched = [node for node in edits.replace]
    auditor = Auditor(
        tree, settings.accumulation_names, path.parent, context.imports, context.structure
    )
    sites = [site for site in auditor.sites() if (site.code, *_start(tree, site.node)) in reported]
    covered = [s for s in sites if any(tree.contains(node, s.node) for node in touched)]
    outcomes += [Outcome(s, *_start(tree, s.node), True, COVERED) for s in covered]
    sites = [s for s in sites if s not in covered]
    companions = []
    if sites:
        domains = Domains(tree, auditor.tracer, context.evidence, text)
        planner = Planner(tree, auditor, unsafe, domains, reach, path)
        outcomes += planner.plan(sites)
        edits = _merged(edits, planner.edits)
        companions = [_rewritten(p, t, e) for p, (t, e) in planner.companions.items()]
    handled = {(o.site.code, o.line, o.column) for o in outcomes}
    pinned = [f for f in findings if f.code == "GA006"]  # in the script's inline metadata
    outcomes += [
        Outcome(f, f.span.line, f.span.column, False, NO_REWRITE.format(code=f.code))
        for f in findings
        if (f.code, f.span.line, f.span.column) not in handled and f not in pinned
    ]
    fixed = (
        _compiled(apply(tree, edits, data, line_length(path)), shown)
        if any(o.applied for o in outcomes)
        else data
    )
    if pinned:
        raised, said = fix_script_pins(text, fixed.decode(module.encoding), pinned, unsafe)
        fixed = raised.encode(module.encoding)
        outcomes += said
    outcomes.sort(key=lambda o: (o.line, o.column, o.site.code))
    return FileFix(shown, data, fixed, outcomes, [c for c in companions if c.changed])


def _compiled(fixed: bytes, shown: str) -> bytes:
    """`fixed`, once it is known to parse and compile."""
    try:
        parse(fixed)
        compile(fixed, shown, "exec")
    except (SourceError, SyntaxError, ValueError) as exc:
        raise SourceError(
            f"internal error: the fix would not parse ({exc}); file left unchanged"
        ) from None
    return fixed


def _rewritten(path: Path, tree, edits) -> FileFix:
    """Another module of the repository with its planned edits applied."""
    shown = display_path(path)
    before = tree.module.bytes
    return FileFix(shown, before, _compiled(apply(tree, edits, before, line_length(path)), shown))


def _framework_fixes(context, reported: set[tuple[str, int, int]], unsafe: bool, path: Path):
    """The edits and outcomes of the GA004 (Trainer) and GA005 (JAX) findings reported; the
    Trainer's under the transformers pin that governs `path` (what it lacks before 4.46, and
    which labels its count counts)."""
    from gaaudit.checks.optax import OptaxAudit
    from gaaudit.checks.trainer import TrainerAudit
    from gaaudit.checks.versions import SHIFTED_COUNT, admits, governing_pin
    from gaaudit.fixes.edits import Edits
    from gaaudit.fixes.optax import OptaxPlanner
    from gaaudit.fixes.trainer import TrainerPlanner

    tree = context.tree
    edits, outcomes = Edits(), []
    if any(code == "GA004" for code, _, _ in reported):
        trainer_audit = TrainerAudit(tree, context.imports)
        sites = [s for s in trainer_audit.sites() if ("GA004", *_start(tree, s.node)) in reported]
        later, pin, _ = admits(path, SHIFTED_COUNT)
        planner = TrainerPlanner(
            tree, trainer_audit, unsafe, governing_pin(path)[0], "" if later else pin
        )
        outcomes += planner.plan(sites)
        edits = _merged(edits, planner.edits)
    if any(code == "GA005" for code, _, _ in reported):
        optax_audit = OptaxAudit(tree, context.accumulation_names, context.imports)
        sites = [s for s in optax_audit.sites() if ("GA005", *_start(tree, s.node)) in reported]
        planner = OptaxPlanner(tree, optax_audit, unsafe)
        outcomes += planner.plan(sites)
        edits = _merged(edits, planner.edits)
    return edits, outcomes


def _window_fixes(context, reported: set[tuple[str, int, int]], edits, outcomes):
    """`edits` and `outcomes` with those of the GA007 findings reported added."""
    from gaaudit.checks.windows import Windows
    from gaaudit.fixes.windows import WindowPlanner

    tree = context.tree
    windows = Windows(tree, context.structure)
    sites = [
        s for s in windows.sites() if ("GA007", *_start(tree, s.conjunct or s.node)) in reported
    ]
    planner = WindowPlanner(tree)
    outcomes = outcomes + planner.plan(sites)
    return _merged(edits, planner.edits), outcomes


def _merged(first, second):
    """Two plans' edits as one; they touch different nodes (overlaps were left to `first`)."""
    from gaaudit.fixes.edits import Edits

    merged = Edits({**second.replace, **first.replace}, spaced=first.spaced | second.spaced)
    for table in ("before", "after"):
        combined = getattr(merged, table)
        for plan in (first, second):
            for anchor, statements in getattr(plan, table).items():
                combined.setdefault(anchor, []).extend(statements)
    return merged


def _start(tree, node) -> tuple[int, int]:
    span = tree.span(node)
    return span.line, span.column


def count_fixable(
    path: Path, settings: Settings, data: bytes | None = None, audited: Audited | None = None
) -> int:
    """How many findings of the file (of `data`, its text from standard input) `gaaudit fix`
    would fix (safe fixes only), planned on `audited`, `check`'s analysis, where there is one."""
    try:
        return sum(o.applied for o in fix_file(path, settings, data=data, audited=audited).outcomes)
    except Exception:  # noqa: BLE001 - unreadable since checked, or a fixer bug: not counted
        return 0


def fix_file(
    path: Path,
    settings: Settings,
    unsafe: bool = False,
    data: bytes | None = None,
    audited: Audited | None = None,
) -> FileFix:
    """Plan the fix of one file on disk, or of `data`, its text from standard input (nothing
    is written here); notebooks cell by cell. `audited`: see `fix_source`."""
    raw = read(path, data).data
    if path.suffix != ".ipynb":  # other files are fixed too, unless the text came on stdin
        return fix_source(raw, path, settings, unsafe, reach=data is None, audited=audited)
    notebook = load_notebook(raw)
    try:
        fixed = fix_source(notebook.text.encode("utf-8"), path, settings, unsafe)
    except SourceError as exc:
        raise notebook.relocate_error(exc) from None
    outcomes = [notebook.relocate_outcome(o) for o in fixed.outcomes]
    after = rebuild(notebook, fixed.after.decode("utf-8"), raw) if fixed.changed else raw
    return FileFix(fixed.path, raw, after, outcomes)
