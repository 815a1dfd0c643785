"""Continuous batching's decoding loop (`StreamWorker`), the same in a thread of the server's process or in a
decoding process of its own (`decode_process`, ServeConfig.decode_in; serving/batcher.py `ContinuousBatcher` runs it
either way). Kept apart from serving/batcher.py and serving/metrics.py so that a decoding process imports neither
kserve nor prometheus_client: what it reports (answers, failures, batch sizes) goes back to the server's process,
which records it.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gr2.inference import RankRequest, RankResult
from serving.schema import PrintableLogs

log = logging.getLogger(__name__)


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
class Job:
    """A request inside the decoding worker. Plain data: it crosses to a decoding process as it is."""

    key: int
    request: RankRequest
    decoder: str
    tau: float
    t_enqueue: float  # perf_counter at submit (CLOCK_MONOTONIC on Linux: one clock for both processes)
    t_join: float | None = None  # when its decode step began (None: still queued)


def stream_key(job: Job) -> tuple[str, float | None]:
    """The running decode a streamed job joins: one per decoder and tau (AR has no tau)."""
    return job.decoder, None if job.decoder == "ar" else job.tau


# What the worker reports, in order: ("done", key, Timed), ("fail", key, exception), ("batch", decoder, waits),
# ("shared_failed", decoder, requests): a shared step or rank() call failed and its requests run alone.
Event = tuple[str, Any, Any]


class StreamWorker:
    """The decoding loop of continuous batching (serving/batcher.py), the same in a thread or a process: it takes
    jobs from `inbox` (`get()` blocks, `get_nowait()` raises queue.Empty) and reports each outcome through `emit`."""

    def __init__(self, reranker: StreamingReranker, max_rows: int, inbox: Any, emit: Callable[[Event], None]):
        self.reranker, self.max_rows, self.inbox, self.emit = reranker, max_rows, inbox, emit
        self.streams: dict[tuple[str, float | None], Any] = {}  # (decoder, tau; AR: None) -> its Stream
        self.jobs: dict[int, Job] = {}  # a stream row's key -> its job

    def run(self) -> None:
        while True:
            try:
                self.turn()
            except Exception:  # never let the worker die (each job in hand is answered or failed: _answer)
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

    def _prompts(self, jobs: list[Job]) -> list[list[int] | None | Exception]:
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

    def _join(self, job: Job, prompt: list[int] | None | Exception) -> bool:
        """The request's prompt into its stream; False for a request that needs no decoding (cold start)."""
        try:
            if isinstance(prompt, Exception):
                raise prompt
            if prompt is None:
                return False
            key = stream_key(job)
            if key not in self.streams:
                self.streams[key] = self.reranker.stream(job.decoder, key[1], self.max_rows)
            self.streams[key].add(job.key, prompt)
            self.jobs[job.key] = job
        except Exception as e:  # this request's own failure (its ids, its options)
            self._answer(job, e, 0)
        return True

    def _step(self, key: tuple[str, float | None], stream: Any) -> None:
        t0 = time.perf_counter()
        try:
            finished = stream.step()
        except Exception:
            # Every job of this stream, not only the rows it lists: a step that failed while rows joined holds
            # them in neither its queue nor its rows.
            keys = [k for k, job in self.jobs.items() if stream_key(job) == key]
            jobs = [self.jobs.pop(k) for k in keys]
            log.exception("a %s decode step failed for %d requests: each runs alone", key[0], len(jobs))
            self._report(("shared_failed", key[0], len(jobs)))
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
            self._report(("batch", key[0], [t0 - job.t_enqueue for job in joined]))
        batch = stream.running + len(finished)
        for f in finished:
            job = self.jobs.pop(f.key)
            try:
                result: RankResult | Exception = self.reranker.stream_result(job.request, f.tokens, f.nfe)
            except Exception as e:
                result = e
            self._answer(job, result, batch)

    def _rank_together(self, jobs: list[Job]) -> None:
        """Requests that do not stream (spec, cold start): one rank() call per (decoder, tau), else each alone."""
        groups: dict[tuple[str, float], list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.decoder, job.tau), []).append(job)
        for (decoder, tau), group in groups.items():
            t0 = time.perf_counter()
            for job in group:
                job.t_join = t0
            self._report(("batch", decoder, [t0 - job.t_enqueue for job in group]))
            try:
                results = self.reranker.rank([job.request for job in group], decoder, tau)
                if len(results) != len(group):
                    raise RuntimeError(f"rank() returned {len(results)} results for {len(group)} requests")
            except Exception:
                log.exception("rank() failed for a batch of %d: each request runs alone", len(group))
                self._report(("shared_failed", decoder, len(group)))
                for job in group:
                    self._rank_alone(job)
                continue
            for job, result in zip(group, results, strict=True):
                self._answer(job, result, len(group))

    def _rank_alone(self, job: Job) -> None:
        try:
            result: RankResult | Exception = self.reranker.rank([job.request], job.decoder, job.tau)[0]
        except Exception as e:
            result = e
        self._answer(job, result, 1)

    def _report(self, event: Event) -> None:
        try:  # (metrics only: never at the cost of an answer)
            self.emit(event)
        except Exception:
            log.exception("metrics %s could not be sent", event[:2])

    def _answer(self, job: Job, result: RankResult | Exception, batch: int) -> None:
        """The job's answer (or its failure). Never raises: a job in hand that is neither answered nor failed would
        leave its client waiting for ever."""
        if not isinstance(result, Exception):
            t1 = time.perf_counter()
            t_join = job.t_join if job.t_join is not None else t1
            timed = Timed(result, (t_join - job.t_enqueue) * 1000, (t1 - t_join) * 1000, batch)
            try:
                self.emit(("done", job.key, timed))
                return
            except Exception as e:  # (e.g. it does not pickle): the request fails instead
                result = e
        try:
            self.emit(("fail", job.key, result))
        except Exception:  # (the server has gone: nobody waits for this answer)
            log.exception("request %s: neither its answer nor its failure could be sent", job.key)


@dataclass(frozen=True)
class ModelSource:
    """What a decoding process needs to load the predictor's model as the predictor did (it cannot be handed the
    loaded one)."""

    path: str  # the local model directory
    dtype: str = "float32"
    torch_threads: int = 1


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

    def get(self) -> Job:
        while not self.conn.poll(1.0):
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                raise SystemExit(0)
        return self._recv()

    def get_nowait(self) -> Job:
        if not self.conn.poll():
            raise queue.Empty
        return self._recv()

    def _recv(self) -> Job:
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
