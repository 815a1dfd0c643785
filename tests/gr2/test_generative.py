"""The generative stages end to end on a small real slice: prepare -> AR SFT -> convert -> CFT -> evaluate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gr2.candidates import attach_candidates, cut_lists
from gr2.config import DiffusionConfig, load_profile
from gr2.data import load_dataset
from gr2.data.dataset import data_root
from gr2.data.split import build_targets, train_sequences
from gr2.generative import Answer, BundleConfig, BundlePrompt, GenerativeReranker
from gr2.inference import RankRequest, load_reranker
from gr2.prompt import label_token, parse_response, parse_trace, response_trace
from gr2.retriever import CoocRetriever
from gr2.stages.evaluate import evaluate_generative
from gr2.stages.opd_rl import train_prompts
from gr2.stages.prepare import SFTData, prepare_sft
from gr2.stages.train_stages import TEACHER_TARGETS, convert, teacher_records, train_ar_teacher, train_cft
from gr2.teacher import SFTRecord

OVERRIDES = {
    "sid.content_weight": 0.0,  # content-free SIDs keep this fast (the title model is tested in test_sid.py)
    "sid.kmeans_iters": 5,
    "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64, "max_len": 320},
    "sft": {
        "lr": 0.01,
        "batch_size": 16,
        "max_steps": 25,
        "warmup": 2,
        "checkpoint_every": 10,
        "log_every": 5,
    },
    "cft": {"lr": 0.01, "batch_size": 16, "max_steps": 6, "warmup": 1, "checkpoint_every": 3, "log_every": 3},
    "diffusion": {"block_size": 4, "taus": [1.0, 0.5], "eval_tau": 0.5, "spec_tau": 0.5},
    "eval": {
        "batch_size": 16,
        "speed_examples": 2,
        "speed_batch": 4,
        "speed_batch_examples": 4,
        "threads": 1,
    },
    "bootstrap_samples": 50,
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gen")
    ds = load_dataset(data_root() / "ml-latest-small")
    users = ds.interactions["user_id"].drop_duplicates().iloc[:60]
    ds.interactions = ds.interactions[ds.interactions["user_id"].isin(users)].reset_index(drop=True)
    ds.items = ds.items[ds.items["item_id"].isin(ds.interactions["item_id"])].reset_index(drop=True)
    prof = load_profile("quick", OVERRIDES)
    seqs = train_sequences(ds)
    ret = CoocRetriever(prof.retriever).fit(seqs, ds.items["item_id"].tolist())
    examples, _ = attach_candidates(build_targets(ds, prof.data.history_len), ret, prof.data.n_candidates)
    data = prepare_sft(examples, ds, prof)
    data.save(root / "sft")
    ar = train_ar_teacher(SFTData.load(root / "sft"), prof, root / "ar")
    dc = prof.diffusion
    naive = convert(ar, dc, root / "naive")
    cft = train_cft(naive, data, prof, root / "cft")
    return {
        "prof": prof,
        "examples": examples,
        "data": data,
        "ar": ar,
        "naive": naive,
        "cft": cft,
        "root": root,
    }


def test_prepare_builds_parseable_records(pipeline):
    data = pipeline["data"]
    n_train = int((pipeline["examples"]["split"] == "train").sum())
    assert data.stats["records_trace"]["n_records"] == len(data.records["trace"]) == n_train > 50
    assert data.evidence.bucket_edges is not None
    # Same lists for both variants; the no-trace responses are strictly shorter.
    assert len(data.records["trace"]) == len(data.records["ar_no_trace"])
    assert all(
        len(a[1]) > len(b[1]) for a, b in zip(data.records["trace"], data.records["ar_no_trace"], strict=True)
    )


def test_sft_loss_falls_and_bundle_serves(pipeline):
    log = [
        json.loads(x)
        for x in (pipeline["root"] / "ar" / "train" / "train_log.jsonl").read_text().splitlines()
    ]
    assert len(log) == 25 and log[-1]["loss"] < log[0]["loss"] - 0.5
    model = load_reranker(pipeline["ar"])
    assert isinstance(model, GenerativeReranker) and model.block_size == 0
    test = pipeline["examples"].query("split == 'test'").head(3)
    reqs = [
        RankRequest(u, list(c), list(h))
        for u, c, h in zip(test.user_id, test.candidates, test.history, strict=True)
    ]
    res = model.rank(reqs, decoder="ar")
    for req, r in zip(reqs, res, strict=True):
        assert sorted(r.ranking) == sorted(req.candidates)  # a permutation, valid or fallen back
        assert r.valid == (r.reason is None) and 0 < r.n_tokens <= model.max_new_tokens
        if not r.valid:
            assert r.ranking == req.candidates  # invalid output falls back to the upstream order
    with pytest.raises(ValueError, match="AR model"):
        model.rank(reqs, decoder="diffusion")


def _candidate_segments(model, ids):
    """Each candidate's tokens after its letter (SID + evidence buckets), in letter order ([A] first)."""
    letters = {model.tokenizer.convert_tokens_to_ids(label_token(i)): i for i in range(model.n_candidates)}
    starts = [k for k, t in enumerate(ids) if t in letters]
    shown = [letters[ids[k]] for k in starts]  # [A] first, unless the bundle lists them last first
    assert shown == list(range(model.n_candidates))[:: -1 if model.short_lists == "last_first" else 1]
    segments = dict(
        zip(
            shown, [ids[a + 1 : b] for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)], strict=True
        )
    )
    return [segments[i] for i in range(model.n_candidates)]


def test_shuffled_rl_prompts_move_letters_not_evidence(pipeline):
    model = load_reranker(pipeline["ar"])
    ex = pipeline["examples"]
    plain, labels, pre, _ = train_prompts(model, ex, 40, seed=3)
    assert labels == pre  # retriever order: the letter index is the retriever rank
    shuffled, s_labels, s_pre, _ = train_prompts(model, ex, 40, seed=3, shuffle=True)
    assert s_pre == pre and s_labels != labels
    assert shuffled == train_prompts(model, ex, 40, seed=3, shuffle=True).ids  # seeded
    moved = 0
    for a, b, y, y_shown in zip(plain, shuffled, pre, s_labels, strict=True):
        seg_a, seg_b = _candidate_segments(model, a), _candidate_segments(model, b)
        # every candidate keeps its SID and its evidence (retriever_rank bucket included): only letters move
        assert sorted(seg_a) == sorted(seg_b)
        assert seg_b[y_shown] == seg_a[y]  # the label points at the held-out item in the shuffled prompt
        moved += seg_a != seg_b
    assert moved >= 30
    with pytest.raises(ValueError, match="not a permutation"):
        model.encode_prompts(ex["history"].head(1).tolist(), ex["candidates"].head(1).tolist(), [[0, 0]])


def test_naive_conversion_copies_weights(pipeline):
    ar, naive = load_reranker(pipeline["ar"]), load_reranker(pipeline["naive"])
    assert naive.block_size == pipeline["prof"].diffusion.block_size
    sa, sn = ar.model.state_dict(), naive.model.state_dict()
    assert sa.keys() == sn.keys() and all(torch.equal(sa[k], sn[k]) for k in sa)


def test_cft_changes_weights_and_keeps_block_size(pipeline):
    naive, cft = load_reranker(pipeline["naive"]), load_reranker(pipeline["cft"])
    assert cft.block_size == naive.block_size
    # the operating tau travels from the conversion to every student trained from it (serving's default)
    assert naive.tau == cft.tau == pipeline["prof"].diffusion.eval_tau == 0.5
    assert (
        naive.spec_tau == cft.spec_tau == pipeline["prof"].diffusion.spec_tau == 0.5
    )  # and spec's draft tau
    assert load_reranker(pipeline["ar"]).tau is None and load_reranker(pipeline["ar"]).spec_tau is None
    assert any(
        not torch.equal(a, b) for a, b in zip(naive.model.parameters(), cft.model.parameters(), strict=True)
    )
    # a call that names no tau decodes at the model's own
    ex = pipeline["examples"].query("split == 'val'").head(4)
    prompts = cft.encode_prompts(ex["history"].tolist(), ex["candidates"].tolist())
    own, at_tau = cft.decode(prompts, "diffusion"), cft.decode(prompts, "diffusion", cft.tau)
    assert own.responses == at_tau.responses and own.nfe == at_tau.nfe
    assert own.nfe > cft.decode(prompts, "diffusion", 0.1).nfe  # (a tau that matters)


def test_cft_trains_on_the_teachers_greedy_responses(pipeline):
    """Each CFT target is the AR teacher's greedy response where that is valid, else the SFT response."""
    data, prof = pipeline["data"], pipeline["prof"]
    meta = json.loads((pipeline["cft"] / "reranker.json").read_text())
    assert meta["cft_targets"]["targets"] == "teacher" == meta["train"]["targets"]
    assert meta["train"]["certainty_weight"] == prof.diffusion.certainty_weight > 0
    saved = torch.load(pipeline["root"] / "cft" / TEACHER_TARGETS)
    records, sft = saved["records"], data.records["trace"]
    assert len(records) == len(sft) == meta["cft_targets"]["n_records"]
    teacher = load_reranker(pipeline["ar"])
    open_id = teacher.tokenizer.convert_tokens_to_ids("{")
    sub = list(range(0, len(sft), max(len(sft) // 24, 1)))
    greedy = teacher.decode([list(sft[i][0]) for i in sub], "ar", 1.0, 8).responses
    for i, g in zip(sub, greedy, strict=True):
        prompt, resp, w = records[i]
        assert list(prompt) == list(sft[i][0])
        if teacher.read_answer(g, teacher.prompt_candidates(prompt)).valid and open_id in g:
            a = g.index(open_id)
            assert list(resp) == g
            assert w == [prof.sft.trace_weight] * a + [prof.sft.answer_weight] * (len(g) - a)
        else:
            assert (list(resp), list(w)) == (list(sft[i][1]), list(sft[i][2]))


class _FakeTeacher:
    """Answers prompt [p] with a fixed response: valid when p is even."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0
        self.open_id = tokenizer.convert_tokens_to_ids("{")
        self.trace = tokenizer.convert_tokens_to_ids(["[A]", "[B]"])  # two trace tokens, neither of them "{"
        assert self.open_id not in self.trace

    def decode(self, prompts, decoder, tau, batch_size):
        assert decoder == "ar"
        self.calls += 1
        return type("D", (), {"responses": [[*self.trace, self.open_id, p[0], 2] for p in prompts]})()

    def read_answer(self, response, n):
        return Answer([], response[3] % 2 == 0, None, None)

    def prompt_candidates(self, prompt):
        return 2


def test_teacher_records_fall_back_and_resume_from_cache(pipeline, tmp_path):
    prof, tok = pipeline["prof"], pipeline["data"].tokenizer
    sft = [SFTRecord([p], [5, 6, 2], [0.5, 1.0, 1.0]) for p in range(5)]
    fake = _FakeTeacher(tok)
    cache = tmp_path / TEACHER_TARGETS
    recs, stats = teacher_records(fake, sft, prof, cache)
    t, a = prof.sft.trace_weight, prof.sft.answer_weight
    for p, r in enumerate(recs):
        if p % 2 == 0:  # valid teacher answer: its tokens, trace weight before "{", answer weight from it
            assert r == ([p], [*fake.trace, fake.open_id, p, 2], [t, t, a, a, a])
        else:  # invalid: the SFT record unchanged
            assert r == sft[p]
    assert stats["teacher_frac"] == pytest.approx(3 / 5) and stats["n_records"] == 5
    calls = fake.calls
    again, stats2 = teacher_records(fake, sft, prof, cache)
    assert again == recs and stats2 == stats and fake.calls == calls  # reloaded, not decoded again


def test_evaluate_rows_and_speed(pipeline):
    prof = pipeline["prof"]
    test = pipeline["examples"].query("split == 'test'").reset_index(drop=True)
    rows, speed, by_length, cold, chosen = evaluate_generative(
        {"ar": pipeline["ar"], "naive": pipeline["naive"], "cft": pipeline["cft"]}, test, prof
    )
    assert chosen is None  # the deployed student here is cft: no RL stage chose its tau
    assert [(r["model"], r["tau"]) for r in rows if r["operating"]] == [("cft", prof.diffusion.eval_tau)]
    assert [(r["model"], r["tau"]) for r in rows] == [
        ("ar", None),
        ("naive", 0.5),
        ("cft", 1.0),
        ("cft", 0.5),
        (
            "spec",
            prof.diffusion.spec_tau,
        ),  # the final student drafts, ar verifies: ar's tokens, so ar's accuracy
    ]
    assert rows[-1]["recall@1"] == rows[0]["recall@1"] and rows[-1]["validity"] == rows[0]["validity"]
    for r in rows:
        assert 0.0 <= r["validity"] <= 1.0 and r["n_users"] == test["user_id"].nunique()
        assert sum(r["invalid_reasons"].values()) == round((1 - r["validity"]) * len(test))
        assert r["ci95"]["recall@1"][0] <= r["recall@1"] <= r["ci95"]["recall@1"][1]
    # Speed: AR then CFT at every tau, at batch 1 and at the serving batch; AR is its own baseline.
    assert [(s["model"], s["tau"], s["batch"]) for s in speed] == [
        (m, t, b)
        for b in (1, 4)
        for m, t in (("ar", None), ("cft", 1.0), ("cft", 0.5), ("spec", prof.diffusion.spec_tau))
    ]
    for s in speed:
        assert s["tokens_per_s"] > 0 and s["nfe_per_seq"] >= 1
        if s["model"] == "ar":
            assert s["speedup_vs_ar"] == 1.0 and s["tokens_per_forward"] == pytest.approx(1.0, abs=0.02)
    assert rows[0]["speedup_vs_ar"] == 1.0 and rows[2]["nfe_per_seq"] == speed[1]["nfe_per_seq"]
    # ar and the deployed student (here cft, at eval_tau) on the test lists cut to each length
    lengths = prof.eval.list_lengths
    assert [(r["model"], r["tau"], r["length"]) for r in by_length] == [
        (m, t, n) for m, t in (("ar", None), ("cft", prof.diffusion.eval_tau)) for n in lengths
    ]
    for r in by_length:
        assert r["lists"] == len(test) and 0.0 <= r["validity"] <= 1.0
        full = next(x for x in rows if (x["model"], x["tau"]) == (r["model"], r["tau"]))
        if r["length"] == 10:  # the full lists: the main row
            assert r["recall@1"] == full["recall@1"] and r["validity"] == full["validity"]
        assert r["floor_recall@1"] == pytest.approx(
            float(np.mean(cut_lists(test, [r["length"]] * len(test), prof.seed)["label"] == 0))
        )
    # users without history: the bundle's cold-start ranker serves every list, always valid
    assert cold["ranker"] == {"cold_start": len(test)} and cold["validity"] == 1.0
    assert cold["served_by"] == "cft (diffusion)" and 0.0 < cold["reordered"] <= 1.0


def test_prepare_cuts_a_share_of_the_lists_and_fits_the_cold_start_ranker(pipeline):
    data = pipeline["data"]
    model = load_reranker(pipeline["ar"])
    sizes = [model.prompt_candidates(r.prompt_ids) for r in data.records["trace"]]
    counts = {n: sizes.count(n) for n in set(sizes)}
    assert counts == data.stats["list_lengths"] and set(counts) <= set(range(2, 11))
    assert 0.1 < 1 - counts[10] / len(sizes) < 0.4  # short_list_share 0.25 of the lists are cut
    for r, n in zip(data.records["trace"], sizes, strict=True):  # each answer ranks its own list
        text = model.tokenizer.decode(r.response_ids, skip_special_tokens=True)
        assert (
            parse_response(text, n).ranking is not None and parse_trace(response_trace(text), n) is not None
        )
    # the cold-start ranker travels in every bundle, and rank() routes users without known history to it
    assert data.cold_start is not None and model.cold_start is not None
    assert load_reranker(pipeline["cft"]).cold_start is not None
    test = pipeline["examples"].head(4)
    reqs = [
        RankRequest(u, list(c), h)
        for u, c, h in zip(
            test.user_id, test.candidates, [[], ["nope"], list(test.history.iat[2]), []], strict=True
        )
    ]
    res = model.rank(reqs, decoder="ar")
    assert [r.ranker for r in res] == ["cold_start", "cold_start", "model", "cold_start"]
    for req, r in zip(reqs, res, strict=True):
        assert sorted(r.ranking) == sorted(req.candidates)
    assert all(r.valid and r.nfe == 0 for r in res if r.ranker == "cold_start")


@pytest.mark.slow  # two torchrun processes, each importing torch and transformers
def test_sft_step_in_two_processes_through_torchrun(pipeline, tmp_path):
    """The SFT step itself (components/_lib/model_steps.train_ar) run by run_step in 2 gloo processes: one bundle
    (written by rank 0), a log of global steps, a checkpoint with both ranks' RNG state."""
    import dataclasses

    import yaml

    from components._lib import trainjob

    prof = dataclasses.replace(
        pipeline["prof"],
        sft=dataclasses.replace(pipeline["prof"].sft, max_steps=3, checkpoint_every=3, batch_size=8),
    )
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(prof.to_dict()))))
    out = tmp_path / "ar2"
    info = trainjob.run_step(
        "train_ar",
        {"sft_dir": str(pipeline["root"] / "sft")},
        {"out_dir": str(out)},
        {"profile": str(path)},
        1,
        2,
    )
    assert info["steps"] == 3 and info["final_loss"] is not None
    assert isinstance(load_reranker(out / "bundle"), GenerativeReranker)
    rows = [json.loads(x) for x in (out / "train" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # one line per global step, not one per rank
    ckpt = out / "train" / "checkpoints" / "step_0000003"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    assert (ckpt / "random_states_1.pkl").exists()


def test_bundle_config_reads_old_and_new_bundles():
    """A reranker.json from before a key existed loads with that key's default; keys BundleConfig does not name
    are kept and written back; an unknown prompt key and a missing max_new_tokens are errors."""
    old = BundleConfig.from_dict(
        {"kind": "generative", "max_new_tokens": 40, "block_size": 4, "stage": "cft"}
    )
    assert old.prompt == BundlePrompt() and not old.prompt.unique_labels and old.prompt.item_tokens == "all"
    assert old.operating_tau() == DiffusionConfig.eval_tau and old.draft_tau() == DiffusionConfig.spec_tau
    assert (old.name, old.n_candidates, old.batch_size, old.cold_start, old.stage) == (
        "generative",
        10,
        32,
        None,
        "cft",
    )
    ar = BundleConfig.from_dict({"max_new_tokens": 40, "tau": 0.5})
    assert ar.operating_tau() is None and ar.draft_tau() is None  # AR models decode without a tau
    raw = {
        "kind": "generative",
        "max_new_tokens": 48,
        "block_size": 8,
        "tau": 0.6,
        "spec_tau": 0.3,
        "prompt": {"item_tokens": "none", "unique_labels": True},
        "kept": "rl",
        "train": {"steps": 3},
    }
    cfg = BundleConfig.from_dict(raw)
    assert cfg.extra == {"kept": "rl"} and cfg.operating_tau() == 0.6 and cfg.draft_tau() == 0.3
    assert BundleConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["kept"] == "rl" and "verifier" not in cfg.to_dict()  # None fields are left out
    with pytest.raises(ValueError, match="unknown prompt keys"):
        BundleConfig.from_dict({**raw, "prompt": {"item_tokens": "none", "sparkles": 1}})
    with pytest.raises(ValueError, match="max_new_tokens"):
        BundleConfig.from_dict({"kind": "generative"})
