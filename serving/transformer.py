"""The InferenceService transformer: online features from Feast, then KServe's own call to the predictor.

KServe's transformer hooks, in order (kserve.Model.__call__):
- `preprocess` validates the whole request (serving/schema.py) before any feature lookup, then looks up the
  `reranker_serving_v1` feature service with one entity row per (user_id, candidate item_id): `history` comes
  from `user_history` (the view training extraction reads, so there is no training/serving skew), and a
  candidate whose `item_features` `title` is null has no catalogue row: it is unknown to the platform. It
  returns the v1 body for the predictor.
- `predict` is kserve's built-in call to the predictor at `predictor_host` (v1 REST, kserve's client), with its
  failures given a status: a predictor 400 comes back as a 400 with the predictor's message; otherwise 502 (a
  bad answer), 503 (unreachable) or 504 (no answer within `timeout_s`).
- `postprocess` answers in the client's protocol (v1 dict, or a v2 InferResponse for v2 clients).
The readiness probes also ask the predictor (`upstream_ready`).

Feast is reached through the SDK (`FeatureStore(repo_path)`, any online store its yaml names: sqlite locally,
Redis in prod) or through Feast's HTTP feature server (`feast_url`, POST /get-online-features).
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import kserve
from kserve.predictor_config import PredictorConfig
from kserve.protocol.infer_type import InferRequest, InferResponse

from serving.schema import BadRequest, ServeConfig, UpstreamError, reply, request_instances, shown

if TYPE_CHECKING:
    from feast import FeatureStore

FEATURE_SERVICE = "reranker_serving_v1"  # feature_repo/services.py

# The client's request (its payload and where its instances sit), from `preprocess` to `predict` and
# `postprocess`: kserve runs the three hooks one after another in the request's own task.
_CLIENT_REQUEST: ContextVar[tuple[Any, str]] = ContextVar("client_request")


@dataclass(frozen=True)
class TransformerConfig:
    predictor_host: str  # host:port of the predictor (KServe injects it as --predictor_host)
    feast_repo: str | None = None  # Feast repo path (feature_store.yaml) for the SDK
    feast_yaml: str | None = None  # a feature_store.yaml other than the repo's (prod: Redis online store)
    feast_url: str | None = None  # or Feast's HTTP feature server base URL
    feature_service: str = FEATURE_SERVICE
    unknown_user: str = "empty"  # "empty": serve with an empty history; "reject": 400
    unknown_items: str = "reject"  # "reject": 400 for a candidate with no item_features row; "pass"
    timeout_s: float = 30.0  # predictor / feature server: no answer within this -> 504
    connect_timeout_s: float = 2.0  # not even connected within this -> 504; refused -> 503
    health_timeout_s: float = 2.0  # the readiness probes' question to the predictor


class FeastTransformer(kserve.Model):
    def __init__(self, name: str, cfg: TransformerConfig, serve_cfg: ServeConfig | None = None):
        super().__init__(name)
        if cfg.unknown_user not in ("empty", "reject") or cfg.unknown_items not in ("reject", "pass"):
            raise ValueError(
                f"bad policy: unknown_user={cfg.unknown_user!r}, unknown_items={cfg.unknown_items!r}"
            )
        if (cfg.feast_repo is None) == (cfg.feast_url is None):
            raise ValueError("set exactly one of feast_repo or feast_url")
        self.cfg = cfg
        self.serve_cfg = serve_cfg or ServeConfig()
        self.store: FeatureStore | None = None
        # the feature server's client (the predictor's is kserve's, configured by `predictor_config`)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._predictor = PredictorConfig(
            cfg.predictor_host,
            # kserve hands this to its httpx client as is: a connect timeout of its own tells a predictor that
            # does not even connect (504) from one that refuses (503) within connect_timeout_s
            predictor_request_timeout_seconds=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
        )

    @property
    def predictor_config(self) -> PredictorConfig:
        """Where and how kserve's built-in `predict` calls the predictor: this transformer's own config, not the
        process-wide one kserve's ModelServer sets from its command line."""
        return self._predictor

    def load(self) -> bool:
        if self.cfg.feast_repo is not None:
            from feast import FeatureStore  # lazy: slow import, and the HTTP path does not need it

            yaml = Path(self.cfg.feast_yaml) if self.cfg.feast_yaml else None
            self.store = FeatureStore(repo_path=self.cfg.feast_repo, fs_yaml_file=yaml)
            self._service = self.store.get_feature_service(self.cfg.feature_service)
        self.ready = True
        return self.ready

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            timeout = httpx.Timeout(self.cfg.timeout_s, connect=self.cfg.connect_timeout_s)
            self._client, self._client_loop = httpx.AsyncClient(timeout=timeout), loop
        return self._client

    async def upstream_ready(self) -> bool:
        """Whether the predictor says its model is ready: the readiness probes ask this (serving/modelserver.py),
        so a frozen or dead predictor takes the transformer out of rotation too."""
        try:
            ready = await self._http_client.is_model_ready(
                self._predictor.predictor_base_url, self.name, timeout=self.cfg.health_timeout_s
            )
        except (httpx.HTTPError, ValueError):  # no answer, an error status, or not JSON
            return False
        return ready is True

    # --- features -----------------------------------------------------------------------------
    async def online_features(self, rows: list[dict[str, str]]) -> dict[str, list[Any]]:
        """Column dict for entity rows [{user_id, item_id}] from the feature service."""
        store = self.store
        if store is not None:
            try:
                return await asyncio.to_thread(
                    lambda: store.get_online_features(features=self._service, entity_rows=rows).to_dict()
                )
            except Exception as e:  # the online store (sqlite, Redis) failed: not the client's fault
                raise UpstreamError(
                    f"feature store: lookup failed ({type(e).__name__}: {shown(str(e), 200)})", 503
                ) from e
        url = self.cfg.feast_url
        if url is None:  # a feast_repo transformer whose load() has not run
            raise RuntimeError("the feature store is not loaded")
        body = {
            "feature_service": self.cfg.feature_service,
            "entities": {"user_id": [r["user_id"] for r in rows], "item_id": [r["item_id"] for r in rows]},
            "full_feature_names": False,
        }
        endpoint = f"{url.rstrip('/')}/get-online-features"
        try:
            r = await self._http().post(endpoint, json=body)
        except httpx.HTTPError as e:
            raise no_answer("feature server", e, endpoint) from e
        try:
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}")
            out = r.json()
            names = out["metadata"]["feature_names"]
            return {n: res["values"] for n, res in zip(names, out["results"], strict=True)}
        except (ValueError, KeyError, TypeError) as e:
            raise UpstreamError(f"feature server: bad answer ({e}): {shown(r.text, 200)}", 502) from e

    async def enrich(self, instances: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        """Validated instances with `history` filled from Feast (unless the client sent one)."""
        rows = [{"user_id": inst["user_id"], "item_id": c} for inst in instances for c in inst["candidates"]]
        feats = await self.online_features(rows) if rows else {}
        out, k = [], 0
        for i, raw in enumerate(instances):
            cands = raw["candidates"]
            span = range(k, k + len(cands))
            k += len(cands)
            if self.cfg.unknown_items == "reject" and "title" in feats:
                for j, r in enumerate(span):
                    if feats["title"][r] is None:
                        raise BadRequest(
                            f"{where}[{i}].candidates[{j}]: unknown item id {shown(cands[j])} (not in the feature store)"
                        )
            inst = dict(raw)
            if "history" not in raw:  # a client-sent history wins (replays, what-if tests)
                history = feats["history"][span[0]] if len(span) else None
                if history is None and self.cfg.unknown_user == "reject":
                    raise BadRequest(
                        f"{where}[{i}].user_id: unknown user {shown(raw['user_id'])} (no history in the feature store)"
                    )
                # the newest ids only: the predictor's body limit allows this many per instance
                inst["history"] = list(history or [])[-self.serve_cfg.max_filled_history :]
            out.append(inst)
        return out

    # --- kserve's hooks: preprocess -> predict (kserve's call to the predictor) -> postprocess ------------
    async def preprocess(
        self, payload: dict | InferRequest | bytes, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The predictor's v1 body: the whole request validated, then each instance's history from Feast."""
        request = request_instances(payload, self.serve_cfg)
        instances = await self.enrich(request.instances, request.where)
        _CLIENT_REQUEST.set((payload, request.where))
        body: dict[str, Any] = {"instances": instances}
        if request.params:
            body["parameters"] = request.params
        return body

    def validate(self, payload: Any) -> Any:
        # our own parser validates (and names fields consistently for v1 and v2); skip kserve's shallow check
        return payload

    async def predict(
        self,
        payload: dict | InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict | InferResponse:
        """kserve's built-in call to the predictor; what goes wrong there gets a status and a message."""
        _, where = _CLIENT_REQUEST.get()  # set by preprocess: kserve calls the hooks in order
        try:
            out = await super().predict(payload, headers, response_headers)
        except httpx.HTTPStatusError as e:
            raise predictor_error(e.response, where) from e
        except httpx.HTTPError as e:
            raise no_answer("predictor", e, str(e.request.url)) from e
        except ValueError as e:  # kserve could not parse a 200's body
            raise UpstreamError(f"predictor: bad answer ({e})", 502) from e
        if not isinstance(out, dict) or not isinstance(out.get("predictions"), list):
            raise UpstreamError(f"predictor: bad answer (no predictions): {shown(str(out), 200)}", 502)
        return out

    async def postprocess(
        self,
        result: dict | InferResponse,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict | InferResponse:
        """The predictor's predictions, in the protocol the client spoke."""
        payload, _ = _CLIENT_REQUEST.get()
        assert isinstance(result, dict)  # predict() let only a v1 answer through
        return reply(payload, self.name, result["predictions"])


def no_answer(what: str, e: httpx.HTTPError, url: str) -> UpstreamError:
    """An upstream that gave no answer at all: 504 when it ran out of time, else 503 (refused, reset, ...)."""
    if isinstance(e, httpx.TimeoutException):
        return UpstreamError(f"{what}: no answer within the timeout ({type(e).__name__}, {url})", 504)
    return UpstreamError(f"{what}: unreachable ({type(e).__name__}, {url})", 503)


def predictor_error(r: httpx.Response, where: str) -> BadRequest | UpstreamError:
    """A predictor's error status: its 400 is the client's input as the model judged it (relayed, the field named
    as the client sent it); anything else is the predictor's failure (503 stays 503, the rest 502)."""
    if r.status_code == 400:
        try:
            msg = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            msg = r.text
        if where != "instances" and msg.startswith("instances["):
            msg = where + msg[len("instances") :]  # name the field as the (v2) client sent it
        return BadRequest(msg)
    status = 503 if r.status_code == 503 else 502
    return UpstreamError(f"predictor: bad answer (HTTP {r.status_code}): {shown(r.text, 200)}", status)
