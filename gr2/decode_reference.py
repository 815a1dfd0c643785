"""Reference decoders: the plain recomputations that gr2/decode.py's fast decoders must equal (the tests hold them
to it: KV cache == no cache, for AR and for block diffusion).

They run the fast decoders' own loops (`ar_loop`, `block_loop`) with a different logits provider: every forward
re-reads the whole sequence, so no cache, anchor or stored block can be wrong here. The block reference also
reads the trace rule's slots afresh before and after every round (`FreshRules`), where the fast loop reads them
once per block when they cannot change. Same arguments, tokens and trajectory as their fast twins; nfe is one
forward per step or round (block diffusion: no round is skipped).
"""

from __future__ import annotations

import torch

from gr2.decode import (
    Block,
    Commit,
    CommitRule,
    Decoding,
    PickRule,
    ar_loop,
    block_loop,
    check_logprobs,
    model_pad_id,
    start,
)
from gr2.model import block_causal_mask
from gr2.rules import NO_RULES, DecodeRules, Rules, Slots, block_slots


class FreshRules(Rules):
    """`Rules` whose block slots are read afresh at every round (`answer_slots` over the decoded positions)."""

    def open_slots(self, resp: torch.Tensor, committed: torch.Tensor, s0: int) -> tuple[Slots | None, bool]:
        if self.follow is None or self.n is None:
            return None, False
        return block_slots(self.follow, self.n, resp[:, : s0 + committed.shape[1]], committed), True

    def round_slots(self, resp: torch.Tensor, committed: torch.Tensor, s0: int) -> tuple[Slots | None, bool]:
        return self.open_slots(resp, committed, s0)


@torch.no_grad()
def ar_generate_nocache(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    *,
    pick: PickRule | None = None,
    logprobs: torch.Tensor | None = None,
    rules: DecodeRules = NO_RULES,
) -> tuple[torch.Tensor, int]:
    """`ar_generate` re-running the whole sequence every step."""
    empty = eos_id if eos_id is not None else model_pad_id(model)
    d = start(model, prompts, max_new_tokens, empty, eos_id, rules)
    d.logprobs = check_logprobs(logprobs, pick, d)

    def step(d: Decoding, t: int) -> torch.Tensor:
        return model(
            input_ids=d.seq[:, : d.P + t],
            attention_mask=d.attn[:, : d.P + t],
            position_ids=d.pos[:, : d.P + t],
            cache=None,
            use_cache=False,
            logits_to_keep=1,
        ).logits[:, -1]

    ar_loop(d, step, pick)
    return d.resp.clone(), d.nfe


class FullLogits:
    """A round's logits from one forward over prompt + finished blocks + canvas under `block_causal_mask`: every
    finished block is seen exactly as its own clean forward."""

    def __init__(self, model: torch.nn.Module, block_size: int):
        self.model, self.block_size = model, block_size

    def __call__(self, d: Decoding, blk: Block) -> torch.Tensor:
        T = d.P + blk.end
        logits = self.model(
            input_ids=d.seq[:, :T],
            attention_mask=block_causal_mask(d.P, T, self.block_size, d.pad_lens),
            position_ids=d.pos[:, :T],
        ).logits
        d.nfe += 1
        return logits[:, d.P + blk.s0 - 1 : T - 1]


@torch.no_grad()
def diffusion_generate_nocache(
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
    """`diffusion_generate` re-running prompt + finished blocks + canvas every round, with `FreshRules`."""
    d = start(model, prompts, max_new_tokens, mask_id, eos_id)
    d.rules = FreshRules.start(rules, d.seq[:, : d.P])
    d.logprobs = check_logprobs(logprobs, commit_fn, d)
    block_loop(d, block_size, Commit(tau, commit_fn, eos_id), FullLogits(model, block_size))
    return d.resp.clone(), d.nfe, d.traj
