"""Step time of a training loop before and after `gaaudit fix`, on the harness model.

    python benchmarks/step_overhead.py [--device cpu|cuda] [--rounds N] [--windows N] [-k K]

The loop below (mean loss divided by K, as users write it) is rewritten by gaaudit's own
fixer into sum-and-count: one token count per micro-batch, a multiplication of the loss by
it, and one division of the gradients per window. Both loops train copies of the tiny GPT-2
of `gaaudit.harness` on the same padded micro-batches with AdamW. Rounds alternate between
them, so that drift of the machine's speed hits both alike, and each round compares the
two. On the CPU torch runs one thread and the time is that thread's CPU time, so that other
jobs on a shared machine disturb the figures less; on a GPU it is wall time. Prints the median time per window of each, and the median and quartiles of
the patched loop's extra time per round. Needs `pip install 'gaaudit[verify]'`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

ORIGINAL = """
from transformers import AutoModelForCausalLM


def train(model: AutoModelForCausalLM, train_dataloader, optimizer, gradient_accumulation_steps):
    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss / gradient_accumulation_steps
        loss.backward()
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def patched_source() -> str:
    """ORIGINAL as `gaaudit fix --unsafe-fixes --min-confidence low` rewrites it."""
    from gaaudit.config import Settings
    from gaaudit.findings import Confidence
    from gaaudit.fixes.fixer import fix_source

    result = fix_source(
        ORIGINAL.encode(), Path("loop.py"), Settings(min_confidence=Confidence.LOW), True
    )
    if not result.changed:
        raise SystemExit("step_overhead: gaaudit fix left the benchmark loop unchanged")
    return result.after.decode()


def loop(source: str):
    namespace: dict = {}
    exec(compile(source, "loop.py", "exec"), namespace)  # noqa: S102 - our own loop, not user code
    return namespace["train"]


WARM_UP = 3  # rounds not timed


def measure(device: str, rounds: int, windows: int, k: int) -> dict[str, list[float]]:
    """Seconds per window of the original and the patched loop, round by round."""
    import torch

    from gaaudit.harness.data import make_window
    from gaaudit.harness.models import build_model

    trains = {"original": loop(ORIGINAL), "patched": loop(patched_source())}
    base = build_model("causal").to(device)
    models = {name: copy.deepcopy(base) for name in trains}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    batches = []
    for seed in range(windows):
        batches += (
            make_window("causal", k, micro_batch_size=8, seed=seed, max_len=64).to(device).micro
        )
    clock = time.perf_counter
    if device == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time
    times: dict[str, list[float]] = {name: [] for name in trains}
    for number in range(WARM_UP + rounds):
        order = list(trains) if number % 2 else list(reversed(trains))
        for name in order:
            synchronize(device)
            started = clock()
            trains[name](models[name], batches, optimizers[name], k)
            synchronize(device)
            if number >= WARM_UP:
                times[name].append((clock() - started) / windows)
    return times


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def table(results: dict[str, dict[str, list[float]]], k: int) -> list[str]:
    lines = [
        (
            f"| device | original loop (ms/window, K={k}) | patched loop (ms/window) "
            "| extra time, median of rounds | quartiles |"
        ),
        "|---|---:|---:|---:|---|",
    ]
    for device, times in results.items():
        original, patched = times["original"], times["patched"]
        extra = sorted(p / o - 1 for o, p in zip(original, patched))
        low, median, high = statistics.quantiles(extra, n=4)
        lines.append(
            f"| {device} | {statistics.median(original) * 1e3:.2f} "
            f"| {statistics.median(patched) * 1e3:.2f} | {median:+.2%} | {low:+.2%} .. {high:+.2%} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", action="append", help="cpu, cuda [default: cpu, and cuda if any]"
    )
    parser.add_argument(
        "--rounds", type=int, default=30, help="timed rounds per loop [default: 30]"
    )
    parser.add_argument("--windows", type=int, default=8, help="windows per round [default: 8]")
    parser.add_argument("-k", type=int, default=4, help="micro-batches per window [default: 4]")
    args = parser.parse_args()
    print("\n".join(run(args.device, args.rounds, args.windows, args.k)))


def run(devices: list[str] | None, rounds: int, windows: int, k: int) -> list[str]:
    """The table's lines for `devices` (default: the CPU, and CUDA when there is one)."""
    import torch

    devices = devices or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    return table({device: measure(device, rounds, windows, k) for device in devices}, k)


if __name__ == "__main__":
    main()
