"""Prompt/response format: lengths, weights, and render -> tokenize -> decode -> parse round trips."""

from __future__ import annotations

import numpy as np
import pytest

from gr2.evidence import FEATURE_NAMES
from gr2.prompt import (
    DUPLICATE,
    EMPTY,
    MISSING_ANSWER,
    OMITTED,
    OUT_OF_SET,
    UNPARSEABLE,
    WRONG_LENGTH,
    bucket_token,
    encode_example,
    encode_prompt,
    feature_aliases,
    parse_response,
    parse_trace,
    render_answer,
    render_prompt,
    render_response,
    render_trace,
)
from gr2.tokenizer import build_tokenizer

K = 16
TRACE = render_trace([3, 0, 7, 1, 1, 5, 0, 2, 6, 4])


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer((K, K, K, 2), FEATURE_NAMES)


def _example(rng, h=20, n=10):
    hist = [tuple(int(c) for c in rng.integers(0, K, 3)) + (0,) for _ in range(h)]
    cands = [tuple(int(c) for c in rng.integers(0, K, 3)) + (int(rng.integers(0, 2)),) for _ in range(n)]
    buckets = rng.integers(0, 4, (n, len(FEATURE_NAMES)))
    return hist, cands, buckets


def test_feature_aliases_distinct_and_short():
    aliases = feature_aliases(FEATURE_NAMES, len(FEATURE_NAMES))
    assert len(set(aliases)) == len(aliases)
    assert aliases[:3] == ["trans", "trec", "co"]


def test_prompt_length_and_content(tok):
    hist, cands, buckets = _example(np.random.default_rng(0))
    text = render_prompt(hist, cands, buckets, FEATURE_NAMES)
    words = text.split()
    # 'history' + 20 x 4 SID + 'candidates' + 10 x (label + 4 SID + 7 buckets) = 202 tokens.
    assert len(words) == 2 + 80 + 10 * (1 + 4 + len(FEATURE_NAMES)) < 250
    assert words[1:5] == [f"<a_{hist[0][0]}>", f"<b_{hist[0][1]}>", f"<c_{hist[0][2]}>", "<d_0>"]
    i = words.index("[C]")
    assert words[i + 5 : i + 5 + len(FEATURE_NAMES)][0] == f"<trans_{buckets[2, 0]}>"
    assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]


def test_item_tokens_choose_which_semantic_ids_the_prompt_shows(tok):
    hist, cands, buckets = _example(np.random.default_rng(0))
    n_ev = len(FEATURE_NAMES)
    none = render_prompt(hist, cands, buckets, FEATURE_NAMES, "none").split()
    assert none[0] == "candidates" and len(none) == 1 + 10 * (1 + n_ev)
    assert none[1 + n_ev + 1 :][:1] == ["[B]"] and none[2 : 2 + n_ev][0] == f"<trans_{buckets[0, 0]}>"
    cand = render_prompt(hist, cands, buckets, FEATURE_NAMES, "candidates").split()
    assert cand[0] == "candidates" and len(cand) == 1 + 10 * (5 + n_ev)
    assert cand[2:6] == [
        f"<a_{cands[0][0]}>",
        f"<b_{cands[0][1]}>",
        f"<c_{cands[0][2]}>",
        f"<d_{cands[0][3]}>",
    ]
    assert render_prompt(hist, cands, buckets, FEATURE_NAMES, "all").split()[0] == "history"
    ids = encode_prompt(tok, hist, cands, buckets, FEATURE_NAMES, "none")
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]).split() == none
    with pytest.raises(ValueError, match="item_tokens"):
        render_prompt(hist, cands, buckets, FEATURE_NAMES, "some")


def test_short_lists_keep_each_candidate_at_a_full_lists_distance_from_the_prompts_end(tok):
    hist, cands, buckets = _example(np.random.default_rng(0))
    n_ev, block = len(FEATURE_NAMES), 1 + len(FEATURE_NAMES)  # a candidate's tokens: its label, its buckets

    def words(n, short_lists):
        return render_prompt(
            hist, cands[:n], buckets[:n], FEATURE_NAMES, "none", short_lists=short_lists, n_full=10
        ).split()

    def distance(w, k):  # tokens from candidate k's label to the prompt's end
        return len(w) - w.index(f"[{chr(ord('A') + k)}]")

    full = words(10, "as_is")
    assert words(10, "fill") == full  # a full list is what it was
    for n in (2, 4, 7):
        fill, as_is = words(n, "fill"), words(n, "as_is")
        assert fill[: len(as_is)] == as_is and fill[len(as_is) :] == [EMPTY] * ((10 - n) * block)
        assert [distance(fill, k) for k in range(n)] == [distance(full, k) for k in range(n)]
        assert distance(as_is, 0) == n * block  # what "fill" is for: as_is moves every distance with n
    last = words(10, "last_first")
    assert [w for w in last if w.startswith("[")] == [f"[{c}]" for c in "JIHGFEDCBA"]
    assert sorted(full) == sorted(last)  # the same tokens, candidate blocks in the other order
    for k in range(10):  # each candidate keeps its own buckets, and sits k + 1 blocks before the end
        i, j = last.index(f"[{chr(ord('A') + k)}]"), full.index(f"[{chr(ord('A') + k)}]")
        assert (
            last[i + 1 : i + 1 + n_ev]
            == full[j + 1 : j + 1 + n_ev]
            == [
                bucket_token(a, b)
                for a, b in zip(feature_aliases(FEATURE_NAMES, n_ev), buckets[k], strict=True)
            ]
        )
        assert distance(last, k) == (k + 1) * block
    assert distance(words(4, "last_first"), 0) == block
    ids = encode_prompt(
        tok, hist, cands[:3], buckets[:3], FEATURE_NAMES, "none", short_lists="fill", n_full=10
    )
    assert tok.decode(ids[1:]).split() == words(3, "fill") and tok.unk_token_id not in ids
    with pytest.raises(ValueError, match="short_lists"):
        render_prompt(hist, cands, buckets, FEATURE_NAMES, "none", short_lists="pad")
    with pytest.raises(ValueError, match="n_full"):
        render_prompt(hist, cands, buckets, FEATURE_NAMES, "none", short_lists="fill")


def test_trace_names_every_candidate_with_its_score_level(tok):
    words = TRACE.split()
    assert words[::2] == [f"[{c}]" for c in "ABCDEFGHIJ"]
    assert words[1::2] == ["<score_3>", "<score_0>", "<score_7>", "<score_1>", "<score_1>"] + [
        "<score_5>",
        "<score_0>",
        "<score_2>",
        "<score_6>",
        "<score_4>",
    ]
    assert tok.unk_token_id not in tok(TRACE, add_special_tokens=False)["input_ids"]


def test_parse_trace_reads_back_the_levels_or_refuses(tok):
    levels = [3, 0, 7, 1, 1, 5, 0, 2, 6, 4]
    assert parse_trace(TRACE, 10) == levels
    # What a model writes comes back through the tokenizer.
    ids = tok(TRACE, add_special_tokens=False)["input_ids"]
    assert parse_trace(tok.decode(ids, skip_special_tokens=True), 10) == levels
    assert parse_trace(render_trace([2, 1, 0]), 3) == [2, 1, 0]
    assert parse_trace(None, 10) is None and parse_trace("", 10) is None
    assert parse_trace(TRACE, 11) is None  # a candidate without a level
    assert parse_trace(TRACE.replace("[C]", "[B]"), 10) is None  # one label twice, one missing
    assert parse_trace(TRACE + " [K]", 10) is None  # something else in the trace
    assert parse_trace(TRACE.replace("<score_7>", "<score_x>"), 10) is None


@pytest.mark.parametrize("trace", [TRACE, None])
def test_encode_round_trip(tok, trace):
    rng = np.random.default_rng(1)
    for _ in range(20):
        hist, cands, buckets = _example(rng, h=int(rng.integers(0, 21)))
        ranking = [int(i) for i in rng.permutation(10)]
        p, r, w = encode_example(
            tok, hist, cands, buckets, ranking, trace, FEATURE_NAMES, answer_weight=1.0, trace_weight=0.3
        )
        assert p[0] == tok.bos_token_id and r[-1] == tok.eos_token_id and len(r) == len(w)
        n_trace = len(trace.split()) if trace else 0
        assert w[:n_trace] == [0.3] * n_trace and w[n_trace:] == [1.0] * (len(r) - n_trace)
        assert len(r) - n_trace == 26  # { "ranking" : [ 10 labels, 9 commas ] } <eos>
        assert parse_response(r, 10, tok) == (ranking, None, None)
        text = tok.decode(r, skip_special_tokens=True)
        assert text == render_response(trace, ranking)
        assert parse_response(text).ranking == ranking


@pytest.mark.parametrize("trace", [None, TRACE])
def test_encoding_equals_the_tokenizers_own(tok, trace):
    """gr2/prompt.py encodes our word-level vocabulary by a lookup per word: the ids the tokenizer itself gives
    (lists of 2-10 candidates, histories of 0-20 items; out-of-vocabulary words: test_encode_rejects_...)."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        hist, cands, buckets = _example(rng, h=int(rng.integers(0, 21)), n=int(rng.integers(2, 11)))
        ranking = [int(i) for i in rng.permutation(len(cands))]
        p, r, _ = encode_example(tok, hist, cands, buckets, ranking, trace, FEATURE_NAMES)
        prompt = render_prompt(hist, cands, buckets, FEATURE_NAMES)
        assert p == [tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]
        response = render_response(trace, ranking)
        assert r == [*tok(response, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_render_response_accepts_letters():
    assert render_answer(["B", "A"]) == '{ "ranking" : [ "B" , "A" ] }'
    assert render_response(None, [1, 0]) == render_answer(["B", "A"])


def test_encode_rejects_out_of_vocabulary(tok):
    hist, cands, buckets = _example(np.random.default_rng(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        encode_example(tok, hist, cands, buckets, list(range(10)), "[A] <score_1> banana", FEATURE_NAMES)
    cands[0] = (K + 5, 0, 0, 0)  # a code beyond the codebook
    with pytest.raises(ValueError, match="outside the vocabulary"):
        encode_example(tok, hist, cands, buckets, list(range(10)), None, FEATURE_NAMES)


def _ans(labels: str) -> str:
    return render_answer(list(labels))


@pytest.mark.parametrize(
    ("text", "reason", "detail"),
    [
        ("[A] <score_1> [B] <score_0>", MISSING_ANSWER, None),
        ('{ "order" : [ ] }', MISSING_ANSWER, None),
        ('{ "ranking" : [ "A" , "B" ', UNPARSEABLE, None),
        ('{ "ranking" : [ "A" "B" ] }', UNPARSEABLE, None),
        ('{ "ranking" : "ABC" }', UNPARSEABLE, None),
        (_ans("ABCDEFGHIJA"), WRONG_LENGTH, "11 labels for 10 candidates"),
        (_ans("ABCDEFGHIK"), OUT_OF_SET, "'K'"),
        ('{ "ranking" : [ 1 ] }', OUT_OF_SET, "1"),
        (_ans("ABCDEFGHIA"), DUPLICATE, "A"),
        (_ans("ABCCE"), DUPLICATE, "C"),
        (_ans("ABCDEFGH"), OMITTED, "I,J"),
    ],
)
def test_parse_reasons(text, reason, detail):
    res = parse_response(text, 10)
    assert res.ranking is None and res.reason == reason
    if detail is not None:
        assert res.detail == detail


def test_parse_ignores_trailing_tokens_and_smaller_n():
    assert parse_response(_ans("CAB") + " } ] step", 3).ranking == [2, 0, 1]
    assert parse_response(_ans("CAB"), 4).reason == OMITTED
    with pytest.raises(ValueError, match="tokenizer"):
        parse_response([1, 2, 3])
