"""Stand-ins for the names a replayed loop uses that the harness does not model."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
import re
import types

import torch

from gaaudit.harness.nets import denoising_loss

# the images of a vision-language batch and what indexes them: `pixel_values`, `images`,
# `image_sizes`, `multimodal_indices`
IMAGE_FIELDS = re.compile(r"^(pixel_values|images?|image_\w+|multimodal_\w+)$")


class Stub:
    """An inert stand-in: callable (as a decorator, it returns what it decorates; handed the
    data first, it returns the data), attribute-able (attributes are stubs too, or the values
    given in `children`), iterable-empty, falsy, a no-op context manager, absorbing in
    arithmetic, unequal to everything else (elementwise for a tensor: `ids == cfg.image_id`),
    dropped from a class's bases, larger than any number (but see replay._Stubs) and, on the
    left of `<`, below another stub (a limit such as `args.max_steps` is never reached,
    `epoch < args.epochs` holds). Items set on it are kept, and `items` gives some from the
    start (`state["iter_num"] += 1` counts from 0). Its repr names the expression it
    replaces."""

    def __init__(self, path: str = "stub", children: dict | None = None, items: dict | None = None):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_children", dict(children or {}))
        object.__setattr__(self, "_items", dict(items or {}))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._children:
            self._children[name] = world_size(name) or Stub(f"{self._path}.{name}")
        return self._children[name]

    def __setattr__(self, name: str, value) -> None:
        self._children[name] = value

    def __call__(self, *args, **kwargs):
        decorated = args[0] if len(args) == 1 and not kwargs else None
        if inspect.isroutine(decorated) or inspect.isclass(decorated):
            return decorated  # a decorator of a library that is not installed: `@beartype`
        if args and isinstance(args[0], (DataSource, Batch, range, types.GeneratorType)):
            # a wrapper around the data or the turns, `metric_logger.log_every(loader, ...)`
            # or `log_every(range(iters_per_epoch), ...)`; a function of a batch that the
            # replay cannot import, `prepare_sample(samples, cuda_enabled=...)`, returns it
            return args[0]
        return Stub(f"{self._path}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return ()  # a base class that is not installed: `class SFTTrainer(SLTrainer):`

    def __getitem__(self, key):
        try:
            return self._items[key]
        except (KeyError, TypeError):  # not set, or a key that cannot be kept (a slice)
            return Stub(f"{self._path}[]")

    def __setitem__(self, key, value) -> None:
        with contextlib.suppress(TypeError):
            self._items[key] = value

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:
        return False

    def __contains__(self, item) -> bool:
        return False

    def __eq__(self, other):
        if torch.is_tensor(other):
            return torch.zeros_like(other, dtype=torch.bool)
        return other is self

    def __ne__(self, other):
        if torch.is_tensor(other):
            return torch.ones_like(other, dtype=torch.bool)
        return other is not self

    __hash__ = object.__hash__

    def __float__(self) -> float:
        return 0.0

    def __int__(self) -> int:
        return 0

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __repr__(self) -> str:
        return f"<stub {self._path}>"


class Tokenizer(Stub):
    """A stub for a tokenizer that also reads the captions the harness serves (each word a
    token id: bindings._fields) back into their ids, as one `Batch` of `input_ids` and
    `attention_mask` padded with its `pad_token_id`, on `device`; other text makes a stub, as
    with Stub."""

    def __init__(self, path: str, pad_token_id: int, device: torch.device | str = "cpu"):
        super().__init__(path, children={"pad_token_id": pad_token_id})
        object.__setattr__(self, "_device", device)

    def __call__(self, text=None, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        if not (
            isinstance(texts, (list, tuple))
            and texts
            and all(
                isinstance(t, str) and t.split() and t.replace(" ", "").isdigit() for t in texts
            )
        ):
            return super().__call__(text, *args, **kwargs)
        rows = [[int(word) for word in t.split()] for t in texts]
        width, pad = max(map(len, rows)), self.pad_token_id
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows], device=self._device)
        return Batch({"input_ids": ids, "attention_mask": (ids != pad).long()})


WORLD_SIZE = {"world_size", "num_processes"}  # `args.world_size`, accelerate's `num_processes`


def world_size(name: str) -> int | None:
    """The processes the replay runs on, for a name that counts them (`args.world_size > 1`
    guards a collective): 1 unless it is a rank of `--distributed`; 1 for a degree of model
    parallelism (`args.pipeline_model_parallel_size`); None for other names."""
    if name.endswith("parallel_size"):
        return 1
    if name not in WORLD_SIZE:
        return None
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if distributed else 1


def _absorb(self, *other):
    return self


def _below(self, other):
    return isinstance(other, Stub)


def _above(self, other):
    return not isinstance(other, Stub)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or"):
    for _form in ("__{}__", "__r{}__", "__i{}__"):
        setattr(Stub, _form.format(_name), _absorb)
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Stub, f"__{_name}__", _absorb)
for _name in ("lt", "le"):
    setattr(Stub, f"__{_name}__", _below)
for _name in ("gt", "ge"):
    setattr(Stub, f"__{_name}__", _above)
del _name, _form


class Progress(Stub):
    """A tqdm stand-in: iterates what it wraps, silently; everything else is inert."""

    def __init__(self, iterable=(), *args, **kwargs):
        super().__init__("tqdm")
        object.__setattr__(self, "_iterable", iterable)

    def __iter__(self):
        return iter(self._iterable)

    def __len__(self) -> int:
        return operator.length_hint(self._iterable)

    def __bool__(self) -> bool:
        return True


RANGE_LIMIT = 10_000


def stub_range(*args):
    """`range` that reads a stub start or step as 0 or 1 and a stub stop as "until the
    optimizer steps" (at most RANGE_LIMIT turns, then Exhausted), so that
    `for epoch in range(args.epochs)` runs."""
    if not any(isinstance(a, Stub) for a in args):
        return range(*args)
    if len(args) == 1:
        args = (0, *args)
    defaults = (0, None, 1)
    start, stop, step = (
        defaults[i] if isinstance(a, Stub) else a for i, a in enumerate((*args, 1)[:3])
    )
    return _bounded(range(start, start + RANGE_LIMIT * step if stop is None else stop, step))


def stub_isinstance(value, classes) -> bool:
    """`isinstance`, where a stub standing for a class that could not be imported
    (`isinstance(sampler, LossAwareSampler)`) is a class of nothing."""
    if isinstance(classes, Stub):
        return False
    if isinstance(classes, tuple):
        classes = tuple(c for c in classes if not isinstance(c, Stub))
    return isinstance(value, classes)


def stub_enumerate(iterable, start=0):
    """`enumerate` that counts from 0 where its start is a stub (`start=start_iter` of a
    resumed epoch the harness could not bind)."""
    return enumerate(iterable, 0 if isinstance(start, Stub) else start)


def stub_getattr(value, name, *default):
    """`getattr`, where a stub name (`getattr(config, dataset_name)`, a caller's value the
    harness stands in for) reads a stub."""
    if isinstance(name, Stub):
        return Stub(f"{name._path} of {value!r}")
    return getattr(value, name, *default)


def tensor_round(number, ndigits=None):
    """`round`, also of a one-element tensor: what the harness's model returns where the
    user's returns a float (`round(accuracy * 100, 2)` in a log line)."""
    if isinstance(number, torch.Tensor):
        number = number.item()
    return round(number, ndigits)


def _bounded(turns: range):
    yield from turns
    if len(turns) == RANGE_LIMIT:
        raise Exhausted(f"a range with an unknown end ran {RANGE_LIMIT} times")


def trange(*args, **kwargs) -> Progress:
    """tqdm's `trange` stand-in."""
    return Progress(stub_range(*args))


def progress_module(path: str = "tqdm") -> Stub:
    """A stand-in for the tqdm package (`tqdm.tqdm`, `tqdm.auto.tqdm`, `trange`)."""
    children = {"tqdm": Progress, "trange": trange}
    return Stub(
        path,
        {
            **children,
            **{sub: Stub(f"{path}.{sub}", children) for sub in ("auto", "std", "notebook", "rich")},
        },
    )


class Exhausted(BaseException):
    """The loop read far more micro-batches than one window without stepping the optimizer."""


class Batch(dict):
    """A dict batch, as a collate function returns (`isinstance(batch, dict)` holds: LAVIS
    and meshgpt branch on it), that also moves with `.to(...)` and reads its keys as
    attributes, as a tokenizer's BatchEncoding does."""

    def to(self, *args, **kwargs) -> Batch:
        """The batch moved: its tensors (a loop may have added others, `samples["iters"]`)."""
        return Batch(
            {k: v.to(*args, **kwargs) if torch.is_tensor(v) else v for k, v in self.items()}
        )

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __missing__(self, key: str) -> None:
        """The images of a vision-language batch, and their indices, where the batch has no
        images (the harness's are text): None."""
        if not IMAGE_FIELDS.search(key) or "pixel_values" in self:
            raise KeyError(key)


class ApexAmp:
    """apex's `amp`, where apex is not installed (it builds on CUDA only): `initialize`
    returns the model and optimizer as they are, `scale_loss` yields the loss unscaled (a
    loss scale apex removes again before the step), and `master_params` reads the optimizer's
    parameters, so a loop that trains through it runs in fp32 as O0 would."""

    @staticmethod
    def initialize(models, optimizers=None, *args, **kwargs):
        return models if optimizers is None else (models, optimizers)

    @staticmethod
    @contextlib.contextmanager
    def scale_loss(loss, optimizers, *args, **kwargs):
        yield loss

    @staticmethod
    def master_params(optimizer):
        for group in optimizer.param_groups:
            yield from group["params"]


class DataSource(Stub):
    """One window of micro-batches served as a DataLoader-like iterable, as an iterator
    (`next(it)`) and as a `get_batch('train')`-style callable; the latter two cycle, so a
    loop that prefetches the next batch still works. `start` skips prefetched items."""

    def __init__(self, path: str, items: list, start: int = 0):
        super().__init__(path)
        for name, value in (("_items", items), ("_position", start), ("_served", 0)):
            object.__setattr__(self, name, value)

    def _serve(self, index: int):
        object.__setattr__(self, "_served", self._served + 1)
        if self._served > 4 * len(self._items) + 4:
            raise Exhausted(f"{self._path} served {self._served - 1} micro-batches")
        return self._items[index % len(self._items)]

    @property
    def served(self) -> int:
        return self._served

    def __iter__(self):
        return (self._serve(i) for i in range(len(self._items)))

    def __next__(self):
        object.__setattr__(self, "_position", self._position + 1)
        return self._serve(self._position - 1)

    def __call__(self, *args, **kwargs):
        return next(self)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return True


class Fabric(Stub):
    """A Lightning Fabric stand-in for one process: `backward` is `loss.backward()` (Fabric
    does not divide by K), `no_backward_sync` does nothing, `all_reduce` over one process returns its input; everything
    else is inert."""

    def backward(self, tensor, *args, **kwargs) -> None:
        tensor.backward(*args)

    def no_backward_sync(self, *args, **kwargs):
        return contextlib.nullcontext()

    world_size = 1

    def all_reduce(self, data, *args, **kwargs):
        return data  # one process: the sum over processes is the value itself


class Booster(Stub):
    """ColossalAI's `booster.backward(loss, optimizer)` (and coati's `strategy.backward`) for
    one process: the loss backpropagated as it is (neither divides by K); everything else is
    inert."""

    def backward(self, loss, *args, **kwargs) -> None:
        loss.backward()


class Turns(Stub):
    """The turns a loop counts, `bar = tqdm(range(steps))`: 0, 1, 2, ... until the replay
    ends at the step; its other attributes are stubs (`bar.set_description(...)`)."""

    def __iter__(self):
        return itertools.count()


class Turn(contextlib.nullcontext):
    """One micro-batch's context from a helper such as `model_forward_contexts(accelerator,
    model, K)` (no gradient sync but at the last): for one process, nothing; entered as it is
    or called first (`with context():`)."""

    def __call__(self, *args, **kwargs) -> Turn:
        return self


class LossScaler(Stub):
    """timm's and MAE's `NativeScaler` for one process in full precision: `loss_scaler(loss,
    optimizer, clip_grad=..., parameters=..., update_grad=...)` backpropagates the loss and,
    when `update_grad` holds, steps the optimizer (a replay clips nothing); everything else
    is inert."""

    def __call__(self, loss, optimizer=None, *args, create_graph=False, update_grad=True, **kw):
        loss.backward(create_graph=create_graph)
        if update_grad and optimizer is not None:
            optimizer.step()
        return torch.zeros(())  # the gradient norm it would report


class Criterion(Stub):
    """A loss function the loop is handed and the harness cannot see (`criterion(outputs,
    targets)`): the loss the harness takes as truth for its model (cross-entropy, mean over
    the targets that are not `ignore_index`; mean squared error for regression), on the
    outputs and targets the loop passes; handed the network and the images by keyword, as
    EDM's losses are (`loss_fn(net=ddp, images=x, labels=y)`), a denoising loss."""

    def __init__(self, name: str, kind: str, ignore_index: int):
        super().__init__(name)
        object.__setattr__(self, "_loss", (kind, ignore_index))

    def __call__(self, *args, **kwargs):
        if not args and {"net", "images"} <= kwargs.keys():
            return denoising_loss(kwargs["net"], kwargs["images"], kwargs.get("labels"))
        if len(args) < 2:
            raise TypeError(
                f"`{self._path}` is not called as `(outputs, targets)`, as the harness's "
                "stand-in for a loss function it cannot see is"
            )
        (output, target), (kind, ignore_index) = args[:2], self._loss
        output = getattr(output, "logits", output).float()
        if kind == "regression":
            return torch.nn.functional.mse_loss(output, target)
        if output.dim() == 3 and target.dim() == 2:  # token logits (B, T, V)
            output, target = output.flatten(0, 1), target.flatten()
        return torch.nn.functional.cross_entropy(output, target, ignore_index=ignore_index)
