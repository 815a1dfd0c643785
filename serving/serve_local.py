"""Run the predictor (and the Feast transformer in front of it) on 127.0.0.1, as `make serve` does.

    python -m serving.serve_local --model_uri runs/<id>/model --feast_repo feature_repo --port 8080
        -> transformer on :8080, predictor on :8081 (a child process), both bound to 127.0.0.1
    python -m serving.serve_local --role predictor --model_uri ... --port 8081
    python -m serving.serve_local --role transformer --predictor_host 127.0.0.1:8081 --feast_repo ... --port 8080

Without --feast_repo/--feast_url, `all` serves the predictor alone on --port. In `all`, the transformer stops
(exit status 1) when its predictor child exits, rather than serving 503s from a dead predictor.

Model control (kserve's /v2/repository/models/<name>/load and /unload) is off unless --enable_model_control.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from serving.schema import BATCHING, DECODE_IN, SERVE_DTYPES, ServeConfig

log = logging.getLogger("serve_local")


def wait_ready(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200 (raises if `proc` dies or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def free_port() -> int:
    """A free TCP port on the loopback interface. Another process may take it before the caller binds it:
    start servers with `start_server`, which retries that race on a new port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """Stop a server process: SIGTERM, up to `grace_s` for its graceful shutdown (a busy machine can take
    long), then SIGKILL. Returns its exit status. Never raises because shutdown was slow."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


ADDRESS_IN_USE = (
    "address already in use"  # uvicorn, Python's socket, Go (Prometheus) all say this on a taken port
)


def start_server(
    command: Callable[[int], list[str]],
    ready_url: Callable[[int], str],
    log: Path,
    *,
    timeout_s: float = 600.0,
    attempts: int = 5,
    cwd: str | Path | None = None,
) -> tuple[subprocess.Popen, int]:
    """Start `command(port)` on a free loopback port and wait until `ready_url(port)` answers 200; returns the
    process and its port. Output goes to `log`. A server that exits because its port was taken between
    `free_port()` and its bind (another process won the race) is started again on a new port. The readiness
    wait is long because it ends as soon as the process dies, and a busy machine starts servers slowly."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            wait_ready(ready_url(port), timeout_s=timeout_s, proc=proc)
            return proc, port
        except RuntimeError:  # exited before it was ready
            if attempt < attempts and ADDRESS_IN_USE in log.read_text(errors="replace").lower():
                log.rename(log.with_name(f"{log.name}.port-taken-{attempt}"))  # kept: the retry is visible
                continue
            raise RuntimeError(
                f"{log.read_text(errors='replace')[-2000:]}\nserver failed: see {log}"
            ) from None
        except BaseException:
            stop(proc)
            raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running(args: list[str], model_name: str, log: Path | None = None) -> Iterator[str]:
    """Run `python -m serving.serve_local <args> --port P` (and, in role `all`, `--predictor_port Q`) on free
    loopback ports until the block exits; yields its URL once /v1/models/<model_name> answers. Output goes to
    `log` (or a temporary file)."""
    role = args[args.index("--role") + 1] if "--role" in args else "all"

    def command(port: int) -> list[str]:
        ports = ["--port", str(port)] + (["--predictor_port", str(free_port())] if role == "all" else [])
        return [sys.executable, "-m", "serving.serve_local", *args, *ports]

    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.log"
        proc, port = start_server(command, lambda p: f"http://127.0.0.1:{p}/v1/models/{model_name}", log)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


# The server's connection bounds (serving/modelserver.py), passed on to the predictor child of `--role all`.
CONNECTION_LIMITS = ("max_header_bytes", "max_headers", "header_timeout_s", "idle_timeout_s")


def model_candidates(model_uri: str | None) -> int | None:
    """The N of a local model directory (its reranker.json), else None (a storage URI is read by the predictor)."""
    from gr2.inference import RerankerLoadError, read_config

    if not model_uri or "://" in model_uri:
        return None
    try:
        n = read_config(model_uri).get("n_candidates")
    except RerankerLoadError:
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 2 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from serving.transformer import TransformerConfig  # lazy: imports kserve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["all", "predictor", "transformer"], default="all")
    p.add_argument("--model_name", default="reranker")
    p.add_argument("--model_uri", help="model directory, file:// or s3:// URI (predictor)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--http_port", dest="port", type=int, default=8080)  # KServe injects --http_port
    p.add_argument(
        "--predictor_port", type=int, default=None, help="role all: predictor port (default port+1)"
    )
    p.add_argument("--predictor_host", help="role transformer: host:port of the predictor")
    p.add_argument("--feast_repo")
    p.add_argument("--feast_yaml", help="feature_store.yaml to use instead of the repo's (prod: Redis)")
    p.add_argument("--feast_url")
    p.add_argument("--unknown_user", choices=["empty", "reject"], default="empty")
    p.add_argument("--unknown_items", choices=["reject", "pass"], default="reject")
    p.add_argument("--max_batch", type=int, default=ServeConfig.max_batch)
    p.add_argument("--max_wait_ms", type=float, default=ServeConfig.max_wait_ms)
    p.add_argument("--batching", choices=BATCHING, default=ServeConfig.batching)
    p.add_argument(
        "--decode_in",
        choices=DECODE_IN,
        default=ServeConfig.decode_in,
        help="role predictor: continuous batching decodes in a process beside the server's (its own GIL) or in "
        "a thread of it (docs/SERVING.md)",
    )
    p.add_argument(
        "--dtype",
        choices=SERVE_DTYPES,
        default=ServeConfig.dtype,
        help="role predictor: what a generative model decodes in (auto: bfloat16 where its bundle validated it and "
        "the CPU has bf16 units, where it is faster under load; else float32: docs/SERVING.md)",
    )
    p.add_argument(
        "--torch_threads",
        type=int,
        default=0,
        help="role predictor: torch's intra-op threads (0: torch's default, one per core). On 2 cores 1 is faster "
        "for every decoder and concurrency: the other core runs HTTP (docs/SERVING.md)",
    )
    p.add_argument("--max_body_bytes", type=int, default=ServeConfig.max_body_bytes)
    p.add_argument(
        "--body_timeout_s",
        type=float,
        default=ServeConfig.body_timeout_s,
        help="a request body not fully received within this gets 408",
    )
    p.add_argument(
        "--max_candidates",
        type=int,
        default=None,
        help="candidates per instance (default: the model's N when --model_uri is a local bundle, else "
        f"{ServeConfig.max_candidates}): the transformer refuses more before any feature lookup",
    )
    p.add_argument("--max_header_bytes", type=int, default=ServeConfig.max_header_bytes)
    p.add_argument("--max_headers", type=int, default=ServeConfig.max_headers)
    p.add_argument(
        "--header_timeout_s",
        type=float,
        default=ServeConfig.header_timeout_s,
        help="a request head begun but not complete within this gets 408",
    )
    p.add_argument(
        "--idle_timeout_s",
        type=int,
        default=ServeConfig.idle_timeout_s,
        help="a connection without a request in progress is closed after this",
    )
    p.add_argument(
        "--predictor_timeout_s",
        type=float,
        default=TransformerConfig.timeout_s,
        help="transformer: no answer from the predictor or the feature server within this gets 504",
    )
    p.add_argument(
        "--enable_model_control",
        action="store_true",
        help="allow kserve's model load/unload endpoints (off: anyone reaching the port could unload the model)",
    )
    return p.parse_known_args(argv)[0]  # kserve parses sys.argv too; tolerate its flags


def serve_predictor(a: argparse.Namespace, cfg: ServeConfig) -> None:
    from serving.modelserver import start_model_server
    from serving.predictor import RerankPredictor

    if not a.model_uri:
        sys.exit("--model_uri is required for the predictor")
    if a.torch_threads > 0:
        import torch  # (the predictor loads it with the model anyway)

        torch.set_num_threads(a.torch_threads)
    model = RerankPredictor(a.model_name, model_uri=a.model_uri, cfg=cfg)
    model.load()
    # the predictor also accepts the histories a transformer in front of it adds to a client's body
    start_model_server([model], a.port, a.host, cfg, cfg.forwarded_body_bytes(), a.enable_model_control)


def serve_transformer(a: argparse.Namespace, cfg: ServeConfig) -> None:
    from serving.modelserver import start_model_server
    from serving.transformer import FeastTransformer, TransformerConfig

    tcfg = TransformerConfig(
        predictor_host=a.predictor_host,
        feast_repo=a.feast_repo,
        feast_yaml=a.feast_yaml,
        feast_url=a.feast_url,
        unknown_user=a.unknown_user,
        unknown_items=a.unknown_items,
        timeout_s=a.predictor_timeout_s,
    )
    model = FeastTransformer(a.model_name, tcfg, cfg)
    model.load()
    start_model_server([model], a.port, a.host, cfg, cfg.max_body_bytes, a.enable_model_control)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request is noise
    a = parse_args(argv)
    cfg = ServeConfig(
        max_batch=a.max_batch,
        max_wait_ms=a.max_wait_ms,
        batching=a.batching,
        decode_in=a.decode_in,
        dtype=a.dtype,
        max_body_bytes=a.max_body_bytes,
        body_timeout_s=a.body_timeout_s,
        max_candidates=a.max_candidates or model_candidates(a.model_uri) or ServeConfig.max_candidates,
        max_header_bytes=a.max_header_bytes,
        max_headers=a.max_headers,
        header_timeout_s=a.header_timeout_s,
        idle_timeout_s=a.idle_timeout_s,
    )
    if a.role == "predictor" or (a.role == "all" and not (a.feast_repo or a.feast_url)):
        serve_predictor(a, cfg)
        return
    if a.role == "transformer":
        serve_transformer(a, cfg)
        return
    pport = a.predictor_port or a.port + 1
    child_args = [
        sys.executable,
        "-m",
        "serving.serve_local",
        "--role",
        "predictor",
        "--model_name",
        a.model_name,
        "--model_uri",
        a.model_uri or "",
        "--host",
        a.host,
        "--port",
        str(pport),
        "--max_batch",
        str(a.max_batch),
        "--max_wait_ms",
        str(a.max_wait_ms),
        "--batching",
        a.batching,
        "--decode_in",
        a.decode_in,
        "--dtype",
        a.dtype,
        "--torch_threads",
        str(a.torch_threads),
        "--max_body_bytes",
        str(a.max_body_bytes),
        "--body_timeout_s",
        str(a.body_timeout_s),
        *(["--enable_model_control"] if a.enable_model_control else []),
        *[f"--{k}={getattr(cfg, k)}" for k in CONNECTION_LIMITS],
    ]
    # A SIGTERM before the transformer's server takes over the signal must still run the `finally` below
    # (Python's default action would exit at once and orphan the predictor child). It is held until the `try`
    # (one arriving while Popen starts the child would otherwise exit before `child` exists); the child
    # starts with it unblocked.
    sigterm = {signal.SIGTERM}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.pthread_sigmask(signal.SIG_BLOCK, sigterm)
    child = subprocess.Popen(
        child_args, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, sigterm)
    )
    stopping = threading.Event()

    def stop_when_child_exits() -> None:
        rc = child.wait()
        if not stopping.is_set():
            log.error("the predictor (pid %d) exited with %s: stopping the transformer", child.pid, rc)
            os.kill(os.getpid(), signal.SIGTERM)  # the server's own graceful shutdown

    threading.Thread(target=stop_when_child_exits, daemon=True).start()
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigterm)  # a SIGTERM held since Popen exits from here
        # a long limit: the wait ends as soon as the child dies, and a busy machine loads the model slowly
        wait_ready(f"http://{a.host}:{pport}/v1/models/{a.model_name}", timeout_s=600, proc=child)
        log.info("predictor ready on %s:%d; starting the transformer on %s:%d", a.host, pport, a.host, a.port)
        a.predictor_host = f"{a.host}:{pport}"
        serve_transformer(a, cfg)
    finally:
        died = child.poll() is not None
        stopping.set()
        stop(child, grace_s=10)
    if died:
        sys.exit(f"the predictor exited with {child.returncode}")


if __name__ == "__main__":
    main()
