"""Requantized model copies (backends/llamacpp/quantize.py) and the ModelSpec option that loads them."""

from __future__ import annotations

import os
import shutil

import pytest

from backends.registry import ModelSpec, SpecError


def test_spec_names_the_quantizations_and_the_runtime():
    assert ModelSpec(source="tiny", quant="q4_0").validated().quant == "q4_0"
    with pytest.raises(SpecError, match="unknown quantization 'q3'; choose one of: q4_0, q4_0-head, q8_0"):
        ModelSpec(source="tiny", quant="q3").validated()
    with pytest.raises(SpecError, match="runs on llama.cpp"):
        ModelSpec(source="tiny", quant="q4_0", backend="pytorch").validated()


def test_a_copy_is_made_once_and_again_when_the_source_changes(tiny_gguf_path, tmp_path):
    from gguf import GGUFReader

    from backends.llamacpp.quantize import quantized_path, requantized

    src = tmp_path / "src.gguf"
    shutil.copyfile(tiny_gguf_path, src)  # a copy: the test changes its mtime
    out = requantized(src, "q4_0-head", folder=tmp_path / "cache", threads=1)
    assert out == quantized_path(src, "q4_0-head", folder=tmp_path / "cache") and out.is_file()
    types = {t.name: t.tensor_type.name for t in GGUFReader(out, "r").tensors}
    assert {v for k, v in types.items() if k.endswith("weight") and "norm" not in k} == {"Q4_0"}
    made = out.stat().st_mtime_ns
    assert requantized(src, "q4_0-head", folder=tmp_path / "cache") == out and out.stat().st_mtime_ns == made
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new source file: the copy is stale
    requantized(src, "q4_0-head", folder=tmp_path / "cache", threads=1)
    assert out.stat().st_mtime_ns != made
    with pytest.raises(ValueError, match="unknown draft quantization"):
        requantized(src, "q2", folder=tmp_path)
