"""One rank of the distributed training test (tests/gr2/test_distributed.py), started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.gr2.ddp_worker OUT

Trains the toy tasks of test_train.py at world size 2, grad_accum 1:
- OUT/sft: AR SFT for SFT_STEPS steps;
- OUT/cft: CFT (diffusion noise from the per-micro-batch generator) killed while fetching the batches of step
  KILL_STEP, after its checkpoint at step KILL_STEP (the test resumes it at world size 1).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from gr2.config import TrainConfig
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import convert_to_diffusion
from gr2.train import BucketedBatches, train
from tests.gr2.toys import EOS, MASK, PAD, toy_items, toy_model

SFT_STEPS, CFT_STEPS, KILL_STEP = 6, 6, 3
SFT_CFG = TrainConfig(
    lr=1e-2, batch_size=8, max_steps=SFT_STEPS, epochs=0, warmup=2, checkpoint_every=0, log_every=0
)
CFT_CFG = TrainConfig(
    lr=3e-3, batch_size=8, max_steps=CFT_STEPS, epochs=0, warmup=1, checkpoint_every=KILL_STEP
)


def sft_batches():
    return BucketedBatches(toy_items(128, 4), 8, functools.partial(collate, pad_id=PAD))


def cft_setup(block: int = 4):
    batches = BucketedBatches(
        toy_items(96, 3), 8, functools.partial(collate, pad_id=PAD, block_size=block, resp_pad_id=EOS)
    )

    def loss_fn(model, batch, rng):
        return masked_diffusion_loss(model, batch, block, MASK, rng)

    return convert_to_diffusion(toy_model(), block, MASK), batches, loss_fn


class Killed(RuntimeError):
    pass


def main(out: Path, world: int) -> None:
    torch.set_num_threads(1)
    train(toy_model(), sft_batches(), ar_batch_loss, SFT_CFG, out / "sft")
    model, batches, loss_fn = cft_setup()

    def dying(i):  # every rank dies fetching its first batch of step KILL_STEP, before any collective
        if i >= KILL_STEP * world:
            raise Killed
        return batches(i)

    dying.steps_per_epoch = batches.steps_per_epoch
    try:
        train(model, dying, loss_fn, CFT_CFG, out / "cft")
    except Killed:
        print("killed as planned", flush=True)


if __name__ == "__main__":
    import os

    main(Path(sys.argv[1]), int(os.environ["WORLD_SIZE"]))
