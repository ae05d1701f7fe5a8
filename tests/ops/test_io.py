import os

import pytest

from citer.ops.io import atomic_dir, atomic_path, read_json, write_json, write_jsonl


def test_atomic_path_keeps_old_file_on_failure(tmp_path):
    dst = tmp_path / "a.json"
    write_json(dst, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(dst) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert read_json(dst) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_dir_replaces_whole_dir(tmp_path):
    dst = tmp_path / "model"
    with atomic_dir(dst) as d:
        (d / "old.txt").write_text("x")
    with atomic_dir(dst) as d:
        (d / "new.txt").write_text("y")
    assert sorted(os.listdir(dst)) == ["new.txt"]
    with pytest.raises(RuntimeError), atomic_dir(dst) as d:
        (d / "partial.txt").write_text("z")
        raise RuntimeError("killed")
    assert sorted(os.listdir(dst)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_write_jsonl(tmp_path):
    dst = tmp_path / "x.jsonl"
    write_jsonl(dst, [{"a": 1}, {"b": "é"}])
    assert dst.read_text(encoding="utf-8").splitlines() == ['{"a": 1}', '{"b": "é"}']
