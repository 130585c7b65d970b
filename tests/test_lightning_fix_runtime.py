"""The Lightning fix at runtime on two processes: a LightningModule returning its mean loss to
a Trainer with `accumulate_grad_batches`, fixed by `gaaudit fix`, trained by a real Lightning
Trainer under DDP (gloo, two CPU processes, each with its own micro-batches): at the
optimizer step its gradient is the full batch's of both processes' micro-batches (the
window's count summed over them, their number folded in, since DDP averages); the original
module's is not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gaaudit.config import Settings
from gaaudit.fixes.fixer import fix_source
from gaaudit.harness.gradcheck import relative_error

pytest.importorskip("lightning")

K, ROWS, WIDTH, VOCAB = 4, 2, 10, 32
MODULE = textwrap.dedent(
    """\
    import lightning as L
    import torch
    import torch.nn.functional as F


    class Tagger(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 8)
            self.head = torch.nn.Linear(8, 32)

        def training_step(self, batch, batch_idx):
            logits = self.head(self.embed(batch["input_ids"]))
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)


    def fit(batches, out):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            accumulate_grad_batches=4,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Recorder(out)],
        )
        torch.manual_seed(0)
        trainer.fit(Tagger(), torch.utils.data.DataLoader(batches, batch_size=None))
    """
)
RUN = textwrap.dedent(
    """

    class Recorder(L.Callback):
        \"\"\"Rank 0 saves the gradients the optimizer's first step used.\"\"\"

        def __init__(self, out):
            self.out = out

        def on_train_start(self, trainer, pl_module):
            def record(optimizer, args, kwargs):
                if trainer.global_rank == 0 and not self.out.exists():
                    torch.save([p.grad.clone() for p in pl_module.parameters()], self.out)

            trainer.optimizers[0].register_step_post_hook(record)


    if __name__ == "__main__":
        import sys
        from pathlib import Path

        fit(torch.load(sys.argv[1]), Path(sys.argv[2]))
    """
)


def micro_batches() -> list[dict[str, torch.Tensor]]:
    """2 K micro-batches of one width with 1 to 9 labelled targets a row (the rest -100):
    the distributed sampler hands the even ones to rank 0, the odd ones to rank 1."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(2 * K):
        ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator)
        labels = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator)
        labels[:, 1 + i :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def gradient(batches, mean_of_means: bool = False) -> list[torch.Tensor]:
    """The module's gradient on `batches` joined into one batch, or (`mean_of_means`) the
    average of each micro-batch's mean loss, which the original's two processes step with
    (Lightning's mean/K on each, DDP's average over them)."""
    namespace: dict = {}
    exec(compile(MODULE, "module.py", "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    module = namespace["Tagger"]()
    groups = [[b] for b in batches] if mean_of_means else [batches]
    for group in groups:
        ids = torch.cat([b["input_ids"] for b in group])
        labels = torch.cat([b["labels"] for b in group])
        logits = module.head(module.embed(ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        (loss / len(groups)).backward()
    return [p.grad for p in module.parameters()]


def two_process_step(source: str, tmp_path: Path, name: str) -> list[torch.Tensor]:
    script, data, out = tmp_path / f"{name}.py", tmp_path / "batches.pt", tmp_path / f"{name}.pt"
    script.write_text(source + RUN)
    torch.save(micro_batches(), data)
    result = subprocess.run(
        [sys.executable, str(script), str(data), str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.exists(), result.stdout[-2000:] + result.stderr[-4000:]
    return torch.load(out)


def test_the_fixed_module_on_two_processes_steps_with_the_full_batch_of_both(tmp_path):
    fixed = fix_source(MODULE.encode(), Path("module.py"), Settings()).after.decode()
    assert "def on_before_optimizer_step(self, optimizer, *args):" in fixed
    reference = gradient(micro_batches())
    assert relative_error(gradient(micro_batches(), mean_of_means=True), reference) > 0.05
    assert relative_error(two_process_step(fixed, tmp_path, "fixed"), reference) < 1e-5
