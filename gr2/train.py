"""One training loop for every stage (SFT, CFT, later OPD/RL): the stage only supplies batches and a loss.

    train(model, batches_fn, loss_fn, cfg, out_dir) -> TrainResult

- `batches_fn(step) -> Batch`: a deterministic function of the step (see `BucketedBatches`), so a resumed run
  sees exactly the batches the killed run would have seen. Under DDP each process asks for
  `step * num_processes + process_index`.
- `loss_fn(model, batch, rng) -> scalar loss`: `rng` is a torch.Generator seeded from (cfg.seed, step, rank),
  so the diffusion noise is replayed exactly on resume too.
- Runs through `accelerate.Accelerator` (CPU here; the same code on GPU / DDP). AdamW (decay on matrices only),
  linear warmup then cosine to min_lr_ratio * lr (or constant), grad-norm clipping.
- out_dir/train_log.jsonl: one line per step {step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed_s};
  a plain log line every log_every steps; a tqdm bar (quiet without a TTY); out_dir/loss_curve.png.
- Checkpoints every checkpoint_every steps (and at the end) in out_dir/checkpoints/step_XXXXXXX/:
  model/ (save_pretrained, safetensors) + trainer_state.pt (optimizer, step, rng states). Written to a .tmp
  folder and renamed, so a kill never leaves a half checkpoint. A new call with the same out_dir resumes from
  the newest one; the lr schedule is a pure function of the step, so the step is the scheduler's whole state.
- out_dir/final/: the trained model (save_model).
"""

from __future__ import annotations

import json
import math
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
STATE_FILE = "trainer_state.pt"


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
        self._epoch, self._order = -1, []

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


def _total_steps(batches_fn: Callable[[int], Batch], cfg: TrainConfig, world: int) -> int:
    spe = getattr(batches_fn, "steps_per_epoch", None)
    by_epochs = math.ceil(cfg.epochs * spe / world) if spe and cfg.epochs > 0 else None
    if cfg.max_steps > 0 and by_epochs is not None:
        return min(cfg.max_steps, by_epochs)
    if cfg.max_steps > 0:
        return cfg.max_steps
    if by_epochs is None:
        raise ValueError("set cfg.max_steps (batches_fn has no steps_per_epoch)")
    return by_epochs


def _save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, opt: Any, keep: int) -> Path:
    ckpt_root = out_dir / "checkpoints"
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f"step_{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp / "model")
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    old = sorted(p for p in ckpt_root.glob("step_*") if not p.name.endswith(".tmp"))
    for p in old[: max(0, len(old) - max(1, keep))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def _load_checkpoint(ckpt: Path, model: torch.nn.Module, opt: Any) -> int:
    from transformers import LlamaForCausalLM

    saved = LlamaForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    model.load_state_dict(saved.state_dict())
    state = torch.load(ckpt / STATE_FILE, weights_only=False)
    opt.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)


def train(
    model: torch.nn.Module,
    batches_fn: Callable[[int], Batch],
    loss_fn: LossFn,
    cfg: TrainConfig,
    out_dir: str | Path,
    accelerator: Any = None,
) -> TrainResult:
    """Train `model` in place for the configured number of steps, resuming from out_dir if it has checkpoints.

    Total steps = min(cfg.max_steps, ceil(cfg.epochs * batches_fn.steps_per_epoch)) (either one when the other
    is 0 / unknown). Returns a TrainResult; the model is left in eval mode with the trained weights.
    """
    from accelerate import Accelerator

    out = Path(out_dir)
    acc = accelerator or Accelerator()
    world, rank = acc.num_processes, acc.process_index
    total = _total_steps(batches_fn, cfg, world)
    raw_model = model
    opt = _make_optimizer(raw_model, cfg)
    model, opt = acc.prepare(model, opt)

    start = 0
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        start = _load_checkpoint(ckpt, acc.unwrap_model(model), opt)
        acc.print(f"[train] resumed from {ckpt} at step {start}")
    log_path = out / LOG_FILE
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        truncate_log(log_path, start)
    acc.wait_for_everyone()

    res = TrainResult(step=start, start_step=start, total_steps=total, out_dir=out, log_path=log_path)
    model.train()
    bar = tqdm(total=total, initial=start, disable=None, desc="train", dynamic_ncols=True)
    t_run, tok_run = 0.0, 0
    win_t, win_tok, win_loss = 0.0, 0, []
    with log_path.open("a") if acc.is_main_process else open("/dev/null", "w") as log:  # noqa: SIM115
        for step in range(start, total):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg, total)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = batches_fn(step * world + rank).to(acc.device)
            rng = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1009 + rank)
            loss = loss_fn(model, batch, rng)
            acc.backward(loss)
            gnorm = acc.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            lval = float(loss.detach())
            ntok = batch.n_tokens * world
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
            log.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{lval:.4f}", tok_s=f"{ntok / max(dt, 1e-9):.0f}")
            if cfg.log_every > 0 and (step + 1) % cfg.log_every == 0:
                log.flush()
                acc.print(
                    f"[train] step {step + 1}/{total} loss {np.mean(win_loss):.4f} lr {lr:.2e} "
                    f"tok/s {win_tok / max(win_t, 1e-9):.0f}"
                )
                win_t, win_tok, win_loss = 0.0, 0, []
            last = step + 1 == total
            if (cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0) or last:
                log.flush()
                acc.wait_for_everyone()
                if acc.is_main_process:
                    _save_checkpoint(out, step + 1, acc.unwrap_model(model), opt, cfg.keep_checkpoints)
    bar.close()
    res.tokens_per_s = tok_run / t_run if t_run > 0 else 0.0
    model.eval()
    acc.wait_for_everyone()
    if acc.is_main_process:
        res.final_dir = save_model(acc.unwrap_model(model), out / "final")
        if log_path.exists() and log_path.stat().st_size > 0:
            plot_loss(log_path, out / "loss_curve.png")
    return res
