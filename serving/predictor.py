"""The KServe predictor: a `kserve.Model` serving any `gr2.inference.Reranker` over v1 and v2.

v1: POST /v1/models/<name>:predict  {"instances": [{user_id, candidates, history?, decoder?, tau?, trace?}],
                                     "parameters"?: {decoder?, tau?, trace?}}  -> {"predictions": [...]}
v2: POST /v2/models/<name>/infer    one BYTES input whose elements are the same instance objects as JSON
                                     strings; request "parameters" as in v1 -> one BYTES output "predictions".
Each prediction: ranking (item ids, best first), valid / fallback, reason, nfe, n_tokens, decoder, tau,
timing_ms {queue, model, total}, batch_size, history_len, history_unknown_dropped, and trace when asked for.

The model loads from a local directory or a storage URI (s3://bucket/prefix, file://path); in a cluster the
KServe storage initializer has already copied `storageUri` to /mnt/models. Decoding runs in the micro-batcher
(serving/batcher.py), so `predict` is async and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import kserve
from kserve.protocol.infer_type import InferRequest, InferResponse

from gr2.inference import DECODERS, Reranker, load_reranker
from serving import metrics
from serving.batcher import ContinuousBatcher, MicroBatcher
from serving.decoding import ModelSource, StreamingReranker
from serving.schema import (
    BadRequest,
    Request,
    ServeConfig,
    format_result,
    parse_instance,
    reply,
    request_instances,
    serving_dtype,
)


def fetch_model_dir(uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the model: `uri` itself, or a download of an s3:// prefix (S3_ENDPOINT_URL)."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    if not uri.startswith("s3://"):
        return Path(uri)
    import boto3  # lazy: only storage URIs need it
    from botocore.config import Config

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    dest = Path(cache_dir or tempfile.mkdtemp(prefix="gr2-model-"))
    s3 = boto3.client(
        "s3",
        endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None,
        config=Config(s3={"addressing_style": "path"}),
    )
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) :]
            if not rel or rel.endswith("/"):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(out))
            n += 1
    if n == 0:
        raise FileNotFoundError(f"{uri}: no objects under this prefix")
    return dest


class RerankPredictor(kserve.Model):
    def __init__(
        self,
        name: str,
        model_uri: str | None = None,
        reranker: Reranker | None = None,
        cfg: ServeConfig | None = None,
    ):
        super().__init__(name)
        if (model_uri is None) == (reranker is None):
            raise ValueError("pass exactly one of model_uri or reranker")
        self.model_uri = model_uri
        self.model_dir: Path | None = None  # where the model was loaded from (None: handed over loaded)
        self.reranker = reranker
        self.cfg = cfg or ServeConfig()
        self.batcher: ContinuousBatcher | MicroBatcher | None = None
        if reranker is not None:
            self.load()

    def load(self) -> bool:
        if self.reranker is None:
            assert self.model_uri is not None  # __init__: exactly one of model_uri or reranker
            self.model_dir = fetch_model_dir(self.model_uri)
            self.reranker = load_reranker(self.model_dir)
        cast = getattr(self.reranker, "cast", None)  # a generative model (the floor has no weights)
        if cast is not None:  # (--dtype auto: the model's validated dtype where it pays, `serving_dtype`)
            dtype = serving_dtype(self.cfg.dtype, getattr(self.reranker, "serve_dtype", None))
            self.cfg = dataclasses.replace(self.cfg, dtype=dtype)
            cast(dtype)
        tau = getattr(self.reranker, "tau", None)
        if tau is not None:  # a diffusion model's own operating point (its bundle's) is the default tau
            self.cfg = dataclasses.replace(self.cfg, default_tau=float(tau))
        spec_tau = getattr(self.reranker, "spec_tau", None)
        if spec_tau is not None:  # and its spec draft threshold the default tau of spec requests
            self.cfg = dataclasses.replace(self.cfg, default_spec_tau=float(spec_tau))
        if self.cfg.batching == "continuous" and isinstance(self.reranker, StreamingReranker):
            self.batcher = ContinuousBatcher(self.reranker, self.cfg.max_batch, self.decoding_source())
        else:
            self.batcher = MicroBatcher(self.reranker.rank, self.cfg.max_batch, self.cfg.max_wait_ms)
        self.ready = True
        return self.ready

    def decoding_source(self) -> ModelSource | None:
        """What a decoding process loads (ServeConfig.decode_in "process"): this model's directory, dtype and
        torch threads. None (decode in a thread) when asked for, or for a model handed over already loaded."""
        if self.cfg.decode_in != "process" or self.model_dir is None:
            return None
        import torch  # (a streaming model is a torch model: already imported)

        return ModelSource(str(self.model_dir), self.cfg.dtype, torch.get_num_threads())

    def stop(self) -> None:
        super().stop()
        if isinstance(self.batcher, ContinuousBatcher):
            self.batcher.close()

    async def healthy(self) -> bool:
        # ready = a model is loaded and its batcher runs (kserve's default only reads the flag)
        batcher = self.batcher
        alive = isinstance(batcher, MicroBatcher) or (batcher is not None and batcher.alive())
        return self.ready and self.reranker is not None and alive

    async def rank_instances(self, request: Request) -> list[dict[str, Any]]:
        """Validate every instance for the model first (all-or-nothing), then decode them concurrently via the
        batcher."""
        t0 = time.perf_counter()
        reranker, batcher = self.reranker, self.batcher
        if reranker is None or batcher is None:  # load() sets both; kserve routes only to a ready model
            raise RuntimeError(f"model {self.name!r} is not loaded")
        parsed = [
            parse_instance(raw, f"{request.where}[{i}]", reranker, self.cfg, request.options)
            for i, raw in enumerate(request.instances)
        ]
        # The decoders this model can run: e.g. "spec" needs a model that carries its verifier.
        can = getattr(reranker, "decoders", DECODERS)
        for i, (_, opts, _) in enumerate(parsed):
            if opts.decoder not in can:
                raise BadRequest(
                    f"{request.where}[{i}].decoder: {opts.decoder!r} is not available for this model ({list(can)})"
                )
        timed = await asyncio.gather(*(batcher.submit(req, o.decoder, o.tau) for req, o, _ in parsed))
        total = (time.perf_counter() - t0) * 1000
        return [
            format_result(
                req,
                t.result,
                opts,
                reranker.name,
                {"queue": round(t.queue_ms, 3), "model": round(t.model_ms, 3), "total": round(total, 3)},
                {
                    "batch_size": t.batch_size,
                    "history_len": len(req.history),
                    "history_unknown_dropped": dropped,
                },
            )
            for (req, opts, dropped), t in zip(parsed, timed, strict=True)
        ]

    def validate(self, payload: Any) -> Any:
        # our own parser validates (and names fields consistently for v1 and v2); skip kserve's shallow check
        return payload

    @metrics.instrument_predict  # requests by status and decoder, latency, validity, tokens per forward
    async def predict(
        self, payload: dict | InferRequest | bytes, headers: dict[str, str] | None = None
    ) -> dict | InferResponse:
        # a BadRequest propagates: serving/modelserver.py answers it with its status and one log line
        request = request_instances(payload, self.cfg)
        return reply(payload, self.name, await self.rank_instances(request))
