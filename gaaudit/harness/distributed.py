"""DDP check: run a loop function on 2 CPU processes (gloo) with unequal token counts per rank
and compare the all-reduced gradient with one full batch of every rank's data."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gaaudit.harness.data import collate, make_records, split_window
from gaaudit.harness.gradcheck import (
    RecordingOptimizer,
    StepReached,
    deterministic,
    full_batch_grads,
    relative_error,
)
from gaaudit.harness.models import build_model, count_tokens

# loop(model, batches, optimizer, k): `model` is wrapped in DistributedDataParallel, `batches`
# are this rank's k micro-batches (dicts), `optimizer.step()` ends the run.
Loop = Callable[[torch.nn.Module, list, torch.optim.Optimizer, int], None]


@dataclass(frozen=True)
class DDPResult:
    """One loop: the relative error of rank 0's gradient at its step, or why there is none."""

    error: float | None
    reason: str = ""


def _rank_records(kind: str, k: int, world_size: int, micro_batch_size: int, seed: int):
    """All samples, sorted by length so that the ranks see very different token counts."""
    records = make_records(kind, k * world_size * micro_batch_size, seed)
    records.sort(key=lambda r: len(r["input_ids"]))
    size = k * micro_batch_size
    return records, [records[r * size:(r + 1) * size] for r in range(world_size)]


def _worker(rank, world_size, loops, kind, k, micro_batch_size, seed, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _, shards = _rank_records(kind, k, world_size, micro_batch_size, seed)
        batches = split_window(kind, shards[rank], k).micro
        for index, loop in enumerate(loops):
            with deterministic(seed, torch.device("cpu")):
                model = torch.nn.parallel.DistributedDataParallel(build_model(kind, seed))
                optimizer = RecordingOptimizer(model.parameters())
                try:
                    loop(model, batches, optimizer, k)
                    outcome = "the loop returned without an optimizer step"
                except StepReached:
                    outcome = optimizer.grads
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    outcome = f"{type(exc).__name__}: {exc}"
            if rank == 0:
                torch.save(outcome, Path(out_dir) / f"{index}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # results are saved; skip the seconds-long teardown of a torch interpreter


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ddp_check(loops: Sequence[Loop], *, k: int = 2, world_size: int = 2,
              micro_batch_size: int = 2, kind: str = "causal", seed: int = 0,
              timeout: float = 120.0) -> list[DDPResult]:
    """Run each loop (a picklable top-level function, see Loop) on `world_size` gloo processes
    and compare rank 0's gradient at its optimizer step with the global full batch."""
    records, shards = _rank_records(kind, k, world_size, micro_batch_size, seed)
    counts = [int(count_tokens(kind, collate(kind, shard))) for shard in shards]
    if len(set(counts)) == 1:
        raise ValueError(f"every rank holds {counts[0]} tokens; use another seed")
    with deterministic(seed, torch.device("cpu")):
        full = split_window(kind, records, 1)
        reference = full_batch_grads(build_model(kind, seed), full)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            context = mp.spawn(_worker, nprocs=world_size, join=False, args=(
                world_size, list(loops), kind, k, micro_batch_size, seed, out_dir))
            deadline = time.monotonic() + timeout
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.terminate()
                    return [DDPResult(None, f"timed out after {timeout:g} s")] * len(loops)
        except mp.ProcessRaisedException as exc:
            return [DDPResult(None, f"a rank failed: {exc}")] * len(loops)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        outcomes = [torch.load(Path(out_dir) / f"{i}.pt") for i in range(len(loops))]
    return [DDPResult(None, o) if isinstance(o, str) else DDPResult(relative_error(o, reference))
            for o in outcomes]
