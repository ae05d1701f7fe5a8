"""Loading a causal LM and its tokenizer (hub id, local directory or GGUF file), and checking that two models can
be paired.

Errors are raised before anything is built on a bad checkpoint: a missing directory, a truncated weights file, a
config of a model that is not a causal LM, or an SLM/LLM pair whose token -> id maps differ (routing hands token ids
from one model to the other, so the tokenizers must be identical; the embedding sizes may differ) or whose layers
are not all full attention (:mod:`citer.decoding.pairing`). A ``.gguf`` file (llama.cpp's format) is read through
transformers' GGUF support and dequantized to the requested dtype; :mod:`citer.models.gguf` refuses a file it cannot
read before any weights are built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from citer.decoding.pairing import PairingError, check_full_attention
from citer.models.gguf import GgufError, check_gguf, gguf_config, hf_location, is_gguf

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE_MAPS = (
    "auto",
    "balanced",
    "balanced_low_0",
    "sequential",
)  # accelerate's named device_map strategies


class ModelLoadError(ValueError):
    """A model that cannot be loaded or used; the message names the model (path or hub id)."""


class VocabMismatchError(ModelLoadError):
    """An SLM and LLM whose tokenizers map tokens to different ids."""


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _looks_local(name_or_path: str) -> bool:
    # A hub id is "name" or "org/name"; anything with more parts, a leading dot/slash or an existing path is local.
    p = Path(name_or_path)
    return p.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def _check_local_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: model directory not found")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a model directory)")
    try:
        json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg}: not valid JSON ({exc})") from exc
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        raise ModelLoadError(f"{path}: no weights file (model.safetensors)")
    for w in weights:
        if w.suffix != ".safetensors":
            continue
        # A truncated or garbled file fails here with the file named, not deep inside from_pretrained.
        from safetensors import safe_open

        try:
            with safe_open(str(w), framework="pt") as fh:
                for key in fh.keys():
                    fh.get_slice(key)
        except Exception as exc:  # safetensors raises its own SafetensorError or OSError
            raise ModelLoadError(f"{w}: corrupt or truncated safetensors checkpoint ({exc})") from exc


def _checked_gguf(name: str) -> tuple[str, str]:
    """``(directory, file name)`` of a GGUF file transformers can load; :class:`ModelLoadError` naming it if not."""
    try:
        check_gguf(name)
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from exc
    return hf_location(name)


def load_tokenizer(name_or_path: str | os.PathLike[str], trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    name = str(name_or_path)
    source, extra = name, {"trust_remote_code": trust_remote_code}
    if is_gguf(name):
        source, gguf_file = _checked_gguf(name)
        extra = {"gguf_file": gguf_file}  # the file's vocabulary, merges and chat template
    try:
        tok = AutoTokenizer.from_pretrained(source, **extra)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:  # KeyError: a GGUF lacking a key
        raise ModelLoadError(f"{name}: cannot load tokenizer ({type(exc).__name__}: {exc})") from exc
    if tok.pad_token is None:
        # Batched generation needs a pad id; EOS is the usual stand-in for hub models without one.
        tok.pad_token = tok.eos_token
    return tok


def _causal_lm_config(name: str, trust_remote_code: bool) -> Any:
    """The config of a causal LM at ``name``; refuses a missing or broken checkpoint or another kind of model."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf = is_gguf(name)
    if gguf:
        _checked_gguf(name)
    elif _looks_local(name) or (_hub_offline() and not _in_hub_cache(name)):
        # Offline, a name not in the hub cache can only be a local directory: say so, not "hub lookup failed".
        _check_local_dir(Path(name).expanduser())
    try:
        if gguf:
            config = gguf_config(name)  # the file's metadata is its config; no remote code comes with a GGUF
        else:
            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: cannot read model config ({exc})") from exc
    remote_causal = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote_causal:
        raise ModelLoadError(f"{name}: model_type {config.model_type!r} is not a causal language model")
    # An encoder checkpoint (BertModel, ...) of a type that also has an LM head must not get a random head.
    causal_classes: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal_classes.update([v] if isinstance(v, str) else v)
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not remote_causal and not any(a in causal_classes for a in archs):
        raise ModelLoadError(f"{name}: architectures {archs} is not a causal language model")
    return config


def load_config(name_or_path: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The config of the causal LM at ``name_or_path`` (hub id, directory or ``.gguf`` file), without its weights;
    :class:`ModelLoadError` naming it where there is none. For callers that need sizes or the context length only
    (a GGUF has no config.json: ``AutoConfig.from_pretrained(path)`` cannot read one)."""
    return _causal_lm_config(str(name_or_path), trust_remote_code)


def _check_placement(name: str, device: str | dict[str, Any]) -> None:
    """Refuse, naming the model, a device torch cannot parse or does not have (a traceback deep in loading else)."""
    if isinstance(device, str) and device in _DEVICE_MAPS:
        return
    where = device.items() if isinstance(device, dict) else [("models.device", device)]
    for module, d in where:
        if d == "disk":
            continue
        label = f"device {d!r}" + (f" (device_map entry {module!r})" if isinstance(device, dict) else "")
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ModelLoadError(f"{name}: {label} is not a torch device ({exc})") from exc
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise ModelLoadError(f"{name}: {label}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: str = "float32",
    device: str | dict[str, Any] = "cpu",
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode from a local directory, a hub id or a ``.gguf`` file.

    ``device`` is a torch device string (``"cpu"``, ``"cuda:0"``) or a ``device_map`` (``"auto"`` or a dict) for
    models split over several GPUs. A GGUF file's weights are dequantized to ``dtype`` at load: the model is then an
    ordinary dense one (it finetunes and saves as a model directory). Raises :class:`ModelLoadError` naming the model
    on any failure.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    name = str(name_or_path)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"{name}: unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    config = _causal_lm_config(name, trust_remote_code)
    _check_placement(name, device)
    use_map = isinstance(device, dict) or device in _DEVICE_MAPS
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if use_map:
        kwargs["device_map"] = device
    source = name
    if is_gguf(name):
        source, kwargs["gguf_file"] = hf_location(name)
        # Dense weights always: transformers may otherwise keep blocks packed behind its own kernels (on MPS), which
        # the engine's forward and finetuning do not expect.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
        kwargs["config"] = config  # read from the file above: transformers would parse the whole header again
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{name}: cannot load model weights ({exc})") from exc
    if getattr(model, "hf_quantizer", None) is not None and is_gguf(name):
        # Dequantized, it is a plain model: without the GGUF marks the Trainer finetunes it and save_pretrained
        # writes an ordinary model directory (both refuse a "quantized" model).
        model.hf_quantizer.remove_quantization_config(model)
    if not use_map:
        model = model.to(device)
    tok = load_tokenizer(name, trust_remote_code)
    if len(tok) > model.get_input_embeddings().num_embeddings:
        raise ModelLoadError(
            f"{name}: tokenizer has {len(tok)} tokens but the model embeds only "
            f"{model.get_input_embeddings().num_embeddings}"
        )
    return model.eval(), tok


def check_same_vocab(slm_tok, llm_tok, slm_name: str, llm_name: str) -> None:
    """Raise :class:`VocabMismatchError` unless both tokenizers have the same token -> id map and EOS."""
    a, b = slm_tok.get_vocab(), llm_tok.get_vocab()
    if a != b:
        only_a = sorted(set(a) - set(b))[:5]
        only_b = sorted(set(b) - set(a))[:5]
        moved = sorted(t for t in set(a) & set(b) if a[t] != b[t])[:5]
        raise VocabMismatchError(
            f"SLM {slm_name} and LLM {llm_name} have different vocabularies ({len(a)} vs {len(b)} tokens; "
            f"only in SLM: {only_a}, only in LLM: {only_b}, different ids: {moved})"
        )
    if slm_tok.eos_token_id != llm_tok.eos_token_id:
        raise VocabMismatchError(
            f"SLM {slm_name} and LLM {llm_name} disagree on EOS ({slm_tok.eos_token_id} vs {llm_tok.eos_token_id})"
        )


def load_pair(
    slm: str | os.PathLike[str],
    llm: str | os.PathLike[str],
    dtype: str = "float32",
    device: str | dict[str, Any] = "cpu",
    trust_remote_code: bool = False,
    llm_device_map: str | dict[str, Any] | None = None,
) -> tuple[Any, Any, Any]:
    """``(slm_model, llm_model, tokenizer)``; refuses, naming the model(s), a pair whose tokenizers differ or a model
    with any layer that is not full attention. Their embedding sizes may differ (see :mod:`citer.decoding.pairing`).

    ``llm_device_map`` places the LLM with an accelerate ``device_map`` (a dict or ``"auto"``) while the SLM sits on
    ``device``. Tokenizers and configs are all checked before any weights are loaded.
    """
    slm_tok = load_tokenizer(slm, trust_remote_code)
    llm_tok = load_tokenizer(llm, trust_remote_code)
    check_same_vocab(slm_tok, llm_tok, str(slm), str(llm))
    for name in (slm, llm):
        try:
            check_full_attention(_causal_lm_config(str(name), trust_remote_code), str(name))
        except PairingError as exc:
            raise ModelLoadError(str(exc)) from exc
    slm_model, tok = load_model(slm, dtype, device, trust_remote_code)
    llm_place = device if llm_device_map is None else llm_device_map
    llm_model, _ = load_model(llm, dtype, llm_place, trust_remote_code)
    return slm_model, llm_model, tok
