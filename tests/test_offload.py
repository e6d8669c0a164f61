"""offload: geometry from headers, the memory planner, layer streaming (CPU path), the cost model, `plan` CLI.

Oracles: streamed logits == resident logits bit for bit (same dtype, same device kind); plan numbers against
hand arithmetic on a synthetic geometry; GGUF header scan against gguf.GGUFReader.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from app.cli import main
from backends.registry import ModelSpec
from backends.base import BackendError
from backends.pytorch.model import init_random
from offload.cost import CostProfile, Datasheet, Roofline, datasheet, pass_cost, project
from offload.geometry import read_geometry
from app.engine.planning import assumed_stats, plan_for, plan_request, read_bench, shape
from offload.plan import GiB, MiB, MemoryBudget, PlanError, PlanRequest, parse_size, plan
from offload.runtimes import resident_mask
from offload.stream import LayerStreamer, offload_model
from offload_helpers import ARGS, session, synthetic, wrap


def request(mode: str = "auto", *, draft: bool = True, **numbers) -> PlanRequest:
    """A plan request as the app builds it: the modes as shapes read from app.config.MODE_FACTS."""
    return plan_request(mode, draft=draft, **numbers)


def with_mode(req: PlanRequest, mode: str) -> PlanRequest:
    return replace(req, shapes=(shape(mode),))


# ---------------------------------------------------------------- sizes and geometry


@pytest.mark.parametrize("text, want", [
    ("8GiB", 8 << 30), ("8GB", 8 * 10**9), ("512MiB", 512 << 20), ("8G", 8 << 30), ("1.5 gib", 3 << 29),
    ("1024", 1024), ("64kb", 64_000), ("2TiB", 2 << 40),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "GiB", "8 GiX", "8iB", "-1GB", "eight"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="like 8GiB"):
        parse_size(bad)


def test_free_vram_is_asked_of_torch_only_where_a_gpu_driver_exists(monkeypatch):
    """A Linux machine with no GPU driver has no VRAM to plan for, and its load does not import torch to learn
    that; where a driver exists, torch is asked."""
    import offload.plan as op
    import offload.stream as stream

    asked = []
    monkeypatch.setattr(stream, "free_vram", lambda device: asked.append(device) or 5 * GiB)
    monkeypatch.setattr(op.sys, "platform", "linux")
    monkeypatch.setattr(op.os.path, "exists", lambda p: False)
    assert op.detect_vram("cuda") == 0 and asked == []
    monkeypatch.setattr(op.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert op.detect_vram("cuda") == 5 * GiB and asked == ["cuda"]


def test_gguf_header_scan_matches_gguf_reader(tiny_gguf_path):
    import gguf

    g = read_geometry(tiny_gguf_path)
    reader = gguf.GGUFReader(tiny_gguf_path)
    per_layer = [0] * g.n_layers
    for t in reader.tensors:
        if t.name.startswith("blk."):
            per_layer[int(t.name.split(".")[1])] += int(t.n_bytes)
    assert list(g.layer_bytes) == per_layer
    assert g.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors if not t.name.startswith("rope"))
    assert (g.arch, g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, g.dim) == ("llama", 30, 9, 3, 64, 576)
    assert g.vocab_size == 49152 and g.tied_embeddings and g.quant == "Q4_1"
    assert g.kv_elems_per_token() == 2 * 30 * 3 * 64


def test_safetensors_geometry_from_headers(tmp_path):
    from safetensors.torch import save_file

    from backends.pytorch.safetensors_loader import hf_config, hf_name

    src = init_random(ARGS, seed=1, dtype=torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(ARGS)))
    save_file({hf_name(k): v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    g = read_geometry(tmp_path)
    layer0 = sum(p.numel() for p in src.layers[0].parameters())
    assert g.layer_params == (layer0,) * 5 and g.layer_bytes == (2 * layer0,) * 5
    assert g.embed_params == 97 * 64 and g.quant == "BF16" and g.n_kv_heads == 2 and g.head_dim == 16
    assert g.n_params == sum(p.numel() for p in src.parameters())


def test_geometry_errors(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01")  # header cut short
    with pytest.raises(BackendError, match="truncated"):
        read_geometry(tmp_path / "x.gguf")
    (tmp_path / "y.gguf").write_bytes(b"NOPE" * 8)
    with pytest.raises(BackendError, match="not a GGUF"):
        read_geometry(tmp_path / "y.gguf")
    with pytest.raises(BackendError, match="config.json"):
        read_geometry(tmp_path)


# ---------------------------------------------------------------- planner


def test_resident_mask_spreads_streamed_layers():
    assert resident_mask(4, 4) == (True,) * 4 and resident_mask(4, 0) == (False,) * 4
    m = resident_mask(10, 5)
    assert sum(m) == 5 and m != (True,) * 5 + (False,) * 5  # interleaved, not a block
    assert all(sum(resident_mask(n, k)) == k for n in range(1, 12) for k in range(n + 1))


def test_kv_accounting_follows_spec_section_9():
    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    req = request(context=4096, beams=4, gamma=3, target_backend="pytorch", draft_backend="pytorch",
                  dtype="bfloat16")
    p = plan(t, d, req, MemoryBudget(vram=64 * GiB, ram=64 * GiB))
    b = 2 * 10 * 2 * 64 * 2  # 2 x layers x kv_heads x head_dim x bf16
    assert p.target.kv_bytes_per_token == b
    assert p.kv_full_bytes == b * 4 * 4096 and p.kv_mem_bytes == b * 4096
    assert p.mode == "dsbd" and p.dsbd_full_fits and p.target.kv_rows == 4
    assert p.target.kv_bytes == b * 4 * 4097  # static cache: context + 1 scratch slot per row
    assert p.draft.kv_rows == 4 and p.target.streamed_layers == 0 and p.target.gpu_layers == 10


def test_pytorch_streams_what_does_not_fit():
    t = synthetic(n_layers=10, layer=100 * MiB, params=50 * MiB)  # bf16: 100 MiB per layer on the GPU
    req = request("sample", draft=False, context=1024, beams=1, target_backend="pytorch", dtype="bfloat16", ring=2)
    whole = plan(t, None, req, MemoryBudget(vram=64 * GiB, ram=64 * GiB))
    fixed = whole.target.vram_bytes - 10 * 100 * MiB  # embeddings, head, KV, activations
    budget = MemoryBudget(vram=fixed + 6 * 100 * MiB + 512 * MiB + MiB, ram=64 * GiB)  # room for 6 layers
    p = plan(t, None, req, budget)
    assert (p.target.gpu_layers, p.target.streamed_layers, p.target.ring) == (4, 6, 2)  # 4 resident + 2 ring
    assert p.target.h2d_bytes == 6 * 100 * MiB and p.vram_bytes <= budget.vram_avail
    assert p.target.ram_bytes == 10 * 100 * MiB + 200 * MiB  # loaded on the CPU first


def test_llamacpp_n_gpu_layers():
    t = synthetic(n_layers=10, layer=100 * MiB)
    req = request("sample", draft=False, context=512, beams=1)
    all_in = plan(t, None, req, MemoryBudget(vram=64 * GiB, ram=64 * GiB))
    assert all_in.target.n_gpu_layers == 11 and all_in.target.cpu_layers == 0  # + the output layer
    cpu = plan(t, None, req, MemoryBudget(vram=0, ram=64 * GiB))
    assert cpu.target.n_gpu_layers == 0 and cpu.target.cpu_layers == 10 and cpu.vram_bytes == 0
    kv_layer = 512 * 2 * 2 * 64 * 4  # f32 cache, one row
    act = all_in.target.vram_bytes - 10 * (100 * MiB + kv_layer) - 50 * MiB
    some = plan(t, None, req, MemoryBudget(vram=act + 3 * (100 * MiB + kv_layer) + 512 * MiB + 1, ram=64 * GiB))
    assert some.target.n_gpu_layers == 3 and some.target.cpu_layers == 7 and some.target.kv_gpu_bytes == 3 * kv_layer


def test_auto_falls_back_to_memory_mode():
    t, d = synthetic(kv_heads=8, head_dim=128), synthetic(n_layers=4, layer=10 * MiB, name="d")
    req = request(context=8192, beams=8, target_backend="pytorch", draft_backend="pytorch", dtype="bfloat16")
    full = plan(t, d, req, MemoryBudget(vram=64 * GiB, ram=64 * GiB))
    assert full.mode == "dsbd" and full.target.streamed_layers == 0
    # Full mode's KV would push layers off the GPU (it still fits, streaming): memory mode keeps them resident.
    roomy = MemoryBudget(vram=full.vram_bytes - full.kv_full_bytes + full.kv_mem_bytes + 2 * GiB, ram=64 * GiB)
    p = plan(t, d, req, roomy)
    assert p.mode == "dsbd-mem" and p.dsbd_full_fits and p.target.kv_rows == 1 and p.target.streamed_layers == 0
    assert "dsbd full mode would read" in p.notes[0] and "outside VRAM" in p.notes[0]
    assert plan(t, d, with_mode(req, "dsbd"), roomy).target.streamed_layers > 0
    # Full mode's KV alone exceeds the GPU: only memory mode fits.
    tight = MemoryBudget(vram=full.vram_bytes - full.kv_full_bytes + full.kv_mem_bytes + 10 * MiB, ram=64 * GiB)
    p = plan(t, d, req, tight)
    assert p.mode == "dsbd-mem" and p.dsbd_full_fits is False and 1 <= p.max_beams < 8 and p.max_context >= 8192
    with pytest.raises(PlanError, match="--mode dsbd-mem"):
        plan(t, d, with_mode(req, "dsbd"), tight)


def test_max_context_and_max_beams_are_tight():
    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    req = request(context=2048, beams=4)
    budget = MemoryBudget(vram=0, ram=4 * GiB)
    p = plan(t, d, req, budget)
    more = replace(req, context=p.max_context + 256)
    assert plan(t, d, replace(req, context=p.max_context), budget).mode == p.mode
    with pytest.raises(PlanError):
        plan(t, d, with_mode(more, p.mode), budget)
    with pytest.raises(PlanError):
        plan(t, d, replace(with_mode(req, "dsbd"), beams=p.max_beams + 1), budget)


def test_no_fit_error_says_what_would_fit():
    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    req = request(context=32768, beams=8)
    with pytest.raises(PlanError) as e:
        plan(t, d, req, MemoryBudget(vram=0, ram=4 * GiB))
    msg = str(e.value)
    assert isinstance(e.value, BackendError)
    assert "does not fit" in msg and "GiB RAM but 2.00 GiB is usable" in msg
    c = int(msg.split("--context ")[1].split(" ")[0])
    assert 0 < c < 32768 and plan(t, d, replace(req, context=c), MemoryBudget(vram=0, ram=4 * GiB))
    with pytest.raises(PlanError, match=r"a Q\d_K\w* quant of the target"):  # 8-bit weights: a smaller quant fits
        plan(t, d, request(context=512, beams=1), MemoryBudget(vram=0, ram=2 * GiB + 700 * MiB))
    with pytest.raises(PlanError, match="--dtype bfloat16"):
        plan(synthetic(params=100 * MiB), None, request(draft=False, context=512, beams=1, target_backend="pytorch"),
             MemoryBudget(vram=0, ram=2 * GiB + 3 * GiB))
    with pytest.raises(PlanError, match="Free .* more RAM"):
        plan(t, d, request(context=512, beams=1), MemoryBudget(vram=0, ram=2 * GiB + 10 * MiB))


def test_plan_for_specs_and_detected_budget():
    from app.config import DecodeParams

    p = plan_for(ModelSpec(source="tiny", backend="pytorch", dtype="bfloat16", n_ctx=1024), ModelSpec(source="tiny"),
                 DecodeParams(mode="dsbd", beams=2).validated(), budget=MemoryBudget(vram=2 * GiB, ram=8 * GiB))
    assert (p.context, p.beams, p.draft_beams, p.gamma) == (1024, 2, 3, 3)
    assert p.target.runtime == "pytorch" and p.draft.runtime == "llamacpp" and p.target.gpu_layers == 30
    b = MemoryBudget.detect(vram=None, ram=None)  # no CUDA here: 0 VRAM; RAM from psutil
    assert b.source == "detected" and b.ram > 0 and (b.vram > 0) == torch.cuda.is_available()


def test_plan_is_printable_and_serialisable():
    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    p = plan(t, d, request(), MemoryBudget(vram=8 * GiB, ram=32 * GiB))
    text = p.format()
    assert "mode: dsbd" in text and "n_gpu_layers" in text and "max context" in text
    back = json.loads(json.dumps(p.as_dict()))
    assert back["target"]["n_gpu_layers"] == 11 and back["budget"]["vram"] == 8 * GiB
    with pytest.raises(PlanError, match="draft beams"):
        plan(t, d, request(beams=4, draft_beams=3), MemoryBudget(vram=0, ram=32 * GiB))


# ---------------------------------------------------------------- streaming (CPU path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpu_layers, ring", [(0, 2), (2, 2), (1, 1), (0, 3)])
def test_streamed_equals_resident_random_model(dtype, gpu_layers, ring):
    resident = session(wrap(init_random(ARGS, seed=4, dtype=dtype), dtype))
    model = wrap(init_random(ARGS, seed=4, dtype=dtype), dtype)
    streamer = offload_model(model, gpu_layers=gpu_layers, device="cpu", ring=ring)
    assert streamer.ring == ring < ARGS.n_layers and len(streamer.streamed_layers) == 5 - gpu_layers
    got = session(model)
    for want, out in zip(resident, got):
        assert np.array_equal(want, out)  # bit for bit
    assert streamer.loads > len(streamer.streamed_layers) > ring  # the ring is reloaded every pass
    assert streamer.bytes_copied == streamer.loads * streamer.streamed_bytes // len(streamer.streamed_layers)
    assert model.info.extra["offload"]["streamed_layers"] == 5 - gpu_layers


def test_streaming_keeps_the_state_dict():
    src = init_random(ARGS, seed=5, dtype=torch.float32)
    want = {k: v.clone() for k, v in src.state_dict().items()}
    streamer = offload_model(wrap(src, torch.float32), gpu_layers=1, device="cpu")
    got = src.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    layer_bytes = sum(p.numel() * 4 for p in src.layers[0].parameters())
    assert layer_bytes <= streamer.streamed_bytes / 4 < layer_bytes + 256 * 10  # one flat, aligned buffer per layer


def test_prefetch_order():
    layers = init_random(replace(ARGS, n_layers=4), seed=6, dtype=torch.float32).layers
    trace: list = []
    s = LayerStreamer(layers, resident=(False,) * 4, device="cpu", ring=2, trace=trace)
    list(s), list(s)  # two passes
    L, C = "load", "compute"
    first = [(L, 0), (L, 1), (C, 0), (L, 2), (C, 1), (L, 3), (C, 2), (C, 3), (L, 0), (L, 1)]  # + next pass's head
    second = [(C, 0), (L, 2), (C, 1), (L, 3), (C, 2), (C, 3), (L, 0), (L, 1)]  # 0 and 1 were prefetched
    assert trace == first + second
    trace.clear()
    one = LayerStreamer(layers, resident=(True, False, True, False), device="cpu", ring=1, trace=trace)
    list(one)
    assert trace == [(C, 0), (L, 1), (C, 1), (C, 2), (L, 3), (C, 3), (L, 1)]  # ring 1: no overlap


def test_streamed_equals_resident_tiny_gguf(tiny_gguf_path):
    from backends.pytorch import load

    model = load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), backend="pytorch"))
    want = session(model)
    streamer = offload_model(model, gpu_layers=10, device="cpu", ring=2)
    assert len(streamer.streamed_layers) == 20 and streamer.ring == 2
    for w, g in zip(want, session(model)):
        assert np.array_equal(w, g)


# ---------------------------------------------------------------- cost model


def test_pass_cost_roofline_and_overlap():
    t = synthetic(n_layers=10, layer=100 * MiB, params=50 * MiB)
    req = request("sample", draft=False, context=1024, beams=1, target_backend="pytorch", dtype="bfloat16")
    budget = MemoryBudget(vram=int(1.2 * GiB), ram=64 * GiB)
    p = plan(t, None, req, budget).target
    assert p.streamed_layers > 0
    hw = Datasheet("x", vram_gb=2, h2d_gbps=10, tflops=100, mem_gbps=1000, overhead_ms=0)
    c = pass_cost(p, hw, 1)
    assert c.copy_s == pytest.approx(p.h2d_bytes / 10e9) and c.bound == "h2d"
    assert c.seconds == pytest.approx(max(c.copy_s, c.gpu_s))
    assert pass_cost(replace(p, ring=1), hw, 1).seconds == pytest.approx(c.copy_s + c.gpu_s)
    big = pass_cost(p, replace(hw, h2d_gbps=1e6, tflops=0.01), 64)
    assert big.bound == "gpu-compute" and big.gpu_s == pytest.approx(2 * p.gpu_params * 64 / 0.01e12)


def test_bench_file_and_projection(tmp_path):
    bench = {
        "config": {"base": {"beams": 4, "draft_beams": None, "gamma": 3}},
        "runs": [{"mode": "dsbd:gamma=2", "stats": {"target_passes": 10, "draft_passes": 20}},
                 {"mode": "sps", "stats": {"target_passes": 30, "draft_passes": 90}}],
        "summary": {"dsbd:gamma=2": {"target_passes_per_token": 0.4, "steps_per_target_pass": 2.5},
                    "sps": {"target_passes_per_token": 0.5, "steps_per_target_pass": 2.0},
                    "beam-sample": {"target_passes_per_token": 1.0, "steps_per_target_pass": 1.0}},
    }
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(bench))
    stats = {s.label: s for s in read_bench(f, request())}
    assert stats["dsbd:gamma=2"].tokens_per_target_pass == pytest.approx(2.5)
    assert stats["dsbd:gamma=2"].request.gamma == 2 and stats["dsbd:gamma=2"].draft_passes_per_target_pass == 2
    assert stats["sps"].request.draft_beams == 1 and stats["beam-sample"].draft_passes_per_target_pass == 0
    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    hw = CostProfile("rtx3060-12gb", machine="gpu", datasheet=datasheet("rtx3060-12gb"))
    rows = {r.label: r for r in project(t, d, MemoryBudget(vram=12 * GiB, ram=64 * GiB), hw,
                                        list(stats.values()))}
    r = rows["dsbd:gamma=2"]
    assert r.fits and r.target_tokens == 4 + 5 * 2
    assert r.tokens_per_s == pytest.approx(2.5 / (r.target_pass_ms + 2 * r.draft_pass_ms) * 1e3)
    assert r.as_dict()["kind"] == "projection"
    tight = project(t, d, MemoryBudget(vram=0, ram=2 * GiB + 300 * MiB), hw, list(stats.values()))
    assert not any(x.fits for x in tight) and "does not fit" in tight[0].why
    with pytest.raises(PlanError, match="summary"):
        (tmp_path / "bad.json").write_text("[1]")
        read_bench(tmp_path / "bad.json", request())


def test_assumed_stats_and_profiles():
    base = request(beams=4, draft_beams=5, gamma=3)
    s = assumed_stats("sps", base, acceptance=0.5)
    assert s.tokens_per_target_pass == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert (s.request.beams, s.request.draft_beams, s.target_tokens, s.draft_tokens) == (1, 1, 4, (1, 1, 1))
    assert assumed_stats("beam-sample", base).tokens_per_target_pass == 1
    assert datasheet("cpu-only").vram_gb == 0 and datasheet(h2d_gbps=1, tflops=2, mem_gbps=3).name == "custom"
    with pytest.raises(PlanError, match="unknown datasheet"):
        datasheet("rtx9090")
    with pytest.raises(PlanError, match="--mem-gbps"):
        datasheet(h2d_gbps=1, tflops=2)


def test_one_speed_model_curves_and_datasheets():
    """A plan prices a mode on a curves profile exactly as the forest policy and the bench read that curve, and
    on a datasheet by the roofline of the plan's own placement; this machine's timed profile projects nothing."""
    from app.engine.timing import cost_profile

    t, d = synthetic(), synthetic(n_layers=4, layer=10 * MiB, name="d")
    base = request(beams=4, draft_beams=5, gamma=3)
    stats = [assumed_stats("beam-sample", base), assumed_stats("dsbd", base, acceptance=0.6)]
    budget = MemoryBudget(vram=24 * GiB, ram=64 * GiB)
    curves = cost_profile("rtx4090-7b")
    rows = {r.label: r for r in project(t, d, budget, curves, stats)}
    assert rows["beam-sample"].target_pass_ms == pytest.approx(curves.target(4) * 1e3)
    n_t = rows["dsbd"].target_tokens
    assert rows["dsbd"].target_pass_ms == pytest.approx(curves.target(n_t) * 1e3)
    drafts = [curves.draft(n) for n in stats[1].draft_tokens]
    assert rows["dsbd"].draft_pass_ms == pytest.approx(sum(drafts) / len(drafts) * 1e3)
    assert rows["dsbd"].bound == "curve"
    sheet = cost_profile("rtx4090-24gb")
    assert sheet.target is None and sheet.vram_gb == 24
    row = project(t, d, budget, sheet, stats[:1])[0]
    placed = sheet.placed(plan(t, d, stats[0].request, budget))
    assert isinstance(placed.target, Roofline)
    assert row.target_pass_ms == pytest.approx(pass_cost(placed.target.placement, sheet.datasheet, 4).seconds * 1e3)
    with pytest.raises(PlanError, match="timed only with the models loaded"):
        project(t, d, budget, cost_profile("timed"), stats)


# ---------------------------------------------------------------- CLI


def test_cli_plan_table_and_json(capsys):
    assert main(["plan", "--vram", "8GiB", "--ram", "32GiB", "--context", "2048", "--beams", "2"]) == 0
    out = capsys.readouterr().out
    assert "mode: dsbd" in out and "request: context 2048, W=2, W_S=3" in out
    assert main(["plan", "--ram", "32GiB", "--cost-profile", "laptop-8gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["budget"]["vram"] == 8 * GiB
    assert data["plan"]["budget"]["source"].startswith("VRAM cost profile laptop-8gb")
    assert {p["mode"] for p in data["projections"]} == {"sample", "beam-sample", "sps", "dsbd", "dsbd-mem"}
    assert all(p["kind"] == "projection" for p in data["projections"])


def test_cli_plan_errors(capsys):
    assert main(["plan", "--vram", "8 bananas", "--ram", "1GiB"]) == 2
    assert "--vram: cannot read size" in capsys.readouterr().err
    assert main(["plan", "--vram", "0", "--ram", "2100MiB", "--context", "8192"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "RAM" in err
