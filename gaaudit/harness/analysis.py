"""Static half of statement replay: find the statement to run, its free names, and the role
each free name (or attribute chain such as `args.gradient_accumulation_steps`) plays."""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field

from gaaudit.analysis.domain import TASKS, TOKEN_TASKS
from gaaudit.fixes.read_ahead import reads_ahead_call
from gaaudit.harness.surroundings import (
    Chain,
    Derived,
    Owner,
    assignments_before,
    constants,
    enclosing_owner,
    framework_base,
    functions_around,
    implemented,
    init_defaults,
    literal,
    methods_called,
    parameter_defaults,
)
from gaaudit.vocabulary import RETURN_COUNT

LOOPS = (ast.For, ast.While)
DEFS = (ast.FunctionDef,)
# The metric loggers of timm-style engines, which time and print what they iterate:
# `metric_logger.log_every(data_loader, print_freq, header)`.
LOGGING_WRAPPERS = {"log_every"}
# Calls that iterate their first argument: `enumerate(tqdm(loader))`, and those loggers.
ITER_WRAPPERS = {"enumerate", "tqdm", "iter", "islice", "zip", *LOGGING_WRAPPERS}
HF_KWARGS = {"input_ids", "labels", "attention_mask", "decoder_input_ids", "inputs_embeds"}
MODEL_METHODS = {"parameters", "named_parameters", "train", "eval", "generate"}
MELS = ("mel", "mels", "mel_spec")  # batch keys of spectrograms: the `frames` kind's inputs
# the share of its inputs a model that scores itself masks: the `masked` kind's keyword
MASK_RATIO_RE = re.compile(r"^mask_?ratio$", re.IGNORECASE)
BATCH_KEYS = {  # names a loop unpacks a batch into, by the field of the harness's batches
    **dict.fromkeys(
        ("input_ids", "ids", "tokens", "input_tokens", "source_ids", "src", "inputs", "x", "seq"),
        "input_ids",
    ),
    **dict.fromkeys(
        ("attention_mask", "attn_mask", "input_mask", "mask", "source_mask"), "attention_mask"
    ),
    **dict.fromkeys(
        ("labels", "label_ids", "lm_labels", "targets", "target", "target_ids", "tgt", "y"),
        "labels",
    ),
    # a spectrogram (the `frames` kind's inputs, channels first) and its length (its labels)
    **dict.fromkeys(MELS, "input_ids"),
    **dict.fromkeys(("mel_lengths", "mel_lens"), "labels"),
    "position_ids": "position_ids",  # each row's positions, 0 .. width - 1
    # each sample's count of text tokens (its length) and of images (none: the harness's
    # batches are text, as a vision-language model's batches without images are)
    "num_text_tokens": "lengths",
    **dict.fromkeys(("num_images", "n_images"), "num_images"),
    # the images a latent-diffusion loop encodes and their captions (the latent kind's)
    **dict.fromkeys(("pixel_values", "pixels", "images", "image"), "pixel_values"),
    **dict.fromkeys(("caption", "captions", "prompt", "prompts"), "caption"),
    # made from the labels: 1 where the loss counts a target, 0 where it ignores one
    **dict.fromkeys(
        ("loss_mask", "label_mask", "labels_mask", "target_mask", "completion_mask"), "loss_mask"
    ),
}
# a key of one side of a preference pair: `chosen_input_ids`, `y_rejected`
PREFERENCE_SIDE = re.compile(
    r"^(?P<first>chosen|rejected)_(?P<before>\w+)$|^(?P<after>\w+)_(?P<last>chosen|rejected)$"
)
MODEL_RE = re.compile(r"model|net$|gpt|llm|transformer", re.IGNORECASE)
OPTIMIZER_RE = re.compile(r"optim", re.IGNORECASE)
OPTIONS_RE = re.compile(r"(kwargs|args|config|cfg|params?)$", re.IGNORECASE)  # what builds one
# what steps without being an optimizer: a learning-rate schedule, `torch.profiler.profile`
SCHEDULER_RE = re.compile(r"sched|profil|^prof$", re.IGNORECASE)
# a function that makes something (`get_sft_collate_fn(**kwargs)`): not a model called on a batch
FACTORY_RE = re.compile(r"(get|make|build|create|load)_", re.IGNORECASE)
# what a function that trains on one micro-batch a call names it: `def train_step(batch)`
BATCH_PARAM = re.compile(r"batch|^(inputs?|samples?|data|examples?)$", re.IGNORECASE)
DATA_ROLES = ("data", "data-call", "micro-batch")
DATA_RE = re.compile(r"batch|loader|data|(^|_)iter(ator)?($|_)", re.IGNORECASE)
DIVISOR_RE = re.compile(r"accum|^n(um)?_micro_?batch(es)?$", re.IGNORECASE)
# the methods of a dict batch that read one of its fields: `batch.pop("loss_mask")`
FIELD_METHODS = ("pop", "get")
# methods called with a string that read a field, a size or a piece of what they are called
# on (`mesh.size("dp")`, `name.split("/")`): never a call that loads data
READING_METHODS = (*FIELD_METHODS, "setdefault", "size", "split")
# what a mapping's entries are iterated through (`for k, v in cond.items()`): no data source
DICT_VIEWS = ("items", "keys", "values")
COUNT_RE = re.compile(r"(steps|iters?)$", re.IGNORECASE)
# what a latent-diffusion loop calls to noise its latents (or, openai's diffusion trainers, to
# score its model on noised images: `diffusion.training_losses(model, x, t)`), and what
# encodes its images, or samples its timesteps (`schedule_sampler.sample(n, device)`)
NOISING = ("add_noise", "get_velocity")
SAMPLER_RE = re.compile(r"sampler$", re.IGNORECASE)
AUTOENCODER_RE = re.compile(r"vae|autoencoder", re.IGNORECASE)
DTYPE_RE = re.compile(r"(^|_)dtype$")  # `weight_dtype`: what the frozen parts are cast to
NOT_DIVISOR_RE = re.compile(r"loss|token|count|item|sum|total", re.IGNORECASE)
# a name of each sequence's (or prompt's) length: `lengths`, `prompt_len`, `prompt_len_or_mask`
LENGTH_RE = re.compile(r"(^|_)(lens?|lengths?)($|_)", re.IGNORECASE)
MICRO_SIZE_RE = re.compile(r"micro_?(batch_?)?(size|bs)$|^mbs$", re.IGNORECASE)
# the samples of the whole window, over its micro-batches (EDM's `batch_gpu_total`)
WINDOW_SIZE_RE = re.compile(r"^(total|global)_batch(_size)?$|^batch_\w*total$", re.IGNORECASE)
# a batch size the loop cuts into K parts is the window's (`batch_size // accum_steps`)
BATCH_SIZE_RE = re.compile(r"batch_?size|(^|_)bs$", re.IGNORECASE)
# an attribute that holds the micro-batch size under the data's own name (`self.microbatch`,
# openai's diffusion trainers); a bare name so called is the micro-batch itself
MICRO_ATTRIBUTE_RE = re.compile(r"^micro_?batch$", re.IGNORECASE)
# a GradScaler, or a loss scaler called with the loss (`loss_scaler(loss, optimizer)`: MAE's)
SCALER_RE = re.compile(r"scaler", re.IGNORECASE)
BOOSTER_RE = re.compile(r"booster|strategy", re.IGNORECASE)  # ColossalAI's `booster.backward`
# a loss function handed in (`train_one_epoch(model, criterion, ...)`, `self.loss_fn`)
CRITERION_RE = re.compile(r"criterion|loss_?(fn|func|function|fct)", re.IGNORECASE)
# `ignore_index=-1` (or a module constant) in the source: the value its loss ignores (used for
# the plain-torch kinds); `label_smoothing=0.1`: part of the image kinds' reference loss.
IGNORE_RE = re.compile(r"ignore_index\s*=\s*(-?\d+)")
IGNORE_NAME_RE = re.compile(r"ignore_index\s*=\s*([A-Za-z_]\w*)")
SMOOTHING_RE = re.compile(r"label_smoothing\s*=\s*(\d*\.?\d+)")
# Model classes, strongest evidence first (the loss model's); then weaker hints (collators,
# argument names).
KIND_HINTS = (
    *((name, pattern) for name, pattern in TASKS if name in TOKEN_TASKS),
    ("seq2seq", re.compile(r"decoder_input_ids|\bT5")),
    ("mlm", re.compile(r"mlm_probability|mlm=True")),
    ("classify", dict(TASKS)["classification"]),  # one label per sequence
)
# A plain model called as `model(x)`: what its data look like, from the source's hints.
NET_HINTS = (
    ("segment", re.compile(r"[Ss]egment|UNet|DeepLab|\bm?IoU\b|\bmiou\b")),
    ("image", re.compile(r"torchvision|\btimm\b|ImageFolder|pixel_values|\bimages?\b")),
    ("regression", re.compile(r"MSELoss|mse_loss|L1Loss|l1_loss|HuberLoss|\*\*\s*2\b")),
)


class NotReplayable(Exception):
    """The statement cannot be replayed; the message says why."""


@dataclass
class Plan:
    """What replay needs to run one statement. `free` holds the names the statement and its
    helpers read before assigning; `roles` maps names and attribute chains to what the harness
    binds there (model, engine, optimizer, optimizers, schedulers, data, data-call, contexts,
    turns, divisor, divisor-call, micro-size, window-size, width, accelerator, fabric, booster,
    scaler, device, dtype, namer (see `_namers`), and a latent-diffusion loop's noise-schedule,
    autoencoder, diffusion and timestep-sampler).
    `splits_batch`: the loop cuts each loader batch into micro-batches itself, so it is served
    the whole window at once. `owner`: the class whose method holds the statement;
    `lightning`: it is a LightningModule whose instance the harness builds for a Lightning
    Trainer (the instance has no role; `self(...)` runs its `forward`). `derived`:
    assignments before the statement to evaluate. `stages`: two models chained as encoder and
    decoder. `settings`: the script's option defaults, given to the stubs that stand for its
    parsed arguments. `items`: the string items of a free mapping that the statement counts
    with (they start at 0) or divides by (K)."""

    target: ast.stmt
    imports: list[ast.stmt]
    helpers: list[ast.stmt]
    free: list[str]
    params: list[str] | None
    optional: set[str]
    roles: dict[Chain, str]
    prefetch: dict[Chain, list[str]] = field(default_factory=dict)
    initial: dict[str, object] = field(default_factory=dict)
    items: dict[str, dict[str, str]] = field(default_factory=dict)
    model_kind: str = "causal"
    ignore_index: int | None = None
    data_arity: int = 0
    data_fillers: int = 0  # of data_arity, the unused values after (input_ids, labels)
    data_keys: tuple = ()  # a tuple batch's fields by position, None where unnamed: `batch[3]`
    # the fields a dict batch is read by, with the harness's field each names: `batch["input_mask"]`
    data_aliases: dict[str, str] = field(default_factory=dict)
    data_tensor: bool = False  # each batch is a tensor of token ids the model is called on
    keyword_batch: bool = False  # the model is handed keywords by a splat: `model(**kwargs)`
    returns: tuple | None = None  # how the loop unpacks its model's result: `loss, (a, b) = ...`
    uses_accumulate: bool = False
    splits_batch: bool = False
    label_smoothing: float = 0.0
    owner: Owner | None = None
    lightning: bool = False
    derived: list[Derived] = field(default_factory=list)
    stages: tuple[Chain, Chain] | None = None
    # a function called once per micro-batch that the fix gave `return_count`: it is called as
    # its patched caller calls it, and the window's gradients divided once by the counts' sum
    caller_divides: bool = False
    settings: dict[str, object] = field(default_factory=dict)  # argparse defaults, by dest
    rebound: frozenset[str] = frozenset()  # imported names assigned again before the statement
    # data bound before the statement to an enumeration of itself: `it = enumerate(loader)`
    enumerated: frozenset[Chain] = frozenset()
    # names that cut each row of a batch to a length, with what is added to them:
    # `batch["input_ids"][..., : args.seq_length + 1]` (`args.seq_length`: 1)
    row_cuts: dict[Chain, int] = field(default_factory=dict)
    # data whose items lead with a record of the turn: `for meta, batch in it: meta["step"]`
    recorded: frozenset[Chain] = frozenset()
    # methods the statement calls on its model after its optimizer steps: `model.get_flops()`
    after_step: frozenset[str] = frozenset()
    # attributes the statement reads on its model without calling them or reading further
    # into them: a part or a switch of the user's model (`discr = model.discr`, `model.use_gan`)
    model_reads: frozenset[str] = frozenset()


def argument_defaults(tree: ast.Module, every: bool = False) -> dict[str, object]:
    """The file's command-line options with a numeric or boolean literal default
    (`parser.add_argument("--ignore_index", default=-100)`), or a string among its literal
    `choices` (a mode, not a path: `--precision`), the first of them where it has no default
    (`--parallel-mode`, which a run must set), by destination: the values a user who runs
    the script without arguments gets; `every`: any literal default (an unset mode is None,
    as argparse leaves it), and the flags that `store_true` (False) or `store_false` (True)."""
    defaults = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            continue
        options = [a.value for a in node.args if isinstance(a, ast.Constant)]
        flags = [o for o in options if isinstance(o, str) and o.startswith("--")]
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        dest = keywords.get("dest")
        name = dest.value if isinstance(dest, ast.Constant) else flags[0] if flags else None
        ok, value = literal(keywords["default"]) if "default" in keywords else (False, None)
        action = keywords.get("action")
        stored = action.value if isinstance(action, ast.Constant) else None
        if every and not ok and stored in ("store_true", "store_false"):
            ok, value = True, stored == "store_false"
        choices = literal(keywords["choices"])[1] if "choices" in keywords else None
        listed = choices if isinstance(choices, (list, tuple)) else ()
        if not every and "default" not in keywords and listed and isinstance(listed[0], str):
            ok, value = True, listed[0]  # a mode the script leaves unset: a run picks one
        mode = isinstance(value, str) and value in listed
        if (
            ok
            and isinstance(name, str)
            and (every or mode or isinstance(value, (bool, int, float)))
        ):
            defaults[name.lstrip("-").replace("-", "_")] = value
    return defaults


def chain_of(node: ast.AST) -> Chain | None:
    """`a.b.c` -> ('a', 'b', 'c'); None for anything that is not a dotted name."""
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        base = chain_of(node.value)
        return None if base is None else (*base, node.attr)
    return None


class FreeNames(ast.NodeVisitor):
    """Names read before any assignment, visiting in evaluation order (straight-line
    approximation: a read counts as free if no assignment precedes it in the text)."""

    def __init__(self):
        self.bound: set[str] = set()
        self.free: dict[str, None] = {}

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound:
                self.free.setdefault(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name) and node.target.id not in self.bound:
            self.free.setdefault(node.target.id)
        self.visit(node.value)
        self.visit(node.target)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node):
        self.visit(node.iter)
        self.visit(node.target)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def _comprehension(self, node, *results):
        for gen in node.generators:
            self.visit(gen.iter)
            self.visit(gen.target)
            for cond in gen.ifs:
                self.visit(cond)
        for result in results:
            self.visit(result)

    def visit_ListComp(self, node):
        self._comprehension(node, node.elt)

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self._comprehension(node, node.key, node.value)

    def _function(self, node):
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d]:
            self.visit(default)
        args = node.args
        self.bound.update(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
        self.bound.update(a.arg for a in (args.vararg, args.kwarg) if a)
        body = node.body if isinstance(node.body, list) else [node.body]
        for stmt in body:
            self.visit(stmt)

    def visit_FunctionDef(self, node):
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.bound.add(node.name)
        self._function(node)

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = _function

    def visit_ClassDef(self, node):
        for base in node.bases + node.decorator_list:
            self.visit(base)
        self.bound.add(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Import(self, node):
        self.bound.update((a.asname or a.name).split(".")[0] for a in node.names)

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node):
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_withitem(self, node):
        self.visit(node.context_expr)
        if node.optional_vars is not None:
            self.visit(node.optional_vars)


def find_target(tree: ast.Module, line: int) -> ast.stmt:
    """The loop or function starting at `line` (decorators included); failing that, the
    innermost loop or function enclosing it."""
    starting, enclosing = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.AsyncFor, ast.AsyncFunctionDef)):
            if node.lineno == line:
                raise NotReplayable(f"line {line} is async code")
            continue
        if not isinstance(node, LOOPS + DEFS):
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if first <= line <= node.lineno:
            starting.append(node)
        elif node.lineno < line <= node.end_lineno:
            enclosing.append(node)
    if starting:
        return starting[0]
    if enclosing:
        return max(enclosing, key=lambda n: n.lineno)
    raise NotReplayable(f"line {line} is not in a loop or a function")


def _module_level(body: list[ast.stmt]):
    """Statements run at import time (not the bodies of functions or classes)."""
    for node in body:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_level(getattr(node, field_name, []))


def _targets_before(tree: ast.Module, target: ast.stmt, augmented: bool) -> list[ast.expr]:
    """What the assignments before `target` bind (`x += ...` too, with `augmented`), at the
    module's top level or in the functions around it."""
    around = functions_around(tree, target)
    statements = [*_module_level(tree.body), *(s for f in around for s in ast.walk(f))]
    kinds = (ast.Assign, ast.AnnAssign, ast.AugAssign) if augmented else (ast.Assign, ast.AnnAssign)
    return [
        bound
        for statement in statements
        if isinstance(statement, kinds) and statement.lineno < target.lineno
        for bound in getattr(statement, "targets", [getattr(statement, "target", None)])
    ]


def _assigned_before(tree: ast.Module, target: ast.stmt) -> set[str]:
    """Names an assignment binds before `target` (see _targets_before)."""
    return {
        name.id
        for bound in _targets_before(tree, target, augmented=False)
        for name in ast.walk(bound)
        if isinstance(name, ast.Name)
    }


def _attributes_set_before(tree: ast.Module, target: ast.stmt) -> set[str]:
    """Attributes an assignment sets before `target` (`args.num_training_steps = ...`)."""
    return {
        bound.attr
        for bound in _targets_before(tree, target, augmented=True)
        if isinstance(bound, ast.Attribute)
    }


def _initial_values(
    tree: ast.Module, target: ast.stmt, free: list[str], settings: dict[str, object]
) -> dict[str, object]:
    """Literal values the source assigns to the statement's free names before it, at module
    level or in the functions enclosing it (`num_items = 0`; `None` reassigned later only
    where the statement tests `is None`), or gives them as parameter
    defaults of those functions (`start_step=0`; `None` only where the statement tests
    `is None`, which also makes `None` of such a parameter without a default: `mixup_fn`;
    not an empty mapping),
    or option defaults it reads into them
    (`ignore_index = args.ignore_index`); 0 for other names the statement only augments
    (`total += n`)."""
    enclosing = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.lineno < target.lineno <= n.end_lineno
    ]
    nodes = list(_module_level(tree.body)) + [s for f in enclosing for s in ast.walk(f)]
    before = sorted(
        (n for n in nodes if isinstance(n, ast.Assign) and n.lineno < target.lineno),
        key=lambda n: n.lineno,
    )
    options = {
        n.targets[0].id: settings[n.value.attr]
        for n in before
        if len(n.targets) == 1
        and isinstance(n.targets[0], ast.Name)
        and isinstance(n.value, ast.Attribute)
        and isinstance(n.value.value, ast.Name)
        and n.value.attr in settings
    }
    guarded = _tested_for_none(target)
    defaults = {}
    for function in enclosing:
        for name, default in parameter_defaults(function.args):
            ok, value = literal(default)
            # else unknown, a stub; so is an empty mapping, the options a caller hands
            # (`optimizer_kwargs={}`, read `optimizer_kwargs["lr"]`)
            if ok and (value is not None or name in guarded) and value != {}:
                defaults[name] = value
    itself = [target] if isinstance(target, ast.FunctionDef) else []
    for function in enclosing + itself:
        given = dict(parameter_defaults(function.args))
        for arg in function.args.posonlyargs + function.args.args + function.args.kwonlyargs:
            if arg.arg in guarded and arg.arg not in given:  # the optional part left out
                defaults[arg.arg] = None
    unset = {  # `profiler = None`, made something else under a condition the statement tests
        bound.id: None
        for n in before
        for bound in n.targets
        if isinstance(bound, ast.Name) and bound.id in guarded and literal(n.value) == (True, None)
    }
    found = {
        name: value
        for name, value in {**defaults, **options, **unset, **constants(before)}.items()
        if name in free
    }
    augmented = {
        n.target.id
        for n in ast.walk(target)
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
    }
    return {**dict.fromkeys(augmented & set(free), 0), **found}


def _bound_under_a_condition(target: ast.stmt) -> list[str]:
    """Names the statement binds only under an `if` or a `try` (`if ...: batch, ds = batch`):
    where that does not run, they hold what they held before it."""
    always, conditional = set(), set()

    def visit(node: ast.AST, under: bool) -> None:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            (conditional if under else always).add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child, under or isinstance(node, (ast.If, ast.Try)))

    visit(target, False)
    return sorted(conditional - always)


def _items(target: ast.stmt, free: list[str], divisor_names) -> dict[str, dict[str, str]]:
    """Free names of mappings whose string items the statement counts with (lit-gpt's
    `state["iter_num"] += 1`: "counter") or divides by (`cfg["gradient_accumulation_steps"]`:
    "divisor"), by name, each item's role by key."""
    items: dict[str, dict[str, str]] = defaultdict(dict)
    augmented = [n.target for n in ast.walk(target) if isinstance(n, ast.AugAssign)]
    for node in ast.walk(target):
        if not (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in free
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            continue
        roles, key = items[node.value.id], node.slice.value
        if any(node is item for item in augmented):
            roles[key] = "counter"
        elif _is_divisor((key,), divisor_names):
            roles.setdefault(key, "divisor")
    return {name: roles for name, roles in items.items() if roles}


def _tested_for_none(target: ast.AST, attributes: bool = False) -> set[str]:
    """The names `target` compares with None (`if mixup_fn is not None:`), or with
    `attributes` the attributes (`if args.snr_gamma is None:`): the code itself handles a None
    value."""
    tested = ast.Attribute if attributes else ast.Name
    return {
        n.left.attr if attributes else n.left.id
        for n in ast.walk(target)
        if isinstance(n, ast.Compare)
        and isinstance(n.left, tested)
        and all(isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)
        and all(isinstance(c, ast.Constant) and c.value is None for c in n.comparators)
    }


def _compared_with_strings(target: ast.AST) -> dict[str, list[str]]:
    """The attributes of names that `target` compares with string literals (`args.mode ==
    "apply"`, `args.mode in ("a", "b")`), with those strings."""
    found: dict[str, list[str]] = {}
    for n in ast.walk(target):
        if isinstance(n, ast.Compare) and len(chain_of(n.left) or ()) == 2 and len(n.ops) == 1:
            ok, value = literal(n.comparators[0])
            strings = value if isinstance(value, (tuple, list, set)) else [value]
            if ok and strings and all(isinstance(v, str) for v in strings):
                in_order = sorted(strings) if isinstance(strings, set) else strings
                found.setdefault(n.left.attr, []).extend(in_order)
    return found


def _dispatched(target: ast.AST) -> dict[str, str]:
    """The attributes an `if`/`elif` chain of `target` tells apart by string literals and
    whose last `else` raises (`else: raise KeyError(args.mode)`), each with the first string it
    is tested for: a run that gets past the chain holds one of them."""
    found: dict[str, str] = {}
    for n in ast.walk(target):
        if not isinstance(n, ast.If):
            continue
        tested: dict[str, str] = {}
        last = n
        while True:
            for attribute, strings in _compared_with_strings(last.test).items():
                tested.setdefault(attribute, strings[0])
            if not (len(last.orelse) == 1 and isinstance(last.orelse[0], ast.If)):
                break
            last = last.orelse[0]
        if len(last.orelse) == 1 and isinstance(last.orelse[0], ast.Raise):
            found = {**tested, **found}
    return found


def _imports(tree: ast.Module, target: ast.stmt) -> list[ast.stmt]:
    inside = {id(n) for n in ast.walk(target)}
    found = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        and id(n) not in inside
        and not getattr(n, "level", 0)
        and getattr(n, "module", "") != "__future__"
    ]
    return sorted(found, key=lambda n: n.lineno)


@dataclass
class _Usage:
    """Evidence gathered from how the code uses each dotted name."""

    evidence: dict = field(default_factory=lambda: defaultdict(set))
    calls: dict = field(default_factory=lambda: defaultdict(list))
    chains: set = field(default_factory=set)
    arity: dict = field(default_factory=dict)
    fillers: dict = field(default_factory=dict)  # unused values after the first two: `_, _`
    assigned: dict = field(default_factory=lambda: defaultdict(list))
    result_attrs: set = field(default_factory=set)
    aliases: list = field(default_factory=list)
    generators: list = field(default_factory=list)
    positions: dict = field(default_factory=lambda: defaultdict(dict))  # `{"labels": batch[3]}`
    tensor_backward: bool = False  # `loss.backward()`: a backward not handed to an engine
    backwarded: set = field(default_factory=set)  # `loss` of `(loss / K).backward()`
    scaled: set = field(default_factory=set)  # `loss` of MAE's `loss_scaler(loss, optimizer)`
    # the name each name is summed from, first: `loss = ce + w * aux` (`loss`: `ce`)
    summed: dict = field(default_factory=dict)
    unpacked: dict = field(default_factory=dict)  # the names each batch unpacks into
    keys: set = field(default_factory=set)  # string keys read: `batch_data["input_mask"]`
    items: dict = field(default_factory=dict)  # the one name each iterated chain's item is bound to
    drawn: dict = field(default_factory=dict)  # the name each `next(chain)` is bound to
    named_unpacks: dict = field(default_factory=dict)  # `ids, labels = batch`: names by batch
    subscripts: list = field(default_factory=list)  # every `x[...]` read
    enumerations: set = field(default_factory=set)  # names bound to `enumerate(...)` before
    records: set = field(default_factory=set)  # names read only by keys no batch has (`_records`)
    # the methods of the class around the statement (`self.step`): the user's, whatever their
    # names say (`self.step(batch)` steps no optimizer)
    own: frozenset = frozenset()
    cut: dict = field(default_factory=lambda: defaultdict(set))  # `n // k`, `n % k`: n's ks

    def add(self, nodes: list[ast.stmt]) -> None:
        parents = {
            child: parent
            for node in nodes
            for parent in ast.walk(node)
            for child in ast.iter_child_nodes(parent)
        }
        self.generators = []
        moved = {  # `tuple(t.to(device) for t in batch)` unpacks `batch`: not iterated data
            loop
            for root in nodes
            for node in ast.walk(root)
            if isinstance(node, ast.Assign) and (loop := _moved_each(node.value))
        }
        made = {}  # `it = pick(iterators)`: the call each name is bound to
        for root in nodes:
            for node in ast.walk(root):
                chain = chain_of(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
                if chain:
                    self.chains.add(chain)
                if isinstance(node, ast.Subscript):
                    self.subscripts.append(node)
                if (
                    isinstance(node, ast.BinOp)
                    and isinstance(node.op, (ast.FloorDiv, ast.Mod))
                    and (size := chain_of(node.left))
                    and (parts := chain_of(node.right))
                ):
                    self.cut[size].add(parts)
                if (key := _field(node)) is not None:
                    self.keys.add(key)
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.targets[0], ast.Name)
                    and (first := _first_term(node.value))
                ):
                    self.summed.setdefault(node.targets[0].id, set()).add(first)
                if isinstance(node, ast.Attribute) and node.attr == "last_loss" and chain:
                    # llama2.c's `loss = raw_model.last_loss`, kept by the model's forward
                    self.evidence[chain[:-1]].add("model-method")
                if isinstance(node, ast.Call):
                    self._call(node, parents)
                elif isinstance(node, ast.For) and _entered(node):
                    self._contexts(node.iter)
                elif isinstance(node, (ast.For, ast.comprehension)) and node not in moved:
                    self._iterated(node.iter, node.target)
                elif isinstance(node, ast.Dict):
                    self._positions(node)
                elif _reads_output(node) and chain_of(node.value):  # not `f()[0]`
                    self.result_attrs.add(chain_of(node.value))
                elif (
                    isinstance(node, ast.Assign)
                    and isinstance(node.targets[0], (ast.Tuple, ast.List))
                    and (unpacked := _unpacked_name(node.value))
                ):
                    self.named_unpacks.setdefault(unpacked, node.targets[0].elts)
                elif (
                    isinstance(node, ast.Assign)
                    and chain_of(node.value)
                    and isinstance(node.targets[0], ast.Name)
                ):
                    self.aliases.append((node.targets[0].id, chain_of(node.value)))
                elif (
                    isinstance(node, ast.Assign)
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Call)
                    and chain_of(node.value.func)
                ):
                    made[node.targets[0].id] = node.value
        for name, call in made.items():  # `it = pick(iterators); batch = next(it)`
            if "next" in self.evidence.get((name,), ()):
                self.generators.append((chain_of(call.func), call, 0))
        bound = {
            n.id
            for root in nodes
            for n in ast.walk(root)
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
        }
        for func, call, arity in self.generators:  # `for src, tgt in batches(pairs, bsz):`
            if not {n.id for n in ast.walk(call) if isinstance(n, ast.Name)} & bound:
                self.evidence[func].add("iterated-call")
                if arity:
                    self.arity.setdefault(func, arity)
        for chain, name in [*self.items.items(), *self.drawn.items()]:
            if name in self.named_unpacks:  # `for batch in loader: ...; ids, labels = batch`
                self.unpacks(chain, self.named_unpacks[name])
        for alias, chain in self.aliases:  # `active = train_loader; for batch in active:`
            self.evidence[chain] |= self.evidence.get((alias,), set()) & {"iterated", "next"}
            if (alias,) in self.arity:
                self.arity.setdefault(chain, self.arity[(alias,)])
        for started in (self.backwarded, self.scaled):  # `loss = ce + w * aux`: a backward
            pending = list(started)  # of `loss` starts from `ce` too
            while pending:
                for first in self.summed.get(pending.pop(), set()) - started:
                    started.add(first)
                    pending.append(first)

    def _call(self, call: ast.Call, parents: dict) -> None:
        func, args = chain_of(call.func), [chain_of(a) for a in call.args]
        if func and func[-1] == "partial" and args and args[0]:
            # `functools.partial(diffusion.training_losses, model, x, t)`: a call, deferred
            self._call(ast.Call(call.args[0], call.args[1:], call.keywords), parents)
        if (
            isinstance(call.func, ast.Attribute)
            and call.func.attr in ("view", "reshape")
            and len(args) > 1
            and args[-1]
            and _is_minus_one(call.args[0])
        ):
            self.evidence[args[-1]].add("width")  # `logits.view(-1, V)`: V is the output width
        handed = args or any(k.arg in ("loss", "tensor") for k in call.keywords)
        keywords = {k.arg: chain_of(k.value) for k in call.keywords if k.arg}
        if func and {"net", "images"} <= keywords.keys():  # EDM's `loss_fn(net=ddp, images=x)`
            self.evidence[func].add("denoising")
            if keywords["net"]:
                self.evidence[keywords["net"]].add("model-method")
        if isinstance(call.func, ast.Attribute) and call.func.attr == "backward":
            self.tensor_backward |= not handed
            started = _scaled_name(call.args[0] if handed and call.args else call.func.value)
            self.backwarded |= {started} if started else set()
        if func is None:
            return
        if call.args and SCALER_RE.search(func[-1]):  # MAE's `loss_scaler(loss, optimizer)`
            self.scaled |= {started} if (started := _scaled_name(call.args[0])) else set()
        parent = parents.get(call)
        self.evidence[func].add("called")
        self.calls[func].append((call, parent))
        if func in (("next",), ("iter",)) and args and args[0]:
            self.evidence[args[0]].add("next")
            if isinstance(parent, ast.Call) and chain_of(parent.func) in (("list",), ("tuple",)):
                parent = parents.get(parent)  # `batch = list(next(loader_iter))`
            self._unpacked(args[0], parent)
            if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Name):
                self.drawn.setdefault(args[0], parent.targets[0].id)
        self._unpacked(func, parent)
        if len(func) < 2 or func in self.own:
            return
        receiver, method = func[:-1], func[-1]
        if method == "zero_grad":
            self.evidence[receiver].add("zero_grad")
        elif method == "step":
            self.evidence[receiver].add("step(arg)" if call.args else "step")
            for arg in args[:1]:
                if arg:
                    self.evidence[arg].add("optimizer-arg")
        elif method in MODEL_METHODS:
            self.evidence[receiver].add("model-method")
        elif method == "backward" and handed:
            self.evidence[receiver].add("backward")  # `engine.backward(loss)`: DeepSpeed's
        elif method == "accumulate":
            self.evidence[receiver].add("accumulate")
            for arg in args:
                if arg:
                    self.evidence[arg].add("model-method")
        elif method in NOISING:
            self.evidence[receiver].add("noising")
        elif method == "training_losses":
            self.evidence[receiver].add("diffusion")
            if args and args[0]:
                self.evidence[args[0]].add("model-method")  # the model it scores
        elif method == "sample" and SAMPLER_RE.search(receiver[-1]):
            self.evidence[receiver].add("timesteps")
        elif method == "encode":
            self.evidence[receiver].add("encodes")
        elif method in ("scale", "unscale_"):
            self.evidence[receiver].add("scaler")
            if method == "unscale_" and args and args[0]:
                self.evidence[args[0]].add("optimizer-arg")

    def _unpacked(self, source: Chain, parent) -> None:
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], (ast.Tuple, ast.List)):
            names = [chain_of(e) for e in parent.targets[0].elts]
            self.unpacks(source, parent.targets[0].elts)
            self.assigned[source] = [n for n in names if n]

    def _positions(self, node: ast.Dict) -> None:
        """`{"input_ids": batch[0], "labels": batch[3]}`: a tuple batch's values by position,
        named by the keys they are given (a conditional value's first branch counts)."""
        for key, value in zip(node.keys, node.values, strict=True):
            value = value.body if isinstance(value, ast.IfExp) else value
            if (
                isinstance(key, ast.Constant)
                and isinstance(key.value, str)
                and isinstance(value, ast.Subscript)
                and isinstance(value.value, ast.Name)
                and isinstance(value.slice, ast.Constant)
                and type(value.slice.value) is int
            ):
                self.positions[value.value.id][value.slice.value] = key.value

    def _contexts(self, iterable: ast.expr) -> None:
        """`for context in model_forward_contexts(accelerator, model, K): with context():`:
        a call that yields one context per micro-batch (each draws its batch in the body)."""
        if isinstance(iterable, ast.Call) and chain_of(iterable.func):
            self.evidence[chain_of(iterable.func)].add("contexts")

    def _iterated(self, iterable: ast.expr, target: ast.expr) -> None:
        """`for ... in enumerate(tqdm(loader))` and the like: `loader` is iterated; so is a
        name bound to such an enumeration before (`for i, batch in iterable`)."""
        sources = [iterable]
        pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
        if pair and isinstance(iterable, ast.Name) and iterable.id in self.enumerations:
            self.evidence[(iterable.id,)].add("enumerated")
            target = target.elts[1]
        while (
            sources
            and isinstance(sources[0], ast.Call)
            and sources[0].args
            and (
                (chain_of(sources[0].func) or ("",))[-1] in ITER_WRAPPERS
                or reads_ahead_call((chain_of(sources[0].func) or ("",))[-1])
            )
        ):
            call = sources.pop(0)
            wrapper = chain_of(call.func)[-1]
            pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
            if wrapper == "enumerate" and pair:
                target = target.elts[1]
            elif reads_ahead_call(wrapper) and pair:  # `for (batch), share in read_ahead(loader)`
                target = target.elts[0]
            sources[:0] = call.args if wrapper == "zip" else call.args[:1]
        for source in sources:
            chain = chain_of(source)
            if (
                isinstance(source, ast.Call)
                and chain_of(source.func)
                and chain_of(source.func)[-1] not in DICT_VIEWS
            ):
                arity = len(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else 0
                self.generators.append((chain_of(source.func), source, arity))
            if chain:
                self.evidence[chain].add("iterated")
                two = isinstance(target, ast.Tuple) and len(target.elts) == 2
                record, batch = target.elts if two else (None, None)
                if getattr(record, "id", None) in self.records and isinstance(batch, ast.Name):
                    self.evidence[chain].add("recorded")  # `for meta, batch in iterator`
                    self.items.setdefault(chain, batch.id)
                elif isinstance(target, (ast.Tuple, ast.List)):
                    self.unpacks(chain, target.elts)
                elif isinstance(target, ast.Name):
                    self.items.setdefault(chain, target.id)

    def unpacks(self, chain: Chain, names: list[ast.expr]) -> None:
        """Each batch of `chain` unpacks into `names`; values after the first two that go to
        `_` names are not used (VideoMAE's `samples, targets, _, _`)."""
        self.arity.setdefault(chain, len(names))
        self.unpacked.setdefault(chain, [n.id if isinstance(n, ast.Name) else None for n in names])
        if len(names) > 2 and all(
            isinstance(n, ast.Name) and n.id.startswith("_") for n in names[2:]
        ):
            self.fillers.setdefault(chain, len(names) - 2)


def _unpacked_name(value: ast.expr) -> str | None:
    """The name whose values an assignment unpacks: `batch` of `ids, labels = batch`, also
    moved one by one (`_moved_each`)."""
    moved = _moved_each(value)
    value = moved.iter if moved else value
    return value.id if isinstance(value, ast.Name) else None


def _moved_each(value: ast.expr) -> ast.comprehension | None:
    """The loop of `tuple(t.to(device) for t in batch)` (or a list of them): each value of
    `batch` moved, which unpacks it rather than iterating data."""
    if isinstance(value, ast.Call) and chain_of(value.func) in (("tuple",), ("list",)):
        value = value.args[0] if len(value.args) == 1 else value
    if not isinstance(value, (ast.GeneratorExp, ast.ListComp)) or len(value.generators) != 1:
        return None
    (loop,) = value.generators
    element = value.elt
    while isinstance(element, ast.Call) and isinstance(element.func, ast.Attribute):
        if element.func.attr not in SAME_TENSOR:
            return None
        element = element.func.value
    moved = isinstance(element, ast.Name) and chain_of(loop.target) == (element.id,)
    return loop if moved and not loop.ifs and isinstance(loop.iter, ast.Name) else None


def _positional_keys(usage: _Usage, data: list[Chain]) -> tuple:
    """The harness's fields of a batch the loop indexes by position into a dict of named
    inputs (one name so indexed, whose keys name the token ids and the labels:
    `{"source_ids": batch[0], "target_ids": batch[1]}`), or unpacks into names that say them
    (`for input_ids, attention_mask, labels in loader`), or into one name, the batch's one
    tensor of token ids (`(texts,) = batch`); None where unnamed."""
    named = [
        {i: _batch_field(key) or _length_key(key) for i, key in p.items()}
        for p in usage.positions.values()
    ]
    named = [p for p in named if {"input_ids", "labels"} <= set(p.values())]
    if len(named) == 1:
        (positions,) = named
        return tuple(positions.get(i) for i in range(max(positions) + 1))
    for chain in data:
        names = usage.unpacked.get(chain, ())
        if len(names) == 1:
            return ("input_ids",)
        keys = tuple(BATCH_KEYS.get(name or "") or _length_key(name or "") for name in names)
        if keys and keys[0] is None and "labels" in keys and "input_ids" not in keys:
            keys = ("input_ids", *keys[1:])  # the inputs lead: `examples, labels, mask, images`
        if {"input_ids", "labels"} <= set(keys) or (
            "input_ids" in keys and {"lengths", "prompt_lengths"} & set(keys) and None not in keys
        ):
            return keys
    return ()


# methods that keep a tensor a tensor of the same values: `batch.to(device)`, `batch.clone()`
SAME_TENSOR = {"to", "cuda", "clone", "long", "contiguous", "detach"}


def _tensor_batch(target: ast.stmt, usage: _Usage, models: list[Chain], data: list[Chain]) -> bool:
    """Whether each batch is one tensor of token ids that the loop calls its model on, as the
    old transformers language-modelling scripts do (`inputs, labels = (batch, batch)`, then
    `model(inputs.to(device), labels=labels)`): never indexed by a key or a position."""
    names = {usage.items[c] for c in data if c in usage.items}
    if not names:
        return False

    def tensor(node: ast.expr) -> str | None:
        while (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SAME_TENSOR
        ) or _sliced(node):
            node = node.func.value if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    pairs = []  # (name, value) of each assignment; each branch of `x if mlm else (b, b)`
    for node in ast.walk(target):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            left, right = node.targets[0], node.value
            for value in (right.body, right.orelse) if isinstance(right, ast.IfExp) else (right,):
                if isinstance(left, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs += zip(left.elts, value.elts)
                else:
                    pairs.append((left, value))
    grown = True
    while grown:  # `inputs = batch`, then `x = inputs.to(device)`
        aliases = {
            left.id
            for left, right in pairs
            if isinstance(left, ast.Name) and tensor(right) in names
        }
        grown = not aliases <= names
        names |= aliases
    if any(
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and tensor(node.value) in names
        for node in ast.walk(target)
    ):
        return False  # `batch[0]`, `batch["input_ids"]`: a tuple or a dict
    if any(  # `self({"input_ids": batch, "labels": batch})`: the inputs of a model
        isinstance(node, ast.Dict)
        and any(
            isinstance(key, ast.Constant) and key.value == "input_ids" and tensor(value) in names
            for key, value in zip(node.keys, node.values)
        )
        for node in ast.walk(target)
    ):
        return True
    return any(
        tensor(value) in names
        for model in models
        for call, _ in usage.calls.get(model, [])
        for value in [*call.args[:1], *(k.value for k in call.keywords if k.arg == "input_ids")]
    )


def _row_cuts(target: ast.stmt, usage: _Usage, data: list[Chain], free: set) -> dict[Chain, int]:
    """The free names (and their attributes) that cut each row of a batch to a length, the
    last index of several whose others take all (`batch["input_ids"][..., : args.seq_length +
    1]`, `x[:, :block]`), with what is added to them: the harness's rows have a length of
    their own, which a script's setting (thousands of tokens) does not fit."""
    names = {usage.items[c] for c in data if c in usage.items}
    cuts: dict[Chain, int] = {}
    for node in ast.walk(target):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple)):
            continue
        *others, last = node.slice.elts
        taken = node.value
        while isinstance(taken, (ast.Subscript, ast.Attribute)):
            taken = taken.value
        if not (
            isinstance(taken, ast.Name)
            and taken.id in names
            and others
            and all(_takes_all(index) for index in others)
            and isinstance(last, ast.Slice)
            and last.lower is None
            and last.step is None
        ):
            continue
        upper, added = last.upper, 0
        if (
            isinstance(upper, ast.BinOp)
            and isinstance(upper.op, ast.Add)
            and isinstance(upper.right, ast.Constant)
            and type(upper.right.value) is int
        ):
            upper, added = upper.left, upper.right.value
        chain = chain_of(upper) if upper is not None else None
        if chain and chain[0] in free:
            cuts.setdefault(chain, added)
    return cuts


def _takes_all(index: ast.expr) -> bool:
    """`...` or `:`."""
    if isinstance(index, ast.Slice):
        return index.lower is None and index.upper is None and index.step is None
    return isinstance(index, ast.Constant) and index.value is Ellipsis


def _sliced(node: ast.expr) -> bool:
    """`batch[:, 0:block_size]`: a window of each row of a token tensor (lit-gpt's inputs and
    targets), not a field of a tuple or a dict."""
    if not isinstance(node, ast.Subscript):
        return False
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return all(isinstance(p, ast.Slice) for p in parts)


def _is_minus_one(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and node.operand.value == 1
    )


def _reads_output(node) -> bool:
    """`x.loss`, `x.logits`, `x["loss"]` or `x[0]`: reading a model output."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("loss", "logits")
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value in ("loss", "logits", 0)
    )


def _scaled_name(node: ast.expr) -> str | None:
    """`loss` of `loss`, `loss / K` or `-loss * w`: the name a backward pass starts from."""
    while isinstance(node, (ast.BinOp, ast.UnaryOp)):
        node = node.left if isinstance(node, ast.BinOp) else node.operand
    return node.id if isinstance(node, ast.Name) else None


def _first_term(node: ast.expr) -> str | None:
    """`ce` of `ce`, `ce + w * aux` or `ce + aux + z`: the name a sum of loss terms starts
    from."""
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        node = node.left
    return node.id if isinstance(node, ast.Name) else None


def _keyed(node: ast.expr) -> bool:
    """`batch["input_ids"]`: a field of a dict batch."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    )


def _records(target: ast.stmt) -> set[str]:
    """The names `target` reads only by string keys that name no field of a batch
    (`meta["grad_accum_index"]`): a record of the turn that a loader yields beside each batch."""
    keyed = [n for n in ast.walk(target) if _keyed(n) and isinstance(n.value, ast.Name)]
    apart = {id(n.value) for n in keyed if _batch_field(n.slice.value) is None}
    found = {n.value.id for n in keyed if id(n.value) in apart}
    return found - {
        n.id
        for n in ast.walk(target)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in apart
    }


def _batch_field(key: str) -> str | None:
    """The harness's field a key of a dict batch names: `input_mask` the attention mask; of a
    preference pair (`x_chosen`, `rejected_input_ids`), the chosen side is the field itself and
    the rejected side `rejected_` and the field (see bindings._fields)."""
    if key in BATCH_KEYS:
        return BATCH_KEYS[key]
    side = PREFERENCE_SIDE.match(key)
    if side is None or (name := side["before"] or side["after"]) not in BATCH_KEYS:
        return None
    chosen = (side["first"] or side["last"]) == "chosen"
    return BATCH_KEYS[name] if chosen else f"rejected_{BATCH_KEYS[name]}"


def _field(node: ast.expr) -> str | None:
    """The field a dict batch is read by: `batch["input_ids"]`, `batch.pop("loss_mask")`,
    `batch.get("labels")`."""
    if _keyed(node):
        return node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FIELD_METHODS
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def _call_shape(usage: _Usage, chain: Chain) -> str | None:
    """'keyed', 'hf', 'nanogpt', 'sequence' or 'logits' from how `chain` is called; None if
    it is not. A call whose value is dropped (`metric_logger.update(**loss_dict)`) is not a
    model's."""
    shapes = set()
    for call, parent in usage.calls.get(chain, []):
        if isinstance(parent, ast.Expr):
            continue
        keywords = {k.arg for k in call.keywords}
        if {"source_ids", "target_ids"} <= keywords:
            shapes.add("keyed")  # CodeBERT's `Seq2Seq(source_ids=..., target_ids=...)`
        elif (
            None in keywords
            and not keywords & HF_KWARGS
            and _backwarded_result(usage, parent)
            and isinstance(parent.targets[0], ast.Name)  # bound to one name, not unpacked
        ):
            shapes.add("sequence")  # `loss = model(**kwargs); backward(loss / K)`: scores itself
        elif keywords & HF_KWARGS == {"input_ids"} and _used_as_tensor(usage, parent):
            shapes.add("logits")  # `out = model(input_ids=x, ...)`, then `out.view(-1, V)`
        elif None in keywords or keywords & HF_KWARGS:
            shapes.add("hf")
        elif "return_loss" in keywords and call.args and not _keyed(call.args[0]):
            shapes.add("sequence")  # `model(seq, return_loss=True)`: a sequence, not a field
        elif len(call.args) == 2 and _backwarded_result(usage, parent, scaled=True):
            shapes.add("sequence")  # `loss, extra = model(x, y, images=z)`: it scores itself
        elif len(call.args) == 2 and not keywords and _scored_against(usage, call, parent):
            shapes.add("teacher")  # `out = model(x, y); F.nll_loss(out, y.view(-1))`
        elif len(call.args) == 2 or "targets" in keywords:
            shapes.add("nanogpt")
        elif _backwarded_result(usage, parent, scaled=True) and not (
            call.args and _keyed(call.args[0])
        ):
            shapes.add("sequence")  # `loss, parts = model(wave, ...)`: it scores itself
        elif _reads_output(parent) or (
            isinstance(parent, ast.Assign)
            and len(parent.targets) == 1
            and chain_of(parent.targets[0]) in usage.result_attrs
        ):
            shapes.add("hf")
        else:
            shapes.add("logits")
    for shape in ("keyed", "hf", "nanogpt", "teacher", "sequence", "logits"):
        if shape in shapes:
            return shape
    return None


def _used_as_tensor(usage: _Usage, parent) -> bool:
    """The call's value is bound to a name the loop calls a tensor's shape methods on
    (`out.view(-1, out.size(-1))`), which a transformers output does not have: its logits."""
    if not (isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Name)):
        return False
    name = parent.targets[0].id
    return any((name, method) in usage.calls for method in ("view", "reshape", "size", "flatten"))


def _scored_against(usage: _Usage, call: ast.Call, parent) -> bool:
    """`model(x, y)` whose output (or the name it is bound to) the loop scores against the
    targets it handed the model (`F.nll_loss(out, y.view(-1))`): a model taking its targets
    for teacher forcing and returning per-token scores (Lightning's demo `Transformer`),
    not nanoGPT's `(logits, loss)`."""
    bound = parent.targets[0] if isinstance(parent, ast.Assign) else None
    output = {bound.id} if isinstance(bound, ast.Name) else set()
    targets = {n.id for n in ast.walk(call.args[1]) if isinstance(n, ast.Name)}

    def holds(node: ast.expr, names: set) -> bool:
        return any(n is call or isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))

    return any(
        len(other.args) >= 2 and holds(other.args[0], output) and holds(other.args[1], targets)
        for calls in usage.calls.values()
        for other, _ in calls
    )


def _backwarded_result(usage: _Usage, parent, scaled: bool = False) -> bool:
    """The call's value, or the first it unpacks into, is what the loop's backward starts
    from (`scaled`: or what it hands a loss scaler): the model computes its loss itself. (An
    image model handed only its inputs may score itself too: a masked autoencoder, told by
    the mask ratio it is handed.)"""
    if not isinstance(parent, ast.Assign) or len(parent.targets) != 1:
        return False
    target = parent.targets[0]
    if isinstance(target, (ast.Tuple, ast.List)) and target.elts:
        target = target.elts[0]
    started = usage.backwarded | (usage.scaled if scaled else set())
    return isinstance(target, ast.Name) and target.id in started


def _returns(usage: _Usage, models: list[Chain]) -> tuple | None:
    """How the loop unpacks what a model call returns (`loss, (ce, aux) = model(...)`, also
    later: `loss, parts = model(...); ce, aux = parts`), as nested tuples of None (`dict` for
    a value it reads as a mapping); None where it does not."""

    def shape(node: ast.expr):
        if isinstance(node, ast.Name) and node.id in usage.named_unpacks:
            return tuple(map(shape, usage.named_unpacks[node.id]))
        if isinstance(node, ast.Name) and any((node.id, v) in usage.calls for v in DICT_VIEWS):
            return dict  # a mapping of further losses: `for loss, w in extra.values()`
        return tuple(map(shape, node.elts)) if isinstance(node, (ast.Tuple, ast.List)) else None

    unpacked = (
        parent.targets[0]
        for chain in models
        for _, parent in usage.calls.get(chain, [])
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], (ast.Tuple, ast.List))
    )
    return next(map(shape, unpacked), None)


def _enumerations(tree: ast.Module, target: ast.stmt, free: list[str]) -> set[str]:
    """The free names the functions around `target` last bind before it to an enumeration of
    their data, wrapped or not, on either side of a condition (Lightning's Fabric examples:
    `iterable = tqdm(enumerate(loader)) if fabric.is_global_zero else enumerate(loader)`):
    their items are pairs of a count and a batch."""

    def enumerates(value: ast.expr) -> bool:
        if isinstance(value, ast.IfExp):
            return enumerates(value.body) and enumerates(value.orelse)
        while isinstance(value, ast.Call) and value.args:
            name = (chain_of(value.func) or ("",))[-1]
            if name == "enumerate":
                return True
            if name not in ITER_WRAPPERS:
                return False
            value = value.args[0]
        return False

    return {d.chain[0] for d in assignments_before(tree, target, free, None) if enumerates(d.value)}


def _counts_turns(value: ast.expr) -> bool:
    """`range(n)`, also wrapped (`tqdm(range(n), total=n)`): the turns, not the data."""
    while (
        isinstance(value, ast.Call)
        and value.args
        and (chain_of(value.func) or ("",))[-1] in ITER_WRAPPERS
    ):
        value = value.args[0]
    return isinstance(value, ast.Call) and (chain_of(value.func) or ("",))[-1] in (
        "range",
        "trange",
    )


def _entered(loop: ast.For) -> bool:
    """Whether the loop's one target is entered as a context in its body (`with ctx():` or
    `with ctx:`): the loop iterates contexts, not batches."""
    if not isinstance(loop.target, ast.Name):
        return False
    name = loop.target.id
    return any(
        isinstance(item, ast.Name) and item.id == name
        for node in ast.walk(ast.Module(loop.body, []))
        if isinstance(node, ast.With)
        for entered in node.items
        for item in [
            entered.context_expr.func
            if isinstance(entered.context_expr, ast.Call)
            else entered.context_expr
        ]
    )


def _harness_made(chain: Chain, role: str | None, usage: _Usage) -> bool:
    """Whether a module-level function is replaced rather than run: a model, a generator of
    batches (`for x, y in batches(pairs, bsz)`), or a data source that is iterated or called
    like `get_batch('train')` (`split_batch(batch, n)` runs)."""
    return (
        role in ("model", "data-call")
        or role == "data"
        and (bool(usage.evidence[chain] & {"iterated", "next"}) or _string_call(usage, chain))
    )


def _string_call(usage: _Usage, chain: Chain) -> bool:
    """`x, y = get_batch("train")`: called with a string first, its result used; a call whose
    result is dropped (`logger.info("...")`, `writer.add_scalar("loss", ...)`) or has a method
    called (`timers("forward").start()`) serves no data, nor one whose string follows what it
    transforms (einops' `rearrange(logits, "b n c -> b c n")`)."""
    if len(chain) > 1 and chain[-1] in READING_METHODS:
        return False
    return any(
        call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
        for call, parent in usage.calls.get(chain, [])
        if not isinstance(parent, (ast.Expr, ast.Attribute))
    )


def disables_grad(node: ast.expr) -> bool:
    """`torch.no_grad()` or `torch.inference_mode()`, as a decorator or a `with` item."""
    chain = chain_of(node.func if isinstance(node, ast.Call) else node) or ("",)
    return chain[-1] in ("no_grad", "inference_mode")


def _no_grad(node: ast.stmt) -> bool:
    """A helper under `@torch.no_grad()` or `@torch.inference_mode()` cannot change a gradient;
    it stays a stub (it usually evaluates on data the harness does not serve)."""
    return any(disables_grad(d) for d in getattr(node, "decorator_list", []))


def _is_divisor(chain: Chain, divisor_names) -> bool:
    dotted = ".".join(chain)
    for name in divisor_names:
        if dotted == name or ("." not in name and chain[-1] == name):
            return True
    return bool(DIVISOR_RE.search(chain[-1])) and not NOT_DIVISOR_RE.search(chain[-1])


def _has_attributes(chain: Chain, usage: _Usage) -> bool:
    """Whether the loop reads attributes of a chain: an object (`self.accumulative_meter.add`),
    not a number."""
    return any(len(other) > len(chain) and other[: len(chain)] == chain for other in usage.chains)


def _role(chain: Chain, usage: _Usage, divisor_names, helpers: set) -> str | None:
    ev, last = usage.evidence.get(chain, set()), chain[-1]
    if last in ITER_WRAPPERS:
        return None  # it iterates the data it is handed
    called = "called" in ev
    if _is_divisor(chain, divisor_names) and not _has_attributes(chain, usage):
        if not called:
            return "divisor"
        if COUNT_RE.search(last) and "accumulate" not in ev:
            return "divisor-call"  # lit-gpt's `train.gradient_accumulation_iters(devices)`
    if not called and (
        MICRO_SIZE_RE.search(last) or len(chain) > 1 and MICRO_ATTRIBUTE_RE.match(last)
    ):
        return "micro-size"
    if not called and (
        WINDOW_SIZE_RE.search(last)
        or BATCH_SIZE_RE.search(last)
        and any(_is_divisor(parts, divisor_names) for parts in usage.cut.get(chain, ()))
    ):
        return "window-size"
    if not called and "width" in ev:
        return "width"
    if "accumulate" in ev or (not called and "accelerator" in last.lower()):
        return "accelerator"
    if not called and "fabric" in last.lower():
        return "fabric"
    if not called and "backward" in ev and BOOSTER_RE.search(last):
        return "booster"
    if "scaler" in ev or (not called and SCALER_RE.search(last)):
        return "scaler"
    if called and SCALER_RE.search(last):
        return "loss-scaler"  # `loss_scaler(loss, optimizer, update_grad=...)`: timm's, MAE's
    if chain[0] in helpers and len(chain) == 1:
        return None
    if called and "backward" in ev:
        return "engine"  # called as the model, and backpropagates: a DeepSpeed engine
    if called and CRITERION_RE.fullmatch(last):
        return "criterion"
    if "contexts" in ev:
        return "contexts"
    if "iterated-call" in ev:
        return "data-call"
    if "noising" in ev:
        return "noise-schedule"
    if "diffusion" in ev:
        return "diffusion"
    if "timesteps" in ev:
        return "timestep-sampler"
    if "encodes" in ev and AUTOENCODER_RE.search(last):
        return "autoencoder"
    if not called and len(chain) == 1 and DTYPE_RE.search(last):
        return "dtype"
    iterated = not called and "iterated" in ev  # `for opt, sched in zip(optimizers, schedulers)`
    if any(SCHEDULER_RE.search(part) for part in chain):
        return "schedulers" if iterated else None  # `scheduler.get_last_lr()[0]`: no output
    shape = _call_shape(usage, chain)
    splat = any(_splatted(call) for call, _ in usage.calls.get(chain, []))
    named = MODEL_RE.search(last) or (
        (shape == "hf" or shape == "sequence" and splat) and not FACTORY_RE.match(last)
    )
    model_like = "model-method" in ev or (shape and named)
    if model_like and not (shape == "logits" and DATA_RE.search(last)):
        return "model"
    if iterated and OPTIMIZER_RE.search(last):
        return "optimizers"
    # not `optimizer_kwargs` nor `optim_param`
    named = OPTIMIZER_RE.search(last) and not OPTIONS_RE.search(last)
    if ev & {"zero_grad", "step", "optimizer-arg"} or (not called and named):
        return "optimizer"
    if ev & {"iterated", "next"} or (called and DATA_RE.search(last)):
        return "data"
    if called and _string_call(usage, chain):
        return "data"
    if not called and (last == "device" or last.endswith("_device")):
        return "device"  # not `to_device(batch, device)`, which moves a batch
    return None


def _own_methods(owner: Owner | None, lightning: bool) -> frozenset[Chain]:
    """The methods of the class around the statement, and of the subclass its instance is
    made of (`self.step`), as chains on its instance; with `lightning`, the instance itself
    (`self(batch)`)."""
    if owner is None:
        return frozenset()
    methods = {
        (owner.instance, m.name)
        for c in owner.classes
        for m in c.body
        if isinstance(m, ast.FunctionDef)
    }
    return frozenset(methods | ({(owner.instance,)} if lightning else set()))


def _local_defs(tree: ast.Module, target: ast.stmt) -> dict[str, ast.FunctionDef]:
    """Functions defined before `target` in the blocks around it, inside functions (the
    read-ahead generator `gaaudit fix` writes above a loop); not the methods of a class around
    it, whose names its methods do not see."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: dict[str, ast.FunctionDef] = {}
    node = target
    while node in parents and parents[node] is not tree:
        parent = parents[node]
        for name in () if isinstance(parent, ast.ClassDef) else ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if isinstance(block, list) and node in block:
                for statement in block[: block.index(node)]:
                    if isinstance(statement, ast.FunctionDef):
                        found.setdefault(statement.name, statement)
        node = parent
    return found


def caller_divides(original: Plan, patched: Plan) -> bool:
    """Whether the fix gave the function planned the `return_count` by which `gaaudit fix` has
    the caller that calls it once per micro-batch divide the window's gradients once."""
    return RETURN_COUNT in (patched.params or ()) and RETURN_COUNT not in (original.params or ())


def analyse(
    source: str,
    line: int,
    divisor_names=(),
    model_kind: str | None = None,
    lightning: bool = False,
) -> Plan:
    """Plan the replay of the loop or function at `line` of `source`; with `lightning`, of a
    method of a LightningModule that a Lightning Trainer runs (see Plan). A copy each call:
    verify plans a loop before its replay and each K replays it again, and the replay sets a
    plan's model kind and ignore value (its syntax trees are only read, or copied first)."""
    return copy.copy(_analysed(source, line, tuple(divisor_names), model_kind, lightning))


@functools.lru_cache(maxsize=8)
def _analysed(source: str, line: int, divisor_names, model_kind, lightning) -> Plan:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise NotReplayable(f"cannot parse the source: {exc.msg} (line {exc.lineno})") from None
    target = find_target(tree, line)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defs.update(_local_defs(tree, target))
    defs.pop(getattr(target, "name", None), None)
    is_def = isinstance(target, ast.FunctionDef)
    scan = FreeNames()
    for stmt in target.body if is_def else [target]:
        scan.visit(stmt)
    free = list(scan.free)
    params, optional = None, set()
    if is_def:
        args = target.args
        positional = args.posonlyargs + args.args
        params = [a.arg for a in positional + args.kwonlyargs]
        tested = _tested_for_none(target)
        optional = {  # a None default the function uses untested stands for a caller's value
            name
            for name, default in parameter_defaults(args)
            if not (literal(default) == (True, None) and name not in tested)
        }
    owner = enclosing_owner(tree, target)
    base = framework_base(tree, owner) if owner else None
    if base and not lightning:
        raise NotReplayable(
            f"the statement is in a method of `{owner.node.name}`, a subclass of `{base[0]}` from "
            f"{base[1]}: the loss, the accumulation and the optimizer step run inside {base[1]}, "
            "which statement replay does not reproduce"
        )
    usage = _Usage(
        enumerations=_enumerations(tree, target, free),
        records=_records(target),
        own=_own_methods(owner, lightning),
    )
    helpers = []
    if lightning and params and len(params) > 1:
        # `training_step(self, batch, ...)`: the Trainer hands it each batch, as a loop's
        # `for batch in loader` does
        usage.evidence[(params[1],)].add("iterated")
        usage.items[(params[1],)] = params[1]

    def gather(pending: list[ast.stmt]) -> None:
        """Add the module-level functions the pending code reads, and what they read."""
        while pending:
            usage.add(pending)
            wanted = [n for n in free if n in defs and defs[n] not in helpers]
            pending = [
                defs[n]
                for n in wanted
                if not _no_grad(defs[n])
                and not _harness_made((n,), _role((n,), usage, divisor_names, set()), usage)
            ]
            helpers.extend(pending)
            for helper in pending:
                inner = FreeNames()
                inner.visit(helper)
                free.extend(n for n in inner.free if n not in free)

    gather([target])
    owner = implemented(tree, owner, [target, *helpers]) if owner else None
    usage.own = _own_methods(owner, lightning)  # with the subclass that fills in its hooks
    methods = methods_called(owner, [target, *helpers], calls_itself=lightning) if owner else []
    for method in methods:
        inner = FreeNames()
        inner.visit(method)
        free += [n for n in inner.free if n not in free]
    gather(methods)  # `log_fn=noop` in a method's signature: `noop` is a helper too
    helper_names = {h.name for h in helpers}
    free = [n for n in free if n not in helper_names]
    derived = assignments_before(tree, target, free, owner)
    usage.add([d.statement for d in derived])
    roles = _roles(usage, free, params or [], usage.own, divisor_names, helper_names)
    imported = {
        (a.asname or a.name).split(".")[0] for node in _imports(tree, target) for a in node.names
    }
    rebound = imported & _assigned_before(tree, target)  # `optim = torch.optim.Adam(...)`
    unbound = imported - rebound
    module_constants = constants(list(_module_level(tree.body)))
    for item in _evaluable(derived, roles, unbound, module_constants, owner):
        if item.reads_model and roles.get(item.chain) in DATA_ROLES:
            # `for p in self.model_params` over `list(self.model.parameters())`: no data
            del roles[item.chain]
    if params and not lightning and (batch := _micro_batch(params, optional, roles, unbound)):
        # data of a parameter left at its default (`sample_weighter=None`) is not bound
        roles = {c: r for c, r in roles.items() if c[0] not in optional or r not in DATA_ROLES}
        roles[(batch,)] = "micro-batch"
        usage.items[(batch,)] = batch
        if batch in usage.named_unpacks:  # `input_ids, labels = batch`
            usage.unpacks((batch,), usage.named_unpacks[batch])
    roles.update(dict.fromkeys(_namers(usage, roles, helpers, methods, owner), "namer"))
    for item in derived:  # `bar = tqdm(range(steps)); for step in bar:` counts turns
        if roles.get(item.chain) == "data" and _counts_turns(item.value):
            roles[item.chain] = "turns"
    given = {name: literal(default)[1] for name, default in init_defaults(owner).items()}
    derived = _evaluable(derived, roles, unbound, module_constants, owner)
    for item in derived:  # a loss keeps its stand-in where the user's does not evaluate
        if roles.get(item.chain) != "criterion":
            roles.pop(item.chain, None)
    data = [
        c for c, r in roles.items() if r in DATA_ROLES and (c[0] not in imported or c[0] in rebound)
    ]
    models = [c for c, r in roles.items() if r in ("model", "engine")]
    # a denoiser trained on latents it noises, conditioned on a text encoder's states: no
    # encoder-decoder pair, but the latent kind's one model in both roles
    latent = bool({"noise-schedule", "diffusion"} & set(roles.values())) or any(
        "denoising" in usage.evidence.get(c, ()) for c in roles
    )
    stages = None if latent else _stages(usage, models)
    shapes = {_call_shape(usage, c) for c in models}
    if model_kind or latent:
        kind = model_kind or "latent"
    else:
        kind = "pair" if stages else _kind(source, shapes)
    if kind == "logits" and not model_kind and _reads_one_position(usage, models):
        kind = "pooled"  # `model(x)[:, -1, :]` scored against one label per sequence
    if kind == "sequence" and usage.keys & set(MELS):
        kind = "frames"  # a model that scores the spectrogram it is handed: TTS trainers
    if kind == "sequence" and any(
        MASK_RATIO_RE.match(k.arg or "")
        for c in models
        for call, _ in usage.calls.get(c, [])
        for k in call.keywords
    ):
        kind = "masked"  # `model(images, mask_ratio=0.75)`: a masked autoencoder's, MAE's
    prefetch = {
        c: usage.assigned[c]
        for c in data
        if usage.assigned.get(c) and all(len(n) == 1 and n[0] in free for n in usage.assigned[c])
    }
    arities = {usage.arity[c] for c in data if c in usage.arity}
    arity = max(arities) if arities else (2 if kind == "nanogpt" else 0)
    fillers = max((usage.fillers.get(c, 0) for c in data if usage.arity.get(c) == arity), default=0)
    settings = argument_defaults(tree)
    every = argument_defaults(tree, every=True)  # and an option left at None that the
    # statement tests for None (`if args.snr_gamma is None:`), or a mode it compares with
    # strings (`if args.mask_way == "v2":`)
    tested = _tested_for_none(target, attributes=True)
    settings.update({o: None for o in tested if o in every and every[o] is None})
    modes = _compared_with_strings(target)  # a string default the loop tells apart from
    # other strings is a mode, not a path (`--peft_type` "prefix" or "lora")
    settings.update({o: every[o] for o in modes if isinstance(every.get(o), str)})
    dispatched = _dispatched(target).items()  # and a value the loop cannot run without
    settings.update({o: v for o, v in dispatched if o not in settings and every.get(o) is None})
    for option in _attributes_set_before(tree, target) & settings.keys():
        value = settings[option]  # a sentinel the code resolves before: `args.steps = ...`
        if not isinstance(value, (int, float)) or value < 0:  # for None, -1 or a mode
            del settings[option]
    return Plan(
        target=target,
        imports=_imports(tree, target),
        helpers=helpers,
        free=free,
        params=params,
        optional=optional,
        roles=roles,
        prefetch=prefetch,
        initial=_initial_values(tree, target, free + _bound_under_a_condition(target), settings),
        items=_items(target, free, divisor_names),
        settings=settings,
        rebound=frozenset(rebound),
        enumerated=frozenset(c for c in data if "enumerated" in usage.evidence.get(c, ())),
        recorded=frozenset(c for c in data if "recorded" in usage.evidence.get(c, ())),
        after_step=_called_after_step(target, usage, roles),
        model_reads=_read_on_model(target, roles),
        model_kind=kind,
        ignore_index=_ignore_index(source, {**given, **module_constants}, kind),
        data_arity=arity,
        data_fillers=fillers,
        data_keys=_positional_keys(usage, data),
        data_aliases={k: field for k in usage.keys if (field := _batch_field(k)) is not None},
        data_tensor=_tensor_batch(target, usage, models, data),
        row_cuts=_row_cuts(target, usage, data, set(free) - {c[0] for c in roles if len(c) == 1}),
        keyword_batch=any(_splatted(call) for c in models for call, _ in usage.calls.get(c, [])),
        returns=_returns(usage, models),
        uses_accumulate=any(
            "accumulate" in usage.evidence.get(c, ())
            for c, r in roles.items()
            if r == "accelerator"
        ),
        splits_batch=_splits_batch(target, [c for c in data if roles[c] == "micro-batch"])
        if is_def
        else _splits_batch(target, data),
        label_smoothing=_smoothing(source),
        owner=owner,
        lightning=lightning,
        derived=derived,
        stages=stages,
    )


def _roles(
    usage: _Usage, free: list[str], params: list[str], own: set, divisor_names, helper_names: set
) -> dict[Chain, str]:
    """The role of each free name or attribute chain (the shortest chain with one wins); the
    owner's own methods (`self._forward`) and builtins have none."""
    roots, roles = set(free) | set(params), {}
    for chain in sorted(usage.chains | set(usage.evidence), key=len):
        if (
            chain[0] not in roots
            or any(chain[:i] in roles for i in range(1, len(chain)))
            or chain[:2] in own
        ):
            continue
        if len(chain) == 1 and chain[0] in vars(builtins) and chain[0] not in params:
            continue
        role = _role(chain, usage, divisor_names, helper_names)
        if role:
            roles[chain] = role
    if usage.tensor_backward or {"loss-scaler", "scaler"} & set(roles.values()):
        # the loop also backpropagates past the engine (a branch without DeepSpeed): an engine
        # there would refuse it, so the model is the harness's own
        roles = {c: "model" if r == "engine" else r for c, r in roles.items()}
    models = {c for c, r in roles.items() if r in ("model", "engine")}
    for chain in list(roles):  # `model_ema(model)`: a wrapper handed the model, not a model
        calls = usage.calls.get(chain, [])
        if chain in models and calls and all(_hands_on(call, models) for call, _ in calls):
            del roles[chain]
    return roles


def _namers(
    usage: _Usage, roles: dict, helpers: list, methods: list, owner: Owner | None
) -> list[Chain]:
    """The helpers and methods of the owner (`self.as_keywords(next(self.batches))`)
    handed each batch that name its fields by position, `dict(zip(fields, batch))`: the
    user's batches are tuples of unnamed fields, the harness's are named already."""
    data = [c for c, r in roles.items() if r in DATA_ROLES]
    drawn = {usage.drawn.get(c) for c in data} | {usage.items.get(c) for c in data}

    def batch(arg: ast.expr) -> bool:
        if isinstance(arg, ast.Call) and chain_of(arg.func) == ("next",) and arg.args:
            arg = arg.args[0]
        return chain_of(arg) in data or isinstance(arg, ast.Name) and arg.id in drawn

    functions = [((f.name,), f, 0) for f in helpers if isinstance(f, ast.FunctionDef)]
    if owner is not None:
        functions += [((owner.instance, f.name), f, 1) for f in methods]
    found = []
    for chain, function, skipped in functions:
        params = [a.arg for a in function.args.posonlyargs + function.args.args][skipped:]
        handed = [c for c, _ in usage.calls.get(chain, []) if c.args and batch(c.args[0])]
        if params and handed and _names_fields(function, params[0]):
            found.append(chain)
    return found


def _names_fields(function: ast.FunctionDef, param: str) -> bool:
    """Whether `function` makes a dict of its parameter `param`'s values zipped with names:
    `dict(zip(fields, param))`, `{k: v for k, v in zip(fields, param)}`."""

    def zipped(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Call)
            and chain_of(node.func) == ("zip",)
            and any(isinstance(a, ast.Name) and a.id == param for a in node.args)
        )

    return any(
        isinstance(node, ast.Call)
        and chain_of(node.func) == ("dict",)
        and node.args
        and zipped(node.args[0])
        or isinstance(node, ast.DictComp)
        and zipped(node.generators[0].iter)
        for node in ast.walk(function)
    )


def _micro_batch(params: list[str], optional: set, roles: dict, unbound: set) -> str | None:
    """The parameter of a function that takes one micro-batch a call and trains on it
    (`def train_step(model, batch, optimizer)`, a DeepSpeed engine's or accelerate's window
    counted across calls): its caller's loop hands it each batch. None when the function
    draws its own data (an imported name not assigned again, smollm's `get_stats_format`,
    draws none), or trains nothing."""
    held = {  # `sample_weighter=None`
        r
        for c, r in roles.items()
        if c[0] not in optional and not (c[0] in unbound and r in DATA_ROLES)
    }
    if held & {"data", "data-call"} or not held & {"model", "engine"}:
        return None
    return next(
        (p for p in params if (p,) not in roles and p not in optional and BATCH_PARAM.search(p)),
        None,
    )


def _hands_on(call: ast.Call, models: set) -> bool:
    """Whether a call is handed one of `models` itself (not its output)."""
    return any(chain_of(a) in models for a in call.args)


def _ignore_index(source: str, module_constants: dict, kind: str) -> int | None:
    """The value the source's loss ignores: `ignore_index=-1`, or `ignore_index=PAD` with
    `PAD` among `constants` (the module's, and the literal defaults of its `__init__`'s
    parameters); -100 for nanoGPT-style code that mentions it; else None."""
    found = IGNORE_RE.search(source)
    if found:
        return int(found.group(1))
    named = IGNORE_NAME_RE.search(source)
    value = module_constants.get(named.group(1)) if named else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return -100 if kind == "nanogpt" and re.search(r"-100\b", source) else None


def _smoothing(source: str) -> float:
    found = SMOOTHING_RE.search(source)
    return float(found.group(1)) if found else 0.0


def _evaluable(
    derived: list[Derived], roles: dict, imported: set, module_constants: dict, owner: Owner | None
) -> list[Derived]:
    """The assignments replay may evaluate: to a name with no role (or a data role, where the
    value is computed from a model: `params = list(enc.parameters())`), reading only imports,
    builtins, module constants and names the harness binds."""
    known = (
        imported
        | set(vars(builtins))
        | set(module_constants)
        | {c[0] for c in roles if len(c) == 1}
        | ({owner.instance} if owner else set())
    )
    models = [c for c, r in roles.items() if r == "model"]
    kept = []
    for item in derived:
        names = {n.id for n in ast.walk(item.value) if isinstance(n, ast.Name)}
        chains = [chain_of(n) for n in ast.walk(item.value) if isinstance(n, ast.Attribute)]
        reads_model = any(
            c[: len(m)] == m for c in chains + [(n,) for n in names] if c for m in models
        )
        role = roles.get(item.chain)
        if names <= known and (
            role in (None, "criterion")  # the user's loss, where it evaluates, over the stand-in
            or role == "data"
            and reads_model
        ):
            kept.append(dataclasses.replace(item, reads_model=reads_model))
    return kept


def _stages(usage: _Usage, models: list[Chain]) -> tuple[Chain, Chain] | None:
    """Two models, the second called with what the first returned: (encoder, decoder)."""
    for first in models:
        results = {
            n.id
            for _, parent in usage.calls.get(first, [])
            if isinstance(parent, ast.Assign)
            for target in parent.targets
            for n in ast.walk(target)
            if isinstance(n, ast.Name)
        }
        for second in (m for m in models if m != first):
            for call, _ in usage.calls.get(second, []):
                fed = [
                    i
                    for i, arg in enumerate(call.args)
                    if any(
                        isinstance(n, ast.Name)
                        and n.id in results
                        or isinstance(n, ast.Call)
                        and chain_of(n.func) == first
                        for n in ast.walk(arg)
                    )
                ]
                if fed[:1] == [0]:
                    raise NotReplayable(
                        f"`{'.'.join(second)}` is called on the output of `{'.'.join(first)}` "
                        "(a backbone and a head); the harness chains two models only as an "
                        "encoder and a decoder that takes the target sequence first"
                    )
                if fed:
                    return first, second
    return None


def _splits_batch(target: ast.stmt, data: list[Chain]) -> bool:
    """A loop that draws one batch a turn (`for batch in loader`, or `batch = next(it)` in a
    statement of its body that holds no loop or comprehension) and whose backward calls sit
    in an inner loop that reads no data source, or a function whose backward calls sit in a
    loop over the micro-batch it is handed: the loop cuts each batch into micro-batches
    itself."""

    def reads_data(node: ast.AST) -> bool:
        return any(
            c[: len(d)] == d
            for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute)) and (c := chain_of(n))
            for d in data
        )

    if isinstance(target, ast.FunctionDef):  # `def forward_backward(self, batch, cond)`:
        # a loop over slices of the one batch it is handed (`range(0, batch.shape[0], mb)`)
        return any(
            isinstance(inner, ast.For)
            and reads_data(inner.iter)
            and any(isinstance(n, ast.Attribute) and n.attr == "backward" for n in ast.walk(inner))
            for inner in ast.walk(target)
        )
    if not isinstance(target, LOOPS):
        return False
    once = (*LOOPS, ast.comprehension)  # not `[next(it) for _ in range(k)]`
    draws = [
        n
        for statement in target.body
        if not any(isinstance(n, once) for n in ast.walk(statement))
        for n in ast.walk(statement)
        if isinstance(n, ast.Call) and chain_of(n.func) == ("next",) and n.args
    ]
    header = [target.iter] if isinstance(target, ast.For) else []
    if not any(reads_data(n) for n in header + draws):
        return False
    return any(
        inner is not target
        and isinstance(inner, LOOPS)
        and not reads_data(inner)
        and any(isinstance(n, ast.Attribute) and n.attr == "backward" for n in ast.walk(inner))
        for inner in ast.walk(target)
    )


def _kind(source: str, shapes: set) -> str:
    """The tiny model to bind: from how the model is called, then from the source's hints."""
    if "hf" in shapes or not shapes - {None}:
        return next((kind for kind, hint in KIND_HINTS if hint.search(source)), "causal")
    if shapes & {"keyed", "nanogpt", "teacher", "sequence"}:
        return next(s for s in ("keyed", "nanogpt", "teacher", "sequence") if s in shapes)
    return next((kind for kind, hint in NET_HINTS if hint.search(source)), "logits")


def _reads_one_position(usage: _Usage, models: list[Chain]) -> bool:
    """A model's per-token output read at one position of each sequence (`model(x)[:, -1, :]`,
    or `out[:, pos]` of the name it is bound to): a language model used as a sequence
    classifier, one label per sequence."""
    calls = [(call, parent) for model in models for call, parent in usage.calls.get(model, [])]
    made = {id(call) for call, _ in calls}
    bound = {
        parent.targets[0].id
        for _, parent in calls
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Name)
    }

    def one_position(node: ast.Subscript) -> bool:
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else []
        of_model = id(node.value) in made or (
            isinstance(node.value, ast.Name) and node.value.id in bound
        )
        return (
            of_model
            and len(parts) >= 2
            and isinstance(parts[0], ast.Slice)
            and parts[0].lower is parts[0].upper is None
            and not isinstance(parts[1], ast.Slice)
        )

    return any(one_position(node) for node in usage.subscripts)


def _called_after_step(target: ast.stmt, usage: _Usage, roles: dict) -> frozenset[str]:
    """The methods the statement calls on a model below its first optimizer step
    (`tflops = model.get_flops(batch)`, for a log line), not in its helpers."""
    inside = {id(n) for n in ast.walk(target)}
    steps = [
        call.lineno
        for chain, role in roles.items()
        if role == "optimizer"
        for call, _ in usage.calls.get((*chain, "step"), [])
        if id(call) in inside
    ]
    return frozenset(
        chain[-1]
        for chain, calls in usage.calls.items()
        if steps and roles.get(chain[:-1]) == "model"
        for call, _ in calls
        if id(call) in inside and call.lineno > min(steps)
    )


def _read_on_model(target: ast.stmt, roles: dict) -> frozenset[str]:
    """The attributes the statement reads whole on a model as a part it binds to a name or a
    switch it tests, neither calling them nor reading further into them: `discr =
    model.discr` (or either side of a conditional so bound), `if model.use_gan:` (not a
    number it computes with: `loss * model.weight`)."""
    parents = {child: node for node in ast.walk(target) for child in ast.iter_child_nodes(node)}

    def part_or_switch(node: ast.AST) -> bool:
        parent = parents.get(node)
        if isinstance(parent, ast.IfExp) and parent.test is not node:  # `a if c else b`
            return part_or_switch(parent)
        if isinstance(parent, ast.Assign):
            return parent.value is node
        if isinstance(parent, (ast.If, ast.While, ast.IfExp)):
            return parent.test is node
        return isinstance(parent, ast.BoolOp) or (
            isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
        )

    return frozenset(
        node.attr
        for node in ast.walk(target)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and roles.get(chain_of(node.value)) == "model"
        and part_or_switch(node)
    )


def _splatted(call: ast.Call) -> bool:
    """Whether the call hands keywords by a splat: `model(**kwargs)`."""
    return any(k.arg is None for k in call.keywords)


def _length_key(name: str) -> str | None:
    """The harness's field a name of lengths stands for: each prompt's length (`prompt_len`,
    `prompt_len_or_mask`), or each sequence's (`lengths`, `seq_lens`): see bindings._fields."""
    if not LENGTH_RE.search(name):
        return None
    return "prompt_lengths" if "prompt" in name.lower() else "lengths"
