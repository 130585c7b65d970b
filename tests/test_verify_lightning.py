"""`gaaudit verify` on a LightningModule: a real Lightning Trainer accumulates K micro-batches
(`accumulate_grad_batches`, which divides each returned loss by K) and its gradient at the
optimizer step is compared with another Trainer's over the same micro-batches as one batch."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FIXTURES, devices, gaaudit, verify_projects

pytest.importorskip("lightning")

MODULE = """\
import {package} as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel
{extra}

def tiny_gpt2():
    config = GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


class LitLM(L.LightningModule):
    def __init__(self{parameters}):
        super().__init__()
        self.model = tiny_gpt2()

    def training_step(self, batch, batch_idx):
        {loss}
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)
"""
MEAN = "loss = self.model(**batch).loss"
# the window's token count rides on every row; Lightning's division by K is undone
TOKEN_SUM = """logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        token_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        k = self.trainer.accumulate_grad_batches
        loss = token_sum * k / batch["window_tokens"][0]"""
DATA = """\
import torch


def window(k):
    generator = torch.Generator().manual_seed(k)
    batches = []
    for _ in range(k):
        ids = torch.randint(1, 64, (2, 12), generator=generator)
        labels = ids.clone()
        labels[:, : int(torch.randint(2, 10, (1,), generator=generator))] = -100
        batches.append({"input_ids": ids, "labels": labels})
    tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for batch in batches:
        batch["window_tokens"] = torch.full((2,), tokens)
    return batches


def module():
    from lit import LitLM

    return LitLM(lr=1e-3)
"""


# a module whose layers are its own, made from an argument: nothing the harness stands in for
OWN_LAYERS = """\
import lightning as L
import torch


class LitNet(L.LightningModule):
    def __init__(self, width):
        super().__init__()
        self.layer = torch.nn.Linear(width, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)
"""
FIXED_LENGTH = "\nblock_size = 24  # the data are packed blocks of this many tokens\n"
FIT = "\n\ndef main():\n    trainer = L.Trainer(accumulate_grad_batches=4)\n    trainer.fit(LitLM())\n"
FIT_PRECISION = FIT.replace("main():", "main(precision):").replace(
    "=4)", "=4, precision=precision)"
)

HOOK = """
    def on_before_optimizer_step(self, optimizer):
        self.log("grad_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), 1e9))
"""


def lit(package="lightning", extra="", parameters="", loss=MEAN, after="") -> str:
    return MODULE.format(package=package, extra=extra, parameters=parameters, loss=loss) + after


# One project per test below, each a module lit.py, all replayed in one run.
PROJECTS = {
    "lightning": ("lit.py", {"lit.py": lit()}),
    "pytorch_lightning": ("lit.py", {"lit.py": lit(package="pytorch_lightning")}),
    "fixed_length": ("lit.py", {"lit.py": lit(extra=FIXED_LENGTH)}),
    "flagged_fixed_length": ("lit.py", {"lit.py": lit(extra=FIXED_LENGTH, after=FIT)}),
    "arguments": ("lit.py", {"lit.py": lit(parameters=", lr")}),
    "own_layers": ("lit.py", {"lit.py": OWN_LAYERS}),
    "fitted": ("lit.py", {"lit.py": lit(after=FIT)}),
    "fitted_with_hook": ("lit.py", {"lit.py": lit(after=HOOK + FIT)}),
    "fitted_precision_at_run_time": ("lit.py", {"lit.py": lit(after=FIT_PRECISION)}),
}


@pytest.fixture(scope="module", params=devices())
def replayed(request, tmp_path_factory) -> dict[str, dict]:
    """Each project's one loop, from one `gaaudit verify -k 2,4` run over them all (on the
    CPU, and on a GPU where one is present)."""
    root = tmp_path_factory.mktemp("projects")
    result, loops = verify_projects(root, PROJECTS, "-k", "2,4", "--device", request.param)
    assert result.returncode == 1, result.stdout + result.stderr
    return {name: loop for name, (loop,) in loops.items()}


def verify(tmp_path, *options: str) -> tuple[int, dict]:
    result = gaaudit("verify", "-k", "2,4", "--format", "json", *options, "lit.py", cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    (loop,) = json.loads(result.stdout)["loops"]
    return result.returncode, loop


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_a_mean_loss_divided_by_lightning_reproduces_the_bug(replayed, package):
    loop = replayed[package]
    assert loop["verdict"] == "bug reproduced", loop
    assert loop["header"] == "class LitLM(L.LightningModule):", loop
    assert [row["original_verdict"] for row in loop["rows"]] == ["bug reproduced"] * 2, loop
    assert 1e-2 < loop["rows"][0]["original_error"] < loop["rows"][1]["original_error"]


def test_on_fixed_length_blocks_the_mean_is_exact(replayed):
    loop = replayed["fixed_length"]
    assert loop["verdict"] == "verified" and loop["fixed_length"], loop
    assert all(row["verdict"] == "verified" for row in loop["rows"]), loop


def test_a_flagged_module_that_matches_the_full_batch_as_it_is_is_verified(replayed, tmp_path):
    """GA003 reports the module at low confidence and `fix` leaves it: on its fixed-length
    blocks it matches the full batch, so it needs no patch and no hint to run `fix`."""
    (tmp_path / "lit.py").write_text(PROJECTS["flagged_fixed_length"][1]["lit.py"])
    checked = gaaudit("check", "--min-confidence", "low", "lit.py", cwd=tmp_path).stdout
    assert "GA003 [low]" in checked
    loop = replayed["flagged_fixed_length"]
    assert loop["verdict"] == "verified", loop
    assert [row["verdict"] for row in loop["rows"]] == ["verified"] * 2, loop


@pytest.mark.parametrize(
    ("loss", "code", "verdict"), [(TOKEN_SUM, 0, "verified"), (MEAN, 1, "bug reproduced")]
)
def test_factories_hand_in_the_module_and_its_batches(tmp_path, loss, code, verdict):
    (tmp_path / "lit.py").write_text(lit(parameters=", lr", loss=loss))
    (tmp_path / "factories.py").write_text(DATA)
    factories = ("--model-factory", "factories:module", "--data-factory", "factories:window")
    got, loop = verify(tmp_path, *factories)
    assert got == code, loop
    assert [row["original_verdict"] for row in loop["rows"]] == [verdict] * 2, loop


@pytest.mark.parametrize("project", ["fitted", "fitted_with_hook", "fitted_precision_at_run_time"])
def test_the_fixed_module_divides_once_per_window_and_matches_the_full_batch(replayed, project):
    """`fix` makes the returned loss the micro-batch's token sum times K and divides the
    gradients by the window's count in `on_before_optimizer_step` (its own, or the module's
    existing hook, at its top; where the Trainer may run in fp16, the sum is taken over the
    window's first count, and the division corrects the ratio): a real Lightning Trainer
    then steps with the full batch's gradient."""
    loop = replayed[project]
    assert [row["original_verdict"] for row in loop["rows"]] == ["bug reproduced"] * 2, loop
    assert [row["verdict"] for row in loop["rows"]] == ["verified"] * 2, loop
    assert all(row["patched_error"] < 1e-5 for row in loop["rows"]), loop


def test_a_module_that_needs_arguments_stands_in_without_its_init(replayed):
    """`LitLM(lr)`: made without its __init__, the tiny model at `self.model`, which its
    training_step calls; its mean loss divided by Lightning shows the bug."""
    loop = replayed["arguments"]
    assert loop["verdict"] == "bug reproduced", loop
    assert [row["original_verdict"] for row in loop["rows"]] == ["bug reproduced"] * 2, loop
    assert all(row["original_error"] > 1e-3 for row in loop["rows"]), loop


def test_a_module_whose_layers_are_its_own_asks_for_the_model_factory(replayed):
    loop = replayed["own_layers"]
    assert loop["verdict"].startswith("not replayable: "), loop
    for row in loop["rows"]:
        assert row["verdict"].startswith("not replayable: TypeError: `LitNet` made without its")
        assert "holds no model" in row["verdict"], row
        assert "`LitNet()` cannot be built here (TypeError: " in row["verdict"], row
        assert row["verdict"].endswith("pass your module with --model-factory"), row


def test_a_framework_trainer_is_replayed_in_one_process(tmp_path):
    (tmp_path / "lit.py").write_text(lit())
    code, loop = verify(tmp_path, "--distributed", "2")
    assert code == 2
    for row in loop["rows"]:
        assert row["verdict"] == (
            "not replayable: a LightningModule is replayed in one process; leave out --distributed"
        )


def test_a_hydra_task_written_for_lightning_1_is_replayed_on_its_configured_data(tmp_path):
    """A module built from a Hydra config: its data module is what the project's configs name
    for `instantiate(cfg.datamodule)` (packed blocks read from a `memmap`: mean/K is exact),
    its network is built in `setup` (skipped: the tiny model stands in), it keeps Lightning
    1.x's `training_epoch_end` and `optimizer_idx`, calls its own `self.step(batch)` (no
    optimizer's) and reads its metrics by `getattr(self, f"{phase}_perplexity")`; run from
    the project, whose source copy of `flash_attn` has no built kernels, which transformers
    must not take for the installed library."""
    project = tmp_path / "project"
    shutil.copytree(FIXTURES / "ok_xmod_lightning_hydra_packed_datamodule", project)
    result = gaaudit(
        "verify", "-k", "4", "--device", "cpu", "--format", "json", "src/tasks/lm.py", cwd=project
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (loop,) = json.loads(result.stdout)["loops"]
    assert loop["fixed_length"] == "`memmap`, src/datamodules/tokens.py, line 29", loop
    (row,) = loop["rows"]
    assert row["verdict"] == "verified" and row["original_error"] < 1e-5, row
