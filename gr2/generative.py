"""The generative re-ranker as a servable model: a bundle directory and the `Reranker` that decodes with it.

One code path turns (history, candidates) into a ranking for evaluation and for serving alike:

    evidence features (served item tables) -> buckets -> prompt tokens -> AR or block-diffusion decoding
    -> parse the JSON answer -> ranking, or the upstream order when the output is invalid (counted).

Bundle layout (written by `save_bundle`, read by `load_bundle`, and by `load_reranker` through the "generative"
kind; in memory a `Bundle`):

    reranker.json     a `BundleConfig`: kind, name, n_candidates, block_size (0 = AR), tau and spec_tau
                      (diffusion), max_new_tokens, prompt, cold_start, lineage, verifier
    model/            save_pretrained (safetensors) + gr2_model.json
    verifier/         (diffusion students from OPD on) the AR teacher, as model/: the "spec" decoder's verifier
    tokenizer/        the closed-vocabulary HF tokenizer
    sids.json         semantic IDs (item -> 4 codes)
    evidence/         per-item evidence tables + bucket edges (what the feature store serves)
    items.txt         the catalogue `known_item` answers from
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from gr2.config import DiffusionConfig
from gr2.continuous import STREAM_DECODERS, Stream, StreamConfig
from gr2.decode import ar_generate, diffusion_generate, spec_generate
from gr2.evidence import Evidence
from gr2.inference import (
    CONFIG_FILE,
    DECODERS,
    DTYPES,
    ITEMS_FILE,
    VERIFIER_DIR,
    RankRequest,
    RankResult,
    register_reranker,
)
from gr2.model import load_model, save_model
from gr2.prompt import (
    ANSWER_HEAD,
    answer_label_token,
    answer_layout,
    encode_prompt,
    label_token,
    parse_response,
    response_trace,
    score_token,
)
from gr2.rules import DecodeRules, Layout, TraceRule
from gr2.sid import SemanticIds
from gr2.teacher import Teacher
from gr2.tokenizer import load_tokenizer

KIND = "generative"
COLD_START = "cold_start"  # RankResult.ranker of a ranking the cold-start ranker made


@dataclass(frozen=True)
class BundlePrompt:
    """reranker.json's "prompt": how the bundle renders prompts and which rules its decoders apply (the profile's
    PromptConfig it was trained with). The defaults are what a bundle written before a key existed meant."""

    n_buckets: int = 4
    max_labels: int = 26
    score_levels: int = 8
    item_tokens: str = "all"
    # bundles before short lists were laid out as long ones (gr2/prompt.py SHORT_LISTS)
    short_lists: str = "as_is"
    unique_labels: bool = False  # bundles before the permutation rule: no rule
    follow_trace: bool = False  # bundles before the trace rule: no rule
    fixed_layout: bool = False  # bundles before the layout rule: no rule

    @classmethod
    def from_dict(cls, d: dict) -> BundlePrompt:
        """An unknown key is an error: a prompt option this code does not know is one it cannot render."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{CONFIG_FILE}: unknown prompt keys {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class BundleConfig:
    """reranker.json of a generative bundle. Each default is written once, here: it is what a bundle written
    before its key existed meant, so every bundle on disk loads (`from_dict`).

    Keys this class does not name (lineage of an older or newer writer) are kept in `extra` and written back as
    read: nothing decodes from them, so they never stop a bundle from loading. An unknown "prompt" key does
    (`BundlePrompt.from_dict`), and so does a missing max_new_tokens (no default could be right)."""

    max_new_tokens: int
    kind: str = KIND
    name: str = KIND
    n_candidates: int = 10
    block_size: int = 0  # 0: AR (`save_bundle` writes the model's)
    # The operating commit threshold (gr2/stages/train_stages.py convert: the profile's diffusion.eval_tau) and
    # spec's draft threshold (diffusion.spec_tau): serving's default taus. None: not recorded (`operating_tau`).
    tau: float | None = None
    spec_tau: float | None = None
    # What serving decodes in where bf16 pays (serving --dtype auto): "bfloat16" when the student in bf16 held the
    # operating tau's rule on validation (gr2/stages/opd_rl.py `operating_tau`), "float32" when it did not.
    # None: not judged (float32).
    serve_dtype: str | None = None
    batch_size: int = 32  # `GenerativeReranker.decode`'s batch
    prompt: BundlePrompt = BundlePrompt()
    cold_start: dict | None = (
        None  # the cold-start ranker (Teacher.to_dict); None: the model decodes everyone
    )
    verifier: str | None = None  # the folder of spec's verifier (VERIFIER_DIR), None without one
    # Lineage: how the bundle was made (model cards and stage summaries read it; no decoder does)
    stage: str | None = None
    variant: str | None = None
    profile: str | None = None
    parent: str | None = None
    teacher: str | None = None
    direction: str | None = None
    train: dict | None = None
    cft_targets: dict | None = None
    rl_config: dict | None = None
    validation: dict | None = None
    extra: dict = field(default_factory=dict)  # keys this class does not name (docstring)

    @classmethod
    def from_dict(cls, d: dict) -> BundleConfig:
        if "max_new_tokens" not in d:
            raise ValueError(f"{CONFIG_FILE}: no max_new_tokens")
        named = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in named and k != "prompt"}
        extra = {k: v for k, v in d.items() if k not in named}
        return cls(**kw, prompt=BundlePrompt.from_dict(d.get("prompt") or {}), extra=extra)

    def to_dict(self) -> dict:
        """The JSON object: every field that is set (None ones left out), `extra` back at the top level."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["prompt"] = asdict(self.prompt)
        return {k: v for k, v in out.items() if v is not None} | self.extra

    def operating_tau(self) -> float | None:
        """The tau a diffusion request without one decodes at: the recorded one, else (bundles before it was
        recorded) the profile default diffusion.eval_tau. None for AR models."""
        if self.block_size < 1:
            return None
        return DiffusionConfig.eval_tau if self.tau is None else self.tau

    def draft_tau(self) -> float | None:
        """spec's draft tau when a request names none: the recorded one, else diffusion.spec_tau's default."""
        if self.block_size < 1:
            return None
        return DiffusionConfig.spec_tau if self.spec_tau is None else self.spec_tau


@dataclass(frozen=True)
class Bundle:
    """A generative bundle in memory: what `load_bundle` reads and `save_bundle` writes (module docstring)."""

    model: PreTrainedModel
    tokenizer: Any
    sids: SemanticIds
    evidence: Evidence
    config: BundleConfig
    verifier: PreTrainedModel | None = None  # the AR model spec's draft is checked by (verifier/)


class Answer(NamedTuple):
    """One decoded response, read: the ranking (candidate indices, best first), whether it was a valid
    permutation, why not, and the trace before the answer (None without one)."""

    ranking: list[int]  # invalid output falls back to the upstream order
    valid: bool
    reason: str | None
    trace: str | None


@dataclass
class Decoded:
    """Raw decoding output for a list of prompts (one entry per prompt)."""

    responses: list[list[int]]  # generated ids up to and including the first eos
    nfe: int  # forward passes summed over batches (spec: draft and verifier forwards)
    seconds: float  # wall time of the decoding calls
    verifier_nfe: int = 0  # spec: the verifier's forwards among nfe


class GenerativeReranker:
    """GR2 (block_size 0: AR) or Diffusion-GR2 (block_size > 0) loaded from a bundle.

    Decoders: "ar", "diffusion" (block_size > 0) and "spec" (block_size > 0 and a `verifier`: the AR model whose
    greedy output speculative decoding reproduces, the model drafting)."""

    kind = KIND

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.model, self.tokenizer, self.sids, self.evidence = (
            bundle.model,
            bundle.tokenizer,
            bundle.sids,
            bundle.evidence,
        )
        self.verifier = bundle.verifier
        config = self.config = bundle.config
        self.name, self.n_candidates, self.block_size = config.name, config.n_candidates, config.block_size
        self.tau = config.operating_tau()  # serving's default tau for this model (None: AR)
        self.spec_tau = config.draft_tau()  # and for its spec requests
        self.serve_dtype = config.serve_dtype  # what serving --dtype auto may decode it in
        self.max_new_tokens, self.batch_size = config.max_new_tokens, config.batch_size
        # The ranker of users without usable history (gr2/stages/prepare.py fit_cold_start)
        self.cold_start = Teacher.from_dict(config.cold_start) if config.cold_start else None
        self.item_tokens, self.short_lists = config.prompt.item_tokens, config.prompt.short_lists
        # what every decoder of this model applies
        self.rules = decode_rules(self.tokenizer, config.prompt, trace=config.variant != "ar_no_trace")
        k = range(config.prompt.max_labels)
        self.label_ids = frozenset(self.tokenizer.convert_tokens_to_ids([label_token(i) for i in k]))

    @property
    def decoders(self) -> tuple[str, ...]:
        """The decoders this model can run (serving rejects the others per request)."""
        if self.block_size < 1:
            return ("ar",)
        return DECODERS if self.verifier is not None else ("diffusion", "ar")

    def cast(self, dtype: str) -> None:
        """Decode in `dtype` ("float32" or "bfloat16", `DTYPES`): the model's weights, and so its activations and KV
        cache. spec's verifier keeps its own, so spec stays token for token equal to the verifier's greedy output.
        Why bfloat16: on a CPU with bf16 matrix units it speeds up the few wide forwards of a diffusion decode
        under load, not AR's many one-token forwards, and the student's validation R@1 held (docs/SERVING.md)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self.model.to(getattr(torch, dtype))

    def with_verifier(self, verifier: PreTrainedModel, name: str) -> GenerativeReranker:
        """The same model (shared, not copied) with another verifier and name."""
        return GenerativeReranker(
            replace(self.bundle, config=replace(self.config, name=name), verifier=verifier)
        )

    # ------------------------------------------------------------------ the Reranker protocol
    def known_item(self, item_id: str) -> bool:
        return item_id in self.sids.codes

    def rank(
        self, requests: list[RankRequest], decoder: str = "diffusion", tau: float | None = None
    ) -> list[RankResult]:
        """Rankings of lists of any lengths 2..N in one call (the decoder pads prompts; evidence pads lists). A
        request without one known history id goes to the cold-start ranker when the bundle has one. tau: as
        `decode`'s."""
        cold = [self.cold(r) for r in requests]
        warm = [r for r, c in zip(requests, cold, strict=True) if not c]
        decoded = iter(self.decode_requests(warm, decoder, tau) if warm else [])
        cold_ranked = iter(self.cold_rank([r for r, c in zip(requests, cold, strict=True) if c]))
        return [next(cold_ranked) if c else next(decoded) for c in cold]

    def decode_requests(
        self, requests: list[RankRequest], decoder: str, tau: float | None
    ) -> list[RankResult]:
        """The model's own rankings."""
        prompts = self.encode_prompts([r.history for r in requests], [r.candidates for r in requests])
        out = self.decode(prompts, decoder, tau)
        per_nfe = out.nfe / max(len(requests), 1)  # nfe is shared by a batch; report the per-request share
        return [self.result(req, resp, per_nfe) for req, resp in zip(requests, out.responses, strict=True)]

    def result(self, request: RankRequest, response: list[int], nfe: float) -> RankResult:
        """A decoded response (up to its eos) as the request's RankResult; nfe: its share of the forwards."""
        ranking, valid, reason, trace = self.read_answer(response, len(request.candidates))
        return RankResult(
            ranking=[request.candidates[i] for i in ranking],
            valid=valid,
            reason=reason,
            nfe=int(round(nfe)),
            n_tokens=len(response),
            trace=trace,
        )

    # ------------------------------------------------------------------ continuous batching (serving/batcher.py)
    def stream(self, decoder: str, tau: float | None, max_rows: int) -> Stream:
        """A running decode that requests join and leave (gr2/continuous.py): "ar", or "diffusion" at tau (None:
        this model's own). `prompts` and `stream_result` are a request's way in and out."""
        if decoder not in STREAM_DECODERS:
            raise ValueError(f"decoder must be one of {list(STREAM_DECODERS)} to stream, got {decoder!r}")
        tau = self.decode_tau(decoder, tau)
        bs = self.block_size if decoder == "diffusion" else 0
        mask, eos = self.tokenizer.mask_token_id, self.tokenizer.eos_token_id
        cfg = StreamConfig(self.max_new_tokens, eos, bs, tau, mask, self.rules, max_rows)
        return Stream(self.model, cfg)

    def prompts(self, requests: list[RankRequest]) -> list[list[int] | None]:
        """The prompt ids the model decodes for each request (encoded together: a call per request costs 4x);
        None for a request `rank` sends to the cold-start ranker (`cold_rank` ranks it)."""
        warm = [r for r in requests if not self.cold(r)]
        encoded = iter(
            self.encode_prompts([r.history for r in warm], [r.candidates for r in warm]) if warm else []
        )
        return [None if self.cold(r) else next(encoded) for r in requests]

    def stream_result(self, request: RankRequest, tokens: list[int], nfe: float) -> RankResult:
        """A stream's row (`Finished.tokens`) as the request's RankResult."""
        return self.result(request, _until_eos(tokens, self.tokenizer.eos_token_id), nfe)

    def cold(self, request: RankRequest) -> bool:
        """Whether the cold-start ranker ranks this request: the bundle has one and no history id is known."""
        return self.cold_start is not None and not any(h in self.sids.codes for h in request.history)

    def cold_rank(self, requests: list[RankRequest]) -> list[RankResult]:
        """The cold-start ranker's rankings (always valid; no decoding): its listwise scores of each candidate's
        evidence as for a user without history."""
        if not requests:
            return []
        assert self.cold_start is not None  # `rank` routes here only then
        x = self.evidence.features_batch([[] for _ in requests], [r.candidates for r in requests])
        return [
            RankResult(
                ranking=[r.candidates[j] for j in self.cold_start.rank(x[i, : len(r.candidates)])],
                valid=True,
                reason=None,
                nfe=0,
                n_tokens=0,
                trace=None,
                ranker=COLD_START,
            )
            for i, r in enumerate(requests)
        ]

    # ------------------------------------------------------------------ the pieces
    def prompt_candidates(self, prompt: Sequence[int]) -> int:
        """How many candidates a prompt lists (its label tokens; lists of any length 2..N are trained)."""
        return sum(t in self.label_ids for t in prompt)

    def encode_prompts(
        self,
        histories: Sequence[Sequence[str]],
        candidates: Sequence[Sequence[str]],
        orders: Sequence[Sequence[int]] | None = None,
        *,
        own_targets: Sequence[str] | None = None,
        users: Sequence[str] | None = None,
    ) -> list[list[int]]:
        """Prompt ids (<bos> + prompt) per list. History items without a semantic ID are skipped (an item the
        model has never seen carries no signal); candidates must all be known (`known_item`).

        `candidates` are in retriever order. orders (optional): per list, the candidate indices in the order the
        prompt shows them (RL's shuffled prompts). The evidence is computed in retriever order either way, so
        each candidate keeps its own buckets, retriever_rank included; only its letter changes. own_targets and
        users: training lists' (RL's prompts), whose evidence must not count their own next item, as at SFT
        (Evidence.features_batch)."""
        hist = [[h for h in hs if h in self.sids.codes] for hs in histories]
        for cs in candidates:
            unknown = [c for c in cs if c not in self.sids.codes]
            if unknown:
                raise KeyError(f"unknown candidate item ids: {unknown[:5]}")
        x = self.evidence.features_batch(hist, [list(c) for c in candidates], own_targets, users)
        buckets = self.evidence.buckets(x)
        prompts = []
        for i, (hs, cs, b) in enumerate(zip(hist, candidates, buckets, strict=True)):
            b = b[: len(cs)]  # a list shorter than the batch's longest: its own rows
            if orders is not None:  # each candidate moves with its own buckets
                order = list(orders[i])
                if sorted(order) != list(range(len(cs))):
                    raise ValueError(f"orders[{i}] = {order} is not a permutation of 0..{len(cs) - 1}")
                cs, b = [cs[j] for j in order], b[order]
            prompts.append(
                encode_prompt(
                    self.tokenizer,
                    [self.sids.codes[h] for h in hs],
                    [self.sids.codes[c] for c in cs],
                    b,
                    self.evidence.feature_names,
                    self.item_tokens,
                    short_lists=self.short_lists,
                    n_full=self.n_candidates,
                )
            )
        return prompts

    def decode(
        self,
        prompts: list[list[int]],
        decoder: str = "diffusion",
        tau: float | None = None,
        batch_size: int | None = None,
    ) -> Decoded:
        """Decode prompts in batches of `batch_size`; decoder "ar", "diffusion" (needs block_size > 0) or "spec"
        (also needs a verifier; tau is the draft's). tau None: this model's own, the operating tau its bundle
        records (`BundleConfig.operating_tau`; spec: its draft tau); AR decodes without one."""
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {list(DECODERS)}, got {decoder!r}")
        if decoder == "spec" and self.verifier is None:
            raise ValueError(f"{self.name} has no verifier (bundle without verifier/): 'spec' needs one")
        tau = self.decode_tau(decoder, tau)
        batch = batch_size or self.batch_size
        eos = self.tokenizer.eos_token_id
        responses: list[list[int]] = []
        nfe, verifier_nfe, seconds = 0, 0, 0.0
        for b0 in range(0, len(prompts), batch):
            chunk = prompts[b0 : b0 + batch]
            t0 = time.perf_counter()
            with torch.inference_mode():  # `_decode_chunk` says why
                toks, n, n_verify = self._decode_chunk(chunk, decoder, tau)
            seconds += time.perf_counter() - t0
            nfe += n
            verifier_nfe += n_verify
            responses += [_until_eos(row, eos) for row in toks.tolist()]
        return Decoded(responses, nfe, seconds, verifier_nfe)

    def decode_tau(self, decoder: str, tau: float | None) -> float:
        """The tau a decoder runs at: `tau`, or this model's own (`decode`'s docstring); checked."""
        if decoder != "ar" and self.block_size < 1:
            raise ValueError(f"{self.name} is an AR model (block_size 0): use decoder='ar'")
        if tau is None:
            tau = {"diffusion": self.tau, "spec": self.spec_tau}.get(decoder) or 1.0  # (AR reads no tau)
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        return tau

    def _decode_chunk(
        self, chunk: list[list[int]], decoder: str, tau: float
    ) -> tuple[torch.Tensor, int, int]:
        """One decode call -> (tokens, nfe, verifier nfe). `decode` runs it under torch.inference_mode: no
        autograd version tracking per op, a share of every small op's cost at batch 1 (docs/RESULTS.md, 'Timing
        noise, speed repeats, and where the time goes'). Only evaluation and serving decode here; RL and OPD,
        which train on what they decode, call the decoders directly (an inference-mode tensor cannot be saved
        for backward)."""
        eos, L, rules = self.tokenizer.eos_token_id, self.max_new_tokens, self.rules
        if decoder == "ar":
            toks, n = ar_generate(self.model, chunk, L, eos, rules=rules)
            return toks, n, 0
        bs, mask = self.block_size, self.tokenizer.mask_token_id
        if decoder == "spec":
            assert self.verifier is not None  # checked by `decode`
            return spec_generate(self.model, self.verifier, chunk, L, bs, tau, mask, eos, rules=rules)
        toks, n, _ = diffusion_generate(self.model, chunk, L, bs, tau, mask, eos, rules=rules)
        return toks, n, 0

    def read_answer(self, response: list[int], n: int) -> Answer:
        """The response read as an Answer. Invalid output falls back to the upstream order."""
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        trace = response_trace(text)
        parsed = parse_response(text, n)
        if parsed.ranking is None:
            return Answer(list(range(n)), False, parsed.reason, trace)
        return Answer(parsed.ranking, True, None, trace)


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def decode_rules(tokenizer: Any, prompt: BundlePrompt, trace: bool = True) -> DecodeRules:
    """The rules a bundle's decoders apply (gr2/rules.py): its answer labels written at most once
    (prompt.unique_labels), the answer follows the trace (prompt.follow_trace), and the response has the shape
    its list's length fixes (prompt.fixed_layout; `trace`: the model writes one). Both need unique_labels."""
    if not prompt.unique_labels:
        return DecodeRules()
    ids = tokenizer.convert_tokens_to_ids
    k = range(prompt.max_labels)
    unique = torch.tensor(ids([answer_label_token(i) for i in k]))
    labels = torch.tensor(ids([label_token(i) for i in k]))
    levels = torch.tensor(ids([score_token(v) for v in range(prompt.score_levels)]))
    follow = layout = None
    if prompt.follow_trace:
        head = len(tokenizer(ANSWER_HEAD, add_special_tokens=False)["input_ids"])
        follow = TraceRule(labels=labels, levels=levels, head=head)
    if prompt.fixed_layout:
        head_ids, sep, tail = answer_layout(tokenizer)
        layout = Layout(labels, levels if trace else None, torch.tensor(head_ids), sep, torch.tensor(tail))
    return DecodeRules(unique, follow, layout)


# ---------------------------------------------------------------------- bundles


def save_bundle(out_dir: str | Path, bundle: Bundle) -> Path:
    """Write a loadable model directory (see the module docstring); the verifier (an AR model) goes to
    verifier/. reranker.json records the model's own block size, and names verifier/ only when it holds one (a
    parent's config, which stages copy, names no file of this bundle)."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_model(bundle.model, out / "model")
    bundle.tokenizer.save_pretrained(str(out / "tokenizer"))
    bundle.sids.save(out / "sids.json")
    bundle.evidence.save(out / "evidence")
    (out / ITEMS_FILE).write_text("".join(f"{i}\n" for i in sorted(bundle.sids.codes)))
    cfg = replace(
        bundle.config,
        kind=KIND,
        block_size=int(getattr(bundle.model.config, "gr2_block_size", 0) or 0),
        verifier=None if bundle.verifier is None else VERIFIER_DIR,
    )
    if bundle.verifier is not None:
        save_model(bundle.verifier, out / VERIFIER_DIR)
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2, default=str) + "\n")
    return out


def bundle_dir(path: str | Path) -> Path:
    """A training stage's output folder keeps its bundle in bundle/ (logs and checkpoints beside it)."""
    p = Path(path)
    return p / "bundle" if (p / "bundle" / CONFIG_FILE).exists() else p


def load_bundle(path: str | Path, with_verifier: bool = False) -> Bundle:
    """The bundle in `path`; its verifier too with `with_verifier` (None when it has none)."""
    path = Path(path)
    return Bundle(
        model=load_model(path / "model")[0],
        tokenizer=load_tokenizer(path / "tokenizer"),
        sids=SemanticIds.load(path / "sids.json"),
        evidence=Evidence.load(path / "evidence"),
        config=BundleConfig.from_dict(json.loads((path / CONFIG_FILE).read_text())),
        verifier=load_verifier(path) if with_verifier else None,
    )


def load_verifier(path: str | Path) -> PreTrainedModel | None:
    """The bundle's verifier (its AR teacher, for the "spec" decoder), or None when it has none."""
    sub = json.loads((Path(path) / CONFIG_FILE).read_text()).get(VERIFIER_DIR)
    return load_model(Path(path) / sub)[0] if sub else None


@register_reranker(KIND)
def _load_generative(path: Path, cfg: dict) -> GenerativeReranker:
    return GenerativeReranker(load_bundle(path, with_verifier=True))
