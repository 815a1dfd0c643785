"""Where a diffusion bundle spends its commit rounds: per block, and per kind of token.

Tokens per forward is the whole story of the diffusion speedup, and it is decided by the tokens that do not
clear tau in their block's first round. This decodes a finished run's lists one at a time (batch 1, greedy, the
bundle's own rules) and reads the trajectory `diffusion_generate` returns: each block's rounds, and for each kind
of token (trace label, score level, answer label, JSON punctuation, eos) the share committed after its block's
first round.

    python -m analysis.rounds_check --run runs/latest --model rl --tau 0.9 --split val --lists 100

prints the summary as JSON (and writes it with --out). For an AR bundle (`--model ar`) it counts instead the
response tokens that the trace rule leaves a single label (`forced_tokens`): the forwards a jump-forward AR
decoder could skip, which the AR baseline of the speed table does not.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from analysis.output import print_json, provenance
from analysis.speed_check import find_bundles
from gr2.decode import diffusion_generate, pad_prompts
from gr2.generative import GenerativeReranker
from gr2.rules import TraceRule, answer_slots, seen_before, single_label
from gr2.stages.evaluate import load
from pipelines.run_local import run_examples, run_profile


def token_kind(token: str) -> str:
    """The kind of a response token: "score" (<score_k>), "trace_label" ([A]), "answer_label" ("A"), else the
    token itself (JSON punctuation, <eos>)."""
    if token.startswith("<score_"):
        return "score"
    if len(token) == 3 and token[0] == "[" and token[2] == "]":
        return "trace_label"
    if len(token) == 3 and token[0] == '"' and token[2] == '"':
        return "answer_label"
    return token


def rounds(model: GenerativeReranker, prompts: list[list[int]], tau: float) -> dict:
    """Decode each prompt alone; rounds per block (0-based block index) and the late share per token kind."""
    tok = model.tokenizer
    per_block: dict[int, list[int]] = defaultdict(list)
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [late, all]
    n_tokens, n_forwards = 0, 0
    for p in prompts:
        out, nfe, traj = diffusion_generate(
            model.model,
            [p],
            model.max_new_tokens,
            model.block_size,
            tau,
            tok.mask_token_id,
            tok.eos_token_id,
            rules=model.rules,
        )
        ids, t = out[0].tolist(), traj[0].tolist()
        length = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
        n_tokens, n_forwards = n_tokens + length, n_forwards + nfe
        for s0 in range(0, length, model.block_size):
            cols = range(s0, min(s0 + model.block_size, length))
            first = min(t[j] for j in cols)
            per_block[s0 // model.block_size].append(max(t[j] for j in cols) - first + 1)
            for j in cols:
                k = kinds[token_kind(tok.convert_ids_to_tokens(ids[j]))]
                k[0], k[1] = k[0] + int(t[j] > first), k[1] + 1
    return {
        "lists": len(prompts),
        "tokens_per_forward": n_tokens / max(n_forwards, 1),
        "forwards_per_list": n_forwards / max(len(prompts), 1),
        "rounds_per_block": {b: float(np.mean(v)) for b, v in sorted(per_block.items())},
        "late_share": {k: {"late": v[0] / v[1], "tokens": v[1]} for k, v in kinds.items()},
    }


def forced_tokens(
    rule: TraceRule, unique: torch.Tensor, prompt_ids: torch.Tensor, responses: torch.Tensor
) -> torch.Tensor:
    """Per response [B, T] (left-padded prompts [B, P]): how many tokens the trace rule leaves one choice, i.e. an
    answer position whose trace allows a single label not written before it (a level no other candidate has,
    or the last label of a tied level)."""
    n = rule.n_candidates(prompt_ids)
    slots = answer_slots(rule, responses, torch.ones_like(responses, dtype=torch.bool), n)
    before = seen_before(responses, unique)[:, :-1]  # [B, T, K]: the labels written before each position
    return single_label(slots, before)[0].sum(-1)


def ar_forced(model: GenerativeReranker, prompts: list[list[int]], batch: int) -> dict:
    """An AR bundle's greedy responses: tokens per list, and those `forced_tokens` counts."""
    follow, unique = model.rules.follow, model.rules.unique
    if follow is None or unique is None:
        raise SystemExit(f"{model.name} has no trace rule (prompt.follow_trace): no token is forced")
    eos = model.tokenizer.eos_token_id
    out = model.decode(prompts, "ar", 1.0, batch)
    width = max(len(r) for r in out.responses)
    resp = torch.tensor([r + [eos] * (width - len(r)) for r in out.responses])
    forced = forced_tokens(follow, unique, pad_prompts(prompts, model.model)[0], resp)
    return {
        "lists": len(prompts),
        "tokens_per_list": sum(len(r) for r in out.responses) / len(prompts),
        "forced_per_list": float(forced.float().mean()),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument(
        "--model", default="rl", help="a bundle of the run (diffusion: rounds; AR: forced tokens)"
    )
    ap.add_argument(
        "--tau", type=float, default=0.0, help="commit threshold (0: the model's operating tau, its bundle's)"
    )
    ap.add_argument("--split", default="val")
    ap.add_argument("--lists", type=int, default=100, help="the split's first N lists")
    ap.add_argument("--out", default="", help="also write the summary here (JSON)")
    args = ap.parse_args(argv)
    run = Path(args.run).resolve()
    profile = run_profile(run)
    torch.set_num_threads(profile.eval.threads)
    model = load(find_bundles(run, [args.model])[args.model])
    examples = run_examples(run)
    df = examples[examples["split"] == args.split].head(args.lists)
    if df.empty:
        raise SystemExit(f"no examples in split {args.split!r}")
    prompts = model.encode_prompts(df["history"].tolist(), df["candidates"].tolist())
    out = provenance("analysis.rounds_check", argv) | {
        "run": run.name,
        "model": args.model,
        "split": args.split,
    }
    if model.block_size < 1:  # an AR bundle: its forced tokens
        out |= ar_forced(model, prompts, profile.eval.batch_size)
    else:
        tau = args.tau or model.tau
        assert tau is not None  # a diffusion bundle has its operating tau
        out |= {"tau": tau} | rounds(model, prompts, tau)
    print_json(out, args.out)
    return out


if __name__ == "__main__":
    main()
