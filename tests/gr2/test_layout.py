"""The layout rule (gr2/rules.py `Layout`): the response's shape, which its list's length fixes, holds for every
decoder whatever its model says, and the decoders' equivalences hold with it."""

import copy

import pytest
import torch

from gr2.decode import GIVEN, ar_generate, diffusion_generate, spec_generate
from gr2.decode_reference import ar_generate_nocache, diffusion_generate_nocache
from gr2.losses import Batch, layout_given, sample_masks
from gr2.model import convert_to_diffusion
from gr2.rules import DecodeRules, Rules
from tests.gr2.toys import BOS, EOS, MASK, toy_model
from tests.gr2.trace_toy import ANSWER, ANSWER_IDS, BS, COMMA, FOLLOW, HEAD, LABELS, LEVELS, SHAPE, follows

RULED = DecodeRules(ANSWER_IDS, FOLLOW, SHAPE)
L = 28  # the longest response: 6 candidates, 12 + 2 + 11 + 1 tokens


def shaped_prompts(seed: int) -> list[list[int]]:
    """Prompts of 1 to 6 candidates (the toy's labels), each label with a random level, as the toy's prompts are."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in [1, 2, 3, 4, 5, 6] * 2:
        lev = torch.randint(0, len(LEVELS), (k,), generator=g).tolist()
        out.append([BOS, *[t for i in range(k) for t in (LABELS[i], LEVELS[lev[i]])]])
    return out


def well_formed(prompt: list[int], row: list[int]) -> bool:
    """The row is the toy's shape for its prompt's k candidates: trace, head, k labels with commas, eos; and its
    answer follows its trace."""
    k = len(prompt) // 2
    end = 2 * k + len(HEAD) + 2 * k - 1
    seps = row[2 * k + len(HEAD) + 1 : end : 2]
    return (
        follows(prompt, row) is True
        and row[2 * k : 2 * k + len(HEAD)] == HEAD
        and seps == [COMMA] * (k - 1)
        and row[end] == EOS
    )


def test_layout_by_hand():
    """3 candidates: label, level three times; the 2-token head; 3 of the first 3 answer labels, commas between;
    eos; then eos (the filler: a label there would count as written)."""
    state = Rules.start(DecodeRules(ANSWER_IDS, layout=SHAPE), torch.tensor([[BOS, 5, 11, 6, 12, 7, 13]]))
    ban = state.layout_bans(0, 16, 24)[0]
    allowed = [(~b).nonzero().flatten().tolist() for b in ban]
    assert allowed[:6] == [[5], LEVELS, [6], LEVELS, [7], LEVELS]
    assert allowed[6:8] == [[HEAD[0]], [HEAD[1]]]
    assert allowed[8:13] == [ANSWER[:3], [COMMA], ANSWER[:3], [COMMA], ANSWER[:3]]
    assert allowed[13] == allowed[14] == allowed[15] == [EOS]
    past = state.layout_bans(14, 40, 24)[0]  # past the eos, as far as any response goes
    assert [(~b).nonzero().flatten().tolist() for b in past] == [[EOS]] * 40


def test_kinds_looked_up_equal_kinds_built():
    """`Layout.kinds` looks each row up in a table of every n, built once per width: the same as building them."""
    n = torch.tensor([0, 1, 2, 3, 4, 5, 6, 3, 1])
    for width in (1, 16, 40):
        assert torch.equal(SHAPE.kinds(n, width), SHAPE.build_kinds(n, width))
        assert torch.equal(SHAPE.kinds(n[:0], width), SHAPE.build_kinds(n[:0], width))
    assert torch.equal(SHAPE.kinds(torch.tensor([7, 2]), 16), SHAPE.build_kinds(torch.tensor([7, 2]), 16))


def test_every_decoder_writes_the_shape_whatever_the_model():
    """An untrained model writes malformed responses; under the layout every decoder's response has the shape, for
    lists of every length, and its answer follows its trace (a permutation of the list's own candidates)."""
    ar = toy_model(seed=3)
    diff = convert_to_diffusion(copy.deepcopy(ar), BS, MASK)
    ps = shaped_prompts(0)
    free = ar_generate(ar, ps, L, EOS, rules=DecodeRules(ANSWER_IDS, FOLLOW))[0]
    assert not any(well_formed(p, r) for p, r in zip(ps, free.tolist(), strict=True))
    outs = {
        "ar": ar_generate(ar, ps, L, EOS, rules=RULED)[0],
        "spec": spec_generate(diff, ar, ps, L, BS, 0.5, MASK, EOS, rules=RULED)[0],
    }
    for tau in (1.0, 0.5, 0.0):
        outs[f"diffusion@{tau}"] = diffusion_generate(diff, ps, L, BS, tau, MASK, EOS, rules=RULED)[0]
    for name, toks in outs.items():
        bad = [p for p, r in zip(ps, toks.tolist(), strict=True) if not well_formed(p, r)]
        assert not bad, (name, bad)


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.0])
def test_the_layout_keeps_the_equivalences(trace_models, tau):
    """cache == no cache, block 1 == AR and spec == AR hold under the layout (with lists of 1 to 6 candidates)."""
    ar, diff = trace_models
    ps = shaped_prompts(1)
    kw = {"rules": RULED}
    a, n_ar = ar_generate(ar, ps, L, EOS, **kw)
    assert torch.equal(a, ar_generate_nocache(ar, ps, L, EOS, **kw)[0])
    d1, n_d1, _ = diffusion_generate(ar, ps, L, 1, tau, MASK, EOS, **kw)
    # (a position the layout fixes in every open row is a block of one committed before any round: no forward)
    assert torch.equal(a, d1) and n_d1 < n_ar
    assert torch.equal(a, spec_generate(diff, ar, ps, L, BS, tau, MASK, EOS, **kw)[0])
    for bs in (3, 4):
        d, _, t1 = diffusion_generate(diff, ps, L, bs, tau, MASK, EOS, **kw)
        e, _, t2 = diffusion_generate_nocache(diff, ps, L, bs, tau, MASK, EOS, **kw)
        assert torch.equal(d, e) and torch.equal(t1, t2)
        assert all(well_formed(p, r) for p, r in zip(ps, d.tolist(), strict=True))


def test_blocks_start_with_the_layouts_tokens(trace_models):
    """Block diffusion commits the tokens the layout fixes before a block's first round (`layout_commits`): their
    trajectory is GIVEN, every other token's is a round, and the block's first forward already reads them (so a
    level's first prediction sees its label)."""
    _, diff = trace_models
    ps = shaped_prompts(2)
    fed: list[torch.Tensor] = []
    hook = diff.register_forward_pre_hook(
        lambda m, a, kw: fed.append(kw["input_ids"].clone()), with_kwargs=True
    )
    try:
        tokens, _, traj = diffusion_generate(diff, ps, L, BS, 0.5, MASK, EOS, rules=RULED)
    finally:
        hook.remove()
    for p, row, t in zip(ps, tokens.tolist(), traj.tolist(), strict=True):
        k = len(p) // 2
        end = 4 * k + len(HEAD) - 1  # the eos
        fixed = {
            *range(0, 2 * k, 2),
            *range(2 * k, 2 * k + len(HEAD)),
            *range(2 * k + len(HEAD) + 1, end, 2),
            *range(end, L),  # the eos, and eos after it
        }
        reached = {j for j in range(L) if t[j] != -1}  # (a block after the row's last is never opened)
        assert {j for j in range(L) if t[j] == GIVEN} == fixed & reached
        assert all(t[j] >= 0 for j in range(end + 1) if j not in fixed)
        assert [row[j] for j in range(0, 2 * k, 2)] == LABELS[:k]
    first = fed[0]  # block 0's first round, the prompt fed with it: [B, P + BS]
    P = first.shape[1] - BS
    assert torch.equal(first[:, P], torch.tensor([LABELS[0]] * len(ps)))


def test_cft_never_masks_the_layouts_tokens():
    """CFT's noise (`sample_masks` with `layout_given`) leaves every fixed token of the layout unmasked in both
    views (the eos and the eos padding after it too), and masks the rest as before."""
    k = 3
    row = [LABELS[0], LEVELS[1], LABELS[1], LEVELS[0], LABELS[2], LEVELS[2], *HEAD]
    row += [ANSWER[0], COMMA, ANSWER[2], COMMA, ANSWER[1], EOS, EOS, EOS]
    resp = torch.tensor([row])
    given = layout_given(resp, SHAPE.fixed(), EOS)
    assert given[0].tolist() == [t in (*LABELS, *HEAD, COMMA, EOS) for t in row]
    assert int(given.sum()) == k + len(HEAD) + (k - 1) + 3
    batch = Batch(
        torch.cat([torch.tensor([[BOS]]), resp], 1),
        torch.ones(1, 1 + len(row)),
        torch.zeros(1, dtype=torch.long),
        1,
        0,
    )
    for seed in range(5):
        masks, _ = sample_masks(batch, len(row), torch.Generator().manual_seed(seed), keep=given)
        assert not bool((masks & given).any()) and bool(masks.any())
        assert torch.equal(masks[0] | masks[1], ~given.expand_as(masks[0]))
