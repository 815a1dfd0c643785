"""The GPU path (skipped without CUDA; run on a GPU machine with `pytest tests/gpu`).

Training runs through accelerate, which places the model on the GPU; decoding builds its masks, positions and
KV cache on the model's device. Checked here on CUDA: the training loop learns and resumes from a checkpoint,
the decoders' exactness properties hold (KV cache == recompute, block_size 1 diffusion == AR), and CUDA
decodes the same tokens as the CPU.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from gr2.config import TrainConfig
from gr2.decode import ar_generate, diffusion_generate
from gr2.decode_reference import ar_generate_nocache, diffusion_generate_nocache
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import convert_to_diffusion
from gr2.train import BucketedBatches, train
from tests.gr2.toys import EOS, MASK, PAD, toy_items, toy_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BS = 4
CFG = TrainConfig(lr=1e-2, batch_size=16, max_steps=120, epochs=0, warmup=5, checkpoint_every=60, log_every=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    items = toy_items(512, 10)
    ar = toy_model()
    res = train(
        ar,
        BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD)),
        ar_batch_loss,
        CFG,
        tmp_path_factory.mktemp("sft"),
    )
    assert next(ar.parameters()).device.type == "cuda"  # accelerate put it on the GPU
    assert res.losses[-1] < 0.5 * res.losses[0]
    diff = convert_to_diffusion(ar, BS, MASK)
    cft = BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD, block_size=BS, resp_pad_id=EOS))
    train(
        diff, cft, lambda m, b, g: masked_diffusion_loss(m, b, BS, MASK, g), CFG, tmp_path_factory.mktemp("c")
    )
    return ar, diff


def _prompts(n=16):
    return [p for p, _, _ in toy_items(n, 99)]


def test_training_resumes_on_cuda(tmp_path):
    items = toy_items(128, 3)
    batches = BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD))
    short = TrainConfig(
        lr=1e-2, batch_size=16, max_steps=6, epochs=0, warmup=1, checkpoint_every=3, log_every=0
    )
    train(toy_model(), batches, ar_batch_loss, short, tmp_path)
    longer = TrainConfig(**{**short.__dict__, "max_steps": 10})
    res = train(toy_model(), batches, ar_batch_loss, longer, tmp_path)
    assert res.start_step == 6 and res.step == 10


def test_decoders_exact_on_cuda(models):
    ar, diff = models
    p = _prompts()
    cached, n1 = ar_generate(ar, p, 16, EOS)
    plain, _ = ar_generate_nocache(ar, p, 16, EOS)
    assert cached.is_cuda and torch.equal(cached, plain)
    for tau in (1.0, 0.9, 0.5):
        a, na, ta = diffusion_generate(diff, p, 16, BS, tau, MASK, EOS)
        b, nb, tb = diffusion_generate_nocache(diff, p, 16, BS, tau, MASK, EOS)
        assert torch.equal(a, b) and torch.equal(ta, tb)
    one = convert_to_diffusion(ar, 1, MASK)
    d1, nd, _ = diffusion_generate(one, p, 16, 1, 0.9, MASK, EOS)
    assert torch.equal(d1, cached) and nd == n1  # block_size 1 is AR, nfe included


def test_cuda_decodes_what_the_cpu_decodes(models):
    ar, diff = models
    p = _prompts()
    gpu_ar, _ = ar_generate(ar, p, 16, EOS)
    gpu_d, _, _ = diffusion_generate(diff, p, 16, BS, 0.9, MASK, EOS)
    cpu_ar, _ = ar_generate(copy.deepcopy(ar).cpu(), p, 16, EOS)
    cpu_d, _, _ = diffusion_generate(copy.deepcopy(diff).cpu(), p, 16, BS, 0.9, MASK, EOS)
    # fp32 on both; kernels differ, so allow a near-tie to flip a token, not more.
    assert (gpu_ar.cpu() == cpu_ar).float().mean() >= 0.99
    assert (gpu_d.cpu() == cpu_d).float().mean() >= 0.99
