"""SARIF 2.1.0 output, for GitHub code scanning and other SARIF viewers."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import quote

from gaaudit import __version__, catalogue
from gaaudit.findings import Confidence, FileError, Finding
from gaaudit.output import CheckRun, source_lines

if TYPE_CHECKING:
    from gaaudit.output.sarif_fixes import Replacement, SuggestedFix

SCHEMA_URI = (
    "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
)
FINGERPRINT_KEY = "gaaudit/v1"
LEVEL = {Confidence.HIGH: "error", Confidence.MEDIUM: "warning", Confidence.LOW: "note"}


def write(run: CheckRun, out: TextIO) -> None:
    """Write a SARIF log of one run: all catalogue rules, the findings, errors as notifications."""
    rules = catalogue.load()
    index = {code: i for i, code in enumerate(rules)}
    errors = run.errors
    log = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "gaaudit",
                        "version": __version__,
                        "informationUri": catalogue.DOCS_URL.partition("#")[0],
                        "rules": [_rule(rule) for rule in rules.values()],
                    }
                },
                "invocations": [
                    {
                        "executionSuccessful": not errors,
                        "toolExecutionNotifications": [_notification(e) for e in errors],
                    }
                ],
                "columnKind": "unicodeCodePoints",
                "results": [
                    _result(
                        finding, index[finding.code], artifact, fingerprint, run.fixes.get(finding)
                    )
                    for finding, artifact, fingerprint in _fingerprinted(run.findings)
                ],
            }
        ],
    }
    json.dump(log, out, indent=2, ensure_ascii=False)
    out.write("\n")


def _rule(rule: catalogue.Rule) -> dict:
    text = f"{rule.why.strip()}\n\n{rule.hint}\n\nUse instead:\n\n{rule.good}"
    markdown = (
        f"## Why is this bad?\n\n{rule.why.strip()}\n\n**Fix:** {rule.hint}\n\n"
        f"## Use instead\n\n```python\n{rule.good.strip()}\n```\n"
    )
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.what.strip()},
        "help": {"text": text, "markdown": markdown},
        "helpUri": rule.help_uri,
        "defaultConfiguration": {"level": rule.severity},
    }


def _result(
    finding: Finding, rule_index: int, artifact: dict, fingerprint: str, fix: SuggestedFix | None
) -> dict:
    span = finding.span
    region = {
        "startLine": span.line,
        "startColumn": span.column,
        "endLine": span.end_line,
        "endColumn": span.end_column,
    }
    result = {
        "ruleId": finding.code,
        "ruleIndex": rule_index,
        "level": LEVEL[finding.confidence],
        "message": {"text": finding.message},
        "locations": [{"physicalLocation": {"artifactLocation": artifact, "region": region}}],
        "partialFingerprints": {FINGERPRINT_KEY: fingerprint},
        "properties": {
            "confidence": str(finding.confidence),
            "evidence": list(finding.evidence),
            **({"cell": finding.cell} if finding.cell is not None else {}),
        },
    }
    if fix is not None:
        result["fixes"] = [_fix(fix, artifact)]
    return result


def _fix(fix: SuggestedFix, artifact: dict) -> dict:
    """One fix changing one file; `applicability` says safe or unsafe, as ruff does."""
    return {
        "description": {"text": fix.description},
        "artifactChanges": [
            {
                "artifactLocation": artifact,
                "replacements": [_replacement(r) for r in fix.replacements],
            }
        ],
        "properties": {"applicability": "unsafe" if fix.unsafe else "safe"},
    }


def _replacement(replacement: Replacement) -> dict:
    """The deleted region both as lines and columns and as a character offset and length
    (code points, as `columnKind` says, counted after any byte-order mark)."""
    (start_line, start_column), (end_line, end_column) = replacement.start, replacement.end
    region = {
        "startLine": start_line,
        "startColumn": start_column,
        "endLine": end_line,
        "endColumn": end_column,
        "charOffset": replacement.offset,
        "charLength": replacement.length,
    }
    inserted = {"insertedContent": {"text": replacement.text}} if replacement.text else {}
    return {"deletedRegion": region, **inserted}


def _notification(error: FileError) -> dict:
    region = {"startLine": error.line, "startColumn": error.column}
    return {
        "level": "error",
        "message": {"text": error.message},
        "descriptor": {"id": error.code},
        "locations": [
            {"physicalLocation": {"artifactLocation": _artifact(error.path), "region": region}}
        ],
    }


def _artifact(path: str) -> dict:
    """A URI relative to %SRCROOT% (the working directory), or an absolute file URI outside it."""
    location = Path(path)
    if location.is_absolute():
        try:
            location = location.relative_to(Path.cwd())
        except ValueError:
            return {"uri": location.as_uri()}
    return {"uri": quote(location.as_posix(), errors="surrogateescape"), "uriBaseId": "%SRCROOT%"}


def _fingerprinted(findings: list[Finding]) -> list[tuple[Finding, dict, str]]:
    """Each finding with its artifact location and fingerprint.

    The fingerprint hashes the code, the file, the text of the finding's first line and its
    occurrence index among equal texts; not the line number, so moving code keeps it.
    """
    sources = {path: source_lines(path) for path in {f.path for f in findings}}
    seen: Counter[tuple[str, str, str]] = Counter()
    triples = []
    for finding in findings:
        lines = sources[finding.path]
        text = (
            " ".join(lines[finding.span.line - 1].split())
            if finding.span.line <= len(lines)
            else ""
        )
        artifact = _artifact(finding.path)
        key = (finding.code, artifact["uri"], text)
        digest = hashlib.sha256("\0".join([*key, str(seen[key])]).encode()).hexdigest()[:32]
        seen[key] += 1
        triples.append((finding, artifact, digest))
    return triples
