"""headatlas: what the attention heads of a transformer do, at corpus scale, stored and queryable.

    import headatlas
    run = headatlas.analyze("corpus.txt", db="atlas.duckdb")      # the embedded engine
    run.heads(ci=True).df()                                        # pandas (headatlas[pandas]); .arrow: Arrow
    headatlas.connect("atlas.duckdb").run("corpus-1a2b3c").layers()
    headatlas.connect("atlas.duckdb").run("corpus-1a2b3c").roles()   # the head atlas (query roles)
    headatlas.compare("atlas.duckdb", "corpus-1a2b3c")                # against its controls (compare)
    headatlas.inspect("The cat sat on the mat.").csm(3, 5)         # one text: attention, z, CSM

The functions are those of ``headatlas.service.api``; the CLI (``headatlas --help``) is a thin
layer over the same library. Subpackages: ``headatlas.service`` (engine, measures, storage, what
users see), ``headatlas.workers`` (queue, writer, beat), ``headatlas.cli``,
``headatlas.migrations``.
"""

from __future__ import annotations

from pathlib import Path as _Path

__version__ = "0.1.0"
__all__ = ["__version__", "analyze", "analyze_series", "compare", "connect", "effects", "inspect"]

# Installed, service/, workers/, cli/ and migrations/ are subpackages inside this folder. In a
# source checkout they sit beside it (the repository keeps the design's folders at its top level),
# so the package looks there too.
_here = _Path(__file__).resolve().parent
if not (_here / "service").is_dir() and (_here.parent / "service" / "__init__.py").is_file():
    __path__.append(str(_here.parent))


def _arrow_from_the_system_under_a_cap() -> None:
    # Under an address-space cap (RLIMIT_AS: `prlimit --as`, `ulimit -v`) Arrow allocates from the
    # system allocator: its default, mimalloc, reserves 1 GiB of address space at its first
    # allocation (DuckDB's first scan of an Arrow table makes one), which the cap counts although
    # little of it is filled; storing a 4,096-token window of SmolLM2 under a 6 GiB cap then failed
    # (docs/benchmarks.md, "Long windows"). Arrow reads the variable once, as it loads: set here,
    # before anything imports it. Without a cap, or where the variable is set already, no change.
    try:
        import resource
    except ImportError:  # not POSIX: no such cap
        return
    import os

    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft > 0:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


_arrow_from_the_system_under_a_cap()

_LAZY = ("analyze", "analyze_series", "compare", "connect", "effects", "inspect")


def __getattr__(name: str):
    # lazy, so that `import headatlas` (every CLI start) stays light until the API is used
    if name in _LAZY:
        from headatlas.service import api

        return getattr(api, name)
    raise AttributeError(f"module 'headatlas' has no attribute {name!r}")


def __dir__() -> list[str]:
    # what dir(headatlas) and tab completion show: the lazy functions too, the internals not
    return sorted({*__all__, "cli", "migrations", "service", "workers"})
