"""Request parsing and validation for the re-ranking endpoints (v1 and v2 carry the same instance objects).

An instance: {"user_id": str, "candidates": [str, ...], "history"?: [str, ...], "decoder"?: "diffusion"|"ar",
"tau"?: float, "trace"?: bool}. Request-level defaults for decoder/tau/trace go in "parameters".
"decoder" may also be "spec" (lossless speculative decoding) for a model that carries its verifier.
Every problem raises `BadRequest` with a message that starts with the offending field's path
(`instances[2].candidates[4]: unknown item id 'x'`), which the server turns into a 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gr2.inference import DECODERS, RankRequest, RankResult, Reranker

INSTANCE_KEYS = {"user_id", "candidates", "history", "decoder", "tau", "trace"}
OPTION_KEYS = {"decoder", "tau", "trace"}


class BadRequest(ValueError):
    """Invalid client input; the message names the field."""


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 16  # micro-batch size cap (requests decoded together)
    # How long the batcher waits to fill a batch after the first request. 0 = greedy: an idle server decodes a
    # request at once, and requests that arrive while a batch decodes form the next batch (serving/batcher.py).
    max_wait_ms: float = 0.0
    max_instances: int = 64  # instances per HTTP request
    max_body_bytes: int = 256 * 1024  # larger payloads get 413
    min_candidates: int = 2  # fewer is not a ranking problem
    max_history: int = 1000  # hard cap on a client-sent history (the model itself reads the last H)
    max_id_len: int = 256
    decoders: tuple[str, ...] = DECODERS
    default_decoder: str = "diffusion"
    default_tau: float = 0.9
    min_tau: float = 0.05  # tau bounds: below this the diffusion decoder degenerates to one token per step
    max_tau: float = 1.0


@dataclass(frozen=True)
class Options:
    decoder: str
    tau: float
    trace: bool


def _is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def parse_json(body: bytes | str, where: str = "body") -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"{where}: malformed JSON ({e})") from e


def parse_options(raw: dict[str, Any], where: str, cfg: ServeConfig, base: Options | None = None) -> Options:
    """decoder/tau/trace from `raw`, falling back to `base` (request parameters) then the config defaults."""
    base = base or Options(cfg.default_decoder, cfg.default_tau, False)
    decoder = raw.get("decoder", base.decoder)
    if not isinstance(decoder, str) or decoder not in cfg.decoders:
        raise BadRequest(f"{where}.decoder: must be one of {list(cfg.decoders)}, got {decoder!r}")
    tau = raw.get("tau", base.tau)
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau):
        raise BadRequest(f"{where}.tau: must be a number, got {tau!r}")
    if not cfg.min_tau <= tau <= cfg.max_tau:
        raise BadRequest(f"{where}.tau: must be within [{cfg.min_tau}, {cfg.max_tau}], got {tau}")
    trace = raw.get("trace", base.trace)
    if not isinstance(trace, bool):
        raise BadRequest(f"{where}.trace: must be true or false, got {trace!r}")
    return Options(decoder, float(tau), trace)


def parse_instance(
    raw: Any, where: str, reranker: Reranker, cfg: ServeConfig, base: Options | None = None
) -> tuple[RankRequest, Options, int]:
    """Validate one instance. Returns the request, its options and how many unknown history ids were dropped.

    Unknown *candidate* ids are rejected (the model cannot rank what it cannot read); unknown *history* ids
    are dropped, because the online history legitimately contains items newer than the model's catalogue.
    """
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: expected an object with user_id and candidates, got {type(raw).__name__}")
    unknown = sorted(set(raw) - INSTANCE_KEYS)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}: unknown field (allowed: {sorted(INSTANCE_KEYS)})")
    user_id = raw.get("user_id")
    if not isinstance(user_id, str) or not user_id or len(user_id) > cfg.max_id_len:
        raise BadRequest(
            f"{where}.user_id: must be a non-empty string of at most {cfg.max_id_len} chars, got {user_id!r}"
        )
    cands = raw.get("candidates")
    if not isinstance(cands, list):
        raise BadRequest(f"{where}.candidates: must be a list of item id strings, got {type(cands).__name__}")
    lo, hi = cfg.min_candidates, reranker.n_candidates
    if len(cands) < lo:
        raise BadRequest(f"{where}.candidates: too few candidates ({len(cands)} < {lo})")
    if len(cands) > hi:
        raise BadRequest(
            f"{where}.candidates: too many candidates ({len(cands)} > {hi}, the model ranks {hi})"
        )
    seen: dict[str, int] = {}
    for j, c in enumerate(cands):
        if not isinstance(c, str) or not c:
            raise BadRequest(f"{where}.candidates[{j}]: must be a non-empty string, got {c!r}")
        if c in seen:
            raise BadRequest(f"{where}.candidates[{j}]: duplicate item id {c!r} (also at index {seen[c]})")
        seen[c] = j
        if not reranker.known_item(c):
            raise BadRequest(f"{where}.candidates[{j}]: unknown item id {c!r}")
    history = raw.get("history", [])
    if history is None:
        history = []
    if not _is_str_list(history):
        raise BadRequest(f"{where}.history: must be a list of item id strings")
    if len(history) > cfg.max_history:
        raise BadRequest(f"{where}.history: too long ({len(history)} > {cfg.max_history})")
    known_history = [h for h in history if reranker.known_item(h)]
    opts = parse_options(raw, where, cfg, base)
    return (
        RankRequest(user_id=user_id, candidates=list(cands), history=known_history),
        opts,
        len(history) - len(known_history),
    )


def parse_instances_list(instances: Any, where: str, cfg: ServeConfig) -> list[Any]:
    if not isinstance(instances, list):
        raise BadRequest(f"{where}: must be a list of instance objects, got {type(instances).__name__}")
    if not instances:
        raise BadRequest(f"{where}: empty; send at least one instance")
    if len(instances) > cfg.max_instances:
        raise BadRequest(f"{where}: too many instances ({len(instances)} > {cfg.max_instances})")
    return instances


def v1_body(payload: Any, cfg: ServeConfig) -> tuple[list[Any], dict[str, Any]]:
    """(instances, parameters) from a v1 body (dict, or bytes when the client sent no JSON content type)."""
    if isinstance(payload, bytes | str):
        payload = parse_json(payload)
    if not isinstance(payload, dict):
        raise BadRequest(f"body: expected a JSON object with 'instances', got {type(payload).__name__}")
    if "instances" not in payload:
        raise BadRequest('instances: missing (body must be {"instances": [...]})')
    params = payload.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("parameters: must be an object")
    return parse_instances_list(payload["instances"], "instances", cfg), params


def v2_instances(infer_request: Any, cfg: ServeConfig) -> tuple[list[Any], dict[str, Any]]:
    """Instances from a v2 InferRequest: one BYTES input whose elements are JSON instance objects."""
    inputs = infer_request.inputs or []
    if len(inputs) != 1:
        raise BadRequest(
            f"inputs: expected exactly one BYTES input holding JSON instances, got {len(inputs)}"
        )
    inp = inputs[0]
    if inp.datatype != "BYTES":
        raise BadRequest(f"inputs[0].datatype: must be BYTES (JSON instances), got {inp.datatype}")
    data = inp.data
    if not isinstance(data, list):
        raise BadRequest("inputs[0].data: must be a list of JSON strings")
    out = []
    for i, d in enumerate(parse_instances_list(data, "inputs[0].data", cfg)):
        if isinstance(d, bytes):
            d = d.decode("utf-8", errors="replace")
        out.append(parse_json(d, f"inputs[0].data[{i}]") if isinstance(d, str) else d)
    params = infer_request.parameters or {}
    params = {k: getattr(v, "value", v) for k, v in dict(params).items() if k in OPTION_KEYS}
    return out, params


def format_result(
    req: RankRequest,
    res: RankResult,
    opts: Options,
    model: str,
    timing: dict[str, float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "user_id": req.user_id,
        "ranking": res.ranking,
        "valid": res.valid,
        "fallback": not res.valid,  # True = the model's output was unusable; ranking is the upstream order
        "reason": res.reason,
        "nfe": res.nfe,
        "n_tokens": res.n_tokens,
        "model": model,
        "decoder": opts.decoder,
        "tau": None if opts.decoder == "ar" else opts.tau,  # spec: the draft's tau
        "timing_ms": timing,
        **extra,
    }
    if opts.trace:
        out["trace"] = res.trace
    return out
