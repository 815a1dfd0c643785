"""The toy task the decoder, training and RL tests train on: the response is a copy of the prompt's tokens (the
"trace", weight 0.5) then their reverse (the "answer", weight 1.0) then eos; and a real slice of MovieLens for the
retrieval and evidence tests. One module for the test toys, imported by every test that needs one."""

import functools
import random

import torch

from gr2.config import ModelConfig, TrainConfig
from gr2.data import Dataset, data_root, load_dataset
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import build_model, convert_to_diffusion
from gr2.train import BucketedBatches, train

PAD, BOS, EOS, MASK, SEP, V = 0, 1, 2, 3, 4, 24
TINY = ModelConfig(d_model=32, n_layer=2, n_head=4, d_ff=64, max_len=128)


def toy_items(n: int, seed: int, kmin: int = 2, kmax: int = 6) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(kmin, kmax)
        toks = [rng.randrange(5, V) for _ in range(k)]
        resp = toks + [SEP] + toks[::-1] + [EOS]
        out.append(([BOS] + toks + [SEP], resp, [0.5] * (k + 1) + [1.0] * (k + 1)))
    return out


def toy_model(seed: int = 0):
    return build_model(TINY, V, PAD, EOS, BOS, MASK, seed=seed)


def toy_sft_and_cft(items: list, block_size: int, max_steps: int, tmp_path_factory) -> tuple:
    """A toy AR model trained on `items` (SFT), and its block-diffusion conversion trained on them too (CFT), on
    one thread; returned on the CPU (the suite's device even where accelerate trained on a GPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = TrainConfig(
        lr=1e-2, batch_size=16, max_steps=max_steps, epochs=0, warmup=5, checkpoint_every=0, log_every=0
    )
    ar = toy_model()
    train(
        ar,
        BucketedBatches(items, 16, functools.partial(collate, pad_id=PAD)),
        ar_batch_loss,
        cfg,
        tmp_path_factory.mktemp("sft"),
    )
    diff = convert_to_diffusion(ar, block_size, MASK)
    cft = BucketedBatches(
        items, 16, functools.partial(collate, pad_id=PAD, block_size=block_size, resp_pad_id=EOS)
    )
    train(
        diff,
        cft,
        lambda m, b, g: masked_diffusion_loss(m, b, block_size, MASK, g),
        cfg,
        tmp_path_factory.mktemp("cft"),
    )
    torch.set_num_threads(n)
    return ar.cpu(), diff.cpu()


def real_slice(n_users: int) -> Dataset:
    """ml-latest-small cut to its first `n_users` users (in id order)."""
    ds = load_dataset(data_root() / "ml-latest-small")
    users = sorted(ds.interactions["user_id"].unique())[:n_users]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    return ds
