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

import pytest
from hypothesis import HealthCheck, given, settings
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
bad_id = not_str | st.just("") | st.text(min_size=CFG.max_id_len + 1, max_size=CFG.max_id_len + 20)
bad_tau = (
    ANY.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
    | st.floats().filter(lambda x: not CFG.min_tau <= x <= CFG.max_tau)
    | st.integers().filter(lambda x: not CFG.min_tau <= x <= CFG.max_tau)
)
bad_decoder = ANY.filter(lambda v: v not in CFG.decoders)
bad_candidates = (
    not_list
    | st.lists(st.sampled_from(ITEMS), max_size=CFG.min_candidates - 1, unique=True)
    | st.lists(bad_id, min_size=1, max_size=3).map(lambda bad: ["a", *bad])
    | st.sampled_from(["a", "b"]).map(lambda c: ["a", "b", c])  # a duplicate
    | st.just([f"c{k}" for k in range(CFG.max_candidates + 1)])
)
bad_history = not_list.filter(lambda v: v is not None) | st.lists(not_str, min_size=1, max_size=3)
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
    what = draw(st.sampled_from(["field", "unknown key", "parameter", "parameters key", "envelope", "bytes"]))
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
    else:
        return v2, draw(st.binary(max_size=64)), "body"
    if v2:
        data = [json.dumps(x) for x in instances] if isinstance(instances, list) else instances
        shape = [len(data)] if isinstance(data, list) else [1]
        inp = {"name": "instances", "shape": shape, "datatype": "BYTES", "data": data}
        body = {"inputs": [inp], **({"parameters": params} if params else {})}
    else:
        body = {"instances": instances, **({"parameters": params} if params else {})}
    return v2, json.dumps(body).encode(), expected


async def through_the_guard(v2: bool, body: bytes) -> tuple[int, dict, bool]:
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
        "headers": [(b"content-type", b"application/json")],
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
def test_every_broken_request_gets_a_4xx_naming_the_field(case):
    v2, body, expected = case
    status, answer, reached = asyncio.run(through_the_guard(v2, body))
    assert 400 <= status < 500 and not reached, (status, answer)
    assert answer["error"].startswith(expected), (expected, answer["error"][:200])
    if v2:
        return  # kserve decodes v2 bodies into an InferRequest only when they are well-formed
    try:  # what a model is handed: kserve's decoded v1 dict, or the bytes it could not decode
        payload = json.loads(body)
    except ValueError:
        payload = body
    with pytest.raises(BadRequest) as e:
        request_instances(payload, CFG)
    assert str(e.value) == answer["error"]


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_never_get_a_5xx(body):
    for v2 in (False, True):
        status, answer, reached = asyncio.run(through_the_guard(v2, body))
        assert 400 <= status < 500 and not reached, (body, status, answer)
        assert answer["error"].startswith(("body", "instances", "inputs")), (body, answer)
