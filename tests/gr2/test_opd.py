"""OPD: KL directions, zero KL when student and teacher agree, and that the loss pulls the student to the teacher."""

import pytest
import torch

from gr2.model import convert_to_diffusion
from gr2.opd import kl_per_token, make_opd_batch, opd_loss, sequence_mean, teacher_logprobs
from tests.gr2.test_rl import peaky_model, prompts
from tests.gr2.toys import EOS, MASK

BS = 4


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
    batch = make_opd_batch(student, teacher, prompts(4), 2, 14, 1, MASK, EOS, 0.9, 1.0, g)
    assert batch.scored.sum() > 20
    loss, stats = opd_loss(student, batch, 1, MASK, direction)
    assert abs(loss.item()) < 1e-5 and abs(stats["kl_forward"]) < 1e-5 and abs(stats["kl_reverse"]) < 1e-5
    # Same weights at block_size 4: the student now reads masked canvases, so it disagrees with the teacher.
    student4 = convert_to_diffusion(teacher, BS, MASK)
    batch4 = make_opd_batch(student4, teacher, prompts(4), 2, 16, BS, MASK, EOS, 0.5, 1.0, g)
    loss4, _ = opd_loss(student4, batch4, BS, MASK, direction)
    assert loss4.item() > 1e-3


def test_teacher_logprobs_are_cached_on_the_committed_tokens():
    teacher = peaky_model(3.0)
    student = convert_to_diffusion(peaky_model(3.0, seed=1), BS, MASK)
    batch = make_opd_batch(student, teacher, prompts(3), 2, 16, BS, MASK, EOS, 0.5, 1.0, None)
    assert batch.teacher_logprobs.shape == (*batch.traj.shape, teacher.config.vocab_size)
    assert torch.allclose(batch.teacher_logprobs, teacher_logprobs(teacher, batch))
    assert not batch.teacher_logprobs.requires_grad


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_opd_steps_reduce_kl(direction):
    teacher = peaky_model(3.0)
    student = convert_to_diffusion(peaky_model(3.0, seed=1), BS, MASK)
    batch = make_opd_batch(student, teacher, prompts(4), 2, 16, BS, MASK, EOS, 0.5, 1.0, None)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        loss, _ = opd_loss(student, batch, BS, MASK, direction)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opd_loss(student, batch, BS, MASK, direction)[0].item() < 0.8 * first
