"""Helpers shared by the figure, report and export tests: a small real run, file checks."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def corpus_of(demo_corpus: Path, folder: Path, docs: slice, name: str) -> Path:
    """Some documents of the shipped excerpt as a corpus file."""
    parts = demo_corpus.read_text(encoding="utf-8").split("\n\n")[docs]
    path = folder / f"{name}.txt"
    path.write_text("\n\n".join(p.strip() for p in parts) + "\n", encoding="utf-8")
    return path


def analyse(corpus: Path, db: Path, model, *, name: str | None = None, **options):
    """Analyse ``corpus`` into ``db`` in this process (the embedded engine) with the analysis
    ``options`` (declared defaults for the rest); returns the Run."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.runner import analyze_corpus, survey_corpus
    from headatlas.service.storage.store import Store

    return analyze_corpus(
        str(corpus),
        store=Store(db),
        model=model,
        params=build_params(**options),
        corpus=survey_corpus(str(corpus)),
        name=name,
        batch_size=8,
    )


def check_png(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    """A valid PNG of ``size`` (width, height) pixels with a real picture in it; returns RGB."""
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    with Image.open(path) as image:
        image.load()
        if size is not None:
            assert image.size == size, f"{path}: {image.size} px, expected {size}"
        rgb = np.asarray(image.convert("RGB"), dtype=np.float64)
    check_not_blank(rgb, str(path))
    return rgb


def check_not_blank(rgb: np.ndarray, what: str) -> None:
    """Not one flat colour, not a near-empty canvas: some variance and many distinct colours."""
    grey = rgb.mean(axis=2)
    assert grey.std() > 10, f"{what}: pixel standard deviation {grey.std():.2f}, looks blank"
    non_white = (grey < 245).mean()
    assert non_white > 0.02, f"{what}: only {non_white:.1%} of pixels are not white"
    packed = rgb.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)
    colours = np.unique(packed)
    assert len(colours) > 50, f"{what}: only {len(colours)} distinct colours"


def check_svg(path: Path, size_in: tuple[float, float]) -> ET.Element:
    """A well-formed SVG document of ``size_in`` inches (72 pt each) with drawn paths."""
    text = Path(path).read_text(encoding="utf-8")
    assert text.lstrip().startswith("<?xml") and "<svg" in text[:2000], f"{path} is not an SVG"
    root = ET.fromstring(text)
    assert root.tag.endswith("svg")
    width, height = (float(root.get(k).removesuffix("pt")) for k in ("width", "height"))
    assert (width, height) == (size_in[0] * 72, size_in[1] * 72), f"{path}: {width}×{height} pt"
    paths = [e for e in root.iter() if e.tag.endswith("path") or e.tag.endswith("use")]
    assert len(paths) > 50, f"{path}: only {len(paths)} drawn elements"
    return root
