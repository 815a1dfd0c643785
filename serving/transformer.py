"""The InferenceService transformer: online features from Feast, then forward to the predictor.

For each instance it looks up the `reranker_v1` feature service (the same one training extraction uses, so
there is no training/serving skew) with one entity row per (user_id, candidate item_id): `history` comes from
`user_history`, and a candidate without an `item_features` row is unknown to the platform. Then it forwards
v1 JSON to the predictor at `predictor_host` and relays the answer (v1 dict, or a v2 InferResponse for v2
clients). Predictor 4xx answers come back as 400s with the predictor's message; the server stays up.

Feast is reached through the SDK (`FeatureStore(repo_path)`, any online store its yaml names: sqlite locally,
Redis in prod) or through Feast's HTTP feature server (`feast_url`, POST /get-online-features).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kserve
from kserve.errors import InferenceError, InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from serving.schema import BadRequest, ServeConfig, parse_instances_list, v1_body, v2_instances

FEATURE_SERVICE = "reranker_v1"


@dataclass(frozen=True)
class TransformerConfig:
    predictor_host: str  # host:port of the predictor (KServe injects it as --predictor_host)
    feast_repo: str | None = None  # Feast repo path (feature_store.yaml) for the SDK
    feast_yaml: str | None = None  # a feature_store.yaml other than the repo's (prod: Redis online store)
    feast_url: str | None = None  # or Feast's HTTP feature server base URL
    feature_service: str = FEATURE_SERVICE
    unknown_user: str = "empty"  # "empty": serve with an empty history; "reject": 400
    unknown_items: str = "reject"  # "reject": 400 for a candidate with no item_features row; "pass"
    timeout_s: float = 30.0


def _check_instance(raw: Any, where: str) -> tuple[str, list[str]]:
    """Just enough validation to build Feast entity rows; the predictor validates the rest."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: expected an object with user_id and candidates, got {type(raw).__name__}")
    user_id, cands = raw.get("user_id"), raw.get("candidates")
    if not isinstance(user_id, str) or not user_id:
        raise BadRequest(f"{where}.user_id: must be a non-empty string, got {user_id!r}")
    if not isinstance(cands, list):
        raise BadRequest(f"{where}.candidates: must be a list of item id strings, got {type(cands).__name__}")
    for j, c in enumerate(cands):
        if not isinstance(c, str) or not c:
            raise BadRequest(f"{where}.candidates[{j}]: must be a non-empty string, got {c!r}")
    return user_id, cands


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
        self.store = None
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def load(self) -> bool:
        if self.cfg.feast_repo is not None:
            from feast import FeatureStore  # lazy: slow import, and the HTTP path does not need it

            kw = {"fs_yaml_file": Path(self.cfg.feast_yaml)} if self.cfg.feast_yaml else {}
            self.store = FeatureStore(repo_path=self.cfg.feast_repo, **kw)
            self._service = self.store.get_feature_service(self.cfg.feature_service)
        self.ready = True
        return self.ready

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client, self._client_loop = httpx.AsyncClient(timeout=self.cfg.timeout_s), loop
        return self._client

    # --- features -----------------------------------------------------------------------------
    async def online_features(self, rows: list[dict[str, str]]) -> dict[str, list[Any]]:
        """Column dict for entity rows [{user_id, item_id}] from the feature service."""
        if self.store is not None:
            return await asyncio.to_thread(
                lambda: self.store.get_online_features(features=self._service, entity_rows=rows).to_dict()
            )
        body = {
            "feature_service": self.cfg.feature_service,
            "entities": {"user_id": [r["user_id"] for r in rows], "item_id": [r["item_id"] for r in rows]},
            "full_feature_names": False,
        }
        r = await self._http().post(f"{self.cfg.feast_url.rstrip('/')}/get-online-features", json=body)
        if r.status_code != 200:
            raise InferenceError(f"feature server answered {r.status_code}: {r.text[:200]}")
        out = r.json()
        names = out["metadata"]["feature_names"]
        return {n: res["values"] for n, res in zip(names, out["results"], strict=True)}

    async def enrich(self, instances: list[Any], where: str) -> list[dict[str, Any]]:
        checked = [_check_instance(raw, f"{where}[{i}]") for i, raw in enumerate(instances)]
        rows = [{"user_id": u, "item_id": c} for u, cands in checked for c in cands]
        feats = await self.online_features(rows) if rows else {}
        out, k = [], 0
        for i, ((user_id, cands), raw) in enumerate(zip(checked, instances, strict=True)):
            span = range(k, k + len(cands))
            k += len(cands)
            if self.cfg.unknown_items == "reject" and "title" in feats:
                for j, r in enumerate(span):
                    if feats["title"][r] is None:
                        raise BadRequest(
                            f"{where}[{i}].candidates[{j}]: unknown item id {cands[j]!r} (not in the feature store)"
                        )
            inst = dict(raw)
            if "history" not in raw:  # a client-sent history wins (replays, what-if tests)
                history = feats["history"][span[0]] if len(span) else None
                if history is None and self.cfg.unknown_user == "reject":
                    raise BadRequest(
                        f"{where}[{i}].user_id: unknown user {user_id!r} (no history in the feature store)"
                    )
                inst["history"] = list(history or [])
            out.append(inst)
        return out

    # --- forwarding ---------------------------------------------------------------------------
    async def forward(
        self, instances: list[dict[str, Any]], params: dict[str, Any], where: str = "instances"
    ) -> list[Any]:
        url = f"http://{self.cfg.predictor_host}/v1/models/{self.name}:predict"
        body: dict[str, Any] = {"instances": instances}
        if params:
            body["parameters"] = params
        r = await self._http().post(url, json=body)
        if 400 <= r.status_code < 500:
            try:
                msg = r.json().get("error", r.text)
            except json.JSONDecodeError:
                msg = r.text
            if where != "instances" and msg.startswith("instances["):
                msg = where + msg[len("instances") :]  # name the field as the (v2) client sent it
            raise InvalidInput(msg)
        if r.status_code != 200:
            raise InferenceError(f"predictor answered {r.status_code}: {r.text[:200]}")
        return r.json()["predictions"]

    def validate(self, payload: Any) -> Any:
        # our own parser validates (and names fields consistently for v1 and v2); skip kserve's shallow check
        return payload

    async def predict(
        self, payload: dict | InferRequest | bytes, headers: dict[str, str] | None = None
    ) -> Any:
        try:
            if isinstance(payload, InferRequest):
                instances, params = v2_instances(payload, self.serve_cfg)
                where = "inputs[0].data"
                preds = await self.forward(await self.enrich(instances, where), params, where)
                data = [json.dumps(p) for p in preds]
                return InferResponse(
                    model_name=self.name,
                    infer_outputs=[
                        InferOutput(name="predictions", shape=[len(data)], datatype="BYTES", data=data)
                    ],
                    response_id=payload.id or str(uuid.uuid4()),
                )
            instances, params = v1_body(payload, self.serve_cfg)
            parse_instances_list(instances, "instances", self.serve_cfg)
            return {"predictions": await self.forward(await self.enrich(instances, "instances"), params)}
        except BadRequest as e:
            raise InvalidInput(str(e)) from e
