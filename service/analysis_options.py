"""The analysis options, declared once: name, type, default, help, SPEC section, and the
``HEADATLAS_*`` setting that supplies the default where one does.

The CLI builds its options from ``OPTIONS`` (``analyze``, ``submit``, ``schedule add``, ``inspect``,
``demo``), ``AnalysisParams`` takes its defaults from it, and ``build_params`` turns the values a
user typed (``--select top:Q``, ``--mixing rollout,norm``) into validated ``AnalysisParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    from headatlas.service.params import AnalysisParams

from headatlas.service.config import Settings


@dataclass(frozen=True)
class Declared:
    """One analysis option. ``default`` is the value as a user types it."""

    name: str  # the Python name: an AnalysisParams field (param=True) or a run setting
    type: type
    default: Any
    help: str
    spec: str | None = None  # the SPEC section that defines it
    setting: str | None = None  # Settings field: HEADATLAS_<SETTING> overrides the default
    param: bool = True  # part of AnalysisParams (changes the numbers, so the run key)
    short: str | None = None
    min: int | None = None
    aliases: tuple[str, ...] = ()  # other long flags for the same option

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def envvar(self) -> str | None:
        return f"HEADATLAS_{self.setting.upper()}" if self.setting else None


# windows that get the mixing measures when --attribution-windows is not given: gradient attribution
# costs one backward pass per (layer, head, token), about 10,000 a 128-token window of the default
# model (benchmarks/attribution_estimate.py); the forward-only measures cost a few forward passes
ATTRIBUTION_WINDOWS = 2
MIXING_WINDOWS = 256
# windows that get --effects when --effect-windows is not given: ablating every head of a window costs
# about half of (layers × heads) forward passes of it (benchmarks/effects.py); the reference set
# of mean ablation is the run's first EFFECT_REFERENCE windows (SPEC §9)
EFFECT_WINDOWS = 64
EFFECT_REFERENCE = 256

# in the order `--help` lists them
OPTIONS: tuple[Declared, ...] = (
    Declared(
        "model",
        str,
        Settings.default("model"),
        "`default` (all-MiniLM-L6-v2), a model folder, a hub name, a .gguf file, smollm2, or random:NAME / random:L,H,D "
        "(`headatlas models` lists them; queued runs: every worker loads the same).",
        setting="model",
        param=False,
        short="-m",
    ),
    Declared("device", str, Settings.default("device"), "auto, cpu, cuda or cuda:N.", setting="device", param=False),
    Declared("dtype", str, "float32", "float32, bfloat16 or float16 (statistics are computed in float32)."),
    Declared(
        "batch_size",
        str,
        Settings.default("batch_size"),
        "Windows per forward pass (one task each when queued), or auto: sized from free memory (the GPU's, or on "
        "CPU the system's, at most 32 there); 32 for queued runs, whose batches are cut before any worker is known.",
        setting="batch_size",
        param=False,
        short="-b",
    ),
    Declared(
        "seq_len",
        int,
        128,
        "Tokens per window, its specials included: [CLS] and [SEP] (an encoder), BOS (a decoder). Longer text is cut.",
        spec="§1, §8",
    ),
    Declared("windowing", str, "chunks", "chunks (cover each document) or first (one window per document).", "§1"),
    Declared(
        "max_windows",
        int,
        None,
        "Analyse only the corpus's first N windows, in corpus order (default: every window). Recorded with the "
        "run: another N is another run.",
        spec="§1",
        min=1,
    ),
    Declared(
        "sentences",
        str,
        "segmenter",
        'Sentence ids: segmenter (a sentence-boundary library: "Mr." or "3.14" do not end a sentence) or punct '
        "(every . ! ? ends one; reproduces runs made before the segmenter).",
        spec="§1",
    ),
    Declared("select", str, "top:0.02", "High-similarity set: top:Q, ratio:R or topk:K.", spec="§3"),
    Declared(
        "gate",
        float,
        4.0,
        "Attention gate: a pair is attended when A_ij >= gate / k_i or A_ji >= gate / k_j, k_i the keys "
        "row i sees (n for an encoder, i + 1 for a decoder).",
        spec="§3, §8",
    ),
    Declared("include_special", bool, False, "Let the specials ([CLS]/[SEP]; a decoder's BOS) form pairs.", spec="§3"),
    Declared("vectors", str, "pre_wo", "pre_wo (head output before W_O) or post_wo (after).", spec="§2"),
    Declared("short_range", int, 4, "Distance counted as short range in short_range_share.", spec="§5"),
    Declared(
        "attribution",
        bool,
        False,
        "Gradient attribution per head to the input tokens (costly: one backward pass per layer, head and token).",
        spec="§6",
    ),
    Declared(
        "attribution_windows",
        int,
        None,
        f"The run's first N windows get --attribution / --mixing, the rest every other statistic (default: "
        f"{ATTRIBUTION_WINDOWS} with --attribution, minutes on a laptop for the default model — analyze says its "
        f"estimate before it starts —; {MIXING_WINDOWS} with --mixing alone).",
        spec="§6",
        min=1,
    ),
    Declared(
        "mixing", list[str], (), "Forward-only mixing measures: rollout, norm, alti (repeat or comma-separate).", "§6"
    ),
    Declared(
        "effects",
        list[str],
        (),
        "Causal effects of every head on the model's own objective and on output drift: zero and mean "
        "ablation, gradient importance (repeat or comma-separate: zero,mean,gradient; gradient for objectives "
        "that are losses). Costly: each window's ablations cost about half of layers × heads forward passes; analyze "
        "says its estimate before it starts.",
        spec="§9",
    ),
    Declared(
        "effect_windows",
        int,
        EFFECT_WINDOWS,
        "--effects: N windows get them (the rest every other statistic), spread over the replicate groups "
        "(--effect-spread).",
        spec="§9",
        min=1,
    ),
    Declared(
        "effect_spread",
        str,
        "groups",
        "--effects: which N windows: groups (in corpus order, the first 8 from 8 replicate groups, the next 8 "
        "two a group, …: their intervals rest on 8 groups, or all the corpus has) or first (the run's first N, "
        "the rule of runs stored before; recorded with the run).",
        spec="§9",
    ),
    Declared(
        "effect_reference",
        int,
        EFFECT_REFERENCE,
        "--effects mean: each head's output is replaced by its mean over the run's first N windows (recorded).",
        spec="§9",
        min=1,
    ),
    Declared(
        "objective",
        str,
        "auto",
        "--effects: the objective O they are measured on: auto (the model's own: next_token_loss for a decoder with "
        "a tied LM head, masked_lm_loss for an encoder whose config names a masked-LM model, else embedding_drift) "
        "or one of those, or one a plugin adds, by name (recorded with the run).",
        spec="§9",
    ),
    Declared(
        "measures",
        list[str],
        (),
        "Measures an installed plugin adds, by name (repeat or comma-separate; `headatlas metrics` lists "
        "them): their per-head sums are stored with the run and their columns shown beside the built-in ones.",
        spec="§5",
    ),
    Declared(
        "csm_bin",
        int,
        8,
        "Corpus-averaged similarity matrices: positions per bin (1 = full resolution: a larger payload; 0 = none).",
        spec="§5c",
        min=0,
    ),
    Declared(
        "examples",
        int,
        5,
        "Top examples kept per head and kind (anchor, pair, attention): the N windows where each is strongest, "
        "with their token positions and text (`headatlas query examples`; 0 = none).",
        spec="§4",
        min=0,
    ),
    Declared(
        "probe",
        bool,
        False,
        "Also score every head on repeated random tokens: induction, duplicate-token and previous-token scores "
        "(once per run; changes no corpus statistic and no run key).",
        spec="§8",
        param=False,
    ),
    Declared("probe_length", int, 50, "--probe: L, the length of the random sequence repeated.", param=False, min=2),
    Declared("probe_sequences", int, 32, "--probe: how many random sequences.", param=False, min=1),
    Declared(
        "replicates",
        str,
        "document",
        "Replicate groups behind the 95% intervals: document (a hash of each window's document; below "
        "10 documents block:8 instead), block:B (B consecutive windows of one document) or window "
        "(reproduces runs stored before, whose intervals are too narrow). The run records the one used.",
        spec="§5d",
    ),
    Declared("text_field", str, "text", "JSONL field / CSV column holding the text.", param=False),
    Declared("encoding", str, "utf-8", "Text encoding of the corpus files.", param=False),
)
BY_NAME = {o.name: o for o in OPTIONS}
PARAM_NAMES = tuple(o.name for o in OPTIONS if o.param)
RUN_NAMES = tuple(o.name for o in OPTIONS if not o.param)
DEFAULTS = {o.name: o.default for o in OPTIONS}


def build_params(**values: Any) -> AnalysisParams:
    """Validated AnalysisParams from option values as typed (CLI, Python API, tasks, schedules);
    an option not given takes its declared default."""
    from headatlas.service.errors import ParameterError

    # imported here: params takes its defaults from this module
    from headatlas.service.params import AnalysisParams, Selection

    unknown = sorted(set(values) - set(PARAM_NAMES))
    if unknown:
        raise ParameterError(f"unknown option {unknown[0]!r}; the analysis options are {', '.join(PARAM_NAMES)}")
    given = {name: values.get(name, DEFAULTS[name]) for name in PARAM_NAMES}
    given["select"] = Selection.parse(given["select"])
    given["mixing"] = parse_mixing(given["mixing"])
    given["effects"] = parse_effects(given["effects"])
    given["measures"] = parse_names(given["measures"])
    return AnalysisParams(**given)


def parse_mixing(values) -> tuple[str, ...]:
    """``--mixing`` values, repeated and/or comma-separated, deduplicated in canonical order."""
    from headatlas.service.params import MIXING

    given = [part.strip().lower() for value in values for part in str(value).split(",") if part.strip()]
    unknown = [m for m in given if m not in MIXING]
    if unknown:
        from headatlas.service.errors import Param, ParameterError

        raise ParameterError(
            Param("mixing", unknown[0], quoted=True), f": choose from {', '.join(MIXING)} (several allowed)"
        )
    return tuple(m for m in MIXING if m in given)


def parse_effects(value) -> tuple[str, ...]:
    """``--effects``: a comma-separated text or a sequence of kinds, deduplicated in SPEC order
    (zero, mean, gradient); empty: none."""
    from headatlas.service.errors import Param, ParameterError
    from headatlas.service.params import EFFECT_KINDS

    parts = [value] if isinstance(value, str) else list(value or ())
    given = [k.strip().lower() for part in parts for k in str(part).split(",") if k.strip()]
    unknown = [k for k in given if k not in EFFECT_KINDS]
    if unknown:
        raise ParameterError(
            Param("effects", unknown[0], quoted=True),
            f": choose from {', '.join(EFFECT_KINDS)} (comma-separated, e.g. zero,mean)",
        )
    return tuple(k for k in EFFECT_KINDS if k in given)


def parse_names(value) -> tuple[str, ...]:
    """``--measures`` values, repeated and/or comma-separated, deduplicated in the order given
    (whether each is a registered measure is checked where measures are chosen)."""
    parts = [value] if isinstance(value, str) else list(value or ())
    return tuple(dict.fromkeys(k.strip() for part in parts for k in str(part).split(",") if k.strip()))


@overload
def parse_batch_size(value: str | int, *, queued: Literal[True]) -> int: ...
@overload
def parse_batch_size(value: str | int, *, queued: Literal[False] = False) -> int | Literal["auto"]: ...
def parse_batch_size(value: str | int, *, queued: bool = False) -> int | Literal["auto"]:
    """``--batch-size``: a positive integer or ``auto`` (sized to the model and device once it is
    loaded). A queued run's batches are cut before a worker is known, so there ``auto`` is the CPU
    size, 32."""
    from headatlas.service.errors import Param, ParameterError

    text = str(value).strip().lower()
    if text == "auto":
        return AUTO_QUEUED if queued else "auto"
    if not text.isdigit() or int(text) < 1:
        raise ParameterError(Param("batch_size", value, quoted=True), ": use a positive integer or auto")
    return int(text)


AUTO_QUEUED = 32
