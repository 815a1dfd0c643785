"""Closed-vocabulary Hugging Face tokenizer: specials, SID tokens, format tokens, save/load round trip."""

from __future__ import annotations

import re

from gr2.evidence import FEATURE_NAMES
from gr2.prompt import EMPTY, render_answer
from gr2.tokenizer import SPECIAL_TOKENS, build_tokenizer, build_vocab, load_tokenizer

SIZES = (8, 8, 8, 3)


def test_vocab_layout():
    vocab = build_vocab(SIZES, FEATURE_NAMES)
    assert vocab[:5] == SPECIAL_TOKENS
    assert len(vocab) == len(set(vocab))
    assert {"<a_0>", "<b_7>", "<c_3>", "<d_2>"} <= set(vocab) and "<d_3>" not in vocab
    assert {"[A]", "[J]", '"A"', '"J"', "{", "}", '"ranking"', ",", "history", "candidates"} <= set(vocab)
    # One bucket token per (feature, bucket), distinct across features, and the trace's 8 score levels.
    sid = re.compile(r"^<[abcd]_\d+>$")
    score = [t for t in vocab if t.startswith("<score_")]
    assert score == [f"<score_{k}>" for k in range(8)]
    assert (
        EMPTY in vocab
    )  # what fills an absent candidate's tokens in a short list (PromptConfig.short_lists)
    others = SPECIAL_TOKENS + score + [EMPTY]
    buckets = [t for t in vocab if t.startswith("<") and not sid.match(t) and t not in others]
    assert len(buckets) == len(FEATURE_NAMES) * 4


def test_special_ids_and_mask():
    tok = build_tokenizer(SIZES, FEATURE_NAMES)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id, tok.unk_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert tok.convert_ids_to_tokens(tok.mask_token_id) == "<mask>"


def test_encode_decode_round_trip_and_unknown(tmp_path):
    tok = build_tokenizer(SIZES, FEATURE_NAMES)
    text = "history <a_1> <b_2> <c_3> <d_0> candidates [A] <a_7> <b_0> <c_1> <d_2> " + render_answer([0])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.split())  # one token per whitespace word: '<a_1>' is not split
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok("<a_99> banana", add_special_tokens=False)["input_ids"] == [tok.unk_token_id] * 2
    tok.save_pretrained(tmp_path)
    back = load_tokenizer(tmp_path)
    assert back(text, add_special_tokens=False)["input_ids"] == ids
    assert back.mask_token_id == tok.mask_token_id and len(back) == len(tok)
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == text


def test_semantic_id_tokens_only_when_the_prompt_shows_items():
    from gr2.config import PromptConfig
    from gr2.sid import SemanticIds
    from gr2.tokenizer import tokenizer_for

    sids = SemanticIds(codes={"x": (1, 2, 3, 0)}, codebook_sizes=SIZES)
    shown = tokenizer_for(sids, FEATURE_NAMES, PromptConfig(item_tokens="candidates")).get_vocab()
    hidden = tokenizer_for(sids, FEATURE_NAMES, PromptConfig(item_tokens="none")).get_vocab()
    assert "<a_1>" in shown and not any(t.startswith("<a_") for t in hidden)
    assert len(shown) - len(hidden) == sum(SIZES) and "<score_7>" in hidden
