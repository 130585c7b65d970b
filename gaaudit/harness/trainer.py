"""Trainer replay: a transformers Trainer of the user's file (a subclass, or the class a
`Trainer(...)` call builds), as written and as `gaaudit fix` rewrote it, trained by a real
Trainer for one optimizer step on a tiny GPT-2 (a language model, else a 3-class sequence
classifier) over K micro-batches of prompt-masked examples of varied length (of one length,
without masks, for data of fixed-length blocks), or on the user's model and batches where
given. Its gradient when the optimizer steps is compared with one backward of the class's
own `compute_loss` over the same examples as one batch. A project that pins transformers
before 4.46, or to 4.47.0 or 4.48.0, is replayed as those releases train (`as_pinned`)."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import io
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from gaaudit.harness.factory import (
    concatenate,
    current,
    current_data,
    to_device,
    without_project,
)
from gaaudit.harness.gradcheck import judged, relative_error, snapshot
from gaaudit.harness.models import LABELS, batch_as_keywords, head
from gaaudit.harness.project import constant, defined
from gaaudit.harness.stubs import Stub

with without_project():  # transformers probes for packages (flash_attn) as it imports
    from transformers import (
        GPT2Config,
        GPT2ForSequenceClassification,
        GPT2LMHeadModel,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainerCallback,
    )


MICRO = 2  # examples per micro-batch
FIXED = 24  # the length of every example of fixed-length data
# The Trainer's methods whose own versions the replay keeps: data loading hands it the
# harness's window in order, where a subclass's (a DistributedSampler, batches grouped by
# length or modality) would serve other micro-batches than the full batch it is compared
# with; the optimizer a subclass makes (parameter groups of layer types an old release
# exported) cannot change the gradients, which are read before it steps.
TRAINERS_OWN = frozenset(
    {
        "get_train_dataloader",
        "_get_train_sampler",
        "get_eval_dataloader",
        "_get_eval_sampler",
        "create_optimizer",
        "create_scheduler",
        "create_optimizer_and_scheduler",
    }
)
# What an older Trainer's `__init__` set and methods copied from it read (`if self.use_apex:`
# in a `training_step` of 4.3x): apex, AMP and sharded DDP, all off, as in the replay.
LEGACY_FLAGS = {
    "use_apex": False,
    "use_amp": False,
    "use_cuda_amp": False,
    "use_cpu_amp": False,
    "do_grad_scaling": False,
    "sharded_ddp": None,
}


class GradientsAtStep(TrainerCallback):
    """Copies every gradient when the optimizer is about to step."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = snapshot(model.parameters())


def trainer_class(
    source: str, filename: str, name: str, loss_func: str = "", stand_ins: bool = False
) -> type:
    """Class (or function) `name` of `source`, defined with the file's imports that this
    environment has and its module-level classes, functions and values that call nothing
    (`project.defined`); a trainer class that cannot be imported (trl's `SFTTrainer`, say)
    stands for the Trainer, and one the file does not define is transformers' class of that
    name; a module of the project that cannot be imported is defined from its source. With
    `loss_func`, the class is built with that function of the file as its
    `compute_loss_func`; with `stand_ins`, the other names of imports that fail are stubs, the
    project's too (Megatron's copy in the project is not built)."""
    modules = None if stand_ins else {}  # stand-ins for all that fails, the project's too
    namespace = defined(source, filename, functools.partial(_stand_in, stand_ins), modules)
    cls = _as_called_before(_named(namespace, name))
    return _given(cls, _named(namespace, loss_func)) if loss_func else cls


def _stand_in(stand_ins: bool, name: str):
    """What a name stands for whose import fails: transformers' Trainer for a trainer class
    (trl's `SFTTrainer`), with `stand_ins` a stub for any other, else nothing."""
    return Trainer if name.endswith("Trainer") else Stub(name) if stand_ins else None


def _as_called_before(cls):
    """A Trainer subclass whose overrides of the Trainer's methods take only the arguments
    they name, as the release they were written for called them (`training_step(self, model,
    inputs)`, which later releases hand the count); `compute_loss` aside (`_predates_the_count`).
    Its data loading and optimizer are the Trainer's own (`TRAINERS_OWN`); the flags of older
    releases that it reads are off (`LEGACY_FLAGS`)."""
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        return cls
    overrides = {
        name: getattr(Trainer, name) if name in TRAINERS_OWN else _taking_what_it_names(method)
        for owner in reversed(cls.__mro__[: cls.__mro__.index(Trainer)])
        if not owner.__module__.startswith("transformers")
        for name, method in vars(owner).items()
        if inspect.isfunction(method) and name != "compute_loss" and hasattr(Trainer, name)
    }
    overrides |= {name: value for name, value in LEGACY_FLAGS.items() if not hasattr(cls, name)}
    return type(cls.__name__, (cls,), overrides)


def _taking_what_it_names(method):
    """`method`, dropping the arguments it cannot bind: trailing positionals and unnamed
    keywords."""
    signature = inspect.signature(method)
    names = set(signature.parameters)

    @functools.wraps(method)
    def called(self, *args, **kwargs):
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError:
            positional = [
                p for p in signature.parameters.values() if p.kind <= p.POSITIONAL_OR_KEYWORD
            ]
            args = args[: len(positional) - 1]
            kwargs = {key: value for key, value in kwargs.items() if key in names}
        return method(self, *args, **kwargs)

    return called


def _named(namespace: dict, name: str):
    if not callable(namespace.get(name)) and name.endswith("Trainer"):
        import transformers  # `transformers.Seq2SeqTrainer(...)`, or a trainer not importable here

        return getattr(transformers, name, Trainer)
    if not callable(namespace.get(name)):
        raise TypeError(f"`{name}` could not be defined from the file")
    return namespace[name]


def as_pinned(cls: type, kind: str = "old", head: bool = False) -> type:
    """`cls` training as the releases a pin of `kind` admits did (`checks.versions.verdict`):
    before 4.46, `compute_loss` called without `num_items_in_batch`, the model's own mean loss,
    divided by the accumulation steps; 4.47.0 and 4.48.0 (`regressed`), a model that takes
    loss kwargs handed no count while the division is skipped, where a transformers `head`
    (`models.head`, whose 5.x class takes `**kwargs`) takes none, as in 4.x."""

    class Regressed(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if head:
                self.model_accepts_loss_kwargs = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.model_accepts_loss_kwargs:
                num_items_in_batch = None
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Pinned(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = False  # no token count reaches the model
            self.loss_is_scaled_for_ga = False  # so `training_step` divides the loss by K

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs)

    made = Regressed if kind == "regressed" else Pinned
    made.__name__ = made.__qualname__ = cls.__name__
    return made


def _predates_the_count(cls: type) -> bool:
    """Whether the class's own `compute_loss` takes no `num_items_in_batch` (nor `**kwargs`):
    written for a release before 4.46, the installed Trainer cannot call it, and it trains as
    those releases do (`as_pinned`)."""
    if cls.compute_loss is Trainer.compute_loss:
        return False
    parameters = inspect.signature(cls.compute_loss).parameters.values()
    return not any(p.name == "num_items_in_batch" or p.kind is p.VAR_KEYWORD for p in parameters)


def _given(cls: type, loss_func) -> type:
    """`cls` built with `compute_loss_func=loss_func`, as the user's file builds it."""

    class Given(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{"compute_loss_func": loss_func, **kwargs})

    Given.__name__ = Given.__qualname__ = cls.__name__
    return Given


def tiny_model(classifier: bool = False) -> torch.nn.Module:
    """A 2-layer GPT-2 from a config, dropout off, weights fixed by the seed."""
    config = GPT2Config(
        vocab_size=64,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        num_labels=3,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if classifier:
        return GPT2ForSequenceClassification(config)
    model = GPT2LMHeadModel(config)
    model.register_forward_pre_hook(batch_as_keywords, with_kwargs=True)
    # as for a `...ForCausalLM` class: the Trainer counts the shifted labels, which the loss
    # averages over (GPT-2's class name leaves the loss type unknown, and the count one too
    # high per row whose first label is not ignored)
    model.loss_type = "ForCausalLM"
    return model


def examples(
    n: int, seed: int = 0, classifier: bool = False, fixed: bool = False, head: str = ""
) -> list[dict[str, torch.Tensor]]:
    """Rows of different lengths: prompt and reply, the prompt masked out of the labels; or
    one class label per row. `fixed`: rows of one length with nothing masked. For a `head`
    (`models.head`), the labels are what it predicts: one class per row ("classify"), a class
    per token of the reply ("tag"), the input itself at a random fifth of the reply's
    positions ("mlm"), other tokens ("seq2seq", shifted right as the decoder's input)."""
    generator = torch.Generator().manual_seed(seed + 1)
    rows = []
    for _ in range(n):
        length = FIXED if fixed else int(torch.randint(6, 40, (1,), generator=generator))
        prompt = 0 if fixed else int(torch.randint(2, length - 2, (1,), generator=generator))
        input_ids = torch.randint(2, 64, (length,), generator=generator)
        labels = input_ids.clone()
        if head == "tag":
            labels = torch.randint(0, LABELS, (length,), generator=generator)
        elif head == "mlm":
            hidden = torch.rand(length, generator=generator) < 0.2
            hidden[-1] = True  # one target at least
            labels[~hidden] = -100
        elif head == "seq2seq":
            labels = torch.randint(2, 64, (length,), generator=generator)
        labels[:prompt] = -100
        if classifier or head == "classify":
            labels = torch.randint(0, 3, (), generator=generator)
        row = {"input_ids": input_ids, "labels": labels}
        if head == "seq2seq":  # as `DataCollatorForSeq2Seq(model=...)` makes them
            row["decoder_input_ids"] = torch.cat([torch.zeros(1, dtype=torch.long), labels[:-1]])
            row["decoder_input_ids"][row["decoder_input_ids"] == -100] = 0
        rows.append(row)
    return rows


def micro_batches(k: int, seed: int, fixed: bool) -> list:
    """One window of `k` collated micro-batches of `MICRO` rows (`examples`), padded to one
    width so that the full batch joins them; `--data-factory`'s window when one is given."""
    data = current_data()
    if data is not None:
        return data.window(k, seed)
    rows = examples(k * MICRO, seed, fixed=fixed)
    width = widest(rows)
    return [collate(rows[i * MICRO : (i + 1) * MICRO], width) for i in range(k)]


def collate(rows: list[dict[str, torch.Tensor]], width: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded to the longest row (or to `width`): pad id 0, attention mask 0, label -100;
    each family of keys alike (`input_ids_chosen`, `attention_mask_chosen`, ...)."""
    width = max(width, widest(rows))
    batch = {}
    for tag in _tags(rows[0]):
        ids, mask, labels = (
            tag.format(field) for field in ("input_ids", "attention_mask", "labels")
        )
        batch[ids] = torch.zeros(len(rows), width, dtype=torch.long)
        batch[mask] = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[ids][i, : len(row[ids])] = row[ids]
            batch[mask][i, : len(row[ids])] = 1
        if labels not in rows[0]:
            continue
        if rows[0][labels].dim() == 0:  # one class label per row
            batch[labels] = torch.stack([row[labels] for row in rows])
            continue
        batch[labels] = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[labels][i, : len(row[labels])] = row[labels]
    return batch


def widest(rows: list[dict[str, torch.Tensor]]) -> int:
    """The longest sequence of any family of the rows."""
    return max(len(row[tag.format("input_ids")]) for row in rows for tag in _tags(row))


def _tags(row: dict) -> list[str]:
    """The families of a row's keys, as a template of the field: `{}` for `input_ids`,
    `{}_chosen` for `input_ids_chosen`."""
    return [key.replace("input_ids", "{}") for key in row if "input_ids" in key]


def _paired(rows: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """One row per example holding a family of the keys for each list of `rows`: a pairwise
    collator's (`input_ids_chosen`, `input_ids_rejected`), with the labels only of families
    whose labels are among `keys`."""
    tags = sorted({key.replace("input_ids", "{}") for key in keys if "input_ids" in key})
    return [
        {
            tag.format(field): value
            for tag, row in zip(tags, together)
            for field, value in row.items()
            if field == "input_ids" or tag.format(field) in keys
        }
        for together in zip(*rows)
    ]


def _paired_keys(source: str, name: str) -> tuple[str, ...]:
    """The batch keys that class `name` of `source` names: by indexing (a reward trainer's
    `inputs["input_ids_chosen"]`) or in a module-level literal constant it reads (a list of
    keys it unpacks), where some name a family of `input_ids` other than `input_ids` itself;
    else ()."""
    tree = ast.parse(source)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    read = {n.id for cls in classes for n in ast.walk(cls) if isinstance(n, ast.Name)}
    listed = [
        node.value
        for node in tree.body
        if constant(node) and any(isinstance(t, ast.Name) and t.id in read for t in node.targets)
    ]
    strings = [
        node.slice for cls in classes for node in ast.walk(cls) if isinstance(node, ast.Subscript)
    ] + [node for value in listed for node in ast.walk(value)]
    keys = {
        node.value
        for node in strings
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(f in node.value for f in ("input_ids", "attention_mask", "labels"))
    }
    pairs = any("input_ids" in key and key != "input_ids" for key in keys)
    return tuple(sorted(keys)) if pairs else ()


def arguments(
    directory: str, k: int, device="cpu", options: dict | None = None, **changes
) -> Seq2SeqTrainingArguments:
    """One optimizer step over k micro-batches, in order, writing nothing outside `directory`
    (the Seq2Seq arguments serve a `Seq2SeqTrainer` subclass too); `changes` override, and
    `options` the project adds to its arguments (`use_lora`) are set where transformers has
    no field of that name."""
    settings = {
        "output_dir": directory,
        "per_device_train_batch_size": MICRO,
        "gradient_accumulation_steps": k,
        "max_steps": 1,
        "learning_rate": 1e-3,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": torch.device(device).type == "cpu",
        "disable_tqdm": True,
        "remove_unused_columns": False,
    }
    made = Seq2SeqTrainingArguments(**{**settings, **changes})
    for name, value in (options or {}).items():
        if not hasattr(made, name):
            setattr(made, name, value)
    return made


@dataclass(frozen=True)
class Window:
    """What one replay trains on: the user's model and k micro-batches (`--model-factory`,
    `--data-factory`) where given, else the tiny GPT-2 (a classifier with `classifier`) and
    k micro-batches of the harness's rows (of one length with `fixed`)."""

    k: int
    seed: int
    device: object
    fixed: bool = False
    classifier: bool = False
    options: tuple = ()  # the project's own arguments: `arguments`' `options`
    keys: tuple = ()  # a pairwise collator's keys (`_paired_keys`): rows of those families
    head: str = ""  # the transformers head the Trainer is given, as `models.head` stands for it
    opts_out: bool = False  # the model is set `accepts_loss_kwargs = False`

    def rows(self) -> list[dict[str, torch.Tensor]]:
        """The window's examples: the harness's rows, one family of them per pairwise key."""
        n = self.k * MICRO
        if not self.keys:
            return examples(n, self.seed, self.classifier, self.fixed, self.head)
        families = sum("input_ids" in key for key in self.keys)
        made = [
            examples(n, self.seed + 101 * i, self.classifier, self.fixed) for i in range(families)
        ]
        return _paired(made, self.keys)

    def model(self) -> torch.nn.Module:
        user = current()
        if user is None:
            model = head(self.head) if self.head else tiny_model(self.classifier)
        else:
            torch.manual_seed(0)
            model = user.build()
        if self.opts_out:
            model.accepts_loss_kwargs = False
        return model

    def micro_batches(self) -> tuple[list, Callable, int]:
        """The Trainer's dataset, its collator (padding every micro-batch to the window's
        width, so that a loss over padded positions matches the full batch's) and the rows
        per micro-batch."""
        data = current_data()
        if data is not None:  # each item is one micro-batch, as the user's loader yields it
            return data.window(self.k, self.seed), _first, 1
        rows = self.rows()  # padded to the full batch's width: its exact slices
        return rows, functools.partial(collate, width=widest(rows)), MICRO

    def full_batch(self):
        data = current_data()
        if data is not None:
            return to_device(concatenate(data.window(self.k, self.seed)), self.device)
        return to_device(collate(self.rows()), self.device)


def _first(rows: list):
    return rows[0]


def _step(cls: type, window: Window) -> list[torch.Tensor]:
    """The gradient when the Trainer's optimizer first steps, after k micro-batches."""
    capture = GradientsAtStep()
    dataset, collator, rows = window.micro_batches()
    with tempfile.TemporaryDirectory() as directory:
        trainer = cls(
            model=window.model(),
            args=arguments(
                directory,
                window.k,
                window.device,
                dict(window.options),
                per_device_train_batch_size=rows,
            ),
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[capture],
        )
        trainer.train()
    if capture.grads is None:
        raise RuntimeError("the Trainer's optimizer never stepped")
    return capture.grads


def _full_batch(cls: type, window: Window) -> list[torch.Tensor]:
    """One backward of the class's `compute_loss` over all k micro-batches as one batch."""
    with tempfile.TemporaryDirectory() as directory:
        model = window.model().to(window.device)
        args = arguments(directory, window.k, window.device, dict(window.options))
        trainer = cls(model=model, args=args)
        trainer.compute_loss(model, window.full_batch()).backward()
    return snapshot(model.parameters())


def _error(cls: type, reference: type, window: Window) -> float:
    """The relative gradient error of `cls` against `reference`'s full-batch loss, on the
    language model, else on the classifier (on the user's model only, when given). On a GPU
    a model that another may follow is first tried on the CPU: a kernel that fails there (a
    classifier's loss gathering at -100) is a device-side assert on the GPU, after which the
    process can run nothing."""
    failure = None
    kinds = (False,) if current() or window.head else (False, True)
    for classifier in kinds:
        try:
            attempt = replace(window, classifier=classifier)
            if classifier != kinds[-1] and torch.device(window.device).type != "cpu":
                for version in {reference, cls}:
                    _full_batch(version, replace(attempt, device="cpu"))
            want = _full_batch(reference, attempt)
            got = _step(cls, attempt)
        except Exception as exc:  # noqa: BLE001 - reported when neither model runs
            failure = failure or exc
            continue
        return relative_error(got, want)
    raise failure


def compare(
    original: str,
    patched: str | None,
    filename: str,
    name: str,
    k: int,
    seed: int,
    device,
    pinned: str = "",
    fixed: bool = False,
    loss_func: str = "",
    options: dict | None = None,
    head: str = "",
    patched_loss_func: str = "",
    opts_out: tuple[bool, bool] = (False, False),
) -> dict:
    """The row of one Trainer class for one K: each version's error against the original
    class's loss over the full batch, with its verdict (`original_verdict`; `verdict` is the
    patched version's, else the original's). `pinned`: the kind of the project's pin
    (`as_pinned`): the versions train as its releases did, and the original also as the
    installed release does (`installed_*`);
    `fixed`: on examples of one length; `loss_func`: the file's function each version's
    Trainer is given as `compute_loss_func`; `options`: the project's own arguments'
    defaults; `head`: the tiny transformers head standing for the one the Trainer is given
    (`models.head`); `patched_loss_func`: the patched version's (a fix may give one);
    `opts_out`: whether the model is set `accepts_loss_kwargs = False`, as written and as
    patched. A version whose `compute_loss` predates the count (`_predates_the_count`) trains
    as the releases before 4.46 did (`predates`: the original does)."""
    row: dict = {"k": k, "original_error": None, "patched_error": None, "predates": False}
    with quietly():
        try:
            reference = trainer_class(original, filename, name, loss_func)
        except Exception as exc:  # noqa: BLE001 - the user's class, reported as the reason
            row["original_verdict"] = row["verdict"] = failed(exc)
            return row
        options = tuple((options or {}).items())
        keys = _paired_keys(original, name)
        window = Window(k, seed, device, fixed, options=options, keys=keys, head=head)
        versions = [("original", original, pinned, loss_func, opts_out[0])]
        if patched:
            versions += [("patched", patched, pinned, patched_loss_func or loss_func, opts_out[1])]
        versions += [("installed", original, "", loss_func, opts_out[0])] if pinned else []
        for version, source, old, given, opted in versions:
            try:
                cls = trainer_class(source, filename, name, given)
                if not old and _predates_the_count(cls):
                    old = "old"
                    row["predates"] |= version == "original"
                if old:
                    cls = as_pinned(cls, old, bool(head))
                error = row[f"{version}_error"] = _error(
                    cls,
                    as_pinned(reference, old, bool(head)) if old else reference,
                    replace(window, opts_out=opted),
                )
                row[f"{version}_verdict"] = judged(error, torch.float32)
            except Exception as exc:  # noqa: BLE001 - the user's class, reported as the reason
                row[f"{version}_verdict"] = failed(exc)
    row["verdict"] = row.pop("patched_verdict", row["original_verdict"])
    return row


@contextlib.contextmanager
def quietly():
    """The replay's output held back: the user's prints, the frameworks' warnings."""
    output = io.StringIO()
    with (
        contextlib.redirect_stdout(output),
        contextlib.redirect_stderr(output),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


def failed(exc: BaseException) -> str:
    return f"not replayable: {type(exc).__name__}: {exc}".splitlines()[0]
