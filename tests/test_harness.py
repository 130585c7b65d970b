"""The runtime harness on real tiny models (torch, transformers, accelerate; CPU, no mocks)."""

from __future__ import annotations

import itertools
import json
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import FIXTURES, gaaudit

from gaaudit.harness.analysis import analyse
from gaaudit.harness.data import make_window, merge_batches
from gaaudit.harness.demo import DemoRow, plot, run_demo
from gaaudit.harness.gradcheck import (
    RecordingOptimizer,
    SeededRows,
    StepReached,
    full_batch_grads,
    relative_error,
)
from gaaudit.harness.models import build_model, count_tokens
from gaaudit.harness.replay import check, compare, replay
from gaaudit.harness.stubs import Batch, Stub, Tokenizer
from gaaudit.harness.stubs import stub_range as range_of


def source(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def line_of(text: str, start: str) -> int:
    """1-based line of the first line that starts (after indentation) with `start`."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(start))


DRAWS = """
def draw(x):
    noise = torch.randn_like(x)
    keep = torch.rand(x.shape) > 0.5
    steps = torch.randint(0, 1000, (x.shape[0],))
    x.uniform_(-1, 1)
    return noise, keep, steps, x
"""


def test_random_draws_of_the_replayed_code_are_made_row_by_row():
    """Noise that a loop draws for each of its micro-batches is, row for row, what it draws
    for one batch of the whole window (which plain draws from one generator are not: normal
    samples come in blocks), counted anew from each window; a draw of other code, or with a
    generator of its own, is left to the generator."""
    namespace = {"torch": torch}
    exec(compile(DRAWS, "train.py", "exec"), namespace)  # noqa: S102 - the test's own code
    draw = namespace["draw"]
    with SeededRows(0, "train.py"):
        parts = [draw(torch.zeros(3, 20)), draw(torch.zeros(2, 20))]
    with SeededRows(0, "train.py") as rows:
        whole = draw(torch.zeros(5, 20))
        rows.restart()
        again = draw(torch.zeros(5, 20))
    for i, drawn in enumerate(whole):
        assert torch.equal(torch.cat([part[i] for part in parts]), drawn)
        assert torch.equal(again[i], drawn)
    torch.manual_seed(0)
    plain = torch.cat([torch.randn(3, 20), torch.randn(2, 20)])
    torch.manual_seed(0)
    assert not torch.equal(plain, torch.randn(5, 20))  # what the rows' seeds are for
    torch.manual_seed(1)
    expected = torch.randn(4), torch.randn(4, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)
    with SeededRows(0, "train.py"):
        elsewhere = torch.randn(4), torch.randn(4, generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(elsewhere, expected))


def test_demo_mean_over_k_error_grows_with_k_and_sum_and_count_matches():
    rows = run_demo([1, 2, 4, 8], seed=0)
    assert [row.k for row in rows] == [1, 2, 4, 8]
    assert rows[0].mean_over_k < 1e-6
    assert all(row.mean_over_k > 1e-3 for row in rows[1:])
    assert rows[-1].mean_over_k > rows[1].mean_over_k
    assert all(row.sum_and_count < 1e-5 for row in rows)


def test_plot_writes_a_file_or_says_matplotlib_is_missing(tmp_path):
    rows = [DemoRow(1, 0.0, 1e-7), DemoRow(2, 0.05, 1e-7)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="matplotlib"):
            plot(rows, tmp_path / "demo.png")
    else:
        plot(rows, tmp_path / "demo.png")
        assert (tmp_path / "demo.png").stat().st_size > 0


def test_window_has_unequal_token_counts_and_a_matching_full_batch():
    window = make_window("causal", 4, micro_batch_size=2, seed=0)
    counts = [int(count_tokens("causal", b)) for b in window.micro]
    assert len(set(counts)) > 1
    assert sum(counts) == int(count_tokens("causal", window.full))
    assert (window.micro[0]["labels"][window.micro[0]["attention_mask"] == 0] == -100).all()
    again = make_window("causal", 4, micro_batch_size=2, seed=0)
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(window.micro, again.micro)
    )


def test_a_ragged_window_pads_each_micro_batch_to_its_own_longest():
    """`ragged`: the same samples, each micro-batch as wide as its longest sample (a collator
    padding to the longest), where the plain window pads all to the window's widest."""
    plain = make_window("causal", 4, micro_batch_size=2, seed=0)
    ragged = make_window("causal", 4, micro_batch_size=2, seed=0, ragged=True)
    widths = [b["input_ids"].shape[1] for b in ragged.micro]
    assert len(set(widths)) > 1 and {b["input_ids"].shape[1] for b in plain.micro} == {max(widths)}
    assert all(int(b["attention_mask"].sum(1).max()) == w for b, w in zip(ragged.micro, widths))
    assert all(torch.equal(a, b) for a, b in zip(plain.full.values(), ragged.full.values()))


@pytest.mark.parametrize("kind", ["causal", "mlm", "nanogpt", "logits", "teacher"])
def test_full_batch_gradient_is_deterministic(kind):
    window = make_window(kind, 2, seed=1)
    first = full_batch_grads(build_model(kind, seed=1), window)
    second = full_batch_grads(build_model(kind, seed=1), window)
    assert relative_error(first, second) == 0.0
    assert relative_error([g * 2 for g in first], first) == pytest.approx(1.0)


def test_recording_optimizer_captures_gradients_and_stops():
    model = torch.nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer = RecordingOptimizer(model.parameters())
    with pytest.raises(StepReached):
        optimizer.step()
    assert torch.equal(optimizer.grads[0], model.weight.grad)
    assert not issubclass(StepReached, Exception)  # a loop's `except Exception` cannot swallow it


def test_recording_optimizer_runs_a_closure_and_skips_the_steps_it_is_told_to():
    """`optimizer.step(closure)` backpropagates in the closure first (Fabric's trainer); with
    `skip`, the first steps change nothing and count the micro-batches anew."""
    model = torch.nn.Linear(3, 1)
    drawn = [0]  # micro-batches the replay has served
    optimizer = RecordingOptimizer(model.parameters(), skip=1)
    optimizer.count(lambda: drawn[0])

    def closure():
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return loss

    drawn[0] = 3
    optimizer.step(closure)  # skipped: goes on
    weight = model.weight.detach().clone()
    drawn[0] = 7
    with pytest.raises(StepReached):
        optimizer.step(closure)
    assert torch.equal(model.weight, weight)  # nothing was stepped
    assert torch.equal(optimizer.grads[0], model.weight.grad) and model.weight.grad.abs().sum() > 0
    assert optimizer.drawn() == 4  # since the skipped step


def test_stub_is_inert():
    args = Stub("args")
    assert not args.with_tracking and args.x.y() is not None
    assert 10**9 < args.max_steps and not (args.max_steps <= 3)  # a limit is never reached
    assert list(itertools.islice(range_of(args.epochs), 2)) == [0, 1]
    assert list(args.loggers) == [] and f"{args.lr:.3f}" == "<stub args.lr>"
    assert isinstance(torch.ones(1) * args.scale, Stub)
    ids = torch.tensor([[3, 4], [5, 6]])
    assert not (ids == args.image_token_id).any() and (ids != args.image_token_id).all()
    with args.context():
        pass


@pytest.mark.parametrize(
    "change",
    [
        {},
        # a switch of the stand-in for the configs: the term it guards is left out
        {"if self.optim_params.entropy_weight > 0:": "if self.optim_params.entropy_weight:"},
        {"if self.cfg.source_weights is not None:": "if self.cfg.source_weights:"},
    ],
    ids=["as-written", "weight-falsy", "weights-falsy"],
)
def test_a_vision_language_batch_without_images_is_replayed_with_its_options_unset(change):
    """A per-batch method of a vision-language trainer: the harness's text batches count no
    images (the pixel inputs are dropped) and their text tokens; an unknown option tested for
    None or compared `> 0` is unset, as a falsy stub is; `getattr` by a caller's stand-in
    reads a stub; a method of the user's model called after the step (a throughput estimate)
    is a stub. Each micro-batch's mean divided by K reproduces the bug."""
    text = (FIXTURES / "ga003_accelerate_vision_language_method_per_batch.py").read_text()
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    result = check(text, line_of(text, "def train_batch"), k=4, device="cpu")
    assert result.verdict == "bug reproduced" and result.error > 1e-2, result
    assert result.replay.bindings["model.estimate_throughput"].startswith("stub: a method")


def test_the_tokenizer_stand_in_reads_the_served_captions_back_into_their_tokens():
    """A latent-diffusion batch's captions are its token ids written as words: the stand-in
    for a tokenizer reads them back, padded; text of the user's own makes a stub."""
    window = make_window("latent", 2)
    tokens = window.full["input_ids"]
    captions = [" ".join(map(str, row.tolist())) for row in tokens]
    tokenizer = Tokenizer("tokenizer", 0)
    encoded = tokenizer(captions, padding="max_length", return_tensors="pt")
    assert torch.equal(encoded.input_ids, tokens) and encoded["attention_mask"].all()
    ragged = tokenizer(["5 6 7", "8 9"])
    assert ragged.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert ragged.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert isinstance(tokenizer("a photo of sks dog"), Stub)


HF_BUGGY = source("""
    import math
    import torch
    from tqdm.auto import tqdm

    def train(args, model, train_dataloader, optimizer, lr_scheduler, logger=None):
        model.train()
        completed_steps = 0
        for step, batch in enumerate(tqdm(train_dataloader)):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            if step % args.gradient_accumulation_steps == args.gradient_accumulation_steps - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break
""")

HF_FIXED = source("""
    import math
    import torch
    from tqdm.auto import tqdm

    def train(args, model, train_dataloader, optimizer, lr_scheduler, logger=None):
        model.train()
        completed_steps = 0
        num_items = 0
        for step, batch in enumerate(tqdm(train_dataloader)):
            outputs = model(**batch)
            n = (batch["labels"][..., 1:] != -100).sum()
            (outputs.loss * n).backward()
            num_items += n
            if step % args.gradient_accumulation_steps == args.gradient_accumulation_steps - 1:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(num_items)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                num_items = 0
            if completed_steps >= args.max_train_steps:
                break
""")


@pytest.mark.parametrize("start", ["for step", "def train"])
def test_hf_loop_bug_reproduced_and_fix_verified(start):
    result = compare(
        HF_BUGGY,
        HF_FIXED,
        line_of(HF_BUGGY, start),
        line_of(HF_FIXED, start),
        k=4,
        divisor_names=["args.gradient_accumulation_steps"],
        device="cpu",
    )
    assert result.original.verdict == "bug reproduced", result.original
    assert result.original.error > 1e-2
    assert result.verdict == "verified", result.patched
    assert result.patched.error < 1e-5
    bindings = result.patched.replay.bindings
    assert bindings["model"] == "tiny causal model"
    assert bindings["args.gradient_accumulation_steps"] == "K = 4"
    assert result.patched.replay.captured_at == "clip_grad_norm_"


MOVED = """\
from project.utils_not_on_this_path import to_device


def train(model, loader, optimizer, device, k):
    for step, batch in enumerate(loader):
        batch = to_device(batch, device)
        loss = model(**batch).loss / k
        loss.backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_batch_mover_that_cannot_be_imported_still_moves_the_batch():
    """`to_device(batch, device)` of a project module the replay cannot import: the batch is
    moved (a stub would hand the model nothing), and `device` is the device, not the mover."""
    result = check(MOVED, line_of(MOVED, "for step"), k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert result.replay.bindings["device"] == "cpu"
    assert "to_device" not in result.replay.bindings


EMA = """\
def train(model, model_ema, loader, optimizer, k):
    for step, batch in enumerate(loader):
        loss = model(**batch).loss / k
        loss.backward()
        if model_ema is not None:
            model_ema(model)
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_wrapper_handed_the_model_is_not_taken_for_a_second_model():
    """`model_ema(model)` updates an average of the weights: it is a stand-in, not a model
    that the loop's model is fed to."""
    result = check(EMA, line_of(EMA, "for step"), k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert "tiny" not in result.replay.bindings["model_ema"]


TRIPLES = """\
def train(model, loader, optimizer, k, metric):
    for step, (input_ids, attention_mask, labels) in enumerate(loader):
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        loss = out.loss / k
        loss.backward()
        acc, shown = metric.summary()
        rate = scheduler.get_last_lr()[0]
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_batch_unpacked_into_named_fields_is_served_in_that_order():
    """`(input_ids, attention_mask, labels)`: three values a batch, named as the harness's
    fields; `acc, shown = metric.summary()` unpacks a helper's result, not a model output
    (though `f()[0]` is read elsewhere)."""
    from gaaudit.harness.analysis import analyse

    plan = analyse(TRIPLES, line_of(TRIPLES, "for step"))
    assert plan.data_keys == ("input_ids", "attention_mask", "labels")
    assert ("metric", "summary") not in plan.roles
    source = TRIPLES.replace("        acc, shown = metric.summary()\n", "").replace(
        "        rate = scheduler.get_last_lr()[0]\n", ""
    )
    result = check(source, 2, k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


def test_a_tuple_batch_named_by_position_is_served_as_the_fields_its_keys_say():
    """`{"source_ids": batch[0], "target_ids": batch[1], "target_lens": batch[2]}` names the
    positions by keys that are not transformers' own: the harness serves its token ids, its
    labels and each row's length there, and `if args.objective == "plain":` takes the
    option's default, the branch a user who passes no option runs."""
    text = (FIXTURES / "ga001_mode_switched_keyword_dict.py").read_text()
    plan = analyse(text, line_of(text, "for step"))
    assert plan.data_keys == ("input_ids", "labels", "lengths", None)
    assert plan.settings["objective"] == "plain"


def test_a_base_trainers_loop_is_planned_with_the_subclass_that_fills_in_its_hooks():
    """A hook the loop calls that raises NotImplementedError is filled in by the first
    subclass that implements every such hook (not one that fills in only some); the batch
    drawn as `list(next(it))` is unpacked there into `src, tgt, seg`."""
    text = (FIXTURES / "ga002_base_trainer_abstract_step.py").read_text()
    plan = analyse(text, line_of(text, "while self.step"))
    assert plan.owner.subclass.name == "CausalLmTrainer"
    assert plan.data_keys == ("input_ids", "labels", None)
    partial = text.replace(
        "    def log(self):\n        print(", "    def show(self):\n        print("
    )
    assert analyse(partial, line_of(partial, "while self.step")).owner.subclass is None


LANGUAGE_MODELLING = """
def train(args, model, tokenizer, train_dataloader, optimizer):
    for step, batch in enumerate(train_dataloader):
        inputs, labels = mask_tokens(batch, tokenizer, args) if args.mlm else (batch, batch)
        inputs = inputs.to(args.device)
        outputs = model(inputs, labels=labels.to(args.device))
        loss = outputs[0] / args.gradient_accumulation_steps
        loss.backward()
        if (step + 1) % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("change", "tensor"),
    [
        ({}, True),  # the old transformers run_language_modeling.py
        ({"(batch, batch)": "(batch[0], batch[1])"}, False),  # a tuple by position
        ({"model(inputs, ": "model(input_ids=inputs, "}, True),
        ({"(batch, batch)": "(batch.input_ids, batch.labels)"}, False),  # fields of it
    ],
)
def test_a_batch_the_model_is_called_on_is_served_as_token_ids(change, tensor):
    from gaaudit.harness.analysis import analyse

    source = LANGUAGE_MODELLING
    for old, new in change.items():
        assert old in source
        source = source.replace(old, new)
    assert analyse(source, line_of(source, "for step")).data_tensor is tensor


ONE_TENSOR = """\
def train(model, loader, optimizer, k):
    for step, (tokens,) in enumerate(loader):
        logits, loss = model(tokens[:, :-1], tokens[:, 1:])
        (loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_batch_of_one_tensor_is_served_as_a_one_tuple_of_token_ids():
    """`(tokens,) = batch` (open_lm's webdataset batches): the one value is the token ids,
    every position a target here, so mean/K is exact on the window's one width."""
    from gaaudit.harness.analysis import analyse

    start = line_of(ONE_TENSOR, "for step")
    assert analyse(ONE_TENSOR, start).data_keys == ("input_ids",)
    result = check(ONE_TENSOR, start, k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "verified", result.replay.reason


LAST_LOSS = """\
raw_model = model.module if ddp else model


def train(model, loader, optimizer, k):
    for step, (X, Y) in enumerate(loader):
        logits = model(X, Y)
        loss = raw_model.last_loss / k
        loss.backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_loss_kept_on_the_model_is_read_from_the_tiny_model():
    """llama2.c's `logits = model(X, Y)`, then `loss = raw_model.last_loss` of a module-level
    `raw_model`: the model read for its loss is the tiny model too, which keeps it there."""
    start = line_of(LAST_LOSS, "for step")
    result = check(LAST_LOSS, start, k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert "tiny" in result.replay.bindings["raw_model"], result.replay.bindings


def test_an_auxiliary_loss_the_tiny_model_lacks_reads_as_zero():
    """`out.loss + out.aux_loss` (minimind's mixture of experts): the tiny model has no
    auxiliary loss, so the term is zero and the mean/K bug is measured as in HF_BUGGY."""
    with_aux = HF_BUGGY.replace("loss = outputs.loss\n", "loss = outputs.loss + outputs.aux_loss\n")
    assert with_aux != HF_BUGGY
    start = line_of(HF_BUGGY, "for step")
    plain, aux = (
        compare(
            text,
            text,
            start,
            start,
            k=4,
            divisor_names=["args.gradient_accumulation_steps"],
            device="cpu",
        )
        for text in (HF_BUGGY, with_aux)
    )
    assert aux.original.verdict == "bug reproduced", aux.original
    assert aux.original.error == pytest.approx(plain.original.error)


SCALER_LOOP = source("""
    def train_one_epoch(model, data_loader, optimizer, loss_scaler, accum_iter):
        for data_iter_step, batch in enumerate(data_loader):
            loss = model(**batch).loss
            loss /= accum_iter
            loss_scaler(
                loss,
                optimizer,
                parameters=model.parameters(),
                update_grad=(data_iter_step + 1) % accum_iter == 0,
            )
""")


def test_a_loss_scaler_that_backpropagates_and_steps_is_modelled():
    """MAE's and timm's `loss_scaler(loss, optimizer, update_grad=...)`: the stand-in runs the
    backward and steps when `update_grad` holds, so the mean/K bug is measured."""
    start = line_of(SCALER_LOOP, "for data_iter_step")
    result = compare(
        SCALER_LOOP, SCALER_LOOP, start, start, k=4, divisor_names=["accum_iter"], device="cpu"
    )
    assert result.original.verdict == "bug reproduced", result.original
    assert result.original.error > 1e-2
    bindings = result.original.replay.bindings
    assert bindings["loss_scaler"].startswith("loss scaler stand-in"), bindings


def test_replay_reports_bindings_and_gradients():
    line = line_of(HF_BUGGY, "for step")
    result = replay(
        HF_BUGGY, line, k=3, divisor_names=["args.gradient_accumulation_steps"], device="cpu"
    )
    assert result.ok and len(result.grads) == len(list(build_model("causal").parameters()))
    assert result.bindings["train_dataloader"] == "3 micro-batches as dict batches"
    assert result.bindings["completed_steps"].startswith("0")
    assert result.bindings["lr_scheduler"] == "stub"


NANO_BUGGY = source("""
    import time
    import torch
    gradient_accumulation_steps = 5 * 8
    grad_clip = 1.0
    iter_num = 0
    decay_lr = False
    learning_rate = 6e-4

    X, Y = get_batch('train')
    while True:
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        if iter_num % eval_interval == 0 and master_process:
            losses = estimate_loss()
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
""")

NANO_FIXED = source("""
    import time
    import torch
    gradient_accumulation_steps = 5 * 8
    grad_clip = 1.0
    iter_num = 0

    X, Y = get_batch('train')
    while True:
        num_tokens = 0
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                n = (Y != -1).sum()
                loss = loss * n
            num_tokens += n
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(num_tokens)
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
""")


def test_nanogpt_loop_with_prefetch_and_scaler():
    result = compare(
        NANO_BUGGY,
        NANO_FIXED,
        line_of(NANO_BUGGY, "while True"),
        line_of(NANO_FIXED, "while True"),
        k=4,
        divisor_names=["gradient_accumulation_steps"],
        device="cpu",
    )
    assert result.original.verdict == "bug reproduced", result.original
    assert result.verdict == "verified", result.patched
    bindings = result.original.replay.bindings
    assert bindings["model"] == "tiny nanogpt model"
    assert bindings["X"] == bindings["Y"] == "the first micro-batch (prefetched)"
    assert bindings["get_batch"] == "4 micro-batches as (input_ids, labels) tuples"
    assert bindings["scaler"].startswith("GradScaler")


CE_BUGGY = source("""
    import torch.nn.functional as F

    for step, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
        (loss / accum_steps).backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
""")

CE_FIXED = source("""
    import torch.nn.functional as F

    n_tokens = 0
    for step, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100,
                               reduction="sum")
        loss.backward()
        n_tokens += (y != -100).sum()
        if (step + 1) % accum_steps == 0:
            for p in model.parameters():
                p.grad.div_(n_tokens)
            optimizer.step()
            optimizer.zero_grad()
            n_tokens = 0
""")


def test_cross_entropy_over_logits():
    result = compare(
        CE_BUGGY,
        CE_FIXED,
        line_of(CE_BUGGY, "for step"),
        line_of(CE_FIXED, "for step"),
        k=4,
        divisor_names=["accum_steps"],
        device="cpu",
    )
    assert result.original.replay.model_kind == "logits"
    assert result.original.verdict == "bug reproduced", result.original
    assert result.verdict == "verified", result.patched


ACCELERATE_BUGGY = source("""
    def train(model, optimizer, train_dataloader, lr_scheduler, k):
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            accelerator.backward(outputs.loss / k)
            if (step + 1) % k == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
""")

ACCELERATE_FIXED = source("""
    def train(model, optimizer, train_dataloader, lr_scheduler, k):
        num_items = 0
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            n = (batch["labels"][..., 1:] != -100).sum()
            accelerator.backward(outputs.loss * n)
            num_items += n
            if (step + 1) % k == 0:
                for p in model.parameters():
                    p.grad /= num_items
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
""")


def test_accelerator_backward_of_loss_over_k():
    result = compare(
        ACCELERATE_BUGGY, ACCELERATE_FIXED, 1, 1, k=4, divisor_names=["k"], device="cpu"
    )
    assert result.original.verdict == "bug reproduced", result.original
    assert result.verdict == "verified", result.patched
    assert result.patched.replay.bindings["optimizer"] == "recording SGD, prepared"


ACCUMULATE_BUGGY = source("""
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
""")

ACCUMULATE_FIXED = source("""
    import torch

    while True:
        batches = [next(data_iter) for _ in range(args.gradient_accumulation_steps)]
        counts = [(b["labels"][..., 1:] != -100).sum() for b in batches]
        n_global = accelerator.gather(torch.stack(counts)).sum()
        for batch, n in zip(batches, counts):
            with accelerator.accumulate(model):
                loss = model(**batch).loss * n
                scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
                accelerator.backward(loss * scale / n_global)
                optimizer.step()
                optimizer.zero_grad()
""")


def test_accelerate_accumulate_divides_by_k_itself():
    result = compare(
        ACCUMULATE_BUGGY,
        ACCUMULATE_FIXED,
        1,
        line_of(ACCUMULATE_FIXED, "while"),
        k=4,
        divisor_names=["args.gradient_accumulation_steps"],
        device="cpu",
    )
    assert result.original.verdict == "bug reproduced", result.original
    assert result.original.replay.captured_at == "accelerator.clip_grad_norm_"
    assert "gradient_accumulation_steps=4" in result.original.replay.bindings["accelerator"]
    assert result.verdict == "verified", result.patched


KIND_BUGGY = source("""
    from transformers import {model_class}

    for step, batch in enumerate(train_dataloader):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
        (loss / gradient_accumulation_steps).backward()
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
""")

KIND_FIXED = source("""
    from transformers import {model_class}

    total = 0
    for step, batch in enumerate(train_dataloader):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss
        n = (batch["labels"]{shift} != -100).sum()
        (loss * n).backward()
        total += n
        if (step + 1) % gradient_accumulation_steps == 0:
            for p in model.parameters():
                p.grad.div_(total)
            optimizer.step()
            optimizer.zero_grad()
""")


@pytest.mark.parametrize(
    ("model_class", "shift", "kind", "dtype"),
    [
        ("AutoModelForMaskedLM", "", "mlm", "float32"),
        ("AutoModelForMaskedLM", "", "mlm", "bfloat16"),
        ("AutoModelForSeq2SeqLM", "", "seq2seq", "float32"),
        ("AutoModelForCausalLM", "[..., 1:]", "causal", "float16"),
    ],
)
def test_model_kinds_and_low_precision(model_class, shift, kind, dtype):
    buggy = KIND_BUGGY.format(model_class=model_class)
    fixed = KIND_FIXED.format(model_class=model_class, shift=shift)
    result = compare(
        buggy,
        fixed,
        line_of(buggy, "for step"),
        line_of(fixed, "for step"),
        k=4,
        dtype=dtype,
        device="cpu",
    )
    assert result.original.replay.model_kind == kind
    assert result.original.verdict == "bug reproduced", result.original
    assert result.verdict == "verified", result.patched


FILE_LOOP = source("""
    import torch

    for step in range(100):
        batch = torch.load(f"shards/batch_{step}.pt")
        loss = model(**batch).loss / accum
        loss.backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
""")


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (FILE_LOOP, 3, "FileNotFoundError"),
        ("for x in loader:\n    print(x)\n", 1, "no backward pass"),
        ("x = 1\n", 1, "not in a loop or a function"),
        ("for x in (:\n", 1, "cannot parse"),
        (
            "for b in loader:\n    (model(**b).loss * 0).backward()\n    optimizer.step()\n",
            1,
            "zero gradients",
        ),
        (
            "for epoch in range(args.epochs):\n    for b in []:\n        optimizer.step()\n",
            1,
            "did not reach an optimizer step (a range with an unknown end ran 10000 times)",
        ),
        ("while True:\n    pass\n", 1, "timed out after 1 s"),
        (  # a message that prints whole tensors: its first line, cut short
            "for b in loader:\n    raise TypeError('x' * 500 + '\\nsecond line')\n",
            1,
            "TypeError: " + "x" * 240 + " ... (line 2)",
        ),
    ],
)
def test_not_replayable_with_a_reason(text, line, reason):
    result = check(text, line, k=2, device="cpu", timeout=1)
    assert result.verdict.startswith("not replayable: "), result.verdict
    assert reason in result.verdict
    assert result.error is None


def test_a_loss_the_harness_does_not_model_is_measured_against_the_loops_own_full_batch():
    """A mean over every logit (padding included) is not the token mean of the harness's
    reference (k1_error), so the loop is compared with itself run on the whole window as one
    micro-batch: the micro-batches are exact slices of it, equal in size, and mean/K is
    exact for them."""
    text = source("""
        for step, batch in enumerate(loader):
            logits = model(**batch).logits
            loss = logits.pow(2).mean() / k
            loss.backward()
            if (step + 1) % k == 0:
                optimizer.step()
    """)
    result = check(text, 1, k=3, divisor_names=["k"], device="cpu")
    assert result.k1_error > 1e-3
    assert result.verdict == "verified" and result.error < 1e-5, result.verdict


MASKLESS_MLM = source("""
    for step, batch in enumerate(loader):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        (out.loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
""")


def test_a_model_called_without_its_attention_mask_sees_the_same_padding_in_both():
    """Issue 18: every micro-batch of a window is padded to the window's width, so a model
    that reads the padding (no attention mask) sees the full batch as their concatenation:
    the mean over K is the bug, and the token-weighted loop is not."""
    original = check(MASKLESS_MLM, 1, k=4, divisor_names=["k"], model_kind="mlm", device="cpu")
    assert original.verdict == "bug reproduced", original.verdict
    fixed = MASKLESS_MLM.replace(
        "(out.loss / k).backward()",
        "n = (batch['labels'] != -100).sum()\n    total += n\n    (out.loss * n).backward()",
    ).replace(
        "optimizer.step()",
        "[p.grad.div_(total) for p in model.parameters() if p.grad is not None]\n"
        "        optimizer.step()",
    )
    fixed = "total = 0\n" + fixed
    result = check(fixed, 2, k=4, divisor_names=["k"], model_kind="mlm", device="cpu")
    assert result.verdict == "verified", result.verdict


NANO_NO_DIVISION = NANO_BUGGY.replace("loss = loss / gradient_accumulation_steps", "loss = loss")


def test_packed_data_makes_mean_over_k_exact_but_not_a_missing_division():
    line = line_of(NANO_BUGGY, "while True")
    packed = check(NANO_BUGGY, line, k=4, packed=True, device="cpu")
    assert packed.verdict == "verified", packed  # GA-GUIDE section 3: exact on packed blocks
    missing = check(NANO_NO_DIVISION, line, k=4, packed=True, device="cpu")
    assert missing.verdict == "bug reproduced"
    assert missing.error == pytest.approx(3.0, rel=1e-4)  # K times the full-batch gradient


FABRIC_BUGGY = source("""
    def train(fabric, model, optimizer, train_loader, grad_accum_steps):
        for iter_num, (input_ids, targets) in enumerate(train_loader):
            is_accumulating = (iter_num + 1) % grad_accum_steps != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(input_ids)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
                fabric.backward(loss / grad_accum_steps)
            if not is_accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
""")


def test_fabric_loop_and_an_ignore_index_read_from_the_source():
    result = check("import torch.nn.functional as F\n" + FABRIC_BUGGY, 2, k=4, device="cpu")
    assert result.verdict == "bug reproduced", result
    assert result.replay.captured_at == "fabric.clip_gradients"
    assert result.replay.bindings["fabric"] == "single-process Fabric stand-in"


BOOSTED_TRAINER = source("""
    import torch
    from coati.trainer.base import SLTrainer
    from coati.trainer.utils import AccumulativeMeanMeter

    class SFTTrainer(SLTrainer):
        def _train(self, epoch):
            for i, batch in enumerate(self.train_dataloader):
                batch = {k: v.to(torch.cuda.current_device()) for k, v in batch.items()}
                loss = self.model(**batch).loss
                self.booster.backward(loss=loss, optimizer=self.optimizer)
                self.accumulative_meter.add("loss", loss.item())
                if (self.num_train_step + 1) % self.accumulation_steps == 0:
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    self.accumulative_meter.reset()
                self.num_train_step += 1
""")


@pytest.mark.parametrize(
    "change, low, high",
    [({}, 2.0, 4.0), ({"loss=loss,": "loss=loss / self.accumulation_steps,"}, 1e-3, 1.0)],
    ids=["undivided", "mean-over-k"],
)
def test_a_booster_trainer_whose_base_class_is_not_installed(change, low, high):
    """ColossalAI's SFT trainer: a base class of an uninstalled library, the batch moved to
    `torch.cuda.current_device()`, and `booster.backward(loss=...)`, which divides nothing (K
    means summed: about K - 1 = 3 from the full batch; divided by K, the means weighed
    equally); an object named like the accumulation steps (`accumulative_meter`) is not K."""
    text = BOOSTED_TRAINER
    for old, new in change.items():
        text = text.replace(old, new)
    result = check(text, line_of(text, "for i, batch"), k=4, device="cpu")
    assert result.replay.bindings["self.booster"].startswith("a booster"), result.replay.bindings
    assert result.replay.bindings["self.accumulation_steps"] == "K = 4"
    assert "self.accumulative_meter" not in result.replay.bindings
    assert result.verdict == "bug reproduced" and low < result.error < high, result


@pytest.mark.parametrize(
    "name, verdict",
    [
        ("ga001_step_function_divides_by_its_k", "bug reproduced"),
        ("ok_step_function_sum_and_count", "verified"),
    ],
)
def test_a_loop_that_calls_the_function_that_backpropagates_is_replayed(name, verdict):
    """`train_step(model, batch, ...)` backpropagates and the loop calling it steps: the loop
    is replayed, its `(inputs, targets, mask)` batches served by position."""
    text = (FIXTURES / f"{name}.py").read_text()
    result = check(text, line_of(text, "for step, batch"), k=4, device="cpu")
    assert result.verdict == verdict, result


SCRIPT_SHAPED = source("""
    import torch

    @torch.no_grad()
    def evaluate(model, loader):
        return sum(model(**b).loss for b in loader)

    def main():
        cfg = load_config()
        model = build().cuda()
        step = 0
        for epoch in range(cfg.epochs):
            while step < cfg.max_steps:
                if step % cfg.eval_every == 0:
                    print(evaluate(model, val_loader))
                total = 0
                for micro in range(cfg.accum_steps):
                    batch = {k: v.cuda() for k, v in next(train_iter).items()}
                    n = (batch["labels"][..., 1:] != -100).sum()
                    (model(**batch).loss * n).backward()
                    total += n
                for p in model.parameters():
                    p.grad /= total
                optimizer.step()
                optimizer.zero_grad()
                step += 1
""")


def test_unknown_limits_stub_ranges_cuda_calls_and_no_grad_helpers_do_not_block_a_replay():
    result = check(SCRIPT_SHAPED, line_of(SCRIPT_SHAPED, "for epoch"), k=4, device="cpu")
    assert result.verdict == "verified", result
    assert result.replay.bindings["cfg.accum_steps"] == "K = 4"
    assert result.replay.bindings["evaluate"] == "stub"


BENCHMARK_BETWEEN_WINDOWS = source("""
    import torch
    from evaluation import render_example

    for step, batch in enumerate(loader):
        if step % 500 == 0:
            model.eval()
            for index in range(10):
                tokens, label = render_example(index)
                with torch.no_grad():
                    scale = model(tokens.to(device)).logits[0, -1, label]
            model.train()
        loss = model(**batch).loss / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
""")


@pytest.mark.parametrize(
    ("change", "left_out"),
    [
        ({}, True),
        # the training code reads a name that only the block binds
        ({".loss / accum_steps": ".loss * scale / accum_steps"}, False),
        # the block takes part in the gradients
        ({"model.train()": "model.train()\n        scale.backward()"}, False),
    ],
    ids=["evaluation", "binds-a-name-read-later", "backward-in-it"],
)
def test_an_evaluation_block_between_windows_is_left_out_of_the_replay(change, left_out):
    """A benchmark pass under `torch.no_grad()` (examples from a module the replay cannot
    import, build-nanogpt's HellaSwag) is left out; kept where the training code reads a
    name only it binds, or where it backpropagates, and then its stand-in reaches torch."""
    text = BENCHMARK_BETWEEN_WINDOWS
    for old, new in change.items():
        assert text.count(old) == 1
        text = text.replace(old, new)
    result = replay(text, line_of(text, "for step"), k=4, device="cpu")
    if left_out:
        assert result.ok, result.reason
    else:
        assert not result.ok and "must be Tensor, not Stub" in result.reason, result.reason


@pytest.mark.parametrize("kind", ["image", "regression", "classify"])
def test_per_sample_windows_differ_in_size_unless_packed(kind):
    sizes = [len(b["labels"]) for b in make_window(kind, 4, micro_batch_size=2).micro]
    assert len(set(sizes)) > 1 and sum(sizes) == 7
    packed = make_window(kind, 4, micro_batch_size=2, packed=True)
    assert [len(b["labels"]) for b in packed.micro] == [2, 2, 2, 2]


@pytest.mark.parametrize(
    ("kind", "ignore_index"),
    [("segment", -100), ("pair", 0), ("causal", None), ("classify", None), ("latent", None)],
)
def test_merged_micro_batches_are_the_full_batch(kind, ignore_index):
    window = make_window(kind, 3, ignore_index=ignore_index)
    merged = merge_batches(window.micro, window.ignore_index)
    assert merged.keys() == window.full.keys()
    assert all(torch.equal(merged[key], window.full[key]) for key in merged)
    if kind == "segment":  # pixels ignored in varying numbers per image
        counts = [int(count_tokens(kind, {"labels": lab[None]})) for lab in window.full["labels"]]
        assert len(set(counts)) > 1 and all(0 < c < 64 for c in counts)


IMAGE_BUGGY = source("""
    import torch.nn.functional as F
    from torchvision import models

    for step, (images, labels) in enumerate(train_dl):
        logits = model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1) / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
""")
IMAGE_FIXED = source("""
    import torch.nn.functional as F
    from torchvision import models

    total = 0
    for step, (images, labels) in enumerate(train_dl):
        logits = model(images)
        n = (labels != -100).sum()
        total += n
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum")
        loss.backward()
        if (step + 1) % accum_steps == 0:
            for p in model.parameters():
                p.grad /= total
            optimizer.step()
""")


def test_image_classification_with_label_smoothing_in_the_reference():
    result = compare(
        IMAGE_BUGGY,
        IMAGE_FIXED,
        line_of(IMAGE_BUGGY, "for step"),
        line_of(IMAGE_FIXED, "for step"),
        k=4,
        device="cpu",
    )
    assert result.original.replay.model_kind == "image"
    assert result.original.verdict == "bug reproduced", result.original
    assert result.verdict == "verified", result.patched
    assert result.patched.replay.bindings["total"] == "0, as assigned before the statement"


BACKBONE_HEAD = source("""
    def train(backbone, head, loader, accum_steps):
        params = list(backbone.parameters()) + list(head.parameters())
        for step, (x, y) in enumerate(loader):
            logits = head(backbone(x))
            loss = F.cross_entropy(logits.view(-1, V), y.view(-1)) / accum_steps
            loss.backward()
            if (step + 1) % accum_steps == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
""")


def test_two_models_chained_as_backbone_and_head_are_not_replayable():
    result = check(BACKBONE_HEAD, line_of(BACKBONE_HEAD, "for step"), k=2, device="cpu")
    assert result.verdict.startswith(
        "not replayable: `head` is called on the output of `backbone` (a backbone and a head)"
    ), result.verdict


MODULE_METHOD = source("""
    import torch

    class Lit(torch.nn.Module):
        def fit(self, loader, optimizer, accum_steps):
            for step, batch in enumerate(loader):
                loss = self(**batch).loss / accum_steps
                loss.backward()
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
""")


def test_a_loop_in_a_method_of_a_torch_module_says_why_it_cannot_bind_self():
    result = check(MODULE_METHOD, line_of(MODULE_METHOD, "for step"), k=2, device="cpu")
    assert result.verdict == (
        "not replayable: TypeError: the loop is a method of the torch "
        "module `Lit`; the harness cannot bind its own model to `self`"
    )


def test_assignments_before_the_loop_run_only_when_they_build_a_torch_module(tmp_path):
    marker = tmp_path / "written.txt"
    text = source(f"""
        import torch.nn as nn

        def main():
            criterion = nn.CrossEntropyLoss()
            log = open({str(marker)!r}, "w")
            for step, (x, y) in enumerate(loader):
                loss = criterion(model(x).view(-1, V), y.view(-1)) / accum_steps
                print(step, file=log)
                loss.backward()
                if (step + 1) % accum_steps == 0:
                    optimizer.step()
    """)
    result = check(text, line_of(text, "for step"), k=2, device="cpu")
    assert result.verdict == "bug reproduced", result
    assert result.replay.bindings["criterion"] == "`nn.CrossEntropyLoss()`, evaluated"
    assert result.replay.bindings["log"] == "stub" and not marker.exists()


def test_a_method_of_the_class_around_the_loop_is_not_a_name_it_reads():
    """lucidrains' trainers define a `device` property beside `train`, whose loop reads a local
    `device = accelerator.device`: the class body is no scope of the method, so the property is
    no helper of the loop, and the loop replays."""
    text = source("""
        class Trainer:
            @property
            def device(self):
                return self.accelerator.device

            def train(self):
                accelerator = self.accelerator
                device = accelerator.device
                while self.step < self.train_num_steps:
                    for _ in range(self.gradient_accumulate_every):
                        data = next(self.dl).to(device)
                        loss = self.model(data)
                        accelerator.backward(loss / self.gradient_accumulate_every)
                    self.opt.step()
                    self.opt.zero_grad()
    """)
    assert analyse(text, line_of(text, "while self.step")).helpers == []
    result = check(text, line_of(text, "while self.step"), k=2, device="cpu")
    assert result.replay.ok, result.replay.reason


def test_an_import_in_the_class_body_that_fails_here_reads_as_a_stub():
    """A copy of an old Trainer imports helpers into its class body, as methods (`from
    transformers.trainer_pt_utils import _get_learning_rate, log_metrics`), which a later
    release no longer has: the class is defined with those names as the module's imports
    left them (a stub where the import failed), and its loop replays."""
    text = source("""
        import torch

        class Trainer:
            from transformers.trainer_pt_utils import a_helper_long_gone, log_metrics

            def train(self, model, loader, args):
                for step, batch in enumerate(loader):
                    loss = model(**batch).loss / args.gradient_accumulation_steps
                    loss.backward()
                    if (step + 1) % args.gradient_accumulation_steps == 0:
                        self.log_metrics("train", {"lr": self.a_helper_long_gone()})
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """)
    result = check(text, line_of(text, "for step"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result


def test_a_first_window_of_one_micro_batch_is_compared_with_that_batch():
    """`if step % K == 0` from step 0 steps after one micro-batch (issue 18, item 2): each
    loop is judged against the full batch of that one, not of K micro-batches, and then on
    its next window, of K."""
    guard = "== args.gradient_accumulation_steps - 1:"
    buggy = HF_BUGGY.replace(guard, "== 0:")
    fixed = HF_FIXED.replace(guard, "== 0:")
    assert buggy != HF_BUGGY and fixed != HF_FIXED
    result = compare(
        buggy,
        fixed,
        line_of(buggy, "for step"),
        line_of(fixed, "for step"),
        k=4,
        divisor_names=["args.gradient_accumulation_steps"],
        device="cpu",
    )
    assert result.patched.window == result.original.window == 1
    assert result.verdict == "verified" and result.patched.first_error < 1e-5, result.patched
    assert result.patched.window_verdict == "verified" and result.patched.error < 1e-5
    # the original divides its one micro-batch's mean by K: 3/4 of the gradient is missing;
    # its next window of K weights the micro-batches' means alike
    assert result.original.verdict == "bug reproduced"
    assert abs(result.original.first_error - 0.75) < 1e-3
    assert result.original.window_verdict == "bug reproduced", result.original
    assert 1e-3 < result.original.error != result.original.first_error


OPTION_DEFAULTS = source("""
    import argparse

    import torch.nn.functional as F


    def train(args, model, loader, optimizer):
        ignore_index = args.ignore_index
        window_tokens = 0
        for step, batch in enumerate(loader):
            logits = model(batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            loss = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum"
            )
            optimizer.backward(loss)
            window_tokens += labels.ne(ignore_index).sum()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                for param in model.parameters():
                    param.grad.div_(window_tokens)
                optimizer.clip_grad_norm(model.parameters(), args.max_grad_norm)
                optimizer.step()
                window_tokens = 0


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--ignore_index", default=-100, type=int)
        parser.add_argument("--max-grad-norm", dest="max_grad_norm", default=1.0, type=float)
        parser.add_argument("--gradient_accumulation_steps", default=8, type=int)
""")


def test_option_defaults_and_an_fp16_optimizers_backward_and_clip_are_replayed():
    """`ignore_index = args.ignore_index` reads the script's argparse default (a stub would
    reach torch), and `optimizer.backward(loss)` / `optimizer.clip_grad_norm(...)` of fp16
    optimizer wrappers backpropagate and capture the gradients (issue 18, item 4)."""
    line = line_of(OPTION_DEFAULTS, "for step")
    result = check(
        OPTION_DEFAULTS, line, k=4, divisor_names=["args.gradient_accumulation_steps"], device="cpu"
    )
    assert result.verdict == "verified" and result.error < 1e-5, result.verdict
    assert result.replay.captured_at == "clip_grad_norm"
    assert result.replay.bindings["args"].endswith("with the script's option defaults")


MISSING_LIBRARY = source("""
    import torch.nn.functional as F
    from beartype_not_installed import beartype


    @beartype
    def token_loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


    def train(model, loader, optimizer, accum):
        for step, batch in enumerate(loader):
            logits = model(batch["input_ids"]).logits[:, :-1]
            loss = token_loss(logits, batch["labels"][:, 1:])
            (loss / accum).backward()
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


def test_a_library_that_is_not_installed_does_not_stop_the_replay():
    """A failing import binds stubs, and a stub used as a decorator returns what it decorates
    (issue 18, item 4): the loop runs, and its mean over K is reproduced as the bug."""
    line = line_of(MISSING_LIBRARY, "for step")
    result = check(MISSING_LIBRARY, line, k=4, divisor_names=["accum"], device="cpu")
    assert result.verdict == "bug reproduced" and result.error > 1e-2, result.verdict


def test_a_stub_decorates_by_returning_what_it_decorates_and_is_inert_otherwise():
    def function():
        return 1

    assert Stub("beartype")(function) is function
    assert Stub("register")(Stub) is Stub
    assert isinstance(Stub("f")(1), Stub) and isinstance(Stub("f")(function, x=1), Stub)


MODULE_TRAINER = source("""
    import torch
    from torch import nn


    def noop(*args, **kwargs):
        pass


    class Trainer(nn.Module):
        def __init__(self, model, optimizer, accum_steps):
            super().__init__()
            self.model, self.optimizer, self.accum_steps = model, optimizer, accum_steps

        def train_step(self, loader):
            for step, batch in enumerate(loader):
                loss = self.model(**batch).loss
                (loss / self.accum_steps).backward()
                self.log(loss)
                if (step + 1) % self.accum_steps == 0:
                    self.optimizer.step()
                    self.optimizer.zero_grad()

        def log(self, value):
            noop(value.item())

        def train(self, log_fn=noop):
            log_fn(self.train_step(None))
""")


def test_a_trainer_that_is_a_torch_module_holding_its_model_is_replayed():
    """A trainer subclassing `nn.Module` only to hold its parts (lucidrains style) is made
    with `nn.Module.__init__`; a module function a called method uses (`noop` in `log`) is
    defined, and one only the class's other methods read (`log_fn=noop`) would become a stub
    (issue 18, item 4)."""
    line = line_of(MODULE_TRAINER, "for step")
    result = check(MODULE_TRAINER, line, k=4, divisor_names=["self.accum_steps"], device="cpu")
    assert result.verdict == "bug reproduced" and result.error > 1e-2, result.verdict
    assert result.replay.bindings["self.model"] == "tiny causal model"


ENGINE = source("""
    import torch
    import util.misc as misc  # not installed here: a stand-in


    def train_one_epoch(model, data_loader, optimizer, accum_iter, start=0, mixup_fn=None, total=None):
        metric_logger = misc.MetricLogger(delimiter="  ")
        for data_iter_step, batch in enumerate(
            metric_logger.log_every(data_loader, 10, "Epoch"), start=start
        ):
            if total is not None and data_iter_step >= total:
                break
            for group in optimizer.param_groups:
                group["lr"] = 1e-4 * group["lr_scale"]
            if mixup_fn is not None:
                batch = mixup_fn(batch)
            with torch.autocast(device_type=device_type, enabled=use_amp):
                loss = model(**batch).loss / accum_iter
            loss.backward()
            torch.cuda.synchronize()
            with open(log_file, "a") as log:
                log.write(str(loss.item()))
            if (data_iter_step + 1) % accum_iter == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


def test_a_timm_style_engine_loop_reaches_its_step():
    """Scaffolding of real engines (issue 18, item 4): the enclosing function's literal
    defaults (`start=0`; `None` where the loop tests `is None`), a stand-in logger wrapped
    around the data (`log_every`), a layer-wise `lr_scale` in the parameter groups,
    `torch.autocast` and `open` handed names the harness could not bind, and
    `torch.cuda.synchronize()` on a CPU machine."""
    result = check(ENGINE, line_of(ENGINE, "for data_iter_step"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result
    bindings = result.replay.bindings
    assert bindings["start"] == "0, as assigned before the statement"
    assert bindings["mixup_fn"] == bindings["total"] == "None, as assigned before the statement"
    assert bindings["data_loader"] == "4 micro-batches as dict batches"
    assert bindings["use_amp"] == bindings["log_file"] == "stub"


ITERATION_ENGINE = source("""
    import torch
    from common.logger import MetricLogger  # not installed here: stand-ins
    from datasets.data_utils import prepare_sample


    def inner_loop(model, data_loader, optimizer, iters_per_epoch, accum_grad_iters, cuda):
        data_loader = iter(data_loader)
        metric_logger = MetricLogger(delimiter="  ")
        for i in metric_logger.log_every(range(iters_per_epoch), 50, "Train"):
            if i >= iters_per_epoch:
                break
            samples = prepare_sample(next(data_loader), cuda_enabled=cuda)
            if not isinstance(samples, dict):
                samples = {"is_empty": True}
            samples.update({"iters": i})
            output = model(samples)
            loss_dict = {k: v for k, v in output.items() if "loss" in k}
            loss = output["loss"] / accum_grad_iters
            loss.backward()
            if (i + 1) % accum_grad_iters == 0:
                optimizer.step()
                optimizer.zero_grad()
            metric_logger.update(**loss_dict)
""")


def test_lavis_iteration_loop_reaches_its_step():
    """LAVIS's iteration-based loop (and Video-LLaMA's, built on it): a stand-in
    `log_every` handed `range(iters_per_epoch)` yields its turns; a stand-in handed the batch
    (`prepare_sample`) returns it; the batch is a dict, as a collate function's is; the
    model handed the whole batch (`model(samples)`) takes the entries its `forward` names;
    and `metric_logger.update(**loss_dict)`, whose value is dropped, is not a model."""
    result = check(ITERATION_ENGINE, line_of(ITERATION_ENGINE, "for i in"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result
    bindings = result.replay.bindings
    assert bindings["iters_per_epoch"] == bindings["metric_logger"] == "stub", bindings
    assert bindings["model"] == "tiny causal model"


def test_a_dict_batch_moves_its_tensors_and_keeps_what_the_loop_added():
    batch = Batch(input_ids=torch.ones(2, 3), iters=3)
    moved = batch.to(torch.float64)
    assert isinstance(moved, dict) and moved.iters == 3
    assert moved.input_ids.dtype == torch.float64 and batch.input_ids.dtype == torch.float32


HANDED_LOSS = source("""
    def train(model, loader, optimizer, loss_fn, accum_steps):
        for step, batch in enumerate(loader):
            logits = model(batch["input_ids"])
            loss = loss_fn(logits, batch["labels"]) / accum_steps
            loss.backward()
            if (step + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


def test_a_loss_function_the_loop_is_handed_is_the_harness_loss():
    """`loss_fn(logits, labels)` of a parameter (issue 18, item 4): the harness's own loss on
    token logits (B, T, V), not a stand-in that reaches no backward."""
    result = check(HANDED_LOSS, line_of(HANDED_LOSS, "for step"), k=4, device="cpu")
    assert result.verdict == "bug reproduced" and result.error > 1e-2, result.verdict
    assert result.replay.bindings["loss_fn"].startswith("the harness's loss"), result.replay


SELF_SCORED = source("""
    def train(model, train_loader, optim, steps, accum):
        for i in range(steps):
            for _ in range(accum):
                loss, (ce_loss, aux_loss) = model(next(train_loader), return_loss=True)
                (loss / accum).backward()
            print(ce_loss.item())
            optim.step()
            optim.zero_grad()
""")


# DialoGPT's loop: no `return_loss`, but what the loop backpropagates is the first value the
# model returns, handed the batch's tensors by position; its breakdown unpacked later, as
# SoundStorm's trainer does.
RETURNED_LOSS = source("""
    def train(model, train_dataloader, optimizer, accum):
        for i, batch in enumerate(train_dataloader):
            input_ids, position_ids, token_ids, label_ids, *_ = batch
            loss, breakdown = model(input_ids, position_ids, token_ids, label_ids)
            ppl, aux = breakdown
            loss = loss / accum
            loss.backward()
            print(ppl.item(), aux.item())
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("loop", [SELF_SCORED, RETURNED_LOSS], ids=["return_loss", "returned"])
def test_a_model_that_scores_its_own_sequences_is_replayed(loop, packed):
    """lucidrains' models take the token sequence and return their loss
    (`model(seq, return_loss=True)`), here unpacked with a breakdown; so does a model whose
    returned value (or its first) the loop backpropagates, whatever else it is handed: the
    harness serves bare sequences to a tiny model of that shape. On sequences of varied
    length mean/K is off; on fixed-length ones it is exact."""
    line = line_of(loop, "for i")
    result = check(loop, line, k=4, divisor_names=["accum"], device="cpu", packed=packed)
    assert result.replay.bindings["model"] == "tiny sequence model", result.replay
    if packed:
        assert result.verdict == "verified" and result.error < 1e-5, result.verdict
    else:
        assert result.verdict == "bug reproduced" and result.error > 1e-2, result.verdict


@pytest.mark.parametrize("packed", [False, True])
def test_a_part_or_switch_of_the_users_model_is_unset_and_its_loss_breakdown_reads_zero(packed):
    """A trainer reads its model's critic and adversarial switch before the micro-steps, which
    the tiny model has not (each a stub: the critic is used after the step, the switch left
    unset), and logs a term of the loss breakdown it unpacks (zero). The loss is what decides:
    mean/K is off on sequences of varied length, exact on fixed-length ones."""
    text = (FIXTURES / "ga001_exact_annotated_tokenizer_parts_read.py").read_text()
    result = check(text, line_of(text, "def train_step"), k=4, device="cpu", packed=packed)
    bindings = result.replay.bindings
    assert bindings["model.critic"].startswith("stub: a part or a switch of your model"), bindings
    assert "model.adversarial" in bindings, bindings
    if packed:
        assert result.verdict == "verified" and result.error < 1e-5, result.verdict
    else:
        assert result.verdict == "bug reproduced" and result.error > 1e-2, result.verdict


# MEGABYTE's training script as `gaaudit fix` leaves it: the model (rewritten in its own
# module) returns its count when asked, and the optimizer's name rebinds an imported module.
COUNT_RETURNED = source("""
    import torch
    import torch.optim as optim

    optim = optim.Adam(model.parameters(), lr=1e-4)

    for i in range(steps):
        window_tokens = 0
        for __ in range(accum):
            loss, micro_tokens = model(next(train_loader), return_loss=True, return_count=True)
            window_tokens += micro_tokens
            (loss * micro_tokens).backward()
        window_tokens = max(float(window_tokens), 1.0)
        for group in optim.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(window_tokens)
        optim.step()
        optim.zero_grad()
""")


def test_a_count_the_model_returns_and_an_optimizer_named_like_a_module_are_replayed():
    """The tiny sequence model returns its loss and its count of targets when asked
    (`return_count=True`, what the fix asks of a model it also rewrites), and `optim`, bound
    to `torch.optim` by an import and then to the optimizer, is the harness's optimizer."""
    line = line_of(COUNT_RETURNED, "for i in")
    result = check(COUNT_RETURNED, line, k=4, divisor_names=["accum"], device="cpu")
    assert result.replay.bindings["optim"] == "recording SGD", result.replay.bindings
    assert result.verdict == "verified" and result.error < 1e-5, result.verdict


# CodeBERT's code2nl loop: turns counted by a progress bar over a range, micro-batches drawn
# from a cycled loader, a tuple batch unpacked by name, and a project encoder-decoder called
# by keyword that returns its mean loss, the loss times its count, and the count.
KEYED_TURNS = source("""
    from itertools import cycle

    from tqdm import tqdm

    def train(model, optimizer, train_dataloader, device, args, num_train_optimization_steps):
        bar = tqdm(range(num_train_optimization_steps), total=num_train_optimization_steps)
        train_dataloader = cycle(train_dataloader)
        nb_tr_steps = 0
        for step in bar:
            batch = next(train_dataloader)
            batch = tuple(t.to(device) for t in batch)
            source_ids, source_mask, target_ids, target_mask = batch
            loss, _, _ = model(
                source_ids=source_ids,
                source_mask=source_mask,
                target_ids=target_ids,
                target_mask=target_mask,
            )
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            bar.set_description(f"loss {loss.item():.4f}")
            nb_tr_steps += 1
            if nb_tr_steps % args.gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


# The same loop correct: each micro-batch's loss sum backpropagated, the gradients divided once
# by the window's count.
KEYED_SUM = {
    "loss, _, _ = model(": "_, loss_sum, count = model(",
    "loss = loss / args.gradient_accumulation_steps\n        loss.backward()": (
        "loss_sum.backward()\n        total = total + count"
    ),
    'f"loss {loss.item():.4f}"': 'f"loss {loss_sum.item():.4f}"',
    "optimizer.step()": (
        "for param in model.parameters():\n"
        "                param.grad /= total\n"
        "            optimizer.step()"
    ),
    "nb_tr_steps = 0": "nb_tr_steps, total = 0, 0",
}
# CodeXGLUE's code-to-text loop: the bar wraps the loader itself.
KEYED_LOADER = {
    "tqdm(range(num_train_optimization_steps), total=num_train_optimization_steps)": (
        "tqdm(train_dataloader)"
    ),
    "        batch = next(train_dataloader)\n": "",
    "for step in bar": "for batch in bar",
}


@pytest.mark.parametrize("loader", [False, True], ids=["range-turns", "loader-turns"])
@pytest.mark.parametrize("correct", [False, True], ids=["mean-over-k", "sum-and-count"])
def test_a_keyword_encoder_decoder_loop_is_replayed_over_its_own_window(loader, correct):
    """The bar over a range counts turns, so the loader alone serves the window (K
    micro-batches, known); the keyword model's mean over K misses the full batch, the sum of
    its loss times count divided once by the counts it returns matches it."""
    text = KEYED_TURNS
    for old, new in {**(KEYED_SUM if correct else {}), **(KEYED_LOADER if loader else {})}.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    result = check(text, line_of(text, "for "), k=4, device="cpu")
    assert result.replay.model_kind == "keyed" and result.replay.drawn == 4, result
    if correct:
        assert result.verdict == "verified" and result.error < 1e-5, result
    else:
        assert result.verdict == "bug reproduced" and result.error > 1e-2, result


# modded-nanogpt's step: two optimizers and their schedulers stepped in a `zip`, and a model
# told not to return its logits.
OPTIMIZER_LIST = source("""
    def train(model, loader, optimizers, schedulers, accum):
        for step, (x, y) in enumerate(loader):
            _, loss = model(x, y, return_logits=False)
            (loss / accum).backward()
            if (step + 1) % accum == 0:
                for opt, sched in zip(optimizers, schedulers):
                    opt.step()
                    sched.step()
                model.zero_grad(set_to_none=True)
""")


def test_optimizers_and_schedulers_stepped_in_a_zip_are_lists_of_one():
    result = check(OPTIMIZER_LIST, line_of(OPTIMIZER_LIST, "for step"), k=4, device="cpu")
    bindings = result.replay.bindings
    assert bindings["optimizers"].startswith("a list of one optimizer"), bindings
    assert bindings["schedulers"] == "a list of one inert scheduler", bindings
    assert result.verdict == "bug reproduced" and result.replay.drawn == 4, result


# Megatron's timers: called with a string, like `get_batch("train")`, but their result is a
# timer whose methods the loop calls, not a batch.
TIMED = source("""
    def train(model, loader, optimizer, timers, accum):
        for step, batch in enumerate(loader):
            timers("forward").start()
            loss = model(**batch).loss / accum
            timers("forward").stop()
            loss.backward()
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


def test_a_function_called_with_a_string_whose_result_has_methods_serves_no_data():
    result = check(TIMED, line_of(TIMED, "for step"), k=4, device="cpu")
    assert "timers" not in result.replay.bindings or result.replay.bindings["timers"] == "stub"
    assert result.verdict == "bug reproduced" and result.replay.drawn == 4, result


@pytest.mark.parametrize(
    ("change", "bound"),
    [
        ({}, -1),
        ({"ignore_index=-1": "ignore_index=None"}, None),  # None: a caller's value stands in
        (  # assigned only on one path: the default is not what the method reads
            {
                "        self.ignore_index = ignore_index\n": "        if model:\n"
                "            self.ignore_index = ignore_index\n"
            },
            None,
        ),
    ],
)
def test_a_trainer_class_reads_its_init_defaults_and_an_einops_call_serves_no_data(change, bound):
    """A lucidrains-style trainer made without running `__init__`: `self.ignore_index =
    ignore_index` reads the parameter's literal default; `rearrange(logits, "b n c -> b c n")`
    (a string after what it transforms) is a library call, not a data source."""
    from gaaudit.harness.analysis import analyse
    from gaaudit.harness.surroundings import literal

    text = (FIXTURES / "ga001_trainer_class_einops_rearrange.py").read_text()
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    plan = analyse(text, line_of(text, "for _ in range(num_steps)"))
    assert ("rearrange",) not in plan.roles
    assert plan.roles[("self", "train_loader")] == "data"
    derived = {d.chain: d.value for d in plan.derived}
    value = derived.get(("self", "ignore_index"))  # left out: not evaluable, a stub
    assert (literal(value)[1] if value else None) == bound


def test_rows_cut_into_inputs_and_targets_are_served_as_token_ids():
    """lit-gpt's packed blocks: `train_data[:, 0 : model.config.block_size]` is a window of
    each row of one token tensor, not a field of a tuple."""
    from gaaudit.harness.analysis import analyse

    text = (FIXTURES / "ga001_exact_packed_blocks_config_block_size.py").read_text()
    assert analyse(text, line_of(text, "for iter_num")).data_tensor
    indexed = text.replace("train_data[:, 0 : model.config.block_size]", "train_data[0]")
    assert not analyse(indexed, line_of(indexed, "for iter_num")).data_tensor


@pytest.mark.parametrize(
    "config",
    ["gradient_accum_steps = 16\n", "class C:\n    gradient_accum_steps = 16\ncfg = C()\n"],
)
def test_k_read_from_an_imported_config_is_the_replays_k(tmp_path, monkeypatch, config):
    """`from project.config import cfg` (InstructLLaMA's SFT script), or a config module: the
    loop's K is the replay's, not the project's 16 (its first window then holds K = 4)."""
    module = f"trainconfig_{len(config)}"  # one module per case: imports are cached
    (tmp_path / f"{module}.py").write_text(config)
    monkeypatch.syspath_prepend(str(tmp_path))
    header = f"from {module} import cfg\n" if "class" in config else f"import {module} as cfg\n"
    text = header + source("""
        import torch.nn.functional as F

        def train(model, optimizer, loader):
            for i, batch in enumerate(loader):
                loss = model(**batch).loss / cfg.gradient_accum_steps
                loss.backward()
                if (i + 1) % cfg.gradient_accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """)
    result = check(text, line_of(text, "for i, batch"), k=4, device="cpu")
    assert result.replay.bindings["cfg.gradient_accum_steps"] == "K = 4", result.replay.bindings
    assert result.replay.drawn == 4 and result.verdict == "bug reproduced", result


GROUP_AND_NEXT_WINDOW = source("""
    import torch.distributed as dist

    def train(model, loader, optimizer, accum_steps):
        bar = None
        profiler = None
        if rank == 0:
            bar = tqdm.tqdm(range(100))
            if cfg.use_profiler:
                profiler = make_profiler()
        for it, batch in enumerate(loader):
            loss = model(**batch).loss / accum_steps
            loss.backward()
            if it % accum_steps == 0:
                world = dist.get_world_size()
                model.clip_grad_norm_(1.0 / world)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                bar.update(1)
                if profiler is not None:
                    profiler.step()
""")


def test_a_loop_that_wants_a_process_group_is_replayed_through_its_short_first_window():
    """A loop calling `torch.distributed` unguarded runs as the one rank of a group; FSDP's
    `model.clip_grad_norm_` clips like torch's; a name set to None and then to something else
    under a condition is a stub (`bar.update`), but None where the loop tests it (`profiler`),
    whose `step()` is no optimizer's. So the replay goes past the short first window's step
    (GA007) to the next one, of K micro-batches, where mean/K shows."""
    text = GROUP_AND_NEXT_WINDOW
    result = check(text, line_of(text, "for it"), k=4, device="cpu")
    assert result.window == 1 and abs(result.first_error - 0.75) < 1e-3, result
    assert result.window_verdict == "bug reproduced" and 1e-3 < result.error < 0.75, result
    assert result.replay.bindings["bar"] == "stub", result.replay.bindings
    assert result.replay.bindings["profiler"] == "None, as assigned before the statement"


PROFILED_EVERY_MICRO_BATCH = source("""
    def train(args, model, loader, optimizer, accum_steps):
        with profiling_context(args) as prof:
            for batch_idx, batch in enumerate(loader):
                accumulate = (batch_idx + 1) % accum_steps == 0
                loss = model(**batch).loss / accum_steps
                loss.backward()
                if accumulate:
                    optimizer.step()
                    optimizer.zero_grad()
                prof.step()
""")


def test_a_profiler_stepped_every_micro_batch_is_no_optimizer():
    """fsdp_qlora's loop: `prof`, bound by a profiling context the replay cannot enter,
    steps once per micro-batch. Taken for an optimizer, it ended the first window after one
    micro-batch; it is a stub, and the window holds K."""
    text = PROFILED_EVERY_MICRO_BATCH
    result = check(text, line_of(text, "for batch_idx"), k=4, device="cpu")
    assert result.replay.bindings["prof"] == "stub", result.replay.bindings
    assert result.window is None and result.replay.drawn == 4, result
    assert result.verdict == "bug reproduced", result


PICKED_STREAM = """\
def train(model, streams, weights, optimizer, k, steps):
    for step in range(steps):
        stream = pick_batches(streams, weights)
        batch = next(stream)
        loss = model(**batch).loss / k
        loss.backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_call_whose_result_the_loop_draws_from_with_next_serves_the_data():
    """`stream = pick_batches(streams, weights); batch = next(stream)`: the call returns an
    iterator the loop draws each batch from, as an iterated call does."""
    text = PICKED_STREAM
    result = check(text, line_of(text, "for step"), k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


FIELDS_NAMED_BY_POSITION = source("""
    import torch

    DTYPES = {"tokens": torch.long, "weights": torch.float}


    def named(batch):
        names = [next(n for n, dtype in DTYPES.items() if v.dtype == dtype) for v in batch]
        return {name: value for name, value in zip(names, batch)}


    def train(model, loader, optimizer, k):
        for step, batch in enumerate(loader):
            loss = model(**named(batch), return_loss=True)
            (loss / k).backward()
            if (step + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
""")


def test_a_helper_that_names_a_tuple_batchs_fields_passes_the_harness_batch_on():
    """`model(**named(batch))`, where `named` zips names with the fields of the user's tuple
    batches: the harness's batches are named already, so the helper passes them on (run on
    them, it would read the keys of a dict as fields) and the bug shows."""
    text = FIELDS_NAMED_BY_POSITION
    line = line_of(text, "for step")
    assert analyse(text, line).roles[("named",)] == "namer"
    unzipped = text.replace("zip(names, batch)", "zip(names, names)")
    assert ("named",) not in analyse(unzipped, line).roles
    result = check(text, line, k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


IMPORTED_DATA_NAME = """\
from project.reporting import batch_stats


def train_on(model, batch, optimizer, accelerator):
    out = model(**batch)
    accelerator.backward(out.loss)
    optimizer.step()
    optimizer.zero_grad()
    return batch_stats(out.loss)
"""


def test_an_imported_function_named_like_data_leaves_the_parameter_the_micro_batch():
    """`batch_stats(...)`, imported: it does not draw the function's data, so `batch` is still
    the micro-batch its caller hands it each call."""
    from gaaudit.harness.analysis import analyse

    text = IMPORTED_DATA_NAME
    line = line_of(text, "def train_on")
    assert analyse(text, line).roles[("batch",)] == "micro-batch"
    result = check(text, line, k=4, device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


RESOLVED_OPTION = source("""
    import argparse


    def train(args, model, loader, optimizer):
        if args.total_steps < 0:
            args.total_steps = args.epochs * len(loader)
        args.scale = args.scale / args.accum_steps
        done = 0
        for step, batch in enumerate(loader):
            if done >= args.total_steps:
                break
            (model(**batch).loss * args.scale).backward()
            if (step + 1) % args.accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
                done += 1


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--total_steps", default=-1, type=int)
        parser.add_argument("--accum_steps", default=8, type=int)
        parser.add_argument("--scale", default=1.0, type=float)
""")


def test_an_option_the_script_sets_before_the_loop_does_not_hold_its_default():
    """`args.total_steps = ...` before the loop resolves the -1 default: the loop reads a stub
    there, not -1, which would end it at once. An option of another default the code sets
    again from itself (DialoGPT's `args.train_batch_size = args.train_batch_size // K`) keeps
    its default, which a stub would not scale the loss by."""
    text = RESOLVED_OPTION
    result = check(text, line_of(text, "for step"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert result.error > 1e-2, result.error


SOMETIMES_WEIGHTED = """\
def train(model, loader, optimizer, k):
    weight = 1.0
    for step, batch in enumerate(loader):
        if "weight" in batch:
            weight = batch.pop("weight")
        (weight * model(**batch).loss / k).backward()
        if (step + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_name_the_loop_binds_only_under_a_condition_holds_its_value_from_before():
    """`weight = 1.0` before the loop, bound again only for batches that hold a weight: on the
    harness's batches it is still 1.0 (not an unbound local)."""
    text = SOMETIMES_WEIGHTED
    result = check(text, line_of(text, "for step"), k=4, divisor_names=["k"], device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert result.replay.bindings["weight"] == "1.0, as assigned before the statement"


MODEL_PARALLEL_BRANCH = """\
def train(args, model, loader, optimizer):
    for step, batch in enumerate(loader):
        if args.tensor_model_parallel_size > 1:
            loss = sharded_forward(model, batch)
        else:
            loss = model(**batch).loss
        (loss / args.grad_accum).backward()
        if (step + 1) % args.grad_accum == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_degree_of_model_parallelism_is_one_in_the_replay():
    """`args.tensor_model_parallel_size > 1` is false on one process, as `args.world_size > 1`
    is: the loop takes its branch without model parallelism."""
    text = MODEL_PARALLEL_BRANCH
    result = check(text, line_of(text, "for step"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


def test_a_model_scoring_its_batch_beside_a_mapping_of_extra_losses_reproduces_the_bug():
    """`main_loss, extra = model(tokens, targets, images=pixels)` whose first value the loop
    sums with `extra.values()` and hands a loss scaler: a model that scores itself (the tiny
    sequence model), returning no extra terms; the batch unpacks into inputs first (`tokens`),
    the epoch's resumed start (`enumerate(loader, start=first_step)`) counts from 0, and
    `--precision` among its choices picks the cast."""
    fixture = FIXTURES / "ga001_loss_scaler_extra_loss_dict.py"
    source = fixture.read_text()
    plan = analyse(source, line_of(source, "def train_epoch"))
    assert plan.model_kind == "sequence" and plan.returns == (None, dict)
    assert plan.data_keys == ("input_ids", "labels", None, "pixel_values")
    assert plan.settings["precision"] == "bf16"
    result = check(source, line_of(source, "def train_epoch"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason


def test_the_options_of_the_scripts_calling_a_function_reach_its_arguments(tmp_path):
    """`train_one_epoch(..., args)` in an engine module reads options that the script beside
    it, which imports and calls it, parses: their defaults (a mode among its choices too, not
    a path) stand in for what it hands over; a script that does not call it gives none."""
    from gaaudit.commands.verify import _caller_options

    engine = tmp_path / "engine.py"
    engine.write_text("def train_one_epoch(model, loader, args):\n    pass\n")
    (tmp_path / "main.py").write_text(
        "import argparse\nfrom engine import train_one_epoch\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--precision', choices=['bf16', 'tf32'], default='bf16')\n"
        "parser.add_argument('--weight', type=float, default=0.5)\n"
        "parser.add_argument('--output_dir', default='./out')\n"
        "train_one_epoch(None, None, parser.parse_args())\n"
    )
    (tmp_path / "other.py").write_text(
        "import argparse\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float, default=0.1)\n"
    )
    assert _caller_options(engine, "train_one_epoch") == (("precision", "bf16"), ("weight", 0.5))


# A script whose rows are cut to a context length set by an option, sharded by a helper of its
# own package (which imports a library missing here) in a layout that the script leaves unset,
# and scored by a loss class of a kernel library missing here too.
SHARDED = {
    "train.py": """\
import argparse

import torch
from accelerate import Accelerator
from fused_kernels_not_installed.losses import CrossEntropyLoss

from shardkit import local_shard


def main(args, model, optimizer, loader):
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation_steps)
    loss_fn = CrossEntropyLoss(backward_in_place=True)
    for batch in loader:
        rows = batch["input_ids"][..., : args.context + 1]
        positions = torch.arange(args.context).expand(rows.shape[0], -1)
        shard = local_shard(
            args.layout,
            rows[..., :-1],
            rows[..., 1:],
            positions,
            accelerator.process_index,
            accelerator.num_processes,
        )
        with accelerator.accumulate(model):
            logits = model(shard["inputs"], position_ids=shard["positions"]).logits
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), shard["targets"].reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulation-steps", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layout", choices=["striped", "blocked"])
    main(parser.parse_args(), None, None, None)
""",
    "shardkit/__init__.py": """\
from ring_exchange_not_installed import all_to_all

from .layouts import blocked, striped


def local_shard(layout, inputs, targets, positions, rank, world):
    if layout == "striped":
        pick = striped
    elif layout == "blocked":
        pick = blocked
    else:
        raise ValueError(f"unknown layout {layout}")
    named = {"inputs": inputs, "targets": targets, "positions": positions}
    return {name: pick(rows, rank, world) for name, rows in named.items()}
""",
    "shardkit/layouts.py": """\
import torch


def striped(rows, rank, world):
    parts = rows.chunk(2 * world, dim=1)
    return torch.cat([parts[rank], parts[2 * world - 1 - rank]], dim=1)


def blocked(rows, rank, world):
    return rows.chunk(world, dim=1)[rank]
""",
}


def test_rows_cut_to_an_option_and_sharded_by_a_module_that_cannot_be_imported(tmp_path):
    """A package of the project whose import fails (a library missing here) is defined from
    its source, so its sharding runs; the layout the script leaves unset is the first of its
    choices; the context length the rows are cut to is the harness's rows'; the loss class of
    a missing kernel library is the harness's cross-entropy. Every target is a token of the
    rows, cut to one length: accelerate's mean/K is exact."""
    for relative, text in SHARDED.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    result = gaaudit("verify", "train.py", "-k", "4", "--device", "cpu", "-f", "json", cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    (loop,) = json.loads(result.stdout)["loops"]
    (row,) = loop["rows"]
    assert row["original_verdict"] == "verified" and row["original_error"] < 1e-5, row


DRAWN_WHOLE_AND_CUT = """\
def train(model, stream, optimizer, criterion, args):
    for step in range(args.steps):
        (rows,) = next(stream)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        size = args.batch_size // args.accum_freq
        for j in range(args.accum_freq):
            x, y = inputs[j * size : (j + 1) * size], targets[j * size : (j + 1) * size]
            logits, _, _ = model(x)
            loss = criterion(logits.reshape(-1, args.vocab_size), y.reshape(-1))
            (loss * x.shape[0] / inputs.shape[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("weighting", "verdict"),
    [("(loss * x.shape[0] / inputs.shape[0])", "verified"), ("loss", "bug reproduced")],
)
def test_a_batch_drawn_with_next_and_cut_by_size_over_k_is_the_whole_window(weighting, verdict):
    """`next(stream)` in a loop whose backward sits in an inner loop over slices of
    `args.batch_size // args.accum_freq` rows: the draw serves the whole window, the size cut
    into K parts is the window's, and the tiny model's logits come first in what the loop
    unpacks. Weighted by its share of rows each slice's mean is exact; undivided, K times off."""
    text = DRAWN_WHOLE_AND_CUT.replace("(loss * x.shape[0] / inputs.shape[0])", weighting)
    result = check(text, line_of(text, "for step"), k=4, device="cpu")
    assert result.verdict == verdict, result.replay.reason
    bindings = result.replay.bindings
    assert bindings["args.batch_size"].endswith("samples, the window's"), bindings
    assert (
        bindings["stream"] == "the whole window as one (input_ids,) tuple (the loop splits it)"
    ), bindings


MASKED_AUTOENCODER = source("""
    def pretrain(model, loader, optimizer, loss_scaler, accum_iter):
        for step, (images, _) in enumerate(loader):
            loss, _, _ = model(images, mask_ratio=0.75)
            loss_scaler(loss / accum_iter, optimizer, update_grad=(step + 1) % accum_iter == 0)
""")


@pytest.mark.parametrize(("packed", "verdict"), [(True, "verified"), (False, "bug reproduced")])
def test_a_model_handed_a_mask_ratio_is_a_masked_autoencoder(packed, verdict):
    """`loss, _, _ = model(images, mask_ratio=0.75)` whose loss reaches a loss scaler scores
    itself, as a masked autoencoder of images does, not a model of token sequences: it masks as
    many patches of every image, so mean/K is exact on micro-batches of one size and off on
    unequal ones."""
    text = MASKED_AUTOENCODER
    result = check(text, line_of(text, "def pretrain"), k=4, device="cpu", packed=packed)
    assert result.replay.model_kind == "masked", result.replay.reason
    assert result.verdict == verdict, result


def test_a_metric_logged_engine_handing_its_model_the_whole_batch_is_replayed():
    """`model(batch, mode=mode)` whose first loss reaches a loss scaler scores the dict batch
    it is handed (the stand-in reads its token ids); a metric logger's `log_every(loader,
    len(loader) // 20)` serves the loader (the harness's is too short for that frequency), and
    a schedule computed from an option left unset (`--lr` None) leaves the groups' rate a
    number, which the loop logs."""
    text = (FIXTURES / "ga001_loss_scaler_whole_batch_task_modes.py").read_text()
    result = check(text, line_of(text, "def train_one_epoch"), k=4, device="cpu")
    assert result.replay.model_kind == "sequence", result.replay.reason
    assert result.verdict == "bug reproduced", result


RECORDED_TURNS = """\
import argparse
import torch.nn.functional as F

def options():
    p = argparse.ArgumentParser()
    p.add_argument("--align", type=str)
    p.add_argument("--head", type=str, default="soft")
    p.add_argument("--accum", type=int, default=8)
    return p.parse_args()

def train(model, loader, optimizer, args):
    turns = numbered(loader, args.accum)
    for info, batch in turns:
        if args.align == "shifted":
            x, y = batch["input_ids"][:, :-1], batch["labels"][:, 1:]
        elif args.align == "same":
            x, y = batch["input_ids"], batch["labels"]
        else:
            raise KeyError(args.align)
        if args.head in ("soft", "hard"):
            out = model(input_ids=x, prefix=None)
        else:
            raise KeyError(args.head)
        loss = F.cross_entropy(out.view(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        if info["index"] == args.accum - 1:
            optimizer.step()
            optimizer.zero_grad()
"""


def test_a_record_of_the_turn_beside_each_batch_and_a_mode_the_loop_dispatches_on():
    """`for info, batch in turns` with `info` read by keys no batch has: the data's items
    lead with a record whose every item is the turn's count (the step comes at `index` K - 1).
    `--align` has no default but the loop raises for any value it does not name: the first it
    names; `--head` keeps its string default, which the loop compares with strings (a mode,
    not a path). The model handed `input_ids=` whose result is viewed is the logits model."""
    plan = analyse(RECORDED_TURNS, line_of(RECORDED_TURNS, "for info"))
    assert plan.recorded == {("turns",)} and plan.data_arity == 0
    assert plan.settings["align"] == "shifted" and plan.settings["head"] == "soft"
    assert plan.model_kind == "logits"
    result = check(RECORDED_TURNS, line_of(RECORDED_TURNS, "for info"), k=4, device="cpu")
    assert result.verdict == "bug reproduced", result.replay.reason
    assert result.error > 1, result.error  # K means summed, undivided
    assert "record of the turn" in result.replay.bindings["turns"]


def test_abstract_hooks_stand_in_and_image_fields_of_a_text_batch_read_none():
    """The class around a loop, abstract where its subclasses live in other modules, is made
    with each abstract method doing nothing and each abstract property a stub; a text batch
    reads an image field it lacks as None, and any other missing key raises KeyError."""
    import abc

    from gaaudit.harness.bindings import _stand_in_hook

    class Strategy(abc.ABC):
        @property
        @abc.abstractmethod
        def world(self): ...

        @abc.abstractmethod
        def clip_grad_norm(self) -> None: ...

    hooks = {name: _stand_in_hook(Strategy, name) for name in Strategy.__abstractmethods__}
    made = object.__new__(type("Strategy", (Strategy,), hooks))
    assert made.clip_grad_norm() is None and isinstance(made.world, Stub)
    text = Batch(input_ids=torch.ones(2, 3), labels=torch.ones(2, 3))
    assert text["pixel_values"] is None and text["multimodal_indices"] is None
    with pytest.raises(KeyError):
        text["token_types"]
    with pytest.raises(KeyError):  # a batch with images: a missing image field is missing
        Batch(pixel_values=torch.ones(1))["images"]
