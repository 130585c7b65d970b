"""Output formats (text, json, sarif, github) and the rule catalogue's entries."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
from dataclasses import fields
from itertools import pairwise
from pathlib import Path

import jsonschema
import pytest
from conftest import expected_findings, fixture_scripts
from hypothesis import given, settings
from hypothesis import strategies as st

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from typer.testing import CliRunner

import gaaudit.output
from gaaudit import catalogue
from gaaudit.cli import app
from gaaudit.config import Settings
from gaaudit.discover.source import decode
from gaaudit.findings import Confidence, FileError, FileReport, Finding, Span
from gaaudit.fixes.fixer import fix_source
from gaaudit.output import CheckRun, write
from gaaudit.output.sarif_fixes import SuggestedFix, replacements

REPO = Path(__file__).resolve().parents[1]
FIXABLE = {"GA001", "GA002", "GA003", "GA004", "GA005", "GA007"}
SOURCE = """\
for step, batch in enumerate(loader):
    outputs = model(**batch)
    loss = outputs.loss / gradient_accumulation_steps
    loss.backward()
"""


@pytest.fixture
def train_py(tmp_path, monkeypatch) -> str:
    """A real file for code frames and fingerprints, named relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(SOURCE, encoding="utf-8")
    return "train.py"


def finding(path: str, code: str = "GA001", line: int = 3, **changes) -> Finding:
    values = {
        "path": path,
        "code": code,
        "message": "mean loss divided by gradient_accumulation_steps",
        "span": Span(line, 12, line, 54),
        "confidence": Confidence.HIGH,
        "evidence": ("labels padded with -100",),
        "hint": "sum and count",
        "fixable": True,
    }
    return Finding(**{**values, **changes})


def render(fmt: str, reports: list[FileReport], files_checked: int = 3, **options) -> str:
    out = io.StringIO()
    write(fmt, CheckRun(reports, files_checked, elapsed=0.1234, **options), out)
    return out.getvalue()


def sample(path: str) -> list[FileReport]:
    return [
        FileReport("b.py", [finding("b.py", "GA002", line=1, confidence=Confidence.LOW, hint="")]),
        FileReport(path, [finding(path), finding(path, line=2, confidence=Confidence.MEDIUM)]),
        FileReport("bad.py", error=FileError("bad.py", "syntax error, not valid Python 3", 4, 7)),
    ]


# text


def test_text_lines_and_summary(train_py):
    lines = render("text", sample(train_py)).splitlines()
    assert lines == [
        "b.py:1:12: GA002 [low] mean loss divided by gradient_accumulation_steps",
        "    labels padded with -100",
        "train.py:2:12: GA001 [medium] mean loss divided by gradient_accumulation_steps",
        "    labels padded with -100",
        "    hint: sum and count",
        "train.py:3:12: GA001 [high] mean loss divided by gradient_accumulation_steps",
        "    labels padded with -100",
        "    hint: sum and count",
        "bad.py:4:7: E999 syntax error, not valid Python 3",
        (
            "Found 3 findings (GA001: 2, GA002: 1) in 2 of 3 files in 0.12s."
            " 1 file could not be checked."
        ),
    ]


def test_text_all_checked_and_quiet():
    assert (
        render("text", [FileReport("a.py")], files_checked=1) == "All checked! 1 file in 0.12s.\n"
    )
    assert render("text", [FileReport("a.py")], quiet=True) == ""
    quiet = render("text", [FileReport("a.py", [finding("a.py")])], quiet=True).splitlines()
    assert quiet[0].startswith("a.py:3:12: GA001 [high]") and not quiet[-1].startswith("Found")


def test_text_statistics(train_py):
    lines = render("text", sample(train_py), statistics=True).splitlines()
    assert lines[:2] == [
        "2  GA001  mean-loss-divided-by-accumulation-steps",
        "1  GA002  unnormalized-accumulation",
    ]
    assert lines[2].startswith("bad.py:4:7: E999") and lines[3].startswith("Found 3 findings")


def test_text_colour_has_ansi_and_code_frame(train_py, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    text = render("text", [FileReport(train_py, [finding(train_py)])], color=True)
    assert "\x1b[" in text
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()
    assert plain[1] == "  3 |     loss = outputs.loss / gradient_accumulation_steps"
    assert plain[2] == "    |            " + "^" * 42


def test_text_colour_frame_multiline_and_unreadable(train_py):
    multi = finding(train_py, span=Span(2, 5, 3, 9))
    gone = finding("missing.py")
    plain = re.sub(
        r"\x1b\[[0-9;]*m", "", render("text", [FileReport(train_py, [multi, gone])], color=True)
    )
    lines = plain.splitlines()
    assert lines[3].startswith("train.py:2:5: GA001")
    assert lines[4:8] == [
        "  2 |     outputs = model(**batch)",
        "    |     " + "^" * 24,
        "  3 |     loss = outputs.loss / gradient_accumulation_steps",
        "    |     ^^^^",
    ]
    assert lines[0].startswith("missing.py:3:12:") and lines[1] == "    labels padded with -100"
    assert lines[8] == "    labels padded with -100"


def test_only_colour_loads_rich():
    script = (
        "import io, sys; from gaaudit.output import *; from gaaudit.findings import FileReport\n"
        "for fmt in FORMATS: write(fmt, CheckRun([FileReport('a.py')], 1, 0.0), io.StringIO())\n"
        "assert 'rich' not in sys.modules, 'rich loaded'\n"
        "write('text', CheckRun([], 0, 0.0, color=True), io.StringIO())\n"
        "assert 'rich' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True)


# json


def test_json_validates_and_round_trips(train_py):
    schema = json.loads((Path(gaaudit.output.__file__).parent / "json_schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    reports = sample(train_py)
    document = json.loads(render("json", reports))
    jsonschema.validate(document, schema, cls=jsonschema.Draft202012Validator)
    assert document["schema_version"] == 1
    assert document["summary"] == {
        "files_checked": 3,
        "findings": 3,
        "errors": 1,
        "by_code": {"GA001": 2, "GA002": 1},
        "hidden": 0,
    }
    assert document["notes"] == []
    first = document["findings"][0]
    rule = catalogue.load()["GA002"]
    assert first == {
        "path": "b.py",
        "code": "GA002",
        "name": rule.name,
        "message": "mean loss divided by gradient_accumulation_steps",
        "line": 1,
        "column": 12,
        "end_line": 1,
        "end_column": 54,
        "cell": None,
        "confidence": "low",
        "evidence": ["labels padded with -100"],
        "hint": "",
        "fixable": True,
        "url": rule.help_uri,
    }
    rebuilt = [
        Finding(
            d["path"],
            d["code"],
            d["message"],
            Span(d["line"], d["column"], d["end_line"], d["end_column"]),
            Confidence.parse(d["confidence"]),
            tuple(d["evidence"]),
            d["hint"],
            d["fixable"],
        )
        for d in document["findings"]
    ]
    assert rebuilt == sorted((f for r in reports for f in r.findings), key=lambda f: f.sort_key)
    assert document["errors"] == [
        {
            "path": "bad.py",
            "code": "E999",
            "message": "syntax error, not valid Python 3",
            "line": 4,
            "column": 7,
        }
    ]


# sarif


def sarif_run(reports: list[FileReport], schema: dict) -> dict:
    log = json.loads(render("sarif", reports))
    jsonschema.validators.validator_for(schema)(schema).validate(log)
    (run,) = log["runs"]
    return run


def test_sarif_validates_with_rules_levels_and_locations(train_py, sarif_schema):
    run = sarif_run(sample(train_py), sarif_schema)
    rules = catalogue.load()
    driver = run["tool"]["driver"]
    assert [r["id"] for r in driver["rules"]] == list(rules)
    for meta in driver["rules"]:
        rule = rules[meta["id"]]
        assert meta["name"] == rule.name and meta["helpUri"] == rule.help_uri
        assert meta["shortDescription"]["text"] == rule.summary
        assert meta["fullDescription"]["text"] == rule.what.strip()
        assert rule.good.strip() in meta["help"]["markdown"] and rule.hint in meta["help"]["text"]
        assert meta["defaultConfiguration"]["level"] == rule.severity
    results = run["results"]
    assert [(r["ruleId"], r["level"]) for r in results] == [
        ("GA002", "note"),
        ("GA001", "warning"),
        ("GA001", "error"),
    ]
    for result in results:
        assert driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
    location = results[2]["locations"][0]["physicalLocation"]
    assert location == {
        "artifactLocation": {"uri": "train.py", "uriBaseId": "%SRCROOT%"},
        "region": {"startLine": 3, "startColumn": 12, "endLine": 3, "endColumn": 54},
    }
    assert results[2]["properties"] == {
        "confidence": "high",
        "evidence": ["labels padded with -100"],
    }
    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is False
    (note,) = invocation["toolExecutionNotifications"]
    assert note["descriptor"]["id"] == "E999" and note["message"]["text"].startswith("syntax error")


def test_sarif_clean_run_and_paths(tmp_path, monkeypatch, sarif_schema):
    monkeypatch.chdir(tmp_path)
    reports = [
        FileReport(
            str(tmp_path / "sub dir" / "x.py"), [finding(str(tmp_path / "sub dir" / "x.py"))]
        ),
        FileReport("/elsewhere/y.py", [finding("/elsewhere/y.py")]),
    ]
    uris = [
        r["locations"][0]["physicalLocation"]["artifactLocation"]
        for r in sarif_run(reports, sarif_schema)["results"]
    ]
    assert uris == [
        {"uri": "file:///elsewhere/y.py"},
        {"uri": "sub%20dir/x.py", "uriBaseId": "%SRCROOT%"},
    ]
    clean = sarif_run([FileReport("a.py")], sarif_schema)
    assert clean["results"] == [] and clean["invocations"][0]["executionSuccessful"] is True


def fingerprints(reports: list[FileReport], schema: dict) -> list[str]:
    return [r["partialFingerprints"]["gaaudit/v1"] for r in sarif_run(reports, schema)["results"]]


def test_sarif_fingerprints_are_stable(train_py, sarif_schema):
    reports = [FileReport(train_py, [finding(train_py), finding(train_py, line=2)])]
    before = fingerprints(reports, sarif_schema)
    assert before == fingerprints(reports, sarif_schema) and len(set(before)) == 2

    Path(train_py).write_text("import torch\n\n" + SOURCE, encoding="utf-8")
    shifted = [FileReport(train_py, [finding(train_py, line=5), finding(train_py, line=4)])]
    assert fingerprints(shifted, sarif_schema) == before


def test_sarif_fingerprints_count_repeated_lines(train_py, sarif_schema):
    Path(train_py).write_text(SOURCE + SOURCE, encoding="utf-8")
    reports = [FileReport(train_py, [finding(train_py), finding(train_py, line=7)])]
    first, second = fingerprints(reports, sarif_schema)
    assert first != second


# sarif fixes

UNSAFE_PAIRS = (
    # the helper builds its targets: asked with `count_only=True`, its prefix runs twice
    "ga003_deepspeed_loss_helper_builds_targets",
    "ga001_exact_grad_division_range_from_one",
    "ga001_exact_nanogpt_memmap_scaler",
    "ga002_nanogpt_micro_loop_no_division",
    "ga001_loss_fn_parameter_default",  # assumes the parameter's default loss function
    "ga002_denoising_loss_mean_undivided",  # counts every label: no ignore_index is visible
    "ga001_exact_speaker_embedding_mask",  # the same
    "ga003_accelerate_deepspeed_plugin_at_launch",  # assumes accelerate before 1.8
    "ga001_read_ahead_window_carried_across_epochs",  # right only for whole windows a pass
    "ga001_apex_fp16_optimizer_backward",  # the same, and the step is apex's wrapper's
    "ga001_count_restarted_by_callers_epoch_loop",  # the same, the count started per call
    "ga001_step_counter_on_self_spans_calls",  # the same, the step's counter on `self`
    "ga002_count_per_process_other_runtime",  # a runtime whose all-reduce gaaudit cannot write
    "ga005_multisteps_alias_masked_sft",  # epochs: MultiSteps carries a short window over
    "ga004_training_step_withholds_count",  # unshifted targets; a causal LM's count is shifted
    # GA004 opt-outs: the Trainer then divides each micro-batch's mean by K
    "ga004_class_attribute_opt_out",
    "ga004_collator_pads_rows",
    "ga004_exact_collator_stacks_rows",
    "ga004_exact_contrastive_embedder_compute_loss",
    "ga004_exact_contrastive_made_targets",
    "ga004_helper_weights_the_models_loss",
    "ga004_exact_pair_fields_listed_old_signature",
    "ga004_exact_pairwise_reward_old_signature",
    "ga004_dpo_loss_types_unpacked",
    "ga004_forward_kwargs_ignored_regression",
    "ga004_labels_branch_old_signature",
    "ga004_sft_old_compute_loss_signature",
    "ga004_token_losses_unpacked",
    "ga004_weighted_classification_compute_loss",
)
MIXED = """\
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

lm = AutoModelForCausalLM.from_pretrained("gpt2")
for step, batch in enumerate(loader):
    outputs = lm(**batch)  # perte moyenne « par jeton »
    loss = outputs.loss / accum_steps
    loss.backward()
    if (step + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()

gpt = GPT(cfg)
for it in range(max_iters):
    for micro_step in range(accum_steps):
        logits, loss = gpt(X, Y)
        X, Y = get_batch("train")
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()"""


def sarif_results(cli, tmp_path: Path, schema: dict, *args: str) -> list[dict]:
    """`gaaudit check --format sarif` results (all confidences), validated against the schema."""
    report = tmp_path / "out.sarif"
    cli("check", "--format", "sarif", "--min-confidence", "low", "-o", str(report), *args)
    return sarif_run_of(json.loads(report.read_text(encoding="utf-8")), schema)["results"]


def sarif_run_of(log: dict, schema: dict) -> dict:
    jsonschema.validators.validator_for(schema)(schema).validate(log)
    (run,) = log["runs"]
    return run


def apply_offsets(text: str, replacements: list[dict]) -> str:
    """Apply SARIF replacements by `charOffset`/`charLength`, last first."""
    regions = sorted(
        ((r["deletedRegion"], r.get("insertedContent", {}).get("text", "")) for r in replacements),
        key=lambda pair: pair[0]["charOffset"],
    )
    for (region, _), (following, _) in pairwise(regions):
        assert region["charOffset"] + region["charLength"] <= following["charOffset"], "overlap"
    for region, inserted in reversed(regions):
        start = region["charOffset"]
        text = text[:start] + inserted + text[start + region["charLength"] :]
    return text


def apply_lines(text: str, replacements: list[dict]) -> str:
    """Apply SARIF replacements by line and column, lines ending at CR, LF or CRLF."""
    starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]

    def offset(line: int, column: int) -> int:
        return starts[line - 1] + column - 1

    edits = []
    for replacement in replacements:
        region = replacement["deletedRegion"]
        start = offset(region["startLine"], region["startColumn"])
        end = offset(region["endLine"], region["endColumn"])
        edits.append((start, end, replacement.get("insertedContent", {}).get("text", "")))
    for start, end, inserted in sorted(edits, reverse=True):
        text = text[:start] + inserted + text[end:]
    return text


def applied(text: str, result: dict) -> str:
    """`text` with the result's one fix applied, checking both region forms agree."""
    ((fix,),) = [result["fixes"]]
    (change,) = fix["artifactChanges"]
    assert (
        change["artifactLocation"] == result["locations"][0]["physicalLocation"]["artifactLocation"]
    )
    by_offsets = apply_offsets(text, change["replacements"])
    assert apply_lines(text, change["replacements"]) == by_offsets
    return by_offsets


def by_file(results: list[dict]) -> dict[str, list[dict]]:
    files: dict[str, list[dict]] = {}
    for result in results:
        files.setdefault(
            result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"], []
        ).append(result)
    return files


@pytest.fixture(scope="module")
def fixtures_sarif(sarif_schema, tmp_path_factory) -> list[dict]:
    """The results of one `gaaudit check fixtures --format sarif --unsafe-fixes` run (all
    confidences) at the repository's root, validated against the schema; without the fixed
    twins, the fixer's output (tests/test_fix.py checks them clean)."""
    report = tmp_path_factory.mktemp("sarif") / "out.sarif"
    args = ["check", "fixtures", "-f", "sarif", "--unsafe-fixes", "--min-confidence", "low"]
    args += ["--extend-exclude", "*.fixed.py"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        result = CliRunner().invoke(app, [*args, "-o", str(report)], catch_exceptions=False)
    assert result.exit_code == 1  # findings
    return sarif_run_of(json.loads(report.read_text(encoding="utf-8")), sarif_schema)["results"]


def test_sarif_has_a_result_per_expected_finding(fixtures_sarif):
    shown = [r for r in fixtures_sarif if r["properties"]["confidence"] != "low"]
    assert len(shown) == expected_findings()


def test_sarif_fixes_rebuild_every_fixed_fixture(fixtures_sarif):
    scripts = [p.relative_to(REPO).as_posix() for p in fixture_scripts()]
    results = by_file(fixtures_sarif)
    pairs = 0
    for script in scripts:
        fixed = script.replace(".py", ".fixed.py")
        with_fix = [r for r in results.get(script, []) if "fixes" in r]
        if not (REPO / fixed).exists():  # `fix` changes nothing here: no result offers a fix
            assert not with_fix, script
            continue
        assert with_fix, script
        pairs += 1
        original = (REPO / script).read_bytes().decode("utf-8")
        for result in with_fix:
            assert applied(original, result) == (REPO / fixed).read_bytes().decode("utf-8"), script
            unsafe = Path(script).stem in UNSAFE_PAIRS
            (fix,) = result["fixes"]
            assert fix["properties"]["applicability"] == ("unsafe" if unsafe else "safe"), script
            assert ("Unsafe (" in fix["description"]["text"]) == unsafe
            assert fix["description"]["text"].startswith(catalogue.load()[result["ruleId"]].hint)
    assert pairs >= 20


def test_sarif_fixes_need_unsafe_fixes_for_unsafe_ones(cli, tmp_path, sarif_schema, monkeypatch):
    monkeypatch.chdir(REPO)
    scripts = [f"fixtures/{name}.py" for name in (*UNSAFE_PAIRS, "ga001_hf_mlm_bert")]
    results = by_file(sarif_results(cli, tmp_path, sarif_schema, *scripts))
    assert all("fixes" not in r for name in scripts[:-1] for r in results[name])
    (bert,) = results[scripts[-1]]
    original = (REPO / scripts[-1]).read_text(encoding="utf-8")
    assert applied(original, bert) == (REPO / "fixtures/ga001_hf_mlm_bert.fixed.py").read_text(
        encoding="utf-8"
    )


def test_sarif_fixes_per_finding_with_bom_crlf_and_no_final_newline(
    cli, tmp_path, sarif_schema, monkeypatch
):
    data = b"\xef\xbb\xbf" + MIXED.replace("\n", "\r\n").encode("utf-8")
    (tmp_path / "mixed.py").write_bytes(data)
    settings = Settings(min_confidence=Confidence.LOW)
    safe = decode(fix_source(data, tmp_path / "mixed.py", settings).after)
    unsafe = decode(fix_source(data, tmp_path / "mixed.py", settings, unsafe=True).after)
    assert MIXED.replace("\n", "\r\n") not in (safe, unsafe) and safe != unsafe

    monkeypatch.chdir(tmp_path)
    ga001, ga002 = sarif_results(cli, tmp_path, sarif_schema, "mixed.py")
    assert (ga001["ruleId"], ga002["ruleId"]) == ("GA001", "GA002") and "fixes" not in ga002
    original = decode(data)
    assert applied(original, ga001) == safe
    assert ga001["fixes"][0]["description"]["text"] == catalogue.load()["GA001"].hint

    ga001_all, ga002_all = sarif_results(cli, tmp_path, sarif_schema, "mixed.py", "--unsafe-fixes")
    assert ga001_all["fixes"] == ga001["fixes"]  # a safe finding keeps its safe fix
    assert applied(original, ga002_all) == unsafe
    (fix,) = ga002_all["fixes"]
    assert fix["properties"] == {"applicability": "unsafe"}
    description = fix["description"]["text"]
    assert "this also fixes GA001 at line 7." in description
    assert "Unsafe (GA002 at line 18): unsafe fix (" in description


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\r\né", max_size=30), st.text(alphabet="ab\r\né", max_size=30))
def test_replacements_rebuild_any_text(before, after):
    """Both region forms rebuild `after`, whatever the line breaks (`applied` checks both)."""
    edits = replacements(before, after)
    found = finding("x.py")
    (result,) = json.loads(
        render(
            "sarif", [FileReport("x.py", [found])], fixes={found: SuggestedFix("d", False, edits)}
        )
    )["runs"][0]["results"]
    assert (applied(before, result) if edits else before) == after


@pytest.mark.parametrize(
    "options, runs",
    [
        (["-f", "text", "-q"], False),
        (["-f", "json"], False),
        (["-f", "github"], False),
        (["-f", "text"], True),  # the summary counts what `gaaudit fix` would fix
        (["-f", "sarif"], True),  # the results carry the fixes
    ],
)
def test_only_sarif_and_the_text_summary_run_the_fixer(options, runs):
    script = (
        "import os, sys\nfrom gaaudit.cli import app\n"
        "try:\n"
        "    app(['check', *sys.argv[1:], '-o', os.devnull, '--no-cache'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('gaaudit.fixes.fixer' in sys.modules)\n"
    )
    target = REPO / "fixtures" / "ga001_hf_mlm_bert.py"
    run = subprocess.run(
        [sys.executable, "-c", script, str(target), *options],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == str(runs)


# github


def test_github_commands_and_escaping():
    reports = [
        FileReport(
            "a,b:c%.py",
            [
                finding("a,b:c%.py", message="50% of\r\nloss: a, b"),
                finding("a,b:c%.py", line=4, confidence=Confidence.MEDIUM, hint=""),
                finding("a,b:c%.py", line=5, confidence=Confidence.LOW, hint=""),
            ],
        ),
        FileReport("bad.py", error=FileError("bad.py", "cannot read file", 1, 1)),
    ]
    assert render("github", reports).splitlines() == [
        (
            "::error file=a%2Cb%3Ac%25.py,line=3,col=12,endLine=3,endColumn=54,"
            "title=GA001 [high]::50%25 of%0D%0Aloss: a, b%0Ahint: sum and count"
        ),
        (
            "::warning file=a%2Cb%3Ac%25.py,line=4,col=12,endLine=4,endColumn=54,"
            "title=GA001 [medium]::mean loss divided by gradient_accumulation_steps"
        ),
        (
            "::notice file=a%2Cb%3Ac%25.py,line=5,col=12,endLine=5,endColumn=54,"
            "title=GA001 [low]::mean loss divided by gradient_accumulation_steps"
        ),
        "::error file=bad.py,line=1,col=1,title=E999::cannot read file",
    ]


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown output format 'xml'"):
        render("xml", [])


# catalogue


def test_catalogue_entries_are_complete():
    paths = sorted((REPO / "rules").glob("*.toml"))
    assert paths, "no rules/*.toml"
    rules = catalogue.load()
    assert list(rules) == [path.stem for path in paths]
    for path in paths:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        assert set(data) == {f.name for f in fields(catalogue.Rule)}, path.name
        rule = catalogue.Rule(**data)
        assert rule == rules[path.stem] and rule.code == path.stem
        for field in fields(rule):
            value = getattr(rule, field.name)
            assert isinstance(value, str), f"{path.name}: {field.name} is not a string"
            assert value.strip() or field.name == "fixed", f"{path.name}: {field.name} is empty"
        assert re.fullmatch(r"GA\d{3}", rule.code)
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name), rule.name
        assert rule.severity in {"error", "warning", "note"}
        assert "\n" not in rule.summary and "\n" not in rule.hint
        for example in (rule.bad, rule.good, rule.fixed):
            ast.parse(example)
        assert rule.bad != rule.good and rule.bad != rule.fixed
        assert bool(rule.fixed) == (rule.code in FIXABLE), (
            "`fixed` is set exactly for rules with a codemod"
        )
