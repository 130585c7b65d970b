"""The `ast` screen: what it blanks or answers without libcst never changes a finding.

Each case is checked both ways: the findings of the screened, focused file equal those of
the whole file analysed by libcst (the screen is a superset of the rules), and a case meant
to hold a finding does hold one, so that the comparison means something.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, finding_key, unscreened

from gaaudit import cache
from gaaudit.checks.engine import check_file, check_recorded
from gaaudit.config import Settings
from gaaudit.discover.screen import screen
from gaaudit.discover.source import PROBES, TRIGGERS, Source
from gaaudit.findings import Confidence

SETTINGS = Settings(min_confidence=Confidence.LOW)
HEAD = "import torch.nn.functional as F\n\n"


def findings(path: Path) -> tuple[list, list]:
    """The findings of `gaaudit check` on a file, and those of its whole, unscreened module
    (tests/test_check.py compares them on every fixture)."""
    screened = check_file(path, SETTINGS).findings
    return sorted(map(finding_key, screened)), sorted(map(finding_key, unscreened(path, SETTINGS)))


def project_file(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    path = tmp_path / name
    path.write_text(text)
    return path


KEPT = {
    "step helper under a modulo guard": HEAD
    + "def update(optimizer):\n    optimizer.step()\n    optimizer.zero_grad()\n\n\n"
    "def train(model, loader, optimizer, k):\n"
    "    for i, (x, y) in enumerate(loader):\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100) / k\n"
    "        loss.backward()\n"
    "        if (i + 1) % k == 0:\n"
    "            update(optimizer)\n",
    "step after a skipping guard": HEAD + "def train(model, loader, optimizer, k):\n"
    "    for i, (x, y) in enumerate(loader):\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100) / k\n"
    "        loss.backward()\n"
    "        if (i + 1) % k != 0:\n"
    "            continue\n"
    "        optimizer.step()\n"
    "        optimizer.zero_grad()\n",
    "modulo through a name": HEAD + "def train(model, loader, optimizer, k):\n"
    "    for i, (x, y) in enumerate(loader):\n"
    "        sync = (i + 1) % k == 0\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100) / k\n"
    "        loss.backward()\n"
    "        if sync:\n"
    "            optimizer.step()\n",
    "micro-step loop, gradients read after": HEAD
    + "def train_step(model, micro_batches, optimizer):\n"
    "    for x, y in micro_batches:\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100) / len(micro_batches)\n"
    "        loss.backward()\n"
    "    for p in model.parameters():\n"
    "        p.grad.clamp_(-1, 1)\n"
    "    optimizer.step()\n",
    "backward helper in a loop": HEAD + "def apply(loss):\n    loss.backward()\n\n\n"
    "def train(model, loader, optimizer, k):\n"
    "    for i, (x, y) in enumerate(loader):\n"
    "        apply(F.cross_entropy(model(x), y, ignore_index=-100) / k)\n"
    "        if (i + 1) % k == 0:\n"
    "            optimizer.step()\n",
    "method of a nested class": HEAD + "class Suite:\n    class Case:\n"
    "        def train(self, model, loader, optimizer, k):\n"
    "            for i, (x, y) in enumerate(loader):\n"
    "                loss = F.cross_entropy(model(x), y, ignore_index=-100) / k\n"
    "                loss.backward()\n"
    "                if (i + 1) % k == 0:\n"
    "                    optimizer.step()\n",
    "accumulation name without a window": HEAD + "def train(model, loader, optimizer, args):\n"
    "    for x, y in loader:\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100)\n"
    "        (loss / args.gradient_accumulation_steps).backward()\n"
    "        optimizer.step()\n",
    "accumulate context": "def train(accelerator, model, loader, optimizer):\n"
    "    for batch in loader:\n"
    "        with accelerator.accumulate(model):\n"
    "            loss = model(**batch, attention_mask=batch['attention_mask']).loss\n"
    "            accelerator.backward(loss)\n"
    "            optimizer.step()\n"
    "            optimizer.zero_grad()\n",
    "module-level script": HEAD + "for i, (x, y) in enumerate(loader):\n"
    "    loss = F.cross_entropy(model(x), y, ignore_index=-100) / 4\n"
    "    loss.backward()\n"
    "    if (i + 1) % 4 == 0:\n"
    "        optimizer.step()\n"
    '"""Docstring that says loss.backward()."""\n',
}

ANSWERED = {
    "backward only in a docstring": 'def f(model):\n    """Call `loss.backward()` next."""\n',
    "one step per batch, a modulo for logging": HEAD + "def train(model, loader, optimizer):\n"
    "    for step, (x, y) in enumerate(loader):\n"
    "        loss = F.cross_entropy(model(x), y, ignore_index=-100)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "        optimizer.zero_grad()\n"
    "        if step % 10 == 0:\n"
    "            print(loss.item())\n",
    "a backward without a loop": "def closure(model, x):\n    model(x).sum().backward()\n",
    "a Trainer override without transformers": "class Run(Base):\n"
    "    def compute_loss(self, model, inputs):\n"
    "        return model(**inputs).loss / self.grad_accum\n",
    "tree_util without JAX": "from torch.utils import _pytree as tree_util\n\n"
    "def halve(grads):\n    return tree_util.tree_map(lambda g: g / 2, grads)\n",
}


@pytest.mark.parametrize("text", KEPT.values(), ids=KEPT.keys())
def test_windows_the_rules_see_are_kept(tmp_path, text):
    screened, whole = findings(project_file(tmp_path, text))
    assert whole and screened == whole


@pytest.mark.parametrize("text", ANSWERED.values(), ids=ANSWERED.keys())
def test_files_without_a_window_are_answered_without_libcst(tmp_path, text):
    path = project_file(tmp_path, text)
    assert screen(path.read_bytes(), frozenset(), tmp_path).data is None
    assert findings(path) == ([], [])


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_the_prefilter_passes_each_trigger(trigger):
    """Triggers are probed through substrings they share: each still passes alone."""
    assert [key in trigger for key, group in PROBES if trigger in group] == [True]
    assert Source(Path("x.py"), b"x = 1\n" + trigger + b"\n").may_have_findings
    assert not Source(Path("x.py"), b"x = 1\n" + trigger[:-1] + b"\n").may_have_findings


def test_triggers_only_in_strings_and_comments_are_answered_without_parsing(monkeypatch):
    def parse(*args, **kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(ast, "parse", parse)
    text = (FIXTURES / "ga001_hf_clm_sft_no_trainer.py").read_text()
    quoted = '"""Run loss.backward() then Trainer(...)."""\n' + "\n".join(
        f"# {line}" for line in text.splitlines()
    )
    assert screen(quoted.encode(), frozenset(), Path(".")).data is None
    with pytest.raises(AssertionError, match="parsed"):
        screen(text.encode(), frozenset(), Path("."))


TRAINER_HEAD = "from transformers import TrainingArguments\n"
COMPUTE_LOSS = (
    "    def compute_loss(self, model, inputs, return_outputs=False):\n"
    "        return model(**inputs).loss\n"
)
TRAINER_SHAPES = {
    "an aliased Trainer": "from transformers import Trainer as T\n\n\nclass Run(T):\n"
    + COMPUTE_LOSS,
    "a module alias": "import transformers as tf\n\n\nclass Run(tf.Seq2SeqTrainer):\n"
    + COMPUTE_LOSS,
    "a same-file base in between": "from trl import SFTTrainer\n\n\nclass Base(SFTTrainer):\n"
    "    pass\n\n\nclass Run(Base):\n" + COMPUTE_LOSS,
    "an opt-out in another method": "from transformers import Trainer\n\n\nclass Run(Trainer):\n"
    "    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):\n"
    "        return model(**inputs).loss\n\n"
    "    def prepare(self):\n        self.model_accepts_loss_kwargs = False\n",
    "a model handed to an aliased Trainer": HEAD
    + "from torch import nn\nfrom transformers import Trainer as T\n\n\n"
    "class Net(nn.Module):\n    def forward(self, x, labels=None):\n"
    "        return {'loss': F.cross_entropy(self.head(x), labels, ignore_index=-100)}\n\n\n"
    "def main(args, data):\n    net = Net()\n    T(model=net, args=args, train_dataset=data).train()\n",
    "a compute_loss_func handed to a Trainer": HEAD + "from transformers import Trainer\n\n\n"
    "def token_loss(outputs, labels, num_items_in_batch=None):\n"
    "    return F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)\n\n\n"
    "def main(model, args, data):\n"
    "    Trainer(model=model, args=args, train_dataset=data, compute_loss_func=token_loss).train()\n",
    "a compute_loss_func set in a subclass": HEAD + "from transformers import Trainer\n\n\n"
    "def token_loss(outputs, labels, num_items_in_batch=None):\n"
    "    return F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)\n\n\n"
    "class Run(Trainer):\n    def __init__(self, *args, **kwargs):\n"
    "        super().__init__(*args, **kwargs)\n        self.compute_loss_func = token_loss\n",
}


@pytest.mark.parametrize("shape", TRAINER_SHAPES)
def test_what_ga004_reads_is_kept(tmp_path, shape):
    """Trainer subclasses (through an alias, a module or a same-file base) are kept whole,
    a call handing a model or a `compute_loss_func` to a Trainer with them, and the
    function; all but the opt-out hold a finding."""
    screened, whole = findings(project_file(tmp_path, TRAINER_HEAD + TRAINER_SHAPES[shape]))
    assert screened == whole
    assert bool(whole) != ("opt-out" in shape)


def test_a_class_named_trainer_is_not_one(tmp_path):
    """transformers' own `class Trainer` derives from nothing GA004 knows: not kept."""
    text = "from transformers import PreTrainedModel\n\n\nclass Trainer:\n" + COMPUTE_LOSS
    assert screen(text.encode(), frozenset(), tmp_path).data is None


TRAIN = HEAD + (
    "from helpers import compute\n\n\n"
    "def train(model, loader, optimizer):\n"
    "    for x, y in loader:\n"
    "        loss = compute(model, x, y)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
)
HELPER = HEAD + (
    "grad_accum = 4\n\n\n"
    "def compute(model, x, y):\n"
    "    return F.cross_entropy(model(x), y, ignore_index=-100) / grad_accum\n"
)


@pytest.mark.parametrize("module", ["helpers", "lib.helpers", "lib.deep.helpers"])
def test_a_helper_module_that_divides_opens_the_file(tmp_path, module):
    """No window, but the loss comes from a module of the repository (perhaps inside a
    package) that divides by an accumulation name: the rules report it, so the screen must
    not answer alone."""
    path = project_file(tmp_path, TRAIN.replace("from helpers", f"from {module}"))
    helper = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    helper.parent.mkdir(parents=True, exist_ok=True)
    helper.write_text(HELPER)
    for package in helper.relative_to(tmp_path).parents[:-1]:
        (tmp_path / package / "__init__.py").touch()
    screened, whole = findings(path)
    assert whole and screened == whole


def test_a_helper_module_appearing_later_is_seen_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "RACY_NS", 0)
    path = project_file(tmp_path, TRAIN)
    _, report, entry = check_recorded(path, SETTINGS, None)
    assert report.findings == [] and entry.dependencies  # the modules looked for
    (tmp_path / "helpers.py").write_text(HELPER)
    assert not cache.unchanged(entry.dependencies)
    _, report, _ = check_recorded(path, SETTINGS, entry)
    assert [f.code for f in report.findings] == ["GA001"]


def test_a_pipeline_schedule_under_another_name_is_kept(tmp_path):
    text = (FIXTURES / "ga001_pipeline_lambda_div_microbatches.py").read_text()
    aliased = text.replace("import Schedule1F1B,", "import Schedule1F1B as Interleave,")
    aliased = aliased.replace("Schedule1F1B(", "Interleave(")
    assert "Interleave(" in aliased and "Schedule1F1B(" not in aliased
    screened, whole = findings(project_file(tmp_path, aliased))
    assert whole and screened == whole


def test_the_focused_copy_keeps_line_numbers(tmp_path):
    source = FIXTURES / "ga001_two_stage_two_sites.py"
    shutil.copy(source, tmp_path / "train.py")
    focused = screen(source.read_bytes(), frozenset(), tmp_path).data
    assert focused is not None
    assert focused.count(b"\n") == source.read_bytes().count(b"\n")
