"""The backbone (a tiny `transformers` Llama, or a pretrained causal LM) and the one attention mask used by every
block-diffusion path.

AR and block-diffusion models are the same `LlamaForCausalLM`: conversion copies the weights unchanged and only
records `gr2_block_size` and `mask_token_id` in the config (docs/PAPER.md, Conversion). What changes is the attention mask that
training and decoding pass in (`block_causal_mask`) and the AR token shift (the token at position i is read off
the logits at position i-1), which keeps the AR next-token head meaning the same thing after conversion.

Layout convention (everywhere in gr2): prompts are LEFT-padded to a common width P, so every response starts at
column P; responses are right-padded. `pad_lens[b]` = number of left-pad columns of row b. Position ids are
`column - pad_lens[b]`, so a row's real tokens get the same positions with or without padding.

The attention implementation is pinned to "sdpa": it honours a 4D boolean mask; "eager" does not
(docs/DEPENDENCIES.md).

Pretrained backbones (`load_pretrained`, ModelConfig.pretrained): any transformers causal LM whose decoder is
`model.model` with head `model.lm_head` (Llama, Qwen2, SmolLM, ...). The project's tokenizer is a closed
WordLevel vocabulary (gr2/tokenizer.py: SID codes, labels, evidence buckets, JSON punctuation), so the backbone
takes that vocabulary: its embedding and head matrices are replaced by ones with a row per project token,
each row initialised to the mean of the pretrained rows of the pieces the backbone's own tokenizer cuts that
token's text into ("{" -> the row of "{", "<score_3>" -> mean of "<", "score", "_", "3", ">"); the special
tokens take the backbone's bos / eos rows, the rest (mask, pad, unknown pieces) the mean row. The transformer
layers keep their pretrained weights. Everything downstream (conversion, decoders, OPD, RL, serving) sees an
ordinary model over the project's token ids. `add_lora` puts LoRA adapters (peft) on the projections and
keeps the embeddings trainable (they are new); `save_model` folds the adapters back, so bundles are plain.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from gr2.config import ModelConfig

ATTN_IMPLEMENTATION = "sdpa"
META_FILE = "gr2_model.json"  # our config next to HF's config.json


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    bos_id: int | None = None,
    mask_id: int | None = None,
    seed: int | None = None,
) -> LlamaForCausalLM:
    """A freshly initialised Llama sized by `cfg`, with sdpa attention pinned.

    `mask_id` may be given already (the tokenizer adds [MASK] before SFT so the AR and diffusion vocabularies are
    the same); the model only becomes a block-diffusion model through `convert_to_diffusion`.
    """
    if seed is not None:
        torch.manual_seed(seed)
    n_kv = cfg.n_kv_head or cfg.n_head
    hf = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=cfg.max_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
    )
    hf.mask_token_id = mask_id
    hf.gr2_block_size = 0  # 0 = autoregressive (causal); >0 = block diffusion with this block size
    hf.gr2_model = dataclasses.asdict(cfg)
    model = LlamaForCausalLM._from_config(hf, attn_implementation=ATTN_IMPLEMENTATION)
    model.eval()
    return model


def model_config(model: torch.nn.Module) -> PretrainedConfig:
    """The model's Hugging Face config. Every gr2 model is a transformers causal LM; `nn.Module` types an
    attribute it does not declare as `Tensor | Module`, so this names the type the code relies on."""
    return cast(PretrainedConfig, model.config)


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The backbone's decoder `model.model` and its LM head `model.lm_head` (every backbone has both: module
    docstring), for the losses that run the two apart."""
    return model.get_submodule("model"), model.get_submodule("lm_head")


def _source(pretrained: str) -> tuple[str, dict[str, Any]]:
    """(from_pretrained path or hub id, extra kwargs): a .gguf file loads through transformers' GGUF reader."""
    p = Path(pretrained).expanduser()
    if p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.exists():
        return str(p), {}
    return pretrained, {"local_files_only": True}  # a hub id: the local cache only, never a download


def _piece_rows(src_tok: Any, token: str) -> list[int]:
    if src_tok is None:
        return []
    special = {"<bos>": src_tok.bos_token_id, "<eos>": src_tok.eos_token_id}
    if token in special:
        return [special[token]] if special[token] is not None else []
    if token in ("<pad>", "<mask>", "<unk>"):
        return []
    return [i for i in src_tok(token, add_special_tokens=False)["input_ids"] if i is not None]


def _embedding_weights(model: PreTrainedModel) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """The (input embedding, output head) weight matrices; the same parameter when they are tied."""
    head = model.get_output_embeddings()
    return model.get_input_embeddings().get_parameter("weight"), head.get_parameter("weight")


def transfer_vocabulary(model: PreTrainedModel, src_tok: Any, tokenizer: Any) -> None:
    """Give `model` the project vocabulary: one embedding (and head) row per project token, the mean of the
    pretrained rows of its pieces under `src_tok` (module docstring). `src_tok` None: every row the mean row."""
    w_in, w_out = _embedding_weights(model)
    old_in = w_in.detach().clone()
    old_out = None if w_out is w_in else w_out.detach().clone()  # tied: one matrix
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    model.resize_token_embeddings(len(tokenizer))
    for new, old in zip(_embedding_weights(model), (old_in, old_out), strict=True):
        if old is None:
            continue
        rows = [_piece_rows(src_tok, t) for t in vocab]
        with torch.no_grad():
            new.copy_(torch.stack([old[r].mean(0) if r else old.mean(0) for r in rows]))
    model.config.vocab_size = len(tokenizer)


def load_pretrained(cfg: ModelConfig, tokenizer: Any) -> PreTrainedModel:
    """The SFT starting point from `cfg.pretrained` (a folder, a .gguf file, or a cached hub id), with the
    project vocabulary (`transfer_vocabulary`), its special ids, sdpa attention and fp32 weights."""
    from transformers import AutoTokenizer

    src, kw = _source(cfg.pretrained)
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION, **kw
    )
    if "gguf_file" in kw:  # GGUF tensors are de-quantized to fp32 on load: from here on a plain model, and
        # save_pretrained refuses one that still carries the GGUF quantizer
        setattr(model, "hf_quantizer", None)  # noqa: B010 (nn.Module.__setattr__ is typed for tensors only)
        model.config.__dict__.pop("quantization_config", None)
    try:
        src_tok = AutoTokenizer.from_pretrained(src, **kw)
    except (OSError, ValueError, KeyError):  # weights without a tokenizer: every row starts at the mean row
        src_tok = None
    transfer_vocabulary(model, src_tok, tokenizer)
    c = model.config
    c.pad_token_id, c.eos_token_id, c.bos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
    )
    c.mask_token_id = tokenizer.mask_token_id
    c.gr2_block_size = 0
    c.gr2_model = dataclasses.asdict(cfg)
    if (
        getattr(model, "generation_config", None) is not None
    ):  # keep save_pretrained's consistency check quiet
        g = model.generation_config
        g.pad_token_id, g.eos_token_id, g.bos_token_id = c.pad_token_id, c.eos_token_id, c.bos_token_id
    model.eval()
    return model


def build_backbone(cfg: ModelConfig, tokenizer: Any, seed: int | None = None) -> PreTrainedModel:
    """What SFT starts from: `cfg.pretrained` if set, else a fresh Llama sized by `cfg`; LoRA if cfg.lora_rank."""
    if seed is not None:
        torch.manual_seed(seed)
    if cfg.pretrained:
        model = load_pretrained(cfg, tokenizer)
    else:
        t = tokenizer
        model = build_model(
            cfg, len(t), t.pad_token_id, t.eos_token_id, t.bos_token_id, t.mask_token_id, seed
        )
    return add_lora(model, cfg)


def add_lora(model: PreTrainedModel, cfg: ModelConfig) -> PreTrainedModel:
    """LoRA adapters (peft) on cfg.lora_targets, injected in place so the model keeps its class, `model.model`,
    `lm_head` and config (what the losses and decoders use). Trainable: the adapters and the embeddings / head
    (the project vocabulary is new to the backbone). No-op when cfg.lora_rank is 0."""
    if cfg.lora_rank <= 0:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets))
    inject_adapter_in_model(lora, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.get_input_embeddings().weight.requires_grad_(True)
    model.get_output_embeddings().weight.requires_grad_(True)
    return model


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every LoRA adapter into its base layer and put the base layer back (in place); no-op without LoRA."""
    if not any("lora_" in name for name, _ in model.named_parameters()):
        return model
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def n_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def convert_to_diffusion(model: PreTrainedModel, block_size: int, mask_id: int) -> PreTrainedModel:
    """AR -> block diffusion (docs/PAPER.md, Conversion): an exact copy of every tensor; only the config changes.

    Block-causal attention and the token shift are applied by the callers (losses, decoder), driven by
    `config.gr2_block_size`; no weights are added, so the naive converted model is the AR model.
    """
    if not 0 <= mask_id < model.config.vocab_size:
        raise ValueError(
            f"mask_id {mask_id} outside the vocabulary ({model.config.vocab_size}); add it first"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out = copy.deepcopy(model)
    out.config.gr2_block_size = int(block_size)
    out.config.mask_token_id = int(mask_id)
    return out


def save_model(model: PreTrainedModel, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """`save_pretrained` (safetensors) plus `gr2_model.json` (our ModelConfig, block size, special ids).

    LoRA adapters are merged into the weights first (in place: call it when training is done), so a saved model
    is always a plain one that `load_model` and serving read without peft."""
    merge_lora(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    c = model.config
    meta = {
        "model": getattr(c, "gr2_model", None),
        "block_size": int(getattr(c, "gr2_block_size", 0) or 0),
        "vocab_size": c.vocab_size,
        "pad_id": c.pad_token_id,
        "eos_id": c.eos_token_id,
        "bos_id": c.bos_token_id,
        "mask_id": getattr(c, "mask_token_id", None),
        "attn_implementation": ATTN_IMPLEMENTATION,
        **(extra or {}),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Load a model saved by `save_model`; returns (model in eval mode, our meta dict)."""
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(  # a Llama, or the class of a pretrained backbone
        path, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
    )
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    model.to(device).eval()
    return model, meta


def _block_end(pos: torch.Tensor, start: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map a position to the last position of its attention group (prompt token: itself; response: its block).

    Query q may attend key k iff _block_end(k) <= _block_end(q): causal in the prompt, bidirectional inside
    a response block, causal across blocks; the prompt never sees the response.
    """
    rel = pos - start
    in_resp = rel >= 0
    end = start + torch.div(rel, block_size, rounding_mode="floor") * block_size + (block_size - 1)
    return torch.where(in_resp, end, pos)


def attention_rows(
    prompt_len: int | torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: int,
    block_size: int,
    pad_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `q_pos` (1D, columns of the full sequence) of `block_causal_mask`, keys 0..kv_len-1.

    The decoder uses this to build the mask of a step that feeds only the new tokens (KV cache holds the rest):
    it is literally a slice of the training mask, so cached decoding and training cannot disagree.
    """
    device = q_pos.device
    start = torch.as_tensor(prompt_len, device=device).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    q = q_pos.reshape(1, -1, 1)
    k = torch.arange(kv_len, device=device).reshape(1, 1, -1)
    allowed = _block_end(k, start, block_size) <= _block_end(q, start, block_size)  # [B|1, Q, K]
    if pad_lens is not None:
        allowed = allowed & (k >= pad_lens.to(device).reshape(-1, 1, 1))
    # A pad query would have no key left (sdpa then returns NaN, and NaN * 0 attention still poisons
    # matmuls); let every query see itself. Pad keys stay invisible to every real query.
    allowed = allowed | (k == q)
    if pad_lens is not None and allowed.shape[0] == 1:
        allowed = allowed.expand(pad_lens.shape[0], -1, -1)
    return allowed.unsqueeze(1)  # [B, 1, Q, K]


def block_causal_mask(
    prompt_len: int | torch.Tensor,
    total_len: int,
    block_size: int,
    pad_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask [B, 1, T, T] (True = may attend) for prompt + block-diffusion response.

    `prompt_len`: column where the response starts (an int, or a [B] tensor for per-row starts); with the
    left-padded layout it is the padded prompt width P, the same for every row. `pad_lens` [B]: left-pad
    columns per row (their keys are hidden; each pad query sees only itself). Blocks of `block_size` are
    aligned at the response start; the last one may be short. Example: P = 3, block_size = 2, T = 7
    (p = prompt, a/b/c = response blocks), row = query, column = key:

              p p p a a b b
          p   1 . . . . . .
          p   1 1 . . . . .
          p   1 1 1 . . . .
          a   1 1 1 1 1 . .      <- bidirectional inside block a
          a   1 1 1 1 1 . .
          b   1 1 1 1 1 1 1      <- block b sees the prompt and all of block a
          b   1 1 1 1 1 1 1

    With block_size = 1 this is exactly the ordinary causal mask. The logits of the token at column i are
    read from column i-1 (AR token shift), so a block's first token is predicted by the last clean token
    before it, and its other tokens by the (partly masked) block itself.
    """
    B = 1 if pad_lens is None else pad_lens.shape[0]
    if isinstance(prompt_len, torch.Tensor) and prompt_len.numel() > 1:
        B = prompt_len.shape[0]
    device = pad_lens.device if pad_lens is not None else torch.device("cpu")
    m = attention_rows(prompt_len, torch.arange(total_len, device=device), total_len, block_size, pad_lens)
    return m.expand(B, -1, -1, -1) if m.shape[0] != B else m


def position_ids_for(pad_lens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Position ids [B, len(columns)] for the left-padded layout (pad columns clamp to 0)."""
    return (columns.reshape(1, -1) - pad_lens.reshape(-1, 1)).clamp(min=0)
