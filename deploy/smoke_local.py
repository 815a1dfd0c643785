"""The end of `make run`: serve the run's model on 127.0.0.1 and send it real requests through the transformer.

    python -m deploy.smoke_local --model_uri <bundle> --feast_repo <feature_store dir> --examples <parquet>

Starts `serving.serve_local` (the Feast transformer in front of the predictor, both on loopback ports), sends
test users' candidate lists over v1 (as retrieved, then reversed: does the ranking follow the model or the
input order?) and v2 with only `user_id` + `candidates` (the transformer reads each
user's history from the run's online store), one malformed request that must get a 4xx, and a good request
after it (the server stayed up). Returns a summary that run_local writes into the run's report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from serving.serve_local import running

MODEL_NAME = "reranker"


def instances(examples: str | Path, n: int) -> list[dict[str, Any]]:
    """The first `n` test users' requests (user_id + candidates as retrieved) from a run's candidate lists."""
    import pandas as pd

    df = pd.read_parquet(examples, columns=["user_id", "candidates", "split"])
    df = df[df["split"] == "test"].head(n)
    return [
        {"user_id": str(r.user_id), "candidates": [str(c) for c in r.candidates]} for r in df.itertuples()
    ]


def v2_body(insts: list[dict[str, Any]]) -> dict[str, Any]:
    """A v2 (open inference protocol) body carrying `insts` as one BYTES input of JSON strings."""
    data = [json.dumps(i) for i in insts]
    return {"inputs": [{"name": "instances", "shape": [len(data)], "datatype": "BYTES", "data": data}]}


def smoke(
    model_uri: str | Path,
    feast_repo: str | Path,
    examples: str | Path,
    n_requests: int = 8,
    log: Path | None = None,
) -> dict[str, Any]:
    """Serve `model_uri` behind the Feast transformer, send real requests, stop. Raises if the server never
    became ready; request failures are counted in the summary, not raised (the report shows them)."""
    args = ["--model_uri", str(model_uri), "--feast_repo", str(feast_repo)]
    with running(args, MODEL_NAME, log) as url:
        return {**probe(url, examples, n_requests), "model_uri": str(model_uri)}


def probe(
    url: str, examples: str | Path, n_requests: int = 8, model_name: str = MODEL_NAME
) -> dict[str, Any]:
    """Send a running server at `url` the requests above (smoke's; also tests/containers against the serving
    container); the summary counts failures rather than raising them."""
    insts = instances(examples, n_requests)
    lat, preds, codes = [], [], []
    with httpx.Client(timeout=120) as http:
        for inst in insts:
            t0 = time.perf_counter()
            r = http.post(f"{url}/v1/models/{model_name}:predict", json={"instances": [inst]})
            lat.append((time.perf_counter() - t0) * 1000)
            codes.append(r.status_code)
            if r.status_code == 200:
                preds.append(r.json()["predictions"][0])
        # The same lists with their candidates reversed: a model that ranks by evidence keeps its top-1;
        # one that copies the input order does not.
        flipped = [{**i, "candidates": i["candidates"][::-1]} for i in insts]
        r = http.post(f"{url}/v1/models/{model_name}:predict", json={"instances": flipped})
        flipped_preds = r.json()["predictions"] if r.status_code == 200 else []
        r2 = http.post(f"{url}/v2/models/{model_name}/infer", json=v2_body(insts[:2]))
        bad = http.post(
            f"{url}/v1/models/{model_name}:predict",
            content=b'{"instances": [{"user_id": ',
            headers={"content-type": "application/json"},
        )
        after = http.post(f"{url}/v1/models/{model_name}:predict", json={"instances": insts[:1]})
    lat.sort()
    return {
        "url": url,
        "requests": len(insts),
        "ok": sum(c == 200 for c in codes),
        "valid": sum(bool(p.get("valid")) for p in preds),
        "with_history": sum(int(p.get("history_len") or 0) > 0 for p in preds),
        "reordered": sum(p["ranking"] != i["candidates"] for p, i in zip(preds, insts, strict=False)),
        "same_top1_reversed": sum(
            a["ranking"][:1] == b["ranking"][:1] for a, b in zip(preds, flipped_preds, strict=False)
        ),
        "reversed_status": r.status_code,
        "p50_ms": round(lat[len(lat) // 2], 1) if lat else None,
        "v2_status": r2.status_code,
        "malformed_status": bad.status_code,
        "status_after_malformed": after.status_code,
        "example": preds[0] if preds else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_uri", required=True)
    ap.add_argument("--feast_repo", required=True)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args(argv)
    res = smoke(a.model_uri, a.feast_repo, a.examples, a.requests)
    print(json.dumps(res, indent=2))
    ok = res["ok"] == res["requests"] and res["v2_status"] == 200 and res["status_after_malformed"] == 200
    return 0 if ok and 400 <= res["malformed_status"] < 500 else 1


if __name__ == "__main__":
    sys.exit(main())
