"""Frozen dataclass configs, loaded from YAML profiles (profiles/<name>.yaml).

One `Profile` holds every stage's settings so a run is described by a single file plus overrides.
Sections a stage does not use are simply ignored by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class DataConfig:
    history_len: int = 20  # H: most recent items before the target kept as history
    n_candidates: int = 10  # N: candidate list length (the paper's N = 10)
    max_train_examples: int = 0  # 0 = all retrieval-hit training lists
    max_eval_examples: int = 0  # 0 = all (validation/test)
    # k: each user's last k positions are test targets and the k before them validation targets (1 = the
    # papers' leave-one-out; more gives a small catalogue enough test lists: gr2/data/split.py).
    eval_positions: int = 1
    # Share of the training lists (SFT, CFT, OPD, RL) cut to a random length 2..N-1, keeping the held-out item
    # and the retriever order (gr2/candidates.py `shorten_some`): clients send any length from 2 to N.
    short_list_share: float = 0.25


@dataclass(frozen=True)
class RetrieverConfig:
    window: int = 3  # co-occurrence window (positions) inside a user's training sequence
    recent: int = 5  # how many recent history items vote for candidates
    decay: float = 0.7  # recency weight decay per step back in history


@dataclass(frozen=True)
class EvidenceConfig:
    top_k: int = 200  # neighbours kept per item in the served tables (transition and co-occurrence lists)
    window: int = 3  # co-occurrence window (positions), as the retriever's
    recent: int = 5  # recent history items that vote for "transition from any recent item"
    decay: float = 0.7  # recency weight decay per step back in history
    max_title_tokens: int = 32  # title tokens kept per item (content similarity)


@dataclass(frozen=True)
class SequenceConfig:
    """A SASRec next-item model on the training sequences (gr2/sequential.py): the history read as a sequence, which
    the count features see only as pairs (docs/RESULTS.md, 'Beyond the GBDT (issue #40)')."""

    # 0: no `sequence` evidence feature. k >= 2: fitted at ingest, k models without one fold of users each (they score
    # the training lists, out of fold) and one on all training sequences (every other list): k + 1 fits in all.
    folds: int = 0
    max_len: int = 20  # the last items of a history it reads (the profiles' data.history_len)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    dropout: float = 0.2
    # fixed, not early-stopped: the validation lists judge the result, so they cannot also stop the training
    epochs: int = 40
    batch_size: int = 128
    lr: float = 1e-3


@dataclass(frozen=True)
class LTRConfig:
    model: str = "gbdt"  # "gbdt" | "logreg"
    max_train_lists: int = 20000
    n_threads: int = 1  # OpenMP threads for the GBDT (oversubscribed spin-waits are very slow on 2 cores)


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_ff: int = 512
    max_len: int = 512
    n_kv_head: int = 0  # 0 = n_head (no grouped-query attention)
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    # A pretrained transformers causal LM instead of the fresh Llama above (whose sizes are then ignored): a local
    # folder, a .gguf file, or a hub id read from the local cache only (gr2/model.py load_pretrained).
    pretrained: str = ""
    lora_rank: int = 0  # > 0: train LoRA adapters (peft) + the embeddings, not the whole backbone
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-3
    batch_size: int = 32
    max_steps: int = 1000
    epochs: float = 3.0
    warmup: int = 50
    weight_decay: float = 0.01
    answer_weight: float = 1.0  # lambda_o
    trace_weight: float = 0.5  # lambda_r < lambda_o (GR2)
    checkpoint_every: int = 200
    log_every: int = 20
    seed: int = 0  # batch order and per-step noise derive from (seed, step): resume replays them exactly
    grad_clip: float = 1.0
    schedule: str = "cosine"  # "cosine" (linear warmup, cosine to min_lr_ratio * lr) | "constant" (OPD/RL)
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    keep_checkpoints: int = 2  # newest checkpoints kept in out_dir/checkpoints
    # Micro-batches of batch_size per process per optimizer step: the global batch is
    # batch_size * grad_accum * world_size (gr2/train.py).
    grad_accum: int = 1
    bf16: bool = False  # bfloat16 autocast of forward + loss (weights, gradients and AdamW stay fp32)


@dataclass(frozen=True)
class DiffusionConfig:
    block_size: int = 8
    taus: tuple[float, ...] = (1.0, 0.9, 0.6, 0.4)
    # The operating tau: the gate judges the student there, its bundle records it (reranker.json "tau", read by
    # BundleConfig.operating_tau into GenerativeReranker.tau) and serving decodes at it by default; a decode or
    # rank call with tau None means it. 0.9 is the papers' parity point; every default tau in the code is this
    # one (profiles set their own).
    eval_tau: float = 0.9
    # The operating tau chosen on validation (gr2/stages/opd_rl.py `operating_tau`): after RL, the lowest of `taus`
    # whose R@1 on validation lists (half of them cut to 2..N-1 candidates, as clients send) is within tau_margin
    # of the AR teacher's on the same lists, at validity >= gate.min_validity; when none is, the lowest within it of
    # the student's own best tau (`choose_tau`). None: eval_tau, as set above.
    tau_margin: float | None = 0.005
    # The spec decoder's draft threshold. spec's output is AR's whatever the draft (gr2/decode.py spec_generate), so
    # this only trades draft forwards against verifier forwards: chosen on validation speed (docs/RESULTS.md,
    # 'The operating tau', its last paragraph).
    spec_tau: float = 0.4
    noise_eps: float = 1e-3  # CFT noise level t ~ U(noise_eps, 1] per block (bounds the 1/t weight)
    complementary: bool = True  # CFT: second view masks exactly the complement (Fast-dLLM v2)
    loss_weighting: str = "inv_t"  # "inv_t" (masked-diffusion ELBO weight 1/t) | "none"
    pad_weight: float = 0.0  # loss weight of block-padding positions after the response (0 = excluded)
    # CFT targets: "teacher" = the AR teacher's greedy response to each SFT prompt (sequence-level distillation;
    # see gr2/stages/train_stages.py teacher_records), "sft" = the SFT responses themselves (the reasoning teacher's trace and answer, per teacher.answer).
    cft_targets: str = "teacher"
    # CFT certainty forcing (dParallel): + this weight * entropy at masked positions the student already predicts
    # right (gr2/losses.py _masked_ce): more positions clear tau per round (docs/RESULTS.md, 'Certainty forcing
    # and teacher targets in CFT').
    certainty_weight: float = 1.0


@dataclass(frozen=True)
class GateConfig:
    min_validity: float = 0.99
    max_gap_to_ar: float = 0.01
    # The production ranker's baseline: a GBDT on the same evidence (`ltr`). A candidate more than this below it
    # in recall@1 is refused: the platform would be better off serving the GBDT.
    max_gap_to_ltr: float = 0.01
    min_speedup: float = 2.4
    require_beats_floor: bool = True
    # Champion against challenger on tonight's test lists: the candidate fails when the paired 95% CI of its
    # recall@1 minus production's lies wholly below -max_drop_vs_production (gr2/gate.py, production rule).
    max_drop_vs_production: float = 0.005


@dataclass(frozen=True)
class SIDConfig:
    n_levels: int = 3  # residual k-means (RQ) levels; a 4th de-dup level is appended (TIGER)
    codebook_size: int = (
        0  # K per level; 0 = derive from catalog size (pow2 >= 2 sqrt(n_items), in [16, max])
    )
    max_codebook_size: int = 256  # TIGER: 3 x 256 for Beauty's 12k items
    kmeans_iters: int = 20
    unique_last_level: bool = True  # collision-aware level 3: distinct codes inside each shared 2-code prefix
    svd_dim: int = 32  # collaborative item factors (truncated SVD of training co-occurrence)
    cooc_window: int = 5  # positions inside a training sequence that count as co-occurring
    content_weight: float = 1.0  # title embedding block (all-MiniLM-L6-v2)
    collab_weight: float = 1.0
    category_weight: float = 0.5  # category TF-IDF block (also the content when there are no titles)
    text_batch_size: int = 128
    text_max_tokens: int = 48


@dataclass(frozen=True)
class PromptConfig:
    n_buckets: int = 4  # evidence bucket tokens per feature (0..n_buckets-1)
    max_labels: int = 26  # candidate labels in the vocabulary (A..Z); N <= max_labels
    score_levels: int = (
        8  # the trace's per-candidate score levels <score_0> .. <score_{L-1}> (gr2/teacher.py)
    )
    # Semantic IDs shown in the prompt: "none" (labels and evidence buckets only), "candidates" (+ each
    # candidate's SID), "all" (+ the history's SIDs). Chosen on validation (docs/RESULTS.md, 'The SFT recipe').
    item_tokens: str = "none"
    # How a list shorter than N is laid out (gr2/prompt.py SHORT_LISTS). Why: the model reads a candidate's evidence
    # by its distance from the trace entry it writes, and with [A] first and nothing after the last candidate
    # ("as_is") a shorter list moves every distance: the AR teacher of lists of 10 wrote wrong traces for lists of
    # 5 and 7 (validation R@1 0.06-0.07 below `ltr` there). "fill" puts <empty> tokens where the absent candidates
    # would sit, so every candidate keeps a full list's distances and a list of N is what it was; "last_first" lists
    # them from the last label down (the same distance at every length, but a list of N changes: ML-100K lost
    # 0.014-0.018 at 10). docs/RESULTS.md, 'Short lists'.
    short_lists: str = "fill"
    # Decode the answer as a permutation: every decoder writes each candidate's label at most once (gr2/rules.py
    # `unique`). Without it parallel decoding writes one label at two ranks of one block (docs/RESULTS.md, 'The
    # permutation rule').
    unique_labels: bool = True
    # The answer follows the trace: once the trace is written, the answer's k-th label must be a candidate with
    # the trace's k-th highest score level (gr2/rules.py `answer_slots`; needs unique_labels). Every decoder, RL's
    # sampler and its replay apply it. Chosen on validation (docs/RESULTS.md, 'Answers that follow their trace').
    follow_trace: bool = True
    # The response has the shape its list's length n fixes: the trace's n labels in order, one score level each,
    # the answer's head, n labels with separators, its tail, eos (gr2/rules.py `Layout`; needs unique_labels).
    # Every decoder, RL's sampler and its replay apply it. Why: a model trained on lists of 10 wrote malformed
    # answers for lists of 2 (validity 0.689, docs/SERVING.md); with it every answer parses.
    fixed_layout: bool = True


@dataclass(frozen=True)
class TeacherConfig:
    l2: float = 1e-3  # ridge on the conditional-logit weights
    max_train_lists: int = 50000  # training lists used to fit the teacher (0 = all)
    # The SFT answer: "teacher" = the teacher's own ranking (distillation: the answer orders the trace's
    # verdicts), "label" = the held-out item first, then the teacher's order, "levels" = by the trace's levels,
    # ties in retriever order (the answer a function of the trace). Chosen on validation on two datasets
    # (docs/RESULTS.md, 'The SFT recipe' and 'Tokens per forward and block size'); RL then trains on the
    # held-out items' reward.
    answer: str = "teacher"
    # What the teacher reads: "buckets", each feature's prompt bucket (gr2/teacher.py), so that the trace is a
    # function of the prompt the student sees, or the "raw" evidence. Chosen on validation on two datasets
    # (docs/RESULTS.md, 'A trace the student can compute').
    inputs: str = "buckets"


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int = 64  # decoding batch for the accuracy rows (whole test split)
    speed_examples: int = 32  # test lists decoded one at a time (batch 1) for the speed rows
    speed_batch: int = 32  # the serving batch measured beside batch 1
    speed_batch_examples: int = 128  # lists decoded at speed_batch
    threads: int = 2  # torch threads while timing (the same for every decoder)
    # Every speed plan runs this many times, interleaved (AR, then each diffusion plan, then again); a row's
    # speedup is the geometric mean over the repeats with a 95% interval, whose lower bound the gate reads (more
    # repeats, a narrower interval; docs/RESULTS.md, 'Timing noise, speed repeats, and where the time goes', has
    # the widths).
    speed_repeats: int = 10
    # The report's table by list length: the test lists cut to each length (keeping the held-out item), decoded
    # by `ar` and the deployed student (gr2/stages/evaluate.py `length_rows`); the full length N reuses the main
    # rows.
    list_lengths: tuple[int, ...] = (2, 3, 5, 7, 10)


@dataclass(frozen=True)
class OPDConfig:
    """On-policy distillation (docs/PAPER.md, OPD): student rollouts scored by the frozen AR teacher.

    Optimiser settings are flat (not a nested TrainConfig) so dotted overrides like opd.lr keep the defaults."""

    rollouts_per_prompt: int = 4  # G'
    prompts_per_step: int = 8  # 128 in the paper
    direction: str = "reverse"  # "reverse": KL(student || teacher) | "forward": KL(teacher || student)
    temperature: float = 1.0  # rollout sampling temperature (on-policy: 1.0)
    tau: float = (
        DiffusionConfig.eval_tau
    )  # commit threshold of the rollout decoder (the operating tau's default)
    max_prompts: int = 2000  # training lists the prompts are drawn from (0 = all)
    lr: float = 5e-5  # constant; the paper's 8B value (docs/PAPER.md, OPD) scaled up for the tiny CPU models
    steps: int = 30
    grad_clip: float = 1.0
    checkpoint_every: int = 10
    log_every: int = 5
    grad_accum: int = 1  # rollout batches per process per optimizer step (TrainConfig.grad_accum)
    bf16: bool = False


REWARD_GAINS = ("rank", "dcg")  # RLConfig.reward (gr2/reward.py)


@dataclass(frozen=True)
class RLConfig:
    """GRPO/DAPO (docs/PAPER.md, RL; GR2 stage 3); one implementation for the AR teacher and the diffusion student."""

    group_size: int = 8  # G rollouts per prompt
    prompts_per_step: int = 8
    alpha: float = 0.2  # conditional format bonus weight
    # How the reward measures the held-out item's promotion (gr2/reward.py): "rank", GR2's linear
    # (before - after) / N; "dcg", the change in its DCG, which pays for the top places as R@1 judges them.
    reward: str = "rank"
    clip_eps: float = 0.2  # epsilon_low
    clip_eps_high: float = 0.2  # epsilon_high (> clip_eps = DAPO clip-higher, e.g. 0.28)
    temperature: float = 1.0  # rollout sampling temperature (group diversity)
    tau: float = DiffusionConfig.eval_tau  # commit threshold of the diffusion rollout decoder (likewise)
    max_prompts: int = 2000  # training lists the prompts are drawn from (0 = all)
    # Show each RL prompt's candidates in a seeded random order (each keeps its own evidence, retriever_rank
    # included; the reward still measures promotion against the retriever order). In retriever order, letter A
    # is the retriever's first candidate, and AR RL learned to put A on top far more often than SFT did, a prior
    # that helps or hurts with the split's share of lists whose held-out item is first (the GR2 TR's
    # "position-bias hacking"). Shuffled, the letter carries no position. Off in the bench profile: it removed
    # the drift but did not make `ar` beat `ar_sft` on test (docs/RESULTS.md, 'AR RL', has the measurements).
    shuffle_candidates: bool = False
    lr: float = 1e-5  # constant; the paper's 8B value (docs/PAPER.md, RL) scaled up for the tiny models
    steps: int = 30
    grad_clip: float = 1.0
    checkpoint_every: int = 10
    log_every: int = 5
    grad_accum: int = 1  # rollout batches per process per optimizer step (TrainConfig.grad_accum)
    bf16: bool = False
    # Certainty forcing through RL (block-diffusion student only; gr2/rl.py rollout_certainty): + this weight *
    # entropy at masked rollout positions the student already predicts right, so RL keeps the tokens per forward
    # that CFT's certainty forcing bought (diffusion.certainty_weight). 0 = off.
    certainty_weight: float = 0.0
    # Validation lists (seeded sample of split "val"; 0 = no check) on which the RL weights must score at least
    # the parent's recall@1 (greedy, at diffusion.eval_tau) to replace them; otherwise the stage keeps the parent's weights
    # and says so in its bundle metadata ("validation"). RL that raises the training reward can lower recall on
    # lists it never saw (docs/RESULTS.md, 'AR RL'). The student's operating tau is chosen on the same lists. Why
    # thousands: on 500 a paired R@1 difference has a standard error near 0.015, three times the tau rule's margin,
    # and both the guard and the chooser flipped on noise (docs/RESULTS.md, 'AR RL').
    val_lists: int = 5000

    def __post_init__(self) -> None:
        if self.reward not in REWARD_GAINS:
            raise ValueError(f"rl.reward {self.reward!r}: expected one of {REWARD_GAINS}")


@dataclass(frozen=True)
class CanaryConfig:
    """Automated canary analysis (deploy/canary.py): traffic steps and the canary-vs-stable thresholds."""

    steps: tuple[int, ...] = (10, 50, 100)  # canaryTrafficPercent per step, increasing; then promote
    step_seconds: float = 300.0  # live traffic observed per step, after the probes
    probe_size: int = 50  # recent requests (the newest test lists) sent to both revisions at every step
    min_requests: int = 50  # requests the canary must have answered in a step to be judged at all
    max_error_rate_increase: float = 0.01  # canary 5xx rate <= stable's + this
    max_p99_ratio: float = 1.5  # canary p99 latency <= stable's * this + p99_slack_s
    p99_slack_s: float = 0.05
    max_validity_drop: float = 0.01  # canary validity >= stable's - this
    max_fallback_increase: float = 0.01  # canary fallback rate <= stable's + this
    min_agreement: float = 0.6  # mean top-k overlap of the two revisions' rankings of the probes
    agreement_k: int = 3


@dataclass(frozen=True)
class DriftConfig:
    """Drift of tonight against production (gr2/drift.py): crossing a threshold is a warning in the report, the
    run's outcome and the KFP UI; it does not stop the run (the gate judges the model)."""

    bins: int = 10  # PSI bins: the production data's deciles of each distribution
    # Population stability index per distribution (history length, item popularity, each evidence feature):
    # above 0.2 is the usual "significant shift" (below 0.1 "no shift").
    max_psi: float = 0.2
    max_new_users: float = 0.2  # share of tonight's users production's data did not have
    max_new_items: float = 0.2  # share of tonight's items (with events) production's data did not have
    # Predictions, production against the candidate on tonight's test lists. Measured on a Beauty calibration
    # slice (docs/NIGHTLY.md): two trained students agree on 0.81 of top-1s (Spearman 0.84); a trained model and
    # the upstream order agree on 0.45-0.49 (Spearman 0.65-0.72). The thresholds sit below the upstream order's
    # level: a model that falls back to the retriever order is the gate's business (floor and production rules);
    # the warning is for a model that ranks unlike production more than not re-ranking at all would.
    min_top1_agreement: float = 0.4  # share of lists whose top-1 is the same
    min_rank_corr: float = 0.5  # mean Spearman correlation of the two rankings of a list
    max_values: int = 20000  # values kept per distribution in a night's data profile (a seeded sample)


@dataclass(frozen=True)
class Profile:
    name: str = "quick"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    ltr: LTRConfig = field(default_factory=LTRConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: TrainConfig = field(default_factory=TrainConfig)
    cft: TrainConfig = field(default_factory=TrainConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    sid: SIDConfig = field(default_factory=SIDConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    ar_rl: RLConfig = field(default_factory=RLConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    bootstrap_samples: int = 1000

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    """Build a (nested) frozen dataclass from a dict, rejecting unknown keys by name."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        default = getattr(cls(), name) if name in known else None
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            kwargs[name] = _build(type(default), value, f"{where}.{name}")
        elif isinstance(default, tuple):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def profile_from_dict(raw: dict[str, Any], where: str = "profile") -> Profile:
    return _build(Profile, raw, where)


def load_profile(name_or_path: str, overrides: dict[str, Any] | None = None) -> Profile:
    """Load `profiles/<name>.yaml` (or a path), then apply dotted overrides like {"sft.max_steps": 10}."""
    raw, path = profile_raw(name_or_path, overrides)
    return profile_from_dict(raw, where=str(path))


def profile_raw(name_or_path: str, overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], Path]:
    """(the profile's raw dict with the dotted overrides applied, its file): what `load_profile` builds from."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"profile {name_or_path!r} not found ({path}); available: {available}")
    raw = yaml.safe_load(path.read_text()) or {}
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    raw.setdefault("name", path.stem)
    return raw, path
