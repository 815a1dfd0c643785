"""Property-based fuzzing of the request parser at the edge (issue 18), in process.

A valid v1 or v2 request is broken in one place (an instance field, an unknown key, the parameters, the
envelope, or the raw bytes); the guard in front of every server (serving/modelserver.py) must answer a 4xx
whose message starts with the broken field's path, never a 5xx, and never pass the body on. The same body
through the models' own entry point (`request_instances`, what kserve hands a model) gives the same error.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serving.modelserver import RequestGuardMiddleware
from serving.schema import INSTANCE_KEYS, OPTION_KEYS, BadRequest, ServeConfig, request_instances

CFG = ServeConfig()
ITEMS = ["a", "b", "c", "d"]
FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=10),  # a cap against a hang, far above the ~1 ms an example takes
    database=None,  # no .hypothesis/ folder in the repository
    suppress_health_check=[HealthCheck.too_slow],
)


def json_values(depth: int = 2) -> st.SearchStrategy:
    """Any JSON value up to `depth` containers deep (NaN and infinities included: json.dumps writes them)."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    if depth == 0:
        return scalars
    inner = json_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)


ANY = json_values()
not_str = ANY.filter(lambda v: not isinstance(v, str))
not_list = ANY.filter(lambda v: not isinstance(v, list))
not_bool = ANY.filter(lambda v: not isinstance(v, bool))
# A JSON escape such as "\\udc80" decodes to a lone surrogate: valid JSON, not valid Unicode (issue 36).
lone_surrogate = st.builds(
    lambda a, c, b: a + c + b,
    st.text(max_size=4),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.text(max_size=4),
)
# Integer literals no float holds (>= 2**1024) or no int() converts (more than 4,300 digits): written into the
# body as raw digits in place of the string LONG (`render`), since json.dumps itself refuses the second kind.
LONG = "__long_integer__"
long_digits = st.integers(309, 6000).map(lambda n: "9" * n)
huge_int = st.integers(min_value=2**1024, max_value=2**1100) | st.just(LONG)
bad_id = (
    not_str
    | st.just("")
    | st.text(min_size=CFG.max_id_len + 1, max_size=CFG.max_id_len + 20)
    | lone_surrogate
    | huge_int
)
bad_tau = (
    ANY.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
    | st.floats().filter(lambda x: not CFG.min_tau <= x <= CFG.max_tau)
    | st.integers().filter(lambda x: not CFG.min_tau <= x <= CFG.max_tau)
    | huge_int
)
bad_decoder = ANY.filter(lambda v: v not in CFG.decoders)
bad_candidates = (
    not_list
    | st.lists(st.sampled_from(ITEMS), max_size=CFG.min_candidates - 1, unique=True)
    | st.lists(bad_id, min_size=1, max_size=3).map(lambda bad: ["a", *bad])
    | st.sampled_from(["a", "b"]).map(lambda c: ["a", "b", c])  # a duplicate
    | st.just([f"c{k}" for k in range(CFG.max_candidates + 1)])
)
bad_history = (
    not_list.filter(lambda v: v is not None)
    | st.lists(not_str, min_size=1, max_size=3)
    | st.lists(bad_id, min_size=1, max_size=3).map(lambda bad: ["h1", *bad])
)
BAD_FIELD = {
    "user_id": bad_id,
    "candidates": bad_candidates,
    "history": bad_history,
    "decoder": bad_decoder,
    "tau": bad_tau,
    "trace": not_bool,
}
unknown_key = st.text(min_size=1, max_size=12).filter(lambda k: k not in INSTANCE_KEYS)


@st.composite
def broken_requests(draw) -> tuple[bool, bytes, str]:
    """(v2?, body, the field path the error must start with)."""
    n = draw(st.integers(1, 3))
    instances = [{"user_id": f"u{i}", "candidates": ["a", "b", "c"]} for i in range(n)]
    params: dict = {}
    i = draw(st.integers(0, n - 1))
    what = draw(
        st.sampled_from(["field", "unknown key", "parameter", "parameters key", "envelope", "bytes", "v2 id"])
    )
    v2 = draw(st.booleans())
    where = "inputs[0].data" if v2 else "instances"
    if what == "field":
        field = draw(st.sampled_from(sorted(BAD_FIELD)))
        instances[i][field] = draw(BAD_FIELD[field])
        expected = f"{where}[{i}].{field}"
    elif what == "unknown key":
        key = draw(unknown_key)
        instances[i][key] = draw(ANY)
        expected = f"{where}[{i}].{key}"
    elif what == "parameter":
        field = draw(st.sampled_from(sorted(OPTION_KEYS)))
        params[field] = draw(BAD_FIELD[field])
        expected = f"parameters.{field}"
    elif what == "parameters key":
        key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in OPTION_KEYS))
        params[key] = draw(ANY)
        expected = f"parameters.{key}"
    elif what == "envelope":
        instances = draw(not_list | st.just([]) | st.just([{"user_id": "u", "candidates": ITEMS}] * 65))
        expected = where
    elif what == "v2 id":
        v2, expected = True, "id"
    else:
        return v2, draw(st.binary(max_size=64)), "body"
    digits = draw(long_digits)
    if v2:
        data = [render(x, digits) for x in instances] if isinstance(instances, list) else instances
        shape = [len(data)] if isinstance(data, list) else [1]
        inp = {"name": "instances", "shape": shape, "datatype": "BYTES", "data": data}
        body = {"inputs": [inp], **({"parameters": params} if params else {})}
        if what == "v2 id":
            body["id"] = draw(bad_id.filter(lambda v: v is not None))
    else:
        body = {"instances": instances, **({"parameters": params} if params else {})}
    return v2, render(body, digits).encode(), expected


def render(obj, digits: str) -> str:
    """json.dumps, with the string LONG written as the integer literal `digits`."""
    return json.dumps(obj).replace(f'"{LONG}"', digits)


async def through_the_guard(
    v2: bool, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, dict, bool]:
    """(status, JSON answer, whether the body reached the app behind the guard)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    path = "/v2/models/reranker/infer" if v2 else "/v1/models/reranker:predict"
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")] if headers is None else headers,
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await RequestGuardMiddleware(app, CFG, CFG.max_body_bytes)(scope, receive, send)
    answer = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(answer), bool(reached)


@FUZZ
@given(broken_requests())
@example((False, b'{"instances": -9223372036854775809}', "instances"))  # orjson: a float, json: an int
@example(
    (False, b'{"instances": [{"user_id": "u", "candidates": ["a", "b"], "tau": 1e400}]}', "instances[0].tau")
)
def test_every_broken_request_gets_a_4xx_naming_the_field(case):
    v2, body, expected = case
    status, answer, reached = asyncio.run(through_the_guard(v2, body))
    assert 400 <= status < 500 and not reached, (status, answer)
    assert answer["error"].startswith(expected), (expected, answer["error"][:200])
    if v2:
        return  # kserve decodes v2 bodies into an InferRequest only when they are well-formed
    try:  # what a model is handed: kserve's decoded v1 dict (orjson), or the bytes it could not decode
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = body
    with pytest.raises(BadRequest) as e:
        request_instances(payload, CFG)
    # The same field, refused for the same reason; the value shown may differ (orjson reads an integer beyond
    # 64 bits as a float, the guard's parser keeps it an integer).
    assert str(e.value).split(", got ")[0] == answer["error"].split(", got ")[0]


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_never_get_a_5xx(body):
    for v2 in (False, True):
        status, answer, reached = asyncio.run(through_the_guard(v2, body))
        assert 400 <= status < 500 and not reached, (body, status, answer)
        assert answer["error"].startswith(("body", "instances", "inputs")), (body, answer)


def valid_request(lengths: list[int], v2: bool, params: dict) -> bytes:
    """A valid body: one instance per list length."""
    items = [f"i{k}" for k in range(CFG.max_candidates)]
    instances = [{"user_id": f"u{k}", "candidates": items[:n]} for k, n in enumerate(lengths)]
    if not v2:
        return json.dumps({"instances": instances, **params}).encode()
    data = [json.dumps(x) for x in instances]
    inp = {"name": "instances", "shape": [len(data)], "datatype": "BYTES", "data": data}
    return json.dumps({"inputs": [inp], **params}).encode()


@FUZZ
@given(
    st.lists(st.integers(2, 10), min_size=1, max_size=5),
    st.booleans(),
    st.fixed_dictionaries(
        {},
        optional={
            "decoder": st.sampled_from(CFG.decoders),
            "tau": st.floats(CFG.min_tau, CFG.max_tau) | st.sampled_from([1, 0.5]),
            "trace": st.booleans(),
        },
    ),
)
def test_valid_requests_of_every_length_pass_and_kserve_parses_them(lengths, v2, options):
    """Lists of any length 2..N, either protocol: through the guard to the model; and a v2 body the guard lets
    through is one kserve's own v2 model accepts (no raw 422 behind the guard)."""
    from kserve.protocol.rest.v2_datamodels import InferenceRequest

    params = {"parameters": options} if options else {}
    body = valid_request(lengths, v2, params)
    status, answer, reached = asyncio.run(through_the_guard(v2, body))
    assert status == 200 and reached, answer
    if v2:
        InferenceRequest.model_validate_json(body)


v2_fields = st.sampled_from(["id", "name", "shape", "content_type", "outputs", "parameters"])


@FUZZ
@given(v2_fields, ANY | lone_surrogate | huge_int, long_digits)
def test_a_v2_body_the_guard_accepts_is_one_kserve_accepts(field, value, digits):
    """Any value in any v2 envelope field: the guard refuses it (4xx naming the field) or kserve's pydantic model
    parses the body (a raw 422 behind the guard was a finding)."""
    from kserve.protocol.rest.v2_datamodels import InferenceRequest

    inp = {
        "name": "instances",
        "shape": [1],
        "datatype": "BYTES",
        "data": [json.dumps({"user_id": "u", "candidates": ITEMS})],
    }
    body: dict = {"inputs": [inp]}
    if field in ("name", "shape"):
        inp[field] = value
    elif field == "content_type":
        inp["parameters"] = {"content_type": value}
    elif field == "outputs":
        body["outputs"] = [{"name": "predictions", "parameters": {"x": value}}]
    elif field == "parameters":
        body["parameters"] = {"tau": value}
    else:
        body["id"] = value
    raw = render(body, digits).encode()
    status, answer, _ = asyncio.run(through_the_guard(True, raw))
    if status == 200:
        InferenceRequest.model_validate_json(raw)
    else:
        assert 400 <= status < 500, answer
        where = {"name": "inputs[0].name", "shape": "inputs[0].shape", "content_type": "inputs[0].parameters"}
        assert answer["error"].startswith(where.get(field, field)), (field, answer)


@pytest.mark.parametrize(
    "headers, status, field",
    [
        (
            [(b"content-type", b"application/json"), (b"content-type", b"text/plain")],
            400,
            "content-type: sent 2 times",
        ),
        (
            [(b"content-type", b"text/plain"), (b"content-type", b"application/json")],
            400,
            "content-type: sent 2 times",
        ),
        ([(b"content-length", b"10"), (b"content-length", b"10")], 400, "content-length: sent 2 times"),
        ([(b"authorization", b"a"), (b"authorization", b"b")], 400, "authorization: sent 2 times"),
        ([(b"x-request-id", "caf\u00e9".encode("latin-1"))], 400, "x-request-id: must be printable ASCII"),
        ([(b"authorization", b"Bearer \x00x")], 400, "authorization: must be printable ASCII"),
        ([(f"x-h{k}".encode(), b"v") for k in range(CFG.max_headers + 1)], 431, "headers: 101 header fields"),
    ],
    ids=[
        "two content types",
        "two content types, JSON last",
        "two lengths",
        "two authorizations",
        "non-ASCII request id",
        "control byte in authorization",
        "too many headers",
    ],
)
def test_headers_the_guard_refuses(headers, status, field):
    got, answer, reached = asyncio.run(through_the_guard(False, valid_request([3], False, {}), headers))
    assert (got, reached) == (status, False) and answer["error"].startswith(field), answer
