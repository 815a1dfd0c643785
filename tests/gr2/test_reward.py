"""The GR2 reward on hand-made lists, including the reward-hacking case (copying the retriever order)."""

import pytest

from gr2.prompt import render_response, render_trace
from gr2.reward import INVALID_REWARD, rank_reward, response_reward
from gr2.tokenizer import build_tokenizer

N = 10
IDENTITY = list(range(N))


def test_promotion_earns_rank_and_format():
    # target at retriever position 3 moved to the top: R_rank = 3/10, plus the format bonus 0.2
    ranking = [3, 0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert rank_reward(ranking, 3, N) == pytest.approx(0.3 + 0.2)
    # moved from 7 to 5: R_rank = 2/10
    assert rank_reward([0, 1, 2, 3, 4, 7, 5, 6, 8, 9], 7, N) == pytest.approx(0.2 + 0.2)


def test_copying_the_input_order_earns_no_format_bonus():
    # the hacking case: the target was at position 4, the policy re-emits the retriever order
    assert rank_reward(IDENTITY, 4, N) == 0.0
    # an unconditional bonus would have paid alpha for it; the conditional one pays nothing
    assert rank_reward(IDENTITY, 4, N, alpha=0.5) == 0.0


def test_already_first_keeps_the_bonus():
    assert rank_reward(IDENTITY, 0, N) == pytest.approx(0.2)
    # demoting an item that was first: R_rank < 0, bonus still paid (rank_pre(x*) = 1 in GR2's rule)
    assert rank_reward([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], 0, N) == pytest.approx(-0.1 + 0.2)


def test_demotion_is_negative_without_bonus():
    assert rank_reward([0, 1, 2, 3, 4, 5, 6, 7, 8, 9][::-1], 2, N) == pytest.approx((2 - 7) / 10)


def test_shuffled_prompt_measures_promotion_against_the_retriever_rank():
    # the held-out item (retriever rank 2) is shown as candidate 5; ranking it first promotes it by 2
    assert rank_reward([5, 0, 1, 2, 3, 4, 6, 7, 8, 9], 5, N, rank_before=2) == pytest.approx(0.2 + 0.2)
    # copying the shuffled order leaves it 5th: a demotion from 2, no bonus
    assert rank_reward(IDENTITY, 5, N, rank_before=2) == pytest.approx(-0.3)
    # the retriever's first, shown as candidate 3 and left there: demoted, but it was first, so the bonus stays
    assert rank_reward(IDENTITY, 3, N, rank_before=0) == pytest.approx(-0.3 + 0.2)
    with pytest.raises(ValueError, match="rank_before"):
        rank_reward(IDENTITY, 3, N, rank_before=N)


def test_invalid_is_minus_one():
    assert rank_reward(None, 3, N) == INVALID_REWARD == -1.0
    with pytest.raises(ValueError):
        rank_reward(IDENTITY, 10, N)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer([4, 4, 4, 4], ["transition", "popularity"])


def _ids(tok, text, eos=True):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids + [tok.eos_token_id] if eos else ids


def test_response_reward_parses_tokens(tok):
    trace = render_trace([1, 0, 7, 2, 0, 0, 3, 1, 0, 0])
    text = render_response(trace, [2, 0, 1, 3, 4, 5, 6, 7, 8, 9])
    r, valid = response_reward(_ids(tok, text), 2, N, tok)
    assert valid and r == pytest.approx(0.2 + 0.2)
    # The same answer after a trace that names [D] twice and [B] never: the trace says nothing, so invalid.
    broken = trace.replace("[B]", "[D]")
    r, valid = response_reward(_ids(tok, render_response(broken, [2, 0, 1, 3, 4, 5, 6, 7, 8, 9])), 2, N, tok)
    assert not valid and r == INVALID_REWARD
    # the same answer copied from the input order while the target sat at 2: no bonus, R = 0
    r, valid = response_reward(_ids(tok, render_response(None, IDENTITY)), 2, N, tok)
    assert valid and r == 0.0
    # duplicates / omissions are invalid: -1
    r, valid = response_reward(_ids(tok, render_response(None, [0, 0, 1, 2, 3, 4, 5, 6, 7, 8])), 2, N, tok)
    assert not valid and r == -1.0
    # no eos (ran out of tokens): overflow is invalid even if the JSON is complete
    r, valid = response_reward(_ids(tok, render_response(None, IDENTITY), eos=False), 0, N, tok)
    assert not valid and r == -1.0


def test_dcg_gain_pays_for_the_top_places():
    # 1 -> 0 earns 1 - 1/log2(3) = 0.369, 3 -> 2 earns 1/log2(4) - 1/log2(5) = 0.069; linear pays 0.1 for both
    assert rank_reward([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], 1, N, gain="dcg") == pytest.approx(
        0.3691 + 0.2, abs=1e-4
    )
    assert rank_reward([0, 1, 3, 2, 4, 5, 6, 7, 8, 9], 3, N, gain="dcg") == pytest.approx(
        0.0693 + 0.2, abs=1e-4
    )
    # the same rules around it: copying the retriever pays nothing, demoting the first keeps the bonus
    assert rank_reward(IDENTITY, 4, N, gain="dcg") == 0.0
    assert rank_reward([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], 0, N, gain="dcg") == pytest.approx(
        -0.3691 + 0.2, abs=1e-4
    )
    assert rank_reward(None, 3, N, gain="dcg") == INVALID_REWARD
    with pytest.raises(ValueError, match="gain"):
        rank_reward(IDENTITY, 3, N, gain="ndcg")


def test_an_unknown_rl_reward_fails_when_the_profile_loads():
    from gr2.config import load_profile

    assert load_profile("smoke", {"ar_rl.reward": "dcg"}).ar_rl.reward == "dcg"
    with pytest.raises(ValueError, match="rl.reward 'top'"):
        load_profile("smoke", {"rl.reward": "top"})
