"""Tiny, deterministic models built from configs (no downloads), dropout off; or the user's
own model while factory.user_model() is active."""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from gaaudit.harness import factory
from gaaudit.harness.nets import (
    NET_KINDS,
    PAD_ID,
    as_unpacked,
    build_net,
    lenient,
    net_count,
    net_loss,
)

VOCAB = 256
# keywords that ask a model for its loss, which the plain logits model does not compute
LOSS_REQUESTS = ("return_loss", "labels", "targets")
MAX_POSITIONS = 128
KINDS = (
    "causal",
    "seq2seq",
    "mlm",
    "classify",
    "nanogpt",
    "logits",
    "pooled",
    "teacher",
    *NET_KINDS,
)
LABELS = 3  # the classes of the `classify` and `pooled` kinds: one label per sequence

# The default value each kind's loss ignores in `labels`; HF models always use -100, the
# plain-torch kinds take another value (`ignore_index`) where the loop under test uses one.
IGNORE_INDEX = {
    "causal": -100,
    "seq2seq": -100,
    "mlm": -100,
    "classify": -100,
    "nanogpt": -1,
    "logits": -100,
    "pooled": -100,
    "teacher": -100,
    **dict.fromkeys(NET_KINDS, -100),
    "sequence": 0,  # the padding, which the model's own loss ignores
}


def ignore_value(kind: str, ignore_index: int | None = None) -> int:
    """The label value `kind` ignores: `ignore_index` where the kind allows another one."""
    if ignore_index is None or kind in (
        "causal",
        "seq2seq",
        "mlm",
        "classify",
        "regression",
        "sequence",
    ):
        return IGNORE_INDEX[kind]
    return ignore_index


class TinyGPT(nn.Module):
    """A nanoGPT-style causal LM: `forward(idx, targets=None) -> (logits, loss)`; the loss
    ignores `ignore_index` (-1 as in nanoGPT) and is also kept as `last_loss` (llama2.c's
    `loss = raw_model.last_loss`); other keywords (`return_logits=False`) are taken and
    ignored."""

    last_loss: torch.Tensor | None = None  # until its first forward

    def __init__(self, width: int = 64, ignore_index: int = -1):
        super().__init__()
        self.ignore_index = ignore_index
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(MAX_POSITIONS, width)
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx, targets=None, **options):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        heads = lambda t: t.unflatten(-1, (2, -1)).transpose(1, 2)
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).flatten(2))
        x = x + self.mlp(self.ln_2(x))
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits[:, [-1], :], None
        loss = self.last_loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=self.ignore_index
        )
        return logits, loss


class TinyTokenModel(nn.Module):
    """A plain module returning logits `(B, T, VOCAB)`; the loop computes the loss itself.
    `returns`: how the loop unpacks them (`logits, _ = model(x)`), the logits first. Its
    `config` holds what lit-gpt-style loops read (`model.config.block_size`); other keywords
    (`prefixes=...`, a project's own options) are taken and ignored, but those that ask for
    a loss (LOSS_REQUESTS), which it does not compute."""

    def __init__(self, width: int = 64, returns: tuple | None = None):
        super().__init__()
        self.returns = returns
        self.config = SimpleNamespace(
            vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=MAX_POSITIONS
        )
        self.embed = nn.Embedding(VOCAB, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, VOCAB))

    def forward(self, input_ids, attention_mask=None, **options):
        asked = next((k for k in LOSS_REQUESTS if k in options), None)
        if asked is not None:  # a loss it does not compute: refused as a keyword it lacks
            raise TypeError(
                f"{type(self).__name__}.forward() got an unexpected keyword argument {asked!r}"
            )
        return as_unpacked(self.mlp(self.embed(input_ids)), self.returns)


class TinyTeacherForced(TinyTokenModel):
    """A model handed its targets too, as Lightning's demo `Transformer` is
    (`model(inputs, target)`), returning per-token log-probabilities flattened to
    `(B * T, VOCAB)`, which the loop scores (`F.nll_loss(out, target.view(-1))`); this stand-in
    predicts from the inputs alone."""

    def forward(self, inputs, target=None):
        return F.log_softmax(super().forward(inputs), dim=-1).flatten(0, 1)


def _hf_model(kind: str) -> nn.Module:
    import transformers as tf

    ids = {"vocab_size": VOCAB, "pad_token_id": PAD_ID, "bos_token_id": 0, "eos_token_id": 0}
    if kind in ("causal", "classify"):
        config = tf.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            n_positions=MAX_POSITIONS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            num_labels=LABELS,
            **ids,
        )
        if kind == "classify":  # reads the last token that is not padding (PAD_ID)
            return tf.GPT2ForSequenceClassification(config)
        model = tf.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # the class name does not say so; silences a warning
        return model
    if kind == "seq2seq":
        return tf.T5ForConditionalGeneration(
            tf.T5Config(
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=2,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                **ids,
            )
        )
    config = tf.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=MAX_POSITIONS,
        num_labels=LABELS,
        **ids,
    )
    return tf.BertForTokenClassification(config) if kind == "tag" else tf.BertForMaskedLM(config)


def head(kind: str, seed: int = 0) -> nn.Module:
    """A tiny transformers head standing for one a Trainer is handed (`checks.trainer
    .head_kind`): "seq2seq" (T5), "mlm" (BERT), "tag" (BERT tagging each token with one of
    LABELS classes) or "classify" (GPT-2 with one of LABELS per sequence), with weights fixed
    by `seed`."""
    torch.manual_seed(seed)
    return _hf_model(kind)


def vocab_size() -> int:
    """Token ids the harness draws lie in 2 .. vocab_size() - 1: below the user's model's
    vocabulary (see factory) where it shows one, else below VOCAB."""
    user = factory.current()
    return VOCAB if user is None or user.vocab_size is None else user.vocab_size


def build_model(
    kind: str = "causal", seed: int = 0, ignore_index: int | None = None, returns=None
) -> nn.Module:
    """A fresh tiny model of `kind` (see KINDS) with weights fixed by `seed`, in eval mode:
    GPT-2 (causal; a sequence classifier for classify), T5 (seq2seq), BERT (mlm), TinyGPT
    (nanogpt), TinyTokenModel (logits), TinyTeacherForced (teacher), a
    model of nets.py (`returns`: how a loop unpacks a model's result); the user's
    model instead while factory.user_model() is active."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")
    torch.manual_seed(seed)
    if factory.current() is not None:
        return factory.current().build()
    if kind == "nanogpt":
        model = TinyGPT(ignore_index=ignore_value(kind, ignore_index))
    elif kind in ("logits", "pooled"):  # pooled: its logits read at the last position
        model = TinyTokenModel(returns=returns)
    elif kind == "teacher":
        model = TinyTeacherForced()
    elif kind in NET_KINDS:
        model = build_net(kind, VOCAB, returns)
    else:
        model = _hf_model(kind)
        model.register_forward_pre_hook(batch_as_keywords, with_kwargs=True)
        model.register_forward_hook(
            functools.partial(_as_tuple, len(returns)) if returns else _lenient_output
        )
    return model.eval()


def batch_as_keywords(module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook: the whole batch dict handed to a project's model as one argument
    (`model(samples)`, LAVIS's BLIP-2; `model(data=inputs, use_cache=False)`, MiniCPM-V's
    Trainer) becomes the keywords the transformers model's `forward` names (the loop's own
    entries, `samples["epoch"]`, left out)."""
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        batch, rest = args[0], {}
    elif not args and "input_ids" not in kwargs:
        key = next((k for k, v in kwargs.items() if isinstance(v, dict) and "input_ids" in v), None)
        if key is None:
            return None
        batch, rest = kwargs[key], {k: v for k, v in kwargs.items() if k != key}
    else:
        return None
    named = inspect.signature(module.forward).parameters
    return (), {key: value for key, value in {**batch, **rest}.items() if key in named}


def _lenient_output(module: nn.Module, inputs, output):
    """A transformers output whose missing `..._loss` attributes (`res.aux_loss` of a
    mixture-of-experts model) read as zero: a term the tiny model does not have."""
    if isinstance(output, dict):  # a ModelOutput, not the tuple of `return_dict=False`
        output.__class__ = lenient(type(output))
    return output


def _as_tuple(size: int, module: nn.Module, inputs, output):
    """The tuple of a transformers output, for a loop that unpacks it into `size` names
    (`loss, logits = model(...)`, `lm_loss, *_ = model(...)`), as releases before
    `return_dict` returned it, without what the loop does not name (the cache)."""
    return output.to_tuple()[:size] if isinstance(output, dict) else output


def mean_token_loss(
    kind: str,
    model: nn.Module,
    batch: dict,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The loss the harness takes as truth: the mean over every valid token of `batch`."""
    if kind in NET_KINDS:
        return net_loss(kind, model, batch, ignore_value(kind, ignore_index), label_smoothing)
    if kind == "nanogpt":
        return model(batch["input_ids"], batch["labels"])[1]
    if kind == "pooled":  # the class read at the last position
        return F.cross_entropy(model(batch["input_ids"])[:, -1].float(), batch["labels"])
    if kind == "teacher":
        scores = model(batch["input_ids"], batch["labels"]).float()
        return F.nll_loss(
            scores, batch["labels"].flatten(), ignore_index=ignore_value(kind, ignore_index)
        )
    if kind == "logits":
        logits = model(batch["input_ids"])
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch["labels"].flatten(),
            ignore_index=ignore_value(kind, ignore_index),
        )
    return model(**batch).loss


def count_tokens(kind: str, batch: dict, ignore_index: int | None = None) -> torch.Tensor:
    """The number of valid (counted) tokens of `batch`; HF causal LMs shift labels inside."""
    if kind in NET_KINDS:
        return net_count(kind, batch, ignore_value(kind, ignore_index))
    labels = batch["labels"][..., 1:] if kind == "causal" else batch["labels"]
    return (labels != ignore_value(kind, ignore_index)).sum()
