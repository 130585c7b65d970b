"""One accumulation window of variable-length, right-padded micro-batches, fixed by a seed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from gaaudit.harness.models import VOCAB, ignore_value

MASK_ID = 1  # the [MASK] token of the tiny MLM; real tokens are drawn from 2..VOCAB-1


@dataclass(frozen=True)
class Window:
    """K micro-batches (`micro`) and the same sequences as one batch (`full`); padded labels
    hold `ignore_index`."""

    kind: str
    micro: list[dict[str, torch.Tensor]]
    full: dict[str, torch.Tensor]
    ignore_index: int

    def to(self, device) -> Window:
        move = lambda b: {name: t.to(device) for name, t in b.items()}
        return Window(self.kind, [move(b) for b in self.micro], move(self.full), self.ignore_index)


def make_records(kind: str, n: int, seed: int = 0, min_len: int = 4, max_len: int = 32) -> list:
    """`n` unpadded samples for `kind`: dicts of 1-D `input_ids` and `labels` tensors."""
    gen = torch.Generator().manual_seed(seed)
    length = lambda: int(torch.randint(min_len, max_len + 1, (), generator=gen))
    tokens = lambda m: torch.randint(2, VOCAB, (m,), generator=gen)
    records = []
    for _ in range(n):
        if kind in ("nanogpt", "logits"):
            seq = tokens(length() + 1)
            records.append({"input_ids": seq[:-1], "labels": seq[1:]})
        elif kind == "seq2seq":
            records.append({"input_ids": tokens(length()), "labels": tokens(length())})
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


def collate(kind: str, records: list, ignore_index: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad `records` into one batch: pad id 0, labels padded with the ignored value."""
    def pad(key, value):
        width = max(len(r[key]) for r in records)
        return torch.stack([torch.cat([r[key], r[key].new_full((width - len(r[key]),), value)])
                            for r in records])

    batch = {"input_ids": pad("input_ids", 0)}
    if kind != "nanogpt":
        lengths = torch.tensor([len(r["input_ids"]) for r in records])
        batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]).long()
    batch["labels"] = pad("labels", ignore_value(kind, ignore_index))
    return batch


def split_window(kind: str, records: list, k: int, ignore_index: int | None = None) -> Window:
    """`records` cut into `k` contiguous micro-batches whose sizes differ by at most one."""
    if not 1 <= k <= len(records):
        raise ValueError(f"cannot split {len(records)} samples into {k} micro-batches")
    bounds = [round(i * len(records) / k) for i in range(k + 1)]
    micro = [collate(kind, records[a:b], ignore_index) for a, b in itertools.pairwise(bounds)]
    return Window(kind, micro, collate(kind, records, ignore_index),
                  ignore_value(kind, ignore_index))


def make_window(kind: str, k: int, micro_batch_size: int = 2, seed: int = 0, min_len: int = 4,
                max_len: int = 32, ignore_index: int | None = None, packed: bool = False) -> Window:
    """A window of `k` micro-batches of `micro_batch_size` random-length samples each; with
    `packed`, every sample is `max_len` long (fixed-length blocks: nothing is padded)."""
    records = make_records(kind, k * micro_batch_size, seed, max_len if packed else min_len,
                           max_len)
    return split_window(kind, records, k, ignore_index)
