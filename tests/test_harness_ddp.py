"""The DDP check: two gloo processes on CPU, unequal token counts per rank."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from gaaudit.harness.distributed import ddp_check


def _tokens(batch):
    return (batch["labels"] != -1).sum()  # nanoGPT targets are already shifted; -1 is ignored


def sum_and_count(model, batches, optimizer, k):
    """GA-GUIDE section 4, plain DDP: all-reduce N on every rank, scale by P / N_global."""
    n_global = sum(_tokens(batch) for batch in batches)
    dist.all_reduce(n_global)
    for i, batch in enumerate(batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            _, loss = model(batch["input_ids"], batch["labels"])
            (loss * _tokens(batch) * dist.get_world_size() / n_global).backward()
    optimizer.step()


def mean_over_k(model, batches, optimizer, k):
    for i, batch in enumerate(batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            _, loss = model(batch["input_ids"], batch["labels"])
            (loss / k).backward()
    optimizer.step()


def never_steps(model, batches, optimizer, k):
    for batch in batches:
        model(batch["input_ids"], batch["labels"])[1].backward()


def test_ddp_sum_and_count_matches_the_global_full_batch_and_mean_over_k_does_not():
    # the nanoGPT-style model keeps transformers out of the two worker processes (faster start)
    correct, buggy, silent = ddp_check([sum_and_count, mean_over_k, never_steps], k=2,
                                       kind="nanogpt")
    assert correct.reason == "" and correct.error < 1e-5
    assert buggy.error > 1e-3
    assert silent.error is None and "without an optimizer step" in silent.reason
