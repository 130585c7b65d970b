"""One accumulation window of variable-length, right-padded micro-batches, fixed by a seed."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from gaaudit.harness.models import LABELS, ignore_value, vocab_size
from gaaudit.harness.nets import NET_KINDS, PAD_ID, PADDED_KINDS, SIZED_KINDS, net_record

MASK_ID = 1  # the [MASK] token of the tiny MLM; real tokens are drawn from 2..vocab_size()-1
PER_SEQUENCE = ("classify", "pooled")  # kinds with one label per sequence


@dataclass(frozen=True)
class Window:
    """K micro-batches (`micro`) and the same samples as one batch (`full`); padded labels
    hold `ignore_index`. `label_smoothing` belongs to the reference loss of the image kinds."""

    kind: str
    micro: list[dict[str, torch.Tensor]]
    full: dict[str, torch.Tensor]
    ignore_index: int
    label_smoothing: float = 0.0

    def to(self, device) -> Window:
        move = lambda b: {name: t.to(device) for name, t in b.items()}
        return dataclasses.replace(self, micro=[move(b) for b in self.micro], full=move(self.full))


def make_records(
    kind: str,
    n: int,
    seed: int = 0,
    min_len: int = 4,
    max_len: int = 32,
    ignore_index: int | None = None,
) -> list:
    """`n` unpadded samples for `kind`: dicts of `input_ids` (token ids, an image or features)
    and `labels` tensors (the latent kind: `pixel_values` and the caption's `input_ids`)."""
    gen = torch.Generator().manual_seed(seed)
    length = lambda: int(torch.randint(min_len, max_len + 1, (), generator=gen))
    tokens = lambda m: torch.randint(2, vocab_size(), (m,), generator=gen)
    records = []
    for _ in range(n):
        if kind in NET_KINDS:
            records.append(net_record(kind, gen, length, tokens, ignore_value(kind, ignore_index)))
        elif kind in ("nanogpt", "logits", "teacher"):
            seq = tokens(length() + 1)
            records.append({"input_ids": seq[:-1], "labels": seq[1:]})
        elif kind == "seq2seq":
            records.append({"input_ids": tokens(length()), "labels": tokens(length())})
        elif kind in PER_SEQUENCE:
            label = torch.randint(0, LABELS, (), generator=gen)
            records.append({"input_ids": tokens(length()), "labels": label})
        elif kind == "mlm":
            ids = tokens(length())
            masked = torch.rand(len(ids), generator=gen) < 0.15
            masked[int(torch.randint(len(ids), (), generator=gen))] = True
            labels = torch.where(masked, ids, torch.tensor(-100))
            records.append({"input_ids": torch.where(masked, MASK_ID, ids), "labels": labels})
        else:
            ids = tokens(length())
            records.append({"input_ids": ids, "labels": ids.clone()})
    return records


def collate(
    kind: str, records: list, ignore_index: int | None = None, widths: dict | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad `records` into one batch (each key to its `widths` entry at least): PAD_ID,
    labels padded with the ignored value; fixed-shape samples (images, features) are stacked."""
    if kind == "frames":  # spectrograms padded with silence to one length; a transcript apiece
        width = max(
            (widths or {}).get("input_ids", 0), *(r["input_ids"].shape[-1] for r in records)
        )
        return {
            "input_ids": torch.stack(
                [F.pad(r["input_ids"], (0, width - r["input_ids"].shape[-1])) for r in records]
            ),
            "labels": torch.stack([r["labels"] for r in records]),
            "text": torch.full((len(records), 1), 2),  # which the stand-in does not read
        }
    if kind in NET_KINDS and kind not in PADDED_KINDS:
        return {key: torch.stack([r[key] for r in records]) for key in records[0]}

    def pad(key, value):
        width = max((widths or {}).get(key, 0), *(len(r[key]) for r in records))
        return torch.stack(
            [torch.cat([r[key], r[key].new_full((width - len(r[key]),), value)]) for r in records]
        )

    batch = {"input_ids": pad("input_ids", PAD_ID)}
    if kind not in ("nanogpt", *PADDED_KINDS):
        lengths = torch.tensor([len(r["input_ids"]) for r in records])
        batch["attention_mask"] = (
            torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]
        ).long()
    if kind in PER_SEQUENCE:
        batch["labels"] = torch.stack([r["labels"] for r in records])
    else:
        batch["labels"] = pad("labels", ignore_value(kind, ignore_index))
    return batch


def split_window(
    kind: str, records: list, k: int, ignore_index: int | None = None, ragged: bool = False
) -> Window:
    """`records` cut into `k` contiguous micro-batches whose sizes differ by at most one, all
    padded to the window's width: the full batch is exactly their concatenation, also for a
    model that reads the padding (no attention mask). `ragged`: each micro-batch padded to its
    own longest sample instead, as a collator padding to the longest does."""
    if not 1 <= k <= len(records):
        raise ValueError(f"cannot split {len(records)} samples into {k} micro-batches")
    bounds = [round(i * len(records) / k) for i in range(k + 1)]
    widths = {
        key: max(r[key].shape[-1] if r[key].dim() else 0 for r in records)
        for key in ("input_ids", "labels")
        if key in records[0]
    }
    micro = [
        collate(kind, records[a:b], ignore_index, None if ragged else widths)
        for a, b in itertools.pairwise(bounds)
    ]
    return Window(
        kind, micro, collate(kind, records, ignore_index), ignore_value(kind, ignore_index)
    )


def merge_batches(batches: list[dict], ignore_index: int) -> dict[str, torch.Tensor]:
    """Micro-batches as one batch (the inverse of split_window): sequences right-padded to the
    widest, labels with `ignore_index`, everything else with 0."""
    merged = {}
    for key in batches[0]:
        tensors = [b[key] for b in batches]
        if tensors[0].dim() == 2:
            width = max(t.shape[1] for t in tensors)
            fill = ignore_index if key == "labels" else 0
            tensors = [F.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors]
        merged[key] = torch.cat(tensors)
    return merged


def make_window(
    kind: str,
    k: int,
    micro_batch_size: int = 2,
    seed: int = 0,
    min_len: int = 4,
    max_len: int = 32,
    ignore_index: int | None = None,
    packed: bool = False,
    label_smoothing: float = 0.0,
    ragged: bool = False,
) -> Window:
    """A window of `k` micro-batches of `micro_batch_size` random-length samples each; with
    `packed`, every sample is `max_len` long (fixed-length blocks: nothing is padded); for
    `ragged`, see split_window. For SIZED_KINDS the window is one sample short unless `packed`,
    so that its micro-batches (and any K chunks of the whole window) differ in size, as the
    last batch of an epoch does."""
    short = kind in SIZED_KINDS and not packed and k > 1 and micro_batch_size > 1
    records = make_records(
        kind,
        k * micro_batch_size - short,
        seed,
        max_len if packed else min_len,
        max_len,
        ignore_index,
    )
    window = split_window(kind, records, k, ignore_index, ragged)
    return dataclasses.replace(window, label_smoothing=label_smoothing)
