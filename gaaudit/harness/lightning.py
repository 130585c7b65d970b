"""Lightning replay: a LightningModule of the user's file, trained by a real Lightning Trainer
with `accumulate_grad_batches` = K for one optimizer step, and by another over the same K
micro-batches as one batch (K = 1); the gradients when each optimizer is about to step are
compared. The module is the one `--model-factory` returns, else the class built with no
arguments; the micro-batches are `--data-factory`'s, else the harness's prompt-masked rows of
varied length (of one length for data of fixed-length blocks), as a collated dict each.

A class whose constructor needs arguments stands in, as the class of a statement replay's loop
does (harness.bindings): made without its `__init__`, its methods the user's, the tiny model at
the attributes `training_step` calls as a model, the harness's data shaped as `training_step`
reads it, and the harness's optimizer (the gradient at the step does not depend on it); its
`setup`, which would build those parts, is skipped. A module written for Lightning 1.x runs
as Lightning 2 runs it (`_as_lightning_2`)."""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import tempfile
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from gaaudit.harness.bindings import lightning_base
from gaaudit.harness.factory import concatenate, current
from gaaudit.harness.gradcheck import judged, relative_error, snapshot
from gaaudit.harness.trainer import MICRO, failed, micro_batches, quietly, trainer_class

LOGGERS = ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning.fabric")
# the hooks of Lightning 1.x that 2.0 refuses to run (they run after the step the replay reads)
EPOCH_ENDS = ("training_epoch_end", "validation_epoch_end", "test_epoch_end")


def _framework(cls: type):
    """The package whose LightningModule `cls` subclasses (`lightning.pytorch` or
    `pytorch_lightning`): its Trainer and Callback are the ones that run the module."""
    import importlib

    return importlib.import_module(lightning_base(cls).__module__.rsplit(".core", 1)[0])


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


def _built(cls: type) -> tuple[Callable | None, str]:
    """What builds a fresh module under one seed: the user's factory, else `cls` when it
    builds with no arguments (the module that tried it is the first one built); else None,
    and why not."""
    user = current()
    make = user.build if user is not None else cls

    def build():
        torch.manual_seed(0)
        return make()

    if user is not None:
        return build, ""
    try:
        ready = [build()]
    except Exception as exc:  # noqa: BLE001 - the user's constructor: a stand-in instead
        return None, f"{type(exc).__name__}: {exc}"
    return (lambda: ready.pop() if ready else build()), ""


def _stand_in(source: str, filename: str, name: str, k: int, seed: int, fixed: bool):
    """A builder of the class made without its `__init__` (see the module's docstring), its
    micro-batches, their full batch, and whether they are of one size (not of one length
    already) because the tiny model has one target per sample, where sizes alone vary the
    count (as verify replays a loop)."""
    from gaaudit.harness.analysis import NotReplayable, analyse
    from gaaudit.harness.bindings import Objects, served
    from gaaudit.harness.data import make_window
    from gaaudit.harness.models import build_model
    from gaaudit.harness.nets import SIZED_KINDS
    from gaaudit.harness.replay import module_namespace
    from gaaudit.harness.stubs import Stub

    try:
        plan = analyse(source, _training_step(source, name), lightning=True)
    except NotReplayable as exc:
        raise TypeError(str(exc)) from None
    sized = plan.model_kind in SIZED_KINDS
    window = make_window(
        plan.model_kind, k, MICRO, seed, packed=fixed or sized, ignore_index=plan.ignore_index
    )

    def build():
        torch.manual_seed(seed)
        model = build_model(plan.model_kind, seed, window.ignore_index, plan.returns)
        objects = Objects(
            plan,
            window.micro,
            k,
            model,
            torch.optim.SGD(model.parameters()),
            device=torch.device("cpu"),
            dtype=torch.float32,
            ignore_index=window.ignore_index,
            namespace=module_namespace(plan, filename),
            bindings={},
            filename=filename,
        )
        module = objects.values[plan.owner.instance]
        if next(module.parameters(), None) is None:
            raise TypeError(
                f"`{name}` made without its __init__ holds no model: the harness stands in for a "
                "model that training_step calls as an attribute (`self.model(...)`), not for "
                "layers of the module itself"
            )
        module._hparams = Stub(f"{plan.owner.instance}.hparams")  # what `self.hparams` reads
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=1e-3)
        module.log = module.log_dict = _skipped  # its metrics may be stubs
        module.setup = module.configure_model = _skipped  # they would build what stands in
        return module

    micro, full = (
        served(plan, b, False, window.ignore_index) for b in (window.micro, [window.full])
    )
    return build, micro, full, sized and not fixed


def _skipped(*args, **kwargs) -> None:
    """A stand-in's `self.log`, whose metrics do not change the gradient, and its `setup`
    hooks, which would build the parts of the module that the harness stands in for (from
    the configuration its `__init__` would have kept)."""


def _training_step(source: str, name: str) -> int:
    """The line of class `name`'s `training_step`."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "training_step":
                    return method.lineno
    raise TypeError(f"`{name}` defines no `training_step` of its own")


def _as_lightning_2(module) -> None:
    """A module written for Lightning 1.x, as Lightning 2 runs it: without its epoch-end hooks
    (`EPOCH_ENDS`), and its hooks that took the optimizer's index
    (`optimizer_zero_grad(epoch, batch_idx, optimizer, optimizer_idx)`) handed 0, its one
    optimizer's, where 2.0 no longer passes it."""
    for name in EPOCH_ENDS:
        if callable(getattr(module, name, None)):
            setattr(module, name, None)
    base = lightning_base(type(module))
    for cls in type(module).__mro__[: type(module).__mro__.index(base)]:
        for name, function in vars(cls).items():
            if not inspect.isfunction(function) or name in vars(module):
                continue
            parameters = list(inspect.signature(function).parameters)
            if "optimizer_idx" in parameters:
                index = parameters.index("optimizer_idx") - 1  # after `self`
                setattr(module, name, _given_index(getattr(module, name), index))


def _given_index(method: Callable, index: int) -> Callable:
    """`method`, handed 0 at position `index` of its arguments, the optimizer's index that
    Lightning 2 no longer passes (under a signature that does not name it: Lightning 2
    refuses a `training_step` that does)."""

    def hook(*args, **kwargs):
        if len(args) >= index:
            args = (*args[:index], 0, *args[index:])
        return method(*args, **kwargs)

    return hook


def _step(build: Callable, batches: list, k: int, device) -> list[torch.Tensor]:
    """The gradient when a Lightning Trainer accumulating `k` batches first steps."""
    module = build()
    _as_lightning_2(module)
    lightning = _framework(type(module))
    if not module.automatic_optimization:
        raise TypeError(
            f"`{type(module).__name__}` optimises manually (automatic_optimization = False): its "
            "window is its own loop's, which the Lightning replay does not read"
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
    with its verdict (`original_verdict`, `verdict`), and `equal_sizes` where a stand-in
    replayed micro-batches of one size."""
    row: dict = {"k": k, "original_error": None, "patched_error": None}
    why = ""
    with quietly(), _quiet():
        try:
            cls = trainer_class(source, filename, name)
            build, why = _built(cls)
            if build is None:
                build, batches, full, row["equal_sizes"] = _stand_in(
                    source, filename, name, k, seed, fixed
                )
            else:
                batches = micro_batches(k, seed, fixed)
                full = [concatenate(batches)]
            want = _step(build, full, 1, device)
            error = row["original_error"] = relative_error(_step(build, batches, k, device), want)
            row["original_verdict"] = judged(error, torch.float32)
        except Exception as exc:  # noqa: BLE001 - the user's module, reported as the reason
            row["original_verdict"] = failed(exc)
            if why:  # the stand-in failed: say what the user can hand in instead
                row["original_verdict"] += (
                    f"; `{name}()` cannot be built here ({why}) and a stand-in made without "
                    "its __init__ did not replay: pass your module with --model-factory"
                )
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
