"""Analysis parameters (docs/SPEC.md §1–3): parsed, validated and recorded on every run.

Two runs with equal ``AnalysisParams.key()`` over the same corpus and model are the same run:
this is what makes ``analyze`` and ``submit`` resumable and idempotent.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace

from headatlas.service.analysis_options import ATTRIBUTION_WINDOWS, DEFAULTS, MIXING_WINDOWS
from headatlas.service.engine.schemes import FALLBACK_BELOW, FALLBACK_BLOCK, FORWARD_MIXING, parse_replicates
from headatlas.service.errors import Param, ParameterError

WINDOWING = ("chunks", "first")
SENTENCES = ("segmenter", "punct")
VECTORS = ("pre_wo", "post_wo")
DTYPES = ("float32", "bfloat16", "float16")
MIXING = FORWARD_MIXING  # the measures --mixing takes
MIXING_FIELDS = ("attribution", "mixing", "attribution_windows")  # recorded only when in use
EFFECT_KINDS = ("zero", "mean", "gradient", "atp")  # SPEC §9: the two ablations, gradient importance, AtP
# recorded only when in use
EFFECT_FIELDS = ("effects", "effect_windows", "effect_spread", "effect_reference", "objective")
# which windows get the effects (engine/effect_spread.py): spread over the replicate groups, or the
# run's first N (the rule of runs stored before)
EFFECT_SPREADS = ("groups", "first")
AUTO_OBJECTIVE = "auto"  # the model's own objective (service.measures.objectives.choose)
# The longest window any front end takes: 32,768 positions, as the stores keep a pair's distance
# (up to seq_len - 1) as SMALLINT. The model's own context is the limit below it, checked against
# its config (model_check.check_seq_len: SmolLM2 takes 8,192, BERT 512).
MAX_SEQ_LEN = 32_768
EXAMPLES = DEFAULTS["examples"]  # top examples kept per head and kind
CSM_BIN = DEFAULTS["csm_bin"]  # default bin of the corpus-averaged similarity matrices, in tokens per side


@dataclass(frozen=True)
class Selection:
    """How the high-similarity set H is chosen from the pair universe P (SPEC §3)."""

    kind: str  # "top" | "ratio" | "topk"
    value: float

    @classmethod
    def parse(cls, text: str) -> Selection:
        kind, sep, raw = text.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in ("top", "ratio", "topk"):
            raise ParameterError(
                Param("select", text, quoted=True),
                ": expected top:Q (share of pairs, e.g. top:0.02), "
                "ratio:R (share of the maximum, e.g. ratio:0.5) or topk:K (e.g. topk:20)",
            )
        if raw.strip().endswith("%"):
            raise ParameterError(
                Param("select", text, quoted=True), ": give a share, not a percentage (top:0.02 for 2%)"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ParameterError(Param("select", text, quoted=True), f": {raw!r} is not a number") from None
        if not math.isfinite(value):
            raise ParameterError(Param("select", text, quoted=True), f": {raw!r} is not a finite number")
        if kind == "top" and not 0.0 < value <= 1.0:
            raise ParameterError(Param("select", text, quoted=True), ": Q must be in (0, 1], e.g. top:0.02")
        if kind == "ratio" and not 0.0 < value <= 1.0:
            raise ParameterError(Param("select", text, quoted=True), ": R must be in (0, 1], e.g. ratio:0.5")
        if kind == "topk":
            if value < 1 or value != int(value):
                raise ParameterError(Param("select", text, quoted=True), ": K must be a positive integer, e.g. topk:20")
        return cls(kind, value)

    def count(self, n_pairs: int) -> int:
        """|H| for a window with ``n_pairs`` pairs, for the count-based kinds."""
        if self.kind == "top":
            return min(n_pairs, math.ceil(self.value * n_pairs - 1e-9))
        if self.kind == "topk":
            return min(n_pairs, int(self.value))
        raise ValueError("ratio selection has no fixed count")

    def __str__(self) -> str:
        value = int(self.value) if self.kind == "topk" else self.value
        return f"{self.kind}:{value}"


@dataclass(frozen=True)
class AnalysisParams:
    """Every choice that changes the numbers. Defaults are SPEC's, declared with the options
    (service/analysis_options.py); construct from typed values with ``build_params``."""

    seq_len: int = DEFAULTS["seq_len"]
    windowing: str = DEFAULTS["windowing"]
    # the corpus's first N windows only (None: all of them); a cap changes the numbers, so the run key
    max_windows: int | None = DEFAULTS["max_windows"]
    sentences: str = DEFAULTS["sentences"]  # segmenter: a sentence-boundary library (SPEC §5b); punct: SPEC §1
    select: Selection = field(default_factory=lambda: Selection.parse(DEFAULTS["select"]))
    gate: float = DEFAULTS["gate"]
    include_special: bool = DEFAULTS["include_special"]
    vectors: str = DEFAULTS["vectors"]
    short_range: int = DEFAULTS["short_range"]
    dtype: str = DEFAULTS["dtype"]
    attribution: bool = DEFAULTS["attribution"]  # gradient attribution per head (SPEC §6)
    mixing: tuple[str, ...] = DEFAULTS["mixing"]  # forward-only mixing measures: rollout, norm, alti
    # windows per run that get attribution / mixing; None: ATTRIBUTION_WINDOWS with attribution, else MIXING_WINDOWS
    attribution_windows: int = DEFAULTS["attribution_windows"]
    # causal effects of heads (SPEC §9): kinds, windows that get them, reference windows of mean ablation
    effects: tuple[str, ...] = DEFAULTS["effects"]
    effect_windows: int = DEFAULTS["effect_windows"]
    # which windows: spread over the replicate groups (groups) or the run's first (first: runs stored before)
    effect_spread: str = DEFAULTS["effect_spread"]
    effect_reference: int = DEFAULTS["effect_reference"]
    # the objective the effects are measured on: auto (the model's own) or a registered one's name
    objective: str = DEFAULTS["objective"]
    # measures a plugin adds, asked for by name (service.engine.measure_contract.requested)
    measures: tuple[str, ...] = DEFAULTS["measures"]
    csm_bin: int = DEFAULTS["csm_bin"]  # averaged similarity matrices: positions per bin (1 = full, 0 = none)
    # top examples kept per (kind, layer, head): service/measures/examples.py (0: none)
    examples: int = DEFAULTS["examples"]
    # replicate groups (SPEC §5d): document | block:B | window; a run records the one it used (resolved())
    replicates: str = DEFAULTS["replicates"]

    def __post_init__(self) -> None:
        try:
            unit, block = parse_replicates(self.replicates)
        except ValueError as exc:
            reason = str(exc).removeprefix(f"{self.replicates!r}")
            raise ParameterError(Param("replicates", self.replicates, quoted=True), reason) from None
        # canonical spelling, so that equal schemes give equal run keys
        object.__setattr__(self, "replicates", f"block:{block}" if unit == "block" else unit)
        if not 4 <= self.seq_len <= MAX_SEQ_LEN:
            raise ParameterError(Param("seq_len", self.seq_len), f": must be between 4 and {MAX_SEQ_LEN} (default 128)")
        _check_choice("windowing", self.windowing, WINDOWING)
        if self.max_windows is not None and self.max_windows < 1:
            raise ParameterError(
                Param("max_windows", self.max_windows), ": must be at least 1 (leave it out to analyse every window)"
            )
        _check_choice("sentences", self.sentences, SENTENCES)
        _check_choice("vectors", self.vectors, VECTORS)
        _check_choice("dtype", self.dtype, DTYPES)
        if not (self.gate > 0 and math.isfinite(self.gate)):
            raise ParameterError(
                Param("gate", self.gate), ": must be a positive finite number (default 4 = four times uniform)"
            )
        if self.short_range < 1:
            raise ParameterError(Param("short_range", self.short_range), ": must be at least 1 (default 4)")
        for method in self.mixing:
            _check_choice("mixing", method, MIXING)
        if self.attribution_windows is None:  # the default depends on what is computed: keyed as resolved
            default = ATTRIBUTION_WINDOWS if self.attribution else MIXING_WINDOWS
            object.__setattr__(self, "attribution_windows", default)
        if self.attribution_windows < 1:
            raise ParameterError(
                Param("attribution_windows", self.attribution_windows),
                f": must be at least 1 (default {ATTRIBUTION_WINDOWS} with ",
                Param("attribution", True),
                f", {MIXING_WINDOWS} with ",
                Param("mixing"),
                " alone)",
            )
        for kind in self.effects:
            _check_choice("effects", kind, EFFECT_KINDS)
        if self.effect_windows < 1:
            raise ParameterError(Param("effect_windows", self.effect_windows), ": must be at least 1")
        _check_choice("effect_spread", self.effect_spread, EFFECT_SPREADS)
        if self.effect_reference < 1:
            raise ParameterError(Param("effect_reference", self.effect_reference), ": must be at least 1 window")
        object.__setattr__(self, "objective", str(self.objective).strip() or AUTO_OBJECTIVE)
        if self.objective != AUTO_OBJECTIVE and not self.effects:
            raise ParameterError(
                Param("objective", self.objective), " names what the effects are measured on: pass ", Param("effects")
            )
        if self.csm_bin < 0:
            # a bin wider than the window is one cell: allowed, so the default fits every --seq-len
            raise ParameterError(
                Param("csm_bin", self.csm_bin),
                ": must be 0 (no averaged matrices) or more",
                hint=f"default {CSM_BIN}, 1 = full resolution",
            )

        if self.examples < 0:
            raise ParameterError(
                Param("examples", self.examples),
                ": must be 0 (keep none) or more",
                hint=f"default {EXAMPLES}: the windows where each head is strongest, per kind",
            )

    @property
    def csm_bins(self) -> int:
        """Bins per side of the averaged similarity matrices (0 when they are not computed)."""
        return -(-self.seq_len // self.csm_bin) if self.csm_bin else 0

    def resolved(self, documents: int) -> AnalysisParams:
        """These parameters for a corpus of ``documents`` distinct documents: ``replicates =
        document`` becomes ``block:8`` below FALLBACK_BELOW documents (SPEC §5d). Runs are keyed
        and recorded with the resolved scheme, so a run says which one its intervals use."""
        if self.replicates == "document" and documents < FALLBACK_BELOW:
            return replace(self, replicates=f"block:{FALLBACK_BLOCK}")
        return self

    @property
    def needs_means(self) -> bool:
        """Whether the effects need the reference means: mean ablation or attribution patching
        (SPEC §9)."""
        return "mean" in self.effects or "atp" in self.effects

    @property
    def mixes(self) -> bool:
        """Whether any mixing measure (attribution included) is computed."""
        return self.attribution or bool(self.mixing)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["select"] = str(self.select)
        out["mixing"] = list(self.mixing)
        out["effects"] = list(self.effects)
        if not self.effects:
            # runs without effects keep the parameters (and the run key) they had before they existed
            for name in EFFECT_FIELDS:
                out.pop(name)
        elif not self.needs_means:
            out.pop("effect_reference")  # no reference set: neither mean ablation nor attribution patching
        if self.effect_spread == "first":
            out.pop("effect_spread", None)  # the rule of the effect runs stored before it: their run key
        if self.objective == AUTO_OBJECTIVE:
            out.pop("objective", None)  # the model's own keeps the run key effect runs had before it could be named
        if self.max_windows is None:
            out.pop("max_windows")  # every window: the run key runs had before a cap existed
        if self.measures:
            out["measures"] = list(self.measures)
        else:
            out.pop("measures")  # runs without a plugin's measures keep the run key they had before
        if not self.mixes:
            # runs without mixing keep the parameters (and the run key) they had before it existed
            for name in MIXING_FIELDS:
                out.pop(name)
        if self.csm_bin == CSM_BIN:
            # the default bin keeps the parameters (and the run key) runs had before the matrices existed
            out.pop("csm_bin")
        if self.examples == EXAMPLES:
            # the default keeps the run key runs had before examples were kept (they change no statistic)
            out.pop("examples")
        if self.replicates == "window":
            # the §5b rule keeps the parameters (and the run key) of the runs stored before §5d,
            # which record no scheme
            out.pop("replicates")
        if self.sentences == "segmenter":
            # the library and its version decide where sentences end: a run made with other rules
            # is another run, not one to resume
            out["segmenter"] = segmenter_id()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> AnalysisParams:
        data = dict(data)
        # parameters stored before --sentences had a choice were all computed with punct
        data.setdefault("sentences", "punct")
        # runs stored before SPEC §5d grouped windows by their own id
        data.setdefault("replicates", "window")
        if isinstance(data.get("select"), str):
            data["select"] = Selection.parse(data["select"])
        if "mixing" in data:
            data["mixing"] = tuple(data["mixing"])
        if "effects" in data:
            data["effects"] = tuple(data["effects"])
        if data.get("effects"):
            # effect runs stored before the windows were spread over groups took the run's first N
            data.setdefault("effect_spread", "first")
        if "measures" in data:
            data["measures"] = tuple(data["measures"])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def key(self) -> str:
        """Stable hash of the parameters (canonical JSON)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def segmenter_id() -> str:
    """The sentence segmenter behind ``--sentences segmenter``, as recorded with a run."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"syntok {version('syntok')}"
    except PackageNotFoundError:
        raise ParameterError(
            Param("sentences", "segmenter"),
            " needs the syntok package: pip install syntok, or pass ",
            Param("sentences", "punct"),
        ) from None


def _check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ParameterError(Param(option, value, quoted=True), f": choose one of {', '.join(choices)}")
