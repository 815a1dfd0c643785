"""The gpu profile's path on CUDA (skipped without CUDA; `pytest tests/gpu` on a GPU machine).

A pretrained backbone (the tiny Llama / Qwen2 stand-ins of tests/gr2/test_backbone.py, no download) trains in
bf16 with gradient accumulation on the GPU, resumes from its checkpoint, and its block-diffusion conversion
decodes exactly with the KV cache; with the gpu profile's own backbone when the local hub cache holds it.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gr2.config import ModelConfig, load_profile
from gr2.decode import diffusion_generate
from gr2.decode_reference import diffusion_generate_nocache
from gr2.losses import ar_batch_loss, collate
from gr2.model import build_backbone, convert_to_diffusion
from gr2.tokenizer import build_tokenizer
from gr2.train import BucketedBatches, train
from tests.gr2.test_backbone import pretrained  # noqa: F401 (the fixture)
from tests.gr2.toys import EOS, MASK, PAD, toy_items

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = load_profile("gpu")


def test_bf16_accumulated_training_and_resume_on_cuda(pretrained, tmp_path):  # noqa: F811
    _, path = pretrained
    tok = build_tokenizer([4, 4, 4, 2], None, n_features=2)
    cfg = dataclasses.replace(
        GPU.sft, lr=1e-3, batch_size=16, max_steps=40, epochs=0, warmup=2, checkpoint_every=20
    )
    assert cfg.bf16 and cfg.grad_accum > 1
    batches = BucketedBatches(toy_items(256, 4), 16, functools.partial(collate, pad_id=PAD))
    model = build_backbone(ModelConfig(pretrained=str(path)), tok, seed=0)
    res = train(model, batches, ar_batch_loss, dataclasses.replace(cfg, max_steps=20), tmp_path)
    assert next(model.parameters()).device.type == "cuda" and next(model.parameters()).dtype == torch.float32
    res = train(
        build_backbone(ModelConfig(pretrained=str(path)), tok, seed=0), batches, ar_batch_loss, cfg, tmp_path
    )
    assert res.start_step == 20 and res.step == 40
    first = sum(res.losses[:5])
    assert all(torch.isfinite(torch.tensor(res.losses))) and sum(res.losses[-5:]) < first
    diff = convert_to_diffusion(model, 4, MASK)
    p = [x for x, _, _ in toy_items(8, 9)]
    a = diffusion_generate(diff, p, 16, 4, 0.9, MASK, EOS)
    b = diffusion_generate_nocache(diff, p, 16, 4, 0.9, MASK, EOS)
    assert torch.equal(a[0], b[0])


def test_gpu_profile_backbone_loads_on_cuda():
    tok = build_tokenizer([256, 256, 256, 16], None, n_features=8)
    try:
        model = build_backbone(GPU.model, tok).cuda()
    except OSError:
        pytest.skip(f"{GPU.model.pretrained} is not in the local hub cache")
    assert model.config.vocab_size == len(tok) and 100e6 < sum(p.numel() for p in model.parameters()) < 2e9
    ids = torch.tensor([[tok.bos_token_id, 10, 11, 12]], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, len(tok)) and torch.isfinite(logits).all()
