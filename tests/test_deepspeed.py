"""A DeepSpeed engine's loop (GA003) with real DeepSpeed on CPU. Its read-ahead fix, run on one
process and on two gloo processes: at every optimizer step the patched loop's gradient is the
token mean over the window's micro-batches of every rank, where the original's is not. And
`gaaudit verify`, which replays such a loop with a real engine around its tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, flat, gaaudit
from transformers import GPT2Config, GPT2LMHeadModel

from gaaudit.commands.verify import REPRODUCED, VERIFIED
from gaaudit.config import Settings
from gaaudit.fixes.fixer import fix_source
from gaaudit.harness.gradcheck import relative_error, snapshot
from gaaudit.harness.trainer import arguments, collate, examples, tiny_model, trainer_class

K, MICRO, WIDTH = 4, 2, 12  # accumulation steps, rows per micro-batch, padded width
TINY = {  # a GPT-2 small enough for CPU, without dropout: the same weights give the same loss
    "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 1,
}  # fmt: skip

TRAIN = """\
import deepspeed
import torch
from transformers import GPT2LMHeadModel

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.0,
}


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def main(net: GPT2LMHeadModel, optimizer, loader, epochs):
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=CONFIG)
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            batch = to_device(batch, engine.device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
"""

# One process of a run: DeepSpeed on the CPU over gloo, a recording optimizer with lr 0 (the
# model stays as built, so every step's gradient is compared on the same weights). It trains
# each script in turn, a fresh model and engine each, so that they share one start-up.
WORKER = """\
import json, os, runpy, sys
import torch
import torch.distributed as dist
import deepspeed, deepspeed.ops
from transformers import GPT2Config, GPT2LMHeadModel

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo, no kernel to compile
dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("GA_ACCELERATE_BEFORE_1_8"):  # its DeepSpeed wrapper left the engine its window
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    def backward(self, loss, sync_gradients=True, **kwargs):
        self.engine.backward(loss, **kwargs)
        self.engine.step()

    DeepSpeedEngineWrapper.backward = backward
data, epochs, *jobs = sys.argv[1:]  # then each script and where its steps go


class Recording(torch.optim.SGD):
    steps = []

    def step(self, closure=None):
        Recording.steps.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        return super().step(closure)


loader = [{k: torch.tensor(v) for k, v in b.items()} for b in json.load(open(data))[rank]]
for script, out in zip(jobs[::2], jobs[1::2], strict=True):
    Recording.steps = []
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(**json.loads(os.environ["GA_TINY_GPT2"])))
    runpy.run_path(script)["main"](net, Recording(net.parameters(), lr=0.0), loader, int(epochs))
    torch.save(Recording.steps, f"{out}.{rank}")
"""


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**TINY))


def batches(rank: int, count: int) -> list[dict]:
    """Micro-batches of one padded width whose valid-label counts differ widely."""
    generator = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(count):
        ids = torch.randint(1, 64, (MICRO, WIDTH), generator=generator)
        labels = ids.clone()
        valid = 2 + (5 * i + 3 * rank) % (WIDTH - 2)  # from 2 to WIDTH - 1 labels per row
        labels[:, valid:] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def token_mean_gradient(windows: list[list[dict]]) -> list[torch.Tensor]:
    """The gradient of the token mean over the concatenation of micro-batches, averaged over
    `windows` (an equal-weight mix of parts, where an epoch's end cuts a window in two)."""
    net = model()
    for part in windows:
        full = {k: torch.cat([torch.tensor(b[k]) for b in part]) for k in ("input_ids", "labels")}
        (net(**full).loss / len(windows)).backward()
    return [p.grad for p in net.parameters()]


def run(
    tmp_path: Path, sources: dict[str, str], world: int, per_rank: int, epochs: int, **environ: str
) -> dict[str, list]:
    """Each source's optimizer steps' gradients (rank 0's: the engine averages them over ranks),
    the sources trained one after the other in the same `world` processes."""
    tmp_path.mkdir(exist_ok=True)
    worker, data = tmp_path / "worker.py", tmp_path / "data.json"
    worker.write_text(WORKER)
    data.write_text(json.dumps([batches(r, per_rank) for r in range(world)]))
    jobs = []
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        jobs += [str(tmp_path / f"{name}.py"), str(tmp_path / name)]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29600 + world + 7 * epochs),
        "WORLD_SIZE": str(world),
        "GA_TINY_GPT2": json.dumps(TINY),
        **environ,
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(data), str(epochs), *jobs],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    return {name: torch.load(tmp_path / f"{name}.0") for name in sources}


def distance(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    flat = torch.cat([g.flatten() for g in got])
    return float((flat - torch.cat([w.flatten() for w in want])).norm() / flat.norm())


@pytest.fixture(scope="module")
def fixed() -> str:
    result = fix_source(TRAIN.encode(), Path("train.py"), Settings())
    (outcome,) = result.outcomes
    assert outcome.applied and outcome.site.code == "GA003", outcome.reason
    text = result.after.decode()
    assert "engine.backward(loss * window_share)" in text
    assert 'print(f"epoch {epoch} step {step} loss {loss.item():.4f}")' in text  # the log keeps
    return text


WORLD, PER_RANK = 2, 2 * K  # two ranks, two whole windows each


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory, fixed, helper_fixed) -> dict[str, list]:
    """The original, its fix and the helper's fix (below), trained on the same two ranks."""
    sources = {"original": TRAIN, "patched": fixed, "helper": helper_fixed}
    return run(tmp_path_factory.mktemp("two_ranks"), sources, WORLD, PER_RANK, epochs=1)


def windows_of_both_ranks() -> list[list[dict]]:
    data = [batches(r, PER_RANK) for r in range(WORLD)]
    return [[b for rank in data for b in rank[w * K : (w + 1) * K]] for w in range(PER_RANK // K)]


def test_each_step_of_the_fixed_loop_is_the_windows_token_mean(on_two_ranks):
    """On two ranks (one rank: the next test), each step of the patched loop is the token mean
    of its window over both ranks; the original's is not."""
    windows = windows_of_both_ranks()
    original, patched = on_two_ranks["original"], on_two_ranks["patched"]
    assert len(original) == len(patched) == len(windows)
    for before, after, window in zip(original, patched, windows, strict=True):
        want = token_mean_gradient([window])
        assert distance(after, want) < 1e-4
        assert distance(before, want) > 1e-2  # the bug the fix removes


def test_a_window_an_epoch_cuts_in_two_keeps_the_original_weight(tmp_path, fixed):
    """Six micro-batches an epoch and K = 4: the second step's window ends one epoch and opens
    the next; each part is a token mean weighing half, as its micro-batches do in the
    original."""
    per_rank = 6
    epoch = batches(0, per_rank)
    patched = run(tmp_path, {"patched": fixed}, 1, per_rank, epochs=2)["patched"]
    assert len(patched) == 3
    assert distance(patched[0], token_mean_gradient([epoch[:4]])) < 1e-4
    assert distance(patched[1], token_mean_gradient([epoch[4:], epoch[:2]])) < 1e-4
    assert distance(patched[2], token_mean_gradient([epoch[2:]])) < 1e-4


def test_the_fix_reads_deepspeeds_own_window_boundary(fixed):
    assert flat(
        "if (engine.micro_steps + len(pending)) % engine.gradient_accumulation_steps() == 0:"
    ) in flat(fixed)
    assert "torch.distributed.all_reduce(total)" in fixed


# The loss helper builds the targets itself (from the batch's ids and its mask of prompt and
# padding), so the reader asks it for its count alone (`count_only=True`): an unsafe fix.
HELPER = TRAIN.replace(
    """def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}
""",
    """def compute_loss(engine, batch):
    device = engine.device
    labels = batch["input_ids"].clone()
    labels[batch["labels"] == -100] = -100
    return engine(input_ids=batch["input_ids"].to(device), labels=labels.to(device)).loss
""",
).replace(
    """            batch = to_device(batch, engine.device)
            loss = engine(**batch).loss
""",
    """            loss = compute_loss(engine, batch)
""",
)


@pytest.fixture(scope="module")
def helper_fixed() -> str:
    result = fix_source(HELPER.encode(), Path("train.py"), Settings(), unsafe=True)
    assert result.outcomes[0].applied, result.outcomes[0].reason
    patched = result.after.decode()
    assert "compute_loss(engine, batch, count_only=True)" in patched
    return patched


def test_a_helper_asked_for_its_count_alone_makes_each_step_the_windows_token_mean(
    on_two_ranks,
):
    """On two ranks, each step of the loop whose helper counts its own targets ahead is the
    token mean of its window over both ranks."""
    steps = on_two_ranks["helper"]
    assert len(steps) == PER_RANK // K
    for step, window in zip(steps, windows_of_both_ranks(), strict=True):
        assert distance(step, token_mean_gradient([window])) < 1e-4


ENGINE = FIXTURES / "ga003_deepspeed_json_config.py"  # K in ds_config_zero2.json beside it


@pytest.fixture(scope="module")
def verified_on_one_process(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list]:
    """One `gaaudit verify` run (its replays share one start-up) over the engine's loop, a
    Trainer's, and the engine's loop logging its gradient norm (a copy, beside its config)."""
    logging = tmp_path_factory.mktemp("logging") / ENGINE.name
    logged = "model_engine.step()\n            print(optimizer._global_grad_norm)"
    logging.write_text(ENGINE.read_text().replace("model_engine.step()", logged))
    shutil.copy(ENGINE.with_name("ds_config_zero2.json"), logging.parent)
    trainer = FIXTURES / "ga004_labels_branch_old_signature.py"
    paths = (ENGINE, trainer, logging)
    result = gaaudit("verify", "-k", "4", "--format", "json", *map(str, paths))
    return result, json.loads(result.stdout)


def test_verify_replays_the_engine_loop_apart_and_proves_its_fix(verified_on_one_process):
    """On one process the replays run in a process kept apart, with a gloo group of one: the
    process that replays the next file has none, so a Trainer replayed there is not taken for
    a distributed run."""
    result, (engine_file, trainer_file, _) = verified_on_one_process
    (loop,) = engine_file["loops"]
    assert loop["header"] == "for step, batch in enumerate(loader):"
    (row,) = loop["rows"]
    assert row["original_verdict"] == REPRODUCED and row["original_error"] > 0.1, row
    assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row
    assert [loop["verdict"] for loop in trainer_file["loops"]] == [REPRODUCED]
    assert result.returncode == 1  # the Trainer's loop, whose fix is not verified


def test_a_loop_that_logs_the_engines_gradient_norm_replays(verified_on_one_process):
    """InternImage logs `optimizer._global_grad_norm`, which DeepSpeed's optimizers keep,
    after each `engine.step()`: the replay's optimizer has it, so the loop reaches its step."""
    _, (_, _, logging_file) = verified_on_one_process
    (loop,) = logging_file["loops"]
    (row,) = loop["rows"]
    assert row["original_verdict"] == REPRODUCED and row["original_error"] > 0.1, row


def test_verify_replays_the_engine_loop_on_the_ranks():
    """Two processes: on the ranks' group, the engine averaging the gradients over them (and
    each whole-window replay of the original, on one process, apart again)."""
    result = gaaudit("verify", "--distributed", "2", "-k", "4", "--format", "json", str(ENGINE))
    assert result.returncode == 0, result.stderr[-2000:]
    (loop,) = json.loads(result.stdout)["loops"]
    for row in loop["rows"]:
        assert row["original_verdict"] == REPRODUCED and row["original_error"] > 0.1, row
        assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row
        assert row["processes"] == 2


ACCELERATE = """\
from accelerate import Accelerator
from transformers import GPT2LMHeadModel


def main(net: GPT2LMHeadModel, optimizer, loader, epochs):
    accelerator = Accelerator()
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    net, optimizer = accelerator.prepare(net, optimizer)
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            loss = net(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
"""
LAUNCHED = {  # `accelerate launch` with a DeepSpeed config of K = 4, as its environment says
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(K),
    "ACCELERATE_GRADIENT_CLIPPING": "1e9",  # no clipping: 0 reads as unset, then 1.0
}


@pytest.mark.parametrize(
    ("requirements", "safe"),
    [
        ("torch==1.13.1\naccelerate\n", True),  # accelerate from 1.8 on needs torch 2.0
        ("accelerate==0.34.2\n", True),
        ("torch>=2.0\naccelerate>=0.34\n", False),
        ("", False),
    ],
)
def test_accelerates_deepspeed_read_ahead_is_safe_where_the_project_keeps_accelerate_before_1_8(
    tmp_path, monkeypatch, requirements, safe
):
    """The read-ahead assumes accelerate before 1.8: a safe fix where the project's
    requirements admit no later release, directly or through torch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "requirements.txt").write_text(requirements)
    (tmp_path / "train.py").write_text(ACCELERATE)
    (outcome,) = fix_source(ACCELERATE.encode(), tmp_path / "train.py", Settings()).outcomes
    assert outcome.applied is safe
    assert safe or "pin `accelerate<1.8` in the project's requirements" in outcome.reason


def test_accelerates_deepspeed_window_is_read_ahead_where_the_engine_ends_it(tmp_path):
    """accelerate launched with DeepSpeed (one process: on CPU accelerate builds no group of
    its own): before 1.8 its `backward` let the engine end each window of K micro-batches, and
    the unsafe fix's steps are the windows' token means; from 1.8 on (installed here) every
    micro-batch is a step of its own, which is why the fix is unsafe."""
    (outcome,) = fix_source(ACCELERATE.encode(), Path("train.py"), Settings()).outcomes
    assert not outcome.applied and "assumes accelerate before 1.8" in outcome.reason
    fixed = fix_source(ACCELERATE.encode(), Path("train.py"), Settings(), unsafe=True).after
    assert b"accelerator.backward(loss * window_share)" in fixed
    data = batches(0, 2 * K)
    before = {**LAUNCHED, "GA_ACCELERATE_BEFORE_1_8": "1"}
    sources = {"original": ACCELERATE, "patched": fixed.decode()}
    original, patched = run(tmp_path / "before", sources, 1, 2 * K, 1, **before).values()
    assert len(original) == len(patched) == 2
    for old, new, window in zip(original, patched, (data[:K], data[K:]), strict=True):
        want = token_mean_gradient([window])
        assert distance(new, want) < 1e-4
        assert distance(old, want) > 1e-2  # the bug the fix removes
    assert (
        len(run(tmp_path / "installed", {"original": ACCELERATE}, 1, K, 1, **LAUNCHED)["original"])
        == K
    )


# Trainer subclasses of fixtures, each trained one step under DeepSpeed (stage 0, K = 4) in turn
# on one gloo process: the gradients each one's optimizer steps on (lr 0) are saved.
TRAINER_WORKER = """\
import sys
from pathlib import Path

import deepspeed.ops
import torch
from gaaudit.harness.trainer import arguments, collate, examples, tiny_model, trainer_class

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo, no kernel to compile
jobs = sys.argv[1:]  # each fixture, its class's name and where its gradients go
steps = []


class Recording(torch.optim.SGD):
    def step(self, closure=None):
        steps.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        return super().step(closure)


engine = {"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": "auto"}
engine["train_micro_batch_size_per_gpu"] = "auto"
engine["gradient_clipping"] = "auto"  # the arguments' 0.0: no clipping (the engine's own: 1.0)
for fixture, name, out in zip(jobs[::3], jobs[1::3], jobs[2::3], strict=True):

    class Recorded(trainer_class(Path(fixture).read_text(), fixture, name)):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = Recording((model or self.model).parameters(), lr=0.0)
            return self.optimizer

    steps.clear()
    args = arguments(out, 4, deepspeed=engine)
    data = examples(8, 0)
    Recorded(model=tiny_model(), args=args, train_dataset=data, data_collator=collate).train()
    assert len(steps) == 1, steps
    torch.save(steps[0], out + ".pt")
"""

FLAG = '**({"scale_wrt_gas": False} if self.is_deepspeed_enabled else {})'
WITHHOLDS = FIXTURES / "ga004_training_step_withholds_count"
DOUBLE_DIVISION = FIXTURES / "ga004_training_step_double_division"


def noiseless(suffix: str) -> str:
    """The double division's fixture without the hook's noise: the same loss each run."""
    source = DOUBLE_DIVISION.with_suffix(suffix).read_text()
    return source.replace("noise_alpha = 5.0", "noise_alpha = 0")


@pytest.fixture(scope="module")
def steps_under_deepspeed(tmp_path_factory) -> dict[str, list]:
    """The step under DeepSpeed of each Trainer the two tests below compare, all in one process:
    the step that withholds the count (as written, fixed, fixed without the flag), and the
    double division without its noise (as written, fixed)."""
    tmp_path = tmp_path_factory.mktemp("trainers")
    fixed = WITHHOLDS.with_suffix(".fixed.py").read_text()
    assert FLAG in fixed
    (tmp_path / "unflagged.py").write_text(fixed.replace(FLAG, ""))
    runs = {
        "withholds": (WITHHOLDS.with_suffix(".py"), "DocReaderTrainer"),
        "withholds.fixed": (WITHHOLDS.with_suffix(".fixed.py"), "DocReaderTrainer"),
        "unflagged": (tmp_path / "unflagged.py", "DocReaderTrainer"),
    }
    for suffix in (".py", ".fixed.py"):
        path = tmp_path / f"noiseless{suffix}"
        path.write_text(noiseless(suffix))
        runs[path.stem] = (path, "NoisyEmbeddingTrainer")
    worker = tmp_path / "worker.py"
    worker.write_text(TRAINER_WORKER)
    jobs = [str(a) for key, (path, name) in runs.items() for a in (path, name, tmp_path / key)]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29731",
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(worker), *jobs],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return {key: torch.load(tmp_path / f"{key}.pt") for key in runs}


def full_batch_gradient(source: str, filename: str, name: str, tmp_path: Path) -> list:
    """The gradient of the class's `compute_loss` over all eight examples at once."""
    net = tiny_model()
    loss_of = trainer_class(source, filename, name)
    loss_of(model=net, args=arguments(str(tmp_path / "reference"), 4)).compute_loss(
        net, collate(examples(8, 0))
    ).backward()
    return snapshot(net.parameters())


def test_a_step_handed_the_count_tells_deepspeed_not_to_divide_again(
    tmp_path, steps_under_deepspeed
):
    """Issue 17, item 3, under DeepSpeed: the step copied from an older Trainer hands the
    engine each micro-batch's mean, which it divides by K (mean/K); the fixed step hands it
    the token sum over the window's count with `scale_wrt_gas=False`, as the stock step
    does: the full batch's gradient. Without that flag the engine divides by K again."""
    original = WITHHOLDS.with_suffix(".py")
    reference = full_batch_gradient(
        original.read_text(), str(original), "DocReaderTrainer", tmp_path
    )
    errors = {
        key: relative_error(steps_under_deepspeed[key], reference)
        for key in ("withholds", "withholds.fixed", "unflagged")
    }
    assert errors["withholds"] > 0.1, errors
    assert errors["withholds.fixed"] < 1e-5, errors
    assert errors["unflagged"] == pytest.approx(0.75, abs=1e-3), errors  # divided by K twice


def test_a_guarded_division_tells_deepspeed_not_to_divide_again(tmp_path, steps_under_deepspeed):
    """The step that divides the count-normalised loss by K once more, fixed: the division is
    kept only where the stock step divides, and DeepSpeed, which divides by K itself unless
    told not to, is told so, as the stock step of 4.49 and later tells it. The original gives
    the full batch's gradient over K * K under DeepSpeed; the fixed step the gradient itself."""
    name = "NoisyEmbeddingTrainer"
    reference = full_batch_gradient(noiseless(".py"), "noiseless.py", name, tmp_path)
    original, fixed = (
        relative_error(steps_under_deepspeed[key], reference)
        for key in ("noiseless", "noiseless.fixed")
    )
    assert original == pytest.approx(1 - 1 / 16, abs=1e-3), original
    assert fixed < 1e-5, fixed
