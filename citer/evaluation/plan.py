"""The sweep's decoding passes as data: a :class:`PassSpec` says what one pass decodes, a :class:`PassBench` holds what
every pass reads (the pair, the splits' prompts, the routers) and runs a spec, and a :data:`PassMap` runs a list of
specs, in order or concurrently, and returns their outcomes in the specs' order.

A pass reads nothing but its spec and the bench, and every pass builds its own engine (a random router is seeded
from the spec, a row's draws from its example index), so where and in which order passes run does not change a bit
of what they return: the sweep maps its passes over whatever :data:`PassMap` it is given (the flow's maps them over
``runtime.task_runner``) and assembles its rows in spec order.

A new method is one more kind of spec: a router key the bench knows, a τ, and the engine keyword arguments it needs
(``engine``, passed to :class:`citer.decoding.engine.RoutedEngine` as they are).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from citer.config import SweepParams
from citer.config.serving import EngineParams
from citer.data.formats import Format
from citer.decoding.baselines import AlwaysSLM, RandomRouter, Router
from citer.decoding.cost import call_tally
from citer.decoding.engine import RoutedEngine
from citer.decoding.speculative import speculative_generate
from citer.decoding.verify import Verification
from citer.evaluation.passes import PassResult, decode_pass, speculative_result
from citer.evaluation.pricing import CallCounts, Pricing, RouterShape
from citer.evaluation.sweep_rows import SweepError

# routed: the pair through ``router``; llm / slm: that model alone (the references); speculative: assisted
# generation on the first ``sweep.speculative_examples`` questions.
PassKind = Literal["routed", "llm", "slm", "speculative"]
RANDOM = "random"  # the router key of random routing: RandomRouter(spec.fraction, sweep.seed)


@dataclass
class Split:
    """One split's examples and the prompt ids every pass decodes from."""

    rows: list[Mapping[str, Any]]
    prompts: list[list[int]]
    ex_hash: str


@dataclass(frozen=True)
class PassSpec:
    """One decoding pass: small, picklable, and all a worker needs besides the bench."""

    name: str  # what the log and the progress bar call it ("dev citer f=0.1")
    split: str  # a key of PassBench.splits
    kind: PassKind = "routed"
    method: str = ""  # the row's method ("citer", "random", ...)
    router: str = ""  # routed: a key of PassBench.routers, or RANDOM
    tau: float = 0.5  # the engine's τ
    fraction: float | None = None  # the target LLM-token fraction (random routing: its probability)
    engine: Mapping[str, Any] = field(default_factory=dict)  # further RoutedEngine keyword arguments


@dataclass
class PassOutcome:
    """What a pass returns: its per-example results, the seconds it took, and (speculative) its call totals."""

    result: PassResult
    seconds: float
    totals: dict[str, float] = field(default_factory=dict)
    n: int = 0  # speculative: the questions measured (the first n of the split)


@dataclass
class PassBench:
    """What every pass reads. Picklable (models and routers included), so a process worker can be sent one."""

    slm: Any
    llm: Any
    tokenizer: Any
    fmt: Format
    params: SweepParams
    splits: dict[str, Split] = field(default_factory=dict)
    routers: dict[str, Router] = field(default_factory=dict)
    # The params' engine block: which kernels decode (``runner``: torch, or llama_cpp on GGUF files of
    # ``llama_cpp_type``), so τ is chosen on the runner that serves.
    engine_params: EngineParams = field(default_factory=EngineParams)

    @property
    def eos(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.eos

    @property
    def vocab(self) -> int:
        return len(self.tokenizer)  # the ids both models share; their embeddings may be padded past it

    def router(self, spec: PassSpec) -> Router:
        if spec.kind != "routed":
            return AlwaysSLM()
        if spec.router == RANDOM:
            if spec.fraction is None:
                raise SweepError(f"pass {spec.name!r}: random routing needs a fraction")
            return RandomRouter(spec.fraction, self.params.seed)
        if spec.router not in self.routers:
            raise SweepError(
                f"pass {spec.name!r}: router {spec.router!r} unknown; have {sorted(self.routers)}"
            )
        return self.routers[spec.router]

    def engine(self, spec: PassSpec) -> Any:
        solo = {"llm": self.llm, "slm": self.slm}.get(spec.kind)
        if self.engine_params.runner == "llama_cpp":
            return self._llama_cpp_engine(spec, solo)
        return RoutedEngine(
            solo if solo is not None else self.slm,
            None if solo is not None else self.llm,
            self.router(spec),
            tau=1.0 if solo is not None else spec.tau,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            gpu=self.params.gpu,
            vocab_size=self.vocab,
            **dict(spec.engine),
        )

    def _llama_cpp_engine(self, spec: PassSpec, solo: Any) -> Any:
        from citer.decoding.llama_cpp_engine import LlamaCppEngine
        from citer.models.to_gguf import gguf_for

        other = sorted(set(spec.engine) - set(Verification().engine_kwargs()))
        if other:
            raise SweepError(
                f"pass {spec.name!r}: engine options {other} need engine.runner torch (the llama_cpp runner takes "
                "verified routing's only)"
            )
        t = self.engine_params.llama_cpp_type
        if solo is not None:
            return LlamaCppEngine(
                gguf_for(solo, t), None, AlwaysSLM(), 1.0, self.eos, self.vocab, self.params.gpu
            )
        return LlamaCppEngine(gguf_for(self.slm, t), gguf_for(self.llm, t), self.router(spec), spec.tau, self.eos,
                              self.vocab, self.params.gpu, **dict(spec.engine))  # fmt: skip

    def scoring_engine(self) -> Any | None:
        """The engine whose SLM the sweep's teacher-forced passes read (τ's quantiles, the oracle's flags): the
        runner's own where it is not torch (its kernels and precision write the hidden states the router will read),
        else None (the torch SLM itself). The caller closes it."""
        if self.engine_params.runner != "llama_cpp":
            return None
        return self._llama_cpp_engine(PassSpec("teacher-forced slm", "dev", "slm"), self.slm)

    def pricings(self, runner: str | None = None) -> tuple[Pricing, Pricing | None]:
        """The pair that ran (to check a pass's counts against its bytes; ``runner``, default the params', names
        whose bytes: the torch models' or their GGUF files') and the reference pair (``price_at``)."""
        ref = self.params.price_at
        reference = Pricing.reference(ref) if ref is not None else None
        if (
            runner or self.engine_params.runner
        ) == "llama_cpp":  # the files' bytes, read without loading them
            from citer.decoding.llama_cpp_runner import gguf_cost
            from citer.models.to_gguf import gguf_for

            t = self.engine_params.llama_cpp_type
            llm_cost = gguf_cost(gguf_for(self.llm, t)) if self.llm is not None else None
            return Pricing.of_costs(self.slm, gguf_cost(gguf_for(self.slm, t)), llm_cost), reference
        return Pricing.measured(self.slm, self.llm), reference

    def run(self, spec: PassSpec) -> PassOutcome:
        split = self.splits[spec.split]
        if spec.kind == "speculative":
            return self._speculative(spec, split)
        t0 = time.perf_counter()
        res = decode_pass(
            self.engine(spec),
            self.tokenizer,
            split.prompts,
            split.rows,
            self.fmt,
            self.params.decoding_batch,
            self.params.max_new_tokens,
            solo_llm=spec.kind == "llm",
            desc=f"sweep {spec.name}",
            pricings=self.pricings(),
        )
        return PassOutcome(res, time.perf_counter() - t0)

    def _speculative(self, spec: PassSpec, split: Split) -> PassOutcome:
        p = self.params
        n = len(split.rows)
        m = min(p.speculative_examples or n, n)
        t0 = time.perf_counter()
        outputs, counts = [], []
        # One prompt per call: assisted generation decodes each alone anyway, and the tally then holds its calls.
        with call_tally(self.slm, self.llm) as tally:
            for prompt in split.prompts[:m]:
                tally.reset()
                outputs += speculative_generate(
                    self.slm,
                    self.llm,
                    [prompt],
                    max_new_tokens=p.max_new_tokens,
                    draft_tokens=p.speculative_tokens,
                    eos_token_id=self.eos,
                    pad_token_id=self.pad,
                    gpu=p.gpu,
                    vocab_size=self.vocab,
                    **dict(spec.engine),
                )
                counts.append(CallCounts(*tally.slm, *tally.llm, 0))
        sp, totals = speculative_result(
            outputs, self.tokenizer, split.rows[:m], self.fmt, p.gpu, min(p.decoding_batch, n)
        )
        # assisted generation runs on the torch models whatever the runner: priced at their bytes
        sp.price(counts, RouterShape(), 0, *self.pricings("torch"), f"pass {spec.name!r}")
        return PassOutcome(sp, time.perf_counter() - t0, totals, m)


# Runs the specs on the bench and returns their outcomes in the specs' order.
PassMap = Callable[[PassBench, Sequence[PassSpec]], list[PassOutcome]]


def run_in_order(bench: PassBench, specs: Sequence[PassSpec]) -> list[PassOutcome]:
    """Every pass here, one after another (the sequential sweep)."""
    return [bench.run(s) for s in specs]


def run_part(part: tuple[PassBench, Sequence[PassSpec]]) -> list[PassOutcome]:
    """Every pass of ``part`` (a bench and its specs) in order: what one worker process is sent."""
    bench, specs = part
    return run_in_order(bench, specs)


def deal(n_items: int, n_chunks: int) -> list[list[int]]:
    """Item indices dealt round-robin into at most ``n_chunks`` non-empty chunks (neighbouring passes, often of
    similar cost, land on different workers)."""
    k = max(1, min(n_chunks, n_items))
    return [c for c in (list(range(i, n_items, k)) for i in range(k)) if c]


def run_chunk(bench: PassBench, specs: Sequence[PassSpec], ids: Sequence[int]) -> list[PassOutcome]:
    """The passes ``ids`` of ``specs`` (what one worker task does)."""
    return [bench.run(specs[i]) for i in ids]


def gather(
    n: int, chunks: Sequence[Sequence[int]], parts: Sequence[Sequence[PassOutcome]]
) -> list[PassOutcome]:
    """The chunks' outcomes back in spec order."""
    out: list[PassOutcome | None] = [None] * n
    for ids, part in zip(chunks, parts, strict=True):
        if len(ids) != len(part):
            raise SweepError(f"pass chunk returned {len(part)} outcomes for {len(ids)} passes")
        for i, o in zip(ids, part, strict=True):
            out[i] = o
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
        raise SweepError(f"passes {missing} returned no outcome")
    return out  # type: ignore[return-value]  # no None left
