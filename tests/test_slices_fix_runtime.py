"""A batch cut into slices whose weighted means are backpropagated with no division, fixed by
`gaaudit fix` and run on real torch: the patched gradient at the step is the full batch's mean,
a short last slice included, also under a torch.distributed process group (gloo, one process)
in a file that imports torch as `th`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import FIXTURES

BATCH, MICRO, WIDTH = 8, 3, 5  # slices of 3, 3 and 2


class Diffusion:
    """Per-example squared errors of the model's prediction, as a diffusion's losses."""

    def training_losses(self, model, x, t, model_kwargs):
        return {"loss": ((model(x) - model_kwargs["target"]) ** 2).mean(dim=1) * t}


class Sampler:
    def sample(self, n, device):
        return torch.ones(n, device=device), torch.ones(n, device=device)


class Recording(torch.optim.SGD):
    def step(self, closure=None):
        self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def step_gradients(name: str) -> list[torch.Tensor]:
    namespace: dict = {}
    path = FIXTURES / name
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = Recording(model.parameters(), lr=0.0)
    loop = namespace["TrainLoop"](model, Diffusion(), Sampler(), optimizer, MICRO)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    loop.run_step(x, {"target": torch.randn(BATCH, WIDTH, generator=generator)})
    return optimizer.seen


def full_batch_gradients() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    target = torch.randn(BATCH, WIDTH, generator=generator)
    (((model(x) - target) ** 2).mean(dim=1)).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return [p.grad for p in model.parameters()]


def error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - r).flatten() for g, r in zip(grads, reference)])
    return float(diff.norm() / torch.cat([r.flatten() for r in reference]).norm())


@pytest.fixture(params=["single", "gloo"])
def process_group(request, tmp_path):
    if request.param == "gloo":
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
        )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_patched_slices_step_with_the_full_batch_mean(process_group):
    reference = full_batch_gradients()
    assert error(step_gradients("ga002_microbatch_slices_weighted_mean.py"), reference) > 0.1
    assert error(step_gradients("ga002_microbatch_slices_weighted_mean.fixed.py"), reference) < 1e-6
    assert error(step_gradients("ok_microbatch_slices_weighted_share.py"), reference) < 1e-6
