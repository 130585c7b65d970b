"""`gaaudit fix` on GA004 (Trainer overrides) and GA005 (JAX accumulation): which rewrite each
finding gets, when it is unsafe or refused and why. The rewrites are proven at runtime in
tests/test_trainer_fix_runtime.py and tests/test_optax_fix_runtime.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, flat

from gaaudit import catalogue
from gaaudit.checks.engine import check_file
from gaaudit.config import Settings
from gaaudit.findings import Confidence
from gaaudit.fixes.fixer import fix_source
from gaaudit.fixes.trainer import DEEPSPEED_ONCE, STOCK_DIVIDES

ALL = Settings(min_confidence=Confidence.LOW)


def fix(source: str, unsafe: bool = True):
    """(fixed text, [(line, code, applied, reason)]) of a dedented source."""
    result = fix_source(textwrap.dedent(source).encode(), Path("train.py"), ALL, unsafe)
    return result.after.decode(), [
        (o.line, o.site.code, o.applied, o.reason) for o in result.outcomes
    ]


def clean(text: str, tmp_path: Path) -> bool:
    path = tmp_path / "fixed.py"
    path.write_text(text)
    return check_file(path, ALL).findings == []


SFT = """\
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, Trainer

    class SFT(Trainer):
        def compute_loss(
            self,
            model,
            inputs,
            return_outputs=False,
        ):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(){ignore})
    """


def test_token_sum_keeps_a_one_per_line_signature(tmp_path):
    text, outcomes = fix(SFT.format(ignore=""), unsafe=False)
    assert "        return_outputs=False,\n        num_items_in_batch=None,\n    ):" in text
    factor = (
        "(self.accelerator.num_processes if num_items_in_batch is not None and "
        "self.args.average_tokens_across_devices else 1)"
    )
    summed = f'reduction="sum") * {factor} / (num_items_in_batch if num_items_in_batch'
    assert flat(summed) in flat(text)
    assert flat("(labels[:, 1:].flatten() != -100).sum())") in flat(text)
    ((line, code, applied, reason),) = outcomes
    assert (line, code, applied) == (5, "GA004", True) and "sums its `cross_entropy`" in reason
    assert clean(text, tmp_path)


def test_another_ignore_value_than_the_trainers_count_is_unsafe():
    text, outcomes = fix(SFT.format(ignore=", ignore_index=0"), unsafe=False)
    ((_, _, applied, reason),) = outcomes
    assert not applied and "apply with --unsafe-fixes" in reason
    assert "the Trainer counts labels != -100 but this loss ignores `0`" in reason
    assert text == textwrap.dedent(SFT.format(ignore=", ignore_index=0"))


def test_training_step_signature_and_super_call():
    text, outcomes = fix(
        """\
        from transformers import Trainer

        class Counting(Trainer):
            def training_step(self, model, inputs):
                self.seen = getattr(self, "seen", 0) + 1
                return super().training_step(model, inputs)
        """
    )
    assert "def training_step(self, model, inputs, num_items_in_batch=None):" in text
    assert "return super().training_step(model, inputs, num_items_in_batch)" in text
    assert outcomes == [
        (4, "GA004", True, "`training_step` accepts `num_items_in_batch` and passes it on")
    ]


PINNED_OVERRIDES = """\
from transformers import Trainer


class Passing(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


class Counting(Trainer):
    def training_step(self, model, inputs):
        return super().training_step(model, inputs)


class Dividing(Trainer):
    def training_step(self, model, inputs):
        loss = self.compute_loss(model, inputs)
        loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()
"""


def test_under_a_pin_before_4_46_no_rewrite_calls_the_newer_trainer(tmp_path, cli):
    """transformers 4.43's Trainer takes no `num_items_in_batch` in `compute_loss` or
    `training_step` and has no `compute_loss_func`: passing the count on, or testing those,
    would fail there, so the project's pin is named and GA006 comes first."""
    (tmp_path / "requirements.txt").write_text("transformers==4.43.4\n")
    script = tmp_path / "trainers.py"
    script.write_text(PINNED_OVERRIDES)
    result = cli("fix", "--min-confidence", "low", "--unsafe-fixes", "trainers.py", cwd=tmp_path)
    assert script.read_text() == PINNED_OVERRIDES, result.output
    refusals = [line for line in result.output.splitlines() if "GA004 not fixed" in line]
    assert len(refusals) == 4, result.output  # `Dividing`: its signature and its division
    for line in refusals:
        assert "pins `transformers==4.43.4` (requirements.txt line 1)" in line, line
        assert "require transformers>=4.46.2 first (GA006)" in line, line
    (tmp_path / "requirements.txt").write_text("transformers>=4.46.2\n")
    result = cli("fix", "--min-confidence", "low", "--unsafe-fixes", "trainers.py", cwd=tmp_path)
    assert "num_items_in_batch" in script.read_text(), result.output


CAUSAL_SFT = """\
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Trainer


class SFT(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits
        loss = F.cross_entropy(logits{logits}.reshape(-1, logits.size(-1)), labels{labels}.reshape(-1))
        return (loss, outputs) if return_outputs else loss


def main(args, data):
    model = AutoModelForCausalLM.from_pretrained("gpt2")
    SFT(model=model, args=args, train_dataset=data).train()
"""


@pytest.mark.parametrize(
    ("pin", "shift", "fixed"),
    [
        ("transformers==4.51.2", False, True),  # counts every label, as this loss does
        ("transformers==4.51.2", True, False),  # counts every label, this loss one fewer a row
        ("transformers>=5.10.1", False, False),  # a causal LM: counts `labels[..., 1:]`
        ("transformers>=5.10.1", True, True),
    ],
)
def test_a_causal_lms_token_sum_counts_what_the_pinned_trainer_counts(
    tmp_path, cli, pin, shift, fixed
):
    """Before 5.10.1 the Trainer counts every label that is not -100; from 5.10.1 on,
    `labels[..., 1:]` for a model whose loss shifts its labels. The token sum is safe only
    where its targets are the positions the governing release counts."""
    (tmp_path / "requirements.txt").write_text(f"{pin}\n")
    source = CAUSAL_SFT.format(
        logits="[..., :-1, :]" if shift else "", labels="[..., 1:]" if shift else ""
    )
    (tmp_path / "train.py").write_text(source)
    result = cli("fix", "--min-confidence", "low", "train.py", cwd=tmp_path)
    (line,) = [line for line in result.output.splitlines() if "GA004" in line]
    assert ("GA004 fixed" in line) is fixed, line
    if pin.startswith("transformers==") and not fixed:
        assert "`transformers==4.51.2` (requirements.txt line 1) counts every label" in line


def test_an_inline_training_step_division_keeps_the_stock_condition(tmp_path):
    """`backward(loss / K)` becomes `backward(loss / K if <stock condition> else loss)`,
    which GA004 and GA001 then read as the Trainer's own fallback, and tells DeepSpeed not
    to divide it again."""
    text, outcomes = fix(
        """\
        from transformers import Trainer

        class T(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                self.accelerator.backward(loss / self.args.gradient_accumulation_steps)
                return loss.detach()
        """
    )
    condition = STOCK_DIVIDES
    once = f"**({DEEPSPEED_ONCE} if self.is_deepspeed_enabled else {{}})"
    expected = (
        f"backward(loss / self.args.gradient_accumulation_steps if {condition} else loss, {once},)"
    )
    assert flat(expected) in flat(text)
    assert [o[1:3] for o in outcomes] == [("GA001", True), ("GA004", True)]
    assert clean(text, tmp_path)


def test_a_division_bound_to_another_name_keeps_its_value_and_says_deepspeed_divides(tmp_path):
    """`total = loss / K` is not put under the stock condition whole (`total` would be unbound
    where the stock step does not divide) but becomes `loss / K if <condition> else loss`; its
    `total.backward()` is no `self.accelerator.backward(...)` to tell DeepSpeed not to divide
    again, so the fix is unsafe and says so."""
    source = """\
        from transformers import Trainer

        class T(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                total = loss / self.args.gradient_accumulation_steps
                total.backward()
                return loss.detach()
        """
    _, outcomes = fix(source, unsafe=False)
    (reason,) = [o[3] for o in outcomes if o[1] == "GA004"]
    assert "reaches no `self.accelerator.backward(...)`" in reason, reason
    assert "under DeepSpeed the engine divides it by the accumulation steps again" in reason
    text, _ = fix(source)
    expected = (
        f"total = (loss / self.args.gradient_accumulation_steps if {STOCK_DIVIDES} else loss)"
    )
    assert flat(expected) in flat(text)
    assert "scale_wrt_gas" not in text


def test_division_of_a_loss_computed_elsewhere_is_refused():
    source = """\
        from transformers import Trainer

        class Manual(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = model(**inputs).loss
                loss = loss / self.args.gradient_accumulation_steps
                self.accelerator.backward(loss)
                return loss.detach()
        """
    text, outcomes = fix(source)
    assert text == textwrap.dedent(source)
    assert [(line, code, applied) for line, code, applied, _ in outcomes] == [
        (6, "GA001", False),
        (6, "GA004", False),
    ]
    assert "does not come from `self.compute_loss(...)`" in outcomes[1][3]


def test_forward_with_one_token_loss_takes_the_loss_kwargs(tmp_path):
    source = """\
        import torch.nn.functional as F
        from torch import nn
        from transformers import Trainer

        class Tagger(nn.Module):
            def forward(self, features, labels=None):
                logits = self.proj(features)
                loss = F.cross_entropy(logits.view(-1, 9), labels.view(-1))
                return {"loss": loss, "logits": logits}

        def main(args):
            Trainer(model=Tagger(), args=args).train()
        """
    text, outcomes = fix(source, unsafe=False)
    assert "def forward(self, features, labels=None, num_items_in_batch=None, **kwargs):" in text
    assert "num_items_in_batch = (labels.view(-1) != -100).sum()" in text
    assert outcomes[0][2] and "takes the Trainer's loss kwargs" in outcomes[0][3]
    assert clean(text, tmp_path)


def test_forward_with_two_loss_terms_is_refused_with_a_reason():
    path = FIXTURES / "ga004_custom_module_forward_ner.py"
    result = fix_source(path.read_bytes(), path, ALL, unsafe=True)
    ((outcome),) = result.outcomes
    assert not outcome.applied and not result.changed
    assert "cannot be made a token sum" in outcome.reason
    assert "the Trainer already divides its mean by the accumulation steps" in outcome.reason


def test_a_step_that_withholds_the_count_becomes_the_stock_step(tmp_path):
    """A `training_step` override that calls `compute_loss` without the count is given the
    stock step's count, guard and DeepSpeed flag, and logs the loss undivided. (Unsafe here
    for `compute_loss`'s own reason: its targets are not shifted, a causal LM's count is.)"""
    path = FIXTURES / "ga004_training_step_withholds_count.py"
    (finding,) = check_file(path, ALL).findings
    assert "TypeError" not in finding.message  # the step calls it without the count
    assert "accelerator divides by nothing in `backward`" in finding.message
    result = fix_source(path.read_bytes(), path, ALL, unsafe=True)
    ((outcome),) = result.outcomes
    assert outcome.applied, outcome.reason
    assert outcome.reason.endswith(
        "; `DocReaderTrainer.training_step` (line 24) hands `compute_loss` the count and divides "
        "by the accumulation steps only where the stock step does"
    )
    safe = fix_source(path.read_bytes(), path, ALL).outcomes[0].reason
    assert "cannot tell whether the Trainer counts the same positions" in safe
    text = result.after.decode()
    assert "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)" in text
    assert flat(STOCK_DIVIDES) in flat(text)
    assert "    loss = loss / self.args.gradient_accumulation_steps\n" in text
    assert flat('**({"scale_wrt_gas": False} if self.is_deepspeed_enabled else {})') in flat(text)
    assert "return loss.detach()\n" in text
    assert clean(text, tmp_path)


def test_a_compute_loss_dividing_by_the_steps_itself_is_refused_not_opted_out():
    """Opting out would have the Trainer divide by K again (K squared), and a token sum over
    its count would still be divided by K: refused, naming the division."""
    path = FIXTURES / "ga004_compute_loss_divides_by_steps_itself.py"
    (finding,) = check_file(path, ALL).findings
    assert "the loss divides by the accumulation steps itself" in finding.message
    assert "K times too large" not in finding.message
    result = fix_source(path.read_bytes(), path, ALL, unsafe=True)
    ((outcome),) = result.outcomes
    assert not outcome.applied and not result.changed
    assert outcome.reason.startswith(
        "`compute_loss` divides its loss by `self.args.gradient_accumulation_steps` (line 14)"
    ), outcome.reason


def test_a_step_that_withholds_the_count_from_another_backward_is_refused():
    """The stock step backpropagates through `self.accelerator.backward(loss)`; a step that
    does not is refused with what to do, and `compute_loss` is left as it is."""
    path = FIXTURES / "ga004_training_step_withholds_count.py"
    source = path.read_text().replace("self.accelerator.backward(loss)", "loss.backward()")
    result = fix_source(source.encode(), path, ALL, unsafe=True)
    ((outcome),) = result.outcomes
    assert not outcome.applied and not result.changed
    assert outcome.reason.startswith(
        "`DocReaderTrainer.training_step` (line 24) does not backpropagate `loss` through one "
        "`self.accelerator.backward(loss)`, as the stock step does: hand it "
        "`num_items_in_batch=num_items_in_batch`"
    ), outcome.reason


def test_opt_out_is_unsafe_and_says_why(cli, tmp_path):
    target = tmp_path / "train.py"
    target.write_bytes((FIXTURES / "ga004_weighted_classification_compute_loss.py").read_bytes())
    result = cli("fix", str(target), "--min-confidence", "low")
    assert result.exit_code == 1
    assert (
        "GA004 not fixed: unsafe fix (the loss cannot be made a token sum (it weights its classes"
        in result.output
    )
    assert (
        "exact only when every micro-batch holds the same number of valid targets" in result.output
    )
    result = cli("fix", str(target), "--unsafe-fixes", "--min-confidence", "low")
    assert result.exit_code == 0
    assert "GA004 fixed: the loss cannot be made a token sum" in result.output
    fixed = FIXTURES / "ga004_weighted_classification_compute_loss.fixed.py"
    assert target.read_bytes() == fixed.read_bytes()


def test_a_division_fixed_by_ga004_is_not_rewritten_again_by_ga001():
    path = FIXTURES / "ga004_training_step_double_division.py"
    result = fix_source(path.read_bytes(), path, ALL)
    outcomes = [(o.line, o.site.code, o.applied) for o in result.outcomes]
    assert outcomes == [(34, "GA001", True), (34, "GA004", True)]
    assert "GA004/GA005 rewrite" in result.outcomes[0].reason


OPTAX = """\
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        losses = per_token(params, batch)
        return {loss}

    def step(params, state, batch, tx):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def train(params, batches, k):
        tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=k)
        state = tx.init(params)
        for batch in batches:
            params, state, loss = step(params, state, batch, tx)
        {after}
        return params
    """


@pytest.mark.parametrize(
    "loss, after, reason",
    [
        ("losses.mean()", "", "the loss is a plain mean over every element"),
        ('jnp.mean(losses, where=batch["valid"]), losses', "", "`has_aux=` does not match"),
        (
            'jnp.mean(losses, where=batch["valid"])',
            "step(params, state, batch, tx)",
            "called in 2 places",
        ),
    ],
    ids=["no-mask", "auxiliary-output", "two-step-calls"],
)
def test_multisteps_fix_is_refused_with_a_reason(loss, after, reason):
    source = OPTAX.format(loss=loss, after=after)
    text, outcomes = fix(source)
    assert text == textwrap.dedent(source)
    ((_, code, applied, why),) = outcomes
    assert code == "GA005" and not applied and reason in why


@pytest.mark.parametrize(
    "aux, applied",
    [
        ('{"valid": jnp.sum(batch["valid"])}', True),
        ('{"loss": mean}', False),  # the fix would make the logged aux the window's share
        ("{**metrics}", False),  # a dict made of the mean beforehand
    ],
    ids=["aux-apart", "aux-reads-the-mean", "aux-bound-from-the-mean"],
)
def test_multisteps_fix_of_a_loss_with_auxiliary_data(aux, applied):
    """`return mean, aux` under `has_aux=True`: fixed where the auxiliary data does not read
    the mean (which becomes the micro-batch's share of its window), else refused."""
    source = (
        OPTAX.format(loss=f"mean, {aux}", after="")
        .replace(
            "        losses = per_token(params, batch)\n",
            "        losses = per_token(params, batch)\n"
            '        mean = jnp.mean(losses, where=batch["valid"])\n'
            '        metrics = {"loss": mean}\n',
        )
        .replace(
            "jax.value_and_grad(loss_fn)(params, batch)",
            "jax.value_and_grad(loss_fn, has_aux=True)(params, batch)",
        )
        .replace("        loss, grads =", "        (loss, aux), grads =")
    )
    assert "has_aux=True" in source and "(loss, aux), grads" in source
    text, outcomes = fix(source)
    ((_, code, done, why),) = outcomes
    assert code == "GA005" and done is applied, why
    if applied:
        assert "use_grad_mean=False" in text and "loss = loss * window_weight / " in text
    else:
        assert "auxiliary outputs read its masked mean" in why


@pytest.mark.parametrize(
    "stem, reason",
    [
        (
            "ga005_multisteps_sums_mean_losses",
            (
                "the loss averages per-row means (`(per_sequence / lengths)`, line 15), so each "
                "micro-batch counts its rows: pass `use_grad_mean=True`"
            ),
        ),
        (
            "ga005_multisteps_grads_normalised_per_micro_batch",
            (
                "the gradients are divided by `num_labels` (line 33), the count each micro-batch "
                "returns beside its summed loss: divide them by the window's total count instead"
            ),
        ),
    ],
    ids=["per-row-means-summed", "gradients-divided-by-own-count"],
)
def test_multisteps_refusal_names_what_the_loss_counts(stem, reason):
    """A refusal says what the micro-batch's loss counts and what MultiSteps needs instead."""
    path = FIXTURES / f"{stem}.py"
    result = fix_source(path.read_bytes(), path, ALL, unsafe=True)
    ((outcome,),) = [result.outcomes]
    assert not outcome.applied and reason in outcome.reason


def test_multisteps_where_mean_reads_windows_ahead(tmp_path):
    text, outcomes = fix(
        OPTAX.format(loss='jnp.mean(losses, where=batch["valid"])', after=""), unsafe=False
    )
    assert 'return jnp.sum(losses, where=batch["valid"]) / window_weight' in text
    assert 'total = jnp.maximum(sum(jnp.sum(batch["valid"]) for batch in window), 1)' in text
    assert "for batch, window_weight in read_ahead(batches):" in text
    assert "every_k_schedule=k, use_grad_mean=False)" in text
    assert outcomes[0][2] and "a last window cut short is counted alone" in outcomes[0][3]
    assert clean(text, tmp_path)


def test_multisteps_loop_run_again_by_an_outer_loop_is_an_unsafe_fix():
    """MultiSteps carries a pass's last, short window into the next pass; reading ahead per
    pass would count the two parts as two windows."""
    source = OPTAX.format(loss='jnp.mean(losses, where=batch["valid"])', after="").replace(
        "for batch in batches:\n            params",
        "for epoch in range(2):\n            for batch in batches:\n                params",
    )
    text, outcomes = fix(source, unsafe=False)
    ((_, code, applied, why),) = outcomes
    assert code == "GA005" and not applied and "carries a pass's last window" in why
    assert text == textwrap.dedent(source)
    text, outcomes = fix(source, unsafe=True)
    assert outcomes[0][2] and "read_ahead(batches)" in text


OPTAX_EPOCHS = """\
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        losses = per_token(params, batch)
        return jnp.mean(losses, where=batch["valid"])

    def step(params, state, batch, tx):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def run_epoch(params, state, batches, tx):
        for batch in batches:
            params, state, loss = step(params, state, batch, tx)
        return params, state

    def train(params, batches, epochs):
        tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
        state = tx.init(params)
        for epoch in range(epochs):{fresh}
            params, state = run_epoch(params, state, batches, tx)
        return params
    """


@pytest.mark.parametrize(
    "fresh", ["", "\n            state = tx.init(params)"], ids=["carried", "fresh"]
)
def test_multisteps_loop_in_a_function_its_caller_runs_again(fresh):
    """`run_epoch(params, state, ...)`, handed the MultiSteps state and returning it, called by
    an epoch loop: a pass's short last window goes on into the next pass, so reading ahead per
    pass is an unsafe fix, naming the caller's loop and the call; where the caller's loop starts
    the state anew (`tx.init`) before each pass, the short window is dropped and the fix is safe."""
    source = OPTAX_EPOCHS.format(fresh=fresh)
    text, outcomes = fix(source, unsafe=False)
    ((_, code, applied, why),) = outcomes
    assert code == "GA005" and applied is bool(fresh), why
    if not fresh:
        assert (
            "unsafe fix (the loop on line 22 runs this one again by calling `run_epoch()`, and "
            "MultiSteps carries a pass's last window" in why
        )
        assert text == textwrap.dedent(source)
    text, outcomes = fix(source, unsafe=True)
    assert outcomes[0][2] and "read_ahead(batches)" in text


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = next(
        line for line in readme.splitlines() if "pip install -e" in line and "pytest" in line
    )
    assert "[verify,test,jax]" in command
    ci_command = command.split("&& ", 2)[2]  # after making and activating the virtualenv
    assert ci_command in (ROOT / ".ci" / "run").read_text()


def test_the_accelerate_fix_reuses_the_users_sync_gradients_block():
    """Issue 17, item 6: the one division goes at the top of the user's own
    `if accelerator.sync_gradients:` block after the backward, before its clipping."""
    original = (FIXTURES / "ga003_accelerate_accumulate_clm.py").read_text()
    text, outcomes = fix(original)
    assert [o[2] for o in outcomes] == [True]
    guard = "if accelerator.sync_gradients:"
    assert text.count(guard) == original.count(guard) == 2
    block = text[text.index(guard) :]
    assert block.index("param.grad.div_(") < block.index("accelerator.clip_grad_norm_(")


HEAD = """\
    from transformers import {head}, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    model = {head}.from_pretrained("checkpoint")
    args = TrainingArguments("out", gradient_accumulation_steps=4{options})
    Trainer(model=model, args=args, train_dataset=rows{given}).train()
    """


@pytest.mark.parametrize(
    "head, options, given, applied, reason",
    [
        ("BertForTokenClassification", "", "", True, ""),
        ("BertForTokenClassification", "", ", **extra", False, "unpacked mapping"),
        ("BertForTokenClassification", ", label_smoothing_factor=0.1", "", False, "smoothing"),
        (
            "BertForTokenClassification",
            ", average_tokens_across_devices=True",
            "",
            False,
            "unsafe fix (`Trainer` gets `compute_loss_func=window_token_loss`",
        ),
        ("T5ForConditionalGeneration", "", "", False, "decoder_input_ids"),
        (
            "T5ForConditionalGeneration",
            "",
            ", data_collator=DataCollatorForSeq2Seq(tokenizer, model=model)",
            True,
            "",
        ),
        ("BertForSequenceClassification", "", "", True, ""),
    ],
)
def test_a_stock_heads_trainer_gets_a_loss_over_the_windows_count(
    tmp_path, head, options, given, applied, reason
):
    """A token head's Trainer gets `compute_loss_func=window_token_loss` where nothing the
    Trainer is given could conflict with it; a head with one label per example an opt-out."""
    text, outcomes = fix(HEAD.format(head=head, options=options, given=given), unsafe=False)
    ((line, code, done, why),) = outcomes
    assert (line, code, done) == (5, "GA004", applied) and reason in why, why
    if applied and head.endswith("SequenceClassification"):
        assert "model.accepts_loss_kwargs = False\nTrainer(" in text
    elif applied:
        assert "def window_token_loss(outputs, labels, num_items_in_batch=None):" in text
        assert "compute_loss_func=window_token_loss" in text and "import torch\n" in text
    if applied:
        assert clean(text, tmp_path)


def test_a_stock_heads_trainer_built_from_a_dict_gets_the_loss_in_it(tmp_path):
    """`Trainer(**trainer_args)` with `trainer_args = dict(...)` in sight: the loss function
    goes into that dict, beside the Trainer's other arguments."""
    source = """\
        from transformers import AutoModelForTokenClassification, Trainer, TrainingArguments

        model = AutoModelForTokenClassification.from_pretrained("checkpoint")
        args = TrainingArguments("out", gradient_accumulation_steps=4)
        trainer_args = dict(
            model=model,
            args=args,
        )
        Trainer(**trainer_args, train_dataset=rows).train()
        """
    text, outcomes = fix(source, unsafe=False)
    assert [(line, done) for line, _, done, _ in outcomes] == [(9, True)]
    assert "    args=args,\n    compute_loss_func=window_token_loss,\n)" in text
    assert "Trainer(**trainer_args, train_dataset=rows).train()" in text
    assert clean(text, tmp_path)


# GA006: a pin raised (safe to a patch release, else unsafe) --------------------------------

TRAINS = """\
from transformers import Trainer, TrainingArguments

args = TrainingArguments(output_dir="out", gradient_accumulation_steps=8)
Trainer(model=model, args=args).train()
"""


@pytest.mark.parametrize(
    "name, before, after",
    [
        (
            "requirements.txt",
            'torch\ntransformers[torch] == 4.30.2 ; python_version >= "3.8"  # pinned\n',
            'torch\ntransformers[torch] >=4.46.2 ; python_version >= "3.8"  # pinned\n',
        ),
        ("requirements.txt", "transformers>=4.30,<4.38\r\n", "transformers>=4.46.2\r\n"),
        ("requirements.txt", "transformers>=4.48.0,<4.48.1\n", "transformers>=4.48.1\n"),
        (
            "setup.py",
            'setup(install_requires=["peft", "transformers==4.33.0", "torch"])\n',
            'setup(install_requires=["peft", "transformers>=4.46.2", "torch"])\n',
        ),
        (
            "pyproject.toml",
            '[project]\ndependencies = [\n    "transformers==4.40.0", "tokenizers==0.19.1",\n]\n',
            '[project]\ndependencies = [\n    "transformers>=4.46.2", "tokenizers==0.19.1",\n]\n',
        ),
        (
            "pyproject.toml",
            '[tool.poetry.dependencies]\ntransformers = "~4.45"\n',
            '[tool.poetry.dependencies]\ntransformers = ">=4.46.2"\n',
        ),
        (
            "pyproject.toml",
            "[tool.poetry.dependencies]\ntransformers = { version = '4.45.2', extras = ['torch'] }\n",
            "[tool.poetry.dependencies]\ntransformers = { version = '>=4.46.2', extras = ['torch'] }\n",
        ),
        (
            "setup.cfg",
            "[options]\ninstall_requires =\n    transformers~=4.40.0\n",
            "[options]\ninstall_requires =\n    transformers>=4.46.2\n",
        ),
        (
            "environment.yml",
            "dependencies:\n  - conda-forge::transformers=4.30\n  - pip:\n    - transformers==4.30.2\n",
            "dependencies:\n  - conda-forge::transformers>=4.46.2\n  - pip:\n    - transformers>=4.46.2\n",
        ),
    ],
)
def test_a_pin_is_raised_in_its_own_syntax_as_an_unsafe_fix(tmp_path, cli, name, before, after):
    """`fix --unsafe-fixes` rewrites only the version constraint (name, extras, marker,
    comment and line ending kept) to the first release with the Trainer's fix; without the
    option the pin is named as an unsafe fix; the raised pin is no finding, and a second run
    changes nothing."""
    (tmp_path / "train.py").write_text(TRAINS)
    pin = tmp_path / name
    pin.write_bytes(before.encode())
    safe = cli("fix", "--no-cache", ".", cwd=tmp_path)
    assert safe.exit_code == 1 and pin.read_bytes() == before.encode(), safe.output
    assert "GA006 not fixed: unsafe fix (" in safe.output and "--unsafe-fixes" in safe.output
    done = cli("fix", "--no-cache", "--unsafe-fixes", ".", cwd=tmp_path)
    assert pin.read_bytes() == after.encode(), done.output
    assert done.exit_code == 0 and "GA006" not in cli("check", "--no-cache", ".").output
    again = cli("fix", "--no-cache", "--unsafe-fixes", ".", cwd=tmp_path)
    assert again.exit_code == 0 and pin.read_bytes() == after.encode()


@pytest.mark.parametrize(
    "name, before, after",
    [
        ("requirements.txt", "transformers==4.48.0  # sft\n", "transformers==4.48.1  # sft\n"),
        ("setup.py", 'setup(install_requires=["transformers==4.46.1"])\n', None),
        (
            "pyproject.toml",
            '[tool.poetry.dependencies]\ntransformers = "4.47.0"\n',
            '[tool.poetry.dependencies]\ntransformers = "==4.47.1"\n',
        ),
    ],
)
def test_an_exact_pin_to_a_release_without_the_fix_gets_its_patch_release_safely(
    tmp_path, cli, name, before, after
):
    """4.46.2, 4.47.1 and 4.48.1 are the patch releases that mended 4.46.0/4.46.1, 4.47.0
    and 4.48.0: an exact pin to one of those moves to its minor's patch release, a safe fix."""
    after = after or before.replace("4.46.1", "4.46.2")
    (tmp_path / "train.py").write_text(TRAINS)
    pin = tmp_path / name
    pin.write_text(before)
    done = cli("fix", "--no-cache", ".", cwd=tmp_path)
    assert done.exit_code == 0 and pin.read_text() == after, done.output
    assert "GA006" not in cli("check", "--no-cache", ".").output


@pytest.mark.parametrize(
    "name, text",
    [
        ("README.md", "Install: `pip install transformers==4.30.2`\n"),
        (
            "requirements.txt",
            "transformers @ git+https://github.com/huggingface/transformers@0dcb46e7a4a9e5\n",
        ),
    ],
)
def test_a_readme_or_a_git_commit_is_named_not_rewritten(tmp_path, cli, name, text):
    (tmp_path / "train.py").write_text(TRAINS)
    (tmp_path / name).write_text(text)
    result = cli(
        "fix", "--no-cache", "--unsafe-fixes", "--min-confidence", "low", ".", cwd=tmp_path
    )
    assert (tmp_path / name).read_text() == text
    assert "GA006 not fixed: a " in result.output, result.output
    assert "require `transformers>=4.46.2` in its place" in result.output


def test_the_pin_is_raised_before_the_trainer_override_it_held_back(tmp_path, cli):
    """With the pin raised first, one `fix --unsafe-fixes` run also gives the Trainer
    override the count the newer Trainer passes: a second run changes nothing."""
    (tmp_path / "requirements.txt").write_text("transformers==4.43.4\n")
    (tmp_path / "train.py").write_text(TRAINS)
    script = tmp_path / "trainers.py"
    script.write_text(PINNED_OVERRIDES)
    cli("fix", "--no-cache", "--min-confidence", "low", "--unsafe-fixes", ".", cwd=tmp_path)
    assert (tmp_path / "requirements.txt").read_text() == "transformers>=4.46.2\n"
    fixed = script.read_text()
    assert "num_items_in_batch" in fixed
    cli("fix", "--no-cache", "--min-confidence", "low", "--unsafe-fixes", ".", cwd=tmp_path)
    assert script.read_text() == fixed


def test_a_scripts_inline_metadata_pin_is_raised_as_the_catalogue_shows():
    """GA006's catalogue example pins transformers in PEP 723 metadata: `--unsafe-fixes`
    makes it the `good` example, byte for byte; without it the pin is named as unsafe."""
    rule = catalogue.load()["GA006"]
    text, outcomes = fix(rule.bad)
    assert text == textwrap.dedent(rule.good)
    assert [(code, applied) for _, code, applied, _ in outcomes] == [("GA006", True)]
    text, outcomes = fix(rule.bad, unsafe=False)
    assert text == textwrap.dedent(rule.bad)
    assert outcomes[0][3].startswith("unsafe fix (`transformers>=4.46.2`")


def test_verify_holds_a_pin_fix_back(tmp_path, cli):
    """`fix --verify` applies only what a replay verifies, and a dependency file is not
    replayed: its pin stays, and the run says why."""
    (tmp_path / "train.py").write_text(TRAINS)
    (tmp_path / "requirements.txt").write_text("transformers==4.48.0\n")
    result = cli("fix", "--no-cache", "--verify", ".", cwd=tmp_path)
    assert (tmp_path / "requirements.txt").read_text() == "transformers==4.48.0\n"
    assert "requirements.txt: fixes held back: --verify replays Python files only" in result.output
    assert result.exit_code == 1
