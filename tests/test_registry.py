"""Model resolution (local files and folders, the Hub) and loading by runtime. Offline and fast."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backends import registry as reg
from backends.base import ModelNotFound, RegistryError
from backends.modelfiles import resolution
from backends.modelfiles.resolution import ResolvedModel, resolve
from backends.registry import ModelSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty model cache."""
    c = tmp_path / "cache"
    monkeypatch.setenv("DSBD_CHAT_CACHE", str(c))
    return c


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
    assert resolution._is_hub_id(source) is hub


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
        from backends.base import RegistryError
        from backends.modelfiles.resolution import resolve
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


# ---------------------------------------------------------------- load_model


def test_load_model_dispatches_by_backend(tmp_path, monkeypatch):
    p = gguf_file(tmp_path / "m.gguf")
    monkeypatch.setitem(reg.RUNTIMES, "llamacpp", lambda path, spec: ("llamacpp", path, spec.n_ctx))
    assert reg.load_model(ModelSpec(str(p), n_ctx=512)) == ("llamacpp", p, 512)


def test_llamacpp_refuses_safetensors_with_a_hint(tmp_path):
    d = st_folder(tmp_path / "ckpt")
    with pytest.raises(RegistryError, match="llama.cpp reads only GGUF: use --draft-backend pytorch"):
        reg.load_model(ModelSpec(str(d), backend="llamacpp"), role="draft")


def test_an_unreachable_hub_reads_the_local_cache_at_once(hub, monkeypatch, tmp_path):
    """An endpoint that does not answer: resolution asks huggingface_hub for the cached file only, instead of
    letting it retry a dead connection for half a minute; a file that is not cached fails with the offline
    message, and a cached one loads."""
    import socket

    from backends.modelfiles import hub as site

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(site, "_last_ok", {})
    real, seen = hub.hf_hub_download, []

    def spy(repo_id, filename, **kw):
        seen.append(kw)
        return real(repo_id, filename, **kw)

    monkeypatch.setattr(hub, "hf_hub_download", spy)
    with pytest.raises(RegistryError, match="cannot reach the Hugging.* and org/m:f.gguf is not in the local"):
        resolve("org/m:f.gguf")
    assert seen == [{"local_files_only": True}]
    cached = gguf_file(tmp_path / "cached.gguf")
    monkeypatch.setattr(hub, "hf_hub_download", lambda repo_id, filename, **kw: seen.append(kw) or str(cached))
    assert resolve("org/m:f.gguf").path == cached and seen[-1] == {"local_files_only": True}
