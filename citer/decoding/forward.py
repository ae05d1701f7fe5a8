"""One forward call of a causal LM that returns both the logits and the router's input.

The router reads the SLM's last-layer hidden state after the final norm, at the position that predicts the next token.
This function is the one definition of that vector: the engine, the KV cache's appends and label collection all call
it, so a router is trained on exactly what it later sees. Shapes: B = rows, T = tokens, V = vocab, H = hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache

from citer.decoding.lean import lean_decoder


def right_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ``(ids, mask)``, both (B, T) long on the CPU, right-padded to the longest (T) with ``pad_id``.

    Full-sequence passes (teacher forcing, pretraining) read position t of row r only where ``mask[r, t]`` is 1, so
    the padding sits after the tokens and no position ids are needed."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


def decoder_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
    *,
    last_index: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    n_pos: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a causal LM and return ``(logits, hidden)``; hidden is the last layer's output after the final norm.
    Families :mod:`citer.decoding.lean` covers run its lean forward (same weights, same arithmetic), others HF's.

    input_ids (B, T) -> logits (B, T, V), hidden (B, T, H); with ``last_index`` (B,) only that position of each row:
    logits (B, V), hidden (B, H) (the head then runs on B vectors, not B*T). A pair (batch_idx (n,), pos_idx (n,))
    picks n arbitrary positions: logits (n, V), hidden (n, H). ``n_pos``: a bound on the positions known on the host
    (the lean forward otherwise takes it from the mask's key count, or reads the positions back).
    """
    lean = lean_decoder(model)
    if lean is not None and (
        attention_mask is None or isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
    ):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
            n_pos = input_ids.shape[1]
        elif n_pos is None and attention_mask is not None:
            n_pos = attention_mask.shape[-1]  # positions index key columns, so they stay below the key count
        elif n_pos is None:
            n_pos = int(position_ids.max()) + 1
        hidden = lean.hidden(input_ids, position_ids, attention_mask, cache, n_pos)  # (B, T, H)
        head = lean.logits
    else:
        out = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        hidden = out.last_hidden_state  # (B, T, H)
        head = model.get_output_embeddings()
    if isinstance(last_index, tuple):
        hidden = hidden[last_index[0], last_index[1]]  # (n, H)
    elif last_index is not None and hidden.shape[1] == 1:
        hidden = hidden[:, 0]  # (B, H): one token per row, a view instead of a gather
    elif last_index is not None:
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]  # (B, H)
    return head(hidden), hidden
