"""GRPO/DAPO for both decoders (docs/PAPER.md, RL; GR2 stage 3): sampled rollouts, trajectory replay, clipped surrogate.

One implementation; only the policy log-probability differs by decoder:
- AR (block_size 0): token log-probs under causal attention (one forward over prompt + response).
- Block diffusion: **trajectory replay** (TraceRL): each committed token is scored on the canvas it was
  committed from: its block holds the tokens committed in earlier rounds, masks elsewhere; the prompt and the
  earlier blocks are clean; block-causal attention and the AR token shift, exactly the decoder's view.

Replay is vectorised into ONE forward per batch. Layout per row: [prompt P | clean response R | canvases],
one canvas (block_size tokens) per (block, commit round) that scores something. A canvas sees the prompt, the
clean blocks before its block and itself (bidirectionally); nothing sees a canvas from outside. A block's
first position is read off the last clean token before the block (the decoder's anchor), so it needs no
canvas; with block_size 1 there are no canvases at all and replay is the AR forward.

Sampling (rollouts need temperature > 0 for group diversity) runs gr2/decode.py's own loops with a sampled
token-choice rule defined here: `sample_ar` = `ar_generate` with `_pick`, `sample_diffusion` =
`diffusion_generate` (cached) with `sample_commits`, i.e. sampled tokens and the sampled token's probability
as commit confidence (threshold tau plus one forced commit). With temperature 0 both reproduce the greedy
decoders token for token (tested). Each returns the log-prob of every token under the policy it sampled from,
softmax(logits / temperature), which the replay must reproduce.

Loss (DAPO): advantages (R - mean) / std per group of G rollouts of one prompt; zero-variance groups are
dropped (no signal); invalid rollouts stay with R = -1; token-level clipped surrogate
min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) summed over all scored tokens of the batch and divided by
their number. A scored token = a committed token at or before the row's first eos.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F

from gr2.decode import GIVEN, ar_generate, diffusion_generate, pad_prompts, threshold_commits
from gr2.losses import Batch, certainty_entropy, diffusion_logits, sample_masks
from gr2.model import block_causal_mask, decoder_and_head, position_ids_for
from gr2.rules import NO_RULES, DecodeRules, Rules, Slots, TraceRule, answer_slots, ban_repeats, keep_slots


@dataclass
class Rollouts:
    """Sampled responses of a batch of prompts (layout as gr2/model.py: prompts left-padded to width P)."""

    prompt_ids: torch.Tensor  # [B, P]
    pad_lens: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, L]
    traj: torch.Tensor  # [B, L] commit round of each token (AR: its column); -1 = never decoded (filler)
    logprobs: torch.Tensor  # [B, L] log-prob of each token under the sampling policy (0 where traj < 0)
    nfe: int

    @property
    def scored(self) -> torch.Tensor:
        return scored_positions(self.tokens, self.traj, None)


def scored_positions(tokens: torch.Tensor, traj: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """[B, L] bool: decoded tokens at or before the first eos (later tokens of the eos block mean nothing)."""
    ok = traj >= 0
    if eos_id is not None:
        is_eos = (tokens == eos_id).long()
        before = (is_eos.cumsum(-1) - is_eos) == 0  # no eos strictly before this column
        ok = ok & before
    return ok


@dataclass
class RolloutBatch(Batch):
    """A `Batch` (input_ids = prompt + response, weights = 1 on scored tokens) plus what RL/OPD losses need."""

    traj: torch.Tensor  # [B, R] commit rounds (-1 = filler)
    old_logprobs: torch.Tensor  # [B, R] sampling-policy log-probs
    advantages: torch.Tensor  # [B] (zeros for OPD)
    teacher_logprobs: torch.Tensor | None = None  # [B, R, V] OPD: the frozen teacher's cached log-probs
    step: int = -1
    stats: dict = field(default_factory=dict)  # rollout statistics logged with the step

    def to(self, device: torch.device | str) -> RolloutBatch:
        t = self.teacher_logprobs
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            weights=self.weights.to(device),
            pad_lens=self.pad_lens.to(device),
            traj=self.traj.to(device),
            old_logprobs=self.old_logprobs.to(device),
            advantages=self.advantages.to(device),
            teacher_logprobs=None if t is None else t.to(device),
        )

    @property
    def scored(self) -> torch.Tensor:
        return self.weights[:, self.prompt_len :] > 0


def rollout_batch(
    ro: Rollouts, eos_id: int, advantages: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> RolloutBatch:
    """Pack (a subset `rows` of) rollouts as a RolloutBatch, cropped to the last scored column."""
    if rows is None:
        rows = torch.arange(ro.tokens.shape[0])
    tokens, traj, lp = ro.tokens[rows], ro.traj[rows], ro.logprobs[rows]
    scored = scored_positions(tokens, traj, eos_id)
    cols = torch.nonzero(scored.any(0))
    L = int(cols.max()) + 1 if len(cols) else 1
    tokens, traj, lp, scored = tokens[:, :L], traj[:, :L], lp[:, :L], scored[:, :L]
    # Prompts keep their common width P so the response starts at the same column as when sampled.
    prompt, pad_lens = ro.prompt_ids[rows], ro.pad_lens[rows]
    P = prompt.shape[1]
    w = torch.cat([torch.zeros(len(rows), P), scored.float()], dim=1)
    adv = torch.zeros(len(rows)) if advantages is None else advantages
    n_tok = int((P - pad_lens).sum()) + int(scored.sum())
    return RolloutBatch(torch.cat([prompt, tokens], 1), w, pad_lens, P, n_tok, traj, lp, adv)


# ---------------------------------------------------------------------------------------------- sampling
def _pick(
    logits: torch.Tensor, temperature: float, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, log-prob of it under softmax(logits / temperature)); temperature 0 = arg-max (log-prob at T=1)."""
    logits = logits.float()
    if temperature <= 0:
        lp = logits.log_softmax(-1)
        tok = lp.argmax(-1)
    else:
        lp = (logits / temperature).log_softmax(-1)
        flat = lp.exp().reshape(-1, lp.shape[-1])
        tok = torch.multinomial(flat, 1, generator=gen).reshape(lp.shape[:-1])
    return tok, lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_ar(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    rules: DecodeRules = NO_RULES,
) -> Rollouts:
    """AR sampling: `ar_generate` (KV cache) with `_pick` as the token choice; temperature 0 = greedy."""
    ids, pad_lens = pad_prompts(prompts, model)  # the decoder's own layout, kept in the Rollouts
    dev = ids.device
    lps = torch.zeros(len(prompts), max_new_tokens, device=dev)
    pick = partial(_pick, temperature=temperature, gen=generator)
    tokens, nfe = ar_generate(model, prompts, max_new_tokens, eos_id, pick=pick, logprobs=lps, rules=rules)
    # AR decodes every column up to its row's first eos, column t at step t; later columns are eos filler.
    decoded = scored_positions(tokens, torch.zeros_like(tokens), eos_id)
    traj = torch.where(decoded, torch.arange(max_new_tokens, device=dev).expand_as(tokens), -1)
    return Rollouts(ids, pad_lens, tokens, traj, lps, nfe)


def sample_commits(
    logits: torch.Tensor, masked: torch.Tensor, tau: float, temperature: float, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_commits` with sampled tokens: confidence = the sampled token's probability; commit every masked
    position with confidence >= tau plus the most confident one. Returns (commit, tokens, log-probs)."""
    tok, lp = _pick(logits, temperature, gen)
    # Confidence = probability of the sampled token under the distribution it was drawn from (greedy: top-1).
    return threshold_commits(lp.exp(), masked, tau), tok, lp


@torch.no_grad()
def sample_diffusion(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    tau: float,
    mask_id: int,
    eos_id: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    rules: DecodeRules = NO_RULES,
) -> Rollouts:
    """Block-diffusion sampling: `diffusion_generate` (cached: same rounds, anchors, nfe and trajectory) with
    `sample_commits` as the commit rule. temperature 0 reproduces `diffusion_generate` exactly."""
    ids, pad_lens = pad_prompts(prompts, model)  # the decoder's own layout, kept in the Rollouts
    dev = ids.device
    lps = torch.zeros(len(prompts), max_new_tokens, device=dev)
    commit_fn = partial(sample_commits, temperature=temperature, gen=generator)
    tokens, nfe, traj = diffusion_generate(
        model,
        prompts,
        max_new_tokens,
        block_size=block_size,
        tau=tau,
        mask_id=mask_id,
        eos_id=eos_id,
        commit_fn=commit_fn,
        logprobs=lps,
        rules=rules,
    )
    return Rollouts(ids, pad_lens, tokens, traj, lps, nfe)


@dataclass(frozen=True)
class Sampling:
    """How `sample` draws a model's rollouts: its own decoder (block_size 0: AR), the response budget and special
    tokens, block diffusion's commit threshold, the temperature, and the decoding rules (gr2/rules.py), which
    `policy_logits` must then replay with."""

    max_new_tokens: int
    block_size: int  # 0: AR sampling
    eos_id: int
    mask_id: int | None = None  # block diffusion's mask token
    tau: float | None = None  # block diffusion's commit threshold (RLConfig.tau, OPDConfig.tau)
    temperature: float = 1.0
    rules: DecodeRules = NO_RULES


def sample(
    model: torch.nn.Module, prompts: list[list[int]], how: Sampling, generator: torch.Generator | None = None
) -> Rollouts:
    """The model's own decoder, sampling per `how`: AR for block_size 0, block diffusion otherwise."""
    T, gen, rules = how.temperature, generator, how.rules
    if how.block_size <= 0:
        return sample_ar(
            model, prompts, how.max_new_tokens, how.eos_id, temperature=T, generator=gen, rules=rules
        )
    if how.mask_id is None or how.tau is None:
        raise ValueError("block diffusion sampling needs mask_id and tau")
    return sample_diffusion(
        model,
        prompts,
        how.max_new_tokens,
        how.block_size,
        how.tau,
        how.mask_id,
        how.eos_id,
        temperature=T,
        generator=gen,
        rules=rules,
    )


# ---------------------------------------------------------------------------------------------- replay
def _canvases(
    tokens: torch.Tensor, traj: torch.Tensor, scored: torch.Tensor, block_size: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, one canvas per (block, round) with a scored non-first token. Returns (canvas tokens [B, C, bs],
    canvas block index [B, C] (-1 = padding canvas), canvas index of each response token [B, R] (-1 = none))."""
    B, R = tokens.shape
    bs = block_size
    tok, tr, sc = tokens.tolist(), traj.tolist(), scored.tolist()
    rows_c: list[list[list[int]]] = []
    rows_q: list[list[int]] = []
    where = torch.full((B, R), -1, dtype=torch.long)
    for b in range(B):
        cs, qs = [], []
        for q, s0 in enumerate(range(0, R, bs)):
            t, x, s = tr[b][s0 : s0 + bs], tok[b][s0 : s0 + bs], sc[b][s0 : s0 + bs]
            for rd in sorted({t[i] for i in range(1, len(t)) if s[i]}):
                # Tokens committed in earlier rounds, and the layout's (GIVEN), are visible (fillers, -1, were masks
                # at the time).
                seen = [0 <= t[i] < rd or t[i] == GIVEN for i in range(len(t))]
                cs.append([x[i] if seen[i] else mask_id for i in range(len(t))] + [mask_id] * (bs - len(t)))
                qs.append(q)
                for i in range(1, len(t)):
                    if s[i] and t[i] == rd:
                        where[b, s0 + i] = len(cs) - 1
        rows_c.append(cs)
        rows_q.append(qs)
    C = max((len(c) for c in rows_c), default=0)
    canv = torch.full((B, C, bs), mask_id, dtype=torch.long)
    cblock = torch.full((B, C), -1, dtype=torch.long)
    for b in range(B):
        if rows_c[b]:
            canv[b, : len(rows_c[b])] = torch.tensor(rows_c[b])
            cblock[b, : len(rows_q[b])] = torch.tensor(rows_q[b])
    return canv.to(tokens.device), cblock.to(tokens.device), where.to(tokens.device)


def replay_mask(
    P: int, R: int, cblock: torch.Tensor, block_size: int, pad_lens: torch.Tensor
) -> torch.Tensor:
    """[B, 1, T, T] bool mask for [prompt P | clean response R | C canvases of block_size] (T = P + R + C bs).

    Prompt + clean response follow `block_causal_mask`; a canvas of block q sees the (non-pad) prompt, clean
    blocks < q and itself; a padding canvas (q = -1) sees only itself."""
    B, C = cblock.shape
    bs = block_size
    dev = pad_lens.device
    T = P + R + C * bs
    m = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
    m[:, : P + R, : P + R] = block_causal_mask(P, P + R, bs, pad_lens)[:, 0]
    if C:
        cb = cblock.repeat_interleave(bs, dim=1)  # [B, C*bs] block of each canvas token
        cid = torch.arange(C, device=dev).repeat_interleave(bs)
        real = (cb >= 0)[:, :, None]
        m[:, P + R :, :P] = real & (torch.arange(P, device=dev)[None, None, :] >= pad_lens[:, None, None])
        bq = torch.arange(R, device=dev) // bs
        m[:, P + R :, P : P + R] = cb[:, :, None] > bq[None, None, :]
        m[:, P + R :, P + R :] = (cid[:, None] == cid[None, :])[None]
    return m.unsqueeze(1)


def policy_logits(
    model: torch.nn.Module,
    batch: RolloutBatch,
    block_size: int,
    mask_id: int | None = None,
    rules: DecodeRules = NO_RULES,
) -> torch.Tensor:
    """Logits [B, R, V] the policy assigned to each response token when it was generated (R = batch.resp_len).

    block_size 0 (AR): one causal forward. Otherwise trajectory replay (module docstring), one forward.
    rules: the rollouts were sampled with them; each token's logits then ban what was committed before it (and,
    with `follow`, what the trace rules out there, once the trace was committed before it, and with `layout`
    what the response's shape rules out there)."""
    logits = _replay_logits(model, batch, block_size, mask_id)
    unique, follow = rules.unique, rules.follow
    if unique is None:
        return logits
    if rules.layout is not None:
        state = Rules.start(rules, batch.input_ids[:, : batch.prompt_len])
        assert state is not None  # (rules.unique is set)
        logits = state.shaped(logits, 0)
    tokens = batch.input_ids[:, batch.prompt_len :]
    seen = committed_before(tokens, batch.traj, unique)
    logits = ban_repeats(logits, seen, unique)
    if follow is not None:
        slots = slots_at_commit(follow, tokens, batch.traj, batch.input_ids[:, : batch.prompt_len])
        logits = keep_slots(logits, slots, seen, unique)
    return logits


def slots_at_commit(
    follow: TraceRule, tokens: torch.Tensor, traj: torch.Tensor, prompt_ids: torch.Tensor
) -> Slots:
    """`answer_slots` as the decoder applied them: active at a token committed after the whole trace was (traj:
    commit rounds, AR: columns; -1 = never decoded; GIVEN: the layout's, known from the start)."""
    n = follow.n_candidates(prompt_ids)
    slots = answer_slots(follow, tokens, traj != -1, n)
    in_trace = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < 2 * n[:, None]
    trace_round = (
        traj.masked_fill(~in_trace, -1).max(-1).values
    )  # [B]: when the trace's last token was committed
    after = traj > trace_round[:, None]
    return Slots(slots.active & after, slots.allowed, slots.no_label & after, slots.wait)


def committed_before(tokens: torch.Tensor, traj: torch.Tensor, unique: torch.Tensor) -> torch.Tensor:
    """[B, R, K]: whether unique[k] was committed in an earlier round than token j (traj: commit rounds, AR:
    columns; -1 = never decoded), i.e. what the decoder banned when it chose token j."""
    hit = ((tokens[:, :, None] == unique) & (traj >= 0)[:, :, None]).float()  # [B, i, K]
    earlier = (traj[:, None, :] < traj[:, :, None]).float()  # [B, j, i]
    return torch.bmm(earlier, hit) > 0


def _replay_logits(
    model: torch.nn.Module, batch: RolloutBatch, block_size: int, mask_id: int | None
) -> torch.Tensor:
    P, R = batch.prompt_len, batch.resp_len
    ids, pad_lens = batch.input_ids, batch.pad_lens
    dev = ids.device
    decoder, head = decoder_and_head(model)
    if block_size <= 0:
        cols = torch.arange(P + R, device=dev)
        hidden = decoder(
            input_ids=ids,
            attention_mask=(cols[None, :] >= pad_lens[:, None]).long(),
            position_ids=position_ids_for(pad_lens, cols),
        ).last_hidden_state
        return head(hidden[:, P - 1 : P + R - 1])
    if mask_id is None:
        raise ValueError("trajectory replay needs mask_id")
    bs = block_size
    Rb = -(-R // bs) * bs  # canvases are whole blocks: pad the response to a block multiple
    tokens = F.pad(ids[:, P:], (0, Rb - R), value=mask_id)
    traj = F.pad(batch.traj, (0, Rb - R), value=-1)
    scored = F.pad(batch.scored, (0, Rb - R), value=False)
    canv, cblock, where = _canvases(tokens, traj, scored, bs, mask_id)
    seq = torch.cat([ids[:, :P], tokens, canv.flatten(1)], dim=1)
    canvas_cols = P + cblock.clamp(min=0)[:, :, None] * bs + torch.arange(bs, device=dev)[None, None, :]
    pos = torch.cat(
        [
            position_ids_for(pad_lens, torch.arange(P + Rb, device=dev)),
            (canvas_cols.flatten(1) - pad_lens[:, None]).clamp(min=0),
        ],
        dim=1,
    )
    hidden = decoder(
        input_ids=seq, attention_mask=replay_mask(P, Rb, cblock, bs, pad_lens), position_ids=pos
    ).last_hidden_state
    # Source column of each token's logits (token shift): a block's first position, or a token without a
    # canvas, reads the clean column before it; others the column before it inside their canvas.
    rr = torch.arange(Rb, device=dev)
    src = (P + rr - 1).expand(ids.shape[0], -1)
    in_canvas = P + Rb + where.clamp(min=0) * bs + (rr % bs)[None, :] - 1
    src = torch.where(where >= 0, in_canvas, src)
    h = hidden.gather(1, src[:, :R, None].expand(-1, -1, hidden.shape[-1]))
    return head(h)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[token] (T <= 0 means 1: the greedy decoders' log-probs)."""
    t = temperature if temperature > 0 else 1.0
    return (logits.float() / t).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------- GRPO
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [n_groups, G] -> (advantages (R - mean) / std [n_groups, G], keep [n_groups]); groups whose
    rewards are all equal (zero variance: no learning signal, advantage undefined) are not kept."""
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True, unbiased=False)
    keep = std.squeeze(1) > eps
    adv = torch.where(std > eps, (rewards - mean) / std.clamp(min=eps), torch.zeros_like(rewards))
    return adv, keep


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    scored: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """DAPO token-level loss: -sum_tokens min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) / n_tokens."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages[:, None]
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + hi) * adv)
    m = scored.float()
    n = m.sum().clamp(min=1)
    loss = -(obj * m).sum() / n
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + hi)).float()
        stats = {
            "clip_frac": float((clipped * m).sum() / n),
            "ratio_mean": float((ratio * m).sum() / n),
            "approx_kl": float(((old_logprobs - logprobs) * m).sum() / n),  # k1 estimate of KL(old || new)
        }
    return loss, stats


def rollout_certainty(
    model: torch.nn.Module,
    batch: RolloutBatch,
    block_size: int,
    mask_id: int,
    eos_id: int,
    rng: torch.Generator,
) -> torch.Tensor:
    """Certainty forcing on the rollouts themselves (dParallel trains it on the model's own outputs): the
    responses noised block by block as in CFT (one view), and `certainty_entropy` at the masked scored positions
    whose arg-max already is the rollout's token.

    Why RL needs it: the replay scores each token only on the canvas it was committed from, so nothing in the
    GRPO loss asks a position to be sure while other positions of its block are still masks, and CFT's
    certainty wears off (tokens per forward fell over RL). This term keeps it at no cost to the arg-max."""
    P, R = batch.prompt_len, batch.resp_len
    pad = -R % block_size  # noise needs whole blocks: pad with eos, what the decoder leaves after an answer
    resp = F.pad(batch.input_ids[:, P:], (0, pad), value=eos_id)
    w = F.pad(batch.weights[:, P:], (0, pad))
    b = Batch(
        torch.cat([batch.input_ids[:, :P], resp], 1), F.pad(batch.weights, (0, pad)), batch.pad_lens, P, 0
    )
    given = F.pad(batch.traj == GIVEN, (0, pad))  # the layout's tokens: never masked, as when sampled
    masks, _ = sample_masks(b, block_size, rng, complementary=False, keep=given)
    logits = diffusion_logits(model, b, masks, block_size, mask_id)  # [B, R + pad, V]
    sel = masks[0] & (w > 0)
    return certainty_entropy(logits[sel].float().log_softmax(-1), resp[sel], w[sel])


def grpo_loss(
    model: torch.nn.Module,
    batch: RolloutBatch,
    block_size: int,
    mask_id: int | None,
    temperature: float,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    certainty_weight: float = 0.0,
    eos_id: int | None = None,
    rules: DecodeRules = NO_RULES,
) -> tuple[torch.Tensor, dict]:
    """The RL loss of a rollout batch: replayed (or AR) log-probs -> clipped surrogate, plus
    certainty_weight * `rollout_certainty` (block diffusion only; its noise is seeded by the step, so a resumed
    run draws the same).

    A batch whose advantages are all zero (every group dropped) has no policy gradient: skip the replay forward,
    the surrogate is a zero still attached to the parameters (the shared loop calls backward on it)."""
    if certainty_weight > 0 and (block_size <= 0 or mask_id is None or eos_id is None):
        raise ValueError("certainty forcing needs a block-diffusion model, mask_id and eos_id")
    if not bool((batch.advantages != 0).any()):
        loss = torch.stack([p.sum() for p in model.parameters() if p.requires_grad]).sum() * 0.0
        stats = {"clip_frac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}
    else:
        logits = policy_logits(model, batch, block_size, mask_id, rules)
        lp = token_logprobs(logits, batch.input_ids[:, batch.prompt_len :], temperature)
        loss, stats = clipped_surrogate(
            lp, batch.old_logprobs, batch.advantages, batch.scored, clip_eps, clip_eps_high
        )
    if certainty_weight > 0 and mask_id is not None and eos_id is not None:  # (both checked above)
        rng = torch.Generator().manual_seed(max(batch.step, 0))
        cf = rollout_certainty(model, batch, block_size, mask_id, eos_id, rng)
        loss = loss + certainty_weight * cf
        stats["certainty_entropy"] = float(cf.detach())
    return loss, stats
