"""Requantized copies of a GGUF file (llama.cpp's quantize API), made once and cached beside the original.

A draft model pays per token for reading its weights; a smaller or simpler weight type makes its passes
cheaper (Q4_0 is also the type llama.cpp repacks for AVX2 / AVX-512 where the repack is on). The copy is
keyed by the source file (path, size, mtime), the type and the llama-cpp-python build: a changed source or
build makes it again. Exactness is untouched: the draft's q is whatever the draft computes.

    python -m backends.llamacpp.quantize SRC.gguf q4_0          # make (or find) the copy, print its path
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# Names users type -> llama_ftype. "-head" variants also quantize the output matrix (the vocabulary head) to the
# same type; otherwise llama.cpp keeps it at a higher precision (Q6_K, or Q8_0 where rows do not fit K blocks).
TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_0-head": "LLAMA_FTYPE_MOSTLY_Q4_0",
         "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
_GGML_Q4_0 = 2  # enum ggml_type


def quantized_path(src: Path, qtype: str, *, folder: Path) -> Path:
    """Where the `qtype` copy of `src` lives in `folder` (the models cache: backends.modelfiles.presets.cache_dir())."""
    _check(qtype)
    src = Path(src)
    return Path(folder) / f"{src.stem}.{qtype}.gguf"


def _source_key(src: Path, qtype: str) -> dict:
    import llama_cpp

    st = src.stat()
    return {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "type": qtype,
            "llama_cpp": llama_cpp.__version__}


def _check(qtype: str) -> None:
    if qtype not in TYPES:
        raise ValueError(f"unknown draft quantization {qtype!r}; choose one of: {', '.join(TYPES)}")


def requantized(src: Path, qtype: str, *, folder: Path, threads: int | None = None) -> Path:
    """The `qtype` copy of `src`, made now if missing or stale (seconds for a 0.5B model)."""
    src = Path(src)
    dest = quantized_path(src, qtype, folder=folder)
    marker = dest.with_name(dest.name + ".source.json")
    want = _source_key(src, qtype)
    try:
        if dest.is_file() and json.loads(marker.read_text()) == want:
            return dest
    except (OSError, ValueError):
        pass  # no marker or a damaged one: make the copy again
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.stem}.", suffix=".tmp")
    os.close(fd)
    try:
        _quantize(src, Path(tmp), qtype, threads)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the original's copy should read like the original
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    marker.write_text(json.dumps(want, indent=1) + "\n")
    return dest


def _quantize(src: Path, dest: Path, qtype: str, threads: int | None) -> None:
    import llama_cpp.llama_cpp as ll

    from backends.base import BackendError
    from backends.llamacpp._native import take_errors

    p = ll.llama_model_quantize_default_params()
    p.ftype = getattr(ll, TYPES[qtype])
    p.allow_requantize = True  # the sources we ship are already quantized
    p.nthread = threads or 0
    if qtype.endswith("-head"):
        p.output_tensor_type = _GGML_Q4_0
    rc = ll.llama_model_quantize(os.fsencode(str(src)), os.fsencode(str(dest)), p)
    if rc != 0:
        raise BackendError(f"llama.cpp could not quantize {src} to {qtype} (code {rc}): {take_errors() or 'no log'}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(f"usage: python -m backends.llamacpp.quantize SRC.gguf {{{'|'.join(TYPES)}}}", file=sys.stderr)
        return 2
    print(requantized(Path(args[0]), args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
