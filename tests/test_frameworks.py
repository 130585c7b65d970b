"""GA004 (Trainer overrides), GA005 (JAX/optax) and GA006 (dependency pins) beyond the fixtures."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES
from packaging.specifiers import SpecifierSet

from gaaudit import catalogue
from gaaudit.checks.engine import check_file
from gaaudit.checks.versions import (
    OLD,
    Pin,
    admits,
    bad_pin,
    check_repository,
    pinned_for,
    verdict,
)
from gaaudit.config import Settings
from gaaudit.findings import Confidence

ALL = Settings(min_confidence=Confidence.LOW)
REPOSITORIES = sorted(p for p in FIXTURES.glob("ga006_*") if p.is_dir())


def found(tmp_path: Path, source: str, name: str = "train.py") -> list[tuple[int, str, str]]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    report = check_file(path, ALL)
    assert report.error is None
    return [(f.span.line, f.code, str(f.confidence)) for f in report.findings]


# GA004 -------------------------------------------------------------------------------------

TRAINER = """\
    {imports}

    class CustomTrainer({base}):
        {body}
        def compute_loss(self, model, inputs, return_outputs=False{params}):
            outputs = model(**inputs{passed})
            loss = outputs.loss
            return (loss, outputs) if return_outputs else loss
    """


def trainer(
    imports="from transformers import Trainer",
    base="Trainer",
    body="pass",
    params=", num_items_in_batch=None",
    passed="",
):
    return TRAINER.format(imports=imports, base=base, body=body, params=params, passed=passed)


@pytest.mark.parametrize(
    "source, expected",
    [
        (trainer(), [(5, "GA004", "low")]),
        (trainer(imports="import transformers as hf", base="hf.Trainer"), [(5, "GA004", "low")]),
        (
            trainer(imports="from trl import SFTTrainer as Base", base="Base"),
            [(5, "GA004", "medium")],
        ),
        (trainer(params=", **kwargs"), [(5, "GA004", "low")]),
        (trainer(params=""), [(5, "GA004", "low")]),
        (trainer(params=", **kwargs", passed=", **kwargs"), []),
        (trainer(passed=", num_items_in_batch=num_items_in_batch"), []),
        (trainer(body="model_accepts_loss_kwargs = False"), [(5, "GA004", "low")]),
        (trainer(body="loss_is_scaled_for_ga = False"), []),
        (trainer(imports="from mylib.engine import Trainer"), []),
        (
            trainer(imports="from transformers import AutoModelForCausalLM, Trainer"),
            [(5, "GA004", "medium")],
        ),
        (
            trainer(imports="from transformers import DataCollatorForSeq2Seq, Trainer"),
            [(5, "GA004", "high")],
        ),
    ],
    ids=[
        "ignored",
        "module-alias",
        "trl-alias",
        "kwargs-ignored",
        "old-signature",
        "kwargs-passed",
        "count-passed",
        "class-attribute-overwritten",
        "scaled-for-ga-false",
        "not-transformers",
        "a-causal-lm-shows-tokens",
        "a-padding-collator-shows-varying-counts",
    ],
)
def test_compute_loss_overrides(tmp_path, source, expected):
    assert found(tmp_path, source) == expected


def test_subclass_of_a_same_file_trainer_and_inherited_opt_out(tmp_path):
    source = """\
        from transformers import Seq2SeqTrainer

        class Base(Seq2SeqTrainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.model_accepts_loss_kwargs = False

        class Child(Base):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss

        class Plain(Seq2SeqTrainer):
            pass

        class Grandchild(Plain):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs)["loss"]
        """
    assert found(tmp_path, source) == [(16, "GA004", "low")]


def test_training_step_divisions(tmp_path):
    source = """\
        from transformers import Trainer

        class StepTrainer(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                if num_items_in_batch is None:
                    loss = loss / self.args.gradient_accumulation_steps
                scaled = loss / self.args.gradient_accumulation_steps
                self.accelerator.backward(scaled)
                return loss.detach() / self.args.gradient_accumulation_steps
        """
    ga004 = [row for row in found(tmp_path, source) if row[1] == "GA004"]
    assert ga004 == [(8, "GA004", "low")]


def test_model_passed_to_trainer_through_a_name(tmp_path):
    source = """\
        import torch.nn.functional as F
        from torch import nn
        from transformers import Trainer

        class Head(nn.Module):
            def forward(self, features, labels=None):
                logits = self.proj(features)
                return F.cross_entropy(logits, labels), logits

        class Unused(nn.Module):
            def forward(self, features, labels=None):
                return F.cross_entropy(self.proj(features), labels)

        def main(args):
            model = Head().to("cuda")
            Trainer(model=model, args=args).train()
        """
    assert found(tmp_path, source) == [(6, "GA004", "low")]


@pytest.mark.parametrize(
    "mask, confidence",
    [('inputs["attention_mask"]', "high"), ('torch.ones_like(inputs["input_ids"])', "low")],
)
def test_a_mask_of_ones_handed_to_the_model_shows_no_varying_count(tmp_path, mask, confidence):
    """minimal-llama's `compute_loss`: labels are the input ids and the mask is all ones, so
    nothing in the file says the count varies (its data is packed elsewhere)."""
    source = f"""\
        import torch
        from transformers import Trainer


        class ModifiedTrainer(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False):
                out = model(
                    input_ids=inputs["input_ids"],
                    attention_mask={mask},
                    labels=inputs["input_ids"],
                )
                return (out.loss, out) if return_outputs else out.loss
        """
    assert found(tmp_path, source) == [(6, "GA004", confidence)]


HEAD_SCRIPT = """\
    import peft
    import trl
    from transformers import {head}, Trainer, TrainingArguments

    model = {head}.from_pretrained("checkpoint"){wrapped}
    args = TrainingArguments("out", gradient_accumulation_steps={k})
    {trainer}(model=model.to("cuda"), args=args{given}).train()
    """


@pytest.mark.parametrize(
    "head, pin, changes, expected",
    [
        # a token head ignores the count in every release: mean/K (4.x) or K means summed (5.x)
        ("AutoModelForTokenClassification", "", {}, [(7, "GA004", "medium")]),
        ("BertForTokenClassification", "transformers==4.48.0", {}, [(7, "GA004", "medium")]),
        ("T5ForConditionalGeneration", "", {"wrapped": ".to('cuda')"}, [(7, "GA004", "medium")]),
        (
            "BertForMaskedLM",
            "",
            {"wrapped": "\n    model = peft.get_peft_model(model, config)"},
            [(8, "GA004", "medium")],
        ),
        ("AutoModelForCausalLM", "", {}, []),  # causal LMs hand the count to their loss
        ("ModernBertForMaskedLM", "", {}, []),  # and a few masked LMs too
        ("AutoModelForTokenClassification", "", {"k": 1}, []),  # one micro-batch per step
        ("AutoModelForTokenClassification", "", {"given": ", compute_loss_func=f"}, []),
        ("AutoModelForTokenClassification", "", {"trainer": "trl.RewardTrainer"}, []),
        # one label per example: exact under 4.x, K times too large where 5.x may be installed
        ("AutoModelForSequenceClassification", "", {}, [(7, "GA004", "medium")]),
        ("BertForMultipleChoice", "transformers>=4.40", {}, [(7, "GA004", "medium")]),
        ("AutoModelForSequenceClassification", "transformers==4.48.0", {}, []),
        ("AutoModelForSequenceClassification", "transformers<5", {}, []),
        (
            "AutoModelForSequenceClassification",
            "",
            {"wrapped": "\n    model.accepts_loss_kwargs = False"},
            [],
        ),
    ],
)
def test_stock_heads_handed_to_a_trainer(tmp_path, head, pin, changes, expected):
    """GA004 on a transformers head whose loss ignores `num_items_in_batch`, read through
    `.to(device)`, peft's wrapper and the project's transformers requirement."""
    if pin:
        (tmp_path / "requirements.txt").write_text(f"torch\n{pin}\n")
    (tmp_path / ".git").mkdir()  # the project's root: no requirement above it is read
    fields = {"head": head, "wrapped": "", "k": 4, "given": "", "trainer": "Trainer", **changes}
    assert found(tmp_path, HEAD_SCRIPT.format(**fields)) == expected


def test_ga004_finding_explains_itself(tmp_path):
    path = FIXTURES / "ga004_weighted_classification_compute_loss.py"
    (finding,) = check_file(path, ALL).findings
    assert "num_items_in_batch" in finding.message and "K times" in finding.message
    assert any("WeightedLossTrainer" in e for e in finding.evidence)
    assert any("CrossEntropyLoss" in e for e in finding.evidence)
    assert finding.hint == catalogue.load()["GA004"].hint and finding.fixable


def test_opt_out_counts_on_the_instance_after_the_base_init(tmp_path):
    """`Trainer.__init__` assigns `model_accepts_loss_kwargs` from the model's signature: only
    an assignment after `super().__init__()` (or in another method) opts out."""
    source = """\
        from transformers import Trainer

        class After(Trainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.model_accepts_loss_kwargs = False

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss

        class Before(Trainer):
            def __init__(self, *args, **kwargs):
                self.model_accepts_loss_kwargs = False
                super().__init__(*args, **kwargs)

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss

        class Attribute(Trainer):
            model_accepts_loss_kwargs = False

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss

            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                self.accelerator.backward(loss / self.args.gradient_accumulation_steps)
                return loss.detach()
        """
    rows = [row for row in found(tmp_path, source) if row[1] == "GA004"]
    assert rows == [(16, "GA004", "low"), (22, "GA004", "low"), (27, "GA004", "low")]
    path = tmp_path / "train.py"
    finding = next(f for f in check_file(path, ALL).findings if f.span.line == 22)
    assert any("line 20 is a class attribute" in e and "overwrites" in e for e in finding.evidence)


def test_model_opted_out_by_its_class_and_divisions_of_an_opted_out_trainer(tmp_path):
    source = """\
        import torch.nn.functional as F
        from torch import nn
        from transformers import Trainer

        class Head(nn.Module):
            accepts_loss_kwargs = False

            def forward(self, features, labels=None, **kwargs):
                return F.cross_entropy(self.proj(features), labels), features

        class Fallback(Trainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.model_accepts_loss_kwargs = False

            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = self.compute_loss(model, inputs)
                self.accelerator.backward(loss / self.args.gradient_accumulation_steps)
                return loss.detach()

        def main(args):
            Fallback(model=Head(), args=args).train()
        """
    assert [row for row in found(tmp_path, source) if row[1] == "GA004"] == []


# GA005 -------------------------------------------------------------------------------------

OPTAX = """\
    import jax
    import jax.numpy as jnp
    {imports}

    def loss_fn(params, batch):
        losses = per_token(params, batch)
        return {loss}

    def make(k):
        return {call}

    def step(params, state, batch, tx):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return tx.update(grads, state, params)
    """


def optax_source(
    imports="import optax",
    loss="losses.mean()",
    call="optax.MultiSteps(optax.adam(1e-3), every_k_schedule=k)",
):
    return OPTAX.format(imports=imports, loss=loss, call=call)


@pytest.mark.parametrize(
    "source, expected",
    [
        (optax_source(), [(10, "GA005", "medium")]),
        (
            optax_source(imports="import optax as ox", call="ox.MultiSteps(ox.sgd(0.1), k)"),
            [(10, "GA005", "medium")],
        ),
        (
            optax_source(
                imports="from optax import MultiSteps, adam", call="MultiSteps(adam(1e-3), k)"
            ),
            [(10, "GA005", "medium")],
        ),
        (
            optax_source(
                imports="from optax import MultiSteps as Accumulate, adam\n    tx = Accumulate(adam(1e-3), 4)"
            ),
            [(4, "GA005", "medium"), (11, "GA005", "medium")],
        ),
        (
            optax_source(loss='jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])'),
            [(10, "GA005", "high")],
        ),
        (optax_source(loss="jnp.mean(losses, where=batch['valid'])"), [(10, "GA005", "high")]),
        (optax_source(loss="undefined_reduce(losses)"), [(10, "GA005", "low")]),
        (  # no mask: as many elements in every micro-batch of one shape
            optax_source(loss="optax.l2_loss(params(batch['x']), batch['y']).mean()"),
            [(10, "GA005", "low")],
        ),
        (
            optax_source(
                call="optax.MultiSteps(optax.adam(1e-3), every_k_schedule=k, use_grad_mean=False)"
            ),
            [(10, "GA005", "medium")],  # K micro-gradients of means summed: K times too large
        ),
        (
            optax_source(call="optax.MultiSteps(optax.adam(1e-3), k, False)"),
            [(10, "GA005", "medium")],
        ),
        (optax_source(call="optax.MultiSteps(optax.adam(1e-3), every_k_schedule=1)"), []),
        (optax_source(loss="jnp.sum(losses)"), []),
        (optax_source(loss='jnp.sum(losses * batch["mask"]) / batch["window_tokens"]'), []),
    ],
    ids=[
        "default",
        "module-alias",
        "from-import",
        "renamed",
        "masked-mean",
        "where-mean",
        "unknown-loss",
        "elementwise-mean",
        "grad-sum",
        "grad-sum-positional",
        "k-is-1",
        "sum-loss",
        "window-count",
    ],
)
def test_multisteps(tmp_path, source, expected):
    assert found(tmp_path, source) == expected


@pytest.mark.parametrize(
    "accumulator, expected",
    [
        ("", [(8, "GA005", "medium")]),  # SUM, its default: K times too large
        (", accumulator=microbatching.AccumulationType.MEAN", [(8, "GA005", "medium")]),
        (", accumulator=microbatching.AccumulationType.CONCAT", []),
    ],
    ids=["sum", "mean", "concat"],
)
def test_optax_microbatch_over_mean_losses(tmp_path, accumulator, expected):
    source = f"""\
        import jax
        from optax import microbatching

        def loss_fn(params, batch):
            return per_token(params, batch).mean()

        def grads(params, batch):
            return microbatching.microbatch(
                jax.grad(loss_fn), argnums=1, microbatch_size=8{accumulator}
            )(params, batch)
        """
    assert found(tmp_path, source) == expected


def test_hand_written_averages_need_a_step_count_divisor(tmp_path):
    source = """\
        import jax
        import jax.tree_util as jtu

        grad_accum_steps = 4

        def loss_fn(params, batch):
            return model_loss(params, batch).mean()

        def window(params, micro_batches, norm):
            grads = None
            for batch in micro_batches:
                _, g = jax.value_and_grad(loss_fn)(params, batch)
                grads = g if grads is None else jtu.tree_map(lambda a, b: a + b, grads, g)
            k = grad_accum_steps
            clipped = jtu.tree_map(lambda g: g / norm, grads)
            averaged = jtu.tree_map(lambda g: g / k, grads)
            by_count = jax.tree.map(lambda g: g / len(micro_batches), grads)
            return clipped, averaged, by_count
        """
    assert found(tmp_path, source) == [(16, "GA005", "medium"), (17, "GA005", "medium")]


def test_seed_003_fires_with_fixed_length_evidence():
    (finding,) = check_file(FIXTURES / "ga005_seed_multisteps_layerwise_adamw.py", ALL).findings
    assert finding.code == "GA005" and finding.confidence is Confidence.LOW
    assert any("memmap" in e for e in finding.evidence)
    assert any("softmax_cross_entropy_with_integer_labels" in e for e in finding.evidence)


# GA006 -------------------------------------------------------------------------------------


def expected_rows(folder: Path) -> list[tuple[str, int, str]]:
    rows = []
    for line in (folder / "expected.txt").read_text().splitlines():
        if line.strip():
            file, number, code = line.split()
            rows.append((file, int(number), code))
    return rows


def repository_rows(folder: Path, reports) -> list[tuple[str, int, str]]:
    return [
        (Path(r.path).resolve().relative_to(folder.resolve()).as_posix(), f.span.line, f.code)
        for r in reports
        for f in r.findings
    ]


@pytest.mark.parametrize("folder", REPOSITORIES, ids=lambda p: p.name)
def test_repository_fixtures_are_exact(folder):
    files = sorted(p for p in folder.rglob("*.py"))
    pins = [row for row in expected_rows(folder) if row[2] == "GA006"]
    assert repository_rows(folder, check_repository(files, [folder])) == pins


def test_repository_fixtures_are_varied():
    buggy = [f for f in REPOSITORIES if expected_rows(f)]
    assert len(buggy) >= 5 and len(REPOSITORIES) - len(buggy) >= 3
    pin_files = {Path(file).name for f in buggy for file, _, _ in expected_rows(f)}
    assert {
        "requirements.txt",
        "pyproject.toml",
        "setup.cfg",
        "setup.py",
        "environment.yml",
    } <= pin_files


def test_repository_python_files_have_only_their_listed_per_file_findings():
    """The scripts beside the pins: what they train is right for the Trainer the pin should
    admit, but where they hand it a transformers head that drops the window's count (Whisper,
    a token classifier: GA004), which a newer release does not mend."""
    for folder in REPOSITORIES:
        listed = [row for row in expected_rows(folder) if row[2] != "GA006"]
        found = [
            (script.relative_to(folder).as_posix(), f.span.line, f.code)
            for script in sorted(folder.rglob("*.py"))
            for f in check_file(script, ALL).findings
        ]
        assert found == listed, folder


@pytest.mark.parametrize(
    "specifier, expected",
    [
        ("==4.45.2", "old"),
        ("<4.46", "old"),
        ("<=4.45", "old"),
        ("~=4.40.0", "old"),
        (">=4.30,<4.46", "old"),
        ("<3", "old"),
        ("==4.46.0", "early"),
        ("==4.46.1", "early"),
        ("<4.46.2", "early"),
        (">=4.46.2", None),
        ("~=4.40", None),
        (">=4.40", None),
        ("==4.46.*", None),
        ("!=4.46.2,<4.47", None),
        ("==5.0.0", None),
        (">=4.46.2,<4.46.2", None),
        # the releases whose Trainer hands a model that takes loss kwargs no count
        ("==4.48.0", "regressed"),
        ("==4.47.0", "regressed"),
        ("==4.47.1", None),
        (">=4.48.0,<4.48.1", "regressed"),
        (">=4.47,<4.48", None),
    ],
)
def test_verdict(specifier, expected):
    assert verdict(SpecifierSet(specifier)) == expected


@pytest.mark.parametrize(
    "requirement, expected",
    [
        ("transformers @ git+https://github.com/huggingface/transformers@v4.28.1", "old"),
        ("transformers @ git+https://github.com/huggingface/transformers.git@v4.46.0", "early"),
        ("transformers @ git+https://github.com/huggingface/transformers.git@v4.47.1", None),
        ("transformers @ git+https://github.com/huggingface/transformers@0dcb46e7a4a9e5", "commit"),
        ("transformers @ git+https://github.com/huggingface/transformers.git", None),
        ("transformers @ git+https://github.com/someone/transformers.git@0dcb46e7", None),
        ("peft @ git+https://github.com/huggingface/transformers@0dcb46e7", None),
    ],
)
def test_git_pins(requirement, expected):
    """A git tag of transformers is that release; a commit cannot be dated offline; the default
    branch, a fork or another package is no pin of transformers' releases."""
    assert bad_pin(Pin(1, 1, requirement, requirement, requirement)) == expected


def write(root: Path, files: dict[str, str]) -> list[Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return sorted(root.rglob("*.py"))


def test_pin_reported_with_column_evidence_and_suppression(tmp_path):
    files = write(
        tmp_path,
        {
            "requirements.txt": "torch\n  transformers==4.45.2\ntransformers<4.46  # noqa: GA006\n",
            "train.py": "from transformers import TrainingArguments\nargs = TrainingArguments('o', gradient_accumulation_steps=4)\n",
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert (finding.span.line, finding.span.column, finding.span.end_column) == (2, 3, 23)
    assert finding.confidence is Confidence.HIGH and "transformers>=4.46.2" in finding.message
    assert any("train.py line 2" in e for e in finding.evidence)
    assert finding.hint == catalogue.load()["GA006"].hint


def test_a_pin_to_the_first_releases_with_the_count_is_medium_beside_a_trainer(tmp_path):
    """transformers 4.46.0/4.46.1 over-scale only the models that drop the count, and most
    decoders of those releases take it (s1's Qwen2): a Trainer seen keeps the pin medium,
    where an older release's is high."""
    trainer = "from transformers import Trainer, TrainingArguments\n"
    trainer += "Trainer(model, TrainingArguments('o', gradient_accumulation_steps=4))\n"
    for pin, expected in (("4.46.1", Confidence.MEDIUM), ("4.45.2", Confidence.HIGH)):
        root = tmp_path / pin
        files = write(root, {"requirements.txt": f"transformers=={pin}\n", "train.py": trainer})
        (report,) = check_repository(files, [root])
        (finding,) = report.findings
        assert finding.confidence is expected, finding.evidence
        unseen = "which models the code trains is not visible" in finding.evidence[-1]
        assert unseen is (expected is Confidence.MEDIUM), finding.evidence


def test_singular_requirement_file_names_the_trainer_it_concerns(tmp_path):
    files = write(
        tmp_path,
        {
            "requirement.txt": "transformers==4.36.2\n",
            "scripts/train.sh": "python src/train.py --gradient_accumulation_steps 32\n",
            "src/train.py": """\
                from transformers import Trainer


                class LoggingTrainer(Trainer):  # a subclass is not where it is built
                    pass


                trainer = LoggingTrainer(model=None)
            """,
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert Path(report.path).name == "requirement.txt"
    (site,) = [e for e in finding.evidence if e.startswith("trainer: ")]
    assert site.startswith("trainer: `LoggingTrainer(...)` in ")
    assert site.endswith("src/train.py line 8")


def test_lightnings_trainer_is_not_a_transformers_trainer_for_a_pin(tmp_path):
    """A Lightning script in a project that pins transformers: `L.Trainer(...)` is not the
    transformers Trainer whose division the pin keeps."""
    files = write(
        tmp_path,
        {
            "requirements.txt": "transformers==4.36.2\n",
            "configs/train.yaml": "gradient_accumulation_steps: 8\n",
            "train.py": """\
                import lightning as L
                from transformers import AutoModelForCausalLM

                trainer = L.Trainer(accumulate_grad_batches=8)
            """,
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert not [e for e in finding.evidence if e.startswith("trainer: ")], finding.evidence
    assert finding.confidence is Confidence.MEDIUM


def test_a_projects_own_trainer_class_is_not_a_transformers_trainer_for_a_pin(tmp_path):
    """A `SuperviseTrainer` of the project's own (a DeepSpeed loop) in a file that imports
    transformers is not the transformers Trainer whose division the pin keeps; a class of
    another module that subclasses one, whatever its name, is; Lightning's `Trainer`, in a
    file that names no transformers, is not, though another file imports transformers'."""
    project = {
        "requirements.txt": "transformers==4.40.0\n",
        "configs/train.yaml": "gradient_accumulation_steps: 8\n",
        "trainers/sft.py": """\
            from transformers import AutoModelForCausalLM


            class SuperviseTrainer:
                def __init__(self, cfgs):
                    self.model = AutoModelForCausalLM.from_pretrained(cfgs.model)


            trainer = SuperviseTrainer(cfgs)
        """,
    }
    (report,) = check_repository(write(tmp_path / "own", project), [tmp_path / "own"])
    (finding,) = report.findings
    assert not [e for e in finding.evidence if e.startswith("trainer: ")], finding.evidence
    assert finding.confidence is Confidence.MEDIUM
    project["trainers/hf.py"] = (
        "import transformers as tf\nfrom transformers import Trainer\n\n\n"
        "class LoggedTrainer(tf.Trainer):\n    pass\n"
    )
    project["trainers/base.py"] = (
        "from trainers.hf import LoggedTrainer\n\n\nclass TrainerNoShuffle(\n    LoggedTrainer,\n):\n    pass\n"
    )
    project["quiet.py"] = (
        "from transformers import AutoModel\nfrom trainers.base import TrainerNoShuffle\n\nTrainerNoShuffle()\n"
    )
    project["lit.py"] = "from pytorch_lightning import Trainer\n\nTrainer(max_epochs=1)\n"
    (report,) = check_repository(write(tmp_path / "sub", project), [tmp_path / "sub"])
    (finding,) = report.findings
    named = [e for e in finding.evidence if e.startswith("trainer: ")]
    assert [e.split("`")[1] for e in named] == ["TrainerNoShuffle(...)"], named
    assert finding.confidence is Confidence.HIGH


@pytest.mark.parametrize(
    "data, expected",
    [
        ("blocks = dataset.map(group_texts)  # block_size tokens each", Confidence.LOW),
        ("labels[prompt] = -100\nblocks = dataset.map(group_texts)", Confidence.HIGH),
    ],
)
def test_pin_confidence_reads_the_trainers_data(tmp_path, data, expected):
    files = write(
        tmp_path,
        {
            "requirements.txt": "transformers==4.40.0\n",
            "train.py": f"from transformers import Trainer, TrainingArguments\n{data}\n"
            "Trainer(args=TrainingArguments('o', gradient_accumulation_steps=8))\n",
        },
    )
    (report,) = check_repository(files, [tmp_path])
    assert report.findings[0].confidence is expected


@pytest.mark.parametrize(
    "pin, sites, confidence",
    [
        ("transformers==4.30.0", ("sft.py",), "HIGH"),
        ("transformers==4.48.0", ("pt.py", "sft.py"), "HIGH"),
    ],
)
def test_a_trainer_over_fixed_length_blocks_is_not_named_beside_one_at_risk(
    tmp_path, pin, sites, confidence
):
    """Pre-training over packed blocks (exact under the old Trainer) beside prompt-masked SFT:
    the pin is reported for the SFT script's Trainer alone; a pin to 4.48.0, whose Trainer sums
    K means whatever the counts, names both."""
    trainer = "Trainer(args=TrainingArguments('o', gradient_accumulation_steps=8))\n"
    files = write(
        tmp_path,
        {
            "requirements.txt": f"{pin}\n",
            "pt.py": "from transformers import Trainer, TrainingArguments\n"
            f"blocks = dataset.map(group_texts)  # block_size tokens each\n{trainer}",
            "sft.py": "from transformers import Trainer, TrainingArguments\n"
            f"labels[prompt] = -100\n{trainer}",
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    named = [e for e in finding.evidence if e.startswith("trainer: ")]
    assert [Path(e.split(" in ")[1].split()[0]).name for e in named] == list(sites), named
    accumulation = next(e for e in finding.evidence if e.startswith("accumulation: "))
    assert accumulation.endswith("sft.py line 3"), accumulation
    assert finding.confidence is Confidence[confidence]


REWARD_TRAINER = """\
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments


class RewardTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        rewards = model(input_ids=inputs["input_ids"])[0]
        {loss}


{built}(args=TrainingArguments("o", gradient_accumulation_steps=8)).train()
"""


@pytest.mark.parametrize(
    "loss, built, expected",
    [
        ("return -F.logsigmoid(rewards[::2] - rewards[1::2]).mean()", "RewardTrainer", "LOW"),
        ("return rewards.mean()", "RewardTrainer", "HIGH"),  # not a pair's loss
        ("return -F.logsigmoid(rewards[::2] - rewards[1::2]).mean()", "Trainer", "HIGH"),
    ],
    ids=["pairs", "no-pairs", "stock-trainer-built"],
)
def test_a_trainer_that_scores_preference_pairs_makes_the_pin_exact(
    tmp_path, loss, built, expected
):
    """A reward model's Trainer has one loss element per pair: with equal micro-batch sizes
    the old Trainer's mean/K is exact, so the pin is low where every Trainer built is one."""
    source = REWARD_TRAINER.format(loss=loss, built=built)
    files = write(tmp_path, {"requirements.txt": "transformers==4.43.4\n", "rm.py": source})
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert finding.confidence is Confidence[expected], finding.evidence


BESIDE_SCRIPT = """\
from transformers import {collator}Trainer, TrainingArguments

from {module} import {name}

{bound} = {name}("data.json")
args = TrainingArguments("o", gradient_accumulation_steps=8)
Trainer({given}, args=args{collated}).train()
"""
REWARD_MODEL = """\
import torch.nn.functional as F
from torch import nn


class RewardModel(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        rewards = self.head(self.backbone(input_ids)[0]).squeeze(-1)
        {loss}
"""
PADDED_DATASET = """\
import torch
from torch.utils.data import Dataset


class SummaryDataset(Dataset):
    def __getitem__(self, index):
        encoded = self.tokenizer(self.texts[index], truncation=True, padding="max_length")
        input_ids = torch.tensor(encoded["input_ids"])
        {labels}
        return {{"input_ids": input_ids, "labels": {returned}}}
"""


@pytest.mark.parametrize(
    "module, script, expected",
    [
        (
            REWARD_MODEL.format(loss="return -F.logsigmoid(rewards[0::2] - rewards[1::2]).mean()"),
            {"name": "RewardModel", "bound": "model", "given": "model=model"},
            "LOW",
        ),
        (
            REWARD_MODEL.format(loss="return F.mse_loss(rewards, self.targets)"),
            {"name": "RewardModel", "bound": "model", "given": "model=model"},
            "HIGH",  # not a pair's loss
        ),
        (
            PADDED_DATASET.format(labels="", returned="input_ids"),
            {"name": "SummaryDataset", "bound": "data", "given": "train_dataset=data"},
            "LOW",
        ),
        (
            PADDED_DATASET.format(
                labels="labels = input_ids.masked_fill(input_ids == 0, -100)", returned="labels"
            ),
            {"name": "SummaryDataset", "bound": "data", "given": "train_dataset=data"},
            "HIGH",  # the padding is ignored: counts vary
        ),
        (
            PADDED_DATASET.format(labels="", returned="input_ids"),
            {
                "name": "SummaryDataset",
                "bound": "data",
                "given": "train_dataset=data",
                "collator": "DataCollatorForLanguageModeling, ",
                "collated": ", data_collator=DataCollatorForLanguageModeling(tok, mlm=False)",
            },
            "HIGH",  # the script's collator masks the padding again
        ),
    ],
    ids=["pairs-model", "no-pairs-model", "own-labels", "masked-labels", "masking-collator"],
)
def test_what_the_trainer_is_given_from_a_module_beside_it_can_make_the_pin_exact(
    tmp_path, module, script, expected
):
    """trlx's summarisation scripts: a reward model of the project whose `forward` scores
    pairs, or a dataset that pads every row to `max_length` and returns its ids as labels,
    holds as many loss elements in every micro-batch, so the old Trainer's mean/K is exact."""
    source = BESIDE_SCRIPT.format(
        **{"collator": "", "collated": "", **script, "module": script["name"].lower()}
    )
    files = write(
        tmp_path,
        {
            "requirements.txt": "transformers==4.32.0\n",
            "train.py": source,
            f"{script['name'].lower()}.py": module,
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert finding.confidence is Confidence[expected], finding.evidence
    if expected == "LOW":
        assert f"{script['name'].lower()}.py line" in finding.evidence[-1], finding.evidence


@pytest.mark.parametrize(
    "arguments",
    [
        'TrainingArguments("o", gradient_accumulation_steps=cfg.batch // cfg.micro)',
        "Seq2SeqTrainingArguments(**config['training_args'])",
        "HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()[1]",
    ],
    ids=["expression", "mapping", "command-line"],
)
def test_accumulation_steps_set_at_run_time_are_medium(tmp_path, arguments):
    files = write(
        tmp_path,
        {
            "requirements.txt": "transformers==4.35.*\n",
            "train.py": f"""\
                from transformers import Trainer, TrainingArguments

                args = {arguments}
                Trainer(args=args).train()
            """,
        },
    )
    (report,) = check_repository(files, [tmp_path])
    (finding,) = report.findings
    assert finding.confidence is Confidence.MEDIUM
    assert "sets the accumulation steps at run time" in finding.message


@pytest.mark.parametrize(
    "pin, reported",
    [
        ('transformers = "^4.40"', False),
        ('transformers = "~4.45"', True),
        ('transformers = "4.45.2"', True),
        ('transformers = { git = "https://github.com/huggingface/transformers" }', False),
    ],
)
def test_poetry_constraints(tmp_path, pin, reported):
    files = write(
        tmp_path,
        {
            "pyproject.toml": f"[tool.poetry.dependencies]\npython = '^3.10'\n{pin}\n",
            "configs/run.yaml": "gradient_accumulation_steps: 8\n",
        },
    )
    assert bool(check_repository(files, [tmp_path])) is reported


def test_accumulation_must_sit_under_the_pin_file(tmp_path):
    files = write(
        tmp_path,
        {
            "a/requirements.txt": "transformers==4.45.2\n",
            "b/requirements.txt": "transformers==4.45.2\n",
            "b/run.sh": "python train.py --gradient-accumulation-steps=4 --bf16\n",
            "c/run.sh": "# --gradient_accumulation_steps 8 was too slow\npython train.py\n",
        },
    )
    reports = check_repository(files, [tmp_path])
    assert [Path(r.path).parent.name for r in reports] == ["b"]
    assert reports[0].findings[0].confidence is Confidence.MEDIUM


TRAIN = """\
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments("out", gradient_accumulation_steps=8)
    Trainer(model=model, args=args, train_dataset=data).train()
    """


@pytest.mark.parametrize(
    "layout, reported, governed",
    [
        # a `requirements/` folder's files govern the code of the folder above it
        ({"requirements/train.txt": "transformers==4.30.0\n"}, ["requirements/train.txt"], "old"),
        # a subproject that names transformers itself is governed by its own requirement
        (
            {
                "requirements.txt": "transformers==4.30.0\n",
                "sub/pyproject.toml": '[project]\ndependencies = ["transformers>=4.46.2"]\n',
            },
            [],
            None,
        ),
        (
            {
                "requirements.txt": "transformers>=4.46.2\n",
                "sub/requirements.txt": "transformers==4.47.0\n",
            },
            ["sub/requirements.txt"],
            "regressed",
        ),
        # a README's pin counts only where no dependency file names transformers
        ({"README.md": "pip install transformers==4.30.0\n"}, ["README.md"], "old"),
        (
            {"README.md": "pip install transformers==4.30.0\n", "setup.py": "['transformers']"},
            [],
            None,
        ),
    ],
    ids=["requirements-folder", "subproject-fixed", "subproject-regressed", "readme", "setup"],
)
def test_the_nearest_requirement_governs_check_fix_and_verify_alike(
    tmp_path, monkeypatch, layout, reported, governed
):
    """GA006 (which pin files are reported for the code), `pinned_for` (fix's refusals,
    verify's replay) and `admits` (GA004's per-example heads) read the same requirement."""
    monkeypatch.chdir(tmp_path)
    files = write(tmp_path, {**layout, "sub/train.py": TRAIN})
    reports = check_repository(files, [tmp_path])
    assert [Path(r.path).as_posix() for r in reports] == reported  # shown from the cwd
    for report in reports:
        (site,) = [e for e in report.findings[0].evidence if e.startswith("trainer: ")]
        assert "sub/train.py line 3" in site
    pinned = pinned_for(tmp_path / "sub/train.py", tmp_path, (*OLD, "regressed"))
    assert (pinned and pinned[1]) == governed
    if governed is not None:
        assert reported[0] in pinned[0]
    later, shown, _ = admits(tmp_path / "sub/train.py", "5.0.0")
    assert later is (governed is None)
    assert later or reported[0] in shown  # the requirement that rules it out, with where


@pytest.mark.parametrize(
    ("name", "text", "later"),
    [
        ("requirements.txt", "torch==1.13.1\naccelerate\n", True),
        ("requirements.txt", "accelerate<1.9\n", True),  # admits 1.8 itself
        ("requirements.txt", "accelerate<1.8\n", False),
        ("pyproject.toml", '[project]\ndependencies = ["accelerate==0.34.2"]\n', False),
        ("pyproject.toml", '[tool.poetry.dependencies]\naccelerate = "^0.34"\n', False),
        ("environment.yml", "dependencies:\n  - accelerate=0.34\n", False),
        ("pyproject.toml", '[project]\ndependencies = ["accelerate-extra==0.1"]\n', True),
    ],
)
def test_admits_reads_the_requirements_of_any_package(tmp_path, monkeypatch, name, text, later):
    """`admits` reads a package's requirements as GA006 reads transformers' (a fix's
    assumption about an accelerate release rests on them)."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, {name: text, "train.py": TRAIN})
    admitted, shown, _ = admits(tmp_path / "train.py", "1.8", "accelerate")
    assert admitted is later
    assert later or name in shown


def test_inline_script_metadata_is_checked_per_file(tmp_path):
    rule = catalogue.load()["GA006"]
    assert found(tmp_path, rule.bad) == [(6, "GA006", "high")]
    assert found(tmp_path, rule.good) == []
    single_step = rule.bad.replace("gradient_accumulation_steps=8", "gradient_accumulation_steps=1")
    assert found(tmp_path, single_step) == []


# Loops a framework runs around the file's forward step -------------------------------------


@pytest.mark.parametrize(
    ("iterations", "confidence"), [("0", "low"), ("800", "medium"), (None, "medium")]
)
def test_a_run_of_no_training_iterations_is_low(tmp_path, iterations, confidence):
    """SwissArmyTransformer's `training_main` (and Megatron's `pretrain`) also evaluate: a
    file that every launch script of the project runs with `--train-iters 0` trains nothing."""
    if iterations is not None:
        (tmp_path / "evaluate.sh").write_text(
            f"deepspeed evaluate_vlm.py --mode finetune --train-iters {iterations} --strict-eval\n"
        )
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'vlm'\n")
    source = (FIXTURES / "ga003_sat_training_main_ignore_index.py").read_text()
    path = tmp_path / "evaluate_vlm.py"
    path.write_text(source)
    (finding,) = check_file(path, ALL).findings
    assert (finding.span.line, finding.code, str(finding.confidence)) == (39, "GA003", confidence)
    if iterations == "0":
        assert "evaluate.sh (line 1) runs this file with `--train-iters 0`" in finding.evidence[-1]
