"""The decoders: AR with a KV cache, threshold-commit block diffusion (docs/PAPER.md), and lossless speculative
decoding (a block-diffusion draft checked by the AR model). Each returns nfe.

Straight functions in the style of LLaDA / Fast-dLLM `generate.py`: `ar_generate`, `diffusion_generate` (KV cache),
`diffusion_generate_nocache` (the reference the cached loop must equal) and `spec_generate`; the diffusion loops
share one commit step (`_commit_round`: the commit rule plus its bookkeeping). They take unpadded prompts (lists of
token ids), left-pad them (see gr2/model.py for the layout) and return `tokens` [B, max_new_tokens]. A row is
finished once it has an eos with every position before it decoded; positions the decoder never wrote after that
are filled with eos. Read a row up to its first eos: with block_size > 1, tokens committed after the eos inside
the same block are kept as decoded (the trajectory must replay them) and mean nothing.

nfe = number of model forward calls for the whole batch, prefill included. For AR generating L tokens that is
exactly L (the prefill yields the first token). Block diffusion, per block: one forward per commit round,
except a round where only the block's first position is still masked: its logits come from the last clean
token before the block and do not depend on the canvas, so it is committed without a forward.

The finished block's KV. Later blocks must see a finished block as a forward over its final tokens computes it:
that is what training shows them (gr2/losses.py: clean blocks before the noisy one). The block's last round
cannot provide it: that forward ran on a canvas where the positions it committed were still masks, and attention
inside a block is bidirectional, so the KV of every position of the block (and the logits of its last column,
which predict the next block's first token) saw those masks. So the finished block is fed once more, folded into
the next block's first round (Fast-dLLM v2): input [finished block, canvas] under the block-causal mask, the
finished block's KV kept, the canvas KV dropped (`DynamicCache.crop`). That costs block_size more tokens in one
forward per block and no extra forward: block_size = 1 diffusion is AR exactly, nfe included, and
nfe = 1 + n_blocks when every block commits in one round.

Permutation answers. `unique` (optional) names tokens that may appear at most once in a response: the answer's
candidate labels, so that every decoder writes each candidate once. Every decoder applies the same rule: a unique
token already written is banned from the logits (`ban_repeats`), and a diffusion round that picks one unique
token at two positions commits only the more confident (`one_of_each`). The equivalences below hold with it.

Answers that follow their trace. `follow` (optional, with `unique`) makes the answer agree with the trace the
response wrote before it (gr2/prompt.py: one label and one score level per candidate, then the answer's head, then
labels one token apart). Once a row's whole trace is decoded, the answer's k-th label must be a candidate whose
level is the k-th highest of the trace (`answer_slots`; nothing else may go there): the answer ranks by the trace, and the model itself only
orders candidates that share a level. Until then a row's answer labels wait: a parallel round commits none of them
while a trace position of the row is still open (in a block that holds the trace's end and the answer's first
labels, a label committed in the trace's last round would be unruled). The trace's open positions precede the
labels in the same block, so a round always has something to commit. The rule is per position, so parallel rounds
obey it as AR does, and every equivalence below holds with it. A greedy diffusion round ends with
`forced_commits`: an open answer position that the rule, given what the round committed, leaves a single label
(a level no other candidate has, or the last label of a tied level) is committed in that round. Its logits could
not pick anything else, so waiting a round for them would cost a forward and decide nothing. (An AR decoder
could skip those forwards too, by feeding a forced token together with the next one, as jump-forward decoding
does; `ar_generate` decodes one token per forward, the baseline the speedups are measured against.) Sampling
(`commit_fn`) leaves them to the model's rounds, so RL's replay sees the trajectory it sampled.

Greedy by default. The token-choice rule is pluggable (`pick` for AR, `commit_fn` for diffusion) so that
gr2/rl.py samples its rollouts with these same loops; the optional `logprobs` output tensor then receives the
rule's log-prob of every decoded token. The greedy path computes no log-probs (no extra softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gr2.model import attention_rows, block_causal_mask, model_config, position_ids_for


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


@dataclass(frozen=True)
class TraceRule:
    """The tokens `answer_slots` reads (module docstring: answers that follow their trace)."""

    labels: (
        torch.Tensor
    )  # [K] the candidates' label tokens [A], [B], ... (prompt and trace); label i answers unique[i]
    levels: torch.Tensor  # [S] the score-level tokens <score_0>, <score_1>, ...: a level's value is its index
    head: int  # tokens between the trace and the answer's first label ('{ "ranking" : [')

    def n_candidates(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[B]: the candidates of each (padded) prompt [B, P], i.e. its label tokens."""
        return torch.isin(prompt_ids, self.labels.to(prompt_ids.device)).sum(-1)


class Slots(NamedTuple):
    """The answer's label positions that the trace rules (`answer_slots`)."""

    active: torch.Tensor  # [B, T]: an answer label's position, ruled by its row's decoded, well-formed trace
    allowed: torch.Tensor  # [B, T, K]: the labels (unique[k]) the trace allows there
    no_label: (
        torch.Tensor
    )  # [B, T]: a position after such a trace where no label belongs (head, commas, tail)
    wait: torch.Tensor  # [B, T]: an answer label's position whose row's trace is not all decoded yet

    def cols(self, start: int, stop: int | None = None) -> Slots:
        return Slots(*(t[:, start:stop] for t in self))


def answer_slots(rule: TraceRule, resp: torch.Tensor, known: torch.Tensor, n: torch.Tensor) -> Slots:
    """The positions of response [B, T] where the trace rules the answer (`known`: decoded positions; n [B]:
    candidates per row). A row whose trace is decoded and well formed (label i then one level, for i < n) rules
    its answer's k-th label position: only a candidate whose level is the trace's k-th highest may go there; and
    no label may go anywhere else after the trace (a label written past the answer would take a slot's label).
    A row whose trace still has an undecoded position makes its answer's label positions wait: a parallel round
    must not commit a label that the rest of the trace could rule out (module docstring)."""
    B, T = resp.shape
    K = len(rule.labels)
    dev = resp.device
    active = torch.zeros(B, T, dtype=torch.bool, device=dev)
    allowed = torch.zeros(B, T, K, dtype=torch.bool, device=dev)
    if T <= 2 * int(n.min()):  # no row is past its trace
        return Slots(active, allowed, active.clone(), active.clone())
    i = torch.arange(K, device=dev)
    lab_col, lev_col = (2 * i).clamp(max=T - 1), (2 * i + 1).clamp(max=T - 1)
    is_level = resp[:, lev_col, None] == rule.levels.to(dev)  # [B, K, S]
    entry_ok = (
        (resp[:, lab_col] == rule.labels.to(dev))
        & is_level.any(-1)
        & known[:, lab_col]
        & known[:, lev_col]
        & (2 * i + 1 < T)
    )
    cand = i[None, :] < n[:, None]  # [B, K]
    trace_ok = (entry_ok | ~cand).all(-1)  # [B]
    level = torch.where(cand, is_level.long().argmax(-1), -1)  # [B, K]; -1: not a candidate of the row
    slot_level = level.sort(-1, descending=True).values  # [B, K]: the level the answer's k-th label must have
    slot_col = 2 * n[:, None] + rule.head + 2 * i[None, :]  # [B, K]
    rows, slots = (trace_ok[:, None] & cand & (slot_col < T)).nonzero(as_tuple=True)
    cols = slot_col[rows, slots]
    active[rows, cols] = True
    allowed[rows, cols] = level[rows] == slot_level[rows, slots, None]
    past_trace = torch.arange(T, device=dev)[None, :] >= 2 * n[:, None]  # [B, T]
    trace_known = (known | past_trace).all(-1)  # [B]
    wait = torch.zeros_like(active)
    w_rows, w_slots = (~trace_known[:, None] & cand & (slot_col < T)).nonzero(as_tuple=True)
    wait[w_rows, slot_col[w_rows, w_slots]] = True
    return Slots(active, allowed, trace_ok[:, None] & past_trace & ~active, wait)


def _slot_bans(
    slots: Slots, seen: torch.Tensor | None, unique: torch.Tensor, vocab: int
) -> torch.Tensor | None:
    """`keep_slots`' mask [B, C, vocab] (True = banned), or None when it bans nothing."""
    allowed = slots.allowed if seen is None else slots.allowed & ~seen
    rule = slots.active & allowed.any(-1)
    if not bool(rule.any() or slots.no_label.any()):
        return None
    ban = torch.zeros(*allowed.shape[:2], vocab, dtype=torch.bool, device=allowed.device)
    ban[rule] = True
    ban[..., unique] = (rule[..., None] & ~allowed) | slots.no_label[..., None]
    return ban


def keep_slots(
    logits: torch.Tensor, slots: Slots, seen: torch.Tensor | None, unique: torch.Tensor
) -> torch.Tensor:
    """logits [B, C, V] with every token but the allowed labels not yet written (seen [B, C or 1, K]) banned at the
    active slots [B, C], and every label banned at the no-label positions. A slot with no such label left (the
    answer put one elsewhere before the trace ruled it) is left as it is, so that some token stays possible."""
    ban = _slot_bans(slots, seen, unique, logits.shape[-1])
    return logits if ban is None else logits.masked_fill(ban, float("-inf"))


def rule_bans(
    vocab: int, seen: torch.Tensor | None, slots: Slots | None, unique: torch.Tensor
) -> torch.Tensor | None:
    """`ban_repeats` then `keep_slots` as one mask [B, C, vocab] (True = banned; seen [B, K]), or None when
    neither bans anything: what a diffusion round applies to its logits (one masked_fill instead of two)."""
    ban = None if slots is None else _slot_bans(slots, None if seen is None else seen[:, None], unique, vocab)
    if seen is None or not bool(seen.any()):  # the trace holds no label: no repeat to ban
        return ban
    if ban is None:
        C = 1 if slots is None else slots.active.shape[1]
        ban = torch.zeros(seen.shape[0], C, vocab, dtype=torch.bool, device=seen.device)
    ban[..., unique] |= seen[:, None]
    return ban


def single_label(slots: Slots, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the active slots [B, C] whose trace allows exactly one label not in `seen` [B, C or 1, K], and the labels
    still allowed [B, C, K]): the positions the rule decides without the model."""
    allowed = slots.allowed & ~seen
    return slots.active & (allowed.sum(-1) == 1), allowed


def _follow_n(
    follow: TraceRule | None, unique: torch.Tensor | None, prompt_ids: torch.Tensor
) -> torch.Tensor | None:
    """Candidates per row when the answer follows the trace (None otherwise); the rule needs `unique`."""
    if follow is None:
        return None
    if unique is None:
        raise ValueError("follow (the answer follows the trace) needs unique (the answer's label tokens)")
    return follow.n_candidates(prompt_ids)


def _trace_ends(n: torch.Tensor | None) -> tuple[int, int]:
    """The response columns where the shortest and the longest trace end (a label and a level per candidate).
    Before the first `answer_slots` rules nothing; from the second on it reads only decoded trace tokens, so a
    loop computes it once for the rest of the response."""
    return (0, 0) if n is None else (2 * int(n.min()), 2 * int(n.max()))


def _block_slots(
    follow: TraceRule | None, n: torch.Tensor | None, resp: torch.Tensor, committed: torch.Tensor
) -> Slots | None:
    """`answer_slots` for the open block, the last committed.shape[1] columns of resp [B, end]: the positions
    before the block are decoded, the block's are as far as `committed` says. None without the rule."""
    if follow is None or n is None:
        return None
    cl = committed.shape[1]
    known = torch.cat([torch.ones_like(resp[:, : resp.shape[1] - cl], dtype=torch.bool), committed], dim=1)
    return answer_slots(follow, resp, known, n).cols(-cl)


def _check_logprobs(logprobs: torch.Tensor | None, rule: Callable | None, shape: tuple[int, int]) -> None:
    """Validate the optional output tensor and clear it: fillers (never decoded) keep log-prob 0."""
    if logprobs is None:
        return
    if rule is None:
        raise ValueError("logprobs needs a token-choice rule that returns them (pick / commit_fn)")
    if tuple(logprobs.shape) != shape:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}, expected {shape}")
    logprobs.zero_()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's (first) parameters: where the decoders build their tensors."""
    return next(model.parameters()).device


def model_pad_id(model: torch.nn.Module) -> int:
    """The id the decoders left-pad prompts with: the config's pad_token_id, 0 when it has none."""
    pad = model_config(model).pad_token_id
    return 0 if pad is None else int(pad)


def pad_prompts(prompts: list[list[int]], model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as every decoder lays them out for `model`: `left_pad` with its pad id, on its device
    -> (ids [B, P], pad_lens [B])."""
    return left_pad(prompts, model_pad_id(model), model_device(model))


def _layout(
    prompts: list[list[int]], max_new_tokens: int, model: torch.nn.Module, fill: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoding buffer and what every forward slices: (seq [B, P + L] = left-padded prompts then `fill`,
    pad_lens [B], attn [B, P + L] (1 = a real column), pos [B, P + L] position ids)."""
    ids, pad_lens = pad_prompts(prompts, model)
    dev = ids.device
    seq = torch.cat([ids, torch.full((ids.shape[0], max_new_tokens), fill, device=dev)], dim=1)
    cols = torch.arange(seq.shape[1], device=dev)
    attn = (cols[None, :] >= pad_lens[:, None]).long()
    return seq, pad_lens, attn, position_ids_for(pad_lens, cols)


def _prefill(
    model: torch.nn.Module, seq: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, P: int
) -> tuple[DynamicCache, torch.Tensor]:
    """Feed the prompt (the first P columns) into a new cache; returns it and the logits [B, V] of the prompt's
    last column (they predict the first response token)."""
    cache = DynamicCache()
    logits = model(
        input_ids=seq[:, :P],
        attention_mask=attn[:, :P],
        position_ids=pos[:, :P],
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    return cache, logits


@torch.no_grad()
def ar_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    use_cache: bool = True,
    pick: PickRule | None = None,
    logprobs: torch.Tensor | None = None,
    unique: torch.Tensor | None = None,
    follow: TraceRule | None = None,
) -> tuple[torch.Tensor, int]:
    """AR decoding, batched with left padding. Returns (tokens [B, max_new_tokens], nfe).

    use_cache=False re-runs the whole sequence every step (reference path for tests).
    pick: the token choice from the last logits (default greedy arg-max, no log-probs computed).
    logprobs: optional output [B, max_new_tokens] (needs `pick`): each decoded token's log-prob as returned
    by `pick`, 0 for the eos filler written after a row finished.
    unique: token ids written at most once per row; follow: the answer follows the trace (module docstring).
    """
    fill = eos_id if eos_id is not None else model_pad_id(model)
    seq, _, attn, pos = _layout(prompts, max_new_tokens, model, fill)
    B, P = seq.shape[0], seq.shape[1] - max_new_tokens
    _check_logprobs(logprobs, pick, (B, max_new_tokens))
    done = torch.zeros(B, dtype=torch.bool, device=seq.device)
    seen = None if unique is None else torch.zeros(B, len(unique), dtype=torch.bool, device=seq.device)
    n = _follow_n(follow, unique, seq[:, :P])
    # fixed: the slots of the whole response, once every trace is decoded (`_trace_ends`)
    trace_end, fixed = _trace_ends(n)[1], None
    cache = DynamicCache() if use_cache else None
    nfe = 0
    for t in range(max_new_tokens):
        lo = P + t - 1 if use_cache and t else 0  # cached: only the last decoded token is new
        logits = model(
            input_ids=seq[:, lo : P + t],
            attention_mask=attn[:, : P + t],
            position_ids=pos[:, lo : P + t],
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=1,  # the LM head on the last column only (the prefill would project all P)
        ).logits[:, -1]
        nfe += 1
        if seen is not None and unique is not None and bool(seen.any()):  # nothing to ban before a label
            logits = ban_repeats(logits[:, None], seen[:, None], unique)[:, 0]
        if follow is not None and n is not None and unique is not None:
            if t < trace_end:
                resp = seq[:, P : P + t + 1]
                slots = answer_slots(follow, resp, torch.ones_like(resp, dtype=torch.bool), n).cols(-1)
            else:
                if fixed is None:
                    resp = seq[:, P:]
                    fixed = answer_slots(follow, resp, torch.ones_like(resp, dtype=torch.bool), n)
                slots = fixed.cols(t, t + 1)
            logits = keep_slots(logits[:, None], slots, None if seen is None else seen[:, None], unique)[:, 0]
        if pick is None:
            tok = logits.argmax(-1)
        else:
            tok, lp = pick(logits)
            if logprobs is not None:
                logprobs[:, t] = lp.masked_fill(done, 0.0)
        if eos_id is not None:
            tok = tok.masked_fill(done, eos_id)
        seq[:, P + t] = tok
        if seen is not None:
            seen |= tok[:, None] == unique
        if eos_id is not None:
            done |= tok == eos_id
            if bool(done.all()):
                break
    return seq[:, P:].clone(), nfe


def threshold_commits(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """The commit rule (docs/PAPER.md) on confidences [B, C]: every masked position with conf >= tau, plus the single
    most confident masked one (progress even when nothing clears tau). Rows with nothing masked commit nothing."""
    conf = conf.masked_fill(~masked, -1.0)  # real confidences are >= 0, so the arg-max is a masked position
    forced = torch.zeros_like(masked).scatter_(1, conf.argmax(-1, keepdim=True), True)
    return masked & ((conf >= tau) | forced)


def select_commits(
    logits: torch.Tensor, masked: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy commits: `threshold_commits` with confidence = top-1 probability, tokens = arg-max.

    logits [B, C, V] (already token-shifted: row j predicts canvas position j), masked [B, C].
    Returns (commit [B, C] bool, greedy tokens [B, C], their log-probs [B, C]): a `CommitRule`.
    """
    # The same ops as gr2/rl.py's temperature-0 pick (max of log_softmax), so greedy decoding and greedy RL
    # rollouts commit identically; one fused log_softmax is also faster on the CPU than max + logsumexp.
    top_lp, pred = logits.float().log_softmax(-1).max(-1)
    return threshold_commits(top_lp.exp(), masked, tau), pred, top_lp


def seen_before(tokens: torch.Tensor, unique: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> [B, T + 1, K]: whether unique[k] occurs in tokens[:, :t], for t = 0..T."""
    hit = (tokens[:, :, None] == unique).long().cumsum(1) > 0
    return torch.cat([torch.zeros_like(hit[:, :1]), hit], dim=1)


def ban_repeats(logits: torch.Tensor, seen: torch.Tensor, unique: torch.Tensor) -> torch.Tensor:
    """logits [B, C, V] with -inf at every unique token already written: seen [B, C or 1, K] (`seen_before`)."""
    ban = torch.zeros(*seen.shape[:2], logits.shape[-1], dtype=torch.bool, device=logits.device)
    ban[..., unique] = seen
    return logits.masked_fill(ban, float("-inf"))


def one_of_each(
    commit: torch.Tensor, pred: torch.Tensor, conf: torch.Tensor, unique: torch.Tensor
) -> torch.Tensor:
    """commit [B, C] less the positions that pick a unique token another committed position of the round picks
    with more confidence (equal: the leftmost wins). The round's most confident position always stays."""
    u = commit & torch.isin(pred, unique)
    same = (pred[:, :, None] == pred[:, None, :]) & u[:, :, None] & u[:, None, :]  # [B, i, j]
    col = torch.arange(pred.shape[1], device=pred.device)
    beats = (conf[:, None, :] > conf[:, :, None]) | (
        (conf[:, None, :] == conf[:, :, None]) & (col[None, None, :] < col[None, :, None])
    )
    return commit & ~(same & beats).any(-1)


def _commit_round(
    shifted: torch.Tensor,
    committed: torch.Tensor,
    tau: float,
    commit_fn: CommitRule | None,
    block: torch.Tensor,
    traj: torch.Tensor | None,
    logprobs: torch.Tensor | None,
    rnd: int,
    eos_id: int | None,
    unique: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    slots: Slots | None = None,
) -> bool:
    """One commit round, shared by the diffusion loops: the commit rule on the token-shifted logits [B, c, V] of
    the block's first c positions, then its bookkeeping in place: the committed tokens into `block`, `rnd` into
    `traj`, their log-probs into `logprobs` (all three: the block's columns) and `committed` [B, cl].
    unique / seen [B, K]: the tokens written at most once, and which of them the response holds so far (updated
    in place with this round's commits). slots: the block's positions the trace rules (`answer_slots`).
    Returns whether an eos was committed (only then can a row have finished)."""
    c = shifted.shape[1]
    masked = ~committed[:, :c]
    if slots is not None:  # a label waits for its row's trace (module docstring)
        slots = slots.cols(0, c)
        masked &= ~slots.wait
    if unique is not None:
        ban = rule_bans(shifted.shape[-1], seen, slots, unique)
        if ban is not None:
            shifted = shifted.masked_fill(ban, float("-inf"))
    # the module global, looked up per round (tests spy on it)
    commit, pred, lp = (select_commits if commit_fn is None else commit_fn)(shifted, masked, tau)
    if seen is not None and unique is not None:  # ban what the response holds already
        hit = pred[..., None] == unique  # [B, c, K] (cheaper than torch.isin on a few columns)
        new = commit & hit.any(-1)
        if bool((new.sum(-1) > 1).any()):  # two positions may pick one label: the more confident commits
            commit = one_of_each(commit, pred, lp, unique)
            new &= commit
        seen |= (hit & new[..., None]).any(1)
    if commit_fn is not None and logprobs is not None:
        logprobs[:, :c] = torch.where(commit, lp, logprobs[:, :c])
    block[:, :c] = torch.where(commit, pred, block[:, :c])  # (no boolean indexing: it waits for a nonzero)
    if traj is not None:
        traj[:, :c].masked_fill_(commit, rnd)
    committed[:, :c] |= commit
    return eos_id is not None and bool((commit & (pred == eos_id)).any())


def forced_commits(
    slots: Slots,
    block: torch.Tensor,
    committed: torch.Tensor,
    seen: torch.Tensor,
    unique: torch.Tensor,
    traj: torch.Tensor | None,
    rnd: int,
) -> None:
    """Commit, in place, every open answer slot of the block whose trace leaves it one label not yet written:
    the rules ban every other token there, so the model's logits cannot change it."""
    if not bool((slots.active & ~committed).any()):
        return
    one, allowed = single_label(slots, seen[:, None])
    pick = (one & ~committed)[..., None] & allowed  # [B, c, K]
    pick &= pick.long().cumsum(1) == 1  # two slots left with one label: the first takes it
    commit = pick.any(-1)
    if not bool(commit.any()):
        return
    block.copy_(torch.where(commit, unique[pick.long().argmax(-1)], block))
    if traj is not None:
        traj.masked_fill_(commit, rnd)
    committed |= commit
    seen |= pick.any(1)


def _finish_rows(
    block: torch.Tensor, committed: torch.Tensor, done: torch.Tensor, eos_id: int, fill: int
) -> None:
    """Rows whose block holds a committed eos with every earlier position committed are done: their open
    positions get `fill` and count as committed (in place)."""
    before = torch.cat(
        [torch.ones_like(committed[:, :1]), committed[:, :-1].long().cumprod(-1).bool()], dim=1
    )
    newly = (committed & (block == eos_id) & before).any(-1) & ~done
    if bool(newly.any()):
        done |= newly
        rest = newly[:, None] & ~committed
        block[rest] = fill
        committed |= newly[:, None]


class _RowsCache:
    """Some rows of a decoding cache, copied, for forwards over those rows only (`diffusion_generate`).

    The copy holds the prompt and the finished blocks of the rows in `rows` [B] (bool); a forward appends the
    canvas KV, which `forward` crops again, so the copy serves every round while the same rows are open."""

    def __init__(self, cache: DynamicCache, rows: torch.Tensor):
        self.rows, self.index = rows, rows.nonzero().squeeze(1)
        self.cache = DynamicCache()
        for i, layer in enumerate(cache.layers):
            layer = cast(DynamicLayer, layer)  # what a DynamicCache() fills (`_prefill`)
            assert layer.keys is not None and layer.values is not None
            self.cache.update(layer.keys[self.index], layer.values[self.index], i)

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, keep: int
    ) -> torch.Tensor:
        """The model's logits [B, keep, V] for ids [B, C] (mask, pos: the full batch's): the rows' own, and
        zeros for the other rows (committed past position 0, whose logits are the anchor's: the round reads none
        of their zeros)."""
        i = self.index
        out = model(
            input_ids=ids[i],
            attention_mask=mask[i],
            position_ids=pos[i],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        ).logits
        self.cache.crop(-ids.shape[1])
        logits = out.new_zeros(len(self.rows), *out.shape[1:])
        return logits.index_copy_(0, i, out)


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
    unique: torch.Tensor | None = None,
    follow: TraceRule | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Block-diffusion decoding with threshold commits (greedy by default). Returns (tokens, nfe, trajectory).

    Blocks of `block_size` are aligned at the response start (the last one is cut at max_new_tokens). Each
    block starts as a canvas of `mask_id`; each round predicts every masked position with the AR token shift
    (position j from hidden j-1; position 0 from the last clean token before the block: the anchor) and commits
    per `select_commits`. The prompt is prefilled once into a DynamicCache; each finished block is added to it
    by the next block's first forward (module docstring).

    trajectory [B, max_new_tokens]: the commit round (0-based, counted over the whole call and shared by the
    batch) at which each token was committed; -1 = eos filler written after the row finished. To replay the
    canvas a token was predicted from (RL): its block holds the tokens with a smaller round, masks elsewhere.

    use_cache=False runs `diffusion_generate_nocache`, the reference (same tokens and trajectory).

    Rows that wait for others. Every row of a batch runs the same rounds, so a row whose block is decided waits
    for the batch's slowest row. Such rows sit those rounds out: a round's forward reads only the rows with an
    open position past position 0 (`_RowsCache`). Rows are independent, so their logits are the same (up to the
    rounding of a smaller matrix product), and the tokens are.

    commit_fn: the commit rule, called as commit_fn(shifted logits, masked, tau) -> (commit, tokens,
    log-probs) (default `select_commits`, no log-probs computed). logprobs: optional output
    [B, max_new_tokens] (needs `commit_fn`): each committed token's log-prob as returned by the rule,
    0 where trajectory is -1. unique: token ids written at most once per row; follow: the answer follows the
    trace (module docstring).
    """
    if not use_cache:
        return diffusion_generate_nocache(
            model,
            prompts,
            max_new_tokens,
            block_size,
            tau,
            mask_id,
            eos_id,
            commit_fn,
            logprobs,
            unique,
            follow,
        )
    L = max_new_tokens
    fill = eos_id if eos_id is not None else mask_id
    seq, pad_lens, attn, pos = _layout(prompts, L, model, mask_id)
    B, P = seq.shape[0], seq.shape[1] - L
    _check_logprobs(logprobs, commit_fn, (B, L))
    resp = seq[:, P:]  # a view: the response as it is decoded
    traj = torch.full((B, L), -1, dtype=torch.long, device=seq.device)
    done = torch.zeros(B, dtype=torch.bool, device=seq.device)
    seen = None if unique is None else torch.zeros(B, len(unique), dtype=torch.bool, device=seq.device)
    n = _follow_n(follow, unique, seq[:, :P])
    first_end, trace_end = _trace_ends(n)
    cache, anchor = _prefill(model, seq, attn, pos, P)
    nfe, rnd, end = 1, 0, 0
    after: Slots | None = None  # the slots past every trace
    # Every response row's attention over prompt + response, built once; each block's masks are slices of it.
    rows = attention_rows(P, torch.arange(P, P + L, device=seq.device), P + L, block_size, pad_lens)
    for s0 in range(0, L, block_size):
        if bool(done.all()):
            break
        end = min(s0 + block_size, L)
        cl = end - s0
        block, committed = resp[:, s0:end], done[:, None].repeat(1, cl)
        block[done] = fill
        back = min(s0, block_size)  # the finished block, fed again by this block's first forward
        first_mask = rows[:, :, s0 - back : end, : P + end].contiguous()  # [finished block, canvas] rows
        canvas_mask = first_mask[:, :, back:].contiguous()
        # Before any trace ends a block has no slots; past every trace the slots do not change (`_trace_ends`):
        # they are read once, for the rest of the response, when the first block past every trace opens.
        if s0 >= trace_end and follow is not None and n is not None and after is None:
            after = answer_slots(follow, resp, torch.ones_like(resp, dtype=torch.bool), n)
        fixed = None if after is None else after.cols(s0, end)
        per_round = first_end < end and s0 < trace_end
        # The block's trace positions (a label and a level per candidate): once all are decoded, its slots are fixed.
        in_trace = None if n is None else torch.arange(s0, end, device=seq.device)[None, :] < 2 * n[:, None]
        slots = _block_slots(follow, n, resp[:, :end], committed) if per_round else fixed
        eos_seen = False  # no row can finish inside this block before some row commits an eos in it
        part: _RowsCache | None = None  # the cache rows of the rows still open (below)
        while not bool(committed.all()):
            todo = None if back else (~committed[:, 1:]).any(-1)  # rows open past position 0 (None: all rows)
            n_todo = B if todo is None else int(todo.sum())
            if n_todo == 0:
                shifted = anchor[:, None]  # only position 0 open: its logits (the anchor) ignore the canvas
            elif todo is not None and n_todo < B:
                # The other rows sit the round out (position 0's logits are the anchor's): the forward reads the
                # open rows only, from a copy of their cache rows, kept while the same rows are open.
                if part is None or not torch.equal(part.rows, todo):
                    part = _RowsCache(cache, todo)
                logits = part.forward(
                    model, seq[:, P + s0 : P + end], canvas_mask, pos[:, P + s0 : P + end], cl
                )
                nfe += 1
                shifted = torch.cat([anchor[:, None], logits[:, :-1]], dim=1)
            else:  # every row; a block's first forward (back) also stores the finished block for every row
                logits = model(
                    input_ids=seq[:, P + s0 - back : P + end],
                    attention_mask=first_mask if back else canvas_mask,
                    position_ids=pos[:, P + s0 - back : P + end],
                    cache=cache,
                    use_cache=True,
                    # The finished block's last column (the new anchor) and the canvas; the LM head skips the
                    # rest of the finished block.
                    logits_to_keep=cl + (1 if back else 0),
                ).logits
                nfe += 1
                cache.crop(-cl)  # keep prompt + finished blocks, drop the canvas
                if back:  # column 0 is the new anchor: the logits are already token-shifted
                    anchor, shifted, back = logits[:, 0], logits[:, :cl], 0
                else:
                    shifted = torch.cat([anchor[:, None], logits[:, :-1]], dim=1)
            lp = None if logprobs is None else logprobs[:, s0:end]
            eos_seen |= _commit_round(
                shifted,
                committed,
                tau,
                commit_fn,
                block,
                traj[:, s0:end],
                lp,
                rnd,
                eos_id,
                unique,
                seen,
                slots,
            )
            if per_round:  # the slots this round left, which are the next round's too: forced commits write
                # answer slots only, and the slots read only trace tokens
                slots = _block_slots(follow, n, resp[:, :end], committed)
                if in_trace is not None and bool((committed | ~in_trace).all()):
                    fixed, per_round = slots, False
            if commit_fn is None and slots is not None and seen is not None and unique is not None:
                forced_commits(slots, block, committed, seen, unique, traj[:, s0:end], rnd)
            rnd += 1
            if eos_seen and eos_id is not None:  # (eos_seen implies an eos_id)
                _finish_rows(block, committed, done, eos_id, fill)
    resp[:, end:] = fill  # blocks never reached because every row had finished
    return resp.clone(), nfe, traj


@torch.no_grad()
def diffusion_generate_nocache(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    tau: float,
    mask_id: int,
    eos_id: int | None,
    commit_fn: CommitRule | None = None,
    logprobs: torch.Tensor | None = None,
    unique: torch.Tensor | None = None,
    follow: TraceRule | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The reference for `diffusion_generate`: every round re-runs prompt + finished blocks + canvas under
    `block_causal_mask`, so every finished block is seen exactly as its own clean forward. Same arguments, tokens
    and trajectory; nfe is one forward per round (the cached loop adds the prefill and skips the rounds where only
    a block's first position is open)."""
    L = max_new_tokens
    fill = eos_id if eos_id is not None else mask_id
    seq, pad_lens, _, pos = _layout(prompts, L, model, mask_id)
    B, P = seq.shape[0], seq.shape[1] - L
    _check_logprobs(logprobs, commit_fn, (B, L))
    resp = seq[:, P:]
    traj = torch.full((B, L), -1, dtype=torch.long, device=seq.device)
    done = torch.zeros(B, dtype=torch.bool, device=seq.device)
    seen = None if unique is None else torch.zeros(B, len(unique), dtype=torch.bool, device=seq.device)
    n = _follow_n(follow, unique, seq[:, :P])
    nfe, rnd, end = 0, 0, 0
    for s0 in range(0, L, block_size):
        if bool(done.all()):
            break
        end = min(s0 + block_size, L)
        cl = end - s0
        block, committed = resp[:, s0:end], done[:, None].repeat(1, cl)
        block[done] = fill
        eos_seen = False
        while not bool(committed.all()):
            T = P + end
            logits = model(
                input_ids=seq[:, :T],
                attention_mask=block_causal_mask(P, T, block_size, pad_lens),
                position_ids=pos[:, :T],
            ).logits
            nfe += 1
            shifted = logits[:, P + s0 - 1 : T - 1]
            lp = None if logprobs is None else logprobs[:, s0:end]
            slots = _block_slots(follow, n, resp[:, :end], committed)
            eos_seen |= _commit_round(
                shifted,
                committed,
                tau,
                commit_fn,
                block,
                traj[:, s0:end],
                lp,
                rnd,
                eos_id,
                unique,
                seen,
                slots,
            )
            if commit_fn is None and seen is not None and unique is not None:
                now = _block_slots(follow, n, resp[:, :end], committed)
                if now is not None:
                    forced_commits(now, block, committed, seen, unique, traj[:, s0:end], rnd)
            rnd += 1
            if eos_seen and eos_id is not None:  # (eos_seen implies an eos_id)
                _finish_rows(block, committed, done, eos_id, fill)
    resp[:, end:] = fill
    return resp.clone(), nfe, traj


@torch.no_grad()
def spec_generate(
    draft: torch.nn.Module,
    verifier: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    tau: float,
    mask_id: int,
    eos_id: int | None,
    unique: torch.Tensor | None = None,
    follow: TraceRule | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Lossless speculative decoding: `ar_generate(verifier, ...)`'s tokens, with a block-diffusion draft.

    Per block (aligned as in `diffusion_generate`): the `draft` fills the block's open positions with its
    threshold-commit rounds (`select_commits` at tau), then the AR `verifier` reads the whole block in one causal
    forward. The decoder keeps the longest prefix of the block that equals the verifier's arg-max, plus the
    verifier's own token at the first disagreement. The draft's tokens after it stay as drafted, unverified: the
    next verification reads them after the corrected token (a correction seldom changes what follows it, so
    drafting them again would mostly cost draft forwards; the verifier still reads every one of them). When the
    verifier accepted a whole block as fed, its arg-max at the block's last column is the next block's first
    token. Every kept token is the verifier's arg-max given kept tokens only (a causal column never sees the
    drafts after it), so the output is AR greedy's whatever the draft; only the cost depends on the draft. (Up to
    float rounding: a forward over several columns may round differently from one column at a time, which can
    only flip an arg-max whose top two logits tie to ~1e-6.)

    Both models keep a KV cache of the prompt and the finished blocks; each stores a finished block with its first
    forward of the next block, as `diffusion_generate` does. Returns (tokens [B, max_new_tokens], nfe = draft
    plus verifier forwards, prefills included, verifier forwards).

    unique, follow: token ids written at most once per row, and the answer follows the trace; the draft and the
    verifier's arg-max both obey them, so the output is `ar_generate(..., unique=unique, follow=follow)`'s.
    """
    L = max_new_tokens
    fill = eos_id if eos_id is not None else model_pad_id(verifier)
    seq, pad_lens, attn, pos = _layout(prompts, L, verifier, mask_id)
    B, P = seq.shape[0], seq.shape[1] - L
    resp = seq[:, P:]
    done = torch.zeros(B, dtype=torch.bool, device=seq.device)
    n = _follow_n(follow, unique, seq[:, :P])
    first_end = _trace_ends(n)[0]
    d_cache, anchor = _prefill(draft, seq, attn, pos, P)
    v_cache, v_logits = _prefill(verifier, seq, attn, pos, P)
    first = v_logits.argmax(-1)  # the verifier's next token (the first response token)
    known = torch.ones_like(done)  # rows whose `first` is exact: the verifier read all their tokens before it
    d_stored = v_stored = 0  # response columns in each cache (finished blocks only)
    nfe, n_verify, end = 2, 1, 0
    rows = attention_rows(P, torch.arange(P, P + L, device=seq.device), P + L, block_size, pad_lens)
    for s0 in range(0, L, block_size):
        if bool(done.all()):
            break
        end = min(s0 + block_size, L)
        cl = end - s0
        block = resp[:, s0:end]
        block[:, 0] = torch.where(known, first, mask_id)
        kept = torch.zeros(
            B, cl, dtype=torch.bool, device=seq.device
        )  # verified: always a prefix of the block
        kept[:, 0] = known
        known = torch.zeros_like(known)  # set again by this block's verifications
        kept[done] = True
        block[done] = fill
        canvas_mask = rows[:, :, s0:end, : P + end].contiguous()
        # Draft the block once: commit rounds until no position is open (which round committed what is not kept).
        drafted = kept.clone()
        seen = None  # the labels the response holds: earlier blocks and this block's kept positions
        if unique is not None:
            held = torch.cat([resp[:, :s0], block.masked_fill(~kept, mask_id)], dim=1)
            seen = (held[:, :, None] == unique).any(1)
        slots = _block_slots(follow, n, resp[:, :end], drafted)
        while not bool(drafted.all()):
            if d_stored < s0 or not bool(drafted[:, 1:].all()):
                # A model's first forward of a block also feeds the finished blocks not yet in its cache.
                new = d_stored < s0
                logits = draft(
                    input_ids=seq[:, P + d_stored : P + end],
                    attention_mask=rows[:, :, d_stored:end, : P + end].contiguous() if new else canvas_mask,
                    position_ids=pos[:, P + d_stored : P + end],
                    cache=d_cache,
                    use_cache=True,
                    logits_to_keep=cl + new,
                ).logits
                nfe += 1
                d_cache.crop(-cl)
                d_stored = s0
                if new:  # column 0 is the last finished column: the new anchor, already token-shifted
                    anchor, shifted = logits[:, 0], logits[:, :cl]
                else:
                    shifted = torch.cat([anchor[:, None], logits[:, :-1]], dim=1)
            else:
                shifted = anchor[:, None]
            _commit_round(shifted, drafted, tau, None, block, None, None, 0, None, unique, seen, slots)
            # The slots this round left: the next round's too (forced commits write answer slots only, and
            # the slots read only trace tokens).
            slots = _block_slots(follow, n, resp[:, :end], drafted)
            if slots is not None and seen is not None and unique is not None and end > first_end:
                # as diffusion_generate: a slot the trace leaves one label is drafted without the model
                # (the verifier's arg-max there is bound to the same label, so the draft only gets cheaper)
                forced_commits(slots, block, drafted, seen, unique, None, 0)
        while not bool(kept.all()):
            # Verify: the verifier's arg-max for every position of the block, in one causal forward.
            new = v_stored < s0
            logits = verifier(
                input_ids=seq[:, P + v_stored : P + end],
                attention_mask=attn[:, : P + end],
                position_ids=pos[:, P + v_stored : P + end],
                cache=v_cache,
                use_cache=True,
                logits_to_keep=cl + new,
            ).logits
            nfe += 1
            n_verify += 1
            v_cache.crop(-cl)
            v_stored = s0
            if unique is not None:  # each column bans what the response holds before the position it predicts
                before = seen_before(resp[:, :end], unique)
                before = before[:, s0:] if new else before[:, s0 + 1 :]
                logits = ban_repeats(logits, before, unique)
                if follow is not None and n is not None:  # and keeps what the trace before it allows there
                    ahead = seq[:, P : P + min(end + 1, L)]  # + the next block's first position
                    sl = answer_slots(follow, ahead, torch.ones_like(ahead, dtype=torch.bool), n)
                    if ahead.shape[1] == end:  # the response's last block: no position after it
                        sl = Slots(
                            F.pad(sl.active, (0, 1)),
                            F.pad(sl.allowed, (0, 0, 0, 1)),
                            F.pad(sl.no_label, (0, 1)),
                            F.pad(sl.wait, (0, 1)),
                        )
                    logits = keep_slots(logits, sl.cols(s0 if new else s0 + 1), before, unique)
            top = logits.argmax(-1)
            if new:  # column 0 is the last finished column: it predicts position 0
                want = top[:, :cl]
            else:  # position 0 is kept by now (the block's first verification kept or corrected it)
                want = torch.cat([block[:, :1], top[:, :-1]], dim=1)
            wrong = ~kept & (block != want)
            j = torch.where(wrong.any(-1), wrong.long().argmax(-1), cl)  # first disagreement (cl: none)
            cols = torch.arange(cl, device=seq.device)[None, :]
            fix = cols == j[:, None]
            block[fix] = want[fix]
            kept = cols <= j[:, None]
            known, first = j == cl, top[:, -1]  # all of the block read as kept: its next token is exact
            if eos_id is not None:  # a kept eos ends its row: AR writes eos after it
                eos = (kept & (block == eos_id)).long()
                after = (eos.cumsum(-1) - eos) > 0
                block[after] = fill
                kept |= after
                done |= eos.bool().any(-1)
    resp[:, end:] = fill
    return resp.clone(), nfe, n_verify
