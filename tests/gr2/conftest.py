"""Fixtures shared by the tests of gr2/."""

from __future__ import annotations

import functools

import pytest
import torch

from gr2.config import TrainConfig
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import convert_to_diffusion
from gr2.train import BucketedBatches, train
from tests.gr2.test_train import EOS, MASK, PAD, toy_model
from tests.gr2.trace_toy import BS, trace_items


@pytest.fixture(scope="session")
def trace_models(tmp_path_factory):
    """AR and block-diffusion models trained on `trace_items`: they copy the trace, then answer at random."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = TrainConfig(
        lr=1e-2, batch_size=16, max_steps=200, epochs=0, warmup=5, checkpoint_every=0, log_every=0
    )
    items = trace_items(512, 10)
    ar = toy_model()
    train(
        ar,
        BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD)),
        ar_batch_loss,
        cfg,
        tmp_path_factory.mktemp("sft"),
    )
    diff = convert_to_diffusion(ar, BS, MASK)
    cft = BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD, block_size=BS, resp_pad_id=EOS))
    train(
        diff,
        cft,
        lambda m, b, g: masked_diffusion_loss(m, b, BS, MASK, g),
        cfg,
        tmp_path_factory.mktemp("cft"),
    )
    yield ar.cpu(), diff.cpu()
    torch.set_num_threads(n)
