"""Model cards are built from the bundle and the report rows, per model."""

from __future__ import annotations

import json

from gr2.model_card import model_card, write_model_cards


def _bundle(tmp_path, name, block_size):
    b = tmp_path / name
    (b / "model").mkdir(parents=True)
    cfg = {
        "name": name,
        "stage": name,
        "block_size": block_size,
        "max_new_tokens": 64,
        "n_candidates": 10,
        "profile": "bench",
        "parent": "/runs/x/cft",
        "train": {"steps": 200, "reward_last": 0.0957},
    }
    (b / "reranker.json").write_text(json.dumps(cfg))
    hf = {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "vocab_size": 900,
    }
    (b / "model" / "config.json").write_text(json.dumps(hf))
    return b


REPORT = {
    "dataset": "amazon_beauty",
    "git_sha": "abc123",
    "n_examples": {"test": 1654},
    "rows": [
        {"model": "ar", "tau": None, "recall@1": 0.3295, "validity": 1.0, "n_users": 1654},
        {
            "model": "rl",
            "tau": 0.9,
            "recall@1": 0.3186,
            "ci95": {"recall@1": [0.2963, 0.3404]},
            "validity": 0.968,
            "invalid_reasons": {"duplicate label": 53},
            "n_users": 1654,
            "nfe_per_seq": 21.25,
            "speedup_vs_ar": 1.45,
        },
    ],
    "speed": [
        {
            "model": "rl",
            "tau": 0.9,
            "batch": 1,
            "tokens_per_s": 2366.3,
            "tokens_per_forward": 2.68,
            "speedup_vs_ar": 1.45,
        }
    ],
}


def test_card_states_decoder_lineage_and_this_models_rows(tmp_path):
    card = model_card("rl", _bundle(tmp_path, "rl", 8), REPORT)
    assert "block diffusion, block_size 8" in card and "d_model 128, 2 layers" in card
    assert "parent: `/runs/x/cft`" in card and "reward_last 0.0957" in card
    assert "| 0.90 | 0.319 [0.296, 0.340] |" in card  # its own row, with the CI
    assert "0.968 (duplicate label 53)" in card and "| 21.2 | 1.45 |" in card
    assert "| 0.90 | 1 | 2366 | 2.68 | 1.45 |" in card
    assert "0.330" not in card  # the AR row belongs to the AR card
    ar = model_card("ar", _bundle(tmp_path, "ar", 0), REPORT)
    assert "autoregressive (KV cache)" in ar and "| — | 0.330 |" in ar


def test_write_model_cards_one_file_per_model(tmp_path):
    bundles = {n: _bundle(tmp_path, n, b) for n, b in (("ar", 0), ("rl", 8), ("opd", 8))}
    paths = write_model_cards(bundles, REPORT, tmp_path / "report")
    assert sorted(p.name for p in paths) == ["ar.md", "opd.md", "rl.md"]
    assert "Not evaluated in this run." in (tmp_path / "report" / "model_cards" / "opd.md").read_text()
