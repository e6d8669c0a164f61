"""Crash-safe chat history: a process saving chats in a tight loop is SIGKILLed mid-way, several times;
every save it reported complete must read back intact. A corrupt file is moved aside with a notice."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import textwrap
import time
from pathlib import Path

import pytest

from helpers import kill_mid_save

ROOT = Path(__file__).resolve().parents[1]
HISTORY_PY = ROOT / "app" / "storage.py"
IDS = [f"chat-{k}" for k in range(4)]
KILLS = 10

# The child loads app/storage.py by path, as a module of its own, away from the app package.
CHILD = textwrap.dedent(f"""
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("history", {str(HISTORY_PY)!r})
    history = importlib.util.module_from_spec(spec); spec.loader.exec_module(history)
    store = history.HistoryStore(sys.argv[1])
    ids, i = {IDS!r}, int(sys.argv[2])
    while True:
        cid = ids[i % len(ids)]
        store.save({{"version": 1, "id": cid, "title": f"t{{i}}", "created": 0, "updated": 0, "system": "",
                    "settings": {{"seq": i}}, "context_from": 0,
                    "messages": [{{"role": "user", "content": f"save {{i}}"}},
                                 {{"role": "assistant", "content": str(i) * 20000}}]}})
        os.write(1, f"{{cid}} {{i}}\\n".encode())  # one write(2) of a few bytes: a pipe never splits it
        i += 1
""")


def _history():
    spec = importlib.util.spec_from_file_location("history_under_test", HISTORY_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def history():
    return _history()


def _check(chat: dict, seq: int) -> None:
    assert chat["settings"]["seq"] == seq and chat["title"] == f"t{seq}"
    assert chat["messages"] == [{"role": "user", "content": f"save {seq}"},
                                {"role": "assistant", "content": str(seq) * 20000}]


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_sigkill_mid_save_never_loses_a_completed_save(tmp_path, history):
    root = tmp_path / "data"
    done: dict[str, int] = {}  # chat id -> last save the child reported complete
    start, stops, rng, torn = 0, [7, 23, 41, 3, 60, 15], random.Random(7), 0
    for round_no in range(KILLS):
        last = kill_mid_save(CHILD, root, start, stops[round_no % len(stops)], rng, done)  # then its next save
        store = history.HistoryStore(root)
        in_flight = last + 1  # may or may not have reached its os.replace before the kill
        for cid, seq in done.items():
            chat = store.load(cid)  # raises CorruptChat if a torn write were visible
            got = chat["settings"]["seq"]
            assert got == seq or (got == in_flight and IDS[in_flight % len(IDS)] == cid), (cid, seq, got)
            _check(chat, got)
            done[cid] = got
            torn += got == in_flight
        items, notices = store.list_chats()
        assert notices == [] and {c["id"] for c in items} == set(done)
        assert not (root / "corrupt").exists()
        start = in_flight + 1
    # Kills mid-write may leave orphaned temp files; they are never taken for chats.
    leftovers = [p.name for p in (root / "chats").iterdir() if p.suffix != ".json"]
    assert all(p.startswith(".") and p.endswith(".tmp") for p in leftovers)
    print(f"\n{KILLS} kills: {len(leftovers)} inside a write (temp file left), {torn} after the rename")


def test_temp_files_left_by_a_crash_are_swept_once_old(tmp_path, history):
    store = history.HistoryStore(tmp_path)
    chat = store.new_chat()
    store.save(chat)
    old, fresh = store.chats_dir / f".{chat['id']}.json.abc.tmp", store.chats_dir / f".{chat['id']}.json.def.tmp"
    for p in (old, fresh):
        p.write_text('{"half": ')
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    store = history.HistoryStore(tmp_path)  # the app starting again
    assert not old.exists() and fresh.exists()  # a fresh one may be another process's write in progress
    assert store.load(chat["id"])["id"] == chat["id"]


def test_atomic_write_is_temp_fsync_replace(tmp_path, history, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(history.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(history.os, "replace", lambda a, b: (calls.append(("replace", Path(a).name, Path(b).name)),
                                                             real_replace(a, b))[1])
    target = tmp_path / "x.json"
    history.atomic_write(target, '{"a": 1}')
    assert calls[0] == "fsync"  # the data is on disk before the rename makes it visible
    kind, src, dst = calls[1]
    assert kind == "replace" and src.startswith(".x.json.") and src.endswith(".tmp") and dst == "x.json"
    assert calls[2:] == ["fsync"] * (os.name == "posix")  # and the rename itself is made durable
    assert json.loads(target.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_failed_write_keeps_the_old_file(tmp_path, history, monkeypatch):
    target = tmp_path / "x.json"
    history.atomic_write(target, "old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(history.os, "fsync", boom)
    with pytest.raises(OSError):
        history.atomic_write(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_corrupt_file_is_moved_aside_with_a_notice(tmp_path, history):
    store = history.HistoryStore(tmp_path / "data")
    good = store.new_chat()
    good["messages"] = [{"role": "user", "content": "fine"}]
    store.save(good)
    bad = store.chats_dir / "chat-torn.json"
    bad.write_text('{"version": 1, "id": "chat-torn", "messages": [{"role": "us', encoding="utf-8")
    items, notices = store.list_chats()
    assert [c["id"] for c in items] == [good["id"]]
    assert len(notices) == 1 and "chat-torn.json is unreadable" in notices[0] and "moved it aside" in notices[0]
    moved = list((store.root / "corrupt").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("chat-torn.") and not bad.exists()
    assert moved[0].read_text(encoding="utf-8").startswith('{"version": 1')  # kept for the user, not deleted
    with pytest.raises(history.HistoryError):
        store.load("chat-torn")  # gone from the list; loading it again says so instead of crashing
