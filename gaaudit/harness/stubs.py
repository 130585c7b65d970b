"""Stand-ins for the names a replayed loop uses that the harness does not model."""

from __future__ import annotations

import operator


class Stub:
    """An inert stand-in: callable, attribute-able (attributes are stubs too, or the values
    given in `children`), iterable-empty, falsy, a no-op context manager, absorbing in
    arithmetic and unequal to everything else. Its repr names the expression it replaces."""

    def __init__(self, path: str = "stub", children: dict | None = None):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_children", dict(children or {}))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._children:
            self._children[name] = Stub(f"{self._path}.{name}")
        return self._children[name]

    def __setattr__(self, name: str, value) -> None:
        self._children[name] = value

    def __call__(self, *args, **kwargs):
        return Stub(f"{self._path}()")

    def __getitem__(self, key):
        return Stub(f"{self._path}[]")

    def __setitem__(self, key, value) -> None:
        pass

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

    def __eq__(self, other) -> bool:
        return other is self

    def __ne__(self, other) -> bool:
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


def _absorb(self, *other):
    return self


def _false(self, other):
    return False


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or"):
    for _form in ("__{}__", "__r{}__", "__i{}__"):
        setattr(Stub, _form.format(_name), _absorb)
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Stub, f"__{_name}__", _absorb)
for _name in ("lt", "le", "gt", "ge"):
    setattr(Stub, f"__{_name}__", _false)
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


def progress_module(path: str = "tqdm") -> Stub:
    """A stand-in for the tqdm package (`tqdm.tqdm`, `tqdm.auto.tqdm`, `trange`)."""
    trange = lambda *args, **kwargs: Progress(range(*args))
    children = {"tqdm": Progress, "trange": trange}
    return Stub(path, {**children, **{sub: Stub(f"{path}.{sub}", children)
                                      for sub in ("auto", "std", "notebook", "rich")}})


class Exhausted(BaseException):
    """The loop read far more micro-batches than one window without stepping the optimizer."""


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
