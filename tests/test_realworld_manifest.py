"""The real-world corpus's manifest is well formed (benchmarks/realworld/README.md).

Its figures come from `python benchmarks/realworld.py score`, which needs the repositories'
snapshots; these tests only read the manifest, as a fresh clone has it.
"""

from __future__ import annotations

import json
import re

from conftest import ROOT, realworld


def rows() -> list[dict]:
    lines = (ROOT / "benchmarks" / "realworld" / "manifest.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_row_names_a_pinned_file_with_a_known_label_and_its_reasons():
    scorer = realworld()
    loaded = scorer.load_manifest()  # exits on a malformed row
    assert len(loaded) == len(rows())
    for row in rows():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row["repo"]), row
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row
        assert row["label"] in scorer.LABELS, row
        assert row["framework"] in scorer.FRAMEWORKS, row
        assert not row["path"].startswith(("/", "..")), row
        assert all(str(row[field]).strip() for field in scorer.FIELDS), row


def test_each_file_is_labelled_once_and_each_repository_pinned_once():
    found = rows()
    assert len({(r["repo"], r["path"]) for r in found}) == len(found), "a file labelled twice"
    commits = {(r["repo"], r["commit"]) for r in found}
    assert len({repo for repo, _ in commits}) == len(commits), "a repository at two commits"
