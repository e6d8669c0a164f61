"""This machine's CPU as llama.cpp's speed depends on it: the model name and the instruction-set flags, read from
/proc/cpuinfo with no runtime loaded (so a machine without llama-cpp-python, a GPU box with only torch, reads them
too)."""

from __future__ import annotations

from pathlib import Path


def cpu_id() -> str:
    """CPU model name and feature flags (Linux /proc/cpuinfo; elsewhere the platform string)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith(("flags", "Features"))), [])
    return model + "|" + " ".join(sorted(set(flags)))


def cpu_summary() -> str:
    """The instruction sets llama.cpp's CPU backend uses here, e.g. 'AVX2, AVX-512, AMX'."""
    flags = set(cpu_id().split("|", 1)[-1].split())
    named = [("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX-512-BF16", "avx512_bf16"), ("AMX", "amx_tile"),
             ("NEON", "asimd")]
    have = [n for n, f in named if f in flags]
    return ", ".join(have) or "no AVX2 (llama.cpp will be slow)"
