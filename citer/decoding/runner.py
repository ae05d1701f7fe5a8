"""One model's forward calls: :class:`ModelRunner`, the one place that chooses how a call runs.

A runner belongs to one model in one engine and holds that engine's choice for it, ``forward`` (:data:`FORWARDS`):

- ``"eager"``: the lean forward (:mod:`citer.decoding.lean`) where it covers the model's family, HF's modules
  elsewhere; ragged calls, a decode step's layers in citer's C++ step ops where the model's linears take its
  kernels (:mod:`citer.decoding.cpu_step`), and in bf16 a short catch-up too, as a decode step of its tokens. The
  default, and what the pipeline's records are made with.
- ``"hf"``: HF's modules always (the oracle the lean forward is tested against).
- ``"compiled"``: the lean forward under ``torch.compile`` with dynamic sizes (:mod:`citer.decoding.compiled`), ragged
  calls; for long CPU runs, where the compile is paid once.
- ``"graphs"``: decode steps and catch-ups of up to :data:`STATIC_Q` tokens as fixed-shape calls, bucketed and
  captured (:mod:`citer.decoding.static_step`; CUDA graphs on a GPU); prompts take the eager ragged call.
- ``"fixed"``, ``"aot_eager"``: the fixed-shape calls run eagerly, or captured and traced without code generation
  (the CPU's check of ``"graphs"``): for tests and benches.

The choice is the runner's, not the model's: two engines over one model may run it differently.
:meth:`ModelRunner.feed` is the engine's one call over a KV pool (:class:`~citer.decoding.kv_pool.KVPool`): rows
whose caches lag by different gaps append in one forward call, padded, packed or as one-token rows
(:func:`~citer.decoding.context.prepare`). :meth:`ModelRunner.forward` is one causal pass, over a pool or not,
returning the logits and the router's input.
Shapes: b = rows in a call, Q = longest chunk, K = key columns, V = vocab, H = hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from citer.decoding import cpu_step
from citer.decoding.compiled import CompiledHidden, compiled_hidden
from citer.decoding.context import CallInput, prepare
from citer.decoding.kv_pool import HFPoolView, KVPool, PoolCall
from citer.decoding.lean import LeanDecoder, lean_decoder, unsupported_reason
from citer.decoding.static_step import StaticSteps, StepMode

# forward -> (the ragged calls' forward: "lean", "hf" or "compiled"; the fixed-shape steps' mode, None for none)
FORWARDS: dict[str, tuple[str, StepMode | None]] = {
    "eager": ("lean", None),
    "hf": ("hf", None),
    "compiled": ("compiled", None),
    "graphs": ("lean", StepMode("inductor", graphs=True)),
    "fixed": ("lean", StepMode()),
    "aot_eager": ("lean", StepMode("aot_eager", graphs=True)),
}

# What packing a call's queries costs per layer (a scatter and a gather), in the multiply-adds a CPU core does
# meanwhile (docs/results.md): an estimate that packs a 1.7B LLM's catch-ups at any padding and leaves small models'
# to the doubling rule.
PACK_COST_MACS = 5_000_000
# Chunks of at most this many tokens run as fixed-shape calls when the runner has ``steps``; longer ones (prompts)
# take the ragged call.
STATIC_Q = 16


class ModelRunner:
    """How one model's calls run in one engine (module docstring)."""

    def __init__(self, model: nn.Module, forward: str = "eager") -> None:
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {list(FORWARDS)}, got {forward!r}")
        self.model = model
        self.forward_kind, self.steps = FORWARDS[forward]
        self._static: StaticSteps | None = None
        self._static_for: LeanDecoder | None = None

    @property
    def lean(self) -> LeanDecoder | None:
        """The model's lean decoder, or None where the runner takes HF's forward."""
        return None if self.forward_kind == "hf" else lean_decoder(self.model)

    @property
    def compiled(self) -> CompiledHidden | None:
        """The compiled lean forward the runner's calls go through (``forward="compiled"``), None when they run
        eagerly: asked for no compile, a family the lean forward does not cover, or a compile that failed."""
        if self.forward_kind != "compiled":
            return None
        lean = lean_decoder(self.model)
        if lean is None:
            return None
        got = compiled_hidden(lean)
        return None if got.failed else got

    @property
    def static(self) -> StaticSteps | None:
        """The fixed-shape steps, where ``steps`` asks for them and the lean forward covers the model."""
        if self.steps is None:
            return None
        lean = self.lean
        if lean is not None and self._static_for is not lean:
            self._static, self._static_for = StaticSteps(lean, self.steps), lean
        return self._static if lean is not None else None

    @property
    def round_shapes(self) -> bool:
        """Whether this model's pools should round their shapes (a few shapes for compiled graphs)."""
        return self.steps is not None or self.compiled is not None

    @property
    def path(self) -> str:
        """``"lean"``, ``"lean+compiled"`` or ``"hf: <reason>"``: which forward this runner's calls take."""
        if self.forward_kind == "hf":
            return "hf: forward='hf'"
        if self.lean is None:
            return f"hf: {unsupported_reason(self.model)}"
        return "lean+compiled" if self.compiled is not None else "lean"

    def new_pool(self) -> KVPool:
        """An empty KV pool for this model, shaped for how its calls run."""
        return KVPool(self.model, 0, 0, round_shapes=self.round_shapes)

    # -- one forward call -------------------------------------------------------------------------------------------
    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        pool: KVPool | None,
        call: PoolCall | None,
        n_pos: int,
    ) -> torch.Tensor:
        """The lean forward's last hidden states (B, T, H) (:meth:`LeanDecoder.hidden`'s arguments), through the
        compiled graphs where the runner compiles, eagerly otherwise."""
        lean = self.lean
        assert lean is not None
        compiled = self.compiled
        if compiled is not None and not torch.compiler.is_compiling():
            return compiled(ids, pos, mask, pool, call, n_pos)
        if torch.compiler.is_compiling():
            return lean.hidden(ids, pos, mask, pool, call, n_pos)
        layer, stack = cpu_step.step_for(lean, ids, mask, pool, call)
        return lean.hidden(ids, pos, mask, pool, call, n_pos, layer=layer, stack=stack)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pool: KVPool | None = None,
        call: PoolCall | None = None,
        *,
        last_index: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        n_pos: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass: ``(logits, hidden)``, hidden the last layer's output after the final norm -- the one
        definition of the router's input, which the engine, the pools' calls and label collection all read.

        input_ids (B, T) -> logits (B, T, V), hidden (B, T, H); with ``last_index`` (B,) only that position of each
        row: logits (B, V), hidden (B, H) (the head then runs on B vectors, not B*T). A pair (batch_idx (n,), pos_idx
        (n,)) picks n arbitrary positions: logits (n, V), hidden (n, H). ``pool``/``call``: the KV pool the call
        writes to and reads, laid out by :func:`~citer.decoding.context.prepare` (None: a full-sequence pass, its
        mask None = causal or an HF 2D padding mask). ``n_pos``: a bound on the positions known on the host (the lean
        forward otherwise takes it from the mask's key count, or reads the positions back).
        """
        lean = self.lean
        if lean is not None and (attention_mask is None or attention_mask.dim() == 4):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(
                    input_ids.shape
                )
                n_pos = input_ids.shape[1]
            elif n_pos is None and attention_mask is not None:
                n_pos = attention_mask.shape[
                    -1
                ]  # positions index key columns, so they stay below the key count
            elif n_pos is None:
                n_pos = int(position_ids.max()) + 1
            hidden = self.hidden(input_ids, position_ids, attention_mask, pool, call, n_pos)  # (B, T, H)
            head = lean.logits
        else:
            cache = HFPoolView(pool, call) if pool is not None and call is not None else None
            out = self.model.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
            )
            hidden = out.last_hidden_state  # (B, T, H)
            head = self.model.get_output_embeddings()
        if isinstance(last_index, tuple):
            hidden = hidden[last_index[0], last_index[1]]  # (n, H)
        elif last_index is not None and hidden.shape[1] == 1:
            hidden = hidden[:, 0]  # (B, H): one token per row, a view instead of a gather
        elif last_index is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]  # (B, H)
        return head(hidden), hidden

    # -- calls over a pool ------------------------------------------------------------------------------------------
    def feed(
        self,
        pool: KVPool,
        chunks: Sequence[Sequence[int]],
        slots: Sequence[int] | None = None,
        packed: bool | None = None,
        every: bool = False,
        decide: tuple[Sequence[int], Sequence[int], Any] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Feed ``chunks[i]`` to slot ``slots[i]`` (default: slot i) in one forward call.

        An empty chunk holds its row: the row rides along (so a call over the active prefix keeps its cheap views)
        but writes nothing and its returned logits/hidden are meaningless. ``packed``: None chooses by cost (the
        body's rule; decode steps pad). Returns logits (b, V) and hidden (b, H) at each row's last
        fed token; ``every``: (b, Q, V), (b, Q, H). ``decide`` = (row ids, step indices, a
        :class:`~citer.decoding.decide.Decision`): a decode step that runs compiled or fixed-shape also returns the
        next step's tokens (b,) and hard flags (b,) from the same graph; otherwise, or when the router cannot be
        traced, only the two.
        """
        b = len(chunks)
        sl = list(range(b)) if slots is None else list(slots)
        gaps = [len(c) for c in chunks]
        q = max(gaps)
        if q == 0:
            raise ValueError("every chunk is empty: nothing to feed")
        if 0 in gaps:
            if packed:
                raise ValueError("a packed call cannot hold rows (empty chunks)")
            packed = False
        static = self.static
        if static is not None and not packed and q <= STATIC_Q:
            if decide is not None and q == 1 and not every and sl == list(range(b)):
                return static.decided(pool, chunks, *decide)
            return static(pool, chunks, sl, every=every)
        lean = self.lean
        tokens = (
            q > 1
            and lean is not None
            and self.compiled is None
            and cpu_step.tokens_as_step(lean, _keys_read(pool, sl, gaps))
        )
        if tokens:
            packed = True  # read back as a packed call's tokens are
        elif packed is None:
            # The packed mask is (N, sum K_i): keep it small, so big prefills stay padded.
            n_keys = sum(pool.lengths[s] for s in sl) + sum(gaps)
            # Eager, packing costs a scatter and a gather of the queries per layer; padding costs the pad tokens'
            # linears: pack where padding would at least double the tokens, or where the pad tokens' multiply-adds
            # exceed what the packing ops cost (a large model's catch-ups). Compiled, those ops fuse away and any
            # padding is wasted matrix work.
            if self.compiled is not None:
                pays = sum(gaps) < b * q
            else:
                waste = (b * q - sum(gaps)) * (lean.layer_macs if lean is not None else 0)
                pays = 2 * sum(gaps) <= b * q or waste >= PACK_COST_MACS
            packed = b > 1 and pays and sum(gaps) * n_keys <= 1 << 22
        # Eager, named slots are attended in place; compiled, a gather (runs would be guarded on, a graph per pattern).
        inp = prepare(
            pool,
            chunks,
            sl,
            packed,
            lean=lean is not None,
            float_mask=self._float_mask(),
            in_place=self.compiled is None,
            tokens=tokens,
        )
        out = self._run(
            pool, inp, every and not packed and q > 1, every and packed, decide if not every else None
        )
        for s, n in zip(sl, gaps, strict=True):
            pool.lengths[s] += n
        if every and packed:
            assert inp.scatter is not None
            tok_row, tok_j, _, _ = inp.scatter
            logits, hidden = out
            lg = logits.new_zeros((b, q, logits.shape[-1]))
            hd = hidden.new_zeros((b, q, hidden.shape[-1]))
            lg[tok_row, tok_j], hd[tok_row, tok_j] = logits, hidden
            return lg, hd
        if every and q == 1:
            return out[0][:, None], out[1][:, None]
        return out

    def _run(
        self,
        pool: KVPool,
        inp: CallInput,
        all_positions: bool,
        all_packed: bool,
        decide: tuple[Sequence[int], Sequence[int], Any] | None,
    ) -> tuple[torch.Tensor, ...]:
        """The prepared call: a decode step with its decision in the compiled graph where it can, else the forward,
        read at each row's last token (or at every position)."""
        call = inp.call
        if decide is not None and call.slots is None and inp.ids.shape[1] == 1 and call.keys is None:
            compiled = self.compiled
            if compiled is not None and not torch.compiler.is_compiling():
                rid, steps = torch.tensor(
                    [list(decide[0]), list(decide[1])], dtype=torch.long, device=pool.device
                )
                out = compiled.decided(
                    inp.ids, inp.pos, inp.mask, pool, call, inp.n_pos, rid, steps, decide[2]
                )
                if out is not None:
                    return out
        last = None if all_positions else inp.pick_all if all_packed else inp.last
        return self.forward(inp.ids, inp.mask, inp.pos, pool, call, last_index=last, n_pos=inp.n_pos)

    def _float_mask(self) -> torch.dtype | None:
        """The additive mask's dtype where HF's eager attention runs the calls; None where they take a bool mask (the
        lean forward, sdpa). The lean check first: a config attribute read costs more than the lookup."""
        if self.lean is not None or self.model.config._attn_implementation == "sdpa":
            return None
        return self.model.get_input_embeddings().weight.dtype


def _keys_read(pool: KVPool, slots: Sequence[int], gaps: Sequence[int]) -> int:
    """The keys a call's queries read in all: a row's token j reads its slot's columns up to its own."""
    return sum(n * pool.lengths[s] + n * (n + 1) // 2 for s, n in zip(slots, gaps, strict=True))
