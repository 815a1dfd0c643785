"""On-policy stages on the shared training loop: OPD and RL (docs/PAPER.md; RL is GR2 stage 3 for the AR teacher).

Both reuse `gr2.train.train` unchanged: each step's batch is a FRESH set of rollouts sampled from the current
model by `batches_fn(step)` (a `RolloutBatch`, i.e. a `Batch` plus trajectories, old log-probs, advantages or
the teacher's cached log-probs), and `loss_fn` replays it. So checkpoints, resume, lr schedule, grad clipping,
train_log.jsonl and the loss curve are the SFT/CFT ones. Determinism for resume: the prompts of step s and the
sampling generator are pure functions of (seed, s); the model at step s is restored from the checkpoint, so a
resumed run samples the same rollouts as the killed one would have. One optimiser step per rollout batch
(on-policy, rho = 1 at the step itself; the clip only bites if a batch were reused).

Per-step rollout statistics (reward, validity, kept groups, KL, clip fraction, sampling seconds) go to
out_dir/train/rollout_log.jsonl (truncated on resume like train_log.jsonl) and to out_dir/train/curves.png.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from gr2.candidates import shorten_some
from gr2.config import OPDConfig, Profile, RLConfig, TrainConfig
from gr2.generative import GenerativeReranker, load_bundle
from gr2.losses import Batch
from gr2.model import add_lora, load_model
from gr2.opd import OPD_RULES, make_opd_batch, opd_loss
from gr2.reward import response_reward
from gr2.rl import RolloutBatch, Sampling, group_advantages, grpo_loss, rollout_batch, sample
from gr2.rules import NO_RULES, DecodeRules
from gr2.stages.evaluate import decode_answers
from gr2.stages.prepare import SFTData
from gr2.stages.train_stages import write_bundle
from gr2.train import LOG_FILE, TrainResult, latest_checkpoint, process_state, train, truncate_log

log = logging.getLogger(__name__)
ROLLOUT_LOG = "rollout_log.jsonl"


# ---------------------------------------------------------------------------------------------- prompts
class TrainPrompts(NamedTuple):
    ids: list[list[int]]  # prompt token ids
    labels: list[int]  # the held-out item's index in each prompt
    pre_ranks: list[int]  # its retriever rank in the list (the reward's rank_before)
    sizes: list[int]  # candidates per prompt (a share of the lists is cut shorter: `shorten_some`)


def train_prompts(
    reranker: GenerativeReranker,
    examples: pd.DataFrame,
    max_prompts: int,
    seed: int,
    short_share: float = 0.0,
    shuffle: bool = False,
) -> TrainPrompts:
    """The prompts of (at most `max_prompts`, seeded sample of) the training lists the model can read, a
    `short_share` of them cut to a random shorter length (as the SFT lists: every length 2..N is served).
    labels and pre_ranks differ only with `shuffle`: each prompt then lists its candidates in a seeded random
    order, every candidate keeping its own evidence (retriever_rank included) - see RLConfig.shuffle_candidates."""
    df = examples[examples["split"] == "train"]
    n = reranker.n_candidates
    ok = df["candidates"].map(lambda cs: len(cs) == n and all(reranker.known_item(c) for c in cs))
    df = df[ok]
    if max_prompts > 0 and len(df) > max_prompts:
        df = df.sample(n=max_prompts, random_state=seed).sort_index()
    if df.empty:
        raise ValueError("no usable training lists (split == 'train' with known candidates)")
    df = shorten_some(df, short_share, seed)
    histories, candidates = df["history"].tolist(), df["candidates"].tolist()
    # training lists: their evidence must not count their own next item, as at SFT (gr2/stages/prepare.py)
    own = {"own_targets": df["target"].tolist(), "users": df["user_id"].tolist()}
    pre_ranks = df["label"].astype(int).tolist()
    sizes = [len(cs) for cs in candidates]
    if not shuffle:
        return TrainPrompts(
            reranker.encode_prompts(histories, candidates, **own), pre_ranks, pre_ranks, sizes
        )
    rng = random.Random(seed * 1_000_003 + 99)
    orders = [list(range(k)) for k in sizes]
    for order in orders:
        rng.shuffle(order)
    labels = [order.index(y) for order, y in zip(orders, pre_ranks, strict=True)]
    return TrainPrompts(
        reranker.encode_prompts(histories, candidates, orders, **own), labels, pre_ranks, sizes
    )


def prompts_for_step(n_prompts: int, per_step: int, step: int, seed: int) -> list[int]:
    """Prompt indices of a step: epochs over a seeded permutation (a pure function of (seed, step))."""
    per_epoch = max(1, n_prompts // per_step)
    epoch, k = divmod(step, per_epoch)
    order = list(range(n_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k * per_step : (k + 1) * per_step]


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + 17)


# ---------------------------------------------------------------------------------------------- batches
@dataclass(frozen=True, eq=False)
class RLBatches:
    """batches_fn for RL: G sampled rollouts per prompt, GR2 rewards, group advantages, zero-variance groups
    dropped (if every group is dropped, the batch keeps all rows with advantage 0: a zero-gradient step)."""

    model: torch.nn.Module
    prompts: list[list[int]]
    labels: list[int]  # the held-out item's index in each prompt
    pre_ranks: list[int]  # its retriever rank (the reward's rank_before)
    sizes: list[int]  # candidates per prompt
    tokenizer: Any
    rc: RLConfig
    block_size: int  # 0 = AR sampling
    max_new_tokens: int
    seed: int
    rules: DecodeRules = NO_RULES  # the serving decoders' rules (`train_rl`)

    def __call__(self, step: int) -> RolloutBatch:
        rc, G = self.rc, self.rc.group_size
        idx = prompts_for_step(len(self.prompts), rc.prompts_per_step, step, self.seed)
        rows_of = [i for i in idx for _ in range(G)]  # prompt index of each rollout
        rep = [self.prompts[i] for i in rows_of]
        t0 = time.perf_counter()
        how = Sampling(
            max_new_tokens=self.max_new_tokens,
            block_size=self.block_size,
            eos_id=self.tokenizer.eos_token_id,
            mask_id=self.tokenizer.mask_token_id,
            tau=rc.tau,
            temperature=rc.temperature,
            rules=self.rules,
        )
        ro = sample(self.model, rep, how, _generator(self.seed, step))
        sample_s = time.perf_counter() - t0
        scored = [
            response_reward(
                row,
                self.labels[i],
                self.sizes[i],
                self.tokenizer,
                alpha=rc.alpha,
                rank_before=self.pre_ranks[i],
                gain=rc.reward,
            )
            for i, row in zip(rows_of, ro.tokens.tolist(), strict=True)
        ]
        rewards = torch.tensor([r for r, _ in scored]).view(len(idx), G)
        adv, keep = group_advantages(rewards)
        rows = torch.nonzero(keep.repeat_interleave(G)).squeeze(-1)
        if len(rows) == 0:
            batch = rollout_batch(ro, self.tokenizer.eos_token_id)
        else:
            batch = rollout_batch(ro, self.tokenizer.eos_token_id, adv.flatten()[rows], rows)
        batch.step = step
        batch.stats = {
            "reward": float(rewards.mean()),
            "validity": float(np.mean([v for _, v in scored])),
            "groups_kept": int(keep.sum()),
            "groups": len(idx),
            "response_tokens": float(batch.scored.sum(-1).float().mean()),
            "nfe": ro.nfe,
            "sample_s": round(sample_s, 3),
        }
        return batch


@dataclass(frozen=True, eq=False)
class OPDBatches:
    """batches_fn for OPD: G' student rollouts per prompt with the teacher's log-probs cached on them."""

    student: torch.nn.Module
    teacher: torch.nn.Module
    prompts: list[list[int]]
    tokenizer: Any
    oc: OPDConfig
    block_size: int
    max_new_tokens: int
    seed: int

    def __call__(self, step: int) -> RolloutBatch:
        oc = self.oc
        device = next(self.student.parameters()).device
        if next(self.teacher.parameters()).device != device:  # train() placed the student (e.g. on a GPU)
            self.teacher.to(device)
        idx = prompts_for_step(len(self.prompts), oc.prompts_per_step, step, self.seed)
        t0 = time.perf_counter()
        how = Sampling(
            max_new_tokens=self.max_new_tokens,
            block_size=self.block_size,
            eos_id=self.tokenizer.eos_token_id,
            mask_id=self.tokenizer.mask_token_id,
            tau=oc.tau,
            temperature=oc.temperature,
            rules=OPD_RULES,  # not the serving decoders' rules: gr2/opd.py says why
        )
        prompts = [self.prompts[i] for i in idx]
        batch = make_opd_batch(
            self.student, self.teacher, prompts, oc.rollouts_per_prompt, how, _generator(self.seed, step)
        )
        batch.step = step
        batch.stats["sample_s"] = round(time.perf_counter() - t0, 3)
        batch.stats["response_tokens"] = float(batch.scored.sum(-1).float().mean())
        return batch


class LoggedLoss:
    """loss_fn(model, batch, rng) around a (loss, stats) function; writes one rollout-log line per step."""

    def __init__(self, fn, path: Path):
        self.fn, self.path = fn, path

    def __call__(self, model, batch: Batch, rng) -> torch.Tensor:
        if not isinstance(batch, RolloutBatch):  # what RLBatches / OPDBatches make
            raise TypeError(f"the on-policy losses need a RolloutBatch, got {type(batch).__name__}")
        loss, stats = self.fn(model, batch)
        # Rank 0 logs its own rollouts; "step" is the micro-batch index (gr2/train.py).
        if process_state().is_main_process:
            row = {"step": batch.step, "loss": float(loss.detach()), **batch.stats, **stats}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return loss


def _train_cfg(c, seed: int) -> TrainConfig:
    return TrainConfig(
        lr=c.lr,
        max_steps=c.steps,
        epochs=0.0,
        warmup=0,
        schedule="constant",
        weight_decay=0.0,  # on-policy fine-tuning: stay close to the start, no decay toward zero
        grad_clip=c.grad_clip,
        checkpoint_every=c.checkpoint_every,
        log_every=c.log_every,
        seed=seed,
        grad_accum=c.grad_accum,
        bf16=c.bf16,
    )


def _run(model, batches_fn, fn, cfg: TrainConfig, out: Path) -> TrainResult:
    """The shared loop, plus the rollout log truncated to the resumed step (as train.py does its own log)."""
    state = process_state()
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        ckpt = latest_checkpoint(out)
        start = int(ckpt.name.split("_")[1]) if ckpt is not None else 0
        # rows are keyed by micro-batch index: G = world size * grad_accum of them per step
        truncate_log(out / ROLLOUT_LOG, start * state.num_processes * cfg.grad_accum)
    state.wait_for_everyone()
    res = train(model, batches_fn, LoggedLoss(fn, out / ROLLOUT_LOG), cfg, out)
    if state.is_main_process:
        plot_curves(out)
    return res


def plot_curves(train_dir: str | Path) -> Path | None:
    """curves.png: loss, and reward / validity (RL) or KL (OPD) per step from the rollout log."""
    from gr2.plots import plt, save

    path = Path(train_dir) / ROLLOUT_LOG
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not rows:
        return None
    keys = [k for k in ("loss", "reward", "validity", "kl_forward", "kl_reverse") if k in rows[0]]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3))
    steps = [r["step"] for r in rows]
    for ax, k in zip(np.atleast_1d(axes), keys, strict=True):
        ax.plot(steps, [r[k] for r in rows], lw=1)
        ax.set_title(k)
        ax.set_xlabel("step")
    return save(fig, Path(train_dir) / "curves.png", dpi=100)


def _summary(res: TrainResult, out: Path) -> dict:
    rows = [json.loads(x) for x in (out / ROLLOUT_LOG).read_text().splitlines() if x.strip()]
    first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5) :]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs])) if rs and k in rs[0] else None  # noqa: E731
    keys = [k for k in ("reward", "validity", "kl_forward", "kl_reverse", "loss") if rows and k in rows[0]]
    secs = [json.loads(x)["elapsed_s"] for x in (out / LOG_FILE).read_text().splitlines() if x.strip()]
    return {
        "steps": res.step,
        **{f"{k}_first": mean(first, k) for k in keys},
        **{f"{k}_last": mean(last, k) for k in keys},
        "seconds_per_step": (secs[-1] / len(secs)) if secs else None,
        "curves": str(out / "curves.png"),
    }


# ---------------------------------------------------------------------------------------------- stages
def train_opd(
    student_bundle: str | Path,
    teacher_bundle: str | Path,
    data: SFTData,
    examples: pd.DataFrame,
    profile: Profile,
    out_dir: str | Path,
    direction: str | None = None,
) -> Path:
    """OPD of a (CFT) diffusion student from the frozen AR teacher on training prompts. Returns the bundle.

    `direction` overrides profile.opd.direction ("forward" | "reverse")."""
    out = Path(out_dir)
    oc = profile.opd
    direction = direction or oc.direction
    parent = load_bundle(student_bundle)
    student, tok = parent.model, parent.tokenizer
    teacher = load_bundle(teacher_bundle).model
    bs = int(student.config.gr2_block_size or 0)
    if bs < 1:
        raise ValueError(f"OPD needs a block-diffusion student; {student_bundle} has block_size {bs}")
    if int(getattr(teacher.config, "gr2_block_size", 0) or 0) != 0:
        raise ValueError(f"the OPD teacher must be an AR model; {teacher_bundle} is block diffusion")
    if len(data.tokenizer) != len(tok):
        raise ValueError("the SFT data and the student bundle have different vocabularies")
    teacher.requires_grad_(False)
    student = add_lora(student, profile.model)
    rr = GenerativeReranker(replace(parent, model=student))
    prompts = train_prompts(rr, examples, oc.max_prompts, profile.seed, profile.data.short_list_share).ids
    batches = OPDBatches(
        student=student,
        teacher=teacher,
        prompts=prompts,
        tokenizer=tok,
        oc=oc,
        block_size=bs,
        max_new_tokens=rr.max_new_tokens,
        seed=profile.seed,
    )
    fn = partial(opd_loss, block_size=bs, mask_id=tok.mask_token_id, direction=direction, rules=OPD_RULES)
    res = _run(student, batches, lambda m, b: fn(m, b), _train_cfg(oc, profile.seed), out / "train")
    meta = replace(
        parent.config,
        name="opd",
        stage="opd",
        parent=str(student_bundle),
        teacher=str(teacher_bundle),
        direction=direction,
        train=_summary(res, out / "train"),
    )
    log.info("train_opd (%s): %s", direction, meta.train)
    # The teacher travels with the student: the "spec" decoder's verifier (serving needs both).
    return write_bundle(out / "bundle", replace(parent, model=student, config=meta, verifier=teacher))


def validation_lists(examples: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    """A seeded sample of at most `n` validation lists (split "val"); empty when n is 0 or there are none."""
    val = examples[examples["split"] == "val"]
    if n <= 0:
        return val.iloc[:0]
    return val.sample(n=n, random_state=seed).sort_index() if len(val) > n else val


def validation_recall(
    reranker: GenerativeReranker, val: pd.DataFrame, decoder: str, tau: float, profile: Profile
) -> float | None:
    """recall@1 of greedy decoding on `val` as the evaluation scores it (invalid -> retriever order); None when
    there are no lists."""
    if val.empty:
        return None
    answers, _ = decode_answers(reranker, val, decoder, tau, profile)
    return float(np.mean([a.ranking[0] == y for a, y in zip(answers, val["label"], strict=True)]))


SHORT_VALIDATION_SHARE = 0.5  # of the lists that choose the operating tau, cut to 2..N-1 (what clients send)


def choose_tau(ar: dict, curve: list[dict], margin: float, min_validity: float) -> tuple[float, bool]:
    """`operating_tau`'s rule on validation figures ({"recall@1", "validity"}; curve: one per tau): (the lowest tau
    whose recall@1 >= ar's - margin and validity >= min_validity, True). When none is: (the lowest valid tau within
    the margin of the student's own best valid tau, False), since a student below `ar` at every tau gains nothing by
    decoding slower than its best (Beauty at 5bb07a2: -0.008 at each of 0.4-1.0, and the old fallback, the highest
    tau, halved the speed); the highest tau when no tau is valid."""
    valid = [c for c in curve if c["validity"] >= min_validity]
    ok = [c for c in valid if c["recall@1"] >= ar["recall@1"] - margin]
    if ok:
        return min(c["tau"] for c in ok), True
    if valid:
        best = max(c["recall@1"] for c in valid)
        return min(c["tau"] for c in valid if c["recall@1"] >= best - margin), False
    return max(c["tau"] for c in curve), False


def holds_rule(
    point: dict, ar: dict, curve: list[dict], within: bool, margin: float, min_validity: float
) -> bool:
    """Whether `point` (the student in another dtype at the chosen tau) holds what chose that tau (`choose_tau`):
    valid, and within the margin of `ar` when the tau was (`within`), else within it of the student's best valid
    tau. Judged against `ar` alone, a bf16 student was refused for the float32 student's own gap (Beauty at
    b02afb0: bf16 0.447, float32 0.446, `ar` 0.454), and served at float32's slower throughput for nothing."""
    valid = [c["recall@1"] for c in curve if c["validity"] >= min_validity]
    if point["validity"] < min_validity or not valid:  # no valid float32 tau: nothing to hold
        return False
    return point["recall@1"] >= (ar["recall@1"] if within else max(valid)) - margin


def operating_tau(student: GenerativeReranker, val: pd.DataFrame, profile: Profile) -> dict[str, Any]:
    """The student's operating tau, chosen on validation (profile.diffusion.tau_margin): the lowest tau of
    diffusion.taus whose recall@1 on `val` (half of it cut to 2..N-1 candidates) is at least the AR teacher's on
    the same lists minus tau_margin, with validity >= gate.min_validity; when none is, the lowest within the margin
    of the student's own best (`choose_tau`). The AR teacher's answers are the `spec` decoder's (its tokens are the
    verifier's AR greedy ones). Returns the choice, its curve, and the student in bfloat16 at the chosen tau under
    the same rule ("bfloat16": its figures and "within"); without a margin, validation lists or the verifier, the
    profile's eval_tau."""
    dc = profile.diffusion
    if dc.tau_margin is None or val.empty or student.verifier is None:
        why = (
            "no tau_margin"
            if dc.tau_margin is None
            else "no validation lists"
            if val.empty
            else "no verifier"
        )
        return {"tau": dc.eval_tau, "chosen_by": f"profile diffusion.eval_tau ({why})"}
    lists = shorten_some(val, SHORT_VALIDATION_SHARE, profile.seed)
    labels = lists["label"].tolist()

    def score(decoder: str, tau: float, model: GenerativeReranker = student) -> dict[str, float]:
        answers, _ = decode_answers(model, lists, decoder, tau, profile)
        hits = [a.ranking[0] == y for a, y in zip(answers, labels, strict=True)]
        return {"recall@1": float(np.mean(hits)), "validity": float(np.mean([a.valid for a in answers]))}

    ar = score("spec", dc.spec_tau)
    curve = [{"tau": t, **score("diffusion", t)} for t in sorted(dc.taus)]
    tau, within = choose_tau(ar, curve, dc.tau_margin, profile.gate.min_validity)
    # The same student in bfloat16 at that tau, under the same rule: where it holds, serving may decode in bf16
    # (serving/predictor.py `serving_dtype`: on CPUs with bf16 units, where it is faster under load).
    half = GenerativeReranker(replace(student.bundle, model=copy.deepcopy(student.model)))
    half.cast("bfloat16")
    bf16: dict[str, Any] = {"tau": tau, **score("diffusion", tau, half)}
    bf16["within"] = holds_rule(bf16, ar, curve, within, dc.tau_margin, profile.gate.min_validity)
    return {
        "tau": tau,
        "chosen_by": "validation"
        if within
        else "validation: no tau within the margin of ar; the lowest within it of the student's best",
        "lists": len(lists),
        "short_share": SHORT_VALIDATION_SHARE,
        "margin": dc.tau_margin,
        "min_validity": profile.gate.min_validity,
        "ar": ar,
        "curve": curve,
        "bfloat16": bf16,
    }


def rl_config(profile: Profile, block_size: int) -> RLConfig:
    """The RL config for a bundle's decoder. The DAG runs the one `rl` step twice and the input bundle's
    block size picks the config: the AR teacher (block_size 0, GR2 stage 3 after SFT) trains under
    `profile.ar_rl`, the block-diffusion student (block_size > 0, after OPD) under `profile.rl`."""
    return profile.rl if block_size > 0 else profile.ar_rl


def train_rl(
    bundle: str | Path, data: SFTData, examples: pd.DataFrame, profile: Profile, out_dir: str | Path
) -> Path:
    """GRPO/DAPO on training prompts with the GR2 reward; the decoder follows the bundle (AR: profile.ar_rl,
    GR2 stage 3; block diffusion: profile.rl, from the OPD checkpoint). Returns the bundle."""
    out = Path(out_dir)
    parent = load_bundle(bundle, with_verifier=True)
    model, tok = parent.model, parent.tokenizer
    bs = int(model.config.gr2_block_size or 0)
    rc = rl_config(profile, bs)
    model = add_lora(model, profile.model)
    if len(data.tokenizer) != len(tok):
        raise ValueError("the SFT data and the bundle have different vocabularies")
    rr = GenerativeReranker(replace(parent, model=model))
    prompts = train_prompts(
        rr, examples, rc.max_prompts, profile.seed, profile.data.short_list_share, rc.shuffle_candidates
    )
    # Rollouts decode as the served model does, so RL optimises the rankings it will serve (rr.rules).
    batches = RLBatches(
        model=model,
        prompts=prompts.ids,
        labels=prompts.labels,
        pre_ranks=prompts.pre_ranks,
        sizes=prompts.sizes,
        tokenizer=tok,
        rc=rc,
        block_size=bs,
        max_new_tokens=rr.max_new_tokens,
        seed=profile.seed,
        rules=rr.rules,
    )
    fn = partial(
        grpo_loss,
        block_size=bs,
        mask_id=tok.mask_token_id,
        temperature=rc.temperature,
        clip_eps=rc.clip_eps,
        clip_eps_high=rc.clip_eps_high,
        certainty_weight=rc.certainty_weight,
        eos_id=tok.eos_token_id,
        rules=rr.rules,
    )
    val = validation_lists(examples, rc.val_lists, profile.seed)
    decoder = "diffusion" if bs > 0 else "ar"
    # The guard decodes at the profile's operating tau (what the gate judges and serving decodes, unless
    # diffusion.tau_margin chooses another below), not at the rollouts' tau: RL can help at one and hurt at the other.
    guard_tau = profile.diffusion.eval_tau
    before = validation_recall(rr, val, decoder, guard_tau, profile)
    res = _run(model, batches, lambda m, b: fn(m, b), _train_cfg(rc, profile.seed), out / "train")
    after = validation_recall(rr, val, decoder, guard_tau, profile)
    kept = "parent" if before is not None and after is not None and after < before else "rl"
    if kept == "parent":  # RL lowered recall on lists it never trained on: serve the parent's weights
        model = load_model(Path(bundle) / "model")[0]  # only the weights: the rest is loaded already
    validation: dict[str, Any] = {
        "lists": len(val),
        "tau": guard_tau if bs > 0 else None,
        "recall@1_parent": before,
        "recall@1_rl": after,
        "kept": kept,
    }
    tau, serve_dtype = parent.config.tau, parent.config.serve_dtype
    if bs > 0:  # the student's operating tau, on the weights it keeps (and whether bf16 holds it)
        chosen = operating_tau(GenerativeReranker(replace(parent, model=model)), val, profile)
        validation["operating_tau"] = chosen
        tau = chosen["tau"]
        if "bfloat16" in chosen:
            serve_dtype = "bfloat16" if chosen["bfloat16"]["within"] else "float32"
    meta = replace(
        parent.config,
        name="rl" if bs > 0 else "ar",
        stage="rl" if bs > 0 else "sft+rl",
        parent=str(bundle),
        tau=tau,
        serve_dtype=serve_dtype,
        rl_config=asdict(rc),
        train=_summary(res, out / "train"),
        validation=validation,
    )
    log.info("train_rl (block_size %d): %s; validation %s", bs, meta.train, meta.validation)
    return write_bundle(out / "bundle", replace(parent, model=model, config=meta))
