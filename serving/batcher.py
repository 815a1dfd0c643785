"""An asyncio micro-batcher: concurrent requests are decoded together, off the event loop.

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
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

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
    queue_ms: float  # waiting for the batch to close and for the previous batch to finish
    model_ms: float  # the batch's rank() call
    batch_size: int


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
