"""What two causal LMs must share to be routed token by token, and what they may differ in.

They share token ids: the tokenizer's vocabulary (``len(tokenizer)``), not the embedding matrix, which checkpoints
pad to a multiple of some size (Qwen2-1.5B embeds 151,936 rows, Qwen2-72B 152,064, for one 151,646-token
tokenizer). Logits are therefore cut to the shared vocabulary wherever a token is chosen or compared, so a padded
row can never be emitted or handed to the other model.

They may sit on different devices (the LLM split by an accelerate ``device_map``): inputs go to each model's
input-embedding device, and callers bring results back to one place.

Our ragged KV cache gives every query all of its row's earlier keys, which is exactly full causal attention; a
sliding-window or mixed-attention layer would silently see too much, so such models are refused, by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class PairingError(ValueError):
    """A model the routed engine cannot run; the message names the model."""


def model_label(model: nn.Module) -> str:
    """The model's path or hub id as it was loaded (``<ClassName>`` for a model built in memory)."""
    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    return str(name) or f"<{type(model).__name__}>"


def embedding_rows(model: nn.Module) -> int:
    """Rows of the output head: the logits' width, ``>= len(tokenizer)`` when the embedding is padded."""
    return int(model.config.get_text_config(decoder=True).vocab_size)


def shared_vocab_size(slm: nn.Module, llm: nn.Module | None, vocab_size: int | None = None) -> int:
    """The number of token ids both models may emit: ``vocab_size`` (pass ``len(tokenizer)``) or, without a
    tokenizer at hand, the smaller embedding. Refuses a ``vocab_size`` larger than either model's embedding."""
    models = [m for m in (slm, llm) if m is not None]
    return vocab_within([(model_label(m), embedding_rows(m)) for m in models], vocab_size)


def vocab_within(widths: Sequence[tuple[str, int]], vocab_size: int | None) -> int:
    """:func:`shared_vocab_size` for models given as (name, logits' width) pairs, whatever runs them."""
    if vocab_size is None:
        return min(n for _, n in widths)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise PairingError(f"vocab_size must be a positive integer (len(tokenizer)), got {vocab_size!r}")
    for name, n in widths:
        if n < vocab_size:
            raise PairingError(f"{name}: embeds {n} tokens, fewer than the tokenizer's {vocab_size}")
    return vocab_size


def cut_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits[..., :vocab_size]`` -- padded embedding rows are never chosen (a view, no copy)."""
    return logits[..., :vocab_size]


class VocabCut:
    """A transformers ``LogitsProcessor`` that masks ids ``>= vocab_size`` for ``generate`` (which needs the full
    width back); applied to the assistant's logits too in assisted generation, whatever their width."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] <= self.vocab_size:
            return scores
        return scores.index_fill(
            -1, torch.arange(self.vocab_size, scores.shape[-1], device=scores.device), float("-inf")
        )


def input_device(model: nn.Module) -> torch.device:
    """Where the model takes its input ids: its input embedding's device (with a ``device_map``, not the first
    parameter's, which may be any layer's)."""
    return model.get_input_embeddings().weight.device


def attention_kinds(config: Any) -> list[str]:
    """The kinds of attention layers a config builds, e.g. ``['full_attention']`` or
    ``['full_attention', 'sliding_attention (window 4096)']``.

    ``layer_types`` (transformers >= 4.54) decides when present. Without it a set ``sliding_window`` means every layer
    slides (Mistral), unless ``use_sliding_window`` is false (Qwen2/Qwen3's default keeps the number but ignores it).
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        kinds = sorted(set(types))
    elif window is not None and getattr(cfg, "use_sliding_window", True):
        kinds = ["sliding_attention"]
    else:
        kinds = ["full_attention"]
    return [f"{k} (window {window})" if k == "sliding_attention" and window else k for k in kinds]


def check_full_attention(config: Any, name: str) -> None:
    """Refuse, in one line naming the model and its layer kinds, a model with any layer that is not full attention."""
    kinds = attention_kinds(config)
    other = [k for k in kinds if k != "full_attention"]
    if other:
        raise PairingError(
            f"{name}: {', '.join(other)} layers are not supported (routed decoding needs full-attention layers only; "
            f"model_type {getattr(config, 'model_type', '?')!r})"
        )
