"""`gaaudit verify`: replay each accumulation loop of a file, original and patched, against
one full-batch step on a tiny real model (GA-GUIDE section 6).

The static half (which loops, which divisors, the patched source) runs here without torch.
The replay runs in a child process (`python -m gaaudit.commands.verify`), so that a hanging or
crashing user loop is stopped by a timeout and cannot take gaaudit down.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import libcst as cst

from gaaudit.config import ConfigError, Settings, check_factory, load, unimportable
from gaaudit.discover.files import discover
from gaaudit.discover.modules import missing_top_module, project_root, search_root
from gaaudit.discover.source import parse, read
from gaaudit.findings import Confidence

VERIFIED, REPRODUCED = "verified", "bug reproduced"
ERROR_MEANS = (
    "error: relative L2 distance between the gradient at the optimizer step and the gradient "
    "of one full-batch step on the same data"
)
# libraries whose models are not the project's, nor their `...Trainer` classes a transformers one
LIBRARIES = ("transformers", "peft", "trl", "torch", "accelerate", "lightning", "pytorch_lightning")
DROP_LAST = re.compile(r"\bdrop_last\s*=\s*True\b")
# a config key of data that Hydra builds: `hydra.utils.instantiate(cfg.datamodule)`
DATA_KEY = re.compile(r"data|loader", re.IGNORECASE)
BEGUN = "begun"  # what the replay process says as it begins a file, before its rows
# the replay downloads nothing: a user's `from_pretrained` fails at once instead
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# as many targets in every sample and no `drop_last=True`: micro-batches of one size all the
# same, as a loader makes them before an epoch's last batch, the one where mean/K is off
# (GA-GUIDE 3)
LAST_BATCH_LEFT_OUT = "no `drop_last=True` found: an epoch's last, short batch is left out"
NOTHING_FIXED = (
    "nothing was fixed, so there is no patched loop "
    "(`gaaudit fix --min-confidence low --unsafe-fixes --diff` says why)"
)


@dataclass(frozen=True)
class Target:
    """One statement to replay: where it starts in the original and in the patched source."""

    line: int
    patched_line: int | None
    header: str
    divisors: tuple[str, ...]
    flagged: bool = True  # False: a loop with no finding, replayed to show it matches
    trainer: str = ""  # a Trainer subclass's name: replayed by a real Trainer, not as a statement
    # what shows that every micro-batch of the file's data holds the same number of loss
    # elements (the check's domain), when its findings all say so: replayed on such data
    fixed_length: str = ""
    # the project's transformers pin (GA006) before 4.46, or to 4.47.0/4.48.0, for a Trainer:
    # replayed as it trains; its kind (`checks.versions.verdict`)
    pinned: str = ""
    pin_kind: str = ""
    # where the project's loader drops its last, short batch (`drop_last=True`): a loop of
    # as many targets in every sample (images, regression, latents) is replayed on
    # micro-batches of one size
    equal_sizes: str = ""
    stops: str = ""  # why the harness cannot stand for what the statement trains: not replayed
    loss_func: str = ""  # the file's function a Trainer is given as `compute_loss_func`
    lightning: bool = False  # `trainer` names a LightningModule: a Lightning Trainer runs it
    # `trainer` names the loss function Megatron's `pretrain` is handed, replayed by its rule;
    # what the forward step binds ahead of the output (`partial(loss_func, loss_mask)`)
    megatron: bool = False
    bound: tuple[str, ...] = ()
    # the literal defaults of the options the project adds to a Trainer's arguments; of a
    # statement, those of the scripts that call its function (`_caller_options`)
    options: tuple[tuple[str, object], ...] = ()
    head: str = ""  # the harness's stand-in for the transformers head a Trainer is given
    patched_loss_func: str = ""  # `loss_func` in the patched source (a fix may give one)
    # whether the model handed to the Trainer is set `accepts_loss_kwargs = False`, as written
    # and as patched
    opts_out: tuple[bool, bool] = (False, False)


# What a verdict on the tiny model that scores its own sequences (nets.TinySequenceModel) is
SCORED_BY_STAND_IN = (
    "replayed with a tiny model that scores its own token sequences (their mean loss over the "
    "tokens that are not padding): a model of yours that averages otherwise (per sequence, per "
    "frame) may differ; pass it with --model-factory"
)
# How a function that trains on the one batch its caller hands it is replayed, and one that
# cuts the batch it is handed into micro-batches itself
CALLED_PER_BATCH = (
    "called once for each micro-batch, as the loop that calls it would, until the optimizer steps"
)
CALLED_WITH_WINDOW = "called once with the whole window, which it cuts into micro-batches itself"
# ... and, patched, how the count its fix makes it return is used
CALLER_DIVIDES = (
    "patched, it is asked for its count (`return_count=True`) and the gradients are divided "
    "once by the window's total, as its patched caller does"
)
# ... and on the tiny model that scores its own spectrogram frames (nets.TinyFrameModel)
SCORED_BY_FRAMES = (
    "replayed with a tiny model that scores its own spectrogram frames (their mean squared "
    "error over the frames within each length): a model of yours that averages otherwise "
    "(over a masked span, per utterance) may differ; pass it with --model-factory"
)
# ... and on the tiny masked autoencoder (nets.TinyMaskedAutoencoder)
SCORED_BY_PATCHES = (
    "replayed with a tiny masked autoencoder that scores its own images (the mean squared error "
    "of its reconstruction over the masked patches, as many in every image): a model of yours "
    "whose masked count varies between images may differ; pass it with --model-factory"
)
# ... and on the latent-diffusion stand-ins (nets.TinyDenoiser and its companions)
DENOISED_BY_STAND_IN = (
    "replayed with latent-diffusion stand-ins (a tiny denoiser that is also its text encoder, an "
    "autoencoder whose latents are the images, DDPM's noise schedule, and a diffusion scoring "
    "each sample's prediction of its noise); each sample draws the same noise and timestep in "
    "its micro-batch as in the whole window, and the loop's own step on the whole window is the "
    "reference"
)
STAND_IN_NOTES = {
    "sequence": SCORED_BY_STAND_IN,
    "frames": SCORED_BY_FRAMES,
    "masked": SCORED_BY_PATCHES,
    "latent": DENOISED_BY_STAND_IN,
}
# How a Trainer subclass written before transformers 4.46 is replayed (harness.trainer)
PREDATES = (
    "replayed as transformers before 4.46 trains: its `compute_loss` takes no "
    "`num_items_in_batch`, which later releases pass"
)
# How a loss function Megatron's `pretrain` is handed is replayed (harness.megatron).
MEGATRON_RULE = (
    "replayed by Megatron's rule, not by Megatron: each micro-batch's loss over K, as its "
    "schedule divides it (a (sum, count) return: the sums over the window's count, as "
    "--calculate-per-token-loss does)"
)
# What a pin's Trainer does, as replayed (`harness.trainer.as_pinned`): the releases before
# 4.46, or those that regressed.
BEFORE_FIX = (
    "replayed as transformers before 4.46 trains, which {} keeps: each micro-batch's mean "
    "divided by K"
)
REGRESSION = (
    "replayed as transformers 4.47.0 and 4.48.0 train, which {} keeps: a model that takes "
    "loss kwargs gets no count, and the K means are summed"
)


@dataclass
class Outcome:
    """The replay verdicts of one loop, one row per window size K."""

    line: int
    header: str
    rows: list[dict] = field(default_factory=list)  # k, original_error, patched_error, verdict
    flagged: bool = True  # the loop has a finding (else it is replayed as it is)
    fixed_length: str = ""  # see Target
    pinned: str = ""  # see Target
    pin_kind: str = ""  # see Target
    equal_sizes: str = ""  # see Target, or LAST_BATCH_LEFT_OUT: the samples have one target each
    replayed: str = ""  # how a framework's loop was replayed, when not by the framework itself

    @property
    def verdict(self) -> str:
        verdicts = [row["verdict"] for row in self.rows]
        if verdicts and all(v == VERIFIED for v in verdicts):
            return VERIFIED
        return next((v for v in verdicts if v != VERIFIED), "not replayable: nothing ran")


class VerifyError(Exception):
    """The replay cannot start as asked (a bad model factory, too few GPUs); worded for the
    user: the option, what was wrong, what to do."""


@dataclass(frozen=True)
class Options:
    """How to replay: window sizes, device, dtype, seed, per-file timeout; the user's model
    and data factories (`module:function`, imported from `project_root`; `factory_option` and
    `data_option` say where they were named) and the number of DDP processes (0: one process,
    no process group)."""

    ks: tuple[int, ...] = (2, 4, 8)
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    timeout: float = 120.0
    model_factory: str | None = None
    project_root: str | None = None
    factory_option: str = "--model-factory"
    distributed: int = 0
    data_factory: str | None = None  # `module:function` returning k micro-batches
    data_option: str = "--data-factory"


def options_for(path: Path, **given) -> Options:
    """Options for verifying `path`: what the command line `given` (None: not given), else
    `[tool.gaaudit.verify]` of the nearest pyproject.toml with a [tool.gaaudit] table, else
    the defaults. Raises ConfigError for a bad table, a malformed factory, or batches of
    the user's own with several processes."""
    settings = load(path)
    configured = settings.verify
    values = {}
    for name, key in (
        ("ks", "k"),
        ("device", "device"),
        ("dtype", "dtype"),
        ("seed", "seed"),
        ("timeout", "timeout"),
        ("distributed", "distributed"),
    ):
        value = given.get(name)
        value = getattr(configured, key) if value is None else value
        if value is not None:
            values[name] = value
    for name, option_name, key in (
        ("model_factory", "factory_option", "model-factory"),
        ("data_factory", "data_option", "data-factory"),
    ):
        factory, option = given.get(name), f"--{key}"
        if factory is not None:
            check_factory(factory, option, name == "data_factory")
            root = project_root(path)
        elif getattr(configured, name) is not None:
            factory = getattr(configured, name)
            option = f"{settings.source}: [tool.gaaudit.verify] {key} ="
            root = settings.source.parent
        if factory is not None:
            module = factory.partition(":")[0]
            missing = missing_top_module(module, root)
            if missing is not None:  # said at once, before a replay process imports torch
                raise ConfigError(
                    unimportable(
                        f"{option} {factory}",
                        module,
                        root,
                        f"ModuleNotFoundError: No module named {missing!r}",
                    )
                )
            values.update({name: factory, option_name: option, "project_root": str(root)})
    if values.get("data_factory") and values.get("distributed"):
        raise ConfigError(
            f"{values['data_option']} {values['data_factory']}: batches of your own are replayed "
            "in one process; leave out --distributed (or the distributed key)"
        )
    return Options(**values)


def targets(
    original: bytes, patched: bytes, line: int | None = None, path: Path = Path("train.py")
) -> list[Target]:
    """The statements holding the file's accumulation windows: those with findings (all
    confidences), then those without, replayed to show that they match. `path` names the
    file in its repository, for helpers imported from its sibling modules and the losses
    its callers there hand it, as `check` reads them."""
    from gaaudit.analysis.domain import Domains
    from gaaudit.analysis.evidence import scan
    from gaaudit.analysis.repository import Imports
    from gaaudit.analysis.tree import Tree, code
    from gaaudit.checks.accumulation import Auditor
    from gaaudit.checks.trainer import TrainerAudit
    from gaaudit.checks.windows import Windows

    tree = Tree(parse(original), original)
    text = original.decode("utf-8", "replace")
    lines = text.removeprefix("\ufeff").splitlines()
    patched_lines = patched.decode("utf-8", "replace").splitlines()
    found: dict[int, Target] = {}
    imports = Imports(tree, path.parent, name=path.name)
    auditor = Auditor(tree, directory=path.parent, imports=imports)
    evidence = imports.data_evidence(scan(text))
    domains = Domains(tree, auditor.tracer, evidence, text)
    # the file's sign of fixed-length blocks, where it shows no padded or masked labels; where
    # it shows neither, that of the data its project's configs build for it
    blocks = f"{evidence.blocks[1]}, line {evidence.blocks[0]}" if evidence.blocks else ""
    if not (evidence.fixed or evidence.padded):
        blocks = _configured_blocks(path, text.removeprefix("\ufeff"))
    # the fixed-length sign of each loop a framework runs, by its call (`pretrain(...)`)
    runners = {
        site.window.anchor: _fixed_length(domains.of(site.origin), blocks)
        for site in auditor.sites()
        if site.window.kind == "pipeline"
    }
    windows = [
        (site.window, site.backward.call or site.node, site.origin.divisions, True, fixed, stops)
        for site in auditor.sites()
        for domain in [domains.of(site.origin)]
        for fixed in [_fixed_length(domain, blocks)]
        for stops in [_launched_window(auditor.structure, site.backward, site.window)]
    ]
    windows += [
        (s.window, s.node, (), True, "", "") for s in Windows(tree, auditor.structure).sites()
    ]
    for backward in auditor.structure.backwards():
        window = auditor.structure.window(backward)
        if window is not None and (
            window.kind in ("modulo", "micro-loop", "accumulate")
            or auditor.structure.deepspeed_engine(backward)
        ):
            windows.append((window, backward.call, (), False, "", ""))
    equal = _drops_last(path) if windows else ""
    for window, anchor, divisions, flagged, fixed, stops in windows:
        statement = _replayed_statement(tree, window, anchor)
        if statement is None:
            continue
        start = tree.line(statement)
        if line is not None and not (start <= line <= tree.span(statement).end_line):
            continue
        previous = found.get(start)
        if previous is not None and not flagged:
            continue
        header = _first_line(tree, statement)
        divisors = {code(d.divisor) for d in divisions}
        if window.size is not None:
            divisors.add(code(window.size))
        merged = tuple(sorted(divisors | set(previous.divisors if previous else ())))
        if previous is not None and previous.flagged and not previous.fixed_length:
            fixed = ""  # another finding of this loop does not say so
        patched_line = _find(patched_lines, header, _occurrence(lines, header, start))
        scope = statement if isinstance(statement, cst.FunctionDef) else tree.scope_of(statement)
        found[start] = Target(
            start,
            patched_line,
            header,
            merged,
            flagged,
            fixed_length=fixed,
            equal_sizes=equal,
            stops=stops,
            options=_caller_options(path.resolve(), scope.name.value)
            if isinstance(scope, cst.FunctionDef)
            else (),
        )
    statements = {line for line, t in found.items() if t.flagged}
    audit = TrainerAudit(tree, imports)
    located = _Locator(tree, lines, patched_lines)
    trainers = _trainer_targets(audit, located, statements)
    setup = _trainer_setup(audit, located, trainers, line, path, original)
    if setup is not None:
        trainers[setup.line] = (setup, setup.line)
    if trainers:  # a Trainer trains as the project's transformers does, with its options
        from gaaudit.checks.versions import OLD, governing_pin

        (pinned, kind), options = (
            governing_pin(path, (*OLD, "regressed")),
            _training_options(search_root(path)),
        )
        for start, (target, end) in trainers.items():
            flagged = target.flagged or bool(pinned)  # GA006 reports it
            changed = replace(
                target, pinned=pinned, pin_kind=kind, flagged=flagged, options=options
            )
            trainers[start] = (changed, end)
    trainers.update(_lightning_targets(located, statements, line, blocks))
    trainers.update(_megatron_targets(auditor, located, statements, line, runners))
    for start, (target, end) in trainers.items():  # its methods' statements: the Trainer runs them
        found = {line: t for line, t in found.items() if not start <= line <= end}
        found[start] = target
    return sorted(found.values(), key=lambda t: t.line)


class _Locator:
    """Where a class or statement of the file starts and ends, its first line, and the line
    of that same header in the patched source."""

    def __init__(self, tree, lines: list[str], patched_lines: list[str]) -> None:
        self.tree, self.lines, self.patched_lines = tree, lines, patched_lines

    def __call__(self, node: cst.CSTNode) -> tuple[int, int, str, int | None]:
        start, end = self.tree.line(node), self.tree.span(node).end_line
        header = _first_line(self.tree, node)
        patched = _find(self.patched_lines, header, _occurrence(self.lines, header, start))
        return start, end, header, patched


def _lightning_targets(
    located: _Locator, statements: set[int], line: int | None, blocks: str
) -> dict[int, tuple[Target, int]]:
    """The file's LightningModule classes with a `training_step`, by the line of their
    `class` statement, with their last line: a real Lightning Trainer runs them. Flagged when
    a finding lies in the class; on fixed-length rows where the file shows such `blocks`."""
    from gaaudit.analysis.tree import code, methods_of

    found = {}
    for cls in located.tree.classes:
        bases = [code(base.value) for base in cls.bases]
        if not any(b.endswith("LightningModule") for b in bases):
            continue
        if "training_step" not in methods_of(cls) or "automatic_optimization" in code(cls):
            continue  # a manual loop is replayed as a statement
        start, end, header, patched = located(cls)
        if line is not None and not start <= line <= end:
            continue
        flagged = any(start <= s <= end for s in statements)
        target = Target(
            start, patched, header, (), flagged, cls.name.value, fixed_length=blocks, lightning=True
        )
        found[start] = (target, end)
    return found


def _megatron_targets(
    auditor, located: _Locator, statements: set[int], line: int | None, fixed: dict
) -> dict[int, tuple[Target, int]]:
    """The loss functions the file's forward step hands Megatron's `pretrain`, by the line of
    their `def`, with their last line: replayed by Megatron's rule (harness.megatron). Flagged
    when a finding lies in the function; on fixed-length rows where its finding says so."""
    from gaaudit.analysis.tree import code, last_name

    found = {}
    for pipeline in auditor.structure.pipelines():
        function = located.tree.functions.get(code(pipeline.loss_fn))
        if last_name(pipeline.call.func) != "pretrain" or function is None:
            continue
        start, end, header, patched = located(function)
        if line is not None and not start <= line <= end:
            continue
        holder = located.tree.parents.get(located.tree.parents.get(pipeline.loss_fn))
        bound = (
            tuple(code(arg.value) for arg in holder.args[1:])
            if isinstance(holder, cst.Call) and last_name(holder.func) == "partial"
            else ()
        )
        flagged = any(start <= s <= end for s in statements)
        target = Target(
            start,
            patched,
            header,
            (),
            flagged,
            function.name.value,
            fixed_length=fixed.get(pipeline.call, ""),
            megatron=True,
            bound=bound,
        )
        found[start] = (target, end)
    return found


def _trainer_setup(
    audit, located: _Locator, trainers: dict, line: int | None, path: Path, original: bytes
) -> Target | None:
    """The file's first call that builds a transformers Trainer (`Trainer(...)`,
    `Seq2SeqTrainer(...)`, a subclass of the file or the project), when no Trainer subclass
    target replays it already: the Trainer's own accumulation, replayed with a real Trainer.
    Its data holds as many loss elements in every row where GA006 reads so (`_exact_data`)."""
    from gaaudit.analysis.tree import code
    from gaaudit.checks.trainer import head_kind

    tree = located.tree
    found = next(
        (
            (call, code(built).rsplit(".", 1)[-1])
            for call in tree.calls
            if code(call.func).endswith("Trainer")
            for built in [_aliased(tree, call)]
            if _builds_transformers_trainer(tree, built, audit, path)
        ),
        None,
    )
    if found is None:
        return None
    call, name = found
    start, end, header, patched = located(tree.statement_of(call))
    if line is not None and not start <= line <= end:
        return None
    if any(t.trainer == name or s <= start <= e for s, (t, e) in trainers.items()):
        return None
    stops, loss = _built_with(tree, call, audit)
    sites = list(audit.sites())
    flagged = any(  # GA004 reports the loss function it is given, or a model's forward
        site.kind == "forward" or site.kind == "loss-function" and site.function.name.value == loss
        for site in sites
    )
    model = audit.given(call)
    given = audit.head_of(model) or ""  # replayed with a head like it
    fixed_loss, fixed_opt_out = (
        _patched_setup(located.patched_lines, patched) if patched else ("", False)
    )
    return Target(
        start,
        patched,
        header,
        (),
        flagged or any(s.kind == "library-head" and s.node is call.func for s in sites),
        name,
        fixed_length=_exact_data(path, original),
        stops=stops,
        loss_func=loss,
        head=head_kind(given.rsplit(".", 1)[-1]) if given else "",
        patched_loss_func=fixed_loss or loss,
        opts_out=(audit.opted_out(model), fixed_opt_out),
    )


def _patched_setup(patched_lines: list[str], line: int) -> tuple[str, bool]:
    """What the patched source's Trainer call starting at `line` is given that `gaaudit fix`
    may add: the file's function as its `compute_loss_func` (else ""), and whether its model
    is set `accepts_loss_kwargs = False`."""
    from gaaudit.analysis.tree import Tree
    from gaaudit.checks.trainer import TrainerAudit

    try:
        tree = Tree(cst.parse_module("\n".join(patched_lines) + "\n"))
    except cst.ParserSyntaxError:
        return "", False
    call = next((c for c in tree.calls if tree.line(tree.statement_of(c)) == line), None)
    if call is None:
        return "", False
    audit = TrainerAudit(tree)
    return _built_with(tree, call, audit)[1], audit.opted_out(audit.given(call))


def _fixed_length(domain, blocks: str) -> str:
    """Why a flagged loop is replayed on rows of one length: its loss's count is fixed, or its
    loss's origin is not visible and the file shows fixed-length `blocks`; "" where neither."""
    if domain.varies is False:
        return domain.sign
    return blocks if domain.kind == "unknown" else ""


def _exact_data(path: Path, original: bytes) -> str:
    """GA006's sign that every row of the file's Trainer holds as many loss elements
    (`checks.versions.exact_data`): what, and where (`line 6` in this file)."""
    from gaaudit.checks.engine import display_path
    from gaaudit.checks.versions import exact_data

    sign = exact_data(path, original)
    if sign is None:
        return ""
    where, line, what = sign
    place = "" if where == path else f"{display_path(where)} "
    return f"{what}, {place}line {line}"


def _aliased(tree, call: cst.Call) -> cst.BaseExpression:
    """The class `call` builds: `Trainer` for `FinetuningTrainer(...)` after
    `FinetuningTrainer = Trainer` in the same scope (its first binding)."""
    if isinstance(call.func, cst.Name):
        bound = tree.bindings(tree.scope_of(call)).get(call.func.value, [])
        first = next((b for b in bound if isinstance(b, cst.Assign)), None)
        if first is not None and isinstance(first.value, (cst.Name, cst.Attribute)):
            return first.value
    return call.func


def _builds_transformers_trainer(tree, built: cst.BaseExpression, audit, path: Path) -> bool:
    """Whether `built` names a transformers or trl Trainer: one imported from either, a
    subclass of the file, or a class of a project module that names transformers or trl and
    subclasses a `...Trainer` there (not Lightning's `Trainer`, nor a project's own)."""
    from gaaudit.analysis.tree import code

    name = code(built).rsplit(".", 1)[-1]
    origin = tree.qualified(built) or ""
    if origin.startswith(("transformers.", "trl.")) or name in audit.trainers:
        return True
    parts = origin.split(".")[:-1]
    if not parts or parts[0] in LIBRARIES:
        return False
    here = path.resolve().parent
    for folder in (here, *here.parents):
        module = folder.joinpath(*parts)
        for candidate in (module.with_suffix(".py"), module / "__init__.py"):
            if candidate.is_file():
                text = candidate.read_text("utf-8", "replace")
                subclass = rf"(?m)^class {re.escape(name)}\((?:[\w.]*Trainer\b)"
                return bool(
                    re.search(subclass, text) and re.search(r"\b(?:transformers|trl)\b", text)
                )
    return False


def _built_with(tree, call: cst.Call, audit) -> tuple[str, str]:
    """What the Trainer `call` builds is given (`audit.given`) that the replay must honour: the
    name of a module-level function of the file passed as `compute_loss_func` (defined in the
    replay), and why the harness cannot stand for the rest (a model of the project's own
    class, which computes a loss of its own; a loss function that is not the file's)."""
    from gaaudit.analysis.tree import code

    loss = audit.given(call, "compute_loss_func")
    if loss is not None and not (isinstance(loss, cst.Name) and loss.value in tree.functions):
        return f"its `compute_loss_func={code(loss)}` is not a function of this file", ""
    model = audit.given(call)
    if isinstance(model, cst.Name):
        bound = tree.bindings(tree.scope_of(call)).get(model.value, [])
        model = next((b.value for b in reversed(bound) if isinstance(b, cst.Assign)), model)
    if isinstance(model, cst.Call) and isinstance(model.func, cst.Name):
        built = model.func.value
        origin = (tree.qualified(model.func) or built).split(".")[0]
        if built[:1].isupper() and origin not in LIBRARIES:
            return (
                f"the Trainer trains `{built}(...)` (line {tree.line(model)}), a model of "
                "the project with a loss of its own, which the harness's tiny language "
                "model does not stand for: pass your model with --model-factory (and your "
                "batches with --data-factory)"
            ), ""
    return "", loss.value if loss is not None else ""


def _launched_window(structure, backward, window) -> str:
    """Why a window the file does not write is not replayed: DeepSpeed's, formed behind
    accelerate with K in the configuration given at launch (the loop itself steps every
    micro-batch), or the loop of SwissArmyTransformer's `training_main`; else ""."""
    from gaaudit.analysis.loops import runner
    from gaaudit.analysis.tree import code

    if window.kind == "framework" and structure.accelerate_deepspeed(backward):
        return (
            "the window is DeepSpeed's, set up through accelerate at launch (its K is in the "
            "configuration given there), which the replay does not build; the loop itself "
            "steps every micro-batch"
        )
    if runner(window) == "training_main":
        return (
            f"the loop is `{code(window.anchor.func)}(...)`'s (line "
            f"{structure.tree.line(window.anchor)}), inside a framework the replay does not "
            "build: it replays loops the file writes"
        )
    return ""


def _drops_last(path: Path) -> str:
    """Where the file, or a module of its project that imports it (the script that builds
    the loader and calls the loop: MAE's `main_finetune.py`) or that it imports (a `data`
    package that builds the loader), builds a loader with `drop_last=True`. The project is
    the current directory when the file is under it."""
    here, root = path.resolve(), search_root(path)
    if not here.is_relative_to(root):
        return ""
    try:
        imported = _imported(ast.parse(path.read_bytes()), here.relative_to(root))
    except (OSError, SyntaxError, ValueError):
        return ""
    imports_this = re.compile(rf"\b(from|import)\s[^\n]*\b{re.escape(path.stem)}\b")
    for module, file, line, text in _drop_last_files(root):
        if (
            file == here
            or any(module == m or module.startswith(f"{m}.") for m in imported)
            or imports_this.search(text)
        ):
            return f"`drop_last=True`, {file.relative_to(root).as_posix()}, line {line}"
    return ""


def _configured_blocks(path: Path, text: str) -> str:
    """The sign of fixed-length blocks in the data that the project's YAML configs build for
    the file at `path` (`text`; `hydra.utils.instantiate(self.cfg.datamodule)`): every module
    that their `_target_`s for that key name shows one and no sign of varying counts; ""
    else."""
    from gaaudit.analysis.evidence import scan
    from gaaudit.discover.modules import configured_targets, locate, shown

    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    keys = {
        node.args[0].attr if isinstance(node.args[0], ast.Attribute) else node.args[0].id
        for node in ast.walk(module)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", "")) == "instantiate"
        and node.args
        and isinstance(node.args[0], (ast.Attribute, ast.Name))
    }
    seen: set = set()
    signs = []
    for key in filter(DATA_KEY.search, keys):
        for target, _, _, _ in configured_targets(path.parent, key, seen):
            file = locate(path.resolve().parent, 0, target.rpartition(".")[0], seen)
            blocks = scan(file.read_text("utf-8", "replace")).blocks if file else None
            if blocks is None:
                return ""
            signs.append(f"{blocks[1]}, {shown(file)}, line {blocks[0]}")
    return signs[0] if signs else ""


def _imported(tree: ast.Module, relative: Path) -> set[str]:
    """The dotted modules a file at `relative` imports, absolute from the project root: what
    `from . import x` names in `pkg/f.py` is `pkg` and `pkg.x`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = list(relative.parent.parts)
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}".lstrip(".") for alias in node.names)
    return names - {""}


def _drop_last_files(root: Path) -> list[tuple[str, Path, int, str]]:
    """The project's Python files that say `drop_last=True`: (dotted module, path, line of
    the first, text)."""
    found = []
    for module, file, text in _project_modules(root):
        match = DROP_LAST.search(text)
        if match:
            line = text.count("\n", 0, match.start()) + 1
            found.append((module, file, line, text))
    return found


@functools.cache
def _project_modules(root: Path) -> tuple[tuple[str, Path, str], ...]:
    """The project's Python files that name what `_drop_last_files` or `_training_options`
    look for (the others are not kept), read once: (dotted module, path, text)."""
    found = []
    for file in sorted(discover([root], Settings(root=root))):
        if file.suffix != ".py":
            continue
        try:
            text = file.read_text("utf-8", "replace")
        except OSError:
            continue
        if "drop_last" in text or "TrainingArguments" in text:
            module = ".".join(file.resolve().relative_to(root).with_suffix("").parts)
            found.append((module.removesuffix(".__init__"), file.resolve(), text))
    return tuple(found)


@functools.cache
def _training_options(root: Path) -> tuple[tuple[str, object], ...]:
    """The literal defaults of the options the project adds to the Trainer's arguments (its
    dataclasses that extend `TrainingArguments`), which a Trainer subclass may read
    (`self.args.use_lora`): the replay's arguments carry them. Values JSON can carry."""
    from gaaudit.harness.surroundings import option_defaults

    found: dict[str, object] = {}
    for _, _, text in _project_modules(root):
        if "TrainingArguments" not in text:
            continue
        with contextlib.suppress(SyntaxError, ValueError):
            for name, value in option_defaults(ast.parse(text)).items():
                if value is None or isinstance(value, (bool, int, float, str)):
                    found.setdefault(name, value)
    return tuple(sorted(found.items()))


@functools.cache
def _caller_options(path: Path, function: str) -> tuple[tuple[str, object], ...]:
    """The command-line option defaults (harness.analysis.argument_defaults) of the scripts
    beside the file that call its `function` (they name it and the file's module, as `check`
    finds its callers): what the arguments they parse and hand it hold in a run that passes
    none (`train_one_epoch(..., args)` reading `args.precision`)."""
    from gaaudit.harness.analysis import argument_defaults

    found: dict[str, object] = {}
    needles = (f"{function}(", path.stem)
    for caller in sorted(path.parent.glob("*.py")):
        try:
            text = caller.read_text("utf-8", "replace")
            if caller != path and all(n in text for n in needles) and "add_argument" in text:
                for name, value in argument_defaults(ast.parse(text)).items():
                    found.setdefault(name, value)
        except (OSError, SyntaxError, ValueError):
            continue
    return tuple(sorted(found.items()))


def _trainer_targets(
    audit, located: _Locator, statements: set[int]
) -> dict[int, tuple[Target, int]]:
    """The file's Trainer subclasses, by the line of their `class` statement, with their last
    line; flagged when GA004 (or GA001 in one of their methods) reports them. One that keeps
    the stock loss is replayed too: the Trainer's own accumulation, with the class's other
    overrides (its optimizer, its batches)."""
    flagged = {site.owner for site in audit.sites() if site.owner is not None}
    found = {}
    for name, cls in audit.trainers.items():
        start, end, header, patched = located(cls)
        reported = cls in flagged or any(start <= line <= end for line in statements)
        found[start] = (Target(start, patched, header, (), reported, name), end)
    return found


def _replayed_statement(tree, window, anchor: cst.CSTNode) -> cst.CSTNode | None:
    """The loop that holds both the backward calls and the optimizer step (or the calls of the
    function that backpropagates), else the function."""
    from gaaudit.analysis.tree import target_names, variables

    loops = [a for a in tree.ancestors(anchor) if isinstance(a, (cst.For, cst.While))]
    if window.kind == "micro-loop" and window.loop in loops:
        outer = loops[loops.index(window.loop) + 1 :]  # the loop whose body also steps
        scope = tree.scope_of(window.loop)
        return outer[0] if outer else scope if isinstance(scope, cst.FunctionDef) else window.loop
    if window.kind in ("modulo", "accumulate") and (loops or window.loop is not None):
        return window.loop or loops[-1]
    scope = tree.scope_of(anchor)
    if window.kind == "framework" and loops and tree.scope_of(loops[0]) is scope:
        inner = loops[0]  # a DeepSpeed engine's: the loop that draws its micro-batches, or the
        for outer in loops[1:]:  # loop around it whose items they are (`for b in window:`)
            if not (isinstance(inner, cst.For) and isinstance(outer, cst.For)):
                break
            if not variables(inner.iter) & target_names(outer.target):
                break
            inner = outer
        return inner
    return scope if isinstance(scope, cst.FunctionDef) else None


def _first_line(tree, statement: cst.CSTNode) -> str:
    """The statement's own first line: not a comment or blank line above it."""
    if hasattr(statement, "leading_lines"):
        statement = statement.with_changes(leading_lines=[])
    return tree.module.code_for_node(statement).strip().splitlines()[0]


def _same_header(text: str, header: str) -> bool:
    """A line that opens the same statement; a `def` matches by name (a fix may add a parameter),
    a `for` also as the fix's read-ahead loop."""
    from gaaudit.fixes.read_ahead import reads_ahead

    text = text.strip()
    if header.startswith(("def ", "async def ")):
        return text.startswith(header.split("(", 1)[0] + "(")
    return text == header or (header.startswith("for ") and reads_ahead(text, header))


def _occurrence(lines: list[str], header: str, line: int) -> int:
    return sum(1 for text in lines[: line - 1] if _same_header(text, header))


def _find(lines: list[str], header: str, occurrence: int) -> int | None:
    matches = [i for i, text in enumerate(lines, 1) if _same_header(text, header)]
    return matches[occurrence] if occurrence < len(matches) else None


def verify_files(
    requests: list[tuple[Path, int | None]], options: Options, jobs: int = 1
) -> list[list[Outcome]]:
    """Every loop of each (path, line) request against what `gaaudit fix` (all confidences,
    unsafe fixes too) would make of it, replayed in one child process (torch imported once);
    with `jobs` > 1, the requests are shared out round-robin to that many worker processes,
    each fixing its share and replaying it in a child of its own."""
    shares = min(jobs, len(requests))
    if shares < 2:
        return _verify_share(requests, options)
    from concurrent.futures import ProcessPoolExecutor

    results: list[list[Outcome]] = [[] for _ in requests]
    threads = max(1, (os.cpu_count() or 1) // shares)
    with ProcessPoolExecutor(shares, initializer=_share_cores, initargs=(threads,)) as pool:
        answered = pool.map(
            _verify_share, [requests[i::shares] for i in range(shares)], [options] * shares
        )
        for i, outcomes in enumerate(answered):
            results[i::shares] = outcomes
    return results


def _share_cores(threads: int) -> None:
    """A worker's replay child runs torch on its share of the cores (unless the user said how
    many): torch's threads, each process as many as there are cores, spin against each other."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _verify_share(requests: list[tuple[Path, int | None]], options: Options) -> list[list[Outcome]]:
    """`verify_files` of some requests, fixed here and replayed in one child process."""
    from gaaudit.fixes.fixer import fix_source

    pairs, companions = [], []
    for path, line in requests:
        original = read(path).data
        fixed = fix_source(
            original, path, Settings(min_confidence=Confidence.LOW), unsafe=True, reach=True
        )
        companions.append([c.path for c in fixed.companions])
        pairs.append((path, original, fixed.after, line))
    results = verify_pairs(pairs, options)
    for outcomes, changed in zip(results, companions):
        # the replay imports the other modules a fix changes as they are on disk: what they
        # define is the harness's stand-in, or the call the fix changed fails there
        for row in (row for o in outcomes if o.flagged and changed for row in o.rows):
            row["verdict"] += (
                f"; the fix also changes {', '.join(changed)}, which the replay imports as it "
                "is on disk: apply the fix with `gaaudit fix`, then verify the fixed file"
            )
    return results


def verify_pair(
    path: Path, original: bytes, patched: bytes, line: int | None, options: Options
) -> list[Outcome]:
    """Plan statically, then replay in a child process bounded by `options.timeout`."""
    return verify_pairs([(path, original, patched, line)], options)[0]


def verify_pairs(
    pairs: list[tuple[Path, bytes, bytes, int | None]], options: Options
) -> list[list[Outcome]]:
    """verify_pair for several (path, original, patched, line) in one child process, bounded by
    `options.timeout` for each file that has loops to replay."""
    planned = [targets(original, patched, line, path) for path, original, patched, line in pairs]
    shown = sys.stderr.isatty()  # the child says on the terminal which loop it replays
    jobs = [
        {
            "original": original.decode("utf-8", "replace"),
            "patched": patched.decode("utf-8", "replace"),
            "targets": [asdict(t) for t in found],
            "options": asdict(options),
            "filename": str(path),
            "progress": shown,
        }
        for (path, original, patched, _), found in zip(pairs, planned)
        if found
    ]
    if not jobs:
        return [[] for _ in pairs]
    answers = iter(_replayed(jobs, options.timeout))
    return [
        (
            [_failed(t, rows) for t in found]
            if isinstance(rows := next(answers), str)
            else [Outcome(**row) for row in rows]
        )
        if found
        else []
        for found in planned
    ]


def _replayed(jobs: list[dict], timeout: float) -> list[list[dict] | str]:
    """Each job's rows, which one child process answers job by job (a line each), waiting at
    most `timeout` seconds for each from the moment the child begins it (and as long for the
    child to start); a job's verdict instead where the child timed out or ended on it (a
    device-side assert on a GPU, a crash in the user's code). The jobs after that one are
    replayed by a new child: a failure loses only its own file's rows."""
    answers: list[list[dict] | str] = []
    with tempfile.TemporaryFile("w+") as given, tempfile.TemporaryFile("w+") as errors:
        json.dump(jobs, given)
        given.seek(0)
        child = subprocess.Popen(
            [sys.executable, "-m", "gaaudit.commands.verify"],
            stdin=given,
            stdout=subprocess.PIPE,
            stderr=None if jobs[0]["progress"] else errors,
            env={**os.environ, **OFFLINE},
            text=True,
        )
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=_read_lines, args=(child.stdout, lines), daemon=True).start()
        try:
            while len(answers) < len(jobs):
                try:
                    line = lines.get(timeout=timeout)
                except queue.Empty:
                    answers.append(f"not replayable: timed out after {timeout:g} s")
                    break
                if line is None:  # the child ended before it answered every job
                    code = child.wait()
                    errors.seek(0)
                    reason = (
                        f"ended by {signal.Signals(-code).name}"
                        if code < 0
                        else _last_error(None if jobs[0]["progress"] else errors.read())
                    )
                    answers.append(f"not replayable: the replay process failed ({reason})")
                    break
                answer = json.loads(line)
                if answer == BEGUN:  # the job's own `timeout` starts now
                    continue
                if isinstance(answer, dict):
                    raise VerifyError(answer["error"])
                answers.append(answer)
        finally:
            if len(answers) == len(jobs):  # done: it stops the processes it started (DDP ranks)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=timeout)
            child.kill()
            child.wait()
    rest = jobs[len(answers) :]
    return answers + (_replayed(rest, timeout) if rest else [])


def _read_lines(stream, lines: queue.SimpleQueue) -> None:
    """The child's answers, a line each, then None when it closes its output."""
    with stream:
        for line in stream:
            lines.put(line)
    lines.put(None)


def _last_error(stderr: str | None) -> str:
    """The child's exception, as its traceback names it last (CUDA adds advice after it)."""
    if stderr is None:
        return "its error is above"
    lines = stderr.strip().splitlines() or ["no output"]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b", line)]
    return (errors or lines)[-1]


def _failed(target: Target, verdict: str) -> Outcome:
    return Outcome(
        target.line,
        target.header,
        [{"k": None, "original_error": None, "patched_error": None, "verdict": verdict}],
        target.flagged,
    )


def _replay_all(jobs: list[dict], begun=lambda: None) -> Iterator[list[dict]]:
    """The child's side: replay every target of every job for every K with the harness (on
    `options.distributed` processes when set, with the user's model when given), calling
    `begun` as each job starts; the jobs share their options, so the model factory and the
    processes are set up once."""
    from gaaudit.harness.factory import load_data_factory, load_factory, user_data, user_model
    from gaaudit.harness.replay import engine_process

    options = Options(**{k: tuple(v) if k == "ks" else v for k, v in jobs[0]["options"].items()})
    factory = None
    if options.model_factory is not None:
        factory = (options.model_factory, options.project_root, options.factory_option)
    data = None
    if options.data_factory is not None:
        data = load_data_factory(options.data_factory, options.project_root, options.data_option)
    with (
        user_model(load_factory(*factory) if factory else None),
        user_data(data),
        _ranks(options, factory) as ranks,
        engine_process(),
    ):
        for job in jobs:
            # what lives on (torch, transformers, the model factory) is left out of later
            # collections: a Trainer collects at each `train()`, a third of a second each over
            # everything imported
            gc.collect()
            gc.freeze()
            begun()
            yield _replay_targets(job, options, ranks)
    if jobs[0].get("progress"):
        _progress("")


@contextlib.contextmanager
def _ranks(options: Options, factory):
    """The DDP worker processes for --distributed, else None."""
    if not options.distributed:
        yield None
        return
    from gaaudit.harness.distributed import Ranks

    with contextlib.closing(
        Ranks(options.distributed, options.device, options.timeout, factory)
    ) as ranks:
        yield ranks


def _replay_targets(job: dict, options: Options, ranks) -> list[dict]:
    from gaaudit.harness.nets import SIZED_KINDS
    from gaaudit.harness.replay import compare

    outcomes = []
    fixed = job["patched"] != job["original"]
    for raw in job["targets"]:
        target = Target(
            **{
                **raw,
                "divisors": tuple(raw["divisors"]),
                "options": tuple(map(tuple, raw["options"])),
                "bound": tuple(raw["bound"]),
            }
        )
        outcome = Outcome(
            target.line,
            target.header,
            flagged=target.flagged,
            fixed_length=target.fixed_length,
            pinned=target.pinned,
            pin_kind=target.pin_kind,
        )
        patched = target.flagged and fixed  # else the loop is replayed as it is
        refused = ""  # what keeps the replay from running at all
        if target.stops and not (target.trainer and options.model_factory):
            refused = target.stops
        elif target.trainer and options.distributed:
            framework = (
                "a LightningModule"
                if target.lightning
                else "a Megatron loss function"
                if target.megatron
                else "a Trainer"
            )
            refused = f"{framework} is replayed in one process; leave out --distributed"
        if refused:
            outcome.rows = [
                {
                    "k": k,
                    "original_error": None,
                    "patched_error": None,
                    "verdict": f"not replayable: {refused}",
                }
                for k in options.ks
            ]
            outcomes.append(asdict(outcome))
            continue
        if target.trainer:  # a framework's trainer runs it
            trains, row = (
                ("a Lightning Trainer", _lightning_row)
                if target.lightning
                else ("Megatron's rule", _megatron_row)
                if target.megatron
                else ("a real Trainer", _trainer_row)
            )
            outcome.replayed = MEGATRON_RULE if target.megatron else ""
            if job.get("progress"):
                _progress(f"training {job['filename']}:{target.line} with {trains}")
            outcome.rows = [row(job, target, options, k, patched) for k in options.ks]
            if any(r.pop("predates", False) for r in outcome.rows):
                outcome.replayed = PREDATES
            if any(r.pop("equal_sizes", False) for r in outcome.rows):
                outcome.equal_sizes = target.equal_sizes or LAST_BATCH_LEFT_OUT
            outcomes.append(asdict(outcome))
            continue
        plan = _planned(job["original"], target)
        # as many targets in every sample, whose counts vary with sizes alone: GA-GUIDE 3
        if plan is not None and plan.model_kind in SIZED_KINDS:
            outcome.equal_sizes = target.equal_sizes or LAST_BATCH_LEFT_OUT
        per_call = plan is not None and "micro-batch" in plan.roles.values()
        counted = per_call and patched and _caller_divides(job, target, plan)
        # micro-batches of one fixed length, no padding; of one size, where sizes count
        packed = bool(target.fixed_length or outcome.equal_sizes)
        for k in options.ks:
            if job.get("progress"):
                _progress(f"replaying {job['filename']}:{target.line} with K = {k}")
            if patched and target.patched_line is None:
                outcome.rows.append(
                    {
                        "k": k,
                        "original_error": None,
                        "patched_error": None,
                        "verdict": "not replayable: the patched loop was not found",
                    }
                )
                continue
            lines = (  # a loop with no finding is its own patch: both replays are the loop
                job["original"],
                job["patched"] if patched else job["original"],
                target.line,
                target.patched_line if patched else target.line,
                k,
                target.divisors,
            )
            if ranks is None:
                result = compare(
                    *lines,
                    device=options.device,
                    dtype=options.dtype,
                    seed=options.seed,
                    timeout=options.timeout,
                    packed=packed,
                    options=dict(target.options),
                )
            else:
                from gaaudit.harness import distributed

                result = distributed.compare(
                    ranks,
                    *lines,
                    dtype=options.dtype,
                    seed=options.seed,
                    timeout=options.timeout,
                    packed=packed,
                    options=dict(target.options),
                )
            outcome.rows.append(
                {
                    "k": k,
                    "original_error": result.original.error,
                    "patched_error": result.patched.error if patched else None,
                    "verdict": f"{_hinted(result.original.verdict, options)}; {NOTHING_FIXED}"
                    if _needs_patch(target, result.original.verdict, patched)
                    else _hinted(result.verdict, options),
                    "original_verdict": result.original.verdict,
                    "first_window": result.original.window,
                    "first_window_error": result.original.first_error,
                    "window_verdict": result.original.window_verdict,
                    "patched_first_window": result.patched.window if patched else None,
                    "patched_first_window_error": result.patched.first_error if patched else None,
                    "dtype": result.dtype,
                    "processes": options.distributed or 1,
                    "process_group": _grouped(result.original, result.patched),
                }
            )
            stand_in = result.original.replay.ok and not options.model_factory
            notes = (
                (CALLED_WITH_WINDOW if plan.splits_batch else CALLED_PER_BATCH) if per_call else "",
                CALLER_DIVIDES if counted else "",
                STAND_IN_NOTES.get(result.original.replay.model_kind, "") if stand_in else "",
            )
            outcome.replayed = "; ".join(note for note in notes if note)
        outcomes.append(asdict(outcome))
    return outcomes


def _planned(source: str, target: Target):
    """The harness's plan of the statement's replay (analysis.Plan), None where it has none."""
    from gaaudit.harness.analysis import NotReplayable, analyse

    try:
        return analyse(source, target.line, target.divisors)
    except NotReplayable:
        return None


def _caller_divides(job: dict, target: Target, plan) -> bool:
    """Whether the fix has the caller of the replayed function divide the window once
    (analysis.caller_divides; replay.compare replays the patched function so)."""
    from gaaudit.harness.analysis import caller_divides

    if target.patched_line is None:
        return False
    patched = _planned(job["patched"], replace(target, line=target.patched_line))
    return patched is not None and caller_divides(plan, patched)


def _progress(text: str) -> None:
    """One status line on the terminal, replaced by the next (cleared with an empty text)."""
    print(f"\r\x1b[K{'gaaudit: ' + text if text else ''}", end="", file=sys.stderr, flush=True)


def _trainer_row(job: dict, target: Target, options: Options, k: int, patched: bool) -> dict:
    """One K of a Trainer class, replayed by a real Trainer (harness.trainer); under a pin
    before 4.46 or to 4.47.0/4.48.0, as that release trains, then as the installed one does."""
    from gaaudit.checks.versions import required
    from gaaudit.harness import trainer
    from gaaudit.harness.gradcheck import resolve_device

    row = trainer.compare(
        job["original"],
        job["patched"] if patched else None,
        job["filename"],
        target.trainer,
        k,
        options.seed,
        resolve_device(options.device),
        pinned=target.pin_kind,
        fixed=bool(target.fixed_length),
        loss_func=target.loss_func,
        options=dict(target.options),
        head=target.head,
        patched_loss_func=target.patched_loss_func,
        opts_out=target.opts_out,
    )
    if target.pinned:  # what fixes it is the requirement: the installed release's verdict
        import transformers

        installed = row.pop("installed_verdict")
        if row["verdict"] != VERIFIED:
            row["verdict"] = (
                f"{row['verdict']}; with the installed transformers {transformers.__version__}: "
                f"{installed}"
                f"{f': require {required(target.pin_kind)}' if installed == VERIFIED else ''}"
            )
    elif _needs_patch(target, row["original_verdict"], patched):
        row["verdict"] = f"{row['verdict']}; {NOTHING_FIXED}"
    return {**row, "dtype": "float32", "processes": 1}


def _megatron_row(job: dict, target: Target, options: Options, k: int, patched: bool) -> dict:
    """One K of a loss function Megatron's `pretrain` is handed, replayed by Megatron's rule
    (harness.megatron); `fix` rewrites none, so it is replayed as it is."""
    from gaaudit.harness import megatron
    from gaaudit.harness.gradcheck import resolve_device

    row = megatron.compare(
        job["original"],
        job["filename"],
        target.trainer,
        target.bound,
        k,
        options.seed,
        resolve_device(options.device),
        bool(target.fixed_length),
    )
    if _needs_patch(target, row["original_verdict"], patched):
        row["verdict"] = f"{row['verdict']}; {NOTHING_FIXED}"
    return {**row, "dtype": "float32", "processes": 1}


def _lightning_row(job: dict, target: Target, options: Options, k: int, patched: bool) -> dict:
    """One K of a LightningModule, trained by a real Lightning Trainer (harness.lightning);
    the patched module too when `gaaudit fix` changed the file."""
    from gaaudit.harness import lightning
    from gaaudit.harness.gradcheck import resolve_device

    device, fixed = resolve_device(options.device), bool(target.fixed_length)
    replay = (job["filename"], target.trainer, k, options.seed, device, fixed)
    row = lightning.compare(job["original"], *replay)
    if patched:
        after = lightning.compare(job["patched"], *replay)
        row["patched_error"], row["verdict"] = after["original_error"], after["verdict"]
    elif _needs_patch(target, row["original_verdict"], patched):
        row["verdict"] = f"{row['verdict']}; {NOTHING_FIXED}"
    return {**row, "dtype": "float32", "processes": 1}


def _first_window(loop: str, key: str, row: dict) -> str:
    """What the row says of a loop whose first window holds fewer than K micro-batches."""
    held, error = row[key], row.get(f"{key}_error")
    text = (
        f"the {loop} loop's first window holds {held} micro-batch{'es' if held > 1 else ''}, "
        f"not {row['k']}"
    )
    if error is None:  # its next window did not replay
        return f"{text}: compared with the full batch of those"
    return (
        f"{text}: error {_number(error)} against the full batch of those; the row's error is "
        "its next window's"
    )


def _needs_patch(target: Target, original: str, patched: bool) -> bool:
    """Whether a row lacks the patch it needs: a flagged loop that fix left, whose original
    verdict is not a match with the full batch."""
    return target.flagged and not patched and original != VERIFIED


def _hinted(verdict: str, options: Options) -> str:
    """A loop that needs a process group says how to give it one."""
    from gaaudit.harness.replay import wants_group

    if not options.distributed and wants_group(verdict):
        return f"{verdict}; replay it with --distributed 2"
    return verdict


def _grouped(*checks) -> bool:
    """Whether a replay ran as the one rank of a process group of its own."""
    from gaaudit.harness.replay import GROUP_OF_ONE

    return any(GROUP_OF_ONE in check.replay.bindings.values() for check in checks)


def _child() -> None:
    """`python -m gaaudit.commands.verify`: a list of jobs on stdin; on stdout, each job's
    outcomes on a line as soon as they are known (or {"error": ...}), each after a line of
    its own that says the job has begun."""
    from gaaudit.harness.distributed import DistributedError
    from gaaudit.harness.factory import FactoryError

    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what else is printed cannot mix in

    def say(answer) -> None:
        print(json.dumps(answer), file=channel, flush=True)

    try:
        for rows in _replay_all(json.loads(sys.stdin.read()), lambda: say(BEGUN)):
            say(rows)
    except (FactoryError, DistributedError) as exc:
        say({"error": str(exc)})


if __name__ == "__main__":
    _child()


def report(results: list[tuple[Path, list[Outcome]]], fmt: str) -> int:
    """Print each file's outcomes (JSON: an object per file, a list of them for several files);
    the exit code over all loops: 0 all verified, 1 one is not, 2 nothing replayed."""
    if fmt == "json":
        files = [
            {
                "path": path.as_posix(),
                "loops": [{**asdict(o), "verdict": o.verdict} for o in outcomes],
            }
            for path, outcomes in results
        ]
        print(json.dumps(files[0] if len(files) == 1 else files, indent=2))
    else:
        print(ERROR_MEANS)
        print(f"{'line':>5}  {'K':>3}  {'original error':>14}  {'patched error':>13}  verdict")
        for path, outcomes in results:
            if len(results) > 1 and outcomes:
                print(path)
            for outcome in outcomes:
                print(f"{outcome.line:>5}  {outcome.header}")
                if outcome.pinned:
                    replayed = REGRESSION if outcome.pin_kind == "regressed" else BEFORE_FIX
                    print(f"{'':>5}  {'':>3}  {replayed.format(outcome.pinned)}")
                if outcome.replayed:
                    print(f"{'':>5}  {'':>3}  {outcome.replayed}")
                if outcome.equal_sizes:
                    why = (
                        "an epoch's last, short batch left out, as no loader of the project "
                        "drops it"
                        if outcome.equal_sizes == LAST_BATCH_LEFT_OUT
                        else f"as the project's loader drops its last, short batch "
                        f"({outcome.equal_sizes})"
                    )
                    print(
                        f"{'':>5}  {'':>3}  replayed on micro-batches of one size, {why}: "
                        "with as many targets in every sample, mean/K is exact on this data"
                    )
                if outcome.fixed_length:
                    print(
                        f"{'':>5}  {'':>3}  replayed on micro-batches of one fixed length, as the "
                        f"file's data is ({outcome.fixed_length}): mean/K is exact on this data"
                    )
                for row in outcome.rows:
                    print(
                        f"{'':>5}  {row['k'] or '-':>3}  {_number(row['original_error']):>14}  "
                        f"{_number(row['patched_error']):>13}  {row['verdict']}"
                    )
                    for loop, key in (
                        ("original", "first_window"),
                        ("patched", "patched_first_window"),
                    ):
                        if row.get(key):
                            print(f"{'':>5}  {'':>3}  {_first_window(loop, key, row)}")
                    if row.get("process_group"):
                        print(
                            f"{'':>5}  {'':>3}  replayed as the one rank of a process group, as "
                            "the loop calls torch.distributed: --distributed 2 replays it on two"
                        )
            if not outcomes:
                print(f"{path}: no accumulation loop to replay")
    everything = [o for _, outcomes in results for o in outcomes]
    replayed = [o for o in everything if not o.verdict.startswith("not replayable")]
    if not replayed:
        return 2
    return 0 if all(o.verdict == VERIFIED for o in everything) else 1


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def run_demo(fmt: str, plot: Path | None) -> int:
    """The reference experiment: full batch vs mean/K vs sum-and-count for K = 1..32."""
    from gaaudit.harness.demo import plot as draw
    from gaaudit.harness.demo import run_demo as experiment

    rows = experiment()
    if fmt == "json":
        print(json.dumps([asdict(row) for row in rows], indent=2))
    else:
        print(f"{'K':>3}  {'mean / K':>10}  {'sum and count':>13}")
        for row in rows:
            print(f"{row.k:>3}  {row.mean_over_k:>10.1e}  {row.sum_and_count:>13.1e}")
    if plot is not None:
        draw(rows, str(plot))
        print(f"gaaudit: wrote the plot to {plot}", file=sys.stderr)
    return 0
