"""Render a report.html as a reader sees it: headless Chromium at a given width, screenshots saved as PNGs.

    python -m kvbench.report.screenshot results/reference/report/report.html \
        --out results/reference/report/screenshots [--width 1400]

Writes top.png (the first screen: the takeaways), plots.png, tables.png and overall.png (one screen from each of
those anchors) and full.png (the whole page scaled to 1/4, to see its shape), and prints the page's height.
Needs Debian's `chromium` package (`apt-get install -y chromium`).

Exit codes: 0 done; 2 no chromium, or a missing report.html: one line naming the fix.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ANCHORS = ["plots", "tables", "overall"]
MEASURE = """<script>window.addEventListener('load',function(){var p={height:document.documentElement.scrollHeight};
%s.forEach(function(i){var e=document.getElementById(i);if(e){p[i]=Math.round(e.getBoundingClientRect().top
+window.scrollY)}});document.body.setAttribute('data-pos',JSON.stringify(p))});</script></body>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    print(
        "kvbench.report.screenshot: error: no chromium found; install it: apt-get install -y chromium", file=sys.stderr
    )
    sys.exit(2)


def browse(page: Path, width: int, height: int, *action: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                chromium(),
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--virtual-time-budget=5000",
                *action,
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
    return done.stdout


def positions(page: Path, width: int) -> dict:
    """Page height and each anchor's y (CSS px), measured by the browser on a copy of the page."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.html"
        probe.write_text(
            page.read_text(encoding="utf-8").replace("</body>", MEASURE % json.dumps(ANCHORS), 1), encoding="utf-8"
        )
        dom = browse(probe, width, 1000, "--dump-dom")
    found = re.search(r"data-pos=\"([^\"]+)\"", dom)
    return json.loads(found.group(1).replace("&quot;", '"')) if found else {"height": 8000}


def save(image: Image.Image, path: Path, scale: float = 1.0, exact: bool = False) -> None:
    """Palette-encoded unless `exact` (these are committed next to the report): screens with plots stay RGB,
    a 256-colour palette greys out their method colours."""
    image = image.convert("RGB")
    if scale != 1:
        image = image.resize((int(image.width * scale), int(image.height * scale)), Image.Resampling.LANCZOS)
    if not exact:
        image = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    image.save(path, optimize=True)
    print(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--screen", type=int, default=1000, help="height of one screen (px)")
    args = parser.parse_args()
    if not args.page.is_file():
        print(f"kvbench.report.screenshot: error: {args.page}: no such file", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    where = positions(args.page, args.width)
    height = min(int(where["height"]) + 20, 30000)
    with tempfile.TemporaryDirectory() as tmp:
        shot = Path(tmp) / "page.png"
        browse(args.page, args.width, height, f"--screenshot={shot}")
        whole = Image.open(shot)
        whole.load()
    save(whole.crop((0, 0, whole.width, min(args.screen, whole.height))), args.out / "top.png", exact=True)
    for anchor in ANCHORS:
        if anchor in where:
            top = max(0, int(where[anchor]) - 10)
            save(
                whole.crop((0, top, whole.width, min(top + args.screen, whole.height))),
                args.out / f"{anchor}.png",
                exact=anchor == "plots",
            )
    save(whole, args.out / "full.png", scale=0.25)
    print(f"page height: {where['height']} px at {args.width} px wide")
    return 0


if __name__ == "__main__":
    sys.exit(main())
