"""The decoding panel: mode selector, the parameters that matter for that mode, presets.

Widget values travel as a plain `settings` dict (stored with each chat) and become a `DecodeParams`
in `params_from`; the engine validates them, so this module only converts types.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.config import LOOKUP_SOURCES, MACHINES
from app.config import load_presets as config_presets
from app.config import (FOREST_POLICIES, KNOBS, MAX_BEAMS, MAX_GAMMA, MODE_FACTS, MODES, QUALITY_LEVELS, REPLACEMENTS,
                        SELECTS, UI_PRESET, DecodeParams)

ASSETS = Path(__file__).resolve().parents[3] / "assets"
FIELDS = ("preset", "mode", "quality", "max_new_tokens", "seed", "temperature", "top_k", "top_p", "beams",
          "draft_beams", "gamma", "threshold", "min_beams", "select", "length_penalty", "forest", "replacement",
          "lookup_nodes", "lookup_sources")
_INTS = ("max_new_tokens", "top_k", "beams", "draft_beams", "gamma", "min_beams", "lookup_nodes")
_FLOATS = ("temperature", "top_p", "threshold", "length_penalty")
CUSTOM = "Custom"


def relevant(mode: str) -> set[str]:
    """The parameter names that change what `mode` does (the others stay hidden)."""
    names = {"mode", "max_new_tokens", "seed", "preset"}
    f = MODE_FACTS[mode]
    if f.samples:
        names |= {"temperature", "top_k", "top_p"}
    if f.beams and f.concrete:
        names |= {"beams", "length_penalty"}
    if not f.concrete:  # auto picks the mode, gamma and W_S; W, t and W_min are the user's
        names |= {"quality", "beams", "threshold", "min_beams"}
    if f.uses_draft:
        names.add("gamma")
    if f.forest:
        names |= {"draft_beams", "threshold", "min_beams", "forest", "replacement", "lookup_nodes", "lookup_sources"}
        if not f.keeps_rows:  # memory mode: which beam to carry between iterations
            names.add("select")
    return names


def visibility(mode: str) -> dict[str, bool]:
    keep = relevant(mode)
    return {name: name in keep for name in FIELDS}


_machine = {"class": "cpu"}  # the serving engine's machine class (set_machine): the presets' caps follow it


def set_machine(machine: str) -> None:
    """Presets shown from now on carry this machine class's forest caps ("cpu" or "gpu")."""
    _machine["class"] = machine if machine in MACHINES else "cpu"


def load_presets(path: Path | None = None) -> dict[str, dict]:
    """{name: {description, settings}}: the presets with the serving machine's forest caps (app.config)."""
    return config_presets(_machine["class"], path)


def default_settings() -> dict:
    d = DecodeParams().as_dict()
    presets = load_presets()
    base = {k: d[k] for k in FIELDS if k in d} | {"draft_beams": 0, "preset": CUSTOM}
    if UI_PRESET in presets:  # the recommended starting point
        base |= presets[UI_PRESET]["settings"] | {"preset": UI_PRESET}
    return base


def _seed_widget(seed) -> int:
    # gr.Number shows None as 0, which reads as "seed 0"; -1 says "random" unambiguously.
    return -1 if seed is None else int(seed)


def settings_from_values(*values) -> dict:
    """Widget values in FIELDS order -> settings dict."""
    return dict(zip(FIELDS, values))


def params_from(settings: dict) -> DecodeParams:
    """Settings dict (widget values, sliders may send floats) -> DecodeParams, not yet validated.

    Fields hidden for the mode take DecodeParams' defaults, so a stale hidden value (say W_min > W
    left over from dsbd) never fails validation of a mode that ignores it.
    """
    s = default_settings() | {k: v for k, v in settings.items() if v is not None or k == "seed"}
    keep, base = relevant(s["mode"]), DecodeParams().as_dict()
    kw = {}
    for k in _INTS + _FLOATS + ("select", "quality", "forest", "replacement"):
        v = s[k] if k in keep else base[k]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = int(round(v)) if k in _INTS else float(v)
        kw[k] = v
    seed = s.get("seed")
    kw["seed"] = int(seed) if isinstance(seed, (int, float)) and seed >= 0 else None
    kw["draft_beams"] = kw["draft_beams"] or None  # 0 = automatic (W + 1 for dsbd, 1 for sps)
    sources = s["lookup_sources"] if "lookup_sources" in keep else base["lookup_sources"]
    kw["lookup_sources"] = (sources,) if isinstance(sources, str) else tuple(sources or ())
    return DecodeParams(mode=s["mode"], **kw)


def summary(settings: dict) -> str:
    """One line naming the mode and its key numbers, e.g. 'dsbd W=2 W_S=3 γ=3'."""
    s = default_settings() | settings
    keep, m = relevant(s["mode"]), s["mode"]
    parts = [m]
    if m == "auto":
        parts.append(s["quality"])
    for name, label in (("beams", "W"), ("draft_beams", "W_S"), ("gamma", "γ"), ("temperature", "T")):
        if name in keep and not (name == "draft_beams" and not s[name]):
            v = s[name]
            parts.append(f"{label}={v:g}" if isinstance(v, (int, float)) else f"{label}={v}")
    if "forest" in keep and s.get("forest") == "adaptive":
        parts.append("adaptive forest")
    if "replacement" in keep and s.get("replacement") == "without":
        parts.append("without replacement")
    return " ".join(parts)


def preset_info(presets: dict, name: str) -> str:
    return presets.get(name, {}).get("description", "your own settings")


def widget_updates(settings: dict, presets: dict | None = None) -> list:
    """gr.update per widget (FIELDS order) showing `settings`, with only the fields of its mode visible."""
    presets = load_presets() if presets is None else presets
    s = default_settings() | settings
    vis = visibility(s["mode"])
    out = []
    for k in FIELDS:
        extra = {"info": preset_info(presets, s[k])} if k == "preset" else {}
        value = (s[k] or 0) if k == "draft_beams" else _seed_widget(s[k]) if k == "seed" else s[k]
        out.append(gr.update(value=value, visible=vis[k], **extra))
    return out


class DecodingPanel:
    """The widgets, created inside the current Blocks context; `components` follow FIELDS order."""

    def __init__(self, settings: dict | None = None) -> None:
        s = default_settings() | (settings or {})
        vis = visibility(s["mode"])
        self.presets = load_presets()
        # each knob's label and info as app.config.KNOBS states them
        v = {k: {"visible": vis[k]} | ({"label": KNOBS[k].label, "info": KNOBS[k].plain} if k in KNOBS else {})
             for k in FIELDS}
        w = {
            "preset": gr.Radio([*self.presets, CUSTOM], value=s["preset"], label="Preset",
                               info=self._preset_info(s["preset"]), elem_id="preset", **v["preset"]),
            "mode": gr.Dropdown(list(MODES), value=s["mode"], label="Decoding mode", elem_id="mode", **v["mode"]),
            "quality": gr.Radio(list(QUALITY_LEVELS), value=s["quality"], elem_id="quality", **v["quality"]),
            "max_new_tokens": gr.Slider(1, 2048, value=s["max_new_tokens"], step=1, **v["max_new_tokens"]),
            "seed": gr.Number(value=_seed_widget(s.get("seed")), precision=0, minimum=-1, **v["seed"]),
            "temperature": gr.Slider(0.05, 2.0, value=s["temperature"], step=0.05, **v["temperature"]),
            "top_k": gr.Slider(0, 200, value=s["top_k"], step=1, **v["top_k"]),
            "top_p": gr.Slider(0.05, 1.0, value=s["top_p"], step=0.01, **v["top_p"]),
            "beams": gr.Slider(1, MAX_BEAMS, value=s["beams"], step=1, **v["beams"]),
            "draft_beams": gr.Slider(0, 4 * MAX_BEAMS, value=s["draft_beams"] or 0, step=1, **v["draft_beams"]),
            "gamma": gr.Slider(0, MAX_GAMMA, value=s["gamma"], step=1, **v["gamma"]),
            "threshold": gr.Slider(0.0, 1.0, value=s["threshold"], step=0.01, **v["threshold"]),
            "min_beams": gr.Slider(1, MAX_BEAMS, value=s["min_beams"], step=1, **v["min_beams"]),
            "select": gr.Radio(list(SELECTS), value=s["select"], **v["select"]),
            "length_penalty": gr.Slider(0.0, 2.0, value=s["length_penalty"], step=0.1, **v["length_penalty"]),
            "forest": gr.Radio(list(FOREST_POLICIES), value=s["forest"], elem_id="forest", **v["forest"]),
            "replacement": gr.Radio(list(REPLACEMENTS), value=s["replacement"], elem_id="replacement",
                                    **v["replacement"]),
            "lookup_nodes": gr.Slider(0, 16, value=s["lookup_nodes"], step=1, **v["lookup_nodes"]),
            "lookup_sources": gr.CheckboxGroup(list(LOOKUP_SOURCES), value=list(s["lookup_sources"]),
                                               elem_id="lookup-sources", **v["lookup_sources"]),
        }
        self.widgets = w
        self.components = [w[k] for k in FIELDS]
        w["mode"].change(self.on_mode, w["mode"], self.components, queue=False, show_progress="hidden")
        w["preset"].input(self.on_preset, w["preset"], self.components, queue=False, show_progress="hidden")

    def _preset_info(self, name: str) -> str:
        return preset_info(self.presets, name)

    def updates(self, settings: dict) -> list:
        return widget_updates(settings, self.presets)

    def on_mode(self, mode: str) -> list:
        vis = visibility(mode)
        return [gr.update(visible=vis[k]) for k in FIELDS]

    def on_preset(self, name: str) -> list:
        if name not in self.presets:
            return [gr.update(info=self._preset_info(name))] + [gr.skip()] * (len(FIELDS) - 1)
        ups = self.updates(self.presets[name]["settings"] | {"preset": name})
        # A preset picks the decoder, not the answer length or the seed: leave those as the user set them.
        return [gr.skip() if k in ("max_new_tokens", "seed") else u for k, u in zip(FIELDS, ups)]
