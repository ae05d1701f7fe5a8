"""A fingerprint of what the routed engine emits across its options, to hold a refactor of ``citer/decoding/`` to
the tokens it emitted before: ``python scripts/decoding_fingerprint.py > before.json``, change the code, run it
again and ``diff``. Tiny random Qwen2 pairs built here (float32 and bf16), every engine option the session
schedules with (shared LLM calls, verification, overlap, fixed-shape steps, continuous batching, sampling); per
case the hash of every row's tokens, writers and take-backs, and the call counts the meter kept."""

from __future__ import annotations

import hashlib
import json
import math
import sys

import torch


def _pair(dtype: torch.dtype, vocab: int = 97) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = []
    for seed, (hidden, layers) in ((1, (32, 1)), (2, (64, 2))):
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=1, bos_token_id=1)  # fmt: skip
        torch.manual_seed(seed)
        m = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(4.0 if p.dim() > 1 else 1.0)
        out.append(m.to(dtype).eval())
    return out[0], out[1]


def _mlp_router(hidden: int) -> torch.nn.Module:
    from citer.routing.mlp import MLPRouter

    torch.manual_seed(0)
    r = MLPRouter(hidden).eval()
    with torch.no_grad():
        r.net[-1].weight.mul_(8.0)
    return r


def cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 2, 11, 1, 7, 3, 9, 4, 6)]
    base = {"prompts": prompts[:4], "n": 24}
    out: dict[str, dict] = {}
    for router in ("random", "mlp", "always_llm"):
        out[f"{router}"] = {**base, "router": router}
        out[f"{router}_b1"] = {**base, "router": router, "prompts": prompts[:1]}
        out[f"{router}_b9"] = {**base, "router": router, "prompts": prompts}
    out["shared_calls"] = {**base, "router": "random", "prompts": prompts,
                           "engine": {"llm_min_rows": 3, "llm_max_wait_steps": 2}}  # fmt: skip
    out["verify"] = {**base, "router": "mlp", "engine": {"verify_rho": 0.5, "verify_window": 3}}
    out["verify_final"] = {**base, "router": "random",
                           "engine": {"verify_rho": 0.2, "verify_window": 2, "verify_final": True}}  # fmt: skip
    out["overlap"] = {**base, "router": "random", "engine": {"overlap": True}}
    out["max_rows"] = {**base, "router": "random", "prompts": prompts, "max_rows": 3}
    out["sampled"] = {**base, "router": "mlp", "sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 3}}
    out["static_eager"] = {**base, "router": "random", "engine": {"forward": "fixed"}}
    out["drafts"] = {**base, "router": "random", "drafts": [[5, 6], [], [7], [8, 9, 10]],
                     "engine": {"verify_rho": 0.3, "verify_window": 2}}  # fmt: skip
    return out


def run_case(spec: dict, slm: torch.nn.Module, llm: torch.nn.Module) -> dict:
    from citer.decoding.baselines import AlwaysLLM, RandomRouter
    from citer.decoding.engine import RoutedEngine

    router = {"random": lambda: RandomRouter(0.3, seed=0), "mlp": lambda: _mlp_router(slm.config.hidden_size),
              "always_llm": AlwaysLLM}[spec["router"]]()  # fmt: skip
    eng = RoutedEngine(slm, llm, router, tau=0.5, eos_token_id=1, **spec.get("engine", {}))
    res = eng.generate_batch(spec["prompts"], spec["n"], max_rows=spec.get("max_rows"),
                             drafts=spec.get("drafts"), **spec.get("sampling", {}))  # fmt: skip
    emitted = json.dumps([res.tokens, res.from_llm, res.replaced])
    b = res.batch
    return {
        "tokens": hashlib.sha256(emitted.encode()).hexdigest()[:16],
        "n_tokens": sum(len(t) for t in res.tokens),
        "llm_tokens": sum(sum(f) for f in res.from_llm),
        "llm_calls": b.llm_calls,
        "steps": b.decode_steps,
        "llm_prompt_tokens": b.llm_prompt_tokens,
        "llm_catchup_tokens": b.llm_catchup_tokens,
    }


def main() -> int:
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        slm, llm = _pair(dtype)
        for case, spec in cases().items():
            with torch.inference_mode():
                out[f"{name}/{case}"] = run_case(spec, slm, llm)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0 if all(not math.isnan(v["n_tokens"]) for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
