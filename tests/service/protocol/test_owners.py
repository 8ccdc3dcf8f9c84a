"""Who owns a sequence among the workers of one replica: the worker its first step reached,
named in a folder they share (peers.py). Two WorkerPeers on one folder stand for two workers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.protocol import peers
from service.protocol.peers import HELD, OWNERS, WorkerPeers


def _workers(folder: Path) -> tuple[WorkerPeers, WorkerPeers]:
    return WorkerPeers(0, 2, folder), WorkerPeers(1, 2, folder)


def test_a_first_step_makes_the_worker_it_reached_the_owner(tmp_path: Path) -> None:
    zero, one = _workers(tmp_path)
    assert zero.owner("a", start=True) is None  # here: worker 0 owns it now
    assert one.owner("a", start=False) == 0  # a later step on the other worker goes to 0
    assert one.owner("a", start=True) == 0  # a restart too: the state is there
    assert zero.owner("a", start=False) is None
    assert one.owner("b", start=True) is None and zero.owner("b", start=False) == 1


def test_a_step_of_a_sequence_nobody_holds_is_answered_where_it_lands(tmp_path: Path) -> None:
    _, one = _workers(tmp_path)
    assert one.owner("gone", start=False) is None  # answered here: not known
    assert list((tmp_path / OWNERS).iterdir()) == []  # and nobody owns it for that


def test_only_the_owner_releases_a_sequence(tmp_path: Path) -> None:
    zero, one = _workers(tmp_path)
    zero.owner(7, start=True)
    one.release(7)  # not its own: nothing changes
    assert one.owner(7, start=False) == 0
    zero.release(7)
    assert one.owner(7, start=True) is None  # free again: the next first step takes it
    assert zero.owner(7, start=False) == 1


def test_a_step_after_its_sequence_is_gone_goes_to_the_worker_that_held_it(tmp_path: Path) -> None:
    """There it is told what became of the sequence (ended, evicted, dropped), not only that
    another worker does not know it."""
    zero, one = _workers(tmp_path)
    zero.owner("s", start=True)
    zero.release("s")  # ended or evicted on worker 0
    assert one.owner("s", start=False) == 0 and zero.owner("s", start=False) is None
    assert one.owner("s", start=True) is None  # a first step still takes it: worker 1 owns it now
    assert zero.owner("s", start=False) == 1
    one.release("s")
    assert zero.owner("s", start=False) == 1  # the last holder, in place of the one before
    WorkerPeers(1, 2, tmp_path)  # worker 1 restarted: what it held went with it
    assert zero.owner("s", start=False) is None


def test_each_worker_names_a_bounded_number_of_the_sequences_it_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "HELD_NAMES", 3)
    zero, one = _workers(tmp_path)
    for i in range(5):
        zero.owner(i, start=True)
        zero.release(i)
    assert [one.owner(i, start=False) for i in range(5)] == [None, None, 0, 0, 0]
    assert len(list((tmp_path / HELD).iterdir())) == 3


def test_int_and_string_ids_are_two_sequences(tmp_path: Path) -> None:
    zero, one = _workers(tmp_path)
    zero.owner(1, start=True)
    assert one.owner("1", start=True) is None  # "1" is not 1: its own owner
    assert zero.owner("1", start=False) == 1 and one.owner(1, start=False) == 0


def test_a_restarted_worker_owns_nothing_of_its_previous_life(tmp_path: Path) -> None:
    zero, one = _workers(tmp_path)
    zero.owner("old", start=True)
    one.owner("theirs", start=True)
    WorkerPeers(0, 2, tmp_path)  # worker 0 again, after a crash: its sequences are gone
    assert one.owner("old", start=False) is None
    assert zero.owner("theirs", start=False) == 1  # the other worker's stay


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 2**64 - 1), st.text(max_size=300)), max_size=12))
def test_any_id_a_client_sends_has_one_owner(ids: list[int | str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        zero, one = _workers(Path(folder))
        for n, sequence_id in enumerate(ids):
            first, other = (zero, one) if n % 2 == 0 else (one, zero)
            claimed = first.owner(sequence_id, start=True) is None
            owner = first.index if claimed else 1 - first.index
            assert other.owner(sequence_id, start=True) == (None if other.index == owner else owner)
        for sequence_id in ids:
            zero.release(sequence_id)
            one.release(sequence_id)
        assert list((Path(folder) / OWNERS).iterdir()) == []


def test_two_workers_starting_the_same_sequences_at_once_agree_on_each_owner(tmp_path: Path) -> None:
    """Two clients start the same ids at the same moment through different workers: for each,
    exactly one worker owns it and the other hands its steps there."""
    zero, one = _workers(tmp_path)
    ids = [f"race-{n}" for n in range(300)]
    together = threading.Barrier(2)
    seen: dict[int, list[int | None]] = {}

    def start(peers: WorkerPeers) -> None:
        together.wait()
        seen[peers.index] = [peers.owner(sequence_id, start=True) for sequence_id in ids]

    threads = [threading.Thread(target=start, args=(peers,)) for peers in (zero, one)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for at_zero, at_one in zip(seen[0], seen[1], strict=True):
        assert (at_zero, at_one) in ((None, 0), (1, None))  # one claimed it; the other names it
