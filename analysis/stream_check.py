"""Check that continuous batching changes no request's tokens, on a finished run's lists.

Serving decodes through gr2/continuous.py: a request joins a running decode and leaves as it finishes. This cuts
each list of a split to a length drawn from 2..N (seeded, so every length shows up), decodes every list alone,
then feeds the same lists to one `Stream` in random waves between its steps (each wave joins the running decode:
join_wait 0) and compares every response token for token:

    python -m analysis.stream_check --run runs/latest --model rl --split test

`--model ar` checks AR's stream (the `ar` bundle); any other bundle is decoded by diffusion at its operating tau
(or --tau). Prints (and with --out writes) JSON: lists, identical, the waves that joined a running decode, the
first mismatches. A mismatch would be a bug, or a float tie (a different batch rounds differently). Exit status 1
on any mismatch.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

from analysis.output import print_json, provenance
from analysis.speed_check import find_bundles, split_lists
from gr2.inference import RankRequest
from gr2.stages.evaluate import load


def check(
    run: Path, model: str, split: str, tau: float | None = None, limit: int = 0, seed: int = 0, show: int = 10
) -> dict:
    profile, df = split_lists(run, split, limit)
    reranker = load(find_bundles(run, [model])[model])
    decoder = "ar" if model == "ar" else "diffusion"
    tau = reranker.decode_tau(decoder, tau)
    rng = random.Random(seed)
    requests = []
    for history, candidates in zip(df["history"], df["candidates"], strict=True):
        n = rng.randint(2, len(candidates)) if len(candidates) > 2 else len(candidates)
        requests.append(RankRequest("", list(candidates)[:n], list(history)))
    prompts = {k: p for k, p in enumerate(reranker.prompts(requests)) if p is not None}  # (cold start: none)
    keys = list(prompts)
    eos = reranker.tokenizer.eos_token_id
    alone = {k: reranker.decode([prompts[k]], decoder, tau).responses[0] for k in keys}
    stream = reranker.stream(decoder, tau, profile.eval.batch_size)
    stream.cfg = replace(stream.cfg, join_wait=0)  # every wave joins the running decode
    got: dict[int, list[int]] = {}
    i, joins = 0, 0
    while len(got) < len(keys):
        wave = keys[i : i + rng.choice([0, 0, 1, 2, 3])]
        i += len(wave)
        joins += bool(wave) and stream.d is not None
        for k in wave:
            stream.add(k, prompts[k])
        for f in stream.step():
            got[f.key] = f.tokens[: f.tokens.index(eos) + 1] if eos in f.tokens else f.tokens
    wrong = [k for k in keys if got[k] != alone[k]]
    return {
        "model": model,
        "decoder": decoder,
        "tau": None if decoder == "ar" else tau,
        "split": split,
        "lists": len(keys),
        "lengths": sorted({len(requests[k].candidates) for k in keys}),
        "waves_joined": joins,
        "identical": len(keys) - len(wrong),
        "mismatches": [{"list": k, "alone": alone[k], "stream": got[k]} for k in wrong[:show]],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--model", default="rl", help="the bundle ('ar': AR decoding; others: diffusion)")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"])
    ap.add_argument(
        "--tau", type=float, help="diffusion's commit threshold (default: the bundle's operating tau)"
    )
    ap.add_argument("--limit", type=int, default=0, help="only the split's first N lists (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    res = provenance("analysis.stream_check", argv) | check(
        Path(args.run).resolve(), args.model, args.split, args.tau, args.limit, args.seed
    )
    print_json(res, args.out)
    return res


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["identical"] == out["lists"] else 1)
