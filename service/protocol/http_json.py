"""JSON bodies, read strictly: a document is refused when it is not JSON, when an object gives a
key twice, or when a string holds a lone surrogate. orjson reads a body first, about four times
as fast as Python's json; where its reading could differ from the strict one (it refuses the
body, keeps one of a key given twice, or reads an integer beyond 64 bits as a float), the strict
reader reads the body again, so that every body is read, or refused, as the strict reader alone
would: the fast reader only ever saves time."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import Any

import orjson

from service.errors import InvalidInput, quote

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate code point, paired or not
STRING = re.compile(rb'"(?:[^"\\]|\\.)*"(\s*:)?')  # a JSON string, and the colon that makes it a key
WIDENED = 2.0**63  # orjson reads an integer outside [-2**63, 2**64) as a float, json as an int
NUMBERS = {int, float}


class _KeyTwice(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _ReadAgain(Exception):
    """orjson's reading may not be the strict reader's."""


def parse_json(data: bytes, what: str) -> Any:
    """The document, as the strict reader reads it; refused in its words."""
    try:
        return _read_fast(data)
    except _ReadAgain:
        return read_strictly(data, what)


def _read_fast(data: bytes) -> Any:
    try:
        doc = orjson.loads(data)  # refuses a lone surrogate, as the strict reader does
        # the document is JSON, so each string starts at the next quote: its keys are the strings
        # followed by a colon, and every one is in the document unless an object gave it twice
        written = sum(1 for colon in STRING.findall(data) if colon)
        if _keys_held(doc) != written:
            raise _ReadAgain
    except (ValueError, RecursionError) as exc:  # orjson refused it; deeper than Python recurses
        raise _ReadAgain from exc
    return doc


def _keys_held(value: Any) -> int:
    """How many keys the objects in `value` hold; _ReadAgain where a number in it may be an
    integer that orjson widened to a float."""
    kind = type(value)
    if kind is dict:
        return len(value) + sum(map(_keys_held, value.values()))
    if kind is list:
        kinds = set(map(type, value))  # at C speed: a tensor's data is a long list of numbers
        if not kinds <= NUMBERS:
            return sum(map(_keys_held, value))
        if float in kinds and not -WIDENED < min(value) <= max(value) < WIDENED:
            raise _ReadAgain
        return 0
    if kind is float and not -WIDENED < value < WIDENED:
        raise _ReadAgain
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
