"""Loops that `gaaudit fix` rewrote, run on real torch against one full-batch step of the same
data: a batch cut into slices (in a file that imports torch as `th`), a next batch fetched
between the forward and the backward, and a backward on two branches (`model.no_sync()` on
all but the last micro-batch, real DDP on a gloo process group). Each original misses the
full batch's gradient; each patched loop matches it, and the correct twin does too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import FIXTURES

BATCH, MICRO, WIDTH = 8, 3, 5  # slices of 3, 3 and 2
K, VOCAB, LENGTH, ROWS = 4, 11, 6, 2


class Recording(torch.optim.SGD):
    """Keeps the gradients the step sees."""

    def step(self, closure=None):
        self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def loaded(name: str) -> dict:
    namespace: dict = {}
    path = FIXTURES / name
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102
    return namespace


def error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - r).flatten() for g, r in zip(grads, reference)])
    return float(diff.norm() / torch.cat([r.flatten() for r in reference]).norm())


@pytest.fixture(params=["single", "gloo"])
def process_group(request, tmp_path):
    if request.param == "gloo":
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
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


def slices_step(name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = Recording(model.parameters(), lr=0.0)
    loop = loaded(name)["TrainLoop"](model, Diffusion(), Sampler(), optimizer, MICRO)
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


# --- token batches: micro-batches of padded targets (-1), each with its own count -----------


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    out = []
    for i in range(2 * K + 1):  # the prefetching loop draws one batch more than it uses
        x = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
        y = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
        y[:, 1 + i % (LENGTH - 1) :] = -1  # a count of its own in each micro-batch
        out.append((x, y))
    return out


def tiny_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def full_batch(batches, clip: bool) -> list[torch.Tensor]:
    model = tiny_lm()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-1).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return [p.grad for p in model.parameters()]


def prefetch_step(name: str) -> list[torch.Tensor]:
    model, batches = tiny_lm(), iter(token_batches())
    optimizer = Recording(model.parameters(), lr=0.0)
    namespace = loaded(name)
    namespace["get_batch"] = lambda data, block_size, batch_size: next(batches)
    namespace["train"](model, optimizer, None, LENGTH, ROWS, K, max_iters=1)
    return optimizer.seen


def test_patched_prefetching_loop_counts_the_batch_its_loss_read():
    reference = full_batch(token_batches()[:K], clip=True)
    original = "ga002_prefetch_between_forward_and_backward.py"
    assert error(prefetch_step(original), reference) > 0.1
    assert error(prefetch_step(original.replace(".py", ".fixed.py")), reference) < 1e-6


def no_sync_step(name: str) -> list[torch.Tensor]:
    model = torch.nn.parallel.DistributedDataParallel(tiny_lm())
    optimizer = Recording(model.parameters(), lr=0.0)
    loaded(name)["train"](model, optimizer, token_batches()[:K], K)
    return optimizer.seen


@pytest.mark.parametrize("process_group", ["gloo"], indirect=True)  # DDP's `no_sync()`
def test_patched_no_sync_branches_both_weighted(process_group):
    reference = full_batch(token_batches()[:K], clip=False)
    original = "ga001_grad_division_no_sync_last_branch.py"
    assert error(no_sync_step(original), reference) > 0.1
    patched = no_sync_step(original.replace(".py", ".fixed.py"))
    assert error(patched, reference) < 1e-6
