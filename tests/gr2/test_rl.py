"""RL: sampling decoders mirror the greedy ones, trajectory replay reproduces the sampler's log-probs, GRPO pieces."""

import pytest
import torch

from gr2.config import load_profile
from gr2.decode import GIVEN, ar_generate, diffusion_generate
from gr2.model import convert_to_diffusion
from gr2.rl import (
    Sampling,
    _canvases,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    policy_logits,
    rollout_batch,
    rollout_certainty,
    sample,
    sample_ar,
    sample_diffusion,
    token_logprobs,
)
from gr2.rules import DecodeRules
from gr2.stages.opd_rl import prompts_for_step, rl_config
from tests.gr2.toys import EOS, MASK, toy_items, toy_model
from tests.gr2.trace_toy import ANSWER_IDS, FOLLOW, SHAPE, follows, trace_items

BS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def peaky_model(scale: float, seed: int = 0):
    """An untrained toy model with scaled embeddings: confident enough that some rounds commit several tokens
    and others one, and that eos appears, without spending test time on training."""
    m = toy_model(seed)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(scale)
    return m


def prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    return [p for p, _, _ in toy_items(n, seed)]


def test_greedy_sampling_reproduces_the_decoders():
    ar = peaky_model(4.0)
    a, n_a = ar_generate(ar, prompts(), 14, EOS)
    ro = sample_ar(ar, prompts(), 14, EOS, temperature=0)
    assert torch.equal(a, ro.tokens) and n_a == ro.nfe
    diff = convert_to_diffusion(ar, BS, MASK)
    for tau in (0.9, 0.3):
        t, nfe, traj = diffusion_generate(diff, prompts(), 16, BS, tau, MASK, EOS)
        ro = sample_diffusion(diff, prompts(), 16, BS, tau, MASK, EOS, temperature=0)
        assert torch.equal(t, ro.tokens) and torch.equal(traj, ro.traj) and nfe == ro.nfe


@pytest.mark.parametrize("scale,temperature,tau", [(3.0, 1.0, 0.1), (6.0, 0.7, 0.4)])
def test_trajectory_replay_matches_sampler_logprobs(scale, temperature, tau):
    diff = convert_to_diffusion(peaky_model(scale), BS, MASK)
    g = torch.Generator().manual_seed(0)
    ro = sample_diffusion(diff, prompts(), 16, BS, tau, MASK, EOS, temperature=temperature, generator=g)
    batch = rollout_batch(ro, EOS)
    scored = batch.scored
    # The case is non-trivial: some block has several rounds, some round commits several tokens of a block.
    traj = batch.traj.clone()
    blocks = [traj[b, s : s + BS][scored[b, s : s + BS]] for b in range(len(traj)) for s in range(0, 16, BS)]
    blocks = [t for t in blocks if len(t)]
    assert any(len(set(t.tolist())) > 1 for t in blocks)
    assert any(len(t) > len(set(t.tolist())) for t in blocks)
    lp = token_logprobs(
        policy_logits(diff, batch, BS, MASK), batch.input_ids[:, batch.prompt_len :], temperature
    )
    err = (lp - batch.old_logprobs)[scored].abs().max()
    assert err < 1e-4, err
    # Negative control: a mean-field estimate (every token read off an all-mask canvas) does not match.
    mf = batch.traj.clone()
    mf[mf >= 0] = 0
    mf_batch = rollout_batch(ro, EOS)
    mf_batch.traj = mf
    lp_mf = token_logprobs(
        policy_logits(diff, mf_batch, BS, MASK), mf_batch.input_ids[:, batch.prompt_len :], temperature
    )
    assert (lp_mf - batch.old_logprobs)[scored].abs().max() > max(100 * err, 1e-4)


def test_ar_replay_matches_sampler_and_block_size_one_is_ar():
    ar = peaky_model(3.0)
    g = torch.Generator().manual_seed(1)
    ro = sample_ar(ar, prompts(), 14, EOS, temperature=1.0, generator=g)
    batch = rollout_batch(ro, EOS)
    logits = policy_logits(ar, batch, 0)
    lp = token_logprobs(logits, batch.input_ids[:, batch.prompt_len :])
    assert (lp - batch.old_logprobs)[batch.scored].abs().max() < 1e-4
    # block_size 1: no canvases at all, replay = the causal forward
    diff1 = convert_to_diffusion(ar, 1, MASK)
    assert torch.allclose(policy_logits(diff1, batch, 1, MASK), logits, atol=1e-4)


def test_canvases_hand_made():
    # one row, two blocks of 4; rounds: block 0 = [0, 1, 1, 2], block 1 = [3, 4, 3, -1(filler)]
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16, EOS]])
    traj = torch.tensor([[0, 1, 1, 2, 3, 4, 3, -1]])
    scored = traj >= 0
    canv, cblock, where = _canvases(tokens, traj, scored, 4, MASK)
    M = MASK
    assert canv[0].tolist() == [[10, M, M, M], [10, 11, 12, M], [M, M, M, M], [14, M, 16, M]]
    assert cblock[0].tolist() == [0, 0, 1, 1]
    # position 0 of each block reads the clean column before it (no canvas); the filler is not scored
    assert where[0].tolist() == [-1, 0, 0, 1, -1, 3, 2, -1]


def test_group_advantages_drop_zero_variance_groups():
    r = torch.tensor(
        [
            [0.5, 0.5, 0.5, 0.5],  # identical rewards: dropped
            [-1.0, -1.0, -1.0, -1.0],  # all invalid: dropped
            [-1.0, 0.2, 0.2, 0.6],  # an invalid rollout stays in a group with signal, at -1
        ]
    )
    adv, keep = group_advantages(r)
    assert keep.tolist() == [False, False, True]
    assert torch.all(adv[:2] == 0)
    g = r[2]
    assert torch.allclose(adv[2], (g - g.mean()) / g.std(unbiased=False))
    assert adv[2, 0] < 0 and abs(float(adv[2].mean())) < 1e-6


def test_clipped_surrogate_hand_made():
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    scored = torch.tensor([[True, True, True], [True, True, False]])
    loss, st = clipped_surrogate(new, old, adv, scored, clip_eps=0.2, clip_eps_high=0.28)
    # A > 0: min(rho, clip(rho)) = [1.28, 1.0, 0.5]; A < 0: min(-rho, -clip(rho)) = [-1.5, -1.0]
    expected = -(1.28 + 1.0 + 0.5 - 1.5 - 1.0) / 5  # token-level: divided by all 5 scored tokens
    assert loss.item() == pytest.approx(expected)
    assert st["clip_frac"] == pytest.approx(3 / 5)


def test_grpo_step_moves_logprobs_with_the_advantage():
    diff = convert_to_diffusion(peaky_model(3.0), BS, MASK)
    g = torch.Generator().manual_seed(2)
    ro = sample_diffusion(diff, prompts(2), 16, BS, 0.5, MASK, EOS, temperature=1.0, generator=g)
    batch = rollout_batch(ro, EOS, advantages=torch.tensor([1.0, -1.0]))
    opt = torch.optim.SGD(diff.parameters(), lr=0.05)
    for _ in range(3):
        loss, _ = grpo_loss(diff, batch, BS, MASK, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        lp = token_logprobs(policy_logits(diff, batch, BS, MASK), batch.input_ids[:, batch.prompt_len :])
    delta = ((lp - batch.old_logprobs) * batch.scored).sum(-1)
    assert delta[0] > 0 > delta[1]


def test_rollout_batch_keeps_selected_rows_and_crops():
    ar = peaky_model(3.0)
    ro = sample_ar(ar, prompts(4), 14, EOS, temperature=1.0, generator=torch.Generator().manual_seed(0))
    b = rollout_batch(ro, EOS, torch.tensor([0.5, -0.5]), torch.tensor([1, 3]))
    assert b.input_ids.shape[0] == 2 and torch.equal(b.input_ids[:, : b.prompt_len], ro.prompt_ids[[1, 3]])
    assert b.advantages.tolist() == [0.5, -0.5]
    assert bool(b.scored[:, -1].any())  # cropped right after the last scored column


def test_prompts_for_step_epochs():
    seen = [i for s in range(5) for i in prompts_for_step(20, 4, s, seed=0)]
    assert sorted(seen) == list(range(20))  # one epoch = every prompt once
    assert prompts_for_step(20, 4, 7, 0) == prompts_for_step(20, 4, 7, 0)  # pure function of (seed, step)


def test_the_input_bundles_decoder_picks_the_rl_config():
    prof = load_profile("quick")
    assert prof.rl != prof.ar_rl  # quick.yaml gives the two runs different learning rates
    assert rl_config(prof, 0) is prof.ar_rl  # the AR teacher: GR2 stage 3
    assert rl_config(prof, 8) is prof.rl  # the block-diffusion student after OPD


def test_all_groups_dropped_gives_zero_gradient():
    diff = convert_to_diffusion(peaky_model(3.0), BS, MASK)
    ro = sample_diffusion(
        diff, prompts(2), 16, BS, 0.5, MASK, EOS, generator=torch.Generator().manual_seed(0)
    )
    loss, _ = grpo_loss(diff, rollout_batch(ro, EOS), BS, MASK, 1.0)  # advantages default to zero
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in diff.parameters())


def test_certainty_forcing_through_rl():
    """grpo_loss + certainty_weight * rollout_certainty (seeded by the step: the same noise twice), which has a
    gradient even when every group was dropped, and whose descent sharpens the student on its own rollouts."""
    diff = convert_to_diffusion(peaky_model(3.0), BS, MASK)
    ro = sample_diffusion(
        diff, prompts(4), 15, BS, 0.5, MASK, EOS, generator=torch.Generator().manual_seed(0)
    )
    batch = rollout_batch(ro, EOS)  # advantages zero: the surrogate contributes nothing
    batch.step = 3

    def term():
        return rollout_certainty(diff, batch, BS, MASK, EOS, torch.Generator().manual_seed(3))

    loss, stats = grpo_loss(diff, batch, BS, MASK, 1.0, certainty_weight=0.5, eos_id=EOS)
    before = term()
    assert before.item() > 0 and loss.item() == pytest.approx(0.5 * before.item(), rel=1e-5)
    assert stats["certainty_entropy"] == pytest.approx(before.item(), rel=1e-5)
    opt = torch.optim.SGD(diff.parameters(), lr=0.5)
    for _ in range(3):
        loss, _ = grpo_loss(diff, batch, BS, MASK, 1.0, certainty_weight=1.0, eos_id=EOS)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert term().item() < before.item()
    with pytest.raises(ValueError, match="certainty forcing needs"):
        grpo_loss(diff, batch, 0, None, 1.0, certainty_weight=0.5, eos_id=EOS)


def test_replay_with_unique_tokens_matches_the_constrained_sampler():
    """Rollouts sampled with `unique` (each content token at most once) replay to the sampler's log-probs only
    when the replay bans what was committed before each token; without the ban they do not."""
    unique = torch.arange(5, 24)
    g = torch.Generator().manual_seed(0)
    diff = convert_to_diffusion(peaky_model(3.0), BS, MASK)
    ar = peaky_model(3.0)
    for model, bs in ((diff, BS), (ar, 0)):
        if bs:
            ro = sample_diffusion(
                model, prompts(), 16, bs, 0.1, MASK, EOS, generator=g, rules=DecodeRules(unique)
            )
        else:
            ro = sample_ar(model, prompts(), 16, EOS, generator=g, rules=DecodeRules(unique))
        batch = rollout_batch(ro, EOS)
        resp = batch.input_ids[:, batch.prompt_len :]
        for row, ok in zip(resp.tolist(), batch.scored.tolist(), strict=True):
            body = [t for t, s in zip(row, ok, strict=True) if s and 5 <= t < 24]
            assert len(body) == len(set(body))
        lp = token_logprobs(policy_logits(model, batch, bs, MASK, DecodeRules(unique)), resp)
        assert (lp - batch.old_logprobs)[batch.scored].abs().max() < 1e-4
        free = token_logprobs(policy_logits(model, batch, bs, MASK), resp)
        assert (free - batch.old_logprobs)[batch.scored].abs().max() > 1e-3


def test_replay_with_the_trace_rule_matches_the_constrained_sampler(trace_models):
    """Rollouts sampled with `follow` (the answer follows the trace) replay to the sampler's log-probs only when
    the replay applies the trace's bans to the tokens committed after the trace; without them they do not."""
    ar, diff = trace_models
    g = torch.Generator().manual_seed(0)
    ps = [p for p, _, _ in trace_items(16, 5)]
    for model, bs in ((diff, BS), (ar, 0)):
        how = Sampling(24, bs, EOS, MASK, tau=0.5, temperature=1.0, rules=DecodeRules(ANSWER_IDS, FOLLOW))
        ro = sample(model, ps, how, g)
        batch = rollout_batch(ro, EOS)
        resp = batch.input_ids[:, batch.prompt_len :]
        assert [follows(p, r) for p, r in zip(ps, ro.tokens.tolist(), strict=True)].count(True) >= 4
        lp = token_logprobs(policy_logits(model, batch, bs, MASK, DecodeRules(ANSWER_IDS, FOLLOW)), resp)
        assert (lp - batch.old_logprobs)[batch.scored].abs().max() < 1e-4
        free = token_logprobs(policy_logits(model, batch, bs, MASK, DecodeRules(ANSWER_IDS)), resp)
        assert (free - batch.old_logprobs)[batch.scored].abs().max() > 1e-3


def test_replay_with_the_layout_matches_the_constrained_sampler(trace_models):
    """Rollouts sampled under the layout (gr2/rules.py `Layout`) replay to the sampler's log-probs only when the
    replay applies it too. Block diffusion commits the layout's fixed tokens before a block's first round (GIVEN):
    the replay shows them in every canvas of their block and scores none of them."""
    ar, diff = trace_models
    g = torch.Generator().manual_seed(1)
    ps = [p for p, _, _ in trace_items(16, 6)]
    ruled = DecodeRules(ANSWER_IDS, FOLLOW, SHAPE)
    for model, bs in ((diff, BS), (ar, 0)):
        ro = sample(model, ps, Sampling(24, bs, EOS, MASK, tau=0.5, temperature=1.0, rules=ruled), g)
        batch = rollout_batch(ro, EOS)
        resp = batch.input_ids[:, batch.prompt_len :]
        assert all(follows(p, r) is not None for p, r in zip(ps, ro.tokens.tolist(), strict=True))
        if bs:  # (the trace labels, the answer's head, its separators and tail)
            assert bool((ro.traj == GIVEN).any()) and not bool(batch.scored[batch.traj == GIVEN].any())
        lp = token_logprobs(policy_logits(model, batch, bs, MASK, ruled), resp)
        assert (lp - batch.old_logprobs)[batch.scored].abs().max() < 1e-4
        free = token_logprobs(policy_logits(model, batch, bs, MASK, DecodeRules(ANSWER_IDS, FOLLOW)), resp)
        # Without the layout the replay spreads mass over tokens the sampler banned: never a higher log-prob, and
        # somewhere off by more than the tolerance that "matches" uses above (how far depends on how much mass the
        # small model leaves on banned tokens, which varies with the CPU's arithmetic: 0.0009 on a Xeon).
        gap = (batch.old_logprobs - free)[batch.scored]
        assert gap.min() > -1e-4 and gap.max() > 1e-4
