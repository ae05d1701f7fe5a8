"""The sweep's row type: one operating point of one method, and the keys of reports/sweep.json.

Every part of evaluation speaks in :class:`SweepRow`: decoding passes produce them, the Pareto maths and the promotion
rule read them, the report writes them. Bytes are compared relative to LLM-only decoding on the same examples
(``bytes_moved_rel_llm``), so rows from one sweep are comparable whatever the model sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The method names of reports/sweep.json, and its row keys (exactly these, in this order).
METHODS = (
    "citer",  # the router of the last label iteration
    "citer_iter1",  # the iteration-1 router, same sweep: does iterating help, on test accuracy and bytes
    "citer_s",  # one-step labels (the CITER-S ablation)
    "citer_emb",  # router-input ablations: + the SLM's chosen-token embedding
    "citer_logits",  # + top-k log-probs, entropy, margin
    "citer_emb_logits",  # + both
    "oracle",  # the lossless bound: the LLM writes exactly where the SLM's greedy token differs from its own
    "slm",
    "llm",
    "random",
    "confidence",
    "query",  # a trained query-level router (RouteLLM recipe)
    "speculative",
    "citer_verify",  # the dev-chosen router with the catch-up's check (rho), a window and the final check
    "bild",  # Big Little Decoder: the SLM's confidence as the trigger, the same check, no router
)
# The methods whose points are thresholds on a score (chosen on dev at sweep.llm_fractions).
THRESHOLD_METHODS = (
    "citer",
    "citer_iter1",
    "citer_s",
    "citer_emb",
    "citer_logits",
    "citer_emb_logits",
    "confidence",
    "query",
    "citer_verify",
    "bild",
)
SWEEP_KEYS = (
    "method",
    "tau",
    "accuracy",
    "llm_token_fraction",
    "llm_calls",
    "bytes_moved",
    "bytes_moved_rel_llm",
    "accuracy_ci",
    "bytes_ci",
    "selected_on_dev",
    # The same calls priced at the reference pair named in priced_at (sweep.price_at; citer.evaluation.pricing).
    "priced_at",
    "bytes_priced_rel_llm",
    "bytes_priced_ci",
)


# Keys of ``SweepRow.extra`` that are wall-clock measurements of the run (see ``SweepRow.sec_per_token``).
MEASURED_EXTRA = ("pass_seconds",)


class SweepError(ValueError):
    """Rows that cannot be compared or chosen from (missing LLM-only row, different examples)."""


@dataclass
class SweepRow:
    """One operating point of one method on the sweep's examples.

    ``bytes_moved`` and ``llm_calls`` are totals over the examples; ``llm_accuracy`` and ``examples_hash`` tie the row
    to the LLM-only reference it was measured against, so a row alone can be judged under a rule.
    """

    method: str
    tau: float | None
    accuracy: float
    llm_token_fraction: float
    llm_calls: int
    bytes_moved: float
    bytes_moved_rel_llm: float
    # Wall-clock seconds per token of the pass that made the row: a fact of the run, not a result. It stays off the
    # report files (reports/provenance.json's run_facts keeps it, :meth:`measured`) so two runs write them alike.
    sec_per_token: float = float("nan")
    gpu_sec_per_token: float | None = None
    # 95% paired-bootstrap intervals over the questions (citer.evaluation.intervals); bytes relative to LLM-only.
    accuracy_ci: tuple[float, float] | None = None
    bytes_ci: tuple[float, float] | None = None
    n_examples: int = 0
    n_tokens: int = 0
    llm_accuracy: float | None = None
    examples_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Per question, in the order of the split's examples: graded right, and bytes moved as if decoded alone
    # (batch 1). The paired bootstrap (citer.evaluation.intervals) resamples these; empty on rows read from old files.
    correct: list[bool] = field(default_factory=list)
    question_bytes: list[float] = field(default_factory=list)
    # The same calls priced at a reference pair (citer.evaluation.pricing), never instead of the measured bytes:
    # ``priced_at`` names the pair ("" when the sweep priced none), the rest mirror the measured fields.
    priced_at: str = ""
    bytes_priced: float | None = None
    bytes_priced_rel_llm: float | None = None
    bytes_priced_ci: tuple[float, float] | None = None
    question_bytes_priced: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The keys of reports/sweep.json (:data:`SWEEP_KEYS`)."""
        d = asdict(self) | {"selected_on_dev": bool(self.extra.get("selected_on_dev", False))}
        return {k: d[k] for k in SWEEP_KEYS}

    def to_details(self) -> dict[str, Any]:
        """Every field but the wall-clock ones (:meth:`measured`)."""
        d = asdict(self)
        del d["sec_per_token"]
        d["extra"] = {k: v for k, v in self.extra.items() if k not in MEASURED_EXTRA}
        return d

    def measured(self) -> dict[str, Any]:
        """The row's wall-clock figures: seconds per token, and the seconds of the pass that made it."""
        return {"sec_per_token": self.sec_per_token} | {
            k: self.extra[k] for k in MEASURED_EXTRA if k in self.extra
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepRow:
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in SWEEP_KEYS[:7] if k not in d]  # files written before intervals lack the rest
        if missing:
            raise SweepError(f"sweep row: fields {missing} missing")
        return cls(**{k: v for k, v in d.items() if k in known})


def rows_of(rows: Iterable[SweepRow], method: str) -> list[SweepRow]:
    return [r for r in rows if r.method == method]


def llm_reference(rows: Sequence[SweepRow]) -> SweepRow:
    """The LLM-only row (the accuracy every ratio refers to)."""
    llm = rows_of(rows, "llm")
    if not llm:
        raise SweepError(
            "sweep rows: no 'llm' row (LLM-only accuracy is the reference of the selection rule)"
        )
    return llm[0]
