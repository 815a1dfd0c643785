"""Batches and the two training objectives: weighted AR cross-entropy (SFT) and block masked diffusion (CFT).

A training item is (prompt_ids, response_ids, response_weights) from the prompt builder; weights put answer
tokens (lambda_o) above trace tokens (lambda_r). `collate` lays a batch out as in gr2/model.py: prompts
left-padded to width P, responses right-padded to R (a multiple of block_size for CFT, so no block straddles
two samples and padding never enters the loss unless `pad_weight` > 0).

Both losses are token averages over the response tokens with weight > 0 (so the AR and CFT numbers are on the
same scale): sum(weight * CE) / count. CFT can add certainty forcing (`certainty_weight`, see `_masked_ce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gr2.model import block_causal_mask, model_config, position_ids_for

Item = tuple[Sequence[int], Sequence[int], Sequence[float]]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, P + R] long: left-padded prompt, then the right-padded response
    weights: (
        torch.Tensor
    )  # [B, P + R] float: loss weight of the token in that column as a target (0 on prompt)
    pad_lens: torch.Tensor  # [B] long: left-pad columns of each row
    prompt_len: int  # P: column where every response starts
    n_tokens: int  # real (non-pad) prompt + response tokens: the unit of tokens/s

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device),
            self.weights.to(device),
            self.pad_lens.to(device),
            self.prompt_len,
            self.n_tokens,
        )

    @property
    def resp_len(self) -> int:
        return self.input_ids.shape[1] - self.prompt_len


def collate(
    items: Sequence[Item],
    pad_id: int,
    block_size: int = 1,
    resp_pad_id: int | None = None,
    pad_weight: float = 0.0,
) -> Batch:
    """Lay out items as a Batch. Response padding uses `resp_pad_id` (default pad_id; for CFT pass eos so the
    post-answer canvas looks like what the decoder leaves there) with loss weight `pad_weight`."""
    P = max(len(p) for p, _, _ in items)
    R = max(len(r) for _, r, _ in items)
    R = -(-R // block_size) * block_size
    rpad = pad_id if resp_pad_id is None else resp_pad_id
    ids = torch.full((len(items), P + R), pad_id, dtype=torch.long)
    w = torch.zeros(len(items), P + R)
    pad_lens = torch.zeros(len(items), dtype=torch.long)
    n = 0
    for i, (p, r, rw) in enumerate(items):
        if len(r) != len(rw):
            raise ValueError(f"item {i}: {len(r)} response tokens but {len(rw)} weights")
        pad_lens[i] = P - len(p)
        ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, P : P + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        ids[i, P + len(r) :] = rpad
        w[i, P : P + len(r)] = torch.as_tensor(list(rw), dtype=torch.float)
        w[i, P + len(r) :] = pad_weight
        n += len(p) + len(r)
    return Batch(ids, w, pad_lens, P, n)


def ar_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted next-token CE. logits [B, T, V] at column i predict labels[:, i + 1]; weights [B, T] belong to
    the label column (0 on prompt and padding). GR2: L = -(lambda_r sum log p(r) + lambda_o sum log p(o)), divided
    by the number of weighted tokens."""
    w = weights[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="none")
    return (ce * w.flatten()).sum() / (w > 0).sum().clamp(min=1)


def ar_batch_loss(model: torch.nn.Module, batch: Batch, rng: torch.Generator | None = None) -> torch.Tensor:
    """SFT loss of a Batch (standard causal attention; the left pads are hidden by the 2D mask)."""
    cols = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    attn = (cols[None, :] >= batch.pad_lens[:, None]).long()
    logits = model(
        input_ids=batch.input_ids, attention_mask=attn, position_ids=position_ids_for(batch.pad_lens, cols)
    ).logits
    return ar_loss(logits, batch.input_ids, batch.weights)


def sample_masks(
    batch: Batch,
    block_size: int,
    rng: torch.Generator,
    noise_eps: float = 0.05,
    complementary: bool = True,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise the response: one t ~ U[noise_eps, 1 - noise_eps] per (row, block), each position masked with
    prob t. Returns (masks [V, B, R] bool, p_mask [V, B, R]) for V = 2 views (the second masks exactly the
    complement, with prob 1 - t) or V = 1. The interval is clipped on both sides so that the 1/t weight of
    either view stays <= 1/noise_eps (BD3-LM clips its schedule for the same variance reason). keep [B, R]:
    positions no view masks (the layout's tokens, `layout_given`: the decoder never predicts them)."""
    B, R = batch.input_ids.shape[0], batch.resp_len
    nb = R // block_size
    t = noise_eps + (1 - 2 * noise_eps) * torch.rand(B, nb, generator=rng)
    t = t.repeat_interleave(block_size, dim=1)
    m = torch.rand(B, R, generator=rng) < t
    masks, probs = [m], [t]
    if complementary:
        masks.append(~m)
        probs.append(1 - t)
    if keep is not None:
        masks = [x & ~keep.cpu() for x in masks]
    dev = batch.input_ids.device
    return torch.stack(masks).to(dev), torch.stack(probs).to(dev)


def layout_given(resp: torch.Tensor, fixed: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, R]: the response positions whose token the layout fixes: up to each row's first eos those holding one of
    `fixed` (gr2/rules.py `Layout.fixed`), and every position after it (eos, the filler). The decoder commits
    them before a block's first round (gr2/decode.py `layout_commits`), so CFT never masks them: every canvas it
    trains on shows them, as every decoding canvas does. Score levels and answer labels are never fixed tokens,
    so the tokens say where they are."""
    is_eos = (resp == eos_id).long()
    upto = (is_eos.cumsum(-1) - is_eos) == 0  # no eos strictly before
    return (torch.isin(resp, fixed.to(resp.device)) & upto) | ~upto


def bd3_mask(
    prompt_len: int, resp_len: int, block_size: int, pad_lens: torch.Tensor, views: int = 1
) -> torch.Tensor:
    """[B, 1, T, T] mask, T = P + (1 + V) R, for the vectorised BD3-LM layout [prompt, x_0 response, V noisy
    x_t responses].

    prompt + x_0 follow `block_causal_mask` (clean block b sees the prompt and clean blocks <= b); a noisy
    block b of any view sees the prompt, clean blocks < b and itself (bidirectionally), never another view.
    Nothing clean sees a noisy token.
    """
    P, R, V = prompt_len, resp_len, views
    B = pad_lens.shape[0]
    dev = pad_lens.device
    m = torch.zeros(B, P + (1 + V) * R, P + (1 + V) * R, dtype=torch.bool, device=dev)
    m[:, : P + R, : P + R] = block_causal_mask(P, P + R, block_size, pad_lens)[:, 0]
    bq = torch.arange(R, device=dev) // block_size
    prompt = (torch.arange(P, device=dev)[None, :] >= pad_lens[:, None])[:, None, :]
    for v in range(V):
        rows = slice(P + (1 + v) * R, P + (2 + v) * R)
        m[:, rows, :P] = prompt
        m[:, rows, P : P + R] = bq[:, None] > bq[None, :]
        m[:, rows, rows] = bq[:, None] == bq[None, :]
    return m.unsqueeze(1)


def diffusion_logits(
    model: torch.nn.Module, batch: Batch, masks: torch.Tensor, block_size: int, mask_id: int
) -> torch.Tensor:
    """Logits [V*B, R, vocab] predicting every response position of the V noised views of `batch` (masks
    [V, B, R]), all views in one forward of B rows (BD3-LM layout, the views side by side after one shared
    prompt and x_0: a third fewer tokens than one row per view, same logits).

    Token shift: response position r is predicted from column r-1 of its own noisy block, or for a block's
    first position from the last clean token before the block (the x_0 copy / the prompt), as in decoding.
    """
    V = masks.shape[0]
    P, R = batch.prompt_len, batch.resp_len
    x0 = batch.input_ids[:, P:]
    xt = torch.where(masks, torch.full_like(x0, mask_id)[None], x0[None])  # [V, B, R]
    seq = torch.cat([batch.input_ids, *xt], dim=1)  # [B, P + (1 + V) R]
    dev = seq.device
    cols = torch.arange(P + R, device=dev)
    pos = position_ids_for(batch.pad_lens, torch.cat([cols, *[cols[P:]] * V]))
    r = torch.arange(R, device=dev)
    src = torch.cat(
        [torch.where(r % block_size == 0, P + r - 1, P + (1 + v) * R + r - 1) for v in range(V)]
    )  # the column whose logits predict view v's position r
    logits = model(
        input_ids=seq,
        attention_mask=bd3_mask(P, R, block_size, batch.pad_lens, V),
        position_ids=pos,
        logits_to_keep=src,
    ).logits  # [B, V*R, vocab]
    return logits.unflatten(1, (V, R)).transpose(0, 1).flatten(0, 1)


def diffusion_loss_from_masks(
    model: torch.nn.Module,
    batch: Batch,
    masks: torch.Tensor,
    p_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    weighting: str = "inv_t",
    certainty_weight: float = 0.0,
) -> torch.Tensor:
    """Masked-diffusion CE for given masks [V, B, R] (`diffusion_logits`: all views in one forward)."""
    logits = diffusion_logits(model, batch, masks, block_size, mask_id)
    x0 = batch.input_ids[:, batch.prompt_len :]
    return _masked_ce(
        logits, x0, batch.weights[:, batch.prompt_len :], masks, p_mask, weighting, certainty_weight
    )


def certainty_entropy(logp: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Certainty forcing (dParallel, Chen et al. 2025): the mean entropy of the predictive distributions
    `logp` [N, vocab] (log-probs) whose arg-max already is the target [N], over those with weight > 0.

    Why: the decoder commits a position in a round only when its top-1 probability clears tau; a model that is
    right but unsure (0.6 on the right token) takes one round per such position. Sharpening only the positions it
    gets right does not move the arg-max (what greedy decoding writes)."""
    right = (weights > 0) & (logp.argmax(-1) == targets)
    entropy = -(logp.exp() * logp).sum(-1)
    return (entropy * right).sum() / right.sum().clamp(min=1)


def _masked_ce(
    logits: torch.Tensor,
    x0: torch.Tensor,
    w: torch.Tensor,
    masks: torch.Tensor,
    p_mask: torch.Tensor,
    weighting: str,
    certainty_weight: float = 0.0,
) -> torch.Tensor:
    """Weighted CE over the masked response positions, + certainty_weight * `certainty_entropy` over them (the
    positions the student gets wrong are left to the CE term)."""
    V = masks.shape[0]
    sel = masks.flatten(0, 1)
    tgt = x0.repeat(V, 1)[sel]
    logp = logits.flatten(0, 1)[sel.flatten()].float().log_softmax(-1)
    ce = F.nll_loss(logp, tgt, reduction="none")  # = cross_entropy; logp is reused by certainty forcing
    wsel = w.repeat(V, 1)[sel]
    scale = wsel
    if weighting == "inv_t":
        scale = scale / p_mask.flatten(0, 1)[sel]
    elif weighting != "none":
        raise ValueError(f"unknown weighting {weighting!r} (inv_t | none)")
    loss = (ce * scale).sum() / (V * (w > 0).sum().clamp(min=1))
    if certainty_weight > 0:
        loss = loss + certainty_weight * certainty_entropy(logp, tgt, wsel)
    return loss


def diffusion_loss_loop(
    model: torch.nn.Module,
    batch: Batch,
    masks: torch.Tensor,
    p_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    weighting: str = "inv_t",
    certainty_weight: float = 0.0,
) -> torch.Tensor:
    """Reference for `diffusion_loss_from_masks`: one forward per (view, block) over [prompt, clean blocks < b,
    noisy block b] under `block_causal_mask`, exactly the decoder's view of a block. Slow; for tests/benchmarks."""
    V = masks.shape[0]
    P, R = batch.prompt_len, batch.resp_len
    x0 = batch.input_ids[:, P:]
    out = torch.zeros(V, x0.shape[0], R, model_config(model).vocab_size, device=x0.device)
    for v in range(V):
        xt = torch.where(masks[v], torch.full_like(x0, mask_id), x0)
        for s0 in range(0, R, block_size):
            T = P + s0 + block_size
            seq = torch.cat([batch.input_ids[:, : P + s0], xt[:, s0 : s0 + block_size]], dim=1)
            cols = torch.arange(T, device=x0.device)
            logits = model(
                input_ids=seq,
                attention_mask=block_causal_mask(P, T, block_size, batch.pad_lens),
                position_ids=position_ids_for(batch.pad_lens, cols),
            ).logits
            out[v, :, s0 : s0 + block_size] = logits[:, P + s0 - 1 : T - 1]
    return _masked_ce(out.flatten(0, 1), x0, batch.weights[:, P:], masks, p_mask, weighting, certainty_weight)


def masked_diffusion_loss(
    model: torch.nn.Module,
    batch: Batch,
    block_size: int,
    mask_id: int,
    rng: torch.Generator,
    noise_eps: float = 0.05,
    complementary: bool = True,
    weighting: str = "inv_t",
    certainty_weight: float = 0.0,
    given: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """CFT objective (docs/PAPER.md, CFT): block masked diffusion with complementary masks, 1/t weighting, answer/trace
    weights, block-causal attention and the AR token shift, plus optional certainty forcing (`_masked_ce`).
    `batch` must be collated with this block_size. given: (the layout's fixed tokens, eos id): those positions
    are never masked (`layout_given`)."""
    if batch.resp_len % block_size:
        raise ValueError(f"response width {batch.resp_len} is not a multiple of block_size {block_size}")
    keep = None if given is None else layout_given(batch.input_ids[:, batch.prompt_len :], *given)
    masks, p_mask = sample_masks(batch, block_size, rng, noise_eps, complementary, keep)
    return diffusion_loss_from_masks(
        model, batch, masks, p_mask, block_size, mask_id, weighting, certainty_weight
    )
