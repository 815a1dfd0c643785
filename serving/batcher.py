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
import pickle
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gr2.inference import RankRequest, RankResult
from serving import metrics
from serving.schema import PrintableLogs, UpstreamError

log = logging.getLogger(__name__)
RankFn = Callable[[list[RankRequest], str, float], list[RankResult]]


@dataclass
class _Item:
    request: RankRequest
    decoder: str
    tau: float
    future: asyncio.Future
    t_enqueue: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Timed:
    result: RankResult
    queue_ms: (
        float  # waiting for the batch to close and for the previous batch to finish (continuous: to join)
    )
    model_ms: float  # the batch's rank() call (continuous: from joining the decode until the row finished)
    batch_size: (
        int  # the requests decoded together (continuous: the rows of the step the request finished in)
    )


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
@runtime_checkable
class StreamingReranker(Protocol):
    """What `ContinuousBatcher` needs of a model (gr2/generative.py `GenerativeReranker`)."""

    def rank(
        self, requests: list[RankRequest], decoder: str = ..., tau: float | None = ...
    ) -> list[RankResult]: ...

    def stream(self, decoder: str, tau: float | None, max_rows: int) -> Any: ...

    def prompts(self, requests: list[RankRequest]) -> list[list[int] | None]: ...

    def stream_result(self, request: RankRequest, tokens: list[int], nfe: float) -> RankResult: ...


STREAMED = ("ar", "diffusion")  # gr2/continuous.py STREAM_DECODERS (not imported: it pulls in torch)


@dataclass
class _Job:
    """A request inside the decoding worker. Plain data: it crosses to a decoding process as it is."""

    key: int
    request: RankRequest
    decoder: str
    tau: float
    t_enqueue: float  # perf_counter at submit (CLOCK_MONOTONIC on Linux: one clock for both processes)
    t_join: float | None = None  # when its decode step began (None: still queued)


# What the worker reports, in order: ("done", key, Timed), ("fail", key, exception), ("batch", decoder, waits).
Event = tuple[str, Any, Any]


class StreamWorker:
    """The decoding loop of continuous batching (module docstring), the same in a thread or a process: it takes
    jobs from `inbox` (`get()` blocks, `get_nowait()` raises queue.Empty) and reports each outcome through `emit`."""

    def __init__(self, reranker: StreamingReranker, max_rows: int, inbox: Any, emit: Callable[[Event], None]):
        self.reranker, self.max_rows, self.inbox, self.emit = reranker, max_rows, inbox, emit
        self.streams: dict[tuple[str, float | None], Any] = {}  # (decoder, tau; AR: None) -> its Stream
        self.jobs: dict[int, _Job] = {}  # a stream row's key -> its job

    def run(self) -> None:
        while True:
            try:
                self.turn()
            except Exception:  # never let the worker die: every job in hand was answered or failed
                log.exception("continuous batcher turn failed")

    def turn(self) -> None:
        busy = any(len(s) for s in self.streams.values())
        new = [self.inbox.get()] if not busy else []  # idle: sleep until a request comes
        while True:
            try:
                new.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        streamed = [job for job in new if job.decoder in STREAMED]
        together = [job for job in new if job.decoder not in STREAMED]
        together += [
            job
            for job, prompt in zip(streamed, self._prompts(streamed), strict=True)
            if not self._join(job, prompt)
        ]
        if together:
            self._rank_together(together)
        for key, stream in list(self.streams.items()):
            if len(stream):
                self._step(key, stream)

    def _prompts(self, jobs: list[_Job]) -> list[list[int] | None | Exception]:
        """Each request's prompt (None: cold start), encoded together; if that fails, one at a time, so that one
        request's bad ids are its own error."""
        if not jobs:
            return []
        try:
            return list(self.reranker.prompts([job.request for job in jobs]))
        except Exception:
            out: list[list[int] | None | Exception] = []
            for job in jobs:
                try:
                    out += self.reranker.prompts([job.request])
                except Exception as e:
                    out.append(e)
            return out

    def _join(self, job: _Job, prompt: list[int] | None | Exception) -> bool:
        """The request's prompt into its stream; False for a request that needs no decoding (cold start)."""
        try:
            if isinstance(prompt, Exception):
                raise prompt
            if prompt is None:
                return False
            key = (job.decoder, None if job.decoder == "ar" else job.tau)
            if key not in self.streams:
                self.streams[key] = self.reranker.stream(job.decoder, key[1], self.max_rows)
            self.streams[key].add(job.key, prompt)
            self.jobs[job.key] = job
        except Exception as e:  # this request's own failure (its ids, its options)
            self.emit(("fail", job.key, e))
        return True

    def _step(self, key: tuple[str, float | None], stream: Any) -> None:
        t0 = time.perf_counter()
        try:
            finished = stream.step()
        except Exception:
            log.exception("a %s decode step failed for %d requests: each runs alone", key[0], len(stream))
            jobs = [self.jobs.pop(k) for k in [*stream.keys, *(k for k, _ in stream.queue)]]
            del self.streams[key]  # its state is not trusted any more; the next request starts a new one
            for job in jobs:
                job.t_join = job.t_join or t0
                self._rank_alone(job)
            return
        joined = [self.jobs[k] for k in stream.keys if self.jobs[k].t_join is None]
        joined += [self.jobs[f.key] for f in finished if self.jobs[f.key].t_join is None]
        for job in joined:
            job.t_join = t0
        if joined:
            self.emit(("batch", key[0], [t0 - job.t_enqueue for job in joined]))
        batch = stream.running + len(finished)
        for f in finished:
            job = self.jobs.pop(f.key)
            try:
                self._answer(job, self.reranker.stream_result(job.request, f.tokens, f.nfe), batch)
            except Exception as e:
                self.emit(("fail", job.key, e))

    def _rank_together(self, jobs: list[_Job]) -> None:
        """Requests that do not stream (spec, cold start): one rank() call per (decoder, tau), else each alone."""
        groups: dict[tuple[str, float], list[_Job]] = {}
        for job in jobs:
            groups.setdefault((job.decoder, job.tau), []).append(job)
        for (decoder, tau), group in groups.items():
            t0 = time.perf_counter()
            for job in group:
                job.t_join = t0
            self.emit(("batch", decoder, [t0 - job.t_enqueue for job in group]))
            try:
                results = self.reranker.rank([job.request for job in group], decoder, tau)
            except Exception:
                log.exception("rank() failed for a batch of %d: each request runs alone", len(group))
                for job in group:
                    self._rank_alone(job)
                continue
            for job, result in zip(group, results, strict=True):
                self._answer(job, result, len(group))

    def _rank_alone(self, job: _Job) -> None:
        try:
            self._answer(job, self.reranker.rank([job.request], job.decoder, job.tau)[0], 1)
        except Exception as e:
            self.emit(("fail", job.key, e))

    def _answer(self, job: _Job, result: RankResult, batch: int) -> None:
        t1 = time.perf_counter()
        t_join = job.t_join if job.t_join is not None else t1
        self.emit(
            ("done", job.key, Timed(result, (t_join - job.t_enqueue) * 1000, (t1 - t_join) * 1000, batch))
        )


@dataclass
class _Row:
    """A submitted request's future, on its event loop."""

    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class ModelSource:
    """What a decoding process needs to load the predictor's model as the predictor did (it cannot be handed the
    loaded one)."""

    path: str  # the local model directory
    dtype: str = "float32"
    torch_threads: int = 1


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
            self.inbox.put(_Job(key, request, decoder, tau, time.perf_counter()))
        return await row.future

    def alive(self) -> bool:
        return self.worker.is_alive() and (self.process is None or self.process.is_alive())

    def _on_event(self, event: Event) -> None:
        kind, key, value = event
        if kind == "batch":
            metrics.observe_batch(key, value)
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
        try:
            kind, message = answers.recv()
        except EOFError:
            process.join(5)
            kind, message = "error", f"it exited with code {process.exitcode}"
        if kind != "ready":
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
        self.queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._feed, name="rank-jobs", daemon=True).start()

    def put(self, job: _Job | None) -> None:
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


def decode_process(source: ModelSource, max_rows: int, inbox: Any, out: Any) -> None:
    """A decoding process's main: load the model as the predictor did, say "ready", then decode what arrives."""
    import torch  # (here: the parent's import does not carry over to a spawned process)

    from gr2.inference import load_reranker

    # the server's log format, with a client's text escaped as in the server's process (serving/modelserver.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(PrintableLogs())
    torch.set_num_threads(source.torch_threads)
    try:
        reranker = load_reranker(source.path)
        reranker.cast(source.dtype)  # type: ignore[attr-defined]  # (only generative models stream)
    except Exception as e:
        out.send(("error", f"{type(e).__name__}: {e}"))
        return
    out.send(("ready", None))

    def emit(event: Event) -> None:
        kind, key, value = event
        if kind == "fail":
            value = portable(value)
        out.send((kind, key, value))

    StreamWorker(reranker, max_rows, _Inbox(inbox), emit).run()  # type: ignore[arg-type]


class _Inbox:
    """A decoding process's end of its inbox, as StreamWorker reads one. While idle it checks each second that
    the server is still there (a server killed without a goodbye would otherwise leave it waiting for ever); a
    closed pipe (the server stopped) ends the process."""

    def __init__(self, conn: Any):
        self.conn = conn

    def get(self) -> _Job:
        while not self.conn.poll(1.0):
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                raise SystemExit(0)
        return self._recv()

    def get_nowait(self) -> _Job:
        if not self.conn.poll():
            raise queue.Empty
        return self._recv()

    def _recv(self) -> _Job:
        try:
            return self.conn.recv()
        except EOFError:
            raise SystemExit(0) from None


def portable(error: Exception) -> Exception:
    """`error` as it can cross to the server: itself if it pickles back to the same type and message, else a
    RuntimeError naming it."""
    try:
        back = pickle.loads(pickle.dumps(error))
        if type(back) is type(error) and str(back) == str(error):
            return error
    except Exception:
        pass
    return RuntimeError(f"{type(error).__name__}: {error}")
