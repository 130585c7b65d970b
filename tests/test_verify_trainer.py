"""`gaaudit verify` on a script that builds a transformers Trainer: its accumulation is the
Trainer's, replayed by a real Trainer on a tiny GPT-2; under a transformers pin before 4.46
(GA006) as those releases train, each micro-batch's mean divided by K, and as the installed
release trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from conftest import FIXTURES, ROOT, devices, gaaudit, verify_projects

from gaaudit.commands.verify import PREDATES, Outcome, report, targets

GA006 = tomllib.loads((ROOT / "rules" / "GA006.toml").read_text())

SCRIPT = """\
from datasets import load_dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

model = AutoModelForCausalLM.from_pretrained("gpt2")
dataset = load_dataset("json", data_files="sft.jsonl", split="train"){data}
args = TrainingArguments(output_dir="out", gradient_accumulation_steps=8)
trainer = Trainer(model=model, args=args, train_dataset=dataset)
trainer.train()
"""
PACKED = """
dataset = dataset.map(group_texts, batched=True)  # blocks of block_size tokens"""


REWARD_SCRIPT = "from reward import RewardModel\n" + SCRIPT.format(data="").replace(
    'AutoModelForCausalLM.from_pretrained("gpt2")', "RewardModel()"
)

PAIRS = """\
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


class PairTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        scores = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])[0]
        loss = -F.logsigmoid(scores[0::2] - scores[1::2]).mean()
        return (loss, scores) if return_outputs else loss


model = AutoModelForCausalLM.from_pretrained("gpt2")
args = TrainingArguments(output_dir="out", gradient_accumulation_steps=8)
PairTrainer(model=model, args=args, train_dataset=pairs).train()
"""

# A Trainer subclass that keeps the stock loss and reads options of the project's own arguments
OPTIONS = """\
from dataclasses import dataclass, field
from typing import Optional

import transformers


@dataclass
class HeadOptions:  # a mixin the arguments combine, as axolotl's do
    head_lr: Optional[float] = field(default=None, metadata={"help": "the head's own rate"})


@dataclass
class TrainingArguments(HeadOptions, transformers.TrainingArguments):
    use_lora: bool = False
"""
HEAD_TRAINER = """\
from transformers import Trainer


class HeadTrainer(Trainer):
    def create_optimizer(self):
        if self.args.use_lora or self.args.head_lr is None:
            return super().create_optimizer()
        raise NotImplementedError(self.args.head_lr)
"""

# A reward model's trainer: each batch holds chosen and rejected sequences, and no labels
REWARD_TRAINER = """\
import torch.nn.functional as F
from transformers import Trainer


class RewardTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        chosen = model(
            input_ids=inputs["input_ids_chosen"], attention_mask=inputs["attention_mask_chosen"]
        )[0]
        rejected = model(
            input_ids=inputs["input_ids_rejected"],
            attention_mask=inputs["attention_mask_rejected"],
        )[0]
        loss = -F.logsigmoid(chosen - rejected).mean()
        return (loss, {"chosen": chosen}) if return_outputs else loss
"""

# trlx's summarisation SFT: a dataset of the module beside the script pads every row to
# max_length and returns its ids as its labels, so every row counts every position
OWN_LABELS_DATASET = """\
import torch
from torch.utils.data import Dataset


class SummaryDataset(Dataset):
    def __getitem__(self, index):
        encoded = self.tokenizer(self.texts[index], truncation=True, padding="max_length")
        input_ids = torch.tensor(encoded["input_ids"])
        return {"input_ids": input_ids, "labels": input_ids}
"""
OWN_LABELS_SCRIPT = """\
from summary_dataset import SummaryDataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

model = AutoModelForCausalLM.from_pretrained("gpt2")
dataset = SummaryDataset("summaries.json")
args = TrainingArguments(output_dir="out", gradient_accumulation_steps=8)
Trainer(model=model, args=args, train_dataset=dataset).train()
"""

# A subclass written for transformers before 4.46: its overrides take no count, which later
# releases hand them
WRITTEN_BEFORE = """\
from transformers import Trainer


class OldTrainer(Trainer):
    def training_step(self, model, inputs):
        return super().training_step(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss
"""

# A subclass that loads its data for several processes and makes its optimizer from names an
# old release exported (mPLUG-Owl's, VILA's), and keeps the stock loss
OWN_LOADING = """\
import torch
from torch.utils.data import DataLoader, DistributedSampler
from transformers import Trainer
from transformers.trainer import ALL_LAYERNORM_LAYERS, get_parameter_names


class ProjectTrainer(Trainer):
    def get_train_dataloader(self):
        sampler = DistributedSampler(self.train_dataset)
        return DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            sampler=sampler,
            collate_fn=self.data_collator,
        )

    def create_optimizer(self):
        decay = set(get_parameter_names(self.model, ALL_LAYERNORM_LAYERS))
        groups = [
            {"params": [p for n, p in self.model.named_parameters() if n in decay]},
            {"params": [p for n, p in self.model.named_parameters() if n not in decay]},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate)
        return self.optimizer
"""

# A multimodal model's calling convention (the batch as one keyword) and a `training_step`
# copied from a 4.3x Trainer, which reads `self.use_apex` (MiniCPM-V's `CPMTrainer`).
COPIED_STEP = """\
from transformers import Trainer


class MultimodalTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = self.model(data=inputs, use_cache=False)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def training_step(self, model, inputs):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        if self.use_apex:
            from apex import amp

            with amp.scale_loss(loss, self.optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            self.accelerator.backward(loss)
        return loss.detach()
"""

# A trainer module of a package under `src/` that takes its helpers from modules of the
# package: one by a relative import, one by the package's name, one of them importing a name
# the installed transformers no longer has
PACKAGE = {
    "src/ranking/__init__.py": "",
    "src/ranking/batching.py": """\
from transformers.trainer import a_name_of_an_older_release


def take(inputs, fields):
    return tuple(inputs[field] for field in fields)
""",
    "src/ranking/scoring.py": """\
import torch.nn.functional as F


def answer_log_probs(logits, labels):
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    return -losses.sum(-1)
""",
    "src/ranking/trainers/__init__.py": "",
    "src/ranking/trainers/ranked.py": """\
from transformers import Trainer

from ranking import scoring

from ..batching import take


class RankedTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        input_ids, attention_mask, labels = take(inputs, ("input_ids", "attention_mask", "labels"))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = -scoring.answer_log_probs(logits, labels).mean()
        return (loss, logits) if return_outputs else loss
""",
}

# One project per test below: its script, then every file it holds.
PROJECTS = {
    "pinned": ("train.py", {"train.py": GA006["bad"]}),
    "stock": ("train.py", {"train.py": GA006["good"]}),
    "requirements": (
        "scripts/sft.py",
        {
            "requirements.txt": "torch\ntransformers>=4.30,<4.40\n",
            "scripts/sft.py": SCRIPT.format(data=""),
        },
    ),
    "packed": (
        "train.py",
        {"requirements.txt": "transformers==4.38.2\n", "train.py": SCRIPT.format(data=PACKED)},
    ),
    "regressed": (
        "train.py",
        {"requirements.txt": "transformers==4.48.0\n", "train.py": SCRIPT.format(data="")},
    ),
    "own_model": ("train.py", {"train.py": REWARD_SCRIPT}),
    "bound": (
        "train.py",
        {
            "train.py": SCRIPT.format(data="").replace(
                "trainer = Trainer(", "FinetuningTrainer = Trainer\ntrainer = FinetuningTrainer("
            )
        },
    ),
    "pairs": ("rm.py", {"requirements.txt": "transformers==4.43.4\n", "rm.py": PAIRS}),
    "options": ("trainer.py", {"params.py": OPTIONS, "trainer.py": HEAD_TRAINER}),
    "reward": ("reward.py", {"reward.py": REWARD_TRAINER}),
    # transformers heads that drop the window's count, and one given a loss that uses it
    **{
        name: ("train.py", {"train.py": (FIXTURES / f"{fixture}.py").read_text()})
        for name, fixture in (
            ("tagger", "ga004_library_token_classifier"),
            ("t5", "ga004_library_seq2seq_trainer"),
            ("tagger_count", "ok_library_token_classifier_window_count"),
        )
    },
    "written_before": ("old.py", {"old.py": WRITTEN_BEFORE}),
    "own_loading": ("trainer.py", {"trainer.py": OWN_LOADING}),
    "copied_step": ("trainer.py", {"trainer.py": COPIED_STEP}),
    "own_labels": (
        "sft.py",
        {
            "requirements.txt": "transformers==4.32.0\n",
            "sft.py": OWN_LABELS_SCRIPT,
            "summary_dataset.py": OWN_LABELS_DATASET,
        },
    ),
}


@pytest.fixture(scope="module", params=devices())
def replayed(request, tmp_path_factory) -> dict[str, Outcome]:
    """Each project's one loop, from one `gaaudit verify -k 2,4` run over them all (on the
    CPU, and on a GPU where one is present)."""
    root = tmp_path_factory.mktemp("projects")
    result, loops = verify_projects(root, PROJECTS, "-k", "2,4", "--device", request.param)
    assert result.returncode == 1, result.stdout + result.stderr  # the pinned ones are not verified
    replayed = {}
    for name, (loop,) in loops.items():
        replayed[name] = Outcome(**{key: value for key, value in loop.items() if key != "verdict"})
    return replayed


def test_a_pin_before_4_46_is_replayed_as_it_trains_and_as_the_installed_release(replayed, capsys):
    loop = replayed["pinned"]
    assert loop.header.startswith("Trainer(model=model") and loop.flagged
    # where the pin is, as a path from the current directory (here absolute: outside it)
    assert loop.pinned.startswith("`transformers==4.45.2` (/"), loop.pinned
    assert loop.pinned.endswith("/pinned/train.py line 6)"), loop.pinned
    for row in loop.rows:
        assert row["original_verdict"] == "bug reproduced" and row["original_error"] > 1e-2
        assert row["installed_error"] < 1e-5, row
        assert row["verdict"].endswith(": verified: require transformers>=4.46.2"), row
    errors = [row["original_error"] for row in loop.rows]
    assert errors[1] > errors[0]  # more micro-batches, more unequal weights

    assert report([(Path("train.py"), [loop])], "text") == 1
    table = capsys.readouterr().out
    assert "replayed as transformers before 4.46 trains, which `transformers==4.45.2`" in table


def test_a_pin_to_4_48_0_is_replayed_with_its_regression(replayed, capsys):
    """4.48.0 hands a model that takes loss kwargs no count and skips its division by K: the
    step sees the sum of K means (3.0 at K = 4 here; 3.08 measured on a real 4.48.0)."""
    loop = replayed["regressed"]
    assert loop.pin_kind == "regressed" and loop.flagged
    for row in loop.rows:
        assert row["original_verdict"] == "bug reproduced", row
        assert row["original_error"] > (row["k"] - 1) * 0.9, row
        assert row["verdict"].endswith(": verified: require transformers>=4.48.1"), row
    assert report([(Path("train.py"), [loop])], "text") == 1
    assert "replayed as transformers 4.47.0 and 4.48.0 train" in capsys.readouterr().out


def test_overrides_written_before_4_46_are_called_as_those_releases_called_them(replayed):
    """The installed Trainer passes `num_items_in_batch` to `compute_loss` and
    `training_step`, which this class's overrides do not take: it trains as the releases it
    was written for did, each micro-batch's mean over K, and says so."""
    loop = replayed["written_before"]
    assert loop.flagged and loop.replayed == PREDATES, loop
    for row in loop.rows:
        assert row["original_verdict"] == "bug reproduced" and row["original_error"] > 1e-2, row


def test_a_subclass_loading_its_own_data_trains_on_the_harness_window(replayed):
    """Its data loading (a DistributedSampler, which wants a process group) and its optimizer
    (parameter groups of a name transformers 5 no longer exports) are the Trainer's own in the
    replay: the window is the harness's, in order, and the gradients are read before the
    optimizer steps. Its stock loss then matches the full batch."""
    loop = replayed["own_loading"]
    assert loop.header.startswith("class ProjectTrainer(") and not loop.flagged, loop
    assert loop.verdict == "verified", loop
    assert all(row["original_error"] < 1e-5 for row in loop.rows), loop


def test_a_step_copied_from_an_older_trainer_runs_with_its_flags_off(replayed):
    """`self.use_apex`, which transformers 5 no longer sets, reads False, and the batch handed
    as `data=inputs` reaches the tiny model as its keywords: the copy's mean over K is
    replayed, a bug on rows of varied length, not the K-fold sum of a step that skipped it."""
    loop = replayed["copied_step"]
    assert loop.header.startswith("class MultimodalTrainer(") and loop.flagged, loop
    for row in loop.rows:
        assert row["original_verdict"] == "bug reproduced", row
        assert 1e-2 < row["original_error"] < 1, row


def test_the_stock_trainer_without_a_pin_matches_the_full_batch(replayed):
    loop = replayed["stock"]
    assert not loop.flagged and loop.pinned == ""
    assert loop.verdict == "verified", loop


@pytest.mark.parametrize("name", ["tagger", "t5"])
def test_a_head_that_drops_the_count_is_replayed_with_a_head_like_it(replayed, name):
    """A token classifier (BERT) and an encoder-decoder (T5) of transformers: the installed
    Trainer weighs their micro-batch means equally (and skips its division where the head
    takes `**kwargs`), as GA004 says."""
    loop = replayed[name]
    assert loop.flagged
    for row in loop.rows:
        assert row["original_verdict"] == "bug reproduced" and row["original_error"] > 1e-2, row


def test_a_head_given_a_loss_over_the_windows_count_matches_the_full_batch(replayed):
    loop = replayed["tagger_count"]
    assert not loop.flagged
    assert loop.verdict == "verified", loop


def test_a_subclass_keeping_the_stock_loss_is_replayed_with_the_projects_options(replayed):
    loop = replayed["options"]  # `self.args.use_lora`, `.head_lr`: the project's defaults
    assert loop.header == "class HeadTrainer(Trainer):" and not loop.flagged
    assert loop.verdict == "verified", loop


def test_a_reward_trainer_gets_batches_of_the_chosen_and_rejected_keys_it_reads(replayed):
    loop = replayed["reward"]  # one term per pair, no labels: mean/K is exact on equal pairs
    assert loop.header == "class RewardTrainer(Trainer):", loop
    assert loop.verdict == "verified", loop


def test_under_the_pin_rows_of_a_dataset_beside_that_count_every_position_are_exact(replayed):
    loop = replayed["own_labels"]  # as GA006 reads the dataset the Trainer is given
    assert loop.fixed_length.startswith("`SummaryDataset` pads each row to `max_length`"), loop
    assert loop.fixed_length.endswith("summary_dataset.py line 9"), loop.fixed_length
    assert all(row["original_verdict"] == "verified" for row in loop.rows), loop
    assert loop.verdict == "verified"


def test_a_pin_in_a_requirements_file_above_the_script_counts(replayed):
    loop = replayed["requirements"]
    assert loop.pinned.startswith("`transformers>=4.30,<4.40` (/"), loop.pinned
    assert loop.pinned.endswith("/requirements/requirements.txt line 2)"), loop.pinned
    assert all(row["original_verdict"] == "bug reproduced" for row in loop.rows), loop
    assert loop.verdict != "verified"


def test_under_the_pin_fixed_length_blocks_are_exact(replayed):
    loop = replayed["packed"]
    assert loop.fixed_length == "`group_texts`, line 6" and loop.pinned
    assert all(row["original_verdict"] == "verified" for row in loop.rows), loop
    assert loop.verdict == "verified"


def test_a_trainer_given_a_model_of_the_project_is_not_replayed(replayed):
    rows = replayed["own_model"].rows
    assert all("`RewardModel(...)` (line 5), a model of the project" in r["verdict"] for r in rows)
    assert all(r["verdict"].startswith("not replayable: ") for r in rows)


REWARD = """\
import torch
from torch import nn


class RewardModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, features, labels=None):
        scores = self.head(features).squeeze(-1)
        return {"loss": nn.functional.mse_loss(scores, labels), "scores": scores}


def build():
    return RewardModel()


def rows(sizes):
    return [{"features": torch.randn(n, 4), "labels": torch.randn(n)} for n in sizes]


def equal(k):
    return rows([3] * k)


def unequal(k):
    return rows([1 + 2 * i for i in range(k)])
"""


def test_factories_replay_a_trainer_of_the_projects_own_model(tmp_path):
    """A per-example mean divided by K (the Trainer's, for a model that takes no token count)
    is exact on micro-batches of one size and wrong on micro-batches of different sizes."""
    (tmp_path / "train.py").write_text(REWARD_SCRIPT)
    (tmp_path / "reward.py").write_text(REWARD)
    factories = ["--model-factory", "reward:build", "train.py", "--format", "json"]
    for data, code, verdict in (("equal", 0, "verified"), ("unequal", 1, "bug reproduced")):
        result = gaaudit(
            "verify", "-k", "4", *factories, "--data-factory", f"reward:{data}", cwd=tmp_path
        )
        assert result.returncode == code, result.stdout + result.stderr
        ((row,),) = [loop["rows"] for loop in json.loads(result.stdout)["loops"]]
        assert row["original_verdict"] == verdict, row


def headers(path) -> list[str]:
    """The headers of the loops `verify` replays in a file (which replays they are is static:
    nothing needs to train to tell)."""
    source = path.read_bytes()
    return [target.header for target in targets(source, source, path=path)]


def test_lightnings_trainer_is_no_transformers_trainer():
    """`L.Trainer(...)` in a file that also imports transformers is not replayed as one."""
    for name in ("ok_lightning_window_token_sum", "ga003_lightning_accumulate_grad_batches"):
        found = headers(FIXTURES / f"{name}.py")
        assert found and not [header for header in found if "Trainer(" in header], found


def test_a_trainer_class_bound_to_a_name_first_is_replayed(replayed):
    """`FinetuningTrainer = Trainer` then `FinetuningTrainer(...)`, as LMFlow builds it."""
    loop = replayed["bound"]
    assert loop.verdict == "verified" and loop.header.startswith("trainer = FinetuningTrainer(")


def test_a_trainer_class_of_the_project_is_replayed_only_when_it_is_a_transformers_one(tmp_path):
    """`from trainers import SFTTrainer`: a transformers Trainer subclass there is replayed;
    a project's own `SFTTrainer(nn.Module)` (lucidrains' shape) is not."""
    script = SCRIPT.format(data="").replace(
        "trainer = Trainer(", "from trainers import SFTTrainer\ntrainer = SFTTrainer("
    )
    (tmp_path / "train.py").write_text(script)
    for base, is_replayed in (("Trainer", True), ("nn.Module", False)):
        (tmp_path / "trainers.py").write_text(
            "from torch import nn\nfrom transformers import Trainer\n\n\n"
            f"class SFTTrainer({base}):\n    pass\n"
        )
        assert bool(headers(tmp_path / "train.py")) == is_replayed


def test_under_the_pin_a_pairwise_loss_over_the_padded_width_is_exact(replayed):
    """Every micro-batch is padded to the window's width, as the full batch is, so a loss that
    averages over every position of its pairs (here the tiny model's logits) holds as many
    elements in each: under a pin before 4.46, mean/K is exact, as for a reward model."""
    loop = replayed["pairs"]
    assert loop.pinned, loop
    assert [row["original_verdict"] for row in loop.rows] == ["verified"] * 2, loop


def test_a_trainer_takes_helpers_from_modules_of_its_package(tmp_path):
    """Modules of the package that cannot be imported here (a relative import, a package
    under `src/`, one that needs an older transformers) are defined as the trainer's own
    file is: their functions run. One sequence score per row, as many rows in every
    micro-batch: the old Trainer's mean/K is exact."""
    for relative, text in {"pyproject.toml": "[project]\nname = 'ranking'\n", **PACKAGE}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    script = "src/ranking/trainers/ranked.py"
    result = gaaudit(
        "verify", script, "-k", "2", "--device", "cpu", "--format", "json", cwd=tmp_path
    )
    assert "Traceback" not in result.stderr, result.stderr
    (loop,) = json.loads(result.stdout)["loops"]
    (row,) = loop["rows"]
    assert row["original_verdict"] == "verified" and row["original_error"] < 1e-5, row
