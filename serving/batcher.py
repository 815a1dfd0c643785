"""The batchers: concurrent requests are decoded together, off the event loop. Both answer `submit(request,
decoder, tau) -> Timed`.

`ContinuousBatcher` (the default for a generative model: ServeConfig.batching): continuous batching. Its worker
(`StreamWorker`, in a decoding process of its own by default: ServeConfig.decode_in) runs one running decode per
(decoder, tau) (gr2/continuous.py `Stream`). A request joins its decode at the next block boundary (diffusion) or
the next token (AR) and is answered as soon as its own row has finished, so it waits neither for a batch to fill,
nor for the batch before it, nor for its slowest batch mate; its latency counts from its own arrival. Requests
that do not stream (spec, and cold-start users, whom no decoder ranks) share one `rank()` call per worker turn.
When a decode step fails, each of its requests runs alone through `rank()`, so a request that fails fails only
itself; when the decoding process dies, the requests it held get 503 and a new one starts.

`MicroBatcher` (models without streams, such as the floor, and ServeConfig.batching "micro"), below:

The first queued item opens a batch; the batch closes when it holds `max_batch` items or `max_wait_ms` has
passed (requests that queued while the previous batch ran join at once, so max_wait_ms=0 is pure greedy
batching: no added latency when idle, natural batches under load). Items are grouped by (decoder, tau) because
`Reranker.rank` takes one of each per call; lists of different lengths share a call (the model pads them: padding
measured faster than a call per length, docs/SERVING.md). Each group runs in a single-thread executor (one model
call at a time: torch models are not re-entrant, and the event loop stays free to accept requests and answer
health probes, kserve#3950). When a shared call fails, each of its requests runs alone, so a request that fails
fails only itself.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gr2.inference import RankRequest, RankResult
from serving import metrics
from serving.decoding import (
    Event,
    Job,
    ModelSource,
    StreamingReranker,
    StreamWorker,
    Timed,
    decode_process,
)
from serving.schema import UpstreamError

log = logging.getLogger(__name__)
RankFn = Callable[[list[RankRequest], str, float], list[RankResult]]
# How long a decoding process may take to load its model (a pretrained backbone from a slow disk included) before
# it is killed and the start fails (at a restart: tried again).
START_TIMEOUT_S = 600.0


@dataclass
class _Item:
    request: RankRequest
    decoder: str
    tau: float
    future: asyncio.Future
    t_enqueue: float = field(default_factory=time.perf_counter)


class MicroBatcher:
    def __init__(self, rank: RankFn, max_batch: int = 16, max_wait_ms: float = 5.0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.rank = rank
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank")
        self.batches_run = 0  # observable: how many rank() calls were made
        self.largest_batch = 0
        self._queue: asyncio.Queue[_Item] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None

    def _ensure_worker(self) -> asyncio.Queue[_Item]:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop or self._worker is None or self._worker.done():
            # (re)bind to the running loop: a queue belongs to the loop it was created on
            self._loop = loop
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue))
        return self._queue

    async def submit(self, request: RankRequest, decoder: str, tau: float) -> Timed:
        queue = self._ensure_worker()
        fut = asyncio.get_running_loop().create_future()
        await queue.put(_Item(request, decoder, tau, fut))
        return await fut

    async def _collect(self, queue: asyncio.Queue[_Item]) -> list[_Item]:
        batch = [await queue.get()]
        deadline = time.perf_counter() + self.max_wait
        while len(batch) < self.max_batch:
            try:  # whatever queued up while the previous batch ran joins without waiting
                batch.append(queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _run(self, queue: asyncio.Queue[_Item]) -> None:
        while True:
            batch = await self._collect(queue)
            groups: dict[tuple[str, float], list[_Item]] = {}
            for it in batch:
                groups.setdefault((it.decoder, it.tau), []).append(it)
            for (decoder, tau), items in groups.items():
                metrics.observe_batch(decoder, [time.perf_counter() - it.t_enqueue for it in items])
                try:
                    await self._decode(items, decoder, tau)
                except Exception:  # any failure of the shared call: each request alone, below
                    log.exception("rank() failed for a batch of %d: each request runs alone", len(items))
                    metrics.observe_shared_failure(decoder)
                    for it in items:  # one request's failure (or shape) never fails another's
                        try:
                            await self._decode([it], decoder, tau)
                        except Exception as e:  # the worker keeps running
                            if not it.future.done():
                                it.future.set_exception(e)

    async def _decode(self, items: list[_Item], decoder: str, tau: float) -> None:
        """One rank() call for `items` (lists of any lengths: the model pads them), off the event loop; each
        item's future gets its result."""
        t0 = time.perf_counter()
        results = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.rank, [it.request for it in items], decoder, tau
        )
        if len(results) != len(items):
            raise RuntimeError(f"rank() returned {len(results)} results for {len(items)} requests")
        t1 = time.perf_counter()
        self.batches_run += 1
        self.largest_batch = max(self.largest_batch, len(items))
        for it, res in zip(items, results, strict=True):
            if not it.future.done():
                it.future.set_result(Timed(res, (t0 - it.t_enqueue) * 1000, (t1 - t0) * 1000, len(items)))


# ---------------------------------------------------------------------------------------------- continuous
@dataclass
class _Row:
    """A submitted request's future, on its event loop."""

    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class ContinuousBatcher:
    """Continuous batching (module docstring) over `reranker`, at most `max_rows` rows per running decode.

    With `source`, the decoding worker runs in a process of its own that loads `source` (ServeConfig.decode_in
    "process", the default of a served model): the event loop's Python (HTTP, JSON, validation) and the decoding
    loop's Python then hold two GILs, not one, which is what the server lost to its decoding loop under load
    (docs/SERVING.md). Requests and answers cross through pipes; if the process dies, the requests it held fail
    with 503 and a new process starts. Without `source` the worker is a thread of this process."""

    def __init__(self, reranker: StreamingReranker, max_rows: int = 16, source: ModelSource | None = None):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.reranker, self.max_rows, self.source = reranker, max_rows, source
        self.pending: dict[int, _Row] = {}  # a job's key -> its request's future
        self.ids = itertools.count()
        self.largest_batch = 0  # the most rows any request finished among
        self.lock = threading.Lock()  # a submit and a process restart see one inbox
        self.process: Any = None
        self.closing = False
        if source is None:
            self.inbox: Any = queue.SimpleQueue()
            worker = StreamWorker(reranker, max_rows, self.inbox, self._on_event)
            self.worker = threading.Thread(target=worker.run, name="rank-stream", daemon=True)
        else:
            answers = self._start_process()
            self.worker = threading.Thread(
                target=self._read, args=(answers,), name="rank-answers", daemon=True
            )
            atexit.register(self.close)  # before multiprocessing's own exit handler stops the process unasked
        self.worker.start()

    def close(self) -> None:
        """Stop the decoding process, if any, for good (the server stops): its inbox closes, so it exits after
        its current step; if it has not within 5 s, it is terminated."""
        self.closing = True
        if isinstance(self.inbox, _Feeder):
            self.inbox.stop()
        if self.process is not None:
            self.process.join(5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)

    async def submit(self, request: RankRequest, decoder: str, tau: float) -> Timed:
        loop = asyncio.get_running_loop()
        row = _Row(loop.create_future(), loop)
        with self.lock:
            key = next(self.ids)
            self.pending[key] = row
            self.inbox.put(Job(key, request, decoder, tau, time.perf_counter()))
        return await row.future

    def alive(self) -> bool:
        return self.worker.is_alive() and (self.process is None or self.process.is_alive())

    def _on_event(self, event: Event) -> None:
        kind, key, value = event
        if kind == "batch":
            metrics.observe_batch(key, value)
            return
        if kind == "shared_failed":
            metrics.observe_shared_failure(key)
            return
        row = self.pending.pop(key, None)
        if row is None:
            return
        if kind == "done":
            self.largest_batch = max(self.largest_batch, value.batch_size)
            self._settle(row, lambda f: f.set_result(value))
        else:
            self._settle(row, lambda f: f.set_exception(value))

    @staticmethod
    def _settle(row: _Row, how: Callable[[asyncio.Future], None]) -> None:
        def settle() -> None:
            if not row.future.done():  # (a client that went away cancelled it)
                how(row.future)

        try:
            row.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the request's event loop has closed: nobody waits for the answer
            pass

    def _on_lost(self, row: _Row, code: int | None) -> None:
        error = UpstreamError(f"the decoding process exited (code {code}) before answering", 503)
        self._settle(row, lambda f: f.set_exception(error))

    # ------------------------------------------------------------------ a decoding process
    def _start_process(self) -> Any:
        """A new decoding process with a new inbox, once it has loaded the model; returns the end its answers
        arrive on. Raises RuntimeError if it could not load the model."""
        ctx = multiprocessing.get_context("spawn")  # not fork: this process has threads (and torch's)
        (jobs, inbox), (answers, out) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=decode_process,
            args=(self.source, self.max_rows, jobs, out),
            name="gr2-decoder",
            daemon=True,
        )
        process.start()
        out.close()  # the child holds the only writing end: its exit reads as EOF here
        jobs.close()  # likewise its reading end of the inbox
        kind, message = "error", f"it did not load the model within {START_TIMEOUT_S:.0f} s"
        try:
            if answers.poll(START_TIMEOUT_S):  # a process stuck loading must not hold the server for ever
                kind, message = answers.recv()
        except EOFError:
            process.join(5)
            message = f"it exited with code {process.exitcode}"
        if kind != "ready":
            if process.is_alive():
                process.kill()
                process.join(5)
            raise RuntimeError(f"the decoding process could not start: {message}")
        self.inbox, self.process = _Feeder(inbox), process
        return answers

    def _read(self, answers: Any) -> None:
        """The answers thread: each answer to its request; when the process dies, fail what it held and start
        another."""
        while True:
            try:
                event = answers.recv()
            except (EOFError, OSError):
                if self.closing:
                    return
                answers = self._restart()
                continue
            try:
                self._on_event(event)
            except Exception:  # never let this thread die: every other request still needs its answer
                log.exception("an answer of the decoding process could not be delivered")

    def _restart(self) -> Any:
        """After the decoding process died: its requests fail with 503, a new process starts (retried every 5 s
        until it does), and what was sent meanwhile goes to it. Returns the new process's answers end."""
        self.process.join(5)
        code = self.process.exitcode
        log.error("the decoding process exited (code %s): its requests fail with 503; restarting it", code)
        metrics.PROCESS_RESTARTS.inc()
        with self.lock:  # requests from now on wait here until the new process runs
            lost, self.pending = self.pending, {}
            old, self.inbox = self.inbox, queue.SimpleQueue()
        old.stop()
        for row in lost.values():
            self._on_lost(row, code)
        waiting = self.inbox
        while True:
            try:
                answers = self._start_process()
                break
            except Exception:
                log.exception("restarting the decoding process failed; trying again in 5 s")
                time.sleep(5)
        with self.lock:
            while True:
                try:
                    self.inbox.put(waiting.get_nowait())
                except queue.Empty:
                    return answers


class _Feeder:
    """The server's end of a decoding process's inbox: `put` never blocks the event loop (a thread writes to the
    pipe, which holds 64 KB where one request can be 256 KB)."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._feed, name="rank-jobs", daemon=True).start()

    def put(self, job: Job | None) -> None:
        self.queue.put(job)

    def stop(self) -> None:
        self.queue.put(None)

    def _feed(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self.conn.send(job)
            except OSError:  # the process is gone: the answers thread fails its requests
                break
        self.conn.close()
