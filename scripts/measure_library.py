"""Model library scan time: a folder of N small GGUF files listed twice (headers read, then from the cache);
then a folder of hard links to a real model file (a 150k-token vocabulary: what a first scan pays per real
file). Writes JSON (--json) and prints it.

    python scripts/measure_library.py --files 50 --real 10 --json docs/measurements/library.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real", type=int, default=10, help="hard links to the qwen-coder draft (0: skip)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from backends.modelfiles.resolution import resolve

    real_file = resolve("qwen-coder", role="draft").path if a.real else None
    with tempfile.TemporaryDirectory(dir=real_file.parent if real_file else None) as tmp:
        root = Path(tmp)
        for name in ("cache", "hf", "home"):
            (root / name).mkdir()
        os.environ.update(DSBD_CHAT_CACHE=str(root / "cache"), HF_HUB_CACHE=str(root / "hf"), HOME=str(root / "home"))
        from backends.modelfiles import library
        from gguf_files import write_gguf

        folder = root / "models"
        for i in range(a.files):
            write_gguf(folder / f"model-{i:03d}.gguf", name=f"model {i}", seed=i)
        first, second = [], []
        for _ in range(a.repeats):
            (library.state_dir() / "headers.json").unlink(missing_ok=True)
            s1 = library.scan(dirs=[folder])
            s2 = library.scan(dirs=[folder])
            first.append((s1.seconds, s1.read))
            second.append((s2.seconds, s2.read))
        real = {}
        if real_file is not None:
            linked = root / "real"
            linked.mkdir()
            for i in range(a.real):
                os.link(real_file, linked / f"copy-{i:02d}.gguf")
            r1, r2 = library.scan(dirs=[linked]), library.scan(dirs=[linked])
            real = {"file": real_file.name, "links": a.real, "first_scan_s": round(r1.seconds, 3),
                    "first_scan_read": r1.read, "second_scan_s": round(r2.seconds, 4), "second_scan_read": r2.read}
    out = {
        "files": a.files,
        "first_scan_s": [round(s, 4) for s, _ in first], "first_scan_read": first[0][1],
        "second_scan_s": [round(s, 4) for s, _ in second], "second_scan_read": second[0][1],
        "first_median_s": round(statistics.median(s for s, _ in first), 4),
        "second_median_s": round(statistics.median(s for s, _ in second), 4),
    }
    out["real_file"] = real
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
