"""The DDP check: two gloo processes on CPU, unequal token counts per rank."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from gaaudit.harness.distributed import ddp_check


def _tokens(batch):
    return (batch["labels"][..., 1:] != -100).sum()  # HF causal LMs shift inside


def sum_and_count(model, batches, optimizer, k):
    """GA-GUIDE section 4, plain DDP: all-reduce N on every rank, scale by P / N_global."""
    n_global = sum(_tokens(batch) for batch in batches)
    dist.all_reduce(n_global)
    for i, batch in enumerate(batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            loss = model(**batch).loss * _tokens(batch)
            (loss * dist.get_world_size() / n_global).backward()
    optimizer.step()


def mean_over_k(model, batches, optimizer, k):
    for i, batch in enumerate(batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            (model(**batch).loss / k).backward()
    optimizer.step()


def never_steps(model, batches, optimizer, k):
    for batch in batches:
        model(**batch).loss.backward()


def test_ddp_sum_and_count_matches_the_global_full_batch_and_mean_over_k_does_not():
    correct, buggy, silent = ddp_check([sum_and_count, mean_over_k, never_steps], k=2)
    assert correct.reason == "" and correct.error < 1e-5
    assert buggy.error > 1e-3
    assert silent.error is None and "without an optimizer step" in silent.reason
