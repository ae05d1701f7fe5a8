"""The model pairs ``bench/gpu.py`` measures: random-weight Qwen2 models at the family's real shapes, built directly
on the device in the bench's dtype (weights are random: decoding speed does not depend on what they say)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from citer.decoding.cost import ModelCost

# Real configs (hidden, intermediate, layers, heads, kv heads, vocab rows, tied embeddings) of the Qwen2 family.
SPECS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(hidden=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tie=True),
    "qwen2-1.5b": dict(hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tie=True),
    "qwen2-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tie=False),
    "qwen2.5-14b": dict(hidden=5120, inter=13824, layers=48, heads=40, kv=8, vocab=152064, tie=False),
    # --tiny: same structure (GQA, tied SLM head, different vocab rows), seconds on a CPU.
    "tiny-slm": dict(hidden=32, inter=64, layers=2, heads=4, kv=2, vocab=512, tie=True),
    "tiny-llm": dict(hidden=64, inter=128, layers=3, heads=4, kv=2, vocab=520, tie=False),
}
# Pair name -> (SLM spec, LLM spec).
PAIRS: dict[str, tuple[str, str]] = {
    "0.5b-7b": ("qwen2-0.5b", "qwen2-7b"),
    "1.5b-14b": ("qwen2-1.5b", "qwen2.5-14b"),
    "tiny": ("tiny-slm", "tiny-llm"),
}


def build_model(name: str, device: str, dtype: torch.dtype, seed: int) -> Any:
    """A random-weight Qwen2ForCausalLM of spec ``name``, built on ``device`` in ``dtype`` (no CPU detour)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = SPECS[name]
    cfg = Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"], tie_word_embeddings=s["tie"],
        max_position_embeddings=32768, rope_theta=1_000_000.0, use_sliding_window=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, 0
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    model.config._name_or_path = name
    return model


def n_params(model: Any) -> int:
    """Parameters of ``model``, a tied embedding counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass
class BuiltPair:
    """A pair's two models on the device, with what every measurement of them needs."""

    name: str  # the PAIRS key, e.g. "0.5b-7b"
    slm: Any
    llm: Any
    costs: tuple[ModelCost, ModelCost]  # (SLM, LLM): weight bytes per call, KV bytes per token
    vocab: int  # ids both models have rows for (the larger vocab's extra rows are masked in generation)


def build_pair(name: str, device: str, dtype: torch.dtype) -> BuiltPair:
    """Pair ``name``'s SLM (seed 1) and LLM (seed 2), built on ``device`` in ``dtype``."""
    slm_name, llm_name = PAIRS[name]
    slm = build_model(slm_name, device, dtype, seed=1)
    llm = build_model(llm_name, device, dtype, seed=2)
    costs = (ModelCost.from_model(slm), ModelCost.from_model(llm))
    vocab = min(SPECS[slm_name]["vocab"], SPECS[llm_name]["vocab"])
    return BuiltPair(name, slm, llm, costs, vocab)
