"""Losses from other modules of the repository, and pipeline schedules' loss functions."""

from __future__ import annotations

import importlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from conftest import FIXTURES, entry, flat

from gaaudit.analysis.provenance import Tracer
from gaaudit.analysis.tree import Tree, argument_for, call_parameters, code, methods_of
from gaaudit.checks.context import Context, run
from gaaudit.checks.engine import check_file
from gaaudit.config import Settings
from gaaudit.discover.modules import Dependency, configured_target, current, file_digest
from gaaudit.discover.source import parse
from gaaudit.findings import Confidence
from gaaudit.fixes.fixer import fix_source
from gaaudit.vocabulary import window_guards

ALL = Settings(min_confidence=Confidence.LOW)
PACKAGES = sorted(p for p in FIXTURES.glob("*_xmod_*") if p.is_dir())

LOSSES = """\
    import torch.nn.functional as F


    def masked_lm_loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.masked_fill(labels == 0, -100).flatten())
    """
TRAIN = """\
    {imports}


    def train(model, loader, optimizer, k):
        for step, batch in enumerate(loader):
            logits = model(batch["input_ids"]).logits
            loss = {call}(logits, batch["labels"])
            (loss / k).backward()
            if (step + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
    """


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def rows(report) -> list[tuple[int, str, str]]:
    return [(f.span.line, f.code, str(f.confidence)) for f in report.findings]


def expected_rows(folder: Path) -> list[tuple[str, int, str, str]]:
    found = []
    for line in (folder / "expected.txt").read_text().splitlines():
        if line.strip():
            file, number, code, confidence = line.split()
            found.append((file, int(number), code, confidence))
    return found


# The repository fixtures -------------------------------------------------------------------


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda p: p.name)
def test_package_fixtures_are_exact_per_file_and_per_directory(folder, cli):
    per_file = [
        (path.relative_to(folder).as_posix(), line, code, confidence)
        for path in sorted(folder.rglob("*.py"))
        for line, code, confidence in rows(check_file(path, ALL))
    ]
    assert per_file == expected_rows(folder)
    result = cli(
        "check", ".", "--no-cache", "--min-confidence", "low", "--format", "json", cwd=folder
    )
    found = json.loads(result.output)["findings"]
    assert [(f["path"], f["line"], f["code"], f["confidence"]) for f in found] == expected_rows(
        folder
    )


def test_package_fixtures_are_varied():
    buggy = [f for f in PACKAGES if expected_rows(f)]
    assert len(buggy) >= 3 and len(PACKAGES) - len(buggy) >= 2
    assert {code for f in buggy for _, _, code, _ in expected_rows(f)} == {
        "GA001",
        "GA002",
        "GA003",
        "GA004",
        "GA005",
    }


def test_correct_packages_are_clean_because_the_helper_was_read(tmp_path):
    """Without its helper module, the correct package's loss is unknown (or guessed from its
    name) and reported. A helper holds definitions, and neither a backward, a gradient
    transform, a scan over micro-batches nor a window's step guard (`% accum_iter`)."""
    checked = 0
    for folder in (p for p in PACKAGES if not expected_rows(p)):
        if any(folder.rglob("*.yaml")) or any(folder.rglob("*.sh")):  # clean because of its
            continue  # configuration or launch script
        copy = tmp_path / folder.name
        write(copy, {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*.py")})
        helpers = [
            p
            for p in copy.rglob("*.py")
            if "def " in p.read_text()
            and not any(w in p.read_text() for w in (".backward(", "value_and_grad", "lax.scan"))
            and not window_guards(p.read_bytes())
        ]
        if not helpers:  # clean because another module's window was read, not its loss
            continue
        if all(p in helpers or "def " not in p.read_text() for p in copy.rglob("*.py")):
            continue  # no window: clean by what its code says (an override taking the count)
        checked += 1
        for helper in helpers:
            helper.unlink()
        reported = [f for p in copy.rglob("*.py") for f in check_file(p, ALL).findings]
        assert reported, folder.name
    assert checked >= 2


# Import spellings and helper shapes --------------------------------------------------------


@pytest.mark.parametrize(
    "files, train, imports, call",
    [
        (
            {"pkg/__init__.py": "", "pkg/losses.py": LOSSES},
            "pkg/train.py",
            "from .losses import masked_lm_loss",
            "masked_lm_loss",
        ),
        (
            {"pkg/losses.py": LOSSES},
            "pkg/train.py",
            "from . import losses",
            "losses.masked_lm_loss",
        ),
        (
            {"pkg/__init__.py": "", "pkg/losses.py": LOSSES},
            "pkg/train.py",
            "import pkg.losses as L",
            "L.masked_lm_loss",
        ),
        (
            {"pkg/__init__.py": "", "pkg/losses.py": LOSSES},
            "pkg/train.py",
            "import pkg.losses",
            "pkg.losses.masked_lm_loss",
        ),
        (
            {"pkg/__init__.py": "", "pkg/losses.py": LOSSES},
            "scripts/train.py",
            "from pkg.losses import masked_lm_loss as mlm",
            "mlm",
        ),
        (
            {
                "src/pkg/__init__.py": "from .impl.losses import masked_lm_loss\n",
                "src/pkg/impl/__init__.py": "",
                "src/pkg/impl/losses.py": LOSSES,
                "pyproject.toml": "",
            },
            "tools/train.py",
            "from pkg import masked_lm_loss",
            "masked_lm_loss",
        ),
        (
            {"a/b/__init__.py": "", "a/__init__.py": "", "a/losses.py": LOSSES},
            "a/b/train.py",
            "from ..losses import masked_lm_loss",
            "masked_lm_loss",
        ),
    ],
    ids=[
        "relative",
        "from-dot-import-module",
        "import-as",
        "import-dotted",
        "absolute-from-sibling-folder",
        "src-layout-reexport",
        "two-dots",
    ],
)
def test_import_spellings_resolve_to_the_helper(tmp_path, files, train, imports, call):
    write(tmp_path, {**files, train: TRAIN.format(imports=imports, call=call)})
    (finding,) = check_file(tmp_path / train, ALL).findings
    assert (finding.code, finding.confidence) == ("GA001", Confidence.HIGH)
    assert "losses.py line 5), returned by `masked_lm_loss()` imported from" in finding.evidence[0]
    assert "can vary: labels set to -100 in `masked_lm_loss()`" in finding.evidence[2]


def test_helper_dividing_by_its_argument_is_reported_at_the_call(tmp_path):
    write(
        tmp_path,
        {
            "utils.py": """\
            def compute_loss(model, batch, steps):
                return model(**batch).loss / steps
            """,
            "train.py": """\
            from utils import compute_loss

            for step, batch in enumerate(loader):
                loss = compute_loss(model, batch, args.gradient_accumulation_steps)
                loss.backward()
                if (step + 1) % args.gradient_accumulation_steps == 0:
                    optimizer.step()
            """,
        },
    )
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert (finding.code, finding.span.line, finding.span.column) == ("GA001", 4, 12)
    assert "`args.gradient_accumulation_steps`" in finding.message


def test_tuple_returning_helper_and_loss_class(tmp_path):
    write(
        tmp_path,
        {
            "objectives.py": """\
            import torch
            from torch import nn


            def loss_and_logs(logits, labels):
                loss = nn.functional.nll_loss(logits, labels)
                return loss, {"loss": loss.item()}


            class TokenLoss(nn.Module):
                def forward(self, logits, labels):
                    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            """,
            "train.py": """\
            from objectives import TokenLoss, loss_and_logs

            criterion = TokenLoss()
            for step, (x, y) in enumerate(loader):
                loss, logs = loss_and_logs(model(x), y)
                (loss / accum_steps).backward()
                summed = criterion(model(x), y)
                summed.backward()
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
            """,
        },
    )
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert (finding.code, finding.span.line, finding.confidence) == ("GA001", 6, Confidence.MEDIUM)
    assert "`nll_loss` with the default reduction='mean'" in finding.evidence[0]


def test_a_jax_loss_returning_a_helpers_loss_and_aux_reads_the_helpers_first_element():
    """`return nll_and_accuracy(...)` under `has_aux=True`: the gradient is of the first
    element of the tuple the imported helper returns, its masked mean."""
    folder = FIXTURES / "ga005_xmod_loss_helper_returns_aux"
    (finding,) = check_file(folder / "train.py", ALL).findings
    assert finding.code == "GA005"
    assert finding.evidence[0].startswith("loss: `jnp.mean(per_token, where=keep)` (")
    assert "returned by `nll_and_accuracy()` imported from `losses`" in finding.evidence[0]


@pytest.mark.parametrize(
    "imports",
    ["from helpers_absent import masked_lm_loss", "from torch.nn.functional import masked_lm_loss"],
)
def test_modules_outside_the_repository_stay_unknown(tmp_path, imports):
    write(tmp_path, {"train.py": TRAIN.format(imports=imports, call="masked_lm_loss")})
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert (
        finding.confidence is Confidence.LOW
        and "a call gaaudit cannot see into" in finding.evidence[0]
    )


def test_helper_calling_a_helper_of_a_third_module(tmp_path):
    write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/base.py": LOSSES,
            "core/wrappers.py": """\
                from .base import masked_lm_loss


                def training_loss(logits, labels):
                    return masked_lm_loss(logits, labels)
                """,
            "train.py": TRAIN.format(
                imports="from core.wrappers import training_loss", call="training_loss"
            ),
        },
    )
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert finding.confidence is Confidence.HIGH
    assert finding.evidence[0].endswith(
        "returned by `masked_lm_loss()` imported from `.base`, "
        "returned by `training_loss()` imported from `core.wrappers`"
    )


def test_import_cycles_end(tmp_path):
    write(
        tmp_path,
        {
            "a.py": "from b import f\n\ndef g(x):\n    return f(x)\n",
            "b.py": "from a import g\n\ndef f(x):\n    return g(x)\n",
            "train.py": TRAIN.format(imports="from a import g", call="g"),
        },
    )
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert finding.confidence is Confidence.LOW


def test_a_changed_helper_changes_the_findings_in_the_same_process(tmp_path):
    write(
        tmp_path,
        {
            "losses.py": LOSSES,
            "train.py": TRAIN.format(
                imports="from losses import masked_lm_loss", call="masked_lm_loss"
            ),
        },
    )
    assert rows(check_file(tmp_path / "train.py", ALL)) == [(8, "GA001", "high")]
    summed = LOSSES.replace(".flatten())", '.flatten(), reduction="sum")')
    write(tmp_path, {"losses.py": summed})
    assert rows(check_file(tmp_path / "train.py", ALL)) == []


# What a file's findings depend on (for the cache) ------------------------------------------


def context_of(path: Path) -> Context:
    data = path.read_bytes()
    context = Context(Tree(parse(data)), path.name, data.decode(), frozenset(), path.parent)
    run(context)
    return context


def test_dependencies_name_the_modules_read_and_looked_for(tmp_path):
    write(
        tmp_path,
        {
            "pkg/losses.py": LOSSES,
            "pkg/train.py": TRAIN.format(
                imports="from .losses import masked_lm_loss", call="masked_lm_loss"
            )
            + TRAIN.format(imports="from .later import masked_lm_loss as later", call="later"),
        },
    )
    dependencies = context_of(tmp_path / "pkg/train.py").dependencies
    losses, later = tmp_path / "pkg/losses.py", tmp_path / "pkg/later.py"
    assert Dependency(str(losses), file_digest(losses)) in dependencies
    assert Dependency(str(later), "") in dependencies  # looked for: creating it changes findings
    assert current(dependencies)
    later.write_text(textwrap.dedent(LOSSES))
    assert not current(dependencies)
    assert context_of(tmp_path / "pkg/train.py").dependencies != dependencies


def test_a_file_without_imported_losses_has_no_dependencies(tmp_path):
    write(
        tmp_path,
        {
            "train.py": TRAIN.format(
                imports="import torch.nn.functional as F", call="F.cross_entropy"
            )
        },
    )
    assert context_of(tmp_path / "train.py").dependencies == frozenset()


# Runs: single file, worker pool, never importing the helper --------------------------------


def test_relative_paths_from_inside_a_package(tmp_path, monkeypatch):
    write(
        tmp_path,
        {
            "__init__.py": "",
            "losses.py": LOSSES,
            "sub/__init__.py": "",
            "sub/train.py": TRAIN.format(
                imports="from ..losses import masked_lm_loss", call="masked_lm_loss"
            ),
        },
    )
    monkeypatch.chdir(tmp_path / "sub")
    assert rows(check_file(Path("train.py"), ALL)) == [(8, "GA001", "high")]


def test_single_file_check_from_another_directory(tmp_path):
    write(
        tmp_path,
        {
            "pkg/losses.py": LOSSES,
            "pkg/train.py": TRAIN.format(
                imports="from .losses import masked_lm_loss", call="masked_lm_loss"
            ),
        },
    )
    result = entry("check", "--no-cache", "pkg/train.py", cwd=tmp_path)
    assert result.returncode == 1
    assert "pkg/train.py:8:10: GA001 [high]" in result.stdout
    assert (
        "(pkg/losses.py line 5), returned by `masked_lm_loss()` imported from `.losses`"
        in result.stdout
    )


def test_worker_pool_sees_through_imports_like_one_process(tmp_path, cli):
    scripts = {
        f"train_{i:02d}.py": TRAIN.format(
            imports="from losses import masked_lm_loss", call="masked_lm_loss"
        )
        for i in range(70)
    }
    write(tmp_path, {"losses.py": LOSSES, **scripts})

    def findings(jobs: str):
        result = cli("check", ".", "--no-cache", "--format", "json", "--jobs", jobs, cwd=tmp_path)
        return sorted(
            (f["path"], f["line"], f["confidence"]) for f in json.loads(result.output)["findings"]
        )

    pooled = findings("2")
    assert pooled == findings("1")
    assert pooled == [(name, 8, "high") for name in sorted(scripts)]


def test_check_neither_runs_nor_imports_the_helper_module(tmp_path):
    sentinel = tmp_path / "ran"
    write(
        tmp_path,
        {
            "losses.py": f"open({str(sentinel)!r}, 'w').close()\nimport torch\n"
            + textwrap.dedent(LOSSES),
            "train.py": TRAIN.format(
                imports="from losses import masked_lm_loss", call="masked_lm_loss"
            ),
        },
    )
    probe = (
        "import sys; from gaaudit.cli import main\n"
        "sys.argv = ['gaaudit', 'check', '--no-cache', 'train.py']\n"
        "try:\n main()\nexcept SystemExit: pass\n"
        "assert not {'torch','losses'} & set(sys.modules), sorted(sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "GA001 [high]" in result.stdout and not sentinel.exists()


def test_a_helpers_module_constant_is_written_at_the_call_by_its_value(tmp_path):
    """`causal_lm_loss` (sft/losses.py) ignores `IGNORE_INDEX`, a constant of its module: the
    count at the call reads its value; a module global that is not a literal is refused."""
    folder = tmp_path / "ga001_xmod_relative_helper"
    shutil.copytree(FIXTURES / folder.name, folder)
    train = folder / "sft/train.py"
    result = fix_source(train.read_bytes(), train, ALL, unsafe=True)
    (outcome,) = result.outcomes
    assert outcome.applied, outcome
    count = 'micro_tokens = (batch["labels"][:, 1:].contiguous().view(-1) != -100).sum()'
    assert count in result.after.decode()
    losses = folder / "sft/losses.py"
    losses.write_text(losses.read_text().replace("IGNORE_INDEX = -100", "IGNORE_INDEX = ignored()"))
    result = fix_source(train.read_bytes(), train, ALL, unsafe=True)
    assert not result.changed
    (outcome,) = result.outcomes
    assert not outcome.applied and outcome.reason


# Pipeline schedules ------------------------------------------------------------------------

SCHEDULE = """\
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import ScheduleGPipe

    n_micro = 8
    schedule = ScheduleGPipe(stage, n_micro, loss_fn={loss_fn}{extra})
    """


@pytest.mark.parametrize(
    "loss_fn, extra, expected",
    [
        ("lambda o, t: F.cross_entropy(o, t) / n_micro", "", [(6, "GA001")]),
        ("lambda o, t: F.cross_entropy(o, t) / n_micro", ", scale_grads=flag", [(6, "GA001")]),
        ("lambda o, t: F.cross_entropy(o, t) / temperature", "", []),
        ("lambda o, t: F.cross_entropy(o, t)", ", scale_grads=flag", []),
        ("lambda o, t: F.cross_entropy(o, t)", ", scale_grads=True", [(6, "GA003")]),
        ("lambda o, t: F.cross_entropy(o, t)", ", scale_grads=False", [(6, "GA002")]),
        ("nn.CrossEntropyLoss()", "", [(6, "GA003")]),
        ('nn.CrossEntropyLoss(reduction="sum")', "", []),
        ("None", "", []),
    ],
)
def test_schedule_loss_functions(tmp_path, loss_fn, extra, expected):
    (tmp_path / "pp.py").write_text(textwrap.dedent(SCHEDULE.format(loss_fn=loss_fn, extra=extra)))
    assert [(f.span.line, f.code) for f in check_file(tmp_path / "pp.py", ALL).findings] == expected


def test_schedule_division_message_says_whether_the_schedule_divides_again(tmp_path):
    (tmp_path / "pp.py").write_text(
        textwrap.dedent(
            SCHEDULE.format(loss_fn="lambda o, t: F.cross_entropy(o, t) / n_micro", extra="")
        )
    )
    (finding,) = check_file(tmp_path / "pp.py", ALL).findings
    assert "`ScheduleGPipe` divides the gradients by `n_microbatches` as well" in finding.message
    assert "`ScheduleGPipe(...)` runs the micro-batches" in finding.evidence[1]


def test_deepspeed_pipeline_names_its_configured_micro_batches(tmp_path):
    (tmp_path / "ds.py").write_text(
        textwrap.dedent("""\
        import deepspeed
        from deepspeed.pipe import PipelineModule
        from torch import nn

        config = {"train_batch_size": 64, "gradient_accumulation_steps": 16}
        net = PipelineModule(layers, num_stages=4, loss_fn=nn.CrossEntropyLoss(ignore_index=-100))
        engine, *_ = deepspeed.initialize(model=net, config=config)
        """)
    )
    (finding,) = check_file(tmp_path / "ds.py", ALL).findings
    assert (finding.code, finding.span.line, finding.confidence) == ("GA003", 6, Confidence.MEDIUM)
    assert "gradient_accumulation_steps (a config dict (line 5))" in finding.message


# Callers: a parameter bound where the function is called ----------------------------------


def test_the_callers_instance_decides_and_its_files_are_dependencies(tmp_path):
    """`train_one_epoch(model, ...)` in engine.py: the class main.py passes (through a
    wrapper) is read for the loss; main.py and its class's module are dependencies, so an
    edit of the caller re-judges engine.py."""
    folder = tmp_path / "pkg"
    shutil.copytree(FIXTURES / "ga001_xmod_loss_scaler_callers", folder)
    engine = folder / "engine.py"
    report = check_file(engine, ALL)
    assert rows(report) == [(12, "GA001", "medium")]
    assert "returned by `TinyLM.forward()` imported from `model`" in report.findings[0].evidence[0]
    dependencies = context_of(engine).dependencies
    assert {"main.py", "model.py"} <= {Path(d.path).name for d in dependencies}
    main = folder / "main.py"
    main.write_text(main.read_text().replace("model = TinyLM()", "model = build_model()"))
    assert not current(dependencies)
    assert rows(check_file(engine, ALL)) == [(12, "GA001", "low")]


def test_a_keyword_only_parameter_is_found_in_its_callers_call(tmp_path):
    """`train_one_epoch(..., *, model)`, called with `model=model`: the caller's instance is
    read as for a positional one (it was an internal error)."""
    folder = tmp_path / "pkg"
    shutil.copytree(FIXTURES / "ga001_xmod_loss_scaler_callers", folder)
    for name, old, new in (
        (
            "engine.py",
            "(model: torch.nn.Module, loader, optimizer, loss_scaler, accum_iter)",
            "(loader, optimizer, loss_scaler, accum_iter, *, model: torch.nn.Module)",
        ),
        (
            "main.py",
            "(model, loader, optimizer, LossScaler(), args.accum_iter)",
            "(loader, optimizer, LossScaler(), args.accum_iter, model=model)",
        ),
    ):
        path = folder / name
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))
    report = check_file(folder / "engine.py", ALL)
    assert rows(report) == [(12, "GA001", "medium")]
    assert "returned by `TinyLM.forward()` imported from `model`" in report.findings[0].evidence[0]


TRIMMED = FIXTURES / "ga001_xmod_model_trims_its_labels"


def test_a_count_the_model_makes_from_its_own_values_is_not_read_ahead_and_says_which(tmp_path):
    """A loss scaler steps out of sight, so the window must be counted ahead, in the call's
    arguments: `PaddedLM.forward` first cuts its targets to a width it computes, so the count
    is refused, naming that local and its line; without the cut it is read ahead."""
    engine = TRIMMED / "engine.py"
    report = fix_source(engine.read_bytes(), engine, ALL, True, reach=True)
    (outcome,) = report.outcomes
    assert not outcome.applied and report.after == report.before and not report.companions
    assert "reading the window ahead: the count is taken inside the loop: " in outcome.reason
    assert (
        "model.py) counts the loss's targets with `width` as line 15 there binds it; count each "
        "micro-batch's valid targets from its batch before the window runs"
    ) in outcome.reason
    folder = tmp_path / "pkg"
    shutil.copytree(TRIMMED, folder)
    model = folder / "model.py"
    model.write_text(re.sub(r"\n        (width|tokens|targets) = [^\n]*", "", model.read_text()))
    after = fix_source((folder / "engine.py").read_bytes(), folder / "engine.py", ALL).after
    counted = "pending.append(((step, (tokens, targets)), (targets[:, 1:].flatten() != 0).sum()))"
    assert flat(counted) in flat(after.decode())


ONE_PATH = FIXTURES / "ga001_xmod_model_loss_on_one_path"


def test_a_mean_the_model_returns_on_one_path_only_is_not_counted(tmp_path):
    """`TwoTaskLM.forward` returns its LM mean only when `task == "lm"` and a zero otherwise:
    counting its targets on every micro-batch would put the tagging micro-batches' targets in
    the window's total, so neither the call's arguments nor the model's return give a count;
    with the mean made on every path, the count is lifted to the call."""
    train = ONE_PATH / "train.py"
    report = fix_source(train.read_bytes(), train, ALL, True, reach=True)
    (outcome,) = report.outcomes
    assert not outcome.applied and report.after == report.before and not report.companions
    assert (
        "model.py) returns `lm_loss` as a mean (line 21) only on one path "
        "of the `if` on line 19; on the other it is what line 18 binds"
    ) in outcome.reason
    folder = tmp_path / "pkg"
    shutil.copytree(ONE_PATH, folder)
    model = folder / "model.py"
    text = model.read_text().replace('        if task == "lm":\n', "        if True:\n")
    model.write_text(text.replace("        lm_loss = torch.zeros(())\n", ""))
    after = fix_source((folder / "train.py").read_bytes(), folder / "train.py", ALL).after
    assert 'micro_tokens = (batch["targets"][:, 1:].flatten() != 0).sum()' in after.decode()


@pytest.mark.parametrize(
    "line, found",
    [
        (b"if (step + 1) % accum_iter == 0:", True),
        (b"update = i % args.gradient_accumulation_steps == 0", True),
        (b"flag = (i + 1) % (cfg['train'].grad_accum) == 0", True),
        (b"if step % accumulation == 0:", False),  # not an accumulation name
        (b"if accum_iter % 2:", False),  # the name is the dividend
        (b"if step % accum_iter_x == 0:", False),  # a longer name
    ],
)
def test_window_guards_are_a_modulo_by_an_accumulation_name(line, found):
    """The byte prefilter admits a file that guards a window, though its backward hides in a
    callable handed the loss."""
    assert bool(window_guards(b"x = 1\n" + line + b"\n")) == found


@pytest.mark.parametrize(
    "package, module, config, setting",
    [  # Hydra configs of another folder; a launch script for `Trainer.from_argparse_args`
        (
            "ga003_xmod_lightning_hydra_config",
            "src/models/lm_module.py",
            "configs/trainer/default.yaml",
            "accumulate_grad_batches: 4",
        ),
        (
            "ga003_xmod_lightning_launch_script",
            "src/lm_module.py",
            "scripts/train.sh",
            "--accumulate_grad_batches 8",
        ),
    ],
)
def test_a_projects_config_sets_lightnings_accumulation_and_is_a_dependency(
    tmp_path, package, module, config, setting
):
    """Lightning's accumulation set in the project's YAML configs or launch scripts reaches
    the LightningModule (at most medium: the run chooses its config); editing it re-judges."""
    folder = tmp_path / "project"
    shutil.copytree(FIXTURES / package, folder)
    (finding,) = check_file(folder / module, ALL).findings
    assert (finding.code, str(finding.confidence)) == ("GA003", "medium")
    assert f"`{setting}` in" in finding.message
    dependencies = context_of(folder / module).dependencies
    config = folder / config
    assert Dependency(str(config), file_digest(config)) in dependencies
    config.write_text(config.read_text().replace(setting, setting[:-1] + "1"))
    assert not current(dependencies)
    assert check_file(folder / module, ALL).findings == []


@pytest.mark.parametrize(
    "configs, expected",
    [
        (
            {"criterion/ce.yaml": "_target_: torch.nn.CrossEntropyLoss\nignore_index: -100\n"},
            ("torch.nn.CrossEntropyLoss", {"ignore_index": "-100"}),
        ),
        (
            {
                "train.yaml": "lr: 1\ncriterion:\n  _target_: torch.nn.MSELoss\n  reduction: sum\n"
                "model:\n  _target_: Net\n"
            },
            ("torch.nn.MSELoss", {"reduction": "sum"}),
        ),
        (
            {
                "criterion/ce.yaml": "_target_: torch.nn.CrossEntropyLoss\n",
                "criterion/mse.yaml": "_target_: torch.nn.MSELoss\n",
            },
            None,
        ),  # the run chooses
    ],
)
def test_the_configs_target_is_what_instantiate_builds(tmp_path, configs, expected):
    for name, text in configs.items():
        (tmp_path / "configs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "configs" / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text("")
    seen: set[Dependency] = set()
    found = configured_target(tmp_path / "src", "criterion", seen)
    assert (found[:2] if found else None) == expected
    assert len(seen) == len(configs)


# A count lifted through the repository model's `forward` ----------------------------------

COUNTED = FIXTURES / "ga001_xmod_model_counts_its_targets"
COUNTED_OK = FIXTURES / "ok_xmod_model_counts_its_targets_token_sum"


def test_the_count_is_the_models_own_in_the_calls_arguments():
    """`Seq2Seq.forward` (model.py) counts the shifted targets under the mask that are not -1;
    the model reaches the loop through `load_model(Seq2Seq(), ...)` (checkpoints.py)."""
    train = COUNTED / "train.py"
    result = fix_source(train.read_bytes(), train, Settings())
    assert [o.applied for o in result.outcomes] == [True]
    after = result.after.decode()
    assert flat(
        "micro_tokens = (target_ids[..., 1:].contiguous().view(-1)"
        "[target_mask[..., 1:].ne(0).view(-1) == 1] != -1).sum()"
    ) in flat(after)
    # the running total keeps what it summed: each micro-batch's mean over K
    assert "tr_loss += (loss / max(micro_tokens, 1) / args.gradient_accumulation_steps)" in after


def _built(folder: Path, name: str = "Seq2Seq"):
    """The class `name` of `folder`'s model.py, built from seed 0."""
    import torch

    sys.path.insert(0, str(folder))
    try:
        import model

        torch.manual_seed(0)
        return getattr(model, name)()
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("model", None)


def _pairs() -> list:
    """K = 4 micro-batches of one width whose masks keep 2 to 11 targets per row."""
    import torch

    generator = torch.Generator().manual_seed(1)
    batches = []
    for kept in (2, 11, 5, 8):
        source = torch.randint(0, 64, (3, 12), generator=generator)
        target = torch.randint(0, 64, (3, 12), generator=generator)
        mask = torch.zeros(3, 12, dtype=torch.long)
        mask[:, : kept + 1] = 1
        batches.append((source, target, mask))
    return batches


def _updates(run_dirs: list[Path], *args: str) -> list:
    """Run each of `run_dirs`' train.py (with `args`) from its init.pt, in this process as a
    script from its folder (each imports its own folder's modules, forgotten again after it):
    how far each one's trained.pt moved."""
    import torch

    saved, here = (sys.argv, list(sys.path)), Path.cwd()
    try:
        for run_dir in run_dirs:
            folder = str(run_dir.resolve())
            os.chdir(folder)
            sys.argv, sys.path[:] = ["train.py", *args], [folder, *saved[1]]
            runpy.run_path("train.py", run_name="__main__")
            for name, module in list(sys.modules.items()):  # the next folder's are so named
                if (getattr(module, "__file__", None) or "").startswith(folder + os.sep):
                    del sys.modules[name]
    finally:
        os.chdir(here)
        sys.argv, sys.path[:] = saved
    moved = []
    for run_dir in run_dirs:
        trained, initial = torch.load(run_dir / "trained.pt"), torch.load(run_dir / "init.pt")
        moved.append(torch.cat([(trained[k] - initial[k]).flatten() for k in initial]))
    return moved


def _copied(folder: Path, tmp_path: Path, source: bytes | None = None) -> Path:
    """`folder` (its train.py as `source` if given) in `tmp_path`, with the seeded initial
    state and one window of K = 4 micro-batches to train on."""
    import torch

    run_dir = tmp_path / folder.name
    shutil.copytree(folder, run_dir)
    if source is not None:
        (run_dir / "train.py").write_bytes(source)
    torch.save(_built(folder).state_dict(), run_dir / "init.pt")
    torch.save(_pairs(), run_dir / "pairs.pt")
    return run_dir


def _full_batch_step(folder: Path):
    """The update of one SGD step (lr 0.1) on the four micro-batches as one batch."""
    import torch

    model = _built(folder)
    source, target, mask = (torch.cat(parts) for parts in zip(*_pairs()))
    loss, _, _ = model(source_ids=source, target_ids=target, target_mask=mask)
    loss.backward()
    return torch.cat([-0.1 * p.grad.flatten() for p in model.parameters()])


def test_fixed_loop_and_its_correct_twin_step_like_the_full_batch(tmp_path):
    reference = _full_batch_step(COUNTED)
    train = COUNTED / "train.py"
    patched = fix_source(train.read_bytes(), train, Settings()).after

    def error(update) -> float:
        return float((update - reference).norm() / reference.norm())

    runs = [
        _copied(COUNTED, tmp_path / "original"),
        _copied(COUNTED, tmp_path / "fixed", patched),
        _copied(COUNTED_OK, tmp_path / "twin"),
    ]
    original, fixed, twin = _updates(runs, "--checkpoint", "init.pt")
    assert error(original) > 0.05
    assert error(fixed) < 1e-4  # float32 sums
    assert error(twin) < 1e-4


LIFTED_MODEL = """\
    import torch.nn as nn
    import torch.nn.functional as F


    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 16)
            self.pad_id = -1

        def forward(self, features, labels):
            logits = self.head(features)
            {body}
    """
LIFTED_LOOP = """\
    from model import LM

    model = LM()
    for step, batch in enumerate(loader):
        {call}
        (loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
    """


@pytest.mark.parametrize(
    "body, call, count",
    [
        (
            "return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)",
            'loss = model(batch["x"], batch["y"])',
            '(batch["y"].flatten() != -1).sum()',
        ),
        (
            "return F.cross_entropy(logits.flatten(0, 1), labels.flatten())",
            "loss = model(**batch)",
            '(batch["labels"].flatten() != -100).sum()',
        ),
        (  # the ignore value is the instance's: not namable at the call
            "return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.pad_id)",
            'loss = model(batch["x"], batch["y"])',
            None,
        ),
        (  # the argument would be drawn again
            "return F.cross_entropy(logits.flatten(0, 1), labels.flatten())",
            'loss = model(batch["x"], next(targets))',
            None,
        ),
        (  # `labels` bound twice: which one the loss reads depends on the path
            (
                "labels = labels.flatten()\n        labels = labels[labels >= 0]\n"
                "        return F.cross_entropy(logits.flatten(0, 1), labels)"
            ),
            'loss = model(batch["x"], batch["y"])',
            None,
        ),
    ],
)
def test_a_count_is_lifted_only_when_the_call_can_name_it(tmp_path, body, call, count):
    _lifted(tmp_path, LIFTED_MODEL.format(body=body), call, count)


def test_a_keyword_only_parameter_after_args_is_lifted_from_its_keyword(tmp_path):
    """`forward(self, features, *extra, labels)`: `labels` is passed by keyword only."""
    body = "return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)"
    model = LIFTED_MODEL.format(body=body).replace("features, labels)", "features, *extra, labels)")
    call = 'loss = model(batch["x"], labels=batch["y"])'
    _lifted(tmp_path, model, call, '(batch["y"].flatten() != -1).sum()')


def _lifted(tmp_path: Path, model: str, call: str, count: str | None) -> None:
    """The fix of LIFTED_LOOP with `call` of `model`: counts `count` at the call, or refused."""
    root = write(
        tmp_path,
        {
            "model.py": model,
            "train.py": LIFTED_LOOP.format(call=call),
        },
    )
    train = root / "train.py"
    result = fix_source(train.read_bytes(), train, ALL)
    (outcome,) = result.outcomes
    if count is None:
        assert not outcome.applied and outcome.reason
    else:
        assert outcome.applied and f"micro_tokens = {count}\n" in result.after.decode()


# Parameters a call passes ------------------------------------------------------------------

SIGNATURES = b"""\
def plain(a, /, b, *rest, c, **options): ...


class Owner:
    def method(self, a, b): ...

    @classmethod
    def build(klass, a, b): ...

    @staticmethod
    def static(a, b): ...

    @classmethod
    def kl(cls, p, /, q, *, mask):
        return (p * mask).sum() / mask.sum()


Owner.kl(a, b, mask=batch["mask"])
"""


def _function(tree: Tree, name: str) -> cst.FunctionDef:
    owner = next(s for s in tree.module.body if isinstance(s, cst.ClassDef))
    return tree.functions.get(name) or methods_of(owner)[name]


@pytest.mark.parametrize(
    "name, call, passed",
    [
        ("plain", "plain(1, 2, 3, c=4)", {"a": "1", "b": "2", "c": "4"}),
        ("plain", "plain(1, 2, a=5, c=4)", {"a": "1", "b": "2", "c": "4"}),  # `a=5`: `options`
        ("plain", "plain(1, 2, 4)", {"a": "1", "b": "2"}),  # `c` is never positional
        ("plain", "plain(*xs, b=2)", {"b": "2"}),  # `*xs` may hold `a`
        ("method", "owner.method(1, 2)", {"a": "1", "b": "2"}),
        ("build", "Owner.build(1, b=2)", {"a": "1", "b": "2"}),
        ("static", "Owner.static(1, 2)", {"a": "1", "b": "2"}),
    ],
)
def test_each_parameter_is_the_argument_a_call_passes_for_it(name, call, passed):
    function = _function(Tree(parse(SIGNATURES), SIGNATURES), name)
    found = {
        parameter.name: code(argument)
        for parameter in call_parameters(function).values()
        if (argument := argument_for(cst.parse_expression(call), parameter)) is not None
    }
    assert found == passed


def test_a_count_is_read_at_the_call_of_a_classmethod_through_every_kind_of_parameter():
    """`kl(cls, p, /, q, *, mask)`: `cls` is the receiver's, `mask` passed by keyword."""
    tree = Tree(parse(SIGNATURES), SIGNATURES)
    function = _function(tree, "kl")
    (returned,) = (n.value for n in tree.walk(function) if isinstance(n, cst.Return))
    call = tree.module.body[-1].body[0].value
    lifted = Tracer(tree).at_call(returned, function, call)
    assert lifted is not None and code(lifted) == '(a * batch["mask"]).sum() / batch["mask"].sum()'


# A loss function of another module returns its count too ----------------------------------

OWN_IGNORE_MODEL = """\
    import torch.nn as nn
    import torch.nn.functional as F


    class TinyLM(nn.Module):
        def __init__(self, vocab=32, dim=16, pad_id=0):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.head = nn.Linear(dim, vocab)
            self.pad_id = pad_id

        def forward(self, ids, labels, *, return_loss=False):
            logits = self.head(self.embed(ids))
            if not return_loss:
                return logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.pad_id)
            return loss
    """
MICRO_LOOP = """\
    import torch

    from model import TinyLM

    model = TinyLM()
    model.load_state_dict(torch.load("init.pt"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(torch.load("batches.pt"))
    for _ in range(1):
        for _ in range(4):
            ids, labels = next(batches)
            loss = model(ids, labels, return_loss=True)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), "trained.pt")
    """


def _micro_batches() -> list:
    """Four micro-batches of one width with 1 to 9 valid (non-pad) labels per row."""
    import torch

    generator = torch.Generator().manual_seed(2)
    batches = []
    for kept in (1, 9, 4, 6):
        ids = torch.randint(1, 32, (2, 10), generator=generator)
        labels = torch.randint(1, 32, (2, 10), generator=generator)
        labels[:, kept:] = 0
        batches.append((ids, labels))
    return batches


@pytest.mark.parametrize(
    "returned, bound, returns_count, asks",
    [
        (
            "loss",
            "loss",
            "return loss, (labels.flatten() != self.pad_id).sum()",
            "loss, micro_tokens = model(ids, labels, return_loss=True, return_count=True)",
        ),
        (  # a tuple: the count goes last
            "loss, logits",
            "loss, _",
            "return loss, logits, (labels.flatten() != self.pad_id).sum()",
            "loss, _, micro_tokens = model(ids, labels, return_loss=True, return_count=True)",
        ),
    ],
    ids=["mean", "tuple"],
)
def test_the_models_forward_returns_its_count_when_the_loop_asks(
    tmp_path, returned, bound, returns_count, asks
):
    """The ignore value is the model's own (`self.pad_id`): the count cannot be written at
    the call, so `forward` returns it beside the mean when asked (`return_count=True`), in
    model.py, and the loop weights each micro-batch by it. `fix` changes both files; a second
    run changes nothing; the result is clean and steps like the full batch."""
    model_py = OWN_IGNORE_MODEL.replace("return loss\n", f"return {returned}\n")
    train_py = MICRO_LOOP.replace("loss = model(", f"{bound} = model(")
    root = write(tmp_path / "repo", {"model.py": model_py, "train.py": train_py})
    before = {name: (root / name).read_bytes() for name in ("model.py", "train.py")}
    shown = entry("fix", "--diff", ".", "--no-cache", cwd=root)
    assert "--- a/train.py" in shown.stdout and "--- a/model.py" in shown.stdout
    assert {name: (root / name).read_bytes() for name in before} == before
    result = entry("fix", ".", "--no-cache", cwd=root)
    assert "Fixed 1 finding in 2 files (train.py, model.py)" in result.stdout, result.stdout
    fixed_model = (root / "model.py").read_text()
    assert "def forward(self, ids, labels, *, return_loss=False, return_count=False):" in (
        fixed_model
    )
    assert f"if return_count:\n            {returns_count}\n" in fixed_model
    assert asks in (root / "train.py").read_text()
    fixed = {name: (root / name).read_bytes() for name in before}
    again = entry("fix", ".", "--no-cache", cwd=root)
    assert again.returncode == 0 and "Fixed 0 findings" in again.stdout
    assert {name: (root / name).read_bytes() for name in before} == fixed
    clean = entry("check", ".", "--no-cache", "--min-confidence", "low", cwd=root)
    assert clean.returncode == 0, clean.stdout

    original, patched = _full_batch_errors(root, before, fixed)
    assert original > 0.5 and patched < 1e-4  # no normalisation: about K times too far


def _full_batch_errors(root: Path, before: dict, fixed: dict) -> tuple[float, float]:
    """How far the step of `root`'s loop (its files as `before`, then as `fixed`) is from the
    full batch's, relative to it."""
    import torch

    model = _built(root, "TinyLM")
    torch.save(model.state_dict(), root / "init.pt")
    torch.save(_micro_batches(), root / "batches.pt")
    ids, labels = (torch.cat(parts) for parts in zip(*_micro_batches()))
    loss = model(ids, labels, return_loss=True)
    (loss[0] if isinstance(loss, tuple) else loss).backward()
    reference = torch.cat([-0.1 * p.grad.flatten() for p in model.parameters()])

    runs = []  # the folder copied twice, so that one process runs both
    for name, files in (("before", before), ("fixed", fixed)):
        copy = root.with_name(f"{root.name}_{name}")
        runs.append(shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__")))
        for file, data in files.items():
            (copy / file).write_bytes(data)
    original, patched = (
        float((moved - reference).norm() / reference.norm()) for moved in _updates(runs)
    )
    return original, patched


def test_verify_holds_back_a_fix_that_also_changes_the_model_module(tmp_path):
    """The replay stands in for the project's model: the loop as written reproduces the bug
    and the patched loop, which asks the stand-in for its count, matches the full batch; the
    verdict says that the fix of model.py (the test above) is not replayed, and `fix
    --verify` holds it back, saying why."""
    root = write(tmp_path / "repo", {"model.py": OWN_IGNORE_MODEL, "train.py": MICRO_LOOP})
    before = {name: (root / name).read_bytes() for name in ("model.py", "train.py")}
    told = entry("verify", "train.py", "-k", "4", "--device", "cpu", "--format", "json", cwd=root)
    rows = [row for loop in json.loads(told.stdout)["loops"] for row in loop["rows"]]
    assert rows and all(
        row["original_error"] > 1e-2
        and row["patched_error"] < 1e-5
        and row["verdict"]
        == "verified; the fix also changes model.py, which the replay imports as it is on "
        "disk: apply the fix with `gaaudit fix`, then verify the fixed file"
        for row in rows
    ), told.stdout
    held = entry("fix", "--verify", ".", "--no-cache", cwd=root)
    assert "fixes held back: the fix also changes model.py" in held.stdout, held.stdout
    assert {name: (root / name).read_bytes() for name in before} == before


def test_standard_input_changes_no_other_file(tmp_path):
    """An editor hands one buffer: the count would have to come from model.py, so the fix is
    refused with the reason and the buffer comes back as it was."""
    root = write(tmp_path / "repo", {"model.py": OWN_IGNORE_MODEL, "train.py": MICRO_LOOP})
    text = (root / "train.py").read_text()
    result = entry("fix", "-", "--stdin-filename", "train.py", cwd=root, stdin=text)
    assert result.stdout == text
    assert "not fixed: the loss is computed in model.py" in result.stderr
    assert "return_count" not in (root / "model.py").read_text()


PASSED_ON = (
    "            return self._loss(logits, labels)\n\n"
    "        def _loss(self, logits, targets):\n"
    "            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), "
    "ignore_index=self.pad_id)\n"
)
OWN_LOSS = (
    "            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), "
    "ignore_index=self.pad_id)\n            return loss\n"
)


def _fixed_repo(tmp_path: Path, model_py: str, *options: str) -> tuple[Path, dict, dict, str]:
    """model.py and the micro-step loop fixed (with `options`): the folder, both files
    before and after, and what `fix` said."""
    root = write(tmp_path / "repo", {"model.py": model_py, "train.py": MICRO_LOOP})
    before = {name: (root / name).read_bytes() for name in ("model.py", "train.py")}
    result = entry("fix", ".", "--no-cache", *options, cwd=root)
    return root, before, {name: (root / name).read_bytes() for name in before}, result.stdout


def test_a_count_made_in_the_method_forward_returns_is_returned_through_forward(tmp_path):
    """`forward` returns `self._loss(...)` as it is: the targets the count reads are `_loss`'s
    own names, so `_loss` returns the count when asked and `forward` passes the request on;
    the fixed loop steps like the full batch, and a second run changes nothing."""
    root, before, fixed, said = _fixed_repo(tmp_path, OWN_IGNORE_MODEL.replace(OWN_LOSS, PASSED_ON))
    assert "Fixed 1 finding in 2 files (train.py, model.py)" in said, said
    model = fixed["model.py"].decode()
    assert "def forward(self, ids, labels, *, return_loss=False, return_count=False):" in model
    assert "return self._loss(logits, labels, return_count=return_count)" in model
    assert "def _loss(self, logits, targets, return_count=False):" in model
    assert "if return_count:\n            return mean_loss, (targets.flatten() != self.pad_id)" in (
        model
    )
    again = entry("fix", ".", "--no-cache", cwd=root)
    assert "Fixed 0 findings" in again.stdout
    assert {name: (root / name).read_bytes() for name in before} == fixed
    original, patched = _full_batch_errors(root, before, fixed)
    assert original > 0.5 and patched < 1e-4


def test_a_decorated_function_that_would_return_the_count_makes_the_fix_unsafe(tmp_path):
    """A decorator gaaudit does not read may drop the new keyword or change what comes back:
    the fix is unsafe, saying which; with --unsafe-fixes it is applied."""
    wrapped = PASSED_ON.replace("        def _loss", "        @keep_dtype\n        def _loss")
    model_py = OWN_IGNORE_MODEL.replace(OWN_LOSS, wrapped).replace(
        "import torch.nn.functional as F\n",
        "import torch.nn.functional as F\n    from wrappers import keep_dtype\n",
    )
    root, before, after, said = _fixed_repo(tmp_path, model_py)
    assert after == before and "Fixed 0 findings" in said
    told = entry("fix", "--diff", ".", "--no-cache", cwd=root)
    assert (
        "unsafe fix (`@keep_dtype` wraps `_loss` (model.py), which gaaudit does not read: "
        "assumes it passes `return_count` on and returns what `_loss` returns)" in told.stderr
    ), told.stderr
    shutil.rmtree(root)
    _, before, after, said = _fixed_repo(tmp_path, model_py, "--unsafe-fixes")
    assert "Fixed 1 finding in 2 files" in said and b"return_count" in after["model.py"]


SEVERAL_RETURNS = (
    "            if self.pad_id is None:\n"
    "                return F.cross_entropy(logits.flatten(0, 1), labels.flatten())\n" + OWN_LOSS
)


def test_a_loss_returned_from_several_places_returns_each_ones_count(tmp_path):
    """`forward` returns a mean from two places, each over its own traced count: each
    `return` gets the count of its own mean beside it; the loop steps like the full batch."""
    root, before, fixed, said = _fixed_repo(
        tmp_path, OWN_IGNORE_MODEL.replace(OWN_LOSS, SEVERAL_RETURNS)
    )
    assert "Fixed 1 finding in 2 files (train.py, model.py)" in said, said
    model = fixed["model.py"].decode()
    assert model.count("if return_count:") == 2
    assert "return mean_loss, (labels.flatten() != -100).sum()" in model
    assert "return loss, (labels.flatten() != self.pad_id).sum()" in model
    original, patched = _full_batch_errors(root, before, fixed)
    assert original > 0.5 and patched < 1e-4


def test_a_return_that_adds_a_mean_of_another_count_is_refused(tmp_path):
    """One of the `return`s adds a mean over every position to the token mean: the sum of
    means over two counts has no one count to weight it by, so nothing changes, and the
    reason names that `return`."""
    mixed = SEVERAL_RETURNS.replace(
        "            return loss\n", "            return loss + logits.pow(2).mean() * 0.1\n"
    )
    root, before, after, _ = _fixed_repo(tmp_path, OWN_IGNORE_MODEL.replace(OWN_LOSS, mixed))
    assert after == before
    told = entry("fix", "--diff", ".", "--no-cache", cwd=root)
    assert (
        "`TinyLM.forward` (model.py) returns on line 19 a loss that adds "
        "`logits.pow(2).mean() * 0.1` to a mean" in told.stderr
    ), told.stderr


# A count lifted through a helper that averages on several paths ---------------------------

CHUNKED = FIXTURES / "ga001_xmod_chunked_loss_helper"


def _fixed_package(source: Path, folder: Path, fixed: str, *modules: str) -> list:
    """A copy of the package `source` in `folder` whose train.py is `fixed`: its `modules`
    and then train.py, imported from there and forgotten again by `sys.modules`."""
    shutil.copytree(source, folder)
    (folder / "train.py").write_text(fixed)
    sys.path.insert(0, str(folder))
    try:
        return [importlib.import_module(name) for name in (*modules, "train")]
    finally:
        sys.path.remove(str(folder))
        for name in (*modules, "train"):
            sys.modules.pop(name, None)


def _chunked_fix(folder: Path) -> str:
    train = folder / "train.py"
    result = fix_source(train.read_bytes(), train, Settings())
    assert [o.applied for o in result.outcomes] == [True], result.outcomes
    return result.after.decode()


def test_a_helper_that_averages_on_every_path_over_one_count_is_counted_at_the_call():
    """`chunked_loss` (losses.py) returns from two places, each a mean over the targets that
    are not its default `ignore_index=-100`, after `targets = targets.reshape(-1)`: the count
    is written at the call, in the loop's own arguments, and losses.py is left as it is."""
    after = _chunked_fix(CHUNKED)
    assert "micro_tokens = (targets[..., 1:] != -100).sum()" in after
    assert "return_count" not in after


def test_a_helper_whose_paths_average_over_different_counts_is_not_counted_at_the_call(tmp_path):
    folder = tmp_path / "pkg"
    shutil.copytree(CHUNKED, folder)
    losses = folder / "losses.py"
    losses.write_text(
        losses.read_text().replace(
            "kept = (targets != ignore_index).sum()", "kept = (targets != 0).sum()"
        )
    )
    train = folder / "train.py"
    result = fix_source(train.read_bytes(), train, Settings())
    assert "!= -100).sum()" not in result.after.decode()


def test_the_chunked_helpers_fix_matches_the_full_batch(tmp_path):
    """Run the fixed loop on K = 4 micro-batches whose prompts mask 1 to 9 targets per row;
    at the step its gradient equals one full-batch step's over the same rows."""
    import torch

    losses, train = _fixed_package(CHUNKED, tmp_path / "pkg", _chunked_fix(CHUNKED), "losses")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    batches = []
    for masked in (1, 9, 4, 6):
        ids = torch.randint(0, 32, (2, 12))
        labels = ids.clone()
        labels[:, :masked] = -100
        batches.append({"input_ids": ids, "labels": labels})

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            self.seen = torch.cat([p.grad.flatten() for p in model.parameters()])
            return super().step(closure)

    optimizer = Recording(model.parameters(), lr=0.0)
    train.train(model, optimizer, batches, accumulation_steps=4)
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    model.zero_grad()
    losses.chunked_loss(model(ids)[..., :-1, :], labels[..., 1:]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(optimizer.seen, full, atol=1e-6), (optimizer.seen - full).abs().max()


GLOBAL_MODEL = FIXTURES / "ga001_xmod_global_model_from_factory"


def _global_model_fix(folder: Path):
    train = folder / "train.py"
    return fix_source(train.read_bytes(), train, Settings())


def test_a_global_model_built_by_a_factory_of_the_repository_says_whether_it_shifts(tmp_path):
    """`model` is a global the main block binds after the function reads it, unpacked from
    `init_model(...)` of model.py and wrapped by `torch.compile`: the class it was built from,
    `TinyMoeForCausalLM`, says the labels are shifted. Named a seq2seq model, they are not;
    with model.py gone, nothing tells, and the fix is refused."""
    (outcome,) = _global_model_fix(GLOBAL_MODEL).outcomes
    assert outcome.applied, outcome.reason
    after = _global_model_fix(GLOBAL_MODEL).after.decode()
    assert "(labels[..., 1:] != -100).sum()" in after
    renamed = write(tmp_path / "seq2seq", {"train.py": (GLOBAL_MODEL / "train.py").read_text()})
    (renamed / "model.py").write_text(
        (GLOBAL_MODEL / "model.py").read_text().replace("MoeForCausalLM", "MoeForSeq2SeqLM")
    )
    after = _global_model_fix(renamed).after.decode()
    assert "(labels != -100).sum()" in after and "labels[..., 1:]" not in after
    alone = write(tmp_path / "alone", {"train.py": (GLOBAL_MODEL / "train.py").read_text()})
    (outcome,) = _global_model_fix(alone).outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(
        "cannot tell whether `model` (line 14) shifts its labels before its loss (a causal LM)"
    )
    assert "`(labels[..., 1:] != -100).sum()` if it does" in outcome.reason


def test_a_repository_model_whose_name_says_nothing_is_read_by_its_bases(tmp_path):
    """minimind-v's shape: `init_model` builds a `TinyMoeVLM`, whose name says neither, but
    which subclasses the repository's causal LM and overrides `forward`: its bases say the
    labels are shifted. A base that says nothing either leaves the fix refused."""
    vlm = (
        "\n\nclass TinyMoeVLM(TinyMoeForCausalLM):\n"
        "    def forward(self, input_ids, labels=None):\n"
        "        return super().forward(input_ids, labels=labels)\n"
    )
    model = (
        (GLOBAL_MODEL / "model.py")
        .read_text()
        .replace("model = TinyMoeForCausalLM(vocab)", "model = TinyMoeVLM(vocab)")
    )
    subclass = write(tmp_path / "vlm", {"train.py": (GLOBAL_MODEL / "train.py").read_text()})
    (subclass / "model.py").write_text(model + vlm)
    (outcome,) = _global_model_fix(subclass).outcomes
    assert outcome.applied, outcome.reason
    assert "(labels[..., 1:] != -100).sum()" in _global_model_fix(subclass).after.decode()
    (subclass / "model.py").write_text((model + vlm).replace("TinyMoeForCausalLM", "TinyMoe"))
    (outcome,) = _global_model_fix(subclass).outcomes
    assert not outcome.applied
    assert outcome.reason.startswith("cannot tell whether `model` (line 14) shifts its labels")


def test_the_global_models_read_ahead_fix_matches_the_full_batch(tmp_path):
    """Run the fixed loop on K = 4 micro-batches whose prompts mask 1 to 9 labels per row: at
    the step the gradient is one full-batch step's, the token mean over the window plus the
    router's auxiliary mean, which keeps its 1/K."""
    import argparse

    import torch

    fixed = _global_model_fix(GLOBAL_MODEL).after.decode()
    models, train = _fixed_package(GLOBAL_MODEL, tmp_path / "pkg", fixed, "model")

    torch.manual_seed(0)
    net = models.TinyMoeForCausalLM()
    batches = []
    for masked in (1, 9, 4, 6):
        ids = torch.randint(0, 32, (2, 12))
        labels = ids.clone()
        labels[:, :masked] = -100
        batches.append((ids, labels))

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            self.seen = torch.cat([p.grad.flatten() for p in net.parameters()])
            return super().step(closure)

    train.model, train.optimizer = net, Recording(net.parameters(), lr=0.0)
    train.args = argparse.Namespace(accumulation_steps=4)
    train.train_epoch(batches)
    net.zero_grad()
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    out = net(ids, labels=labels)
    (out.loss + out.aux_loss).backward()
    full = torch.cat([p.grad.flatten() for p in net.parameters()])
    assert torch.allclose(train.optimizer.seen, full, atol=1e-6), (
        (train.optimizer.seen - full).abs().max()
    )


def test_a_model_class_of_the_same_file_is_named_as_such():
    """The loss of a model class the training file defines itself: its evidence says so (not
    "imported from `.<the file itself>`"), and its inline `nn.CrossEntropyLoss(...)(...)` is
    the loss the fix counts (the fixture's .fixed.py)."""
    (finding,) = check_file(FIXTURES / "ga001_seq2seq_keyword_model.py", ALL).findings
    assert finding.evidence[0].endswith("returned by `Seq2Seq.forward()` of this file")


def test_a_loss_function_its_caller_hands_in_is_fixed_only_as_unsafe(tmp_path):
    """`train(..., step_fn)`: main.py hands in `masked_step`, whose count the fix uses, but
    another caller may hand a function of another count (or none: GLM's `train_step` is given
    the pretraining and the fine-tuning forward steps), so the fix is unsafe and says why."""
    root = write(
        tmp_path,
        {
            "losses.py": """\
                import torch.nn.functional as F


                def masked_step(model, batch):
                    mask = batch["mask"]
                    logits = model(batch["input_ids"])
                    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
                    return (losses * mask.flatten()).sum() / mask.sum()
                """,
            "engine.py": """\
                def train(model, loader, optimizer, step_fn, accum_steps):
                    for i, batch in enumerate(loader):
                        loss = step_fn(model, batch)
                        (loss / accum_steps).backward()
                        if (i + 1) % accum_steps == 0:
                            optimizer.step()
                            optimizer.zero_grad()
                """,
            "main.py": """\
                from engine import train
                from losses import masked_step


                def main(model, loader, optimizer):
                    train(model, loader, optimizer, masked_step, 4)
                """,
        },
    )
    engine = root / "engine.py"
    data = engine.read_bytes()
    safe = fix_source(data, engine, ALL, reach=True)
    assert safe.after == data and not safe.companions
    (outcome,) = safe.outcomes
    assert outcome.reason.startswith(
        "unsafe fix (`step_fn` is a parameter of `train()`: assumes every caller hands "
        "`masked_step` ("
    )
    assert "losses.py), whose count this is); apply with --unsafe-fixes" in outcome.reason
    unsafe = fix_source(data, engine, ALL, unsafe=True, reach=True)
    assert 'micro_tokens = batch["mask"].sum()' in unsafe.after.decode()


DENOISER = """\
    from collections import namedtuple

    import torch
    import torch.nn.functional as F
    from torch import nn

    Result = namedtuple("Result", ["loss", "pred"])


    class Denoiser(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.net = nn.Linear(dim, dim)

        def forward(self, x, lens):
            keep = torch.rand(x.shape[:2]) < 0.5  # a span drawn here: its size is out of sight
            pred = self.net(x)
            loss = F.mse_loss(pred, x, reduction="none")[keep].mean()
            return Result(loss, pred)


    class DenoiserWithHub(Denoiser, HubMixin):
        @classmethod
        def load(cls, path):
            return torch.load(path)
    """
DENOISER_TRAINER = """\
    import torch

    from pkg.model import Denoiser


    class Trainer:
        def __init__(self, model: Denoiser, optimizer, accum, compile=False):
            if compile:
                model = torch.compile(model)
            self.model = model
            self.optimizer = optimizer
            self.accum = accum

        def fit(self, loader):
            for step, (x, lens) in enumerate(loader):
                loss, pred = self.model(x, lens=lens)
                (loss / self.accum).backward()
                if (step + 1) % self.accum == 0:
                    self.optimizer.step()
                    self.optimizer.zero_grad()
    """


def test_an_annotated_model_of_the_repository_is_named_where_its_loss_is_out_of_sight(tmp_path):
    """Issue 17, item 4: `self.model` is the `Denoiser` its parameter is annotated with (through
    `model = torch.compile(model)`), whose `forward` makes a mean over a span it draws itself:
    no argument names that count, so the refusal points at `Denoiser.forward` instead of asking
    for `labels=`. The module also defines a subclass whose one method is not the loss's: the
    module is still read (a class emptied of its methods would not parse)."""
    root = write(
        tmp_path / "repo",
        {"pkg/__init__.py": "", "pkg/model.py": DENOISER, "pkg/train.py": DENOISER_TRAINER},
    )
    script = root / "pkg" / "train.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(
        "`self.model(...)` (line 16) runs `Denoiser.forward` ("
    ) and outcome.reason.endswith(
        "pkg/model.py), which makes a loss gaaudit cannot trace to a count: have it return the "
        "loss's valid count beside it (one per mean term if it adds means over different "
        "counts), backpropagate the loss times that count and divide the gradients once by the "
        "window's total"
    ), outcome.reason


# A Trainer subclass whose base is the project's own Trainer, in another module -------------

BASED = FIXTURES / "ga004_xmod_trainer_base_of_another_module"


def test_a_trainer_base_of_another_module_is_followed_and_is_a_dependency(tmp_path):
    """`class CorrectorTrainer(BaseTrainer)`, `BaseTrainer` imported from `.base`, where it
    derives from `transformers.Trainer`: GA004 reads the override, and editing the base (no
    longer a Trainer) re-judges it."""
    folder = tmp_path / "project"
    shutil.copytree(BASED, folder)
    corrector, base = folder / "trainers/corrector.py", folder / "trainers/base.py"
    (finding,) = check_file(corrector, ALL).findings
    assert finding.code == "GA004"
    assert any("through `BaseTrainer` of `.base`" in line for line in finding.evidence)
    dependencies = context_of(corrector).dependencies
    assert Dependency(str(base), file_digest(base)) in dependencies
    base.write_text(base.read_text().replace("(transformers.Trainer)", "(object)"))
    assert not current(dependencies)
    assert check_file(corrector, ALL).findings == []


# The data module a file imports ------------------------------------------------------------

PADDED_DATA = FIXTURES / "ga001_xmod_padded_data_module"
FIXED_DATA = FIXTURES / "ga001_exact_xmod_fixed_length_data_module"


@pytest.mark.parametrize(
    "folder, module, confidence, sign",
    [
        (PADDED_DATA, "dataloader.py", Confidence.HIGH, "`pad_sequence` in `dataloader`"),
        (FIXED_DATA, "data.py", Confidence.LOW, "`block_size` in `data`"),
    ],
    ids=["padded", "fixed-length"],
)
def test_a_file_showing_nothing_of_its_data_reads_the_data_module_it_imports(
    tmp_path, folder, module, confidence, sign
):
    """A training file whose own code shows neither padding nor fixed-length blocks takes the
    signs of the repository's data module it imports (`from dataloader import ...`): targets
    padded with -100 there make the count vary, blocks of one length make mean/K exact. The
    module is a dependency: without it the finding is medium, as the file alone says."""
    project = tmp_path / "project"
    shutil.copytree(folder, project)
    train, data = project / "train.py", project / module
    (finding,) = check_file(train, ALL).findings
    assert finding.confidence is confidence
    assert sign in finding.evidence[-1]
    dependencies = context_of(train).dependencies
    assert Dependency(str(data), file_digest(data)) in dependencies
    data.unlink()
    assert not current(dependencies)
    (alone,) = check_file(train, ALL).findings
    assert alone.confidence is Confidence.MEDIUM and "`dataloader`" not in alone.evidence[-1]


def test_a_data_modules_padding_does_not_make_a_models_own_loss_a_token_loss(tmp_path):
    """A loss a model of no known task returns (`loss = self.model(wave)`) is a token loss only
    where the file itself shows tokens: a data module that pads waveforms to the batch's
    longest says nothing of what that loss averages over (a per-clip mean, say)."""
    write(
        tmp_path,
        {
            "speech/data.py": """\
                from torch.nn.utils.rnn import pad_sequence


                def collate(waves):
                    return pad_sequence(waves, batch_first=True)
                """,
            "speech/trainer.py": """\
                from .data import collate


                class Trainer:
                    def __init__(self, model, loader, optimizer, grad_accum_every=4):
                        self.model, self.loader, self.optimizer = model, loader, optimizer
                        self.grad_accum_every = grad_accum_every

                    def train_step(self):
                        batches = iter(self.loader)
                        for _ in range(self.grad_accum_every):
                            loss = self.model(next(batches))
                            (loss / self.grad_accum_every).backward()
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                """,
        },
    )
    trainer = tmp_path / "speech/trainer.py"
    (finding,) = check_file(trainer, ALL).findings
    assert finding.confidence is Confidence.LOW, finding.evidence
    assert "the file shows no tokens" in finding.evidence[-1]
    assert str(tmp_path / "speech/data.py") in {d.path for d in context_of(trainer).dependencies}


def test_a_data_packages_init_lists_its_modules_and_is_no_sign(tmp_path):
    """`from dataset import build_dataset`, where `dataset/__init__.py` re-exports a packed and
    a padded builder: the list says nothing of which the file's data use (xtuner's configs)."""
    write(
        tmp_path,
        {
            "dataset/__init__.py": "from .packed import build_packed_dataset\n",
            "dataset/packed.py": "def build_packed_dataset(rows):\n    return rows\n",
            "train.py": PADDED_DATA.joinpath("train.py")
            .read_text()
            .replace("from dataloader import get_dataloader", "from dataset import get_dataloader"),
        },
    )
    (finding,) = check_file(tmp_path / "train.py", ALL).findings
    assert finding.confidence is Confidence.MEDIUM, finding.evidence
