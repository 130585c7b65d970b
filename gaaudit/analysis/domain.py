"""What a mean loss averages over, and whether that count can vary between micro-batches.

The one model of the loss's domain that check, fix and verify share (GA-GUIDE section 3):
token losses (a count that varies where targets can be ignored or masked, fixed over full
packed blocks), one element per example (classification, pairwise preference losses), dense
fixed-size tensors (MSE over images, latents, frames), or unknown. A finding's confidence
follows from it: high or medium only where the count can vary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import libcst as cst

from gaaudit.analysis.evidence import Evidence
from gaaudit.analysis.provenance import MASKED_MEAN, MEANS_OF_ALL, Origin, Tracer
from gaaudit.analysis.tree import (
    Tree,
    code,
    dotted,
    keyword,
    last_name,
    positional,
    string_value,
    target_names,
    walk,
)
from gaaudit.findings import Confidence

Kind = Literal["tokens", "examples", "dense", "unknown"]

# Decoder-only vision and audio models that transformers (or their remote code) names
# `...ForConditionalGeneration`: their loss shifts the labels as a causal LM's does.
CAUSAL_CONDITIONAL = (
    r"(?:\w*Llava\w*|Qwen\d*(?:_\d)?_?(?:VL|Omni|Audio)\w*|Idefics\d|SmolVLM|PaliGemma\d?"
    r"|Gemma3n?|Mllama|Llama4|Mistral3|Chameleon|Emu3|Janus|Aria|GotOcr2|InternVL|Kosmos2"
    r"|ChatGLM\d?|Glm4v\w*|Otter|Flamingo|MplugOwl\d?|AyaVision|Cohere2Vision|DeepseekVL\w*)"
    r"ForConditionalGeneration"
)
# Vision models whose language model may be a decoder or an encoder-decoder (BLIP-2 with OPT
# or with T5): their class names no task.
EITHER_CONDITIONAL = r"(?:Blip2|InstructBlip\w*)ForConditionalGeneration"
# Model classes by the task their `.loss` serves, strongest first (transformers' naming; peft's
# `task_type="CAUSAL_LM"` for a model of any name).
TASKS = (
    (
        "causal",
        re.compile(
            r"ForCausalLM|LMHeadModel|DoubleHeadsModel|CausalLM\b|SFTTrainer|\bCAUSAL_LM\b"
            rf"|\b{CAUSAL_CONDITIONAL}|\bCausalLMOutput"  # a causal LM's output class
        ),
    ),
    (
        "seq2seq",
        re.compile(
            rf"Seq2SeqLM|\b(?!{CAUSAL_CONDITIONAL}|{EITHER_CONDITIONAL})\w+ForConditionalGeneration"
            r"|\bT5Model|\bM?Bart"
            r"|Pegasus|MarianMT|MTModel|EncoderDecoderModel|ForSpeechSeq2Seq|\bSEQ_2_SEQ_LM\b"
        ),
    ),
    ("mlm", re.compile(r"MaskedLM|ForTokenClassification")),
    (
        "classification",
        re.compile(
            r"For(?:Sequence|Image|Audio|Video)Classification|ForMultipleChoice"
            r"|ForQuestionAnswering|ForImageClassificationWithTeacher"
        ),
    ),
)
TOKEN_TASKS = {"causal", "seq2seq", "mlm"}
DENSE_LOSSES = {
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
    "KLDivLoss", "BCELoss", "BCEWithLogitsLoss",
}  # fmt: skip
TOKEN_LOSSES = {"cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss"}
# Models of images, latents or audio whose losses average over fixed-size tensors (a
# tokenizer that returns a loss learns the codes of images, video or audio).
DENSE_MODEL = re.compile(
    r"(?i)vae|autoencoder|unet|diffusion|discr|gan$|soundstream|codec|tokenizer$"
)
# Keywords of a model call that hand it the micro-batch's lengths or masks (`lens=`,
# `target_mask=`): its loss then covers a varying number of positions.
LENGTHS = re.compile(r"(?i)(?:^|_)(?:lens?|lengths?|mask)$|^num_\w*tokens$")
# ... but not the mask of a conditioning embedding (`speaker_emb_mask=`), which scores nothing
EMBEDDING_MASK = re.compile(r"(?i)(?:^|_)emb(?:ed)?(?:ding)?s?_mask$")
# Megatron's loss mask: ones, but for end-of-document tokens under `--eod-mask-loss`.
EOD_MASK = "get_ltor_masks_and_position_ids"
ONES = {"ones", "ones_like"}  # `attention_mask=torch.ones_like(ids)`: a mask that hides nothing
# A pairwise preference loss: a log-sigmoid of margins, or a loss of the chosen and the
# rejected answers' log-probabilities (DPO and kin): one element per pair.
PAIRWISE = re.compile(r"\blogsigmoid\b|\blog_sigmoid\b|\b(?:chosen|preferred)\w*\W.*\brejected")
# Per-row means averaged over the rows (GRPO's sequence-level loss,
# `((loss * mask).sum(dim=1) / mask.sum(dim=1)).mean()`): one element per sequence.
PER_ROW = re.compile(
    r"\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?-?\d+\s*\)\s*/.*\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?-?\d+\s*\)"
)
SQUARED = re.compile(r"\*\*\s*2\b|\.pow\(\s*2\s*\)|\.abs\(\)|\btorch\.abs\(|\.square\(\)")
# How another module's loss is described when it is a plain `.mean()` there: its code first.
RETURNED_MEAN = re.compile(r"`([^`]*)\.mean\(\)`")
FLATTENED = re.compile(r"\.(?:view|reshape)\(\s*-1\s*\)|\.flatten\(\)|\.view\(\s*-1\s*,")
# Targets a contrastive loss makes itself, one per row of its scores (`torch.arange(n)`, the
# positive's column for each query): none can be an ignore value.
MADE_TARGETS = re.compile(r"^(?:torch|np|jnp)\.(?:arange|zeros|ones|full|zeros_like|ones_like)\(")


def tasks(text: str) -> set[str]:
    """The tasks of the model classes named in `text`: `causal`, `seq2seq`, `mlm`,
    `classification`."""
    return {name for name, pattern in TASKS if pattern.search(text)}


def shifts_labels(text: str) -> bool | None:
    """Whether the model named in `text` shifts its labels (a causal LM): None when the
    text names none, or models of both kinds."""
    found = tasks(text)
    if not found:
        return None
    return None if "causal" in found and len(found) > 1 else "causal" in found


# What a count counts outside language models, as messages say it: plural, and as a modifier
WORDS = {
    "dense": ("elements", "element"),
    "examples": ("examples", "example"),
    "unknown": ("valid targets", "valid-target"),
}


@dataclass(frozen=True)
class Domain:
    """What the loss averages over; `varies` is None where the code cannot tell."""

    kind: Kind
    varies: bool | None
    sign: str  # what shows it, quoted in the finding's evidence

    @property
    def elements(self) -> str:
        """What the loss's count counts, as messages and hints say it."""
        return WORDS.get(self.kind, ("valid tokens",))[0]

    def worded(self, text: str) -> str:
        """A rule's message or hint, in this domain's words (tokens are the rules' default;
        a loss gaaudit could not trace counts "valid targets")."""
        if self.kind not in WORDS:
            return text
        plural, single = WORDS[self.kind]
        return (
            text.replace("valid tokens", plural)
            .replace("valid-token", single)
            .replace("per token", f"per {single.rpartition('-')[2]}")
        )

    def confidence(self) -> tuple[Confidence, str]:
        if self.varies:
            return Confidence.HIGH, f"the count the loss averages over can vary: {self.sign}"
        if self.varies is False:
            return Confidence.LOW, (
                f"{self.sign}, so every micro-batch holds the same number of loss elements and "
                "mean/K is exact; it becomes wrong as soon as they differ"
            )
        if self.kind == "unknown":
            return (
                Confidence.LOW,
                f"gaaudit could not tell what the loss averages over: {self.sign}",
            )
        return Confidence.MEDIUM, f"{self.sign}; whether its count varies is not visible"


class Domains:
    """Reads the domain of the losses of one file."""

    def __init__(self, tree: Tree, tracer: Tracer, evidence: Evidence, text: str) -> None:
        self.tree = tree
        self.text = text
        self.tracer = tracer
        self.evidence = evidence

    def _eod_mask(self, count: cst.BaseExpression) -> bool:
        """Whether a count (`loss_mask.sum()`) sums a mask that every assignment of the file
        takes from Megatron's `get_ltor_masks_and_position_ids`, reshapes, or passes on from a
        function of the file (`get_batch`)."""
        root = count
        while isinstance(root, (cst.Call, cst.Attribute, cst.Subscript)):
            root = root.func if isinstance(root, cst.Call) else root.value
        if not isinstance(root, cst.Name):
            return False
        values = [
            node.value
            for node in self.tree.assignments
            if isinstance(node, cst.Assign)
            and any(root.value in target_names(t.target) for t in node.targets)
        ]
        calls = [v for v in values if isinstance(v, cst.Call)]
        made = [v for v in calls if last_name(v.func) == EOD_MASK]
        passed = [v for v in calls if code(v.func) in self.tree.functions]
        return bool(made) and all(
            v in made or v in passed or code(v).startswith((f"{root.value}.", f"{root.value}["))
            for v in values
        )

    def of(self, origin: Origin, returned: bool = False) -> Domain:
        """The domain of a traced loss; `returned`: a model's loss handed back to a framework
        (`compute_loss`), see `model_loss`."""
        if origin.kind == "unknown":
            return Domain("unknown", None, "its origin is not visible")
        if origin.variable:
            return Domain("tokens", True, f"{origin.variable}, where the loss is computed")
        if origin.reduces and (found := _reduced(origin.reduces, origin.reduces)):
            return found
        if origin.rows:
            return _per_row(f"`{origin.callee}()`")
        source = origin.source
        owner = origin.callee.split(".")[0]
        if origin.module and DENSE_MODEL.search(owner):
            return Domain("dense", False, f"`{owner}` models fixed-size images or signals")
        spelled = RETURNED_MEAN.match(origin.what) if origin.module else None
        if spelled and (found := _reduced(spelled[1], spelled[0][1:-1])):  # another module's
            return found
        if origin.configured is not None:
            call = source if isinstance(source, cst.Call) else origin.configured
            return self._torch_loss(origin.configured, call)
        if origin.beside:
            return Domain(
                "unknown",
                None,
                f"`{code(source.func)}(...)` also returns `{origin.beside}`, a count, so its "
                "loss may be the sum over it (fairseq's convention), which mean/K does not weight "
                "wrongly",
            )
        if isinstance(source, cst.Call) and origin.from_model:
            return self.model_loss(source, returned=True)
        if isinstance(source, (cst.Attribute, cst.Subscript)):
            return self.model_loss(self._model_call(source), returned)
        if isinstance(source, cst.Call) and isinstance(source.func, cst.Attribute):
            reduced = source.func.value  # `x.mean()`, or `torch.mean(x)`'s `x`
            if self.tree.qualified(source.func) in MEANS_OF_ALL:
                reduced = next(iter(positional(source)), reduced)
            # the names it reduces spelled too, for a pairwise loss built in steps (`probs =
            # torch.sigmoid(preferred - rejected)`, then `(-torch.log(probs)).mean()`)
            named = [self.spelled(n, 0) for n in walk(reduced) if isinstance(n, cst.Name)]
            found = _reduced(self.spelled(reduced), code(source), " ".join(named))
            if found is None and self.tracer.per_row(reduced) is not None:
                found = _per_row(f"`{_short(code(source))}`")
            if found is None and self.tracer.summed_along(reduced):
                found = Domain(
                    "examples",
                    False,
                    f"`{_short(code(source))}` averages per-row sums, one per row",
                )
            if found is not None:
                return found
        if MASKED_MEAN in origin.what:
            if origin.count is not None and self._eod_mask(origin.count):
                return Domain(
                    "tokens",
                    False,
                    "its mask is Megatron's `get_ltor_masks_and_position_ids` loss mask, all ones "
                    "over full blocks unless `--eod-mask-loss` hides end-of-document tokens",
                )
            if origin.ignored:  # an `ignore_index=` by hand: the data path decides
                return self._tokens(f"a mean over the targets other than `{origin.ignored}`")
            return Domain("tokens", True, "a mask or count taken per micro-batch")
        if tasks(self.text) == {"classification"}:
            return Domain(
                "examples", False, "a mean in a classifier's file, one element per example"
            )
        what = "a mean whose elements gaaudit cannot name"
        here = _reduces_here(origin)  # it counts every element of its tensor
        if here and self.evidence.one_length is not None:
            line, sign = self.evidence.one_length
            return Domain(
                "dense",
                False,
                f"a mean over every element of its tensor; rows are padded to one length ({sign}, "
                f"line {line})",
            )
        found = self._tokens(what)
        if found.varies is None and here and not tasks(self.text):
            return Domain("dense", None, what)  # no sign of tokens: it counts its elements
        return found

    def spelled(self, expr: cst.BaseExpression, hops: int = 3) -> str:
        """The code of what `.mean()` reduces: a name's assigned value (`loss = -logsigmoid(z)`),
        with what the name was before where the value reworks it (`y = y.view(-1)`, then
        `y = y.to(device)`)."""
        if isinstance(expr, cst.Name) and expr in self.tree.order:
            stmt = self.tracer.binding(expr.value, expr)
            while isinstance(stmt, cst.AugAssign):  # `losses += aux`: what was there before
                stmt = self.tracer.binding(expr.value, stmt)
            if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                if isinstance(stmt.targets[0].target, cst.Tuple):
                    unpacked = self._unpacked(stmt.targets[0].target, expr, stmt.value, hops)
                    return unpacked or code(expr)
                earlier = [
                    n for n in walk(stmt.value) if isinstance(n, cst.Name) and n.value == expr.value
                ]
                before = self.spelled(earlier[0], hops - 1) if earlier and hops else ""
                return f"{code(stmt.value)} {before}".strip()
        return code(expr)

    def _unpacked(
        self, target: cst.Tuple, name: cst.Name, value: cst.BaseExpression, hops: int
    ) -> str:
        """What a name unpacked from a same-file helper's returned tuple is there, on every
        path (`losses, chosen, rejected = self.dpo_loss(...)`, whose `losses` each loss type
        assigns in an arm of its own)."""
        names = [e.value.value if isinstance(e.value, cst.Name) else None for e in target.elements]
        helper = self.tracer.helper(value.func) if isinstance(value, cst.Call) and hops else None
        if helper is None or name.value not in names:
            return ""
        index = names.index(name.value)
        for returned in self.tracer.returns(helper):
            if isinstance(returned, cst.Tuple) and len(returned.elements) == len(names):
                element = returned.elements[index].value
                assigned = self.tree.bindings(helper).get(code(element), ())
                values = [a.value for a in assigned if isinstance(a, cst.Assign)]
                return " ".join(code(v) for v in values) or self.spelled(element, hops - 1)
        return ""

    def _torch_loss(self, configured: cst.Call, call: cst.Call) -> Domain:
        """A torch loss built by `configured` (`nn.CrossEntropyLoss()`, or the call itself)
        and called as `call`."""
        func = self.tracer.default(configured.func) or configured.func
        name = (self.tree.qualified(func) or dotted(func) or "").rsplit(".", 1)[-1]
        if name in DENSE_LOSSES:
            return Domain(
                "dense", False, f"`{name}` averages over every element of fixed-size tensors"
            )
        ignore = keyword(configured, "ignore_index")
        if ignore is not None:
            return self._tokens(f"`{name}(ignore_index={code(ignore)})` skips ignored targets")
        if tasks(self.text) == {"classification"}:
            return Domain(
                "examples", False, f"`{name}` in a classifier's file, one element per example"
            )
        targets = positional(call)[1:2] or [keyword(call, "target")]
        if (
            name in TOKEN_LOSSES
            and targets[0] is not None
            and FLATTENED.search(self.spelled(targets[0]))
        ):
            return self._tokens(f"`{name}` over flattened token targets")
        if targets[0] is not None and MADE_TARGETS.match(self.spelled(targets[0])):
            return Domain("examples", False, f"`{name}` over targets it makes, one per row")
        if self.evidence.padded is not None or self.evidence.masked is not None:
            return self._tokens(f"`{name}`")
        return Domain("unknown", None, f"`{name}` over targets gaaudit cannot see to be tokens")

    def _model_call(self, node: cst.CSTNode) -> cst.Call | None:
        """The model call whose output `node` reads (`out.loss`, `out[0]`)."""
        value = node.value if isinstance(node, (cst.Attribute, cst.Subscript)) else None
        return self.tracer.origin_call(value) if value is not None else None

    def model_loss(self, call: cst.Call | None = None, returned: bool = False) -> Domain:
        """The domain of the loss a model computes for its labels; `call` is the model call,
        when known (else the file's model classes tell). A loss `returned` by a model of no
        known task (`loss = net(x, y)`, not transformers' `out.loss`) is a token loss only
        where the file shows tokens or hands the model the micro-batch's lengths or masks."""
        model = call.func if call is not None else None
        if model is not None:
            annotated = self.tracer.annotated_class(model)  # `model: VideoTokenizer`
            owner = model.value if isinstance(model, cst.Attribute) else None
            # the model, its annotated class, or what its method is called on
            # (`diffusion.training_losses(model, latents, t)`)
            for named in (n for n in (model, annotated, owner) if n is not None):
                if DENSE_MODEL.search(last_name(named) or ""):
                    return Domain(
                        "dense", False, f"`{code(named)}` models fixed-size images or signals"
                    )
        found = self._task(model, 4) if model is not None else None
        if found is None and tasks(self.text) == {"classification"}:
            found = "classification"
        if found == "classification":
            return Domain(
                "examples", False, "a classification model's loss, one element per example"
            )
        what = "a model's mean loss over its labels"
        handed = self._handed_lengths(call) if call is not None else None
        if handed is not None:
            return Domain(
                "tokens", True, f"{what}; the model is handed the micro-batch's `{handed}=`"
            )
        evidence = self.evidence
        shown = found in TOKEN_TASKS or tasks(self.text) & TOKEN_TASKS
        # a data module's padding may be of audio or images: the file itself must show tokens
        if returned and not shown and (evidence.module or not evidence.shows_shape):
            return Domain("unknown", None, f"{what}, and the file shows no tokens")
        return self._tokens(what)

    def _handed_lengths(self, call: cst.Call) -> str | None:
        """The keyword by which a model call is handed the micro-batch's lengths or masks, its
        own or a key of the dict literal it is handed as `**inputs`; not a mask of ones
        (`attention_mask=torch.ones_like(ids)` hides no position)."""
        keywords = [
            a.keyword.value
            for a in call.args
            if a.keyword and not (isinstance(a.value, cst.Call) and last_name(a.value.func) in ONES)
        ]
        for arg in call.args:
            if arg.star == "**" and isinstance(arg.value, cst.Name):
                bound = self.tracer.binding(arg.value.value, call)
                if isinstance(bound, cst.Assign) and isinstance(bound.value, cst.Dict):
                    keywords += [
                        key
                        for e in bound.value.elements
                        if isinstance(e, cst.DictElement)
                        and (key := string_value(e.key)) is not None
                    ]
        return next(
            (k for k in keywords if LENGTHS.search(k) and not EMBEDDING_MASK.search(k)), None
        )

    def _task(self, expr: cst.BaseExpression, hops: int) -> str | None:
        """The task of the model class that `expr` was built from, following assignments,
        `accelerator.prepare(...)` unpacking, wrappers and `from_pretrained`."""
        if hops < 0:
            return None
        if isinstance(expr, cst.Call):
            if isinstance(expr.func, cst.Attribute) and expr.func.attr.value.startswith("from_"):
                return _task_of(code(expr.func.value))
            return _task_of(code(expr.func)) or next(
                (t for a in expr.args if (t := self._task(a.value, hops - 1))), None
            )
        if not isinstance(expr, (cst.Name, cst.Attribute)):
            return None
        name = dotted(expr)
        if name is None:
            return None
        if task := _task_of(name):  # a model class handed on (`dict(type=AutoModelForCausalLM...)`)
            return task
        if "." in name:
            values = self.tree.assigned_values.get(name, [])
            return next((t for v in values if (t := self._task(v, hops - 1))), None)
        stmt = self.tracer.binding(name, expr)
        if not isinstance(stmt, cst.Assign):
            return None
        value = stmt.value
        target = stmt.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, cst.Call):
            names = [dotted(e.value) for e in target.elements]
            args = positional(value)
            if name in names and names.index(name) < len(args):
                return self._task(args[names.index(name)], hops - 1)
            return None
        return self._task(value, hops - 1)

    def _tokens(self, what: str) -> Domain:
        """A token loss: its count varies where the data path pads, masks or ignores targets,
        is fixed over packed blocks, and is otherwise not visible."""
        evidence = self.evidence
        if evidence.padded is not None:
            line, sign = evidence.padded
            return Domain("tokens", True, f"{what}; {sign} (line {line})")
        if evidence.fixed is not None:
            line, sign = evidence.fixed
            return Domain(
                "tokens", False, f"{what}; the data are fixed-length ({sign}, line {line})"
            )
        if evidence.masked is not None:
            line, sign = evidence.masked
            return Domain("tokens", True, f"{what}; the inputs are padded ({sign}, line {line})")
        return Domain("tokens", None, what)


def _reduces_here(origin: Origin) -> bool:
    """Whether the loss is an unmasked `x.mean()` or `torch.mean(x)` written in this file."""
    source = origin.source
    if origin.module or not isinstance(source, cst.Call):
        return False
    func = source.func
    return (func.attr.value if isinstance(func, cst.Attribute) else dotted(func)) in (
        "mean",
        "nanmean",
    )


def _task_of(name: str) -> str | None:
    """The task of the first model class `name` matches."""
    return next((task for task, pattern in TASKS if pattern.search(name)), None)


def _reduced(reduced: str, mean: str, named: str = "") -> Domain | None:
    """The domain of the mean `mean` by what it reduces, spelled out: a pairwise preference
    loss (one element per pair; also by the values of the `named` it reduces), a squared
    error or norm (a dense tensor)."""
    if PAIRWISE.search(reduced) or PAIRWISE.search(named):
        return Domain("examples", False, "a pairwise preference loss, one element per pair")
    if PER_ROW.search(reduced):
        return _per_row(f"`{_short(mean)}`")
    if SQUARED.search(reduced):
        return Domain("dense", False, f"`{_short(mean)}` averages a dense tensor")
    return None


def _per_row(mean: str) -> Domain:
    """A mean of per-row means (`mean`: the code that takes it, quoted), one per sequence."""
    return Domain("examples", False, f"{mean} averages per-row means, one per sequence")


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
