"""bench/compare.py's narrowing of an interleaved comparison: the cases and servers it takes,
refusing what it would not measure (an unknown case or server, or a comparison without mha-serve,
whose ratios it reports)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ROOT, bench_module


@pytest.fixture
def compare(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # compare.py imports bench/common.py as `common`
    return bench_module("compare")


def test_cases_are_chosen_by_number_in_their_own_order(compare: ModuleType) -> None:
    one_client, _, _, heavy, *_ = compare.CASES
    assert compare.case_list("4,1") == [one_client, heavy]
    assert compare.case_list("1") == [one_client]
    assert all(compare.ONE_CHANNEL in case[0] for case in compare.case_list("5,6"))
    for bad in ("", "0", str(len(compare.CASES) + 1), "1,x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            compare.case_list(bad)


def test_servers_are_chosen_by_name_with_mha_serve_among_them(compare: ModuleType) -> None:
    assert compare.server_list("floor: ORT in-line, mha-serve") == ("mha-serve", "floor: ORT in-line")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown servers"):
        compare.server_list("mha-serve,KServe")
    with pytest.raises(argparse.ArgumentTypeError, match="mha-serve must be among"):
        compare.server_list("KServe + ORT,floor: ORT in-line")


def test_each_floor_runs_its_own_mode_of_floor_py(compare: ModuleType, tmp_path: Path) -> None:
    floors = [name for name in compare.SERVERS if name.startswith("floor")]
    modes = {name: compare.server_command(name, tmp_path, 8001)[0][2] for name in floors}
    assert modes == {"floor: ORT in-line": "ort", "floor: served graph in-line": "served", "floor: no compute": "none"}


def test_the_summary_reports_the_chosen_cases_only(compare: ModuleType) -> None:
    one_client, eight = compare.CASES[0], compare.CASES[1]
    row = {"p50_ms": 2.0, "rps": 100.0, "server_cpu_ms_per_request": 1.0}
    faster = {"p50_ms": 1.0, "rps": 300.0, "server_cpu_ms_per_request": 0.5}
    per_run = {
        "mha-serve": {one_client[0]: [row, row], eight[0]: [row, row]},
        "floor: ORT in-line": {one_client[0]: [faster, row], eight[0]: [faster, faster]},
    }
    summary = compare.summarize(per_run, [one_client, eight])
    over = summary["mha_serve_over"]["floor: ORT in-line"]
    assert over[f"{one_client[0]}, p50_ms"] == {"median": 1.5, "runs": [2.0, 1.0]}
    assert over[f"{eight[0]}, rps"]["runs"] == [round(100 / 300, 3)] * 2
    assert set(summary["medians"]["mha-serve"]) == {one_client[0], eight[0]}
    assert summary["every_run"] == per_run  # each run's figures, beside their medians


def test_a_base_revision_is_served_from_its_own_checkout(compare: ModuleType, tmp_path) -> None:
    """`mha-serve @REV` imports its code from the checkout (python -P: not the working tree first),
    with mha-serve's own flags and none of the name's."""
    command, env = compare.server_command("mha-serve @abc123", tmp_path / "model", 9000, tmp_path)
    assert command[1:4] == ["-P", "-m", "service.cli"] and "@abc123" not in command
    assert env["PYTHONPATH"] == str(tmp_path)
    ours, ours_env = compare.server_command("mha-serve --backend ort-cpu", tmp_path / "model", 9000)
    assert ours_env["PYTHONPATH"] == str(ROOT) and ours[-2:] == ["--backend", "ort-cpu"]


def test_a_checkout_holds_the_revision_and_goes_afterwards(compare: ModuleType) -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    with compare.checkout("HEAD") as tree:
        said = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        assert said.stdout == head.stdout and (tree / "service" / "cli.py").is_file()
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True)
    assert str(tree) not in listed.stdout


def test_the_host_s_steal_is_read_as_proc_stat_writes_it(compare: ModuleType, tmp_path) -> None:
    common = compare.common
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (guest: inside user already)
    stat.write_text("cpu  100 0 50 800 0 0 0 50 40 0\ncpu0 50 0 25 400 0 0 0 25 20 0\nintr 1 2\n")
    before = common.cpu_ticks(stat)
    assert before == (1000, 50)
    stat.write_text("cpu  400 0 150 1200 0 0 0 250 90 0\ncpu0 1 1 1 1 1 1 1 1 1 1\n")
    after = common.cpu_ticks(stat)
    assert common.steal_pct(before, after) == 20.0  # 200 of 1,000 ticks
    assert common.steal_pct(after, after) == 0.0  # no time passed: nothing to divide
    ticks, steal = common.cpu_ticks()  # this machine's, as the comparison reads it
    assert ticks > 0 and 0 <= steal <= ticks


def test_the_summary_says_how_much_cpu_the_host_took(compare: ModuleType) -> None:
    one_client = compare.CASES[0]
    calm = {"p50_ms": 1.0, "rps": 100.0, "server_cpu_ms_per_request": 1.0, "steal_pct": 1.0}
    stolen = {**calm, "steal_pct": 30.0}
    per_run = {"mha-serve": {one_client[0]: [calm, stolen, calm]}, "floor: no compute": {one_client[0]: [calm] * 3}}
    summary = compare.summarize(per_run, [one_client])
    assert summary["steal_pct"] == {"median": 1.0, "max": 30.0}
    assert summary["medians"]["mha-serve"][one_client[0]]["steal_pct"] == 1.0


class _Scripted:
    """A server whose visits find the host taking these shares of the CPUs, in turn."""

    def __init__(self, steals: list[float]) -> None:
        self.steals, self.visits = list(steals), 0

    def case(self, B: int, T: int, clients: int, seconds: float, one_channel: bool = False) -> dict:
        self.visits += 1
        return {"p50_ms": float(self.visits), "steal_pct": self.steals.pop(0)}


def test_a_visit_the_host_stole_from_is_measured_again_and_the_least_stolen_kept(compare: ModuleType) -> None:
    case = compare.CASES[0]
    calm = _Scripted([1.0, 50.0])
    assert compare.visit(calm, case, 1.0, max_steal=5.0) == {"p50_ms": 1.0, "steal_pct": 1.0, "tries": 1}
    assert calm.visits == 1
    burst = _Scripted([30.0, 2.0, 0.0])
    assert compare.visit(burst, case, 1.0, max_steal=5.0) == {"p50_ms": 2.0, "steal_pct": 2.0, "tries": 2}
    stormy = _Scripted([30.0, 10.0, 20.0, 0.0])  # never under the bound: three visits, the calmest kept
    assert compare.visit(stormy, case, 1.0, max_steal=5.0) == {"p50_ms": 2.0, "steal_pct": 10.0, "tries": 3}
    assert stormy.visits == compare.STEAL_TRIES
    unbounded = _Scripted([90.0])  # without --max-steal every visit counts as it came
    assert compare.visit(unbounded, case, 1.0, max_steal=None)["steal_pct"] == 90.0


def test_the_summary_counts_the_visits_measured_again(compare: ModuleType) -> None:
    one_client = compare.CASES[0]
    row = {"p50_ms": 1.0, "rps": 100.0, "server_cpu_ms_per_request": 1.0, "steal_pct": 1.0, "tries": 1}
    again = {**row, "tries": 3}
    summary = compare.summarize({"mha-serve": {one_client[0]: [row, again, again]}}, [one_client])
    assert summary["steal_pct"]["visits measured again"] == 2


def test_a_model_dir_without_an_export_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    """Before, each server failed on its own and the run said only "exited with 2 (see its log)"."""
    (half := tmp_path / "half").mkdir()  # a folder, but no weights: no exported model
    nowhere = tmp_path / "nowhere"
    expected = {  # what `mha serve --model-dir` says of each
        nowhere: f"{nowhere.resolve()}: no such directory; export one with `mha export --out {nowhere.resolve()}`",
        half: f"{half.resolve()} holds no exported model (no weights.safetensors); export one with `mha export --out",
    }
    for given, says in expected.items():
        args = ["--runs", "2", "--cases", "1", "--servers", "mha-serve", "--model-dir", str(given)]
        run = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "bench" / "compare.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert run.returncode == 2, run.stderr[-2000:]
        assert says in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_the_model_dir_is_an_exported_models_folder_resolved(
    small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = bench_module("common")
    monkeypatch.chdir(small_model_dir.parent)
    assert common.model_dir(small_model_dir.name) == small_model_dir.resolve()
    with pytest.raises(argparse.ArgumentTypeError, match="holds no exported model"):
        common.model_dir(str(small_model_dir.parent))


def test_a_server_that_exits_before_it_is_ready_is_reported_with_its_logs_last_line(
    compare: ModuleType, tmp_path: Path
) -> None:
    log_path = tmp_path / "server.log"
    with log_path.open("w") as out:
        said = "print('starting'); print('cannot start: --model-dir /x: no such directory')"
        proc = subprocess.Popen([sys.executable, "-c", f"{said}; raise SystemExit(2)"], stdout=out)
    proc.wait(30)
    with pytest.raises(RuntimeError) as info:
        compare.wait_ready("127.0.0.1:1", proc, timeout=30, log_path=log_path)
    assert str(info.value) == (
        f"the server exited with 2 before it was ready; its log, {log_path}, ends: "
        "cannot start: --model-dir /x: no such directory"
    )
