"""Token lists as one right-padded batch, for full-sequence passes (teacher forcing, pretraining, scoring)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def right_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ``(ids, mask)``, both (B, T) long on the CPU, right-padded to the longest (T) with ``pad_id``.

    Full-sequence passes read position t of row r only where ``mask[r, t]`` is 1, so the padding sits after the
    tokens and no position ids are needed."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask
