"""The user's own model (`gaaudit verify --model-factory module:function`, or `model-factory`
in `[tool.gaaudit.verify]`): imported from the project root, checked once, then built in place
of the tiny harness model while user_model() is active."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


class FactoryError(Exception):
    """The model factory cannot be used; the message names the option and what to do."""


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


_current: UserModel | None = None


def load_factory(target: str, root: str, option: str = "--model-factory") -> UserModel:
    """Import `module:function` with `root` first on sys.path, call it twice under one seed and
    check that it returns the same torch.nn.Module both times. `option` says where the factory
    was named (`--model-factory` or the pyproject key), for the error messages."""
    where = f"{option} {target}"
    module_name, _, attribute = target.partition(":")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        value = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise FactoryError(
            f"{where}: cannot import {module_name!r} from {root} ({type(exc).__name__}: {exc}); "
            "name a module importable from the project root (the directory of pyproject.toml)"
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
            f"{where}: {attribute!r} is a {type(value).__name__}, not callable; "
            "name a function that takes no arguments and returns the model"
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


@contextlib.contextmanager
def user_model(model: UserModel | None) -> Iterator[None]:
    """While active, models.build_model builds `model` and the data fit its vocabulary."""
    global _current
    previous, _current = _current, model
    try:
        yield
    finally:
        _current = previous


def current() -> UserModel | None:
    """The user's model in effect, if any."""
    return _current
