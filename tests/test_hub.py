"""Hugging Face search, repo files and resumable downloads, through the real huggingface_hub client against a
local stand-in for the Hub (tests/hub_server.py) serving small GGUF files written by the test."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backends.modelfiles import hub, library
from offload.gguf_header import read_header
from gguf_files import write_gguf
from hub_server import FakeHub, isolate

REPO = "org/tiny-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    out = {"tiny-Q8_0.gguf": write_gguf(d / "a.gguf", name="Tiny", n_embd=128, n_ff=512, n_layer=4, n_head=4)[0],
           "tiny-Q4_K_M.gguf": write_gguf(d / "b.gguf", name="Tiny", n_embd=64, n_ff=256, n_layer=4, n_head=4)[0],
           "mmproj-tiny-F16.gguf": write_gguf(d / "c.gguf", name="Projector")[0]}
    for p in write_gguf(d / "tiny-F16.gguf", name="Tiny", split=2):
        out[f"F16/{p.name}"] = p
    return {k: v.read_bytes() for k, v in out.items()}


@pytest.fixture
def fake(tmp_path, monkeypatch, files):
    isolate(monkeypatch, tmp_path)
    with FakeHub() as server:
        server.add_repo(REPO, files, downloads=100, last_modified="2024-05-01T00:00:00.000Z",
                        gguf={"total": 1_000_000, "architecture": "llama", "context_length": 2048})
        server.add_repo("org/newer-GGUF", {"n-Q4_0.gguf": files["tiny-Q4_K_M.gguf"]}, downloads=5,
                        last_modified="2025-06-01T00:00:00.000Z")
        server.add_repo("org/no-gguf", {"model.safetensors": b"x"}, downloads=1000)
        server.add_repo("org/private-GGUF", {"p.gguf": files["tiny-Q4_K_M.gguf"]}, private=True)
        server.add_repo("org/gated-GGUF", {"g.gguf": files["tiny-Q4_K_M.gguf"]}, gated=True,
                        last_modified="2023-01-01T00:00:00.000Z")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(hub, "_last_ok", {})
        yield server


def test_search_gguf_only_sorted(fake):
    by_downloads = hub.search("GGUF")
    # no-gguf has no .gguf file and the private repo is not listed; a gated one is, marked
    assert [m.id for m in by_downloads] == [REPO, "org/newer-GGUF", "org/gated-GGUF"]
    assert [m.gated for m in by_downloads] == [False, False, True]
    assert by_downloads[0].downloads == 100 and by_downloads[0].params == 1_000_000 and by_downloads[0].arch == "llama"
    assert [m.id for m in hub.search("newer")] == ["org/newer-GGUF"]
    assert [m.id for m in hub.search("GGUF", sort="recent", limit=2)] == ["org/newer-GGUF", REPO]
    with pytest.raises(hub.HubError, match="unknown sort"):
        hub.search("x", sort="best")


def test_family_drafts_are_smaller_repos_and_checkable_from_their_header(fake, files, tmp_path):
    fake.add_repo("org/tiny-big-GGUF", {"big.gguf": files["tiny-Q8_0.gguf"]}, downloads=50, gguf={"total": 10**10})
    found = hub.family_drafts("tiny", below_params=10**9)
    assert [m.id for m in found] == [REPO]  # the 10B one is not smaller than a 1B target
    header = hub.fetch_header(REPO, "tiny-Q4_K_M.gguf")
    target = tmp_path / "target.gguf"
    target.write_bytes(files["tiny-Q8_0.gguf"])
    assert library.check_pair(header, target).compatible  # same vocabulary, judged from the fetched header


def test_repo_files_grouped_by_quantization_and_shard(fake, files):
    listing = hub.repo_files(REPO)
    groups = {g.name: g for g in listing.groups}
    assert set(groups) == {"tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "F16/tiny-F16", "mmproj-tiny-F16.gguf"}
    f16 = groups["F16/tiny-F16"]
    assert f16.quant == "F16" and f16.shards == 2 and f16.complete and [f.shard for f in f16.files] == [(1, 2), (2, 2)]
    assert f16.size == files["F16/tiny-F16-00001-of-00002.gguf"].__len__() + len(files["F16/tiny-F16-00002-of-00002.gguf"])
    q4 = groups["tiny-Q4_K_M.gguf"]
    assert q4.quant == "Q4_K_M" and q4.files[0].sha256 == hashlib.sha256(files["tiny-Q4_K_M.gguf"]).hexdigest()
    assert groups["mmproj-tiny-F16.gguf"].kind == "mmproj" and listing.groups[-1].kind == "mmproj"
    assert listing.group("q8_0").name == "tiny-Q8_0.gguf"
    with pytest.raises(hub.HubNotFound, match="Q2_K is not in the repo"):
        listing.group("Q2_K")
    fake.repos[REPO].files.pop("F16/tiny-F16-00002-of-00002.gguf")
    assert not {g.name: g for g in hub.repo_files(REPO).groups}["F16/tiny-F16"].complete


def test_quant_names_from_file_names():
    assert hub.quant_of("Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert hub.quant_of("model.IQ4_XS.gguf") == "IQ4_XS"
    assert hub.quant_of("Q5_K_S/model-Q5_K_S-00001-of-00002.gguf") == "Q5_K_S"
    assert hub.quant_of("gemma-UD-Q4_K_XL.gguf") == "Q4_K_XL"
    assert hub.quant_of("llama-fp16.gguf") == "F16" and hub.quant_of("plain.gguf") == "unknown"


def test_download_dropped_halfway_resumes_from_the_partial_file(fake, files):
    name = "tiny-Q8_0.gguf"
    data = files[name]
    fake.drop_after[name] = len(data) // 2
    with pytest.raises(hub.HubError, match="connection lost"):
        hub.download_file(REPO, name)
    part = hub.download_path(REPO, name).with_name(name + ".part")
    kept = part.stat().st_size
    assert 0 < kept < len(data) and data.startswith(part.read_bytes())
    seen = []
    path = hub.download_file(REPO, name, progress=seen.append)
    assert path.read_bytes() == data and not part.exists() and not Path(str(part) + ".json").exists()
    assert fake.requests[-1][2] == f"bytes={kept}-"  # continued, not restarted
    assert seen[0].done == kept and seen[-1].state == "done" and seen[-1].done == len(data)
    assert hub.download_file(REPO, name) == path  # already there: nothing fetched again


def test_download_killed_with_the_app_resumes_after_a_restart(fake, files, tmp_path):
    name = "tiny-Q8_0.gguf"
    data = files[name]
    fake.hold_after[name] = len(data) // 3  # the child is mid-file when it is killed
    code = f"from backends.modelfiles import hub; hub.download_file({REPO!r}, {name!r})"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    part = hub.download_path(REPO, name).with_name(name + ".part")
    try:
        assert fake.holding.wait(120), "the download did not start"
        time.sleep(0.5)  # the child writes what it received
    finally:
        child.kill()
        child.wait(30)
        fake.released.set()
    kept = part.stat().st_size
    assert 0 < kept < len(data)
    manager = hub.DownloadManager()  # a new app: the partial download comes back paused
    try:
        (job,) = manager.jobs()
        assert job.state == "paused" and job.done == kept and job.total == len(data)
        manager.resume(job.id)
        final = manager.wait(job.id, timeout=60)
    finally:
        manager.close()
    assert final.state == "done", final.error
    assert hub.download_path(REPO, name).read_bytes() == data
    assert any(r[2] == f"bytes={kept}-" for r in fake.requests)
    found = {Path(e.path).name: e for e in library.scan().entries}  # the library lists it in place
    assert found[name].repo == REPO and found[name].usable


def test_corrupt_download_is_refused_and_deleted(fake, files):
    name = "tiny-Q4_K_M.gguf"
    bad = bytearray(files[name])
    bad[-10] ^= 0xFF
    fake.corrupt[name] = bytes(bad)
    with pytest.raises(hub.ChecksumMismatch, match="sha256"):
        hub.download_file(REPO, name)
    dest = hub.download_path(REPO, name)
    assert not dest.exists() and not list(dest.parent.iterdir())


def test_not_found_login_and_gated_errors(fake):
    with pytest.raises(hub.HubNotFound, match="repo org/nope not found"):
        hub.repo_files("org/nope")
    with pytest.raises(hub.HubNotFound, match="missing.gguf not found in org/tiny-GGUF"):
        hub.download_file(REPO, "missing.gguf")
    with pytest.raises(hub.HubAuth, match="hf auth login"):
        hub.repo_files("org/private-GGUF")
    with pytest.raises(hub.HubAuth, match="gated: accept its license"):
        hub.download_file("org/gated-GGUF", "g.gguf")
    with pytest.raises(hub.HubNotFound, match="not a Hugging Face repo id"):
        hub.repo_files("not a repo")
    with pytest.raises(hub.HubError, match="no '..'"):
        hub.download_path(REPO, "../../escape.gguf")


def test_private_repo_with_a_token(fake, monkeypatch, files):
    monkeypatch.setenv("HF_TOKEN", fake.token)
    path = hub.download_file("org/private-GGUF", "p.gguf")
    assert path.read_bytes() == files["tiny-Q4_K_M.gguf"]


def test_offline_and_unreachable_say_no_network(fake, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubOffline, match="no network: HF_HUB_OFFLINE is set"):
        hub.search("tiny")
    with pytest.raises(hub.HubOffline, match="HF_HUB_OFFLINE"):
        hub.download_file(REPO, "tiny-Q8_0.gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(hub.HubOffline, match="no network: .* cannot reach http://127.0.0.1"):
        hub.repo_files(REPO)


def test_disk_space_checked_before_starting(fake, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(hub.NotEnoughSpace, match="not enough disk space for tiny-Q8_0.gguf"):
        hub.download_file(REPO, "tiny-Q8_0.gguf")
    dest = hub.download_path(REPO, "tiny-Q8_0.gguf")
    assert not dest.with_name(dest.name + ".part").exists()


def test_queue_pause_resume_and_cancel_with_confirmation(fake, files):
    fake.hold_after["tiny-Q8_0.gguf"] = 1 << 20
    fake.throttle_s = 0.01  # a few progress ticks per file, with a speed
    events = []
    manager = hub.DownloadManager(on_progress=events.append)
    try:
        first = manager.add(REPO, "tiny-Q8_0.gguf")
        second = manager.add(REPO, "tiny-Q4_K_M.gguf")
        assert fake.holding.wait(60)  # the first is mid-file
        assert manager.get(first.id).state == "running" and manager.get(second.id).state == "queued"  # one at a time
        manager.pause(first.id)
        fake.released.set()
        paused = manager.wait(first.id, timeout=30)
        assert paused.state == "paused" and 0 < paused.done < len(files["tiny-Q8_0.gguf"])
        plan = manager.cancel(first.id)  # without confirm: says what would be lost, does nothing
        assert not plan.cancelled and plan.bytes_lost == paused.done and manager.get(first.id).state == "paused"
        assert "deletes" in plan.describe()
        manager.resume(first.id)
        assert manager.wait(first.id, timeout=60).state == "done"
        assert manager.wait(second.id, timeout=60).state == "done"
        assert hub.download_path(REPO, "tiny-Q8_0.gguf").read_bytes() == files["tiny-Q8_0.gguf"]
        with pytest.raises(hub.HubError, match="nothing to cancel"):
            manager.cancel(second.id, confirm=True)
        fake.add_repo("org/big-GGUF", {"big.gguf": files["tiny-Q8_0.gguf"]})
        fake.released.clear()
        fake.holding.clear()
        fake.hold_after["big.gguf"] = 1 << 20
        third = manager.add("org/big-GGUF", "big.gguf")
        assert fake.holding.wait(60)
        threading.Timer(0.5, fake.released.set).start()  # the worker sees the cancel at its next block
        done = manager.cancel(third.id, confirm=True)
        assert done.cancelled and manager.get(third.id).state == "cancelled"
        dest = hub.download_path("org/big-GGUF", "big.gguf")
        assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    finally:
        manager.close()
    states = {e.state for e in events}
    assert {"queued", "running", "paused", "done", "cancelled"} <= states
    assert any(e.speed > 0 for e in events if e.state == "running")


def test_header_fetch_and_fit_badges(fake, files):
    from app.engine.planning import MemoryBudget, hub_fits

    path = hub.fetch_header(REPO, "tiny-Q8_0.gguf")
    local = read_header(path)
    assert path.stat().st_size == local.data_offset < len(files["tiny-Q8_0.gguf"])  # the header only
    assert local.metadata["general.name"] == "Tiny"
    assert any(r[2] and r[2].startswith("bytes=0-") for r in fake.requests)
    listing = hub.repo_files(REPO)
    roomy = hub_fits(listing, budget=MemoryBudget(vram=8 << 30, ram=16 << 30))
    assert {f.badge for f in roomy.values()} == {"gpu"} and set(roomy) == {g.name for g in listing.groups
                                                                              if g.kind == "model"}
    cpu = hub_fits(listing, budget=MemoryBudget(vram=0, ram=16 << 30))
    assert {f.badge for f in cpu.values()} == {"cpu"}
    tight = hub_fits(listing, budget=MemoryBudget(vram=0, ram=(2 << 30) + (1 << 20)))
    assert {f.badge for f in tight.values()} == {"no"} and "does not fit" in next(iter(tight.values())).detail


def test_downloaded_file_resolves_offline(fake, monkeypatch, files):
    from backends.modelfiles.resolution import resolve

    hub.download_file(REPO, "tiny-Q4_K_M.gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = resolve(f"{REPO}:tiny-Q4_K_M.gguf")
    assert got.path == hub.download_path(REPO, "tiny-Q4_K_M.gguf") and got.kind == "gguf"
