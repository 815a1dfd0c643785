"""The batchers: concurrent requests are decoded together, off the event loop. Both answer `submit(request,
decoder, tau) -> Timed`.

`ContinuousBatcher` (the default for a generative model: ServeConfig.batching): continuous batching. A worker
thread runs one running decode per (decoder, tau) (gr2/continuous.py `Stream`). A request joins its decode at the
next block boundary (diffusion) or the next token (AR) and is answered as soon as its own row has finished, so it
waits neither for a batch to fill, nor for the batch before it, nor for its slowest batch mate; its latency counts
from its own arrival. Requests that do not stream (spec, and cold-start users, whom no decoder ranks) share one
`rank()` call per worker turn. When a decode step fails, each of its requests runs
alone through `rank()`, so a request that fails fails only itself.

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
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gr2.inference import RankRequest, RankResult
from serving import metrics

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
class _Row:
    request: RankRequest
    decoder: str
    tau: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    t_enqueue: float = field(default_factory=time.perf_counter)
    t_join: float | None = None  # when its decode step began (None: still queued)


class ContinuousBatcher:
    """Continuous batching (module docstring) over `reranker`, at most `max_rows` rows per running decode."""

    def __init__(self, reranker: StreamingReranker, max_rows: int = 16):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.reranker, self.max_rows = reranker, max_rows
        self.inbox: queue.SimpleQueue[_Row] = queue.SimpleQueue()
        self.streams: dict[tuple[str, float | None], Any] = {}  # (decoder, tau; AR: None) -> its Stream
        self.rows: dict[int, _Row] = {}  # a stream row's key -> its request
        self.ids = itertools.count()
        self.largest_batch = 0
        self.worker = threading.Thread(target=self._run, name="rank-stream", daemon=True)
        self.worker.start()

    async def submit(self, request: RankRequest, decoder: str, tau: float) -> Timed:
        loop = asyncio.get_running_loop()
        row = _Row(request, decoder, tau, loop.create_future(), loop)
        self.inbox.put(row)
        return await row.future

    def alive(self) -> bool:
        return self.worker.is_alive()

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        while True:
            try:
                self._turn()
            except Exception:  # never let the worker die: every request in hand was answered or failed
                log.exception("continuous batcher turn failed")

    def _turn(self) -> None:
        busy = any(len(s) for s in self.streams.values())
        new = [self.inbox.get()] if not busy else []  # idle: sleep until a request comes
        while True:
            try:
                new.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        streamed = [row for row in new if row.decoder in STREAMED]
        together = [row for row in new if row.decoder not in STREAMED]
        together += [
            row
            for row, prompt in zip(streamed, self._prompts(streamed), strict=True)
            if not self._join(row, prompt)
        ]
        if together:
            self._rank_together(together)
        for key, stream in list(self.streams.items()):
            if len(stream):
                self._step(key, stream)

    def _prompts(self, rows: list[_Row]) -> list[list[int] | None | Exception]:
        """Each request's prompt (None: cold start), encoded together; if that fails, one at a time, so that one
        request's bad ids are its own error."""
        if not rows:
            return []
        try:
            return list(self.reranker.prompts([row.request for row in rows]))
        except Exception:
            out: list[list[int] | None | Exception] = []
            for row in rows:
                try:
                    out += self.reranker.prompts([row.request])
                except Exception as e:
                    out.append(e)
            return out

    def _join(self, row: _Row, prompt: list[int] | None | Exception) -> bool:
        """The request's prompt into its stream; False for a request that needs no decoding (cold start)."""
        try:
            if isinstance(prompt, Exception):
                raise prompt
            if prompt is None:
                return False
            key = (row.decoder, None if row.decoder == "ar" else row.tau)
            if key not in self.streams:
                self.streams[key] = self.reranker.stream(row.decoder, key[1], self.max_rows)
            rid = next(self.ids)
            self.streams[key].add(rid, prompt)
            self.rows[rid] = row
        except Exception as e:  # this request's own failure (its ids, its options)
            self._fail(row, e)
        return True

    def _step(self, key: tuple[str, float | None], stream: Any) -> None:
        t0 = time.perf_counter()
        try:
            finished = stream.step()
        except Exception:
            log.exception("a %s decode step failed for %d requests: each runs alone", key[0], len(stream))
            rows = [self.rows.pop(k) for k in [*stream.keys, *(k for k, _ in stream.queue)]]
            del self.streams[key]  # its state is not trusted any more; the next request starts a new one
            for row in rows:
                row.t_join = row.t_join or t0
                self._rank_alone(row)
            return
        joined = [self.rows[k] for k in stream.keys if self.rows[k].t_join is None]
        joined += [self.rows[f.key] for f in finished if self.rows[f.key].t_join is None]
        for row in joined:
            row.t_join = t0
        if joined:
            metrics.observe_batch(key[0], [t0 - row.t_enqueue for row in joined])
        batch = stream.running + len(finished)
        self.largest_batch = max(self.largest_batch, batch)
        for f in finished:
            row = self.rows.pop(f.key)
            try:
                self._answer(row, self.reranker.stream_result(row.request, f.tokens, f.nfe), batch)
            except Exception as e:
                self._fail(row, e)

    def _rank_together(self, rows: list[_Row]) -> None:
        """Requests that do not stream (spec, cold start): one rank() call per (decoder, tau), else each alone."""
        groups: dict[tuple[str, float], list[_Row]] = {}
        for row in rows:
            groups.setdefault((row.decoder, row.tau), []).append(row)
        for (decoder, tau), group in groups.items():
            t0 = time.perf_counter()
            for row in group:
                row.t_join = t0
            metrics.observe_batch(decoder, [t0 - row.t_enqueue for row in group])
            try:
                results = self.reranker.rank([row.request for row in group], decoder, tau)
            except Exception:
                log.exception("rank() failed for a batch of %d: each request runs alone", len(group))
                for row in group:
                    self._rank_alone(row)
                continue
            self.largest_batch = max(self.largest_batch, len(group))
            for row, result in zip(group, results, strict=True):
                self._answer(row, result, len(group))

    def _rank_alone(self, row: _Row) -> None:
        try:
            self._answer(row, self.reranker.rank([row.request], row.decoder, row.tau)[0], 1)
        except Exception as e:
            self._fail(row, e)

    def _answer(self, row: _Row, result: RankResult, batch: int) -> None:
        t1 = time.perf_counter()
        t_join = row.t_join if row.t_join is not None else t1
        timed = Timed(result, (t_join - row.t_enqueue) * 1000, (t1 - t_join) * 1000, batch)
        self._settle(row, lambda f: f.set_result(timed))

    def _fail(self, row: _Row, error: Exception) -> None:
        self._settle(row, lambda f: f.set_exception(error))

    @staticmethod
    def _settle(row: _Row, how: Callable[[asyncio.Future], None]) -> None:
        def settle() -> None:
            if not row.future.done():  # (a client that went away cancelled it)
                how(row.future)

        try:
            row.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the request's event loop has closed: nobody waits for the answer
            pass
