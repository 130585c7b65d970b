"""GA006: a transformers requirement raised to a release with the Trainer's fix.

An exact pin to a release whose next patch release has the fix (`==4.48.0`) becomes that
patch release, a safe fix. Any other pin is raised to the first release with the fix or
later, an unsafe fix: a newer transformers may need changes elsewhere in the code, and its
Trainer counts the window's tokens only for models whose `forward` takes loss kwargs
(custom `compute_loss` overrides: GA004). The requirement keeps its name, extras, marker
and layout; only its version constraint changes.
"""

from __future__ import annotations

import re
from pathlib import Path

from gaaudit.checks.versions import (
    CONDA,
    POETRY,
    Pin,
    bad_pin,
    is_readme,
    minimum,
    pins,
    script_pins,
)
from gaaudit.findings import Finding
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.codemod import FileFix

CAVEAT = (
    "a newer transformers may need changes elsewhere in the code, and its Trainer counts the "
    "window's tokens only for models whose `forward` takes loss kwargs"
)
# An exact pin to a release without the fix, and the patch release of its minor that has it
PATCHED = {"4.46.0": "4.46.2", "4.46.1": "4.46.2", "4.47.0": "4.47.1", "4.48.0": "4.48.1"}
# `transformers[torch] == 4.30.2 ; python_version >= "3.8"`: name and extras, specifier, marker
PEP_508 = re.compile(r"(?i)^(transformers\s*(?:\[[^\]]*\]\s*)?)([^;@\s][^;@]*?)(\s*(?:;.*)?)$")
# poetry's `"^4.40"`, and `{ version = "4.45.2", extras = [...] }`
QUOTED = re.compile(r"""(?P<quote>["'])(?P<constraint>[^"']*)(?P=quote)""")
POETRY_VERSION = re.compile(r"""version\s*=\s*(?P<quote>["'])(?P<constraint>[^"']*)(?P=quote)""")


def mending(pin: Pin, kind: str) -> tuple[str, bool]:
    """The version constraint that mends a pin of `kind` (`bad_pin`), and whether it is
    safe: the same minor's patch release with the fix for an exact pin to a release without
    it (`==4.48.0`: `==4.48.1`), else the first release with the fix or later (unsafe)."""
    from packaging.requirements import Requirement

    (only, *more) = Requirement(pin.requirement).specifier or [None]
    if only is not None and not more and only.operator == "==" and only.version in PATCHED:
        return f"=={PATCHED[only.version]}", True
    return f">={minimum(kind)}", False


def raised(pin: Pin, constraint: str) -> str | None:
    """`pin.shown` with `constraint` for its version, written in the pin's own syntax (PEP
    508, conda or poetry); None for a git URL, which names no version to change."""
    if pin.requirement == pin.shown:  # PEP 508 as written
        parts = PEP_508.match(pin.shown)
        return f"{parts[1]}{constraint}{parts[3]}" if parts else None
    if conda := CONDA.match(pin.shown):  # `transformers=4.45`, `conda-forge::transformers 4.45`
        return f"{pin.shown[: conda.start(1)].rstrip(' =')}{constraint}"
    if POETRY.match(pin.shown):
        name, value = pin.shown.split("=", 1)
        found = (POETRY_VERSION if value.lstrip().startswith("{") else QUOTED).search(value)
        if found is None:
            return None
        start, end = found.span("constraint")
        return f"{name}={value[:start]}{constraint}{value[end:]}"
    return None


def fix_pins(path: Path, shown: str, findings: list[Finding], unsafe: bool) -> FileFix:
    """The GA006 findings of one dependency file (`shown` as reported), each pin raised
    where `unsafe` allows; a README's advice is left to the user."""
    before = path.read_bytes()
    text = before.decode("utf-8", "surrogateescape")
    written = {(p.line, p.column): p for p in pins(path, text)}
    found = [(f, written.get(_at(f))) for f in findings]
    readme = "a README's advice is not rewritten" if is_readme(path) else ""
    after, outcomes = _raise(text, found, unsafe, readme)
    return FileFix(shown, before, after.encode("utf-8", "surrogateescape"), outcomes)


def fix_script_pins(
    before: str, after: str, findings: list[Finding], unsafe: bool
) -> tuple[str, list[Outcome]]:
    """The GA006 findings of a script's inline metadata (PEP 723, read in `before`) raised
    in `after`, the script as its other fixes left it: comments untouched, so the same pins
    in the same order, perhaps on other lines."""
    read, now = script_pins(before), script_pins(after)
    where = {(pin.line, pin.column): moved for pin, moved in zip(read, now)}
    return _raise(after, [(f, where.get(_at(f))) for f in findings], unsafe)


def _raise(
    text: str, found: list[tuple[Finding, Pin | None]], unsafe: bool, unread: str = ""
) -> tuple[str, list[Outcome]]:
    """`text` with each finding's pin raised (where `unsafe` allows; nowhere where `unread`
    says why not), and the outcomes, at the findings' own positions."""
    lines = text.splitlines(keepends=True)
    outcomes = []
    for finding, pin in sorted(found, key=_right_to_left):
        kind = bad_pin(pin) if pin is not None else None
        constraint, safe = mending(pin, kind) if kind else (f">={minimum('old')}", False)
        new = None if unread or kind in (None, "commit") else raised(pin, constraint)
        if new is None:
            git = pin is not None and "@" in pin.requirement
            what = unread or ("a git URL is not rewritten" if git else "an unread form of pin")
            why = f"{what}: require `transformers{constraint}` in its place"
            outcomes.append(Outcome(finding, *_at(finding), False, why))
        elif not safe and not unsafe:
            why = f"unsafe fix (`{new}`: {CAVEAT}); apply with --unsafe-fixes"
            outcomes.append(Outcome(finding, *_at(finding), False, why))
        else:
            body, start = lines[pin.line - 1], pin.column - 1
            lines[pin.line - 1] = body[:start] + new + body[start + len(pin.shown) :]
            outcomes.append(Outcome(finding, *_at(finding), True, f"`{pin.shown}` -> `{new}`"))
    return "".join(lines), sorted(outcomes, key=lambda o: (o.line, o.column))


def _right_to_left(item: tuple[Finding, Pin | None]) -> tuple[int, int]:
    """Line by line, right to left along a line: the columns still to come stay as read."""
    where = item[1] or item[0].span
    return where.line, -where.column


def _at(finding: Finding) -> tuple[int, int]:
    return finding.span.line, finding.span.column
