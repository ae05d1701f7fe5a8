"""Token lengths of rows against a model's context: which rows cannot be labelled or trained on whole.

A row's length is counted exactly as labels and finetuning encode it: the prompt and the target of
:mod:`citer.data.prompts` tokenized separately without special tokens, plus the EOS that ends every target. The
context is the smallest over the models of ``max_position_embeddings`` and, when it states a real limit, the
tokenizer's ``model_max_length`` (unset tokenizers report 1e30). The models of a pair share token ids, so the first
model's tokenizer counts for all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from citer.data.formats import Format
from citer.data.prompts import build_prompt, build_target
from citer.ops.progress import progress

# A tokenizer's model_max_length at or above this is the library's "no limit" placeholder, not a context size.
_NO_LIMIT = 10**8
_CHUNK = 512


@dataclass(frozen=True)
class ContextBudget:
    """The tokenizer that counts and the number of positions a prompt + reference may fill."""

    tokenizer: Any
    limit: int
    source: str  # which model and which setting gave ``limit``, for messages

    def describe(self) -> str:
        return f"{self.limit} tokens ({self.source})"


def context_limit(name: str, config: Any, tokenizer: Any) -> tuple[int, str]:
    """``(limit, source)`` of one model: its position embeddings or its tokenizer's stated maximum, the smaller."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found: list[tuple[int, str]] = []
    positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        found.append((positions, f"{name}: max_position_embeddings={positions}"))
    stated = getattr(tokenizer, "model_max_length", None)
    if isinstance(stated, int) and 0 < stated < _NO_LIMIT:
        found.append((stated, f"{name}: tokenizer model_max_length={stated}"))
    if not found:
        raise ValueError(
            f"{name}: field max_position_embeddings: missing from the config and the tokenizer states no "
            "model_max_length; the context length cannot be checked"
        )
    return min(found, key=lambda f: f[0])


def load_budget(refs: Sequence[str | os.PathLike[str]], trust_remote_code: bool = False) -> ContextBudget:
    """The budget of the models ``refs`` (directories, ``.gguf`` files or hub ids): config and tokenizer only, no
    weights."""
    from transformers import AutoConfig, AutoTokenizer

    from citer.models.gguf import check_gguf, gguf_config, hf_location, is_gguf

    if not refs:
        raise ValueError("no model given to check row lengths against")
    tokenizer = None
    limits = []
    for ref in refs:
        name = str(ref)
        try:
            if is_gguf(name):  # a llama.cpp file: its metadata is the config, its vocabulary the tokenizer
                check_gguf(name)
                source, file = hf_location(name)
                config, tok = gguf_config(name), AutoTokenizer.from_pretrained(source, gguf_file=file)
            else:
                config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
                tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{name}: cannot read the model's config and tokenizer ({exc})") from exc
        limits.append(context_limit(name, config, tok))
        tokenizer = tokenizer or tok
    limit, source = min(limits, key=lambda f: f[0])  # ties: the first model named
    return ContextBudget(tokenizer, limit, source)


def _count(tokenizer: Any, texts: list[str]) -> list[int]:
    if getattr(tokenizer, "is_fast", False):
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def sequence_lengths(rows: Sequence[Mapping[str, Any]], fmt: Format, tokenizer: Any) -> list[int]:
    """Tokens of prompt + target + EOS per row, as :func:`citer.routing.labels.encode_rows` and finetuning count."""
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0
    out: list[int] = []
    starts = range(0, len(rows), _CHUNK)
    for s in progress(starts, desc="row lengths", total=len(starts), unit="chunk"):
        chunk = rows[s : s + _CHUNK]
        prompts = _count(tokenizer, [build_prompt(r, fmt) for r in chunk])
        targets = _count(tokenizer, [build_target(r, fmt) for r in chunk])
        out.extend(p + t + eos for p, t in zip(prompts, targets, strict=True))
    return out


def over_limit(lengths: Sequence[int], limit: int) -> list[int]:
    """Indexes of the lengths above ``limit``."""
    return [i for i, n in enumerate(lengths) if n > limit]
