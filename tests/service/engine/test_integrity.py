"""What is served is what was exported: the manifest vouches for it, or the server refuses."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights
from service.client.client import MHAClient
from service.client.parity import verify_server
from service.engine.keeper import ModelLoadError
from tests.support import ServerThread, make_settings

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("other-seed")
    export_model_dir(out, SMALL, init_weights(SMALL, seed=4))
    return out


@pytest.fixture(scope="module")
def other_width(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = MHAConfig(d_model=64, n_head=4, max_seq_len=64)
    out = tmp_path_factory.mktemp("other-width")
    export_model_dir(out, config, init_weights(config, seed=3))
    return out


def _copy(source: Path, target: Path) -> Path:
    target.mkdir(exist_ok=True)
    for name in ("weights.safetensors", "model.onnx", "manifest.json"):
        shutil.copy(source / name, target / name)
    return target


def _swap_weights(d: Path, other_seed: Path, other_width: Path) -> None:
    shutil.copy(other_seed / "weights.safetensors", d / "weights.safetensors")


def _swap_both(d: Path, other_seed: Path, other_width: Path) -> None:
    for name in ("weights.safetensors", "model.onnx"):
        shutil.copy(other_seed / name, d / name)


def _other_width(d: Path, other_seed: Path, other_width: Path) -> None:
    shutil.copy(other_width / "weights.safetensors", d / "weights.safetensors")


def _zero_hashes(d: Path, other_seed: Path, other_width: Path) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    for entry in manifest["files"].values():
        entry["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(manifest))


def _config_edited(d: Path, other_seed: Path, other_width: Path) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["config"]["causal"] = False
    (d / "manifest.json").write_text(json.dumps(manifest))


def _no_manifest(d: Path, other_seed: Path, other_width: Path) -> None:
    (d / "manifest.json").unlink()


TAMPERING = {
    "weights-of-another-seed": (_swap_weights, "weights.safetensors: sha256"),
    "both-files-of-another-seed": (_swap_both, "model.onnx: sha256"),
    "weights-of-another-width": (_other_width, "weights.safetensors: sha256"),
    "all-zero-hashes": (_zero_hashes, "differs from the manifest's 000000000000"),
    "config-edited": (_config_edited, "differs from the manifest's"),
    "no-manifest": (_no_manifest, "missing ['manifest.json']"),
}


@pytest.mark.parametrize(("tamper", "why"), TAMPERING.values(), ids=TAMPERING.keys())
def test_the_server_refuses_files_the_manifest_does_not_vouch_for(
    small_model_dir: Path, other_seed: Path, other_width: Path, tmp_path: Path, tamper, why: str
) -> None:
    d = _copy(small_model_dir, tmp_path / "model")
    tamper(d, other_seed, other_width)
    with ServerThread(make_settings(d, backend="torch"), wait_ready=False) as server:
        with pytest.raises(ModelLoadError, match="refusing to serve") as info:
            server.load()
        assert why in str(info.value) and "--allow-unverified" in str(info.value)


def test_allow_unverified_serves_and_says_so_everywhere(
    small_model_dir: Path, other_seed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = _copy(small_model_dir, tmp_path / "model")
    shutil.copy(other_seed / "weights.safetensors", d / "weights.safetensors")
    with ServerThread(make_settings(d, backend="torch", allow_unverified=True)) as server, MHAClient(server.url) as c:
        parameters = c.model_config().parameters
        info = server.registry.get_sample_value("mha_model_info", {**server.engine.loaded.model.labels()})
    assert parameters["verified"].string_value == "false" and info == 1.0
    assert server.engine.loaded.model.labels()["verified"] == "false"
    assert any(r.levelname == "ERROR" and "UNVERIFIED" in r.getMessage() for r in caplog.records)


def test_the_served_identity_is_published_and_checked_by_verify(small_model_dir: Path, other_seed: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as server:
        with MHAClient(server.url) as client:
            parameters = client.model_config().parameters
        expected = hashlib.sha256((small_model_dir / "weights.safetensors").read_bytes()).hexdigest()
        assert parameters["weights_sha256"].string_value == expected
        assert parameters["verified"].string_value == "true"
        assert verify_server(server.url, small_model_dir).ok
        report = verify_server(server.url, other_seed)  # same C: only the identity can tell
    assert not report.ok and any("the server serves weights sha256" in p for p in report.problems)


def test_a_workers_timings_are_kept_for_the_others_and_unreadable_ones_measured_again(
    small_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With workers (their folder set), the first load keeps its backends' timings there; a
    second load of the same model takes them; a file that cannot be read is said and measured
    again, never served from."""
    from service.engine.keeper import load_model
    from service.engine.served import ModelIdentity

    settings = make_settings(small_model_dir, worker_socket_dir=tmp_path)
    identity = ModelIdentity("mha", "1")
    caplog.set_level("INFO", logger="service.engine.keeper")
    _, first, _ = load_model(settings, identity, lambda *_: None, small_model_dir)
    (kept,) = tmp_path.glob("timings-*.json")
    assert json.loads(kept.read_text())["probes"] == first.timings.probes != {}
    _, second, _ = load_model(settings, identity, lambda *_: None, small_model_dir)
    assert second.timings == first.timings and "timed by another worker" in caplog.text
    kept.write_text('{"probes": ')  # cut short
    caplog.clear()
    _, third, _ = load_model(settings, identity, lambda *_: None, small_model_dir)
    assert f"measuring the backends again: {kept} cannot be read" in caplog.text
    assert third.timings.probes.keys() == first.timings.probes.keys()
    assert len(list(tmp_path.iterdir())) == 1  # nothing left half-written beside it
    own_gpu = replace(settings, worker_own_gpu=True, worker_index=1)  # its GPU may be another kind
    load_model(own_gpu, identity, lambda *_: None, small_model_dir)
    assert len(list(tmp_path.iterdir())) == 2 and "timed by another worker" not in caplog.text
