"""Megatron replay: the loss function a file's forward step hands Megatron's schedule
(`return output_tensor, partial(loss_func, loss_mask)`), called as the schedule calls it, on
the per-token losses of the harness's tiny language model, each micro-batch's loss divided by
the number of micro-batches before its backward (megatron/schedules.py), or, for a loss
function returning megatron-core's (sum, count, report), the sums divided once by the window's
count (`--calculate-per-token-loss`); compared with one step over the K micro-batches as one
batch. Megatron itself is not built: the file's imports that this environment lacks are
stand-ins (harness.stubs), `get_args()` gives the defaults of the project's
`megatron/arguments.py` (Megatron's global arguments, which `pretrain` sets up), and what the
forward step binds ahead of the output is the micro-batch's loss mask (a name holding `mask`)
or zero (an auxiliary loss that the tiny model does not have)."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from gaaudit.discover.modules import project_folders
from gaaudit.harness.analysis import argument_defaults
from gaaudit.harness.factory import concatenate, to_device
from gaaudit.harness.gradcheck import deterministic, judged, relative_error, snapshot
from gaaudit.harness.models import TinyTokenModel
from gaaudit.harness.stubs import Stub
from gaaudit.harness.trainer import failed, micro_batches, quietly, trainer_class


def _arguments(path: Path) -> dict[str, object]:
    """The defaults of the command-line arguments of the Megatron the file's project holds
    (`megatron/arguments.py` in the folders from the file's up to the project's root): what
    `get_args()` gives a run that passes none of them (`args.num_experts == [1]`)."""
    for folder in project_folders(path.resolve().parent):
        for candidate in (folder / "megatron" / "arguments.py", folder / "arguments.py"):
            if candidate.parent.name == "megatron" and candidate.is_file():
                with contextlib.suppress(OSError, SyntaxError, ValueError):
                    return argument_defaults(ast.parse(candidate.read_bytes()), every=True)
    return {}


def _losses(model: torch.nn.Module, batch: dict, bound: tuple[str, ...]) -> tuple[list, object]:
    """What the forward step hands the loss function for `batch`: the values bound ahead of
    the output, and the output, the per-token losses of the shifted labels (zero where a label
    is ignored, as Megatron's cross entropy over pad tokens is masked out by the loss mask)."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    output = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100
    ).view(labels.shape)
    mask = (labels != -100).float()
    zero = torch.zeros((), device=mask.device)
    return [mask if "mask" in name else zero for name in bound], output


def _gradient(loss_func, model, batches: list[dict], bound: tuple[str, ...]) -> list:
    """The gradient after the schedule's K backward passes, each of the loss over K; of a
    loss function returning megatron-core's (sum, count, report), as under
    `--calculate-per-token-loss`: the sums, divided once by the window's count."""
    model.zero_grad(set_to_none=True)
    tokens = None
    for batch in batches:
        values, output = _losses(model, batch, bound)
        returned = loss_func(*values, output)
        if isinstance(returned, tuple) and len(returned) == 3:
            returned[0].backward()
            tokens = returned[1] + (0 if tokens is None else tokens)
        else:
            loss = returned[0] if isinstance(returned, tuple) else returned
            (loss / len(batches)).backward()
    grads = snapshot(model.parameters())
    return grads if tokens is None else [g / tokens for g in grads]


def compare(
    source: str, filename: str, name: str, bound: tuple[str, ...], k: int, seed: int, device, fixed
) -> dict:
    """The row of the loss function `name` for one K: its error against one full-batch step,
    with its verdict; `fixed`: on rows of one length with nothing masked."""
    row: dict = {"k": k, "original_error": None, "patched_error": None}
    with quietly(), deterministic(seed, torch.device(device)):
        try:
            loss_func = trainer_class(source, filename, name, stand_ins=True)
            if "get_args" in loss_func.__globals__:  # set up by `pretrain`, which does not run
                arguments = Stub("get_args()", _arguments(Path(filename)))
                loss_func.__globals__["get_args"] = lambda: arguments
            batches = [to_device(batch, device) for batch in micro_batches(k, seed, fixed)]
            model = TinyTokenModel().to(device)
            want = _gradient(loss_func, model, [concatenate(batches)], bound)
            error = relative_error(_gradient(loss_func, model, batches, bound), want)
            row["original_error"] = error
            row["original_verdict"] = judged(error, torch.float32)
        except Exception as exc:  # noqa: BLE001 - the user's function, reported as the reason
            row["original_verdict"] = failed(exc)
    row["verdict"] = row["original_verdict"]
    return row
