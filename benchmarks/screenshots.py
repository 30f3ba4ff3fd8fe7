"""The screenshots of `headatlas serve` in docs/usage.md (`make screenshots`): each page in headless
Chromium at 1,400 px, from a run of the shipped excerpt with the default model and its control.

    python benchmarks/screenshots.py [--db build/screenshots.duckdb] [--out docs/img] [--only serve-head.png …]

The database is made when missing (``headatlas analyze … --control``, about a minute on 2 cores).
Needs Debian's chromium and chromium-driver and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from web_support import chromium, chromium_missing, serving  # noqa: E402

WIDTH = 1400
# (file, address, what must be on the page before the shot, height in px)
PAGES = (
    ("serve-runs.png", "/runs", "#runs", 560),
    ("serve-run.png", "/runs/demo", "#atlas-grid", 1500),
    ("serve-head.png", "/runs/demo/heads/1/1", '#example[data-state="done"]', 1250),
    ("serve-examples.png", "/runs/demo/heads/1/1#top-examples", "ol.top-examples mark", 900),
    ("serve-compare.png", "/compare/demo/demo-control?by=depth", "#compare-table", 1300),
    (
        "serve-text.png",
        "/runs/demo/try?layer=1&head=1&lines=layer&text=The+cat+sat+on+the+mat.+It+was+warm,+so+the+cat+slept+there.",
        "#own-text",
        1450,
    ),
    (
        "serve-sql.png",
        "/runs/demo/sql?q=SELECT+layer,+head,+within_sentence_lift_dm,+repetition_words_lift_dm+"
        "FROM+head_metrics+ORDER+BY+4+DESC+LIMIT+8",
        "#sql-result",
        700,
    ),
)


def make_database(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    corpus = ROOT / "service" / "data" / "wiki_excerpt.txt"
    headatlas = Path(sys.executable).parent / "headatlas"
    subprocess.run(
        [str(headatlas), "analyze", str(corpus), "--name", "demo", "--control", "--db", str(db), "--quiet"], check=True
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", type=Path, default=ROOT / "build" / "screenshots.duckdb")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--only", nargs="+", default=None, help="Only these screenshots (file names).")
    args = parser.parse_args(argv)
    missing = chromium_missing()
    if missing:
        raise SystemExit(missing)
    if not args.db.exists():
        make_database(args.db)
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from headatlas.service.web.app import WebApp

    args.out.mkdir(parents=True, exist_ok=True)
    with serving(WebApp(str(args.db))) as url, chromium(width=WIDTH, height=1000) as browser:
        for name, address, ready, height in PAGES:
            if args.only and name not in args.only:
                continue
            started = time.perf_counter()
            browser.set_window_size(WIDTH, height)
            browser.get(url + address)
            WebDriverWait(browser, 300).until(lambda b, css=ready: b.find_elements(By.CSS_SELECTOR, css))
            time.sleep(0.3)  # layout settled
            path = args.out / name
            browser.save_screenshot(str(path))
            Image.open(path).convert("RGB").quantize(128).save(path, optimize=True)
            print(f"{path} ({path.stat().st_size // 1024} KB, {time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
