"""Random-weight Qwen2 models and random prompts for the engine benches.

Only torch and transformers: ``bench/engine_v0.py`` imports this beside an older copy of ``citer``.
"""

from __future__ import annotations

import torch


def random_qwen2(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def prompts_for(vocab: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of mixed lengths (12..24 tokens), ids in [3, vocab), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(12, 25, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
