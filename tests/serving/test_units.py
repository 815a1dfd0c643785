"""In-process tests: the micro-batcher, loading a model from an s3:// URI (moto server on loopback), and the
transformer's unknown-user / unknown-item policies against the real Feast online store."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import boto3
import pytest
from botocore.config import Config
from kserve.errors import InvalidInput
from moto.server import ThreadedMotoServer

from components.artifact_store import open_store
from gr2.inference import CONFIG_FILE, FloorReranker, RankRequest
from serving.batcher import MicroBatcher
from serving.predictor import RerankPredictor
from serving.schema import BadRequest, ServeConfig, serving_dtype
from serving.transformer import FeastTransformer, TransformerConfig


def test_batcher_batches_concurrent_requests_and_keeps_order():
    calls = []

    def rank(reqs, decoder, tau):
        calls.append((len(reqs), decoder, tau))
        return FloorReranker().rank(reqs)

    async def main():
        b = MicroBatcher(rank, max_batch=4, max_wait_ms=50)
        reqs = [RankRequest(str(k), [f"a{k}", f"b{k}"], []) for k in range(10)]
        out = await asyncio.gather(
            *(b.submit(r, "diffusion", 0.9) for r in reqs[:9]), b.submit(reqs[9], "ar", 0.9)
        )
        return reqs, out, b

    reqs, out, b = asyncio.run(main())
    assert [t.result.ranking for t in out] == [r.candidates for r in reqs]
    # 9 diffusion requests -> batches of 4, 4 and (4 minus the ar one = 1 grouped apart); ar alone
    assert sorted(calls) == sorted(
        [(4, "diffusion", 0.9), (4, "diffusion", 0.9), (1, "diffusion", 0.9), (1, "ar", 0.9)]
    )
    assert b.largest_batch == 4 and out[0].batch_size == 4


def test_greedy_batcher_runs_an_idle_request_at_once_and_batches_what_queued_meanwhile():
    """max_wait_ms=0 (the serving default): no added wait when idle; requests that arrive while a batch decodes
    form the next batch together."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def rank(reqs, decoder, tau):
        calls.append(len(reqs))
        started.set()
        if len(calls) == 1:
            release.wait(timeout=30)  # hold the first batch while the others queue
        return FloorReranker().rank(reqs)

    async def main():
        b = MicroBatcher(rank, max_batch=8, max_wait_ms=0)
        first = asyncio.ensure_future(b.submit(RankRequest("u0", ["a", "b"], []), "diffusion", 0.9))
        while not started.is_set():
            await asyncio.sleep(0.001)
        rest = [
            asyncio.ensure_future(b.submit(RankRequest(f"u{k}", ["a", "b"], []), "diffusion", 0.9))
            for k in range(1, 6)
        ]
        await asyncio.sleep(0.02)
        release.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(main())
    assert calls == [1, 5]
    assert first.batch_size == 1 and first.queue_ms < 20
    assert [t.batch_size for t in rest] == [5] * 5


def test_batcher_never_blocks_the_event_loop_and_survives_errors():
    release = threading.Event()
    seen = []

    def rank(reqs, decoder, tau):
        if decoder == "boom":
            raise RuntimeError("model crashed")
        release.wait(timeout=30)  # blocks the executor thread, not the loop
        return FloorReranker().rank(reqs)

    async def main():
        b = MicroBatcher(rank, max_batch=2, max_wait_ms=1)
        task = asyncio.ensure_future(b.submit(RankRequest("u", ["a", "b"], []), "diffusion", 0.9))
        for _ in range(50):  # the loop keeps running other coroutines while rank() is blocked
            await asyncio.sleep(0.001)
            seen.append(task.done())
        release.set()
        first = await task
        with pytest.raises(RuntimeError, match="model crashed"):
            await b.submit(RankRequest("u", ["a", "b"], []), "boom", 0.9)
        again = await b.submit(RankRequest("u", ["b", "a"], []), "diffusion", 0.9)
        return first, again

    first, again = asyncio.run(main())
    assert len(seen) == 50 and not any(seen)
    assert first.result.ranking == ["a", "b"] and again.result.ranking == ["b", "a"]


def test_a_request_that_fails_in_the_model_fails_only_itself():
    """A shared model call that raises is run again one request at a time: the request that fails gets its own
    error, the others their rankings (one client's request never fails another's)."""
    calls = []

    def rank(reqs, decoder, tau):
        calls.append(len(reqs))
        if any(r.user_id == "poison" for r in reqs):
            raise ValueError("cannot rank this one")
        return FloorReranker().rank(reqs)

    async def main():
        b = MicroBatcher(rank, max_batch=8, max_wait_ms=50)
        users = ["a", "poison", "b", "c"]
        reqs = [RankRequest(u, ["x", "y", "z"][: 2 + k % 2], []) for k, u in enumerate(users)]
        return await asyncio.gather(*(b.submit(r, "ar", 1.0) for r in reqs), return_exceptions=True)

    a, poison, b, c = asyncio.run(main())
    assert isinstance(poison, ValueError) and str(poison) == "cannot rank this one"
    assert [t.result.ranking for t in (a, b, c)] == [["x", "y"], ["x", "y"], ["x", "y", "z"]]
    assert calls == [4, 1, 1, 1, 1] and {t.batch_size for t in (a, b, c)} == {1}


def test_predictor_loads_from_s3_uri(tmp_path, monkeypatch):
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {
            "AWS_ACCESS_KEY_ID": "t",
            "AWS_SECRET_ACCESS_KEY": "t",
            "AWS_DEFAULT_REGION": "us-east-1",
            "S3_ENDPOINT_URL": f"http://{host}:{port}",
            "GR2_S3_BUCKET": "models",
        }.items():
            monkeypatch.setenv(k, v)
        boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", config=Config(s3={"addressing_style": "path"})
        ).create_bucket(Bucket="models")
        model = FloorReranker(name="floor-s3", n_candidates=4, items=["a", "b", "c"]).save(tmp_path / "m")
        manifest = open_store().upload("run9", "model", model)
        p = RerankPredictor("reranker", model_uri=manifest.uri)
        p.load()
        assert p.reranker.name == "floor-s3" and p.reranker.n_candidates == 4
        assert p.reranker.known_item("c") and not p.reranker.known_item("d")
        out = asyncio.run(p.predict({"instances": [{"user_id": "u", "candidates": ["c", "a"]}]}))
        assert out["predictions"][0]["ranking"] == ["c", "a"]
    finally:
        server.stop()


def test_predictor_rejects_a_decoder_the_model_cannot_run():
    """'spec' needs a model that carries its verifier: asking another model for it is a 400 naming the field."""

    class NoVerifier(FloorReranker):
        decoders = ("diffusion", "ar")

    p = RerankPredictor("reranker", reranker=NoVerifier(n_candidates=4, items=["a", "b", "c"]))
    inst = {"user_id": "u", "candidates": ["c", "a"]}
    with pytest.raises(BadRequest, match=r"instances\[1\]\.decoder: 'spec' is not available"):
        asyncio.run(p.predict({"instances": [inst, {**inst, "decoder": "spec"}]}))
    with pytest.raises(BadRequest, match=r"instances\[0\]\.decoder: 'spec' is not available"):
        asyncio.run(p.predict({"instances": [inst], "parameters": {"decoder": "spec"}}))
    out = asyncio.run(p.predict({"instances": [{**inst, "decoder": "ar"}]}))
    assert out["predictions"][0]["ranking"] == ["c", "a"] and out["predictions"][0]["decoder"] == "ar"


def test_transformer_policies(feast_repo, ml_slice):
    items = list(ml_slice["items"]["item_id"])
    strict = FeastTransformer(
        "reranker", TransformerConfig("127.0.0.1:1", feast_repo=str(feast_repo), unknown_user="reject")
    )
    strict.load()
    out = asyncio.run(strict.enrich([{"user_id": "3", "candidates": items[:2]}], "instances"))
    assert out[0]["history"] == ml_slice["history"]["3"]
    with pytest.raises(ValueError, match=r"instances\[0\].user_id: unknown user 'ghost'"):
        asyncio.run(strict.enrich([{"user_id": "ghost", "candidates": items[:2]}], "instances"))
    with pytest.raises(ValueError, match=r"instances\[0\].candidates\[1\]: unknown item id 'zzz'"):
        asyncio.run(strict.enrich([{"user_id": "3", "candidates": [items[0], "zzz"]}], "instances"))
    lenient = FeastTransformer(
        "reranker", TransformerConfig("127.0.0.1:1", feast_repo=str(feast_repo), unknown_items="pass")
    )
    lenient.load()
    out = asyncio.run(lenient.enrich([{"user_id": "ghost", "candidates": [items[0], "zzz"]}], "instances"))
    assert out[0]["history"] == []
    # predictor unreachable -> a clean error, not a hang (InvalidInput is for client errors only)
    with pytest.raises(Exception) as e:
        asyncio.run(lenient({"instances": [{"user_id": "3", "candidates": items[:2]}]}))
    assert not isinstance(e.value, InvalidInput)
    assert e.value.status == 503 and str(e.value).startswith("predictor: unreachable (ConnectError")


@pytest.mark.server  # `feast serve` in a fresh process
def test_transformer_via_feast_http_feature_server(feast_repo, ml_slice, tmp_path):
    """The dev overlay's path: Feast's HTTP feature server (`feast serve`) instead of the SDK."""
    import sys
    from pathlib import Path

    from serving.serve_local import start_server, stop

    feast_bin = Path(sys.executable).with_name("feast")
    proc, port = start_server(
        lambda port: [str(feast_bin), "serve", "-h", "127.0.0.1", "-p", str(port)],
        lambda port: f"http://127.0.0.1:{port}/health",
        tmp_path / "feast.log",
        cwd=feast_repo,
    )
    try:
        items = list(ml_slice["items"]["item_id"])
        t = FeastTransformer(
            "reranker", TransformerConfig("127.0.0.1:1", feast_url=f"http://127.0.0.1:{port}")
        )
        t.load()

        async def go():
            ok = await t.enrich(
                [{"user_id": "3", "candidates": items[:3]}, {"user_id": "ghost", "candidates": items[3:5]}],
                "instances",
            )
            with pytest.raises(ValueError, match=r"instances\[0\].candidates\[0\]: unknown item id 'zzz'"):
                await t.enrich([{"user_id": "3", "candidates": ["zzz", items[0]]}], "instances")
            return ok

        out = asyncio.run(go())
        assert out[0]["history"] == ml_slice["history"]["3"] and out[1]["history"] == []
    finally:
        stop(proc)  # feast serve can take long to stop on a busy machine: the test is about serving, not that


def test_predictor_decodes_at_the_models_operating_tau_by_default():
    """A diffusion model's bundle records the tau the gate judged it at: serving uses it when a request names
    none, and a request's own tau still wins."""
    seen: list[float] = []

    class AtTau(FloorReranker):
        tau = 0.6

        def rank(self, requests, decoder="diffusion", tau=0.9):
            seen.append(tau)
            return super().rank(requests, decoder, tau)

    p = RerankPredictor("reranker", reranker=AtTau(n_candidates=4, items=["a", "b", "c"]))
    inst = {"user_id": "u", "candidates": ["c", "a"]}
    out = asyncio.run(p.predict({"instances": [inst]}))
    assert out["predictions"][0]["tau"] == 0.6 and seen == [0.6]
    out = asyncio.run(p.predict({"instances": [{**inst, "tau": 0.9}]}))
    assert out["predictions"][0]["tau"] == 0.9 and seen == [0.6, 0.9]
    # a model without one (the floor, an AR model) keeps the configured default
    assert RerankPredictor("r", reranker=FloorReranker(n_candidates=4, items=["a"])).cfg.default_tau == 0.9


def test_spec_requests_default_to_the_models_spec_tau():
    """spec decodes AR's tokens at any draft tau, and its bundle records the one chosen for speed: a spec request
    that names no tau (neither in the instance nor in the parameters) drafts at it; any named tau still wins."""
    seen: list[tuple[str, float]] = []

    class Student(FloorReranker):
        tau, spec_tau = 0.6, 0.3

        def rank(self, requests, decoder="diffusion", tau=0.9):
            seen.extend((decoder, tau) for _ in requests)
            return super().rank(requests, decoder, tau)

    p = RerankPredictor("reranker", reranker=Student(n_candidates=4, items=["a", "b", "c"]))
    inst = {"user_id": "u", "candidates": ["c", "a"]}
    for body, want in [
        ({"instances": [{**inst, "decoder": "spec"}, inst]}, [("spec", 0.3), ("diffusion", 0.6)]),
        ({"instances": [inst], "parameters": {"decoder": "spec"}}, [("spec", 0.3)]),
        ({"instances": [{**inst, "decoder": "spec"}], "parameters": {"tau": 0.5}}, [("spec", 0.5)]),
        ({"instances": [{**inst, "decoder": "spec", "tau": 0.8}]}, [("spec", 0.8)]),
    ]:
        seen.clear()
        out = asyncio.run(p.predict(body))
        assert sorted(seen) == sorted(want), body
        assert sorted((r["decoder"], r["tau"]) for r in out["predictions"]) == sorted(want)


def test_serve_local_takes_the_edge_candidate_cap_from_a_local_model(tmp_path):
    """The transformer refuses more candidates than the model ranks before any feature lookup: serve_local reads N
    from a local model directory (a storage URI is the predictor's to read; then --max_candidates)."""
    from serving.serve_local import model_candidates, parse_args

    model = FloorReranker(n_candidates=7).save(tmp_path / "m")
    assert model_candidates(str(model)) == 7
    assert model_candidates("s3://bucket/model") is None and model_candidates(str(tmp_path / "none")) is None
    a = parse_args(["--max_candidates", "12", "--idle_timeout_s", "3", "--header_timeout_s", "1.5"])
    assert (a.max_candidates, a.idle_timeout_s, a.header_timeout_s) == (12, 3, 1.5)


def test_dtype_auto_serves_in_bfloat16_only_what_was_validated_so_on_a_cpu_with_bf16_units():
    amx, plain = frozenset({"avx512f", "amx_bf16"}), frozenset({"avx2"})
    assert serving_dtype("auto", "bfloat16", amx) == "bfloat16"
    assert serving_dtype("auto", "bfloat16", frozenset({"avx512_bf16"})) == "bfloat16"
    assert serving_dtype("auto", "bfloat16", plain) == "float32"  # no bf16 units: slower there
    assert serving_dtype("auto", "float32", amx) == "float32"  # its bf16 did not hold on validation
    assert serving_dtype("auto", None, amx) == "float32"  # not judged (AR teachers, older bundles)
    assert (
        serving_dtype("bfloat16", None, plain) == "bfloat16"
        and serving_dtype("float32", "bfloat16", amx) == "float32"
    )
    assert ServeConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServeConfig(dtype="float16")


def test_the_predictor_casts_its_model_to_the_dtype_auto_resolves(model_dir, tmp_path, monkeypatch):
    import torch

    bundle = tmp_path / "bundle"
    shutil.copytree(model_dir, bundle)
    cfg = json.loads((bundle / CONFIG_FILE).read_text())
    (bundle / CONFIG_FILE).write_text(json.dumps({**cfg, "serve_dtype": "bfloat16"}))
    thread = ServeConfig(decode_in="thread")
    for flags, want in [({"amx_bf16"}, torch.bfloat16), ({"avx2"}, torch.float32)]:
        monkeypatch.setattr("serving.schema.read_cpu_flags", lambda f=flags: frozenset(f))
        p = RerankPredictor("reranker", model_uri=str(bundle), cfg=thread)
        p.load()
        assert next(p.reranker.model.parameters()).dtype == want and p.cfg.dtype == str(want).split(".")[1]
