"""analysis/rounds_check.py `forced_tokens`: the answer tokens the trace rule leaves one choice (what a
jump-forward AR decoder could skip)."""

import torch

from analysis.rounds_check import forced_tokens
from tests.gr2.trace_toy import ANSWER_IDS, FOLLOW


def test_forced_tokens_by_hand():
    # Levels 1, 3, 1 (tests/gr2/test_decode.py test_answer_slots_by_hand): B is the only level-3 candidate
    # (forced); A and C tie, so the first of them is the model's choice and the second is forced.
    resp = torch.tensor([[5, 12, 6, 14, 7, 12, 15, 16, 18, 23, 17, 23, 19]])  # the answer B, A, C
    prompt = torch.tensor([[1, 5, 12, 6, 14, 7, 12]])  # the toy prompt: each candidate's label and level
    assert forced_tokens(FOLLOW, ANSWER_IDS, prompt, resp).tolist() == [2]
    # Three distinct levels: every label is forced.
    distinct = resp.clone()
    distinct[0, 5] = 13  # C at level 2: the answer B, C, A
    distinct[0, [8, 10, 12]] = torch.tensor([18, 19, 17])
    assert forced_tokens(FOLLOW, ANSWER_IDS, prompt, distinct).tolist() == [3]
    # A broken trace rules nothing: no token is forced.
    broken = resp.clone()
    broken[0, 2] = 7
    assert forced_tokens(FOLLOW, ANSWER_IDS, prompt, broken).tolist() == [0]
