"""A real Hugging Face tokenizer over the closed vocabulary (WordLevel model, whitespace-split pre-tokenizer).

Vocabulary: special tokens, SID code tokens per level (<a_k> <b_k> <c_k> <d_k>), candidate labels ([A] in the
prompt and trace, "A" in the JSON answer), evidence bucket tokens per feature, the trace's score levels and
JSON punctuation (all listed by gr2.prompt.format_vocabulary). Saved/loaded with save_pretrained/from_pretrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gr2.config import PromptConfig
from gr2.prompt import format_vocabulary
from gr2.sid import SemanticIds, sid_token

PAD, BOS, EOS, MASK, UNK = "<pad>", "<bos>", "<eos>", "<mask>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK, UNK]  # ids 0..4, in this order


def build_vocab(
    codebook_sizes: Sequence[int],
    feature_names: Sequence[str] | None,
    n_features: int | None = None,
    n_buckets: int = PromptConfig.n_buckets,
    max_labels: int = PromptConfig.max_labels,
    score_levels: int = PromptConfig.score_levels,
) -> list[str]:
    """Ordered vocabulary: specials, SID tokens level by level, then the format's tokens."""
    n_features = len(feature_names) if feature_names is not None else (n_features or 0)
    sid = [sid_token(level, c) for level, k in enumerate(codebook_sizes) for c in range(k)]
    fmt = format_vocabulary(feature_names, n_features, n_buckets, max_labels, score_levels)
    return list(dict.fromkeys([*SPECIAL_TOKENS, *sid, *fmt]))


def build_tokenizer(
    codebook_sizes: Sequence[int],
    feature_names: Sequence[str] | None,
    n_features: int | None = None,
    cfg: PromptConfig = PromptConfig(),
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Wrap a `tokenizers` WordLevel model as PreTrainedTokenizerFast (with pad/bos/eos/mask/unk set)."""
    vocab = build_vocab(
        codebook_sizes, feature_names, n_features, cfg.n_buckets, cfg.max_labels, cfg.score_levels
    )
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # '<a_12>' and '"ranking"' stay whole
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    return fast


def tokenizer_for(
    sids: SemanticIds, feature_names: Sequence[str] | None, cfg: PromptConfig = PromptConfig()
) -> PreTrainedTokenizerFast:
    """The tokenizer for the prompts of `cfg`: semantic-ID tokens only when the prompt shows items
    (cfg.item_tokens != "none"; unused output classes would only cost softmax work), and the evidence features."""
    sizes = sids.codebook_sizes if cfg.item_tokens != "none" else ()
    return build_tokenizer(sizes, feature_names, cfg=cfg)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(path))
