"""The decoders: AR with a KV cache, and threshold-commit block diffusion (PAPER 3.5), each returning nfe.

Small pure functions in the style of LLaDA / Fast-dLLM `generate.py`. Both take unpadded prompts (lists of token
ids), left-pad them (see gr2/model.py for the layout) and return `tokens` [B, max_new_tokens]. A row is finished
once it has an eos with every position before it decoded; positions the decoder never wrote after that are
filled with eos. Read a row up to its first eos: with block_size > 1, tokens committed after the eos inside the
same block are kept as decoded (the trajectory must replay them) and mean nothing.

nfe = number of model forward calls for the whole batch, prefill included. For AR generating L tokens that is
exactly L (the prefill yields the first token). Block diffusion, per block: one forward per commit round,
except a round where only the block's first position is still masked: its logits come from the last clean
token before the block and do not depend on the canvas, so it is committed without a forward. The forward that
stores a finished block's KV is folded into the next block's first round (Fast-dLLM v2): the input is
[finished block, canvas] under the block-causal mask, the finished block's KV is kept and the canvas KV
dropped (`DynamicCache.crop`). So block_size = 1 diffusion is AR exactly, nfe included, and
nfe = 1 + n_blocks when every block commits in one round.

Greedy by default. The token-choice rule is pluggable (`pick` for AR, `commit_fn` for diffusion) so that
gr2/rl.py samples its rollouts with these same loops; the optional `logprobs` output tensor then receives the
rule's log-prob of every decoded token. The greedy path computes no log-probs (no extra softmax).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from gr2.model import attention_rows, block_causal_mask, position_ids_for


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids [B, P], pad_lens [B])."""
    P = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. bos)")
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
    pad_lens = torch.tensor([P - len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), pad_lens.to(device)


# pick(logits [B, V]) -> (tokens [B], log-probs [B]): the AR token choice (default: arg-max).
PickRule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# commit_fn(logits [B, C, V], masked [B, C], tau) -> (commit [B, C], tokens [B, C], log-probs [B, C]):
# the diffusion commit rule (default: `select_commits`).
CommitRule = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _check_logprobs(logprobs: torch.Tensor | None, rule: Callable | None, shape: tuple[int, int]) -> None:
    """Validate the optional output tensor and clear it: fillers (never decoded) keep log-prob 0."""
    if logprobs is None:
        return
    if rule is None:
        raise ValueError("logprobs needs a token-choice rule that returns them (pick / commit_fn)")
    if tuple(logprobs.shape) != shape:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}, expected {shape}")
    logprobs.zero_()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _pad_id(model: torch.nn.Module) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


@torch.no_grad()
def ar_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    use_cache: bool = True,
    pick: PickRule | None = None,
    logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """AR decoding, batched with left padding. Returns (tokens [B, max_new_tokens], nfe).

    use_cache=False re-runs the whole sequence every step (reference path for tests).
    pick: the token choice from the last logits (default greedy arg-max, no log-probs computed).
    logprobs: optional output [B, max_new_tokens] (needs `pick`): each decoded token's log-prob as returned
    by `pick`, 0 for the eos filler written after a row finished.
    """
    dev = _device(model)
    ids, pad_lens = left_pad(prompts, _pad_id(model), dev)
    B, P = ids.shape
    _check_logprobs(logprobs, pick, (B, max_new_tokens))
    out = torch.full((B, max_new_tokens), eos_id if eos_id is not None else _pad_id(model), device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    seq = ids
    cache = DynamicCache() if use_cache else None
    nfe = 0
    fed = 0  # columns already in the cache
    for t in range(max_new_tokens):
        cols = torch.arange(fed if use_cache else 0, seq.shape[1], device=dev)
        attn = (torch.arange(seq.shape[1], device=dev)[None, :] >= pad_lens[:, None]).long()
        logits = model(
            input_ids=seq[:, cols],
            attention_mask=attn,
            position_ids=position_ids_for(pad_lens, cols),
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=1,  # the LM head on the last column only (the prefill would project all P)
        ).logits[:, -1]
        nfe += 1
        fed = seq.shape[1]
        if pick is None:
            tok = logits.argmax(-1)
        else:
            tok, lp = pick(logits)
            if logprobs is not None:
                logprobs[:, t] = torch.where(done, torch.zeros_like(lp), lp)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
        out[:, t] = tok
        if eos_id is not None:
            done |= tok == eos_id
            if bool(done.all()):
                break
        seq = torch.cat([seq, tok[:, None]], dim=1)
    return out, nfe


def threshold_commits(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """The commit rule (PAPER 3.5) on confidences [B, C]: every masked position with conf >= tau, plus the single
    most confident masked one (progress even when nothing clears tau). Rows with nothing masked commit nothing."""
    conf = conf.masked_fill(~masked, -1.0)  # real confidences are >= 0, so the arg-max is a masked position
    forced = torch.zeros_like(masked).scatter_(1, conf.argmax(-1, keepdim=True), True)
    return masked & ((conf >= tau) | forced)


def select_commits(
    logits: torch.Tensor, masked: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy commits: `threshold_commits` with confidence = top-1 probability, tokens = arg-max.

    logits [B, C, V] (already token-shifted: row j predicts canvas position j), masked [B, C].
    Returns (commit [B, C] bool, greedy tokens [B, C]).
    """
    # The same ops as gr2/rl.py's temperature-0 pick (max of log_softmax), so greedy decoding and greedy RL
    # rollouts commit identically; one fused log_softmax is also faster on the CPU than max + logsumexp.
    top_lp, pred = logits.float().log_softmax(-1).max(-1)
    return threshold_commits(top_lp.exp(), masked, tau), pred


def _crop_to(cache: DynamicCache, length: int) -> None:
    """Truncate the cache to its first `length` columns (`crop` takes the number to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _finished(block: torch.Tensor, committed: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B] rows with a committed eos in `block` whose every earlier block position is committed."""
    before = torch.cat(
        [torch.ones_like(committed[:, :1]), committed[:, :-1].long().cumprod(-1).bool()], dim=1
    )
    return (committed & (block == eos_id) & before).any(-1)


@torch.no_grad()
def diffusion_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    tau: float,
    mask_id: int,
    eos_id: int | None,
    use_cache: bool = True,
    commit_fn: CommitRule | None = None,
    logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Block-diffusion decoding with threshold commits (greedy by default). Returns (tokens, nfe, trajectory).

    Blocks of `block_size` are aligned at the response start (the last one is cut at max_new_tokens). Each
    block starts as a canvas of `mask_id`; each round predicts every masked position with the AR token shift
    (position j from hidden j-1; position 0 from the last clean token before the block) and commits per
    `select_commits`. The prompt is prefilled once into a DynamicCache; finished blocks are appended to it.

    trajectory [B, max_new_tokens]: the commit round (0-based, counted over the whole call and shared by the
    batch) at which each token was committed; -1 = eos filler written after the row finished. To replay the
    canvas a token was predicted from (RL): its block holds the tokens with a smaller round, masks elsewhere.

    use_cache=False is the reference path: every round re-runs prompt + finished blocks + canvas under
    `block_causal_mask` (same tokens and trajectory; more compute; it runs a forward every round).

    commit_fn: the commit rule, called as commit_fn(shifted logits, masked, tau) -> (commit, tokens,
    log-probs) (default `select_commits`, no log-probs computed). logprobs: optional output
    [B, max_new_tokens] (needs `commit_fn`): each committed token's log-prob as returned by the rule,
    0 where trajectory is -1.
    """
    dev = _device(model)
    ids, pad_lens = left_pad(prompts, _pad_id(model), dev)
    B, P = ids.shape
    L = max_new_tokens
    _check_logprobs(logprobs, commit_fn, (B, L))
    fill = eos_id if eos_id is not None else mask_id
    resp = torch.full((B, L), mask_id, dtype=torch.long, device=dev)
    traj = torch.full((B, L), -1, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nfe, rnd = 0, 0

    cache, anchor = None, None
    if use_cache:
        cache = DynamicCache()
        cols = torch.arange(P, device=dev)
        attn = (cols[None, :] >= pad_lens[:, None]).long()
        anchor = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=position_ids_for(pad_lens, cols),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        nfe += 1

    if use_cache:
        # Every response row's attention over prompt + response, built once; each block's masks are slices.
        resp_rows = attention_rows(P, torch.arange(P, P + L, device=dev), P + L, block_size, pad_lens)
    end = 0  # response columns reached so far
    for s0 in range(0, L, block_size):
        if bool(done.all()):
            break
        cl = min(block_size, L - s0)
        end = s0 + cl
        block = resp[:, s0 : s0 + cl]  # view: writes land in resp
        committed = torch.zeros(B, cl, dtype=torch.bool, device=dev)
        committed[done] = True
        block[done] = fill
        pending = use_cache and s0 > 0  # previous block's KV not yet in the cache
        if use_cache:
            # The block's attention rows and positions, sliced once: [finished block, canvas] for the fold
            # round, the canvas rows alone for the other rounds.
            n_pend = block_size if pending else 0
            cols = torch.arange(P + s0 - n_pend, P + s0 + cl, device=dev)
            fold_mask = resp_rows[:, :, s0 - n_pend : s0 + cl, : P + s0 + cl].contiguous()
            fold_pos = position_ids_for(pad_lens, cols)
            canvas_mask, canvas_pos = fold_mask[:, :, n_pend:].contiguous(), fold_pos[:, n_pend:]
        eos_seen = False  # no row can finish inside this block before some row commits an eos in it
        while True:
            masked = ~committed
            if not bool(masked.any()):
                break
            if not use_cache:
                T = P + s0 + cl
                cols = torch.arange(T, device=dev)
                logits = model(
                    input_ids=torch.cat([ids, resp[:, : s0 + cl]], dim=1),
                    attention_mask=block_causal_mask(P, T, block_size, pad_lens),
                    position_ids=position_ids_for(pad_lens, cols),
                ).logits
                nfe += 1
                shifted = logits[:, P + s0 - 1 : P + s0 + cl - 1]
            elif pending or bool(masked[:, 1:].any()):
                logits = model(
                    input_ids=torch.cat([resp[:, s0 - n_pend : s0], block], dim=1) if pending else block,
                    attention_mask=fold_mask if pending else canvas_mask,
                    position_ids=fold_pos if pending else canvas_pos,
                    cache=cache,
                    use_cache=True,
                    # Only the last cl + 1 columns' logits are read (the finished block's last column = the
                    # new anchor, then canvas 0..cl-2); skip the LM head for the rest of the finished block.
                    logits_to_keep=cl + 1 if pending else cl,
                ).logits
                nfe += 1
                _crop_to(cache, P + s0)  # keep prompt + finished blocks, drop the canvas
                if pending:
                    anchor = logits[:, 0]
                    logits = logits[:, 1:]
                    pending = False
                shifted = torch.cat([anchor[:, None], logits[:, : cl - 1]], dim=1)
            else:  # only position 0 masked: its logits (anchor) do not depend on the canvas
                shifted = anchor[:, None]
            masked = masked[:, : shifted.shape[1]]
            c = shifted.shape[1]
            if commit_fn is None:  # the module global, looked up per round (tests spy on it)
                commit, pred = select_commits(shifted, masked, tau)
            else:
                commit, pred, lp = commit_fn(shifted, masked, tau)
                if logprobs is not None:
                    logprobs[:, s0 : s0 + c][commit] = lp[commit]
            block[:, :c] = torch.where(commit, pred, block[:, :c])
            traj[:, s0 : s0 + c].masked_fill_(commit, rnd)
            committed[:, :c] |= commit
            rnd += 1
            if eos_id is not None:
                eos_seen = eos_seen or bool((commit & (pred == eos_id)).any())
            if eos_seen:
                newly = _finished(block, committed, eos_id) & ~done
                if bool(newly.any()):
                    done |= newly
                    rest = newly[:, None] & ~committed
                    block[rest] = fill
                    committed |= newly[:, None]
    resp[:, end:] = fill  # blocks never reached because every row had finished
    return resp, nfe, traj
