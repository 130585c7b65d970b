"""A fix under fp16 autocast and a GradScaler keeps the original's magnitude (issue 17, item 6).

Weighting each micro-batch's mean by its token count makes the backward's loss thousands of
times larger; fp16 activation gradients then overflow, and the GradScaler skips the step and
halves its scale. The fix weights by the count over the window's first count instead, and
divides by the same ratio at the step. Real torch on CPU: fp16 autocast, `torch.amp.GradScaler`;
and a real Accelerator and Fabric, whose fp16 backward scales the same way.
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest
import torch

from gaaudit.config import Settings
from gaaudit.fixes.fixer import fix_source

LOOP = textwrap.dedent(
    """\
    import torch
    import torch.nn.functional as F


    def train(model, batches, optimizer, scaler, accum_steps):
        for step, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            scaler.scale(loss / accum_steps).backward()
            if (step + 1) % accum_steps == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    """
)
K, MICRO, LENGTH, VOCAB, SCALE = 4, 4, 24, 16, 2.0**17


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(K):
        x = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=generator)
        y = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=generator)
        y[:, : int(torch.randint(1, LENGTH - 1, (1,), generator=generator))] = -100
        out.append((x, y))
    return out


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def run(source: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The GradScaler's scale after one window, and the unscaled gradients it stepped with."""
    namespace: dict = {}
    exec(compile(source, "train.py", "exec"), namespace)  # noqa: S102
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    grads: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    namespace["train"](net, batches(), optimizer, scaler, K)
    return scaler.get_scale(), grads[0] if grads else {}


def test_the_fix_under_a_grad_scaler_keeps_the_scale_and_matches_the_full_batch():
    patched = fix_source(LOOP.encode(), Path("train.py"), Settings(), False).after.decode()
    assert "(micro_tokens / window_reference)" in patched
    by_count = patched.replace("(micro_tokens / window_reference)", "micro_tokens").replace(
        "div_(window_tokens / window_reference)", "div_(window_tokens)"
    )
    assert run(LOOP)[0] == SCALE
    assert run(by_count)[0] < SCALE  # an overflow: the step was skipped, the scale halved
    scale, grads = run(patched)
    assert scale == SCALE
    net, data = model(), batches()
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
    for name, param in net.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-2, atol=1e-4), name


LOOPS = {  # a framework whose fp16 backward runs a GradScaler, its precision set at run time
    "accelerate": textwrap.dedent(
        """\
        import torch.nn.functional as F
        from accelerate import Accelerator


        def train(model, batches, optimizer, accum_steps, precision):
            accelerator = Accelerator(
                gradient_accumulation_steps=accum_steps, mixed_precision=precision, cpu=True
            )
            model, optimizer = accelerator.prepare(model, optimizer)
            for x, y in batches:
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        """
    ),
    "fabric": textwrap.dedent(
        """\
        import torch.nn.functional as F
        from lightning.fabric import Fabric


        def train(model, batches, optimizer, accum_steps, precision):
            fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
            model, optimizer = fabric.setup(model, optimizer)
            for step, (x, y) in enumerate(batches):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
                fabric.backward(loss / accum_steps)
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    ),
}
PRECISION = {
    "accelerate": ("accelerate", "Accelerator", "no"),
    "fabric": ("lightning.fabric", "Fabric", "32-true"),
}


def backed(framework: str, source: str, monkeypatch) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses handed to the framework's `backward`, and the gradients of the first step."""
    module, name, precision = PRECISION[framework]
    cls = getattr(importlib.import_module(module), name)
    handed: list[float] = []
    backward = getattr(cls.backward, "__wrapped__", cls.backward)

    def recording(self, loss, *args, **kwargs):
        handed.append(float(loss.detach()))
        return backward(self, loss, *args, **kwargs)

    recording.__wrapped__ = backward  # the next run records only its own losses
    monkeypatch.setattr(cls, "backward", recording)
    namespace: dict = {}
    exec(compile(source, "train.py", "exec"), namespace)  # noqa: S102
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    grads: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    )
    namespace["train"](net, batches(), optimizer, K, precision)
    return handed, grads[0]


@pytest.mark.parametrize("framework", LOOPS)
def test_a_framework_that_may_train_in_fp16_keeps_the_magnitude(framework, monkeypatch):
    """accelerate's and Fabric's fp16 backward run a GradScaler: where the precision is
    chosen at run time (or is fp16), each micro-batch is weighted by its count over the
    window's first count, so what reaches `backward` stays near the original's loss, not
    its count times that; and the step still matches the full batch (run here in fp32 on
    CPU, where neither has a GradScaler)."""
    source = LOOPS[framework]
    patched = fix_source(source.encode(), Path("train.py"), Settings(), False).after.decode()
    assert "(micro_tokens / window_reference)" in patched
    by_count = patched.replace("(micro_tokens / window_reference)", "micro_tokens").replace(
        "window_tokens / window_reference /", "window_tokens /"
    )
    original, _ = backed(framework, source, monkeypatch)
    weighted, grads = backed(framework, patched, monkeypatch)
    counted, counted_grads = backed(framework, by_count, monkeypatch)
    bound = 4 * K * max(original)
    assert max(weighted) < bound < max(counted) / 5
    net, data = model(), batches()
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
    for name, param in net.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-4, atol=1e-6), name
        assert torch.allclose(counted_grads[name], param.grad, rtol=1e-4, atol=1e-6), name
