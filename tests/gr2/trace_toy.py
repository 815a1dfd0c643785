"""A toy of the real response format for the trace rule (gr2/rules.py): the prompt shows each
candidate's label and its level; the response writes a trace (label, level per candidate), a 2-token head, then the
labels in a random order, so an unconstrained answer ignores the trace. Its trained models: the `trace_models` fixture (conftest.py)."""

from __future__ import annotations

import torch

from gr2.rules import Layout, TraceRule
from tests.gr2.toys import BOS, EOS

BS = 4
LABELS, LEVELS, HEAD, ANSWER, COMMA = (
    list(range(5, 11)),
    list(range(11, 15)),
    [15, 16],
    list(range(17, 23)),
    23,
)
FOLLOW = TraceRule(torch.tensor(LABELS), torch.tensor(LEVELS), head=len(HEAD))
ANSWER_IDS = torch.tensor(ANSWER)
# The toy's response shape: its answer has no tail but the eos.
SHAPE = Layout(torch.tensor(LABELS), torch.tensor(LEVELS), torch.tensor(HEAD), COMMA, torch.tensor([EOS]))


def trace_items(n: int, seed: int) -> list:
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(3, 5, (1,), generator=rng))
        lev = [LEVELS[int(v)] for v in torch.randint(0, 4, (k,), generator=rng)]
        trace = [t for i in range(k) for t in (LABELS[i], lev[i])]
        order = torch.randperm(k, generator=rng).tolist()
        answer = [t for j, i in enumerate(order) for t in ([COMMA] if j else []) + [ANSWER[i]]]
        resp = trace + HEAD + answer + [EOS]
        out.append(([BOS, *trace], resp, [1.0] * len(resp)))
    return out


def follows(prompt: list[int], row: list[int]) -> bool | None:
    """Whether the answer lists the candidates by non-increasing level of the response's own trace; None without
    a well-formed trace and a whole answer."""
    k = len(prompt) // 2
    trace = row[: 2 * k]
    if trace[::2] != LABELS[:k] or not set(trace[1::2]) <= set(LEVELS):
        return None
    level = {ANSWER[i]: LEVELS.index(trace[2 * i + 1]) for i in range(k)}
    answer = row[2 * k + len(HEAD) :: 2][:k]
    if sorted(answer) != sorted(level):
        return None
    return all(level[a] >= level[b] for a, b in zip(answer, answer[1:], strict=False))


class Scripted(torch.nn.Module):
    """`inner` (which keeps its cache) with its logits replaced by one-hot scores for `items`' responses: the
    logits at a row's position p predict the response token at p + 1 (read off the position ids, so cached and
    uncached loops see the same script). Unlike the trained toy, whose traces tie every level, its traces are
    `trace_items`' own, with distinct levels: a round that completes a trace leaves answer slots one label."""

    def __init__(self, inner: torch.nn.Module, items: list):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.prompt_len = torch.tensor([len(p) for p, _, _ in items])
        width = max(len(r) for _, r, _ in items)
        self.resp = torch.full((len(items), width + 1), EOS)
        self.full = None  # the cache of the whole batch (its rows are the items)
        for i, (_, r, _) in enumerate(items):
            self.resp[i, : len(r)] = torch.tensor(r)

    def forward(self, **kw):
        out = self.inner(**kw)
        rows = self._rows(kw.get("cache"), out.logits.shape[0])
        # the response index each returned column predicts
        at = kw["position_ids"][:, -out.logits.shape[1] :] + 1 - self.prompt_len[rows, None]
        tok = self.resp[rows].gather(1, at.clamp(0, self.resp.shape[1] - 1))
        out.logits = 10.0 * torch.nn.functional.one_hot(tok, self.config.vocab_size).float()
        return out

    def _rows(self, cache, batch: int) -> torch.Tensor:
        """The items the forward's rows are: all of them in order for a whole batch; for some rows only (the
        decoder's forward over its open rows, from a copy of their cache rows), the items whose cached keys
        those rows hold."""
        if batch == len(self.prompt_len):
            self.full = cache
            return torch.arange(batch)
        full = self.full.layers[0].keys
        part = cache.layers[0].keys[:, :, : full.shape[2]]
        return torch.tensor([next(i for i in range(len(full)) if torch.equal(full[i], k)) for k in part])
