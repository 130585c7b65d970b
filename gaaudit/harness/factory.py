"""The user's own model and batches (`gaaudit verify --model-factory module:function` and
`--data-factory module:function`, or `model-factory` / `data-factory` in
`[tool.gaaudit.verify]`): imported from the project root, checked once, then used in place of
the tiny harness model while user_model() is active, and of the harness's window while
user_data() is."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gaaudit.config import unimportable

DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


class FactoryError(Exception):
    """A factory cannot be used; the message names the option and what to do."""


@dataclass(frozen=True)
class UserModel:
    """A checked factory (`label` is its `module:function`); `vocab_size` bounds the token ids
    the harness draws (None: not visible on the model)."""

    factory: Callable[[], nn.Module]
    vocab_size: int | None
    label: str

    def build(self) -> nn.Module:
        """A fresh instance (the caller seeds torch first), kept in eval mode without dropout,
        so that a loop's `model.train()` changes nothing."""
        model = self.factory()
        for module in model.modules():
            if isinstance(module, DROPOUTS):
                module.p = 0.0
        model.train = lambda mode=True: nn.Module.train(model, False)
        return model.eval()


@contextlib.contextmanager
def without_project() -> Iterator[None]:
    """sys.path without the working directory, where the user's project lies, while the
    harness imports its own libraries: a package of the project that they probe for by name
    (a source checkout of `flash_attn` whose compiled extension was never built) is not taken
    for an installed one."""
    here = {"", ".", os.getcwd()}
    removed = [path for path in sys.path if path in here]
    sys.path[:] = [path for path in sys.path if path not in here]
    try:
        yield
    finally:
        sys.path[:0] = removed


def load_factory(target: str, root: str, option: str = "--model-factory") -> UserModel:
    """Import `module:function` with `root` first on sys.path, call it twice under one seed and
    check that it returns the same torch.nn.Module both times. `option` says where the factory
    was named (`--model-factory` or the pyproject key), for the error messages."""
    where = f"{option} {target}"
    value = _imported(
        target, root, where, "a function that takes no arguments and returns the model"
    )
    first, second = (_call(value, where) for _ in range(2))
    if any(
        not torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values())
    ):
        raise FactoryError(
            f"{where}: two calls under the same torch seed returned different "
            "weights; initialise them from torch's global generator or load them"
        )
    return UserModel(value, _vocab_size(first), target)


def _imported(target: str, root: str, where: str, wanted: str) -> Callable:
    """The callable `module:function` names, imported with `root` first on sys.path."""
    module_name, _, attribute = target.partition(":")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        value = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise FactoryError(
            unimportable(where, module_name, root, f"{type(exc).__name__}: {exc}")
        ) from None
    for name in attribute.split("."):
        if not hasattr(value, name):
            raise FactoryError(
                f"{where}: {module_name!r} has no attribute {attribute!r}; name a "
                "function defined in it"
            )
        value = getattr(value, name)
    if not callable(value):
        raise FactoryError(
            f"{where}: {attribute!r} is a {type(value).__name__}, not callable; name {wanted}"
        )
    return value


def _call(factory: Callable, where: str) -> nn.Module:
    torch.manual_seed(0)
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - reported with the option's name
        raise FactoryError(
            f"{where}: calling it with no arguments failed "
            f"({type(exc).__name__}: {exc}); make it build and return the model "
            "without arguments"
        ) from None
    if not isinstance(model, nn.Module):
        raise FactoryError(
            f"{where}: returned a {type(model).__name__}, not a torch.nn.Module; "
            "return the model instance"
        )
    return model


def _vocab_size(model: nn.Module) -> int | None:
    """`model.config.vocab_size`, else `model.vocab_size`, else the first nn.Embedding's size."""
    for size in (
        getattr(getattr(model, "config", None), "vocab_size", None),
        getattr(model, "vocab_size", None),
    ):
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)


@dataclass(frozen=True)
class UserData:
    """A checked data factory: `window(k, seed)` returns the k micro-batches of one window, as
    the loop's data loader yields them."""

    factory: Callable[[int], list]
    where: str  # the option and its value, for the error messages

    def window(self, k: int, seed: int) -> list:
        torch.manual_seed(seed)
        return _batches(self.factory, k, self.where)


def load_data_factory(target: str, root: str, option: str = "--data-factory") -> UserData:
    """Import `module:function` as load_factory does, call it with k = 2 and check that it
    returns two micro-batches that concatenate into one batch."""
    where = f"{option} {target}"
    function = _imported(target, root, where, "a function that takes k and returns k micro-batches")
    torch.manual_seed(0)
    concatenate(_batches(function, 2, where), where)
    return UserData(function, where)


def _batches(function: Callable[[int], list], k: int, where: str) -> list:
    try:
        batches = function(k)
    except Exception as exc:  # noqa: BLE001 - reported with the option's name
        raise FactoryError(
            f"{where}: calling it with k={k} failed ({type(exc).__name__}: {exc}); make it "
            "return k micro-batches"
        ) from None
    if not isinstance(batches, (list, tuple)) or len(batches) != k:
        got = f"{len(batches)} items" if isinstance(batches, (list, tuple)) else repr(batches)
        raise FactoryError(
            f"{where}: called with k={k}, it returned {got}; return a list of k micro-batches, "
            "each what the loop's data loader yields"
        )
    return list(batches)


def concatenate(batches: list, where: str = "the micro-batches"):
    """The micro-batches as one batch: tensors joined along their first dimension, mappings
    key by key, tuples (and lists of tensors) position by position, other lists one after the
    other; any other value must be the same in every micro-batch."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        if any(b.shape[1:] != first.shape[1:] for b in batches):
            shapes = ", ".join(str(tuple(b.shape)) for b in batches)
            raise FactoryError(
                f"{where}: tensors of shapes {shapes} do not join into one batch; pad the "
                "micro-batches of a window to one width"
            )
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return type(first)({key: concatenate([b[key] for b in batches], where) for key in first})
    if isinstance(first, tuple) or (
        isinstance(first, list) and all(isinstance(v, torch.Tensor) for v in first)
    ):
        joined = [concatenate(list(values), where) for values in zip(*batches)]
        return type(first)(joined) if not hasattr(first, "_fields") else type(first)(*joined)
    if isinstance(first, list):
        return [item for batch in batches for item in batch]
    if any(b != first for b in batches):
        raise FactoryError(
            f"{where}: {type(first).__name__} values differ between micro-batches; only "
            "tensors, mappings, tuples and lists join into one batch"
        )
    return first


def to_device(batch, device):
    """`batch` with every tensor inside it on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({key: to_device(value, device) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


_active: dict[str, UserModel | UserData | None] = {"model": None, "data": None}


@contextlib.contextmanager
def _activated(role: str, value) -> Iterator[None]:
    previous, _active[role] = _active[role], value
    try:
        yield
    finally:
        _active[role] = previous


def user_model(model: UserModel | None):
    """While active, models.build_model builds `model` and the data fit its vocabulary."""
    return _activated("model", model)


def current() -> UserModel | None:
    """The user's model in effect, if any."""
    return _active["model"]


def user_data(data: UserData | None):
    """While active, the harness replays on `data`'s batches (see current_data)."""
    return _activated("data", data)


def current_data() -> UserData | None:
    """The user's batches in effect, if any."""
    return _active["data"]
