"""`gaaudit verify --model-factory`, `--data-factory` and `[tool.gaaudit.verify]`: the user's
own model and batches in place of the harness's, and verify's defaults from pyproject.toml."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, devices, gaaudit, verify_projects
from torch import nn

from gaaudit.commands.verify import (
    LAST_BATCH_LEFT_OUT,
    REPRODUCED,
    VERIFIED,
    _drops_last,
    options_for,
)
from gaaudit.config import ConfigError, VerifySettings, load
from gaaudit.harness.factory import FactoryError, load_factory, user_model
from gaaudit.harness.models import build_model, vocab_size

TINY_LM = '''
from pathlib import Path

from torch import nn


class TinyLM(nn.Module):
    """Returns logits; no config, so the vocabulary comes from the embedding."""

    def __init__(self, vocab=50, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.GRU(width, width, batch_first=True)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        hidden, _ = self.mix(self.embed(ids))
        return self.head(self.drop(hidden))


def build():
    with (Path(__file__).parent / "calls.txt").open("a") as log:
        log.write("built\\n")
    return TinyLM()
'''

LOGITS_LOOP = """
import torch.nn.functional as F


def train(model, loader, optimizer, accumulation_steps):
    model.train()
    for step, (ids, targets) in enumerate(loader):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        (loss / accumulation_steps).backward()
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TINY_LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0))
"""

DDP_SFT = """
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq


def train(model, loader, optimizer, accumulation_steps):
    model.train()
    for step, batch in enumerate(loader):
        sync = (step + 1) % accumulation_steps == 0
        with nullcontext() if sync else model.no_sync():
            loss = model(**batch).loss / accumulation_steps
            loss.backward()
        if sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    model = AutoModelForCausalLM.from_pretrained("my-org/my-llama").cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train(model, build_loader(DataCollatorForSeq2Seq), optimizer, 8)
"""


def project(root: Path, files: dict[str, str], verify_table: str = "") -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    if verify_table:
        (root / "pyproject.toml").write_text(
            f"[project]\nname = 'demo'\n\n[tool.gaaudit.verify]\n{textwrap.dedent(verify_table)}"
        )
    return root


def rows_of(stdout: str) -> list[dict]:
    (loop,) = json.loads(stdout)["loops"]
    return loop["rows"]


def test_model_factory_from_the_command_line_drives_a_custom_lm(tmp_path):
    root = project(tmp_path / "proj", {"tinylm.py": TINY_LM, "train.py": LOGITS_LOOP})
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")  # the import root
    result = gaaudit(
        "verify",
        str(root / "train.py"),
        "--model-factory",
        "tinylm:build",
        "-k",
        "2,4",
        "--device",
        "cpu",
        "--format",
        "json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "with tinylm:build" in result.stderr
    for row in rows_of(result.stdout):
        assert row["original_verdict"] == REPRODUCED and row["original_error"] > 1e-3, row
        assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row
    # built by the factory (2 checks, then the reference and the replays); token ids < 50
    assert len((root / "calls.txt").read_text().splitlines()) > 4


def test_pyproject_verify_table_sets_factory_processes_and_k(tmp_path):
    root = project(
        tmp_path / "proj",
        {"zoo.py": TINY_LLAMA, "src/train.py": DDP_SFT},
        """
        model-factory = "zoo:tiny_llama"
        distributed = 2
        k = [2]
        device = "cpu"
    """,
    )
    result = gaaudit("verify", str(root / "src" / "train.py"), "--format", "json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "with zoo:tiny_llama on 2 DDP processes" in result.stderr
    (row,) = rows_of(result.stdout)
    assert row["k"] == 2 and row["processes"] == 2
    assert row["original_verdict"] == REPRODUCED and row["original_error"] > 1e-3, row
    assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row


def test_a_factory_that_cannot_load_stops_verify_and_holds_back_fix_verify(tmp_path):
    root = project(tmp_path, {"train.py": LOGITS_LOOP}, 'model-factory = "missing_models:build"\n')
    result = gaaudit("verify", "train.py", "-k", "2", cwd=root)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.splitlines()[-1]
    assert "pyproject.toml: [tool.gaaudit.verify] model-factory = missing_models:build" in message
    assert "cannot import 'missing_models'" in message and "project root" in message
    fixed = gaaudit("fix", "--verify", "train.py", cwd=root)
    assert "train.py: fixes held back:" in fixed.stdout and "missing_models" in fixed.stdout
    assert (root / "train.py").read_text() == textwrap.dedent(LOGITS_LOOP)


def test_a_factory_module_is_looked_for_without_running_the_project(tmp_path, monkeypatch):
    """verify says at once that a factory's module is missing (before a replay process
    imports torch), looking in the project root, the current directory and the installed
    packages, and runs none of the project's code to find it."""
    from gaaudit.discover.modules import missing_top_module

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "here.py").write_text("raise SystemExit('imported')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert missing_top_module("models.tiny", tmp_path) is None
    assert missing_top_module("json.decoder", elsewhere) is None
    monkeypatch.chdir(tmp_path)
    assert missing_top_module("here", elsewhere) is None
    assert missing_top_module("missing_models.tiny", elsewhere) == "missing_models"


def test_malformed_factory_and_bad_values_are_usage_errors(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOGITS_LOOP))
    for args, words in (
        (["--model-factory", "models"], ["--model-factory", "module:function", "'models'"]),
        (["-k", "2,x"], ["-k", "window sizes"]),
        (["--dtype", "fp64"], ["--dtype", "float32"]),
    ):
        result = cli("verify", str(script), *args)
        assert result.exit_code == 2 and all(w in result.output for w in words), result.output


@pytest.mark.parametrize(
    "table, words",
    [
        ('k = "2,4"', ["[tool.gaaudit.verify] k", "list of window sizes"]),
        ("k = [0]", ["[tool.gaaudit.verify] k"]),
        ('device = "tpu"', ["device", "auto, cpu, cuda"]),
        ('dtype = "fp8"', ["dtype", "float32, bfloat16, float16"]),
        ("timeout = -1", ["timeout", "seconds > 0"]),
        ("distributed = true", ["distributed", "number of processes"]),
        ('model-factory = "a.b"', ["model-factory", "module:function"]),
        ("colour = 1", ["colour", "unknown key", "model-factory"]),
    ],
)
def test_bad_verify_table_names_the_file_and_key(tmp_path, table, words):
    (tmp_path / "pyproject.toml").write_text(f"[tool.gaaudit.verify]\n{table}\n")
    with pytest.raises(ConfigError) as caught:
        load(tmp_path)
    assert str(tmp_path / "pyproject.toml") in str(caught.value)
    assert all(w in str(caught.value) for w in words), caught.value


def test_command_line_wins_over_the_table_which_wins_over_defaults(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.gaaudit.verify]\nk = [3]\ndtype = "bfloat16"\nseed = 7\nmodel-factory = "m:f"\n'
    )
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text("")
    (tmp_path / "m.py").write_text("")
    (tmp_path / "pkg").mkdir()
    assert load(tmp_path).verify == VerifySettings(
        model_factory="m:f", k=(3,), dtype="bfloat16", seed=7
    )
    options = options_for(script, ks=(2,), seed=None, model_factory=None)
    assert (options.ks, options.dtype, options.seed, options.device) == (
        (2,),
        "bfloat16",
        7,
        "auto",
    )
    assert options.model_factory == "m:f" and options.project_root == str(tmp_path)
    assert "[tool.gaaudit.verify] model-factory" in options.factory_option
    given = options_for(script, model_factory="pkg.models:Builder.tiny")
    assert (
        given.model_factory == "pkg.models:Builder.tiny"
        and given.factory_option == "--model-factory"
    )


FACTORIES = """
import random

import torch
from torch import nn

NOT_CALLABLE = 3


def needs_arguments(width):
    return nn.Linear(width, width)


def returns_config():
    return {"vocab_size": 10}


def unseeded():
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.fill_(random.random())
    return layer


class Vocab(nn.Module):
    vocab_size = 17

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)


def with_vocab():
    return Vocab()
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module of factories, importable while the test runs."""
    (tmp_path / "factories_under_test.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "factories_under_test", raising=False)
    yield str(tmp_path)
    sys.modules.pop("factories_under_test", None)


@pytest.mark.parametrize(
    "target, words",
    [
        ("no_such_module:build", ["cannot import 'no_such_module'", "ModuleNotFoundError"]),
        ("factories_under_test:missing", ["has no attribute 'missing'"]),
        ("factories_under_test:NOT_CALLABLE", ["is a int, not callable"]),
        ("factories_under_test:needs_arguments", ["no arguments failed", "TypeError"]),
        ("factories_under_test:returns_config", ["returned a dict, not a torch.nn.Module"]),
        ("factories_under_test:unseeded", ["different weights"]),
    ],
)
def test_factory_errors_name_the_option_and_what_to_do(factories, target, words):
    with pytest.raises(FactoryError) as caught:
        load_factory(target, factories, "--model-factory")
    assert str(caught.value).startswith(f"--model-factory {target}: ")
    assert all(w in str(caught.value) for w in words), caught.value


def test_a_loaded_factory_replaces_the_model_kept_in_eval_without_dropout(factories):
    model = load_factory("factories_under_test:with_vocab", factories)
    assert model.vocab_size == 17
    with user_model(model):
        built = build_model("causal", seed=3)
        assert type(built).__name__ == "Vocab" and vocab_size() == 17
        built.train()
        assert not built.training and built.drop.p == 0.0
        assert torch.equal(build_model("causal", seed=3).linear.weight, built.linear.weight)
    assert isinstance(build_model("nanogpt"), nn.Module) and vocab_size() == 256


STUB_REACHES_TORCH = """\
import torch
from mylib.config import get_config

cfg = get_config()


def train(model, loader, optimizer, accum):
    for step, batch in enumerate(loader):
        loss = model(**batch).loss / accum
        loss.backward()
        weights = torch.ones(cfg.max_len)
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_stand_in_reaching_torch_is_named_with_its_line(at_two):
    """`cfg` comes from a library that is not installed: the replay binds a stand-in, and
    when torch is handed `cfg.max_len` the verdict says which value it lacked, and where."""
    (loop,) = at_two["stub_reaches_torch"]
    verdict = loop["rows"][0]["original_verdict"]
    assert verdict.startswith("not replayable: TypeError")
    assert "(line 11; it reads `cfg.max_len`, which the harness could not bind" in verdict


UNPACKS_A_STAND_IN = """\
from mylib.metrics import TokenMetric  # not installed here: a stand-in

metric = TokenMetric()


def train(model, loader, optimizer, accum):
    for step, batch in enumerate(loader):
        loss = model(**batch).loss / accum
        loss.backward()
        acc, running = metric.get_metric()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


LAUNCHED = FIXTURES / "ga003_accelerate_deepspeed_plugin_at_launch.py"


def test_a_stand_in_unpacks_and_a_deepspeed_window_set_up_at_launch_is_named(at_two):
    """`acc, running = metric.get_metric()` of a library that is not installed unpacks into
    stand-ins, so the loop replays (the bug reproduced); an accelerate loop whose window
    DeepSpeed forms, with K in the configuration given at launch, is not replayed as if each
    micro-batch were a window, and the verdict says why."""
    (unpacked,), (deepspeed,) = at_two["unpacks"], at_two["launched"]
    assert unpacked["rows"][0]["original_verdict"] == "bug reproduced", unpacked
    assert deepspeed["verdict"] == (
        "not replayable: the window is DeepSpeed's, set up through accelerate at launch (its K "
        "is in the configuration given there), which the replay does not build; the loop "
        "itself steps every micro-batch"
    )


OWN_MODEL_CALLS = """
def train(model, loader, optimizer, accumulation_steps):
    for step, batch in enumerate(loader):
        loss = {call}
        (loss / accumulation_steps).backward()
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


MODEL_CALLS = {
    "keyword": ('model(batch["input_ids"], return_loss=True)', "TypeError"),
    "attribute": ("model(**batch).loss * model.loss_weight", "AttributeError"),
}


WRITES_TO_ITS_OUTPUT = """
import os


def train(model, loader, optimizer, accum):
    for step, batch in enumerate(loader):
        os.write(1, b"{ not an answer\\n")  # to the process's output, past sys.stdout
        loss = model(**batch).loss / accum
        loss.backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.fixture(scope="module")
def at_two(tmp_path_factory) -> dict[str, list[dict]]:
    """The loops of the scripts above, from one `verify -k 2` run over them all."""
    projects = {
        "stub_reaches_torch": ("train.py", {"train.py": STUB_REACHES_TORCH}),
        "writes": ("train.py", {"train.py": WRITES_TO_ITS_OUTPUT}),
        "unpacks": ("train.py", {"train.py": UNPACKS_A_STAND_IN}),
        "launched": (LAUNCHED.name, {LAUNCHED.name: LAUNCHED.read_text()}),
    }
    for name, (call, _) in MODEL_CALLS.items():
        projects[name] = ("train.py", {"train.py": OWN_MODEL_CALLS.format(call=call)})
    root = tmp_path_factory.mktemp("at_two")
    return verify_projects(root, projects, "-k", "2")[1]


@pytest.mark.parametrize("name", MODEL_CALLS)
def test_a_model_call_the_tiny_model_refuses_names_the_model_factory(at_two, name):
    """A keyword argument or attribute of the user's own model (issue 18, item 4): the
    verdict says which option would hand the harness that model."""
    (loop,) = at_two[name]
    verdict = loop["rows"][0]["original_verdict"]
    assert verdict.startswith(f"not replayable: {MODEL_CALLS[name][1]}: "), verdict
    assert verdict.endswith(
        "the loop calls its model in a way the harness's tiny model does not take: "
        "pass your model with --model-factory"
    ), verdict


def test_what_a_loop_writes_to_the_process_output_does_not_mix_with_the_answers(at_two):
    (loop,) = at_two["writes"]
    assert loop["rows"][0]["original_verdict"] == REPRODUCED, loop


MASKED_TRIPLES = """
import torch.nn.functional as F


def train(model, loader, optimizer, accumulation_steps):
    for step, (features, targets, mask) in enumerate(loader):
        logits = model(features)
        loss = (F.cross_entropy(logits, targets, reduction="none") * mask).sum() / mask.sum()
        loss = loss / accumulation_steps
        loss.backward()
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TRIPLES = """
import torch


def window(k):
    # k micro-batches of (features, targets, mask) holding 1, 2, ... valid rows
    rows = torch.arange(6)
    return [
        (torch.randn(6, 8), torch.randint(0, 4, (6,)), (rows <= i).float()) for i in range(k)
    ]


def ragged(k):
    return [(torch.randn(6, 8 + i), torch.zeros(6).long(), torch.ones(6)) for i in range(k)]


def classifier():
    return torch.nn.Linear(8, 4)
"""


@pytest.mark.parametrize("device", devices())
def test_data_factory_replays_a_loop_over_batches_of_the_users_own(tmp_path, device):
    """A loop that unpacks three values (issue 18, item 3): the harness's batches, served as
    token ids, labels and a mask, do not fit, and verify says which option hands in the
    user's, which do; the reference is the loop on the whole window as one micro-batch."""
    root = project(tmp_path / "proj", {"batches.py": TRIPLES, "train.py": MASKED_TRIPLES})
    (root / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    run = lambda *options: gaaudit(
        "verify",
        "train.py",
        "-k",
        "2,4",
        "--device",
        device,
        "--format",
        "json",
        *options,
        cwd=root,
    )
    alone = run()
    assert alone.returncode == 2
    assert "the 3 values the loop unpacks" in alone.stdout and "--data-factory" in alone.stdout
    result = run("--data-factory", "batches:window", "--model-factory", "batches:classifier")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on the batches of batches:window" in result.stderr
    for row in rows_of(result.stdout):
        assert row["original_verdict"] == REPRODUCED and row["original_error"] > 1e-3, row
        assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row
    tiny = run("--data-factory", "batches:window")
    assert "pass your model with --model-factory" in tiny.stdout


def test_data_factory_from_the_table_and_its_errors(tmp_path):
    root = project(
        tmp_path,
        {"batches.py": TRIPLES, "train.py": MASKED_TRIPLES},
        """
        data-factory = "batches:ragged"
        model-factory = "batches:classifier"
        k = [2]
        device = "cpu"
    """,
    )
    ragged = gaaudit("verify", "train.py", cwd=root)
    assert ragged.returncode == 2 and "Traceback" not in ragged.stderr
    message = ragged.stderr.splitlines()[-1]
    assert "[tool.gaaudit.verify] data-factory = batches:ragged" in message
    assert "tensors of shapes (6, 8), (6, 9) do not join" in message and "pad" in message
    together = gaaudit("verify", "train.py", "--distributed", "2", cwd=root)
    assert together.returncode == 2 and "replayed in one process" in together.stderr
    malformed = gaaudit("verify", "train.py", "--data-factory", "batches", cwd=root)
    assert malformed.returncode == 2 and "takes k and returns k micro-batches" in malformed.stderr


TIMM_ENGINE = """
import math
import sys

import torch
from timm.data import Mixup  # not installed here: a stand-in


def train_one_epoch(model, criterion, data_loader, optimizer, device, accum_iter, mixup_fn, steps=None):
    optimizer.zero_grad()
    for data_iter_step, (samples, targets, _, _) in enumerate(data_loader):
        if data_iter_step // accum_iter >= steps:
            continue
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        outputs = model(samples)
        loss = criterion(outputs, targets)
        if not math.isfinite(loss.item()):
            sys.exit(1)
        loss /= accum_iter
        loss.backward()
        if (data_iter_step + 1) % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TIMM_MAIN = """
import torch
from torchvision import datasets

from engine import train_one_epoch


def main(model, criterion, optimizer, root, batch_size, accum_iter):
    images = datasets.ImageFolder(root)
    loader = torch.utils.data.DataLoader(images, batch_size=batch_size, drop_last=True)
    train_one_epoch(model, criterion, loader, optimizer, "cuda", accum_iter, None, len(loader))
"""


# The engine beside a script whose loader keeps its last batch, and a module that does not
# import the engine building one that drops it.
TIMM_KEEPS_LAST = {
    "engine.py": TIMM_ENGINE,
    "main.py": TIMM_MAIN.replace("drop_last=True", "drop_last=False"),
    "data.py": TIMM_MAIN.replace("from engine ", "from x "),
}


def test_an_engine_handed_its_criterion_is_exact_where_the_loader_drops_its_last_batch(
    at_four, tmp_path
):
    """A timm-style engine (MAE's, ConvNeXt's, VideoMAE's, Swin's): the loss function is a
    parameter, `mixup_fn` is tested for None, the batches carry values the loop drops (`_`),
    a None default stands for the caller's number, and the loader is built by the script
    that imports the engine. One target per image: mean/K is exact when every micro-batch
    holds as many images, which `drop_last=True` there ensures; a loader elsewhere in the
    project does not count, and without one the replay leaves out the last, short batch
    alone (GA-GUIDE section 3: exact but for that batch)."""
    code, loops = at_four
    (loop,) = loops["drops_last"]
    assert loop["equal_sizes"] == "`drop_last=True`, main.py, line 10", loop
    (row,) = loop["rows"]
    assert row["original_verdict"] == VERIFIED and row["original_error"] < 1e-5, row
    assert row["verdict"] == VERIFIED and code == 0, row  # nothing to fix; nor in the others
    (loop,) = loops["keeps_last"]
    (row,) = loop["rows"]
    assert loop["equal_sizes"] == LAST_BATCH_LEFT_OUT and row["original_verdict"] == VERIFIED
    root = project(tmp_path, TIMM_KEEPS_LAST)
    text = gaaudit("verify", "engine.py", "-k", "4", cwd=root).stdout
    assert "an epoch's last, short batch left out, as no loader of the project drops it" in text


def test_drop_last_counts_in_a_module_the_file_imports_relatively(tmp_path, monkeypatch):
    """`from .data import loader` in `pkg/engine.py` reaches `pkg/data.py`; a loader in a
    module the file neither imports nor is imported by does not count."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "data.py").write_text("loader = DataLoader(images, drop_last=True)\n")
    (tmp_path / "other.py").write_text("\nloader = DataLoader(texts, drop_last=True)\n")
    engine = tmp_path / "pkg" / "engine.py"
    engine.write_text("import torch\nfrom .data import loader\n")
    monkeypatch.chdir(tmp_path)
    assert _drops_last(Path("pkg/engine.py")) == "`drop_last=True`, pkg/data.py, line 1"
    engine.write_text("import torch\n")
    assert _drops_last(Path("pkg/engine.py")) == ""


def test_drop_last_is_searched_in_the_files_repository_only(tmp_path, monkeypatch):
    """Run from a folder holding several repositories (a home directory), the search reads
    the file's repository: a script of another one that imports a module of the same name
    does not count; the whole folder is read where the file is in no repository."""
    (tmp_path / "project" / ".git").mkdir(parents=True)
    (tmp_path / "project" / "engine.py").write_text("import torch\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "main.py").write_text(
        "import engine\nDataLoader(x, drop_last=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert _drops_last(Path("project/engine.py")) == ""
    (tmp_path / "project" / ".git").rmdir()
    expected = "`drop_last=True`, elsewhere/main.py, line 2"
    assert _drops_last(Path("project/engine.py")) == expected


GLUE = """
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification


def train(model, train_dataloader, optimizer, args):
    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss {divided}
        loss.backward()
        if (step + 1) % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


DIVISIONS = {
    "mean-over-k": ("/ args.gradient_accumulation_steps", VERIFIED),
    "no-division": ("", REPRODUCED),
}


@pytest.mark.parametrize("name", DIVISIONS)
def test_a_sequence_classifier_is_replayed_with_one_label_per_sequence(at_four, name):
    """A GLUE-style loop (`AutoModelForSequenceClassification`): one label per sequence, so
    mean/K is exact on micro-batches of one size (GA-GUIDE section 3), the last short batch
    left out, while a missing division stays K times too large."""
    (loop,) = at_four[1][name]
    assert loop["equal_sizes"] == LAST_BATCH_LEFT_OUT, loop
    (row,) = loop["rows"]
    assert row["original_verdict"] == DIVISIONS[name][1], row


POSITIONAL = """
import torch
from transformers import RobertaForSequenceClassification


def train(model, train_dataloader, eval_dataloader, optimizer, writer, logger, args):
    logger.info("  Num batches = %d", len(train_dataloader))
    for step, batch in enumerate(train_dataloader):
        batch = tuple(t.to(args.device) for t in batch)
        inputs = {
            "input_ids": batch[0],
            "attention_mask": batch[1],
            "token_type_ids": batch[2] if args.model_type == "bert" else None,
            "labels": batch[3],
        }
        loss = model(**inputs)[0] / args.gradient_accumulation_steps
        loss.backward()
        writer.add_scalar("train/loss", loss.item(), step)
        if step % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            for eval_batch in eval_dataloader:
                logger.info("eval batch of %d", len(eval_batch[0]))
"""


@pytest.fixture(scope="module")
def at_four(tmp_path_factory) -> tuple[int, dict[str, list[dict]]]:
    """The exit code of one `verify -k 4` run over the sequence classifiers and the timm
    engines above, and each one's loops."""
    projects = {
        name: ("glue.py", {"glue.py": GLUE.format(divided=divided)})
        for name, (divided, _) in DIVISIONS.items()
    }
    projects["positional"] = ("glue.py", {"glue.py": POSITIONAL})
    projects["drops_last"] = ("engine.py", {"engine.py": TIMM_ENGINE, "main.py": TIMM_MAIN})
    projects["keeps_last"] = ("engine.py", TIMM_KEEPS_LAST)
    result, loops = verify_projects(tmp_path_factory.mktemp("at_four"), projects, "-k", "4")
    return result.returncode, loops


def test_a_tuple_batch_indexed_by_position_is_served_and_its_first_window_counted(at_four):
    """TensorDataset batches read by position into named inputs (`"labels": batch[3]`) are
    tuples in that order; a log called with a string (`writer.add_scalar("train/loss", ...)`)
    and an evaluation loader that is not drawn from before the step serve no micro-batches,
    so the first window (`step % K == 0` from step 0) is counted: one micro-batch."""
    (loop,) = at_four[1]["positional"]
    (row,) = loop["rows"]
    assert row["first_window"] == 1, row
    assert row["original_verdict"] == REPRODUCED and row["verdict"] == VERIFIED, row
