"""One training loop for every stage (SFT, CFT, OPD, RL): the stage only supplies batches and a loss.

    train(model, batches_fn, loss_fn, cfg, out_dir) -> TrainResult

- `batches_fn(i) -> Batch`: a deterministic function of the global micro-batch index i, so a resumed run sees
  exactly the batches the killed run would have seen (see `BucketedBatches`).
- `loss_fn(model, batch, rng) -> scalar loss`: `rng` is a torch.Generator seeded from (cfg.seed, i), so the
  diffusion noise is replayed exactly on resume too.
- Data parallel over N processes (torchrun, a Kubeflow TrainJob, or 1): optimizer step s averages the gradients
  of G = world_size * cfg.grad_accum micro-batches, i = s * G + k * world_size + rank for accumulation round k.
  So 1 process with grad_accum 2 and 2 processes with grad_accum 1 take the same steps on the same batches
  (the distributed test checks the weights). The model is NOT wrapped in DistributedDataParallel: the
  on-policy losses call the backbone's submodules (model.model, lm_head) and read its config, which a DDP
  wrapper hides and whose gradients it would not synchronise. Instead the gradients are all-reduced once per
  optimizer step (`average_gradients`), which is exact for every stage.
- cfg.bf16: the forward pass and loss run under bfloat16 autocast; weights, gradients and AdamW stay fp32.
- Runs through `accelerate.Accelerator` (device placement, the process group, checkpoints). AdamW (decay on
  matrices only), linear warmup then cosine to min_lr_ratio * lr (or constant), grad-norm clipping.
- out_dir/train_log.jsonl: one line per step {step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed_s}
  (loss and tokens over all processes); a plain log line every log_every steps; a tqdm bar (quiet without a
  TTY); out_dir/loss_curve.png.
- Checkpoints every checkpoint_every steps (and at the end) in out_dir/checkpoints/step_XXXXXXX/:
  `Accelerator.save_state` (model.safetensors, optimizer.bin, random_states_<rank>.pkl per process) plus
  trainer_state.json (step, world size, grad_accum). Written to a .tmp folder and renamed, so a kill never
  leaves a half checkpoint. A new call with the same out_dir resumes from the newest one, at any world size:
  the weights and optimizer are global, a rank without saved RNG state keeps its own (the per-step noise is
  seeded from the micro-batch index anyway). Keep world_size * grad_accum the same to continue on the same
  batches. The lr schedule is a pure function of the step, so the step is the scheduler's whole state.
- out_dir/final/: the trained model (save_model).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gr2.config import TrainConfig
from gr2.losses import Batch, Item
from gr2.model import save_model

LossFn = Callable[[torch.nn.Module, Batch, torch.Generator], torch.Tensor]
LOG_FILE = "train_log.jsonl"
STATE_FILE = "trainer_state.json"
GRAD_BUCKET = 2**25  # gradient elements per all-reduce call (bounds the extra memory)
log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int  # optimizer steps done in total (including those before a resume)
    start_step: int  # step this call resumed from (0 = fresh run)
    total_steps: int
    losses: list[float] = field(default_factory=list)  # per step of this call
    tokens_per_s: float = 0.0  # this call's real tokens / wall time of its steps
    out_dir: Path | None = None
    final_dir: Path | None = None
    log_path: Path | None = None


class BucketedBatches:
    """Length-bucketed batches as a function of the step: no padding to a global max length.

    Each epoch: shuffle items (seeded by seed + epoch), sort each window of `bucket_factor` batches by length,
    cut it into batches, shuffle the batch order. `batch(step)` = batch step % steps_per_epoch of epoch
    step // steps_per_epoch.
    """

    def __init__(
        self,
        items: Sequence[Item],
        batch_size: int,
        collate_fn: Callable[[list[Item]], Batch],
        seed: int = 0,
        bucket_factor: int = 50,
    ) -> None:
        if not items:
            raise ValueError("no training items")
        self.items, self.batch_size, self.collate_fn = items, batch_size, collate_fn
        self.seed, self.window = seed, batch_size * bucket_factor
        self.steps_per_epoch = math.ceil(len(items) / batch_size)
        self._epoch = -1
        self._order: list[list[int]] = []  # the current epoch's batches (item indices)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        idx = list(range(len(self.items)))
        rng.shuffle(idx)
        length = [len(self.items[i][0]) + len(self.items[i][1]) for i in range(len(self.items))]
        batches: list[list[int]] = []
        for w0 in range(0, len(idx), self.window):
            win = sorted(idx[w0 : w0 + self.window], key=lambda i: length[i])
            batches += [win[b : b + self.batch_size] for b in range(0, len(win), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def __call__(self, step: int) -> Batch:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self._epoch_batches(epoch)
        return self.collate_fn([self.items[i] for i in self._order[k]])


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup over cfg.warmup steps, then cosine from lr to min_lr_ratio * lr at total_steps."""
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule != "cosine":
        raise ValueError(f"unknown schedule {cfg.schedule!r} (cosine | constant)")
    frac = min(1.0, (step - cfg.warmup) / max(1, total_steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def process_state() -> Any:
    """accelerate's PartialState: joins the process group that torchrun / a TrainJob set up (nccl on GPUs, gloo on
    CPU). accelerate only forms a CPU group when asked for the CPU, hence cpu= when there is no CUDA."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """Newest complete checkpoint folder in out_dir/checkpoints (None if there is none)."""
    done = sorted(p for p in (Path(out_dir) / "checkpoints").glob("step_*") if (p / STATE_FILE).exists())
    done = [p for p in done if not p.name.endswith(".tmp")]
    return done[-1] if done else None


def _make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]  # matrices and embeddings decay; norms do not
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _total_steps(batches_fn: Callable[[int], Batch], cfg: TrainConfig, micro_per_step: int) -> int:
    spe = getattr(batches_fn, "steps_per_epoch", None)
    by_epochs = math.ceil(cfg.epochs * spe / micro_per_step) if spe and cfg.epochs > 0 else None
    if cfg.max_steps > 0 and by_epochs is not None:
        return min(cfg.max_steps, by_epochs)
    if cfg.max_steps > 0:
        return cfg.max_steps
    if by_epochs is None:
        raise ValueError("set cfg.max_steps (batches_fn has no steps_per_epoch)")
    return by_epochs


def average_gradients(params: Sequence[torch.nn.Parameter], world: int) -> None:
    """All-reduce (mean) the gradients of `params` over the process group, in flat buckets.

    A parameter without a gradient on this rank contributes zeros, so every rank issues the same collectives."""
    import torch.distributed as dist

    def flush(bucket: list[torch.nn.Parameter]) -> None:
        if not bucket:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    bucket, size = [], 0
    for p in params:
        bucket.append(p)
        size += p.numel()
        if size >= GRAD_BUCKET:
            flush(bucket)
            bucket, size = [], 0
    flush(bucket)


def _save_checkpoint(acc: Any, out_dir: Path, step: int, micro: dict[str, int], keep: int) -> Path:
    """Every rank writes its part (accelerate: weights and optimizer on rank 0, RNG state per rank) into a
    .tmp folder; rank 0 then adds trainer_state.json and renames it, so only complete checkpoints exist."""
    ckpt_root = out_dir / "checkpoints"
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f"step_{step:07d}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **micro}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        old = sorted(p for p in ckpt_root.glob("step_*") if not p.name.endswith(".tmp"))
        for p in old[: max(0, len(old) - max(1, keep))]:
            shutil.rmtree(p, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def _load_checkpoint(acc: Any, ckpt: Path, micro: dict[str, int]) -> int:
    state = json.loads((ckpt / STATE_FILE).read_text())
    acc.load_state(str(ckpt))  # weights, optimizer, and this rank's RNG state if that rank saved one
    saved_g = state["world_size"] * state["grad_accum"]
    if saved_g != micro["world_size"] * micro["grad_accum"]:
        log.warning(
            "resuming %s saved with world_size x grad_accum = %d at %d: the step continues, the batch order "
            "and the effective batch change",
            ckpt,
            saved_g,
            micro["world_size"] * micro["grad_accum"],
        )
    return int(state["step"])


def truncate_log(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """Keep the log lines of steps < upto_step (a killed run may have logged steps past its checkpoint)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] < upto_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def plot_loss(log_path: str | Path, png_path: str | Path, title: str = "training loss") -> Path:
    """Loss curve (raw + moving average) from a train_log.jsonl."""
    from gr2.plots import plt, save

    rows = [json.loads(x) for x in Path(log_path).read_text().splitlines() if x.strip()]
    steps = np.array([r["step"] for r in rows])
    loss = np.array([r["loss"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, lw=0.6, alpha=0.5, label="loss")
    if len(loss) >= 10:
        k = max(2, len(loss) // 20)
        ax.plot(steps[k - 1 :], np.convolve(loss, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return save(fig, png_path, dpi=100)


def train(
    model: torch.nn.Module,
    batches_fn: Callable[[int], Batch],
    loss_fn: LossFn,
    cfg: TrainConfig,
    out_dir: str | Path,
    accelerator: Any = None,
) -> TrainResult:
    """Train `model` in place for the configured number of steps, resuming from out_dir if it has checkpoints.

    Total steps = min(cfg.max_steps, ceil(cfg.epochs * batches_fn.steps_per_epoch / G)) (either one when the
    other is 0 / unknown), G = micro-batches per step over all processes. Returns a TrainResult; the model is
    left in eval mode with the trained weights (on every rank).
    """
    from accelerate import Accelerator

    out = Path(out_dir)
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    world, rank, accum = acc.num_processes, acc.process_index, max(1, cfg.grad_accum)
    if world != int(os.environ.get("WORLD_SIZE", "1")):  # N copies of a 1-process run would train N times
        raise RuntimeError(f"launched as {os.environ['WORLD_SIZE']} processes, but accelerate sees {world}")
    micro = {"world_size": world, "grad_accum": accum}
    G = world * accum
    total = _total_steps(batches_fn, cfg, G)
    opt = _make_optimizer(model, cfg)
    # Device placement only: no DDP wrapper (see the module docstring).
    model = acc.prepare_model(model, evaluation_mode=True)
    opt = acc.prepare_optimizer(opt)
    params = [p for p in model.parameters() if p.requires_grad]

    start = 0
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        start = _load_checkpoint(acc, ckpt, micro)
        acc.print(f"[train] resumed from {ckpt} at step {start}")
    if world > 1:  # every rank starts from rank 0's weights (a fresh init or a pretrained resize may differ)
        import torch.distributed as dist

        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    log_path = out / LOG_FILE
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        truncate_log(log_path, start)
    acc.wait_for_everyone()

    res = TrainResult(step=start, start_step=start, total_steps=total, out_dir=out, log_path=log_path)
    model.train()
    bar = tqdm(total=total, initial=start, disable=None if acc.is_main_process else True, desc="train")
    t_run, tok_run = 0.0, 0
    win_t, win_tok, win_loss = 0.0, 0, []
    with log_path.open("a") if acc.is_main_process else open(os.devnull, "w") as log_f:  # noqa: SIM115
        for step in range(start, total):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg, total)
            for g in opt.param_groups:
                g["lr"] = lr
            loss_sum, ntok = 0.0, 0
            for k in range(accum):
                i = step * G + k * world + rank  # the global micro-batch index (module docstring)
                batch = batches_fn(i).to(acc.device)
                rng = torch.Generator().manual_seed((cfg.seed * 1_000_003 + i) * 1009)
                with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    loss = loss_fn(model, batch, rng)
                (loss / accum).backward()
                loss_sum += float(loss.detach())
                ntok += batch.n_tokens
            stats = torch.tensor([loss_sum, float(ntok)], dtype=torch.float64, device=acc.device)
            if world > 1:
                import torch.distributed as dist

                average_gradients(params, world)
                dist.all_reduce(stats)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            lval, ntok = float(stats[0]) / G, int(stats[1])
            t_run, tok_run = t_run + dt, tok_run + ntok
            win_t, win_tok = win_t + dt, win_tok + ntok
            win_loss.append(lval)
            res.losses.append(lval)
            res.step = step + 1
            row = {
                "step": step,
                "loss": lval,
                "lr": lr,
                "grad_norm": None if gnorm is None else float(gnorm),
                "tokens": ntok,
                "tokens_per_s": ntok / max(dt, 1e-9),
                "elapsed_s": t_run,
            }
            log_f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{lval:.4f}", tok_s=f"{ntok / max(dt, 1e-9):.0f}")
            if cfg.log_every > 0 and (step + 1) % cfg.log_every == 0:
                log_f.flush()
                acc.print(
                    f"[train] step {step + 1}/{total} loss {np.mean(win_loss):.4f} lr {lr:.2e} "
                    f"tok/s {win_tok / max(win_t, 1e-9):.0f}"
                )
                win_t, win_tok, win_loss = 0.0, 0, []
            last = step + 1 == total
            if (cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0) or last:
                log_f.flush()
                _save_checkpoint(acc, out, step + 1, micro, cfg.keep_checkpoints)
    bar.close()
    res.tokens_per_s = tok_run / t_run if t_run > 0 else 0.0
    model.eval()
    acc.wait_for_everyone()
    if acc.is_main_process:
        res.final_dir = save_model(acc.unwrap_model(model), out / "final")
        if log_path.exists() and log_path.stat().st_size > 0:
            plot_loss(log_path, out / "loss_curve.png")
    acc.wait_for_everyone()
    return res
