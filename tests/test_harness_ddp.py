"""`gaaudit verify --distributed N`: the fixer's output replayed on real gloo processes, each
rank with its own micro-batches (unequal token counts), against the global full batch."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict

import pytest
from conftest import FIXTURES, clipping_unfixed, devices, gaaudit

from gaaudit.commands.verify import REPRODUCED, VERIFIED, Options, _replay_all, targets

# Every fixture that trains under DistributedDataParallel is replayed on two processes.
DDP_FIXTURES = sorted(
    p
    for p in FIXTURES.glob("ga*.py")
    if not p.name.endswith(".fixed.py") and "DistributedDataParallel" in p.read_text()
)
# One target per image in chunks of one size: the mean/K is exact (GA-GUIDE section 3).
EXACT = {"ga001_ddp_no_sync_chunks"}
# A method its caller calls once per micro-batch, which the fix has return its count: each rank
# sums its counts, and the patched caller divides by the processes' total over their number.
COUNTED_BY_CALLER = FIXTURES / "ga001_split_batch_popped_mask.py"

NEVER_SYNCS = """
import torch.distributed as dist


def train(model, loader, optimizer, accumulation_steps):
    for step, batch in enumerate(loader):
        with model.no_sync():
            loss = model(**batch).loss / accumulation_steps
            loss.backward()
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize("device", devices(2))
def test_ddp_fixtures_are_proven_on_two_processes(tmp_path, device):
    """gloo on CPU; NCCL with one GPU per process on CUDA."""
    never_syncs = tmp_path / "never_syncs.py"
    never_syncs.write_text(textwrap.dedent(NEVER_SYNCS))
    assert {p.stem for p in DDP_FIXTURES} > EXACT
    paths = [*DDP_FIXTURES, COUNTED_BY_CALLER, never_syncs]
    result = gaaudit(
        "verify",
        "--distributed",
        "2",
        "-k",
        "2,4",
        "--device",
        device,
        "--format",
        "json",
        *map(str, paths),
    )
    assert "on 2 DDP processes" in result.stderr and "Traceback" not in result.stderr
    files = {entry["path"]: entry["loops"] for entry in json.loads(result.stdout)}
    for path in (*DDP_FIXTURES, COUNTED_BY_CALLER):
        (loop,) = files[path.as_posix()]
        for row in loop["rows"]:
            assert row["processes"] == 2 and row["k"] in (2, 4), row
            if path.stem in EXACT:
                assert row["original_verdict"] == VERIFIED and row["original_error"] < 1e-5, row
                continue
            assert row["original_verdict"] == REPRODUCED and row["original_error"] > 1e-3, row
            assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row
    (loop,) = files[never_syncs.as_posix()]
    assert all("did not all-reduce them" in row["verdict"] for row in loop["rows"]), loop
    assert result.returncode == 1  # one file is not verified


def test_rank_shards_hold_unequal_token_counts():
    from gaaudit.harness.analysis import analyse
    from gaaudit.harness.distributed import Ranks, _RankSession
    from gaaudit.harness.models import count_tokens

    source = (FIXTURES / "ga001_nanogpt_sft_padded.py").read_text()
    plan = analyse(source, 81)  # a nanoGPT-style loop: no transformers to import
    ranks = Ranks(2, "cpu")  # the processes start at the first replay only
    session = _RankSession(ranks, plan, 2, 2, 0, "cpu", "float32", 60.0, False)
    micro, ignore = session.window.micro, session.window.ignore_index
    assert len(micro) == 4 and session.per_rank == 2
    counts = [
        int(sum(count_tokens(plan.model_kind, b, ignore) for b in micro[r * 2 : r * 2 + 2]))
        for r in range(2)
    ]
    assert counts[0] != counts[1]


def replayed_in_one_process(original: str, patched: str) -> dict:
    job = {
        "original": original,
        "patched": patched,
        "targets": [asdict(t) for t in targets(original.encode(), patched.encode())],
        "options": asdict(Options(ks=(2,), device="cpu", timeout=60)),
        "filename": str(FIXTURES / "ga001_ddp_no_sync_chunks.py"),
    }
    (outcomes,) = _replay_all([job])
    ((row,),) = [outcome["rows"] for outcome in outcomes]
    return row


def test_the_fixed_ddp_loop_also_runs_in_one_process():
    """The fix guards its collectives with `dist.is_initialized()` (issue 17, item 2): the
    patched loop runs without a process group, and matches that process's full batch."""
    original = FIXTURES / "ga001_ddp_no_sync_chunks.py"
    patched = original.with_name("ga001_ddp_no_sync_chunks.fixed.py").read_text()
    assert "if dist.is_initialized():\n" in patched
    row = replayed_in_one_process(original.read_text(), patched)
    assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row


def test_a_ddp_loop_replayed_in_one_process_says_how_to_replay_it():
    """An unguarded collective (the user's own) needs a process group: the loop is replayed
    as the one rank of a group of its own, and the verdict says so and how to replay it on
    two. The group is the replay's only: the replays after it (a Trainer's) see no
    distributed run."""
    import torch.distributed as dist

    original = FIXTURES / "ga001_ddp_no_sync_chunks.py"
    patched = original.with_name("ga001_ddp_no_sync_chunks.fixed.py").read_text()
    unguarded = patched.replace("if dist.is_initialized():\n", "if True:\n", 1)
    row = replayed_in_one_process(original.read_text(), unguarded)
    assert row["verdict"] == VERIFIED and row["process_group"], row
    assert row["patched_error"] < 1e-5, row
    assert not dist.is_initialized()


def test_a_flagged_loop_left_unfixed_says_how_to_replay_its_collective(tmp_path):
    """A loop `fix` leaves as it is (clipping every micro-batch, its step counted in the body)
    whose own collective needs a process group: replayed as one rank of a group, the verdict
    says so and how to replay it on two, then that nothing was fixed."""
    source = clipping_unfixed()
    script = tmp_path / "train.py"
    script.write_text(
        source.replace(
            "        loss.backward()\n",
            "        loss.backward()\n        torch.distributed.all_reduce(loss.detach())\n",
            1,
        )
    )
    result = gaaudit("verify", str(script), "-k", "2", "--device", "cpu")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bug reproduced; nothing was fixed" in result.stdout, result.stdout
    assert (
        "replayed as the one rank of a process group, as the loop calls torch.distributed: "
        "--distributed 2 replays it on two" in result.stdout
    ), result.stdout
