"""The harness objects bound to a replayed statement's free names, by role: the tiny model (or
its two stages), the recording optimizer, the data, K, accelerate and GradScaler, the
instance of the class whose method holds the loop, and the assignments evaluated before it."""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import functools
import inspect
import math
import os
import re
import types
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from gaaudit.harness import factory
from gaaudit.harness.analysis import DATA_ROLES, Plan, chain_of
from gaaudit.harness.data import merge_batches
from gaaudit.harness.models import TinyTokenModel, ignore_value, vocab_size
from gaaudit.harness.nets import (
    PAD_ID,
    GaussianDiffusion,
    IdentityAutoencoder,
    NoiseSchedule,
    TimestepSampler,
    output_width,
)
from gaaudit.harness.stubs import (
    Batch,
    Booster,
    Criterion,
    DataSource,
    Fabric,
    LossScaler,
    Stub,
    Tokenizer,
    Turn,
    Turns,
    world_size,
)
from gaaudit.harness.surroundings import literal

TOKENIZER = re.compile(r"tokeni[sz]er", re.IGNORECASE)

MISSING_NAMES = 8  # module names the owner class's definition reads that become stubs


class Caller(NamedTuple):
    """The loop that calls a function taking one micro-batch a call: the parameter each
    batch goes to, the batches, ignite's engine whose state counts the calls (or None), and
    what the loop enters around each call: accelerate's `accumulate(model)` where the
    function backpropagates through an accelerator without entering it itself (smollm's
    `_do_batch`, whose caller does), else nothing."""

    batch: str
    source: DataSource
    engine: Stub | None
    turn: Callable[[], contextlib.AbstractContextManager]


class Objects:
    """`values` maps the statement's free names to what they are bound to; `bindings`
    receives a description of each. Raises (for replay to report) where the code around the
    statement cannot be reproduced."""

    def __init__(
        self,
        plan: Plan,
        batches: list,
        k: int,
        model,
        optimizer,
        *,
        device,
        dtype,
        ignore_index: int,
        namespace: dict,
        bindings: dict,
        filename: str,
    ):
        self.plan, self.bindings, self.values, self.filename = plan, bindings, {}, filename
        self.sources: list[DataSource] = []  # the data the loop reads, to count what it drew
        self.caller: Caller | None = None  # see `_bind_data`
        roles = {  # not a module's attributes (`torch.optim`), but its K (`config.accum_steps`)
            c: r
            for c, r in plan.roles.items()
            if not isinstance(namespace.get(c[0]), types.ModuleType)
            or c[0] in plan.rebound
            or r == "divisor"
        }
        if plan.owner is not None:
            self._instance(namespace)
        if plan.lightning:  # what Lightning sets itself (`self.trainer.accumulate_grad_batches`)
            base = lightning_base(type(self.values[plan.owner.instance]))
            instance = plan.owner.instance
            roles = {
                c: r
                for c, r in roles.items()
                if not (len(c) > 1 and c[0] == instance and hasattr(base, c[1]))
            }
        # a function trained one micro-batch a call counts K across its calls, in `accumulate`
        # (its own, or its caller's: see Caller)
        per_call = "micro-batch" in plan.roles.values()
        steps = k if plan.uses_accumulate or per_call else 1
        self.accelerator, self.optimizer, text = _accelerator(roles, optimizer, device, steps)
        self.model = model
        lacking = {  # what the tiny model lacks of the user's: stubs, and why
            **dict.fromkeys(
                plan.model_reads,
                "a part or a switch of your model that the harness's model does not have, "
                "left unset",
            ),
            **dict.fromkeys(
                plan.after_step,  # what it computes for a log line
                "a method of your model, called after the optimizer step, that the harness's "
                "model does not have",
            ),
        }
        for name in lacking.keys() - set(dir(model)):
            setattr(model, name, Stub(f"model.{name}"))
            self.bindings[f"model.{name}"] = f"stub: {lacking[name]}"
        fabric = Fabric(
            "fabric",
            {"clip_gradients": lambda *args, **kwargs: optimizer.clip("fabric.clip_gradients")},
        )
        self.scaler = None
        if "scaler" in roles.values():
            enabled = dtype == torch.float16 and device.type == "cuda"
            self.scaler = torch.amp.GradScaler(device.type, enabled=enabled)
        samples = sum(_samples(b) for b in batches)
        self.user = factory.current_data() is not None  # batches of the user's own, as they are
        items = served(plan, batches, self.user, ignore_index)
        if plan.data_tensor and isinstance(model, TinyTokenModel):  # lit-gpt: rows of
            # `block_size + 1` tokens, cut into inputs `[:, :block_size]` and targets `[:, 1:]`
            model.config.block_size = items[0].shape[1] - 1  # a window's rows share a width
        width = output_width(plan.model_kind, vocab_size())
        size = math.ceil(samples / k)
        described = {
            "model": (model, f"tiny {plan.model_kind} model"),
            "optimizer": (self.optimizer, text),
            "optimizers": ([self.optimizer], f"a list of one optimizer: {text}"),
            "schedulers": ([Stub("scheduler")], "a list of one inert scheduler"),
            "accelerator": (self.accelerator, f"Accelerator(gradient_accumulation_steps={steps})"),
            "scaler": (self.scaler, f"GradScaler(enabled={getattr(self.scaler, '_enabled', 0)})"),
            "fabric": (fabric, "single-process Fabric stand-in"),
            "booster": (Booster("booster"), "a booster whose backward(loss) backpropagates it"),
            "loss-scaler": (
                LossScaler("loss_scaler"),
                "loss scaler stand-in: backward, and a step where update_grad holds",
            ),
            "divisor": (k, f"K = {k}"),
            "turns": (Turns("turns"), "the loop's turns, counted from 0"),
            "contexts": (
                lambda *args, **kwargs: [Turn() for _ in range(k)],
                f"a function yielding K = {k} no-op contexts",
            ),
            "divisor-call": (lambda *args, **kwargs: k, f"a function returning K = {k}"),
            "micro-size": (size, f"{size} samples: a batch of {samples} makes {k} micro-batches"),
            "window-size": (samples, f"{samples} samples, the window's"),
            "width": (width, f"{width}, the model's output width"),
            "device": (str(device), str(device)),
            "dtype": (torch.float32, "torch.float32, the dtype of the tiny model's weights"),
            "noise-schedule": (
                NoiseSchedule(),
                "DDPM's linear noise schedule, predicting the noise",
            ),
            "autoencoder": (IdentityAutoencoder(), "an autoencoder whose latents are the images"),
            "diffusion": (
                GaussianDiffusion(),
                "a diffusion scoring the model's prediction of the noise, per sample",
            ),
            "timestep-sampler": (TimestepSampler(device), "uniform timesteps, each of weight 1"),
        }
        if "engine" in roles.values():
            engine = _deepspeed(model, self.optimizer, k, device)
            described["engine"] = (engine, f"DeepSpeed engine (gradient_accumulation_steps={k})")
        stages = self._stages(model)
        for chain, role in roles.items():
            if role in DATA_ROLES:
                self._bind_data(chain, role, items, namespace)
            elif role == "criterion":
                ignored = ignore_value(plan.model_kind, ignore_index)
                loss = Criterion(".".join(chain), plan.model_kind, ignored)
                text = "the harness's loss for its model (cross-entropy; MSE for regression)"
                self._bind(chain, loss, text, namespace)
            elif role == "namer":  # the user's own batches are named as the user's code does
                if not self.user:
                    text = "passes on the harness's batch, whose fields are named already"
                    self._bind(chain, lambda batch, *args, **kwargs: batch, text, namespace)
            elif chain in stages:
                part = "encoder" if chain == self.plan.stages[0] else "decoder"
                self._bind(
                    chain, stages[chain], f"the {part} of the tiny encoder-decoder pair", namespace
                )
            else:
                self._bind(chain, *described[role], namespace, imported=role == "divisor")
        length = _row_length(items[0]) if items else None
        for chain, added in plan.row_cuts.items() if length is not None else ():
            cut = f"`{'.'.join(chain)}{f' + {added}' if added else ''}`"
            text = f"{length - added}: the harness's rows hold {length} tokens, cut at {cut}"
            self._bind(chain, length - added, text, namespace)
        for name, value in plan.initial.items():
            if name not in self.values and name not in namespace:
                self.values[name] = value
                self.bindings[name] = f"{value!r}, as assigned before the statement"
        for name, roles in plan.items.items():
            if name not in self.values and name not in namespace:
                values = {key: k if role == "divisor" else 0 for key, role in roles.items()}
                self.values[name] = Stub(name, items=values)
                held = ", ".join(f"[{key!r}] = {value}" for key, value in values.items())
                self.bindings[name] = f"stub whose items start as {held}"
        self._derive(namespace)
        params = [p for p in plan.params or [] if p not in plan.optional]
        for name in plan.free + params:
            if name in plan.optional:
                continue
            if name not in self.values and (
                name in params or (name not in namespace and name not in vars(builtins))
            ):
                if TOKENIZER.search(name):  # `labels[labels == tokenizer.pad_token_id] = -100`
                    self.values[name] = Tokenizer(name, PAD_ID, device)
                    self.bindings.setdefault(
                        name,
                        f"stub whose pad_token_id is {PAD_ID}, the data's, and that reads the "
                        "captions it serves back into their tokens",
                    )
                elif (processes := world_size(name)) is not None:
                    self.values[name] = processes
                    self.bindings.setdefault(name, "the processes the replay runs on")
                else:
                    self.values[name] = Stub(name)
                    self.bindings.setdefault(name, "stub")
        for name, value in self.values.items():  # `args.ignore_index`: the script's default
            if type(value) is Stub and plan.settings:
                for option, default in plan.settings.items():
                    if option not in value._children:
                        setattr(value, option, default)
                described = self.bindings.get(name, "stub")
                self.bindings[name] = f"{described}, with the script's option defaults"

    def _instance(self, namespace: dict) -> None:
        """An instance of the class that owns the statement, made without running its
        `__init__`: its methods are the user's, unknown attributes read as stubs."""
        owner = self.plan.owner
        code = compile(
            ast.Module([_imports_read(c) for c in owner.classes], []), self.filename, "exec"
        )
        for _ in range(MISSING_NAMES):
            try:
                exec(code, namespace)  # noqa: S102
                break
            except NameError as exc:  # `def train(self, log_fn=noop)` in a method not replayed
                if exc.name is None or exc.name in namespace:
                    raise
                namespace[exc.name] = Stub(exc.name)
        cls = namespace[owner.classes[-1].name]
        module = issubclass(cls, torch.nn.Module)
        if (
            module
            and not self.plan.lightning
            and any(  # `self(**batch)`: the instance is the model
                isinstance(n, ast.Call) and chain_of(n.func) == (owner.instance,)
                for n in ast.walk(self.plan.target)
            )
        ):
            raise TypeError(
                f"the loop is a method of the torch module `{cls.__name__}`; the "
                f"harness cannot bind its own model to `{owner.instance}`"
            )
        getter = _module_stub_attribute if module else _stub_attribute
        if self.plan.lightning:  # stubs only where the class reads them: Lightning probes
            getter = _stubs_only_for(getter, _read_attributes(owner))  # hooks by getattr
        # a hook left abstract, whose subclasses live in other modules: a method doing nothing
        hooks = sorted(getattr(cls, "__abstractmethods__", ()))
        stand_in = type(
            cls.__name__,
            (cls,),
            {"__getattr__": getter, **{hook: _stand_in_hook(cls, hook) for hook in hooks}},
        )
        instance = object.__new__(stand_in)
        if self.plan.lightning:  # the LightningModule's own set-up, not the user's
            lightning_base(cls).__init__(instance)
        elif module:  # a trainer that is a torch module only to hold its parts: `self.model`
            torch.nn.Module.__init__(instance)
        self.values[owner.instance] = instance
        made = f"a {cls.__name__}"
        if owner.subclass:
            made += f" (the subclass of {owner.node.name} that fills in its hooks)"
        self.bindings[owner.instance] = (
            f"{made} made without __init__ (its methods run; unknown attributes are stubs)"
        )
        if hooks:
            named = ", ".join(f"`{hook}`" for hook in hooks)
            self.bindings[owner.instance] += (
                f"; its abstract {named} stand in (methods doing nothing, properties stubs)"
            )

    def _stages(self, model) -> dict:
        """The encoder and decoder of the tiny pair, for a loop that calls two models."""
        if self.plan.stages is None:
            return {}
        base = getattr(model, "module", model)
        if not hasattr(base, "encoder") or not hasattr(base, "decoder"):
            raise TypeError(
                "the loop chains two models; the harness serves them as the encoder "
                "and decoder of its own pair, which the supplied model does not have"
            )
        return dict(zip(self.plan.stages, (base.encoder, base.decoder)))

    def _derive(self, namespace: dict) -> None:
        """Evaluate the assignments before the statement that are literals, read a harness
        model (`params = list(enc.parameters())`) or build a torch module such as a loss
        (`criterion = nn.CrossEntropyLoss()`); what fails to evaluate stays a stub."""
        scope = {**namespace, **self.values}
        for item in self.plan.derived:
            ok, value = literal(item.value)
            if not ok and (item.reads_model or _builds_torch_module(item.value, scope)):
                try:
                    code = compile(ast.Expression(item.value), self.filename, "eval")
                    value = eval(code, scope)
                    ok = True
                except Exception:  # noqa: BLE001, S112 - the name stays a stub
                    continue
            if ok:
                self._bind(item.chain, value, f"`{ast.unparse(item.value)}`, evaluated", namespace)
                if len(item.chain) == 1:
                    scope[item.chain[0]] = value

    def _bind_data(self, chain, role: str, items: list, namespace: dict) -> None:
        prefetched = self.plan.prefetch.get(chain, [])
        source = DataSource(".".join(chain), items, start=1 if prefetched else 0)
        self.sources.append(source)
        one, many = ("dict batch", "dict batches")
        if self.plan.data_arity:
            keys = self.plan.data_keys or ("input_ids", "labels")
            fields = ", ".join(key or "_" for key in keys) + ("," if len(keys) == 1 else "")
            one, many = (f"({fields}) tuple", f"({fields}) tuples")
        if self.user:
            one, many = ("batch of the data factory", "batches of the data factory")
        text = f"{len(items)} micro-batches as {many}"
        if self.plan.splits_batch:
            text = f"the whole window as one {one} (the loop splits it)"
        if role == "micro-batch":  # the function is called once for each, as its caller would
            engine = None
            if "engine" in self.plan.params and ("engine",) not in self.plan.roles:
                # ignite's `update(engine, batch)`: `engine.state.iteration` counts the calls
                engine = self.values["engine"] = Stub("engine", {"state": Stub("engine.state")})
                self.bindings["engine"] = "ignite's engine, whose state counts the calls from 1"
            turn = contextlib.nullcontext
            if self.accelerator is not None and not self.plan.uses_accumulate:
                turn = functools.partial(self.accelerator.accumulate, self.model)
                self.bindings["accelerator.accumulate"] = "entered around each call"
            self.caller = Caller(chain[0], source, engine, turn)
            self.values[chain[0]] = items[0]
            self.bindings[chain[0]] = f"each of {text}, one a call (the caller's loop)"
        elif role == "data-call":
            self._bind(
                chain, lambda *args, **kwargs: source, f"a function returning {text}", namespace
            )
        elif chain in self.plan.enumerated:
            self._bind(chain, enumerate(source), f"{text}, enumerated", namespace)
        elif chain in self.plan.recorded:  # `meta["grad_accum_index"]` reads 0, 1, 2, ...
            records = ((defaultdict(functools.partial(int, i)), b) for i, b in enumerate(source))
            text = f"{text}, each after a record of the turn whose every item is its count from 0"
            self._bind(chain, records, text, namespace)
        else:
            self._bind(chain, source, text, namespace)
        for index, (name,) in enumerate(prefetched):
            self.values[name] = items[0] if len(prefetched) == 1 else items[0][index]
            self.bindings[name] = "the first micro-batch (prefetched)"

    def drawn(self) -> int:
        """How many micro-batches the loop drew before its step, when that is the window it
        formed (0 when unknown: a prefetching loop, a loop that splits one batch, or several
        data sources drawn from; a source bound but not drawn from, an evaluation loader say,
        does not count)."""
        served = [source.served for source in self.sources if source.served]
        if len(served) != 1 or self.plan.splits_batch or self.plan.prefetch:
            return 0
        return served[0]

    def _bind(self, chain, value, text: str, namespace: dict, imported: bool = False) -> None:
        """Bind `value` at `chain`: a free name, or an attribute of a stand-in (or of the
        instance whose method holds the loop); with `imported`, also an attribute of an object
        the module imports (`cfg.gradient_accum_steps` of a project's config), which the
        loop and its helpers then see through an `Overlay` (the object itself stays as it is)."""
        root = chain[0]
        owner = self.plan.owner
        if len(chain) == 1:
            self.values[root] = value
        elif imported and len(chain) == 2 and root in namespace and root not in self.values:
            if not isinstance(namespace[root], Overlay):
                namespace[root] = Overlay(namespace[root])
            namespace[root]._replaced[chain[1]] = value
        elif root in namespace or not (
            isinstance(self.values.setdefault(root, Stub(root)), Stub)
            or owner is not None
            and root == owner.instance
        ):
            return
        else:
            holder = self.values[root]
            for name in chain[1:-1]:
                holder = getattr(holder, name)
            setattr(holder, chain[-1], value)
        self.bindings[".".join(chain)] = text


class Overlay:
    """An object with some attributes replaced, the others read from it."""

    def __init__(self, wrapped) -> None:
        self._wrapped, self._replaced = wrapped, {}

    def __getattr__(self, name: str):  # only for names the overlay does not hold itself
        if name in ("_wrapped", "_replaced"):  # not set yet: a copy being made
            raise AttributeError(name)
        if name in self._replaced:
            return self._replaced[name]
        return getattr(self._wrapped, name)


def _samples(batch) -> int:
    """The first dimension of the first tensor in a batch (its number of samples), else 1."""
    tensor = _first_tensor(batch)
    return len(tensor) if tensor is not None and tensor.dim() else 1


def _row_length(batch) -> int | None:
    """The length of a batch's rows: the last dimension of its `input_ids`, else of its first
    tensor; None where it holds none."""
    tensor = _first_tensor(batch, "input_ids")
    return tensor.shape[-1] if tensor is not None and tensor.dim() > 1 else None


def _first_tensor(batch, preferred: str | None = None) -> torch.Tensor | None:
    """The first tensor in a batch, through its first nested value (of a mapping, its
    `preferred` field where it has one); None where that holds none."""
    if isinstance(batch, Mapping) and preferred is not None and preferred in batch:
        batch = batch[preferred]
    if isinstance(batch, torch.Tensor):
        return batch
    values = list(batch.values()) if isinstance(batch, Mapping) else batch
    if not isinstance(values, (list, tuple)):
        return None
    nested = (v for v in values if isinstance(v, (torch.Tensor, Mapping, list, tuple)))
    return next((_first_tensor(v, preferred) for v in nested), None)


def lightning_base(cls: type) -> type:
    """The LightningModule class that `cls` subclasses."""
    return next(c for c in cls.__mro__ if c.__name__ == "LightningModule")


def _does_nothing(self, *args, **kwargs) -> None:
    """An abstract method of the class the loop is a method of, made to run as a no-op."""


def _stand_in_hook(cls: type, name: str):
    """What stands in for the abstract `name` of `cls`: a method doing nothing, or for an
    abstract property a stub."""
    if isinstance(inspect.getattr_static(cls, name, None), property):
        return property(lambda self: Stub(f"{type(self).__name__}.{name}"))
    return _does_nothing


def _stub_attribute(self, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    value = world_size(name) or Stub(f"{type(self).__name__}.{name}")
    object.__setattr__(self, name, value)
    return value


def _imports_read(node: ast.ClassDef) -> ast.ClassDef:
    """The class with each import in its body (an old Trainer's `from
    transformers.trainer_pt_utils import _get_learning_rate, ...`, functions it makes its
    methods) turned into assignments of what the module namespace holds for those names: the
    import as `module_namespace` ran it, a stub where it failed."""
    made = copy.copy(node)
    made.body = []
    for statement in node.body:
        if not isinstance(statement, (ast.Import, ast.ImportFrom)):
            made.body.append(statement)
            continue
        for alias in statement.names:
            name = alias.asname or alias.name.split(".")[0]
            read = ast.Assign([ast.Name(name, ast.Store())], ast.Name(name, ast.Load()))
            made.body.append(ast.copy_location(read, statement))
    return ast.fix_missing_locations(made)


def _read_attributes(owner) -> re.Pattern:
    """The attributes of its instance that the owner's classes' methods read: by name
    (`self.tokenizer`), or by a name they format (`getattr(self, f"{phase}_metrics")`, any
    name of that form)."""
    names = set()
    for node in (n for cls in owner.classes for n in ast.walk(cls)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == owner.instance
            and isinstance(node.ctx, ast.Load)
        ):
            names.add(re.escape(node.attr))
        elif (
            isinstance(node, ast.Call)
            and chain_of(node.func) == ("getattr",)
            and len(node.args) > 1
            and chain_of(node.args[0]) == (owner.instance,)
            and isinstance(node.args[1], ast.JoinedStr)
            and any(isinstance(part, ast.Constant) for part in node.args[1].values)
        ):
            names.add(
                "".join(
                    re.escape(part.value) if isinstance(part, ast.Constant) else r"\w+"
                    for part in node.args[1].values
                )
            )
    return re.compile("|".join(sorted(names)) or "(?!)")


def _stubs_only_for(getter, names: re.Pattern):
    """A torch module's `getter` for the attributes `names` matches only; other attributes are
    missing, as without the stand-in."""

    def get(self, name: str):
        if not names.fullmatch(name):
            return torch.nn.Module.__getattr__(self, name)
        return getter(self, name)

    return get


def _module_stub_attribute(self, name: str):
    """A torch module's submodules, parameters and buffers, else a stub."""
    try:
        return torch.nn.Module.__getattr__(self, name)
    except AttributeError:
        return _stub_attribute(self, name)


def _builds_torch_module(node: ast.expr, scope: dict) -> bool:
    """`nn.CrossEntropyLoss(...)`: a call of a torch.nn.Module class defined by torch itself."""
    chain = chain_of(node.func) if isinstance(node, ast.Call) else None
    if chain is None or chain[0] not in scope:
        return False
    value = scope[chain[0]]
    for name in chain[1:]:
        value = getattr(value, name, None)
    return (
        isinstance(value, type)
        and issubclass(value, torch.nn.Module)
        and value.__module__.startswith("torch.")
    )


def _accelerator(roles: dict, optimizer, device, steps: int) -> tuple:
    """A real Accelerator when the loop uses one (its clipping recorded on the optimizer), the
    optimizer the loop steps (prepared by it), and that optimizer's description."""
    if "accelerator" not in roles.values():
        return None, optimizer, "recording SGD"
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=device.type == "cpu", gradient_accumulation_steps=steps)

    def clip(*args, **kwargs):
        accelerator.unscale_gradients()
        optimizer.clip("accelerator.clip_grad_norm_")

    accelerator.clip_grad_norm_ = accelerator.clip_grad_value_ = clip
    return accelerator, accelerator.prepare(optimizer), "recording SGD, prepared"


def _deepspeed(model, optimizer, k: int, device):
    """A real DeepSpeed engine around the tiny model that steps the recording optimizer every
    `k` micro-batches, without clipping (the gradient is compared before any), on the
    replay's process group."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError:
        raise ModuleNotFoundError(
            "the loop steps a DeepSpeed engine; install deepspeed to replay it"
        ) from None
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo: no kernel to build
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # one machine: local is global
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": k,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def served(plan: Plan, batches: list, user: bool, ignore_index: int) -> list:
    """What the loop's data yields: the user's batches as they are, tuples by position
    (`batch[3]` read as `labels`), `(input_ids, labels)` pairs, token tensors, image tensors
    (a latent-diffusion loop that reads its batches by no key), or dict `Batch`es; one merged
    batch for a loop that cuts it into micro-batches."""
    if plan.splits_batch:
        batches = [factory.concatenate(batches) if user else merge_batches(batches, ignore_index)]
    if user:
        return list(batches)
    fields = [_fields(b, ignore_index) for b in batches]
    if plan.data_keys:  # a tuple by position; an input the harness does not make is zeros
        return [
            tuple(
                f[key] if key in f else torch.zeros_like(f["input_ids"]) for key in plan.data_keys
            )
            for f in fields
        ]
    if plan.data_arity:  # `(images, labels)` of a latent-diffusion loop: images, tokens
        pair = (
            ("pixel_values", "input_ids")
            if plan.model_kind == "latent"
            else ("input_ids", "labels")
        )
        return [(*(b[key] for key in pair), *[None] * plan.data_fillers) for b in batches]
    if plan.data_tensor or (plan.model_kind == "sequence" and not plan.keyword_batch):
        return [b["input_ids"] for b in batches]
    if plan.model_kind == "latent" and not plan.data_aliases:  # read by no key: the images
        return [b["pixel_values"] for b in batches]
    aliased = plan.data_aliases.items()  # `batch["input_mask"]`: the field under that name
    return [
        Batch({**b, **{alias: f[key] for alias, key in aliased if key in f}})
        for b, f in zip(batches, fields)
    ]


def _fields(batch: dict, ignore_index: int) -> dict:
    """A harness batch's fields, with the loss mask made from its labels (1 where the loss
    counts a target) where it has labels, and where it has an attention mask each sequence's
    length, its prompt's (its first half, at least one token) and its number of images (0:
    the batch is text); where it has token rows, also each row's positions and the rejected
    side of a preference pair (`rejected_input_ids`, ...): each token moved to the next id of
    the vocabulary, padding and ignored targets kept, so that each row's two sides differ the
    same way in every micro-batch and in the full batch; beside a latent-diffusion batch's
    images, each caption as text, its token ids as words (which the harness's tokenizer reads
    back)."""
    if "pixel_values" in batch:
        captions = [" ".join(map(str, row.tolist())) for row in batch["input_ids"]]
        return {**batch, "caption": captions}
    if "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(-1)
        batch = {
            **batch,
            "lengths": lengths,
            "prompt_lengths": (lengths + 1) // 2,
            "num_images": torch.zeros_like(lengths),
        }
    if "labels" not in batch:
        return batch
    fields = {**batch, "loss_mask": (batch["labels"] != ignore_index).long()}
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.is_floating_point():
        return fields
    rejected = {
        "rejected_input_ids": _next_token(ids),
        "rejected_labels": _next_token(batch["labels"]),
        **{f"rejected_{k}": fields[k] for k in ("attention_mask", "loss_mask") if k in fields},
    }
    positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    return {**fields, "position_ids": positions, **rejected}


def _next_token(ids: torch.Tensor) -> torch.Tensor:
    """Each token id (2 .. vocab_size() - 1) moved to the next, the last to the first; padding
    and ignored targets (below 2) kept."""
    return torch.where(ids >= 2, 2 + (ids - 1) % (vocab_size() - 2), ids)
