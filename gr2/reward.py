"""The GR2 re-ranking reward (docs/PAPER.md): rank promotion of the held-out item plus a conditional format bonus.

    R = R_rank + alpha * R_fmt,   R_rank = (rank_before - rank_after) / N  in [-1, 1]

`gain="dcg"` measures the promotion in DCG instead (a list metric that weighs the top, as R@1 and NDCG@k do):
R_rank = 1/log2(rank_after + 2) - 1/log2(rank_before + 2). Moving the item from 1 to 0 (0-based) then earns 0.37,
from 3 to 2 only 0.07, where the linear gain pays 1/N for either (`RLConfig.reward`).

rank_before = the held-out item's position in the retriever order, rank_after = its position in the model's
ranking (both 0-based; the difference is the same as with 1-based ranks). Usually the prompt lists the
candidates in retriever order, so rank_before is the item's index in the prompt (its `label`); RL prompts that
list them shuffled (`RLConfig.shuffle_candidates`) pass the retriever rank separately. The format bonus
(R_fmt = 1 for a valid permutation) is paid only when R_rank > 0 or the item was already first: with an
unconditional bonus, re-emitting the input order earns R_rank = 0 + alpha on every list, and the policy learns
to copy the retriever (reward hacking, GR2). Invalid or overflowing output (no eos) earns -1, and so does a
trace that does not name each candidate once with one score level (`parse_trace`): the rank reward looks only at
the answer, so without this rule RL lets the trace drift into text that no longer says anything (on Beauty
without titles, AR RL began to write "[A] .. [D] .. [C] .. [D]" in one list in nine, and the student converted
from it learnt the broken traces).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gr2.config import REWARD_GAINS
from gr2.prompt import parse_response, parse_trace, response_trace

INVALID_REWARD = -1.0


def dcg_gain(rank: int) -> float:
    """The DCG of a list whose one relevant item sits at 0-based `rank`."""
    return 1.0 / math.log2(rank + 2)


def rank_reward(
    ranking: Sequence[int] | None,
    label: int,
    n: int,
    alpha: float = 0.2,
    rank_before: int | None = None,
    gain: str = "rank",
) -> float:
    """R for one list: `ranking` = candidate indices best first (None = invalid), `label` = the target's index
    in the prompt, `rank_before` = its retriever rank (default: `label`, the prompt in retriever order), `gain`:
    how R_rank measures the promotion, one of `REWARD_GAINS` (module docstring)."""
    if ranking is None:
        return INVALID_REWARD
    before = label if rank_before is None else rank_before
    for name, v in (("label", label), ("rank_before", before)):
        if not 0 <= v < n:
            raise ValueError(f"{name} {v} outside 0..{n - 1}")
    if gain not in REWARD_GAINS:
        raise ValueError(f"gain {gain!r}: expected one of {REWARD_GAINS}")
    after = list(ranking).index(label)
    r_rank = (before - after) / n if gain == "rank" else dcg_gain(after) - dcg_gain(before)
    bonus = alpha if (r_rank > 0 or before == 0) else 0.0
    return r_rank + bonus


def response_reward(
    response: Sequence[int],
    label: int,
    n: int,
    tokenizer: Any,
    alpha: float = 0.2,
    rank_before: int | None = None,
    gain: str = "rank",
) -> tuple[float, bool]:
    """(R, valid) for generated token ids. A response without eos (ran out of tokens), or with text before the
    answer that is not a well-formed trace, counts as invalid."""
    ids = list(response)
    eos = tokenizer.eos_token_id
    if eos not in ids:
        return INVALID_REWARD, False
    text = tokenizer.decode(ids[: ids.index(eos)], skip_special_tokens=True)
    ranking = parse_response(text, n).ranking
    trace = response_trace(text)
    if ranking is not None and trace is not None and parse_trace(trace, n) is None:
        ranking = None
    return rank_reward(ranking, label, n, alpha, rank_before, gain), ranking is not None
