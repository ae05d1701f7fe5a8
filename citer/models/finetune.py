"""SLM chain-of-thought finetuning with the transformers Trainer (CITER's first step: make the SLM a decent reasoner).

The loss covers only the target (chain of thought + EOS); prompt positions are labelled -100. Prompts and targets
come from ``citer.data.prompts`` so the SLM is trained on exactly the text it later continues. On CUDA with
``finetune.deepspeed`` the Trainer runs DeepSpeed ZeRO-2 from ``infra/deepspeed/zero2.json`` (its "auto" values are
filled in by the Trainer from the same arguments); on CPU the same code path runs without it. LoRA (peft) is an
option; the adapters are merged before saving so the output is an ordinary model directory.

Rows longer than ``max_length`` are cut (their answer is lost, or the whole row when the prompt fills it). The count
and share come back in the result; above ``max_truncated_fraction`` finetuning refuses before training.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from citer.config import FinetuneParams
from citer.data.formats import Format
from citer.data.origin import Row, source
from citer.data.prompts import build_prompt, build_target
from citer.models.evaluate import evaluate_model
from citer.models.loading import count_params, load_model
from citer.ops.io import atomic_dir


class FinetuneError(ValueError):
    """Input finetuning cannot use; the message names what is wrong."""


@dataclass
class FinetuneResult:
    out_dir: str
    train_examples: int
    truncated_examples: int  # rows cut at max_length (dropped ones, whose prompt fills it, included)
    steps: int
    train_loss: float
    seconds: float
    trainable_params: int
    deepspeed: bool
    lora: bool
    truncated_fraction: float = 0.0  # truncated_examples / rows given
    eval_accuracy: float | None = None
    eval_n: int = 0
    log_history: list[dict[str, float]] = field(default_factory=list)  # Trainer log_history: the loss curve

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a tracker."""
        out = {
            "train_examples": float(self.train_examples),
            "truncated_examples": float(self.truncated_examples),
            "truncated_fraction": self.truncated_fraction,
            "steps": float(self.steps),
            "train_loss": self.train_loss,
            "seconds": self.seconds,
            "trainable_params": float(self.trainable_params),
        }
        if self.eval_accuracy is not None:
            out["eval_accuracy"] = self.eval_accuracy
        return out


def encode_sft(
    rows: Sequence[dict[str, Any]], fmt: Format, tokenizer, max_length: int
) -> tuple[list[dict[str, list[int]]], list[int]]:
    """``({"input_ids", "labels"} per usable row, indexes of the rows cut)``: prompt labels -100, target + EOS kept.

    A row whose prompt alone fills ``max_length`` has nothing to learn from and is dropped (and counted as cut).
    """
    if tokenizer.eos_token_id is None:
        raise FinetuneError("tokenizer has no eos_token; the target could not end")
    feats, cut = [], []
    for i, r in enumerate(rows):
        p = tokenizer.encode(build_prompt(r, fmt), add_special_tokens=False)
        t = tokenizer.encode(build_target(r, fmt), add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(p) + len(t) > max_length:
            cut.append(i)
        ids = (p + t)[:max_length]
        if len(ids) <= len(p):
            continue
        feats.append({"input_ids": ids, "labels": [-100] * len(p) + ids[len(p) :]})
    return feats, cut


def check_truncation(rows: Sequence[dict[str, Any]], cut: Sequence[int], params: FinetuneParams) -> float:
    """The share of ``rows`` cut at ``max_length``; raises :class:`FinetuneError` above ``max_truncated_fraction``."""
    frac = len(cut) / len(rows) if rows else 0.0
    if frac <= params.max_truncated_fraction:
        return frac
    from_file = all(isinstance(rows[i], Row) for i in cut)
    shown = [str(rows[i].line) if from_file else str(i + 1) for i in cut[:10]]
    more = f" and {len(cut) - 10} more" if len(cut) > 10 else ""
    raise FinetuneError(
        f"{source(rows)}: {len(cut)} of {len(rows)} training rows ({frac:.1%}) are longer than "
        f"finetune.max_length={params.max_length} tokens (prompt + target + EOS) and would be cut, more than "
        f"finetune.max_truncated_fraction={params.max_truncated_fraction} allows ({'lines' if from_file else 'rows'} {', '.join(shown)}{more}); "
        "raise finetune.max_length, drop those rows (citer data validate --model lists them) or raise the fraction"
    )


class SFTCollator:
    """Right-pads a batch: pad id in ``input_ids``, 0 in ``attention_mask``, -100 in ``labels``."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, feats: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), width), self.pad, dtype=torch.long)  # (B, T)
        labels = torch.full((len(feats), width), -100, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(feats), width), dtype=torch.long)  # (B, T)
        for r, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[r, :n] = torch.tensor(f["input_ids"])
            labels[r, :n] = torch.tensor(f["labels"])
            mask[r, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_arguments(
    params: FinetuneParams, output_dir: str | os.PathLike[str], *, deepspeed: bool | None = None
):
    """The Trainer's arguments. ``deepspeed=None`` means: on when ``params.deepspeed`` and CUDA is present.

    ``report_to`` stays "none": the calling flow logs ``FinetuneResult.log_history`` itself.
    """
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    use_ds = (params.deepspeed and cuda) if deepspeed is None else deepspeed
    ds_config = None
    if use_ds:
        ds_config = str(Path(params.deepspeed_config).resolve())
        if not Path(ds_config).is_file():
            raise FinetuneError(f"{params.deepspeed_config}: DeepSpeed config file not found")
    return TrainingArguments(
        output_dir=str(output_dir),
        learning_rate=params.lr,
        weight_decay=params.weight_decay,
        num_train_epochs=params.epochs,
        max_steps=params.max_steps,
        per_device_train_batch_size=params.batch_size,
        gradient_accumulation_steps=params.gradient_accumulation_steps,
        warmup_steps=params.warmup_ratio,  # a float below 1 is a fraction of the steps (transformers 5.x)
        lr_scheduler_type=params.lr_scheduler,
        max_grad_norm=1.0,
        bf16=params.bf16 and cuda,
        use_cpu=not cuda,
        deepspeed=ds_config,
        seed=params.seed,
        data_seed=params.seed,
        logging_steps=params.logging_steps,
        logging_first_step=True,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        optim="adamw_torch",
    )


def _apply_lora(model, params: FinetuneParams):
    from peft import LoraConfig, get_peft_model

    lp = params.lora
    cfg = LoraConfig(
        r=lp.r,
        lora_alpha=lp.alpha,
        lora_dropout=lp.dropout,
        target_modules=list(lp.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def build_trainer(
    model,
    tokenizer,
    train_rows: Sequence[dict[str, Any]],
    fmt: Format,
    params: FinetuneParams,
    output_dir: str | os.PathLike[str],
    *,
    deepspeed: bool | None = None,
):
    """``(trainer, rows cut)`` ready to ``train()``; LoRA adapters are attached when ``params.lora.enabled``.

    Refuses (:func:`check_truncation`) when too many rows would be cut at ``params.max_length``.
    """
    from transformers import Trainer, set_seed

    if not train_rows:
        raise FinetuneError("finetune: no training rows")
    feats, cut = encode_sft(train_rows, fmt, tokenizer, params.max_length)
    check_truncation(train_rows, cut, params)
    if not feats:
        raise FinetuneError(
            f"finetune: every training row's prompt is longer than max_length={params.max_length}"
        )
    set_seed(params.seed)
    if params.lora.enabled:
        model = _apply_lora(model, params)
    args = training_arguments(params, output_dir, deepspeed=deepspeed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=feats,
        data_collator=SFTCollator(pad),
        processing_class=tokenizer,
    )
    # The loss curve comes back in FinetuneResult.log_history; printing every log line is the flow's choice.
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer, len(cut)


def finetune_slm(
    model_dir: str | os.PathLike[str],
    train_rows: Sequence[dict[str, Any]],
    fmt: Format,
    params: FinetuneParams,
    out_dir: str | os.PathLike[str],
    eval_rows: Sequence[dict[str, Any]] | None = None,
    *,
    eval_batch_size: int = 64,
    eval_max_new_tokens: int = 96,
) -> FinetuneResult:
    """Finetune the SLM in ``model_dir`` on ``train_rows`` and save it (model + tokenizer) to ``out_dir``.

    ``eval_rows`` (at most ``params.eval_examples`` of them) are then decoded greedily and graded; the accuracy
    and the Trainer's loss curve come back in the result. ``out_dir`` appears only when everything succeeded.
    """
    if not train_rows:
        raise FinetuneError("finetune: no training rows")
    dtype = "float32"  # master weights stay fp32; bf16 autocast comes from TrainingArguments on GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(model_dir, dtype=dtype, device=device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="citer-sft-") as scratch:
        trainer, truncated = build_trainer(model, tok, train_rows, fmt, params, scratch)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        out = trainer.train()
        history = [dict(h) for h in trainer.state.log_history]
        steps = trainer.state.global_step
        deepspeed_on = bool(trainer.is_deepspeed_enabled)
    trained = trainer.model
    if params.lora.enabled:
        trained = trained.merge_and_unload()
    trained.eval()
    seconds = time.perf_counter() - t0
    result = FinetuneResult(
        out_dir=str(out_dir),
        train_examples=len(trainer.train_dataset),
        truncated_examples=truncated,
        truncated_fraction=truncated / len(train_rows),
        steps=steps,
        train_loss=float(out.training_loss),
        seconds=seconds,
        trainable_params=trainable if params.lora.enabled else count_params(trained),
        deepspeed=deepspeed_on,
        lora=params.lora.enabled,
        log_history=history,
    )
    if eval_rows:
        ev = evaluate_model(
            trained, tok, list(eval_rows)[: params.eval_examples], fmt, eval_batch_size, eval_max_new_tokens
        )
        result.eval_accuracy, result.eval_n = ev.accuracy, ev.n
    with atomic_dir(out_dir) as tmp:
        trained.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return result
