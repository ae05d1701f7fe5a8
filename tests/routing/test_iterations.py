"""Fingerprints say when a label set or router on disk still matches its inputs; stale iterations are removed."""

from __future__ import annotations

import json

from citer.routing.iterations import (
    fingerprint,
    model_fingerprint,
    recorded_fingerprint,
    remove_stale_iterations,
    source_digest,
)


def test_fingerprint_is_canonical_and_sensitive():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_model_fingerprint_follows_weights_not_time(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    big = bytearray(3 << 20)  # sampled: head and tail
    (d / "model.safetensors").write_bytes(big)
    first = model_fingerprint(d)
    (d / "model.safetensors").write_bytes(big)  # rewritten, same bytes
    assert model_fingerprint(d) == first
    big[10] = 1
    (d / "model.safetensors").write_bytes(big)
    assert model_fingerprint(d) != first
    assert model_fingerprint("Qwen/Qwen2-1.5B") == "hub:Qwen/Qwen2-1.5B"


def test_source_digest_and_recorded(tmp_path):
    assert source_digest(["citer.routing.mlp"]) != source_digest(["citer.routing.labels"])
    assert recorded_fingerprint(tmp_path / "none.json") is None
    (tmp_path / "meta.json").write_text(json.dumps({"fingerprint": "abc"}))
    assert recorded_fingerprint(tmp_path / "meta.json") == "abc"


def test_remove_stale_iterations(tmp_path):
    for k in (1, 2, 3, 10):
        (tmp_path / f"iter{k}").mkdir()
        (tmp_path / f"router_iter{k}.json").write_text("{}")
    (tmp_path / "citer_s").mkdir()
    removed = remove_stale_iterations(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["iter10", "iter3"]
    remove_stale_iterations(tmp_path, 2, prefix="router_iter")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "citer_s",
        "iter1",
        "iter2",
        "router_iter1.json",
        "router_iter2.json",
    ]


def test_remove_stale_iterations_keeps_listed_ablations(tmp_path):
    routers, reports = tmp_path / "routers", tmp_path / "reports"
    for name in ("iter1", "iter2", "citer_s", "ablation_emb", "ablation_logits", "ablation_emb_logits"):
        (routers / name).mkdir(parents=True)
    reports.mkdir()
    for name in ("router", "router_iter1", "router_ablation_emb", "router_ablation_logits"):
        (reports / f"{name}.json").write_text("{}")
    # Without ablations, ablation entries are left alone (callers that do not know of them).
    assert remove_stale_iterations(routers, 1) == [routers / "iter2"]
    assert (routers / "ablation_logits").is_dir()
    removed = remove_stale_iterations(routers, 1, ablations=["emb", "emb_logits"])
    assert removed == [routers / "ablation_logits"]
    assert sorted(p.name for p in routers.iterdir()) == [
        "ablation_emb",
        "ablation_emb_logits",
        "citer_s",
        "iter1",
    ]
    removed = remove_stale_iterations(
        reports, 1, prefix="router_iter", ablations=["emb"], ablation_prefix="router_ablation_"
    )
    assert removed == [reports / "router_ablation_logits.json"]
    assert remove_stale_iterations(routers, 1, ablations=[]) == [
        routers / "ablation_emb",
        routers / "ablation_emb_logits",
    ]
