"""Names the rules recognise, shared by the libcst analysis and the `ast` screen (no libcst here)."""

from __future__ import annotations

import re

# An optimizer's name: `optimizer`, `opt_g`, or its algorithm's (`adam`, `muon_opt`, `sgd`).
OPTIMIZER = re.compile(
    r"(^|_)opt|optim|(^|_)(adam|adamw|sgd|muon|lion|lamb|adafactor|sophia|shampoo|soap|rmsprop)"
    r"($|_|\d)"
)
BACKWARDS = ("backward", "manual_backward")
# Methods that step an optimizer: torch's `step`, and `step_and_update_lr` of the `ScheduledOptim`
# wrapper that Transformer and FastSpeech code copies (its learning rate set, then the step).
STEPS = frozenset({"step", "step_and_update_lr"})
CLIPPERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")  # torch.nn.utils
# torch.distributed.pipelining schedules: after the last backward of a step they divide the
# gradients by `n_microbatches`, unless built with `scale_grads=False`.
# fmt: off
TORCH_SCHEDULES = frozenset({
    "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
    "PipelineScheduleSingle", "PipelineScheduleMulti",
})
# Functions that run the training loop around a forward-step function of the file: Megatron's
# `pretrain` (its schedule divides each micro-batch's loss by their number) and
# SwissArmyTransformer's `training_main` (DeepSpeed's `engine.backward` divides it by K).
LOOP_RUNNERS = frozenset({"pretrain", "training_main"})
# DeepSpeed's PipelineModule takes a loss_fn too
PIPELINE_CLASSES = TORCH_SCHEDULES | {"PipelineModule"} | LOOP_RUNNERS

# The parameter `gaaudit fix` gives a function that backpropagates a micro-batch for its caller:
# asked, it returns its loss and count, and the caller divides the window's gradients once.
RETURN_COUNT = "return_count"

# Calls that start a distributed runtime, and the packages whose collectives the fixes write.
DISTRIBUTED_STARTS = frozenset({"init_distributed", "init_process_group"})
GATHERED_PACKAGES = frozenset({"torch", "accelerate", "lightning", "deepspeed"})
TRAINER_MODULES = ("transformers.", "trl.")  # a `...Trainer` qualified under these is one

# Default names of accumulation divisors; extend with `accumulation-names` in the config.
ACCUMULATION_NAMES = frozenset({
    "gradient_accumulation_steps", "grad_accum_steps", "grad_accumulation_steps",
    "accumulation_steps", "accum_steps", "accum_iter", "accum_iters", "grad_accum",
    "gradient_accumulation", "accumulate_grad_batches", "ga_steps", "num_accumulation_steps",
    "n_accum", "accum", "accumulate", "grad_acc_steps", "micro_steps", "num_micro_batches",
    "n_microbatches", "num_microbatches", "n_micro_batches", "n_micro", "num_micro", "microbatches",
    "accum_grad", "accum_grad_n_steps", "grad_accum_every", "gradient_accumulate_every",
    "accum_freq",
})
# fmt: on


def matched_names(configured: frozenset[str]) -> frozenset[str]:
    """The default accumulation names and the configured ones, lowercased: a name matches in
    any case (a module constant `ACCUMULATION_STEPS`)."""
    return frozenset(name.lower() for name in ACCUMULATION_NAMES | configured)


# A modulo by an accumulation name: `% accum_iter`, `% (self.cfg.accum_iter)`, `% a["k"].accum`.
# The literal `%` first lets the search skip at memory speed.
WINDOW_GUARD = re.compile(
    rb"%[ \t]*\(?[ \t]*(?:[A-Za-z_]\w*(?:\[[^\]\n]*\])?\.)*(?:"
    + b"|".join(sorted((n.encode() for n in ACCUMULATION_NAMES), key=len, reverse=True))
    + rb")(?!\w)"
)


def window_guards(data: bytes) -> list[int]:
    """Where `data` takes a modulo by an accumulation name (`% accum_iter`, `% args.k`): a
    window's step guard, in a file whose backward may hide in a callable handed the loss
    (MAE's `loss_scaler(loss, optimizer, update_grad=...)`)."""
    return [match.start() for match in WINDOW_GUARD.finditer(data)] if b"%" in data else []


def steps_optimizer(receiver: str, positional: int) -> bool:
    """Whether `<receiver>.step(...)` (or another of `STEPS`) with `positional` positional
    arguments is an optimizer step: `optimizer.step()`, `opt.step()`, `scaler.step(optimizer)`;
    never a scheduler's."""
    receiver = receiver.lower()
    if "sched" in receiver:
        return False
    return bool(OPTIMIZER.search(receiver)) or ("scaler" in receiver and positional == 1)


# Functions that move a batch's tensors to a device and keep its structure (accelerate's
# `send_to_device`, the common `to_device(batch, device)` helper): a count read through one
# is the batch's, and a replay that cannot import one moves the batch itself.
MOVERS = frozenset(
    ("to_device", "move_to_device", "send_to_device", "batch_to_device", "to_cuda", "move_to_cuda")
)
