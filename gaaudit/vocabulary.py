"""Names the rules recognise, shared by the libcst analysis and the `ast` screen (no libcst here)."""

from __future__ import annotations

import re

OPTIMIZER = re.compile(r"(^|_)opt|optim")
BACKWARDS = ("backward", "manual_backward")
# torch.distributed.pipelining schedules: after the last backward of a step they divide the
# gradients by `n_microbatches`, unless built with `scale_grads=False`.
# fmt: off
TORCH_SCHEDULES = frozenset({
    "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
    "PipelineScheduleSingle", "PipelineScheduleMulti",
})
PIPELINE_CLASSES = TORCH_SCHEDULES | {"PipelineModule"}  # DeepSpeed's takes a loss_fn too

TRAINER_MODULES = ("transformers.", "trl.")  # a `...Trainer` qualified under these is one

# Default names of accumulation divisors; extend with `accumulation-names` in the config.
ACCUMULATION_NAMES = frozenset({
    "gradient_accumulation_steps", "grad_accum_steps", "grad_accumulation_steps",
    "accumulation_steps", "accum_steps", "accum_iter", "accum_iters", "grad_accum",
    "gradient_accumulation", "accumulate_grad_batches", "ga_steps", "num_accumulation_steps",
    "n_accum", "accum", "accumulate", "grad_acc_steps", "micro_steps", "num_micro_batches",
    "n_microbatches", "num_microbatches", "n_micro_batches", "n_micro", "num_micro", "microbatches",
})
# fmt: on


def window_guards(data: bytes, names=ACCUMULATION_NAMES) -> list[int]:
    """Where `data` takes a modulo by an accumulation name (`% accum_iter`, `% args.k`): a
    window's step guard, in a file whose backward may hide in a callable handed the loss
    (MAE's `loss_scaler(loss, optimizer, update_grad=...)`). One search per name: a file
    without the name costs one scan at memory speed."""
    if b"%" not in data:
        return []
    found = []
    for name in names:
        needle = name.encode()
        at = data.find(needle)
        while at >= 0:
            if _after_modulo(data, at, len(needle)):
                found.append(at)
            at = data.find(needle, at + len(needle))
    return sorted(found)


def _after_modulo(data: bytes, at: int, length: int) -> bool:
    """Whether the name of `length` bytes at offset `at` is a whole word that a `%`
    precedes, through an opening parenthesis and an attribute chain (`% (cfg.accum_iter)`)."""
    if _WORD.match(data, at + length) or (at and _WORD.match(data, at - 1)):
        return False
    return _CHAIN.search(data, max(0, at - 80), at) is not None


_WORD = re.compile(rb"\w")
_CHAIN = re.compile(rb"%[ \t]*\(?[ \t]*(?:[A-Za-z_]\w*(?:\[[^\]\n]*\])?\.)*\Z")


def steps_optimizer(receiver: str, positional: int) -> bool:
    """Whether `<receiver>.step(...)` with `positional` positional arguments is an optimizer
    step: `optimizer.step()`, `opt.step()`, `scaler.step(optimizer)`; never a scheduler's."""
    receiver = receiver.lower()
    if "sched" in receiver:
        return False
    return bool(OPTIMIZER.search(receiver)) or ("scaler" in receiver and positional == 1)
