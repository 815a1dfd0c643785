"""The one owner of the text format: prompt, trace words, answer JSON, encoding with loss weights, parsing.

Prompt (whitespace-separated closed-vocabulary tokens). Per candidate: its label and evidence buckets; with
item_tokens "candidates" also its semantic ID, with "all" also the history's semantic IDs (oldest -> newest):
    candidates [A] <trans_3> <trec_1> <co_1> <pop_2> <cat_0> <sim_1> <rank_0> [B] ...              (none)
    history <a_3> <b_17> <c_9> <d_0> ... candidates [A] <a_..> <b_..> <c_..> <d_..> <trans_3> ... [B] ...   (all)
A list shorter than N (short_lists "fill", the profiles' default) is filled with <empty> tokens where its absent
candidates would sit: candidates [A] ... [E] ... <empty> <empty> ... (as many as a candidate has, per absent one).
Response = trace then answer (the answer is valid JSON once the tokens are joined by spaces). The trace is the
reasoning teacher's verdict on each candidate, in label order: a score level 0 (weak) .. L-1 (strongest):
    [A] <score_5> [B] <score_0> [C] <score_7> ... [J] <score_2> { "ranking" : [ "C" , "A" , ... ] }
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gr2.sid import sid_token

# --- vocabulary pieces --------------------------------------------------------------------------------------
HISTORY, CANDIDATES = "history", "candidates"
EMPTY = "<empty>"  # fills an absent candidate's tokens when short lists are filled to N (SHORT_LISTS "fill")
# How a list shorter than N is laid out (PromptConfig.short_lists): "as_is" (its candidates, [A] first), "last_first"
# (from its last label down to [A]), "fill" ([A] first, then EMPTY tokens where candidates n..N-1 would sit).
SHORT_LISTS = ("as_is", "last_first", "fill")
JSON_TOKENS = ["{", "}", '"ranking"', ":", "[", "]", ","]
ITEM_TOKENS = ("none", "candidates", "all")  # which semantic IDs a prompt shows (PromptConfig.item_tokens)

# Evidence feature name -> short token stem, matched by keyword in order (the evidence module owns the names).
_ALIAS_RULES = [
    ("trans_rec", "trec"),
    ("trans", "trans"),
    ("cooc", "co"),
    ("co_occ", "co"),
    ("co-occ", "co"),
    ("pop", "pop"),
    ("categ", "cat"),
    ("content", "sim"),
    ("sim", "sim"),
    ("retriev", "rank"),
    ("rank", "rank"),
    ("recen", "rec"),
]


def feature_alias(name: str) -> str:
    """Short, token-safe stem for an evidence feature name (e.g. 'transition_from_last' -> 'trans')."""
    low = name.lower()
    for key, alias in _ALIAS_RULES:
        if key in low:
            return alias
    return re.sub(r"[^a-z0-9]+", "_", low).strip("_") or "f"


def feature_aliases(feature_names: Sequence[str] | None, n_features: int) -> list[str]:
    """Aliases for all features, made unique (duplicate stems get a numeric suffix); f0.. when names are None."""
    if feature_names is None:
        return [f"f{i}" for i in range(n_features)]
    out: list[str] = []
    for name in feature_names:
        a = feature_alias(name)
        base, k = a, 2
        while a in out:
            a, k = f"{base}{k}", k + 1
        out.append(a)
    return out


def bucket_token(alias: str, bucket: int) -> str:
    return f"<{alias}_{int(bucket)}>"


def score_token(level: int) -> str:
    """A candidate's score level in the trace: <score_0> (weak) .. <score_{L-1}> (strongest evidence)."""
    return f"<score_{int(level)}>"


def render_trace(score_levels: Sequence[int]) -> str:
    """The trace: every candidate's label followed by its score level, in label order ([A] first).

    Why this trace: scoring a candidate only needs that candidate's own evidence (a local computation), and the
    answer then orders explicit score tokens. Without the trace the answer's first token has to score and
    compare all N candidates at once (docs/RESULTS.md, 'What the trace buys')."""
    return " ".join(f"{label_token(i)} {score_token(level)}" for i, level in enumerate(score_levels))


_TRACE_ENTRY = re.compile(r"\[([A-Z])\]\s*<score_(\d+)>")


def response_trace(text: str) -> str | None:
    """The text a response writes before its answer object ("{"), stripped; None when there is none."""
    return text[: max(text.find("{"), 0)].strip() or None


def parse_trace(trace: str | None, n_candidates: int) -> list[int] | None:
    """Each candidate's score level, in label order, from a trace as `render_trace` writes it; None unless each of
    the N candidates has exactly one level and nothing else is there (what the report reads back from a model's
    trace, to see whether its answer follows it)."""
    if not trace:
        return None
    entries = _TRACE_ENTRY.findall(trace)
    if len(entries) != n_candidates or _TRACE_ENTRY.sub("", trace).strip():
        return None
    levels = {ord(label) - ord("A"): int(level) for label, level in entries}
    if sorted(levels) != list(range(n_candidates)):
        return None
    return [levels[i] for i in range(n_candidates)]


def label_token(i: int) -> str:
    """Candidate label as cited in the prompt and trace: [A], [B], ..."""
    return f"[{chr(ord('A') + i)}]"


def answer_label_token(i: int) -> str:
    """Candidate label inside the JSON answer: "A" (a JSON string)."""
    return f'"{chr(ord("A") + i)}"'


def format_vocabulary(
    feature_names: Sequence[str] | None, n_features: int, n_buckets: int, max_labels: int, score_levels: int
) -> list[str]:
    """Every non-SID, non-special token the format can emit, in a stable order (the tokenizer's vocabulary)."""
    aliases = feature_aliases(feature_names, n_features)
    toks = [HISTORY, CANDIDATES, *JSON_TOKENS]
    toks += [label_token(i) for i in range(max_labels)] + [answer_label_token(i) for i in range(max_labels)]
    toks += [bucket_token(a, b) for a in aliases for b in range(n_buckets)]
    toks += [score_token(level) for level in range(score_levels)]
    toks.append(EMPTY)
    return list(dict.fromkeys(toks))  # de-duplicate, keep order


# --- rendering ----------------------------------------------------------------------------------------------
def _sid_text(codes: Sequence[int]) -> str:
    return " ".join(sid_token(level, c) for level, c in enumerate(codes))


def render_prompt(
    history_sids: Sequence[Sequence[int]],
    candidate_sids: Sequence[Sequence[int]],
    evidence_buckets: np.ndarray | Sequence[Sequence[int]],
    feature_names: Sequence[str] | None = None,
    item_tokens: str = "all",
    *,
    short_lists: str = "as_is",
    n_full: int = 0,
) -> str:
    """Prompt text: per candidate its label and evidence buckets; `item_tokens` says which semantic IDs are
    shown too ("none", "candidates": each candidate's, "all": also the history's, oldest -> newest).
    `short_lists` (SHORT_LISTS) lays out a list shorter than `n_full` (N) so that candidate k sits as far from the
    prompt's end, and from its trace entry, as in a list of N ("fill") or at every length ("last_first")."""
    if item_tokens not in ITEM_TOKENS:
        raise ValueError(f"item_tokens must be one of {ITEM_TOKENS}, got {item_tokens!r}")
    if short_lists not in SHORT_LISTS:
        raise ValueError(f"short_lists must be one of {SHORT_LISTS}, got {short_lists!r}")
    if short_lists == "fill" and n_full < 1:
        raise ValueError(f"short_lists 'fill' needs the full list's length n_full, got {n_full}")
    n = len(candidate_sids)
    buckets = np.asarray(evidence_buckets, dtype=np.int64).reshape(n, -1)
    aliases = feature_aliases(feature_names, buckets.shape[1])
    parts = [HISTORY, *(_sid_text(s) for s in history_sids)] if item_tokens == "all" else []
    parts.append(CANDIDATES)
    for i in range(n - 1, -1, -1) if short_lists == "last_first" else range(n):
        sid = candidate_sids[i]
        ev = " ".join(bucket_token(a, b) for a, b in zip(aliases, buckets[i], strict=True))
        item = f" {_sid_text(sid)}" if item_tokens != "none" else ""
        parts.append(f"{label_token(i)}{item} {ev}".rstrip())
    if short_lists == "fill" and n_full > n:  # as many EMPTY as a candidate has tokens, for each absent one
        parts += [" ".join([EMPTY] * len(parts[-1].split()))] * (n_full - n)
    return " ".join(parts)


def encode_prompt(
    tokenizer: Any,
    history_sids: Sequence[Sequence[int]],
    candidate_sids: Sequence[Sequence[int]],
    evidence_buckets: np.ndarray | Sequence[Sequence[int]],
    feature_names: Sequence[str] | None = None,
    item_tokens: str = "all",
    *,
    short_lists: str = "as_is",
    n_full: int = 0,
) -> list[int]:
    """<bos> + the prompt's token ids: the one tokenisation of a prompt, for training and serving alike.
    Raises if any token falls outside the vocabulary: a silent <unk> would train or serve garbage."""
    text = render_prompt(
        history_sids,
        candidate_sids,
        evidence_buckets,
        feature_names,
        item_tokens,
        short_lists=short_lists,
        n_full=n_full,
    )
    return [tokenizer.bos_token_id, *_encode(tokenizer, text)]


ANSWER_HEAD = '{ "ranking" : ['  # the answer's tokens before its first label; labels then sit one token apart


def render_answer(ranking_labels: Sequence[int | str]) -> str:
    """The JSON answer as space-separated tokens; json.loads accepts it as is."""
    labels = [answer_label_token(r) if isinstance(r, int | np.integer) else f'"{r}"' for r in ranking_labels]
    return f"{ANSWER_HEAD} " + " , ".join(labels) + " ] }"


def answer_layout(tokenizer: Any) -> tuple[list[int], int, list[int]]:
    """The answer's fixed tokens as `encode_example` encodes them: (head, the tokens before the first label; the
    separator between two labels; tail, the tokens after the last label, eos last). Raises unless labels sit one
    token apart, the shape the decoders' rules assume (gr2/rules.py)."""
    ids = _encode(tokenizer, render_answer([0, 1]))
    a, b = tokenizer.convert_tokens_to_ids([answer_label_token(0), answer_label_token(1)])
    if ids.count(a) != 1 or ids.count(b) != 1 or ids.index(b) != ids.index(a) + 2:
        raise ValueError(f"the answer's labels are not one token apart in this tokenizer: {ids}")
    i = ids.index(a)
    return ids[:i], ids[i + 1], [*ids[i + 3 :], tokenizer.eos_token_id]


def render_response(trace: str | None, ranking_labels: Sequence[int | str]) -> str:
    """Trace (if any) then the answer. ranking_labels: candidate indices (0 = A) or label letters, best first."""
    answer = render_answer(ranking_labels)
    return f"{trace.strip()} {answer}" if trace else answer


def encode_example(
    tokenizer: Any,
    history_sids: Sequence[Sequence[int]],
    candidate_sids: Sequence[Sequence[int]],
    evidence_buckets: np.ndarray | Sequence[Sequence[int]],
    ranking: Sequence[int],
    trace: str | None = None,
    feature_names: Sequence[str] | None = None,
    *,
    answer_weight: float = 1.0,
    trace_weight: float = 0.5,
    item_tokens: str = "all",
    short_lists: str = "as_is",
    n_full: int = 0,
) -> tuple[list[int], list[int], list[float]]:
    """(prompt_ids, response_ids, response_weights): `encode_prompt`; trace + answer + <eos>.

    Answer tokens (and <eos>) weigh answer_weight, trace tokens trace_weight (GR2: lambda_r < lambda_o).
    Raises if any token falls outside the vocabulary: a silent <unk> would train on garbage.
    """
    p_ids = encode_prompt(
        tokenizer,
        history_sids,
        candidate_sids,
        evidence_buckets,
        feature_names,
        item_tokens,
        short_lists=short_lists,
        n_full=n_full,
    )
    t_ids = _encode(tokenizer, trace) if trace else []
    a_ids = [*_encode(tokenizer, render_answer(ranking)), tokenizer.eos_token_id]
    weights = [trace_weight] * len(t_ids) + [answer_weight] * len(a_ids)
    return p_ids, t_ids + a_ids, weights


def _encode(tokenizer: Any, text: str) -> list[int]:
    # Our word-level vocabulary: a dict lookup per word, the same ids (tests/gr2/test_prompt.py). The serving
    # thread encodes every request, and the tokenizer's call cost 0.1 ms a prompt.
    vocab = _word_vocab(tokenizer)
    if vocab is not None:
        unk = tokenizer.unk_token_id  # (a property: read once, not per word)
        ids = [vocab.get(w, unk) for w in text.split()]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.unk_token_id in ids:
        bad = [w for w in text.split() if tokenizer.convert_tokens_to_ids(w) == tokenizer.unk_token_id]
        raise ValueError(f"tokens outside the vocabulary: {sorted(set(bad))[:10]}")
    return ids


_WORD_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _word_vocab(tokenizer: Any) -> dict[str, int] | None:
    """The word -> id map when `tokenizer` only splits on whitespace and looks words up (gr2/tokenizer.py's
    WordLevel vocabulary: no normalizer, no special tokens added), else None (e.g. a pretrained backbone's BPE)."""
    if tokenizer not in _WORD_VOCABS:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        spec = json.loads(backend.to_str()) if backend is not None else {}
        plain = (
            spec.get("model", {}).get("type") == "WordLevel"
            and spec.get("pre_tokenizer") == {"type": "WhitespaceSplit"}
            and spec.get("normalizer") is None
        )
        _WORD_VOCABS[tokenizer] = dict(spec["model"]["vocab"]) if plain else None
    return _WORD_VOCABS[tokenizer]


# --- parsing ------------------------------------------------------------------------------------------------
MISSING_ANSWER = "missing answer"
UNPARSEABLE = "unparseable JSON"
WRONG_LENGTH = "wrong length"
OUT_OF_SET = "out-of-set label"
DUPLICATE = "duplicate label"
OMITTED = "omitted label"


class ParseResult(NamedTuple):
    ranking: list[int] | None  # candidate indices, best first; None when invalid
    reason: str | None  # one of the constants above when invalid
    detail: str | None = None  # e.g. which label was duplicated


def parse_response(
    response: str | Sequence[int], n_candidates: int = 10, tokenizer: Any = None
) -> ParseResult:
    """Parse a generated response (text, or token ids with `tokenizer`) into a ranking, or say precisely why not.

    Checks, in order: an answer object exists ('{'), it is JSON with a "ranking" list, its length is not above
    N, every label is one of the N candidates, no label repeats, none is missing.
    """
    if isinstance(response, str):
        text = response
    elif tokenizer is None:
        raise ValueError("parse_response needs the tokenizer to decode token ids")
    else:
        text = tokenizer.decode(list(response), skip_special_tokens=True)
    start = text.find("{")
    if start < 0:
        return ParseResult(None, MISSING_ANSWER, "no '{' in the response")
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as e:
        return ParseResult(None, UNPARSEABLE, str(e))
    if not isinstance(obj, dict) or "ranking" not in obj:
        return ParseResult(None, MISSING_ANSWER, 'no "ranking" key in the answer object')
    labels = obj["ranking"]
    if not isinstance(labels, list):
        return ParseResult(None, UNPARSEABLE, '"ranking" is not a list')
    if len(labels) > n_candidates:
        return ParseResult(None, WRONG_LENGTH, f"{len(labels)} labels for {n_candidates} candidates")
    idx: list[int] = []
    for lab in labels:
        if not (isinstance(lab, str) and len(lab) == 1 and 0 <= ord(lab) - ord("A") < n_candidates):
            return ParseResult(None, OUT_OF_SET, repr(lab))
        idx.append(ord(lab) - ord("A"))
    seen: set[int] = set()
    for i in idx:
        if i in seen:
            return ParseResult(None, DUPLICATE, chr(ord("A") + i))
        seen.add(i)
    if len(idx) < n_candidates:
        missing = [chr(ord("A") + i) for i in range(n_candidates) if i not in seen]
        return ParseResult(None, OMITTED, ",".join(missing))
    return ParseResult(idx, None)
