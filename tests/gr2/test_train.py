"""Losses (AR, vectorised block masked diffusion) and the shared training loop (resume, logs, checkpoints), on
the toy task of tests/gr2/toys.py."""

import functools
import json

import pytest
import torch

from gr2.config import TrainConfig
from gr2.losses import (
    _masked_ce,
    ar_batch_loss,
    ar_loss,
    collate,
    diffusion_loss_from_masks,
    diffusion_loss_loop,
    masked_diffusion_loss,
    sample_masks,
)
from gr2.model import convert_to_diffusion
from gr2.train import BucketedBatches, latest_checkpoint, lr_at, train
from tests.gr2.toys import EOS, MASK, PAD, toy_items, toy_model


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_collate_layout():
    items = [([1, 5, 6], [7, 8, 2], [0.5, 1.0, 1.0]), ([1], [9, 2], [1.0, 1.0])]
    b = collate(items, PAD, block_size=4, resp_pad_id=EOS)
    assert b.prompt_len == 3 and b.resp_len == 4 and b.n_tokens == 3 + 3 + 1 + 2
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 8, 2, 2], [0, 0, 1, 9, 2, 2, 2]]
    assert b.pad_lens.tolist() == [0, 2]
    assert b.weights.tolist() == [[0, 0, 0, 0.5, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0]]


def test_ar_loss_matches_manual():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    w = torch.tensor([[0, 0, 0.5, 1, 0], [0, 1, 1, 1, 1.0]])
    lp = logits.log_softmax(-1)
    total, count = 0.0, 0
    for b in range(2):
        for i in range(1, 5):
            if w[b, i] > 0:
                total += -w[b, i] * lp[b, i - 1, labels[b, i]]
                count += 1
    assert torch.allclose(ar_loss(logits, labels, w), total / count)


def test_sample_masks_complementary_and_per_block_t():
    b = collate(toy_items(8, 0), PAD, block_size=4, resp_pad_id=EOS)
    masks, p = sample_masks(b, 4, torch.Generator().manual_seed(0), noise_eps=0.05)
    assert masks.shape == (2, 8, b.resp_len)
    assert torch.equal(masks[1], ~masks[0])
    assert torch.allclose(p[0] + p[1], torch.ones_like(p[0]))
    blocks = p[0].reshape(8, -1, 4)
    assert torch.equal(blocks, blocks[..., :1].expand_as(blocks))  # one t per block
    assert p.min() >= 0.05 and p.max() <= 0.95


def test_vectorised_diffusion_loss_equals_block_loop():
    """x_t (+) x_0 with the 3-part mask == one forward per block under block_causal_mask (the decoder's view)."""
    model = toy_model()
    for bs in (1, 3, 4):
        b = collate(toy_items(5, 1), PAD, block_size=bs, resp_pad_id=EOS, pad_weight=0.0)
        masks, p = sample_masks(b, bs, torch.Generator().manual_seed(bs))
        fast = diffusion_loss_from_masks(model, b, masks, p, bs, MASK)
        slow = diffusion_loss_loop(model, b, masks, p, bs, MASK)
        assert torch.allclose(fast, slow, atol=1e-5), (bs, fast, slow)
        sharp = diffusion_loss_from_masks(model, b, masks, p, bs, MASK, certainty_weight=0.5)
        sharp_slow = diffusion_loss_loop(model, b, masks, p, bs, MASK, certainty_weight=0.5)
        assert torch.allclose(sharp, sharp_slow, atol=1e-5) and sharp > fast + 1e-3, (bs, sharp, fast)


def _certainty_case():
    """One row, 4 positions, vocab 3: position 0 masked and right, 1 masked and wrong, 2 masked and right with
    weight 0 (padding), 3 not masked."""
    logits = torch.tensor([[[2.0, 0.5, 0.1], [0.3, 1.5, 0.2], [0.1, 0.2, 3.0], [1.0, 1.0, 1.0]]])
    x0 = torch.tensor([[0, 2, 2, 1]])
    w = torch.tensor([[1.0, 0.5, 0.0, 1.0]])
    masks = torch.tensor([[[True, True, True, False]]])
    return logits, x0, w, masks, torch.full((1, 1, 4), 0.5)


def test_certainty_forcing_adds_mean_entropy_of_right_predictions_only():
    logits, x0, w, masks, p = _certainty_case()
    base = _masked_ce(logits, x0, w, masks, p, "inv_t")
    lp = logits[0].log_softmax(-1)
    manual_ce = (-lp[0, 0] * 1.0 / 0.5 - lp[1, 2] * 0.5 / 0.5) / 3  # 3 response tokens with weight > 0
    assert torch.allclose(base, manual_ce)
    entropy0 = -(lp[0].exp() * lp[0]).sum()  # only position 0 is masked, weighted and right
    sharp = _masked_ce(logits, x0, w, masks, p, "inv_t", certainty_weight=2.0)
    assert torch.allclose(sharp, base + 2.0 * entropy0)


def test_certainty_forcing_leaves_wrong_predictions_to_the_ce():
    """The extra gradient is zero at the wrong position and raises the top-1 probability at the right one."""
    logits, x0, w, masks, p = _certainty_case()
    grads = []
    for beta in (0.0, 1.0):
        lg = logits.clone().requires_grad_(True)
        _masked_ce(lg, x0, w, masks, p, "inv_t", certainty_weight=beta).backward()
        grads.append(lg.grad[0])
    extra = grads[1] - grads[0]
    assert torch.allclose(extra[1:], torch.zeros_like(extra[1:]))
    stepped = logits[0, 0] - 0.1 * extra[0]
    assert stepped.softmax(-1)[0] > logits[0, 0].softmax(-1)[0]


def test_diffusion_loss_all_masked_block1_is_ar_loss():
    """block_size 1 with every position masked and no 1/t weight reduces to the AR loss (token shift)."""
    model = toy_model()
    b = collate(toy_items(6, 2), PAD, block_size=1)
    masks = torch.ones(1, 6, b.resp_len, dtype=torch.bool)
    d = diffusion_loss_from_masks(model, b, masks, torch.ones_like(masks, dtype=torch.float), 1, MASK, "none")
    assert torch.allclose(d, ar_batch_loss(model, b), atol=1e-5)


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(50, TrainConfig(lr=0.5, warmup=0, schedule="constant"), 100) == 0.5


def _cft_setup(bs: int = 4):
    items = toy_items(96, 3)
    batches = BucketedBatches(
        items, 16, functools.partial(collate, pad_id=PAD, block_size=bs, resp_pad_id=EOS)
    )

    def loss_fn(model, batch, rng):
        return masked_diffusion_loss(model, batch, bs, MASK, rng)

    return convert_to_diffusion(toy_model(), bs, MASK), batches, loss_fn


class Killed(RuntimeError):
    pass


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    cfg = TrainConfig(
        lr=3e-3, batch_size=16, max_steps=8, epochs=0, warmup=2, checkpoint_every=3, log_every=4
    )
    m_ref, batches, loss_fn = _cft_setup()
    ref = train(m_ref, batches, loss_fn, cfg, tmp_path / "ref")
    assert ref.step == 8 and ref.start_step == 0 and len(ref.losses) == 8

    m, batches, loss_fn = _cft_setup()

    def dying(step):  # the process is killed while fetching the batch of step 7
        if step == 7:
            raise Killed
        return batches(step)

    dying.steps_per_epoch = batches.steps_per_epoch
    with pytest.raises(Killed):
        train(m, dying, loss_fn, cfg, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step_0000006"

    m2, batches, loss_fn = _cft_setup()  # a fresh process: fresh weights, resumes from disk
    res = train(m2, batches, loss_fn, cfg, tmp_path / "run")
    assert res.start_step == 6 and res.step == 8 and len(res.losses) == 2
    for (n, p), (_, q) in zip(m_ref.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), n
    assert res.losses == pytest.approx(ref.losses[6:], abs=1e-5)
    rows = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))  # no duplicate steps from the killed run
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, abs=1e-5)
    assert {"loss", "lr", "tokens_per_s"} <= set(rows[0])
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 0
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) == cfg.keep_checkpoints

    again = train(m2, batches, loss_fn, cfg, tmp_path / "run")  # finished run: nothing left to do
    assert again.start_step == 8 and again.losses == []


@pytest.mark.parametrize("kind", ["ar", "cft"])
def test_losses_decrease_on_toy_task(tmp_path, kind):
    cfg = TrainConfig(
        lr=1e-2, batch_size=16, max_steps=80, epochs=0, warmup=5, checkpoint_every=0, log_every=0
    )
    if kind == "ar":
        model = toy_model()
        batches = BucketedBatches(toy_items(256, 4), 16, functools.partial(collate, pad_id=PAD))
        res = train(model, batches, ar_batch_loss, cfg, tmp_path)
    else:
        model, batches, loss_fn = _cft_setup()
        res = train(model, batches, loss_fn, cfg, tmp_path)
    first, last = sum(res.losses[:10]) / 10, sum(res.losses[-10:]) / 10
    assert last < 0.75 * first, (first, last)
    assert res.tokens_per_s > 0


def test_bucketed_batches_deterministic_and_cover_epoch():
    items = toy_items(50, 5)
    src = BucketedBatches(items, 8, lambda xs: xs, seed=1, bucket_factor=2)
    assert src.steps_per_epoch == 7
    epoch0 = [src(s) for s in range(7)]
    assert sorted(id(x) for b in epoch0 for x in b) == sorted(id(x) for x in items)
    assert src(3) == epoch0[3] and src(9) == BucketedBatches(
        items, 8, lambda xs: xs, seed=1, bucket_factor=2
    )(9)
    spread = [max(len(x[1]) for x in b) - min(len(x[1]) for x in b) for b in epoch0]
    assert sum(spread) < 7 * 10  # batches are length-bucketed (lengths 6..14 overall)
