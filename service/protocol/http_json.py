"""JSON bodies, read strictly: a document is refused when it is not JSON, when an object gives a
key twice, or when a string holds a lone surrogate. orjson reads a body of up to 8 MiB first,
about four times as fast as Python's json; where its reading could differ from the strict one
(it refuses the body, keeps one of a key given twice, or reads an integer beyond 64 bits as a
float), the strict reader reads the body again, so that every body is read, or refused, as the
strict reader alone would: the fast reader only ever saves time. A larger body goes to the
strict reader alone: orjson first builds a tree of 16 bytes a value, which for a body of short
numbers is several times the body's size, beyond what the in-flight budget counts for it. So
does a body of many strings or containers, which the fast reader's checks take longer over."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import Any

import orjson

from service.errors import InvalidInput, quote

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate code point, paired or not
STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?')  # a JSON string, and the colon that makes it a key
WIDENED = 2.0**63  # orjson reads an integer outside [-2**63, 2**64) as a float, json as an int
# Bodies orjson reads first: at most 8 MiB (its tree, 16 bytes a value, is not in the in-flight
# budget), and of a tensor's shape: a long run of numbers, few strings, escapes and containers,
# each of which costs the key count a step of Python (a body of 2 million strings took 0.60 s
# that way, against the strict reader's 0.03)
FAST_MAX_BYTES = 8 << 20
FAST_MAX_STEPS = {b'"': 8192, b"\\": 1024, b"[": 65536, b"{": 4096}  # per body, at most
NUMBERS = {int, float}


class _KeyTwice(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Widened(Exception):
    """A number that may be an integer orjson read as a float."""


READ_AGAIN = object()  # what the fast reader returns where its reading may not be the strict one


def parse_json(data: bytes, what: str) -> Any:
    """The document, as the strict reader reads it; refused in its words."""
    doc = _read_fast(data)
    # orjson's document is gone before the strict reader reads: a body never holds two at once
    return read_strictly(data, what) if doc is READ_AGAIN else doc


def _read_fast(data: bytes) -> Any:
    if len(data) > FAST_MAX_BYTES or any(data.count(byte) > most for byte, most in FAST_MAX_STEPS.items()):
        return READ_AGAIN
    try:
        doc = orjson.loads(data)  # refuses a lone surrogate, as the strict reader does
        # the document is JSON, so each string starts at the next quote: its keys are the strings
        # followed by a colon, and every one is in the document unless an object gave it twice
        written = sum(1 for colon in STRING.findall(data) if colon)
        return doc if _keys_held(doc) == written else READ_AGAIN
    except (ValueError, RecursionError, _Widened):  # refused by orjson; deeper than Python recurses
        return READ_AGAIN


def _keys_held(value: Any) -> int:
    """How many keys the objects in `value` hold; _Widened where a number in it may be an
    integer that orjson read as a float."""
    kind = type(value)
    if kind is dict:
        return len(value) + sum(map(_keys_held, value.values()))
    if kind is list:
        kinds = set(map(type, value))  # at C speed: a tensor's data is a long list of numbers
        if not kinds <= NUMBERS:
            return sum(map(_keys_held, value))
        if float in kinds and not -WIDENED < min(value) <= max(value) < WIDENED:
            raise _Widened
        return 0
    if kind is float and not -WIDENED < value < WIDENED:
        raise _Widened
    return 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys each stand once. Parsers disagree on a key given twice (Python's
    json keeps the last, Triton's rapidjson finds the first), so a proxy, Triton and this server
    could each read another request from the same bytes: refused, not guessed."""
    doc = dict(pairs)
    if len(doc) < len(pairs):
        raise _KeyTwice(next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1))
    return doc


def read_strictly(data: bytes, what: str) -> Any:
    """The document; refused when not JSON, when an object names a key twice, or when a string
    holds a lone surrogate: JSON can escape one (\\ud800), but no text encoding, and so neither
    gRPC nor a log line, can carry it."""
    try:
        doc = json.loads(data, object_pairs_hook=_unique_keys)
        if SURROGATE_ESCAPE.search(data):  # rare: look closer
            json.dumps(doc, ensure_ascii=False).encode()
    except _KeyTwice as exc:
        raise InvalidInput(f"{what} gives the key {quote(exc.key)} twice in one object; send each key once") from None
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} holds a lone surrogate escape (\\ud800 to \\udfff): expected text") from exc
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInput(f"{what} is not valid JSON: {str(exc) or type(exc).__name__}") from exc
    except ValueError as exc:  # an integer of more digits than Python converts from text
        limit = sys.get_int_max_str_digits()
        raise InvalidInput(f"{what} holds an integer of more than {limit} digits: expected numbers of 64 bits") from exc
    return doc
