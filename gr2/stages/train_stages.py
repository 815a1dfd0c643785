"""The training stages built on the shared loop (gr2/train.py): AR teacher SFT (GR2), and AR -> block-diffusion
conversion + conversion fine-tuning (CFT). Each writes a servable bundle (gr2/generative.py) plus its training
log and loss curve; each resumes from its checkpoints when re-run on the same folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from gr2.config import DiffusionConfig, Profile, TrainConfig
from gr2.generative import (
    Bundle,
    BundleConfig,
    BundlePrompt,
    GenerativeReranker,
    decode_rules,
    load_bundle,
    save_bundle,
)
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import add_lora, build_backbone, convert_to_diffusion, n_params
from gr2.stages.prepare import SFTData
from gr2.teacher import SFTRecord
from gr2.train import BucketedBatches, LossFn, TrainResult, process_state, train

log = logging.getLogger(__name__)


def _max_new_tokens(records: list[SFTRecord], block_size: int) -> int:
    """Longest training response plus one block of slack, rounded up to a block multiple."""
    longest = max(len(r.response_ids) for r in records)
    b = max(block_size, 1)
    return -(-(longest + b) // b) * b


def _fit(
    model: torch.nn.Module, records: list[SFTRecord], collate_fn, loss_fn: LossFn, cfg: TrainConfig, out: Path
) -> TrainResult:
    batches = BucketedBatches(records, cfg.batch_size, collate_fn, seed=cfg.seed)
    return train(model, batches, loss_fn, cfg, out)


def write_bundle(out_dir: str | Path, bundle: Bundle) -> Path:
    """save_bundle on rank 0 only: a stage may run in N processes (gr2/train.py); every rank waits for it."""
    state = process_state()
    if state.is_main_process:
        save_bundle(out_dir, bundle)
    state.wait_for_everyone()
    return Path(out_dir)


def _summary(res: TrainResult, model: torch.nn.Module, n_records: int) -> dict:
    return {
        "steps": res.step,
        "final_loss": float(sum(res.losses[-20:]) / max(len(res.losses[-20:]), 1)) if res.losses else None,
        "tokens_per_s": round(res.tokens_per_s, 1),
        "n_params": n_params(model),
        "n_records": n_records,
        "loss_curve": str(res.out_dir / "loss_curve.png") if res.out_dir else None,
    }


def train_ar_teacher(data: SFTData, profile: Profile, out_dir: str | Path, variant: str = "trace") -> Path:
    """SFT of the AR re-ranker on prompt -> (trace, answer), answer weighted above trace. Returns the bundle.

    variant "ar_no_trace" trains the same model on answers only (what the trace buys)."""
    out = Path(out_dir)
    records = data.records[variant]
    tok = data.tokenizer
    torch.manual_seed(profile.seed)
    model = build_backbone(profile.model, tok, profile.seed)  # fresh, or pretrained (+ LoRA): gr2/model.py
    res = _fit(
        model, records, partial(collate, pad_id=tok.pad_token_id), ar_batch_loss, profile.sft, out / "train"
    )
    meta = BundleConfig(
        name="ar_sft" if variant == "trace" else "ar_no_trace",  # "ar" once RL (GR2 stage 3) ran
        stage="sft",
        variant=variant,
        n_candidates=profile.data.n_candidates,
        # how the bundle renders prompts (item_tokens, ...)
        prompt=BundlePrompt.from_dict(dataclasses.asdict(profile.prompt)),
        max_new_tokens=_max_new_tokens(records, 1),
        train=_summary(res, model, len(records)),
        profile=profile.name,
        # every bundle trained from this one carries it (their configs copy this one)
        cold_start=None if data.cold_start is None else data.cold_start.to_dict(),
    )
    log.info("train_ar_teacher %s: %s", variant, meta.train)
    return write_bundle(out / "bundle", Bundle(model, tok, data.sids, data.evidence, meta))


def convert(
    ar_bundle: str | Path, diffusion: DiffusionConfig, out_dir: str | Path, name: str = "naive"
) -> Path:
    """Naive conversion (docs/PAPER.md, Conversion): copy every AR weight unchanged; only block size
    (diffusion.block_size) and mask token change. The bundle, and every bundle trained from it, records the
    students' operating commit threshold (diffusion.eval_tau: the one the gate judges) as "tau" and the spec
    decoder's draft threshold (diffusion.spec_tau): serving decodes at them unless a request names another tau."""
    block_size = diffusion.block_size
    ar = load_bundle(ar_bundle)
    student = convert_to_diffusion(ar.model, block_size, ar.tokenizer.mask_token_id)
    meta = replace(
        ar.config,
        name=name,
        stage="convert",
        parent=str(ar_bundle),
        tau=diffusion.eval_tau,
        spec_tau=diffusion.spec_tau,
        max_new_tokens=-(-ar.config.max_new_tokens // block_size) * block_size + block_size,
    )
    return write_bundle(out_dir, replace(ar, model=student, config=meta))


TEACHER_TARGETS = "teacher_targets.pt"


def teacher_records(
    teacher: GenerativeReranker, records: list[SFTRecord], profile: Profile, cache: Path | None = None
) -> tuple[list[SFTRecord], dict]:
    """Sequence-level distillation targets for CFT: the AR teacher's greedy response to every SFT prompt.

    Why: an SFT answer puts the held-out item first, and which item that is cannot be read off the prompt, so one
    prompt has many plausible responses. A block-diffusion student trained on them spreads each masked position over
    those modes, and few positions clear tau in a round. The teacher's greedy response is one function of the
    prompt; trained on it, the student's predictions are confident and it commits more tokens per forward. This
    is the standard remedy of non-autoregressive decoding (sequence-level KD: Kim & Rush 2016; Gu et al. 2018).

    `teacher` decodes with the AR decoder (a naive conversion holds the teacher's weights unchanged). Where its
    response is invalid the SFT response is kept, so no prompt is dropped. Weights follow encode_example: trace
    tokens sft.trace_weight, answer and eos sft.answer_weight. `cache`: the targets are saved there and reloaded
    on a resumed run (same targets, no second decode)."""
    if cache is not None and cache.exists():
        saved = torch.load(cache)
        return [SFTRecord(*r) for r in saved["records"]], saved["stats"]
    tok = teacher.tokenizer
    open_id = tok.convert_tokens_to_ids("{")
    batch = profile.eval.batch_size
    sft = profile.sft
    out: list[SFTRecord] = []
    n_teacher = n_same = 0
    t0 = time.perf_counter()
    for b0 in tqdm(range(0, len(records), batch), disable=None, desc="teacher targets", unit="batch"):
        chunk = records[b0 : b0 + batch]
        decoded = teacher.decode([list(r.prompt_ids) for r in chunk], "ar", 1.0, batch)
        for r, resp in zip(chunk, decoded.responses, strict=True):
            if teacher.read_answer(resp, teacher.prompt_candidates(r.prompt_ids)).valid and open_id in resp:
                a = resp.index(open_id)
                w = [sft.trace_weight] * a + [sft.answer_weight] * (len(resp) - a)
                out.append(SFTRecord(list(r.prompt_ids), list(resp), w))
                n_teacher += 1
                n_same += list(resp) == list(r.response_ids)
            else:
                out.append(r)
    stats = {
        "targets": "teacher",
        "n_records": len(out),
        "teacher_frac": n_teacher / max(len(out), 1),  # the rest kept their SFT response (teacher invalid)
        "same_as_sft_frac": n_same / max(len(out), 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if cache is not None:  # written then renamed: a reader never sees half a file
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"records": [tuple(r) for r in out], "stats": stats}, cache.with_suffix(".tmp"))
        cache.with_suffix(".tmp").rename(cache)
    return out, stats


def train_cft(naive_bundle: str | Path, data: SFTData, profile: Profile, out_dir: str | Path) -> Path:
    """Conversion fine-tuning: the masked-diffusion objective inside blocks (docs/PAPER.md, CFT) on the SFT prompts, with
    the AR teacher's greedy responses as targets (diffusion.cft_targets "teacher", `teacher_records`) or the
    SFT responses ("sft").

    Responses are padded to block multiples with eos (what the decoder leaves after the answer), padding
    excluded from the loss unless diffusion.pad_weight > 0; complementary masks that never cover the layout's
    fixed tokens (the decoder commits them before a block's first round, gr2/losses.py `layout_given`);
    block-causal attention + token shift. Same loop, batches and checkpointing as SFT."""
    out = Path(out_dir)
    naive = load_bundle(naive_bundle)
    model, tok = naive.model, naive.tokenizer
    dc = profile.diffusion
    bs = int(model.config.gr2_block_size)
    if bs != dc.block_size:
        raise ValueError(f"bundle block_size {bs} != profile diffusion.block_size {dc.block_size}")
    if dc.cft_targets == "teacher":
        teacher = GenerativeReranker(naive)
        with (
            process_state().main_process_first()
        ):  # rank 0 decodes and caches; the other ranks read the cache
            records, targets = teacher_records(teacher, data.records["trace"], profile, out / TEACHER_TARGETS)
        log.info("cft targets: %s", targets)
    elif dc.cft_targets == "sft":
        records, targets = data.records["trace"], {"targets": "sft", "n_records": len(data.records["trace"])}
    else:
        raise ValueError(f"diffusion.cft_targets must be 'teacher' or 'sft', got {dc.cft_targets!r}")
    collate_fn = partial(
        collate,
        pad_id=tok.pad_token_id,
        block_size=bs,
        resp_pad_id=tok.eos_token_id,
        pad_weight=dc.pad_weight,
    )
    layout = decode_rules(tok, naive.config.prompt).layout
    loss_fn = partial(
        _cft_loss,
        given=None if layout is None else (layout.fixed(), tok.eos_token_id),
        block_size=bs,
        mask_id=tok.mask_token_id,
        noise_eps=dc.noise_eps,
        complementary=dc.complementary,
        weighting=dc.loss_weighting,
        certainty_weight=dc.certainty_weight,
    )
    model = add_lora(model, profile.model)  # after the teacher targets: they are the unchanged model's
    res = _fit(model, records, collate_fn, loss_fn, profile.cft, out / "train")
    meta = replace(
        naive.config,
        name="cft",
        stage="cft",
        parent=str(naive_bundle),
        train={
            **_summary(res, model, len(records)),
            "targets": targets["targets"],
            "certainty_weight": dc.certainty_weight,
        },
        cft_targets=targets,
    )
    log.info("train_cft: %s", meta.train)
    return write_bundle(out / "bundle", replace(naive, model=model, config=meta))


def _cft_loss(model, batch, rng, **kw) -> torch.Tensor:
    return masked_diffusion_loss(model, batch, rng=rng, **kw)


def bundle_meta(bundle: str | Path) -> dict:
    return json.loads((Path(bundle) / "reranker.json").read_text())
