"""`gaaudit verify` on a script that builds a transformers Trainer: its accumulation is the
Trainer's, replayed by a real Trainer on a tiny GPT-2; under a transformers pin before 4.46
(GA006) as those releases train, each micro-batch's mean divided by K, and as the installed
release trains."""

from __future__ import annotations

import json

import tomllib
from conftest import FIXTURES, ROOT, gaaudit

from gaaudit.commands.verify import targets

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


def verify(path, cwd) -> tuple[int, list[dict]]:
    result = gaaudit("verify", "-k", "2,4", "--format", "json", str(path), cwd=cwd)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)["loops"]


def test_a_pin_before_4_46_is_replayed_as_it_trains_and_as_the_installed_release(tmp_path):
    (tmp_path / "train.py").write_text(GA006["bad"])
    code, (loop,) = verify("train.py", tmp_path)
    assert code == 1
    assert loop["header"].startswith("Trainer(model=model") and loop["flagged"]
    assert loop["pinned"] == "`transformers==4.45.2` (train.py line 6)"
    for row in loop["rows"]:
        assert row["original_verdict"] == "bug reproduced" and row["original_error"] > 1e-2
        assert row["installed_error"] < 1e-5, row
        assert row["verdict"].endswith(": verified: require transformers>=4.46.2"), row
    errors = [row["original_error"] for row in loop["rows"]]
    assert errors[1] > errors[0]  # more micro-batches, more unequal weights

    table = gaaudit("verify", "-k", "2", "train.py", cwd=tmp_path).stdout
    assert "replayed as transformers before 4.46 trains, which `transformers==4.45.2`" in table


def test_the_stock_trainer_without_a_pin_matches_the_full_batch(tmp_path):
    (tmp_path / "train.py").write_text(GA006["good"])
    code, (loop,) = verify("train.py", tmp_path)
    assert code == 0 and not loop["flagged"] and loop["pinned"] == ""
    assert all(row["verdict"] == "verified" for row in loop["rows"]), loop


def test_a_pin_in_a_requirements_file_above_the_script_counts(tmp_path):
    (tmp_path / "requirements.txt").write_text("torch\ntransformers>=4.30,<4.40\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "sft.py").write_text(SCRIPT.format(data=""))
    code, (loop,) = verify("scripts/sft.py", tmp_path)
    assert code == 1
    assert loop["pinned"] == "`transformers>=4.30,<4.40` (requirements.txt line 2)"
    assert all(row["original_verdict"] == "bug reproduced" for row in loop["rows"]), loop


def test_under_the_pin_fixed_length_blocks_are_exact(tmp_path):
    (tmp_path / "requirements.txt").write_text("transformers==4.38.2\n")
    (tmp_path / "train.py").write_text(SCRIPT.format(data=PACKED))
    code, (loop,) = verify("train.py", tmp_path)
    assert code == 0, loop
    assert loop["fixed_length"] == "`group_texts`, line 6" and loop["pinned"]
    assert all(row["original_verdict"] == "verified" for row in loop["rows"]), loop


def test_a_trainer_given_a_model_of_the_project_is_not_replayed(tmp_path):
    script = SCRIPT.format(data="").replace(
        'AutoModelForCausalLM.from_pretrained("gpt2")', "RewardModel()"
    )
    (tmp_path / "train.py").write_text("from reward import RewardModel\n" + script)
    code, (loop,) = verify("train.py", tmp_path)
    assert code == 2
    assert all(
        "`RewardModel(...)` (line 5), a model of the project" in r["verdict"] for r in loop["rows"]
    )


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
    script = SCRIPT.format(data="").replace(
        'AutoModelForCausalLM.from_pretrained("gpt2")', "RewardModel()"
    )
    (tmp_path / "train.py").write_text("from reward import RewardModel\n" + script)
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


def test_a_trainer_class_bound_to_a_name_first_is_replayed(tmp_path):
    """`FinetuningTrainer = Trainer` then `FinetuningTrainer(...)`, as LMFlow builds it."""
    script = SCRIPT.format(data="").replace(
        "trainer = Trainer(", "FinetuningTrainer = Trainer\ntrainer = FinetuningTrainer("
    )
    (tmp_path / "train.py").write_text(script)
    code, (loop,) = verify("train.py", tmp_path)
    assert code == 0 and loop["header"].startswith("trainer = FinetuningTrainer("), loop


def test_a_trainer_class_of_the_project_is_replayed_only_when_it_is_a_transformers_one(tmp_path):
    """`from trainers import SFTTrainer`: a transformers Trainer subclass there is replayed;
    a project's own `SFTTrainer(nn.Module)` (lucidrains' shape) is not."""
    script = SCRIPT.format(data="").replace(
        "trainer = Trainer(", "from trainers import SFTTrainer\ntrainer = SFTTrainer("
    )
    (tmp_path / "train.py").write_text(script)
    for base, replayed in (("Trainer", True), ("nn.Module", False)):
        (tmp_path / "trainers.py").write_text(
            "from torch import nn\nfrom transformers import Trainer\n\n\n"
            f"class SFTTrainer({base}):\n    pass\n"
        )
        assert bool(headers(tmp_path / "train.py")) == replayed


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


def test_under_the_pin_a_pairwise_loss_over_the_padded_width_is_exact(tmp_path):
    """Every micro-batch is padded to the window's width, as the full batch is, so a loss that
    averages over every position of its pairs (here the tiny model's logits) holds as many
    elements in each: under a pin before 4.46, mean/K is exact, as for a reward model."""
    (tmp_path / "requirements.txt").write_text("transformers==4.43.4\n")
    (tmp_path / "rm.py").write_text(PAIRS)
    _, (loop,) = verify("rm.py", tmp_path)
    assert loop["pinned"], loop
    assert [row["original_verdict"] for row in loop["rows"]] == ["verified"] * 2, loop
