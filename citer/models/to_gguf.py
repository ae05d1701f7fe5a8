"""An HF decoder written as a GGUF file for llama.cpp, as llama.cpp's own ``convert_hf_to_gguf.py`` writes it
(Llama: q/k rows permuted for its RoPE; Qwen2: biases kept, rows as they are), then quantized by llama.cpp's own
quantizer (:func:`quantize_gguf`, needs ``llama-cpp-python``). The vocabulary is written as placeholder pieces:
citer tokenizes with the model's own tokenizer and feeds llama.cpp token ids, so the file serves the llama.cpp runner,
not llama.cpp's own text front ends.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from citer.models.gguf import GgufError

# HF parameter names -> GGUF tensor names, per layer (llama.cpp's llama and qwen2 architectures share them)
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}  # fmt: skip
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # HF model_type -> GGUF architecture
GGUF_TYPES = ("F32", "BF16", "F16")
CONVERTER_VERSION = 1  # part of a cached file's key: a change to how files are written makes new ones


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """A Llama q or k projection's rows reordered as llama.cpp's converter does (its RoPE rotates adjacent pairs,
    HF's the two halves of each head); ``n_head``: the projection's heads."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under their GGUF names (a tied head left out), Llama's q/k rows permuted."""
    c = model.config
    arch = ARCHITECTURES.get(c.model_type)
    if arch is None:
        raise GgufError(
            f"no GGUF writer for model_type {c.model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    out: dict[str, torch.Tensor] = {}
    for k, t in model.state_dict().items():
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if k.startswith("model.layers."):
            parts = k.split(".")
            part, kind = ".".join(parts[3:-1]), parts[-1]
            if part not in _LAYER:
                raise GgufError(f"{c.model_type}: no GGUF name for parameter {k!r}")
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if part == "self_attn.q_proj" else c.num_key_value_heads
                t = llama_permute(t, heads)
            out[f"blk.{parts[2]}.{_LAYER[part]}.{kind}"] = t
        elif k in _TOP:
            out[_TOP[k]] = t
        else:
            raise GgufError(f"{c.model_type}: no GGUF name for parameter {k!r}")
    return out


def write_gguf(model: Any, path: str | os.PathLike[str], dtype: str = "F32") -> Path:
    """``model`` (an HF Llama or Qwen2 causal LM) as a GGUF file at ``path``, matrices in ``dtype`` (F32, BF16, F16),
    norms and biases in F32. Written to a temporary name, then renamed."""
    import gguf

    if dtype not in GGUF_TYPES:
        raise GgufError(f"GGUF dtype {dtype!r}: expected one of {', '.join(GGUF_TYPES)}")
    c = model.config
    tensors = gguf_tensors(model)
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    arch = ARCHITECTURES[c.model_type]
    w = gguf.GGUFWriter(str(tmp), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                     "F16": gguf.LlamaFileType.MOSTLY_F16}[dtype])  # fmt: skip
    n = c.vocab_size
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.NORMAL] * n)
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    bos = getattr(c, "bos_token_id", None)
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.ndim == 2 and dtype == "BF16":
            w.add_tensor(name, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)  # fmt: skip
        elif t.ndim == 2 and dtype == "F16":
            w.add_tensor(name, t.to(torch.float16).numpy())
        else:
            w.add_tensor(name, t.to(torch.float32).numpy())
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def quantize_gguf(
    src: str | os.PathLike[str], out: str | os.PathLike[str], qtype: str, threads: int = 0
) -> Path:
    """``src`` quantized to ``qtype`` (``Q8_0``, ``Q4_K_M``, ``Q4_0``, ...: a ``LLAMA_FTYPE_MOSTLY_*`` name) by
    llama.cpp's ``llama_model_quantize``, its rules for which tensor gets which type included (rows that do not fit
    a type's blocks fall back to another). Written to a temporary name, then renamed."""
    from citer.decoding.llama_cpp_runner import _lib

    lc = _lib()
    ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise GgufError(f"llama.cpp {lc.__version__} has no quantization type {qtype!r}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or torch.get_num_threads()
    out = Path(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise GgufError(f"{src}: llama_model_quantize to {qtype} returned {rc}")
    os.replace(tmp, out)
    return out


def cache_dir() -> Path:
    """Where converted files are kept: ``CITER_GGUF_CACHE``, else ``~/.cache/citer/gguf`` (outside the project: a
    DVC-tracked models directory stays as its stages wrote it)."""
    return Path(os.environ.get("CITER_GGUF_CACHE") or Path.home() / ".cache" / "citer" / "gguf")


def weights_digest(model: Any) -> str:
    """A digest of the model's config and every tensor's name, dtype, shape and bytes: the cache key of its files."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:20]


def gguf_for(model: Any, qtype: str, where: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file of ``model`` in llama.cpp type ``qtype`` (F32, BF16, F16, or a quantization such as Q8_0,
    Q4_K_M, Q4_0: written in F32, then quantized by llama.cpp's own quantizer), cached in ``where`` (default
    :func:`cache_dir`) under the digest of the weights, so a model is converted once."""
    d = Path(where) if where is not None else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    key = f"{weights_digest(model)}-v{CONVERTER_VERSION}"
    out = d / f"{key}-{qtype.lower()}.gguf"
    if out.exists():
        return out
    if qtype.upper() in GGUF_TYPES:
        return write_gguf(model, out, qtype.upper())
    full = d / f"{key}-f32.gguf"
    if not full.exists():
        write_gguf(model, full, "F32")
    return quantize_gguf(full, out, qtype)
