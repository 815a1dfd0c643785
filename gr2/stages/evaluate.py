"""Evaluation of the generative models: accuracy rows over the whole test split, and speed measured side by side.

Accuracy: every model decodes every test list through `GenerativeReranker` (the serving code path): parse,
fall back to the retriever order on invalid output, score with gr2.metrics.evaluate (paired CIs vs the floor).

Speed: in this one process, on the same test lists and thread count, each decoder runs at batch 1 and at a
serving batch; tokens/s counts generated tokens up to and including eos. `speedup_vs_ar` divides by the AR
teacher's tokens/s at the same batch; `ideal_speedup` is the same ratio in tokens per forward pass (what the
speedup would be if a block forward cost what an AR step costs), so the per-forward overhead is visible.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import scipy.stats
import torch

from gr2.candidates import cut_lists
from gr2.config import EvalConfig, Profile
from gr2.gate import paired_comparison
from gr2.generative import Answer, GenerativeReranker
from gr2.inference import RankRequest, Reranker, load_reranker
from gr2.metrics import apply_fallback, evaluate
from gr2.prompt import parse_trace
from gr2.stages.prepare import SFTData, list_features

log = logging.getLogger(__name__)


def load(bundle: str | Path) -> GenerativeReranker:
    """A generative bundle through the reranker registry (`load_reranker`), as serving loads it."""
    rr = load_reranker(bundle)
    if not isinstance(rr, GenerativeReranker):
        raise ValueError(f"{bundle}: a {type(rr).__name__}, not a generative bundle")
    return rr


def teacher_row(data: SFTData, test: pd.DataFrame, profile: Profile) -> dict:
    """The reasoning teacher's own ranking of the test lists, scored like every other row: the model whose
    per-candidate verdicts the SFT traces carry, so the report shows how much of it the students keep."""
    rankings = data.teacher.rank(list_features(data.evidence, test)).tolist()
    return evaluate(
        test, rankings, None, n_boot=profile.bootstrap_samples, seed=profile.seed, model="teacher"
    )


def decode_answers(
    model: GenerativeReranker, examples: pd.DataFrame, decoder: str, tau: float | None, profile: Profile
) -> tuple[list[Answer], list[list[int]]]:
    """Greedy decoding of `examples` as the evaluation scores it: (answers, responses)."""
    candidates = examples["candidates"].tolist()
    prompts = model.encode_prompts(examples["history"].tolist(), candidates)
    out = model.decode(prompts, decoder, tau or 1.0, profile.eval.batch_size)
    answers = [model.read_answer(r, len(c)) for r, c in zip(out.responses, candidates, strict=True)]
    return answers, out.responses


def rankings(
    model: Reranker, examples: pd.DataFrame, tau: float | None, profile: Profile
) -> tuple[list[list[int]], int]:
    """Greedy rankings of `examples` as the report scores them: a generative model decodes at `tau` (its AR
    decoder when it has no blocks), any other reranker answers through `rank` (the serving API); an invalid
    output becomes the upstream order. A list with a candidate the model does not know gets the upstream order
    too (serving refuses such a request: a model trained on an older catalog). Returns the rankings and how many
    lists had an unknown candidate."""
    cands = examples["candidates"].tolist()
    known = [all(model.known_item(c) for c in cs) for cs in cands]
    out = [list(range(len(cs))) for cs in cands]
    idx = [i for i, k in enumerate(known) if k]
    sub = examples.iloc[idx].reset_index(drop=True)
    n = [len(cands[i]) for i in idx]  # lists of any length 2..N
    if idx and isinstance(model, GenerativeReranker):
        decoder = "ar" if model.block_size == 0 else "diffusion"
        answers, _ = decode_answers(model, sub, decoder, tau if decoder == "diffusion" else None, profile)
        ranked = apply_fallback([a.ranking for a in answers], [a.valid for a in answers], n)
    elif idx:
        requests = [
            RankRequest(str(u), list(c), list(h))
            for u, c, h in zip(sub["user_id"], sub["candidates"], sub["history"], strict=True)
        ]
        results = model.rank(requests, "diffusion", tau or 1.0)
        ranked = apply_fallback(
            [[r.candidates.index(x) for x in res.ranking] for r, res in zip(requests, results, strict=True)],
            [res.valid for res in results],
            n,
        )
    for i, r in zip(idx, ranked if idx else [], strict=True):
        out[i] = r
    return out, len(cands) - len(idx)


def decode_rows(
    model: GenerativeReranker, examples: pd.DataFrame, decoder: str, tau: float | None, profile: Profile
) -> dict:
    """One report row: metrics over `examples` (+ validity, invalid reasons, mean response tokens)."""
    answers, responses = decode_answers(model, examples, decoder, tau, profile)
    row = evaluate(
        examples,
        [a.ranking for a in answers],
        [a.valid for a in answers],
        n_boot=profile.bootstrap_samples,
        seed=profile.seed,
        model=model.name,
        tau=tau,
    )
    reasons: dict[str, int] = {}
    for a in answers:
        if not a.valid:
            reasons[str(a.reason)] = reasons.get(str(a.reason), 0) + 1
    row["invalid_reasons"] = reasons
    row["mean_response_tokens"] = sum(len(r) for r in responses) / max(len(responses), 1)
    trace = trace_summary(answers, examples["label"].tolist(), examples["candidates"].map(len).tolist())
    if trace is not None:
        row["trace"] = trace
    return row


def trace_summary(answers: Sequence[Answer], labels: list[int], sizes: Sequence[int]) -> dict | None:
    """What a model's traces carry and whether its answers follow them, over the lists with a complete trace:
    `recall@1` of the trace's own ranking (its highest score level first; ties keep the retriever order) and
    `answer_follows`, the share of valid answers whose first label has the trace's highest level. None for a
    model that writes no trace."""
    parsed = []
    for a, y, n in zip(answers, labels, sizes, strict=True):
        lv = parse_trace(a.trace, n)
        if lv is not None:
            parsed.append((a, lv, y))
    if not parsed:
        return None
    hits = [int(np.argmax(lv)) == y for _, lv, y in parsed]
    follows = [lv[a.ranking[0]] == max(lv) for a, lv, _ in parsed if a.valid]
    return {
        "lists": len(parsed),
        "recall@1": float(np.mean(hits)),
        "answer_follows": float(np.mean(follows)) if follows else None,
    }


def _geometric_ci(logs: list[float]) -> tuple[float, list[float] | None]:
    """exp(mean) of log ratios and its 95% interval (Student t over the repeats; None with one repeat)."""
    n = len(logs)
    m = statistics.fmean(logs)
    if n < 2:
        return math.exp(m), None
    h = float(scipy.stats.t.ppf(0.975, n - 1)) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(m), [math.exp(m - h), math.exp(m + h)]


def speed_table(
    models: dict[str, GenerativeReranker],
    plans: list[tuple[str, str, float | None]],
    test: pd.DataFrame,
    ev: EvalConfig,
    warmup: bool = False,
) -> list[dict]:
    """Speed side by side: same prompts (the first test lists), same threads, batch 1 and the serving batch.

    `plans` are (model name, decoder, tau); the one named "ar" is the baseline of `speedup_vs_ar` and
    `ideal_speedup` (tokens per forward: what the speedup would be if every forward cost an AR step). A repeat
    decodes the lists one decode call (`batch` lists) at a time, every plan on a chunk before the next chunk, so
    all plans are timed over the same stretch of time and a slow moment (another process, a frequency change)
    hits them alike; the garbage collector is off while timing. A plan's speedup in a repeat is its tokens/s over
    AR's in that repeat; its row reports the geometric mean over the `ev.speed_repeats` repeats with a 95%
    interval (`speedup_ci95`, Student t on the log ratios: what the gate reads), the median tokens/s, and nfe
    and tokens per forward (the same every repeat: greedy decoding). warmup: decode the first chunk with every
    plan first, untimed (a GPU's kernels and allocator; on the CPU the models have already decoded the whole test
    split)."""
    speed: list[dict] = []
    base = next(i for i, p in enumerate(plans) if p[0] == "ar")
    repeats = max(ev.speed_repeats, 1)
    for batch, n_ex in ((1, ev.speed_examples), (ev.speed_batch, ev.speed_batch_examples)):
        sub = test.head(n_ex)
        prompts = models["ar"].encode_prompts(sub["history"].tolist(), sub["candidates"].tolist())
        chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        if warmup:
            for name, decoder, tau in plans:
                models[name].decode(chunks[0], decoder, tau or 1.0, batch)
        seconds = [[0.0] * len(plans) for _ in range(repeats)]
        tokens, nfe, verify = [0] * len(plans), [0] * len(plans), [0] * len(plans)
        gc.collect()
        gc.disable()
        try:
            for r in range(repeats):
                for chunk in chunks:
                    for i, (name, decoder, tau) in enumerate(plans):
                        out = models[name].decode(chunk, decoder, tau or 1.0, batch)
                        seconds[r][i] += out.seconds
                        if r == 0:
                            tokens[i] += sum(len(x) for x in out.responses)
                            nfe[i], verify[i] = nfe[i] + out.nfe, verify[i] + out.verifier_nfe
        finally:
            gc.enable()
        for i, (name, _, tau) in enumerate(plans):
            tps = [tokens[i] / max(sec[i], 1e-9) for sec in seconds]
            base_tps = [tokens[base] / max(sec[base], 1e-9) for sec in seconds]
            speedup, ci = _geometric_ci([math.log(a / b) for a, b in zip(tps, base_tps, strict=True)])
            nfe_seq = nfe[i] / len(chunks)  # nfe counts forwards per decode call (a batch)
            tokens_per_forward = tokens[i] / len(prompts) / max(nfe_seq, 1e-9)
            row = {
                "model": name,
                "tau": tau,
                "batch": batch,
                "tokens_per_s": statistics.median(tps),
                "nfe_per_seq": nfe_seq,
                "tokens_per_forward": tokens_per_forward,
                "n_sequences": len(prompts),
                "seconds": sum(sec[i] for sec in seconds),
                "repeats": repeats,
                "speedup_vs_ar": speedup,
                "speedup_ci95": ci,
            }
            row["ideal_speedup"] = tokens_per_forward / (
                tokens[base] / len(prompts) / (nfe[base] / len(chunks))
            )
            if verify[i]:  # spec: tokens kept per verifier forward, the acceptance length
                row["tokens_per_verify"] = tokens[i] / len(prompts) / (verify[i] / len(chunks))
            speed.append(row)
    return speed


class Evaluation(NamedTuple):
    rows: list[dict]  # accuracy rows on the test lists
    speed: list[dict]  # `speed_table`
    by_length: list[dict]  # `length_rows` of ar and the deployed student
    cold_start: dict  # `cold_start_row` of the deployed student
    operating_tau: (
        dict | None
    )  # how the deployed student's tau was chosen (gr2/stages/opd_rl.py `operating_tau`)


def evaluate_generative(
    bundles: Mapping[str, str | Path], test: pd.DataFrame, profile: Profile
) -> Evaluation:
    """Rows for every bundle (AR models decoded AR; diffusion models at each tau, naive and opd at eval_tau),
    a `spec` row, the speed list, `ar` and the deployed student by list length, and the cold-start row.

    `bundles` maps a row name to a bundle; the AR teacher must be under "ar" (the speed baseline). `spec` is
    speculative decoding at spec_tau: the final student (rl, else opd, else cft) drafts, "ar" verifies, so its
    tokens are ar's (gr2/decode.py spec_generate) and its accuracy row equals ar's."""
    if "ar" not in bundles:
        raise ValueError("evaluate_generative needs the AR teacher under the name 'ar' (the speed baseline)")
    torch.set_num_threads(profile.eval.threads)
    ev, dc = profile.eval, profile.diffusion
    models = {name: load(path) for name, path in bundles.items()}
    for name, m in models.items():
        m.name = name
    rows: list[dict] = []
    plans: list[tuple[str, str, float | None]] = []
    for name, m in models.items():
        if m.block_size == 0:
            plans.append((name, "ar", None))
        elif name in ("naive", "opd"):  # intermediate stages: the serving tau only
            plans.append((name, "diffusion", dc.eval_tau))
        else:  # cft and the final student: the whole tau sweep (and the model's own operating tau)
            plans += [(name, "diffusion", t) for t in dict.fromkeys([*dc.taus, m.tau])]
    student = next((n for n in ("rl", "opd", "cft") if n in models), None)
    if student is not None:
        models["spec"] = models[student].with_verifier(models["ar"].model, name="spec")
        plans.append(("spec", "spec", dc.spec_tau))
    for name, decoder, tau in plans:
        log.info("evaluate %s (%s, tau=%s) on %d test lists", name, decoder, tau, len(test))
        rows.append(decode_rows(models[name], test, decoder, tau, profile))

    speed_plans = [p for p in plans if p[0] != "naive" and (p[0] == "ar" or p[1] != "ar")]
    speed = speed_table(models, speed_plans, test, ev)
    # Each row's own speed figures are its batch-1 ones.
    b1 = {(s["model"], s["tau"]): s for s in speed if s["batch"] == 1}
    for row in rows:
        s = b1.get((row["model"], row["tau"]))
        if s is not None:
            row.update(
                nfe_per_seq=s["nfe_per_seq"],
                tokens_per_s=s["tokens_per_s"],
                speedup_vs_ar=s["speedup_vs_ar"],
                speedup_ci95=s["speedup_ci95"],
            )
    # The deployed student at its operating tau (its bundle's: chosen on validation), the row the gate judges.
    served = [("ar", "ar", None)] + (
        [(student, "diffusion", models[student].tau)] if student is not None else []
    )
    for row in rows:
        row["operating"] = any(row["model"] == n and row["tau"] == t for n, d, t in served[1:])
    by_length = [
        r
        for name, decoder, tau in served
        for r in length_rows(models[name], decoder, tau, test, profile, rows)
    ]
    name, decoder, tau = served[-1]  # the deployed model: its cold-start path
    chosen = (models[name].config.validation or {}).get("operating_tau") if student is not None else None
    cold = cold_start_row(models[name], decoder, tau, test, profile)
    return Evaluation(rows, speed, by_length, cold, chosen)


def ablation_rows(bundles: Mapping[str, str | Path], test: pd.DataFrame, profile: Profile) -> dict:
    """What the trace buys: the AR teacher (`bundles["ar"]`) and its no-trace ablation (`bundles["ar_no_trace"]`)
    decoded once each on the same test lists; their rows as the stage table's, and the paired bootstrap CI of
    ar - ar_no_trace (recall@1, after the fallback)."""
    torch.set_num_threads(profile.eval.threads)
    n_boot, seed = profile.bootstrap_samples, profile.seed
    lengths = test["candidates"].map(len).tolist()
    rows, ranked = [], {}
    for name in ("ar", "ar_no_trace"):
        model = load(bundles[name])
        answers, _ = decode_answers(model, test, "ar", None, profile)
        ranking, valid = [a.ranking for a in answers], [a.valid for a in answers]
        rows.append(evaluate(test, ranking, valid, n_boot=n_boot, seed=seed, model=name))
        ranked[name] = apply_fallback(ranking, valid, lengths)
    # the production rule's paired comparison, with the ablation in production's place
    paired = paired_comparison(test, ranked["ar"], ranked["ar_no_trace"], n_boot, seed)
    return {"rows": rows, "ar_minus_ar_no_trace": {k: paired[k] for k in ("n_lists", "delta", "ci95")}}


def length_rows(
    model: GenerativeReranker,
    decoder: str,
    tau: float | None,
    test: pd.DataFrame,
    profile: Profile,
    full_rows: Sequence[dict] = (),
) -> list[dict]:
    """R@1 (and its paired difference with the floor) and validity of one model on the test lists cut to each
    length of eval.list_lengths, keeping the held-out item (gr2/candidates.py `cut_lists`): clients send any
    length 2..N. A length of N or more is the full lists: their row from `full_rows` when it is there."""
    out = []
    for n in profile.eval.list_lengths:
        full = n >= max(test["candidates"].map(len), default=0)
        row = next((r for r in full_rows if full and (r["model"], r["tau"]) == (model.name, tau)), None)
        lists = test if full else cut_lists(test, [n] * len(test), profile.seed)
        if row is None:
            log.info(
                "evaluate %s (%s, tau=%s) on %d test lists cut to %d", model.name, decoder, tau, len(test), n
            )
            row = decode_rows(model, lists, decoder, tau, profile)
        out.append(
            {
                "model": model.name,
                "tau": tau,
                "length": int(n),
                "lists": len(lists),
                "recall@1": row["recall@1"],
                "ci95": {"recall@1": row["ci95"]["recall@1"]},
                "floor_recall@1": float(np.mean(lists["label"].to_numpy() == 0)),
                "delta_vs_floor": {"recall@1": row["delta_vs_floor"]["recall@1"]},
                "validity": row["validity"],
                "invalid_reasons": row.get("invalid_reasons", {}),
            }
        )
    return out


def cold_start_row(
    model: GenerativeReranker, decoder: str, tau: float | None, test: pd.DataFrame, profile: Profile
) -> dict:
    """The served path of users without history: the test lists with their histories removed, through
    `model.rank` as serving calls it (the bundle's cold-start ranker; a bundle without one decodes them). A row
    with R@1 against the floor (paired CI), validity, the share of lists it reorders and who ranked them."""
    requests = [
        RankRequest(str(u), list(c), []) for u, c in zip(test["user_id"], test["candidates"], strict=True)
    ]
    results = model.rank(requests, decoder, tau or 1.0)
    rankings = [
        [r.candidates.index(c) for c in res.ranking] for r, res in zip(requests, results, strict=True)
    ]
    row = evaluate(
        test,
        rankings,
        [res.valid for res in results],
        n_boot=profile.bootstrap_samples,
        seed=profile.seed,
        model="cold_start",
        tau=tau,
    )
    row["reordered"] = float(np.mean([k != sorted(k) for k in rankings])) if rankings else 0.0
    row["ranker"] = dict(Counter(res.ranker for res in results))
    row["served_by"] = f"{model.name} ({decoder})"
    return row
