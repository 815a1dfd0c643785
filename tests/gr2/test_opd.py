"""OPD: KL directions, zero KL when student and teacher agree, that the loss pulls the student to the teacher, and
the rules OPD samples under."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import gr2.opd
from gr2.config import OPDConfig
from gr2.model import convert_to_diffusion
from gr2.opd import OPD_RULES, kl_per_token, make_opd_batch, opd_loss, sequence_mean, teacher_logprobs
from gr2.rl import Sampling, sample
from gr2.rules import DecodeRules
from gr2.stages.opd_rl import OPDBatches
from tests.gr2.test_rl import peaky_model, prompts
from tests.gr2.toys import EOS, MASK

BS = 4


def how(max_new_tokens: int, block_size: int, tau: float) -> Sampling:
    """OPD's sampling of the toy student: temperature 1, under OPD's rules."""
    return Sampling(max_new_tokens, block_size, EOS, MASK, tau=tau, temperature=1.0, rules=OPD_RULES)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_kl_directions_match_torch():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 11, generator=g).log_softmax(-1)
    t = torch.randn(3, 5, 11, generator=g).log_softmax(-1)
    fwd = torch.nn.functional.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # KL(t || s)
    rev = torch.nn.functional.kl_div(t, s, log_target=True, reduction="none").sum(-1)  # KL(s || t)
    assert torch.allclose(kl_per_token(s, t, "forward"), fwd, atol=1e-6)
    assert torch.allclose(kl_per_token(s, t, "reverse"), rev, atol=1e-6)
    assert not torch.allclose(fwd, rev)
    with pytest.raises(ValueError):
        kl_per_token(s, t, "sideways")


def test_sequence_mean_is_per_sequence_then_batch():
    x = torch.tensor([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert sequence_mean(x, m).item() == pytest.approx((2.0 + 4.0) / 2)  # the empty row does not count


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_kl_zero_when_student_and_teacher_agree(direction):
    teacher = peaky_model(3.0)
    # The naive conversion at block_size 1 is the AR model exactly: the replayed student equals the teacher.
    student = convert_to_diffusion(teacher, 1, MASK)
    g = torch.Generator().manual_seed(0)
    batch = make_opd_batch(student, teacher, prompts(4), 2, how(14, 1, 0.9), g)
    assert batch.scored.sum() > 20
    loss, stats = opd_loss(student, batch, 1, MASK, direction)
    assert abs(loss.item()) < 1e-5 and abs(stats["kl_forward"]) < 1e-5 and abs(stats["kl_reverse"]) < 1e-5
    # Same weights at block_size 4: the student now reads masked canvases, so it disagrees with the teacher.
    student4 = convert_to_diffusion(teacher, BS, MASK)
    batch4 = make_opd_batch(student4, teacher, prompts(4), 2, how(16, BS, 0.5), g)
    loss4, _ = opd_loss(student4, batch4, BS, MASK, direction)
    assert loss4.item() > 1e-3


def test_teacher_logprobs_are_cached_on_the_committed_tokens():
    teacher = peaky_model(3.0)
    student = convert_to_diffusion(peaky_model(3.0, seed=1), BS, MASK)
    batch = make_opd_batch(student, teacher, prompts(3), 2, how(16, BS, 0.5), None)
    assert batch.teacher_logprobs.shape == (*batch.traj.shape, teacher.config.vocab_size)
    assert torch.allclose(batch.teacher_logprobs, teacher_logprobs(teacher, batch))
    assert not batch.teacher_logprobs.requires_grad


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_opd_steps_reduce_kl(direction):
    teacher = peaky_model(3.0)
    student = convert_to_diffusion(peaky_model(3.0, seed=1), BS, MASK)
    batch = make_opd_batch(student, teacher, prompts(4), 2, how(16, BS, 0.5), None)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        loss, _ = opd_loss(student, batch, BS, MASK, direction)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opd_loss(student, batch, BS, MASK, direction)[0].item() < 0.8 * first


def test_opd_samples_its_student_without_the_serving_rules(monkeypatch):
    """OPD's stage samples its student under OPD_RULES, which are none: not `unique` and `follow`, which RL and
    the served decoders apply (gr2/opd.py says why). On the toy model the rules change the rollouts: OPD's repeat
    tokens that `unique` would ban, and they are exactly the unruled sampler's."""
    assert OPD_RULES.unique is None and OPD_RULES.follow is None
    teacher = peaky_model(3.0)
    student = convert_to_diffusion(peaky_model(3.0, seed=1), BS, MASK)
    seen = []

    def spy(model, rep, how, generator):
        seen.append((rep, how, generator.initial_seed()))
        return sample(model, rep, how, generator)

    monkeypatch.setattr(gr2.opd, "sample", spy)
    oc = OPDConfig(rollouts_per_prompt=2, prompts_per_step=4, tau=0.5)
    tok = SimpleNamespace(eos_token_id=EOS, mask_token_id=MASK)
    batches = OPDBatches(
        student=student,
        teacher=teacher,
        prompts=prompts(4),
        tokenizer=tok,
        oc=oc,
        block_size=BS,
        max_new_tokens=16,
        seed=0,
    )
    batch = batches(0)
    [(rep, used, seed)] = seen
    assert used.rules is OPD_RULES and used.tau == oc.tau and used.temperature == oc.temperature
    resp = batch.input_ids[:, batch.prompt_len :]
    again = sample(student, rep, replace(used, rules=DecodeRules()), torch.Generator().manual_seed(seed))
    assert torch.equal(resp, again.tokens[:, : resp.shape[1]])
    unique = torch.arange(5, 24)  # the toy's content tokens
    repeats = sum(
        len(body) - len(set(body))
        for row, ok in zip(resp.tolist(), batch.scored.tolist(), strict=True)
        for body in [[t for t, s in zip(row, ok, strict=True) if s and 5 <= t < 24]]
    )
    assert repeats > 0  # what `unique` forbids
    ruled = sample(
        student, rep, replace(used, rules=DecodeRules(unique)), torch.Generator().manual_seed(seed)
    )
    assert not torch.equal(again.tokens, ruled.tokens)
