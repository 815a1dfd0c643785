"""The decoders: AR with a KV cache, threshold-commit block diffusion (docs/PAPER.md), and lossless speculative
decoding (a block-diffusion draft checked by the AR model). Each returns nfe.

Straight functions in the style of LLaDA / Fast-dLLM `generate.py`: `ar_generate`, `diffusion_generate` and
`spec_generate`. They take unpadded prompts (lists of token ids), left-pad them into one `Decoding` state (see
gr2/model.py for the layout) and return `tokens` [B, max_new_tokens]. A row is finished once it has an eos with
every position before it decoded; positions the decoder never wrote after that are filled with eos. Read a row up
to its first eos: with block_size > 1, tokens committed after the eos inside the same block are kept as decoded
(the trajectory must replay them) and mean nothing.

One block skeleton. Block diffusion and spec run the same loop, `block_loop`: per block, open a canvas of masks,
run commit rounds until every position is committed, then (spec only) verify the block. What differs between
modes is where a round's logits come from, one provider per mode: `CachedLogits` (a KV cache; diffusion's forwards
read only the rows still open) for diffusion and for spec's draft, and a full recompute for the reference decoders
of gr2/decode_reference.py, which the tests hold the fast ones to. Spec's verification is the loop's hook
(`Verification`). Every mode commits through one step (`commit_round`: the commit rule plus its bookkeeping).

nfe = number of model forward calls for the whole batch, prefill included. For AR generating L tokens that is
exactly L (the prefill yields the first token). Block diffusion, per block: one forward per commit round,
except a round where only the block's first position is still masked: its logits come from the last clean
token before the block and do not depend on the canvas, so it is committed without a forward. Block diffusion
has no prefill of its own: the prompt is fed with the first block's first round, as a finished block is fed
with the next (below), under its causal rows of the training mask. A prompt column never attends to the
canvas, so its KV and the anchor are what a prefill computes; the forward it saves was one in five of a
Beauty list's at batch 1 (docs/RESULTS.md, 'The prompt in the first round'). spec's verifier feeds it with
its first verification the same way.

The finished block's KV. Later blocks must see a finished block as a forward over its final tokens computes it:
that is what training shows them (gr2/losses.py: clean blocks before the noisy one). The block's last round
cannot provide it: that forward ran on a canvas where the positions it committed were still masks, and attention
inside a block is bidirectional, so the KV of every position of the block (and the logits of its last column,
which predict the next block's first token) saw those masks. So the finished block is fed once more, folded into
the next block's first round (Fast-dLLM v2): input [finished block, canvas] under the block-causal mask, the
finished block's KV kept, the canvas KV dropped (`DynamicCache.crop`). That costs block_size more tokens in one
forward per block and no extra forward: block_size = 1 diffusion is AR exactly, nfe included (without a layout
rule: a block the layout fixes needs no round, `layout_commits`), and nfe = n_blocks when every block commits in
one round.

Rules. `unique` (tokens written at most once per row) and `follow` (the answer follows the trace) are
gr2/rules.py's; every decoder applies both, and the equivalences hold with them. A greedy diffusion round ends
with `forced_commits`: an open answer position that the trace rule, given what the round committed, leaves a
single label (a level no other candidate has, or the last label of a tied level) is committed in that round. Its
logits could not pick anything else, so waiting a round for them would cost a forward and decide nothing. (An AR
decoder could skip those forwards too, by feeding a forced token together with the next one, as jump-forward
decoding does; `ar_generate` decodes one token per forward, the baseline the speedups are measured against.)
Sampling (`commit_fn`) leaves them to the model's rounds, so RL's replay sees the trajectory it sampled. Every
block, greedy or sampled, starts with the tokens the layout fixes committed (`layout_commits`), so the first round
reads each score level's label.

Greedy by default. The token-choice rule is pluggable (`pick` for AR, `commit_fn` for diffusion) so that
gr2/rl.py samples its rollouts with these same loops; the optional `logprobs` output tensor then receives the
rule's log-prob of every decoded token. The greedy path computes no log-probs (no extra softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gr2.model import attention_rows, model_config, position_ids_for
from gr2.rules import NO_RULES, DecodeRules, Rules, Slots, one_of_each, single_label


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


# A trajectory's value for a token the layout gave before the block's first round (`layout_commits`): every round
# of its block saw it, and no round chose it (RL's replay shows it and scores nothing there).
GIVEN = -2

# pick(logits [B, V]) -> (tokens [B], log-probs [B]): the AR token choice (default: arg-max).
PickRule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# commit_fn(logits [B, C, V], masked [B, C], tau) -> (commit [B, C], tokens [B, C], log-probs [B, C]):
# the diffusion commit rule (default: `select_commits`).
CommitRule = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Decoding:
    """One decoding call: the buffer every forward slices, the finished rows, the rules and the counts."""

    seq: torch.Tensor  # [B, P + L]: the left-padded prompts, then the response as it is decoded
    pad_lens: torch.Tensor  # [B]
    P: int  # the prompts' (padded) width
    eos_id: int | None
    fill: int  # what a finished row's undecoded positions get (eos)
    rules: Rules | None = None  # unique / follow (gr2/rules.py)
    logprobs: torch.Tensor | None = None  # [B, L] optional output: each decoded token's log-prob
    nfe: int = 0
    rnd: int = 0  # commit rounds so far: the trajectory's clock
    attn: torch.Tensor = field(init=False)  # [B, P + L]: 1 = a real column
    pos: torch.Tensor = field(init=False)  # [B, P + L]: position ids
    done: torch.Tensor = field(init=False)  # [B]: finished rows
    traj: torch.Tensor = field(init=False)  # [B, L]: each token's commit round (-1: never decoded; GIVEN)

    def __post_init__(self) -> None:
        B, dev = self.seq.shape[0], self.seq.device
        cols = torch.arange(self.seq.shape[1], device=dev)
        self.attn = (cols[None, :] >= self.pad_lens[:, None]).long()
        self.pos = position_ids_for(self.pad_lens, cols)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.traj = torch.full((B, self.L), -1, dtype=torch.long, device=dev)

    @property
    def resp(self) -> torch.Tensor:
        return self.seq[:, self.P :]  # a view: the response as it is decoded

    @property
    def L(self) -> int:
        return self.seq.shape[1] - self.P


def start(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    empty: int,
    eos_id: int | None,
    rules: DecodeRules = NO_RULES,
) -> Decoding:
    """The state of a decoding call: the prompts left-padded for `model`, then max_new_tokens of `empty` (what
    an undecoded position holds: the mask for diffusion), and the rules for these prompts."""
    ids, pad_lens = pad_prompts(prompts, model)
    seq = torch.cat([ids, torch.full((len(ids), max_new_tokens), empty, device=ids.device)], dim=1)
    fill = eos_id if eos_id is not None else empty  # (without an eos no row finishes: nothing is filled)
    return Decoding(seq, pad_lens, ids.shape[1], eos_id, fill, Rules.start(rules, ids))


def check_logprobs(logprobs: torch.Tensor | None, rule: Callable | None, d: Decoding) -> torch.Tensor | None:
    """Validate the optional output tensor and clear it: fillers (never decoded) keep log-prob 0."""
    if logprobs is None:
        return None
    if rule is None:
        raise ValueError("logprobs needs a token-choice rule that returns them (pick / commit_fn)")
    if tuple(logprobs.shape) != tuple(d.traj.shape):
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}, expected {tuple(d.traj.shape)}")
    return logprobs.zero_()


# ---------------------------------------------------------------------------------------------- AR
# step(d, t) -> the logits [B, V] that predict response position t (one forward).
ARStep = Callable[[Decoding, int], torch.Tensor]


def ar_loop(d: Decoding, step: ARStep, pick: PickRule | None) -> None:
    """AR decoding: one token per forward, for every row, until every row has its eos."""
    for t in range(d.L):
        ar_commit(d, step(d, t), t, pick)
        if d.eos_id is not None and bool(d.done.all()):
            break


def ar_commit(d: Decoding, logits: torch.Tensor, t: int, pick: PickRule | None) -> None:
    """One AR step's bookkeeping: the token of response column t from its logits [B, V] (one forward, counted),
    under the rules; a finished row gets eos."""
    resp, rules = d.resp, d.rules
    d.nfe += 1
    if rules is not None:
        logits = rules.ar_logits(logits, resp, t)
    if pick is None:
        tok = logits.argmax(-1)
    else:
        tok, lp = pick(logits)
        if d.logprobs is not None:
            d.logprobs[:, t] = lp.masked_fill(d.done, 0.0)
    if d.eos_id is not None:
        tok = tok.masked_fill(d.done, d.eos_id)
    resp[:, t] = tok
    if rules is not None:
        rules.seen |= tok[:, None] == rules.unique
    if d.eos_id is not None:
        d.done |= tok == d.eos_id


@torch.no_grad()
def ar_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    *,
    pick: PickRule | None = None,
    logprobs: torch.Tensor | None = None,
    rules: DecodeRules = NO_RULES,
) -> tuple[torch.Tensor, int]:
    """AR decoding with a KV cache, batched with left padding. Returns (tokens [B, max_new_tokens], nfe).

    pick: the token choice from the last logits (default greedy arg-max, no log-probs computed).
    logprobs: optional output [B, max_new_tokens] (needs `pick`): each decoded token's log-prob as returned
    by `pick`, 0 for the eos filler written after a row finished.
    rules: the token ids written at most once per row and whether the answer follows the trace (gr2/rules.py).
    """
    empty = eos_id if eos_id is not None else model_pad_id(model)  # the tail once every row has finished
    d = start(model, prompts, max_new_tokens, empty, eos_id, rules)
    d.logprobs = check_logprobs(logprobs, pick, d)
    cache = DynamicCache()

    def step(d: Decoding, t: int) -> torch.Tensor:
        lo = d.P + t - 1 if t else 0  # only the last decoded token is new (the first step: the prompt)
        return model(
            input_ids=d.seq[:, lo : d.P + t],
            attention_mask=d.attn[:, : d.P + t],
            position_ids=d.pos[:, lo : d.P + t],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,  # the LM head on the last column only (the prefill would project all P)
        ).logits[:, -1]

    ar_loop(d, step, pick)
    return d.resp.clone(), d.nfe


# ---------------------------------------------------------------------------------------------- commits
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


@dataclass(frozen=True)
class Commit:
    """How a mode's rounds commit (`commit_round`)."""

    tau: float
    commit_fn: CommitRule | None = None  # None: `select_commits`, greedy (then `forced_commits` too)
    eos_id: int | None = None  # a committed eos may finish its row (spec's draft: None, its verifier does)


@dataclass
class Block:
    """The open block: the response's columns s0:end (views) and what its rounds know about them."""

    tokens: torch.Tensor  # [B, cl]: the canvas
    committed: torch.Tensor  # [B, cl]
    s0: int = 0
    traj: torch.Tensor | None = None  # [B, cl]: the round each token was committed at
    logprobs: torch.Tensor | None = None  # [B, cl]: their log-probs (a sampling commit_fn)
    slots: Slots | None = None  # the positions the trace rules (`answer_slots`)
    per_round: bool = False  # the commits can change the slots: read them again after each round
    eos_seen: bool = False  # an eos was committed in the block (only then can a row have finished)

    @property
    def end(self) -> int:
        return self.s0 + self.tokens.shape[1]


def commit_round(shifted: torch.Tensor, blk: Block, how: Commit, rules: Rules | None, rnd: int) -> bool:
    """One commit round: the commit rule on the token-shifted logits [B, c, V] of the block's first c positions,
    then its bookkeeping in place: the committed tokens, `rnd` into their trajectory, their log-probs, `committed`,
    and the labels the response holds (`rules.seen`). Returns whether an eos was committed."""
    c = shifted.shape[1]
    masked = ~blk.committed[:, :c]
    slots = None if blk.slots is None else blk.slots.cols(0, c)
    if rules is not None:
        ban = rules.bans(shifted.shape[-1], slots, blk.s0, c)
        if ban is not None:  # at open positions only: a committed one may have every token banned (its own
            # label is written; the layout allows only labels there), and a sampler must not see such a row
            shifted = shifted.masked_fill(ban & masked[..., None], float("-inf"))
    if slots is not None:  # a label waits for its row's trace (gr2/rules.py)
        masked &= ~slots.wait
    # the module global, looked up per round (tests spy on it)
    commit, pred, lp = (select_commits if how.commit_fn is None else how.commit_fn)(shifted, masked, how.tau)
    if rules is not None:  # ban what the response holds already
        hit = pred[..., None] == rules.unique  # [B, c, K] (cheaper than torch.isin on a few columns)
        new = commit & hit.any(-1)
        if bool((new.sum(-1) > 1).any()):  # two positions may pick one label: the more confident commits
            commit = one_of_each(commit, pred, lp, rules.unique)
            new &= commit
        rules.seen |= (hit & new[..., None]).any(1)
    if how.commit_fn is not None and blk.logprobs is not None:
        blk.logprobs[:, :c] = torch.where(commit, lp, blk.logprobs[:, :c])
    # (no boolean indexing: it waits for a nonzero)
    blk.tokens[:, :c] = torch.where(commit, pred, blk.tokens[:, :c])
    if blk.traj is not None:
        blk.traj[:, :c].masked_fill_(commit, rnd)
    blk.committed[:, :c] |= commit
    return how.eos_id is not None and bool((commit & (pred == how.eos_id)).any())


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


def finish_rows(blk: Block, done: torch.Tensor, eos_id: int, fill: int) -> None:
    """Rows whose block holds a committed eos with every earlier position committed are done: their open
    positions get `fill` and count as committed (in place)."""
    committed = blk.committed
    before = torch.cat(
        [torch.ones_like(committed[:, :1]), committed[:, :-1].long().cumprod(-1).bool()], dim=1
    )
    newly = (committed & (blk.tokens == eos_id) & before).any(-1) & ~done
    if bool(newly.any()):
        done |= newly
        rest = newly[:, None] & ~committed
        blk.tokens[rest] = fill
        committed |= newly[:, None]


# ---------------------------------------------------------------------------------------------- the block loop
# logits(d, blk) -> the token-shifted logits [B, c, V] of the block's first c positions (c = 1: only position
# 0's, which need no forward); the provider counts its forwards in d.nfe.
Logits = Callable[[Decoding, Block], torch.Tensor]


def open_block(d: Decoding, s0: int, end: int, first: tuple[torch.Tensor, torch.Tensor] | None) -> Block:
    """The canvas of columns s0:end: masks, and `fill` in finished rows. first (spec): the verifier's token for
    the block's first position and the rows where it is exact, which start with it committed. The tokens the
    layout fixes start committed too (`layout_commits`)."""
    tokens, committed = d.resp[:, s0:end], d.done[:, None].repeat(1, end - s0)
    if first is not None:
        tokens[:, 0] = torch.where(first[1], first[0], tokens[:, 0])
        committed[:, 0] |= first[1]
    tokens[d.done] = d.fill
    logprobs = None if d.logprobs is None else d.logprobs[:, s0:end]
    blk = Block(tokens, committed, s0, d.traj[:, s0:end], logprobs)
    if d.rules is not None:
        if first is not None:
            d.rules.seen |= tokens[:, 0, None] == d.rules.unique
        layout_commits(d, blk)
        blk.slots, blk.per_round = d.rules.open_slots(d.resp, committed, s0)
    return blk


def layout_commits(d: Decoding, blk: Block) -> None:
    """Commit, in place and before the block's first round, every open position whose token the layout fixes (a
    trace label, the answer's head, a separator, its tail, eos: gr2/rules.py `Layout`).

    Why: the bans would commit them in the first round anyway, but that round would predict every score level from
    a canvas of masks, so the model could find a candidate's evidence by position only. A list shorter than N moves
    every position, and the student, trained mostly on lists of N, then wrote score levels nearly 1 apart from the
    teacher's (|level difference| 0.84 against 0.07 on lists of N; docs/RESULTS.md, 'Layout tokens before the
    first round'). With the label in place, the level after it reads that label's evidence. Their trajectory is
    GIVEN; sampling gives them too, so RL trains the decoder that serves, and CFT never masks them (gr2/losses.py
    `layout_given`)."""
    assert d.rules is not None
    fixed = d.rules.fixed_tokens(blk.s0, blk.tokens.shape[1])
    if fixed is None:
        return
    tokens, where = fixed
    new = where & ~blk.committed
    if not bool(new.any()):
        return
    blk.tokens.copy_(torch.where(new, tokens, blk.tokens))
    if blk.traj is not None:
        blk.traj.masked_fill_(new, GIVEN)
    blk.committed |= new
    if d.eos_id is not None and bool((new & (tokens == d.eos_id)).any()):
        blk.eos_seen = True
        finish_rows(blk, d.done, d.eos_id, d.fill)


def block_loop(
    d: Decoding, block_size: int, how: Commit, logits: Logits, verify: Verification | None = None
) -> None:
    """The block skeleton of every block decoder. Blocks of `block_size` are aligned at the response start (the
    last one is cut at L). Each starts as a canvas of masks (`open_block`) and is decoded by `run_block`."""
    end = 0
    for s0 in range(0, d.L, block_size):
        if bool(d.done.all()):
            break
        end = min(s0 + block_size, d.L)
        run_block(d, open_block(d, s0, end, None if verify is None else verify.first), how, logits, verify)
    d.resp[:, end:] = d.fill  # blocks never reached because every row had finished


def run_block(
    d: Decoding, blk: Block, how: Commit, logits: Logits, verify: Verification | None = None
) -> None:
    """The rounds of one open block: each predicts the open positions (`logits`) and commits per `how`
    (`commit_round`), then the trace's forced labels; an eos ends its row once every position before it is
    decoded. `verify` (spec) then checks the finished block."""
    rules, s0 = d.rules, blk.s0
    while not bool(blk.committed.all()):
        blk.eos_seen |= commit_round(logits(d, blk), blk, how, rules, d.rnd)
        if rules is not None and blk.per_round:  # the slots this round left: the next round's too (forced
            # commits write answer slots only, and the slots read only trace tokens)
            blk.slots, blk.per_round = rules.round_slots(d.resp, blk.committed, s0)
        if rules is not None and blk.slots is not None and how.commit_fn is None:
            forced_commits(blk.slots, blk.tokens, blk.committed, rules.seen, rules.unique, blk.traj, d.rnd)
        d.rnd += 1
        if blk.eos_seen and how.eos_id is not None:
            finish_rows(blk, d.done, how.eos_id, d.fill)
    if verify is not None:
        verify(d, blk)


# ---------------------------------------------------------------------------------------------- diffusion
class _RowsCache:
    """Some rows of a decoding cache, copied, for forwards over those rows only (`CachedLogits`).

    The copy holds the prompt and the finished blocks of the rows in `rows` [B] (bool); a forward appends the
    canvas KV, which `forward` crops again, so the copy serves every round while the same rows are open."""

    def __init__(self, cache: DynamicCache, rows: torch.Tensor):
        self.rows, self.index = rows, rows.nonzero().squeeze(1)
        self.cache = DynamicCache()
        for i, layer in enumerate(cache.layers):
            layer = cast(DynamicLayer, layer)  # what a DynamicCache() fills (`prefill`)
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


class BlockCache:
    """A model's KV cache of the prompt and the finished blocks (the module docstring's finished block's KV), for
    forwards over the open block: a block's first forward also feeds the columns not yet stored (the finished
    blocks, and first of all the prompt: it has no forward of its own, the module docstring's nfe), and every
    forward's block KV is dropped again."""

    def __init__(self, model: torch.nn.Module, d: Decoding):
        self.model, self.cache = model, DynamicCache()
        # the response columns in the cache (the finished blocks fed so far); negative: prompt columns still to feed
        self.stored = -d.P

    def forward(self, d: Decoding, blk: Block, mask: torch.Tensor) -> torch.Tensor:
        """The logits of the open block's columns, and first of the last finished column when this forward
        stores finished blocks (mask: the fed columns' attention rows)."""
        P, end, cl = d.P, blk.end, blk.tokens.shape[1]
        logits = self.model(
            input_ids=d.seq[:, P + self.stored : P + end],
            attention_mask=mask,
            position_ids=d.pos[:, P + self.stored : P + end],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=cl + (self.stored < blk.s0),  # the LM head skips the rest of the finished blocks
        ).logits
        d.nfe += 1
        self.cache.crop(-cl)  # keep prompt + finished blocks, drop the block
        self.stored = blk.s0
        return logits


class CachedLogits:
    """A round's logits from a `BlockCache`. A round predicts every open position with the AR token shift:
    position j from hidden j - 1, position 0 from the last clean token before the block (the anchor).

    Rows that wait for others (row_subsets). Every row of a batch runs the same rounds, so a row whose block is
    decided waits for the batch's slowest row. Such rows sit those rounds out: a round's forward reads only the
    rows with an open position past position 0 (`_RowsCache`). Rows are independent, so their logits are the same
    (up to the rounding of a smaller matrix product), and the tokens are."""

    def __init__(self, model: torch.nn.Module, d: Decoding, block_size: int, *, row_subsets: bool):
        self.kv, self.row_subsets = BlockCache(model, d), row_subsets
        self.anchor: torch.Tensor | None = (
            None  # [B, V]: set by each block's first forward (the prompt's, first)
        )
        self.block_size = block_size
        # Every response row's attention over prompt + response, built once; each block's masks are slices of it.
        cols = torch.arange(d.P, d.P + d.L, device=d.seq.device)
        self.rows = attention_rows(d.P, cols, d.P + d.L, block_size, d.pad_lens)
        self.s0 = -1  # the block the two below belong to
        self.canvas_mask = self.rows  # the open block's canvas rows of `rows`
        self.part: _RowsCache | None = None  # the cache rows of the rows still open (row_subsets)

    def __call__(self, d: Decoding, blk: Block) -> torch.Tensor:
        s0, end, P = blk.s0, blk.end, d.P
        if s0 != self.s0:  # a new block: its canvas's mask; no copy of cache rows yet
            self.s0, self.part = s0, None
            self.canvas_mask = self.rows[:, :, s0:end, : P + end].contiguous()
        stored = self.kv.stored
        if stored < s0:  # the block's first forward also feeds what is not stored: column 0 is the new anchor
            mask = self.rows[:, :, max(stored, 0) : end, : P + end]
            if stored < 0:  # the prompt too, under the training mask's causal prompt rows
                prompt = torch.arange(P, device=d.seq.device)
                mask = torch.cat([attention_rows(P, prompt, P + end, self.block_size, d.pad_lens), mask], 2)
            logits = self.kv.forward(d, blk, mask.contiguous())
            self.anchor = logits[:, 0]
            return logits[:, :-1]  # already token-shifted: column j predicts position j
        assert self.anchor is not None  # (a forward of this decode set it)
        todo = (~blk.committed[:, 1:]).any(-1)  # rows open past position 0
        n_todo = int(todo.sum())
        if n_todo == 0:  # only position 0 open: its logits (the anchor) ignore the canvas
            return self.anchor[:, None]
        if self.row_subsets and n_todo < len(todo):  # the other rows sit the round out
            if self.part is None or not torch.equal(self.part.rows, todo):
                self.part = _RowsCache(self.kv.cache, todo)
            ids, pos = d.seq[:, P + s0 : P + end], d.pos[:, P + s0 : P + end]
            d.nfe += 1
            logits = self.part.forward(self.kv.model, ids, self.canvas_mask, pos, end - s0)
        else:
            logits = self.kv.forward(d, blk, self.canvas_mask)
        return torch.cat([self.anchor[:, None], logits[:, :-1]], dim=1)


@torch.no_grad()
def diffusion_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    tau: float,
    mask_id: int,
    eos_id: int | None,
    *,
    commit_fn: CommitRule | None = None,
    logprobs: torch.Tensor | None = None,
    rules: DecodeRules = NO_RULES,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Block-diffusion decoding with threshold commits (greedy by default). Returns (tokens, nfe, trajectory).

    `block_loop` with `CachedLogits` (row subsets on): the first block's first forward feeds the prompt into a
    DynamicCache, and each finished block is added to it by the next block's first forward (module docstring).
    Each round commits per `select_commits` at tau (or `commit_fn`).

    trajectory [B, max_new_tokens]: the commit round (0-based, counted over the whole call and shared by the
    batch) at which each token was committed; -1 = eos filler written after the row finished; GIVEN = a token the
    layout fixes, committed before the block's first round. To replay the canvas a token was predicted from (RL):
    its block holds the GIVEN tokens and those with a smaller round, masks elsewhere.

    commit_fn: the commit rule, called as commit_fn(shifted logits, masked, tau) -> (commit, tokens, log-probs)
    (default `select_commits`, no log-probs computed). logprobs: optional output [B, max_new_tokens] (needs
    `commit_fn`): each committed token's log-prob as returned by the rule, 0 where trajectory is -1.
    rules: gr2/rules.py.
    """
    d = start(model, prompts, max_new_tokens, mask_id, eos_id, rules)
    d.logprobs = check_logprobs(logprobs, commit_fn, d)
    rounds = CachedLogits(model, d, block_size, row_subsets=True)
    block_loop(d, block_size, Commit(tau, commit_fn, eos_id), rounds)
    return d.resp.clone(), d.nfe, d.traj


# ---------------------------------------------------------------------------------------------- spec
class Verification:
    """spec's hook: the AR verifier reads a drafted block in one causal forward and keeps the longest prefix that
    equals its arg-max, plus its own token at the first disagreement; again until the whole block is kept.

    After a correction, the verifier's own arg-max at each later position of the block replaces the draft there,
    unverified (Jacobi decoding's refinement), and where that arg-max repeats the label just moved into place, the
    label it displaced goes instead (a swap of tied candidates). The same forward computed them with one wrong token
    in their context, and a trace's score levels hardly depend on each other, so they are more often what the
    verifier writes than the draft's tokens are (Beauty validation: the draft and `ar` differ in 5.5 tokens per
    list, mostly score levels; on 150 lists, verifier forwards per list, prefill included, fell from 7.4 to 6.4).
    The next verification reads them after the corrected token. When the verifier accepted a whole block as fed,
    its arg-max at the block's last column is the next block's first token (`first`). Every kept token is the
    verifier's arg-max given kept tokens only (a causal column never sees the drafts after it), so the output is
    AR greedy's whatever the draft; only the cost depends on the draft. (Up to float rounding: a forward over
    several columns may round differently from one column at a time, which can only flip an arg-max whose top two
    logits tie to ~1e-6.) Like the draft, the verifier stores a finished block with its first forward of the next."""

    def __init__(self, verifier: torch.nn.Module, d: Decoding):
        self.kv = BlockCache(verifier, d)  # the first verification feeds the prompt
        self.n = 0  # verifier forwards
        # The verifier's token for the next block's first position, and the rows where it is exact: the
        # verifier read all their tokens before it. None yet: the first block's draft writes its own.
        self.first = (d.resp[:, 0].clone(), torch.zeros_like(d.done))

    def __call__(self, d: Decoding, blk: Block) -> None:
        tokens, cl = blk.tokens, blk.tokens.shape[1]
        cols = torch.arange(cl, device=tokens.device)[None, :]
        # kept: verified, always a prefix of the block; known: set again by this block's verifications
        kept = d.done[:, None] | ((cols == 0) & self.first[1][:, None])
        first, known = self.first[0], torch.zeros_like(d.done)
        while not bool(kept.all()):
            new = self.kv.stored < blk.s0  # the block's first verification also feeds the finished blocks
            top = self.logits(d, blk, new).argmax(-1)
            if new:  # column 0 is the last finished column: it predicts position 0
                want = top[:, :cl]
            else:  # position 0 is kept by now (the block's first verification kept or corrected it)
                want = torch.cat([tokens[:, :1], top[:, :-1]], dim=1)
            wrong = ~kept & (tokens != want)
            j = torch.where(wrong.any(-1), wrong.long().argmax(-1), cl)  # first disagreement (cl: none)
            # The verifier's token at the disagreement, and its arg-max at every later position as the new draft
            # there (class docstring); the kept prefix and the agreeing positions before j stay as they are.
            at_j = j.clamp(max=cl - 1)[:, None]
            displaced, moved = tokens.gather(1, at_j), want.gather(1, at_j)
            tokens.copy_(torch.where(cols >= j[:, None], want, tokens))
            if d.rules is not None:
                # A label moved to j: where a later arg-max repeats it (computed with the displaced label
                # written, so banned there), the displaced label takes its place: a swap of two tied candidates.
                swap = (cols > j[:, None]) & (tokens == moved) & torch.isin(moved, d.rules.unique)
                tokens.copy_(torch.where(swap, displaced, tokens))
            kept = cols <= j[:, None]
            known, first = j == cl, top[:, -1]  # all of the block read as kept: its next token is exact
            if d.eos_id is not None:  # a kept eos ends its row: AR writes eos after it
                eos = (kept & (tokens == d.eos_id)).long()
                after = (eos.cumsum(-1) - eos) > 0
                tokens[after] = d.fill
                kept |= after
                d.done |= eos.bool().any(-1)
        self.first = (first, known)
        if d.rules is not None:  # the verifier rewrote the block: the labels the response holds
            d.rules.recount(d.resp[:, : blk.end])

    def logits(self, d: Decoding, blk: Block, new: bool) -> torch.Tensor:
        """The verifier's logits for the block's positions (and the next block's first), under the rules."""
        logits = self.kv.forward(d, blk, d.attn[:, : d.P + blk.end])
        self.n += 1
        if d.rules is None:
            return logits
        return d.rules.causal_logits(logits, d.resp, blk.s0 if new else blk.s0 + 1)


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
    *,
    rules: DecodeRules = NO_RULES,
) -> tuple[torch.Tensor, int, int]:
    """Lossless speculative decoding: `ar_generate(verifier, ...)`'s tokens, with a block-diffusion draft.

    `block_loop` with the `draft`'s `CachedLogits` (greedy threshold-commit rounds at tau, blocks aligned as in
    `diffusion_generate`) and the `verifier`'s `Verification` as the hook. Returns (tokens [B, max_new_tokens],
    nfe = draft plus verifier forwards, verifier forwards). Neither has a prefill of its own (module docstring).

    rules (gr2/rules.py): the draft and the verifier's arg-max both obey them, so the output is
    `ar_generate(..., rules=rules)`'s.
    """
    d = start(verifier, prompts, max_new_tokens, mask_id, eos_id, rules)
    drafts = CachedLogits(draft, d, block_size, row_subsets=False)
    verify = Verification(verifier, d)
    block_loop(d, block_size, Commit(tau), drafts, verify)
    return d.resp.clone(), d.nfe, verify.n
