from operator import attrgetter
from typing import get_args, get_origin

import pytest
import yaml
from conftest import REPO
from pydantic import BaseModel, ValidationError

from citer.config import ConfigError, ModelsParams, Params, load_params
from citer.config.serving import EngineParams


def test_repo_params_load():
    p = load_params(REPO / "params.yaml")
    assert isinstance(p, Params)
    # As params.yaml writes them, most not the defaults: a loader that dropped a block, or the file, fails here.
    expected = {
        "data.format": "math",
        "data.train": "data/embedded/math_train.jsonl",
        "data.test": "data/embedded/math_test.jsonl",
        "synth.n_train": 6000,
        "synth.n_test": 300,
        "bootstrap.slm.hidden_size": 32,
        "bootstrap.llm.hidden_size": 96,
        "bootstrap.llm.num_hidden_layers": 3,
        "finetune.lr": 3.0e-3,
        "finetune.max_steps": 1050,
        "finetune.lr_scheduler": "cosine",
        "finetune.bf16": False,
        "eval.batch_size": 100,
        "eval.max_new_tokens": 64,
        "labels.iterations": 2,
        "labels.max_new_tokens": 64,
        "router.min_val_auc": 0.7,
        "router.ablations": ["emb", "logits", "emb_logits"],
        "sweep.llm_fractions": [0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.3, 0.5],
        "sweep.rule.kind": "min_bytes_at_accuracy",
        "sweep.rule.accuracy_ratio": 0.99,
        "sweep.rule.bytes_budget_rel_llm": 0.4,
        "registry.model_name": "citer-router",
        "registry.alias": "champion",
        "registry.min_eval_examples": 200,
        "runtime.task_runner": "local",
        "runtime.address": None,
        "inference.max_new_tokens": 64,
    }
    assert {k: attrgetter(k)(p) for k in expected} == expected


def test_unknown_key_named(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("router:\n  lr: 0.001\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"router\.lrr"):
        load_params(f)


def test_wrong_type_named(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("router:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"router\.lr: Input should be a valid number"):
        load_params(f)


def test_llm_fraction_out_of_range(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("sweep:\n  llm_fractions: [0.2, 1.5]\n")
    with pytest.raises(ConfigError, match="llm_fractions"):
        load_params(f)
    f.write_text("sweep:\n  taus: [0.2]\n")  # the hand-made grid is gone: an old key fails by name
    with pytest.raises(ConfigError, match="taus"):
        load_params(f)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "a: [\n"])
def test_bad_files(tmp_path, text):
    f = tmp_path / "params.yaml"
    f.write_text(text)
    if text == "":
        assert load_params(f) == Params()
    else:
        with pytest.raises(ConfigError, match=str(f)):
            load_params(f)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "nope.yaml")


# --- bounded params (issue #13): every number has its range, refused at load time with key, value and range ---


def _write(path, raw):
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _with(key, value):
    """The repo's params.yaml with one dotted key set (nested blocks such as bootstrap.slm stay complete)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    *parents, last = key.split(".")
    block = raw
    for part in parents:
        block = block.setdefault(part, {})
    block[last] = value
    return raw


BAD = [
    ("seed", -1),
    ("synth.seed", -1),
    ("synth.n_train", 0),
    ("synth.n_dev", 0),
    ("synth.n_test", -5),
    ("synth.max_start", 0),
    ("synth.max_operand", 0),
    ("synth.max_total", 10),  # < max_start + max_operand
    ("synth.min_steps", 0),
    ("synth.max_steps", 1),  # < min_steps
    ("synth.variety", 1.5),
    ("synth.n_choices", 1),
    ("validate.max_chars_warning", 0),
    ("validate.max_bad_row_fraction", 1.5),
    ("bootstrap.seed", -1),
    ("bootstrap.vocab_size", 100),
    ("bootstrap.slm.hidden_size", 0),
    ("bootstrap.slm.intermediate_size", 0),
    ("bootstrap.slm.num_hidden_layers", 0),
    ("bootstrap.slm.num_attention_heads", 3),  # does not divide hidden_size 32
    ("bootstrap.slm.num_key_value_heads", 0),
    ("bootstrap.llm.num_key_value_heads", 3),  # does not divide num_attention_heads 4
    ("bootstrap.slm.max_position_embeddings", 0),
    ("bootstrap.slm_pretrain.steps", 0),
    ("bootstrap.slm_pretrain.lr", 0.0),
    ("bootstrap.llm_pretrain.batch_size", 0),
    ("bootstrap.llm_pretrain.warmup_ratio", 1.0),
    ("bootstrap.llm_pretrain.weight_decay", -0.1),
    ("models.device", "tpu9"),
    ("models.device", "cuda:x"),
    ("models.device", "gpu"),
    ("models.dtype", "fp8"),
    ("models.llm_device_map", "everywhere"),
    ("finetune.seed", -1),
    ("finetune.lr", 0.0),
    ("finetune.weight_decay", -0.01),
    ("finetune.epochs", 0),
    ("finetune.max_steps", 0),
    ("finetune.max_steps", -2),
    ("finetune.max_length", 0),
    ("finetune.batch_size", 0),
    ("finetune.gradient_accumulation_steps", 0),
    ("finetune.warmup_ratio", 1.0),
    ("finetune.logging_steps", 0),
    ("finetune.eval_examples", 0),
    ("finetune.max_truncated_fraction", 1.5),
    ("finetune.lora.r", 0),
    ("finetune.lora.alpha", 0),
    ("finetune.lora.dropout", 1.0),
    ("eval.n_examples", -298),
    ("eval.batch_size", 0),
    ("eval.max_new_tokens", 0),
    ("labels.iterations", 0),
    ("labels.n_examples", -1),
    ("labels.batch_size", 0),
    ("labels.max_new_tokens", 0),
    ("labels.tau", 1.5),
    ("router.lr", -0.001),
    ("router.weight_decay", -1.0),
    ("router.epochs", 0),
    ("router.batch_size", 1),
    ("router.dropout", 1.5),
    ("router.dropout", -0.1),
    ("router.val_fraction", 1.0),
    ("router.patience", 0),
    ("router.seed", -1),
    ("router.min_val_auc", 1.5),
    ("router.logit_k", 0),
    ("sweep.llm_fractions", [0.2, 1.5]),
    ("sweep.n_examples", -1),
    ("sweep.batch_size", 0),
    ("sweep.decode_batch_size", 0),
    ("sweep.max_new_tokens", 0),
    ("sweep.seed", -1),
    ("sweep.speculative_examples", -1),
    ("sweep.speculative_tokens", 0),
    ("sweep.query.train_examples", 1),
    ("sweep.query.epochs", 0),
    ("sweep.query.lr", 0.0),
    ("sweep.query.weight_decay", -1.0),
    ("sweep.intervals.resamples", 10),
    ("sweep.intervals.level", 1.0),
    ("sweep.rule.accuracy_ratio", 0.0),
    ("sweep.rule.accuracy_ratio", 1.01),
    ("sweep.rule.bytes_budget_rel_llm", 0.0),
    ("registry.min_eval_examples", 0),
    ("lock.timeout_s", 0),
    ("inference.tau", 1.5),
    ("inference.llm_fraction", -0.1),
    ("inference.batch_size", 0),
    ("inference.max_new_tokens", 0),
    ("serve.port", 0),
    ("serve.port", 65536),
    ("serve.max_new_tokens", 0),
    ("serve.tau", -0.1),
    ("serve.llm_fraction", 2.0),
    ("serve.max_prompts_per_request", 0),
    ("serve.max_tokens_per_request", 0),
    ("serve.max_queued_requests", 0),
]


@pytest.mark.parametrize(("key", "value"), BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_out_of_range_value_is_refused_naming_key_and_value(tmp_path, key, value):
    f = _write(tmp_path / "params.yaml", _with(key, value))
    with pytest.raises(ConfigError) as info:
        load_params(f)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"{key}: {value!r} is not allowed (" in msg, msg


def test_message_states_the_whole_range(tmp_path):
    f = _write(tmp_path / "params.yaml", {"router": {"dropout": 1.5}})
    with pytest.raises(ConfigError) as info:
        load_params(f)
    assert (
        str(info.value) == f"{f}: invalid params -> router.dropout: 1.5 is not allowed (must be >= 0 and < 1)"
    )
    for raw, rule in [
        ({"eval": {"n_examples": -298}}, "eval.n_examples: -298 is not allowed (must be >= 0)"),
        ({"serve": {"port": 70000}}, "serve.port: 70000 is not allowed (must be >= 1 and <= 65535)"),
        ({"inference": {"tau": 2}}, "inference.tau: 2 is not allowed (must be >= 0 and <= 1, or null)"),
        (
            {"finetune": {"max_steps": 0}},
            "finetune.max_steps: 0 is not allowed (must be -1 (train for epochs) or >= 1)",
        ),
        (
            {"synth": {"min_steps": 4, "max_steps": 3}},
            "synth.max_steps: 3 is not allowed (must be >= min_steps = 4)",
        ),
        (
            {"models": {"device": "tpu9"}},
            "models.device: 'tpu9' is not allowed (must be cpu, cuda, cuda:N, mps or a device_map strategy: "
            "auto, balanced, balanced_low_0, sequential)",
        ),
        (
            {"models": {"dtype": "fp8"}},
            "models.dtype: 'fp8' is not allowed (must be 'float32', 'bfloat16' or 'float16')",
        ),
    ]:
        with pytest.raises(ConfigError) as info:
            load_params(_write(f, raw))
        assert str(info.value).endswith(rule), str(info.value)


def test_every_bad_key_is_listed_in_one_line(tmp_path):
    f = _write(
        tmp_path / "params.yaml", {"eval": {"n_examples": -298, "batch_size": 0}, "router": {"lrr": 1}}
    )
    with pytest.raises(ConfigError) as info:
        load_params(f)
    msg = str(info.value)
    assert "\n" not in msg
    for part in ("eval.n_examples: -298", "eval.batch_size: 0", "router.lrr: Extra inputs are not permitted"):
        assert part in msg


def test_wrong_type_names_the_value(tmp_path):
    f = _write(tmp_path / "params.yaml", {"serve": {"port": "eighty"}})
    with pytest.raises(ConfigError, match=r"serve\.port: Input should be a valid integer.*\(got 'eighty'\)"):
        load_params(f)


def test_odd_head_width_is_refused(tmp_path):
    slm = {"hidden_size": 34, "intermediate_size": 64, "num_hidden_layers": 1}
    f = _write(
        tmp_path / "params.yaml",
        {"bootstrap": {"slm": slm | {"num_attention_heads": 2, "num_key_value_heads": 1}}},
    )
    with pytest.raises(
        ConfigError, match=r"bootstrap\.slm\.num_attention_heads: 2 is not allowed \(must leave an even"
    ):
        load_params(f)


@pytest.mark.parametrize(
    ("blocks", "key"),
    [
        ({"data": {"format": "mc"}}, "data.format = 'mc'"),
        ({"inference": {"format": "mc"}}, "inference.format = 'mc'"),
        ({"serve": {"prompt_format": "mc"}}, "serve.prompt_format = 'mc'"),
        ({"data": {"format": "math"}, "bootstrap": {"formats": ["mc"]}}, "data.format = 'math'"),
    ],
)
def test_embedded_pair_must_learn_the_format_routed(tmp_path, blocks, key):
    """bootstrap.formats names the forms the embedded pair learns; a format it never saw is refused in one line."""
    f = _write(tmp_path / "params.yaml", blocks)
    with pytest.raises(ConfigError, match=r"bootstrap\.formats: \[.*\] is not allowed \(must include " + key):
        load_params(f)


def test_formats_are_free_when_the_pair_is_your_own(tmp_path):
    both = _write(
        tmp_path / "both.yaml", {"data": {"format": "mc"}, "bootstrap": {"formats": ["math", "mc"]}}
    )
    assert load_params(both).data.format == "mc"
    off = _write(tmp_path / "off.yaml", {"data": {"format": "mc"}, "bootstrap": {"enabled": False}})
    assert load_params(off).data.format == "mc"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("eval.n_examples", 0),
        ("labels.n_examples", 0),
        ("sweep.speculative_examples", 0),
        ("finetune.max_steps", -1),
        ("finetune.max_steps", 1),
        ("finetune.epochs", 0.5),
        ("router.dropout", 0.0),
        ("finetune.warmup_ratio", 0.0),
        ("serve.port", 65535),
        ("serve.port", 1),
        ("sweep.rule.accuracy_ratio", 1.0),
        ("synth.max_steps", 2),  # == min_steps
        ("synth.max_total", 29),  # == max_start + max_operand
        ("bootstrap.vocab_size", 258),
        ("inference.tau", None),
        ("models.device", "cuda"),
        ("models.device", "cuda:3"),  # absent devices are the loader's business, not the params'
        ("models.device", "mps"),
        ("models.device", "auto"),
        ("models.dtype", "bfloat16"),
        ("models.llm_device_map", "auto"),
        ("models.llm_device_map", {"model.embed_tokens": 0, "model.layers.0": "cuda:1", "lm_head": "cpu"}),
    ],
)
def test_boundary_values_are_accepted(tmp_path, key, value):
    p = load_params(_write(tmp_path / "params.yaml", _with(key, value)))
    obj = p
    for part in key.split("."):
        obj = getattr(obj, part)
    assert obj == value


def test_device_checked_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; from citer.config import ModelsParams; ModelsParams(device='cuda:0');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(ValidationError, match="must be cpu, cuda, cuda:N, mps"):
        ModelsParams(device="tpu9")


def _blocks(model=Params, seen=None):
    seen = seen if seen is not None else set()
    if model in seen:
        return seen
    seen.add(model)
    for f in model.model_fields.values():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            _blocks(f.annotation, seen)
    return seen


def test_defaults_and_repo_params_are_valid():
    # Defaults are not validated by pydantic when used: validate every one of them (nested blocks included).
    assert Params.model_validate(Params().model_dump(by_alias=True)) == Params()
    for block in _blocks():
        if all(not f.is_required() for f in block.model_fields.values()):
            assert block.model_validate(block().model_dump(by_alias=True)) == block()
    load_params(REPO / "params.yaml")


def test_every_number_has_a_lower_bound():
    """A new numeric field comes with its range (or an explicit check, listed here)."""
    checked = {("FinetuneParams", "max_steps")}
    unbounded = []
    for block in _blocks():
        for name, f in block.model_fields.items():
            if get_origin(f.annotation) in (list, tuple, dict):  # llm_fractions: checked item by item
                continue
            types = {a for a in (get_args(f.annotation) or (f.annotation,)) if a is not type(None)}
            if not types & {int, float} or bool in types:
                continue
            if not any(getattr(m, b, None) is not None for m in f.metadata for b in ("ge", "gt")):
                if (block.__name__, name) not in checked:
                    unbounded.append(f"{block.__name__}.{name}")
    assert not unbounded


def test_params_choose_the_runner_and_refuse_torch_only_options():
    assert EngineParams().runner == "torch"
    assert EngineParams(runner="llama_cpp", llama_cpp_type="Q4_K_M").runner_name() == "llama_cpp:Q4_K_M"
    assert EngineParams(llama_cpp_type="Q4_0").runner_name() == "torch"  # the type matters only to llama_cpp
    with pytest.raises(ValueError, match="llama_cpp runs no overlap"):
        EngineParams(runner="llama_cpp", overlap=True)
    with pytest.raises(ValueError, match="llama_cpp runs no forward"):
        EngineParams(runner="llama_cpp", forward="compiled")
    with pytest.raises(ValueError, match="forward"):
        EngineParams(forward="aot_eager")  # the test-only modes are not the params'
    assert EngineParams().forward == "eager"
    assert (
        EngineParams(runner="llama_cpp", llm_prefill="admit").llm_prefill == "admit"
    )  # both runners read prompts so
    shared = EngineParams(runner="llama_cpp", llm_min_rows=4, llm_max_wait_steps=3, llm_schedule="measured")
    assert shared.llm_min_rows == 4  # shared LLM calls run on either runner
    with pytest.raises(ValueError, match="llama_cpp_type"):
        EngineParams(runner="llama_cpp", llama_cpp_type="q4_0")


def test_the_engine_block_defaults_are_the_engines_own():
    """A block read without pydantic (the GPU bench) leaves unset settings to the engine: its defaults must be the
    params' defaults, or the GPU would time another engine than ``citer route`` builds."""
    import inspect

    from citer.decoding.engine import ENGINE_SETTINGS, RoutedEngine

    sig = inspect.signature(RoutedEngine)
    defaults = EngineParams().model_dump()
    assert {k: sig.parameters[k].default for k in ENGINE_SETTINGS} == {
        k: defaults[k] for k in ENGINE_SETTINGS
    }
