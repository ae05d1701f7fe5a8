"""A lean decoder forward for the families users bring (Qwen2/Qwen2.5, Llama 3.x, Qwen3, Mistral without a window).

The HF modules spend most of a small decode step in Python (attention-interface lookup, config reads, output
dataclasses, one RoPE module call per layer), not in the matrix products. This module reads the weights of the HF
model it is given -- q/k/v and gate/up are fused into one matrix each and the HF parameters become views of it, and a
large CPU model's weights move onto huge pages (:mod:`~citer.kernels.huge_pages`) with the HF parameters pointed
there, so both paths read the same memory, never two copies -- and runs the same arithmetic in a handful of tensor ops per layer
(gpt-fast's ``model.py`` shape). K/V go to the layer's pool buffers where the call's
:class:`~citer.decoding.kv_pool.PoolCall` says (:func:`~citer.decoding.kv_pool.write_and_read`), padded, packed or
without a pool.

:func:`lean_decoder` returns ``None`` for a model it does not cover, with the reason in :func:`unsupported_reason`;
callers then keep the HF forward. Which forward a call takes is not decided here but by the model's runner in an
engine (:class:`~citer.decoding.runner.ModelRunner`).
Shapes: B = rows, T = tokens per row, H = hidden, nh/kv = query/key-value heads, D = head_dim, K = key columns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from citer.decoding.kv_pool import PoolCall, write_and_read
from citer.decoding.layers import (
    HeadShape,
    LayerWeights,
    attn_in,
    attn_out_mlp,
    fused_attention,
    grouped_attention,
    rms_norm,
)
from citer.kernels import huge_pages
from citer.kernels.cpu_linear import linear

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
# RoPE types whose inverse frequencies do not depend on the sequence length (dynamic/longrope re-scale per call).
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum out, in) matrix for several linears reading the same input; each HF weight becomes a view of it."""
    w = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        b = torch.cat(
            [m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features) for m in linears]
        )
    else:
        b = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    o = 0
    for m in linears:
        n = m.out_features
        m.weight.data = w[o : o + n]
        if m.bias is not None and b is not None:
            m.bias.data = b[o : o + n]
        o += n
    return w, b


class LeanDecoder:
    """The decoder of one HF causal LM as plain tensor ops; see the module docstring."""

    def __init__(self, model: nn.Module, rehome: bool = True) -> None:
        # The fused matrices become the HF parameters' storage, so they are made in the parameters' own mode: an
        # inference tensor inside a normal parameter breaks a later autograd or no_grad use of the HF model, and a
        # normal one inside an inference parameter breaks inference-mode use.
        infer = model.get_input_embeddings().weight.is_inference()
        with torch.inference_mode(infer), torch.no_grad():
            self._build(model, rehome)
        self._source = _fingerprint(model)
        dec = model.get_decoder()
        self._embed_mod, self._head_mod = dec.embed_tokens, model.get_output_embeddings()

    def _build(self, model: nn.Module, rehome: bool) -> None:
        cfg = model.config.get_text_config(decoder=True)
        dec = model.get_decoder()
        attn0 = dec.layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(attn0.head_dim)
        self.scale = float(attn0.scaling)
        self.eps = float(cfg.rms_norm_eps)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", None) or 4096)
        self.shape = HeadShape(self.n_heads, self.n_kv, self.head_dim, self.eps, self.scale)
        self.embed = dec.embed_tokens.weight  # (V, H)
        self.norm = dec.norm.weight
        self.head = model.get_output_embeddings().weight  # (V, H), tied or not
        rot = dec.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float()  # (D/2,)
        self.rope_scale = float(rot.attention_scaling)
        self._rope_tab: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: list[LayerWeights] = []
        for layer in dec.layers:
            a, m = layer.self_attn, layer.mlp
            wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
            wgu, bgu = _fuse([m.gate_proj, m.up_proj])
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            self.layers.append(
                LayerWeights(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    wqkv=wqkv,
                    bqkv=bqkv,
                    q_norm=None if qn is None else qn.weight,
                    k_norm=None if kn is None else kn.weight,
                    wo=a.o_proj.weight,
                    bo=a.o_proj.bias,
                    wgu=wgu,
                    bgu=bgu,
                    wd=m.down_proj.weight,
                    bd=m.down_proj.bias,
                )
            )
        if rehome:
            sizes = huge_pages.cpu_storages(p.data for p in model.parameters())
            if huge_pages.wanted(sizes):
                assert sizes is not None
                self._rehome(model, sizes)

    def _rehome(self, model: nn.Module, sizes: dict[int, int]) -> None:
        """Moves the model's weights into a huge-page :class:`~citer.kernels.huge_pages.Arena`, a layer at a time:
        this view's tensors and the HF parameters over the same storages are pointed at the copies together, so each
        old storage is freed before the next is copied."""
        moved = huge_pages.Arena(sizes)
        dec = model.get_decoder()
        for i, layer in enumerate(dec.layers):
            L = self.layers[i]
            self.layers[i] = LayerWeights(**{k: None if t is None else moved(t) for k, t in vars(L).items()})
            for p in layer.parameters():
                p.data = moved(p.data)
        self.embed, self.norm, self.head = moved(self.embed), moved(self.norm), moved(self.head)
        # the rest (embeddings, final norm, head): some of them are the tensors above
        for p in model.parameters():
            p.data = moved(p.data)

    @property
    def layer_macs(self) -> int:
        """Multiply-adds a token costs one layer's linears (its four matrices): what a padded token wastes per layer."""
        L = self.layers[0]
        return sum(w.numel() for w in (L.wqkv, L.wo, L.wgu, L.wd))

    def static_tensors(self) -> list[torch.Tensor]:
        """Every weight tensor a forward reads (embedding, head, final norm, every layer's weights, biases and norms,
        the RoPE tables built so far): what a captured step must find at the same address at every replay."""
        out = [self.embed, self.head, self.norm]
        for L in self.layers:
            out += [t for t in vars(L).values() if isinstance(t, torch.Tensor)]
        for tab in self._rope_tab.values():
            out += list(tab)
        return out

    def stale(self, model: nn.Module) -> bool:
        """True when the model's weights were moved or replaced since this view was built (``.to``, ``.half``).
        Checked on every call, so it reads two module attributes, not HF's slower accessors."""
        e, h = self._embed_mod.weight, self._head_mod.weight
        return (e.data_ptr(), e.dtype, e.device, h.data_ptr()) != self._source

    def rope(self, pos: torch.Tensor, n_pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B, T), every entry < ``n_pos`` -> cos, signed sin (B, T, 1, D): rows of a table computed as HF's
        rotary embedding computes them (elementwise, so a row equals HF's value at that position), the sine's first
        half negated for :func:`~citer.decoding.layers.rotate`."""
        tab = self.rope_table(n_pos, dtype, pos.device)
        return F.embedding(pos, tab[0])[:, :, None], F.embedding(pos, tab[1])[:, :, None]

    def rope_table(
        self, n_pos: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, signed sin) table of at least ``n_pos`` rows. It grows by doubling, decided on the Python int
        ``n_pos`` so that no position is read back from the device."""
        tab = self._rope_tab.get(dtype)
        if tab is None or tab[0].shape[0] < n_pos or tab[0].device != device:
            n = max(n_pos, 2 * (0 if tab is None else tab[0].shape[0]), 256)
            freqs = torch.arange(n, device=device).float()[:, None] * self.inv_freq.to(device)  # (n, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = (emb.sin() * self.rope_scale).to(dtype)
            half = sin.shape[-1] // 2
            tab = (
                (emb.cos() * self.rope_scale).to(dtype),
                torch.cat((-sin[:, :half], sin[:, half:]), dim=-1),
            )
            self._rope_tab[dtype] = tab
        return tab

    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        pool: Any,
        call: PoolCall | None,
        n_pos: int,
        attention: str = "sdpa",
        layer: Callable[..., torch.Tensor] | None = None,
        stack: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The model's one body: ids, pos (B, T), every position < ``n_pos``; mask (B, 1, T, K) bool (True = attend)
        or additive float, None = causal over T; ``pool.buffers(i, like)`` gives layer i's K/V buffers, which
        ``call`` says where to write and what to attend (:func:`~citer.decoding.kv_pool.write_and_read`; no pool:
        a full-sequence pass). Returns the last layer's output after the final norm, (B, T, H). The ragged calls
        (eager, or traced whole by :mod:`citer.decoding.compiled`) and the fixed-shape steps
        (:mod:`citer.decoding.static_step`, whose ``layer`` may be :func:`decoder_layer` compiled) run it alike;
        ``attention``: :func:`decoder_layer`'s; ``stack(x, cos, sin, mask, pool, call)``, where given, runs every layer
        in one call (:func:`citer.decoding.cpu_step.decode_stack`)."""
        x = F.embedding(ids, self.embed)  # (B, T, H)
        cos, sin = self.rope(pos, n_pos, x.dtype)
        if stack is not None:
            return rms_norm(stack(x, cos, sin, mask, pool, call), self.norm, self.eps)
        run_layer = decoder_layer if layer is None else layer
        for i, L in enumerate(self.layers):
            kb, vb = pool.buffers(i, x) if pool is not None else (None, None)
            x = run_layer(x, cos, sin, mask, L, self.shape, kb, vb, call, attention)
        return rms_norm(x, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.head)


def decoder_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    L: LayerWeights,
    shape: HeadShape,
    kb: torch.Tensor | None,
    vb: torch.Tensor | None,
    call: PoolCall | None,
    attention: str,
) -> torch.Tensor:
    """One decoder layer: x (B, T, H) -> (B, T, H). Its new K/V go to the layer's pool buffers kb, vb (R, kv, C, D)
    where ``call`` says, and its queries attend what the call names (none: the call's own keys, causal).
    ``attention``: ``"sdpa"`` the library kernel (packed calls per row, named slots in place a run at a time);
    ``"fused_decode"`` one-query rows as fused products and sums (:func:`fused_attention`, for a compiler to fuse:
    the same math, other rounding); ``"fused"`` every query so, written in the output projection's layout;
    ``"grouped"`` two batched matrix products (:func:`grouped_attention`: compiles for symbolic rows and tokens)."""
    b, t = x.shape[0], x.shape[1]
    q, k, v = attn_in(x, L, shape, cos, sin)  # (B, nh, T, D), (B, kv, T, D) x2
    varlen = runs = None
    if kb is not None and vb is not None and call is not None:
        k, v = write_and_read(kb, vb, k, v, call)
        varlen, runs = call.varlen, call.runs
        if runs is not None:  # the pool's rows, cut to the columns attended (views)
            k, v = k[:, :, : call.kv_len], v[:, :, : call.kv_len]
    if attention == "fused":
        assert mask is not None and mask.dtype == torch.bool
        o = fused_attention(q, k, v, mask, shape.scale, flat=True)  # (B, T, nh D)
    elif attention == "grouped":
        assert mask is not None and mask.dtype == torch.bool
        o = grouped_attention(q, k, v, mask, shape.scale).transpose(1, 2).reshape(b, t, -1)
    elif attention == "fused_decode" and varlen is None and runs is None and t == 1:
        o = fused_attention(q, k, v, mask, shape.scale).transpose(1, 2).reshape(b, t, -1)
    else:
        o = attend(q, k, v, mask, shape, varlen, runs).transpose(1, 2).reshape(b, t, -1)
    return attn_out_mlp(x, o, L, shape.eps)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    shape: HeadShape,
    varlen: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    runs: tuple[tuple[int, int, int], ...] | None = None,
) -> torch.Tensor:
    """The library kernel's attention: q (B, nh, T, D), k/v (B, kv, K, D) -> (B, nh, T, D). ``varlen`` = (row (N,),
    j (N,), b, Q): q holds N packed tokens (B = 1, T = N) of b rows under a (b, 1, Q, K) mask; the queries are laid
    out per row for the attention and packed back. ``runs`` (``PoolCall.runs``): k/v are the pool's (R, kv, K, D)
    and each run of consecutive slots is attended as one view of it, so no row's keys are copied (a gather writes
    every attended key and reads it twice)."""
    gqa = shape.n_heads != shape.n_kv
    if varlen is None and runs is None:
        causal = mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=shape.scale, enable_gqa=gqa
        )
    if varlen is not None:
        row, j, b, width = varlen
        qp = q.new_zeros((b, width, q.shape[1], q.shape[3]))  # (b, Q, nh, D)
        qp[row, j] = q[0].transpose(0, 1)  # (N, nh, D)
        q = qp.transpose(1, 2)  # (b, nh, Q, D)
    if runs is None:
        runs = ((0, 0, q.shape[0]),)
    outs = [
        F.scaled_dot_product_attention(
            q[i : i + n],
            k[s : s + n],
            v[s : s + n],
            attn_mask=None if mask is None else mask[i : i + n],
            scale=shape.scale,
            enable_gqa=gqa,
        )
        for i, s, n in runs
    ]  # (n, nh, Q, D) a run
    o = outs[0] if len(outs) == 1 else torch.cat(outs)  # (b, nh, Q, D)
    if varlen is None:
        return o
    return o.transpose(1, 2)[row, j].transpose(0, 1)[None]  # (1, nh, N, D)


def _fingerprint(model: nn.Module) -> tuple:
    e, h = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return (e.data_ptr(), e.dtype, e.device, h.data_ptr())


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (None: it can)."""
    cfg = model.config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {list(FAMILIES)}"
    if model.training:
        return "model in training mode (dropout)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(k != "full_attention" for k in layer_types) or kind == "mistral":
            return "sliding-window attention"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} rescales per call"
    params = list(model.parameters())
    if any(type(p) is not nn.Parameter or not p.is_floating_point() or p.is_meta for p in params):
        return "quantized, meta or non-float parameters"
    if len({p.device for p in params}) != 1:
        return "parameters on several devices (device_map)"
    dec = model.get_decoder()
    if not all(hasattr(dec, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "decoder without embed_tokens/layers/norm/rotary_emb"
    return None


_DECODERS: weakref.WeakKeyDictionary[nn.Module, LeanDecoder] = weakref.WeakKeyDictionary()


def lean_decoder(model: nn.Module, rehome: bool = True) -> LeanDecoder | None:
    """The model's lean decoder, built on first use and rebuilt if its weights moved; None where it does not apply
    (:func:`unsupported_reason` says why). One per model: building it fuses the model's matrices in place and, with
    ``rehome``, moves a large CPU model's weights onto huge pages (:mod:`citer.kernels.huge_pages`)."""
    got = _DECODERS.get(model)
    if got is not None and not got.stale(model) and not model.training:
        return got
    if unsupported_reason(model) is not None:
        return None
    dec = _DECODERS[model] = LeanDecoder(model, rehome)
    return dec
