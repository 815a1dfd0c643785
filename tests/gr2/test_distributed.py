"""Data-parallel training in 2 CPU processes (torchrun, gloo) against 1 process at the same global batch.

gr2/train.py splits each optimizer step into world_size * grad_accum micro-batches by a global index, so 2
processes x grad_accum 1 and 1 process x grad_accum 2 see the same batches and average the same gradients:
the weights must agree to float32 rounding (1e-5), and a checkpoint written by 2 processes must resume in 1.
The 2-process side runs in tests/gr2/ddp_worker.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gr2.losses import ar_batch_loss
from gr2.train import latest_checkpoint, train
from tests.gr2.ddp_worker import CFT_CFG, KILL_STEP, SFT_CFG, cft_setup, sft_batches
from tests.gr2.toys import toy_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, "-m", "tests.gr2.ddp_worker", str(out)], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("killed as planned") == 2  # both ranks stopped at the planned step
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "train_log.jsonl").read_text().splitlines()]


def _assert_same_weights(model: torch.nn.Module, final_dir: Path) -> None:
    saved = load_file(final_dir / "model.safetensors")
    state = model.state_dict()
    assert saved, final_dir
    for name, w in saved.items():
        assert torch.allclose(state[name], w, atol=1e-5, rtol=0), name


@pytest.mark.slow  # two gloo processes, each importing torch and transformers
def test_two_processes_match_one_process_at_the_same_global_batch(two_procs, tmp_path):
    torch.set_num_threads(1)
    one = toy_model()
    res = train(one, sft_batches(), ar_batch_loss, dataclasses.replace(SFT_CFG, grad_accum=2), tmp_path)
    assert res.step == SFT_CFG.max_steps
    two = _losses(two_procs / "sft")
    assert len(two) == SFT_CFG.max_steps and two == pytest.approx(res.losses, abs=1e-5)
    assert res.losses[-1] < res.losses[0]  # it trained: the comparison is not between two untouched models
    _assert_same_weights(one, two_procs / "sft" / "final")
    # Not a tautology: 1 process at half the global batch takes different steps.
    half = toy_model()
    train(half, sft_batches(), ar_batch_loss, SFT_CFG, tmp_path / "half")
    diff = max((a - b).abs().max().item() for a, b in zip(half.parameters(), one.parameters(), strict=True))
    assert diff > 1e-3


@pytest.mark.slow  # reads the two-process run above
def test_checkpoint_from_two_processes_resumes_in_one(two_procs, tmp_path):
    torch.set_num_threads(1)
    ckpt = latest_checkpoint(two_procs / "cft")
    assert ckpt is not None and ckpt.name == f"step_{KILL_STEP:07d}"
    assert json.loads((ckpt / "trainer_state.json").read_text()) == {
        "step": KILL_STEP,
        "world_size": 2,
        "grad_accum": 1,
    }
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    cfg = dataclasses.replace(CFT_CFG, grad_accum=2)
    ref, batches, loss_fn = cft_setup()
    uninterrupted = train(ref, batches, loss_fn, cfg, tmp_path / "ref")
    model, batches, loss_fn = cft_setup()  # a fresh process at world size 1: fresh weights, resumes from disk
    res = train(model, batches, loss_fn, cfg, two_procs / "cft")
    assert res.start_step == KILL_STEP and res.step == CFT_CFG.max_steps
    assert _losses(two_procs / "cft") == pytest.approx(uninterrupted.losses, abs=1e-5)
    for (n, p), (_, q) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.allclose(p, q, atol=1e-5, rtol=0), n
