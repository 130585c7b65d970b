"""GA006: a transformers pin without the Trainer's accumulation fix, where the code accumulates.

Repository level (`check_repository`): requirements files, pyproject.toml (PEP 621 and
poetry), setup.cfg, setup.py and conda environment files, against
`gradient_accumulation_steps > 1` in the Python files and config files under the
pin file's folder. File level (`findings`): a script's PEP 723 inline metadata.
"""

from __future__ import annotations

import ast
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from gaaudit import catalogue
from gaaudit.analysis.domain import PAIRWISE
from gaaudit.analysis.evidence import SUPPRESSION, scan
from gaaudit.checks.engine import display_path
from gaaudit.config import DEFAULT_EXCLUDE
from gaaudit.discover.files import Excluded
from gaaudit.discover.modules import search_root
from gaaudit.findings import Confidence, FileReport, Finding, Span

if TYPE_CHECKING:  # packaging is imported where pins are judged: most runs find none
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

CODE = "GA006"
FIXED = "4.46.2"
EARLY = "4.46.0"
# Releases whose `training_step` hands a model that takes loss kwargs no count and skips its
# division by K (the next patch release restored both)
REGRESSED = ("4.47.0", "4.48.0")
# The first release whose Trainer counts `labels[..., 1:]` for a model whose loss shifts its
# labels (a causal LM); the ones before count every label that is not -100.
SHIFTED_COUNT = "5.10.1"
OLD = ("old", "commit")  # the pins whose Trainer predates 4.46 (or may)
FLAGS = {"--gradient_accumulation_steps", "--gradient-accumulation-steps"}
CONFIGS = {".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".sh"}
WANTED = (*CONFIGS, ".txt", ".md", ".rst", "setup.py")  # the endings of every file `_walk` may keep
MAX_BYTES = 1 << 20
# `gradient_accumulation_steps: 8`, `"gradient_accumulation_steps": 8`, `= 8`, `--gradient-accumulation-steps 8`
SETTING = re.compile(r"""gradient[_-]accumulation[_-]steps["']?\s*(?:[:=]|\s)\s*["']?(\d+)\b""")
# The ref of a git URL of transformers itself: a release tag (`@v4.28.0`) or a commit.
GIT_REF = re.compile(
    r"huggingface/transformers(?:\.git)?@(?:v(?P<release>\d+\.\d+\.\d+)|[0-9a-f]{7,40})(?:[#&]|$)"
)
# The release a git URL of another package installs, read from its tag (`...@v0.8.5_fixes`)
RELEASE_REF = re.compile(r"@v?(\d+\.\d+(?:\.\d+)?)(?![\d.])")
SCRIPT = re.compile(r"(?m)^# /// script\s*$")  # PEP 723 inline script metadata
FRAMEWORK = re.compile(rb"\b(?:transformers|trl)\b")
LIBRARIES = ("transformers", "trl")  # whose Trainers the pin governs
CLASS = re.compile(rb"(?m)^[ \t]*class[ \t]+(\w+)[ \t]*\(([^)]*)\)")  # a class and its bases
# A call's start that is not Lightning's `L.Trainer(` / `pl.Trainer(`
NOT_LIGHTNING = rb"(?<![\w.])(?!(?:pl|L|lightning|pytorch_lightning)\.)"
# `transformers.Trainer(`, `SFTTrainer(`
TRAINER_CALL = re.compile(NOT_LIGHTNING + rb"((?:\w+\.)*\w*Trainer)\s*\(")
TRAINER_SEEN = "the code trains with a transformers Trainer"
EXACT = (
    "every micro-batch the Trainer sees holds the same number of loss elements ({}), where the "
    "old Trainer's mean/K is exact; it becomes wrong as soon as they differ"
)
NO_TRAINER = (
    "no transformers Trainer seen in the code; the pin matters where a framework trains with one "
    "from this configuration"
)
# Releases probed to decide what a specifier admits, with the versions it names and their successors.
PROBES = (
    "2.0.0",
    "3.0.0",
    *(f"4.{minor}.0" for minor in range(100)),
    "4.46.1",
    "4.46.2",
    "4.46.3",
    *(f"{major}.0.0" for major in range(5, 10)),
)


@cache
def patterns(package: str) -> SimpleNamespace:
    """How a requirement of `package` is written: `named`, a requirement that names it;
    `quoted`, a quoted PEP 508 string; `poetry`, `conda`; `readme`, a README's pin in a `pip
    install` line or a code span (`transformers==4.29.2`: a lower bound alone excludes no later
    release)."""
    name = re.escape(package)
    return SimpleNamespace(
        package=package,
        named=re.compile(rf"(?i){name}(?![\w-])"),
        quoted=re.compile(rf"""(["'])\s*({name}(?![\w-])[^"']*)\1""", re.IGNORECASE),
        poetry=re.compile(rf"""^(\s*["']?){name}["']?\s*=(?!=)\s*(.+?)\s*$""", re.IGNORECASE),
        conda=re.compile(rf"^(?:[\w-]+::)?{name}\s*(?:=|\s)\s*(\d[\w.*]*)$", re.IGNORECASE),
        readme=re.compile(rf"\b{name}(?:\[[\w,]+\])?\s*(?:==|<=|<|~=)\s*\d[\w.*]*"),
    )


TRANSFORMERS = patterns("transformers")
QUOTED, POETRY, CONDA = TRANSFORMERS.quoted, TRANSFORMERS.poetry, TRANSFORMERS.conda


@dataclass(frozen=True)
class Accumulation:
    """Where the code sets gradient_accumulation_steps above 1."""

    path: Path
    where: str
    trainer: bool  # set on a TrainingArguments-like call
    run_time: bool = False  # from a value known only at run time (`cfg.accumulation`)


@dataclass(frozen=True)
class Pin:
    """A transformers requirement and where it is written."""

    line: int
    column: int
    shown: str  # as written
    requirement: str  # as PEP 508 (poetry and conda constraints converted)
    raw: str  # the whole source line, for suppression comments


def verdict(specifier: SpecifierSet) -> str | None:
    """Whether a specifier admits only releases without the fix: `old` when the newest it
    admits predates 4.46, `early` when that is 4.46.0 or 4.46.1, `regressed` when it admits
    only 4.47.0 or 4.48.0 (`REGRESSED`), None otherwise."""
    from packaging.version import Version

    admitted = _admitted(specifier)
    if admitted and all(str(v) in REGRESSED for v in admitted):
        return "regressed"
    if not admitted or max(admitted) >= Version(FIXED):
        return None
    return "early" if max(admitted) >= Version(EARLY) else "old"


def minimum(kind: str) -> str:
    """The first release that mends a pin of `kind` (`verdict`)."""
    return "4.48.1" if kind == "regressed" else FIXED


def required(kind: str) -> str:
    """The requirement that mends a pin of `kind` (`verdict`)."""
    return f"transformers>={minimum(kind)}"


def _admitted(specifier: SpecifierSet) -> list[Version]:
    """The releases a specifier admits among PROBES, the versions it names and their successors."""
    from packaging.version import Version

    declared = [v for v in (_version(s.version) for s in specifier) if v is not None]
    probes = [*map(Version, PROBES), *declared]
    probes += [Version(f"{v.major}.{v.minor}.{v.micro + 1}") for v in declared]
    return [v for v in probes if specifier.contains(v, prereleases=True)]


def _version(text: str) -> Version | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        return None


def bad_pin(pin: Pin) -> str | None:
    """The verdict on a pin that names transformers with a version specifier, or installs it
    from a git tag (judged as that release) or commit (`commit`: it cannot be dated here)."""
    from packaging.requirements import InvalidRequirement, Requirement  # only where pins are
    from packaging.specifiers import SpecifierSet

    try:
        requirement = Requirement(pin.requirement)
    except InvalidRequirement:
        return None
    if requirement.name.lower() != "transformers":
        return None
    if requirement.url:
        ref = _git_ref(requirement.url)
        if ref in (None, "commit"):
            return ref  # None: the default branch, which has the fix
        return verdict(SpecifierSet(f"=={ref}"))
    return verdict(requirement.specifier) if requirement.specifier else None


def _git_ref(url: str) -> str | None:
    """What a git URL of transformers installs: a release (`@v4.28.0`: "4.28.0"), "commit",
    or None (the default branch)."""
    ref = GIT_REF.search(url)
    return None if ref is None else ref.group("release") or "commit"


# Pins -------------------------------------------------------------------------------------


def pins(path: Path, text: str, package: str = "transformers") -> list[Pin]:
    """The requirements of `package` of one dependency file (and, in a requirements file or
    setup.cfg, its other requirements)."""
    lines = text.splitlines()
    name = path.name.lower()
    written = patterns(package)
    if name == "pyproject.toml":
        return [*_quoted(lines, written=written), *_poetry(lines, written)]
    if name == "setup.py":
        return list(_quoted(lines, written=written))
    if name == "setup.cfg":
        return list(_setup_cfg(lines))
    if name.startswith("environment"):
        return list(_environment(lines, written))
    if is_readme(path):
        return list(_readme(lines, written))
    return [
        pin for number, raw in enumerate(lines, 1) if (pin := _requirement_line(number, raw, 0))
    ]


def is_pin_file(path: Path) -> bool:
    name = path.name.lower()
    if name in ("pyproject.toml", "setup.py", "setup.cfg"):
        return True
    if name.startswith("environment") and path.suffix in (".yml", ".yaml"):
        return True
    if is_readme(path):
        return True
    text_file = path.suffix == ".txt"
    return text_file and (
        name.startswith(("requirement", "constraint")) or path.parent.name == "requirements"
    )


def is_readme(path: Path) -> bool:
    return path.name.lower().startswith("readme") and path.suffix in (".md", ".rst", ".txt")


def _readme(lines: list[str], written: SimpleNamespace = TRANSFORMERS) -> Iterator[Pin]:
    """The versions of a package (`patterns`) a README tells its users to install."""
    for number, raw in enumerate(lines, 1):
        for match in written.readme.finditer(raw):
            text = match.group(0)
            yield Pin(number, match.start() + 1, text, text.replace(" ", ""), raw)


def _requirement_line(number: int, raw: str, start: int) -> Pin | None:
    """A requirements-file line (from column `start`), without its comment and options."""
    body = re.sub(r"(^|\s)#.*", "", raw[start:])
    stripped = body.strip()
    if not stripped or stripped.startswith("-"):
        return None
    column = start + len(body) - len(body.lstrip()) + 1
    return Pin(number, column, stripped, stripped, raw)


def _quoted(
    lines: Iterable[str], first: int = 1, written: SimpleNamespace = TRANSFORMERS
) -> Iterator[Pin]:
    """Quoted PEP 508 strings naming a package (`patterns`): PEP 621 arrays, setup.py lists,
    PEP 723."""
    for number, raw in enumerate(lines, first):
        for match in written.quoted.finditer(raw):
            text = match.group(2).strip()
            yield Pin(number, match.start(2) + 1, text, text, raw)


def _poetry(lines: list[str], written: SimpleNamespace = TRANSFORMERS) -> Iterator[Pin]:
    """`transformers = "^4.40"` or `transformers = { version = "4.45.2", ... }` (of the
    package of `patterns`)."""
    for number, raw in enumerate(lines, 1):
        match = written.poetry.match(raw)
        if match is None:
            continue
        value = match.group(2)
        inner = re.search(r"""version\s*=\s*["']([^"']+)""", value)
        if value.startswith("{") and inner is None:
            continue
        constraint = inner.group(1) if inner else value.strip("\"'")
        converted = _poetry_constraint(constraint)
        if converted is not None:
            shown = raw.strip()
            requirement = f"{written.package}{converted}"
            yield Pin(number, len(match.group(1)) + 1, shown, requirement, raw)


def _poetry_constraint(constraint: str) -> str | None:
    """Poetry's `^4.40`, `~4.45`, `4.45.2` as a PEP 440 specifier."""
    parts = []
    for piece in (p.strip() for p in constraint.split(",")):
        operator = piece[:1] if piece[:1] in "^~" and piece[:2] != "~=" else ""
        version = _version(piece[len(operator) :])
        if operator and version is not None:
            major, minor = (*version.release, 0)[:2]
            whole = (operator == "^" and major) or len(version.release) == 1
            upper = f"{major + 1}" if whole else f"{major}.{minor + 1}"
            parts += [f">={version}", f"<{upper}"]
        elif version is not None:
            parts.append(f"=={version}")
        elif piece not in ("", "*"):
            parts.append(piece)
    return ",".join(parts) or None


def _setup_cfg(lines: list[str]) -> Iterator[Pin]:
    """Lines of `[options]` (`install_requires`) and `[options.extras_require]`."""
    section = ""
    for number, raw in enumerate(lines, 1):
        header = re.match(r"\s*\[([^\]]+)\]", raw)
        if header:
            section = header.group(1).strip()
            continue
        if not section.startswith("options"):
            continue
        key = re.match(r"\s*[\w.-]+\s*=(?!=)\s*", raw)
        pin = _requirement_line(number, raw, key.end() if key else 0)
        if pin is not None:
            yield pin


def _environment(lines: list[str], written: SimpleNamespace = TRANSFORMERS) -> Iterator[Pin]:
    """`- transformers=4.45` (conda) and `- transformers==4.45.2` (pip) list items (conda's
    of the package of `patterns`)."""
    for number, raw in enumerate(lines, 1):
        item = re.match(r"""(\s*-\s*["']?)([^"'#]+?)["']?\s*(?:#.*)?$""", raw)
        if item is None:
            continue
        text = item.group(2)
        conda = written.conda.match(text)
        requirement = text
        if conda:
            version = conda.group(1)
            wildcard = "" if version.endswith("*") else ".*"
            requirement = f"{written.package}=={version}{wildcard}"
        yield Pin(number, len(item.group(1)) + 1, text, requirement, raw)


# Accumulation -------------------------------------------------------------------------------


def accumulation_in(source: str | bytes) -> list[tuple[int, str, bool, bool]]:
    """(line, what, on a TrainingArguments-like call, known only at run time) for each
    `gradient_accumulation_steps > 1` in Python source, and each given on a TrainingArguments-
    like call by an expression (`cfg.accumulation`), in line order. Read with `ast`: these
    files are only scanned, not audited."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    constants = {
        target.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and type(node.value.value) is int
    }
    options = {  # `args.gradient_accumulation_steps` is read where its option is declared
        flag.lstrip("-").replace("-", "_")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for flag in (a.value for a in node.args if isinstance(a, ast.Constant))
        if flag in FLAGS
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
        given = {k.arg: k.value for k in node.keywords if k.arg}
        value = given.get("gradient_accumulation_steps")
        spread = next((k.value for k in node.keywords if k.arg is None), None)
        if value is None and spread is not None and name.endswith("TrainingArguments"):
            what = f"`{name}(**{ast.unparse(spread)})`, whose mapping may set it"
            found.append((node.lineno, what, True, True))
        elif name == "HfArgumentParser" and "TrainingArguments" in ast.unparse(node):
            what = (
                "`HfArgumentParser` reading `--gradient_accumulation_steps` from the command line"
            )
            found.append((node.lineno, what, True, True))
        elif value is not None and name.endswith(("Arguments", "Config")):
            what = f"`{name}(gradient_accumulation_steps={ast.unparse(value)})`"
            if _steps(value, constants) > 1:
                found.append((node.lineno, what, True, False))
            elif _set_at_run_time(value, constants, options):
                found.append((node.lineno, what, True, True))
        elif name == "add_argument" and any(
            isinstance(a, ast.Constant) and a.value in FLAGS for a in node.args
        ):
            steps = _steps(given.get("default"), constants)
            if steps > 1:
                found.append(
                    (
                        node.lineno,
                        f"`--gradient_accumulation_steps` defaulting to {steps}",
                        False,
                        False,
                    )
                )
    return sorted(found)


def _set_at_run_time(value: ast.expr, constants: dict[str, int], options: set[str]) -> bool:
    """An expression known only at run time (`cfg.accumulation`), but not a constant nor a
    command-line option the file declares (its default was judged where it is declared)."""
    if isinstance(value, ast.Constant) or _steps(value, constants):
        return False
    return not (isinstance(value, ast.Attribute) and value.attr in options)


def _steps(value: ast.expr | None, constants: dict[str, int]) -> int:
    """An integer literal, or a module-level name bound to one."""
    if isinstance(value, ast.Name):
        return constants.get(value.id, 0)
    return value.value if isinstance(value, ast.Constant) and type(value.value) is int else 0


def _accumulations(path: Path, data: bytes, root: Path) -> Iterator[Accumulation]:
    shown = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    if path.suffix == ".py":
        if re.search(rb"gradient[_-]accumulation[_-]steps|TrainingArguments", data):
            for line, what, trainer, run_time in accumulation_in(data):
                yield Accumulation(path, f"{what} in {shown} line {line}", trainer, run_time)
        return
    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        match = SETTING.search(raw)
        if match and int(match.group(1)) > 1 and not raw.lstrip().startswith(("#", ";", "//")):
            yield Accumulation(
                path,
                f"`gradient_accumulation_steps` {match.group(1)} in {shown} line {number}",
                False,
            )


# Findings -----------------------------------------------------------------------------------


def _finding(
    shown: str,
    pin: Pin,
    kind: str,
    accumulation: Accumulation | str,
    trainer: bool,
    sites: Iterable[str] = (),
    exact: str | None = None,
    documented: str = "",
) -> Finding:
    if kind == "old":
        problem = (
            "admits only transformers releases before 4.46, whose Trainer divides each "
            "micro-batch's mean loss by the accumulation steps"
        )
    elif kind == "commit":
        problem = (
            "installs transformers from a git commit, which may predate 4.46 and its Trainer's "
            "division of each micro-batch's mean loss by the accumulation steps"
        )
    elif kind == "regressed":
        problem = (
            "admits only transformers 4.47.0 or 4.48.0, whose Trainer hands a model that takes "
            "loss kwargs no `num_items_in_batch` and skips its division by the accumulation "
            "steps: the loss is K times too large"
        )
    else:
        problem = (
            "admits transformers 4.46.0/4.46.1 at best, whose Trainer over-scales the loss of "
            "models that ignore `num_items_in_batch`"
        )
    if exact is not None and kind == "regressed":
        confidence, why = (
            Confidence.MEDIUM,
            f"K times too large whatever the counts; {EXACT.format(exact)}",
        )
    elif exact is not None:
        confidence, why = Confidence.LOW, EXACT.format(exact)
    elif trainer:
        confidence, why = Confidence.HIGH, TRAINER_SEEN
    else:
        confidence, why = Confidence.MEDIUM, NO_TRAINER
    capped = {
        "commit": "gaaudit cannot date the commit offline",
        "early": (
            "the decoders of those releases that take the count (Llama, Qwen2, Gemma, Phi, "
            "Mixtral) get it right, and which models the code trains is not visible here"
        ),
    }.get(kind) or documented
    if capped and confidence > Confidence.MEDIUM:
        confidence, why = Confidence.MEDIUM, f"{why}; {capped}"
    accumulates = "the code accumulates gradients"
    if isinstance(accumulation, Accumulation):
        if accumulation.run_time:
            accumulates = "the code sets the accumulation steps at run time"
            if confidence > Confidence.MEDIUM:
                confidence, why = Confidence.MEDIUM, f"{why}; K may be 1"
        accumulation = accumulation.where
    return Finding(
        path=shown,
        code=CODE,
        message=f"`{pin.shown}` {problem}, and {accumulates}: require `{required(kind)}`",
        span=Span(pin.line, pin.column, pin.line, pin.column + len(pin.shown)),
        confidence=confidence,
        evidence=(
            f"pin: `{pin.shown}`",
            f"accumulation: {accumulation}",
            *(f"trainer: {site}" for site in sites),
            f"confidence {confidence}: {why}",
        ),
        hint=catalogue.load()[CODE].hint,
    )


def _trainer_sites(path: Path, data: bytes, trainers: frozenset[str]) -> Iterator[str]:
    """Where a file of the code builds a transformers or trl Trainer: `SFTTrainer(` in
    train.py line 150 (the first such call of the file)."""
    for number, name in _built(data, trainers):
        yield f"`{name}(...)` in {display_path(path)} line {number}"
        return


def _built(data: bytes, trainers: frozenset[str] | None = None) -> Iterator[tuple[int, str]]:
    """The transformers or trl Trainers a file that names either builds: line and class name;
    with `trainers` (`_trainer_classes`), the calls of those classes or of those modules'
    `...Trainer`, else any `...Trainer(` call."""
    if FRAMEWORK.search(data) is None:  # `Trainer` imported from Lightning, say
        return
    if trainers is not None:
        named = _named_calls(trainers)
        if named.search(data) is None:
            return
    elif b"Trainer" not in data:
        return
    for number, line in enumerate(data.splitlines(), 1):
        if line.lstrip().startswith((b"#", b"class ", b"def ")):
            continue
        call = TRAINER_CALL.search(line) if trainers is None else named.search(line)
        if call:
            yield number, call.group(1).decode("utf-8", "replace")


@cache
def _named_calls(trainers: frozenset[str]) -> re.Pattern[bytes]:
    """A call of one of `trainers`' classes (`TrainerNoShuffle(`), or of a `...Trainer` of
    one of their modules (`tf.Trainer(`)."""
    names = b"|".join(re.escape(n.encode()) for n in sorted(trainers)) or b"(?!)"
    return re.compile(
        NOT_LIGHTNING
        + rb"((?:\w+\.)*(?:"
        + names
        + rb")|(?:"
        + names
        + rb")\.(?:\w+\.)*\w*Trainer)\s*\("
    )


def _trainer_classes(sources: Iterable[bytes]) -> frozenset[str]:
    """What builds a transformers or trl Trainer in the code: the `...Trainer` classes imported
    from either (`from trl import SFTTrainer as SFT`), either module's names (`import
    transformers as tf`, for `tf.Trainer(`), and the classes of any file that subclass one of
    those (`class LLaVATrainer(Trainer)`, `class DPO(tf.Trainer)`); not a project's own
    `SuperviseTrainer` built on something else."""
    known: set[str] = set()
    bases: dict[str, set[str]] = {}
    for data in sources:
        for name, listed in CLASS.findall(data):
            names = bases.setdefault(name.decode(), set())
            for base in listed.decode("utf-8", "replace").split(","):
                if "=" not in base and (dotted := base.strip()):
                    names.update(_base_names(dotted))
        if b"Trainer" not in data or FRAMEWORK.search(data) is None:
            continue
        try:
            module = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(module):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
                known |= {a.asname or a.name for a in node.names if a.name.endswith("Trainer")}
            elif isinstance(node, ast.Import):
                known |= {a.asname or a.name for a in node.names if a.name in LIBRARIES}
    while grown := {name for name, of in bases.items() if name not in known and of & known}:
        known |= grown
    return frozenset(known)


def _base_names(base: str) -> set[str]:
    """The names a class base makes it a Trainer by: its class, and the module of a
    `tf.Trainer`."""
    parts = base.split(".")
    return {parts[-1], parts[0]} if parts[-1].endswith("Trainer") else {parts[-1]}


def _suppressed(raw: str) -> bool:
    match = SUPPRESSION.search(raw)
    return match is not None and (
        match.group("codes") is None or CODE in match.group("codes").upper()
    )


def _read(path: Path) -> bytes:
    """A regular file's bytes; pipes, devices, links and oversized files read as empty."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return b""
        return path.read_bytes()
    except OSError:
        return b""


def _walk(root: Path) -> Iterator[Path]:
    """Config and dependency files under `root`, skipping hidden and default-excluded folders.
    Names are judged as strings first: most files of a tree are neither (sources, headers)."""
    excluded = Excluded.of(list(DEFAULT_EXCLUDE))
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not excluded.match(d, d, "/")
        )
        for name in sorted(filenames):
            if not name.lower().endswith(WANTED):
                continue
            path = Path(directory, name)
            if (path.suffix in CONFIGS or is_pin_file(path)) and _regular(path):
                yield path


def _real(path: Path) -> Path:
    """The absolute path with links resolved where they resolve (a link loop stays as it is)."""
    return Path(os.path.realpath(path))


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def check_repository(files: list[Path], roots: list[Path]) -> list[FileReport]:
    """GA006 over the checked folders: one report per dependency file with a bad transformers pin.

    Dependency and config files are gathered from the folders in `roots`; the checked Python
    `files` give the accumulation settings. A pin file is judged against the accumulation
    settings found in its own folder and below. Nothing else is read unless a bad pin exists.
    """
    walked = sorted({_real(p) for root in roots if root.is_dir() for p in _walk(root)})
    bad, declared = _bad_pins(walked, files)
    if not bad:
        return []
    scanned = [p for p in walked if p.suffix in CONFIGS] + [
        _real(p) for p in files if p.suffix == ".py"
    ]
    data = {path: _read(path) for path in scanned}
    base = Path(os.path.commonpath([p.parent for p in bad] + [p.parent for p in scanned]))
    accumulations = [a for path in scanned for a in _accumulations(path, data[path], base)]
    classes = _trainer_classes(data[p] for p in scanned if p.suffix == ".py")
    reports = []
    for path, found in sorted(bad.items()):
        here = [a for a in accumulations if _governs(path, a.path, declared)]
        if not here:
            continue
        trainers = {
            p: site
            for p in scanned
            if p.suffix == ".py" and _governs(path, p, declared)
            for site in _trainer_sites(p, data[p], classes)
        }
        trainer = any(a.trainer for a in here) or bool(trainers)
        exact, at_risk = _exact(trainers, data, classes)
        # the accumulation named: set in the code before at run time, by a named Trainer first
        here.sort(key=lambda a: (a.run_time, a.path not in at_risk))
        shown = display_path(path)
        documented = (
            "the README names the version, not a dependency file" if is_readme(path) else ""
        )
        findings = []
        for pin, kind in found:  # a regressed release over-scales fixed-length blocks too
            sites = [*(trainers if kind == "regressed" else at_risk).values()]
            findings.append(_finding(shown, pin, kind, here[0], trainer, sites, exact, documented))
        reports.append(FileReport(shown, findings))
    return reports


def _bad_pins(
    walked: list[Path], files: list[Path]
) -> tuple[dict[Path, list[tuple[Pin, str]]], set[Path]]:
    """The dependency files among `walked` and `files` with a transformers pin without the
    fix, and their pins with the verdict of each (`bad_pin`); and the folders whose dependency
    files name transformers (`_owner`). A README's pin counts only where no dependency file of
    its folder or above names transformers."""
    bad, declared = {}, set()
    pin_files = {p for p in walked if is_pin_file(p)} | {_real(p) for p in files if is_pin_file(p)}
    for path in sorted(pin_files, key=is_readme):  # READMEs last: see `declared`
        text = _read(path).decode("utf-8", "replace")
        named = pins(path, text)
        if not is_readme(path):
            if any(TRANSFORMERS.named.match(pin.requirement) for pin in named):
                declared.add(_owner(path))
        elif any(_owner(path).is_relative_to(folder) for folder in declared):
            continue  # a dependency file rules; a README's version is advice
        found = [
            (pin, kind) for pin in named if (kind := bad_pin(pin)) and not _suppressed(pin.raw)
        ]
        if found:
            bad[path] = found
    return bad, declared


def _owner(pin_file: Path) -> Path:
    """The folder whose code a dependency file governs: its own, or the one above a
    `requirements/` folder (`requirements/train.txt`)."""
    folder = pin_file.parent
    return folder.parent if folder.name == "requirements" else folder


def _governs(pin_file: Path, path: Path, declared: set[Path]) -> bool:
    """Whether `pin_file` governs the file at `path`: `path` is under its folder (`_owner`),
    and no folder between them names transformers in dependency files of its own (a
    subproject's requirement rules its code)."""
    owner = _owner(pin_file)
    return path.is_relative_to(owner) and not any(
        folder != owner and folder.is_relative_to(owner) and path.is_relative_to(folder)
        for folder in declared
    )


def pinned_for(path: Path, root: Path, kinds=OLD) -> tuple[str, str] | None:
    """The transformers pin that keeps `path`'s Trainer as a release of `kinds` trains (see
    `verdict`; by default before 4.46: a pin admitting only older releases, or a git commit),
    among the requirements that govern it (`governing`): where it is written,
    `` `transformers==4.31.0` (requirements.txt line 3) ``, and its kind."""
    for where, pin in governing(path, root)[0]:
        if (kind := bad_pin(pin)) in kinds and not _suppressed(pin.raw):
            return _written(where, pin), kind
    return None


def governing_pin(path: Path, kinds=OLD) -> tuple[str, str]:
    """The transformers pin of `kinds` that governs `path` (`pinned_for`), searched up to its
    repository within the current directory (`search_root`), and its kind; ("", "") when
    there is none."""
    return pinned_for(path, search_root(path), kinds) or ("", "")


def governing(
    path: Path, root: Path, package: str = "transformers"
) -> tuple[list[tuple[Path, Pin]], list[Path]]:
    """The requirements of `package` that govern `path`, with where each is written: those of
    its inline script metadata, else those of the dependency files of the nearest folder, from
    its own up to `root`, that names it (GA006 reads them so: `_governs`), else the first pin
    of the nearest README; and the dependency files read."""
    here, read, readmes, names = _real(path), [], [], patterns(package).named
    text = _read(here).decode("utf-8", "replace")
    named = [(here, p) for p in script_pins(text, package) if names.match(p.requirement)]
    folders = [f for f in here.parents if f.is_relative_to(_real(root))]
    for folder in folders if not named else ():
        for pin_file in _pin_files(folder):
            read.append(pin_file)
            text = _read(pin_file).decode("utf-8", "replace")
            found = [
                (pin_file, p) for p in pins(pin_file, text, package) if names.match(p.requirement)
            ]
            (readmes if is_readme(pin_file) else named).extend(found)
        if named:
            break
    return named or readmes[:1], read


def admits(path: Path, release: str, package: str = "transformers") -> tuple[bool, str, list[Path]]:
    """Whether the requirements of `package` that govern `path` (`governing`, up to its
    repository: `search_root`) admit `release` or a later one; the first that does not, else
    the first, as written with where ("" where none names it: any release); and the
    dependency files read."""
    named, read = governing(path, search_root(path), package)
    for where, pin in named:
        if not _admits_from(pin, release):
            return False, _written(where, pin), read
    return True, _written(*named[0]) if named else "", read


def _written(where: Path, pin: Pin) -> str:
    """A pin as written, with where: `` `transformers==4.31.0` (requirements.txt line 3) ``."""
    return f"`{pin.shown}` ({display_path(where)} line {pin.line})"


def _admits_from(pin: Pin, release: str) -> bool:
    """Whether a requirement admits `release` or a later one: a git tag from that release on
    (a fork's `v0.8.5_fixes` read as 0.8.5), another git ref (the default branch, or a commit
    that cannot be dated here), or a specifier that admits such a release; a requirement that
    cannot be read admits any."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(pin.requirement)
    except InvalidRequirement:
        return True
    ref = _git_ref(requirement.url or "")
    if ref is None and (tag := RELEASE_REF.search(requirement.url or "")):
        ref = tag.group(1)
    if ref not in (None, "commit"):
        return _version(ref) >= _version(release)
    if requirement.url or not requirement.specifier:
        return True
    earliest, specifier = _version(release), requirement.specifier
    return specifier.contains(earliest, prereleases=True) or any(
        v >= earliest for v in _admitted(specifier)
    )


def _pin_files(folder: Path) -> list[Path]:
    """The dependency files of `folder` and of its `requirements/` folder."""
    listed = (*_listed(folder), *_listed(folder / "requirements"))
    return [p for p in listed if _regular(p)]


def _listed(folder: Path) -> list[Path]:
    """The dependency files of `folder` by name (picked before sorting: a folder of a
    thousand scripts has few)."""
    try:
        return sorted(p for p in folder.iterdir() if is_pin_file(p))
    except OSError:
        return []


def _exact(
    trainers: dict[Path, str], data: dict[Path, bytes], classes: frozenset[str]
) -> tuple[str | None, dict]:
    """The Trainers the pin puts at risk, and where there are none, the sign in every file that
    builds one that each micro-batch holds the same number of loss elements (`exact_data`): the
    old Trainer's mean/K is then exact. A Trainer over such data is not named beside others."""
    signs, varying = [], {}
    for path, site in trainers.items():
        sign = exact_data(path, data[path], classes)
        if sign is None:
            varying[path] = site
        else:
            where, line, what = sign
            signs.append(f"{what} in {display_path(where)} line {line}")
    if varying or not signs:
        return None, varying
    return "; ".join(signs), trainers


def exact_data(
    path: Path, data: bytes, classes: frozenset[str] | None = None
) -> tuple[Path, int, str] | None:
    """Where the file at `path`, which builds a Trainer, shows that every micro-batch holds the
    same number of loss elements: fixed-length blocks and no padded or masked targets, a
    Trainer of the file's own that scores preference pairs, or what the Trainer is given
    (`_given`); the file, line and what. `classes`: the Trainer classes of the code
    (`_trainer_classes`), else any `...Trainer(` call is taken for one."""
    text = data.decode("utf-8", "replace")
    evidence = scan(text)
    sign = evidence.blocks or _pairs(text, data, classes)
    if sign is not None:
        return path, *sign
    return _given(path, data, evidence.padded is not None, classes)


def _pairs(text: str, data: bytes, classes: frozenset[str] | None) -> tuple[int, str] | None:
    """Where every Trainer the file builds is a class of the file whose `compute_loss` scores
    preference pairs (a reward model's `logsigmoid(chosen - rejected)`): one loss element per pair."""
    if "compute_loss" not in text:
        return None
    try:
        module = ast.parse(data)
    except (SyntaxError, ValueError):
        return None
    pairwise = {
        cls.name: (method.lineno, f"`{cls.name}.compute_loss` scores preference pairs")
        for cls in module.body
        if isinstance(cls, ast.ClassDef)
        for method in cls.body
        if isinstance(method, ast.FunctionDef)
        and method.name == "compute_loss"
        and PAIRWISE.search(ast.get_source_segment(text, method) or "")
    }
    built = {name.rsplit(".", 1)[-1] for _, name in _built(data, classes)}
    if not pairwise or not built or not built <= pairwise.keys():
        return None
    return min(pairwise[name] for name in built)


def _given(
    path: Path, data: bytes, padded: bool, classes: frozenset[str] | None
) -> tuple[Path, int, str] | None:
    """A sign in what every Trainer the file builds is given, a class of the file or of a
    module beside it: a model whose `forward` scores preference pairs (one loss element per
    pair), or, where the file shows no padding of its own, a dataset that pads each row to
    `max_length` and returns its ids as its labels (every position counted, none ignored)."""
    try:
        module = ast.parse(data)
    except (SyntaxError, ValueError):
        return None
    names = {name.rsplit(".", 1)[-1] for _, name in _built(data, classes)}
    calls = [
        node
        for node in ast.walk(module)
        if isinstance(node, ast.Call) and _called(node.func) in names
    ]
    signs = []
    for call in calls:
        given = {k.arg: k.value for k in call.keywords}
        handed = given.get("model") or next(iter(call.args), None)
        model = _project_class(path, data, module, handed)
        dataset = _project_class(path, data, module, given.get("train_dataset"))
        sign = (model and _scores_pairs(*model)) or (
            dataset and not padded and _own_labels(*dataset)
        )
        if not sign:
            return None
        signs.append(sign)
    return signs[0] if signs else None


def _called(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _project_class(
    path: Path, data: bytes, module: ast.Module, value: ast.expr | None
) -> tuple[Path, ast.ClassDef, str] | None:
    """The class `value` is an instance of (`Cls(...)`, or a name bound to one in the file),
    defined in the file (`data`, parsed as `module`) or in a module beside it that the file
    imports the class from (`from reward_model import GPTRewardModel`): its file, node and
    source."""
    if isinstance(value, ast.Name):
        bound = [
            node.value
            for node in ast.walk(module)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)
        ]
        value = bound[0] if len(bound) == 1 else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
        return None
    name = value.func.id
    beside = (
        path.parent.joinpath(*node.module.split(".")).with_suffix(".py")
        for node in module.body
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.level <= 1
        and any((a.asname or a.name) == name for a in node.names)
    )
    for where in (path, *beside):
        source = data if where == path else _read(where)
        try:
            tree = module if where == path else ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for cls in tree.body:
            if isinstance(cls, ast.ClassDef) and cls.name == name:
                return where, cls, source.decode("utf-8", "replace")
    return None


def _scores_pairs(where: Path, cls: ast.ClassDef, text: str) -> tuple[Path, int, str] | None:
    """Where a model class's `forward` scores preference pairs: one loss element per pair."""
    forward = next((m for m in cls.body if getattr(m, "name", "") == "forward"), None)
    if forward is not None and PAIRWISE.search(ast.get_source_segment(text, forward) or ""):
        return where, forward.lineno, f"`{cls.name}.forward` scores preference pairs"
    return None


def _own_labels(where: Path, cls: ast.ClassDef, text: str) -> tuple[Path, int, str] | None:
    """Where a dataset class, padding each row to `max_length` and ignoring no target,
    returns its ids as its labels (`{"input_ids": ids, "labels": ids}`): every row counts
    every position."""
    source = ast.get_source_segment(text, cls) or ""
    if re.search(r"-\s*100\b|ignore", source, re.IGNORECASE) or not any(
        isinstance(node, ast.keyword)
        and node.arg == "padding"
        and isinstance(node.value, ast.Constant)
        and node.value.value == "max_length"
        for node in ast.walk(cls)
    ):
        return None
    for node in ast.walk(cls):
        if isinstance(node, ast.Dict):
            fields = {
                k.value: ast.dump(v)
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant)
            }
            if "labels" in fields and fields["labels"] == fields.get("input_ids"):
                what = f"`{cls.name}` pads each row to `max_length` and trains on every position"
                return where, node.lineno, what
    return None


def findings(context) -> list[Finding]:
    """GA006 for a script whose PEP 723 metadata pins transformers while it accumulates."""
    tree = context.tree
    imports = tree.imports.values()
    if not _has_script(tree.module) or not any(
        q.split(".")[0] in ("transformers", "trl") for q in imports
    ):
        return []
    text = tree.module.code
    settings = [s for s in accumulation_in(text) if not s[3]]
    if not settings:
        return []
    line, what, trainer, _ = settings[0]
    trainer = trainer or any(
        q.startswith(("transformers.", "trl.")) and q.endswith("Trainer") for q in imports
    )
    return [
        _finding(context.path, pin, kind, f"{what} (line {line})", trainer)
        for pin in script_pins(text)
        if (kind := bad_pin(pin))
    ]


def script_pins(text: str, package: str = "transformers") -> list[Pin]:
    """The requirements of `package` in a script's PEP 723 inline metadata (`# /// script`)."""
    start = SCRIPT.search(text)
    if start is None:
        return []
    first = text.count("\n", 0, start.start()) + 1
    block = []
    for line in text.splitlines()[first:]:
        if line.rstrip() == "# ///":
            break
        block.append(line)
    return list(_quoted(block, first + 1, patterns(package)))


def _has_script(module) -> bool:
    """A `# /// script` comment among the module's top-level comment lines (cheap, no codegen)."""
    lines = [
        *module.header,
        *(line for s in module.body for line in s.leading_lines),
        *module.footer,
    ]
    return any(
        line.comment is not None and line.comment.value.rstrip() == "# /// script" for line in lines
    )
