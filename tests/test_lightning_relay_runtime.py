"""The Lightning fix of a loss made two calls deep, at runtime: `training_step` gets it from
`shared_step`, which makes it on one path of an `if` with a cross-entropy module and on the
other with a label-smoothed helper that counts its targets
(`fixtures/ga003_lightning_smoothing_branch_helper.py`). A real Lightning Trainer with
`accumulate_grad_batches` trains the fixture's module on a tiny BART over micro-batches padded
to different target counts: on either path, the fixed module's gradient at the optimizer step is
the gradient of the window's token mean; the original's is not."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from gaaudit.harness.gradcheck import relative_error

pl = pytest.importorskip("pytorch_lightning")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ga003_lightning_smoothing_branch_helper"
K, ROWS, WIDTH = 4, 2, 9


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny BART, built from a config (no weights downloaded) and saved where the module's
    `from_pretrained` reads it."""
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bart")
    transformers.BartForConditionalGeneration(config).save_pretrained(path)
    return str(path)


def micro_batches(pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K (input ids, output ids) micro-batches of one width, whose targets end in padding
    after 1 to 7 tokens a row: each holds its own number of targets."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for i in range(K):
        inputs = torch.randint(3, 64, (ROWS, WIDTH), generator=generator)
        outputs = torch.randint(3, 64, (ROWS, WIDTH), generator=generator)
        outputs[0, 2 + i :] = pad
        outputs[1, 8 - 2 * i :] = pad
        out.append((inputs, outputs))
    return out


def summarizer(source: Path, model_path: str, smoothing: float):
    namespace: dict = {"__name__": source.stem}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # noqa: S102
    args = argparse.Namespace(model_path=model_path, label_smoothing=smoothing, lr=0.0)
    return namespace["Summarizer"](args)


class Recorder(pl.Callback):
    """The gradients the optimizer's one step used."""

    def on_train_start(self, trainer, pl_module):
        def record(optimizer, args, kwargs):
            self.grads = [p.grad.clone() for p in pl_module.parameters()]

        trainer.optimizers[0].register_step_post_hook(record)


def stepped(module, batches) -> list[torch.Tensor]:
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=K,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return recorder.grads


def full_batch(module, batches) -> list[torch.Tensor]:
    """The gradient of the window's token mean: each micro-batch's mean (the original
    `shared_step`'s) weighted by its non-pad targets."""
    counts = [(outputs[:, 1:] != module.pad_token_id).sum() for _, outputs in batches]
    total = sum(counts)
    for (inputs, outputs), count in zip(batches, counts):
        (module.shared_step(inputs, outputs) * count / total).backward()
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["cross-entropy", "label-smoothed"])
def test_the_fixed_relay_steps_with_the_full_batchs_token_mean(model_path, smoothing):
    original = FIXTURE.with_suffix(".py")
    pad = summarizer(original, model_path, smoothing).pad_token_id
    batches = micro_batches(pad)
    reference = full_batch(summarizer(original, model_path, smoothing), batches)
    before = stepped(summarizer(original, model_path, smoothing), batches)
    after = stepped(summarizer(FIXTURE.with_suffix(".fixed.py"), model_path, smoothing), batches)
    assert relative_error(before, reference) > 1e-3
    assert relative_error(after, reference) < 1e-5
