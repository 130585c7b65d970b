"""Lightning replay: a LightningModule of the user's file, trained by a real Lightning Trainer
with `accumulate_grad_batches` = K for one optimizer step, and by another over the same K
micro-batches as one batch (K = 1); the gradients when each optimizer is about to step are
compared. The module is the one `--model-factory` returns, else the class built with no
arguments; the micro-batches are `--data-factory`'s, else the harness's prompt-masked rows of
varied length (of one length for data of fixed-length blocks), as a collated dict each."""

from __future__ import annotations

import contextlib
import logging
import tempfile

import torch
from torch.utils.data import DataLoader

from gaaudit.harness.factory import concatenate, current, current_data
from gaaudit.harness.gradcheck import judged, relative_error, snapshot
from gaaudit.harness.trainer import (
    MICRO,
    collate,
    examples,
    failed,
    quietly,
    trainer_class,
    widest,
)

LOGGERS = ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning.fabric")


def _framework(cls: type):
    """The package whose LightningModule `cls` subclasses (`lightning.pytorch` or
    `pytorch_lightning`): its Trainer and Callback are the ones that run the module."""
    import importlib

    base = next(c for c in cls.__mro__ if c.__name__ == "LightningModule")
    return importlib.import_module(base.__module__.rsplit(".core", 1)[0])


def _callback(lightning):
    class GradientsAtStep(lightning.Callback):
        """Copies every gradient the optimizer's first step used: after the module's own
        `on_before_optimizer_step` (where a patched module divides by its window's count),
        which runs after the callbacks' hooks."""

        def __init__(self) -> None:
            self.grads: list[torch.Tensor] | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            def record(optimizer, args, kwargs) -> None:
                if self.grads is None:
                    self.grads = snapshot(pl_module.parameters())

            for optimizer in trainer.optimizers:
                optimizer.register_step_post_hook(record)

    return GradientsAtStep()


def _module(cls: type):
    """A fresh module under one seed: the user's factory's, else `cls()`."""
    torch.manual_seed(0)
    user = current()
    if user is not None:
        return user.build()
    try:
        return cls()
    except Exception as exc:  # noqa: BLE001 - the user's constructor: say what would do
        raise TypeError(
            f"`{cls.__name__}()` cannot be built here ({type(exc).__name__}: {exc}): pass your "
            "module with --model-factory"
        ) from None


def _micro_batches(k: int, seed: int, fixed: bool) -> list:
    data = current_data()
    if data is not None:
        return data.window(k, seed)
    rows = examples(k * MICRO, seed, fixed=fixed)
    width = widest(rows)  # one width: the full batch joins them
    return [collate(rows[i * MICRO : (i + 1) * MICRO], width) for i in range(k)]


def _step(cls: type, batches: list, k: int, device) -> list[torch.Tensor]:
    """The gradient when a Lightning Trainer accumulating `k` batches first steps."""
    lightning = _framework(cls)
    module = _module(cls)
    if not module.automatic_optimization:
        raise TypeError(
            f"`{cls.__name__}` optimises manually (automatic_optimization = False): its window "
            "is its own loop's, which the Lightning replay does not read"
        )
    capture = _callback(lightning)
    with tempfile.TemporaryDirectory() as directory:
        trainer = lightning.Trainer(
            accelerator="gpu" if torch.device(device).type == "cuda" else "cpu",
            devices=1,
            max_steps=1,
            accumulate_grad_batches=k,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=directory,
            callbacks=[capture],
        )
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    if capture.grads is None:
        raise RuntimeError("the Lightning Trainer's optimizer never stepped")
    return capture.grads


def compare(source: str, filename: str, name: str, k: int, seed: int, device, fixed: bool) -> dict:
    """The row of one LightningModule class for one K: its error against one full-batch step,
    with its verdict (`original_verdict`, `verdict`)."""
    row: dict = {"k": k, "original_error": None, "patched_error": None}
    with quietly(), _quiet():
        try:
            cls = trainer_class(source, filename, name)
            batches = _micro_batches(k, seed, fixed)
            want = _step(cls, [concatenate(batches)], 1, device)
            error = row["original_error"] = relative_error(_step(cls, batches, k, device), want)
            row["original_verdict"] = judged(error, torch.float32)
        except Exception as exc:  # noqa: BLE001 - the user's module, reported as the reason
            row["original_verdict"] = failed(exc)
    row["verdict"] = row["original_verdict"]
    return row


@contextlib.contextmanager
def _quiet():
    """Lightning's own log lines (devices, tips) held back for the replay."""
    loggers = [logging.getLogger(name) for name in LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
