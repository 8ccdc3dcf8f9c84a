"""The JSON reader of HTTP bodies: orjson reads first, and whatever a body holds, the document
(types included) or the refusal (its words included) is the strict reader's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import InvalidInput
from service.protocol import http_json
from service.protocol.http_json import parse_json, read_strictly

BOUNDARIES = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**19, 10**39, 10**400]
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(BOUNDARIES)
    | st.floats()  # NaN and the infinities too, which json.dumps writes and orjson refuses
    | st.text(max_size=6)
    | st.sampled_from(['":', '\\":', "\ud800", "\udc00x", "\ud83d\ude00", "{", "[", "a:b"])
)
KEYS = st.sampled_from(["a", "b", '"', '":', "\\", "\ud800"]) | st.text(max_size=3)


@st.composite
def documents(draw: st.DrawFn, depth: int = 0) -> str:
    """JSON text, written by hand so that an object may give a key twice and spaces stand anywhere."""
    space = draw(st.sampled_from(["", " ", "\n\t "]))
    kind = draw(st.sampled_from(["leaf", "list", "object"] if depth < 3 else ["leaf"]))
    if kind == "leaf":
        return space + json.dumps(draw(LEAVES), ensure_ascii=draw(st.booleans())) + space
    if kind == "list":
        items = draw(st.lists(documents(depth + 1), max_size=4))
        return f"{space}[{','.join(items)}]{space}"
    keys = draw(st.lists(KEYS, max_size=4))
    keys += draw(st.lists(st.sampled_from(keys), max_size=2)) if keys else []  # given twice, now and then
    pairs = [f"{json.dumps(key)}{space}:{draw(documents(depth + 1))}" for key in keys]
    return f"{space}{{{','.join(pairs)}}}{space}"


def _read(reader: object, data: bytes) -> tuple[str, str]:
    """What a reader makes of `data`: the document's repr (which tells 1 from 1.0), or the refusal."""
    try:
        return "document", repr(reader(data, "the body"))  # type: ignore[operator]
    except InvalidInput as exc:
        return "refused", str(exc)


@settings(max_examples=600, deadline=None)
@given(documents())
def test_every_document_is_read_as_the_strict_reader_reads_it(text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    assert _read(parse_json, data) == _read(read_strictly, data)


@settings(max_examples=400, deadline=None)
@given(documents(), st.binary(max_size=3), st.integers(min_value=0))
def test_every_damaged_body_is_refused_or_read_as_the_strict_reader_would(text: str, junk: bytes, at: int) -> None:
    data = text.encode("utf-8", "surrogatepass")
    at %= len(data) + 1
    damaged = data[:at] + junk + data[at:]
    assert _read(parse_json, damaged) == _read(read_strictly, damaged)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '[{"x": [1, 2]}, {"b": {"c": 1, "c": 1}}]',
        '{"a\\"": 1, "a\\"": 2}',  # the key holds an escaped quote
        '["a", ":", {"b": ":", "b": 1}]',  # strings that end before a colon, none of them keys
        '{"shape": [18446744073709551616, 4, 128]}',  # beyond 64 bits: orjson reads a float
        '{"parameters": {"sequence_id": -9223372036854775809}}',
        '{"data": [0.5, 100000000000000000000000000000000000000000]}',
        "[1e400, NaN]",
        '"\\ud800"',
        "\ufeff[1]",
        "{}",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    ],
)
def test_a_body_orjson_reads_otherwise_is_read_again(text: str) -> None:
    data = text.encode()
    assert _read(parse_json, data) == _read(read_strictly, data)


def test_what_orjson_would_read_otherwise_is_read_again_and_the_rest_is_not() -> None:
    """The fast reader steps aside just where it must: the common body is orjson's alone."""
    x = np.random.default_rng(0).standard_normal((2, 8, 4), dtype=np.float32)
    body = {"id": "r", "inputs": [{"name": "x", "shape": [2, 8, 4], "datatype": "FP32", "data": x.tolist()}]}
    assert http_json._read_fast(json.dumps(body).encode()) == body
    for text in ('{"a": 1, "a": 2}', "[18446744073709551616]", '["\\ud800"]', "[NaN]", "[1e19]"):
        assert http_json._read_fast(text.encode()) is http_json.READ_AGAIN, text
    largest = b"[" + b" " * (http_json.FAST_MAX_BYTES - 2) + b"]"
    assert http_json._read_fast(largest) == [] and http_json._read_fast(largest + b" ") is http_json.READ_AGAIN
    for byte, most in http_json.FAST_MAX_STEPS.items():  # a body of many strings, escapes or containers
        item = {b'"': b'"a"', b"\\": b'"\\n"', b"[": b"[]", b"{": b"{}"}[byte]
        body = b"[" + b",".join([item] * ((most - 1) // item.count(byte))) + b"]"  # at most `most`
        assert body.count(byte) <= most and http_json._read_fast(body) == json.loads(body), byte
        more = body[:-1] + b"," + b",".join([item] * 2) + b"]"
        assert more.count(byte) > most and http_json._read_fast(more) is http_json.READ_AGAIN, byte
