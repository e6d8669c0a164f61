"""Blind votes are crash-safe: a process voting on saved comparisons in a tight loop is SIGKILLed mid-way,
several times; every vote it reported saved reads back intact after a restart, nothing is moved aside."""

from __future__ import annotations

import os
import random
import textwrap
from pathlib import Path

import pytest

from helpers import kill_mid_save

ROOT = Path(__file__).resolve().parents[1]
N_RECORDS, KILLS = 4, 8
CHOICES = ["A", "B", "tie", "both-bad"]

CHILD = textwrap.dedent(f"""
    import os, sys
    sys.path.insert(0, {str(ROOT)!r})
    import app
    import app.compare as R
    store, i = R.ResultStore(sys.argv[1]), int(sys.argv[2])
    ids = sorted(r["id"] for r in store.list())
    choices = {CHOICES!r}
    while True:
        rec = store.load(ids[i % len(ids)])
        rec["answers"][0]["text"] = str(i) * 20000  # a save of some size, tagged with its number
        R.apply_vote(rec, choices[i % len(choices)])
        store.save(rec)
        os.write(1, f"{{rec['id']}} {{i}}\\n".encode())  # one write(2): a pipe never splits it
        i += 1
""")


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_sigkill_mid_vote_never_loses_a_saved_vote(tmp_path):
    import app.compare as R

    store = R.ResultStore(tmp_path)
    ids = []
    for k in range(N_RECORDS):
        rec = R.new_comparison(prompt=f"p{k}", modes=["greedy", "dsbd"], seed=k, settings={}, models={})
        rec["id"] = f"cmp-{k}"
        store.save(rec)
        ids.append(rec["id"])
    done: dict[str, int] = {}
    start, stops, rng, torn = 0, [5, 17, 3, 29, 11], random.Random(12), 0
    for round_no in range(KILLS):
        last = kill_mid_save(CHILD, tmp_path, start, stops[round_no % len(stops)], rng, done)
        again = R.ResultStore(tmp_path)  # the app starting again
        in_flight = last + 1  # may or may not have reached its rename before the kill
        loaded = {r["id"]: r for r in again.list()}
        assert again.notices == [] and set(loaded) == set(ids)
        for rid, seq in done.items():
            rec = loaded[rid]
            text = rec["answers"][0]["text"]
            got = int(text[: len(text) // 20000])  # the text is str(n) * 20000 for save number n
            assert text == str(got) * 20000
            assert got == seq or (got == in_flight and ids[in_flight % len(ids)] == rid), (rid, seq, got)
            assert rec["vote"]["choice"] == CHOICES[got % len(CHOICES)]
            done[rid] = got
            torn += got == in_flight
        assert not (tmp_path / "corrupt").exists()
        start = in_flight + 1
    tallies = R.pair_tallies(R.ResultStore(tmp_path).list())
    assert tallies[("dsbd", "greedy")]["votes"] == N_RECORDS  # every comparison holds exactly one vote
    print(f"\n{KILLS} kills, {start} votes saved in all, {torn} landed just after the rename")
