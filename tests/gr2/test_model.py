"""Backbone and attention mask: sdpa honours our 4D masks; the block mask matches its definition."""

import pytest
import torch

from gr2.config import ModelConfig
from gr2.model import (
    ATTN_IMPLEMENTATION,
    attention_rows,
    block_causal_mask,
    build_model,
    convert_to_diffusion,
    load_model,
    position_ids_for,
    save_model,
)

PAD, BOS, EOS, MASK, V = 0, 1, 2, 3, 40
TINY = ModelConfig(d_model=32, n_layer=2, n_head=4, d_ff=64, max_len=128)


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, V, PAD, EOS, BOS, MASK, seed=0)


def reference_mask(P: int, T: int, bs: int, pad_len: int) -> torch.Tensor:
    """The definition, one position at a time."""
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(T):
            if k == q:
                ok = True  # every query sees itself (pad rows must not be empty)
            elif k < pad_len:
                ok = False
            elif q < P:
                ok = k <= q  # causal prompt, never the response
            elif k < P:
                ok = True  # the response sees the whole (real) prompt
            else:
                ok = (k - P) // bs <= (q - P) // bs  # same or earlier block
            m[q, k] = ok
    return m


@pytest.mark.parametrize("P,T,bs", [(3, 7, 2), (5, 16, 4), (4, 13, 4), (1, 9, 3), (6, 6, 2)])
def test_block_mask_matches_definition(P, T, bs):
    pad_lens = torch.tensor([0, 1, P - 1])
    m = block_causal_mask(P, T, bs, pad_lens)
    assert m.shape == (3, 1, T, T) and m.dtype == torch.bool
    for b, pl in enumerate(pad_lens.tolist()):
        assert torch.equal(m[b, 0], reference_mask(P, T, bs, pl)), (b, pl)


def test_block_size_one_is_causal():
    T = 11
    m = block_causal_mask(4, T, 1)
    assert torch.equal(m[0, 0], torch.tril(torch.ones(T, T, dtype=torch.bool)))


def test_attention_rows_are_a_slice_of_the_mask():
    pad_lens = torch.tensor([0, 2])
    full = block_causal_mask(5, 17, 4, pad_lens)
    q = torch.arange(9, 15)
    assert torch.equal(attention_rows(5, q, 15, 4, pad_lens), full[:, :, 9:15, :15])


def test_sdpa_pinned_and_full_causal_4d_mask_reproduces_default_logits(model):
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION == "sdpa"
    x = torch.randint(4, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        default = model(x).logits
        masked = model(x, attention_mask=block_causal_mask(5, 12, 1, torch.zeros(2, dtype=torch.long))).logits
        block = model(x, attention_mask=block_causal_mask(5, 12, 4, torch.zeros(2, dtype=torch.long))).logits
    assert torch.allclose(default, masked, atol=1e-6)
    assert torch.allclose(default[:, :5], block[:, :5], atol=1e-6)  # the prompt is unaffected
    assert not torch.allclose(default[:, 5:], block[:, 5:], atol=1e-3)  # bidirectional blocks do change it


def test_left_padding_matches_unpadded(model):
    x = torch.randint(4, V, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.full((1, 3), PAD), x], dim=1)
    pad_lens = torch.tensor([3])
    with torch.no_grad():
        ref = model(x, attention_mask=block_causal_mask(4, 9, 2)).logits
        out = model(
            padded,
            attention_mask=block_causal_mask(7, 12, 2, pad_lens),
            position_ids=position_ids_for(pad_lens, torch.arange(12)),
        ).logits
    assert not torch.isnan(out).any()
    assert torch.allclose(ref, out[:, 3:], atol=1e-5)


def test_convert_copies_weights_and_save_load_roundtrip(model, tmp_path):
    d = convert_to_diffusion(model, block_size=4, mask_id=MASK)
    assert d.config.gr2_block_size == 4 and d.config.mask_token_id == MASK
    assert model.config.gr2_block_size == 0  # the AR model is untouched
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), d.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    save_model(d, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    loaded, meta = load_model(tmp_path / "m")
    assert meta["block_size"] == 4 and meta["mask_id"] == MASK and meta["eos_id"] == EOS
    assert meta["model"]["d_model"] == TINY.d_model
    assert loaded.config._attn_implementation == "sdpa"
    x = torch.randint(4, V, (2, 10))
    with torch.no_grad():
        assert torch.equal(d(x).logits, loaded(x).logits)


def test_convert_rejects_mask_outside_vocab(model):
    with pytest.raises(ValueError, match="mask_id"):
        convert_to_diffusion(model, 4, V + 1)
