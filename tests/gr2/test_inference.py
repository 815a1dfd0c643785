"""The inference API: FloorReranker as the pre-rank floor, and load_reranker's dispatch on reranker.json."""

import json

import pytest

from gr2.inference import (
    FloorReranker,
    RankRequest,
    RankResult,
    Reranker,
    RerankerLoadError,
    load_reranker,
    register_reranker,
)


def test_floor_keeps_upstream_order_valid_nfe0():
    floor = FloorReranker(n_candidates=3)
    reqs = [RankRequest("u1", ["c", "a", "b"], ["x"]), RankRequest("u2", ["b", "c", "a"], [])]
    out = floor.rank(reqs, decoder="ar", tau=0.4)
    assert out == [
        RankResult(["c", "a", "b"], True, None, 0, 0, None),
        RankResult(["b", "c", "a"], True, None, 0, 0, None),
    ]
    assert out[0].ranking is not reqs[0].candidates  # a copy: callers may mutate results
    assert isinstance(floor, Reranker)


def test_floor_roundtrip_with_catalogue(tmp_path):
    FloorReranker(name="floor-ml", n_candidates=7, items=["i2", "i1"]).save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "reranker.json").read_text())["kind"] == "floor"
    r = load_reranker(tmp_path / "m")
    assert (r.name, r.n_candidates) == ("floor-ml", 7)
    assert r.known_item("i1") and not r.known_item("i3")


def test_floor_without_catalogue_knows_every_item(tmp_path):
    r = load_reranker(FloorReranker().save(tmp_path))
    assert r.known_item("anything")


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(RerankerLoadError, match="missing"):
        load_reranker(tmp_path)
    (tmp_path / "reranker.json").write_text("{not json")
    with pytest.raises(RerankerLoadError, match="not valid JSON"):
        load_reranker(tmp_path)
    (tmp_path / "reranker.json").write_text('{"kind": "nope"}')
    with pytest.raises(RerankerLoadError, match="unknown kind 'nope'.*floor"):
        load_reranker(tmp_path)
    (tmp_path / "reranker.json").write_text('{"kind": "floor", "n_candidates": "10"}')
    with pytest.raises(RerankerLoadError, match="n_candidates"):
        load_reranker(tmp_path)


def test_register_new_kind(tmp_path):
    class Reverse(FloorReranker):
        def rank(self, requests, decoder="diffusion", tau=0.9):
            return [RankResult(r.candidates[::-1], True, None, 1, 2, "t") for r in requests]

    register_reranker("test-reverse")(lambda path, cfg: Reverse(name=cfg["name"]))
    (tmp_path / "reranker.json").write_text('{"kind": "test-reverse", "name": "rev"}')
    r = load_reranker(tmp_path)
    assert r.name == "rev"
    assert r.rank([RankRequest("u", ["a", "b"], [])])[0].ranking == ["b", "a"]
