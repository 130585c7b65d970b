"""What a user logs keeps its meaning after `gaaudit fix` (issue 17, item 1), on real torch.

A loop logs a running total of its divided loss; the fix weights what the backward sees and
leaves the name the log reads alone. Both loops run on the same weights and micro-batches
(prompt-masked targets, so token counts differ): the logged values are the same, and only
the patched gradient at the step is the full batch's token mean.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from gaaudit.config import Settings
from gaaudit.fixes.fixer import fix_source

LOOP = textwrap.dedent(
    """\
    import torch.nn.functional as F


    def train(model, batches, optimizer, accum_steps, logged):
        running_loss = 0.0
        for step, (x, y) in enumerate(batches):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100) / accum_steps
            loss.backward()
            running_loss += loss.item()
            if (step + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
                logged.append(running_loss)
                running_loss = 0.0
    """
)
K, MICRO, LENGTH, VOCAB = 4, 2, 12, 16


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2 * K):
        x = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=generator)
        y = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=generator)
        prompt = int(torch.randint(1, LENGTH - 1, (1,), generator=generator))
        y[:, :prompt] = -100  # a prompt of another length in each micro-batch
        out.append((x, y))
    return out


def run(source: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The logged values and the gradients at each optimizer step."""
    namespace: dict = {}
    exec(compile(source, "train.py", "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    logged: list[float] = []
    namespace["train"](model, batches(), optimizer, K, logged)
    return logged, grads


def full_batch() -> list[dict[str, torch.Tensor]]:
    """Each window's gradient as one batch: the token mean over all its micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    data, out = batches(), []
    for start in range(0, len(data), K):
        x = torch.cat([b[0] for b in data[start : start + K]])
        y = torch.cat([b[1] for b in data[start : start + K]])
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    difference = torch.cat([(got[n] - want[n]).flatten() for n in want])
    return float(difference.norm() / torch.cat([w.flatten() for w in want.values()]).norm())


def test_a_running_total_logs_the_same_values_and_only_the_gradient_changes():
    patched = fix_source(LOOP.encode(), Path("train.py"), Settings(), False).after.decode()
    assert patched != LOOP and "running_loss += loss.item()" in patched
    logged_before, grads_before = run(LOOP)
    logged_after, grads_after = run(patched)
    assert len(logged_after) == 2 and logged_after == logged_before
    reference = full_batch()
    assert min(error(g, r) for g, r in zip(grads_before, reference)) > 1e-2
    assert max(error(g, r) for g, r in zip(grads_after, reference)) < 1e-5
