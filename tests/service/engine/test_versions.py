"""Which version a request goes to, and which versions a policy serves (the routing rules of
service/engine/versions.py and service/engine/sources.py; tests/e2e/test_model_updates.py
runs them in a real server while versions load and retire)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from export.layout import ModelFiles
from model import MHAConfig
from service.decode.control import SequenceControl
from service.decode.sequences import SequenceLimits, SequenceStore
from service.engine.served import ModelIdentity, ServedModel
from service.engine.sources import ModelSource, VersionPolicy, version_number
from service.engine.versions import Loaded, Versions, VersionState
from service.errors import InvalidInput, ModelNotFound, NotReady

CONFIG = MHAConfig(d_model=8, n_head=2, max_seq_len=16)


def _loaded(version: str, state: VersionState = VersionState.SERVING) -> Loaded:
    model = ServedModel(ModelIdentity("mha", version), CONFIG, ModelFiles(Path("m")), 4, 1.0, "0" * 64, True)
    store = SequenceStore(CONFIG, SequenceLimits(), lambda: 0.0)
    parts: Any = SimpleNamespace(sequences=store)  # only the store is asked: which sequences it holds
    return Loaded(model, parts, parts, parts, parts, state)


def _begin(loaded: Loaded, sequence_id: int) -> None:
    loaded.decoder.sequences.open(SequenceControl(sequence_id, start=True), rows=1, width=CONFIG.d_model)


def test_requests_go_to_the_version_named_or_the_latest() -> None:
    versions = Versions("mha")
    with pytest.raises(NotReady, match="no version of model 'mha' is loaded"):
        versions.for_request("")
    one, two = _loaded("1"), _loaded("2")
    versions.add(two)
    versions.add(one)
    assert versions.for_request("") is two and versions.for_request("1") is one
    with pytest.raises(ModelNotFound, match=r"unknown version '7' of model 'mha'; available: \['1', '2'\]"):
        versions.for_request("7")
    one.state = VersionState.RETIRING
    with pytest.raises(ModelNotFound, match="version '1' of model 'mha' is retiring"):
        versions.for_request("1")
    assert [v.version for v in versions.serving()] == ["2"]


def test_a_version_named_by_any_string_is_kept_in_order() -> None:
    """--model-version takes any name: numbers in order, the rest first. '²' passes isdigit() and
    fails int(): `mha serve --model-version ²` loaded the model, then could not start."""
    versions = Versions("mha")
    for name in ("10", "²", "2", "v3"):
        versions.add(_loaded(name))
    assert [v.version for v in versions] == ["²", "v3", "2", "10"]
    assert versions.for_request("²").version == "²"


def test_a_sequence_goes_on_on_the_version_it_began_on() -> None:
    versions = Versions("mha")
    one, two = _loaded("1"), _loaded("2")
    versions.add(one)
    _begin(one, 5)
    versions.add(two)
    one.state = VersionState.RETIRING  # version 2 came: 1 serves only its sequences
    step = SequenceControl(5)
    assert versions.for_step(step, "") is one and versions.for_step(step, "1") is one
    with pytest.raises(InvalidInput, match=r"sequence '5' began on version '1'.*names version '2'"):
        versions.for_step(step, "2")
    assert versions.for_step(SequenceControl(6, start=True), "") is two  # new sequences: the latest
    assert versions.for_step(SequenceControl(9), "") is two  # unknown anywhere: the latest says so


def test_policies_choose_as_triton_does() -> None:
    present = [3, 1, 2, 10]
    assert VersionPolicy().choose(present) == [10]
    assert VersionPolicy("latest", count=2).choose(present) == [3, 10]
    assert VersionPolicy("all").choose(present) == [1, 2, 3, 10]
    assert VersionPolicy("specific", versions=(2, 7)).choose(present) == [2]
    names = ("1", "01", "0", "-1", "v2", "²", "9" * 30)
    assert [version_number(n) for n in names] == [1, 1, None, None, None, None, None]


def test_a_repository_names_its_versions(tmp_path: Path) -> None:
    for version in ("1", "2", "notes", "3"):
        (tmp_path / "mha" / version).mkdir(parents=True)
    (tmp_path / "mha" / "4").write_text("a file, not a version")
    source = ModelSource("mha", repository=tmp_path, read_policy=lambda _: VersionPolicy("latest", count=2))
    wanted, _ = source.wanted()
    assert wanted == {"2": tmp_path / "mha" / "2", "3": tmp_path / "mha" / "3"}
    with pytest.raises(FileNotFoundError, match="has no folder gpt/"):
        dataclasses.replace(source, name="gpt").wanted()
    (tmp_path / "mha" / "03").mkdir()  # which of 3/ and 03/ served would be the file system's choice
    with pytest.raises(ValueError, match=r"holds 03/ and 3/, both version 3: keep one of them"):
        source.wanted()


def test_a_policy_that_chooses_no_version_there_is_refused_not_an_empty_model(tmp_path: Path) -> None:
    """Served as it says, it would retire every version and serve nothing: Triton refuses it."""
    (tmp_path / "mha" / "1").mkdir(parents=True)
    source = ModelSource("mha", repository=tmp_path, read_policy=lambda _: VersionPolicy("specific", versions=(7,)))
    with pytest.raises(ValueError, match=r"holds versions \[1\], and its version_policy serves versions \[7\]"):
        source.wanted()
    (tmp_path / "mha" / "1").rmdir()
    with pytest.raises(ValueError, match=r"holds no version folder \(1/, 2/, ...\), and its version_policy serves the"):
        dataclasses.replace(source, read_policy=lambda _: VersionPolicy()).wanted()
