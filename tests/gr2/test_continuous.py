"""Continuous batching (gr2/continuous.py): a request gets the tokens it gets decoded alone, whenever it joins and
whoever it shares the decode with; rows leave as they finish; the buffer stays bounded; forwards are all counted."""

import random

import pytest
import torch

from gr2.continuous import Stream, StreamConfig
from gr2.decode import ar_generate, diffusion_generate
from gr2.rules import NO_RULES, DecodeRules
from tests.gr2.toys import EOS, MASK
from tests.gr2.trace_toy import ANSWER_IDS, BS, FOLLOW, trace_items

L = 24


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of every shape a stream must place: whole ones, a lone bos, shorter than a block, and longer than
    any other (a joining row that needs more room than the running rows' padding gives)."""
    ps = [p for p, _, _ in trace_items(n, seed)]
    shapes = [lambda p: p, lambda p: p[:1], lambda p: p[:3], lambda p: p + p[1:] + p[1:]]
    return [shapes[i % len(shapes)](p) if i % 3 else p for i, p in enumerate(ps)]


def decode_alone(model, bs: int, rules: DecodeRules, p: list[int]) -> list[int]:
    if bs:
        return diffusion_generate(model, [p], L, bs, 0.5, MASK, EOS, rules=rules)[0][0].tolist()
    return ar_generate(model, [p], L, EOS, rules=rules)[0][0].tolist()


def run_stream(stream: Stream, prompts: list[list[int]], seed: int) -> tuple[dict, int]:
    """Feed prompts in random waves between steps (some steps none, some several) -> ({key: Finished}, the
    widest buffer seen)."""
    rng, got, i, widest = random.Random(seed), {}, 0, 0
    for _ in range(2000):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if i < len(prompts):
                stream.add(i, prompts[i])
                i += 1
        for f in stream.step():
            assert f.key not in got
            got[f.key] = f
        if stream.d is not None:
            widest = max(widest, stream.d.seq.shape[1])
        if len(got) == len(prompts):
            return got, widest
    raise AssertionError("the stream did not finish every request")


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
@pytest.mark.parametrize("rules", [NO_RULES, DecodeRules(ANSWER_IDS, FOLLOW)], ids=["free", "follow"])
def test_a_request_gets_its_tokens_alone_whenever_it_joins(trace_models, mode, rules):
    ar, diff = trace_models
    model, bs = (ar, 0) if mode == "ar" else (diff, BS)
    prompts = mixed_prompts(30, 5)
    stream = Stream(model, StreamConfig(L, EOS, bs, 0.5, MASK, rules, max_rows=6, join_wait=0))
    got, widest = run_stream(stream, prompts, seed=1)
    for k, p in enumerate(prompts):
        assert got[k].tokens == decode_alone(model, bs, rules, p), k
    longest = max(len(p) for p in prompts)
    # joins, leaves and moves of the response start keep the buffer within a prompt, a response and a block or two
    assert widest <= longest + L + 2 * max(bs, 1) + L
    assert stream.d is None and len(stream) == 0  # idle again


def test_rows_leave_as_they_finish_and_every_forward_is_shared_out(trace_models):
    _, diff = trace_models
    ps = [p for p, _, _ in trace_items(8, 3)]
    stream = Stream(diff, StreamConfig(L, EOS, BS, 0.5, MASK, DecodeRules(ANSWER_IDS, FOLLOW)))
    short = next(p for p in ps if len(p) == 7)  # a 3-candidate list: its response is a block shorter
    long = next(p for p in ps if len(p) == 9)  # than a 4-candidate one's
    stream.add("short", short)
    stream.add("long", long)
    left: list[str] = []
    while len(left) < 2:
        left += [f.key for f in stream.step()]
        if left == ["short"]:
            assert stream.running == 1  # the finished row left while the other decodes
    assert left == ["short", "long"]
    calls = []
    stream2 = Stream(diff, StreamConfig(L, EOS, BS, 0.5, MASK, DecodeRules(ANSWER_IDS, FOLLOW), max_rows=3))
    calls.clear()
    handle = diff.register_forward_hook(lambda *a: calls.append(1))
    try:
        got, _ = run_stream(stream2, ps, seed=4)
    finally:
        handle.remove()
    assert sum(f.nfe for f in got.values()) == pytest.approx(len(calls))


def test_stream_config_rejects_what_cannot_decode():
    with pytest.raises(ValueError, match="mask_id"):
        StreamConfig(L, EOS, block_size=4)
    with pytest.raises(ValueError, match="max_rows"):
        StreamConfig(L, EOS, max_rows=0)
    with pytest.raises(ValueError, match="empty prompt"):
        Stream(torch.nn.Linear(1, 1), StreamConfig(L, EOS)).add(0, [])


def test_a_prompt_joins_a_running_decode_unless_it_is_about_to_end(trace_models):
    """join_wait: joining costs a prefill that every running row waits for, so a prompt queued when the decode has
    at most join_wait steps (blocks) to go starts the next decode instead."""
    _, diff = trace_models
    ps = [p for p, _, _ in trace_items(4, 11)]
    stream = Stream(diff, StreamConfig(L, EOS, BS, 0.5, MASK, join_wait=2))
    stream.add("a", ps[0])
    stream.step()
    assert stream.steps_left() == (L - BS) // BS  # no layout: rows may run to max_new_tokens
    stream.add("b", ps[1])
    stream.step()
    assert "b" in stream.keys  # 5 blocks to go: it joined
    while stream.steps_left() > 2:
        stream.step()
    stream.add("c", ps[2])
    stream.step()
    assert "c" not in stream.keys and [k for k, _ in stream.queue] == ["c"]  # 2 to go: it waits
    while "c" not in stream.keys:
        stream.step()
    assert stream.keys == ["c"] and stream.s0 == BS  # it began a decode of its own (its first block is done)
