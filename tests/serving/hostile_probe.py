"""Hostile-request probe (issue 18): every bad-input kind of tests/serving/test_robustness.py, and a few partial
failures, sent once to `python -m serving.serve_local` on 127.0.0.1 (transformer with a sqlite Feast repo, and
the predictor child behind it); records each answer's status, whether its error names the field, the time it
took and whether the server still answers a health probe and a valid request afterwards.

    python -m tests.serving.hostile_probe --out benchmarks/hostile_requests
    python -m tests.serving.hostile_probe --code <a checkout of another commit> --out /tmp/before

`--code` runs the servers from another source tree (same interpreter), to compare against an older commit.
Model control (unload) goes last: on a server that allows it, it leaves no model behind.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gr2.inference import FloorReranker
from serving.schema import ServeConfig
from serving.serve_local import free_port, wait_ready
from tests.serving.conftest import MODEL, build_feast_repo, load_ml_slice
from tests.serving.test_robustness import V1, hostile

JSON = {"content-type": "application/json"}
GOOD_TIMEOUT_S = 60.0


def half_sent(port: int, wait_s: float) -> tuple[int, str]:
    """A body that declares 100 bytes and sends 15: (status, error), or (0, why) when nothing came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(
            f"POST {V1} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        )
        s.sendall(b'{"instances": [')
        answer = b""
        try:
            while b"}" not in answer and (chunk := s.recv(4096)):
                answer += chunk
        except TimeoutError:
            return 0, f"no answer within {wait_s:g} s"
    head, _, body = answer.decode(errors="replace").partition("\r\n\r\n")
    status = int(head.split(" ")[1]) if head.startswith("HTTP/") else 0
    return status, body


def still_up(url: str, good: dict) -> bool:
    try:
        ready = httpx.get(f"{url}/v2/health/ready", timeout=GOOD_TIMEOUT_S).status_code == 200
        served = httpx.post(url + V1, json=good, timeout=GOOD_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False
    return ready and served


def error_of(r: httpx.Response) -> str:
    try:
        obj = r.json()
    except ValueError:
        return r.text[:200]
    return str(obj.get("error", obj.get("detail", obj)))[:200] if isinstance(obj, dict) else str(obj)[:200]


def probe(url: str, port: int, sl: dict, body_timeout_s: float) -> list[dict]:
    items = list(sl["items"]["item_id"])
    users = list(sl["history"])
    good = {"instances": [{"user_id": users[0], "candidates": items[:3]}]}
    rows = []

    def send(kind, path, body, ctype, expect, field, method="POST", client=None):
        headers = {"content-type": ctype} if ctype else {}
        t0 = time.perf_counter()
        try:
            r = (client or httpx).request(method, url + path, content=body, headers=headers, timeout=60)
            status, err = r.status_code, error_of(r)
        except httpx.HTTPError as e:
            status, err = 0, f"{type(e).__name__}: {e}"[:200]
        ms = (time.perf_counter() - t0) * 1000
        rows.append(
            {
                "kind": kind,
                "status": status,
                "expected": expect,
                "field": field,
                "named": field is not None and err.startswith(field),
                "ms": round(ms, 1),
                "bytes_sent": len(body),
                "up": still_up(url, good),
                "error": err[:120],
            }
        )

    send("valid request (baseline)", V1, json.dumps(good).encode(), "application/json", 200, None)
    for kind, path, body, ctype, status, field in hostile(items):
        send(kind, path, body, ctype, status, field)
    deep = b'{"instances": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with httpx.Client(base_url=url) as client:  # one keep-alive connection
        send(
            "JSON nested 1,000 levels, then a valid request on the same connection",
            V1,
            deep,
            "application/json",
            400,
            "body: JSON nested",
            client=client,
        )
        t0 = time.perf_counter()
        try:
            after = client.post(V1, json=good, timeout=60).status_code
        except httpx.HTTPError:
            after = 0
        rows[-1]["keep_alive_next"] = after
        rows[-1]["ms_next"] = round((time.perf_counter() - t0) * 1000, 1)
    # one id repeated: 173 KB, under the body limit (43,292 distinct ids would be over it: 413)
    many = {"instances": [{"user_id": users[0], "candidates": ["a"] * 43_292}]}
    send(
        "43,292 candidates in one instance",
        V1,
        json.dumps(many).encode(),
        "application/json",
        400,
        "instances[0].candidates: too many",
    )
    send(
        "unknown candidate id",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": [items[0], "nope"]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates[1]",
    )
    send(
        "one candidate",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": items[:1]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates: too few",
    )
    send(
        "duplicate candidate",
        V1,
        json.dumps({"instances": [{"user_id": users[0], "candidates": [items[0], items[0]]}]}).encode(),
        "application/json",
        400,
        "instances[0].candidates[1]: duplicate",
    )
    send(
        "tau 7",
        V1,
        json.dumps({"instances": [{**good["instances"][0], "tau": 7}]}).encode(),
        "application/json",
        400,
        "instances[0].tau",
    )
    send(
        "65 instances",
        V1,
        json.dumps({"instances": good["instances"] * 65}).encode(),
        "application/json",
        400,
        "instances: too many",
    )
    send(
        "body of 300,000 bytes",
        V1,
        json.dumps({"instances": [{**good["instances"][0], "history": ["h" * 250] * 1180}]}).encode(),
        "application/json",
        413,
        "body: payload",
    )
    send(
        "unknown model",
        f"/v1/models/nope{MODEL}:predict",
        json.dumps(good).encode(),
        "application/json",
        404,
        None,
    )
    near = near_limit_body(sl, items)
    send(
        f"{len(near):,}-byte body of 64 instances (under the limit; Feast adds histories)",
        V1,
        near,
        "application/json",
        200,
        None,
    )
    t0 = time.perf_counter()
    status, err = half_sent(port, body_timeout_s + 30)
    rows.append(
        {
            "kind": "half-sent body (declares 100 bytes, sends 15)",
            "status": status,
            "expected": 408,
            "named": err.startswith('{"error": "body'),
            "ms": round((time.perf_counter() - t0) * 1000, 1),
            "bytes_sent": 15,
            "up": still_up(url, good),
            "error": err[:120],
        }
    )
    send("model control: load", f"/v2/repository/models/{MODEL}/load", b"", None, 403, "model control is off")
    send(
        "model control: unload",
        f"/v2/repository/models/{MODEL}/unload",
        b"",
        None,
        403,
        "model control is off",
    )
    return rows


def near_limit_body(sl: dict, items: list[str]) -> bytes:
    """64 instances just under the client body limit: 40 known users (Feast fills their histories) and 24
    with client-sent histories of long ids (the padding)."""
    limit = ServeConfig().max_body_bytes
    instances = [{"user_id": u, "candidates": items[:10]} for u in list(sl["history"])[:40]]
    instances += [{"user_id": "filler", "candidates": items[:3], "history": []} for _ in range(24)]

    def body() -> bytes:
        return json.dumps({"instances": instances}, separators=(",", ":")).encode()

    while len(body()) < limit - 1000:
        min(instances[40:], key=lambda i: len(i["history"]))["history"].append("h" * 200)
    return body()


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Hostile requests against serve_local (transformer + predictor on 127.0.0.1)",
        "",
        f"`{meta['command']}`; {meta['machine']}; code at {meta['code']}. One request per kind, sent to the",
        "transformer; `ms` is the client's wall time for that one request on a shared machine (indicative only).",
        "`named`: the error message starts with the field the table's test expects; `up`: afterwards",
        "/v2/health/ready answers 200 and a valid request 200. The servers' log over the whole probe:",
        f"{meta['log_bytes']:,} bytes, {meta['log_tracebacks']} tracebacks.",
        "",
        "| bad-input kind | status | expected | field named | server up | ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = f" (next on the same connection: {r['keep_alive_next']})" if "keep_alive_next" in r else ""
        named = "–" if r.get("field", "") is None else "yes" if r["named"] else "no"
        lines.append(
            f"| {r['kind']} | {r['status']}{extra} | {r['expected']} | {named} "
            f"| {'yes' if r['up'] else 'no'} | {r['ms']:g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="writes <out>.json and <out>.md")
    p.add_argument("--code", default=None, help="source tree to run the servers from (default: this one)")
    p.add_argument("--body_timeout_s", type=float, default=ServeConfig.body_timeout_s)
    a = p.parse_args(argv)
    code = Path(a.code).resolve() if a.code else Path(__file__).resolve().parents[2]
    sl = load_ml_slice()
    with tempfile.TemporaryDirectory(prefix="gr2-hostile-") as tmp:
        tmp = Path(tmp)
        model = FloorReranker(name="floor", n_candidates=10, items=sl["items"]["item_id"]).save(tmp / "model")
        repo = build_feast_repo(sl, tmp / "feature_repo")
        port = free_port()
        log = (tmp / "server.log").open("w")
        args = ["--model_uri", str(model), "--feast_repo", str(repo), "--port", str(port)]
        if a.code is None:  # the older code may not know the flag; its default is 10 s either way
            args += ["--body_timeout_s", str(a.body_timeout_s)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "serving.serve_local", *args],
            cwd=code,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{url}/v1/models/{MODEL}", timeout_s=1800, proc=proc)
            rows = probe(url, port, sl, a.body_timeout_s)
            Path(f"{a.out}.partial.json").write_text(json.dumps(rows, indent=2) + "\n")  # before the shutdown
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        log_text = (tmp / "server.log").read_text(errors="replace")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True)
    meta = {
        "command": "python -m tests.serving.hostile_probe " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "code": rev.stdout.strip() or code.name,
        "log_tracebacks": log_text.count("Traceback"),
        "log_bytes": len(log_text),
    }
    Path(f"{a.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    Path(f"{a.out}.md").write_text(markdown(rows, meta))
    Path(f"{a.out}.partial.json").unlink(missing_ok=True)
    print(markdown(rows, meta))
    print(meta)


if __name__ == "__main__":
    main()
