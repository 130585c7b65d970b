"""`gaaudit fix`: exact before/after pairs, guarantees on bytes, and the CLI contract."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import textwrap
from functools import cache
from pathlib import Path

import libcst as cst
import pytest
from conftest import FIXTURES, expected, fixture_scripts, gaaudit, realworld

from gaaudit import catalogue
from gaaudit.checks.engine import PARALLEL_THRESHOLD, check_file
from gaaudit.config import Settings
from gaaudit.findings import Confidence
from gaaudit.fixes import codemod
from gaaudit.fixes.edits import DIVIDE_NOTE, WEIGHT_NOTE, wrapped
from gaaudit.fixes.fixer import fix_source

ALL = Settings(min_confidence=Confidence.LOW)
PAIRS = sorted(FIXTURES.glob("*.fixed.py"))

BUGGY = textwrap.dedent(
    """\
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    for step, batch in enumerate(loader):
        outputs = model(**batch)  # forward
        loss = outputs.loss / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    """
)


def fixed(
    data: bytes, unsafe: bool = True, settings: Settings = ALL, path: Path = Path("x.py")
) -> bytes:
    return fix_source(data, path, settings, unsafe).after


@cache
def fixed_fixture(script: Path):
    """`fix_source` of a fixture at every confidence, unsafe fixes too, made once for the tests
    that read it."""
    return fix_source(script.read_bytes(), script, ALL, unsafe=True)


def original_of(pair: Path) -> Path:
    return pair.with_name(pair.name.replace(".fixed.py", ".py"))


def test_every_fixable_shape_has_a_pair_and_every_finding_an_outcome():
    assert len(PAIRS) >= 20
    for script in fixture_scripts():
        if rows := expected(script):
            result = fixed_fixture(script)
            changes = result.after != script.read_bytes()
            assert changes == script.with_name(script.stem + ".fixed.py").exists(), script.name
            told = {(o.line, o.site.code) for o in result.outcomes}
            assert {(line, code) for line, code, _ in rows} <= told, script.name


def test_a_finding_no_rewrite_covers_is_reported_not_fixed(tmp_path, cli):
    """A JAX step whose micro-gradients another module averages: `fix` says so and exits 1."""
    shutil.copytree(FIXTURES / "ga005_xmod_microbatch_combinator", tmp_path / "repo")
    result = cli("fix", "train.py", cwd=tmp_path / "repo")
    assert result.exit_code == 1
    assert "train.py:18:" in result.output and "GA005 not fixed: `" in result.output
    assert "(accumulation.py line 22), another module gaaudit does not rewrite" in result.output
    assert "Fixed 0 findings in 0 files; 1 not fixed." in result.output


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.stem)
def test_pair_is_exact_compiles_is_clean_and_idempotent(pair: Path):
    after = pair.read_bytes()
    before = original_of(pair).read_bytes()
    assert fixed_fixture(original_of(pair)).after == after
    # compiles, reads no name it binds nowhere where the original bound it or did not read it,
    # and holds no block twice in a row that the original did not
    assert realworld().sound(before, after, str(pair))
    assert check_file(pair, ALL).findings == []
    assert fixed(after) == after
    assert b"gaaudit" not in after


def test_the_window_divisor_is_read_once_not_per_parameter():
    """A tensor count compared or converted per parameter would synchronise the device once
    per parameter (issue 17, item 6): the divisor is a Python number by then."""
    divisions = [
        line
        for pair in PAIRS
        for line in pair.read_text().splitlines()
        if "param.grad.div_(" in line
    ]
    assert len(divisions) >= 20
    assert not [line for line in divisions if "max(" in line or "float(" in line]


@pytest.mark.parametrize(
    "script", [s for s in fixture_scripts() if not expected(s)], ids=lambda p: p.stem
)
def test_clean_files_are_byte_identical(script: Path):
    assert fixed(script.read_bytes()) == script.read_bytes()


def test_rewrite_keeps_comments_and_divides_before_the_step():
    after = fixed(BUGGY.encode()).decode()
    assert "# forward" in after
    assert 'micro_tokens = (batch["labels"][..., 1:] != -100).sum()' in after
    assert "loss = outputs.loss * micro_tokens" in after
    assert after.index("window_tokens = max(float(window_tokens), 1.0)") < after.index(
        "param.grad.div_(window_tokens)"
    )
    assert after.index("param.grad.div_(window_tokens)") < after.index("optimizer.step()")
    assert after.index("window_tokens = 0") < after.index("for step, batch")
    # each inserted block says why in one line, right above it
    assert f"    {WEIGHT_NOTE}\n    micro_tokens = " in after
    assert f"        {DIVIDE_NOTE}\n        window_tokens = max(" in after


UNKNOWN_TARGETS = """
import torch.nn.functional as F


def train(model, loader, optimizer, accum):
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        (loss / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_only_a_loss_known_to_average_over_tokens_counts_tokens_by_name():
    """A cross-entropy over targets that may be image labels (an unknown domain) counts
    `micro_count`/`window_count`; the causal LM of `BUGGY` keeps `micro_tokens`/`window_tokens`
    (issue 17, item 6)."""
    after = fixed(UNKNOWN_TARGETS.encode()).decode()
    assert "micro_count = (y != -100).sum()" in after
    assert "param.grad.div_(window_count)" in after and "_tokens" not in after
    tokens = fixed(BUGGY.encode()).decode()
    assert "micro_tokens = " in tokens and "param.grad.div_(window_tokens)" in tokens
    assert "_count" not in tokens


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: s.replace("\n", "\r\n"),
        lambda s: "\ufeff" + s,
        lambda s: s.replace("    ", "\t"),
        lambda s: "# -*- coding: latin-1 -*-\n# caf\xe9\n" + s,
    ],
    ids=["crlf", "bom", "tabs", "latin-1"],
)
def test_encodings_and_line_endings_survive(transform):
    text = transform(BUGGY)
    encoding = "latin-1" if "coding: latin-1" in text else "utf-8"
    data = text.encode(encoding)
    after = fixed(data)
    assert after != data
    decoded = after.decode(encoding)
    assert decoded.startswith(text[:10])
    if "\r\n" in text:
        assert "\n" not in decoded.replace("\r\n", "")
    if "\t" in text:
        assert "\n\t\tfor group in optimizer.param_groups:" in decoded
    compile(after, "x.py", "exec")
    assert fixed(after) == after


def test_unsafe_fixes_are_held_back_with_a_reason(tmp_path, cli):
    script = FIXTURES / "ga002_nanogpt_micro_loop_no_division.py"
    target = tmp_path / script.name
    target.write_bytes(script.read_bytes())
    result = cli("fix", str(target))
    assert result.exit_code == 1
    assert "not fixed: unsafe fix" in result.output and "--unsafe-fixes" in result.output
    assert target.read_bytes() == script.read_bytes()
    result = cli("fix", str(target), "--unsafe-fixes")
    assert result.exit_code == 0
    assert target.read_bytes() == script.with_name(script.stem + ".fixed.py").read_bytes()


def test_a_folder_is_checked_on_workers_and_only_its_flagged_files_are_fixed(tmp_path):
    """`fix --jobs 2` over a folder of more files than one process checks alone: each file
    is checked on the workers first, then the flagged ones are rewritten as `fix` rewrites
    each alone, and the clean ones are left as they are."""
    clean = sorted(FIXTURES.glob("ok_*.py"))
    fixed = sorted(FIXTURES.glob("ga00*.fixed.py"))[:6]
    flagged = [p.with_name(p.name.replace(".fixed", "")) for p in fixed]
    assert len(clean) + len(flagged) > PARALLEL_THRESHOLD
    folder, alone = tmp_path / "folder", tmp_path / "alone"
    for copy in (folder, alone):
        copy.mkdir()
        for script in (*clean, *flagged):
            (copy / script.name).write_bytes(script.read_bytes())
    options = ("--unsafe-fixes", "--min-confidence", "low", "--no-cache")
    result = gaaudit("fix", ".", "--jobs", "2", *options, cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    assert f"in {len(flagged)} files (" in result.stdout, result.stdout
    for script in flagged:
        gaaudit("fix", script.name, *options, cwd=alone)
        rewritten = (folder / script.name).read_bytes()
        assert rewritten != script.read_bytes(), script.name
        assert rewritten == (alone / script.name).read_bytes(), script.name
    for script in clean:
        assert (folder / script.name).read_bytes() == script.read_bytes(), script.name


def test_unfixable_finding_says_why_with_its_position(tmp_path, cli):
    script = FIXTURES / "ga001_optional_loss_fct_token_tagger.py"
    (tmp_path / script.name).write_bytes(script.read_bytes())
    result = cli("fix", ".", cwd=tmp_path)
    assert result.exit_code == 1
    assert (
        f"{script.name}:31:24: GA001 not fixed: the loss is defined otherwise on a path of the "
        "`if` on line 21 of `_calculate_loss()`, over a count of its own" in result.output
    )
    assert "Fixed 0 findings in 0 files; 1 not fixed." in result.output


def test_window_across_calls_is_refused_with_what_to_do(tmp_path, cli):
    script = FIXTURES / "ga001_lightning_manual_optimization.py"
    (tmp_path / script.name).write_bytes(script.read_bytes())
    result = cli("fix", ".", cwd=tmp_path)
    assert result.exit_code == 1
    assert f"{script.name}:29:16: GA001 not fixed: the window spans calls of `training_step`" in (
        result.output
    )
    assert "on `self`" in result.output and "before `opt.step()`" in result.output
    assert (tmp_path / script.name).read_bytes() == script.read_bytes()


def test_a_closure_window_across_calls_names_its_holder_and_a_clip_on_every_call():
    """ignite's `update(engine, batch)`: the count outlives calls in a `nonlocal` of the
    enclosing function, not on `self`; a clip on every call is named first, since no loop of
    the file draws the calls' micro-batches to read them ahead."""
    source = (FIXTURES / "ga001_ignite_update_per_batch.py").read_bytes()
    clipping = source.replace(
        b"        loss.backward()\n",
        b"        loss.backward()\n        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
    )
    for data, clips in ((source, False), (clipping, True)):
        result = fix_source(data, Path("x.py"), ALL, unsafe=True)
        assert result.after == data
        (outcome,) = result.outcomes
        assert "a variable of `train()` that `update` declares `nonlocal`" in outcome.reason
        assert (
            "each call clips the gradients (`torch.nn.utils.clip_grad_norm_`, line 26)"
            in (outcome.reason)
        ) == clips
        assert ("clip once, at the step, then keep" in outcome.reason) == clips


def test_a_loss_megatron_accumulates_is_refused_with_megatron_cores_switch(tmp_path, cli):
    script = FIXTURES / "ga003_megatron_pretrain_sft_loss_mask.py"
    (tmp_path / script.name).write_bytes(script.read_bytes())
    result = cli("fix", ".", cwd=tmp_path)
    assert result.exit_code == 1
    assert f"{script.name}:42:12: GA003 not fixed: Megatron's schedule divides" in result.output
    assert "`--calculate-per-token-loss`" in result.output
    assert (tmp_path / script.name).read_bytes() == script.read_bytes()


LIGHTNING = textwrap.dedent(
    """\
    import lightning as L
    import torch.nn.functional as F


    class Tagger(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            logits = self.net(batch["input_ids"])
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


    trainer = L.Trainer(accumulate_grad_batches=8)
    """
)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            (
                "    def __init__(self, net):\n        super().__init__()\n",
                "    def __init__(self, net):\n",
            ),
            "`Tagger` has no `__init__` calling `super().__init__()`, where the window's count would start",
        ),
        (
            (
                "accumulate_grad_batches=8",
                'accumulate_grad_batches=8, strategy="deepspeed_stage_2"',
            ),
            "the Trainer runs a DeepSpeed strategy, which keeps the gradients outside `param.grad`",
        ),
        (
            (
                "def training_step(self, batch, batch_idx):",
                "def training_step(self, batch, batch_idx, optimizer_idx):",
            ),
            "`training_step` runs once per optimizer (`optimizer_idx`)",
        ),
        (
            (
                "\n\ntrainer =",
                '\n    def validation_step(self, batch, batch_idx):\n        self.log("val", self.training_step(batch, batch_idx))\n\n\ntrainer =',
            ),
            "`training_step` is also called on line 15, where the window's count would take",
        ),
        (
            ("accumulate_grad_batches=8", "accumulate_grad_batches=8, strategy=args.strategy"),
            "unsafe fix (the Trainer's strategy `args.strategy` is chosen at run time",
        ),
    ],
    ids=["no-init", "deepspeed", "per-optimizer", "called-by-validation", "strategy-unknown"],
)
def test_a_lightning_module_is_fixed_unless_the_count_or_the_division_has_no_place(change, reason):
    """The module as written is fixed (the returned loss weighted, a hook dividing); without
    a `super().__init__()` to start the count after, or with DeepSpeed keeping the gradients
    out of `param.grad`, it is refused, saying why."""
    named = LIGHTNING.replace(
        "import lightning", '"""Trained without deepspeed."""\n\nimport lightning'
    )
    (outcome,) = fix_source(named.encode(), Path("lit.py"), ALL).outcomes
    assert outcome.applied
    source = LIGHTNING.replace(*change)
    (outcome,) = fix_source(source.encode(), Path("lit.py"), ALL).outcomes
    assert not outcome.applied and outcome.reason.startswith(reason), outcome.reason


@pytest.mark.parametrize(
    ("precision", "scaled"),
    [('"16-mixed"', True), ("args.precision", True), ('"bf16-mixed"', False)],
)
def test_a_lightning_module_that_may_train_in_fp16_weights_by_a_reference(precision, scaled):
    """Under fp16 the Trainer's GradScaler needs the original's magnitude: each micro-batch's
    sum is taken over the window's first count (averaged over the processes)."""
    source = LIGHTNING.replace("=8)", f"=8, precision={precision})")
    after = fix_source(source.encode(), Path("lit.py"), ALL).after.decode()
    assert ("(micro_tokens / self.window_reference)" in after) is scaled
    assert ("param.grad.div_(window_tokens / self.window_reference)" in after) is scaled


@pytest.mark.parametrize(
    ("requirement", "applied"),
    [
        ("pytorch_lightning==1.3.5\n", False),  # no `trainer.strategy`, no hook
        (
            "pytorch-lightning @ git+https://github.com/someone/pytorch-lightning.git@v0.8.5_fixes\n",
            False,
        ),
        ("lightning<1.6\n", False),
        ("pytorch-lightning>=1.6\n", True),
        ("lightning==2.4.0\n", True),
        ("torch\n", True),  # Lightning named nowhere: any release
    ],
)
def test_a_lightning_module_pinned_before_1_6_is_refused(
    tmp_path, monkeypatch, requirement, applied
):
    """The division lives in `on_before_optimizer_step` and reduces the count with
    `trainer.strategy`: under a project's Lightning before 1.6 the returned sums would never
    be divided, so the fix is refused, naming the pin."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "requirements.txt").write_text(requirement)
    (outcome,) = fix_source(LIGHTNING.encode(), tmp_path / "lit.py", ALL).outcomes
    assert outcome.applied is applied, outcome.reason
    if not applied:
        assert outcome.reason.startswith(f"the project requires `{requirement.strip()}`")


def test_a_lightning_module_with_a_mixin_keeps_the_mixins_hook():
    """The hook the fix adds calls the one it overrides where the module has other bases."""
    source = LIGHTNING.replace("(L.LightningModule)", "(LoggingMixin, L.LightningModule)")
    after = fix_source(source.encode(), Path("lit.py"), ALL).after.decode()
    assert "        super().on_before_optimizer_step(optimizer, *args)\n" in after
    assert "super().on_before_optimizer_step" not in fixed(LIGHTNING.encode()).decode()


def test_a_lightning_modules_own_hook_gets_the_division_after_its_docstring():
    hooked = LIGHTNING.replace(
        "\n\ntrainer =",
        '\n    def on_before_optimizer_step(self, optimizer):\n        """Log the norm."""\n'
        '        self.log("norm", 1.0)\n\n\ntrainer =',
    )
    after = fix_source(hooked.encode(), Path("lit.py"), ALL).after.decode()
    assert '"""Log the norm."""\n        # one division per window' in after
    compile(after, "lit.py", "exec")
    one_line = hooked.replace(
        '    def on_before_optimizer_step(self, optimizer):\n        """Log the norm."""\n'
        '        self.log("norm", 1.0)\n',
        "    def on_before_optimizer_step(self, optimizer): pass\n",
    )
    assert one_line != hooked
    (outcome,) = fix_source(one_line.encode(), Path("lit.py"), ALL).outcomes
    assert not outcome.applied and "written on one line" in outcome.reason


def test_an_added_torch_import_goes_before_the_files_torch_submodule_imports():
    """`import torch` lands where isort would put it: before `import torch.nn.functional`."""
    after = fixed(LIGHTNING.encode()).decode()
    assert after.startswith(
        "import lightning as L\nimport torch\nimport torch.nn.functional as F\n"
    )


def test_a_window_with_a_backward_the_fix_would_not_weight_is_refused():
    """A branch that backpropagates the loss times a factor of each micro-batch (not a loss
    scale the window keeps) is no mean to weight: one division at the step would divide
    that branch's gradients too."""
    script = FIXTURES / "ga002_microbatch_slices_fp16_branch.py"
    text = script.read_text().replace("(loss * loss_scale)", "(loss * micro.shape[0])")
    (outcome,) = fix_source(text.encode(), script, ALL, unsafe=True).outcomes
    assert not outcome.applied and outcome.line == 28
    assert outcome.reason.startswith(
        "the window also backpropagates `(loss * micro.shape[0])` (line 26)"
    )


def test_a_backward_in_a_function_the_window_loop_calls_is_refused_where_it_cannot_count():
    """`train_step` backpropagates through a GradScaler, whose reference count lives in the
    window's loop; the verl-shaped helper whose loop adds up a running total of what it returns
    (`total += f(...).item()`) binds no name the count could join."""
    script = FIXTURES / "ga001_step_function_divides_by_its_k.py"
    (outcome,) = fix_source(script.read_bytes(), script, ALL, unsafe=True).outcomes
    assert not outcome.applied and outcome.line == 20
    assert outcome.reason.startswith(
        "the backward in `train_step()` (line 16), which the loop of line 35 calls once per "
        "micro-batch goes through a GradScaler"
    )
    script = FIXTURES / "ga001_helper_masked_mean_world_size.py"
    (outcome,) = fix_source(script.read_bytes(), script, ALL, unsafe=True).outcomes
    assert not outcome.applied and outcome.reason.startswith(
        "`self._loss_and_backward(...)` is called inside a larger statement (line 37)"
    )


def test_a_backward_under_a_flag_the_loop_passes_false_is_refused():
    """The loop's call turns the method's backward off (`backward=False`): its micro-batches
    would add their counts to a window with no gradient of theirs."""
    script = FIXTURES / "ga001_backward_in_micro_step_method.py"
    text = script.read_text().replace(
        "micro_batches=len(chunks))", "micro_batches=len(chunks), backward=self.training)"
    )
    assert text != script.read_text()
    (outcome,) = fix_source(text.encode(), script, ALL, unsafe=True).outcomes
    assert not outcome.applied and outcome.reason.startswith(
        "the backward in `_micro_step()` runs only when `backward` (line 23)"
    )


def test_micro_steps_into_gradients_the_caller_already_holds_are_refused():
    """`pretrain_loss` adds its micro-batches to the gradients its caller accumulated and then
    steps: one division after its loop would divide the caller's gradients too (InstructLLaMA's
    PPO update, which a safe fix once made worse than the original)."""
    script = FIXTURES / "ga001_micro_steps_into_callers_gradients.py"
    outcomes = {o.line: o for o in fix_source(script.read_bytes(), script, ALL, True).outcomes}
    assert not outcomes[15].applied
    assert outcomes[15].reason.startswith(
        "`pretrain_loss()` backpropagates into gradients its caller steps (line 27)"
    )
    cleared = script.read_text().replace(
        "        losses = []\n", "        losses = []\n        self.optimizer.zero_grad()\n"
    )
    assert cleared != script.read_text()
    outcomes = {o.line: o for o in fix_source(cleared.encode(), script, ALL, True).outcomes}
    assert outcomes[16].applied, outcomes  # cleared first: its loop is the whole window


def test_a_conditional_labels_expression_is_counted_whole():
    """ColossalAI's `labels=batch["labels"] if self.apply_loss_mask else batch["input_ids"]`:
    the count shifts and compares the whole conditional, not its last operand (unparenthesised,
    the mask branch summed the label ids themselves)."""
    source = textwrap.dedent(
        """\
        from transformers import AutoModelForCausalLM


        def train(model, optimizer, loader, accumulation_steps, mask_prompts):
            for step, batch in enumerate(loader):
                outputs = model(
                    batch["input_ids"],
                    labels=batch["labels"] if mask_prompts else batch["input_ids"],
                )
                (outputs.loss / accumulation_steps).backward()
                if (step + 1) % accumulation_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    )
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=False)
    fixed = result.after.decode()
    assert '(batch["labels"] if mask_prompts else batch["input_ids"])[..., 1:] != -100\n' in fixed
    assert "micro_tokens = (\n" in fixed  # the count's line, too long, split black's way
    compile(fixed, "train.py", "exec")


PER_PATH = """\
import torch.nn.functional as F


def train(model, batches, optimizer, k, rescale):
    for step, batch in enumerate(batches):
        out = model(batch["input_ids"])
        if rescale:
            out = out * 2
        if batch.get("labels") is not None:
            loss = F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten())
        else:
            loss = out.pow(2).mean()
        (loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    "change, reason",
    [
        ("", ""),
        (
            (
                "        if batch.get",
                "        if rescale:\n            pass\n        elif batch.get",
            ),
            "and a path reaches the backward with no loss bound in sight",
        ),
    ],
    ids=["both-counted", "a-path-binds-none"],
)
def test_a_loss_on_two_paths_binds_each_paths_count_or_is_refused(change, reason):
    """Each path of the `if` binds its own count before its loss, and the token loss of one
    path stays a mean (a `reduction="sum"` there would leave the other path unweighted); a
    path that binds no loss in sight is refused, saying so."""
    source = PER_PATH.replace(*change) if change else PER_PATH
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    if not reason:
        fixed = result.after.decode()
        assert outcome.applied and "reduction" not in fixed
        assert 'micro_tokens = (batch["labels"].flatten() != -100).sum()' in fixed
        assert "micro_tokens = out.pow(2).numel()" in fixed
        assert "(loss * micro_tokens).backward()" in fixed
        return
    assert not outcome.applied and reason in outcome.reason
    assert result.after == source.encode()


ONE_PATH = (FIXTURES / "ga001_aux_loss_on_one_path.py").read_text()
ARMS = (
    "            loss = token_mean + 0.01 * out.balance_loss\n"
    "        else:\n"
    "            loss = token_mean\n"
)


@pytest.mark.parametrize(
    "arms",
    [
        ARMS,
        (
            "            loss = token_mean\n        else:\n"
            "            loss = token_mean + 0.01 * out.balance_loss\n"
        ),
        None,  # on one line each: `if experts: loss = ...` / `else: loss = ...`
    ],
    ids=["term-in-if", "term-in-else", "one-line-arms"],
)
def test_a_term_added_on_one_path_only_is_refused_and_on_every_path_weighted_alone(arms):
    """A term the loss adds on one path of an `if` only is not weighted by the mean's count
    (the term-in-if loop was weighted as a whole, the term-in-else one read ahead with the term
    added on both paths); written on every path, the mean's term is weighted alone."""
    if arms is None:
        source = ONE_PATH.replace(
            "        if experts:\n" + ARMS,
            "        if experts: loss = token_mean + 0.01 * out.balance_loss\n"
            "        else: loss = token_mean\n",
        )
    else:
        source = ONE_PATH.replace(ARMS, arms)
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    assert not outcome.applied and result.after == source.encode()
    assert "adds `0.01 * out.balance_loss` to its mean on one path of the `if`" in outcome.reason
    every = ONE_PATH.replace(
        "        if experts:\n" + ARMS,
        "        loss = token_mean + (0.01 * out.balance_loss if experts else 0)\n",
    )
    fixed = fix_source(every.encode(), Path("train.py"), ALL).after.decode()
    assert "(0.01 * out.balance_loss if experts else 0) / accumulation" in fixed
    assert "token_mean * window_share" in fixed


def test_a_term_added_on_every_path_of_an_if_is_not_called_one_paths():
    """Where each arm adds the term to a mean over a count of its own, the refusal does not
    say the term is added on one path only (the advice to add it on every path would be
    moot)."""
    source = ONE_PATH.replace(
        ARMS,
        "            loss = token_mean + 0.01 * out.balance_loss\n        else:\n"
        "            loss = per_token.mean() + 0.01 * out.balance_loss\n",
    )
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    assert not outcome.applied and result.after == source.encode()
    assert "on one path of the `if`" not in outcome.reason
    assert "no mean gaaudit can count" in outcome.reason


def test_a_lightning_loss_a_function_adds_gradients_to_is_refused_saying_why():
    """Lightning divides the returned loss by K and draws the batches itself: the penalty a
    torch.autograd.Function adds in its `backward` would be divided by the window's count at
    the step, and the window cannot be read ahead, so the fix is refused, saying both."""
    source = textwrap.dedent(
        """\
        import lightning as L
        import torch
        import torch.nn.functional as F


        class Penalised(torch.autograd.Function):
            @staticmethod
            def forward(ctx, loss, logits):
                ctx.save_for_backward(logits)
                return loss

            @staticmethod
            def backward(ctx, grad_output):
                (logits,) = ctx.saved_tensors
                return grad_output, 1e-4 * logits / logits.numel()


        class Tagger(L.LightningModule):
            def __init__(self, net):
                super().__init__()
                self.net = net

            def training_step(self, batch, batch_idx):
                logits = self.net(batch["tokens"])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["tags"].flatten())
                return Penalised.apply(loss, logits)


        L.Trainer(accumulate_grad_batches=4).fit(Tagger(torch.nn.Linear(8, 5)))
        """
    )
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    assert not outcome.applied and result.after == source.encode()
    assert "`Penalised.apply(...)`" in outcome.reason
    assert "the window cannot be read ahead" in outcome.reason


PATHS_HEAD = """\
import torch


def train(model, batches, optimizer, k, c, d):
    for step, (x, y, keep) in enumerate(batches):
        err = (model(x) - y) ** 2
"""
PATHS_TAIL = """\
        (loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    "paths, expected",
    [
        (  # the binding before an `if` without `else` stands on two of the three paths
            (
                "        loss = err.mean()\n        if c:\n            if d:\n"
                "                loss = (err * keep).sum() / keep.sum()\n"
            ),
            ["err.numel()", "keep.sum()"],
        ),
        (  # an `elif` path, and one that raises
            (
                "        if c:\n            loss = (err * keep).sum() / keep.sum()\n"
                "        elif d:\n            loss = err.mean()\n        else:\n"
                "            raise ValueError(c)\n"
            ),
            ["keep.sum()", "err.numel()"],
        ),
        (  # the `if` in a loop, which may bind the loss more than once or not at all
            (
                "        for part in range(2):\n            if c:\n"
                "                loss = (err * keep).sum() / keep.sum()\n            else:\n"
                "                loss = err.mean()\n"
            ),
            "and the `if` does not run on every path to it",
        ),
        (  # in a `with` block, one path's loss returned by the model with other outputs
            (
                "        with torch.autocast('cpu', enabled=d):\n            if c:\n"
                "                loss = (err * keep).sum() / keep.sum()\n            else:\n"
                "                loss, parts = model.losses(x, y)\n"
            ),
            "and on line 11 no mean gaaudit can count",
        ),
    ],
    ids=["nested-without-else", "elif-and-raise", "in-a-loop", "model-loss-in-with"],
)
def test_every_path_to_the_backward_binds_its_count_or_is_refused(paths, expected):
    """Where the loss the backward reads is bound in an `if`, every path to the backward binds
    its own count (one count for all of them would weight the other paths wrongly), or the
    fix is refused (`expected`: the counts bound, or the reason)."""
    source = PATHS_HEAD + paths + PATHS_TAIL
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    fixed = result.after.decode()
    if isinstance(expected, str):  # refused, saying why
        assert not outcome.applied and expected in outcome.reason
        assert result.after == source.encode()
        return
    assert outcome.applied, outcome.reason
    assert [
        line.split(" = ")[1] for line in fixed.splitlines() if "micro_" in line and " = " in line
    ] == expected


def test_a_count_rebound_before_a_skipped_backward_is_refused():
    """The next batch is fetched after the loss, then a non-finite loss skips its backward:
    counting right after the loss would count a micro-batch the window never sees."""
    source = textwrap.dedent(
        """\
        import torch
        import torch.nn.functional as F


        def train(model, optimizer, get_batch, accum_steps):
            X, Y = get_batch()
            for micro_step in range(accum_steps):
                logits = model(X)
                loss = F.cross_entropy(logits.flatten(0, 1), Y.flatten(), ignore_index=-1)
                X, Y = get_batch()
                if not torch.isfinite(loss):
                    continue
                loss.backward()
            optimizer.step()
        """
    )
    result = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    (outcome,) = result.outcomes
    assert not outcome.applied and result.after == source.encode()
    assert outcome.reason.startswith("`Y`, which the count reads, is bound again between the loss")


def test_a_file_that_imports_nothing_gets_import_torch_after_its_docstring():
    source = textwrap.dedent(
        '''\
        """Fine-tunes an AutoModelForCausalLM handed in by the caller."""


        def train(model, loader, optimizer, accelerator):
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        '''
    )
    after = fixed(source.encode()).decode()
    docstring = '"""Fine-tunes an AutoModelForCausalLM handed in by the caller."""'
    assert after.startswith(f"{docstring}\nimport torch\n\n\ndef train(")
    assert "torch.as_tensor(window_tokens" in after and fixed(after.encode()).decode() == after
    compile(after, "train.py", "exec")


def test_diff_writes_nothing_and_git_applies(tmp_path, cli):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for name in ("ga001_hf_clm_sft_no_trainer.py", "ok_sum_and_count_grad_div.py"):
        (tmp_path / name).write_bytes((FIXTURES / name).read_bytes())
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.py")}
    result = cli("fix", ".", "--diff", cwd=tmp_path)
    assert result.exit_code == 1
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.py")} == before
    patch = tmp_path / "fix.patch"
    patch.write_text(result.stdout)
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    assert (tmp_path / "ga001_hf_clm_sft_no_trainer.py").read_bytes() == (
        FIXTURES / "ga001_hf_clm_sft_no_trainer.fixed.py"
    ).read_bytes()
    assert cli("fix", ".", "--diff", cwd=tmp_path).exit_code == 0


def test_fix_writes_in_place_keeps_mode_and_is_idempotent(tmp_path, cli):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)
    target.chmod(0o750)
    assert cli("fix", ".", cwd=tmp_path).exit_code == 0
    once = target.read_bytes()
    assert once != BUGGY.encode() and stat.S_IMODE(target.stat().st_mode) == 0o750
    assert cli("fix", ".", cwd=tmp_path).exit_code == 0
    assert target.read_bytes() == once
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_unparsable_and_read_only_files_are_left_untouched(tmp_path, cli):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    loss.backward()\n")
    locked = tmp_path / "locked.py"
    locked.write_text(BUGGY)
    locked.chmod(0o444)
    result = cli("fix", ".", cwd=tmp_path)
    assert result.exit_code == 2
    assert "broken.py:1:7: E999" in result.output
    if os.geteuid() != 0:  # root may write anything
        assert "locked.py: E999" in result.output and "not writable" in result.output
        assert locked.read_text() == BUGGY
    assert broken.read_text() == "def f(:\n    loss.backward()\n"


def test_interrupted_write_leaves_the_original(tmp_path, monkeypatch):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(codemod.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        codemod.write_atomic(target, b"new", BUGGY.encode())
    assert target.read_text() == BUGGY
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_file_changed_since_read_is_not_overwritten(tmp_path):
    target = tmp_path / "train.py"
    target.write_text(BUGGY + "# edited meanwhile\n")
    with pytest.raises(codemod.WriteError, match="changed while gaaudit was fixing it"):
        codemod.write_atomic(target, b"new", BUGGY.encode())
    assert target.read_text().endswith("# edited meanwhile\n")


@pytest.mark.parametrize("rule", list(catalogue.load().values()), ids=lambda r: r.code)
def test_rule_fixed_example_is_what_fix_produces(rule):
    """`fixed` is the codemod's output; a rule without a codemod leaves `bad` as it is."""
    assert fixed(rule.bad.encode(), unsafe=False).decode() == (rule.fixed or rule.bad)


EXPLICIT = textwrap.dedent(
    """\
    import torch.nn.functional as F

    for step, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            y.view(-1),
        )
        loss = loss / accum
        loss.backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
            print(f"loss {loss.item() * accum:.3f}", float(loss))
    """
)


def test_explicit_token_loss_becomes_a_sum_and_the_log_the_window_mean():
    after = fixed(EXPLICIT.encode()).decode()
    assert '        y.view(-1),\n        reduction="sum",\n    )\n' in after
    assert "loss = loss" not in after and "micro_tokens = (y.view(-1) != -100).sum()" in after
    assert "window_loss += loss.detach()\n" in after
    mean = "(window_loss / window_tokens)"
    # `loss.item() * accum` read the mean: now the window's; `float(loss)` read the mean over
    # `accum`: now the window's over `accum`, the scale the user had
    assert (
        f'    f"loss {{{mean}.item():.3f}}",\n            float({mean[1:-1]} / accum),\n' in after
    )
    # the counts are reset after the step's log has read them, not before
    assert (
        after.index("float(") < after.rindex("window_tokens = 0") < after.rindex("window_loss = 0")
    )


def test_a_mean_read_elsewhere_keeps_the_mean_and_weights_it():
    source = EXPLICIT.replace(
        "    loss = loss / accum\n", "    seen.append(loss.item())\n    loss = loss / accum\n"
    )
    after = fixed(source.encode()).decode()
    assert 'reduction="sum"' not in after
    assert (
        "loss = loss * micro_tokens" in after
        and "window_loss += loss.detach() * micro_tokens" in after
    )


def test_a_loss_module_called_once_is_built_with_a_sum_and_a_weighted_one_refused():
    source = EXPLICIT.replace(
        "import torch.nn.functional as F\n",
        "import torch.nn as nn\n\ncriterion = nn.CrossEntropyLoss()\n",
    )
    source = source.replace("loss = F.cross_entropy(", "loss = criterion(")
    after = fixed(source.encode()).decode()
    assert 'criterion = nn.CrossEntropyLoss(reduction="sum")' in after
    weighted = source.replace("nn.CrossEntropyLoss()", "nn.CrossEntropyLoss(weight=w)")
    report = fix_source(weighted.encode(), Path("x.py"), ALL, True)
    assert report.after == weighted.encode()
    assert "class weights" in report.outcomes[0].reason


def test_a_mean_mixed_with_another_term_weights_only_the_mean_by_its_share():
    """Weighting `lm_loss * a + mc_loss * b` by the token count would weight the
    multiple-choice term by tokens too (issue 16, item 6): the loop reads each window ahead,
    and only the mean's term moves from 1/K to its share of the window's tokens."""
    script = FIXTURES / "ga001_weighted_sum_of_means.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    (outcome,) = report.outcomes
    assert outcome.applied, outcome.reason
    after = report.after.decode()
    assert (
        "    lm_loss * args.lm_coef * window_share\n"
        "            + mc_loss * args.mc_coef / args.gradient_accumulation_steps\n"
        "        ).backward()" in after
    )
    assert 'pending.append(((step, batch), (batch["lm_labels"][..., 1:] != -100).sum()))' in after


def test_a_mean_whose_weight_the_loop_changes_is_refused_with_the_term():
    """A weight the loop rebinds is not the one the backward would read: refused, naming
    the other term and why the window cannot be read ahead."""
    script = FIXTURES / "ga001_weighted_sum_of_means.py"
    source = (
        script.read_text()
        .replace(
            "        lm_loss, mc_loss =", "        lm_coef = step / 10\n        lm_loss, mc_loss ="
        )
        .replace("lm_loss * args.lm_coef", "lm_loss * lm_coef")
    )
    report = fix_source(source.encode(), script, ALL, True)
    assert report.after == source.encode()
    (outcome,) = report.outcomes
    assert "adds `mc_loss * args.mc_coef` to its mean" in outcome.reason
    assert "reading the window ahead: the mean enters the loss" in outcome.reason


def test_a_mean_plus_a_mean_over_its_own_targets_is_weighted_whole_unless_counts_differ():
    """`0.5 * out.loss + w * kd`, `kd` masked over `labels >= 0` by a nested helper: for a
    sequence-to-sequence model the same labels `out.loss` counts (any negative label but -100
    would fail its cross-entropy), so the whole loss is one token mean; a causal model counts
    its labels shifted, another count, so the loss stays a mean plus another term."""
    script = FIXTURES / "ga003_accelerate_distillation_ce_plus_masked_kl.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    assert "accelerator.backward(loss * micro_tokens * accelerator." in report.after.decode()
    causal = script.read_text().replace("Seq2SeqLM", "CausalLM").encode()
    report = fix_source(causal, script, ALL, True)
    assert report.after == causal
    (outcome,) = report.outcomes
    assert "adds `kd_weight * kd` to its mean" in outcome.reason


def test_a_log_between_the_steps_reports_the_micro_batch_mean():
    source = EXPLICIT.replace(
        "    loss.backward()\n",
        "    loss.backward()\n    if step % 100 == 0:\n        print(loss.item() * accum)\n",
    )
    after = fixed(source.encode()).decode()
    assert "print((loss / max(micro_tokens, 1)).item())" in after


def test_a_helpers_mean_is_counted_in_the_helper_and_its_other_callers_see_no_change():
    """`loss = compute_loss(model, batch)` in the loop: the helper returns its count beside
    the mean when asked; the evaluation's call still gets the mean."""
    script = FIXTURES / "ga001_custom_compute_loss_helper.py"
    after = fixed(script.read_bytes(), unsafe=False).decode()
    assert "def compute_loss(model, batch, return_count=False):" in after
    assert "        return loss, (shift_labels.view(-1) != -100).sum()\n    return loss\n" in after
    assert "loss, micro_tokens = compute_loss(model, batch, return_count=True)" in after
    assert "compute_loss(model, {k: v.to(device) for k, v in b.items()}).item()" in after
    assert fixed(after.encode()) == after.encode()


HELPER_TWO_RETURNS = """
import torch.nn.functional as F


def compute_loss(model, batch):
    logits = model(batch["input_ids"]).logits
    if batch.get("labels") is None:
        return logits.new_zeros(())
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def train(model, loader, optimizer, accum):
    for step, batch in enumerate(loader):
        loss = compute_loss(model, batch)
        (loss / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_helper_with_two_returns_is_refused_with_what_to_do():
    report = fix_source(HELPER_TWO_RETURNS.encode(), Path("x.py"), ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied
    assert "`compute_loss` has more than one `return`" in outcome.reason


def test_a_mean_of_means_along_a_dimension_is_refused_with_the_inner_mean():
    """`helper(...).mean()` whose helper returns `losses.mean(1)`: its elements are means over
    each micro-batch's padded width, so weighting the rows (`.numel()`) would be a safe fix
    that fixes nothing."""
    script = FIXTURES / "ga001_masked_mean_over_padded_width.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(
        "the loss averages means along a dimension (`losses.mean(1)`, line 14)"
    )


REFUSED_LOOP = """
def train(model, loader, optimizer, accum):
    for step, batch in enumerate(loader):
{body}
        (loss / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (  # a mask in one branch, none in the other, of an `elif`; the first binds no loss
            """        x, y, mask = batch
        losses = F.mse_loss(model(x), y, reduction="none")
        if x.dim() > 2:
            pass
        elif mask is not None:
            loss = (losses * mask).sum() / mask.sum()
        else:
            loss = losses.mean()""",
            (
                "the loss is defined otherwise on a path of the `if` on line 10, over a count "
                "of its own, and a path reaches the backward with no loss bound in sight: bind "
                "each path's valid-target count beside its loss"
            ),
        ),
        (
            """        ids, labels = batch
        loss = model(ids, labels).loss""",
            (
                "`model(ids, labels).loss` is the loss of `model(...)` (line 7), which is handed "
                "no `labels=` that gaaudit can count: pass them by that name"
            ),
        ),
        (  # a model handed the batch whole finds its targets in it
            """        loss = model(batch)["loss"]""",
            (
                '`model(batch)["loss"]` is the loss of `model(batch)` (line 6), which finds its '
                "targets in `batch` itself, where gaaudit cannot count them: have the model "
                "return its count of valid targets beside the loss"
            ),
        ),
        (  # a model handed a spread dict picks its targets out of it
            """        logits, loss = model(**batch)""",
            (
                "`model(...)` (line 6) finds its targets in `**batch`, where gaaudit cannot "
                "count them: have the model return its count of valid targets beside the loss, "
                "backpropagate the loss times that count and divide the gradients once by the "
                "window's total"
            ),
        ),
        (
            """        ids, mask, segments = batch
        logits, loss = model(ids, mask, segments)""",
            (
                "`model(...)` (line 7) computes its own loss, and none of its arguments is named "
                "as its targets: pass them as `labels=` or `targets=`"
            ),
        ),
        (
            """        loss = token_loss(model, batch)""",
            (
                "gaaudit could not tell what the loss averages over: it is `token_loss(...)`, a "
                "call gaaudit cannot see into; backpropagate each micro-batch's loss sum and "
                "divide the gradients once by the window's count (see `gaaudit explain GA001`)"
            ),
        ),
    ],
)
def test_a_refusal_says_what_is_missing_where_and_what_to_do(body, reason):
    """Issue 17, item 4: each refusal names the statement that stops the fix, by its line, and
    says what would let it through."""
    source = "import torch.nn.functional as F\nfrom losses import token_loss\n" + (
        REFUSED_LOOP.format(body=body)
    )
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied and outcome.reason.startswith(reason), outcome.reason


SCALED_ON_ONE_BRANCH = """
import torch.nn.functional as F


def train(model, loader, optimizer, scaler, accum, use_amp):
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y, ignore_index=-100)
        if use_amp:
            scaler.scale(loss / accum).backward()
        else:
            (loss / accum).backward()
        if (step + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
"""


def test_a_window_is_fixed_whole_or_not_at_all():
    """The fp16 branch could be weighted alone, but the one division at the step would then
    divide the other branch's mean/K too (and read a reference count it never set): neither
    backward is rewritten, and the one that could be says which stopped it."""
    report = fix_source(SCALED_ON_ONE_BRANCH.encode(), Path("train.py"), ALL, True)
    assert report.after == report.before
    scaled, plain = report.outcomes
    assert not scaled.applied and not plain.applied
    assert plain.reason.startswith(
        "the window backpropagates through the GradScaler on line 9 and without it on line 11"
    )
    assert scaled.reason == f"another backward of its window is not fixed (line 11: {plain.reason})"


def test_two_losses_backpropagated_in_one_micro_step_are_refused_but_branches_are_fixed():
    """Two means backpropagated on one path through the micro-step each need a window count
    of their own: one shared count and one division would weight them wrongly. The same
    losses on the two branches of an `if` (stepped by one optimizer) are one loss a
    micro-step, which one count serves."""
    script = FIXTURES / "ga001_two_optimizers_one_guard.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    assert report.after == report.before
    assert [o.applied for o in report.outcomes] == [False, False]
    assert all(
        o.reason.startswith(
            "the window backpropagates 2 losses, `(critic_loss / accum_steps)` (line 13) and "
            "`(generator_loss / accum_steps)` (line 15), each a mean over a count of its own"
        )
        for o in report.outcomes
    )
    lines = script.read_text().splitlines()
    branched = "\n".join(
        [
            *lines[:11],
            "        if step % 2:",
            *("    " + line for line in lines[11:13]),
            "        else:",
            *("    " + line for line in lines[13:15]),
            *lines[15:],
        ]
    )
    one_optimizer = branched.replace("            opt_c.step()\n", "").replace(
        "            opt_c.zero_grad()\n", ""
    )
    report = fix_source(one_optimizer.encode(), script, ALL, True)
    assert [o.applied for o in report.outcomes] == [True, True]


EXCLUSIVE_LOSSES = {
    "train.py": """
import torch.nn.functional as F


def train(model, loader, optimizer, accum, aux):
    for step, (x, y) in enumerate(loader):
        if aux(step):
            loss_a = F.cross_entropy(model(x), y, ignore_index=-100)
            (loss_a / accum).backward()
            continue
        loss_b = F.nll_loss(model(x).log_softmax(-1), y, ignore_index=-100)
        (loss_b / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
""",
    "lit.py": """
import lightning as L
import torch.nn.functional as F


class Module(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.get("nll"):
            return F.nll_loss(self.net(x).log_softmax(-1), y, ignore_index=-100)
        return F.cross_entropy(self.net(x), y, ignore_index=-100)


trainer = L.Trainer(accumulate_grad_batches=4)
""",
}


@pytest.mark.parametrize("name", sorted(EXCLUSIVE_LOSSES))
def test_losses_of_which_one_a_micro_step_runs_are_fixed_together(name):
    """A branch that leaves the micro-step (`continue`, a `return` of `training_step`) before
    the other loss is reached: one loss a micro-step, which one count serves."""
    source = EXCLUSIVE_LOSSES[name]
    report = fix_source(source.encode(), Path(name), ALL, True)
    assert [o.applied for o in report.outcomes] == [True, True]
    second = (
        "        loss_b = F.nll_loss(model(x).log_softmax(-1), y, ignore_index=-100)\n"
        "        (loss_b / accum).backward()\n"
    )
    moved = source.replace(second, "").replace(
        "        if aux(step):", second + "        if aux(step):"
    )
    if moved != source:  # the second loss first: both run when the branch is taken
        report = fix_source(moved.encode(), Path(name), ALL, True)
        assert [o.applied for o in report.outcomes] == [False, False]


def test_a_backward_in_an_ifs_test_is_on_the_path_of_a_loss_after_that_if():
    """`if (loss / k).backward() is None:` with no `else`, and a second loss after the `if`:
    both run every micro-step (refused as two losses; it raised AttributeError before)."""
    source = """
import torch.nn.functional as F


def train(model, critic, loader, optimizer, accum):
    for step, (x, y) in enumerate(loader):
        out = model(x)
        loss = F.cross_entropy(out, y, ignore_index=-100)
        if (loss / accum).backward() is None:
            print("backpropagated")
        aux = F.cross_entropy(critic(out), y, ignore_index=-100)
        (aux / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    assert report.after == report.before
    assert [o.applied for o in report.outcomes] == [False, False]
    assert all("the window backpropagates 2 losses" in o.reason for o in report.outcomes)


def test_a_window_that_steps_two_optimizers_is_refused_with_both_named():
    """Muon for the matrices and AdamW for the rest, stepped under one guard: dividing only
    the first optimizer's gradients would leave the second stepping on a sum."""
    source = (
        SCALED_ON_ONE_BRANCH.replace("scaler, accum, use_amp", "muon_opt, accum")
        .replace(
            """        if use_amp:
            scaler.scale(loss / accum).backward()
        else:
            (loss / accum).backward()
""",
            "        (loss / accum).backward()\n",
        )
        .replace(
            "            scaler.step(optimizer)\n            scaler.update()\n",
            "            optimizer.step()\n            muon_opt.step()\n",
        )
    )
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied
    assert outcome.reason.startswith("the window steps 2 optimizers, `optimizer` and `muon_opt`")


UNREAD_STEP = """
import torch.nn.functional as F
from setup import accum, loader, model, {optimizer}

for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y, ignore_index=-100)
    (loss / accum).backward()
    if {guard}:
        {optimizer}.step()
        {optimizer}.zero_grad()
"""


@pytest.mark.parametrize(
    ("optimizer", "guard", "reason"),
    [
        (
            "optimizer",
            "should_step(step)",
            (
                "gaaudit cannot tell which micro-batches the step of line 9 closes: the loss is "
                "divided by `accum`, but no guard it reads (`(step + 1) % accum == 0`, say) leads"
            ),
        ),
        (  # a name gaaudit does not take for an optimizer's
            "updater",
            "(step + 1) % accum == 0",
            (
                "gaaudit sees no optimizer step in the module's top level, where the window's "
                "loss is backpropagated (it knows a step by its optimizer's name"
            ),
        ),
    ],
)
def test_a_step_gaaudit_cannot_place_the_window_of_is_named(optimizer, guard, reason):
    source = UNREAD_STEP.format(optimizer=optimizer, guard=guard)
    (outcome,) = fix_source(source.encode(), Path("train.py"), ALL, True).outcomes
    assert not outcome.applied and outcome.reason.startswith(reason), outcome.reason


def test_an_optimizer_named_for_its_algorithm_is_stepped_and_divided():
    """`adam.step()` closes the window as `optimizer.step()` does: the fix divides the
    gradients `adam` holds."""
    source = UNREAD_STEP.format(optimizer="adam", guard="(step + 1) % accum == 0")
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    assert [o.applied for o in report.outcomes] == [True]
    assert "for group in adam.param_groups:" in report.after.decode()


def test_a_pipeline_stage_is_refused_because_weighting_would_scale_the_other_stages():
    """Weighting the last stage's loss scales the gradients it sends to the other stages,
    which never see the window's count: the fix says what to do instead."""
    script = FIXTURES / "ga002_pipeline_stage_loss_func_default.py"
    report = fix_source(script.read_bytes(), script, ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied and "a pipeline stage" in outcome.reason
    assert "backward(gradient=...)" in outcome.reason
    assert "N the step's valid-target count" in outcome.reason  # a loss it could not trace


def test_a_refusal_counts_in_the_words_of_the_losss_domain():
    """The pipeline stage's advice for a mean squared error says elements, not tokens."""
    script = FIXTURES / "ga002_pipeline_stage_loss_func_default.py"
    source = script.read_text().replace("F.cross_entropy", "F.mse_loss")
    (outcome,) = fix_source(source.encode(), script, ALL, True).outcomes
    assert not outcome.applied and "N the step's element count" in outcome.reason
    assert "token" not in outcome.reason


POSITIONAL_LABELS = """
def train(model, loader, optimizer, accum):
    for step, (input_ids, position_ids, token_ids, label_ids) in enumerate(loader):
        loss, ppl = model(input_ids, position_ids, token_ids, label_ids)
        (loss / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_models_labels_handed_by_position_are_found_by_their_name():
    """`model(input_ids, position_ids, token_ids, label_ids)`: the count is taken over the
    labels, not over the second argument (position ids count every position)."""
    after = fixed(POSITIONAL_LABELS.encode()).decode()
    assert "micro_count = label_ids.numel()" in after  # an unknown model's labels
    assert "position_ids.numel()" not in after
    report = fix_source(POSITIONAL_LABELS.encode(), Path("x.py"), ALL, False)
    assert "no ignore_index is visible" in report.outcomes[0].reason  # unsafe: -100? -1?


def test_clipping_after_every_micro_batch_reads_the_window_ahead():
    """Clipping inside the micro-steps would clip a token-weighted sum far harder than the
    mean the original clips: the loop reads each window ahead instead, and each micro-batch's
    backward weights its mean by its share of the window's count, in the mean's magnitude."""
    script = FIXTURES / "ga001_clip_every_micro_batch.py"
    report = fix_source(script.read_bytes(), script, ALL, False)
    (outcome,) = report.outcomes
    assert outcome.applied, outcome.reason
    after = report.after.decode()
    assert "in read_ahead(enumerate(loader)):" in after
    assert "(loss * window_share * args.gradient_accumulation_steps).backward()" in after
    assert "param.grad.div_" not in after  # no division at the step
    assert "clip_grad_norm_(model.parameters(), args.max_grad_norm)" in after


READ_AHEAD_GUARD = """
import torch
from transformers import GPT2LMHeadModel

def train(model: GPT2LMHeadModel, loader, optimizer, args):
    updates = 0
    for input_ids, labels in loader:
        out = model(input_ids, labels=labels)
        loss = (out.loss + out.aux_loss) / args.k
        loss.backward()
        updates += 1
        if updates % args.k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_counter_raised_once_per_micro_batch_is_raised_ahead_by_the_reader():
    """`updates += 1; if updates % k == 0:`: the reader is handed the counter as the loop starts
    and raises it for each micro-batch it reads, so its windows end where the loop steps."""
    after = fixed(READ_AHEAD_GUARD.encode(), unsafe=False).decode()
    assert "def read_ahead(items, updates):" in after
    assert "            updates += 1\n            pending.append(" in after
    assert "for (input_ids, labels), window_share in read_ahead(loader, updates):" in after


@pytest.mark.parametrize(
    "raised",
    [
        "        if out.loss.isfinite():\n            updates += 1\n",  # not for every one
        "        updates += 1\n        if args.reset:\n            updates = 0\n",  # rebound
    ],
)
def test_a_counter_not_raised_once_per_micro_batch_is_not_read_ahead(raised):
    """The reader cannot tell how a counter moves that some micro-batches skip or that the
    body rebinds: the fix is refused and says both why."""
    source = READ_AHEAD_GUARD.replace("        updates += 1\n", raised)
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, True).outcomes
    assert not outcome.applied
    assert "adds `out.aux_loss` to its mean" in outcome.reason
    assert "reading the window ahead: the step's guard reads `updates`" in outcome.reason


@pytest.mark.parametrize("rebound", [False, True])
def test_a_divisor_the_loop_computes_is_undone_unless_rebound_before_the_backward(rebound):
    """The weighted term undoes the divisor as it stands at the backward: a divisor bound
    before the division is read ahead; one bound again between the division and the backward
    no longer holds what divided the loss, and the fix is refused, saying so."""
    divided = "        loss = (out.loss + out.aux_loss) / parts\n"
    source = READ_AHEAD_GUARD.replace(
        "        loss = (out.loss + out.aux_loss) / args.k\n",
        "        parts = args.k\n" + divided + ("        parts = 1\n" if rebound else ""),
    )
    assert divided in source
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is not rebound, outcome.reason
    if rebound:
        assert "the divisor `parts` reads is bound again between" in outcome.reason


def test_a_micro_batch_skipped_before_its_backward_makes_the_read_ahead_unsafe():
    """A `continue` before the backward drops a micro-batch its window has already counted."""
    skipping = (
        READ_AHEAD_GUARD.replace(
            "        loss = (",
            "        if out.loss.isnan():\n            continue\n        loss = (",
        )
        .replace("updates % args.k == 0", "(step + 1) % args.k == 0")
        .replace("for input_ids, labels in", "for step, (input_ids, labels) in enumerate(loader):#")
    )
    (outcome,) = fix_source(skipping.encode(), Path("x.py"), ALL, False).outcomes
    assert not outcome.applied and "--unsafe-fixes" in outcome.reason, outcome.reason
    assert "window_share" in fixed(skipping.encode(), unsafe=True).decode()


def test_a_step_test_bound_once_in_the_loop_is_read_ahead_as_its_value():
    """`boundary = (step + 1) % k == 0; ...; if boundary:` (DDP's `no_sync` shape): the
    generator tests the value the loop binds, which reads only the loop's target."""
    source = (FIXTURES / "ga001_ddp_no_sync_sft.py").read_text()
    clipping = source.replace(
        "            loss.backward()\n",
        "            loss.backward()\n            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
    )
    after = fixed(clipping.encode(), unsafe=False).decode()
    assert "            if (step + 1) % accumulation_steps == 0:\n" in after
    assert "(loss * window_share * accumulation_steps).backward()" in after
    assert "if boundary:" in after and "model.no_sync()" in after  # the loop's own lines stay


def test_an_optimizer_that_backpropagates_itself_is_not_divided_before_its_step():
    """apex's `FP16_Optimizer` (`optimizer.backward(loss)`) fills the gradients it steps on
    inside `step()`: a division of `param_groups`' gradients before it would divide nothing,
    so the window is read ahead (its guard's counter raised by the reader), unsafe as the
    `while` loop carries a short window into its next pass, and the reason says both; without
    that branch the same loop is fixed."""
    script = FIXTURES / "ga001_apex_fp16_optimizer_backward.py"
    (outcome,) = fix_source(script.read_bytes(), script, ALL).outcomes
    assert not outcome.applied and "`optimizer.backward(...)` (line 44)" in outcome.reason
    assert "loss-scaling wrapper (apex's `FP16_Optimizer`" in outcome.reason
    assert "reading the window ahead: unsafe fix (the loop on line 37 runs" in outcome.reason
    after = script.with_name(script.stem + ".fixed.py").read_text()
    assert "for batch, window_share in read_ahead(train_dataloader, step):" in after
    plain = FIXTURES / "ga001_example_share_divisor.py"
    assert all(o.applied for o in fix_source(plain.read_bytes(), plain, ALL).outcomes)


READ_AHEAD_EPOCH = """
from transformers import GPT2LMHeadModel

K = 4


def train_epoch(model: GPT2LMHeadModel, loader, optimizer):
    for i, (input_ids, labels) in enumerate(loader):
        out = model(input_ids, labels=labels)
        loss = (out.loss + out.aux_loss) / K
        loss.backward()
        if (i + 1) % K == 0:
            optimizer.step()
            optimizer.zero_grad()


def main(model, loader, optimizer, epochs):
    for epoch in range(epochs):
        train_epoch(model, loader, optimizer)
"""


@pytest.mark.parametrize(
    "old, new, safe",
    [
        ("", "", False),  # a pass's short last window goes on into the next call's first
        ("    for i,", "    optimizer.zero_grad()\n    for i,", True),  # cleared first
        ("(i + 1) % K == 0", "(i + 1) % K == 0 or i == len(loader) - 1", True),  # steps at its end
        ("        train_epoch(", "        optimizer.zero_grad()\n        train_epoch(", True),
        ("    for epoch in range(epochs):\n    ", "", True),  # called once
    ],
    ids=["carried", "cleared-first", "steps-at-end", "caller-clears", "no-caller-loop"],
)
def test_a_window_read_ahead_in_a_function_its_caller_runs_again(old, new, safe):
    """`train_epoch(model, loader, optimizer)`, called by an epoch loop: where neither it nor
    the caller's loop clears the gradients between passes and the step's guard does not hold at
    a pass's end, a short last window goes on into the next pass, which reading ahead per pass
    counts as two windows: the fix is unsafe, naming the caller's loop and the call."""
    source = READ_AHEAD_EPOCH.replace(old, new)
    assert source != READ_AHEAD_EPOCH or not safe
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason
    if not safe:
        assert (
            "reading the window ahead: unsafe fix (the loop on line 18 runs this one again by "
            "calling `train_epoch()` and does not clear the gradients" in outcome.reason
        )
    assert "read_ahead(enumerate(loader))" in fixed(source.encode(), unsafe=True).decode()


@pytest.mark.parametrize(
    "wrapper, safe", [("tqdm", True), ("islice", False)], ids=["progress-bar", "islice"]
)
def test_a_pass_that_steps_at_its_end_is_read_through_a_progress_bar(wrapper, safe):
    """`for i, x in enumerate(tqdm(loader))` with `or i == len(loader) - 1`: the bar draws
    what the loader does, so each pass ends on a step; `islice(loader, n)` may stop short."""
    source = READ_AHEAD_EPOCH.replace(
        "(i + 1) % K == 0", "(i + 1) % K == 0 or i == len(loader) - 1"
    ).replace("enumerate(loader)", f"enumerate({wrapper}(loader, 100))")
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason


SPREAD = """
from transformers import {model}

K = 8


def train(model: {model}, loader, optimizer):
    for step, batch in enumerate(loader):
        {unpacked} = model(**batch, return_dict=False){part}
        (loss / K).backward()
        if (step + 1) % K == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    "model, unpacked, part, count",
    [
        ("AutoModelForCausalLM", "loss, logits", "[:2]", 'batch["labels"][..., 1:]'),
        ("AutoModelForCausalLM", "loss, *_", "", 'batch["labels"][..., 1:]'),
        ("AutoModelForSeq2SeqLM", "loss, logits", "[:2]", 'batch["labels"]'),
        ("PreTrainedModel", "loss, logits", "[:2]", None),  # its kind unknown: not counted
    ],
    ids=["causal-sliced", "causal-starred", "seq2seq", "kind-unknown"],
)
def test_a_loss_unpacked_from_a_model_handed_the_batch_dict_counts_its_labels(
    model, unpacked, part, count
):
    """`loss, logits = model(**batch, return_dict=False)[:2]`: a transformers model takes its
    `labels` from the dict it is handed, as `model(**batch).loss` does; counted where the file
    shows the model's kind (shifted for a causal LM)."""
    source = SPREAD.format(model=model, unpacked=unpacked, part=part)
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is (count is not None), outcome.reason
    if count is None:
        assert "finds its targets in `**batch`" in outcome.reason
    else:
        assert f"micro_tokens = ({count} != -100).sum()" in fixed(source.encode()).decode()


INIT_PAD = (FIXTURES / "ga001_trainer_class_criterion_ignores_init_pad.py").read_text()


@pytest.mark.parametrize(
    "old, new, count",
    [
        ("", "", "self.pad_id"),  # kept on the instance by `__init__`
        ("ignore_index=pad_id", "ignore_index=self.pad_id", "self.pad_id"),  # read from it
        ("        self.pad_id = pad_id\n", "", None),  # kept nowhere the loop can read
        ("        running = 0.0\n", "        running = 0.0\n        self.pad_id = 0\n", None),
    ],
    ids=["kept-on-self", "read-from-self", "not-kept", "kept-then-changed"],
)
def test_an_ignore_value_read_in_init_is_counted_through_what_keeps_it(old, new, count):
    """`self.criterion = nn.CrossEntropyLoss(ignore_index=pad_id)` in `__init__`: the loop
    counts `targets != self.pad_id` where `__init__` keeps it there (and nothing sets it
    again), and is refused where the loop cannot read `pad_id`, rather than writing a count
    that raises NameError."""
    source = INIT_PAD.replace(old, new)
    assert source != INIT_PAD or not old
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is (count is not None), outcome.reason
    if count is None:
        assert "the loss's ignore value `pad_id` is read in `__init__()`" in outcome.reason
    else:
        assert f"(targets.reshape(-1) != {count}).sum()" in fixed(source.encode()).decode()


PLAIN_EPOCH = READ_AHEAD_EPOCH.replace("(out.loss + out.aux_loss) / K", "out.loss / K")


@pytest.mark.parametrize(
    "old, new, safe",
    [
        ("", "", False),  # a pass's short last window goes on into the next call's first
        ("    for i,", "    optimizer.zero_grad()\n    for i,", True),  # cleared first
        ("(i + 1) % K == 0", "(i + 1) % K == 0 or i == len(loader) - 1", True),  # steps at its end
        ("        train_epoch(", "        optimizer.zero_grad()\n        train_epoch(", True),
        ("    for epoch in range(epochs):\n    ", "", True),  # called once
    ],
    ids=["carried", "cleared-first", "steps-at-end", "caller-clears", "no-caller-loop"],
)
def test_a_window_count_started_in_a_function_its_caller_runs_again(old, new, safe):
    """The one division at the step, in `train_epoch()` that an epoch loop calls: the count
    starts at the function's loop, so where nothing clears the gradients between calls and the
    step's guard does not hold at a pass's end, the next call's first division would count only
    its part of a window the last call began: the fix is unsafe, naming the caller's loop and
    the call; with --unsafe-fixes it is made as written."""
    source = PLAIN_EPOCH.replace(old, new)
    assert source != PLAIN_EPOCH or not safe
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason
    if not safe:
        assert outcome.reason.startswith(
            "unsafe fix (the loop on line 18 runs this one again by calling `train_epoch()` and "
            "does not clear the gradients between its passes"
        )
    after = fixed(source.encode(), unsafe=True).decode()
    assert (
        "    window_tokens = 0\n    for i," in after and "param.grad.div_(window_tokens)" in after
    )


COUNTER_ON_SELF = (FIXTURES / "ga001_step_counter_on_self_spans_calls.py").read_text()


@pytest.mark.parametrize(
    "old, new, safe",
    [
        ("", "", False),  # `self.step` goes on from one call into the next, the gradients too
        ("        self.model.train()", "        self.step = 0", True),  # reset per call
        ("        self.model.train()", "        self.seen, self.step = 0, 0", True),  # in a tuple
        ("        self.model.train()", "        self.steps[0] = 0", False),  # another attribute
        (  # cleared at the end of the pass
            "                self.step += 1\n",
            "                self.step += 1\n        self.optimizer.zero_grad()\n",
            True,
        ),
        (  # a local counter: no caller in this file runs `_train()` again
            "            for input_ids, labels in self.loader:",
            "            for i, (input_ids, labels) in enumerate(self.loader):",
            True,
        ),
        (  # steps at each pass's end
            "(self.step + 1) % self.accumulation == 0",
            "(self.step + 1) % self.accumulation == 0 or i == len(self.loader) - 1",
            True,
        ),
        (  # a test at the length that reads the outliving counter holds in the first call only
            "(self.step + 1) % self.accumulation == 0",
            "(self.step + 1) % self.accumulation == 0 or self.step == len(self.loader) - 1",
            False,
        ),
    ],
    ids=[
        "carried",
        "reset",
        "reset-in-tuple",
        "item-reset",
        "cleared-at-end",
        "local",
        "steps-at-end",
        "end-by-counter",
    ],
)
def test_a_step_counter_that_outlives_the_function_carries_its_windows_across_calls(old, new, safe):
    """`_train()` tests `(self.step + 1) % K`, a counter it raises and does not reset: whoever
    calls it (here a base class in another file), a pass's last window goes on into the next
    call, while the one division's count starts in the function: unsafe, naming the counter,
    unless the function resets it, clears the gradients at a pass's end or steps there. The
    pipeline branch's `zero_grad()` never runs with the window's loop, so clears nothing."""
    source = COUNTER_ON_SELF.replace(old, new)
    if new.endswith("len(self.loader) - 1"):
        source = source.replace(
            "for input_ids, labels in self.loader:",
            "for i, (input_ids, labels) in enumerate(self.loader):",
        )
    if "enumerate" in new:
        source = source.replace("self.step + 1", "i + 1")
    assert source != COUNTER_ON_SELF or not safe
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason
    if not safe:
        assert outcome.reason.startswith(
            "unsafe fix (the step's guard reads `self.step`, which `_train()` raises and does "
            "not reset before its loop, and nothing clears the gradients at the end of a pass"
        )
        assert "keep the window's count beside `self.step`" in outcome.reason


SCRIPT_RUN = (FIXTURES / "ga002_script_train_resumes_step_counter.py").read_text()
SCRIPT_CALL = "    train(model, optimizer, scheduler, step, dataset, opt, Collator(tokenizer))\n"


@pytest.mark.parametrize(
    "change, importer, safe",
    [
        ((SCRIPT_CALL, SCRIPT_CALL), None, True),  # once, from `__main__`
        (  # through a `main()` that block calls once
            (SCRIPT_CALL, f"    main()\n\n\ndef main():\n    opt = None\n{SCRIPT_CALL}"),
            None,
            True,
        ),
        ((SCRIPT_CALL, "    for _ in range(2):\n    " + SCRIPT_CALL), None, False),
        ((SCRIPT_CALL, SCRIPT_CALL * 2), None, False),
        ((SCRIPT_CALL, SCRIPT_CALL), ("evaluate.py", "from train_reader import train\n"), False),
        ((SCRIPT_CALL, SCRIPT_CALL), ("tools/run.py", "import train_reader as reader\n"), False),
        # a folder `check` skips (`build/`, a default exclusion) holds no importer
        ((SCRIPT_CALL, SCRIPT_CALL), ("build/lib/run.py", "import train_reader\n"), True),
    ],
    ids=[
        "main-block",
        "through-main",
        "in-a-loop",
        "twice",
        "from-import",
        "import",
        "excluded-folder",
    ],
)
def test_a_step_counter_handed_in_is_safe_where_the_function_runs_once(
    tmp_path, monkeypatch, change, importer, safe
):
    """FiD's `train(..., step, ...)` raises a counter it is handed, so a call's last window
    could go on into the next call: where the script calls it once, from its `__main__` block
    (outside any loop, directly or through a function so called), and no file of its project
    imports the script, no next call exists, and the fix is safe."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train_reader.py"
    script.write_text(SCRIPT_RUN.replace(*change))
    if importer is not None:
        (tmp_path / importer[0]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / importer[0]).write_text(importer[1])
    (outcome,) = fix_source(script.read_bytes(), script, ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason
    if not safe:  # a next call, or a loop running this one again, carries the last window on
        assert outcome.reason.startswith("unsafe fix (") and "`train()`" in outcome.reason


def test_a_guard_reading_an_attribute_the_loop_raises_is_not_read_ahead():
    """The reader draws a window's micro-batches before the loop raises `self.step`, so it
    would test a stale counter, every window running to the pass's end: it refuses."""
    source = COUNTER_ON_SELF.replace(
        "(loss / self.accumulation).backward()",
        "((loss + logits.pow(2).mean()) / self.accumulation).backward()",
    )
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, True).outcomes
    assert not outcome.applied
    assert outcome.reason.endswith(
        "reading the window ahead: the step's guard reads `self.step`, which the loop computes"
    )


BRANCHED_EPOCH = """
from transformers import GPT2LMHeadModel

K = 4


def train_epoch(model: GPT2LMHeadModel, loader, optimizer, pipelined):
    if pipelined:
        for input_ids, labels in loader:
            model.run_pipeline(input_ids, labels, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    else:
        for i, (input_ids, labels) in enumerate(loader):
            out = model(input_ids, labels=labels)
            loss = out.loss / K
            loss.backward()
            if (i + 1) % K == 0:
                optimizer.step()
                optimizer.zero_grad()


def main(model, loader, optimizer, epochs, pipelined):
    for epoch in range(epochs):
        train_epoch(model, loader, optimizer, pipelined)
"""


@pytest.mark.parametrize(
    "old, new, safe",
    [
        ("", "", False),  # the pipeline branch's clear never runs with the window
        ("    if pipelined:", "    optimizer.zero_grad()\n    if pipelined:", True),
    ],
    ids=["other-branch", "before-the-if"],
)
def test_a_clear_on_the_other_branch_of_an_if_does_not_clear_between_passes(old, new, safe):
    """`if pipelined: ... zero_grad()` / `else: <the window's loop>`: that clear never runs
    with the window, so the caller's epoch loop still carries a pass's last window into the
    next call: unsafe; a clear before the `if`, on the window's path, clears between passes."""
    source = BRANCHED_EPOCH.replace(old, new)
    (outcome,) = fix_source(source.encode(), Path("x.py"), ALL, False).outcomes
    assert outcome.applied is safe, outcome.reason
    if not safe:
        assert outcome.reason.startswith(
            "unsafe fix (the loop on line 24 runs this one again by calling `train_epoch()`"
        )


def test_a_batch_moved_and_unpacked_in_the_loop_is_counted_ahead_as_drawn():
    """`batch = tuple(t.cuda() for t in batch)` then `ids, labels, *_ = batch`: the reader
    counts `batch[1]`, the same elements as the loop's `labels`, on the batch as drawn."""
    source = READ_AHEAD_GUARD.replace(
        "    for input_ids, labels in loader:\n",
        "    for batch in loader:\n"
        "        batch = tuple(t.cuda() for t in batch)\n"
        "        input_ids, labels, *_ = batch\n",
    )
    after = fixed(source.encode(), unsafe=False).decode()
    assert "pending.append((batch, (batch[1][..., 1:] != -100).sum()))" in after


def test_a_window_read_ahead_weights_the_backward_on_each_branch():
    """`if fp16: optimizer.backward(loss)` / `else: loss.backward()` of a window read ahead:
    the division stays (the name keeps its mean), so each branch's backward takes the
    weighted term, not only the finding's."""
    source = textwrap.dedent(
        """\
        from transformers import GPT2LMHeadModel


        def train(model: GPT2LMHeadModel, loader, optimizer, args):
            for i, (input_ids, labels) in enumerate(loader):
                loss = model(input_ids, labels=labels).loss
                loss = loss / args.accumulation_steps
                if args.fp16:
                    optimizer.backward(loss)
                else:
                    loss.backward()
                if (i + 1) % args.accumulation_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    )
    after = fixed(source.encode(), unsafe=False).decode()
    term = "loss * window_share * args.accumulation_steps"
    assert f"optimizer.backward({term})" in after and f"({term}).backward()" in after


def test_a_sum_divided_by_its_count_and_k_at_once_backpropagates_the_sum():
    """`loss_sum / (n_tokens * k)` is the mean over K, made in one division: unlogged, the sum
    is backpropagated as it is (never the sum times its count); logged, the name keeps its
    value and the backward undoes both factors."""
    logged = (
        (FIXTURES / "ga001_sum_over_count_times_k.py")
        .read_bytes()
        .replace(b"    loss.backward()\n", b"    loss.backward()\n    print(loss.item())\n")
    )
    after = fixed(logged)
    assert b"loss = loss_sum / (n_tokens * grad_accum_steps)\n" in after
    assert b"(loss * grad_accum_steps * micro_tokens).backward()" in after
    assert b"print(loss.item())" in after and b"micro_tokens = n_tokens\n" in after


@pytest.mark.parametrize(
    "divided",
    [
        "loss_sum / (n_tokens * grad_accum_steps)",
        "loss_sum / grad_accum_steps / n_tokens",
        "(loss_sum / grad_accum_steps) / n_tokens",
    ],
)
def test_a_sum_divided_by_k_and_its_count_becomes_the_sum(divided):
    """The sum is in sight: the fix backpropagates it as it is, counting `n_tokens`."""
    source = (FIXTURES / "ga001_sum_over_count_times_k.py").read_bytes()
    after = fixed(source.replace(b"loss_sum / (n_tokens * grad_accum_steps)", divided.encode()))
    assert b"    loss = loss_sum\n    loss.backward()\n" in after
    assert b"micro_tokens = n_tokens\n" in after and f"loss = {divided}".encode() not in after


HELPER_ON_BRANCHES = """
import torch
import torch.nn.functional as F


def compute(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def train(model, loader, optimizer, accumulation_steps, fp16):
    for step, batch in enumerate(loader):
        if fp16:
            with torch.autocast("cuda"):
                loss = compute(model, batch)
        else:
            loss = compute(model, batch)
        loss = loss / accumulation_steps
        loss.backward()
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_helper_loss_bound_on_both_branches_asks_both_for_its_count():
    """The fix asked only the last binding for the count (`else:`), so the `if fp16:` path
    met an unbound `micro_tokens`; now each branch's call returns it."""
    report = fix_source(HELPER_ON_BRANCHES.encode(), Path("train.py"), ALL, True)
    after = report.after.decode()
    assert [o.applied for o in report.outcomes] == [True]
    assert after.count("loss, micro_tokens = compute(model, batch, return_count=True)") == 2
    compile(after, "train.py", "exec")


BOUND_OTHERWISE = {
    "if-binds-otherwise": HELPER_ON_BRANCHES.replace(
        "                loss = compute(model, batch)", "                loss = model(**batch).loss"
    ),
    "bound-before-an-if-without-else": HELPER_ON_BRANCHES.replace(
        "        if fp16:\n", "        loss = model(**batch).loss\n        if fp16:\n"
    ).replace("        else:\n            loss = compute(model, batch)\n", ""),
}


@pytest.mark.parametrize("source", BOUND_OTHERWISE.values(), ids=BOUND_OTHERWISE)
def test_a_path_that_binds_the_loss_otherwise_is_refused(source):
    """Where another path leaves a loss that no call of the helper made, no count exists on
    it: the fix is refused with the line, instead of a rewrite that fails on that path."""
    assert source.count("loss = compute(") == 1
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied and "bind the loss the same way on every path" in outcome.reason


def test_a_binding_on_another_branch_that_does_not_reach_the_backward_is_left_alone():
    """Each branch backpropagates a loss of its own: the other branch's binding never reaches
    this backward, so it does not block the fix of either."""
    source = HELPER_ON_BRANCHES.replace(
        "                loss = compute(model, batch)\n",
        '                logits = model(batch["input_ids"])\n'
        '                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), '
        "ignore_index=-100)\n"
        "                (loss / accumulation_steps).backward()\n",
    ).replace(
        "            loss = compute(model, batch)\n        loss = loss / accumulation_steps\n"
        "        loss.backward()\n",
        "            loss = compute(model, batch)\n            (loss / accumulation_steps).backward()\n",
    )
    report = fix_source(source.encode(), Path("train.py"), ALL, True)
    after = report.after.decode()
    assert [o.applied for o in report.outcomes] == [True, True], report.outcomes
    assert after.count("return_count=True") == 1
    compile(after, "train.py", "exec")


@pytest.mark.parametrize(
    "called",
    ["self.loss(piece)", "self.loss(piece, labels=piece.masked_fill(piece == 0, -100))"],
    ids=["no-targets", "labels"],
)
@pytest.mark.parametrize(
    "decorator",
    ["    @abstractmethod\n", "    # each objective defines it\n"],
    ids=["abstract", "stub"],
)
def test_a_loss_left_to_subclasses_is_refused_even_with_labels(called, decorator):
    """Issue 17, item 4: the base class's `loss` is abstract (or a stub with only its
    docstring), so what it averages over is each subclass's own (a causal one shifts its
    labels): no count written at the call is safe, however the labels are named; the refusal
    says where the method is and what to do."""
    script = FIXTURES / "ga002_abstract_loss_method.py"
    source = script.read_text().replace("self.loss(piece)", called)
    source = source.replace("    @abstractmethod\n", decorator)
    report = fix_source(source.encode(), script, ALL, True)
    assert report.after == report.before
    (outcome,) = report.outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(
        "`self.loss(...)` (line 26) is left to subclasses (`def loss`, line 19), each making its "
        "loss over a count of its own that this loop cannot see: have each return"
    ), outcome.reason


def test_a_mean_made_on_one_path_only_is_not_weighted_by_every_micro_batchs_count():
    """`loss = zero` / `if scheduled(step): loss = ce(...)`: the skipped micro-batches make no
    mean, so counting their targets too would dilute the window; the fix is refused, naming the
    `if` and the placeholder's line."""
    script = FIXTURES / "ga001_loss_on_one_path_placeholder.py"
    (outcome,) = fix_source(script.read_bytes(), script, ALL, unsafe=True).outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(
        "the loss is defined otherwise on a path of the `if` on line 14, over a count of its "
        "own, and on line 13 no mean gaaudit can count"
    ), outcome.reason


ACCUMULATE_UNDER_DEEPSPEED = """\
import torch.nn.functional as F
from accelerate import Accelerator


def main(model, loader, optimizer):
    accelerator = Accelerator()
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.print("micro-batches per step:", accelerator.gradient_accumulation_steps)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    "made, sign",
    [
        ("accelerator = Accelerator()", "it reads `deepspeed_plugin`"),
        ("accelerator = Accelerator(gradient_accumulation_steps=4)", "it reads `deepspeed_plugin`"),
        (
            (
                "plugin = DeepSpeedPlugin(zero_stage=3)\n"
                "    accelerator = Accelerator(deepspeed_plugin=plugin)"
            ),
            "it makes a `DeepSpeedPlugin`",
        ),
        (
            "accelerator = Accelerator(deepspeed_plugin=plugin)",
            "it hands `Accelerator` a `deepspeed_plugin`",
        ),
    ],
    ids=["reads", "reads-with-k", "makes-plugin", "hands-plugin"],
)
def test_an_accumulate_window_a_deepspeed_launch_may_run_is_an_unsafe_fix(made, sign):
    """A file that reads `deepspeed_plugin`, or hands the Accelerator one, may run under ZeRO,
    whose gradients are not in `param.grad`, whether or not it sets K itself: the one division
    at `sync_gradients` would miss them while the backward is weighted by the count, so the
    fix is unsafe, saying so; without the plugin it is safe."""
    plain = ACCUMULATE_UNDER_DEEPSPEED.replace(
        "    if accelerator.state.deepspeed_plugin is not None:\n"
        '        accelerator.print("micro-batches per step:", accelerator.gradient_accumulation_steps)\n',
        "",
    )
    source = ACCUMULATE_UNDER_DEEPSPEED if "reads" in sign else plain
    source = source.replace("accelerator = Accelerator()", made)
    source = source.replace("def main(model, ", "def main(plugin, model, ").encode()
    (outcome,) = fix_source(source, Path("train.py"), ALL).outcomes
    assert not outcome.applied
    assert outcome.reason.startswith(f"unsafe fix (the file may train under DeepSpeed ({sign})")
    unsafe = fix_source(source, Path("train.py"), ALL, unsafe=True)
    assert "param.grad.div_(" in unsafe.after.decode()
    assert fix_source(plain.encode(), Path("train.py"), ALL).outcomes[0].applied


BOOSTER = (
    (FIXTURES / "ga002_booster_backward_loss_keyword.py")
    .read_text()
    .replace("import torch\n", "import torch\nfrom transformers import AutoModelForCausalLM\n")
    .replace("def train(model, ", "def train(model: AutoModelForCausalLM, ")
)
BOOSTED = BOOSTER.replace(
    "    loader = DataLoader(",
    "    booster = Booster(plugin=PLUGIN)\n"
    "    model, optimizer, *_ = booster.boost(model, optimizer)\n"
    "    loader = DataLoader(",
).replace(
    "import torch\n",
    "import torch\nfrom colossalai.booster import Booster\n"
    "from colossalai.booster.plugin import GeminiPlugin, TorchDDPPlugin\n",
)


@pytest.mark.parametrize(
    "source, safe",
    [
        (BOOSTER, False),  # a booster handed in, its plugin not seen
        (BOOSTED.replace("PLUGIN", "GeminiPlugin()"), False),
        (BOOSTED.replace("PLUGIN", "TorchDDPPlugin()"), True),
    ],
    ids=["handed-in", "gemini", "torch-ddp"],
)
def test_a_colossalai_booster_backward_is_an_unsafe_fix_unless_its_plugin_is_ddp(source, safe):
    """`booster.backward(loss=..., optimizer=...)`: ColossalAI's sharding plugins keep the
    gradients outside `param.grad`, where the one division before the step would not reach
    them while each micro-batch's loss is weighted by its count; the fix is unsafe, saying so,
    unless the file boosts with the TorchDDP plugin alone."""
    (outcome,) = fix_source(source.encode(), Path("train.py"), ALL).outcomes
    assert outcome.applied is safe
    if not safe:
        assert outcome.reason.startswith("unsafe fix (`booster.backward(...)` runs a ColossalAI")
    unsafe = fix_source(source.encode(), Path("train.py"), ALL, unsafe=True)
    assert "param.grad.div_(" in unsafe.after.decode()


FABRIC_FSDP = (FIXTURES / "ga001_fabric_no_backward_sync.py").read_text()


@pytest.mark.parametrize(
    "strategy, safe",
    [
        ('strategy="fsdp"', True),
        ('strategy="deepspeed_stage_2"', False),
        ("strategy=DeepSpeedStrategy(stage=3)", False),
    ],
    ids=["fsdp", "deepspeed-string", "deepspeed-strategy"],
)
def test_a_fabric_loop_under_a_deepspeed_strategy_is_an_unsafe_fix(strategy, safe):
    """`fabric.backward(loss)` under Fabric's DeepSpeed strategy: ZeRO keeps the gradients
    outside `param.grad`, where the one division before the step would not reach them; the fix
    is unsafe, saying which strategy, and safe under FSDP, whose gradients are there."""
    source = FABRIC_FSDP.replace('strategy="fsdp"', strategy)
    if "DeepSpeedStrategy" in strategy:
        source = source.replace(
            "import lightning as L\n",
            "import lightning as L\nfrom lightning.fabric.strategies import DeepSpeedStrategy\n",
        )
    assert strategy in source
    (outcome,) = fix_source(source.encode(), Path("train.py"), ALL).outcomes
    assert outcome.applied is safe
    if not safe:
        assert outcome.reason.startswith("unsafe fix (the file may train under DeepSpeed (it ")
        assert ("deepspeed_stage_2" in outcome.reason) or "DeepSpeedStrategy" in outcome.reason


NO_SYNC_ELSE_STEPS = FIXTURES / "ga003_accelerate_no_sync_else_steps.py"


def test_a_window_stepped_in_its_guards_else_weights_both_branches_and_divides_there():
    """`if n % k != 0:` backpropagates under `no_sync`, `else:` makes the loss again,
    backpropagates and steps: both backward calls are weighted, each counting its own
    branch's targets, and the one division sits between the `else`'s backward and its
    clipping. Where the file tests for `DistributedType.DEEPSPEED`, the accelerator's backward
    may be DeepSpeed's, whose ZeRO gradients no division reaches: unsafe. An `else` that steps
    before its backward leaves the division no place: refused."""
    source = NO_SYNC_ELSE_STEPS.read_text()
    after = fix_source(source.encode(), NO_SYNC_ELSE_STEPS, ALL).after.decode()
    assert after.count('micro_tokens = (batch["labels"].view(-1) != -100).sum()') == 2
    division, clip = after.index("param.grad.div_("), after.index("accelerator.clip_grad_norm_")
    assert after.rindex("accelerator.backward(", 0, division) > after.index("        else:\n")
    assert division < clip
    tested = source.replace(
        "    batches = 0\n",
        "    batches = 0\n"
        "    if accelerator.distributed_type == DistributedType.DEEPSPEED:\n"
        '        print("ZeRO")\n',
    ).replace("import Accelerator\n", "import Accelerator, DistributedType\n")
    outcomes = fix_source(tested.encode(), NO_SYNC_ELSE_STEPS, ALL).outcomes
    assert [o.applied for o in outcomes] == [False, False]
    assert outcomes[0].reason.startswith(
        "unsafe fix (the file may train under DeepSpeed (it tests for `DistributedType.DEEPSPEED`)"
    )
    assert all(
        o.applied for o in fix_source(tested.encode(), NO_SYNC_ELSE_STEPS, ALL, True).outcomes
    )
    early = source.replace(
        "            accelerator.backward(loss)\n            accelerator.clip_grad_norm_",
        "            optimizer.step()\n            accelerator.backward(loss)\n"
        "            accelerator.clip_grad_norm_",
    )
    outcomes = fix_source(early.encode(), NO_SYNC_ELSE_STEPS, ALL).outcomes
    assert not any(o.applied for o in outcomes)
    assert "steps before its last backward" in outcomes[-1].reason


def test_a_distributed_runtime_whose_collectives_fix_cannot_write_makes_it_unsafe():
    """A file started on the processes of a runtime gaaudit does not gather for (BMTrain's
    `bmt.init_distributed`) would count each process's window alone: the fix is unsafe, saying
    what to gather; the same loop without that start is a safe fix."""
    script = FIXTURES / "ga002_count_per_process_other_runtime.py"
    source = script.read_bytes()
    (outcome,) = fix_source(source, script, ALL).outcomes
    assert not outcome.applied
    assert outcome.reason.startswith("unsafe fix (the file runs on the processes of `bmt` (line")
    assert "`bmt`'s all-reduce" in outcome.reason
    single = source.replace(b"    bmt.init_distributed(seed=1)\n", b"")
    assert fix_source(single, script, ALL).outcomes[0].applied


def test_a_refusal_that_says_to_divide_the_gradients_warns_of_deepspeed():
    """Where the file may train under DeepSpeed (it reads `deepspeed_plugin`), ZeRO keeps the
    gradients outside `param.grad`: the refusal says to weight each backward instead."""
    script = FIXTURES / "ga003_accelerate_step_in_helper_may_run_deepspeed.py"
    source = script.read_bytes()
    advice = "but under DeepSpeed, which this file may train with, ZeRO keeps the gradients"
    (outcome,) = fix_source(source, script, ALL, unsafe=True).outcomes
    assert not outcome.applied and advice in outcome.reason
    assert "times the accumulation steps (DeepSpeed's backward divides by them)" in outcome.reason
    plain = source[: source.index(b"    if accelerator.state.deepspeed_plugin")]
    (outcome,) = fix_source(plain, script, ALL, unsafe=True).outcomes
    assert not outcome.applied and "DeepSpeed" not in outcome.reason


HELPER_TARGETS = FIXTURES / "ga003_deepspeed_loss_helper_builds_targets.py"


def test_a_loss_helper_that_builds_its_targets_is_asked_for_its_count_alone_ahead(tmp_path):
    """A DeepSpeed loop whose loss helper tokenises the batch's texts and builds the targets
    itself: the reader calls the helper as the loop does, with `count_only=True`, and the
    helper returns the count just before its forward. Unsafe: its statements before the
    forward run once more per micro-batch. The loop's own call, spread over lines, stays."""
    source = HELPER_TARGETS.read_text().replace(
        "loss = compute_loss(model, tokenizer, batch)",
        "loss = compute_loss(\n            model=model, tokenizer=tokenizer, batch=batch,\n"
        "            is_training=True,\n        )",
    )
    (tmp_path / ".git").mkdir()
    script = tmp_path / "train.py"
    (outcome,) = fix_source(source.encode(), script, ALL).outcomes
    assert not outcome.applied
    assert "unsafe fix (`compute_loss()` builds its targets itself" in outcome.reason
    assert "its statements before line 26 once more per micro-batch" in outcome.reason
    after = fixed(source.encode(), path=script).decode()
    assert fixed(after.encode(), path=script) == after.encode()
    assert "def compute_loss(model, tokenizer, batch, is_training=True, count_only=False):" in after
    assert (
        "    if count_only:\n        return (labels[..., 1:] != -100).sum()\n"
        "    with torch.set_grad_enabled(is_training):\n"
    ) in after
    assert (  # the reader's copy of the call, one argument a line in its tuple
        "                    (batch_idx, batch),\n                    compute_loss(\n"
        "                        model=model,\n"
    ) in after
    assert "                        count_only=True,\n                    ),\n" in after
    assert "loss = compute_loss(\n            model=model, tokenizer=tokenizer" in after
    assert "model.backward(loss * window_share)" in after
    written = set(after.splitlines()) - set(source.splitlines())
    long = [line for line in written if len(line) > 88]
    assert [line.strip()[:4] for line in long] == ["for "], long  # the header verify finds


@pytest.mark.parametrize(
    "forward_before, line",
    [("    labels = input_ids.clone()", 24), ("    for i, prompt in enumerate(prompts):", 26)],
    ids=["bound-after", "masked-after"],
)
def test_a_helper_count_set_after_its_forward_is_not_asked_ahead(forward_before, line):
    """The helper binds the targets the count reads, or masks them, only after its forward:
    it cannot count a micro-batch before running it; the refusal names the line."""
    source = HELPER_TARGETS.read_text()
    helper = source[
        source.index("    with torch.set_grad_enabled") : source.index("\n\n\ndef main")
    ]
    forward = "    logits = model(input_ids=input_ids.to(device)).logits\n"

    def forward_at(statement: str) -> bytes:
        return (
            source.replace(
                helper,
                "    return F.cross_entropy(\n"
                "        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(device), "
                "ignore_index=-100\n    )",
            )
            .replace(statement, forward + statement)
            .replace("import torch\n", "import torch\nimport torch.nn.functional as F\n")
            .encode()
        )

    (outcome,) = fix_source(forward_at(forward_before), HELPER_TARGETS, ALL, True).outcomes
    assert not outcome.applied
    assert (
        "reading the window ahead: the count `(labels[:, 1:].flatten() != -100).sum()` reads "
        f"`labels`, which `compute_loss()` sets on line {line}, not before its loss is made "
        f"(line {line - 1})"
    ) in outcome.reason, outcome.reason
    (outcome,) = fix_source(forward_at("    return F."), HELPER_TARGETS, ALL, True).outcomes
    assert outcome.applied


NESTED = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("gpt2")


    def train(loader, optimizer, accumulation_steps_from_the_command_line, epochs):
        for epoch in range(epochs):
            for step, batch in enumerate(loader):
                print("a line of the user's own that is longer than the configured width, left as it is")
                loss = model(**batch).loss / accumulation_steps_from_the_command_line
                loss.backward()
                if (step + 1) % accumulation_steps_from_the_command_line == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """
)


@pytest.mark.parametrize(
    "config, width",
    [
        ("", 88),
        ("pyproject.toml:[tool.ruff]\nline-length = 78\n", 78),
        ("pyproject.toml:[tool.black]\nline-length = 79\n", 79),
        ("setup.cfg:[flake8]\nmax-line-length = 80\n", 80),
        ("tox.ini:[flake8]\nmax-line-length = 84\n", 84),
    ],
    ids=["default", "ruff", "black", "setup.cfg", "tox.ini"],
)
def test_lines_a_fix_writes_are_wrapped_at_the_projects_line_length(tmp_path, config, width):
    """Inserted and rewritten lines stay within the project's configured line length (88
    where none is), split as black splits them; the user's own lines are left as they are."""
    if config:
        name, text = config.split(":", 1)
        (tmp_path / name).write_text(text)
    (tmp_path / ".git").mkdir()
    script = tmp_path / "train.py"
    script.write_text(NESTED)
    after = fixed(NESTED.encode(), path=script).decode()
    compile(after, "train.py", "exec")
    assert fixed(after.encode(), path=script).decode() == after
    original = set(NESTED.splitlines())
    written = [line for line in after.splitlines() if line not in original]
    assert written and all(len(line) <= width for line in written), written
    assert any(len(line) > width for line in NESTED.splitlines() if line in after)
    assert "param.grad.div_(\n" in after  # split at its brackets, black's way


def test_a_header_that_fits_is_left_on_its_line():
    """A header of 88 columns, its colon included, fits at 88: black leaves it as it is."""
    header = "if (step + 1) % accumulation_steps == 0 and step > warmup_steps and not done_:"
    header = header.replace("done_", "done" + "_" * (89 - len(header)))
    assert len(header) == 88
    statement = cst.parse_statement(header + "\n    pass\n")
    assert cst.Module([]).code_for_node(wrapped(statement, 0, 88)) == header + "\n    pass\n"
    assert cst.Module([]).code_for_node(wrapped(statement, 0, 87)).startswith("if (\n")


@pytest.mark.parametrize(
    "header, split",
    [
        (  # the rest fits after the closing parenthesis: black splits inside them
            (
                "if (model_engine.micro_steps + len(pending)) % ",
                "model_engine.",
                "gradient_accumulation_steps() == 0:",
            ),
            (
                "if (",
                "    model_engine.micro_steps + len(pending)",
                ") % model_engine.gradient_accumulation_steps() == 0:",
            ),
        ),
        (
            (
                "if (num_items_in_batch is None or not self.model_accepts_loss_kwargs) ",
                "and self.compute_loss_func is None:",
            ),
            (
                "if (",
                "    num_items_in_batch is None or not self.model_accepts_loss_kwargs",
                ") and self.compute_loss_func is None:",
            ),
        ),
        (  # two operators of least precedence: parentheses around it all, one operand a line
            (
                "if (step + 1) % accumulation_steps == 0 ",
                "and step > warmup_steps and not already_stepped_here:",
            ),
            (
                "if (",
                "    (step + 1) % accumulation_steps == 0",
                "    and step > warmup_steps",
                "    and not already_stepped_here",
                "):",
            ),
        ),
    ],
)
def test_a_condition_starting_with_parentheses_is_split_inside_them_as_black_does(header, split):
    """black 26 at 88 columns splits the header, written on one line, so (checked once; black
    is no dependency)."""
    statement = cst.parse_statement("".join(header) + "\n    pass\n")
    expected = "\n".join((*split, "    pass\n"))
    assert cst.Module([]).code_for_node(wrapped(statement, 0, 88)) == expected
