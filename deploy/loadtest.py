"""Load test (a benchmark, not a test): concurrent HTTP clients against the re-ranking server, per decoder.

    python -m deploy.loadtest --model_uri <diffusion bundle> --ar_model_uri <AR teacher bundle> \
        --decoders ar diffusion spec --concurrency 1 2 4 8 32 --requests 200 --out benchmarks/serving
starts one predictor per decoder on 127.0.0.1 (the AR rows decode the AR teacher; or use --url for a running server /
the transformer), lets the decoders alternate in --turns turns at each concurrency level (side by side; each level
sends --requests, or --min_per_client per client and turn when that is more), sends v1 requests
built from real examples (--examples parquet: user_id, history, candidates) or from the model's item catalogue,
each client on its own keep-alive connection (`Connection`), and writes <out>.json / <out>.md: rows of decoder,
tau, concurrency, p50_ms, p95_ms, p99_ms, rps, errors, client_cpu_ms (the load generator's CPU per request),
plus the command, the machine (its CPU model), git sha and the machine's load average before and after. The
diffusion and spec rows decode at the bundle's taus (its validated operating tau, and its spec_tau) unless --tau /
--spec_tau say otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gr2.config import DiffusionConfig
from gr2.inference import CONFIG_FILE, VERIFIER_DIR
from gr2.report import git_sha, machine_info
from serving.schema import BATCHING, DECODE_IN, SERVE_DTYPES, ServeConfig, serving_dtype
from serving.serve_local import running, wait_ready


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def load_instances(
    examples: str | None, model_dir: str | None, n: int, n_candidates: int, seed: int
) -> list[dict]:
    rng = random.Random(seed)
    if examples:
        import pandas as pd

        df = pd.read_parquet(examples, columns=["user_id", "history", "candidates"]).head(n)
        return [
            {"user_id": str(r.user_id), "history": list(r.history), "candidates": list(r.candidates)}
            for r in df.itertuples()
        ]
    if model_dir is None:
        raise ValueError("load_instances needs examples or a model directory (its items.txt)")
    items = [ln.strip() for ln in (Path(model_dir) / "items.txt").read_text().splitlines() if ln.strip()]
    return [
        {"user_id": f"u{k}", "history": rng.sample(items, 5), "candidates": rng.sample(items, n_candidates)}
        for k in range(n)
    ]


@dataclass
class Samples:
    """Raw measurements of one decoder at one concurrency level (possibly gathered over several turns)."""

    lat: list[float] = field(default_factory=list)  # client-side latency of each successful request, ms
    queue: list[float] = field(default_factory=list)  # the predictor's own timing_ms per request
    model: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU time while sending (the load generator's share)


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON bodies, encoded before the clock starts.

    The load generator shares the machine with the servers, so its own CPU per request is taken from theirs: httpx
    spent 2.0-2.5 ms of CPU per request (`python -m deploy.loadtest` at 32 clients), this client 0.15-0.35 ms
    (docs/SERVING.md). It reads what uvicorn and a proxy send: a body with content-length, or chunked; anything
    else, or a connection the server closed, is a ConnectionError (the load test counts the request as an error)."""

    def __init__(self, url: str, timeout_s: float = 120.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{url!r}: expected http://host[:port] or https://host[:port]")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.timeout_s = timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST; a broken connection is closed and the error raised (the next post reopens)."""
        try:
            return await asyncio.wait_for(self._post(path, body), self.timeout_s)
        except BaseException:
            self.close()
            raise

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.tls or None
            )
        assert self.reader is not None
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
        self.writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        first = (await self.reader.readline()).split(b" ", 2)  # HTTP/1.1 200 OK
        if len(first) < 2 or not first[1].isdigit():  # (b"" when the server closed the connection)
            raise ConnectionError(f"no HTTP status line: {b' '.join(first)[:80]!r}")
        status = int(first[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                data += (await self.reader.readexactly(size + 2))[:-2]  # each chunk ends in CRLF
            await self.reader.readline()  # the empty trailer
        else:
            raise ConnectionError("response without content-length or chunked body")
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def measure(
    url: str,
    model: str,
    instances: list[dict],
    decoder: str,
    tau: float,
    concurrency: int,
    n_requests: int,
    first: int = 0,
    into: Samples | None = None,
) -> Samples:
    """Send requests first .. first + n_requests - 1 (instances cycled) from `concurrency` closed-loop clients,
    each on its own keep-alive connection."""
    out = into or Samples()
    path = f"{urllib.parse.urlsplit(url).path.rstrip('/')}/v1/models/{model}:predict"
    bodies = [
        json.dumps(
            {"instances": [{**instances[k % len(instances)], "decoder": decoder, "tau": tau}]}
        ).encode()
        for k in range(first, first + n_requests)
    ]
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def client() -> None:
        conn = Connection(url)
        try:
            while True:
                try:
                    body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                try:
                    status, data = await conn.post(path, body)
                except (TimeoutError, OSError, EOFError, ValueError):  # refused, reset, cut off, garbled
                    status, data = 0, b""
                if status == 200:
                    out.lat.append((time.perf_counter() - t0) * 1000)
                    timing = json.loads(data)["predictions"][0].get("timing_ms", {})
                    out.queue.append(timing.get("queue", float("nan")))
                    out.model.append(timing.get("model", float("nan")))
                else:
                    out.errors += 1
        finally:
            conn.close()

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    out.wall_s += time.perf_counter() - t0
    out.client_cpu_s += time.process_time() - cpu0
    return out


def summarize(decoder: str, tau: float, concurrency: int, s: Samples) -> dict[str, Any]:
    return {
        "decoder": decoder,
        "tau": None if decoder == "ar" else tau,  # spec: the draft's
        "concurrency": concurrency,
        "n": len(s.lat) + s.errors,
        "p50_ms": round(percentile(s.lat, 50), 2),
        "p95_ms": round(percentile(s.lat, 95), 2),
        "p99_ms": round(percentile(s.lat, 99), 2),
        "rps": round(len(s.lat) / s.wall_s, 2) if s.wall_s > 0 else 0.0,
        "client_cpu_ms": round(1000 * s.client_cpu_s / max(1, len(s.lat) + s.errors), 3),  # per request
        "errors": s.errors,
        # where the time goes: waiting in the batcher, and the model call (prompt encoding + decoding + parsing);
        # the rest of p50 is HTTP, JSON and request validation
        "queue_p50_ms": round(percentile(s.queue, 50), 2),
        "model_p50_ms": round(percentile(s.model, 50), 2),
    }


def compare(
    rows: list[dict[str, Any]], decoder: str = "diffusion", batching: str | None = None
) -> list[dict[str, Any]]:
    """Per concurrency measured for `decoder` and AR (behind the same batcher when `batching` is given): its
    p50 / AR p50 and its req/s / AR req/s."""
    by = {(r["decoder"], r["concurrency"]): r for r in rows if batching in (None, r.get("batching"))}
    out = []
    for (dec, c), d in sorted(by.items(), key=lambda kv: kv[0][1]):
        ar = by.get(("ar", c))
        if dec == decoder and ar is not None and ar["p50_ms"] > 0 and ar["rps"] > 0:
            out.append(
                {
                    "concurrency": c,
                    "p50_ratio": round(d["p50_ms"] / ar["p50_ms"], 3),
                    "rps_ratio": round(d["rps"] / ar["rps"], 3),
                }
            )
    return out


def bundle_tau(model_uri: str | None, key: str, given: float | None) -> float:
    """The tau a decoder's rows use: `given`, else the bundle's ("tau": BundleConfig.operating_tau, the one chosen
    on validation; "spec_tau": draft_tau), else the profile default (an AR bundle, or --url without a bundle)."""
    default = DiffusionConfig.eval_tau if key == "tau" else DiffusionConfig.spec_tau
    cfg = Path(model_uri) / CONFIG_FILE if model_uri else None
    if given is not None or cfg is None or not cfg.is_file():
        return default if given is None else given
    from gr2.generative import BundleConfig  # torch and transformers: only when a bundle is read

    bundle = BundleConfig.from_dict(json.loads(cfg.read_text()))
    tau = bundle.operating_tau() if key == "tau" else bundle.draft_tau()
    return default if tau is None else tau


def bundle_dtype(model_uri: str | None, asked: str) -> str:
    """What a server started with --dtype `asked` decodes the bundle at `model_uri` in (`serving_dtype`: "auto"
    reads the bundle's serve_dtype and this CPU's flags)."""
    cfg = Path(model_uri) / CONFIG_FILE if model_uri else None
    validated = json.loads(cfg.read_text()).get("serve_dtype") if cfg is not None and cfg.is_file() else None
    return serving_dtype(asked, validated)


def fmt_load(load: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def dtypes(report: dict[str, Any]) -> str:
    """What the servers decoded in, when not float32 alike (reports from before --dtype: float32)."""
    d = report.get("dtype") or {}
    model, ar = d.get("model", "float32"), d.get("ar", "float32")
    return "" if model == ar == "float32" else f"; dtype: diffusion and spec {model}, AR {ar}"


def to_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Serving load test",
        "",
        f"`{report['command']}`  ",
        f"machine: {report['machine']}; git {report['git_sha']}; load average (1, 5, 15 min) before "
        f"{fmt_load(report['load_average']['before'])}, after {fmt_load(report['load_average']['after'])}; "
        f"max_batch {report.get('max_batch')}, torch threads per server {report.get('torch_threads', 0) or 'default'}"
        + (f", continuous batching decodes in a {report['decode_in']}" if report.get("decode_in") else "")
        + dtypes(report),
        "",
        "| batching | decoder | tau | concurrency | p50 ms | p95 ms | p99 ms | req/s | errors | server: queue p50 ms "
        "| model p50 ms | client CPU ms per request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r.get('batching', 'micro')} | {r['decoder']} | {r['tau']} | {r['concurrency']} | {r['p50_ms']} | "
            f"{r['p95_ms']} | {r['p99_ms']} | {r['rps']} | {r['errors']} | {r.get('queue_p50_ms')} | "
            f"{r.get('model_p50_ms')} | {r.get('client_cpu_ms')} |"
        )
    for batching, ratios in report.get("by_batching", {}).items():
        for decoder in ("diffusion", "spec"):
            if ratios.get(f"{decoder}_vs_ar"):
                lines += [
                    "",
                    f"| {batching}: concurrency | {decoder} p50 / AR p50 | {decoder} req/s / AR req/s |",
                    "|---|---|---|",
                ]
                lines += [
                    f"| {c['concurrency']} | {c['p50_ratio']} | {c['rps_ratio']} |"
                    for c in ratios[f"{decoder}_vs_ar"]
                ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _server(a: argparse.Namespace, model_uri: str | None, batching: str, dtype: str) -> Iterator[str]:
    """The URL of a ready server: --url as given, or the predictor started on a free loopback port."""
    if a.url is not None:
        wait_ready(f"{a.url}/v1/models/{a.model_name}", timeout_s=300)
        yield a.url
        return
    args = ["--role", "predictor", "--model_uri", model_uri, "--model_name", a.model_name]
    args += ["--max_batch", str(a.max_batch), "--max_wait_ms", str(a.max_wait_ms), "--batching", batching]
    args += ["--torch_threads", str(a.torch_threads), "--dtype", dtype, "--decode_in", a.decode_in]
    with running(args, a.model_name) as url:
        yield url


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server; default: start the predictor for --model_uri")
    ap.add_argument("--model_uri")
    ap.add_argument("--ar_model_uri", help="the AR teacher bundle for the 'ar' rows (default: --model_uri)")
    ap.add_argument("--model_name", default="reranker")
    ap.add_argument("--examples", help="examples parquet to draw requests from")
    ap.add_argument("--decoders", nargs="+", default=["ar", "diffusion", "spec"])
    ap.add_argument(
        "--tau", type=float, help="the diffusion rows' commit threshold (default: the bundle's operating tau)"
    )
    ap.add_argument(
        "--spec_tau",
        type=float,
        help="the spec rows' draft threshold (default: the bundle's; spec decodes AR's tokens at any tau, this one "
        "sets its speed)",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 32])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument(
        "--turns",
        type=int,
        default=10,
        help="each level's requests are split in turns; the decoders alternate",
    )
    ap.add_argument(
        "--min_per_client",
        type=int,
        default=4,
        help="each turn sends at least this many requests per client: a turn with fewer requests than clients "
        "never reaches its concurrency (at 32, 200 requests in 10 turns kept at most 20 in flight)",
    )
    ap.add_argument("--n_candidates", type=int, default=10)
    ap.add_argument("--max_batch", type=int, default=16)
    ap.add_argument("--max_wait_ms", type=float, default=ServeConfig.max_wait_ms)
    ap.add_argument(
        "--batching",
        nargs="+",
        choices=BATCHING,
        default=[ServeConfig.batching],
        help="the servers' batcher, the same for every decoder (serving/batcher.py); several: side by side",
    )
    ap.add_argument(
        "--decode_in",
        choices=DECODE_IN,
        default=ServeConfig.decode_in,
        help="where each server's continuous batching decodes: a process beside its HTTP process, or a thread of it",
    )
    ap.add_argument(
        "--torch_threads",
        type=int,
        default=1,
        help="each predictor's torch threads (serve_local; the base manifest's 1; 0: one per core)",
    )
    ap.add_argument(
        "--dtype",
        choices=SERVE_DTYPES,
        default=ServeConfig.dtype,
        help="what the --model_uri server decodes in (the diffusion and spec rows; auto: the bundle's validated "
        "dtype where this CPU has bf16 units)",
    )
    ap.add_argument(
        "--ar_dtype",
        choices=SERVE_DTYPES,
        default=ServeConfig.dtype,
        help="what the AR rows' server decodes in (auto: the AR teacher's bundle validates no bf16, so float32, "
        "AR's faster one on the CPUs measured, docs/SERVING.md)",
    )
    ap.add_argument("--out", default="benchmarks/serving")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.url is None and not a.model_uri:
        sys.exit("give --url or --model_uri")
    if "spec" in a.decoders and a.model_uri and not (Path(a.model_uri) / VERIFIER_DIR).is_dir():
        sys.exit(
            f"spec needs a bundle that carries its verifier ({a.model_uri} has no {VERIFIER_DIR}/): pass --decoders"
        )
    rows, load_before, cpu = [], os.getloadavg(), machine_info()
    # Both servers stay up and the decoders alternate in short turns at each concurrency level, so a drift of
    # the machine hits AR and diffusion alike (the ratios are side by side). AR rows decode the AR teacher
    # (--ar_model_uri) when given: the student's own AR decoding is not the baseline the diffusion decoder is
    # meant to beat. Same server code, same requests, same settings.
    with contextlib.ExitStack() as stack:
        served = {}
        for batching, decoder in [(b, d) for b in a.batching for d in a.decoders]:
            uri = a.ar_model_uri if decoder == "ar" and a.ar_model_uri else a.model_uri
            dtype = bundle_dtype(uri, a.ar_dtype if decoder == "ar" else a.dtype)
            url = stack.enter_context(_server(a, uri, batching, dtype))
            instances = load_instances(a.examples, uri, a.requests, a.n_candidates, a.seed)
            tau = (
                bundle_tau(uri, "spec_tau", a.spec_tau)
                if decoder == "spec"
                else bundle_tau(uri, "tau", a.tau)
            )
            asyncio.run(measure(url, a.model_name, instances, decoder, tau, 1, 3))  # warm-up, not recorded
            # the dtype a row records: None for a running server (--url), which decodes in its own
            served[batching, decoder] = (uri, url, instances, tau, None if a.url else dtype)
        for c in a.concurrency:
            samples = {d: Samples() for d in served}
            n = max(a.requests, a.turns * c * a.min_per_client)  # instances cycled past --requests
            # turn t sends the same requests to every decoder, one decoder after another
            for t in range(a.turns):
                lo, hi = t * n // a.turns, (t + 1) * n // a.turns
                for key, (_, url, instances, tau, _) in served.items():
                    asyncio.run(
                        measure(url, a.model_name, instances, key[1], tau, c, hi - lo, lo, samples[key])
                    )
            for (batching, decoder), (uri, _, _, tau, served_in) in served.items():
                row = {**summarize(decoder, tau, c, samples[batching, decoder]), "model_uri": uri}
                row["batching"], row["dtype"] = batching, served_in
                print(json.dumps(row), flush=True)
                rows.append(row)
    # stable: per batcher and decoder, in concurrency order
    rows.sort(key=lambda r: (a.batching.index(r["batching"]), a.decoders.index(r["decoder"])))
    report = {
        "command": "python -m deploy.loadtest " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{cpu['cpu']} x{cpu['cores']}, python {cpu['python']}",
        "git_sha": git_sha(short=True),
        "load_average": {"before": load_before, "after": os.getloadavg()},  # 1, 5, 15 min
        "batching": a.batching,
        "max_batch": a.max_batch,
        "torch_threads": a.torch_threads,
        "decode_in": None if a.url else a.decode_in,
        "dtype": None
        if a.url
        else {
            "model": bundle_dtype(a.model_uri, a.dtype),
            "ar": bundle_dtype(a.ar_model_uri or a.model_uri, a.ar_dtype),
        },
        # the first batcher's ratios (the server's default when --batching is not given), then each batcher's
        "by_batching": {
            b: {"diffusion_vs_ar": compare(rows, "diffusion", b), "spec_vs_ar": compare(rows, "spec", b)}
            for b in a.batching
        },
        "rows": rows,
        "diffusion_vs_ar": compare(rows, "diffusion", a.batching[0]),
        "spec_vs_ar": compare(rows, "spec", a.batching[0]),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(report))
    return report


if __name__ == "__main__":
    main()
