"""`gaaudit check` end to end: fixtures, rule examples, formats, exit codes, config, discovery."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import (
    FIXTURES,
    expected,
    expected_findings,
    finding_key,
    fixture_scripts,
    gaaudit,
    unscreened,
)

from gaaudit import catalogue
from gaaudit.analysis.domain import shifts_labels
from gaaudit.checks.engine import check_file
from gaaudit.config import DEFAULT_EXCLUDE, Settings
from gaaudit.discover.files import Excluded
from gaaudit.findings import Confidence
from gaaudit.fixes.fixer import fix_source

ALL = Settings(min_confidence=Confidence.LOW)

BUGGY = textwrap.dedent(
    """\
    from transformers import DataCollatorForSeq2Seq

    for step, batch in enumerate(loader):
        outputs = model(**batch)
        loss = outputs.loss / accum_steps{comment}
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    """
)


def buggy(comment: str = "") -> str:
    return BUGGY.format(comment=comment)


@pytest.mark.parametrize("script", fixture_scripts(), ids=lambda p: p.stem)
def test_fixture_findings_are_exact_and_survive_the_screen(script: Path):
    """The `.expected` findings, the same as the whole module's without the `ast` screen
    (tests/test_screen.py)."""
    report = check_file(script, ALL)
    assert report.error is None
    got = [(f.span.line, f.code, str(f.confidence)) for f in report.findings]
    assert got == expected(script)
    whole = unscreened(script, ALL)
    assert sorted(map(finding_key, report.findings)) == sorted(map(finding_key, whole))


def test_fixture_catalogue_is_large_and_varied():
    scripts = fixture_scripts()
    buggy_ones = [s for s in scripts if expected(s)]
    clean = [s for s in scripts if not expected(s)]
    assert len(buggy_ones) >= 20 and len(clean) >= 8
    codes = {code for s in buggy_ones for _, code, _ in expected(s)}
    levels = {level for s in buggy_ones for _, _, level in expected(s)}
    assert {"GA001", "GA002", "GA003"} <= codes and levels == {"low", "medium", "high"}


@pytest.mark.parametrize("rule", list(catalogue.load().values()), ids=lambda r: r.code)
def test_rule_examples(rule, tmp_path):
    examples = (("bad", rule.bad, True), ("good", rule.good, False), ("fixed", rule.fixed, False))
    for name, source, should_fire in examples:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        codes = [f.code for f in check_file(path, ALL).findings]
        assert (rule.code in codes) is should_fire, (name, codes)


def test_finding_carries_evidence_and_hint(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(buggy())
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.span.line, finding.span.column) == ("GA001", 5, 12)
    assert finding.confidence is Confidence.HIGH
    assert any("outputs.loss" in e for e in finding.evidence)
    assert any("(step + 1) % accum_steps == 0" in e for e in finding.evidence)
    assert any("DataCollatorForSeq2Seq" in e for e in finding.evidence)
    assert finding.hint == catalogue.load()["GA001"].hint


def test_messages_and_hints_speak_of_the_loss_gaaudit_saw():
    """A headline says "Mean loss" only where gaaudit saw a mean; a dense loss's hint counts
    elements, and one gaaudit could not trace counts valid targets, not valid tokens."""
    (unknown,) = check_file(FIXTURES / "ga001_unknown_loss_fn_param.py", ALL).findings
    assert "could not tell" in unknown.evidence[-1]
    assert unknown.message.startswith("Loss divided by")
    assert "fewer valid targets" in unknown.message and "valid-target count" in unknown.hint
    (dense,) = check_file(FIXTURES / "ga003_exact_accelerate_mse_latents.py", ALL).findings
    assert "valid-token" not in dense.hint and "element count" in dense.hint
    assert "fewer elements" in dense.message
    (tokens,) = check_file(FIXTURES / "ga001_padded_documents_ignore_index.py", ALL).findings
    assert tokens.message.startswith("Mean loss") and "valid-token" in tokens.hint
    # a model handed in under a class annotation: the class tells what it models
    annotated = check_file(FIXTURES / "ga001_exact_annotated_tokenizer_parts_read.py", ALL)
    for finding in annotated.findings:
        assert "`ImageTokenizer` models fixed-size images" in finding.evidence[-1], finding


def test_step_after_a_skipping_guard_is_a_window(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(
        textwrap.dedent(
            """\
            for step, batch in enumerate(loader):
                loss = model(**batch).loss / k
                loss.backward()
                if (step + 1) % k != 0:
                    continue
                optimizer.step()
                optimizer.zero_grad()
            """
        )
    )
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.span.line) == ("GA001", 2)
    assert any("after `if (step + 1) % k != 0: continue` (line 4)" in e for e in finding.evidence)


def test_a_mean_on_the_first_arm_of_an_elif_chain_is_traced_through_its_helper(tmp_path):
    """A helper whose `if` arm averages, an `elif` sums and an `else` keeps the elements, and
    that returns the loss after the chain: the mean arm still reaches that return."""
    path = tmp_path / "train.py"
    path.write_text(
        textwrap.dedent(
            """\
            import torch.nn.functional as F


            def reduced(losses, lengths, reduction="mean"):
                if reduction == "mean":
                    loss = (losses / lengths).mean()
                elif reduction == "sum":
                    loss = losses.sum()
                else:
                    loss = losses
                return loss


            for step, (x, y, lengths) in enumerate(loader):
                losses = F.cross_entropy(model(x), y, reduction="none").sum(-1)
                loss = reduced(losses, lengths, reduction="mean") / k
                loss.backward()
                if (step + 1) % k == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            """
        )
    )
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.span.line) == ("GA001", 16)
    assert any("(losses / lengths).mean()" in e for e in finding.evidence)


BACKWARD_HELPER = """\
from transformers import AutoModelForCausalLM


def backward_step(optimizer, model, lm_loss, args):
    lm_loss.backward()


def train(args, loader, optimizer):
    model = AutoModelForCausalLM.from_pretrained(args.model)
    for step, batch in enumerate(loader):
        lm_loss = model(**batch).loss / args.gradient_accumulation_steps
        backward_step(optimizer, model, lm_loss=lm_loss, args=args)
        if (step + 1) % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    "signature, arguments",
    [
        ("(optimizer, model, lm_loss, args)", "lm_loss=lm_loss, args=args"),  # by keyword
        ("(optimizer, model, *, lm_loss, args)", "lm_loss=lm_loss, args=args"),  # keyword-only
        ("(optimizer, /, model, lm_loss, args)", "lm_loss, args"),  # after a positional-only
    ],
    ids=["keyword", "keyword-only", "positional-only-before"],
)
def test_a_backward_helper_is_handed_its_loss_as_its_parameter_binds(
    tmp_path, signature, arguments
):
    """A same-file helper that backpropagates its parameter `lm_loss`: the loss the loop hands
    it is the argument bound to that parameter, passed by keyword or by position, whatever
    parameters come before it; the finding is the loop's division, fixed at the step."""
    path = tmp_path / "train.py"
    source = BACKWARD_HELPER.replace("(optimizer, model, lm_loss, args)", signature)
    path.write_text(source.replace("lm_loss=lm_loss, args=args", arguments))
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.span.line) == ("GA001", 11)
    (outcome,) = fix_source(path.read_bytes(), path, ALL, False).outcomes
    assert outcome.applied, outcome.reason


@pytest.mark.parametrize(
    "comment, reported",
    [
        ("", True),
        ("  # noqa", False),
        ("  # noqa: GA001", False),
        ("  # noqa: GA002", True),
        ("  # gaaudit: ignore[GA001]", False),
        ("  # gaaudit: ignore[GA002, GA003]", True),
        ("  # a comment that mentions GA001", True),
    ],
)
def test_suppressions(tmp_path, comment, reported):
    path = tmp_path / "train.py"
    path.write_text(buggy(comment))
    assert bool(check_file(path, ALL).findings) is reported


def test_noqa_inside_a_string_does_not_suppress(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(buggy('; note = "# noqa"'))
    assert check_file(path, ALL).findings


def test_exit_codes_and_text_output(tmp_path, cli):
    (tmp_path / "bad.py").write_text(buggy())
    (tmp_path / "clean.py").write_text("print('hello')\n")
    result = cli("check", "clean.py", cwd=tmp_path)
    assert result.exit_code == 0 and "All checked!" in result.output
    result = cli("check", ".", cwd=tmp_path)
    assert result.exit_code == 1
    assert "bad.py:5:12: GA001 [high]" in result.output
    assert cli("check", ".", "--exit-zero").exit_code == 0


def test_unparsable_file_is_e999_and_others_still_checked(tmp_path, cli):
    (tmp_path / "bad.py").write_text(buggy())
    (tmp_path / "broken.py").write_text("def f(:\n    loss.backward()\n")
    result = cli("check", ".", cwd=tmp_path)
    assert result.exit_code == 2
    assert "broken.py:1:" in result.output and "E999" in result.output
    assert "bad.py:5:12: GA001" in result.output


def test_min_confidence(tmp_path, cli):
    low = FIXTURES / "ga001_exact_hf_clm_group_texts.py"
    assert cli("check", str(low)).exit_code == 0
    result = cli("check", str(low), "--min-confidence", "low")
    assert result.exit_code == 1 and "[low]" in result.output
    high_only = cli(
        "check", str(FIXTURES / "ga001_inplace_accum_iter_vit.py"), "--min-confidence", "high"
    )
    assert high_only.exit_code == 0


def test_select_and_ignore_options(tmp_path, cli):
    (tmp_path / "bad.py").write_text(buggy())
    assert cli("check", ".", "--ignore", "GA001", cwd=tmp_path).exit_code == 0
    assert cli("check", ".", "--select", "GA002", cwd=tmp_path).exit_code == 0
    assert cli("check", ".", "--select", "GA", cwd=tmp_path).exit_code == 1


def test_pyproject_config(tmp_path, cli):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bad.py").write_text(buggy())
    (tmp_path / "other.py").write_text(buggy())
    (tmp_path / "pyproject.toml").write_text(
        '[tool.gaaudit]\nper-file-ignores = { "scripts/*.py" = ["GA001"] }\nmin-confidence = "high"\n'
    )
    result = cli("check", ".", cwd=tmp_path)
    assert "other.py:5:12: GA001" in result.output and "scripts/bad.py" not in result.output


def test_config_found_from_a_subdirectory(tmp_path, cli):
    (tmp_path / "pyproject.toml").write_text('[tool.gaaudit]\nignore = ["GA001"]\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(buggy())
    assert cli("check", "bad.py", cwd=tmp_path / "pkg").exit_code == 0


@pytest.mark.parametrize(
    "table, words",
    [
        ('select = "GA001"', ["select", "list of strings"]),
        ('min-confidence = "sure"', ["min-confidence", "low, medium, high"]),
        ("colour = true", ["colour", "unknown key"]),
        ('ignore = ["GA999"]', ["ignore", "unknown rule code or prefix 'GA999'", "GA006"]),
        ('per-file-ignores = { "a.py" = ["GA7"] }', ["per-file-ignores", "'GA7'"]),
    ],
)
def test_bad_config_names_the_key(tmp_path, cli, table, words):
    (tmp_path / "pyproject.toml").write_text(f"[tool.gaaudit]\n{table}\n")
    (tmp_path / "bad.py").write_text(buggy())
    result = gaaudit("check", ".", cwd=tmp_path)
    assert result.returncode == 2
    assert "pyproject.toml" in result.stderr and all(w in result.stderr for w in words), (
        result.stderr
    )


def test_accumulation_names_are_configurable(tmp_path, cli):
    source = textwrap.dedent(
        """\
        def train_step(model, batch, every):
            loss = model(**batch).loss / every
            loss.backward()
        """
    )
    (tmp_path / "step.py").write_text(source)
    assert cli("check", ".", cwd=tmp_path).exit_code == 0
    (tmp_path / "pyproject.toml").write_text('[tool.gaaudit]\naccumulation-names = ["every"]\n')
    result = cli("check", ".", cwd=tmp_path)
    assert result.exit_code == 1 and "step.py:2:12: GA001" in result.output


def test_discovery_honours_gitignore_and_default_excludes(tmp_path, cli):
    for name in (
        "kept.py",
        "ignored/x.py",
        ".venv/lib/x.py",
        "build/x.py",
        "node_modules/x.py",
        "notes.txt",
    ):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(buggy())
    (tmp_path / ".gitignore").write_text("ignored/\n")
    result = cli("check", ".", "-q", cwd=tmp_path)
    reported = {line.split(":")[0] for line in result.output.splitlines() if ": GA" in line}
    assert reported == {"kept.py"}
    assert (
        cli("check", "ignored/x.py", cwd=tmp_path).exit_code == 1
    )  # named files are always checked
    excluded = cli("check", ".", "--extend-exclude", "kept.py", cwd=tmp_path)
    assert excluded.exit_code == 0
    replaced = cli("check", ".", "--exclude", "kept.py", "-q", cwd=tmp_path)
    assert "build/x.py" in replaced.output


@pytest.mark.parametrize(
    "patterns",
    [
        list(DEFAULT_EXCLUDE),
        ["build", "*.egg-info", "docs/", "src/gen_*.py", "x?.py"],
        ["build", "!build", "*.log"],  # a negation: order matters, pathspec decides
    ],
    ids=["defaults", "mixed", "negated"],
)
def test_excludes_match_as_gitignore_patterns_do(patterns):
    """Entry by entry, as the walk asks (an excluded folder is not entered), the lookups
    agree with pathspec on the whole pattern list."""
    import pathspec

    spec = pathspec.GitIgnoreSpec.from_lines(patterns)
    excluded = Excluded.of(patterns)
    entries = [
        ("build", True), ("a/build", True), ("a/build", False), ("rebuild", True),
        ("x.egg-info", True), (".egg-info", True), ("egg-info", True), ("docs", True),
        ("a/docs", False), ("src/gen_a.py", False), ("gen_a.py", False), ("x1.py", False),
        ("x12.py", False), (".venv", True), ("venv", False), ("a/.git", True), ("b.log", False),
        ("__pycache__", True), ("site-packages", True), ("env.py", False),
    ]  # fmt: skip
    for relative, is_dir in entries:
        suffix = "/" if is_dir else ""
        name = relative.rpartition("/")[2]
        whole = spec.match_file(relative + suffix) or spec.match_file(name + suffix)
        assert excluded.match(relative, name, suffix) == whole, (patterns, relative)


def test_missing_path_is_a_usage_error(tmp_path):
    result = gaaudit("check", "nope.py", cwd=tmp_path)
    assert result.returncode == 2 and "nope.py" in result.stderr


def test_formats_over_fixtures(cli):
    data = json.loads(cli("check", str(FIXTURES), "--format", "json").output)
    assert data["schema_version"] == 1 and data["summary"]["findings"] == expected_findings()
    github = cli("check", str(FIXTURES), "--format", "github").output
    assert github.count("title=GA00") == expected_findings()


def test_statistics(cli):
    """One row per code, most frequent first, with the rule's name and its count."""
    names = ("ga001_hf_mlm_bert", "ga001_hf_clm_sft_no_trainer", "ga002_hf_clm_no_division")
    result = cli("check", *(str(FIXTURES / f"{name}.py") for name in names), "--statistics")
    assert result.exit_code == 1
    rows = [line.split() for line in result.output.splitlines()[:2]]
    assert rows == [
        ["2", "GA001", "mean-loss-divided-by-accumulation-steps"],
        ["1", "GA002", "unnormalized-accumulation"],
    ]


def test_rules_and_explain(cli):
    listing = cli("rules").output
    for rule in catalogue.load().values():
        assert rule.code in listing and rule.name in listing
    explained = cli("explain", "ga001")
    assert explained.exit_code == 0
    assert "Why is this bad?" in explained.output and "Use instead" in explained.output
    assert catalogue.load()["GA001"].bad.strip().splitlines()[0] in explained.output
    assert gaaudit("explain", "GA999").returncode == 2


def test_version_and_module_entry_point():
    from gaaudit import __version__

    result = gaaudit("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_check_never_imports_frameworks_or_user_code(tmp_path):
    sentinel = tmp_path / "ran"
    (tmp_path / "train.py").write_text(
        f"open({str(sentinel)!r}, 'w').close()\nimport torch\n" + buggy()
    )
    probe = (
        "import sys; from gaaudit.cli import main; sys.argv=['gaaudit','check','.'];\n"
        "try:\n main()\nexcept SystemExit: pass\n"
        "assert not {'torch','transformers','accelerate'} & set(sys.modules), sys.modules.keys()"
    )
    result = gaaudit_python(probe, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "GA001" in result.stdout and not sentinel.exists()


def gaaudit_python(code: str, cwd: Path):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("name", "first", "rest"),
    [
        ("ga007_enumerate_step_guard_from_zero", "1 micro-batch instead of", "is shifted"),
        (
            "ga007_counter_raised_before_test_plus_one",
            "gradient_accumulation_steps - 1 micro-batches instead of",
            "already counts this micro-batch",
        ),
    ],
)
def test_an_off_by_one_window_says_how_many_micro_batches_the_first_holds(name, first, rest):
    """GA007 from both sides: a counter from 0 tested with `i % K` (the first window holds one
    micro-batch), and one raised before `(i + 1) % K` (K - 1)."""
    (finding,) = [f for f in check_file(FIXTURES / f"{name}.py", ALL).findings if f.code == "GA007"]
    assert f"the first window holds {first}" in finding.message and rest in finding.message


@pytest.mark.parametrize(
    ("size", "share"), [("ids.shape[0]", True), ("ids.shape[1:].numel()", False)]
)
def test_a_loss_divided_by_its_share_of_the_batch_is_weighted_by_examples(tmp_path, size, share):
    """`loss / (batch_size / ids.shape[0])` (DialoGPT's): GA001, worded as a share of the
    examples; another divisor of the micro-batch's shape is no such share (and no crash)."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""\
        for step, (ids, labels) in enumerate(loader):
            loss = model(ids, labels=labels).loss / (batch_size / {size})
            loss.backward()
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
        """)
    )
    messages = [f.message for f in check_file(script, ALL).findings]
    assert any("weighted by its share of the examples" in m for m in messages) is share, messages


@pytest.mark.parametrize(
    "factor, flagged",
    [
        ("self.loss_weights_per_dataset[dataset_idx]", True),  # one of several weights
        ("0.5", True),
        ("num_tokens", False),  # a count: the mean becomes a sum
    ],
)
def test_a_weight_multiplied_into_a_mean_keeps_it_a_mean(tmp_path, factor, flagged):
    """`loss *= weights[dataset_idx]` (smollm's m4 trainer) scales a mean; `loss *= count`
    makes it a sum."""
    source = (FIXTURES / "ga003_accelerate_dataset_weighted_mean.py").read_text()
    old = "loss *= self.loss_weights_per_dataset[dataset_idx]"
    assert old in source
    path = tmp_path / "train.py"
    path.write_text(source.replace(old, f"loss *= {factor}"))
    codes = [f.code for f in check_file(path, Settings(min_confidence=Confidence.LOW)).findings]
    assert codes == (["GA003"] if flagged else [])


@pytest.mark.parametrize(
    "test, flagged",
    [
        ("accum_index == grad_accum_steps - 1", True),
        ("accum_index + 1 == grad_accum_steps", True),
        ("grad_accum_steps - 1 == accum_index", True),
        ("accum_index == n_layers - 1", False),  # not an accumulation name
        ("accum_index != grad_accum_steps - 1", False),
    ],
)
def test_a_step_at_the_windows_last_index_makes_a_window(tmp_path, test, flagged):
    source = (FIXTURES / "ga002_last_index_counter_reset.py").read_text()
    old = "accum_index == grad_accum_steps - 1"
    assert old in source
    path = tmp_path / "train.py"
    path.write_text(source.replace(old, test))
    codes = [f.code for f in check_file(path, Settings(min_confidence=Confidence.LOW)).findings]
    assert codes == (["GA002"] if flagged else [])


@pytest.mark.parametrize(
    "divided",
    [
        "loss_sum / (n_tokens * grad_accum_steps)",
        "loss_sum / (grad_accum_steps * n_tokens)",
        "loss_sum / grad_accum_steps / n_tokens",
        "loss_sum / n_tokens / grad_accum_steps",
    ],
)
def test_a_sum_divided_by_its_count_and_k_is_a_mean_over_k(tmp_path, divided):
    """However the two divisions are written, a token sum over its own count and K is mean/K
    (GA001), never a missing division (GA002)."""
    source = (FIXTURES / "ga001_sum_over_count_times_k.py").read_text()
    path = tmp_path / "train.py"
    path.write_text(source.replace("loss_sum / (n_tokens * grad_accum_steps)", divided))
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.confidence) == ("GA001", Confidence.HIGH), finding
    assert "`grad_accum_steps`" in finding.message


@pytest.mark.parametrize(
    "unpacked, confidence",
    [
        ("loss, sample_size, logging_output", Confidence.LOW),  # fairseq's criterion
        ("loss, ntokens, logging_output", Confidence.LOW),
        ("loss, num_masked_tokens, logging_output", Confidence.LOW),  # icefall's HuBERT
        ("loss, accuracy, logging_output", Confidence.HIGH),  # not a count
        ("mean_loss, sample_size, logging_output", Confidence.HIGH),  # named a mean
    ],
)
def test_a_loss_returned_beside_its_count_may_be_a_sum(tmp_path, unpacked, confidence):
    """A call that hands back a count beside its loss often sums over that count (fairseq's
    convention): sum/K weighs every target alike, so such a finding is low."""
    source = (FIXTURES / "ga001_criterion_returns_sample_size.py").read_text()
    old = "loss, sample_size, logging_output = criterion(model, sample)"
    assert old in source
    name = unpacked.split(",")[0]
    path = tmp_path / "train.py"
    path.write_text(
        source.replace(old, f"{unpacked} = criterion(model, sample)").replace(
            "(loss / cfg.update_freq)", f"({name} / cfg.update_freq)"
        )
    )
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.confidence) == ("GA001", confidence), finding


@pytest.mark.parametrize(
    "window_size",
    [
        "cfg[\n            'gradient_accumulation_steps'\n        ]",  # another layout and quotes
        'cfg["gradient_accumulation_steps"]',
        'cfg["micro_steps"]',  # another entry: the divisor's own key says it is K
    ],
)
def test_a_config_entry_named_for_accumulation_is_the_windows_k(tmp_path, window_size):
    """`loss / cfg["gradient_accumulation_steps"]` divides by K however the window's own test
    spells its size (lit-gpt's `is_accumulating` spans three lines): GA001, never GA002."""
    source = (FIXTURES / "ga001_config_dict_divisor.py").read_text()
    old = "cfg[\n            'gradient_accumulation_steps'\n        ]"
    assert old in source
    path = tmp_path / "train.py"
    path.write_text(source.replace(old, window_size))
    (finding,) = check_file(path, ALL).findings
    assert (finding.code, finding.confidence) == ("GA001", Confidence.HIGH), finding


@pytest.mark.parametrize(
    ("product", "codes"),
    [("loss.sum().mul(scale / total)", []), ("loss.mean().mul(0.5)", ["GA002"])],
)
def test_the_tensor_method_of_a_product_reads_as_the_product(tmp_path, product, codes):
    """EDM's `loss.sum().mul(loss_scaling / batch_gpu_total).backward()` is a sum scaled by a
    constant, as `loss.sum() * (...)` is: no finding; a mean times a weight stays a mean."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import torch.nn.functional as F

            for step, (x, y) in enumerate(loader):
                loss = F.mse_loss(model(x), y, reduction="none")
                {product}.backward()
                if (step + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            """
        )
    )
    assert [f.code for f in check_file(script, ALL).findings] == codes


def test_the_last_micro_batch_backpropagated_in_the_stepping_else_joins_the_window():
    """`if n % k != 0:` backpropagates under `no_sync`, `else:` backpropagates the last
    micro-batch and steps: both backward calls are findings of one window, which the evidence
    places in the guard's `else`."""
    findings = check_file(FIXTURES / "ga001_ddp_no_sync_else_steps.py", ALL).findings
    assert [f.span.line for f in findings] == [27, 32]
    window = "window: optimizer step in the `else` of `if (step + 1) % accum_steps != 0:` (line 22)"
    assert all(window in f.evidence for f in findings)


STEPPING_ELSE = FIXTURES / "ga007_stepping_else_from_zero.py"


@pytest.mark.parametrize(
    ("test", "flagged"),
    [
        ("step % args.gradient_accumulation_steps != 0", True),
        ("0 != step % args.gradient_accumulation_steps", True),
        ("step % args.gradient_accumulation_steps", True),
        ("(step + 1) % args.gradient_accumulation_steps != 0", False),  # K in each window
        ("step % args.gradient_accumulation_steps == 0", False),  # the `else` steps K - 1 of K
        ("step % args.gradient_accumulation_steps != 0 and step > 0", False),  # not one test
    ],
)
def test_a_stepping_else_on_a_counter_from_zero_steps_after_one_micro_batch(
    tmp_path, test, flagged
):
    """GA007 for the stepping `else`: `if i % K != 0:` backpropagates, its `else:`
    backpropagates and steps; with `i` from 0 the `else` runs first, at i = 0. The fix counts
    from 1 in the same test."""
    source = STEPPING_ELSE.read_text()
    script = tmp_path / "train.py"
    script.write_text(source.replace("step % args.gradient_accumulation_steps != 0", test))
    found = [f for f in check_file(script, ALL).findings if f.code == "GA007"]
    assert bool(found) is flagged, found
    if flagged:
        (finding,) = found
        assert finding.message.startswith(f"the `else` of `if {test}:` steps the optimizer")
        assert "the first window holds 1 micro-batch" in finding.message
        fixed = fix_source(script.read_bytes(), script, ALL).after.decode()
        assert fixed == source.replace(
            "step % args.gradient_accumulation_steps != 0",
            test.replace("step %", "(step + 1) %"),
        )


@pytest.mark.parametrize(
    ("named", "shifts"),
    [
        ("model = Qwen2_5_VLForConditionalGeneration.from_pretrained(name)", True),
        ("LlavaNextForConditionalGeneration, PaliGemmaForConditionalGeneration", True),
        ('LoraConfig(r=8, task_type="CAUSAL_LM")', True),
        ("model = T5ForConditionalGeneration.from_pretrained(name)", False),
        ("WhisperForConditionalGeneration", False),
        ('LoraConfig(task_type="SEQ_2_SEQ_LM")', False),
        ("Blip2ForConditionalGeneration", None),  # OPT (a decoder) or T5
        ("a model named `...ForConditionalGeneration`, as encoder-decoders are", None),
        ("GPT2LMHeadModel beside BartForConditionalGeneration", None),
    ],
)
def test_whether_the_named_model_shifts_its_labels(named, shifts):
    """The count of a model's own loss follows its task: decoder-only vision models named
    `...ForConditionalGeneration` shift their labels as causal LMs do, encoder-decoders do
    not; a name of either kind, or names of both, say nothing."""
    assert shifts_labels(named) is shifts


WINDOW_OF_CALLS = """\
import torch.nn.functional as F


class Learner:
    def optimizer_step(self):
        {helper}

    def training_step(self, batch):
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        (loss / self.accumulation_steps).backward()
        {call}
        self.n_iter += 1
"""


@pytest.mark.parametrize(
    ("helper", "call", "guard", "calls"),
    [  # the caller guards the helper's call; the helper guards its own step
        (
            "self.optimizer.step()",
            "if self.n_iter % self.accumulation_steps == 0:\n            self.optimizer_step()",
            "self.n_iter % self.accumulation_steps == 0",
            "training_step",
        ),
        (
            "if self.n_iter % self.k == 0:\n            self.optimizer.step()",
            "self.optimizer_step()",
            "self.n_iter % self.k == 0",
            "optimizer_step",
        ),
    ],
)
def test_a_step_guarded_in_or_around_a_stepping_helper_makes_a_window_of_calls(
    tmp_path, helper, call, guard, calls
):
    """A function that backpropagates and steps through a same-file helper under `if a % k`,
    whether the test guards the helper's call or the step inside the helper (XLM's
    `self.optimize(loss)`), makes a window of K calls (of the function holding the test)."""
    script = tmp_path / "learner.py"
    script.write_text(WINDOW_OF_CALLS.format(helper=helper, call=call))
    (finding,) = check_file(script, ALL).findings
    assert finding.code == "GA001", finding
    window = next(e for e in finding.evidence if e.startswith("window:"))
    assert f"guarded by `{guard}`" in window and f"spans calls of `{calls}`" in window, window
