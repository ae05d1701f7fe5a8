"""The embedded model pair: a tokenizer built offline and two Qwen2 models pretrained from scratch on the synthetic task.

Everything here runs on CPU in minutes: a byte-level BPE tokenizer trained on the corpus (digits always single
tokens, so arithmetic is digit by digit and answer extraction works on decoded text), then a plain seeded torch loop
(AdamW, linear warm-up and cosine decay, full-sequence LM loss on prompt + target + EOS).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from citer.config import ArchParams, BootstrapParams, PretrainParams
from citer.data.formats import Format
from citer.data.jsonl import read_jsonl
from citer.data.prompts import CHAT_TEMPLATE, build_prompt, build_target
from citer.decoding.padding import right_padded
from citer.models.loading import count_params
from citer.ops.io import atomic_dir
from citer.ops.progress import progress

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


class BootstrapError(ValueError):
    """Input the bootstrap cannot use (an empty or missing training split, a vocabulary too small)."""


def corpus_texts(rows: Sequence[dict[str, Any]], fmt: Format) -> list[str]:
    """Prompt + target text per row: exactly what the models are later asked to continue and write."""
    return [build_prompt(r, fmt) + build_target(r, fmt) for r in rows]


def build_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE ``Qwen2Tokenizer`` whose merges are trained on ``texts``.

    ``AutoTokenizer`` loads a directory whose config says ``qwen2`` as ``Qwen2Tokenizer`` and rebuilds its
    normalizer and pre-tokenizer from Qwen2's own rules, whatever ``tokenizer.json`` says; so the merges are trained
    under exactly those rules (NFC, Qwen2's split regex, byte-level) and the tokenizer is built as that class. Qwen2's
    regex makes every digit its own token; byte-level makes every NFC string representable, so
    decode(encode(x)) == x. The 256-byte alphabet plus merges of the frequent template words keeps the vocabulary --
    and so the small model's embedding -- small. It carries the task's chat template
    (:data:`~citer.data.prompts.CHAT_TEMPLATE`), saved with it, so clients that format chats with the tokenizer's
    template send the training prompt.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if not texts:
        raise BootstrapError("tokenizer: no training text")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise BootstrapError(f"bootstrap.vocab_size: must be at least {len(alphabet) + 2}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=merges,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(arch: ArchParams, tokenizer, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``arch`` for ``tokenizer``."""
    return new_model(arch, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)


def new_model(arch: ArchParams, vocab_size: int, eos_id: int, pad_id: int, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``arch`` for a vocabulary of ``vocab_size`` ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    return model


def encode_corpus(texts: Sequence[str], tokenizer, max_length: int) -> list[list[int]]:
    """Token ids of each text followed by EOS (prompts carry no special tokens; the target ends with EOS)."""
    out = []
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(ids) > max_length:
            raise BootstrapError(
                f"training text {i} is {len(ids)} tokens, longer than max_position_embeddings"
            )
        out.append(ids)
    return out


def _lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak (a multiplier on the peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass
class PretrainResult:
    steps: int
    seconds: float
    final_loss: float
    losses: list[float]  # mean loss per logging window


def pretrain(
    model, seqs: Sequence[Sequence[int]], pad_id: int, params: PretrainParams, seed: int, log_every: int = 50
) -> PretrainResult:
    """Train ``model`` in place on full sequences (loss on every real token, not on padding); seeded."""
    if not seqs:
        raise BootstrapError("pretrain: no training sequences")
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=params.lr,
        betas=(0.9, 0.98),
        foreach=True,  # multi-tensor steps (PyTorch's default on CUDA only): the same weights bit for bit, faster
    )
    warmup = max(1, int(params.warmup_ratio * params.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_at(s, params.steps, warmup))
    model.train()
    order = torch.randperm(len(seqs), generator=gen)
    cursor, window, losses = 0, [], []
    t0 = time.perf_counter()
    for step in progress(range(params.steps), desc="pretrain", total=params.steps, unit="step"):
        if cursor + params.batch_size > len(order):
            order, cursor = torch.randperm(len(seqs), generator=gen), 0
        batch = [seqs[i] for i in order[cursor : cursor + params.batch_size].tolist()]
        cursor += params.batch_size
        ids, mask = right_padded(batch, pad_id)  # (B, T)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(
            input_ids=ids, attention_mask=mask, labels=labels, use_cache=False
        ).loss  # no KV cache to fill
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append(loss.item())
        if len(window) == log_every or step == params.steps - 1:
            losses.append(sum(window) / len(window))
            window = []
    model.eval()
    return PretrainResult(params.steps, time.perf_counter() - t0, losses[-1], losses)


def _read_rows(data_dir: Path, fmt: Format) -> list[dict[str, Any]]:
    path = data_dir / f"{fmt}_train.jsonl"
    if not path.is_file():
        raise BootstrapError(f"{path}: training split not found (run `citer data synth` first)")
    rows = read_jsonl(path, fmt)
    if not rows:
        raise BootstrapError(f"{path}: training split is empty")
    return rows


@dataclass(frozen=True)
class PretrainJob:
    """One model of the pair, from its shape and token sequences to its weights in ``save_dir`` (plain data, so the
    two models can train in separate processes: :func:`citer.ops.processes.run_jobs`)."""

    arch: ArchParams
    pretrain: PretrainParams
    seed: int
    seqs: list[list[int]]  # the corpus, encoded (ids + EOS)
    vocab_size: int
    eos_id: int
    pad_id: int
    save_dir: str


def pretrain_job(job: PretrainJob) -> dict[str, Any]:
    """Build, pretrain and save one model; its parameter count, seconds and final loss."""
    model = new_model(job.arch, job.vocab_size, job.eos_id, job.pad_id, job.seed)
    res = pretrain(model, job.seqs, job.pad_id, job.pretrain, job.seed)
    model.save_pretrained(job.save_dir)
    return {"params": count_params(model), "pretrain_seconds": res.seconds, "final_loss": res.final_loss}


def bootstrap_models(
    params: BootstrapParams,
    data_dir: str | os.PathLike[str],
    slm_dir: str | os.PathLike[str],
    llm_dir: str | os.PathLike[str],
    processes: int = 0,
    after_slm: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Build the SLM base into ``slm_dir`` and the LLM into ``llm_dir`` (each with the shared tokenizer) from the
    synthetic train split(s) in ``data_dir``.

    With ``processes`` = 2 the two models train side by side in worker processes of one torch thread (the same
    weights as one after the other on one thread). Each directory is written atomically, the SLM's first: then
    ``after_slm`` runs (what needs only the SLM, e.g. its finetuning) while the LLM trains. Returns flat metrics
    (parameter counts, seconds, final losses) for the flow to log.
    """
    from citer.ops.processes import run_jobs

    data = Path(data_dir)
    texts: list[str] = []
    for fmt in params.formats:
        texts += corpus_texts(_read_rows(data, fmt), fmt)
    t0 = time.perf_counter()
    tok = build_tokenizer(texts, params.vocab_size)
    metrics: dict[str, Any] = {"vocab_size": len(tok), "n_train_texts": len(texts)}

    def record(key: str, arch: ArchParams, res: dict[str, Any]) -> None:
        metrics.update({f"{key}_{k}": v for k, v in res.items()} | {f"{key}_arch": arch.model_dump()})

    # one encoding for both models, held to the shorter context of the two
    seqs = encode_corpus(texts, tok, min(max(a.max_position_embeddings, 1) for a in (params.slm, params.llm)))
    with atomic_dir(llm_dir) as llm_tmp:
        with atomic_dir(slm_dir) as slm_tmp:
            jobs = [
                PretrainJob(
                    arch,
                    pre,
                    params.seed + seed_off,
                    seqs,
                    len(tok),
                    tok.eos_token_id,
                    tok.pad_token_id,
                    str(tmp),
                )
                for arch, pre, seed_off, tmp in (
                    (params.slm, params.slm_pretrain, 1, slm_tmp),
                    (params.llm, params.llm_pretrain, 2, llm_tmp),
                )
            ]
            results = run_jobs(pretrain_job, jobs, processes)
            try:
                record("slm", params.slm, next(results))
                tok.save_pretrained(slm_tmp)
            except BaseException:
                results.close()  # stops the LLM's worker
                raise
        try:
            if after_slm is not None:
                after_slm()
            record("llm", params.llm, next(results))
        finally:
            results.close()
        tok.save_pretrained(llm_tmp)
    metrics["seconds"] = time.perf_counter() - t0
    return metrics
