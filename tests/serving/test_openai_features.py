"""What evaluation tools ask of an OpenAI server, through the official ``openai`` client against a live ``citer``
server: ``n`` > 1, log-probs from the model that wrote each token, ``echo`` with the routed policy's prompt scores,
token-id prompts, the prompt template, and a schema that declares every status the server answers."""

from __future__ import annotations

import copy

import openai
import pytest
from live import serving, spread_engine

from citer.data.prompts import CHAT_TEMPLATE, build_prompt
from citer.decoding.scoring import routed_loglikelihood
from citer.serving.server import build_app
from citer.serving.templates import chat_prompt, template_info

MODEL = "citer-test"
MAX_NEW = 24
PROMPT = "Question: 2 + 3\nAnswer:"


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return spread_engine(tiny_pair)


@pytest.fixture(scope="module")
def tok(tiny_pair):
    return tiny_pair[2]


@pytest.fixture(scope="module")
def server(engine, tok):
    app = build_app(engine, tok, model_name=MODEL, max_new_tokens=MAX_NEW, fmt="math", info={"router": "t/1"})
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def _alone(engine, ids, n, *, row_id=0, logprobs=None, **kw):
    """The engine's own decode of one row: its Emitted tokens (EOS included)."""
    sess = engine.session()
    key = sess.add(ids, n, row_id=row_id, logprobs=logprobs, **kw)
    out = []
    while sess.busy:
        out += [e for e in sess.step() if e.key == key]
    return out


def _text(tok, ems):
    return tok.decode([e.token for e in ems if e.token != tok.eos_token_id], skip_special_tokens=True)


def test_models_say_which_template_a_raw_completion_should_use(client, tok):
    (card,) = client.models.list().data
    prompts = card.model_extra["citer"]["prompts"]
    assert prompts["prompt_format"] == "math" and prompts["chat"].startswith("citer")
    assert prompts["completion_prompt"] == "Question: {problem}\nAnswer:"
    assert prompts["chat_template"] == CHAT_TEMPLATE


def test_n_choices_are_independent_seeded_samples_of_each_prompt(client, engine, tok):
    prompts = [PROMPT, "Question: 7\nAnswer:"]
    kw = {"model": MODEL, "prompt": prompts, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 3}
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:  # choice prompt * n + sample keys its own draws, as a row of that id alone
        ids = tok.encode(prompts[c.index // 3], add_special_tokens=False)
        ref = _alone(engine, ids, 10, row_id=c.index, temperature=1.0, seed=3)
        assert c.text == _text(tok, ref), c.index
    assert len({c.text for c in r.choices[:3]}) == 3  # the samples of one prompt differ
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in r.choices]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
    assert len(r.model_extra["citer"]["per_choice"]) == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "2 + 3"}], n=2, max_tokens=8, temperature=0
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: n equal answers


def test_completion_logprobs_come_from_the_model_that_wrote_each_token(client, engine, tok):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=3)
    (c,) = r.choices
    lp = c.logprobs
    # Every token has its entry, EOS too (its text is empty, so the tokens still add up to the text).
    ref = _alone(engine, tok.encode(PROMPT, add_special_tokens=False), 16, logprobs=3)
    assert "".join(lp.tokens) == c.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref], abs=1e-5)
    assert lp.model_extra["from_llm"] == [e.from_llm for e in ref]
    assert any(lp.model_extra["from_llm"]) and not all(lp.model_extra["from_llm"])  # both models wrote
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert [max(t.values()) for t in lp.top_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)  # greedy
    assert lp.text_offset[0] == len(PROMPT)
    assert lp.text_offset == [len(PROMPT) + len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # The tokens do not change for being asked their log-probs.
    assert c.text == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16).choices[0].text


def test_chat_logprobs_and_top_logprobs(client, engine, tok):
    msgs = [{"role": "user", "content": "4 + 4"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    ids = tok.encode(build_prompt({"problem": "4 + 4"}, "math"), add_special_tokens=False)
    ref = _alone(engine, ids, 12, logprobs=2)
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in ref], abs=1e-5)
    assert [t.model_extra["from_llm"] for t in content] == [e.from_llm for e in ref]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy
    assert all(t.bytes == list(t.token.encode()) for t in content)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=2)


def test_echo_scores_the_prompt_with_the_routed_policy(client, engine, tok):
    ids = tok.encode(PROMPT, add_special_tokens=False)
    want = routed_loglikelihood(engine, ids[:1], ids[1:], top_k=1)
    assert any(want.from_llm) and not all(want.from_llm)  # the router splits the prompt between the models
    # max_tokens 0: a score, nothing generated.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.logprobs, abs=1e-5)
    assert lp.model_extra["from_llm"] == [None, *want.from_llm]
    assert r.model_extra["citer"]["echo"]["tokens_by_model"]["llm"] == sum(want.from_llm)
    # What lm-evaluation-harness sends: token ids, echo, one generated token, logprobs 1.
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=1, echo=True, logprobs=1)
    a, b = (c.logprobs for c in r.choices)
    assert len(a.token_logprobs) == len(ids) + 1 and len(b.token_logprobs) == 6
    assert a.token_logprobs[1:-1] == pytest.approx(want.logprobs, abs=1e-5)
    gen = _alone(engine, ids, 1, logprobs=1)[0]
    assert a.token_logprobs[-1] == pytest.approx(gen.logprob, abs=1e-5)
    assert r.choices[0].text == PROMPT + a.tokens[-1]
    # echo without logprobs only repeats the prompt.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True).choices[0]
    assert plain.text.startswith(PROMPT) and plain.logprobs is None


def test_token_id_prompts_equal_text_prompts(client, tok):
    ids = tok.encode(PROMPT, add_special_tokens=False)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=[len(tok) + 5], max_tokens=2)
    assert ei.value.body["param"] == "prompt"


def test_streams_carry_every_choice_and_its_logprobs(client):
    kw = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 1,
        "n": 2,
        "logprobs": 2,
    }
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, echo=True, stream_options={"include_usage": True})
    )
    for c in full.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == PROMPT + c.text
        toks = [t for m in mine if m.logprobs for t in m.logprobs.tokens]
        lps = [x for m in mine if m.logprobs for x in m.logprobs.token_logprobs]
        assert "".join(toks) == PROMPT + c.text
        assert lps[-len(c.logprobs.token_logprobs) :] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6)
        offs = [x for m in mine if m.logprobs for x in m.logprobs.text_offset]
        assert offs == [len("".join(toks[:i])) for i in range(len(toks))]
        assert [m.finish_reason for m in mine if m.finish_reason] == [c.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    msgs = [{"role": "user", "content": "1 + 2"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, n=2, logprobs=True)
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=8, n=2, stream=True, logprobs=True
        )
    )
    for c in chat.choices:
        mine = [ch.choices[0] for ch in streamed if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.delta.content or "" for m in mine) == c.message.content
        got = [t.logprob for m in mine if m.logprobs for t in m.logprobs.content]
        assert got == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-6)


def test_the_ten_client_probes(client, server):
    """The probes of issue 24, all answered as OpenAI would."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": "3 + 3"}]
    assert (
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4).choices[0].message.content
        is not None
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.total_tokens > 0
    assert len(client.completions.create(model=MODEL, prompt=["1", "2", "3"], max_tokens=3).choices) == 3
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_NEW, stop=["\n", " "])
    assert "\n" not in stopped.choices[0].text and " " not in stopped.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=msgs)
    assert len(client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=3).choices) == 2
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1).choices[0].logprobs
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert echoed.choices[0].text.startswith(PROMPT)


def test_chat_uses_the_tokenizers_own_template_and_ours_otherwise(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 7 + 5?"}]
    assert chat_prompt(msgs, "math", tok) == build_prompt({"problem": "What is 7 + 5?"}, "math")
    embedded = copy.deepcopy(tok)
    embedded.chat_template = CHAT_TEMPLATE
    mc = [{"role": "user", "content": "Which is even?\nChoices: (A) 3 (B) 4"}]
    for m, fmt in ((msgs, "math"), (mc, "mc")):
        rendered = embedded.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert chat_prompt(m, fmt, embedded) == rendered == chat_prompt(m, fmt, None)
    instruct = copy.deepcopy(tok)
    instruct.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert chat_prompt(msgs, "math", instruct) == "<system>be brief\n<user>What is 7 + 5?\n<assistant>"
    assert chat_prompt(msgs, "raw", instruct) == "What is 7 + 5?"
    assert template_info("math", instruct)["chat"].startswith("tokenizer")
    assert template_info("math", embedded)["completion_prompt"] == "Question: {problem}\nAnswer:"


def test_the_schema_declares_every_status_in_openais_error_shape(engine, tok):
    from fastapi.testclient import TestClient

    for key, auth in ((None, set()), ("k", {"401"})):
        app = build_app(engine, tok, model_name=MODEL, max_new_tokens=4, api_key=key)
        with TestClient(app) as tc:
            headers = {"Authorization": "Bearer k"} if key else {}
            schema = tc.get("/openapi.json", headers=headers).json()
        paths = schema["paths"]
        for route in ("/v1/completions", "/v1/chat/completions"):
            responses = paths[route]["post"]["responses"]
            assert set(responses) == {"200", "400", "404", "429", "500"} | auth, route
        assert set(paths["/v1/models"]["get"]["responses"]) == {"200"} | auth
        error = {"$ref": "#/components/schemas/ErrorResponse"}
        for route in paths.values():
            for op in route.values():
                for status, resp in op["responses"].items():
                    if status != "200":
                        assert resp["content"]["application/json"]["schema"] == error, status
        assert "HTTPValidationError" not in schema["components"]["schemas"]
        assert set(schema["components"]["schemas"]["ErrorDetail"]["properties"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert "Retry-After" in paths["/v1/completions"]["post"]["responses"]["429"]["headers"]


schemathesis = pytest.importorskip("schemathesis")


def test_schemathesis_finds_no_undeclared_status(server):
    """Schemathesis generates requests from /openapi.json and checks every answer's status, content type and
    body against the schema (bounded: a few dozen requests per route, small max_tokens)."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    failures, statuses = [], set()
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(max(case.body["max_tokens"], 0), 4)  # bounded decodes
                # Half the cases get past the model check, to reach the other refusals and the answers.
                if len(str(case.body.get("model"))) % 2:
                    case.body["model"] = MODEL
            statuses.add(case.call_and_validate(checks=checks, base_url=server).status_code)

        try:
            run()
        except Exception as exc:  # every route's failure, then one assertion naming them all
            failures.append(f"{operation.method} {operation.path}: {exc}")
    assert not failures, "\n".join(failures)
    assert {200, 400, 404} <= statuses  # it did reach both the answers and the refusals


def test_the_embedded_tokenizer_carries_the_task_template(embedded_tok, tmp_path):
    from transformers import AutoTokenizer

    embedded_tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "Ann has 3 apples. She finds 2. How many now?"}]
    want = build_prompt({"problem": msgs[0]["content"]}, "math")
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    assert chat_prompt(msgs, "math", loaded) == want


def test_route_level_refusals_come_in_openais_error_shape(server, client):
    """Bodies that are not JSON or not UTF-8, unknown URLs and wrong methods: OpenAI's {"error": {...}} (FastAPI's
    {"detail": ...} before), seen by the official client as its typed errors with their code."""
    import httpx

    def post(body: bytes) -> httpx.Response:
        return httpx.post(
            f"{server}/v1/completions", content=body, headers={"content-type": "application/json"}
        )

    cut = post(b'{"model": "citer-test", "prompt": ')
    assert cut.status_code == 400 and cut.json()["error"] == {
        "message": "the request body is not valid JSON (Expecting value, character 34)",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
    latin1 = post('{"model": "citer-test", "prompt": "caf\xe9"}'.encode("latin-1"))
    assert latin1.status_code == 400 and latin1.json()["error"]["code"] == "invalid_body"

    with pytest.raises(openai.NotFoundError) as err:
        client.get("/nope", cast_to=object)
    assert err.value.code == "unknown_url" and err.value.type == "invalid_request_error"
    assert "Invalid URL (GET /v1/nope)" in err.value.message
    with pytest.raises(openai.APIStatusError) as err:
        client.get("/completions", cast_to=object)
    assert err.value.status_code == 405 and err.value.code == "method_not_allowed"
    assert err.value.message.endswith("GET is not allowed on /v1/completions (allowed: POST)")
    with pytest.raises(openai.BadRequestError) as err:  # a field of the wrong type: 400, never FastAPI's 422
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens="many")  # type: ignore[arg-type]
    assert err.value.status_code == 400 and err.value.param == "max_tokens"
