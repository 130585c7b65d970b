"""The bug in numbers: mean/K against sum-and-count on the tiny GPT-2 (GA-GUIDE section 1)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gaaudit.harness.data import make_records, split_window
from gaaudit.harness.gradcheck import deterministic, full_batch_grads, relative_error, snapshot
from gaaudit.harness.models import build_model, count_tokens


@dataclass(frozen=True)
class DemoRow:
    """Relative gradient error against the full batch for one number of micro-batches."""

    k: int
    mean_over_k: float
    sum_and_count: float


def run_demo(ks: Iterable[int] = range(1, 33), seed: int = 0, max_len: int = 63) -> list[DemoRow]:
    """Split max(ks) sequences of random length 4..max_len (right-padded, labels -100 on
    padding) into K micro-batches for each K and accumulate both ways. The two ways weight the
    same micro-batch gradients (1/K each, or the micro-batch's tokens over the window's), so
    each micro-batch is backpropagated once; the full batch, the same for every K, once."""
    ks = list(ks)
    records = make_records("causal", max(ks), seed, min_len=4, max_len=max_len)
    rows = []
    with deterministic(seed, torch.device("cpu")):
        model = build_model("causal", seed)
        reference = full_batch_grads(model, split_window("causal", records, 1))
        for k in ks:
            window = split_window("causal", records, k)
            total = sum(count_tokens("causal", batch) for batch in window.micro)
            mean_over_k = [torch.zeros_like(g) for g in reference]
            summed = [torch.zeros_like(g) for g in reference]
            for batch in window.micro:
                model(**batch).loss.backward()
                share = count_tokens("causal", batch) / total
                for grad, by_k, by_tokens in zip(snapshot(model.parameters()), mean_over_k, summed):
                    by_k.add_(grad, alpha=1 / k)
                    by_tokens.add_(grad, alpha=share)
                model.zero_grad(set_to_none=True)
            rows.append(
                DemoRow(
                    k, relative_error(mean_over_k, reference), relative_error(summed, reference)
                )
            )
    return rows


def plot(rows: list[DemoRow], path: str) -> None:
    """Save a log-scale plot of both errors against K to `path` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'gaaudit[verify]'") from None
    figure, axes = pyplot.subplots(figsize=(6, 4))
    ks = [row.k for row in rows]
    # an exact match (error 0, as at K=1) cannot be drawn on a log scale
    axes.plot(ks, [max(r.mean_over_k, 1e-12) for r in rows], "o-", label="mean / K")
    axes.plot(ks, [max(r.sum_and_count, 1e-12) for r in rows], "s-", label="sum and count")
    axes.set(
        xlabel="micro-batches K",
        ylabel="relative gradient error",
        yscale="log",
        title="Gradient accumulation vs one full batch (tiny GPT-2)",
    )
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
