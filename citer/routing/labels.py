"""Token-level preference collection (CITER section 3.2).

Iteration 1 needs no decoding loop for the easy tokens: one teacher-forced pass of each model over prompt + reference
gives, at every target position t, both models' greedy next token and the SLM's hidden state.

    SLM argmax == reference token  -> ``slm_correct``, label 1 (SLM preferred)
    else LLM argmax == reference   -> ``llm_correct``, label 0 (LLM preferred)
    else                           -> ``both_wrong``: decode the rest of the answer from prefix + the SLM's token
                                      (SLM only) and prefer the SLM iff the final answer is correct.

Iteration k >= 2 relabels only the ``both_wrong`` tokens, rolling out through the routed engine with router k-1:
SLM iff the rollout from the SLM's token is right. With ``rollout_llm_token`` the LLM's token is rolled out too where
the SLM's branch fails: only the LLM's right -> LLM; both wrong -> the previous label stands (see
:func:`collect_iter_k`). CITER-S (``params.citer_s``) labels every ``both_wrong`` token LLM without a rollout.
Rollouts themselves live in :mod:`citer.routing.rollouts`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from citer.config import LabelsParams
from citer.data.formats import Format
from citer.data.origin import origin
from citer.data.prompts import build_prompt, build_target
from citer.decoding.baselines import Router
from citer.decoding.pairing import cut_logits, input_device
from citer.ops.progress import progress
from citer.routing.label_store import LLM_PREFERRED, SLM_PREFERRED, LabelsError, LabelSet, make_tokens_table
from citer.routing.rollouts import Branch, pad_id, rollout_correct, rollout_engine

__all__ = [
    "Branch",
    "Encoded",
    "InProcessWork",
    "LabelWork",
    "TeacherForced",
    "assemble_teacher_forced",
    "citer_s_labels",
    "collect_iter1",
    "collect_iter_k",
    "encode_rows",
    "rollout_correct",
    "rows_hash",
    "teacher_forced",
]


@dataclass(frozen=True)
class Encoded:
    """One training example as token ids: the target ends in EOS."""

    example_id: str
    prompt: list[int]
    target: list[int]
    origin: str = ""  # "file:line" (or "row N") for error messages


def encode_rows(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], fmt: Format, n_examples: int = 0
) -> list[Encoded]:
    """Prompt and target ids per row (prompt and target encoded separately, no special tokens, EOS appended)."""
    if tokenizer.eos_token_id is None:
        raise LabelsError("tokenizer: field eos_token is not set")
    use = rows[:n_examples] if n_examples > 0 else rows
    out = []
    for i, row in enumerate(use):
        try:
            prompt = tokenizer.encode(build_prompt(row, fmt), add_special_tokens=False)
            target = tokenizer.encode(build_target(row, fmt), add_special_tokens=False)
        except KeyError as exc:
            raise LabelsError(f"{origin(row, i)}: field {exc.args[0]!r} missing for format {fmt!r}") from exc
        if not prompt:
            raise LabelsError(f"{origin(row, i)}: field prompt encodes to no tokens")
        eos = [int(tokenizer.eos_token_id)]
        out.append(Encoded(str(i), list(prompt), list(target) + eos, origin(row, i)))
    if not out:
        raise LabelsError("rows: no examples to label (empty input)")
    return out


def rows_hash(encoded: Sequence[Encoded]) -> str:
    """Identifies the exact token sequences labelled, so iteration k refuses rows that differ from iteration 1."""
    h = hashlib.sha256()
    for e in encoded:
        h.update(json.dumps([e.prompt, e.target]).encode())
    return h.hexdigest()[:16]


def model_name(model: Any) -> str:
    return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))


# ----------------------------------------------------------------------------------------------------------------
# Teacher-forced pass


@dataclass
class TeacherForced:
    """Per target token, flattened in (example, position) order; N = total target tokens."""

    example_index: torch.Tensor  # (N,) long, index into the encoded list
    position: torch.Tensor  # (N,) long, index into that example's target
    ref: torch.Tensor  # (N,) long, the reference token
    slm_token: torch.Tensor  # (N,) long, SLM argmax at the position that predicts ref
    llm_token: torch.Tensor  # (N,) long
    hidden: torch.Tensor  # (N, H) float32, SLM last hidden state after the final norm


def _decoder_hidden(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Last hidden state after the final norm: (B, L) -> (B, L, H), the router input (docs/contracts.md)."""
    # Right padding: positions 0..len-1 of every row are exactly the unpadded sequence's positions.
    out = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    return out.last_hidden_state


@torch.inference_mode()
def _targets_forward(model: Any, batch: Sequence[Encoded], pad_id: int, want_hidden: bool, vocab_size: int):
    """Argmax over the tokenizer's ``vocab_size`` ids (n,) and optionally hidden (n, H) at each target position."""
    device = input_device(model)
    seqs = [e.prompt + e.target[:-1] for e in batch]  # the last target token (EOS) predicts nothing we need
    max_pos = getattr(model.config, "max_position_embeddings", None)
    L = max(len(s) for s in seqs)
    if max_pos is not None and L > max_pos:
        i = max(range(len(seqs)), key=lambda j: len(seqs[j]))
        raise LabelsError(
            f"{batch[i].origin}: field prompt+target has {len(seqs[i])} tokens, more than the "
            f"model's max_position_embeddings={max_pos} (citer data validate --model lists every such row)"
        )
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    h = _decoder_hidden(model, ids.to(device), mask.to(device))  # (B, L, H)
    # Target token t of example b is predicted at sequence position len(prompt) - 1 + t.
    b_idx = torch.cat([torch.full((len(e.target),), b) for b, e in enumerate(batch)])
    p_idx = torch.cat([torch.arange(len(e.target)) + len(e.prompt) - 1 for e in batch])
    ht = h[b_idx.to(h.device), p_idx.to(h.device)]  # (n, H)
    # (n, V): padded embedding rows never win
    logits = cut_logits(model.get_output_embeddings()(ht), vocab_size)
    return logits.argmax(-1).cpu(), (ht.float().cpu() if want_hidden else None)


def teacher_forced_order(encoded: Sequence[Encoded]) -> list[int]:
    """The order :func:`teacher_forced` batches examples in: shortest first (ties by index)."""
    return sorted(range(len(encoded)), key=lambda i: len(encoded[i].prompt) + len(encoded[i].target))


def teacher_forced(
    slm: Any,
    llm: Any,
    encoded: Sequence[Encoded],
    batch_size: int,
    pad_id: int,
    vocab_size: int | None = None,
) -> TeacherForced:
    """One forward pass per model per batch (similar lengths together); greedy tokens among the tokenizer's
    ``vocab_size`` ids (default: the smaller embedding), so embeddings padded to different sizes compare alike."""
    vocab = vocab_size or min(int(m.get_output_embeddings().out_features) for m in (slm, llm))
    order = teacher_forced_order(encoded)
    per_ex: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    starts = range(0, len(order), batch_size)
    for s in progress(starts, desc="labels: teacher-forced", total=len(starts), unit="batch"):
        idx = order[s : s + batch_size]
        batch = [encoded[i] for i in idx]
        slm_tok, hid = _targets_forward(slm, batch, pad_id, want_hidden=True, vocab_size=vocab)
        llm_tok, _ = _targets_forward(llm, batch, pad_id, want_hidden=False, vocab_size=vocab)
        off = 0
        for i, e in zip(idx, batch, strict=True):
            n = len(e.target)
            per_ex[i] = (slm_tok[off : off + n], llm_tok[off : off + n], hid[off : off + n])
            off += n
    return assemble_teacher_forced(encoded, per_ex)


def assemble_teacher_forced(
    encoded: Sequence[Encoded], per_ex: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> TeacherForced:
    """Per-example ``(slm_token, llm_token, hidden)`` flattened in (example, position) order."""
    ex = range(len(encoded))
    return TeacherForced(
        example_index=torch.cat([torch.full((len(encoded[i].target),), i) for i in ex]),
        position=torch.cat([torch.arange(len(encoded[i].target)) for i in ex]),
        ref=torch.cat([torch.tensor(encoded[i].target) for i in ex]),
        slm_token=torch.cat([per_ex[i][0] for i in ex]),
        llm_token=torch.cat([per_ex[i][1] for i in ex]),
        hidden=torch.cat([per_ex[i][2] for i in ex]),
    )


class LabelWork(Protocol):
    """Where the costly passes run; every kind returns exactly what :class:`InProcessWork` returns."""

    hidden_size: int

    def teacher_forced(self, encoded: Sequence[Encoded], batch_size: int) -> TeacherForced: ...

    def rollouts(
        self, encoded: Sequence[Encoded], branches: Sequence[Branch], routed: bool, batch: int, max_new: int
    ) -> list[bool]: ...


@dataclass
class InProcessWork:
    """The passes on models held by this process; ``routed`` rollouts use ``router`` at ``tau``, others the SLM."""

    slm: Any
    llm: Any
    tokenizer: Any
    rows: Sequence[Mapping[str, Any]]
    fmt: Format
    router: Router | None = None
    tau: float = 1.0
    verify: dict[str, Any] | None = None  # routed rollouts' verification (RoutedEngine keyword arguments)

    @property
    def hidden_size(self) -> int:
        return int(self.slm.config.hidden_size)

    def teacher_forced(self, encoded: Sequence[Encoded], batch_size: int) -> TeacherForced:
        tok = self.tokenizer
        return teacher_forced(self.slm, self.llm, encoded, batch_size, pad_id(tok), len(tok))

    def rollouts(
        self, encoded: Sequence[Encoded], branches: Sequence[Branch], routed: bool, batch: int, max_new: int
    ) -> list[bool]:
        if routed and hasattr(self.router, "eval"):
            self.router.eval()
        args = (self.llm, self.router, self.tau) if routed else (None, None, 1.0)
        engine = rollout_engine(self.slm, *args, self.tokenizer, self.verify if routed else None)
        tok = self.tokenizer
        return rollout_correct(engine, tok, encoded, self.rows, self.fmt, branches, batch, max_new)


# ----------------------------------------------------------------------------------------------------------------
# Iterations


def collect_iter1(
    slm: Any,
    llm: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    params: LabelsParams,
    *,
    slm_name: str | None = None,
    llm_name: str | None = None,
    work: LabelWork | None = None,
) -> LabelSet:
    """Iteration-1 labels: teacher-forced cases, SLM-only rollouts for ``both_wrong`` (LLM label under CITER-S).

    ``work`` runs the passes elsewhere (shards on workers; ``slm``/``llm`` may then be None); default: here."""
    work = work or InProcessWork(slm, llm, tokenizer, rows, fmt)
    enc = encode_rows(tokenizer, rows, fmt, params.n_examples)
    tf = work.teacher_forced(enc, params.batch_size)
    slm_ok = tf.slm_token == tf.ref  # (N,)
    llm_ok = tf.llm_token == tf.ref
    case = [
        "slm_correct" if s else "llm_correct" if m else "both_wrong"
        for s, m in zip(slm_ok, llm_ok, strict=True)
    ]
    label = torch.where(slm_ok, SLM_PREFERRED, LLM_PREFERRED)  # (N,) both_wrong filled below
    both = torch.nonzero(~slm_ok & ~llm_ok).flatten().tolist()
    if both and not params.citer_s:
        branches = [Branch(int(tf.example_index[i]), int(tf.position[i]), int(tf.slm_token[i])) for i in both]
        ok = work.rollouts(enc, branches, False, params.batch_size, params.max_new_tokens)
        label[both] = torch.tensor([SLM_PREFERRED if o else LLM_PREFERRED for o in ok])
    dtype = torch.float16 if params.hidden_dtype == "float16" else torch.float32
    n = len(case)
    table = make_tokens_table(
        {
            "example_id": [enc[i].example_id for i in tf.example_index.tolist()],
            "position": tf.position.tolist(),
            "case": case,
            "label": label.tolist(),
            "iteration": [1] * n,
            "row": list(range(n)),
            "slm_token": tf.slm_token.tolist(),
            "llm_token": tf.llm_token.tolist(),
            "ref_token": tf.ref.tolist(),
        }
    )
    meta = {
        "iteration": 1,
        "fmt": fmt,
        "slm": slm_name if slm_name is not None else model_name(slm),
        "llm": llm_name if llm_name is not None else model_name(llm),
        "citer_s": params.citer_s,
        "n_examples": len(enc),
        "rows_hash": rows_hash(enc),
        "n_rollouts": 0 if params.citer_s else len(both),
    }
    return LabelSet(hidden=tf.hidden.to(dtype), tokens=table, meta=meta)


def citer_s_labels(ls: LabelSet) -> LabelSet:
    """CITER-S (the paper's ablation, close to Co-LLM's labels): every ``both_wrong`` token -> LLM, no rollout.

    Derived from an iteration-1 label set (same hidden states and cases), so the baseline costs no extra decoding.
    """
    if ls.iteration != 1:
        raise LabelsError(
            f"label set: field iteration={ls.iteration}; CITER-S labels derive from iteration 1"
        )
    tokens = ls.tokens.copy()
    both = tokens["case"] == "both_wrong"
    tokens.loc[both, "label"] = LLM_PREFERRED
    meta = dict(ls.meta, citer_s=True, n_rollouts=0, n_changed=int((ls.tokens.loc[both, "label"] != 0).sum()))
    return LabelSet(ls.hidden, tokens, meta)


def collect_iter_k(
    prev: LabelSet,
    router: Router,
    slm: Any,
    llm: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    params: LabelsParams,
    work: LabelWork | None = None,
) -> LabelSet:
    """Relabel ``prev``'s ``both_wrong`` tokens by routed rollouts (router of iteration k-1, τ = params.tau).

    The SLM's token is rolled out: right -> SLM, else LLM. With ``params.rollout_llm_token`` a failed SLM branch
    is compared with the LLM's branch (rolled out only there, and only when the LLM's token differs): the LLM's
    right -> LLM; both wrong -> neither token rescues the answer under the current router, so this token carries
    no new evidence and ``prev``'s label stands (the flag off would label it LLM). Every other token, and every
    hidden state, is carried over unchanged. ``work``: as in :func:`collect_iter1` (it holds the router then).
    """
    work = work or InProcessWork(slm, llm, tokenizer, rows, fmt, router, params.tau, params.verify_kwargs)
    k = prev.iteration + 1
    if prev.meta.get("citer_s"):
        raise LabelsError("label set: field citer_s is true; CITER-S labels are one-step, no iteration k")
    enc = encode_rows(tokenizer, rows, fmt, int(prev.meta.get("n_examples", 0)))
    if prev.meta.get("rows_hash") != rows_hash(enc):
        raise LabelsError(
            f"label set (iteration {prev.iteration}): field rows_hash={prev.meta.get('rows_hash')!r} does not match "
            f"the given rows ({rows_hash(enc)!r}); pass the same rows, format and tokenizer as iteration 1"
        )
    slm_h = work.hidden_size
    if prev.hidden_size != slm_h:
        raise LabelsError(f"label set: field hidden has size {prev.hidden_size}, the SLM's is {slm_h}")
    tokens = prev.tokens.copy()
    both = tokens.index[tokens["case"] == "both_wrong"].tolist()
    meta = dict(prev.meta, iteration=k, tau=params.tau, rollout_llm_token=params.rollout_llm_token)
    meta |= params.verify_meta
    if not both:
        return LabelSet(prev.hidden, tokens, dict(meta, n_rollouts=0, n_changed=0))

    def run(idx: list[int], col: str) -> list[bool]:
        sel = tokens.loc[idx]
        branches = [
            Branch(int(e), int(p), int(t))
            for e, p, t in zip(sel["example_id"], sel["position"], sel[col], strict=True)
        ]
        return work.rollouts(enc, branches, True, params.batch_size, params.max_new_tokens)

    old = tokens.loc[both, "label"].tolist()
    slm_ok = dict(zip(both, run(both, "slm_token"), strict=True))
    new = {i: SLM_PREFERRED if ok else LLM_PREFERRED for i, ok in slm_ok.items()}
    outcomes: dict[str, int] = {"slm_ok": sum(slm_ok.values())}
    n_rollouts = len(both)
    if params.rollout_llm_token:
        failed = [i for i in both if not slm_ok[i]]
        # Where both models chose the same token the LLM's branch is the SLM's: it fails too, no rollout needed.
        differ = [i for i in failed if tokens.at[i, "llm_token"] != tokens.at[i, "slm_token"]]
        llm_ok = dict.fromkeys(failed, False) | dict(zip(differ, run(differ, "llm_token"), strict=True))
        for i in failed:
            new[i] = _compare(False, llm_ok[i], int(tokens.at[i, "label"]))
        n_rollouts += len(differ)
        outcomes.update(
            only_llm_ok=sum(llm_ok.values()),
            neither_ok=sum(not v for v in llm_ok.values()),  # these keep the previous label
        )
    labels = [new[i] for i in both]
    tokens.loc[both, "label"] = labels
    tokens.loc[both, "iteration"] = k
    n_changed = sum(int(a != b) for a, b in zip(old, labels, strict=True))
    return LabelSet(
        prev.hidden, tokens, dict(meta, n_rollouts=n_rollouts, n_changed=n_changed, outcomes=outcomes)
    )


def _compare(slm_ok: bool, llm_ok: bool, previous: int) -> int:
    """Preference from the two branches: the SLM's right -> SLM (the cheaper, also when both are right); only the
    LLM's right -> LLM; both wrong -> ``previous`` (the token did not decide the outcome: no new evidence)."""
    if slm_ok:
        return SLM_PREFERRED
    return LLM_PREFERRED if llm_ok else previous
