"""The burst (issue 36, a benchmark, not a test): concurrent clients sending what real traffic holds, against
`python -m serving.serve_local` serving a real model on 127.0.0.1.

    python -m tests.serving.burst --model_uri <bundle> --examples <examples parquet> \
        [--feast_repo <feature_store dir>] --requests 300 --concurrency 16 --out benchmarks/serving_burst

Good requests: 1-5 instances each, every instance one test list cut to a random length 2..10 (the retriever's order
kept), with its user's history (client-sent), no history at all (a new user), or, with --feast_repo, the history
the transformer looks up; a random decoder the model serves and a random tau or the default; v1 or v2. Bad
requests (a share of them, --bad_share): the hostile bodies of tests/serving/test_robustness.py. All are sent in a
shuffled order, `concurrency` at a time. Counts: good requests that failed (any status but 200), answers that are
not a permutation of their own instance's candidates, bad requests answered 5xx; validity by list length; the
machine's load before and after (the figures of a shared 2-core machine are the load's too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pandas as pd

from deploy.loadtest import percentile
from gr2.inference import read_config
from gr2.report import git_sha, machine_info
from serving.serve_local import running
from tests.serving.support import MODEL
from tests.serving.test_robustness import V1, V2, hostile

TAUS = (None, 0.4, 0.6, 0.9, 1.0)  # None: the model's own default


def good_request(rng: random.Random, lists: pd.DataFrame, decoders: list[str], feast: bool) -> dict:
    """(path, body, the instances sent) of one valid request."""
    instances = []
    for _ in range(rng.randint(1, 5)):
        row = lists.iloc[rng.randrange(len(lists))]
        cands = list(row["candidates"])
        n = rng.randint(2, len(cands))
        keep = sorted(rng.sample(range(len(cands)), n))
        inst: dict = {"user_id": str(row["user_id"]), "candidates": [cands[j] for j in keep]}
        who = rng.random()
        if who < 0.1:
            inst["user_id"], inst["history"] = f"new-{rng.randrange(10**9)}", []  # a cold-start user
        elif not feast or who < 0.5:
            inst["history"] = list(row["history"])  # else the transformer fills it from Feast
        if rng.random() < 0.7:
            inst["decoder"] = rng.choice(decoders)
        tau = rng.choice(TAUS)
        if tau is not None:
            inst["tau"] = tau
        instances.append(inst)
    if rng.random() < 0.5:
        return {
            "path": V1,
            "body": json.dumps({"instances": instances}).encode(),
            "instances": instances,
            "v2": False,
        }
    data = [json.dumps(i) for i in instances]
    body = {"inputs": [{"name": "instances", "shape": [len(data)], "datatype": "BYTES", "data": data}]}
    return {"path": V2, "body": json.dumps(body).encode(), "instances": instances, "v2": True}


async def send(client: httpx.AsyncClient, req: dict, gate: asyncio.Semaphore) -> dict:
    async with gate:
        t0 = time.perf_counter()
        try:
            r = await client.post(
                req["path"], content=req["body"], headers={"content-type": "application/json"}
            )
            status, answer = r.status_code, r.content
        except httpx.HTTPError as e:
            status, answer = 0, str(e).encode()
        return {**req, "status": status, "answer": answer, "ms": (time.perf_counter() - t0) * 1000}


def predictions(res: dict) -> list[dict]:
    out = json.loads(res["answer"])
    if not res["v2"]:
        return out["predictions"]
    return [json.loads(d) for d in out["outputs"][0]["data"]]


def summarize(results: list[dict]) -> dict:
    good = [r for r in results if "instances" in r]
    bad = [r for r in results if "instances" not in r]
    failed = [r for r in good if r["status"] != 200]
    not_permutation, by_length, rankers = 0, {}, {}
    for r in good:
        if r["status"] != 200:
            continue
        for inst, p in zip(r["instances"], predictions(r), strict=True):
            if sorted(p["ranking"]) != sorted(inst["candidates"]):
                not_permutation += 1
            n = len(inst["candidates"])
            if p["ranker"] == "model":
                by_length.setdefault(n, []).append(p["valid"])
            rankers[p["ranker"]] = rankers.get(p["ranker"], 0) + 1
    lat = [r["ms"] for r in good if r["status"] == 200]
    return {
        "good_requests": len(good),
        "good_failed": len(failed),
        "failed_statuses": sorted({r["status"] for r in failed}),
        "instances": sum(len(r["instances"]) for r in good),
        "not_permutations": not_permutation,
        "rankers": rankers,
        "validity_by_length": {n: round(sum(v) / len(v), 4) for n, v in sorted(by_length.items())},
        "bad_requests": len(bad),
        "bad_statuses": {
            str(s): sum(r["status"] == s for r in bad) for s in sorted({r["status"] for r in bad})
        },
        "bad_5xx": sum(r["status"] >= 500 or r["status"] == 0 for r in bad),
        "p50_ms": round(percentile(lat, 50), 1),
        "p95_ms": round(percentile(lat, 95), 1),
        "p99_ms": round(percentile(lat, 99), 1),
    }


def markdown(report: dict) -> str:
    s, m = report["summary"], report["meta"]
    lines = [
        "# The burst: concurrent mixed traffic against serve_local (issue 36)",
        "",
        f"`{m['command']}` at {m['git_sha']}; {m['machine']}; load average {m['load_before']} before, "
        f"{m['load_after']} after (a shared 2-core machine). Model `{m['model']}` (N = {m['n_candidates']}, "
        f"decoders {', '.join(m['decoders'])}), served {m['served']}. {m['requests']} requests at concurrency "
        f"{m['concurrency']} in {m['wall_s']:.1f} s.",
        "",
        "| what | count |",
        "|---|---|",
        f"| good requests (1-5 instances of 2-10 candidates, mixed decoders, tau, v1/v2) | {s['good_requests']} |",
        f"| instances in them | {s['instances']} |",
        f"| good requests that failed | **{s['good_failed']}** {s['failed_statuses'] or ''} |",
        f"| answers that are not a permutation of their own candidates | **{s['not_permutations']}** |",
        f"| rankings by the model / by the cold-start ranker | {s['rankers'].get('model', 0)} / "
        f"{s['rankers'].get('cold_start', 0)} |",
        f"| bad requests (hostile bodies) | {s['bad_requests']}: {s['bad_statuses']} |",
        f"| bad requests answered 5xx or not at all | **{s['bad_5xx']}** |",
        f"| good requests' latency p50 / p95 / p99 (ms) | {s['p50_ms']} / {s['p95_ms']} / {s['p99_ms']} |",
        f"| server log tracebacks | {m['log_tracebacks']} |",
        "",
        "Validity of the model's rankings by list length (the rest are the cold-start ranker's, always valid):",
        "",
        "| length | " + " | ".join(str(n) for n in s["validity_by_length"]) + " |",
        "|---|" + "---|" * len(s["validity_by_length"]),
        "| validity | " + " | ".join(f"{v:.3f}" for v in s["validity_by_length"].values()) + " |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_uri", required=True)
    p.add_argument("--examples", required=True, help="examples parquet (user_id, history, candidates; split)")
    p.add_argument("--feast_repo", default=None, help="serve through the transformer with this Feast repo")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--bad_share", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="writes <out>.json and <out>.md")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    cfg = read_config(a.model_uri)
    decoders = (
        ["ar"]
        if int(cfg.get("block_size", 0)) < 1
        else ["diffusion", "ar"] + (["spec"] if cfg.get("verifier") else [])
    )
    df = pd.read_parquet(a.examples)
    lists = df[df["split"] == "test"] if "split" in df else df
    items = [c for cs in lists["candidates"].head(50) for c in cs]
    bad = [
        {"path": h[1], "body": h[2], "v2": h[1] == V2} for h in hostile(items) if h[3] == "application/json"
    ]
    n_bad = round(a.requests * a.bad_share)
    reqs = [good_request(rng, lists, decoders, a.feast_repo is not None) for _ in range(a.requests - n_bad)]
    reqs += [rng.choice(bad) for _ in range(n_bad)]
    rng.shuffle(reqs)
    args = ["--model_uri", a.model_uri] + (["--feast_repo", a.feast_repo] if a.feast_repo else [])
    with (
        tempfile.TemporaryDirectory(prefix="gr2-burst-") as tmp,
        running(args, MODEL, Path(tmp) / "server.log") as url,
    ):
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        t0 = time.perf_counter()

        async def run() -> list[dict]:
            gate = asyncio.Semaphore(a.concurrency)
            limits = httpx.Limits(max_connections=a.concurrency)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(send(client, r, gate) for r in reqs))

        results = asyncio.run(run())
        wall = time.perf_counter() - t0
        load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
        log_text = (Path(tmp) / "server.log").read_text(errors="replace")
    report = {
        "meta": {
            "command": "python -m tests.serving.burst "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "git_sha": git_sha(short=True),
            "machine": "{cpu}, {cores} cores, Python {python}".format(**machine_info()),
            "model": cfg.get("name"),
            "n_candidates": cfg.get("n_candidates"),
            "decoders": decoders,
            "served": "by the transformer (Feast) and the predictor" if a.feast_repo else "by the predictor",
            "requests": a.requests,
            "concurrency": a.concurrency,
            "wall_s": wall,
            "load_before": load_before,
            "load_after": load_after,
            "log_tracebacks": log_text.count("Traceback"),
        },
        "summary": summarize(results),
    }
    Path(f"{a.out}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(f"{a.out}.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
