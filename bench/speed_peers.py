"""Peer decoders for ``bench/speed.py`` that live in environments of their own, run with that environment's Python
as ``PYTHON bench/speed_peers.py {llama_cpp,vllm} DIR``; each prints one JSON line with its wall times (a warm-up, then
``reps`` runs of ``prompt_len`` random ids and ``new_tokens`` greedy tokens, no EOS).

- ``llama_cpp`` (``--llama-cpp-python``: llama-cpp-python and gguf): DIR holds ``config.json`` and one ``.npy`` per
  tensor (bf16 stored as uint16), the same random weights the other rows decode with, written here into a GGUF file
  (llama architecture, a placeholder vocabulary of the same size). q and k are not permuted to llama.cpp's rotary
  layout: with random weights the tokens mean nothing either way, and the work per token is the same.
- ``vllm`` (``--vllm-python``: vllm's CPU backend): DIR/hf is the model saved by ``save_pretrained``; no tokenizer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def write_gguf(src: Path, out: Path) -> None:
    import gguf
    import numpy as np

    cfg = json.loads((src / "config.json").read_text())
    bf16 = cfg["dtype"] == "bf16"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    n = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.NORMAL] * n)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for path in sorted(src.glob("*.npy")):
        arr = np.load(path)
        kind = gguf.GGMLQuantizationType.BF16 if bf16 and arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32 and arr.dtype == np.uint16:  # norms: bf16 bits -> f32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        w.add_tensor(path.stem, arr, raw_dtype=kind if kind == gguf.GGMLQuantizationType.BF16 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def time_llama_cpp(src: Path) -> dict:
    import numpy as np
    from llama_cpp import Llama

    cfg = json.loads((src / "config.json").read_text())
    gguf_path = src / "model.gguf"
    if not gguf_path.exists():
        write_gguf(src, gguf_path)
    llm = Llama(model_path=str(gguf_path), n_ctx=cfg["prompt_len"] + cfg["new_tokens"] + 8, n_batch=cfg["prompt_len"],
                n_threads=cfg["threads"], n_threads_batch=cfg["threads"], verbose=False)  # fmt: skip
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg["vocab_size"], cfg["prompt_len"])]
    walls = []
    for _ in range(1 + cfg["reps"]):  # the first run warms up
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        for _ in range(cfg["new_tokens"]):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(cfg["vocab_size"],))
            llm.eval([int(np.argmax(logits))])  # greedy, as every other row
        walls.append(time.perf_counter() - t)
    import llama_cpp

    return {"reps_s": walls[1:], "warmup_s": walls[0], "version": llama_cpp.__version__}


def time_vllm(src: Path) -> dict:
    """vLLM's CPU backend decoding the HF model directory ``src/hf`` (saved by the bench), ``batch`` rows of random
    prompt ids, greedy, no EOS: the rows' wall times, the first run a warm-up."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads((src / "config.json").read_text())
    llm = LLM(model=str(src / "hf"), dtype=cfg["dtype_name"], skip_tokenizer_init=True, seed=0,
              max_model_len=cfg["prompt_len"] + cfg["new_tokens"] + 8, max_num_seqs=max(cfg["batch"], 1))  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in rng.integers(3, cfg["vocab_size"], cfg["prompt_len"])])
               for _ in range(cfg["batch"])]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=cfg["new_tokens"], ignore_eos=True, detokenize=False)
    walls = []
    for _ in range(1 + cfg["reps"]):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    import vllm

    return {"reps_s": walls[1:], "warmup_s": walls[0], "version": vllm.__version__}


if __name__ == "__main__":
    peers = {"llama_cpp": time_llama_cpp, "vllm": time_vllm}
    if len(sys.argv) != 3 or sys.argv[1] not in peers:
        raise SystemExit(f"usage: PYTHON bench/speed_peers.py {{{','.join(peers)}}} DIR")
    print(json.dumps(peers[sys.argv[1]](Path(sys.argv[2]))), flush=True)
