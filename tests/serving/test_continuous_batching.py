"""Continuous batching in the predictor (serving/batcher.py `ContinuousBatcher`), with the real trained toy bundle:
each request gets the ranking it gets alone whenever it arrives and whoever it decodes with; a request that arrives
during a decode joins it; a short list leaves before its long batch mates; a failing decode step or request fails
no other request."""

from __future__ import annotations

import asyncio
import os
import pickle
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from gr2.inference import RankRequest, load_reranker
from serving.batcher import ContinuousBatcher
from serving.decoding import Job, ModelSource, StreamWorker, portable
from serving.predictor import RerankPredictor
from serving.schema import BadRequest, ServeConfig, UpstreamError


@pytest.fixture(scope="module")
def reranker(model_dir):
    return load_reranker(model_dir)


def requests_of(ml_slice, n_requests: int, seed: int) -> list[tuple[RankRequest, str, float]]:
    """Lists of every length 2..N, users with history and without (cold start), AR, diffusion at two taus, spec."""
    rng = random.Random(seed)
    items = list(ml_slice["items"]["item_id"])
    users = list(ml_slice["history"])
    out = []
    for k in range(n_requests):
        n = rng.randint(2, 10)
        history = ml_slice["history"][users[k % len(users)]] if k % 5 else []
        req = RankRequest(users[k % len(users)], rng.sample(items, n), history)
        decoder, tau = rng.choice([("ar", 1.0), ("diffusion", 0.4), ("diffusion", 0.9), ("spec", 0.4)])
        out.append((req, decoder, tau))
    return out


def shared_failures(decoder: str) -> float:
    return REGISTRY.get_sample_value("gr2_shared_decode_failures_total", {"decoder": decoder})


def alone(reranker, req: RankRequest, decoder: str, tau: float):
    return reranker.rank([req], decoder, tau)[0]


def same(a, b) -> bool:
    return (a.ranking, a.valid, a.trace, a.n_tokens, a.ranker) == (
        b.ranking,
        b.valid,
        b.trace,
        b.n_tokens,
        b.ranker,
    )


def test_every_request_gets_its_ranking_alone_whenever_it_arrives(reranker, ml_slice):
    sent = requests_of(ml_slice, 36, seed=0)
    rng = random.Random(1)

    async def main():
        b = ContinuousBatcher(reranker, max_rows=5)  # few rows: requests also queue for a row

        async def client(k: int):
            await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over running decodes
            req, decoder, tau = sent[k]
            return await b.submit(req, decoder, tau)

        return await asyncio.gather(*(client(k) for k in range(len(sent)))), b

    out, b = asyncio.run(main())
    assert b.largest_batch > 1  # requests did decode together
    for (req, decoder, tau), timed in zip(sent, out, strict=True):
        assert same(timed.result, alone(reranker, req, decoder, tau)), (req, decoder, tau)
        assert sorted(timed.result.ranking) == sorted(req.candidates)


def test_a_request_that_arrives_during_a_decode_joins_it_and_a_short_list_leaves_first(reranker, ml_slice):
    items = list(ml_slice["items"]["item_id"])
    history = ml_slice["history"][list(ml_slice["history"])[0]]
    longs = [RankRequest(str(k), items[10 * k : 10 * k + 10], history) for k in range(3)]
    short = RankRequest("short", items[40:42], history)
    running: list[int] = []
    stepped, go = threading.Event(), threading.Event()
    make = reranker.stream

    def stream(decoder, tau, max_rows):  # the real stream, watched: rows per step
        s = make(decoder, tau, max_rows)
        step = s.step

        def watched():
            done = step()
            running.append(s.running + len(done))
            if not stepped.is_set():  # after the first step, hold the decode until the late request is in
                stepped.set()
                go.wait(30)
            return done

        s.step = watched
        return s

    async def main():
        watched = type("Watched", (), {})()  # the reranker with its stream watched
        for name in ("rank", "prompts", "stream_result"):
            setattr(watched, name, getattr(reranker, name))
        watched.stream = stream
        b = ContinuousBatcher(watched, max_rows=8)
        order: list[str] = []

        async def submit(req):
            await b.submit(req, "diffusion", 0.9)
            order.append(req.user_id)

        early = [asyncio.create_task(submit(r)) for r in longs]
        await asyncio.get_running_loop().run_in_executor(None, stepped.wait, 30)  # the decode runs
        late = asyncio.create_task(submit(short))
        await asyncio.sleep(0.05)  # the task has queued its request
        go.set()
        await asyncio.gather(*early, late)
        return order

    order = asyncio.run(main())
    assert max(running) == 4  # the late request decoded together with the three running ones
    assert order[0] == "short"  # 2 candidates: it left while the 10-candidate lists still decoded


def test_rows_join_after_a_block_the_layout_gave_whole(reranker, ml_slice):
    """The served bundle's layout gives some blocks whole (no forward: the cache stops a block earlier than the
    one before s0). Rows that join then are prefilled to where the cache stops, and get their tokens alone; they
    failed the step before (a cache of another length)."""
    items = list(ml_slice["items"]["item_id"])
    users = [u for u in ml_slice["history"] if ml_slice["history"][u]]
    joined_after_a_given_block = 0
    for seed in range(30):
        rng = random.Random(seed)
        reqs = [
            RankRequest(
                u, rng.sample(items, rng.randint(2, 10)), ml_slice["history"][u][: rng.randint(1, 30)]
            )
            for u in (users[k % len(users)] for k in range(12))
        ]
        prompts, tau = reranker.prompts(reqs), rng.choice([0.4, 0.9])
        stream, sent, got = reranker.stream("diffusion", tau, rng.choice([3, 5])), 0, {}
        while len(got) < len(reqs):
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                if sent < len(reqs):
                    stream.add(sent, prompts[sent])
                    sent += 1
            rounds = stream.rounds
            if (
                stream.queue
                and rounds is not None
                and 0 <= rounds.kv.stored < stream.s0 - stream.cfg.block_size
            ):
                joined_after_a_given_block += 1
            got.update((f.key, f) for f in stream.step())
        for k, req in enumerate(reqs):
            assert same(
                reranker.stream_result(req, got[k].tokens, got[k].nfe), alone(reranker, req, "diffusion", tau)
            )
    assert joined_after_a_given_block > 0  # the case under test happened


@pytest.mark.parametrize("where", ["step", "join"])
def test_a_failing_decode_step_or_request_fails_no_other(reranker, ml_slice, where):
    """A decode step that fails ("join": while rows joined, after they had left the stream's queue) sends each of
    its requests through rank() alone; a request with unknown ids fails alone."""
    sent = requests_of(ml_slice, 8, seed=2)
    sent = [(r, "diffusion", 0.4) for r, _, _ in sent]
    poison = RankRequest("poison", ["no-such-item", "nor-this"], sent[1][0].history)  # (a warm user)
    make, failed = reranker.stream, []

    def stream(decoder, tau, max_rows):  # the first stream's second step, or its first join, raises
        s = make(decoder, tau, max_rows)
        name = "step" if where == "step" else "merge"
        real, calls = getattr(s, name), []

        def flaky(*args):
            calls.append(1)
            if len(calls) == (2 if where == "step" else 1) and not failed:
                failed.append(1)
                raise RuntimeError(f"a decode {where} failed")
            return real(*args)

        setattr(s, name, flaky)
        return s

    async def main():
        flaky = type("Flaky", (), {})()
        for name in ("rank", "prompts", "stream_result"):
            setattr(flaky, name, getattr(reranker, name))
        flaky.stream = stream
        b = ContinuousBatcher(flaky, max_rows=3)  # (8 requests, 3 rows: the others join as rows leave)
        jobs = [b.submit(*s) for s in sent] + [b.submit(poison, "diffusion", 0.4)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 120), b

    before = shared_failures("diffusion")
    out, b = asyncio.run(main())
    assert failed and isinstance(out[-1], KeyError) and "unknown candidate" in str(out[-1])
    assert shared_failures("diffusion") == before + 1  # seen by Prometheus, not only in the log
    for (req, decoder, tau), timed in zip(sent, out[:-1], strict=True):
        assert same(timed.result, alone(reranker, req, decoder, tau))
    assert b.alive()


def test_a_bfloat16_predictor_ranks_every_request_and_spec_stays_its_verifiers(model_dir, reranker, ml_slice):
    """--dtype bfloat16 (ServeConfig.dtype): the predictor casts the model it decodes, not spec's verifier. Every
    request of every length, decoder and user gets a permutation of its own candidates, and spec's tokens are the
    float32 server's (they are the verifier's greedy tokens whatever drafts them)."""
    pred = RerankPredictor("reranker", model_uri=str(model_dir), cfg=ServeConfig(dtype="bfloat16"))
    pred.load()
    assert next(pred.reranker.model.parameters()).dtype == torch.bfloat16
    assert next(pred.reranker.verifier.parameters()).dtype == torch.float32
    sent = requests_of(ml_slice, 24, seed=2)

    async def main():
        return await asyncio.gather(*(pred.batcher.submit(req, d, tau) for req, d, tau in sent))

    for (req, decoder, tau), timed in zip(sent, asyncio.run(main()), strict=True):
        assert sorted(timed.result.ranking) == sorted(req.candidates)
        if decoder == "spec":
            assert same(timed.result, alone(reranker, req, decoder, tau)), req
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServeConfig(dtype="float16")


# ---------------------------------------------------------------------------------------- a decoding process
def test_a_decoding_process_gives_each_request_its_ranking_alone_and_each_failure_its_own(
    model_dir, reranker, ml_slice
):
    """ServeConfig.decode_in "process" (the served default): the same rankings as decoding alone in this process,
    from another process; a request with unknown ids fails alone, with its own error type and message."""
    sent = requests_of(ml_slice, 24, seed=3)
    poison = RankRequest("poison", ["no-such-item", "nor-this"], sent[1][0].history)
    b = ContinuousBatcher(reranker, max_rows=5, source=ModelSource(str(model_dir)))
    assert b.process.pid != os.getpid() and b.alive()
    rng = random.Random(4)

    async def client(req, decoder, tau):
        await asyncio.sleep(rng.random() * 0.3)
        return await b.submit(req, decoder, tau)

    async def main():
        jobs = [client(*s) for s in sent] + [client(poison, "diffusion", 0.4)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    out = asyncio.run(main())
    assert isinstance(out[-1], KeyError) and "unknown candidate" in str(out[-1])
    for (req, decoder, tau), timed in zip(sent, out[:-1], strict=True):
        assert same(timed.result, alone(reranker, req, decoder, tau)), (req, decoder, tau)
    assert b.largest_batch > 1
    b.close()
    assert not b.process.is_alive()


def test_a_killed_decoding_process_fails_only_the_requests_it_held_with_503_and_comes_back(
    model_dir, reranker, ml_slice
):
    sent = requests_of(ml_slice, 6, seed=5)
    b = ContinuousBatcher(reranker, max_rows=16, source=ModelSource(str(model_dir)))
    first = b.process

    async def main():
        os.kill(first.pid, signal.SIGSTOP)  # frozen: what is sent now waits in its inbox
        held = [asyncio.ensure_future(b.submit(*s)) for s in sent]
        await asyncio.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        lost = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 60)
        after = await asyncio.wait_for(b.submit(*sent[0]), 120)  # a new process answers
        return lost, after

    restarts = REGISTRY.get_sample_value("gr2_decoding_process_restarts_total")
    lost, after = asyncio.run(main())
    assert REGISTRY.get_sample_value("gr2_decoding_process_restarts_total") == restarts + 1
    assert all(isinstance(e, UpstreamError) and e.status == 503 for e in lost), lost
    assert "the decoding process exited" in str(lost[0])
    assert b.process is not first and b.alive()
    assert same(after.result, alone(reranker, *sent[0]))
    b.close()


def test_a_decoding_process_stuck_loading_fails_the_start_and_is_killed(model_dir, tmp_path, monkeypatch):
    import multiprocessing
    import shutil

    import serving.batcher

    stuck = shutil.copytree(model_dir, tmp_path / "model")
    (stuck / "sids.json").unlink()
    os.mkfifo(stuck / "sids.json")  # opening it blocks until a writer comes: none will
    monkeypatch.setattr(serving.batcher, "START_TIMEOUT_S", 3.0)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="did not load the model within 3 s"):
        # (only the decoding process's start is under test: the server's own model copy is not used)
        ContinuousBatcher(object(), max_rows=4, source=ModelSource(str(stuck)))  # type: ignore[arg-type]
    assert set(multiprocessing.active_children()) == before  # killed and reaped, not left behind


def test_the_predictor_decodes_in_a_process_unless_told_otherwise(model_dir):
    served = RerankPredictor("reranker", model_uri=str(model_dir))
    served.load()
    assert served.batcher.process is not None and served.batcher.alive()
    served.stop()
    assert not served.batcher.process.is_alive()
    threaded = RerankPredictor("reranker", model_uri=str(model_dir), cfg=ServeConfig(decode_in="thread"))
    threaded.load()
    assert threaded.batcher.process is None and threaded.batcher.alive()
    with pytest.raises(ValueError, match="decode_in must be one of"):
        ServeConfig(decode_in="gpu")


def test_an_answer_that_cannot_be_sent_fails_its_request_and_no_other(reranker, ml_slice):
    """A decoding process sends each answer pickled; one that cannot be sent must fail its own request, not vanish
    (its client would wait for ever) nor take its batch mates with it."""
    sent = requests_of(ml_slice, 10, seed=11)

    class Inbox(queue.SimpleQueue):
        def get(self, block=True, timeout=None):
            if self.empty():  # the worker would idle with jobs unanswered: one was lost
                raise AssertionError("the worker waits for new jobs while some were never answered")
            return self.get_nowait()

    inbox = Inbox()
    for key, (req, decoder, tau) in enumerate(sent):
        inbox.put(Job(key, req, decoder, tau, time.perf_counter()))
    outcome = {}

    def emit(event):
        kind, key, _ = event
        if kind == "done" and key in (3, 4):
            raise pickle.PicklingError("cannot pickle the answer")
        if kind != "batch":
            outcome[key] = kind

    worker = StreamWorker(reranker, 16, inbox, emit)
    while len(outcome) < len(sent):
        worker.turn()
    assert outcome == {key: "fail" if key in (3, 4) else "done" for key in range(len(sent))}


def test_errors_cross_to_the_server_with_their_status():
    for error in (BadRequest("instances[0].candidates: unknown", 413), UpstreamError("upstream", 503)):
        back = pickle.loads(pickle.dumps(portable(error)))
        assert (type(back), str(back), back.status) == (type(error), str(error), error.status)
    unpicklable = RuntimeError(lambda: 0)
    assert isinstance(portable(unpicklable), RuntimeError) and "function" in str(portable(unpicklable))


SERVER_SCRIPT = """
import sys, time
from gr2.inference import load_reranker
from serving.batcher import ContinuousBatcher
from serving.decoding import ModelSource

if __name__ == "__main__":
    b = ContinuousBatcher(load_reranker(sys.argv[1]), 4, ModelSource(sys.argv[1]))
    print(b.process.pid, flush=True)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_decoding_process_whose_server_was_killed_exits(model_dir, tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE, cwd=root, env=env
    )
    decoder = int(server.stdout.readline())
    assert running(decoder)
    server.kill()  # no goodbye: no atexit, no close()
    server.wait()
    deadline = time.monotonic() + 30
    while running(decoder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(decoder)
