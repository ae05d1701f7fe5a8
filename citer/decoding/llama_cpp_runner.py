"""One model on llama.cpp's CPU kernels (AVX2, AVX-512, AMX; any GGUF type it runs: F32, BF16, Q8_0, Q4_K_M, Q4_0,
...): a context of one sequence id per row, fed the rows' new tokens in one batched decode and read back as the last
token's logits, and, for the SLM, its final-norm hidden state, the vector a router reads (:class:`LlamaCppModel`).
In a :class:`~citer.decoding.session.DecodeSession` a context is the session's slot table (:class:`LlamaCppPool`: the
live rows' sequence ids) and :class:`LlamaCppRunner` runs the session's calls on it, as
:class:`~citer.decoding.runner.ModelRunner` runs a torch model's over a :class:`~citer.decoding.kv_pool.KVPool`.

``llama-cpp-python`` is an optional dependency (built from source: ``CITER_LLAMA_CPP=1 bash scripts/setup.sh``);
:func:`missing` says in one line why it cannot run here.

Shapes: R = rows fed in a call, V = the model's vocabulary, H = its hidden size.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from citer.decoding.cost import ModelCost
from citer.decoding.kv_pool import compaction
from citer.models.gguf import GgufError


def missing() -> str | None:
    """Why llama.cpp cannot run in this Python, in one line; None where it can."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as err:  # ImportError, or a shared library that fails to load
        return f"llama-cpp-python is not importable here ({type(err).__name__}: {err}); CITER_LLAMA_CPP=1 bash scripts/setup.sh builds it"
    return None


_BACKEND: dict[str, Any] = {}

# llama.cpp's AMX buffer type (int8 tiles for Q4_0/Q4_1/Q8_0/K-quants) segfaults in ggml_backend_amx_mul_mat on some
# AMX Xeons (llama.cpp#20824, open upstream; here every quantized file, any shape, on an AMX VM). A build with AMX
# compiled in therefore loads weights without the extra buffer types (no AMX, no CPU repacking) unless this is "1";
# scripts/setup.sh builds without AMX (-mno-amx-int8), keeping the repacked AVX-512 kernels.
AMX_ENV = "CITER_LLAMA_CPP_AMX"


def extra_buffers() -> bool:
    """Whether models load into llama.cpp's extra CPU buffer types (repacked weights, AMX tiles): yes, unless the
    library was built with AMX and ``CITER_LLAMA_CPP_AMX`` is not ``1``."""
    amx = "AMX_INT8 = 1" in _lib().llama_print_system_info().decode()
    return not amx or os.environ.get(AMX_ENV) == "1"


def _lib() -> Any:
    """The llama.cpp binding, its backend initialised once and its log kept off stderr (warnings and errors kept for
    error messages)."""
    if "lc" not in _BACKEND:
        import llama_cpp as lc

        lines: list[str] = []

        def keep(level: int, text: bytes, _: Any) -> None:
            if level in (3, 4):  # ggml_log_level WARN, ERROR
                lines.append(text.decode("utf-8", "replace").strip())

        _BACKEND["cb"] = lc.llama_log_callback(keep)  # held: llama.cpp keeps only the pointer
        lc.llama_log_set(_BACKEND["cb"], None)
        lc.llama_backend_init()
        _BACKEND.update(lc=lc, log=lines)
    return _BACKEND["lc"]


def _last_log() -> str:
    lines = _BACKEND.get("log", [])
    return lines[-1] if lines else "no message"


@dataclass
class LlamaCppModel:
    """A GGUF model in a llama.cpp context holding ``rows`` sequences of up to ``row_tokens`` tokens each.

    ``hidden``: the context also returns each fed row's final-norm hidden state (llama.cpp's embeddings output with
    pooling none), as the SLM's router needs. :meth:`feed` appends tokens to rows; :meth:`clear` empties one row,
    :meth:`reset` all; :meth:`fit` makes the context larger (the weights stay loaded); :meth:`twin` is a second
    context over the same weights.
    """

    path: Path
    rows: int
    row_tokens: int
    hidden: bool = False
    threads: int = field(default_factory=torch.get_num_threads)
    _model: Any = field(default=None, init=False, repr=False)
    _ctx: Any = field(default=None, init=False, repr=False)
    _batch: Any = field(default=None, init=False, repr=False)
    _cap: int = field(default=0, init=False, repr=False)
    _twin_of: LlamaCppModel | None = field(default=None, init=False, repr=False)  # whose weights a twin reads
    lengths: list[int] = field(default_factory=list, init=False)  # tokens held per row

    def __post_init__(self) -> None:
        lc = _lib()
        self.path = Path(self.path)
        if not self.path.is_file():
            raise GgufError(f"{self.path}: no such GGUF file")
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = extra_buffers()
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise GgufError(f"{self.path}: llama.cpp could not load it ({_last_log()})")
        self.vocab_size = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model)))
        self.hidden_size = int(lc.llama_model_n_embd(self._model))
        self.max_positions = int(lc.llama_model_n_ctx_train(self._model))
        self._make_context()

    def _make_context(self) -> None:
        lc = _lib()
        cp = lc.llama_context_default_params()
        cp.n_seq_max = self.rows
        cp.n_ctx = self.rows * self.row_tokens
        cp.n_batch = cp.n_ctx  # a catch-up may feed every row's whole prompt in one decode
        cp.n_ubatch = min(cp.n_batch, 512)
        cp.n_threads = cp.n_threads_batch = self.threads
        # a cache per row (n_ctx / rows cells each): a step attends its own row's cells only, where one cache shared
        # by every row makes each step attend all of them
        cp.kv_unified = False
        if self.hidden:
            cp.embeddings = True
            cp.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise RuntimeError(f"{self.path}: llama.cpp could not make a context ({_last_log()})")
        self.lengths = [0] * self.rows

    def fit(self, rows: int, row_tokens: int) -> None:
        """A context of at least ``rows`` rows of ``row_tokens`` tokens (a new, empty one where this is smaller)."""
        if rows <= self.rows and row_tokens <= self.row_tokens:
            return
        _lib().llama_free(self._ctx)
        self.rows, self.row_tokens = max(rows, self.rows), max(row_tokens, self.row_tokens)
        self._make_context()

    def twin(self, hidden: bool | None = None) -> LlamaCppModel:
        """An empty context of this one's size over the same loaded weights (a second session's rows; the weights
        are read, never written, by either); ``hidden`` (default this one's): whether it returns hidden states."""
        t = copy.copy(self)
        t._ctx, t._batch, t._cap, t._twin_of = None, None, 0, self
        t.hidden = self.hidden if hidden is None else hidden
        t._make_context()
        return t

    def clear(self, row: int) -> None:
        """Row ``row`` empty (its sequence's cache entries removed), for the next prompt to take it."""
        lc = _lib()
        lc.llama_memory_seq_rm(lc.llama_get_memory(self._ctx), row, -1, -1)
        self.lengths[row] = 0

    def cost(self) -> ModelCost:
        """What a decode call reads (:func:`gguf_cost` of the file)."""
        return gguf_cost(self.path)

    def close(self) -> None:
        lc = _BACKEND.get("lc")
        if lc is None or lc.llama_free is None:  # None: the interpreter is shutting down, the library with it
            return
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model and self._twin_of is None:
            lc.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:  # the weights and cache are llama.cpp's memory: a dropped engine frees them
        self.close()

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Every row empty."""
        lc = _lib()
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        self.lengths = [0] * self.rows

    def _batch_for(self, n: int) -> Any:
        lc = _lib()
        if n > self._cap:
            if self._batch is not None:
                lc.llama_batch_free(self._batch)
            self._cap = max(n, 2 * self._cap)
            self._batch = lc.llama_batch_init(self._cap, 0, 1)
        return self._batch

    def feed(self, tokens: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens[row]`` to each row in one decode; the logits (R, V) float32 after each row's last token
        and, with ``hidden``, its hidden state (R, H), rows in the order of ``tokens``."""
        if any(not t for t in tokens.values()):
            raise ValueError("feed: every row fed needs at least one token")
        return self._decode(tokens, {row: [len(t) - 1] for row, t in tokens.items()})

    def feed_at(
        self, tokens: dict[int, list[int]], read: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`feed`, reading the outputs after the new tokens at indices ``read[row]`` of each row's chunk
        (verification reads every caught-up position): logits (n, V), rows in the order of ``tokens``, each row's
        indices in the order given."""
        if any(not t for t in tokens.values()):
            raise ValueError("feed: every row fed needs at least one token")
        return self._decode(tokens, read)

    def rewind(self, row: int, length: int) -> None:
        """Row ``row`` keeps its first ``length`` tokens; the cache forgets the rest (a verified row cut)."""
        if length < self.lengths[row]:
            lc = _lib()
            if not lc.llama_memory_seq_rm(lc.llama_get_memory(self._ctx), row, length, -1):
                # a recurrent model's memory cannot forget part of a sequence: verified routing cannot run on it
                raise RuntimeError(
                    f"{self.path.name}: llama.cpp cannot take back row {row}'s tokens from {length}"
                )
            self.lengths[row] = length

    def positions(
        self, seqs: list[list[int]], rows: list[int], pos: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced: each of ``seqs`` read whole (the context emptied first, at most :attr:`rows` sequences of
        :attr:`row_tokens`), the logits (n, V) and, with ``hidden``, the hidden states (n, H) at the n pairs
        ``(seqs index rows[i], position pos[i])``, in that order; the context is left empty."""
        self.reset()
        want: dict[int, list[int]] = {}
        for r, q in zip(rows, pos, strict=True):
            want.setdefault(r, []).append(q)
        flagged = {r: sorted(set(qs)) for r, qs in want.items()}
        try:
            logits, hidden = self._decode({r: list(seqs[r]) for r in flagged}, flagged)
        finally:
            self.reset()
        at = {(r, q): k for k, (r, q) in enumerate((r, q) for r, qs in flagged.items() for q in qs)}
        idx = torch.tensor([at[r, q] for r, q in zip(rows, pos, strict=True)], dtype=torch.long)
        return logits.index_select(0, idx), None if hidden is None else hidden.index_select(0, idx)

    def _decode(
        self, tokens: dict[int, list[int]], out: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens[row]`` to each row in one decode, reading the logits (and hidden states) at the indices
        ``out[row]`` of each row's new tokens, rows in the order of ``tokens``."""
        lc = _lib()
        n = sum(len(t) for t in tokens.values())
        if n == 0:
            raise ValueError("feed: no tokens to decode")
        b = self._batch_for(n)
        i = 0
        read = []  # the batch index of every token whose outputs are read
        for row, toks in tokens.items():
            start = self.lengths[row]
            if start + len(toks) > self.row_tokens:
                raise ValueError(
                    f"{self.path.name}: row {row} would hold {start + len(toks)} tokens, over the context's "
                    f"{self.row_tokens} per row"
                )
            wanted = set(out.get(row, ()))
            for j, t in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, start + j, 1, row
                b.logits[i] = j in wanted
                i += 1
            read += [i - len(toks) + j for j in out.get(row, ())]
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"{self.path.name}: llama_decode returned {rc} ({_last_log()})")
        for row, toks in tokens.items():
            self.lengths[row] += len(toks)
        # read by batch index: with embeddings on, llama.cpp may output more tokens than were flagged
        logits = torch.from_numpy(np.stack([
            np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, j), shape=(self.vocab_size,)) for j in read
        ]))  # fmt: skip
        if not self.hidden:
            return logits, None
        hidden = torch.from_numpy(np.stack([
            np.ctypeslib.as_array(lc.llama_get_embeddings_ith(self._ctx, j), shape=(self.hidden_size,)) for j in read
        ]))  # fmt: skip
        return logits, hidden


def gguf_type_counts(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many tensors of each GGUF type a file holds (``{"Q4_0": 168, "F32": 61, ...}``): what a report names as
    the precision a llama.cpp model ran at."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def gguf_cost(path: str | os.PathLike[str]) -> ModelCost:
    """What a decode call of the GGUF file's model reads, as the engine's meter counts it, from the file alone (no
    model loaded): its tensors but an untied input embedding (rows looked up), and the K and V of one token at
    llama.cpp's default cache type (F16). Kept per file version: reading a GGUF's tensor table can take longer than
    a short decode."""
    p = Path(path).resolve()
    st = p.stat()
    return _gguf_cost(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _gguf_cost(path: Path, size: int, mtime_ns: int) -> ModelCost:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str) -> int | None:
        f = reader.fields.get(f"{arch}.{name}")
        return None if f is None else int(f.parts[f.data[0]][0])

    f = reader.fields["general.architecture"]
    arch = bytes(f.parts[f.data[0]]).decode()
    names = {t.name for t in reader.tensors}
    weight = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if t.name != "token_embd.weight" or "output.weight" not in names
    )
    heads, layers = field("attention.head_count"), field("block_count")
    kv_heads = field("attention.head_count_kv") or heads
    head_dim = field("attention.key_length") or (field("embedding_length") or 0) // (heads or 1)
    if not (heads and layers and head_dim and kv_heads):
        raise GgufError(
            f"{path}: no {arch}.block_count/attention.head_count/embedding_length to size its cache"
        )
    return ModelCost(weight_bytes=weight, kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2)


MAX_SEQUENCES = 256  # llama.cpp's limit on a context's sequence ids (LLAMA_MAX_SEQ); more rows take turns


class LlamaCppPool:
    """A session's slot table over one llama.cpp context, what :class:`~citer.decoding.kv_pool.KVPool` is to a torch
    model: the live rows are slots 0..n-1, slot ``i`` holding the context's sequence id ``seq[i]``. Moving a row to
    another slot renames its sequence id; no cache entry is copied. The context grows only while no row is live
    (growing makes a new, empty one), to at least ``rows_hint`` rows; while rows are live, :meth:`room` admits only
    rows that fit its free sequence ids and row length."""

    def __init__(self, model: LlamaCppModel, rows_hint: int = 1) -> None:
        self.model = model
        self.rows_hint = min(MAX_SEQUENCES, max(1, rows_hint))
        self.seq: list[int] = []
        self._columns = 0  # the row length the next admission asks for

    @property
    def lengths(self) -> list[int]:
        """Tokens each live slot holds."""
        return [self.model.lengths[q] for q in self.seq]

    def reset(self) -> None:
        """Every row forgotten (the context kept)."""
        self.model.reset()
        self.seq = []

    def room(self, columns: Sequence[int]) -> int:
        """How many of the next rows, asking ``columns[i]`` tokens each, may be admitted now: any number (up to
        :data:`MAX_SEQUENCES`) while no row is live, else those that fit the free sequence ids and the row length,
        in order."""
        if not self.seq:
            return min(len(columns), MAX_SEQUENCES)
        free = self.model.rows - len(self.seq)
        n = 0
        while n < min(free, len(columns)) and columns[n] <= self.model.row_tokens:
            n += 1
        return n

    def ensure_capacity(self, columns: int) -> None:
        """Rows of ``columns`` tokens for the next admission (the context grows there, if it must and may)."""
        self._columns = max(self._columns, columns) if self.seq else columns

    def add_slots(self, k: int) -> list[int]:
        """Open ``k`` empty slots after the live ones, each on a free sequence id."""
        m = self.model
        if not self.seq and (k > m.rows or self._columns > m.row_tokens):
            # powers of two: few context rebuilds
            m.fit(max(k, self.rows_hint), 1 << max(self._columns - 1, 1).bit_length())
        taken = set(self.seq)
        free = [q for q in range(m.rows) if q not in taken][:k]
        if len(free) < k or self._columns > m.row_tokens:
            raise RuntimeError(
                f"{m.path.name}: {k} more rows of {self._columns} tokens do not fit the context"
            )
        n = len(self.seq)
        self.seq += free
        return list(range(n, n + k))

    def remove_slots(self, slots: Sequence[int]) -> dict[int, int]:
        """Free ``slots`` (their sequences cleared); the live slots stay a prefix, the tail rows moving into the holes
        as :meth:`KVPool.remove_slots` moves them. Returns ``{old_slot: new_slot}`` for the rows that moved."""
        for s in set(slots):
            self.model.clear(self.seq[s])
        keep_n, moved = compaction(len(self.seq), slots)
        for a, b in moved.items():
            self.seq[b] = self.seq[a]
        del self.seq[keep_n:]
        return moved

    def rewind(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps its first ``length`` tokens (a verified row cut)."""
        self.model.rewind(self.seq[slot], length)


@dataclass
class LlamaCppRunner:
    """How one llama.cpp model's calls run in a :class:`~citer.decoding.session.DecodeSession`: the session's calls
    (:meth:`feed`, as :class:`~citer.decoding.runner.ModelRunner` takes them) as decodes of the pool's sequences. No
    compiled or captured steps. Counts its calls, the tokens they read and their seconds."""

    static = None  # the torch runner's fixed-shape steps and compiled forward: none here
    compiled = None
    steps = None
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def feed(
        self,
        pool: LlamaCppPool,
        chunks: Sequence[Sequence[int]],
        slots: Sequence[int] | None = None,
        every: bool = False,
        decide: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``chunks[i]`` to slot ``slots[i]`` (default: slot i) in one decode: the logits (b, V) after each row's
        last token and the hidden states (b, H) (b, 0 where the context returns none); ``every``: the logits (b, Q,
        V) at every fed position. An empty chunk holds its row (its outputs are zeros)."""
        t0 = time.perf_counter()
        slots = range(len(chunks)) if slots is None else slots
        fed = {pool.seq[s]: [int(t) for t in c] for s, c in zip(slots, chunks, strict=True) if c}
        at = [i for i, c in enumerate(chunks) if c]
        m, b = pool.model, len(chunks)
        if every:
            logits, _ = m.feed_at(fed, {q: list(range(len(c))) for q, c in fed.items()})  # (N, V)
            out = logits.new_zeros((b, max(len(c) for c in chunks), logits.shape[-1]))
            n = 0
            for i in at:
                out[i, : len(chunks[i])] = logits[n : n + len(chunks[i])]
                n += len(chunks[i])
            res = (out, logits.new_zeros((b, 0)))
        else:
            logits, hidden = m.feed(fed)  # (k, V), (k, H) or None
            full = logits.new_zeros((b, logits.shape[-1]))
            full[at] = logits
            h = logits.new_zeros((b, 0 if hidden is None else hidden.shape[-1]))
            if hidden is not None:
                h[at] = hidden
            res = (full, h)
        self.calls += 1
        self.tokens += sum(len(c) for c in fed.values())
        self.seconds += time.perf_counter() - t0
        return res
