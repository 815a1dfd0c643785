"""Request parsing and validation for the re-ranking endpoints (v1 and v2 carry the same instance objects).

An instance: {"user_id": str, "candidates": [str, ...], "history"?: [str, ...], "decoder"?: "diffusion"|"ar",
"tau"?: float, "trace"?: bool}. Request-level defaults for decoder/tau/trace go in "parameters".
"decoder" may also be "spec" (lossless speculative decoding) for a model that carries its verifier.

One validator for the whole request, run with the same code twice: at the servers' edge on the raw body
(`validate_body`, from serving/modelserver.py: before kserve decodes the body and before the transformer looks
anything up in Feast), and by each model on the payload kserve decoded (`request_instances`); the predictor
then adds what only the model knows (`parse_instance`: its candidate count and catalogue). Every problem
raises `BadRequest` with a 4xx status and a message that starts with the offending field's path
(`instances[2].candidates[4]: unknown item id 'x'`); client values are echoed cut short (`shown`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gr2.config import DiffusionConfig
from gr2.inference import DECODERS, DTYPES, RankRequest, RankResult, Reranker

INSTANCE_KEYS = {"user_id", "candidates", "history", "decoder", "tau", "trace"}
OPTION_KEYS = {"decoder", "tau", "trace"}
V1_KEYS = {"instances", "parameters"}
V2_KEYS = {"id", "inputs", "outputs", "parameters"}
V2_INPUT_KEYS = {"name", "shape", "datatype", "data", "parameters"}
V2_INPUT_PARAMETERS = {"content_type"}  # what kserve's own client may put on a BYTES input
OUTPUT = "predictions"

if TYPE_CHECKING:
    from kserve.protocol.infer_type import InferResponse


class BadRequest(ValueError):
    """Invalid client input; the message names the field. `status`: 400, or 413/415 for the body as a whole."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its status (a decoding process sends it)
        return type(self), (str(self), self.status)


class UpstreamError(RuntimeError):
    """The predictor or the feature store failed (502 bad answer, 503 unreachable, 504 no answer in time)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its status (a decoding process sends it)
        return type(self), (str(self), self.status)


BATCHING = ("continuous", "micro")
# CPU flags of the bf16 matrix / dot-product units bf16 was measured on
BF16_UNITS = ("amx_bf16", "avx512_bf16")


def serving_dtype(asked: str, validated: str | None, cpu_flags: frozenset[str] | None = None) -> str:
    """What a model is served in: `asked`, unless "auto": "bfloat16" when the model's bundle validated it
    (`validated`, its serve_dtype) and this CPU has bf16 units (`cpu_flags`: /proc/cpuinfo's), else "float32"."""
    if asked != "auto":
        return asked
    flags = cpu_flags if cpu_flags is not None else read_cpu_flags()
    return "bfloat16" if validated == "bfloat16" and any(f in flags for f in BF16_UNITS) else "float32"


def read_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (Linux /proc/cpuinfo; none elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split()
    )


SERVE_DTYPES = (*DTYPES, "auto")  # ServeConfig.dtype
DECODE_IN = ("process", "thread")  # where continuous batching decodes (serving/batcher.py)


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 16  # the requests decoded together (continuous batching: the rows of a running decode)
    # "continuous": requests join running decodes and leave as they finish; "micro": one rank() call per batch
    # (serving/batcher.py). A model without streams (the floor) is micro-batched either way.
    batching: str = "continuous"
    # How long the batcher waits to fill a batch after the first request. 0 = greedy: an idle server decodes a
    # request at once, and requests that arrive while a batch decodes form the next batch (serving/batcher.py).
    max_wait_ms: float = 0.0
    # What a generative model decodes in (gr2/generative.py `cast`): "float32", "bfloat16", or "auto": bfloat16 where
    # the model's bundle says it held its validation rule in bf16 (serve_dtype) and the CPU has bf16 units, else
    # float32 (`serving_dtype`). There bf16 lifted the diffusion server's requests/s at 32 clients by a fifth and
    # more, and slowed AR and one-list decodes a little (docs/SERVING.md).
    dtype: str = "auto"
    # Where continuous batching decodes: "process" (a decoding process beside the HTTP server's, the default) or
    # "thread" (of the server's process). In one process the event loop's Python and the decoding loop's take turns
    # on one GIL: a process lifted diffusion's requests/s at 32 clients by a fifth or more (docs/SERVING.md).
    decode_in: str = "process"
    max_instances: int = 64  # instances per HTTP request
    max_body_bytes: int = 256 * 1024  # larger client payloads get 413
    body_timeout_s: float = 10.0  # a body not fully received by then gets 408 (slow or half-sent bodies)
    max_depth: int = 8  # JSON nesting; a valid request needs 4 (body, instances, instance, candidates)
    min_candidates: int = 2  # fewer is not a ranking problem
    # Edge cap per instance, before any feature lookup (serve_local sets it to a local model's N, --max_candidates
    # otherwise); the predictor then holds a list to its model's N.
    max_candidates: int = 100
    max_history: int = 1000  # hard cap on a client-sent history (the model itself reads the last H)
    # The transformer forwards at most the newest this-many ids of a Feast history (the models read H = 20).
    max_filled_history: int = 100
    max_id_len: int = 256
    # The HTTP server's own bounds (serving/modelserver.py, docs/SECURITY.md), not only the mesh's:
    max_header_bytes: int = 32 * 1024  # a request line + headers larger than this: 431, connection closed
    max_headers: int = 100  # more header fields: 431
    header_timeout_s: float = 10.0  # a request head begun but not complete within this: 408, closed
    # A connection without a request in progress (new, or between requests) is closed after this. Above the 60 s
    # idle timeout of the usual load balancers, so that they close first (kserve's default is 65 too).
    idle_timeout_s: int = 65
    decoders: tuple[str, ...] = DECODERS
    default_decoder: str = "diffusion"
    default_tau: float = (
        DiffusionConfig.eval_tau
    )  # a diffusion model whose bundle names its operating tau serves at that instead
    default_spec_tau: float = DiffusionConfig.spec_tau  # spec's draft tau; likewise the bundle's spec_tau
    min_tau: float = 0.05  # tau bounds: below this the diffusion decoder degenerates to one token per step
    max_tau: float = 1.0

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {list(BATCHING)}, got {self.batching!r}")
        if self.decode_in not in DECODE_IN:
            raise ValueError(f"decode_in must be one of {list(DECODE_IN)}, got {self.decode_in!r}")
        if self.dtype not in SERVE_DTYPES:
            raise ValueError(f"dtype must be one of {list(SERVE_DTYPES)}, got {self.dtype!r}")

    def forwarded_body_bytes(self) -> int:
        """The predictor's body limit: a client's max_body_bytes plus the histories the transformer adds from
        Feast (max_filled_history ids of at most max_id_len bytes, quoted, per instance). So a request the
        client sent within the limit is never refused for bytes the transformer added."""
        return self.max_body_bytes + self.max_instances * self.max_filled_history * (self.max_id_len + 3)


@dataclass(frozen=True)
class Options:
    decoder: str
    tau: float
    trace: bool
    tau_given: bool = True  # False: no tau in the request, so each instance takes its own decoder's default


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters: a hostile 200 KB value is never echoed whole (reply or log)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def printable(text: str) -> str:
    """`text` with every character that is not printable (newlines, control characters, lone surrogates)
    written as its escape: a client's field name or URL path cannot start a forged log line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class PrintableLogs(logging.Filter):
    """Escapes the client's text in every log line (`printable`): a URL path with %0A reached kserve's timing
    log decoded (`drop_kserve_timing` now leaves it out), and a field name or path could otherwise start a forged
    line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = printable(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(printable(a) if isinstance(a, str) else a for a in record.args)
        return True


def shown(value: Any, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters."""
    return cut(repr(value), limit)


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, as a client wrote it: errors name it rather than a Python type, which
    differs between parsers (kserve's orjson reads an integer beyond 64 bits as a float, the guard's json does
    not)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | LongInteger):
        return "number"
    names: tuple[tuple[type, str], ...] = (
        (str, "string"),
        (list, "array"),
        (dict, "object"),
        (type(None), "null"),
    )
    return next((name for t, name in names if isinstance(value, t)), type(value).__name__)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """Deepest bracket nesting of a JSON text, found without parsing it (parsers recurse per level)."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


class LongInteger:
    """An integer literal too long to be a value of this API (Python refuses to convert more than 4,300 digits,
    and a 10^400 tau overflows a float): parsed as this marker, which every field check refuses by name."""

    def __init__(self, digits: str):
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


MAX_INT_DIGITS = 20  # an int64 has 19 digits; no field of this API needs more


def _parse_int(text: str) -> int | LongInteger:
    return int(text) if len(text) <= MAX_INT_DIGITS else LongInteger(text)


def parse_json(body: bytes | str, where: str, cfg: ServeConfig) -> Any:
    """JSON within the depth limit. NaN, Infinity and 1e999 parse to floats, and integers of more than
    MAX_INT_DIGITS digits to a `LongInteger`, that the field checks refuse."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else body
    except UnicodeDecodeError as e:
        raise BadRequest(f"{where}: not UTF-8 ({e})") from e
    if not text.strip():
        raise BadRequest(f"{where}: empty; expected JSON")
    depth = json_depth(text)
    if depth > cfg.max_depth:
        raise BadRequest(f"{where}: JSON nested {depth} levels deep (the limit is {cfg.max_depth})")
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise BadRequest(f"{where}: malformed JSON ({e})") from e


def check_keys(raw: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed, key=str)
    if unknown:
        field = cut(f"{where}.{unknown[0]}" if where else str(unknown[0]), 80)
        raise BadRequest(f"{field}: unknown field (allowed: {sorted(allowed)})")


def parse_options(raw: dict[str, Any], where: str, cfg: ServeConfig, base: Options | None = None) -> Options:
    """decoder/tau/trace from `raw`, falling back to `base` (request parameters) then the config defaults."""
    base = base or Options(cfg.default_decoder, cfg.default_tau, False, tau_given=False)
    decoder = raw.get("decoder", base.decoder)
    if not isinstance(decoder, str) or decoder not in cfg.decoders:
        raise BadRequest(f"{where}.decoder: must be one of {list(cfg.decoders)}, got {shown(decoder)}")
    given = "tau" in raw or base.tau_given
    default = cfg.default_spec_tau if decoder == "spec" else cfg.default_tau
    tau = raw.get("tau", base.tau if base.tau_given else default)
    if (
        isinstance(tau, bool)
        or not isinstance(tau, int | float)
        or (isinstance(tau, float) and not math.isfinite(tau))
    ):
        raise BadRequest(f"{where}.tau: must be a finite number, got {shown(tau)}")
    if not cfg.min_tau <= tau <= cfg.max_tau:  # exact for any int: no float(10**400) overflow
        raise BadRequest(f"{where}.tau: must be within [{cfg.min_tau}, {cfg.max_tau}], got {shown(tau)}")
    trace = raw.get("trace", base.trace)
    if not isinstance(trace, bool):
        raise BadRequest(f"{where}.trace: must be true or false, got {shown(trace)}")
    return Options(decoder, float(tau), trace, given)


def check_text(value: Any, where: str, limit: int) -> str:
    """A non-empty string of at most `limit` characters that is valid Unicode (a JSON escape like "\\ud800"
    decodes to a lone surrogate, which no UTF-8 encoder downstream can write: kserve's orjson, httpx, logs)."""
    if not isinstance(value, str) or not value or len(value) > limit:
        raise BadRequest(f"{where}: must be a non-empty string of at most {limit} chars, got {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{where}: not valid Unicode ({e.reason} at {e.start}), got {shown(value)}") from e
    return value


def check_id(value: Any, where: str, cfg: ServeConfig) -> str:
    return check_text(value, where, cfg.max_id_len)


def check_instance(
    raw: Any, where: str, cfg: ServeConfig, base: Options | None = None
) -> tuple[str, list[str], list[str] | None, Options]:
    """The model-independent checks of one instance: (user_id, candidates, history or None, options)."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: expected an object with user_id and candidates, got {json_type(raw)}")
    check_keys(raw, INSTANCE_KEYS, where)
    user_id = check_id(raw.get("user_id"), f"{where}.user_id", cfg)
    cands = raw.get("candidates")
    if not isinstance(cands, list):
        raise BadRequest(f"{where}.candidates: must be a list of item id strings, got {json_type(cands)}")
    if len(cands) < cfg.min_candidates:
        raise BadRequest(f"{where}.candidates: too few candidates ({len(cands)} < {cfg.min_candidates})")
    if len(cands) > cfg.max_candidates:
        raise BadRequest(f"{where}.candidates: too many candidates ({len(cands)} > {cfg.max_candidates})")
    seen: dict[str, int] = {}
    for j, c in enumerate(cands):
        check_id(c, f"{where}.candidates[{j}]", cfg)
        if c in seen:
            raise BadRequest(
                f"{where}.candidates[{j}]: duplicate item id {shown(c)} (also at index {seen[c]})"
            )
        seen[c] = j
    history = raw.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise BadRequest(f"{where}.history: must be a list of item id strings, got {json_type(history)}")
        if len(history) > cfg.max_history:
            raise BadRequest(f"{where}.history: too long ({len(history)} > {cfg.max_history})")
        for j, h in enumerate(history):
            check_id(h, f"{where}.history[{j}]", cfg)
    return user_id, cands, history, parse_options(raw, where, cfg, base)


def parse_instance(
    raw: Any, where: str, reranker: Reranker, cfg: ServeConfig, base: Options | None = None
) -> tuple[RankRequest, Options, int]:
    """Validate one instance for `reranker`. Returns the request, its options and how many unknown history ids
    were dropped.

    Unknown *candidate* ids are rejected (the model cannot rank what it cannot read); unknown *history* ids
    are dropped, because the online history legitimately contains items newer than the model's catalogue.
    """
    user_id, cands, history, opts = check_instance(raw, where, cfg, base)
    hi = reranker.n_candidates
    if len(cands) > hi:
        raise BadRequest(
            f"{where}.candidates: too many candidates ({len(cands)} > {hi}, the model ranks {hi})"
        )
    for j, c in enumerate(cands):
        if not reranker.known_item(c):
            raise BadRequest(f"{where}.candidates[{j}]: unknown item id {shown(c)}")
    history = history or []
    known_history = [h for h in history if reranker.known_item(h)]
    return (
        RankRequest(user_id=user_id, candidates=list(cands), history=known_history),
        opts,
        len(history) - len(known_history),
    )


def parse_instances_list(instances: Any, where: str, cfg: ServeConfig) -> list[Any]:
    if not isinstance(instances, list):
        raise BadRequest(f"{where}: must be a list of instance objects, got {json_type(instances)}")
    if not instances:
        raise BadRequest(f"{where}: empty; send at least one instance")
    if len(instances) > cfg.max_instances:
        raise BadRequest(f"{where}: too many instances ({len(instances)} > {cfg.max_instances})")
    return instances


def parse_parameters(params: Any, cfg: ServeConfig) -> Options:
    """Request-level defaults ("parameters", v1 and v2): only decoder, tau and trace."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"parameters: must be an object, got {json_type(params)}")
    check_keys(params, OPTION_KEYS, "parameters")
    return parse_options(params, "parameters", cfg)


def v1_body(payload: Any, cfg: ServeConfig) -> tuple[list[Any], Any]:
    """(instances, parameters) of a v1 body: {"instances": [...], "parameters"?: {...}}."""
    if not isinstance(payload, dict):
        raise BadRequest(f"body: expected a JSON object with 'instances', got {json_type(payload)}")
    if "instances" not in payload:
        raise BadRequest('instances: missing (body must be {"instances": [...]})')
    check_keys(payload, V1_KEYS, "")
    return parse_instances_list(payload["instances"], "instances", cfg), payload.get("parameters")


def v2_body(payload: Any, cfg: ServeConfig) -> tuple[list[Any], Any]:
    """(instances, parameters) of a v2 body: one BYTES input whose elements are JSON instance objects."""
    if not isinstance(payload, dict):
        raise BadRequest(f"body: expected a JSON object with 'inputs', got {json_type(payload)}")
    if "inputs" not in payload:
        raise BadRequest('inputs: missing (body must be {"inputs": [one BYTES input of JSON instances]})')
    check_keys(payload, V2_KEYS, "")
    if payload.get("id") is not None:  # echoed back in the answer: as bounded as any id
        check_id(payload["id"], "id", cfg)
    inputs = payload["inputs"]
    if not isinstance(inputs, list) or len(inputs) != 1:
        got = len(inputs) if isinstance(inputs, list) else json_type(inputs)
        raise BadRequest(f"inputs: expected exactly one BYTES input holding JSON instances, got {got}")
    inp = inputs[0]
    if not isinstance(inp, dict):
        raise BadRequest(
            f"inputs[0]: must be an object with name, shape, datatype and data, got {json_type(inp)}"
        )
    check_keys(inp, V2_INPUT_KEYS, "inputs[0]")
    check_id(inp.get("name"), "inputs[0].name", cfg)
    if inp.get("datatype") != "BYTES":
        raise BadRequest(
            f"inputs[0].datatype: must be BYTES (JSON instances), got {shown(inp.get('datatype'))}"
        )
    if inp.get("parameters") is not None:
        if not isinstance(inp["parameters"], dict):
            raise BadRequest("inputs[0].parameters: must be an object")
        check_keys(inp["parameters"], V2_INPUT_PARAMETERS, "inputs[0].parameters")
        for key, value in inp["parameters"].items():  # what kserve's v2 model accepts: a string here
            check_text(value, f"inputs[0].parameters.{key}", 64)
    data = parse_instances_list(inp.get("data"), "inputs[0].data", cfg)
    shape = inp.get("shape")
    if not isinstance(shape, list) or [type(x) for x in shape] != [int] or shape != [len(data)]:
        raise BadRequest(
            f"inputs[0].shape: must be [{len(data)}] for {len(data)} data elements, got {shown(inp.get('shape'))}"
        )
    outputs = payload.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(
            isinstance(o, dict) and o.get("name") == OUTPUT for o in outputs
        ):
            raise BadRequest(f"outputs: the only output is [{{'name': '{OUTPUT}'}}], got {shown(outputs)}")
        for k, o in enumerate(outputs):
            check_keys(o, {"name"}, f"outputs[{k}]")
    instances = []
    for i, d in enumerate(data):
        if isinstance(d, bytes | str):
            d = parse_json(d, f"inputs[0].data[{i}]", cfg)
        instances.append(d)
    return instances, payload.get("parameters")


@dataclass(frozen=True)
class Request:
    """A validated request: its instances (raw dicts, each checked), the request-level options and where the
    instances sit in the body ("instances" for v1, "inputs[0].data" for v2: error messages name that path)."""

    instances: list[dict[str, Any]]
    params: dict[str, Any]
    options: Options
    where: str


def check_request(payload: Any, v2: bool, cfg: ServeConfig) -> Request:
    instances, params = v2_body(payload, cfg) if v2 else v1_body(payload, cfg)
    options = parse_parameters(params, cfg)
    where = "inputs[0].data" if v2 else "instances"
    for i, raw in enumerate(instances):
        check_instance(raw, f"{where}[{i}]", cfg, options)
    return Request(instances, dict(params or {}), options, where)


def validate_body(body: bytes, v2: bool, cfg: ServeConfig) -> Request:
    """The edge check of a raw predict (v1) or infer (v2) body."""
    return check_request(parse_json(body, "body", cfg), v2, cfg)


def request_instances(payload: Any, cfg: ServeConfig) -> Request:
    """The same check on what kserve hands a model: a v1 dict (bytes without a JSON content type) or a v2
    InferRequest."""
    from kserve.protocol.infer_type import InferRequest  # lazy: a slow import the edge checks do not need

    if isinstance(payload, InferRequest):
        body = {
            "id": payload.id,
            "inputs": [
                {
                    "name": i.name,
                    "shape": list(i.shape),
                    "datatype": i.datatype,
                    "data": i.data,
                    "parameters": i.parameters or None,
                }
                for i in payload.inputs
            ],
            "parameters": payload.parameters,
        }
        return check_request(body, True, cfg)
    if isinstance(payload, bytes | str):
        payload = parse_json(payload, "body", cfg)
    return check_request(payload, False, cfg)


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
        "ranker": res.ranker,  # "model", or "cold_start": no known history id (gr2/generative.py)
        "decoder": opts.decoder,
        "tau": None if opts.decoder == "ar" else opts.tau,  # spec: the draft's tau
        "timing_ms": timing,
        **extra,
    }
    if opts.trace:
        out["trace"] = res.trace
    return out


def reply(payload: Any, model_name: str, predictions: list[dict[str, Any]]) -> dict | InferResponse:
    """The answer in the request's protocol: v1 {"predictions": [...]}, or for a v2 InferRequest one BYTES
    output "predictions" holding each prediction as a JSON string."""
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

    if not isinstance(payload, InferRequest):
        return {"predictions": predictions}
    data = [json.dumps(p) for p in predictions]
    return InferResponse(
        model_name=model_name,
        infer_outputs=[InferOutput(name=OUTPUT, shape=[len(data)], datatype="BYTES", data=data)],
        response_id=payload.id or str(uuid.uuid4()),  # kserve 500s on a None id (docs/DEPENDENCIES.md)
    )
