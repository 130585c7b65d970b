"""Statement replay (GA-GUIDE section 6): run one loop or function of a source text with its
free names bound to harness objects, capture the gradients at the first optimizer step (or
gradient clipping) and compare them with one full batch. This executes the user's code (its
imports, the statement and the module-level helpers it calls) in this process."""

from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import copy
import inspect
import io
import re
import signal
import threading
import traceback
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gaaudit.harness import factory
from gaaudit.harness.analysis import (
    LOGGING_WRAPPERS,
    NotReplayable,
    Plan,
    analyse,
    caller_divides,
    disables_grad,
)
from gaaudit.harness.bindings import Caller, Objects
from gaaudit.harness.data import Window, make_window, merge_batches
from gaaudit.harness.gradcheck import (
    AGREEMENT,
    TOLERANCE,
    RecordingOptimizer,
    SeededRows,
    StepReached,
    autocast,
    deterministic,
    full_batch_grads,
    judged,
    relative_error,
    resolve_device,
    resolve_dtype,
    snapshot,
)
from gaaudit.harness.models import build_model, ignore_value
from gaaudit.harness.nets import NOISED_KINDS
from gaaudit.harness.project import project_import
from gaaudit.harness.stubs import (
    ApexAmp,
    Exhausted,
    Progress,
    Stub,
    progress_module,
    stub_enumerate,
    stub_getattr,
    stub_isinstance,
    stub_range,
    tensor_round,
    trange,
)
from gaaudit.vocabulary import BACKWARDS, CLIPPERS, MOVERS, RETURN_COUNT, STEPS

ENGINE_STARTUP = 120.0  # seconds a fresh process may take to import torch and DeepSpeed
BRIEF = 240  # characters of an exception's message a verdict quotes at most
GROUP_OF_ONE = "a gloo process group of one rank (the loop calls torch.distributed)"
# the process kept for replays that want a process group (in the verifying process), and
# whether this is it
_apart: dict = {"pool": None, "engine": False}
TRACKERS = (
    "wandb",
    "mlflow",
    "comet_ml",
    "neptune",
    "tensorboardX",
    "swanlab",
    "aim",
    "clearml",
    "trackio",
    "torch.utils.tensorboard",
)


@dataclass(frozen=True)
class Replay:
    """One replay: the gradients captured (None when it could not run) and why not."""

    grads: list[torch.Tensor] | None
    reason: str = ""
    captured_at: str = ""
    bindings: dict[str, str] = field(default_factory=dict)
    model_kind: str = ""
    output: str = ""
    drawn: int = 0  # micro-batches the loop drew before its step (0: unknown)

    @property
    def ok(self) -> bool:
        return self.grads is not None


@dataclass(frozen=True)
class Check:
    """One loop against the full batch. `verdict` is `verified`, `bug reproduced`,
    `inconclusive: ...` or `not replayable: ...`. `error` is the relative gradient error
    (see _Session.check for its reference); `k1_error` is the error of the loop replayed with
    the whole window as one micro-batch, when that ran (it rules out a harness mismatch).
    A loop whose first window holds fewer than K micro-batches (`window`, GA007) is judged on
    that window and, where the replay goes on to its next step, on its next window too
    (`first_error` is then the first's, `error` and `window_verdict` the next's): it
    reproduces a bug when either does."""

    verdict: str
    error: float | None
    k1_error: float | None
    replay: Replay
    window: int | None = None  # micro-batches of the window the loop formed, when not K
    first_error: float | None = None
    window_verdict: str | None = None  # its next window's alone, after a short first window


@dataclass(frozen=True)
class Comparison:
    """An original loop and its patched version against the same full batch. `verdict` is the
    patched loop's: `verified`, `bug reproduced`, `inconclusive: ...` or `not replayable: ...`."""

    original: Check
    patched: Check
    k: int
    dtype: str
    tolerance: float

    @property
    def verdict(self) -> str:
        return self.patched.verdict


# Kinds whose tiny model's outputs at the valid positions do not change with how far a batch is
# padded (causal attention, position-wise layers, or an attention mask that hides the padding)
PADDING_FREE = ("causal", "nanogpt", "logits", "teacher", "classify", "sequence", "pair", "keyed")
# The harness's fields that tell a loop the padding apart
MASKS = {"attention_mask", "loss_mask"}


class _TimedOut(BaseException):
    """The replay ran past its time limit."""


class _Session:
    """Shared settings, data and reference gradients for the replays of one check."""

    def __init__(self, plan: Plan | str, k, micro_batch_size, seed, device, dtype, timeout, packed):
        self.kind = getattr(plan, "model_kind", "causal")
        self.k, self.seed, self.timeout = k, seed, timeout
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.tolerance = TOLERANCE[self.dtype]
        data = factory.current_data()
        self.user = (
            data is not None
        )  # the user's batches: the loop on the whole window is the reference
        if self.user:
            ignore_index = ignore_value(self.kind, getattr(plan, "ignore_index", None))

            def fresh(n: int) -> Window:
                micro = [factory.to_device(b, self.device) for b in data.window(n, seed)]
                return Window("user", micro, factory.concatenate(micro), ignore_index)
        else:

            def fresh(n: int, ragged: bool = False) -> Window:
                return make_window(
                    self.kind,
                    n,
                    micro_batch_size,
                    seed,
                    packed=packed,
                    ignore_index=getattr(plan, "ignore_index", None),
                    label_smoothing=getattr(plan, "label_smoothing", 0.0),
                    ragged=ragged,
                ).to(self.device)

        self.window = fresh(k)
        self.fresh = fresh
        self.longer: dict[int, Window] = {}  # after a short first window: its micro-batches and K
        self.windows: dict[tuple[int, int], Window] = {(k, 0): self.window}
        self.references: dict[tuple[int, int], list[torch.Tensor]] = {}
        # the user's batches, or noise the loop draws itself: the loop's own step on the whole
        # window as one micro-batch is the reference
        self.own_reference = self.user or self.kind in NOISED_KINDS
        if not self.own_reference:
            self.reference(k)  # before any replay can touch torch's global state

    def _reference(self, window: Window) -> list[torch.Tensor]:
        with deterministic(self.seed, self.device):
            model = build_model(self.kind, self.seed, self.window.ignore_index).to(self.device)
            return full_batch_grads(model, window)

    def drawn_from(self, after: int, ragged: bool = False) -> Window:
        """The micro-batches a replay draws: the window, or (`after`) a first window of `after`
        micro-batches followed by K more; `ragged` (the harness's data only): the same samples,
        each micro-batch padded to its own longest."""
        if ragged:
            return self.fresh(after + self.k, ragged=True)
        if not after:
            return self.window
        if after not in self.longer:
            self.longer[after] = self.fresh(after + self.k)
        return self.longer[after]

    def first(self, n: int, after: int = 0) -> Window:
        """The window of the `n` micro-batches drawn after the first `after` (the whole window
        when n is K and `after` 0)."""
        if (n, after) not in self.windows:
            micro = self.drawn_from(after).micro[after : after + n]
            full = (
                factory.concatenate(micro)
                if self.user
                else merge_batches(micro, self.window.ignore_index)
            )
            self.windows[n, after] = replace(self.window, micro=micro, full=full)
        return self.windows[n, after]

    def reference(self, n: int, after: int = 0) -> list[torch.Tensor]:
        """The full-batch gradient of those micro-batches."""
        if (n, after) not in self.references:
            self.references[n, after] = self._reference(self.first(n, after))
        return self.references[n, after]

    def replay(
        self, plan: Plan, filename: str, whole: int = 0, after: int = 0, ragged: bool = False
    ) -> Replay:
        """Replay `plan` on the window; with `whole` = n, on the first n micro-batches (after the
        first `after`) as one; with `after` alone, through the step of a first window of `after`
        micro-batches to the next step (see check); with `ragged`, on micro-batches each
        padded to its own longest sample."""
        if whole:
            batches, k = [self.first(whole, after).full], 1
        else:
            batches, k = self.drawn_from(after, ragged).micro, self.k
        return _execute(
            plan,
            filename,
            batches,
            k,
            self.window.ignore_index,
            self.seed,
            self.device,
            self.dtype,
            self.timeout,
            skip=1 if after and not whole else 0,
        )

    def check(self, plan: Plan | str, filename: str) -> Check:
        """The verdict on one loop (see Check). A first window of fewer than K micro-batches
        (`step % K == 0` from step 0, GA007) is judged against the full batch of those; the
        loop is then replayed on to its next step and judged on that window too."""
        if isinstance(plan, str):
            return Check(f"not replayable: {plan}", None, None, Replay(None, plan))
        result = self.replay(plan, filename)
        if not result.ok:
            return Check(f"not replayable: {result.reason}", None, None, result)
        short = result.drawn if 0 < result.drawn < self.k else None  # `step % K == 0` from 0
        first = self._judged(plan, filename, result, short or self.k)
        if short is None:
            return first
        later = self.replay(plan, filename, after=short)
        if not later.ok:  # judged on its first window alone
            return replace(first, window=short)
        n = later.drawn if 0 < later.drawn <= self.k else self.k
        window = self._judged(plan, filename, later, n, after=short)
        verdicts = (first.verdict, window.verdict)
        return replace(
            window,
            verdict="bug reproduced"
            if "bug reproduced" in verdicts
            else next((v for v in verdicts if v != "verified"), "verified"),
            window=short,
            first_error=first.error,
            window_verdict=window.verdict,
        )

    def _judged(self, plan: Plan, filename: str, result: Replay, n: int, after: int = 0) -> Check:
        """The verdict on a replay that reached its step after `n` micro-batches (drawn after
        the first `after`). fp32: the gradient against their full batch; the one-micro-batch
        replay only runs to explain a mismatch. bf16/fp16: the one-micro-batch replay runs
        first, must agree with the full batch within AGREEMENT, and is the reference, so that
        only the splitting is measured. With the user's batches, or a loop that draws its own
        noise (NOISED_KINDS), that replay is the reference in any precision."""
        check = partial(Check, replay=result)
        exact = self.dtype == torch.float32
        error = (
            relative_error(result.grads, self.reference(n, after))
            if exact and not self.own_reference
            else None
        )
        if error is not None and error < self.tolerance:
            return check("verified", error, None)
        whole = self.replay(plan, filename, whole=n, after=after) if self.k > 1 else result
        if self.own_reference:
            if not whole.ok:
                return check(
                    "not replayable: with the whole window as one micro-batch the loop "
                    f"failed ({whole.reason})",
                    None,
                    None,
                )
            error = relative_error(result.grads, whole.grads)
            return check(judged(error, self.dtype), error, None)
        k1_error = relative_error(whole.grads, self.reference(n, after)) if whole.ok else None
        if k1_error is None or (not exact and k1_error >= AGREEMENT[self.dtype]):
            detail = whole.reason or f"error {k1_error:.1e}"
            return check(
                "not replayable: with the whole window as one micro-batch the loop "
                f"does not match the full batch either ({detail}); its loss is not "
                "the token mean the harness models",
                error,
                k1_error,
            )
        if not exact or k1_error >= AGREEMENT[self.dtype]:
            # the loop's own full batch (its model reads the padding, say): the micro-batches
            # are exact slices of it, so only the splitting is measured
            error = relative_error(result.grads, whole.grads)
            if exact and error < self.tolerance and self._tells_padding(plan):
                error = max(error, self._ragged_error(plan, filename, result, whole, after))
        return check(judged(error, self.dtype), error, k1_error)

    def _tells_padding(self, plan: Plan) -> bool:
        """Whether the loop reads which positions are padding (an attention or loss mask) of
        a model whose outputs there do not depend on how far its batch is padded."""
        fields = {*plan.data_keys, *plan.data_aliases.values()}
        return self.kind in PADDING_FREE and bool(MASKS & fields)

    def _ragged_error(
        self, plan: Plan, filename: str, result: Replay, whole: Replay, after: int
    ) -> float:
        """The error of the loop on micro-batches each padded to its own longest sample, as a
        collator padding to the longest pads them, against its run on the whole window: a loss
        that averages over the padded width (`(loss * mask).mean(1)`) weights the micro-batches
        by their widths, which one padded width for the window hides. 0 where that replay does
        not reach the same step."""
        ragged = self.replay(plan, filename, after=after, ragged=True)
        if not ragged.ok or ragged.drawn != result.drawn:
            return 0.0
        return relative_error(ragged.grads, whole.grads)


def _plan(
    source: str, line: int, divisor_names, model_kind, ignore_index, options=None
) -> Plan | str:
    """The replay plan, or why there is none."""
    try:
        plan = analyse(source, line, tuple(divisor_names), model_kind)
        if ignore_index is not None:
            plan.ignore_index = ignore_index
        plan.settings = {**(options or {}), **plan.settings}
        if _beyond_pairs(plan) and not plan.data_keys and factory.current_data() is None:
            return (
                f"the loop unpacks {plan.data_arity} values from each batch; the harness "
                "serves dict batches or (input_ids, labels) pairs (hand in batches of your "
                "own with --data-factory)"
            )
        return plan
    except NotReplayable as exc:
        return str(exc)
    except (RecursionError, ValueError, MemoryError) as exc:  # pathological sources
        return f"the harness could not analyse the statement ({type(exc).__name__}: {exc})"


def _beyond_pairs(plan: Plan) -> bool:
    """The loop unpacks other than the harness's `(input_ids, labels)` pairs from each batch
    (values it leaves to `_` aside): three named values, say."""
    return plan.data_arity - plan.data_fillers not in (0, 2)


def replay(
    source: str,
    line: int,
    *,
    k: int = 4,
    divisor_names=(),
    model_kind: str | None = None,
    ignore_index: int | None = None,
    micro_batch_size: int = 2,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "float32",
    timeout: float = 60.0,
    packed: bool = False,
    filename: str = "<replay>",
) -> Replay:
    """Replay the loop or function at `line` of `source` on one window of `k` micro-batches
    (see compare for the options)."""
    plan = _plan(source, line, divisor_names, model_kind, ignore_index)
    if isinstance(plan, str):
        return Replay(None, plan)
    window = make_window(
        plan.model_kind, k, micro_batch_size, seed, packed=packed, ignore_index=plan.ignore_index
    )
    device = resolve_device(device)
    return _execute(
        plan,
        filename,
        window.to(device).micro,
        k,
        window.ignore_index,
        seed,
        device,
        resolve_dtype(dtype),
        timeout,
    )


def check(
    source: str,
    line: int,
    *,
    k: int = 4,
    divisor_names=(),
    model_kind: str | None = None,
    ignore_index: int | None = None,
    micro_batch_size: int = 2,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "float32",
    timeout: float = 60.0,
    packed: bool = False,
) -> Check:
    """Replay one loop and judge its gradient against the full batch (see compare)."""
    plan = _plan(source, line, divisor_names, model_kind, ignore_index)
    session = _Session(plan, k, micro_batch_size, seed, device, dtype, timeout, packed)
    return session.check(plan, "<loop>")


def compare(
    original_source: str,
    patched_source: str,
    loop_line_original: int,
    loop_line_patched: int,
    k: int = 4,
    divisor_names=(),
    *,
    model_kind: str | None = None,
    ignore_index: int | None = None,
    micro_batch_size: int = 2,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "float32",
    timeout: float = 60.0,
    packed: bool = False,
    options: dict | None = None,
    make_session=None,
) -> Comparison:
    """Replay a loop before and after a fix on the same model, data and full-batch reference.

    `divisor_names`: the names or dotted chains that hold K (names containing `accum` are
    taken too). `model_kind` / `ignore_index`: override what the source suggests (see
    models.KINDS). `packed`: fixed-length samples with no padding, where mean/K is exact.
    `timeout`: seconds per replay. `device`: `auto`, `cpu` or `cuda`; `dtype`: float32,
    bfloat16 or float16 (autocast). `options`: the option defaults of the scripts that call
    the loop's function, for the stand-in of the arguments they hand it (the file's own
    defaults win). `make_session`: a _Session subclass (distributed.py runs the replays on
    several ranks)."""
    planned_with = (divisor_names, model_kind, ignore_index, options)
    original = _plan(original_source, loop_line_original, *planned_with)
    patched = _plan(patched_source, loop_line_patched, *planned_with)
    planned = [p for p in (original, patched) if isinstance(p, Plan)]
    for plan in planned[1:]:
        plan.model_kind, plan.ignore_index = planned[0].model_kind, planned[0].ignore_index
    if isinstance(patched, Plan) and isinstance(original, Plan):
        patched.caller_divides = caller_divides(original, patched)
    session = (make_session or _Session)(
        planned[0] if planned else "", k, micro_batch_size, seed, device, dtype, timeout, packed
    )
    before = session.check(original, "<original>")
    unchanged = (patched_source, loop_line_patched) == (original_source, loop_line_original)
    return Comparison(
        before,
        before if unchanged else session.check(patched, "<patched>"),
        k,
        str(session.dtype).removeprefix("torch."),
        session.tolerance,
    )


def _execute(
    plan: Plan,
    filename: str,
    batches: list,
    k: int,
    ignore_index: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    timeout: float,
    wrap=None,
    skip: int = 0,
) -> Replay:
    """Run the planned statement once; never raises for what the user's code does. `wrap`
    (e.g. DistributedDataParallel) is applied to the fresh model, unless a DeepSpeed engine
    wraps it. The gradients are captured at the step after the first `skip` ones."""
    engine = "engine" in plan.roles.values()
    dist = torch.distributed
    ranks = dist.is_initialized() and dist.get_world_size() > 1  # a rank of --distributed
    args = (plan, filename, batches, k, ignore_index, seed, device, dtype, timeout, None, skip)
    if engine and not ranks and not _apart["engine"]:
        return _in_own_process(args, timeout)
    output, bindings = io.StringIO(), {}
    grads, where, reason, drawn, grouped = None, "", "", 0, False
    precision = autocast(device, dtype)  # the harness's own, made before the loop's are changed
    with (
        deterministic(seed, device),
        contextlib.redirect_stdout(output),
        contextlib.redirect_stderr(output),
        warnings.catch_warnings(),
        _autocast_as_asked(device, dtype),
    ):
        warnings.simplefilter("ignore")
        kind = plan.model_kind
        model = build_model(kind, seed, ignore_index, plan.returns).to(device)
        if wrap is None or engine:
            model.no_sync = contextlib.nullcontext  # DDP's, for one process: nothing to skip
        else:
            model = wrap(model)
        optimizer = RecordingOptimizer(model.parameters(), skip=skip)
        try:
            namespace = module_namespace(plan, filename)
            objects = Objects(
                plan,
                batches,
                k,
                model,
                optimizer,
                device=device,
                dtype=dtype,
                ignore_index=ignore_index,
                namespace=namespace,
                bindings=bindings,
                filename=filename,
            )
            optimizer.count(objects.drawn)
            function, kwargs = _callable(plan, filename, namespace, objects)
            rows = SeededRows(seed, filename)
            optimizer.window_begun = rows.restart
            with (
                rows,
                _capturing(optimizer, namespace, model),
                _staying_on(device),
                precision,
                _time_limit(timeout),
            ):
                counted = plan.caller_divides and objects.caller is not None
                total = 0.0  # the window's count, where the caller divides by it
                for call, turn in _calls(kwargs, objects.caller):
                    with turn():
                        result = function(**call, **({RETURN_COUNT: True} if counted else {}))
                        if inspect.isgenerator(result):
                            for _ in result:
                                pass
                    if counted:
                        total += float(result[-1])
        except StepReached as stop:
            grads, where, drawn = optimizer.grads, stop.where, optimizer.drawn()
        except Exhausted as exc:
            reason = f"the loop did not reach an optimizer step ({exc})"
        except _TimedOut:
            reason = f"timed out after {timeout:g} s"
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as the reason
            reason = _describe(exc, filename, plan)
            grouped = (
                isinstance(exc, (ValueError, RuntimeError))
                and wants_group(str(exc))
                and not dist.is_initialized()
            )
        else:
            grads, where = snapshot(model.parameters()), "end of statement"
            if objects.scaler is not None and objects.scaler.is_enabled():
                grads = [g / objects.scaler.get_scale() for g in grads]
            if counted:
                grads = [g / _per_process(total, device) for g in grads]
    if grouped:  # `dist.get_rank()`, a DistributedSampler: again as the one rank of a group
        with group_of_one("gloo"):
            result = _execute(*args)
        return replace(result, bindings={**result.bindings, "torch.distributed": GROUP_OF_ONE})
    stopped = where in ("", "end of statement")  # no further than the first clip, if any
    clipped = optimizer.clipped if stopped else optimizer.last_clipped
    if clipped is not None and (stopped or clipped[2] == drawn):
        # the latest clip belongs to the step (no micro-batch drawn since; a loop that reads
        # its window ahead drew it all before the first), or the replay went no further than
        # the first clip: the gradients there
        (grads, where, drawn), reason = clipped, ""
    if grads is not None and not any(g.any() for g in grads):
        grads, reason = (
            None,
            (
                "the optimizer stepped with zero gradients"
                if where != "end of statement"
                else "no backward pass and no optimizer step was reached"
            ),
        )
    return Replay(
        grads,
        reason,
        where if grads is not None else "",
        bindings,
        plan.model_kind,
        output.getvalue()[-4000:],
        drawn,
    )


def _per_process(count: float, device: torch.device) -> float:
    """A window's count as the patched caller divides by it: summed over the processes and
    divided by their number, where the gradients are averaged over them (at least 1)."""
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        summed = torch.tensor(count, device=device)
        dist.all_reduce(summed)
        return max(summed.item(), 1.0) / dist.get_world_size()
    return max(count, 1.0)


def _calls(kwargs: dict, caller: Caller | None) -> Iterator[tuple[dict, Callable]]:
    """The arguments of each call of the statement, with what the call is made in: once, or,
    for a function that takes one micro-batch a call, once for each micro-batch its caller's
    loop draws."""
    if caller is None:
        yield kwargs, contextlib.nullcontext
        return
    for call, batch in enumerate(caller.source, 1):
        if caller.engine is not None:
            caller.engine.state.iteration = call
        yield {**kwargs, caller.batch: batch}, caller.turn


@contextlib.contextmanager
def group_of_one(backend: str):
    """A process group of this process alone, for the block only (a Trainer replayed after it
    must not see a distributed run); the loop may have destroyed it itself."""
    dist = torch.distributed
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def processes():
    """How the harness starts its processes (DDP ranks, the DeepSpeed one): forked from a
    server that has imported the harness, torch and the transformers models it builds once
    (where transformers is installed), so that a rank starts in a second instead of importing
    them again; spawned where there is no fork server (Windows). Never a plain fork of the
    verifying process, whose thread pools have run."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    models = ("gpt2.modeling_gpt2", "bert.modeling_bert", "t5.modeling_t5")
    preload = ["gaaudit.harness.distributed", *(f"transformers.models.{m}" for m in models)]
    context.set_forkserver_preload(preload)
    return context


def _in_own_process(args: tuple, timeout: float) -> Replay:
    """A replay on one process of a loop that steps a DeepSpeed engine, in the process kept
    for them: DeepSpeed wants a process group and keeps state of its own, which the replays
    here must not meet (a Trainer would see a distributed run)."""
    import multiprocessing

    if _apart["pool"] is None:
        _apart["pool"] = processes().Pool(1, initializer=_engine_process)
    job = _apart["pool"].apply_async(
        _engine_replay, (factory.current(), factory.current_data(), args)
    )
    try:
        return job.get(timeout + ENGINE_STARTUP)
    except multiprocessing.TimeoutError:
        _engine_process_stopped()  # it may still be running: the next replay gets a fresh one
        return Replay(None, f"timed out after {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - the process could not run the replay
        return Replay(None, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def engine_process():
    """Within the block, DeepSpeed replays share one process, started at the first; it stops
    when the block ends (a verify run)."""
    try:
        yield
    finally:
        _engine_process_stopped()


def _engine_process_stopped() -> None:
    if _apart["pool"] is not None:
        _apart["pool"].terminate()
        _apart["pool"] = None


atexit.register(_engine_process_stopped)  # a replay outside `engine_process()` (the API's)


def _engine_process() -> None:
    """The kept process starts: a gloo group of one, for every replay it runs."""
    import torch.distributed as dist

    _apart["engine"] = True
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _engine_replay(model, data, args: tuple) -> Replay:
    """In the kept process: the replay with the user's factories."""
    with factory.user_model(model), factory.user_data(data):
        result = _execute(*args)
    if result.grads is not None:
        result = replace(result, grads=[g.cpu() for g in result.grads])
    return result


def module_namespace(plan: Plan, filename: str) -> dict:
    """Module globals: `range` that tolerates stub limits, `enumerate` stub starts, `round`
    that takes tensors, `isinstance` that takes a stub for a class, `getattr` by a stub name,
    `open` that tolerates stub paths, the source's imports (stubs for those that fail, but a
    batch mover such as `to_device`, which moves the batch, and a module of the project, which
    is defined from its source: `project.project_import`; trackers and tqdm replaced), then
    the module-level helpers the statement uses (stubs read in them as in the statement:
    `_Stubs`)."""
    namespace = {
        "__name__": "__gaaudit_replay__",
        "__builtins__": builtins,
        "range": stub_range,
        "enumerate": stub_enumerate,
        "round": tensor_round,
        "isinstance": stub_isinstance,
        "getattr": stub_getattr,
        "open": _open,
        _UNPACK: _unpacked,
        _UNSET: _unset,
    }
    modules: dict = {}
    for node in plan.imports:
        try:
            exec(compile(ast.Module([node], []), filename, "exec"), namespace)  # noqa: S102
        except (Exception, SystemExit):  # noqa: BLE001 - its names become stubs
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                if alias.name in MOVERS:  # `to_device(batch, device)`: moves, keeps all
                    namespace.setdefault(name, factory.to_device)
                    continue
                if isinstance(node, ast.ImportFrom) and (node.module, alias.name) == (
                    "apex",
                    "amp",
                ):  # apex builds on CUDA only: its amp as O0 runs it
                    namespace.setdefault(name, ApexAmp)
                    continue
                found = project_import(node, alias, filename, Stub, modules)
                namespace.setdefault(name, Stub(name) if found is None else found)
    for name, value in list(namespace.items()):
        module = (
            value.__name__
            if isinstance(value, types.ModuleType)
            else getattr(value, "__module__", None) or ""
        )
        if any(module == t or module.startswith(t + ".") for t in TRACKERS):
            namespace[name] = Stub(name)
        elif isinstance(value, types.ModuleType) and module.split(".")[0] == "tqdm":
            namespace[name] = progress_module(name)
        elif module.split(".")[0] == "tqdm":
            namespace[name] = trange if getattr(value, "__name__", "") == "trange" else Progress
    for helper in plan.helpers:
        module = ast.fix_missing_locations(ast.Module([_Stubs().visit(copy.deepcopy(helper))], []))
        try:
            exec(compile(module, filename, "exec"), namespace)  # noqa: S102
        except (Exception, SystemExit):  # noqa: BLE001, S112 - its name stays a stub
            continue
    return namespace


def _open(file, mode: str = "r", *args, **kwargs):
    """`open`, except that a path the harness could not bind (`open(log_file, "a")`) is an
    empty file in memory: a log the loop writes goes nowhere."""
    if isinstance(file, Stub):
        return io.BytesIO() if "b" in mode else io.StringIO()
    return open(file, mode, *args, **kwargs)


def _callable(plan: Plan, filename: str, namespace: dict, objects: Objects):
    """The statement as a function of its free names (a loop is wrapped in one; a function
    target is defined without its decorators), and the keyword arguments to call it with."""
    values = objects.values
    namespace.update({n: v for n, v in values.items() if n not in (plan.params or ())})
    target = copy.deepcopy(plan.target)
    target = _Stubs().visit(_LoggingLeftOut().visit(_EvaluationLeftOut(plan.target).visit(target)))
    if plan.params is not None:
        target.decorator_list = []
        module = ast.fix_missing_locations(ast.Module([target], []))
        exec(compile(module, filename, "exec"), namespace)  # noqa: S102
        return namespace[target.name], {n: values[n] for n in plan.params if n in values}
    wrapper = ast.parse(f"def __gaaudit_replay__({', '.join(values)}):\n    pass").body[0]
    wrapper.body = [target]
    ast.copy_location(wrapper, plan.target)
    module = ast.fix_missing_locations(ast.Module([wrapper], []))
    exec(compile(module, filename, "exec"), namespace)  # noqa: S102
    return namespace["__gaaudit_replay__"], values


_UNPACK = "__gaaudit_unpacked__"
_UNSET = "__gaaudit_unset__"
# calls by which a block takes part in the window's gradients
GRADIENT_CALLS = frozenset({*BACKWARDS, *CLIPPERS, *STEPS, "zero_grad", "unscale_"})


class _EvaluationLeftOut(ast.NodeTransformer):
    """An `if` block that evaluates (a `torch.no_grad()` or `torch.inference_mode()` block,
    or a `.eval()` call, in it), makes none of GRADIENT_CALLS and binds no name that only it
    binds and the rest of the statement reads is left out: a validation pass, a benchmark or
    samples drawn every N steps read data the harness does not make (build-nanogpt's
    HellaSwag examples) and cannot change the gradients at the step. (A name that the
    training code binds again, `logits, loss = model(x)`, is that code's own.)"""

    def __init__(self, target: ast.stmt) -> None:
        self.reads, self.binds = _names(target, ast.Load), _names(target, ast.Store)

    def visit_If(self, node: ast.If) -> ast.stmt:
        calls = {_called(n) for n in ast.walk(node) if isinstance(n, ast.Call)}
        evaluates = "eval" in calls or any(
            disables_grad(item.context_expr)
            for n in ast.walk(node)
            if isinstance(n, ast.With)
            for item in n.items
        )
        binds, reads = _names(node, ast.Store), _names(node, ast.Load)
        only_here = set(binds) - set(self.binds - binds)
        if evaluates and not calls & GRADIENT_CALLS and not only_here & set(self.reads - reads):
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)


class _LoggingLeftOut(ast.NodeTransformer):
    """A metric logger's iteration (`metric_logger.log_every(loader, print_freq, header)`) is
    its loader: the logger only times and prints it, every `print_freq` items, which a loop may
    compute from the loader's length (`len(loader) // 50`), 0 for the harness's window."""

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        if getattr(node.func, "attr", None) in LOGGING_WRAPPERS and node.args:
            return node.args[0]
        return node


def _called(call: ast.Call) -> str:
    """The name a call calls, also on a call's result (`scaler.scale(loss).backward()`:
    `backward`)."""
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None) or ""


def _names(node: ast.AST, context: type) -> Counter:
    """How often each name is read (`ast.Load`) or bound (`ast.Store`) under `node`."""
    return Counter(
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, context)
    )


class _Stubs(ast.NodeTransformer):
    """How stubs read where Python's protocols cannot say: `acc, loss = metric.get_metric()`
    goes through `_unpacked`, so that a stub unpacks into as many stubs as there are names
    (iterated, a stub is empty); the `x` of `x is None` and `x > 0` through `_unset`, so that
    a stub is None or 0 there (`if cfg.weights is not None:`, `if cfg.z_loss > 0:`), the
    option left unset, as it is falsy in `if cfg.weights:`. (Elsewhere a stub is larger than
    any number: a limit, `step < args.max_steps`, is never reached.)"""

    def visit_Assign(self, node: ast.Assign) -> ast.Assign:
        self.generic_visit(node)
        (target, *more) = node.targets
        if (
            not more
            and isinstance(target, (ast.Tuple, ast.List))
            and not any(isinstance(e, ast.Starred) for e in target.elts)
        ):
            unpack = ast.Name(_UNPACK, ast.Load())
            node.value = ast.Call(unpack, [node.value, ast.Constant(len(target.elts))], [])
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.Compare:
        self.generic_visit(node)
        right = node.comparators[0]
        if len(node.ops) == 1 and isinstance(right, ast.Constant):
            tests_none = isinstance(node.ops[0], (ast.Is, ast.IsNot)) and right.value is None
            tests_sign = isinstance(node.ops[0], ast.Gt) and right.value in (0, 0.0)
            if tests_none or tests_sign and type(right.value) is not bool:
                node.left = ast.Call(ast.Name(_UNSET, ast.Load()), [node.left, right], [])
        return node


def _unpacked(value, count: int):
    if type(value) is Stub:
        return tuple(Stub(f"{value._path}[{i}]") for i in range(count))
    return value


def _unset(value, unset):
    return unset if type(value) is Stub else value


@contextlib.contextmanager
def _capturing(optimizer: RecordingOptimizer, namespace: dict, model: torch.nn.Module):
    """Capture the gradients at any optimizer's step, and record gradient clipping (which
    then clips nothing: torch's, and the model's own, as FSDP's `model.clip_grad_norm_`), for
    the duration of the replay."""

    def stepping(stepped, *args) -> None:
        if stepped is not optimizer:  # its own `step()` records too
            optimizer.record("optimizer.step")

    hook = register_optimizer_step_pre_hook(stepping)
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    saved = [(m, n, getattr(m, n)) for m in modules for n in CLIPPERS if hasattr(m, n)]
    originals = {id(f): n for _, n, f in saved}

    def clipper(name):
        return lambda *args, **kwargs: optimizer.clip(name)

    for module, name, _ in saved:
        setattr(module, name, clipper(name))
    for key, value in list(namespace.items()):
        if id(value) in originals:
            namespace[key] = clipper(originals[id(value)])
    if not hasattr(model, "clip_grad_norm_"):  # a fresh model of the replay's, not the user's
        model.clip_grad_norm_ = clipper("clip_grad_norm_")
    try:
        yield
    finally:
        hook.remove()
        for module, name, function in saved:
            setattr(module, name, function)


@contextlib.contextmanager
def _staying_on(device: torch.device):
    """On a machine without the accelerator the code expects, `.cuda()` and `.to(...)` to a
    CUDA device (`"cuda"`, `local_rank`, a stand-in's value) keep tensors and modules where
    the replay runs, `torch.cuda.synchronize()` has nothing to wait for, and
    `torch.cuda.current_device()` is that device (`to_device(batch, ...)`)."""
    if device.type == "cuda":
        yield
        return
    cuda, tensor, module = torch.cuda, torch.Tensor, torch.nn.Module
    saved = tensor.cuda, module.cuda, tensor.to, module.to, cuda.synchronize, cuda.current_device
    tensor.cuda = module.cuda = lambda self, *args, **kwargs: self
    tensor.to, module.to = _staying(tensor.to, device), _staying(module.to, device)
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.current_device = lambda: device
    try:
        yield
    finally:
        tensor.cuda, module.cuda, tensor.to, module.to, cuda.synchronize, cuda.current_device = (
            saved
        )


def _staying(to, device: torch.device):
    """`to` with a CUDA device, a device index or a stand-in read as `device`, and a stand-in
    dtype left out (`x.to(device_id, dtype=cast_dtype)` of an unbound script)."""

    def where(value):
        cuda = isinstance(value, str) and value.startswith("cuda")
        index = isinstance(value, int) and not isinstance(value, bool)
        if cuda or index or isinstance(value, Stub):
            return device
        return device if isinstance(value, torch.device) and value.type == "cuda" else value

    def moved(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = where(kwargs["device"])
        if isinstance(kwargs.get("dtype"), Stub):
            del kwargs["dtype"]
        return to(self, *map(where, args), **kwargs)

    return moved


@contextlib.contextmanager
def _autocast_as_asked(device: torch.device, dtype: torch.dtype):
    """The loop's own `torch.autocast(...)` runs as --dtype asks, on the replay's device:
    disabled for float32, else in that dtype. A script's mixed precision would otherwise make
    the replay's precision depend on the machine (bf16 on a GPU; nothing on the CPU, where
    `autocast("cuda")` casts nothing), and `enabled=args.amp` handed a stand-in needs no
    value."""
    original = torch.autocast.__init__
    signature = inspect.signature(original)
    asked = {
        "device_type": device.type,
        "dtype": None if dtype == torch.float32 else dtype,
        "enabled": dtype != torch.float32,
    }

    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments.update(asked)
        if isinstance(bound.arguments.get("cache_enabled"), Stub):
            bound.arguments["cache_enabled"] = None
        original(*bound.args, **bound.kwargs)

    torch.autocast.__init__ = init
    try:
        yield
    finally:
        torch.autocast.__init__ = original


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _TimedOut after `seconds` (main thread only; elsewhere there is no limit)."""
    if threading.current_thread() is not threading.main_thread() or not seconds:
        yield
        return

    def expire(signum, frame):
        raise _TimedOut()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def wants_group(message: str) -> bool:
    """Whether an error says the loop called `torch.distributed` (or a DistributedSampler)
    without a process group: the replay retries it in a group of one, and verify's verdict
    suggests `--distributed 2`."""
    return "process group" in message


def _describe(exc: BaseException, filename: str, plan: Plan) -> str:
    """The error, the script's line it came from, and the stand-ins that line reads (a value
    the harness could not bind reaching torch: `range(args.max_steps)`)."""
    frames = [
        (frame, line)
        for frame, line in traceback.walk_tb(exc.__traceback__)
        if frame.f_code.co_filename == filename
    ]
    mismatch = ""  # what the user can hand in instead of the harness's model or data
    if factory.current() is None and factory.current_data() is not None:
        mismatch = "; the tiny harness model was handed your batches"
    elif factory.current() is None and _model_call_refused(exc):
        mismatch = "; the loop calls its model in a way the harness's tiny model does not take"
    if mismatch:
        mismatch += ": pass your model with --model-factory"
    elif factory.current_data() is None and _beyond_pairs(plan):
        fields = ", ".join(key or "_" for key in plan.data_keys)
        mismatch = (
            f"; the harness served the {plan.data_arity} values the loop unpacks from each "
            f"batch as ({fields}): hand in batches of your own with --data-factory"
        )
    if not frames:
        return f"{type(exc).__name__}: {_brief(exc)}{mismatch}"
    frame, line = frames[-1]
    text = " ".join(
        ast.unparse(node)
        for root in (plan.target, *plan.helpers)
        for node in ast.walk(root)
        if isinstance(node, ast.expr) and getattr(node, "lineno", None) == line
    )
    paths = {
        stub._path
        for name, value in {**frame.f_globals, **frame.f_locals}.items()
        for stub in _stubs_read(name, value, text)
    }
    paths = sorted(p for p in paths if not any(o.startswith(p + ".") for o in paths))
    read = (
        f"; it reads {', '.join(f'`{p}`' for p in paths)}, which the harness could not bind "
        "and stands in for"
        if paths
        else ""
    )
    return f"{type(exc).__name__}: {_brief(exc)} (line {line}{read}){mismatch}"


def _brief(exc: BaseException) -> str:
    """The exception's first line, cut short: a message may print whole tensors."""
    text = next(iter(str(exc).strip().splitlines()), "")
    return text if len(text) <= BRIEF else text[:BRIEF].rstrip() + " ..."


def _model_call_refused(exc: BaseException) -> bool:
    """The harness's model refused what the loop asked of it: a keyword argument its
    `forward` does not take (`return_loss=True`), or an attribute it does not have."""
    if isinstance(exc, TypeError):
        return ".forward() got an unexpected keyword argument" in str(exc)
    return isinstance(exc, AttributeError) and isinstance(
        getattr(exc, "obj", None), torch.nn.Module
    )


def _stubs_read(name: str, value, text: str) -> list[Stub]:
    """The stubs `text` reads through `name`: `cfg.max_len` of a stub `cfg`, or of an
    `args` whose `max_len` is a stub."""
    found = []
    for chain in re.findall(rf"(?<![\w.]){re.escape(name)}((?:\.\w+)*)", text):
        read = value
        for attribute in chain.split(".")[1:]:
            read = getattr(read, attribute, None)
        if isinstance(read, Stub):
            found.append(read)
    return found
