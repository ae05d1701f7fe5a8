"""An unknown params key names the key it was probably meant to be ("did you mean"), in the same one line."""

from __future__ import annotations

import pytest
import yaml

from citer.config import ConfigError, load_params


def _write(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_unknown_key_suggests_the_one_meant(tmp_path):
    raw = {
        "router": {"lrr": 1},
        "sweeps": {},
        "validate": {"file": []},
        "sweep": {"rule": {"acuracy_ratio": 0.9}},
    }
    with pytest.raises(ConfigError) as info:
        load_params(_write(tmp_path / "params.yaml", raw))
    msg = str(info.value)
    assert "\n" not in msg
    assert "router.lrr: Extra inputs are not permitted (did you mean router.lr?)" in msg
    assert "sweeps: Extra inputs are not permitted (did you mean sweep?)" in msg
    assert (
        "validate.file: Extra inputs are not permitted (did you mean validate.files?)" in msg
    )  # an aliased block
    assert (
        "sweep.rule.acuracy_ratio: Extra inputs are not permitted (did you mean sweep.rule.accuracy_ratio?)"
        in msg
    )
    with pytest.raises(ConfigError) as info:
        load_params(_write(tmp_path / "params.yaml", {"router": {"zzz": 1}}))
    assert str(info.value).endswith("router.zzz: Extra inputs are not permitted")  # nothing close: no guess
