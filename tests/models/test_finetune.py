"""SLM chain-of-thought finetuning with the Trainer: masking, a real (tiny) run, LoRA, and the DeepSpeed wiring."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from citer.config import FinetuneParams, LoraParams
from citer.data.prompts import build_prompt
from citer.models.finetune import FinetuneError, SFTCollator, encode_sft, finetune_slm, training_arguments
from citer.models.loading import load_model

ROWS = [
    {"id": f"r{i}", "problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. So \\boxed{{{i + 1}}}."}
    for i in range(8)
]
TINY = FinetuneParams(lr=3e-3, max_steps=12, batch_size=4, max_length=64, logging_steps=4, bf16=False)


def test_prompt_positions_are_masked_and_the_target_ends_in_eos(char_tokenizer):
    tok = char_tokenizer
    feats, truncated = encode_sft(ROWS[:2], "math", tok, max_length=64)
    assert truncated == []
    for f, row in zip(feats, ROWS, strict=False):
        n_prompt = len(build_prompt(row, "math"))  # the char tokenizer: one token per character
        assert f["labels"][:n_prompt] == [-100] * n_prompt
        assert f["labels"][n_prompt:] == f["input_ids"][n_prompt:]
        assert f["input_ids"][-1] == tok.eos_token_id
        assert tok.decode(f["input_ids"][n_prompt:-1]) == " " + row["solution"]
    short, truncated = encode_sft(ROWS[:2], "math", tok, max_length=len(build_prompt(ROWS[0], "math")) + 3)
    assert truncated == [0, 1] and all(
        len(f["input_ids"]) == len(build_prompt(ROWS[0], "math")) + 3 for f in short
    )
    none, truncated = encode_sft(ROWS[:2], "math", tok, max_length=4)
    assert none == [] and truncated == [0, 1]
    batch = SFTCollator(tok.pad_token_id)(feats)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    pad_cols = batch["attention_mask"] == 0
    assert (batch["labels"][pad_cols] == -100).all() and (
        batch["input_ids"][pad_cols] == tok.pad_token_id
    ).all()


def test_finetune_trains_saves_and_evaluates(tiny_pair_dirs, tmp_path):
    out = tmp_path / "slm"
    res = finetune_slm(tiny_pair_dirs[0], ROWS, "math", TINY, out, eval_rows=ROWS[:3])
    losses = [h["loss"] for h in res.log_history if "loss" in h]
    assert res.steps == 12 and len(losses) >= 3 and losses[-1] < losses[0]
    assert res.eval_n == 3 and 0.0 <= res.eval_accuracy <= 1.0
    assert not res.deepspeed and not res.lora and res.train_examples == len(ROWS)
    model, tok = load_model(out)
    base, _ = load_model(tiny_pair_dirs[0])
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), base.state_dict().values(), strict=True)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slm"]  # no checkpoints or scratch left beside it
    # Seeded: the same run gives the same weights.
    again = finetune_slm(tiny_pair_dirs[0], ROWS, "math", TINY, tmp_path / "again")
    assert again.train_loss == res.train_loss
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_finetune_saves_a_plain_merged_model(tiny_pair_dirs, tmp_path):
    params = TINY.model_copy(update={"lora": LoraParams(enabled=True, r=4, alpha=8, dropout=0.0), "lr": 1e-2})
    res = finetune_slm(tiny_pair_dirs[0], ROWS, "math", params, tmp_path / "slm")
    weights = load_file(tmp_path / "slm" / "model.safetensors")
    base = load_file(tiny_pair_dirs[0] / "model.safetensors")
    assert res.lora and sorted(weights) == sorted(base)  # no lora_A / lora_B keys: adapters merged
    changed = [k for k in base if not torch.equal(base[k], weights[k])]
    assert changed and all(any(m in k for m in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)
    assert res.trainable_params < sum(t.numel() for t in base.values()) // 4


def test_bad_input_fails_before_anything_is_written(tiny_pair_dirs, tmp_path):
    with pytest.raises(FinetuneError, match="no training rows"):
        finetune_slm(tiny_pair_dirs[0], [], "math", TINY, tmp_path / "out")
    with pytest.raises(
        FinetuneError, match=r"8 of 8 training rows \(100.0%\) are longer than finetune.max_length=4"
    ):
        finetune_slm(
            tiny_pair_dirs[0], ROWS, "math", TINY.model_copy(update={"max_length": 4}), tmp_path / "out"
        )
    with pytest.raises(ValueError, match="missing.*not found"):
        finetune_slm(tmp_path / "missing", ROWS, "math", TINY, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_deepspeed_is_off_on_cpu_unless_asked(tmp_path):
    args = training_arguments(FinetuneParams(deepspeed=True), tmp_path)
    assert args.deepspeed is None and args.use_cpu == (not torch.cuda.is_available()) and args.report_to == []
    with pytest.raises(FinetuneError, match="nope.json: DeepSpeed config file not found"):
        training_arguments(FinetuneParams(deepspeed_config="nope.json"), tmp_path, deepspeed=True)


_DS_CHECK = """
import json, sys
from citer.config import FinetuneParams
from citer.models.finetune import build_trainer
from conftest import make_char_tokenizer, make_qwen2
tok = make_char_tokenizer()
rows = [{"problem": "1 + 1?", "solution": "\\\\boxed{2}"}]
params = FinetuneParams(deepspeed=True, deepspeed_config=sys.argv[1], batch_size=2, lr=1e-3, bf16=False)
trainer, _ = build_trainer(make_qwen2(len(tok)), tok, rows, "math", params, sys.argv[2], deepspeed=True)
cfg = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
print(json.dumps({"enabled": trainer.is_deepspeed_enabled, "args": trainer.args.deepspeed,
                  "stage": cfg["zero_optimization"]["stage"], "micro": cfg["train_micro_batch_size_per_gpu"],
                  "clip": cfg["gradient_clipping"]}))
"""


def test_deepspeed_zero2_config_reaches_the_trainer(tmp_path):
    # A fresh process: DeepSpeed sets up a one-rank process group and Accelerate's global state, which must not
    # leak into other tests. No optimizer is built, so no ops are JIT-compiled.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=f"{REPO}:{REPO / 'tests'}",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
    )
    cfg = REPO / "infra" / "deepspeed" / "zero2.json"
    proc = subprocess.run(
        [sys.executable, "-c", _DS_CHECK, str(cfg), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"enabled": True, "args": str(cfg), "stage": 2, "micro": 2, "clip": 1.0}
