"""OPD and RL resume after a real SIGKILL mid-run (issue 18): the shared loop's resume, through the stages.

A child process (forked: no second import of torch and transformers) runs the stage and is SIGKILLed while
it samples the rollouts of step 3, with the checkpoint of step 2 on disk and the rollout log already holding
step 2. The stage is then run again on the same folder: it resumes from step 2 and must end with the
weights of an uninterrupted run (within 1e-6) and the same training and rollout logs.

RL scores rollouts with `token_reward` here: the tiny two-step SFT model's rankings are random, so the GR2
reward would often tie inside a group, every group would be dropped and the weights would never move (a resume
test that could not fail); and every response has the same length (its list's length fixes its layout, gr2/rules.py).
Resuming does not depend on what the reward is. The stage code is
untouched: `run` sets its hooks on the stage module and undoes them afterwards.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from gr2.candidates import attach_candidates
from gr2.config import load_profile
from gr2.data import load_dataset
from gr2.data.dataset import data_root
from gr2.data.split import build_targets, train_sequences
from gr2.retriever import CoocRetriever
from gr2.stages import opd_rl
from gr2.stages.prepare import SFTData, prepare_sft
from gr2.stages.train_stages import convert, train_ar_teacher
from gr2.train import latest_checkpoint

STEPS, EVERY, KILL_AT = 4, 2, 3
ON_POLICY = {"lr": 1e-3, "steps": STEPS, "checkpoint_every": EVERY, "log_every": 3, "max_prompts": 16}
OVERRIDES = {
    "sid.content_weight": 0.0,
    "sid.kmeans_iters": 3,
    "data.n_candidates": 4,  # short prompts and responses: cheap rollouts
    "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64, "max_len": 320},
    "sft": {"lr": 0.01, "batch_size": 16, "max_steps": 2, "warmup": 1, "checkpoint_every": 0, "log_every": 0},
    "diffusion": {"block_size": 4, "eval_tau": 0.6},  # not the rollouts' tau (rl.tau 0.9): the guard reads it
    "opd": {**ON_POLICY, "rollouts_per_prompt": 2, "prompts_per_step": 2},
    "rl": {**ON_POLICY, "group_size": 2, "prompts_per_step": 2},
}
TIMING = {"tokens_per_s", "elapsed_s", "sample_s"}  # wall-clock fields: the only ones allowed to differ


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """A tiny AR teacher and its naive block-diffusion conversion on 30 users, as the stages read them."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("resume")
    ds = load_dataset(data_root() / "ml-latest-small")
    users = ds.interactions["user_id"].drop_duplicates().iloc[:30]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    prof = load_profile("quick", OVERRIDES)
    ret = CoocRetriever(prof.retriever).fit(train_sequences(ds), ds.items["item_id"].tolist())
    examples, _ = attach_candidates(build_targets(ds, prof.data.history_len), ret, prof.data.n_candidates)
    data = prepare_sft(examples, ds, prof)
    data.save(root / "sft")
    examples.to_pickle(root / "examples.pkl")
    ar = train_ar_teacher(data, prof, root / "ar_run")
    convert(ar, prof.diffusion, root / "naive")
    os.symlink(ar, root / "ar")
    return root


def token_reward(
    response, label, n, tokenizer, alpha=0.2, rank_before=None, gain="rank"
) -> tuple[float, bool]:
    """A reward that differs between any two different rollouts of one prompt: a checksum of their tokens."""
    return sum((i + 1) * int(t) for i, t in enumerate(response)) % 97 / 97, False


def run(stage: str, root: Path, out: Path, block_at: int | None = None) -> Path:
    """The stage as the pipeline runs it. With `block_at`, write out/blocked and sleep when the stage asks for
    the rollouts of that step (the test kills the process there)."""
    prof = load_profile("quick", OVERRIDES)
    data = SFTData.load(root / "sft")
    examples = pd.read_pickle(root / "examples.pkl")
    batches = opd_rl.OPDBatches if stage == "opd" else opd_rl.RLBatches
    sample, reward = batches.__call__, opd_rl.response_reward

    def blocking(self, step: int):
        if step == block_at:
            (out / "blocked").write_text(str(step))
            time.sleep(3600)  # killed here
        return sample(self, step)

    batches.__call__ = blocking
    opd_rl.response_reward = token_reward
    try:
        if stage == "opd":
            return opd_rl.train_opd(root / "naive", root / "ar", data, examples, prof, out)
        return opd_rl.train_rl(root / "naive", data, examples, prof, out)
    finally:
        batches.__call__, opd_rl.response_reward = sample, reward


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.parametrize("stage", ["opd", "rl"])
def test_stage_resumes_after_sigkill_to_the_uninterrupted_weights_and_logs(bundles, tmp_path, stage):
    ref = tmp_path / "ref"
    run(stage, bundles, ref)

    out = tmp_path / "killed"
    out.mkdir()
    child = multiprocessing.get_context("fork").Process(target=run, args=(stage, bundles, out, KILL_AT))
    child.start()
    try:
        while not (out / "blocked").exists():
            assert child.is_alive(), f"the stage died before step {KILL_AT} (exit code {child.exitcode})"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
    finally:
        child.kill()
        child.join()
    train = out / "train"
    assert latest_checkpoint(train).name == f"step_{KILL_AT - 1:07d}"
    # the step after the checkpoint was trained and logged before the kill: the resume must drop and redo it
    logged = [r["step"] for r in _rows(train / "rollout_log.jsonl")]
    assert logged == list(range(KILL_AT))

    run(stage, bundles, out)  # what a restarted process does: the same call on the same folder
    got = load_file(train / "final" / "model.safetensors")
    want = load_file(ref / "train" / "final" / "model.safetensors")
    start = load_file(bundles / "naive" / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.allclose(got[name], w, rtol=0, atol=1e-6), name
    assert any(not torch.equal(w, start[name]) for name, w in want.items())  # the stage really trained
    for log in ("train_log.jsonl", "rollout_log.jsonl"):
        resumed, uninterrupted = _rows(train / log), _rows(ref / "train" / log)
        assert [r["step"] for r in resumed] == list(range(STEPS)), log
        assert [r.keys() for r in resumed] == [r.keys() for r in uninterrupted], log
        for r, u in zip(resumed, uninterrupted, strict=True):
            for k in r:  # the same values, floats within 1e-6
                assert r[k] == u[k] or abs(r[k] - u[k]) <= 1e-6, (log, r["step"], k, r[k], u[k])


@pytest.mark.parametrize("scores,kept", [((0.5, 0.4), "parent"), ((0.4, 0.4), "rl")])
def test_rl_keeps_its_parent_when_validation_recall_drops(bundles, tmp_path, monkeypatch, scores, kept):
    """RL replaces the parent's weights only if recall@1 on the validation lists does not drop (ties keep RL);
    the bundle metadata says which weights it holds and why."""
    calls = iter(scores)  # the parent's validation recall, then the RL weights'
    taus = []
    monkeypatch.setattr(opd_rl, "validation_recall", lambda r, v, d, tau, p: taus.append(tau) or next(calls))
    bundle = run("rl", bundles, tmp_path / "rl")
    v = json.loads((bundle / "reranker.json").read_text())["validation"]
    assert (
        taus[:2] == [v["tau"]] * 2 and v["tau"] == load_profile("quick", OVERRIDES).diffusion.eval_tau
    )  # as served
    assert v["kept"] == kept and (v["recall@1_parent"], v["recall@1_rl"]) == scores and v["lists"] > 0
    got = load_file(bundle / "model" / "model.safetensors")
    parent = load_file(bundles / "naive" / "model" / "model.safetensors")
    assert all(torch.equal(got[k], w) for k, w in parent.items()) == (kept == "parent")


def test_validation_recall_is_the_evaluation_recall(bundles):
    from gr2.stages.evaluate import decode_rows, load

    prof = load_profile("quick", OVERRIDES)
    val = opd_rl.validation_lists(pd.read_pickle(bundles / "examples.pkl"), 25, prof.seed)
    assert 0 < len(val) <= 25 and set(val["split"]) == {"val"}
    rr = load(bundles / "ar")
    got = opd_rl.validation_recall(rr, val, "ar", 1.0, prof)
    assert got == pytest.approx(decode_rows(rr, val, "ar", None, prof)["recall@1"])
    assert opd_rl.validation_recall(rr, val.iloc[:0], "ar", 1.0, prof) is None
