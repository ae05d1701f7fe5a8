"""Blocks of routed batch inference and the server."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from citer.config.base import (
    _Block,
    _FieldError,
)


class EngineParams(_Block):
    """The routed decoder as ``citer route``, ``citer serve`` and ``citer.load_champion`` build it.

    Shared LLM calls: a row the router sends to the LLM may wait, without advancing, until ``llm_min_rows`` rows want
    the LLM or it has waited ``llm_max_wait_steps`` steps, so one read of the LLM's weights serves several rows.
    Tokens never change, only when they arrive; 1 and 0 (the default) call the LLM at once -- the batch-1 latency
    regime the paper measures. Worth turning on where many rows decode together (a busy server, ``citer route``).
    """

    llm_min_rows: int = Field(1, ge=1, le=4096)
    llm_max_wait_steps: int = Field(0, ge=0, le=4096)
    # "measured": the engine calls its LLM queue by a rule derived from its own measured step times
    # (citer.decoding.call_rule), ignoring the two counts above; "fixed": by the counts.
    llm_schedule: Literal["fixed", "measured"] = "fixed"
    # "admit": the LLM reads admitted prompts in one call beside the SLM's prefill; "lazy": in each row's first
    # catch-up, mixed with other rows' catch-ups.
    llm_prefill: Literal["lazy", "admit"] = "lazy"
    # How both models' calls run (citer.decoding.runner): "eager" the lean forward as calls come (the pipeline's
    # records); "compiled" it under torch.compile (faster steps once compiled, seconds per graph kind paid at the
    # first requests, fused rounding): a long-running CPU server or a big route; "graphs" decode steps and short
    # catch-ups as fixed-shape calls captured per bucket: CUDA graphs, the path bench/gpu_oneshot.sh measures.
    forward: Literal["eager", "compiled", "graphs"] = "eager"
    # Queue the SLM's step while the LLM's catch-up is in flight (on CUDA, a stream of its own); the LLM's tokens
    # reach the SLM a step later. Same tokens; pays where the device overlaps the calls (a GPU), not on a CPU.
    overlap: bool = False
    # Which kernels decode: "torch" (this engine, every option above) or "llama_cpp" (both models as GGUF files on
    # llama.cpp's CPU kernels, citer.decoding.llama_cpp_engine; needs llama-cpp-python: CITER_LLAMA_CPP=1 bash
    # scripts/setup.sh). Honoured by citer route, the sweep's passes and citer serve, so tau is chosen on the runner
    # that serves. It shares LLM calls (llm_min_rows, llm_max_wait_steps, llm_schedule) and reads prompts
    # (llm_prefill) as the torch engine does, and runs no other forward or overlap.
    runner: Literal["torch", "llama_cpp"] = "torch"
    # The llama.cpp type the pipeline's models are converted to (llama.cpp's quantizer for the quantized ones):
    # F32, BF16, F16, Q8_0, Q6_K, Q5_K_M, Q5_0, Q4_K_M, Q4_0, ... ; K-quants need widths that are multiples of 256.
    llama_cpp_type: str = Field("Q8_0", pattern=r"^(F32|BF16|F16|Q[2-8](_[01K])?(_[SML])?)$")

    def runner_name(self) -> str:
        """What decodes, as a registered version records it: ``torch``, or ``llama_cpp:<type>``."""
        return "torch" if self.runner == "torch" else f"llama_cpp:{self.llama_cpp_type}"

    @model_validator(mode="after")
    def _one_runner(self) -> EngineParams:
        torch_only = {"forward": "eager", "overlap": False}
        if self.runner == "llama_cpp":
            for name, default in torch_only.items():
                if getattr(self, name) != default:
                    raise _FieldError(
                        "runner", self.runner, f"llama_cpp runs no {name} (set it to {default!r})"
                    )
        return self


class InferenceParams(_Block):
    """``citer route``: the champion router over a JSONL of questions; rerunning resumes where it stopped."""

    input: str | None = None  # None: data.test, the split the sweep routed
    output: str = "outputs/predictions.jsonl"
    format: Literal["math", "mc"] | None = None  # None: data.format
    tau: float | None = Field(None, ge=0.0, le=1.0)  # None: the champion's tau tag
    # Ask for a share of tokens sent to the LLM instead of a raw τ (from the champion's dev score quantiles).
    llm_fraction: float | None = Field(None, ge=0.0, le=1.0)
    batch_size: int = Field(32, ge=1)
    max_new_tokens: int = Field(96, ge=1)


class ServeParams(_Block):
    """``citer serve``: the OpenAI-compatible endpoint in front of the registry's champion router."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_new_tokens: int = Field(128, ge=1)
    model_name: str = "citer"  # the OpenAI model id clients pass
    prompt_format: Literal["auto", "math", "mc", "raw"] = "auto"  # chat prompts; auto = data.format
    tau: float | None = Field(None, ge=0.0, le=1.0)  # None = the champion's τ
    llm_fraction: float | None = Field(None, ge=0.0, le=1.0)  # instead of tau: a target share of LLM tokens
    # Limits: over them a request gets 400 (too many prompts or tokens) or 429 (queue full) with a clear body.
    max_prompts_per_request: int = Field(64, ge=1)
    # prompts x max_tokens, the decoding work one request asks
    max_tokens_per_request: int = Field(65536, ge=1)
    max_queued_requests: int = Field(32, ge=1)
    # Continuous batching: requests join the running batch at any step, up to this many rows in the SLM's batch (a row
    # waiting for the LLM leaves it to a newcomer; live rows at most twice this).
    # false: one request at a time (the old behaviour; benchmarks compare against it).
    continuous_batching: bool = True
    max_batch_rows: int = Field(32, ge=1, le=4096)
    # A non-loopback host needs an API key (read from this environment variable) unless allow_remote_without_key.
    api_key_env: str = "CITER_API_KEY"
    allow_remote_without_key: bool = False
