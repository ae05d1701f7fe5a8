import pytest
from conftest import REPO

from citer.config import ConfigError, Params, load_params


def test_repo_params_load():
    p = load_params(REPO / "params.yaml")
    assert isinstance(p, Params)
    assert p.data.format in ("math", "mc")


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
