"""Continuous batching of the AR and block-diffusion decoders: a `Stream` is one running decode that requests
join and leave (serving/batcher.py runs one per decoder and tau).

New prompts join at the running decode's next block boundary (diffusion) or next token (AR), and a row leaves as
soon as it has finished, so a request waits neither for a batch to fill nor for the batch's slowest row. A
request gets the tokens it gets decoded alone (tests/gr2/test_continuous.py), up to the float rounding of a
different batch, as with any batch.

The layout. The rows share one buffer and one KV cache (gr2/decode.py's `Decoding`), and every forward feeds the
same columns of every row. A row that joins when the running rows' next block starts at response column s0 is
placed so that its prompt ends at column P + s0: its response starts there (its `offset`), and the columns before
its prompt are its left padding. Blocks stay aligned (s0 is a multiple of block_size); position ids count from
each row's first real token; and the mask is the training mask with each row's own response start
(`attention_rows` takes per-row starts), so a row sees what it sees alone. A diffusion decode feeds the running
rows' last finished block with the next block's first forward (gr2/decode.py): a joining row's prompt tail sits
in those columns, is fed with them under its causal mask, and its prefill covers the columns before. The rows a
diffusion decode begins with need no prefill: their prompts are fed with the first block's first forward, as
decoding alone feeds them. A row's columns past its own max_new_tokens are hidden from it and count as decoded.
The rules take the offsets (gr2/rules.py `Rules.offset`).

The buffer does not grow without end: once every row's response starts past column 0, the response start moves to
the earliest one, and the columns that are padding in every row are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gr2.decode import (
    CachedLogits,
    Commit,
    Decoding,
    ar_commit,
    model_pad_id,
    open_block,
    pad_prompts,
    run_block,
)
from gr2.model import attention_rows
from gr2.rules import NO_RULES, DecodeRules, Rules

STREAM_DECODERS = ("ar", "diffusion")  # spec (a draft and its verifier) is not streamed


@dataclass(frozen=True)
class StreamConfig:
    """How a stream decodes: greedy AR (block_size 0) or block diffusion at tau, every row under `rules`."""

    max_new_tokens: int
    eos_id: int
    block_size: int = 0  # 0: AR
    tau: float = 1.0
    mask_id: int | None = None  # diffusion's undecoded positions
    rules: DecodeRules = NO_RULES
    max_rows: int = 32  # rows decoded together; later prompts wait for a row to leave
    # A prompt joins a running decode only if that decode has more than this many steps (blocks; AR: tokens)
    # to go; otherwise it waits and starts the next decode. Joining costs the joiners' prefill, a forward that
    # every running row waits for: measured on Beauty's 3-block responses at 8 closed-loop clients, joining a
    # decode in its last two blocks lost 15-20% of diffusion's requests/s (docs/SERVING.md).
    join_wait: int = 2

    def __post_init__(self) -> None:
        if self.block_size > 0 and self.mask_id is None:
            raise ValueError("a diffusion stream (block_size > 0) needs mask_id")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")


@dataclass(frozen=True)
class Finished:
    """A row that left: its key, its max_new_tokens tokens (as a decoder returns them) and its share of the
    forwards it took part in (each forward split between the rows it fed)."""

    key: Any
    tokens: list[int]
    nfe: float


class Stream:
    """One running decode (module docstring). `add` queues prompts; each `step` admits queued prompts, decodes one
    block (diffusion) or one token (AR) for every row, and returns the rows that finished."""

    def __init__(self, model: torch.nn.Module, cfg: StreamConfig):
        self.model, self.cfg = model, cfg
        self.queue: list[tuple[Any, list[int]]] = []
        self.d: Decoding | None = None  # the running rows; None: idle
        self.keys: list[Any] = []
        self.nfe: list[float] = []
        self.offset = torch.zeros(0, dtype=torch.long)  # [B]: each row's response start
        self.s0 = 0  # the response column the next step decodes (diffusion: the next block's first)
        self.rounds: CachedLogits | None = None  # diffusion: the KV cache and the round logits
        self.cache: DynamicCache | None = None  # AR: the KV cache

    def add(self, key: Any, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. bos)")
        self.queue.append((key, list(prompt)))

    def __len__(self) -> int:
        """Rows running and queued."""
        return len(self.keys) + len(self.queue)

    @property
    def running(self) -> int:
        return len(self.keys)

    @property
    def empty(self) -> int:
        """What an undecoded position holds."""
        return self.cfg.eos_id if self.cfg.block_size < 1 else cast(int, self.cfg.mask_id)

    @torch.inference_mode()  # serving only: nothing here is trained on (gr2/generative.py `_decode_chunk`)
    def step(self) -> list[Finished]:
        self.admit()
        d = self.d
        if d is None:
            return []
        nfe = d.nfe
        if self.cfg.block_size > 0:
            self.block_step(d)
        else:
            self.ar_step(d)
        share = (d.nfe - nfe) / len(self.keys)
        self.nfe = [n + share for n in self.nfe]
        return self.leave()

    # ------------------------------------------------------------------ decoding
    def ar_step(self, d: Decoding) -> None:
        assert self.cache is not None
        t, P = self.s0, d.P
        lo = P + t - 1 if t else 0  # the first step feeds the prompts
        logits = self.model(
            input_ids=d.seq[:, lo : P + t],
            attention_mask=d.attn[:, : P + t],
            position_ids=d.pos[:, lo : P + t],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        ar_commit(d, logits, t, None)
        self.s0 = t + 1

    def block_step(self, d: Decoding) -> None:
        assert self.rounds is not None
        s0, cfg = self.s0, self.cfg
        end = min(s0 + cfg.block_size, d.L)
        blk = open_block(d, s0, end, None)
        past = (
            torch.arange(s0, end, device=d.seq.device)[None, :] >= (self.offset + cfg.max_new_tokens)[:, None]
        )
        if bool(past.any()):  # a row's columns past its own end: decoded, as far as its rounds go
            blk.tokens.masked_fill_(past, d.fill)
            blk.committed |= past
        run_block(d, blk, Commit(cfg.tau, None, cfg.eos_id), self.rounds)
        self.s0 = end

    # ------------------------------------------------------------------ rows leaving
    def leave(self) -> list[Finished]:
        d, L = self.d, self.cfg.max_new_tokens
        assert d is not None
        out_of_room = self.offset + L <= self.s0
        gone = d.done | out_of_room
        if not bool(gone.any()):
            return []
        out = []
        for r in gone.nonzero().squeeze(1).tolist():
            o = int(self.offset[r])
            tokens = d.resp[r, o : o + L].clone()
            tokens[self.s0 - o :] = d.fill  # columns never reached: the row had finished
            out.append(Finished(self.keys[r], tokens.tolist(), self.nfe[r]))
        stay = (~gone).nonzero().squeeze(1)
        if len(stay) == 0:
            self.reset()
            return out
        self.keys = [self.keys[i] for i in stay.tolist()]
        self.nfe = [self.nfe[i] for i in stay.tolist()]
        self.select(stay)
        self.compact()
        return out

    def steps_left(self) -> int:
        """Steps until every running row has its eos at the latest: each row's response length from the
        layout when the rules have one (gr2/rules.py `Layout`), else max_new_tokens."""
        d = self.d
        assert d is not None
        end = self.offset + self.cfg.max_new_tokens
        kind = None if d.rules is None else d.rules.kind
        if kind is not None and kind.shape[1] > 0:  # a row's last ruled position is its eos
            ruled = kind != 0
            last = kind.shape[1] - ruled.flip(1).long().argmax(1)
            end = torch.where(ruled.any(1), torch.minimum(end, last), end)
        step = max(self.cfg.block_size, 1)
        return -(-(int(end.max()) - self.s0) // step)

    def reset(self) -> None:
        self.d, self.rounds, self.cache, self.keys, self.nfe, self.s0 = None, None, None, [], [], 0
        self.offset = torch.zeros(0, dtype=torch.long)

    # ------------------------------------------------------------------ rows joining
    def admit(self) -> None:
        room = self.cfg.max_rows - len(self.keys)
        if not self.queue or room <= 0:
            return
        if self.d is not None and self.steps_left() <= self.cfg.join_wait:
            return  # the running decode is about to end: start with the next one instead of paying a prefill
        if self.rounds is not None and self.rounds.kv.stored < 0:
            return  # the running rows' prompts are not in the cache yet (no forward so far): nothing to join
        batch, self.queue = self.queue[:room], self.queue[room:]
        keys, prompts = [k for k, _ in batch], [p for _, p in batch]
        if self.d is None:
            self.begin(keys, prompts)
        else:
            self.join(keys, prompts)

    def begin(self, keys: list[Any], prompts: list[list[int]]) -> None:
        """An idle stream starts as gr2/decode.py's decoders do."""
        cfg = self.cfg
        ids, pad_lens = pad_prompts(prompts, self.model)
        self.d = self.decoding(ids, pad_lens, cfg.max_new_tokens, Rules.start(cfg.rules, ids))
        self.keys, self.nfe, self.s0 = keys, [0.0] * len(keys), 0
        self.offset = torch.zeros(len(keys), dtype=torch.long, device=ids.device)
        if cfg.block_size > 0:
            # The prompts are fed with the first block's first forward, as decoding alone feeds them.
            self.rounds = CachedLogits(self.model, self.d, cfg.block_size, row_subsets=True)
        else:
            self.cache = DynamicCache()

    def join(self, keys: list[Any], prompts: list[list[int]]) -> None:
        """New rows whose responses start at column s0: their prompts end there (module docstring)."""
        d, cfg, s0 = self.d, self.cfg, self.s0
        assert d is not None
        grow = max(len(p) for p in prompts) - (d.P + s0)
        if grow > 0:  # a prompt longer than the room before s0: pad every running row on the left
            self.pad_left(grow)
            d = cast(Decoding, self.d)
        P, L = d.P, cfg.max_new_tokens
        width = max(d.L, s0 + L)
        if width > d.L:
            self.widen(width)
            d = cast(Decoding, self.d)
        n = len(prompts)
        ids = torch.full((n, P + s0), model_pad_id(self.model), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P + s0 - len(p) :] = torch.tensor(p, dtype=torch.long)
        pad_lens = torch.tensor([P + s0 - len(p) for p in prompts], dtype=torch.long)
        dev = d.seq.device
        ids, pad_lens = ids.to(dev), pad_lens.to(dev)
        offset = torch.full((n,), s0, dtype=torch.long, device=dev)
        rules = Rules.start(cfg.rules, ids, offset)
        new = self.decoding(ids[:, :P], pad_lens, width, rules)
        new.seq[:, P : P + s0] = ids[:, P:]  # the prompts' tails, before their responses
        cache = DynamicCache()
        # Their prefill: every column the running rows' cache holds; the next step feeds the columns after it, the new
        # rows' prompt tails among them. AR: every step fed its token, so the cache ends one column before s0.
        # Diffusion: at the last block that had a forward, which is not always the block before s0 (a block the
        # layout gives whole has none).
        stop = P + (self.rounds.kv.stored if self.rounds is not None else s0 - 1)
        self.model(
            input_ids=new.seq[:, :stop],
            attention_mask=new.attn[:, :stop],
            position_ids=new.pos[:, :stop],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        d.nfe += 1
        joined = [1 / n] * n  # the new rows' prefill
        self.merge(new, cache)
        self.keys, self.nfe = self.keys + keys, self.nfe + joined
        self.offset = torch.cat([self.offset, offset])
        self.remask()

    # ------------------------------------------------------------------ the shared state
    def decoding(
        self, prompt_ids: torch.Tensor, pad_lens: torch.Tensor, width: int, rules: Rules | None
    ) -> Decoding:
        empty = self.empty
        seq = torch.cat([prompt_ids, torch.full((len(prompt_ids), width), empty, dtype=torch.long)], dim=1)
        return Decoding(seq, pad_lens, prompt_ids.shape[1], self.cfg.eos_id, self.cfg.eos_id, rules)

    def rebuild(
        self, seq: torch.Tensor, pad_lens: torch.Tensor, P: int, rows: torch.Tensor | None = None
    ) -> None:
        """A new `Decoding` over seq (attn and pos follow from pad_lens), keeping done, traj, rules and the
        counts of rows `rows` (all when None) of the old one."""
        old = self.d
        assert old is not None
        keep = slice(None) if rows is None else rows
        d = Decoding(seq, pad_lens, P, old.eos_id, old.fill, rules=old.rules, nfe=old.nfe, rnd=old.rnd)
        d.done = old.done[keep].clone()
        self.d = d

    def select(self, rows: torch.Tensor) -> None:
        d = self.d
        assert d is not None
        rules = None if d.rules is None else d.rules.select(rows)
        self.rebuild(d.seq[rows], d.pad_lens[rows], d.P, rows)
        cast(Decoding, self.d).rules = rules
        self.offset = self.offset[rows]
        for layer in self.layers():
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        if self.rounds is not None and self.rounds.anchor is not None:  # (None: no forward yet)
            self.rounds.anchor = self.rounds.anchor[rows]
        self.remask()

    def merge(self, new: Decoding, cache: DynamicCache) -> None:
        d = self.d
        assert d is not None and d.seq.shape[1] == new.seq.shape[1] and d.P == new.P
        rules = d.rules if d.rules is None or new.rules is None else d.rules.concat(new.rules)
        done = torch.cat([d.done, new.done])
        self.rebuild(torch.cat([d.seq, new.seq]), torch.cat([d.pad_lens, new.pad_lens]), d.P)
        d = cast(Decoding, self.d)
        d.rules, d.done = rules, done
        for layer, add in zip(self.layers(), self.layers(cache), strict=True):
            layer.keys = torch.cat([layer.keys, add.keys])
            layer.values = torch.cat([layer.values, add.values])
        if self.rounds is not None:  # (the new rows' anchor comes from the next block's first forward)
            a = self.rounds.anchor
            assert a is not None  # (`admit` joins only once the running rows' prompts are stored)
            self.rounds.anchor = torch.cat([a, a.new_zeros(len(new.seq), *a.shape[1:])])

    def pad_left(self, n: int) -> None:
        """n more pad columns before every row (P grows by n)."""
        d = self.d
        assert d is not None
        pad = torch.full((len(d.seq), n), model_pad_id(self.model), dtype=torch.long, device=d.seq.device)
        rules = d.rules
        self.rebuild(torch.cat([pad, d.seq], dim=1), d.pad_lens + n, d.P + n)
        cast(Decoding, self.d).rules = rules
        for layer in self.layers():
            z = layer.keys.new_zeros(*layer.keys.shape[:2], n, layer.keys.shape[3])
            layer.keys, layer.values = torch.cat([z, layer.keys], 2), torch.cat([z, layer.values], 2)

    def widen(self, width: int) -> None:
        """Room for responses up to response column `width`."""
        d = self.d
        assert d is not None
        more = torch.full((len(d.seq), width - d.L), self.empty, dtype=torch.long, device=d.seq.device)
        rules = d.rules
        self.rebuild(torch.cat([d.seq, more], dim=1), d.pad_lens, d.P)
        cast(Decoding, self.d).rules = rules

    def compact(self) -> None:
        """Move the response start to the earliest row's, then drop the columns every row pads."""
        d = self.d
        assert d is not None
        m = int(self.offset.min())
        if m > 0:
            rules = None if d.rules is None else d.rules.shift(m)
            self.rebuild(d.seq, d.pad_lens, d.P + m)
            cast(Decoding, self.d).rules = rules
            self.offset, self.s0 = self.offset - m, self.s0 - m
            if self.rounds is not None:
                self.rounds.kv.stored -= m
            d = cast(Decoding, self.d)
        c = int(d.pad_lens.min())
        if c > 0:
            rules = d.rules
            self.rebuild(d.seq[:, c:], d.pad_lens - c, d.P - c)
            cast(Decoding, self.d).rules = rules
            for layer in self.layers():
                layer.keys, layer.values = layer.keys[:, :, c:], layer.values[:, :, c:]
        if m > 0 or c > 0:
            self.remask()

    def remask(self) -> None:
        """The diffusion rounds' masks for the rows as they are now (`CachedLogits.rows`, with each row's own
        response start and end)."""
        d, rounds = self.d, self.rounds
        if rounds is None or d is None:
            return
        P, W = d.P, d.L
        start = P + self.offset
        cols = torch.arange(P, P + W, device=d.seq.device)
        rows = attention_rows(start, cols, P + W, self.cfg.block_size, d.pad_lens)  # [B, 1, W, P + W]
        k = torch.arange(P + W, device=d.seq.device)
        hidden = k[None, :] >= (start + self.cfg.max_new_tokens)[:, None]  # [B, P + W]: past a row's end
        rows &= ~(hidden[:, None, None, :] & (k[None, None, None, :] != cols[None, None, :, None]))
        rounds.rows, rounds.s0, rounds.part = rows, -1, None

    def layers(self, cache: DynamicCache | None = None) -> list[DynamicLayer]:
        if cache is None:
            cache = self.rounds.kv.cache if self.rounds is not None else self.cache
        assert cache is not None
        return [cast(DynamicLayer, layer) for layer in cache.layers]
