"""The server's decoding loop without the server: closed-loop clients straight on a `Stream` (gr2/continuous.py).

A benchmark (not a test). `deploy.loadtest` measures requests/s through HTTP; this measures what the decoding
thread alone could serve, so the gap between the two is the server's own cost (HTTP, the event loop, and on a
small machine their contention with the decoding thread for the CPU). C clients each send a list as soon as their
last one is answered; every step admits what waits (as serving/batcher.py's thread does). Per decoder and
concurrency, two rows:

- `decode`: prompts encoded beforehand: the stream's own rate (forwards and its bookkeeping);
- `encode+decode`: each new request's prompt encoded, and each answer parsed, in the loop (what the serving
  thread also does: `GenerativeReranker.prompts`, `stream_result`).

    python -m analysis.stream_rate --run runs/latest --concurrency 8 32 --threads 1 --out benchmarks/stream_rate

The diffusion rows decode the `rl` bundle at its operating tau, the AR rows the `ar` bundle, both at --dtype,
max batch --max_batch (the server's defaults). Each (decoder, concurrency, row) is timed --repeats times,
interleaved, and reported as the median; ratios are diffusion over AR. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from analysis.output import print_json, provenance, run_record
from analysis.speed_check import load_models, split_lists
from gr2.inference import DTYPES, RankRequest
from serving.schema import ServeConfig

MODES = ("decode", "encode+decode")
ENCODE_BATCHES = (1, 4, 16)


@dataclass(frozen=True)
class Load:
    """What to time: closed-loop clients per row, answers per row, and the server's settings."""

    concurrency: tuple[int, ...] = (8, 32)
    lists: int = 600  # answers per diffusion row (AR rows: half, for similar seconds per row)
    repeats: int = 3
    dtype: str = "float32"  # the diffusion rows' (serve_local --dtype)
    ar_dtype: str = "float32"
    max_batch: int = ServeConfig.max_batch
    threads: int = 1  # torch threads: the server's default on 2 cores


def closed_loop(
    reranker: Any,
    decoder: str,
    requests: list[RankRequest],
    clients: int,
    lists: int,
    *,
    encode: bool,
    max_batch: int,
) -> float:
    """Lists per second of `clients` closed-loop clients over `lists` answers (the requests cycled)."""
    warm = [q for q in requests if not reranker.cold(q)]  # (a cold-start user is not decoded)
    prompts = reranker.prompts(warm) if not encode else []
    stream = reranker.stream(decoder, None, max_batch)
    sent = 0

    def send(n: int) -> None:
        nonlocal sent
        new = list(range(sent, sent + n))
        sent += n
        ids = (
            reranker.prompts([warm[i % len(warm)] for i in new])
            if encode
            else [prompts[i % len(warm)] for i in new]
        )
        for key, p in zip(new, ids, strict=True):
            stream.add(key, p)

    send(clients)
    done, t = 0, time.perf_counter()
    while done < lists:
        finished = stream.step()
        done += len(finished)
        if encode:
            for f in finished:
                reranker.stream_result(warm[f.key % len(warm)], f.tokens, f.nfe)
        send(len(finished))
    return done / (time.perf_counter() - t)


def encode_ms(reranker: Any, requests: list[RankRequest], batch: int, lists: int = 400) -> float:
    """Milliseconds per list to encode prompts `batch` requests at a time (the serving thread encodes the requests
    that arrived during a step together: at a few clients, one to a few)."""
    t = time.perf_counter()
    for i in range(0, lists, batch):
        reranker.prompts([requests[(i + k) % len(requests)] for k in range(batch)])
    return (time.perf_counter() - t) / lists * 1000


def measure(run: Path, load: Load) -> dict:
    """rows: decoder, tau, concurrency, mode, lists_per_s (the median) and the runs it is the median of;
    encode_ms_per_list: per batch size, the median of the repeats."""
    _, df = split_lists(run, "test", 0)
    torch.set_num_threads(load.threads)  # (after split_lists, which sets the run's own)
    requests = [
        RankRequest("", list(c), list(h)) for h, c in zip(df["history"], df["candidates"], strict=True)
    ]
    loaded = load_models(run, [f"ar:{load.ar_dtype}", f"rl:{load.dtype}"])
    models = dict(zip(("ar", "diffusion"), loaded.values(), strict=True))
    for decoder, m in models.items():  # warm-up: the first forwards of each shape are slow
        closed_loop(m, decoder, requests, max(load.concurrency), 50, encode=False, max_batch=load.max_batch)
    rates: dict[tuple[str, int, str], list[float]] = {}
    encode: dict[int, list[float]] = {}
    for _ in range(load.repeats):
        for b in ENCODE_BATCHES:
            encode.setdefault(b, []).append(encode_ms(models["diffusion"], requests, b))
        for c in load.concurrency:
            for mode in MODES:
                for decoder, m in models.items():
                    n = load.lists if decoder == "diffusion" else max(load.lists // 2, 1)
                    rate = closed_loop(
                        m, decoder, requests, c, n, encode=mode != "decode", max_batch=load.max_batch
                    )
                    rates.setdefault((decoder, c, mode), []).append(rate)
    tau = models["diffusion"].decode_tau("diffusion", None)
    rows = [
        {
            "decoder": decoder,
            "tau": None if decoder == "ar" else tau,
            "concurrency": c,
            "mode": mode,
            "lists_per_s": round(statistics.median(r), 1),
            "runs": [round(x, 1) for x in r],
        }
        for (decoder, c, mode), r in rates.items()
    ]
    return {
        "rows": rows,
        "encode_ms_per_list": {b: round(statistics.median(t), 3) for b, t in encode.items()},
    }


def markdown(res: dict) -> str:
    rows = {(r["decoder"], r["concurrency"], r["mode"]): r for r in res["rows"]}
    m = res["machine"]
    lines = [
        "# The decoding loop alone (no HTTP)",
        "",
        f"`{res['command']}`  ",
        f"machine: {m['cpu']} x{m['cores']}, torch {m['torch']}; git {res['git_sha']}; run {res['run']['run_id']}; "
        f"diffusion in {res['dtype']}, AR in {res['ar_dtype']}; max batch {res['max_batch']}; torch threads {res['threads']}; median of {res['repeats']} interleaved runs",
        "",
        "| concurrency | mode | AR lists/s | diffusion lists/s | diffusion / AR |",
        "|---|---|---|---|---|",
    ]
    for c in res["concurrency"]:
        for mode in MODES:
            a, d = rows[("ar", c, mode)]["lists_per_s"], rows[("diffusion", c, mode)]["lists_per_s"]
            lines.append(f"| {c} | {mode} | {a} | {d} | {d / a:.2f}x |")
    enc = ", ".join(f"{ms} ms at {b}" for b, ms in res["encode_ms_per_list"].items())
    lines += [
        "",
        f"Encoding a prompt (`GenerativeReranker.prompts`), per list, requests encoded together: {enc}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    d = Load()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=list(d.concurrency))
    ap.add_argument("--lists", type=int, default=d.lists, help="answers per diffusion row (AR rows: half)")
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument(
        "--dtype", choices=DTYPES, default=d.dtype, help="the diffusion rows' (serve_local --dtype)"
    )
    ap.add_argument("--ar_dtype", choices=DTYPES, default=d.ar_dtype, help="the AR rows'")
    ap.add_argument("--max_batch", type=int, default=d.max_batch)
    ap.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads (the server's on 2 cores: 1)"
    )
    ap.add_argument("--out", help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    run = Path(args.run).resolve()
    load = Load(
        concurrency=tuple(args.concurrency),
        lists=args.lists,
        repeats=args.repeats,
        dtype=args.dtype,
        ar_dtype=args.ar_dtype,
        max_batch=args.max_batch,
        threads=args.threads,
    )
    res = (
        provenance("analysis.stream_rate", argv, machine=True)
        | {"run": run_record(run, json.loads((run / "report.json").read_text()))}
        | asdict(load)
        | measure(run, load)
    )
    print_json(res, f"{args.out}.json" if args.out else None)
    if args.out:
        Path(f"{args.out}.md").write_text(markdown(res))
    return res


if __name__ == "__main__":
    main()
