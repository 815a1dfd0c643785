"""The rules every decoder applies to its logits: permutation answers and answers that follow their trace.

Permutation answers. `unique` (optional) names tokens that may appear at most once in a response: the answer's
candidate labels, so that every decoder writes each candidate once. Every decoder applies the same rule: a unique
token already written is banned from the logits (`ban_repeats`), and a diffusion round that picks one unique
token at two positions commits only the more confident (`one_of_each`). The decoders' equivalences (gr2/decode.py)
hold with it.

Answers that follow their trace. `follow` (optional, with `unique`) makes the answer agree with the trace the
response wrote before it (gr2/prompt.py: one label and one score level per candidate, then the answer's head, then
labels one token apart). Once a row's whole trace is decoded, the answer's k-th label must be a candidate whose
level is the k-th highest of the trace (`answer_slots`; nothing else may go there): the answer ranks by the trace,
and the model itself only orders candidates that share a level. Until then a row's answer labels wait: a parallel
round commits none of them while a trace position of the row is still open (in a block that holds the trace's end
and the answer's first labels, a label committed in the trace's last round would be unruled). The trace's open
positions precede the labels in the same block, so a round always has something to commit. The rule is per
position, so parallel rounds obey it as AR does, and every equivalence holds with it. A slot the rule leaves a
single label (`single_label`) needs no model at all: gr2/decode.py's `forced_commits`.

`DecodeRules` is the pair every decoder, RL's sampler and its replay take (what travels together); `Rules` is one
decoding call's state of both rules (which labels each row holds, where its trace ends, its slots);
the decoders ask it for the bans of a position and for a block's slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F


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


@dataclass(frozen=True)
class Layout:
    """The response's shape, which its list's length n fixes (module docstring: the layout). Every position is one
    of: a fixed token (a trace label, the answer's head, a separator, its tail, eos), a score level, or an answer
    label of the n candidates (`unique[:n]`). Past the eos: eos, the filler a finished row gets (a token there means
    nothing, but a label there would count as written and could leave an answer slot no label)."""

    labels: torch.Tensor  # [K] the prompt's label tokens [A], [B], ...: n = how many a prompt holds
    levels: torch.Tensor | None  # [S] the trace's score levels; None: the response has no trace (answer only)
    head: torch.Tensor  # [H] the answer's tokens before its first label ('{ "ranking" : [')
    sep: int  # the token between two answer labels (',')
    tail: torch.Tensor  # the tokens after the last label, eos last (']', '}', eos)
    # `kinds` of every n = 0..K per (width, device), computed once: serving starts a decode per few requests,
    # and building the kinds op by op cost 4% of its decoding thread at 32 clients (docs/SERVING.md)
    _by_n: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def n_candidates(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[B]: the candidates of each (padded) prompt [B, P], i.e. its label tokens."""
        return torch.isin(prompt_ids, self.labels.to(prompt_ids.device)).sum(-1)

    def table(self, unique: torch.Tensor, vocab: int) -> torch.Tensor:
        """[M, vocab] bool, the tokens allowed by each kind of position (`kinds` indexes it): 0 any, 1 a level,
        1 + n the first n answer labels (n = 1..K), then one row per fixed token: labels, head, sep, tail."""
        K, dev = len(self.labels), unique.device
        fixed = self.fixed().to(dev)
        t = torch.zeros(2 + K + len(fixed), vocab, dtype=torch.bool, device=dev)
        t[0] = True
        if self.levels is not None:
            t[1, self.levels.to(dev)] = True
        first_n = torch.arange(K, device=dev)[None, :] < torch.arange(1, K + 1, device=dev)[:, None]  # [K, K]
        t[2 : 2 + K, unique] = first_n
        t[2 + K + torch.arange(len(fixed), device=dev), fixed] = True
        return t

    def fixed(self) -> torch.Tensor:
        """[F]: the fixed tokens, in `table`'s order (kind 2 + K + i is fixed token i)."""
        return torch.cat([self.labels, self.head, torch.tensor([self.sep]), self.tail])

    def kinds(self, n: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width]: the kind of each response position (a row of `table`) for rows of n [B] candidates."""
        K = len(self.labels)
        if len(n) and int(n.max()) > K:  # (no prompt holds a label twice; built anyway)
            return self.build_kinds(n, width)
        key = (width, n.device)
        if key not in self._by_n:
            self._by_n[key] = self.build_kinds(torch.arange(K + 1, device=n.device), width)
        return self._by_n[key][n.clamp(min=0)]

    def build_kinds(self, n: torch.Tensor, width: int) -> torch.Tensor:
        """`kinds`, computed."""
        K, H, dev = len(self.labels), len(self.head), n.device
        fix = 2 + K  # the first fixed row: label 0
        p, n = torch.arange(width, device=dev)[None, :], n[:, None]
        kind = torch.zeros(len(n), width, dtype=torch.long, device=dev)
        a = 2 * n if self.levels is not None else torch.zeros_like(n)  # where the answer starts
        if self.levels is not None:  # label i then its level, for i < n
            trace = p < a
            kind = torch.where(trace & (p % 2 == 0), fix + (p // 2).clamp(max=K - 1), kind)
            kind = torch.where(trace & (p % 2 == 1), 1, kind)
        q = p - a
        kind = torch.where((q >= 0) & (q < H), fix + K + q.clamp(0, H - 1), kind)
        r = q - H  # the answer's labels at even r < 2n - 1, separators between
        answer = (r >= 0) & (r < 2 * n - 1)
        kind = torch.where(answer & (r % 2 == 0), 1 + n, kind)
        kind = torch.where(answer & (r % 2 == 1), fix + K + H, kind)
        u = r - (2 * n - 1)  # the tail, eos last, then eos again
        return torch.where(u >= 0, fix + K + H + 1 + u.clamp(0, len(self.tail) - 1), kind)


@dataclass(frozen=True)
class DecodeRules:
    """The rules a decoding call applies: `unique`, the tokens written at most once per row (the answer's labels),
    `follow`, the answer follows the trace, and `layout`, the response's shape (both need `unique`). The default
    applies none (`NO_RULES`)."""

    unique: torch.Tensor | None = None  # [K]
    follow: TraceRule | None = None
    layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.unique is None and self.follow is not None:
            raise ValueError("follow (the answer follows the trace) needs unique (the answer's label tokens)")
        if self.unique is None and self.layout is not None:
            raise ValueError("layout (the response's shape) needs unique (the answer's label tokens)")


NO_RULES = DecodeRules()


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

    def pad_col(self) -> Slots:
        """One more column, ruling nothing (a position past the response)."""
        return Slots(
            F.pad(self.active, (0, 1)),
            F.pad(self.allowed, (0, 0, 0, 1)),
            F.pad(self.no_label, (0, 1)),
            F.pad(self.wait, (0, 1)),
        )


def answer_slots(
    rule: TraceRule,
    resp: torch.Tensor,
    known: torch.Tensor,
    n: torch.Tensor,
    offset: torch.Tensor | None = None,
) -> Slots:
    """The positions of response [B, T] where the trace rules the answer (`known`: decoded positions; n [B]:
    candidates per row; offset [B]: the column where each row's response starts, 0 by default: gr2/continuous.py). A row whose trace is decoded and well formed (label i then one level, for i < n) rules
    its answer's k-th label position: only a candidate whose level is the trace's k-th highest may go there; and
    no label may go anywhere else after the trace (a label written past the answer would take a slot's label).
    A row whose trace still has an undecoded position makes its answer's label positions wait: a parallel round
    must not commit a label that the rest of the trace could rule out (module docstring)."""
    B, T = resp.shape
    K = len(rule.labels)
    dev = resp.device
    active = torch.zeros(B, T, dtype=torch.bool, device=dev)
    allowed = torch.zeros(B, T, K, dtype=torch.bool, device=dev)
    o = torch.zeros_like(n) if offset is None else offset
    trace_end = o + 2 * n  # [B]
    if T <= int(trace_end.min()):  # no row is past its trace
        return Slots(active, allowed, active.clone(), active.clone())
    i = torch.arange(K, device=dev)
    lab_col = (o[:, None] + 2 * i).clamp(max=T - 1)  # [B, K]
    lev_col = (lab_col + 1).clamp(max=T - 1)
    is_level = resp.gather(1, lev_col)[..., None] == rule.levels.to(dev)  # [B, K, S]
    entry_ok = (
        (resp.gather(1, lab_col) == rule.labels.to(dev))
        & is_level.any(-1)
        & known.gather(1, lab_col)
        & known.gather(1, lev_col)
        & (o[:, None] + 2 * i + 1 < T)
    )
    cand = i[None, :] < n[:, None]  # [B, K]
    trace_ok = (entry_ok | ~cand).all(-1)  # [B]
    level = torch.where(cand, is_level.long().argmax(-1), -1)  # [B, K]; -1: not a candidate of the row
    slot_level = level.sort(-1, descending=True).values  # [B, K]: the level the answer's k-th label must have
    slot_col = trace_end[:, None] + rule.head + 2 * i[None, :]  # [B, K]
    rows, slots = (trace_ok[:, None] & cand & (slot_col < T)).nonzero(as_tuple=True)
    cols = slot_col[rows, slots]
    active[rows, cols] = True
    allowed[rows, cols] = level[rows] == slot_level[rows, slots, None]
    past_trace = torch.arange(T, device=dev)[None, :] >= trace_end[:, None]  # [B, T]
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


def seen_before(tokens: torch.Tensor, unique: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> [B, T + 1, K]: whether unique[k] occurs in tokens[:, :t], for t = 0..T."""
    hit = (tokens[:, :, None] == unique).long().cumsum(1) > 0
    return torch.cat([hit.new_zeros(hit.shape[0], 1, hit.shape[2]), hit], dim=1)  # (T = 0: one row)


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


def block_slots(
    follow: TraceRule,
    n: torch.Tensor,
    resp: torch.Tensor,
    committed: torch.Tensor,
    offset: torch.Tensor | None = None,
) -> Slots:
    """`answer_slots` for the open block, the last committed.shape[1] columns of resp [B, end]: the positions
    before the block are decoded, the block's are as far as `committed` says."""
    cl = committed.shape[1]
    known = torch.cat([torch.ones_like(resp[:, : resp.shape[1] - cl], dtype=torch.bool), committed], dim=1)
    return answer_slots(follow, resp, known, n, offset).cols(-cl)


def extend_kinds(kind: torch.Tensor, width: int) -> torch.Tensor:
    """`Layout.kinds` [B, W] to at least `width` columns: a row's last kind (past its eos: eos) goes on."""
    if kind.shape[1] >= width:
        return kind
    return torch.cat([kind, kind[:, -1:].expand(-1, width - kind.shape[1])], dim=1)


def shift_cols(x: torch.Tensor, offset: torch.Tensor, fill: int) -> torch.Tensor:
    """x [B, W] with row b moved offset[b] columns right (width W + max offset), `fill` before it."""
    W = x.shape[1]
    cols = torch.arange(W + int(offset.max()), device=x.device)[None, :] - offset[:, None]
    out = x.gather(1, cols.clamp(0, W - 1))
    return out.masked_fill((cols < 0) | (cols >= W), fill)


@dataclass
class Rules:
    """Both rules' state for one decoding call of B rows: `start` builds it, the decoders update `seen`."""

    unique: torch.Tensor  # [K] the tokens written at most once per row
    seen: torch.Tensor  # [B, K]: which of them each row's response holds so far
    follow: TraceRule | None = None  # the answer follows the trace
    n: torch.Tensor | None = None  # [B] candidates per row (with `follow`)
    # The response columns where the shortest and the longest trace end (a label and a level per candidate).
    # Before the first, `answer_slots` rules nothing; from the second on it reads only decoded trace tokens, so
    # a decoder reads the slots past it once (`after`) for the rest of the response.
    first_end: int = 0
    trace_end: int = 0
    after: Slots | None = None
    layout: Layout | None = None
    kind: torch.Tensor | None = None  # [B, W]: `Layout.kinds` of the response's first W positions (past: any)
    table: torch.Tensor | None = None  # `Layout.table` for the logits' vocabulary (read at the first bans)
    # [B]: the column where each row's response starts (gr2/continuous.py: a row that joined a running decode;
    # `kind` is shifted by it). None: 0 for every row. spec (`causal_logits`, `recount`) reads none.
    offset: torch.Tensor | None = None

    @classmethod
    def start(
        cls, rules: DecodeRules, prompt_ids: torch.Tensor, offset: torch.Tensor | None = None
    ) -> Rules | None:
        """The state of `rules` for prompts [B, P] (None without `unique`) whose responses start at columns
        `offset` [B] (None: 0)."""
        unique, follow, layout = rules.unique, rules.follow, rules.layout
        if unique is None:
            return None
        seen = torch.zeros(len(prompt_ids), len(unique), dtype=torch.bool, device=prompt_ids.device)
        state = cls(unique, seen, offset=offset)
        if layout is not None:  # every ruled position lies before 4K + H + tail (K labels)
            n = layout.n_candidates(prompt_ids)
            width = 4 * len(layout.labels) + len(layout.head) + len(layout.tail)
            state.layout, state.kind, state.n = layout, layout.kinds(n, width), n
            if offset is not None:
                state.kind = shift_cols(state.kind, offset, 0)
        if follow is not None:
            state.follow, state.n = follow, follow.n_candidates(prompt_ids)
        state.ends()
        return state

    def ends(self) -> None:
        """`first_end` and `trace_end` from n and the offsets."""
        if self.follow is None or self.n is None:
            return
        end = 2 * self.n if self.offset is None else self.offset + 2 * self.n
        self.first_end, self.trace_end = int(end.min()), int(end.max())
        self.after = None

    # What gr2/continuous.py does to a running decode's rows: keep some, add others, move the response start.
    def select(self, index: torch.Tensor) -> Rules:
        """The state of rows `index` only."""
        out = replace(self, seen=self.seen[index])
        for f in ("n", "kind", "offset"):
            if getattr(self, f) is not None:
                setattr(out, f, getattr(self, f)[index])
        out.ends()
        return out

    def concat(self, other: Rules) -> Rules:
        """These rows, then `other`'s (the same rules; offsets set on both)."""
        out = replace(self, seen=torch.cat([self.seen, other.seen]))
        if self.n is not None and other.n is not None:
            out.n = torch.cat([self.n, other.n])
        if self.offset is not None or other.offset is not None:
            out.offset = torch.cat([self.offsets(), other.offsets()])
        if self.kind is not None and other.kind is not None:
            w = max(self.kind.shape[1], other.kind.shape[1])
            out.kind = torch.cat([extend_kinds(self.kind, w), extend_kinds(other.kind, w)])
        out.ends()
        return out

    def offsets(self) -> torch.Tensor:
        """[B]: `offset`, 0 for every row when it is None."""
        return torch.zeros_like(self.seen[:, 0], dtype=torch.long) if self.offset is None else self.offset

    def shift(self, m: int) -> Rules:
        """The response start moved m columns right: column m is column 0 now."""
        out = replace(self)
        out.offset = self.offsets() - m
        if self.kind is not None:
            out.kind = self.kind[:, m:]
        out.ends()
        return out

    def layout_bans(self, start: int, width: int, vocab: int) -> torch.Tensor | None:
        """[B, width, vocab] (True = banned): what the layout rules out at response positions start..start+width,
        or None when it rules none of them."""
        if self.kind is None or self.layout is None:
            return None
        kind = self.kind[:, start : start + width]
        if not bool(kind.any()):
            return None
        kind = extend_kinds(kind, width)
        if self.table is None or self.table.shape[1] != vocab:
            self.table = self.layout.table(self.unique, vocab)
        return ~self.table[kind]

    def fixed_tokens(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens [B, width], where [B, width]): the fixed tokens of the layout at response positions
        start..start+width and where they are, or None when the layout fixes none of them."""
        if self.kind is None or self.layout is None:
            return None
        kind = self.kind[:, start : start + width]
        kind = extend_kinds(kind, width)
        first = 2 + len(self.layout.labels)
        where = kind >= first
        if not bool(where.any()):
            return None
        fixed = self.layout.fixed().to(kind.device)
        return fixed[(kind - first).clamp(min=0)], where

    def bans(self, vocab: int, slots: Slots | None, start: int, width: int) -> torch.Tensor | None:
        """`rule_bans` and `layout_bans` as one mask [B, width, vocab] (True = banned), or None: what a diffusion
        round applies to the logits of the block's first `width` positions (from response column `start`)."""
        ban = rule_bans(vocab, self.seen, slots, self.unique)
        shape = self.layout_bans(start, width, vocab)
        if shape is None or ban is None:
            return shape if ban is None else ban
        return ban | shape

    def shaped(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        """logits [B, C, V] of response positions start..start+C with what the layout rules out banned."""
        ban = self.layout_bans(start, logits.shape[1], logits.shape[-1])
        return logits if ban is None else logits.masked_fill(ban, float("-inf"))

    def slots_after(self, resp: torch.Tensor) -> Slots:
        """The slots of response [B, T] once every trace is decoded (read once: they do not change)."""
        assert self.follow is not None and self.n is not None
        if self.after is None:
            known = torch.ones_like(resp, dtype=torch.bool)
            self.after = answer_slots(self.follow, resp, known, self.n, self.offset)
        return self.after

    def open_slots(self, resp: torch.Tensor, committed: torch.Tensor, s0: int) -> tuple[Slots | None, bool]:
        """A block's slots as it opens (resp [B, L]: the response; committed [B, cl]: the block's decoded
        positions from column s0), and whether its commits can change them (then `round_slots` reads them after
        each round). A block before every trace's end has none; past every trace's end they are fixed."""
        if self.follow is None or self.n is None:
            return None, False
        end = s0 + committed.shape[1]
        if s0 >= self.trace_end:
            return self.slots_after(resp).cols(s0, end), False
        if self.first_end < end:
            return block_slots(self.follow, self.n, resp[:, :end], committed, self.offset), True
        return None, False

    def round_slots(self, resp: torch.Tensor, committed: torch.Tensor, s0: int) -> tuple[Slots | None, bool]:
        """The block's slots after a round (`open_slots`), and whether later rounds can still change them: until
        every trace position of the block is decoded."""
        assert self.follow is not None and self.n is not None
        end = s0 + committed.shape[1]
        slots = block_slots(self.follow, self.n, resp[:, :end], committed, self.offset)
        trace_end = 2 * self.n if self.offset is None else self.offset + 2 * self.n
        in_trace = torch.arange(s0, end, device=resp.device)[None, :] < trace_end[:, None]
        return slots, not bool((committed | ~in_trace).all())

    def ar_logits(self, logits: torch.Tensor, resp: torch.Tensor, t: int) -> torch.Tensor:
        """An AR step's logits [B, V] for response position t (resp [B, T]: the decoded tokens up to t), with
        the repeats banned and the trace's slot kept."""
        logits = self.shaped(logits[:, None], t)[:, 0]
        if bool(self.seen.any()):  # nothing to ban before a label
            logits = ban_repeats(logits[:, None], self.seen[:, None], self.unique)[:, 0]
        if self.follow is None or self.n is None:
            return logits
        if t < self.trace_end:
            now = resp[:, : t + 1]
            known = torch.ones_like(now, dtype=torch.bool)
            slots = answer_slots(self.follow, now, known, self.n, self.offset).cols(-1)
        else:
            slots = self.slots_after(resp).cols(t, t + 1)
        return keep_slots(logits[:, None], slots, self.seen[:, None], self.unique)[:, 0]

    def causal_logits(self, logits: torch.Tensor, resp: torch.Tensor, start: int) -> torch.Tensor:
        """A causal forward's logits [B, C, V] whose column j predicts response position start + j (resp [B, T]:
        the tokens before each of them): each column bans what the response holds before its position and keeps
        what the trace before it allows there (spec's verifier)."""
        end = start + logits.shape[1] - 1
        before = seen_before(resp[:, :end], self.unique)[:, start:]
        logits = ban_repeats(self.shaped(logits, start), before, self.unique)
        if self.follow is None or self.n is None:
            return logits
        ahead = resp[:, : end + 1]  # + the position the last column predicts, when the response has it
        slots = answer_slots(self.follow, ahead, torch.ones_like(ahead, dtype=torch.bool), self.n)
        if ahead.shape[1] == end:  # the response's last block: no position after it
            slots = slots.pad_col()
        return keep_slots(logits, slots.cols(start), before, self.unique)

    def recount(self, resp: torch.Tensor) -> None:
        """`seen` from the tokens of resp [B, T] (after a decoder rewrote some)."""
        self.seen = (resp[:, :, None] == self.unique).any(1)
