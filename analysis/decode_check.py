"""Decoder equivalence: what every decoder of a finished run writes, as digests to compare across commits.

A change to gr2/decode.py that is meant to keep behaviour must keep every token. This decodes a split of a run
(default: the test lists) with every decoder its report has a row for: each AR bundle, each diffusion bundle at
each tau the report lists, and `spec` at its tau (the final student drafting, `ar` verifying, as the evaluation
pairs them). It decodes through `GenerativeReranker.decode`, the evaluation's path, at the evaluation's batch
(profile eval.batch_size) over the whole split, and at batch 1 over its first --batch1-lists lists (one row per
forward: no row ever sits a round out). Per decoder and batch it records a sha256 over all responses' tokens,
the nfe and verifier nfe totals and the token count:

    python -m analysis.decode_check --run runs/latest --out build/decode_before.json
    python -m analysis.decode_check --run runs/latest --out build/decode_after.json \\
        --compare build/decode_before.json --report benchmarks/decode_equivalence

writes --out (JSON). With --compare (the digests of another commit) it also writes the comparison, per decoder
identical yes/no, to <report>.json and <report>.md, and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from analysis.output import provenance, run_record
from analysis.speed_check import run_bundles, split_lists
from gr2.generative import GenerativeReranker
from gr2.stages.evaluate import load

DRAFTS = ("rl", "opd", "cft")  # spec's draft: the final student, as gr2/stages/evaluate.py picks it


def plans(report: dict, models: dict[str, GenerativeReranker]) -> list[tuple[str, str, float | None]]:
    """(row name, decoder, tau) for every generative row of the report, in its order."""
    out: list[tuple[str, str, float | None]] = []
    for row in report["rows"]:
        name, tau = row["model"], row.get("tau")
        if name == "spec":
            out.append((name, "spec", tau))
        elif name in models:
            out.append((name, "ar" if models[name].block_size == 0 else "diffusion", tau))
    return out


def digest(
    model: GenerativeReranker, prompts: list[list[int]], decoder: str, tau: float | None, batch: int
) -> dict:
    out = model.decode(prompts, decoder, tau or 1.0, batch)
    sha = hashlib.sha256(json.dumps(out.responses).encode()).hexdigest()
    return {
        "sha256": sha,
        "nfe": out.nfe,
        "verifier_nfe": out.verifier_nfe,
        "tokens": sum(len(r) for r in out.responses),
        "seconds": round(out.seconds, 2),
    }


def check(run: Path, split: str, batch1_lists: int, limit: int = 0) -> dict:
    report = json.loads((run / "report.json").read_text())
    profile, df = split_lists(run, split, limit)
    names = [r["model"] for r in report["rows"]]
    bundles = run_bundles(run)
    models = {name: load(bundles[name]) for name in names if name in bundles}
    if "spec" in names:
        draft = next(n for n in DRAFTS if n in models)
        models["spec"] = models[draft].with_verifier(models["ar"].model, "spec")
    prompts = models["ar"].encode_prompts(df["history"].tolist(), df["candidates"].tolist())
    batch = profile.eval.batch_size
    decoders = {}
    t0 = time.perf_counter()
    for name, decoder, tau in plans(report, models):
        key = f"{name}@{tau}" if tau is not None else name
        decoders[key] = {
            "decoder": decoder,
            "tau": tau,
            f"batch{batch}": digest(models[name], prompts, decoder, tau, batch),
            "batch1": digest(models[name], prompts[:batch1_lists], decoder, tau, 1),
        }
        print(key, json.dumps(decoders[key]), flush=True)
    return {
        "run": run_record(run, report),
        "split": split,
        "lists": len(df),
        "batch": batch,
        "batch1_lists": min(batch1_lists, len(df)),
        "seconds": round(time.perf_counter() - t0, 1),
        "decoders": decoders,
    }


def compare(before: dict, after: dict) -> dict:
    """Per decoder and batch: identical (same digest, nfe and verifier nfe) or not."""
    rows = []
    for key, a in after["decoders"].items():
        b = before["decoders"].get(key, {})
        for batch in (k for k in a if k.startswith("batch")):
            x, y = b.get(batch), a[batch]
            same = x is not None and all(x[f] == y[f] for f in ("sha256", "nfe", "verifier_nfe", "tokens"))
            rows.append({"decoder": key, "batch": batch, "identical": same, "before": x, "after": y})
    missing = sorted(set(before["decoders"]) - set(after["decoders"]))
    return {
        "before": {k: before[k] for k in ("command", "git_sha", "seconds")},
        "after": {k: after[k] for k in ("command", "git_sha", "seconds")},
        "machine": after["machine"],
        "run": after["run"],
        "split": after["split"],
        "lists": after["lists"],
        "batch1_lists": after["batch1_lists"],
        "identical": all(r["identical"] for r in rows) and not missing,
        "missing": missing,
        "rows": rows,
    }


def markdown(c: dict) -> str:
    lines = [
        "# Decoder equivalence",
        "",
        f"Every decoder of run `{c['run']['run_id']}` ({c['run']['dataset']}, profile {c['run']['profile']}) on "
        f"its {c['lists']} {c['split']} lists at the evaluation's batch and on the first {c['batch1_lists']} at "
        "batch 1, decoded at two commits: a sha256 over all responses' tokens, and the nfe totals.",
        "",
        f"- before: `{c['before']['git_sha']}`: `{c['before']['command']}` ({c['before']['seconds']} s)",
        f"- after: `{c['after']['git_sha']}`: `{c['after']['command']}` ({c['after']['seconds']} s)",
        f"- machine: {c['machine']}",
        f"- identical: **{'yes' if c['identical'] else 'no'}**"
        + (f" (missing after: {c['missing']})" if c["missing"] else ""),
        "",
        "| decoder | batch | tokens | nfe | verifier nfe | sha256 (first 16) | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in c["rows"]:
        a = r["after"]
        lines.append(
            f"| {r['decoder']} | {r['batch'][5:]} | {a['tokens']} | {a['nfe']} | {a['verifier_nfe']} | "
            f"`{a['sha256'][:16]}` | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a finished run directory (make run / make bench)")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"])
    ap.add_argument(
        "--batch1-lists", type=int, default=200, help="lists decoded at batch 1 (the split's first)"
    )
    ap.add_argument("--limit", type=int, default=0, help="only the split's first N lists (0: all)")
    ap.add_argument("--out", required=True, help="the digests (JSON)")
    ap.add_argument("--compare", help="digests of another commit (--out of an earlier run of this tool)")
    ap.add_argument(
        "--report", default="benchmarks/decode_equivalence", help="comparison prefix (.json, .md)"
    )
    args = ap.parse_args(argv)
    res = provenance("analysis.decode_check", argv, machine=True) | check(
        Path(args.run).resolve(), args.split, args.batch1_lists, args.limit
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if not args.compare:
        return 0
    c = compare(json.loads(Path(args.compare).read_text()), res)
    prefix = Path(args.report)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(c, indent=2) + "\n")
    prefix.with_suffix(".md").write_text(markdown(c))
    print(markdown(c))
    return 0 if c["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
