"""Loops that `gaaudit fix` rewrote, run on real torch against one full-batch step of the same
data: a batch cut into slices (in a file that imports torch as `th`), a next batch fetched
between the forward and the backward, a loss scaler that steps out of sight (its windows read
ahead), and a backward on two branches (`model.no_sync()` on
all but the last micro-batch, real DDP on a gloo process group); then generated loops of every
division form (a GradScaler's included), window shape and loss source, with and without a
log after the backward, at K = 4 and K = 1, and in a file that imports torch.distributed (run
in a gloo process group); the generated loops again on a GPU (NCCL) where one is present. Each original with K > 1 misses the full batch's gradient; each
patched loop matches it and logs what the original logged; the correct twin matches too."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import FIXTURES, devices, on_cuda, two_processes

from gaaudit.config import Settings
from gaaudit.fixes.fixer import fix_source

BATCH, MICRO, WIDTH = 8, 3, 5  # slices of 3, 3 and 2
K, VOCAB, LENGTH, ROWS = 4, 11, 6, 2


class Recording(torch.optim.SGD):
    """Keeps the gradients its first step sees."""

    def step(self, closure=None):
        if not hasattr(self, "seen"):
            self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def loaded(name: str = "", source: str = "") -> dict:
    """The names a fixture (or the given source) defines, run as a module."""
    path = FIXTURES / name if name else None
    namespace: dict = {}
    text = path.read_text() if path else source
    exec(compile(text, str(path or "train.py"), "exec"), namespace)  # noqa: S102
    return namespace


def error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - r).flatten() for g, r in zip(grads, reference)])
    return float(diff.norm() / torch.cat([r.flatten() for r in reference]).norm())


@pytest.fixture(params=["single", "gloo"])
def process_group(request, tmp_path):
    """No process group, or one of a single process: gloo, or NCCL where a GPU is present."""
    if request.param != "single":
        dist.init_process_group(
            request.param, init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
        )
    yield request.param
    if dist.is_initialized():
        dist.destroy_process_group()


# --- a batch cut into slices, each slice's weighted mean backpropagated ---------------------


class Diffusion:
    """Per-example squared errors of the model's prediction, as a diffusion's losses."""

    def training_losses(self, model, x, t, model_kwargs):
        return {"loss": ((model(x) - model_kwargs["target"]) ** 2).mean(dim=1) * t}


class Sampler:
    def sample(self, n, device):
        return torch.ones(n, device=device), torch.ones(n, device=device)


def slices_step(name: str, use_fp16: bool | None = None) -> list[torch.Tensor]:
    """The gradients the loop's optimizer steps with; with `use_fp16`, of a loop that builds
    its own optimizer over fp32 master copies (replaced by a recording one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    if use_fp16 is None:
        optimizer = Recording(model.parameters(), lr=0.0)
        loop = loaded(name)["TrainLoop"](model, Diffusion(), Sampler(), optimizer, MICRO)
    else:
        loop = loaded(name)["TrainLoop"](model, Diffusion(), Sampler(), MICRO, use_fp16)
        optimizer = loop.opt = Recording(loop.master, lr=0.0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    loop.run_step(x, {"target": torch.randn(BATCH, WIDTH, generator=generator)})
    return optimizer.seen


def slices_full_batch() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    target = torch.randn(BATCH, WIDTH, generator=generator)
    ((model(x) - target) ** 2).mean(dim=1).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return [p.grad for p in model.parameters()]


def test_patched_slices_step_with_the_full_batch_mean(process_group):
    reference = slices_full_batch()
    assert error(slices_step("ga002_microbatch_slices_weighted_mean.py"), reference) > 0.1
    assert error(slices_step("ga002_microbatch_slices_weighted_mean.fixed.py"), reference) < 1e-6
    assert error(slices_step("ok_microbatch_slices_weighted_share.py"), reference) < 1e-6


@pytest.mark.parametrize("use_fp16", [False, True], ids=["fp32", "loss-scaled"])
def test_patched_loss_scaled_slices_step_with_the_full_batch_mean(process_group, use_fp16):
    """Each branch weighted, the loss-scaled one times its scale, and the gradients divided
    where they accumulate (the model's), not in the master copies the optimizer steps."""
    name = "ga002_microbatch_slices_master_copies"
    reference = slices_full_batch()
    assert error(slices_step(f"{name}.py", use_fp16), reference) > 0.1
    assert error(slices_step(f"{name}.fixed.py", use_fp16), reference) < 1e-6


# --- token batches: micro-batches of padded targets, each with its own count ---------------


def token_batches(
    count: int, ignore: int, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches whose targets are padded with `ignore`: 2, 3, 4, 5, 5, ... targets a
    row, at least one of them after a causal shift (a window of 4 counts otherwise than the
    next 4, so a count of the wrong batch changes the window's total)."""
    generator = torch.Generator().manual_seed(2)
    out = []
    for i in range(count):
        x = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
        y = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
        y[:, min(2 + i, LENGTH - 1) :] = ignore
        out.append((x.to(device), y.to(device)))
    return out


class CausalLM(torch.nn.Module):
    """Logits for `model(x)`; for `model(input_ids=..., labels=...)` an output whose `.loss`
    is the token mean of the shifted labels, as HF causal LMs return."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))

    def forward(self, x=None, input_ids=None, labels=None):
        if labels is None:
            return self.net(x)
        logits = self.net(input_ids)[:, :-1]
        mean = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"loss": mean})


def full_batch(batches, ignore: int, clip: bool = False) -> list[torch.Tensor]:
    """The gradient of one step on `batches` joined into one batch."""
    model = CausalLM().to(batches[0][0].device)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=ignore).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return [p.grad for p in model.parameters()]


def prefetch_step(name: str) -> list[torch.Tensor]:
    # the prefetching loop draws one batch more than it uses
    model, batches = CausalLM(), iter(token_batches(K + 1, -1))
    optimizer = Recording(model.parameters(), lr=0.0)
    namespace = loaded(name)
    namespace["get_batch"] = lambda data, block_size, batch_size: next(batches)
    namespace["train"](model, optimizer, None, LENGTH, ROWS, K, max_iters=1)
    return optimizer.seen


def test_patched_prefetching_loop_counts_the_batch_its_loss_read():
    reference = full_batch(token_batches(K, -1), -1, clip=True)
    original = "ga002_prefetch_between_forward_and_backward.py"
    assert error(prefetch_step(original), reference) > 0.1
    assert error(prefetch_step(original.replace(".py", ".fixed.py")), reference) < 1e-6


def loss_scaler_step(name: str) -> tuple[list[float], list[torch.Tensor]]:
    """What MAE's engine logged, and the gradient its scaler stepped with."""
    model, logged = CausalLM(), []
    optimizer = Recording(model.parameters(), lr=0.0)
    namespace = loaded(name)
    scaler = namespace["NativeScaler"]()
    namespace["train_one_epoch"](model, token_batches(K, -100), optimizer, scaler, K, logged)
    return logged, optimizer.seen


def test_patched_loss_scaler_window_is_read_ahead():
    """The scaler backpropagates and steps out of sight: each micro-batch's mean weighted by
    its share of the window's tokens, counted ahead, steps like the full batch, and the loop
    logs what it logged."""
    reference = full_batch(token_batches(K, -100), -100)
    original = "ga001_loss_scaler_read_ahead.py"
    logged, grads = loss_scaler_step(original)
    assert error(grads, reference) > 0.1
    patched_logged, patched = loss_scaler_step(original.replace(".py", ".fixed.py"))
    assert error(patched, reference) < 1e-6 and patched_logged == logged


def scaled_optim_step(name: str) -> tuple[list[float], list[torch.Tensor]]:
    """What the wrapper's loop logged over two windows, and the gradient of its first step."""
    model, logged = CausalLM(), []
    optimizer = Recording(model.parameters(), lr=0.0)
    batches = [{"input_ids": x, "labels": y} for x, y in token_batches(K + 2, -100)]
    loaded(name)["finetune"](model, batches, optimizer, K, logged)
    return logged, optimizer.seen


def test_patched_loss_scaling_optimizer_window_is_read_ahead():
    """A wrapper that backpropagates the loss itself and unscales only inside its step has no
    gradients to divide before it: each micro-batch's mean weighted by its share of the
    window's tokens, counted ahead, steps like the full batch, and the loop logs the same
    token means."""
    model, window = CausalLM(), token_batches(K, -100)
    joined = [torch.cat(side) for side in zip(*window)]
    model(input_ids=joined[0], labels=joined[1]).loss.backward()  # the shifted labels' mean
    reference = [p.grad for p in model.parameters()]
    original = "ga002_loss_scaling_optimizer_backward.py"
    logged, grads = scaled_optim_step(original)
    assert error(grads, reference) > 0.1
    patched_logged, patched = scaled_optim_step(original.replace(".py", ".fixed.py"))
    assert error(patched, reference) < 1e-6 and patched_logged == logged


def no_sync_step(name: str) -> list[torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(CausalLM())
    optimizer = Recording(model.parameters(), lr=0.0)
    loaded(name)["train"](model, optimizer, token_batches(K, -1), K)
    return optimizer.seen


@pytest.mark.parametrize("process_group", ["gloo"], indirect=True)  # DDP's `no_sync()`
def test_patched_no_sync_branches_both_weighted(process_group):
    reference = full_batch(token_batches(K, -1), -1)
    original = "ga001_grad_division_no_sync_last_branch.py"
    assert error(no_sync_step(original), reference) > 0.1
    patched = no_sync_step(original.replace(".py", ".fixed.py"))
    assert error(patched, reference) < 1e-6


class TupleTagger(CausalLM):
    """Logits first in a tuple, as pytorch-transformers' models returned them."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.detach()


def both_branches_step(name: str, fp16: bool) -> tuple[float, list[torch.Tensor]]:
    model = TupleTagger()
    optimizer = Recording(model.parameters(), lr=0.0)
    batches = [{"input_ids": x, "labels": y} for x, y in token_batches(K, -100)]
    logged = loaded(name)["TaggingModel"]().train(model, batches, optimizer, K, fp16=fp16)
    return logged, optimizer.seen


@pytest.mark.parametrize("fp16", [False, True], ids=["float32", "autocast"])
def test_patched_helper_loss_is_counted_on_both_branches(fp16):
    """The loss comes from a method on both branches of `if fp16:`; the fix asks both for the
    count, so neither path meets an unbound name, and the patched loop logs what it logged."""
    reference = full_batch(token_batches(K, -100), -100)
    original = "ga001_helper_loss_on_both_branches.py"
    logged, grads = both_branches_step(original, fp16)
    patched_logged, patched = both_branches_step(original.replace(".py", ".fixed.py"), fp16)
    tolerance = 1e-2 if fp16 else 1e-6  # bfloat16 matmuls under autocast
    assert error(grads, reference) > 0.1
    assert error(patched, reference) < tolerance
    assert patched_logged == pytest.approx(logged, rel=tolerance)


def accelerate_step(name: str, cast_loss: bool) -> tuple[float, list[torch.Tensor]]:
    model = CausalLM()
    optimizer = Recording(model.parameters(), lr=0.0)
    logged = loaded(name)["train"](model, token_batches(K, -100), optimizer, K, cast_loss)
    return logged, optimizer.seen


@pytest.mark.parametrize("cast_loss", [False, True], ids=["as-is", "cast"])
def test_patched_accelerate_window_divides_after_either_branch(cast_loss):
    """accelerate's backward on two branches of an `if`: the one division follows the `if`,
    so the window is divided whichever branch backpropagates (it once followed the first
    branch's backward only, leaving the other branch's gradients sums)."""
    reference = generated_reference("model", K, "cpu")
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    original = "ga003_accelerate_backward_on_both_branches.py"
    logged, grads = accelerate_step(original, cast_loss)
    patched_logged, patched = accelerate_step(original.replace(".py", ".fixed.py"), cast_loss)
    assert error(grads, reference) > 0.1
    assert error(patched, reference) < 1e-6
    assert patched_logged == pytest.approx(logged)


# --- distillation: a model's token mean plus a KL divergence masked over the same labels -----


class Seq2Seq(torch.nn.Module):
    """For `model(input_ids=..., labels=...)`: logits at each target position and their token
    mean over the labels that are not -100, unshifted (a sequence-to-sequence model)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))

    def forward(self, input_ids, labels):
        logits = self.net(input_ids)
        mean = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Output", (), {"loss": mean, "logits": logits})


def distillation_step(name: str) -> tuple[list[dict], list[torch.Tensor]]:
    student, teacher = Seq2Seq(0), Seq2Seq(1)
    optimizer = Recording(student.parameters(), lr=0.0)
    batches = [{"input_ids": x, "labels": y} for x, y in token_batches(K, -100)]
    history = loaded(name)["distil"](student, teacher, batches, optimizer, K)
    return history, optimizer.seen


def test_patched_distillation_weights_its_one_token_mean_as_a_whole():
    """`0.5 * out.loss + w * kd`, `kd` a KL divergence a nested helper masks over the labels
    `out.loss` counts: one token mean, weighted whole by that count (it was refused as a mean
    plus another term), as the correct twin sums and counts; the logged metrics stay each
    micro-batch's means."""
    student, teacher = Seq2Seq(0), Seq2Seq(1)
    x = torch.cat([x for x, _ in token_batches(K, -100)])
    y = torch.cat([y for _, y in token_batches(K, -100)])
    out, guide = student(x, y), teacher(x, y)
    keep = (y >= 0).unsqueeze(-1)
    kl = F.kl_div(
        (out.logits / 2).log_softmax(-1), (guide.logits / 2).softmax(-1), reduction="none"
    )
    (0.5 * out.loss + 4 * (kl * keep).sum() / keep.sum()).backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    reference = [p.grad for p in student.parameters()]
    original = "ga003_accelerate_distillation_ce_plus_masked_kl.py"
    logged, grads = distillation_step(original)
    patched_logged, patched = distillation_step(original.replace(".py", ".fixed.py"))
    _, correct = distillation_step("ok_accelerate_distillation_sum_and_count.py")
    assert error(grads, reference) > 0.1
    assert error(patched, reference) < 1e-6
    assert error(correct, reference) < 1e-6
    assert [m["loss"] for m in patched_logged] == pytest.approx([m["loss"] for m in logged])


# --- a loss bound on two paths of an `if`, each a mean over a count of its own -------------


def frame_batches(masked: list[bool]) -> list[tuple]:
    """Micro-batches of frames, each kept wholly (no mask) or partly by a mask that keeps
    2, 3, 4, ... frames a row (`masked`)."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i, partly in enumerate(masked):
        frames = torch.randn(ROWS, LENGTH, WIDTH, generator=generator)
        targets = torch.randn(ROWS, LENGTH, generator=generator)
        keep = torch.zeros(ROWS, LENGTH) if partly else None
        if partly:
            keep[:, : 2 + i] = 1.0
        out.append((frames, targets, keep))
    return out


def per_path_step(name: str, batches: list[tuple]) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, 1)
    optimizer = Recording(model.parameters(), lr=0.0)
    return loaded(name)["train"](model, batches, optimizer, K), optimizer.seen


def per_path_full_batch(batches: list[tuple]) -> list[torch.Tensor]:
    """The gradient of the squared errors' mean over every kept frame of the window."""
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, 1)
    kept = [torch.ones_like(t) if keep is None else keep for _, t, keep in batches]
    errors = [(model(f).squeeze(-1) - t) ** 2 * k for (f, t, _), k in zip(batches, kept)]
    (sum(e.sum() for e in errors) / sum(k.sum() for k in kept)).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "original, twin",
    [
        # `if keep is not None: masked mean / else: plain mean`: each path binds its own count
        # before its loss (the plain one before the name is rebound to its mean)
        ("ga001_masked_or_plain_mean_per_path.py", "ok_masked_or_plain_sum_per_path.py"),
        # a helper binds a plain mean, then a masked one under an `if` with no `else`: the fix
        # binds a count before each inside the helper and returns the one of the path taken
        # (it once returned the masked path's count on both, a NameError where no mask came)
        ("ga001_helper_mean_rebound_on_one_path.py", "ok_helper_sum_and_count_on_each_path.py"),
    ],
    ids=["in-the-loop", "in-a-helper"],
)
@pytest.mark.parametrize(
    "masked",
    [[True, False, True, True], [True] * K, [False] * K],
    ids=["mixed", "masked", "unmasked"],
)
def test_patched_loss_on_two_paths_is_counted_on_each(original, twin, masked):
    """A loss bound on two paths, each over a count of its own: the window steps like the full
    batch whichever paths its micro-batches take, and the loop returns the running mean it
    returned."""
    batches = frame_batches(masked)
    reference = per_path_full_batch(batches)
    logged, grads = per_path_step(original, batches)
    patched_logged, patched = per_path_step(original.replace(".py", ".fixed.py"), batches)
    twin_logged, twin_grads = per_path_step(twin, batches)
    assert (error(grads, reference) > 0.1) == any(masked)  # equal counts when none is masked
    assert error(patched, reference) < 1e-6 and error(twin_grads, reference) < 1e-6
    assert patched_logged == pytest.approx(logged) == pytest.approx(twin_logged)


def nested_path_batches(paths: list[str]) -> list[tuple]:
    """Frame batches for the four paths of nested `if`s: each micro-batch masked ("m") or
    not, weighted per row ("w") or not ("mw": both)."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for (frames, targets, keep), path in zip(frame_batches(["m" in p for p in paths]), paths):
        weights = torch.rand(ROWS, generator=generator) + 0.5 if "w" in path else None
        out.append((frames, targets, keep, weights))
    return out


def nested_path_full_batch(batches: list[tuple]) -> list[torch.Tensor]:
    """The gradient of the weighted squared errors' sum over every kept frame of the window,
    divided by the number of kept frames."""
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, 1)
    total, count = 0.0, 0.0
    for frames, targets, keep, weights in batches:
        keep = torch.ones_like(targets) if keep is None else keep
        weights = torch.ones(ROWS) if weights is None else weights
        errors = (model(frames).squeeze(-1) - targets) ** 2
        total, count = total + (errors * keep * weights[:, None]).sum(), count + keep.sum()
    (total / count).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "paths",
    [["m", "", "mw", "w"], ["mw", "m", "mw", "w"], ["", "", "", ""]],
    ids=["every-path", "mixed", "unmasked"],
)
def test_patched_loss_on_nested_paths_is_counted_on_each(paths):
    """Four paths of nested `if`s in a `with` block, each a mean over its own count: each binds
    its count, so the window steps like the full batch whichever paths it takes, and the
    running loss it returns is the original's."""
    batches = nested_path_batches(paths)
    reference = nested_path_full_batch(batches)
    original = "ga001_loss_on_nested_paths.py"
    logged, grads = per_path_step(original, batches)
    patched_logged, patched = per_path_step(original.replace(".py", ".fixed.py"), batches)
    assert (error(grads, reference) > 0.1) == any(p != "" for p in paths)
    assert error(patched, reference) < 1e-6
    assert patched_logged == pytest.approx(logged)


# --- every division form, window shape and loss source, with and without a log --------------

FORMS = {  # how the loop divides by K and backpropagates
    "divide": ("loss = loss / accum_steps\n", "loss.backward()\n"),
    "divide-at-backward": ("", "(loss / accum_steps).backward()\n"),
    "scaler": ("loss = loss / accum_steps\n", "scaler.scale(loss).backward()\n"),
    "no-division": ("", "loss.backward()\n"),
}
LOSSES = {  # an explicit token loss (made a sum), and a causal LM's `.loss` (weighted)
    "cross-entropy": "loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)\n",
    "model": "loss = model(input_ids=x, labels=y).loss\n",
}
HEADER = (
    "import torch\nimport torch.nn.functional as F\nfrom transformers import AutoModelForCausalLM\n\n\n"
    "def train(model, batches, optimizer, accum_steps, logged, scaler):\n"
)


def generated(form: str, window: str, loss: str, log: bool, distributed: bool = False) -> str:
    divide, backward = FORMS[form]
    body = LOSSES[loss] + divide + backward + ("logged.append(loss.item())\n" if log else "")
    step = "optimizer.step()\noptimizer.zero_grad()\n"
    if form == "scaler":
        step = "scaler.step(optimizer)\nscaler.update()\n" + step.replace("optimizer.step()\n", "")
    if window == "modulo":
        loop = "for step, (x, y) in enumerate(batches):\n" + textwrap.indent(body, "    ")
        loop += "    if (step + 1) % accum_steps == 0:\n" + textwrap.indent(step, "        ")
    else:
        loop = "for start in range(0, len(batches), accum_steps):\n"
        loop += "    for x, y in batches[start : start + accum_steps]:\n"
        loop += textwrap.indent(body, "        ") + textwrap.indent(step, "    ")
    header = HEADER.replace("import torch\n", "import torch\nimport torch.distributed as dist\n", 1)
    return (header if distributed else HEADER) + textwrap.indent(loop, "    ")


def generated_run(source: str, k: int, device: str) -> tuple[list[float], list[torch.Tensor]]:
    """What the loop logged, and the gradient of its first step."""
    model = CausalLM().to(device)
    optimizer = Recording(model.parameters(), lr=0.0)
    logged: list[float] = []
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
    batches = token_batches(K, -100, device)
    loaded(source=source)["train"](model, batches, optimizer, k, logged, scaler)
    return logged, optimizer.seen


def generated_reference(loss: str, k: int, device: str) -> list[torch.Tensor]:
    """The gradient of one step on the first `k` micro-batches joined into one batch."""
    batches = token_batches(k, -100, device)
    if loss != "model":
        return full_batch(batches, -100)
    model = CausalLM().to(device)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    model(input_ids=x, labels=y).loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("k", [K, 1])
@pytest.mark.parametrize("log", [False, True], ids=["quiet", "logged"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("window", ["modulo", "micro-loop"])
@pytest.mark.parametrize("form", FORMS)
def test_every_generated_loop_fixed_steps_with_the_full_batch_and_logs_the_same(
    form, window, loss, log, k, device
):
    """At K = 4 and at K = 1, where the fix's names must be bound as well."""
    source = generated(form, window, loss, log)
    patched = fix_source(source.encode(), Path("train.py"), Settings(), False).after.decode()
    assert patched != source
    reference = generated_reference(loss, k, device)
    logged, grads = generated_run(source, k, device)
    patched_logged, patched_grads = generated_run(patched, k, device)
    assert error(grads, reference) > 0.1 if k > 1 else error(grads, reference) < 1e-6
    assert error(patched_grads, reference) < 1e-6
    assert patched_logged == pytest.approx(logged, rel=1e-5) and len(logged) == K * log


@pytest.mark.parametrize("process_group", ["gloo", on_cuda("nccl")], indirect=True)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("window", ["modulo", "micro-loop"])
@pytest.mark.parametrize("form", FORMS)
def test_generated_loops_of_a_distributed_file_gather_their_count(
    process_group, form, window, loss
):
    """A file that imports torch.distributed gets the count all-reduced under
    `dist.is_initialized()`: run in a process group (gloo on CPU; NCCL on a GPU, where the
    count must be a tensor on the model's device), the patched loop still matches the full
    batch and logs what the original logged."""
    device = "cuda" if process_group == "nccl" else "cpu"
    source = generated(form, window, loss, log=True, distributed=True)
    patched = fix_source(source.encode(), Path("train.py"), Settings(), False).after.decode()
    assert "dist.all_reduce(window_" in patched
    reference = generated_reference(loss, K, device)
    logged, _ = generated_run(source, K, device)
    patched_logged, patched_grads = generated_run(patched, K, device)
    assert error(patched_grads, reference) < 1e-6
    assert patched_logged == pytest.approx(logged, rel=1e-5)


# --- a short last window that goes on into the next epoch ------------------------------------

EPOCHS = """
import torch.nn.functional as F


def train(model, batches, optimizer, accum_steps, epochs):
    for epoch in range(epochs):
        for step, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
            loss = loss / accum_steps
            loss.backward()
            if (step + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
"""


class EveryStep(torch.optim.SGD):
    """Keeps the gradients each of its steps sees."""

    def step(self, closure=None):
        grads = [p.grad.clone() for p in self.param_groups[0]["params"]]
        self.seen = [*getattr(self, "seen", []), grads]


def epochs_second_step(source: str) -> list[torch.Tensor]:
    """Six micro-batches an epoch, K = 4: the gradient of the second epoch's first step."""
    model = CausalLM()
    optimizer = EveryStep(model.parameters(), lr=0.0)
    loaded(source=source)["train"](model, token_batches(6, -100), optimizer, K, 2)
    return optimizer.seen[1]


@pytest.mark.parametrize("reset", [False, True], ids=["carried", "cleared"])
def test_patched_window_spanning_epochs_counts_its_tail(reset):
    """Where no `zero_grad` clears the gradients between epochs, the first epoch's last two
    micro-batches stay in the next epoch's first window, and so must their count: the fix
    starts the count before the epoch loop. Where an epoch starts with a `zero_grad`, the
    count starts with it."""
    source = EPOCHS
    if reset:
        source = EPOCHS.replace(
            "        for step", "        optimizer.zero_grad()\n        for step"
        )
    patched = fix_source(source.encode(), Path("train.py"), Settings(), False).after.decode()
    batches = token_batches(6, -100)
    reference = full_batch(batches[:4] if reset else batches[4:] + batches[:4], -100)
    assert error(epochs_second_step(source), reference) > 0.1
    assert error(epochs_second_step(patched), reference) < 1e-6


def epochs_steps(source: str, length: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    """What the loop logged over two epochs of `length` micro-batches, and each step's
    gradients."""
    model, logged = CausalLM(), []
    optimizer = EveryStep(model.parameters(), lr=0.0)
    namespace = loaded(source=source)
    namespace["fit"](
        model, token_batches(length, -100), optimizer, namespace["FlaggedScaler"](), K, 2, logged
    )
    return logged, optimizer.seen


def epochs_windows(length: int, tail: str) -> list[list[torch.Tensor]]:
    """The token mean's gradient of each window the original steps on over two epochs: an
    epoch's short last window "dropped" (each epoch clears the gradients first), "stepped"
    alone, or "carried" into the next epoch's first."""
    batches, windows, pending = token_batches(length, -100), [], []
    for _ in range(2):
        pending = [] if tail == "dropped" else pending
        for index, batch in enumerate(batches):
            pending.append(batch)
            if (index + 1) % K == 0 or (tail == "stepped" and index == length - 1):
                windows.append(full_batch(pending, -100))
                pending = []
    return windows


def test_a_window_carried_across_epochs_makes_the_read_ahead_unsafe():
    """Two epochs of 10 micro-batches at K = 4: the original's third window is the first
    epoch's last 2 and the second's first 4. Reading ahead per epoch counts those as two
    windows, so the fix is unsafe; it is right where every epoch holds whole windows (8),
    and, safe, where each epoch clears the gradients first (its short last window dropped)
    or steps at its last micro-batch."""
    name = "ga001_read_ahead_window_carried_across_epochs"
    source, patched = ((FIXTURES / f"{name}{end}").read_text() for end in (".py", ".fixed.py"))
    (outcome,) = fix_source(source.encode(), Path("x.py"), Settings(), False).outcomes
    assert not outcome.applied and "goes on into the next pass's first" in outcome.reason
    logged, original = epochs_steps(source, 10)
    carried = epochs_windows(10, "carried")
    assert max(error(g, r) for g, r in zip(original, carried)) > 0.1
    patched_logged, fixed = epochs_steps(patched, 10)
    assert patched_logged == logged and len(fixed) == len(carried) == 4
    assert error(fixed[2], carried[2]) > 0.1  # the carried window, weighed as two
    assert all(error(fixed[i], carried[i]) < 1e-6 for i in (0, 1, 3))
    _, whole = epochs_steps(patched, 8)
    assert len(whole) == 4 and all(
        error(g, r) < 1e-6 for g, r in zip(whole, epochs_windows(8, "carried"))
    )
    clearing = source.replace(
        "        for index,", "        optimizer.zero_grad()\n        for index,"
    )
    result = fix_source(clearing.encode(), Path("x.py"), Settings(), False)
    assert result.outcomes[0].applied, result.outcomes[0].reason
    _, cleared = epochs_steps(result.after.decode(), 10)
    windows = epochs_windows(10, "dropped")
    assert len(cleared) == len(windows) == 4
    assert all(error(g, r) < 1e-6 for g, r in zip(cleared, windows))
    step = "(index + 1) % accumulation == 0"
    ending = source.replace(step, f"({step} or index == len(loader) - 1)")
    result = fix_source(ending.encode(), Path("x.py"), Settings(), False)
    assert result.outcomes[0].applied, result.outcomes[0].reason  # no window goes on
    _, stepped = epochs_steps(result.after.decode(), 10)
    windows = epochs_windows(10, "stepped")
    assert len(stepped) == len(windows) == 6
    assert all(error(g, r) < 1e-6 for g, r in zip(stepped, windows))


# --- a GradScaler loop on two processes: one reference count for all ranks -------------------

TWO_RANKS_LIMIT = 120  # seconds; a hung rendezvous fails this test, not the suite


def _scaled_rank(rank: int, source: str, rendezvous: str, out: str) -> None:
    """One of two gloo ranks running `source`'s loop over its own micro-batches (the even
    or the odd ones), DDP averaging their gradients; rank 0 saves what its step saw."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(CausalLM())
    optimizer = Recording(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    batches = token_batches(2 * K, -100)[rank::2]
    loaded(source=source)["train"](model, batches, optimizer, K, [], scaler)
    if rank == 0:
        torch.save(optimizer.seen, out)
    dist.barrier()
    dist.destroy_process_group()


def two_rank_gradients(source: str, tmp_path: Path) -> list[torch.Tensor]:
    out = tmp_path / f"grads{len(list(tmp_path.iterdir()))}.pt"
    rendezvous = tmp_path / f"{out.stem}.rendezvous"
    ranks = two_processes(_scaled_rank, (source, str(rendezvous), str(out)))
    deadline = time.monotonic() + TWO_RANKS_LIMIT
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two gloo ranks did not finish within {TWO_RANKS_LIMIT} s")
    return torch.load(out)


def test_a_scaled_loop_on_two_ranks_matches_the_full_batch_of_both(tmp_path):
    """The count is summed over the ranks and their number folded in (DDP averages); under a
    GradScaler each micro-batch is also weighted by its count over the window's first count,
    to keep fp16 magnitudes: that reference must be the same on every rank (here their first
    micro-batches count differently), or the ranks' sums are mixed at different scales and
    no one division undoes it."""
    source = generated("scaler", "modulo", "cross-entropy", log=False, distributed=True)
    patched = fix_source(source.encode(), Path("train.py"), Settings(), False).after.decode()
    reference = generated_reference("cross-entropy", 2 * K, "cpu")
    assert error(two_rank_gradients(source, tmp_path), reference) > 0.1
    assert error(two_rank_gradients(patched, tmp_path), reference) < 1e-6


def test_patched_window_counts_only_the_micro_batches_it_backpropagates():
    """A micro-batch whose loss spikes is left out (`if not spike: loss.backward()`): the
    patched window counts its tokens only where its gradient is, so it steps like the full
    batch of the micro-batches kept."""
    batches = token_batches(K, -100)
    with torch.no_grad():
        model = CausalLM()
        losses = [
            F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).item()
            for x, y in batches
        ]
    second, highest = sorted(losses)[-2:]
    limit = (highest + second) / 2  # the spike: only the highest is left out
    reference = full_batch([b for b, loss in zip(batches, losses) if loss < limit], -100)
    grads = {}
    for name in (
        "ga001_backward_skipped_on_loss_spike.py",
        "ga001_backward_skipped_on_loss_spike.fixed.py",
    ):
        model = CausalLM()
        optimizer = Recording(model.parameters(), lr=0.0)
        loaded(name)["train"](model, batches, optimizer, K, limit)
        grads[name] = optimizer.seen
    original, patched = grads.values()
    assert error(original, reference) > 0.1
    assert error(patched, reference) < 1e-6


def micro_step_method_run(name: str) -> tuple[float, float, float]:
    """What `train_step` and `evaluate` return, and the error of the gradient the step sees
    against the full batch's: rows with prompts of different lengths, micro-batches of 2."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    response = torch.arange(LENGTH) >= torch.arange(BATCH)[:, None] % (LENGTH - 1)
    model = CausalLM()
    optimizer = Recording(model.parameters(), lr=0.0)
    tuner = loaded(name)["ResponseTuner"](model, optimizer, micro_size=2, max_norm=1e6)
    logged = tuner.train_step(inputs, targets, response)
    evaluated = tuner.evaluate(inputs, targets, response)
    model.zero_grad()
    losses = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
    mask = response.flatten().float()
    ((losses * mask).sum() / mask.sum()).backward()
    return logged, evaluated, error(optimizer.seen, [p.grad for p in model.parameters()])


def test_patched_micro_step_method_weights_its_backward_and_the_caller_divides_once():
    """A method backpropagates each micro-batch's mean over K and its caller steps once after
    the loop: asked for its count, the method backpropagates the micro-batch's sum and the
    caller divides the window once, so the step sees the full batch's token mean; the logged
    running total and the evaluation (which asks for no count) stay what they were."""
    original = "ga001_backward_in_micro_step_method.py"
    logged, evaluated, before = micro_step_method_run(original)
    patched_logged, patched_evaluated, after = micro_step_method_run(
        original.replace(".py", ".fixed.py")
    )
    assert before > 0.1 and after < 1e-6
    assert (patched_logged, patched_evaluated) == pytest.approx((logged, evaluated), rel=1e-6)
