"""What `mha tune` searches and what it keeps, as decisions on measured numbers (the search on
real servers: tests/e2e/test_tune.py).

Found on the first GPU run (docs/gpu.md): the search's winner, measured again beside the defaults,
served 0.92x their req/s at 1.12x their p99, and config.env still named it; and on a GPU host,
where `--workers auto` starts one worker, the search measured `workers 1` as a candidate of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from service.app.tune import (
    Candidate,
    Confirmation,
    Measured,
    Point,
    Request,
    dimensions,
    settle,
    verdict,
    write_results,
)

TARGET_MS = 5.0


def _measured(candidate: Candidate, rps: float, p99_ms: float) -> Measured:
    return Measured(candidate, [Point(concurrency=1, throughput_rps=rps, p50_ms=p99_ms / 2, p99_ms=p99_ms)])


def _confirmation(chosen: tuple[float, float], default: tuple[float, float], rounds: int = 3) -> Confirmation:
    row = {"chosen_rps": chosen[0], "chosen_p99_ms": chosen[1], "default_rps": default[0], "default_p99_ms": default[1]}
    return Confirmation(Candidate(backend="ort-cuda").settings(), 1, [dict(row) for _ in range(rounds)])


SEARCHED = _measured(Candidate(backend="ort-cuda"), 533.0, 3.03)
DEFAULTS = _measured(Candidate(), 455.0, 4.91)


def _workers(cpus: int, auto_workers: int) -> list[object]:
    return dict(dimensions(cpus, auto_workers, ["ort-cpu", "torch"], ["fp32"]))["workers"]


def test_the_search_never_measures_the_worker_count_auto_starts_as_a_candidate_of_its_own() -> None:
    assert _workers(16, 1) == [0, 8]  # a GPU host: auto is one worker, so 1 is the defaults again
    assert _workers(16, 16) == [0, 1, 8]  # a CPU host: auto is one per CPU
    assert _workers(2, 2) == [0, 1]


def test_a_winner_the_confirmation_shows_worse_leaves_config_env_with_the_defaults(tmp_path: Path) -> None:
    """The GPU run's numbers: 0.92x the req/s and 1.12x the p99 beside the defaults."""
    confirmation = _confirmation(chosen=(490.0, 4.4), default=(533.0, 3.93))
    assert not confirmation.holds(TARGET_MS)
    chosen = settle(SEARCHED, DEFAULTS, confirmation, TARGET_MS)
    assert chosen is DEFAULTS
    said = verdict(TARGET_MS, SEARCHED, chosen, confirmation)
    assert "not better, so config.env keeps the defaults" in said
    assert said.splitlines()[-1] == f"chosen: {Candidate().label()} (455 req/s, p99 4.91 ms at 1 clients)"
    request = Request(tmp_path, [(1, 64, 128)], TARGET_MS, [1], 1.0, 60.0, out=tmp_path / "tune")
    write_results(request, [DEFAULTS, SEARCHED], chosen, confirmation)
    assert "MHA_BACKEND=auto" in (tmp_path / "tune" / "config.env").read_text()
    summary = json.loads((tmp_path / "tune" / "candidates.json").read_text())
    assert summary["confirmation"]["holds"] is False and summary["confirmation"]["settings"]["backend"] == "ort-cuda"
    assert "not better, so the defaults are kept" in (tmp_path / "tune" / "candidates.md").read_text()


def test_a_winner_the_confirmation_bears_out_is_kept() -> None:
    more_rps = _confirmation(chosen=(600.0, 3.0), default=(500.0, 3.5))
    assert settle(SEARCHED, DEFAULTS, more_rps, TARGET_MS) is SEARCHED
    assert verdict(TARGET_MS, SEARCHED, SEARCHED, more_rps).splitlines()[-1].startswith("chosen: ort-cuda")
    within_where_defaults_are_not = _confirmation(chosen=(400.0, 4.0), default=(500.0, 6.0))
    assert settle(SEARCHED, DEFAULTS, within_where_defaults_are_not, TARGET_MS) is SEARCHED
    neither_within_but_lower_p99 = _confirmation(chosen=(400.0, 8.0), default=(500.0, 10.0))
    assert settle(SEARCHED, DEFAULTS, neither_within_but_lower_p99, TARGET_MS) is SEARCHED


def test_a_gain_within_noise_is_not_a_reason_to_change() -> None:
    assert not _confirmation(chosen=(510.0, 3.0), default=(500.0, 3.0)).holds(TARGET_MS)  # 2 %: MIN_GAIN is 3 %
    assert not _confirmation(chosen=(500.0, 9.9), default=(500.0, 10.0)).holds(TARGET_MS)


def test_without_measured_defaults_the_search_s_choice_stands() -> None:
    unmeasured = Measured(Candidate(), error="the server did not start")
    worse = _confirmation(chosen=(400.0, 3.0), default=(500.0, 3.0))
    assert settle(SEARCHED, unmeasured, worse, TARGET_MS) is SEARCHED


rps = st.floats(1.0, 1e5)
p99 = st.floats(0.1, 100.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(rps, p99, rps, p99), min_size=3, max_size=7))
def test_what_settle_keeps_never_measured_worse_than_the_defaults_beside_them(
    rounds: list[tuple[float, float, float, float]],
) -> None:
    rows = [{"chosen_rps": a, "chosen_p99_ms": b, "default_rps": c, "default_p99_ms": d} for a, b, c, d in rounds]
    confirmation = Confirmation(SEARCHED.candidate.settings(), 1, rows)
    if settle(SEARCHED, DEFAULTS, confirmation, TARGET_MS) is not SEARCHED:
        return
    chosen_p99, default_p99 = confirmation.median("chosen_p99_ms"), confirmation.median("default_p99_ms")
    if chosen_p99 <= TARGET_MS and default_p99 <= TARGET_MS:
        assert confirmation.median("chosen_rps") > confirmation.median("default_rps")
    elif chosen_p99 > TARGET_MS and default_p99 > TARGET_MS:
        assert chosen_p99 < default_p99
    else:
        assert chosen_p99 <= TARGET_MS
