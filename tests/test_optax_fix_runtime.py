"""GA005 fixes proven with real jax and optax on CPU (issue 5; `pip install 'gaaudit[jax]'`).

The code of a fixture pair and of the catalogue's example, as written and as `gaaudit fix`
rewrote it, runs one accumulation window of masked, variable-length micro-batches on a tiny
model; the gradient it applies is compared with the gradient of the masked token mean over
the whole window at once. The optimizer that receives the accumulated gradient is plain SGD
with rate 1, so the applied gradient is the parameters' change.
"""

from __future__ import annotations

import ast
import os
import types

import numpy as np
import pytest
from conftest import FIXTURES

from gaaudit import catalogue

# Each jitted function here is compiled once and run on tiny arrays: with XLA's cheapest
# backend optimisation the module compiles in about a third less time, to the same results.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
jax = pytest.importorskip("jax", reason="jax is an optional extra: pip install 'gaaudit[jax]'")
optax = pytest.importorskip(
    "optax", reason="optax is an optional extra: pip install 'gaaudit[jax]'"
)
jnp = jax.numpy

VOCAB, WIDTH, ROWS, LENGTH = 11, 8, 2, 12


# Fixed token embeddings, made with NumPy: JAX starts its threads on its first computation, and
# the suite's process pools fork before these tests run (conftest.py orders them last).
EMBED = np.random.default_rng(0).normal(size=(VOCAB, WIDTH)).astype(np.float32)


def initial_params() -> dict:
    """A linear head over fixed token embeddings; small, so that the change of the parameters
    keeps the gradient's precision."""
    w, b = jax.random.split(jax.random.PRNGKey(1))
    return {
        "w": 0.01 * jax.random.normal(w, (WIDTH, VOCAB)),
        "b": 0.01 * jax.random.normal(b, (VOCAB,)),
    }


def logits_of(params: dict, input_ids) -> jax.Array:
    return jnp.asarray(EMBED)[input_ids] @ params["w"] + params["b"]


def micro_batches(count: int, seed: int = 2) -> list[dict]:
    """Token rows with a prompt and padding masked out; lengths differ between micro-batches."""
    key = jax.random.PRNGKey(seed)
    batches = []
    for _ in range(count):
        key, ids, lengths, prompts = jax.random.split(key, 4)
        input_ids = jax.random.randint(ids, (ROWS, LENGTH), 0, VOCAB)
        length = jax.random.randint(lengths, (ROWS, 1), 2, LENGTH + 1)
        prompt = jax.random.randint(prompts, (ROWS, 1), 0, 2)
        position = jnp.arange(LENGTH)[None, :]
        mask = ((position < length) & (position >= prompt)).astype(jnp.float32)
        batches.append(
            {"input_ids": input_ids, "labels": jnp.roll(input_ids, -1, axis=1), "loss_mask": mask}
        )
    return batches


def window_gradient(batches: list[dict], key: str = "loss_mask") -> dict:
    """The gradient of the masked token mean over every micro-batch at once."""
    whole = {name: jnp.concatenate([b[name] for b in batches]) for name in batches[0]}

    def loss(params):
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits_of(params, whole["input_ids"]), whole["labels"]
        )
        return jnp.sum(losses * whole[key]) / jnp.sum(whole[key])

    return jax.grad(loss)(initial_params())


def applied(before: dict, after: dict) -> dict:
    return jax.tree.map(lambda a, b: a - b, before, after)


def relative_error(got: dict, want: dict) -> float:
    difference = jnp.concatenate(
        [jnp.ravel(g - w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    )
    return float(
        jnp.linalg.norm(difference)
        / jnp.linalg.norm(jnp.concatenate([jnp.ravel(w) for w in jax.tree.leaves(want)]))
    )


def definitions(source: str, filename: str) -> dict:
    """A module's definitions and assignments run in a namespace (the imports this environment
    lacks are left out; `if __name__ == "__main__"` is not run)."""
    namespace: dict = {"__name__": "fixture"}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If):
            continue
        try:
            exec(compile(ast.Module([node], []), filename, "exec"), namespace)  # noqa: S102
        except ImportError:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                raise
    return namespace


@pytest.mark.parametrize("version", ["bad", "fixed"])
def test_multisteps_catalogue_example(version):
    """`optax.MultiSteps` over a masked mean: the rule's example as written and as fixed."""
    rule = catalogue.load()["GA005"]
    namespace = definitions(getattr(rule, version), f"GA005.{version}")
    sgd = types.SimpleNamespace(
        **{**vars(optax), "adamw": lambda learning_rate, **_: optax.sgd(1.0)}
    )
    namespace["optax"] = sgd  # the inner optimizer applies the accumulated gradient as it is
    batches = micro_batches(4)
    params = namespace["train"](initial_params(), logits_of, batches, accum_steps=4)
    error = relative_error(applied(initial_params(), params), window_gradient(batches))
    assert (error < 1e-5) if version == "fixed" else (error > 1e-3), error


class TinySeq2Seq:
    """A decoder-only stand-in with the Flax T5 call signature the fixture uses."""

    def _shift_right(self, labels):
        return jnp.concatenate([jnp.zeros_like(labels[:, :1]), labels[:, :-1]], axis=1)

    def __call__(self, input_ids, attention_mask, decoder_input_ids, params, train):
        context = (jnp.asarray(EMBED)[input_ids] * attention_mask[..., None]).mean(
            axis=1, keepdims=True
        )
        return types.SimpleNamespace(
            logits=logits_of(params, decoder_input_ids) + context @ params["w"]
        )


@pytest.mark.parametrize("suffix", [".py", ".fixed.py"])
def test_python_loop_average(suffix):
    """`tree_map(lambda g: g / accum_steps, grads)` after a Python loop over micro-batches."""
    path = FIXTURES / f"ga005_tree_map_python_loop{suffix}"
    namespace = definitions(path.read_text(), str(path))
    batches = []
    for batch in micro_batches(namespace["accum_steps"]):
        batches.append(
            {
                "input_ids": batch["input_ids"],
                "attention_mask": jnp.ones_like(batch["input_ids"]),
                "labels": batch["labels"],
                "decoder_attention_mask": batch["loss_mask"],
            }
        )
    model = TinySeq2Seq()
    grads, _ = namespace["accumulate_gradients"](initial_params(), model, batches)
    whole = {name: jnp.concatenate([b[name] for b in batches]) for name in batches[0]}
    original = definitions((FIXTURES / "ga005_tree_map_python_loop.py").read_text(), "original")
    reference = jax.grad(original["loss_fn"])(initial_params(), model, whole)
    error = relative_error(grads, reference)
    assert (error < 1e-5) if suffix == ".fixed.py" else (error > 1e-3), error


@pytest.mark.parametrize("suffix", [".py", ".fixed.py"])
def test_lax_scan_average(suffix):
    """A `lax.scan` over stacked micro-batches with a `where=` masked mean."""
    path = FIXTURES / f"ga005_lax_scan_accumulate{suffix}"
    namespace = definitions(path.read_text(), str(path))
    batches = micro_batches(namespace["num_micro_batches"])
    stacked = {
        "input_ids": jnp.stack([b["input_ids"] for b in batches]),
        "labels": jnp.stack([b["labels"] for b in batches]),
        "selected": jnp.stack([b["loss_mask"] for b in batches]),
    }

    def apply_fn(input_ids, params, train):
        return types.SimpleNamespace(logits=logits_of(params, input_ids))

    optimizer = optax.sgd(1.0)
    params, _, _ = namespace["train_step"](
        initial_params(), optimizer.init(initial_params()), stacked, apply_fn, optimizer
    )
    error = relative_error(applied(initial_params(), params), window_gradient(batches))
    assert (error < 1e-5) if suffix == ".fixed.py" else (error > 1e-3), error


LOGGED = """\
import jax
import jax.numpy as jnp
import optax


def loss_fn(params, apply_fn, batch):
    logits = apply_fn(params, batch["input_ids"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    mask = batch["loss_mask"]
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def micro_step(params, opt_state, batch, apply_fn, optimizer):
    loss, grads = jax.value_and_grad(loss_fn)(params, apply_fn, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train(params, apply_fn, batches, logged, accum_steps=4):
    optimizer = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=accum_steps)
    opt_state = optimizer.init(params)
    for batch in batches:
        params, opt_state, loss = micro_step(params, opt_state, batch, apply_fn, optimizer)
        logged.append(float(loss))
    return params
"""


# The loss function returns its mean first beside auxiliary data, under `has_aux=True`.
LOGGED_AUX = LOGGED.replace(
    "    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)\n",
    "    loss = jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)\n"
    "    return loss, {'tokens': jnp.sum(mask)}\n",
).replace(
    "    loss, grads = jax.value_and_grad(loss_fn)(params, apply_fn, batch)\n",
    "    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, apply_fn, batch)\n",
)


@pytest.mark.parametrize("source", [LOGGED, LOGGED_AUX], ids=["loss", "loss-and-aux"])
def test_multisteps_fix_keeps_the_logged_loss_a_micro_batch_mean(source):
    """Issue 17, item 1, for JAX: the step's loss value, logged every micro-step, is the
    micro-batch's masked mean before and after the fix; only the applied gradient changes
    (also where the loss function returns auxiliary data beside it, `has_aux=True`)."""
    from pathlib import Path

    from gaaudit.config import Settings
    from gaaudit.findings import Confidence
    from gaaudit.fixes.fixer import fix_source

    assert source == LOGGED or ("has_aux=True" in source and "return loss, {" in source)
    fixed = fix_source(source.encode(), Path("train.py"), Settings(min_confidence=Confidence.LOW))
    assert fixed.changed and "use_grad_mean=False" in fixed.after.decode()
    batches = micro_batches(4)
    means = [
        float(
            jnp.sum(
                optax.softmax_cross_entropy_with_integer_labels(
                    logits_of(initial_params(), b["input_ids"]), b["labels"]
                )
                * b["loss_mask"]
            )
            / jnp.sum(b["loss_mask"])
        )
        for b in batches
    ]
    for code, exact in ((source, False), (fixed.after.decode(), True)):
        logged: list[float] = []
        params = definitions(code, "train.py")["train"](
            initial_params(), logits_of, batches, logged
        )
        assert np.allclose(logged, means, rtol=1e-5), (logged, means)
        error = relative_error(applied(initial_params(), params), window_gradient(batches))
        assert (error < 1e-5) if exact else (error > 1e-3), error


def whole_batch(count: int, **names: str) -> tuple[dict, list[dict]]:
    """`count` micro-batches of `micro_batches`, concatenated into one batch whose keys are
    renamed as the fixture reads them (`names`: fixture key -> micro-batch key)."""
    batches = micro_batches(count)
    return {k: jnp.concatenate([b[v] for b in batches]) for k, v in names.items()}, batches


@pytest.mark.parametrize("suffix", [".py", ".fixed.py"])
def test_microbatch_sum_of_plain_means(suffix):
    """`microbatch` adding up the gradients of its slices' plain means: fixed, it averages
    them (accumulator MEAN), the whole batch's gradient."""
    path = FIXTURES / f"ga005_optax_microbatch_sum{suffix}"
    namespace = definitions(path.read_text(), str(path))
    batch, _ = whole_batch(16, inputs="input_ids", labels="labels")  # 32 rows, 4 slices
    optimizer = optax.sgd(1.0)
    params, _ = namespace["update"](
        initial_params(), optimizer.init(initial_params()), batch, logits_of, optimizer
    )
    reference = jax.grad(namespace["loss_fn"])(initial_params(), logits_of, batch)
    error = relative_error(applied(initial_params(), params), reference)
    assert (error < 1e-5) if suffix == ".fixed.py" else (error > 1e-3), error


@pytest.mark.parametrize("suffix", [".py", ".fixed.py"])
def test_microbatch_sum_of_masked_means(suffix):
    """`microbatch` adding up the gradients of its slices' masked token means: fixed, each
    slice's masked sum is divided by the whole batch's count, so the summed gradient and the
    returned loss are the whole batch's token mean's."""
    path = FIXTURES / f"ga005_optax_microbatch_sum_masked_tokens{suffix}"
    namespace = definitions(path.read_text(), str(path))
    batch, batches = whole_batch(32, words="input_ids", tags="labels", real="loss_mask")
    optimizer = optax.sgd(1.0)
    params, _, loss = namespace["train_step"](
        initial_params(), optimizer.init(initial_params()), batch, logits_of, optimizer
    )
    error = relative_error(applied(initial_params(), params), window_gradient(batches))
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits_of(initial_params(), batch["words"]), batch["tags"]
    )
    mean = float(jnp.sum(losses * batch["real"]) / jnp.sum(batch["real"]))
    if suffix == ".fixed.py":
        assert error < 1e-5 and np.isclose(float(loss), mean, rtol=1e-5), (error, loss, mean)
    else:
        assert error > 1e-3 and not np.isclose(float(loss), mean, rtol=1e-2), (error, loss)


DECORATED = FIXTURES / "ga005_xmod_decorated_loss_imported_masked_mean"


def test_multisteps_fix_of_a_decorated_loss_over_an_imported_masked_mean(monkeypatch):
    """A loss decorated with `jax.value_and_grad` (a keyword-only parameter after a bare `*`)
    unpacks its micro-batch tuple and returns the masked token mean of a helper of another
    module (losses.py): fixed, it returns that mean times its kept count over the window's,
    MultiSteps sums, and the logged loss stays the micro-batch's mean. Six micro-batches with
    K = 4: the last window, cut short, still runs and logs its means (MultiSteps accumulates it
    without a step, as in the original), so a log over the whole loop keeps its meaning."""
    from gaaudit.config import Settings
    from gaaudit.fixes.fixer import fix_source

    train = DECORATED / "train.py"
    fixed = fix_source(train.read_bytes(), train, Settings())
    assert [o.applied for o in fixed.outcomes] == [True]
    after = fixed.after.decode()
    assert "masked_token_nll(logits, tags, keep=keep) * keep.sum() / window_weight" in after
    assert "sum(micro_batch[2].sum() for micro_batch in window)" in after
    batches = micro_batches(6)
    tuples = [(b["input_ids"], b["labels"], b["loss_mask"] > 0) for b in batches]

    def means(params, part):
        return [
            float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
                logits_of(params, tokens), tags), where=keep))
            for tokens, tags, keep in part
        ]  # fmt: skip

    monkeypatch.syspath_prepend(str(DECORATED))
    monkeypatch.delitem(__import__("sys").modules, "losses", raising=False)
    for source, exact in ((train.read_text(), False), (after, True)):
        logged: list[float] = []
        params = definitions(source, "train.py")["train"](
            initial_params(), logits_of, tuples, logged
        )
        # the first window under the initial parameters, the last under those of its step
        want = means(initial_params(), tuples[:4]) + means(params, tuples[4:])
        assert np.allclose(logged, want, rtol=1e-5), (logged, want)
        error = relative_error(applied(initial_params(), params), window_gradient(batches[:4]))
        assert (error < 1e-5) if exact else (error > 1e-3), error


HELPER_AUX = FIXTURES / "ga005_xmod_loss_helper_returns_aux"


def test_multisteps_fix_of_a_helper_returning_its_mean_beside_auxiliary_data(monkeypatch):
    """`return nll_and_accuracy(...)` under `has_aux=True`, the helper of another module
    returning its masked token mean and the accuracy: fixed, the loss function unpacks the
    two and returns the mean times its kept count over the window's beside the accuracy as it
    was. The logged loss and accuracy are each micro-batch's, before and after; the applied
    gradient becomes the window's token mean's, as the correct twin's is."""
    from gaaudit.config import Settings
    from gaaudit.fixes.fixer import fix_source

    train = HELPER_AUX / "train.py"
    fixed = fix_source(train.read_bytes(), train, Settings())
    assert [o.applied for o in fixed.outcomes] == [True]
    after = fixed.after.decode()
    assert "mean_loss, aux = nll_and_accuracy(logits, tags, keep)" in after
    assert "return mean_loss * keep.sum() / window_weight, aux" in after
    batches = micro_batches(4)
    tuples = [(b["input_ids"], b["labels"], b["loss_mask"] > 0) for b in batches]
    want = []
    for tokens, tags, keep in tuples:
        logits = logits_of(initial_params(), tokens)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tags)
        right = jnp.argmax(logits, axis=-1) == tags
        want.append((float(jnp.mean(losses, where=keep)), float(jnp.mean(right, where=keep))))

    twin = HELPER_AUX.with_name("ok_xmod_loss_helper_returns_aux_sums")
    for folder, source, exact in (
        (HELPER_AUX, train.read_text(), False),
        (HELPER_AUX, after, True),
        (twin, (twin / "train.py").read_text(), True),
    ):
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(__import__("sys").modules, "losses", raising=False)
        logged: list[tuple[float, float]] = []
        params = definitions(source, "train.py")["train"](
            initial_params(), logits_of, tuples, logged
        )
        assert np.allclose(logged, want, rtol=1e-5), (logged, want)
        error = relative_error(applied(initial_params(), params), window_gradient(batches))
        assert (error < 1e-5) if exact else (error > 1e-3), error
