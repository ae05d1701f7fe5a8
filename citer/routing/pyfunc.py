"""The registered router as a generator: an MLflow pyfunc, logged from code (nothing pickled), that writes text.

``predict`` takes prompts (a DataFrame with a string column ``prompt``, a list of strings or one string) and returns
one row per prompt: ``text`` (the continuation), ``answer`` (extracted when the config names a format, else empty)
and the routing stats ``n_tokens``, ``llm_tokens``, ``llm_token_fraction``, ``llm_calls``, ``bytes_moved``.
Params (optional): ``max_new_tokens``, ``tau`` (a negative τ means the config's).

The model's config (``model_config`` at registration, :func:`citer.tracking.registry.register_router`) names the
pair by reference and the decoding settings: ``slm``, ``llm`` (hub ids or paths relative to the project root), ``tau``,
``prompt_format`` (``raw``: the prompt is continued as given; ``math``/``mc``: it is the question, wrapped in the
training template), ``answer_format`` (``math``/``mc``/``none``), ``max_new_tokens``, ``dtype``, ``device``.

The router's ``router.json`` records the digests of the SLM and LLM it was trained with; loading it with other model
files under the configured names is refused (:mod:`citer.routing.pair_check`) unless the loader passes
``model_config={"allow_pair_mismatch": True}``.

Where relative model paths resolve, first match wins: ``project_root`` in the config (a loader passes it:
``mlflow.pyfunc.load_model(uri, model_config={"project_root": "/path/to/project"})``), the ``CITER_ROOT``
environment variable, the current directory. The router itself is the artifact ``router_dir``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model

# predict is untyped on purpose (type hints would become a second schema); the logged signature is the schema.
warnings.filterwarnings("ignore", message=".*Add type hints to the `predict` method.*")


def resolve_ref(ref: str, root: str | os.PathLike[str]) -> str:
    """A model ref as loading needs it: a path under ``root`` when one exists there, else the ref (a hub id)."""
    p = Path(ref)
    local = p if p.is_absolute() else Path(root) / p
    return str(local) if local.exists() else ref


def config_root(cfg: dict[str, Any]) -> Path:
    return Path(cfg.get("project_root") or os.environ.get("CITER_ROOT") or os.getcwd())


def wrap_prompt(text: str, fmt: str) -> str:
    """The text the models continue: ``raw`` as given, ``math``/``mc`` through the training template."""
    from citer.data.prompts import ANSWER_CUE, build_prompt

    if fmt == "math":
        return build_prompt({"problem": text.strip()}, "math")
    if fmt == "mc":  # "question\nChoices: (A) x (B) y" -> the same text build_prompt makes from an mc row
        return f"Question: {text.strip()}\n{ANSWER_CUE}"
    return text


def prompts_of(model_input: Any) -> list[str]:
    """The prompts of a DataFrame (column ``prompt``, else its only column), a dict, a list or one string."""
    import pandas as pd

    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        model_input = pd.DataFrame(model_input)
    if isinstance(model_input, pd.DataFrame):
        if "prompt" in model_input.columns:
            col = model_input["prompt"]
        elif len(model_input.columns) == 1:
            col = model_input.iloc[:, 0]
        else:
            raise ValueError(f"input: expected a column 'prompt', got columns {list(model_input.columns)}")
        values = col.tolist()
    else:
        values = list(model_input)
    for i, v in enumerate(values, start=1):
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"input row {i}: field prompt must be a non-empty string, got {v!r}")
    return values


class CiterGenerator(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        from citer.decoding.engine import RoutedEngine
        from citer.decoding.verify import Verification
        from citer.models.loading import load_pair
        from citer.routing.mlp import load_router

        cfg = dict(context.model_config or {})
        for key in ("slm", "llm", "tau"):
            if key not in cfg:
                raise ValueError(
                    f"model_config: field {key} missing; re-register the router with its pair and tau"
                )
        root = config_root(cfg)
        slm_ref, llm_ref = resolve_ref(cfg["slm"], root), resolve_ref(cfg["llm"], root)
        try:
            slm, llm, tok = load_pair(slm_ref, llm_ref, cfg.get("dtype", "float32"), cfg.get("device", "cpu"))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{exc} (relative model refs resolve against {root}: model_config project_root, else CITER_ROOT, "
                "else the current directory)"
            ) from exc
        router, meta = load_router(context.artifacts["router_dir"], slm=slm, vocab_size=len(tok))
        from citer.routing.iterations import pair_digests
        from citer.routing.pair_check import check_pair

        check_pair(
            meta,
            pair_digests(slm_ref, llm_ref),
            f"router of this model (slm={cfg['slm']}, llm={cfg['llm']})",
            remedy="point the model config at the pair it was trained with, or load it with model_config="
            '{"allow_pair_mismatch": true}',
            allow=str(cfg.get("allow_pair_mismatch", False)).strip().lower() in ("1", "true", "yes"),
        )
        if router.hidden_size != slm.config.hidden_size:
            raise ValueError(
                f"router hidden_size={router.hidden_size} but SLM {slm_ref} has hidden size {slm.config.hidden_size}"
            )
        self.config = cfg
        self.tokenizer = tok
        self.engine = RoutedEngine(
            slm,
            llm,
            router.to(slm.device).eval(),
            tau=float(cfg["tau"]),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **Verification.from_tags(cfg).engine_kwargs(),  # the point's rho/W, when one was chosen
        )

    def predict(self, context, model_input, params=None):  # untyped: MLflow reads type hints as a schema
        import pandas as pd

        from citer.data.answers import extract_answer

        cfg, params = self.config, dict(params or {})
        max_new = int(params.get("max_new_tokens") or cfg.get("max_new_tokens", 128))
        tau = params.get("tau")
        tau = float(tau) if tau is not None and float(tau) >= 0 else float(cfg["tau"])
        if tau > 1.0:
            raise ValueError(f"params: field tau must lie in [0, 1], got {tau}")
        self.engine.tau = tau
        fmt, answer_fmt = cfg.get("prompt_format", "raw"), cfg.get("answer_format", "none")
        ids = []
        for i, text in enumerate(prompts_of(model_input), start=1):
            enc = self.tokenizer.encode(wrap_prompt(text, fmt), add_special_tokens=False)
            if not enc:
                raise ValueError(f"input row {i}: field prompt encodes to no tokens")
            ids.append(list(enc))
        res = self.engine.generate_batch(ids, max_new_tokens=max_new, temperature=0.0)
        out = []
        for toks, st in zip(res.tokens, res.rows, strict=True):
            text = self.tokenizer.decode(list(toks), skip_special_tokens=True)
            answer = extract_answer(text, answer_fmt) if answer_fmt in ("math", "mc") else None
            n, llm_tokens = len(toks), int(getattr(st, "llm_tokens", 0))
            out.append(
                {
                    "text": text,
                    "answer": answer or "",
                    "n_tokens": n,
                    "llm_tokens": llm_tokens,
                    "llm_token_fraction": llm_tokens / n if n else 0.0,
                    "llm_calls": int(getattr(st, "llm_calls", 0)),
                    "bytes_moved": float(getattr(st, "bytes_moved", 0.0)),
                }
            )
        return pd.DataFrame(out)


set_model(CiterGenerator())
