"""Machine-readable output; the document's shape is `json_schema.json` (schema_version 1)."""

from __future__ import annotations

import json
from typing import TextIO

from gaaudit import __version__, catalogue
from gaaudit.output import CheckRun

SCHEMA_VERSION = 1


def write(run: CheckRun, out: TextIO) -> None:
    """Write one JSON document describing the whole run."""
    json.dump(_document(run), out, indent=2, ensure_ascii=False)
    out.write("\n")


def _document(run: CheckRun) -> dict:
    rules = catalogue.load()
    findings, errors = run.findings, run.errors
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "gaaudit", "version": __version__},
        "summary": {
            "files_checked": run.files_checked,
            "findings": len(findings),
            "errors": len(errors),
            "by_code": run.counts,
            "hidden": run.hidden,
        },
        "findings": [
            {
                "path": f.path,
                "code": f.code,
                "name": rules[f.code].name,
                "message": f.message,
                "line": f.span.line,
                "column": f.span.column,
                "end_line": f.span.end_line,
                "end_column": f.span.end_column,
                "cell": f.cell,
                "confidence": str(f.confidence),
                "evidence": list(f.evidence),
                "hint": f.hint,
                "fixable": f.fixable,
                "url": rules[f.code].help_uri,
            }
            for f in findings
        ],
        "errors": [
            {
                "path": e.path,
                "code": e.code,
                "message": e.message,
                "line": e.line,
                "column": e.column,
            }
            for e in errors
        ],
        "notes": [{"path": path, "message": note} for path, note in run.notes],
    }
