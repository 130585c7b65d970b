"""Static half of statement replay: find the statement to run, its free names, and the role
each free name (or attribute chain such as `args.gradient_accumulation_steps`) plays."""

from __future__ import annotations

import ast
import builtins
import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

Chain = tuple[str, ...]
LOOPS = (ast.For, ast.While)
DEFS = (ast.FunctionDef,)
ITER_WRAPPERS = {"enumerate", "tqdm", "iter", "islice", "zip"}
HF_KWARGS = {"input_ids", "labels", "attention_mask", "decoder_input_ids", "inputs_embeds"}
MODEL_METHODS = {"parameters", "named_parameters", "train", "eval", "generate"}
MODEL_RE = re.compile(r"model|net$|gpt|llm|transformer", re.IGNORECASE)
OPTIMIZER_RE = re.compile(r"optim", re.IGNORECASE)
SCHEDULER_RE = re.compile(r"sched", re.IGNORECASE)
DATA_RE = re.compile(r"batch|loader|data|(^|_)iter(ator)?($|_)", re.IGNORECASE)
DIVISOR_RE = re.compile(r"accum", re.IGNORECASE)
NOT_DIVISOR_RE = re.compile(r"loss|token|count|item|sum|total", re.IGNORECASE)
# `ignore_index=-1` in the source: the value its loss ignores (used for nanogpt / logits kinds).
IGNORE_RE = re.compile(r"ignore_index\s*=\s*(-?\d+)")
# Model classes, strongest evidence first; then weaker hints (collators, argument names).
KIND_HINTS = (
    ("causal", re.compile(r"ForCausalLM|LMHeadModel|CausalLM\b")),
    ("seq2seq", re.compile(r"Seq2SeqLM|ForConditionalGeneration|\bT5Model|\bM?Bart|Pegasus"
                           r"|MarianMT|EncoderDecoderModel")),
    ("mlm", re.compile(r"MaskedLM")),
    ("seq2seq", re.compile(r"decoder_input_ids|\bT5")),
    ("mlm", re.compile(r"mlm_probability|mlm=True")),
)


class NotReplayable(Exception):
    """The statement cannot be replayed; the message says why."""


@dataclass
class Plan:
    """What replay needs to run one statement. `free` holds the names the statement and its
    helpers read before assigning; `roles` maps names and attribute chains to what the harness
    binds there (model, optimizer, data, divisor, accelerator, fabric, scaler, device)."""

    target: ast.stmt
    imports: list[ast.stmt]
    helpers: list[ast.stmt]
    free: list[str]
    params: list[str] | None
    optional: set[str]
    roles: dict[Chain, str]
    prefetch: dict[Chain, list[str]] = field(default_factory=dict)
    initial: dict[str, object] = field(default_factory=dict)
    model_kind: str = "causal"
    ignore_index: int | None = None
    data_arity: int = 0
    uses_accumulate: bool = False


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


def _initial_values(tree: ast.Module, target: ast.stmt, free: list[str]) -> dict[str, object]:
    """Literal values the source assigns to the statement's free names before it, at module
    level or in the functions enclosing it (`num_items = 0`); 0 for other names the statement
    only augments (`total += n`)."""
    enclosing = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and n.lineno < target.lineno <= n.end_lineno]
    nodes = list(_module_level(tree.body)) + [s for f in enclosing for s in ast.walk(f)]
    found = {}
    for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
        if not isinstance(node, ast.Assign) or node.lineno >= target.lineno:
            continue
        for name in [t.id for t in node.targets if isinstance(t, ast.Name) and t.id in free]:
            with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError,
                                     RecursionError):
                found[name] = ast.literal_eval(node.value)
    augmented = {n.target.id for n in ast.walk(target)
                 if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
    return {**dict.fromkeys(augmented & set(free), 0), **found}


def _imports(tree: ast.Module, target: ast.stmt) -> list[ast.stmt]:
    inside = {id(n) for n in ast.walk(target)}
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             and id(n) not in inside and not getattr(n, "level", 0)
             and getattr(n, "module", "") != "__future__"]
    return sorted(found, key=lambda n: n.lineno)


@dataclass
class _Usage:
    """Evidence gathered from how the code uses each dotted name."""

    evidence: dict = field(default_factory=lambda: defaultdict(set))
    calls: dict = field(default_factory=lambda: defaultdict(list))
    chains: set = field(default_factory=set)
    arity: dict = field(default_factory=dict)
    assigned: dict = field(default_factory=lambda: defaultdict(list))
    result_attrs: set = field(default_factory=set)
    aliases: list = field(default_factory=list)

    def add(self, nodes: list[ast.stmt]) -> None:
        parents = {child: parent for node in nodes for parent in ast.walk(node)
                   for child in ast.iter_child_nodes(parent)}
        for root in nodes:
            for node in ast.walk(root):
                chain = chain_of(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
                if chain:
                    self.chains.add(chain)
                if isinstance(node, ast.Call):
                    self._call(node, parents)
                elif isinstance(node, (ast.For, ast.comprehension)):
                    self._iterated(node.iter, node.target)
                elif _reads_output(node):
                    self.result_attrs.add(chain_of(node.value))
                elif isinstance(node, ast.Assign) and chain_of(node.value) \
                        and isinstance(node.targets[0], ast.Name):
                    self.aliases.append((node.targets[0].id, chain_of(node.value)))
        for alias, chain in self.aliases:  # `active = train_loader; for batch in active:`
            self.evidence[chain] |= self.evidence.get((alias,), set()) & {"iterated", "next"}
            if (alias,) in self.arity:
                self.arity.setdefault(chain, self.arity[(alias,)])

    def _call(self, call: ast.Call, parents: dict) -> None:
        func = chain_of(call.func)
        if func is None:
            return
        args, parent = [chain_of(a) for a in call.args], parents.get(call)
        self.evidence[func].add("called")
        self.calls[func].append((call, parent))
        if func in (("next",), ("iter",)) and args and args[0]:
            self.evidence[args[0]].add("next")
            self._unpacked(args[0], parent)
        self._unpacked(func, parent)
        if len(func) < 2:
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
        elif method == "accumulate":
            self.evidence[receiver].add("accumulate")
            for arg in args:
                if arg:
                    self.evidence[arg].add("model-method")
        elif method in ("scale", "unscale_"):
            self.evidence[receiver].add("scaler")
            if method == "unscale_" and args and args[0]:
                self.evidence[args[0]].add("optimizer-arg")

    def _unpacked(self, source: Chain, parent) -> None:
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], (ast.Tuple, ast.List)):
            names = [chain_of(e) for e in parent.targets[0].elts]
            self.arity.setdefault(source, len(names))
            self.assigned[source] = [n for n in names if n]

    def _iterated(self, iterable: ast.expr, target: ast.expr) -> None:
        """`for ... in enumerate(tqdm(loader))` and the like: `loader` is iterated."""
        sources = [iterable]
        while sources and isinstance(sources[0], ast.Call) and sources[0].args \
                and (chain_of(sources[0].func) or ("",))[-1] in ITER_WRAPPERS:
            call = sources.pop(0)
            wrapper = chain_of(call.func)[-1]
            if wrapper == "enumerate" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]
            sources[:0] = call.args if wrapper == "zip" else call.args[:1]
        for source in sources:
            chain = chain_of(source)
            if chain:
                self.evidence[chain].add("iterated")
                if isinstance(target, (ast.Tuple, ast.List)):
                    self.arity.setdefault(chain, len(target.elts))


def _reads_output(node) -> bool:
    """`x.loss`, `x.logits`, `x["loss"]` or `x[0]`: reading a model output."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("loss", "logits")
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
        and node.slice.value in ("loss", "logits", 0)


def _call_shape(usage: _Usage, chain: Chain) -> str | None:
    """'hf', 'nanogpt' or 'logits' from how `chain` is called; None if it is not."""
    shapes = set()
    for call, parent in usage.calls.get(chain, []):
        keywords = {k.arg for k in call.keywords}
        if None in keywords or keywords & HF_KWARGS:
            shapes.add("hf")
        elif len(call.args) == 2 or "targets" in keywords:
            shapes.add("nanogpt")
        elif _reads_output(parent) or (isinstance(parent, ast.Assign) and len(parent.targets) == 1
                                       and chain_of(parent.targets[0]) in usage.result_attrs):
            shapes.add("hf")
        else:
            shapes.add("logits")
    for shape in ("hf", "nanogpt", "logits"):
        if shape in shapes:
            return shape
    return None


def _harness_made(chain: Chain, role: str | None, usage: _Usage) -> bool:
    """Whether a module-level function is replaced rather than run: a model, or a data source
    that is iterated or called like `get_batch('train')` (`split_batch(batch, n)` runs)."""
    return role == "model" or role == "data" and (
        bool(usage.evidence[chain] & {"iterated", "next"}) or _string_call(usage, chain))


def _string_call(usage: _Usage, chain: Chain) -> bool:
    return any(isinstance(a, ast.Constant) and isinstance(a.value, str)
               for call, _ in usage.calls.get(chain, []) for a in call.args)


def _no_grad(node: ast.stmt) -> bool:
    """A helper under `@torch.no_grad()` or `@torch.inference_mode()` cannot change a gradient;
    it stays a stub (it usually evaluates on data the harness does not serve)."""
    return any((chain_of(d.func if isinstance(d, ast.Call) else d) or ("",))[-1]
               in ("no_grad", "inference_mode") for d in getattr(node, "decorator_list", []))


def _is_divisor(chain: Chain, divisor_names) -> bool:
    dotted = ".".join(chain)
    for name in divisor_names:
        if dotted == name or ("." not in name and chain[-1] == name):
            return True
    return bool(DIVISOR_RE.search(chain[-1])) and not NOT_DIVISOR_RE.search(chain[-1])


def _role(chain: Chain, usage: _Usage, divisor_names, helpers: set) -> str | None:
    ev, last = usage.evidence.get(chain, set()), chain[-1]
    called = "called" in ev
    if not called and _is_divisor(chain, divisor_names):
        return "divisor"
    if "accumulate" in ev or (not called and "accelerator" in last.lower()):
        return "accelerator"
    if not called and "fabric" in last.lower():
        return "fabric"
    if "scaler" in ev or (not called and "scaler" in last.lower()):
        return "scaler"
    if chain[0] in helpers and len(chain) == 1:
        return None
    shape = _call_shape(usage, chain)
    model_like = "model-method" in ev or (shape and (MODEL_RE.search(last) or shape == "hf"))
    if model_like and not (shape == "logits" and DATA_RE.search(last)):
        return "model"
    if SCHEDULER_RE.search(last):
        return None
    if ev & {"zero_grad", "step", "optimizer-arg"} or (not called and OPTIMIZER_RE.search(last)):
        return "optimizer"
    if ev & {"iterated", "next"} or (called and DATA_RE.search(last)):
        return "data"
    if called and _string_call(usage, chain):
        return "data"
    if last == "device" or last.endswith("_device"):
        return "device"
    return None


def analyse(source: str, line: int, divisor_names=(), model_kind: str | None = None) -> Plan:
    """Plan the replay of the loop or function at `line` of `source`."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise NotReplayable(f"cannot parse the source: {exc.msg} (line {exc.lineno})") from None
    target = find_target(tree, line)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defs.pop(getattr(target, "name", None), None)
    is_def = isinstance(target, ast.FunctionDef)
    scan = FreeNames()
    for stmt in (target.body if is_def else [target]):
        scan.visit(stmt)
    free = list(scan.free)
    params, optional = None, set()
    if is_def:
        args = target.args
        positional = args.posonlyargs + args.args
        params = [a.arg for a in positional + args.kwonlyargs]
        optional = {a.arg for a in positional[len(positional) - len(args.defaults):]}
        optional |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    usage, helpers, pending = _Usage(), [], [target]
    while pending:
        usage.add(pending)
        wanted = [n for n in free if n in defs and defs[n] not in helpers]
        pending = [defs[n] for n in wanted if not _no_grad(defs[n]) and not _harness_made(
            (n,), _role((n,), usage, divisor_names, set()), usage)]
        helpers += pending
        for helper in pending:
            inner = FreeNames()
            inner.visit(helper)
            free += [n for n in inner.free if n not in free]
    helper_names = {h.name for h in helpers}
    free = [n for n in free if n not in helper_names]
    roots = set(free) | set(params or ())
    roles = {}
    for chain in sorted(usage.chains | set(usage.evidence), key=len):
        if chain[0] not in roots or any(chain[:i] in roles for i in range(1, len(chain))):
            continue
        if len(chain) == 1 and chain[0] in vars(builtins) and chain[0] not in (params or ()):
            continue
        role = _role(chain, usage, divisor_names, helper_names)
        if role:
            roles[chain] = role
    data = [c for c, r in roles.items() if r == "data"]
    models = [c for c, r in roles.items() if r == "model"]
    shapes = {_call_shape(usage, c) for c in models}
    kind = model_kind or _kind(source, shapes)
    ignore = IGNORE_RE.search(source)
    ignore_index = int(ignore.group(1)) if ignore else (
        -100 if kind == "nanogpt" and re.search(r"-100\b", source) else None)
    prefetch = {c: usage.assigned[c] for c in data if usage.assigned.get(c)
                and all(len(n) == 1 and n[0] in free for n in usage.assigned[c])}
    arities = {usage.arity[c] for c in data if c in usage.arity}
    arity = max(arities) if arities else (2 if kind == "nanogpt" else 0)
    if arity not in (0, 2):
        raise NotReplayable(f"the loop unpacks {arity} values from each batch; the harness "
                            "serves dict batches or (input_ids, labels) pairs")
    return Plan(target=target, imports=_imports(tree, target), helpers=helpers, free=free,
                params=params, optional=optional, roles=roles, prefetch=prefetch,
                initial=_initial_values(tree, target, free), model_kind=kind,
                ignore_index=ignore_index, data_arity=arity,
                uses_accumulate=any("accumulate" in usage.evidence.get(c, ())
                                    for c, r in roles.items() if r == "accelerator"))


def _kind(source: str, shapes: set) -> str:
    """The tiny model to bind: from how the model is called, then from the source's hints."""
    if "hf" in shapes or not shapes - {None}:
        return next((kind for kind, hint in KIND_HINTS if hint.search(source)), "causal")
    return "nanogpt" if "nanogpt" in shapes else "logits"
