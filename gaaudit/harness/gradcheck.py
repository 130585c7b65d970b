"""The gradient-comparison core: precision settings, the full-batch reference, the error
measure and the recording optimizer that ends a replay at its first step."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from gaaudit.harness.data import Window
from gaaudit.harness.models import mean_token_loss
from gaaudit.harness.stubs import Stub

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# A correct loop stays below these relative errors. In fp32 the error is measured against the
# full batch; under bf16/fp16 autocast against the loop's own one-micro-batch replay in the same
# precision, whose distance to the fp32 full batch must stay below AGREEMENT (measured: up to
# 4e-2 bf16 and 1.5e-2 fp16 for the tiny T5, 4e-3 / 5e-4 for GPT-2; splitting noise 4e-3 / 4e-4).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
AGREEMENT = {torch.float32: 1e-5, torch.bfloat16: 1e-1, torch.float16: 5e-2}
BUG_THRESHOLD = 1e-3
# torch's random draws: functions, and Tensor methods that fill their tensor in place
RANDOM = {
    *("rand", "randn", "randint", "rand_like", "randn_like", "randint_like"),
    *("normal", "bernoulli", "multinomial", "poisson"),
    *("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_"),
    *("log_normal_", "cauchy_"),
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` means cuda when available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "float32") -> torch.dtype:
    """A torch dtype from a name (`float32`, `bf16`, ...) or a dtype; only the three in TOLERANCE."""
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in TOLERANCE:
        raise ValueError(f"unsupported dtype {dtype!r}; expected float32, bfloat16 or float16")
    return resolved


def bug_threshold(dtype: torch.dtype) -> float:
    """The error above which a loop's gradient is wrong beyond numerical noise."""
    return max(BUG_THRESHOLD, 2 * TOLERANCE[dtype])


def judged(error: float, dtype: torch.dtype) -> str:
    """`verified`, `bug reproduced` or `inconclusive: ...`, by the size of a relative gradient
    error against one full-batch step."""
    if error < TOLERANCE[dtype]:
        return "verified"
    if error > bug_threshold(dtype):
        return "bug reproduced"
    return (
        f"inconclusive: error {error:.1e} is above the tolerance {TOLERANCE[dtype]:.0e} but "
        "within numerical noise"
    )


@contextlib.contextmanager
def deterministic(seed: int, device: torch.device) -> Iterator[None]:
    """Seed everything, force deterministic kernels, full float32 precision on a GPU (no
    TF32 in matrix products and convolutions, which cuDNN allows by default) and one CPU
    thread (reduction order then does not depend on the machine, and tiny models run no
    slower); restore the caller's state afterwards. torch's deterministic-kernel switch is
    thrown on a GPU only: on one CPU thread the kernels are deterministic already, and the
    switch imports torch's compiler (seconds per replay process)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    switch = device.type != "cpu"
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        if switch:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(1)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            if switch:
                torch.use_deterministic_algorithms(was, warn_only=warn_only)
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for bf16/fp16 (weights and gradients stay fp32); nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def snapshot(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """fp32 copies of the parameters' gradients (zeros where a gradient is missing)."""
    return [
        p.grad.detach().float().clone()
        if p.grad is not None
        else torch.zeros_like(p, dtype=torch.float32)
        for p in params
    ]


def full_batch_grads(model: torch.nn.Module, window: Window) -> list[torch.Tensor]:
    """The reference: one backward on the mean loss over all valid tokens of the whole window."""
    model.zero_grad(set_to_none=True)
    mean_token_loss(
        window.kind, model, window.full, window.ignore_index, window.label_smoothing
    ).backward()
    grads = snapshot(model.parameters())
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """||g - ref|| / ||ref|| over all parameters, flattened, in fp64."""
    g = torch.cat([t.detach().double().flatten().cpu() for t in grads])
    ref = torch.cat([t.detach().double().flatten().cpu() for t in reference])
    if g.shape != ref.shape:
        raise ValueError(f"gradient sizes differ: {g.numel()} vs {ref.numel()}")
    diff, norm = (g - ref).norm().item(), ref.norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


class StepReached(BaseException):
    """Ends a replay when the gradients are captured. A BaseException, so that a loop's own
    `except Exception:` cannot swallow it."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


class _Group(dict):
    """A parameter group that answers 1.0 for a key the user's own groups would carry (a
    layer-wise `lr_scale` that a schedule multiplies the learning rate by), and keeps its
    number where a schedule computed from stand-ins (options the harness could not bind)
    writes a stub: the loop reads it back as a number (`metric_logger.update(lr=...)`)."""

    def __missing__(self, key):
        return 1.0

    def __setitem__(self, key, value):
        if not isinstance(value, Stub):
            super().__setitem__(key, value)


class SeededRows(TorchFunctionMode):
    """While it is on, a random draw that the code of `filename` makes (`torch.randn_like(x)`,
    `torch.rand(ids.shape)`, `t.uniform_()`) is made row by row along its first dimension,
    each row from a seed of the place in that code that drew it and of the row's index among
    that place's draws since the window began. K micro-batches then draw for their rows what
    one batch of the whole window draws for its: noise added to the data does not keep their
    gradients from matching the full batch's. A draw given a generator of its own is left
    as it is; `restart` begins a window."""

    def __init__(self, seed: int, filename: str) -> None:
        super().__init__()
        self.seed, self.filename = seed, filename
        self.rows: dict[tuple[int, ...], int] = {}

    def restart(self) -> None:
        self.rows.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        site = self._site() if name in RANDOM and "generator" not in kwargs else None
        drawn = func(*args, **kwargs)
        if site is None or not isinstance(drawn, torch.Tensor):
            return drawn
        if name in ("rand", "randn") and args and all(isinstance(a, int) for a in args):
            args = (tuple(args),)  # `torch.randn(b, d)`: the size as one argument
        n = drawn.shape[0] if drawn.dim() else 1
        start = self.rows.get(site, 0)
        self.rows[site] = start + n
        rows = [_row_arguments(args, kwargs, n, r) for r in range(n)] if drawn.dim() else []
        if not rows or None in rows:  # no argument holds the rows: one seed for the draw
            return self._seeded(self._key(site, start), drawn.device, func, args, kwargs)
        pieces = [
            self._seeded(self._key(site, start + r), drawn.device, func, *row)
            for r, row in enumerate(rows)
        ]
        if name.endswith("_"):  # each row filled in place, through its view
            return drawn
        if any(p.shape != (1, *drawn.shape[1:]) for p in pieces):
            return self._seeded(self._key(site, start), drawn.device, func, args, kwargs)
        return torch.cat(pieces)

    def _site(self) -> tuple[int, ...] | None:
        """Where in the replayed file's code the draw is made (its function's first line and
        the instruction that called on), and where the code that drew is (the same, or a
        function the file calls that draws twice: a loss's noise level and its noise)."""
        drawing = frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename != self.filename:
            frame = frame.f_back
        if frame is None:
            return None
        return (
            frame.f_code.co_firstlineno,
            frame.f_lasti,
            drawing.f_code.co_firstlineno,
            drawing.f_lasti,
        )

    def _key(self, site: tuple[int, ...], row: int) -> int:
        key = self.seed
        for part in (*site, row):
            key = (key * 1_000_003 + part) % 2**61
        return key  # below 2**63, what torch.manual_seed takes

    @staticmethod
    def _seeded(key: int, device: torch.device, func, args, kwargs):
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(key)
            return func(*args, **kwargs)


def _row_arguments(args: tuple, kwargs: dict, n: int, r: int) -> tuple[tuple, dict] | None:
    """`args` and `kwargs` of a draw of `n` rows, for its row `r` alone: a tensor of `n` rows
    sliced to that row, a size of `n` rows made one; None when none of them holds the rows."""
    sliced = False

    def row(value):
        nonlocal sliced
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            sliced = True
            return value[r : r + 1]
        if (
            isinstance(value, (tuple, list))
            and value
            and all(isinstance(v, int) for v in value)
            and value[0] == n
        ):
            sliced = True
            return (1, *value[1:])
        return value

    arguments = (tuple(row(a) for a in args), {k: row(v) for k, v in kwargs.items()})
    return arguments if sliced else None


class RecordingOptimizer(torch.optim.SGD):
    """A real SGD whose `step()` records the gradients in `grads` and raises StepReached; the
    first `skip` steps change nothing and go on."""

    _global_grad_norm = 0.0  # DeepSpeed's optimizers' last norm, which loops log

    def __init__(self, params, lr: float = 1e-3, skip: int = 0):
        super().__init__(params, lr=lr)
        self.param_groups = [_Group(group) for group in self.param_groups]
        self.grads: list[torch.Tensor] | None = None
        self.skip = skip
        # the gradients at the first and at the latest clip, where it was, and the
        # micro-batches drawn by then
        self.clipped: tuple[list[torch.Tensor], str, int] | None = None
        self.last_clipped: tuple[list[torch.Tensor], str, int] | None = None
        self.drawn: Callable[[], int] = lambda: 0  # micro-batches drawn since the last step
        self.window_begun: Callable[[], None] = lambda: None  # after a step it skips

    def count(self, drawn: Callable[[], int]) -> None:
        """Count the micro-batches drawn (the replay's counter) from here on."""
        start = drawn()
        self.drawn = lambda: drawn() - start

    def record(self, where: str = "optimizer.step") -> None:
        """Snapshot the gradients of every parameter group, then end the replay (after the
        steps to skip, which start the window anew)."""
        if self.skip:
            self.skip -= 1
            self.count(self.drawn)
            self.clipped = self.last_clipped = None
            self.window_begun()
            return
        self.grads = self._gradients()
        raise StepReached(where)

    def clip(self, where: str) -> None:
        """A clipping call, which clips nothing here: the gradients before the first and the
        latest one are kept and the replay goes on to the step. A clip at the step leaves
        them as they were there; a loop that clips every micro-batch is measured at its step,
        over its window."""
        self.last_clipped = (self._gradients(), where, self.drawn())
        if self.clipped is None:
            self.clipped = self.last_clipped

    def _gradients(self) -> list[torch.Tensor]:
        return snapshot(p for group in self.param_groups for p in group["params"])

    def step(self, closure=None):
        if closure is not None:  # `optimizer.step(closure)`: the closure backpropagates first
            with torch.enable_grad():
                closure()
        self.record()

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """`optimizer.backward(loss)` of fp16 optimizer wrappers (apex, Megatron, bmtrain's
        OptimManager): in full precision there is no loss scale, so a plain backward."""
        loss.backward()

    def clip_grad_norm(self, *args, **kwargs) -> None:
        """The wrappers' own clipping (`optim_manager.clip_grad_norm(...)`), recorded as
        `torch.nn.utils.clip_grad_norm_` is."""
        self.clip("clip_grad_norm")
