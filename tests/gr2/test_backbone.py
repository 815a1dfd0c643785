"""Pretrained backbones (gr2/model.py load_pretrained / add_lora): tiny Llama (SmolLM family) and Qwen2 models
built from a config and saved with a byte-level BPE tokenizer stand in for downloaded checkpoints.

Checked: the backbone takes the project vocabulary with rows initialised from its own pieces; LoRA trains only
the adapters and the embeddings and folds back into a plain model that loads and decodes the same; and the
block-diffusion path runs on it unchanged (conversion, CFT, both KV-cache decoders exact, OPD and GRPO steps).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from gr2.config import ModelConfig, TrainConfig
from gr2.decode import ar_generate, diffusion_generate
from gr2.decode_reference import ar_generate_nocache, diffusion_generate_nocache
from gr2.losses import ar_batch_loss, collate, masked_diffusion_loss
from gr2.model import build_backbone, convert_to_diffusion, load_model, save_model
from gr2.opd import OPD_RULES, make_opd_batch, opd_loss
from gr2.rl import Sampling, grpo_loss, rollout_batch, sample_diffusion
from gr2.tokenizer import build_tokenizer
from gr2.train import BucketedBatches, train
from tests.gr2.toys import EOS, MASK, PAD, toy_items

BS = 4
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, True),  # SmolLM2 is a Llama with tied embeddings
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, False),  # untied head: both matrices are transferred
}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges (256 byte tokens + bos/eos), like GPT-2's before training."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"<s>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pretrained(request, tmp_path_factory):
    """A saved 'pretrained' checkpoint folder (weights + tokenizer) of one family."""
    config_cls, model_cls, tied = FAMILIES[request.param]
    cfg = config_cls(
        vocab_size=258,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    model_cls(cfg).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return request.param, path


@pytest.fixture(scope="module")
def project_tok():
    tok = build_tokenizer([4, 4, 4, 2], None, n_features=2)
    # the toy tasks of test_train.py use ids 0..23 with these four specials
    assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (PAD, EOS, MASK)
    return tok


def test_backbone_takes_the_project_vocabulary(pretrained, project_tok):
    family, path = pretrained
    src = FAMILIES[family][1].from_pretrained(path)
    model = build_backbone(ModelConfig(pretrained=str(path)), project_tok)
    assert isinstance(model, FAMILIES[family][1]) and model.config.vocab_size == len(project_tok)
    assert model.get_input_embeddings().weight.shape == (len(project_tok), 32)
    c = model.config
    assert (c.pad_token_id, c.eos_token_id, c.bos_token_id, c.mask_token_id) == (0, EOS, 1, MASK)
    assert c.gr2_block_size == 0 and c.gr2_model["pretrained"] == str(path)
    src_in, new_in = src.get_input_embeddings().weight, model.get_input_embeddings().weight
    pieces = byte_tokenizer()('"ranking"', add_special_tokens=False)["input_ids"]
    assert len(pieces) == 9  # one byte each: a mean over several pretrained rows
    row = project_tok.convert_tokens_to_ids('"ranking"')
    assert torch.allclose(new_in[row], src_in[pieces].mean(0))
    assert torch.allclose(new_in[project_tok.eos_token_id], src_in[257])  # eos keeps the pretrained eos row
    if not FAMILIES[family][2]:
        src_out, new_out = src.get_output_embeddings().weight, model.get_output_embeddings().weight
        assert torch.allclose(new_out[row], src_out[pieces].mean(0))
    # The transformer layers are the pretrained ones.
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], src.state_dict()[name])


def test_lora_backbone_trains_and_the_diffusion_path_runs_unchanged(pretrained, project_tok, tmp_path):
    family, path = pretrained
    mcfg = ModelConfig(pretrained=str(path), lora_rank=4, lora_alpha=8)
    model = build_backbone(mcfg, project_tok, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and "model.embed_tokens.weight" in trainable
    assert not any(n.endswith("base_layer.weight") for n in trainable)
    cfg = TrainConfig(
        lr=1e-2, batch_size=16, max_steps=30, epochs=0, warmup=2, checkpoint_every=0, log_every=0
    )
    batches = BucketedBatches(toy_items(256, 4), 16, functools.partial(collate, pad_id=PAD))
    res = train(model, batches, ar_batch_loss, cfg, tmp_path / "sft")
    assert sum(res.losses[-5:]) < 0.8 * sum(res.losses[:5]), res.losses
    after = dict(model.named_parameters())  # train() saved final/: the adapters are merged by now
    assert not any("lora_" in n for n in after)
    base = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[base], before["model.layers.0.self_attn.q_proj.base_layer.weight"])
    reloaded, _ = load_model(tmp_path / "sft" / "final")
    assert type(reloaded) is type(model)
    prompts = [p for p, _, _ in toy_items(6, 9)]
    assert torch.equal(ar_generate(reloaded, prompts, 12, EOS)[0], ar_generate(model, prompts, 12, EOS)[0])
    cached, _ = ar_generate(model, prompts, 12, EOS)
    assert torch.equal(cached, ar_generate_nocache(model, prompts, 12, EOS)[0])

    # Conversion, then CFT with fresh adapters, on the block-causal mask with token shift.
    diff = convert_to_diffusion(reloaded, BS, MASK)
    from gr2.model import add_lora

    diff = add_lora(diff, mcfg)
    cft = BucketedBatches(
        toy_items(64, 5), 16, functools.partial(collate, pad_id=PAD, block_size=BS, resp_pad_id=EOS)
    )
    cft_cfg = dataclasses.replace(cfg, max_steps=3)
    res = train(
        diff, cft, lambda m, b, g: masked_diffusion_loss(m, b, BS, MASK, g), cft_cfg, tmp_path / "cft"
    )
    assert len(res.losses) == 3 and all(torch.isfinite(torch.tensor(res.losses)))
    for tau in (1.0, 0.5):
        a = diffusion_generate(diff, prompts, 16, BS, tau, MASK, EOS)
        b = diffusion_generate_nocache(diff, prompts, 16, BS, tau, MASK, EOS)
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])

    # OPD and GRPO steps through the losses that call model.model / lm_head directly.
    student = add_lora(convert_to_diffusion(load_model(tmp_path / "cft" / "final")[0], BS, MASK), mcfg)
    batch = make_opd_batch(
        student, reloaded, prompts[:3], 2, Sampling(16, BS, EOS, MASK, tau=0.5, rules=OPD_RULES), None
    )
    loss, _ = opd_loss(student, batch, BS, MASK, "reverse")
    loss.backward()
    g = torch.Generator().manual_seed(2)
    ro = sample_diffusion(student, prompts[:2], 16, BS, 0.5, MASK, EOS, temperature=1.0, generator=g)
    loss, _ = grpo_loss(student, rollout_batch(ro, EOS, advantages=torch.tensor([1.0, -1.0])), BS, MASK, 1.0)
    loss.backward()
    grads = [p.grad for n, p in student.named_parameters() if "lora_B" in n]
    assert grads and all(gr is not None for gr in grads) and any(gr.abs().sum() > 0 for gr in grads)
    out = save_model(student, tmp_path / "student")
    assert not any("lora_" in k for k in load_model(out)[0].state_dict())


def test_gpu_and_smoke_profiles_name_a_pretrained_backbone():
    from gr2.config import load_profile

    gpu = load_profile("gpu")
    assert gpu.model.pretrained and all(c.bf16 for c in (gpu.sft, gpu.cft, gpu.opd, gpu.rl, gpu.ar_rl))
    assert gpu.sft.grad_accum > 1
    smoke = load_profile("smollm2")
    assert smoke.model.pretrained.endswith(".gguf") and smoke.model.lora_rank > 0
