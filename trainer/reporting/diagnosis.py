"""The spec's own diagnosis tables, applied to a run's live metrics (the "X1 diagnosis panel").

The spec ("Concurrency", "Rollout queue", "Saturation and duplicates") says how to read a few metric
curves together. This module turns those tables into rules over a window of the latest logged steps:

* ``bottleneck``: ``rollout/queue_size`` with the two mirror-image waits, ``perf/rollout_wait_s``
  (trainer waited on an empty queue) and ``rollout/backpressure_s`` (generation waited on staleness);
* ``concurrency``: which of the three limits on rollouts in flight binds; its staleness reading is
  the bottleneck card's verdict, so the two never disagree on the same waits;
* ``saturation``: ``frac_reward_zero_std``, ``reward_dropped`` and ``reward`` against the reward range
  (also the end state of "saturated at the top": both at the top, no longer climbing);
* ``duplicates``: ``completions/duplicate_frac`` and ``entropy`` (collapse vs. non-random sampling),
  with ``completions/mean_length`` (short answers repeat when right; only a jump is non-random);
* ``clipping``: ``completions/clipped_ratio``.

The verdicts' words (titles, advice, plain labels of the evidence keys) are in
:mod:`trainer.reporting.diagnosis_words`.

The spec says "high", "near the top", "climbing"; the numbers that make those words concrete are
the module constants below. Waits are read as a fraction of the step time, levels as a position in
the reward range, trends as the least-squares change over the window divided by the range.

Pure stdlib: the control plane imports this without torch/transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainer.config.run_schema import DEFAULTS
from trainer.reporting.diagnosis_words import (
    BOTH_HOLD,
    BOTTLENECK,
    CONCURRENCY,
    DUPLICATES,
    SATURATION,
    SATURATION_RETIRE_ADVICE,
)
from trainer.reporting.metrics import (
    BATCH_SAMPLES_PER_STEP,
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_DUPLICATE_FRAC,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    FRAC_REWARD_ZERO_STD,
    PERF_ROLLOUT_WAIT_S,
    PERF_STEP_S,
    REWARD,
    REWARD_DROPPED,
    ROLLOUT_BACKPRESSURE_S,
    ROLLOUT_CONCURRENCY,
    ROLLOUT_CONCURRENCY_CAP,
    ROLLOUT_GENERATED_TOKENS_PER_S,
    ROLLOUT_QUEUE_SIZE,
    ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC,
    SAMPLE_STALENESS_MEAN,
)
from trainer.rollout.flow import StalenessPolicy  # stdlib only, like this module

__all__ = ["DEFAULT_WINDOW_STEPS", "TOPICS", "Diagnosis", "diagnose", "infer_reward_range"]

TOPICS = ("bottleneck", "concurrency", "saturation", "duplicates", "clipping")
DEFAULT_WINDOW_STEPS = 20

# AsyncGRPOConfig defaults of the config keys the rules read (the run schema: no transformers import).
CONFIG_DEFAULTS: dict[str, int] = {
    name: DEFAULTS[name] for name in ("max_staleness", "num_generations", "max_concurrent_rollouts")
}

# ---- waits (bottleneck, concurrency) -------------------------------------------------------------
# A wait is read as a fraction of the mean step time (perf/step_s): the trainer idling 10% of every
# step is worth a look, under 2% is noise. Without perf/step_s, absolute seconds are used instead.
WAIT_HIGH_FRAC = 0.10
WAIT_LOW_FRAC = 0.02
WAIT_HIGH_S = 1.0
WAIT_LOW_S = 0.1
# Queue fill = rollout/queue_size / (batch/samples_per_step * max(max_staleness, 1)), i.e. the share of
# the staleness allowance sitting in the queue. "Nearly empty" under a quarter, "about full" over half
# (in-flight rollouts hold the rest of the allowance, so the queue rarely reaches 1.0).
QUEUE_EMPTY_FILL = 0.25
QUEUE_FULL_FILL = 0.5

# ---- concurrency ---------------------------------------------------------------------------------
# The cap is "below" max_concurrent_rollouts when under 95% of it; rollouts in flight "reach" a limit
# at 80% of it (the window mean dips while groups finish and new ones start).
CAP_BELOW_FRAC = 0.95
AT_LIMIT_FRAC = 0.80
# Low KV-cache usage: the controller's own raise threshold (trainer/rollout/flow.py RAISE_BELOW_USAGE).
KV_LOW_USAGE = 0.60

# ---- saturation ----------------------------------------------------------------------------------
FRAC_ZERO_STD_LOW = 0.25  # at or under: most groups still give a gradient
FRAC_ZERO_STD_HIGH = 0.50  # at or over: most groups are dropped
ALL_DROPPED_FRAC = 0.99  # the last few points: every group dropped (the run cannot take a step)
NEAR_BOTTOM = 0.2  # position in the reward range (0 = min, 1 = max)
NEAR_TOP = 0.8
# Least-squares change over the window, as a fraction of the range, that counts as climbing/falling.
# 0.10 keeps per-step noise of ~0.1 over 20-30 steps from reading as a trend.
TREND_MIN_CHANGE = 0.10
# A partial match names the nearest rule when it meets at least this share (and two) of its conditions.
PARTIAL_MATCH_FRAC = 0.66

# ---- duplicates ----------------------------------------------------------------------------------
# Levels as a fraction of the ceiling (num_generations - 1) / num_generations, where every group is
# one rollout copied G times.
DUP_HEALTHY_OF_CEILING = 0.15
DUP_NOT_RANDOM_OF_CEILING = 0.60
DUP_RISE_OF_CEILING = 0.05  # change over the window that counts as "slowly rising"
ENTROPY_FALL_REL = 0.10  # entropy falling by 10% of its window mean over the window
# Short answers (a number, a word) repeat token for token whenever the policy gets them right, so their
# duplicate level says nothing about sampling; only the spec's *jump* toward the ceiling does.
SHORT_ANSWER_TOKENS = 32.0  # completions/mean_length at or under this is "short"
DUP_JUMP_OF_CEILING = 0.30  # rise of the recent level over the window's first points that is a jump
RECENT_POINTS = 5  # "current level" = mean of the last few points, so a jump shows before the mean moves

# ---- clipping ------------------------------------------------------------------------------------
CLIPPED_HIGH = 0.10  # one completion in ten cut at max_completion_length scores 0 more than it should


@dataclass(frozen=True)
class Diagnosis:
    """One verdict of the spec's tables, with the numbers behind it."""

    topic: str  # "bottleneck" | "concurrency" | "saturation" | "duplicates" | "clipping"
    verdict: str  # slug, e.g. "generation_bound"
    title: str  # short human sentence
    severity: str  # "ok" | "info" | "warn"
    evidence: dict[str, float] = field(default_factory=dict)  # metric name (or name:derived) -> number
    advice: str = ""  # the spec's advice, in English

    def as_dict(self) -> dict:
        """A JSON-ready dict (evidence copied)."""
        return asdict(self)


# ==== series helpers ==================================================================================
Points = list[tuple[float, float]]


def _clean(points: Sequence[tuple[int, float | None]]) -> Points:
    """(step, value) pairs with None / NaN / inf / non-numeric values dropped."""
    out = []
    for step, value in points:
        if value is None or isinstance(value, str):
            continue
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append((float(step), v))
    return out


def _windowed(series: Mapping[str, Points], window: int) -> dict[str, Points]:
    """Each series cut to the last ``window`` steps of the run (the latest step over all metrics).

    One run-wide cut, not per metric: a metric that stopped being logged long ago drops out instead of
    having its stale values read as current.
    """
    last = max((p[-1][0] for p in series.values() if p), default=None)
    if last is None:
        return {}
    first = last - max(1, window)
    cut = {name: [p for p in pts if p[0] > first] for name, pts in series.items()}
    return {name: pts for name, pts in cut.items() if pts}


def _mean(points: Points) -> float:
    return sum(v for _, v in points) / len(points)


def _recent(points: Points, n: int = RECENT_POINTS) -> float:
    """Mean of the last ``n`` points: the current level."""
    return _mean(points[-n:])


def _change(points: Points) -> float:
    """Least-squares slope times the step span: how much the series moved over the window.

    Fewer than 3 points (or one step) give 0: no trend without evidence.
    """
    if len(points) < 3:
        return 0.0
    xs = [x for x, _ in points]
    mx, my = sum(xs) / len(xs), _mean(points)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope * (xs[-1] - xs[0])


def _trend(change: float, threshold: float = TREND_MIN_CHANGE) -> str:
    """ "climbing" / "falling" / "flat" from a normalised change."""
    if change >= threshold:
        return "climbing"
    if change <= -threshold:
        return "falling"
    return "flat"


def _config(config: Mapping[str, Any] | None) -> dict[str, int]:
    """The config keys the rules read, with spec defaults for missing or None values."""
    out = dict(CONFIG_DEFAULTS)
    for key in CONFIG_DEFAULTS:
        value = (config or {}).get(key)
        if value is not None:
            out[key] = int(value)
    return out


# ==== bottleneck ======================================================================================
def _wait_level(wait_s: float, step_s: float | None) -> str:
    """ "high" / "some" / "low" for a mean wait, relative to the step time when known."""
    if step_s and step_s > 0:
        x, hi, lo = wait_s / step_s, WAIT_HIGH_FRAC, WAIT_LOW_FRAC
    else:
        x, hi, lo = wait_s, WAIT_HIGH_S, WAIT_LOW_S
    if x >= hi:
        return "high"
    if x <= lo:
        return "low"
    return "some"


def _wait_evidence(w: Mapping[str, Points], name: str, step_s: float | None) -> dict[str, float]:
    wait = _mean(w[name])
    ev = {name: wait}
    if step_s and step_s > 0:
        ev[f"{name}:step_frac"] = wait / step_s
    return ev


def _queue_fill(w: Mapping[str, Points], cfg: Mapping[str, int]) -> float | None:
    """Queued samples as a share of the staleness lead (max(max_staleness, 1) steps' worth of
    samples, ``StalenessPolicy.lead``); None if not computable."""
    if ROLLOUT_QUEUE_SIZE not in w or BATCH_SAMPLES_PER_STEP not in w:
        return None
    per_step = _mean(w[BATCH_SAMPLES_PER_STEP])
    if per_step <= 0:
        return None
    return _mean(w[ROLLOUT_QUEUE_SIZE]) / StalenessPolicy(max_staleness=cfg["max_staleness"]).lead(per_step)


def _bottleneck_verdict(rw: str, bp: str, fill: float | None, rw_x: float, bp_x: float) -> tuple[str, bool]:
    """(verdict, exact) from the two wait levels; in the grey zone, lean on the queue, then the waits."""
    if rw == "high" and bp == "high":
        return "staleness_too_tight", True
    if rw == "high":
        return "generation_bound", True
    if bp == "high":
        return "trainer_bound", True
    if rw == "low" and bp == "low":
        return "balanced", True
    # Some waiting, none of it high: name the nearer rule. The queue says which side is ahead.
    if fill is not None and fill <= QUEUE_EMPTY_FILL and rw == "some":
        return "generation_bound", False
    if fill is not None and fill >= QUEUE_FULL_FILL and bp == "some":
        return "trainer_bound", False
    return ("generation_bound" if rw_x >= bp_x else "trainer_bound"), False


def _bottleneck(w: Mapping[str, Points], cfg: Mapping[str, int]) -> Diagnosis | None:
    """Spec "Rollout queue": the two waits, read with the queue size, say which side is the bottleneck."""
    if PERF_ROLLOUT_WAIT_S not in w or ROLLOUT_BACKPRESSURE_S not in w:
        return None  # the reading needs both mirror images
    step_s = _mean(w[PERF_STEP_S]) if PERF_STEP_S in w else None
    rw_s, bp_s = _mean(w[PERF_ROLLOUT_WAIT_S]), _mean(w[ROLLOUT_BACKPRESSURE_S])
    rw, bp = _wait_level(rw_s, step_s), _wait_level(bp_s, step_s)
    fill = _queue_fill(w, cfg)
    scale = step_s if step_s and step_s > 0 else 1.0
    verdict, exact = _bottleneck_verdict(rw, bp, fill, rw_s / scale, bp_s / scale)
    ev = {
        **_wait_evidence(w, PERF_ROLLOUT_WAIT_S, step_s),
        **_wait_evidence(w, ROLLOUT_BACKPRESSURE_S, step_s),
    }
    for name in (PERF_STEP_S, ROLLOUT_QUEUE_SIZE, BATCH_SAMPLES_PER_STEP, SAMPLE_STALENESS_MEAN):
        if name in w:
            ev[name] = _mean(w[name])
    if fill is not None:
        ev["rollout/queue_size:fill"] = fill
    ev["config/max_staleness"] = float(cfg["max_staleness"])
    title, severity, advice = BOTTLENECK[verdict]
    if not exact:
        title, severity = f"Leaning {title[0].lower()}{title[1:]}", "info"
    return Diagnosis("bottleneck", verdict, title, severity, ev, advice)


# ==== concurrency =====================================================================================
# Bottleneck verdicts in which max_staleness holds generation back: the concurrency card's
# "staleness limit" reading. Read from the bottleneck card's verdict so the two cards never disagree
# on the same two waits (the old, separate reading named staleness on any backpressure while the
# bottleneck card called the same window generation-bound).
STALENESS_BINDS = frozenset({"trainer_bound", "staleness_too_tight"})


def _concurrency_verdict(
    w: Mapping[str, Points], cfg: Mapping[str, int], step_s: float | None, bottleneck: Diagnosis | None
) -> str:
    """The first of the spec's three readings that holds, in the spec's order; else "none".

    Staleness binds when the bottleneck card says generation waits on max_staleness; without a
    bottleneck reading (perf/rollout_wait_s absent), when rollout/backpressure_s is not negligible.
    """
    hard = cfg["max_concurrent_rollouts"]
    running = _mean(w[ROLLOUT_CONCURRENCY]) if ROLLOUT_CONCURRENCY in w else None
    if bottleneck is not None:
        if bottleneck.verdict in STALENESS_BINDS:
            return "staleness_limit"
    elif ROLLOUT_BACKPRESSURE_S in w and _wait_level(_mean(w[ROLLOUT_BACKPRESSURE_S]), step_s) != "low":
        return "staleness_limit"
    if ROLLOUT_CONCURRENCY_CAP in w:
        cap = _mean(w[ROLLOUT_CONCURRENCY_CAP])
        if cap < CAP_BELOW_FRAC * hard and (running is None or running >= AT_LIMIT_FRAC * cap):
            return "server_load"
    kv_low = (
        ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC not in w or _mean(w[ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC]) < KV_LOW_USAGE
    )
    waiting = PERF_ROLLOUT_WAIT_S in w and _wait_level(_mean(w[PERF_ROLLOUT_WAIT_S]), step_s) == "high"
    if running is not None and running >= AT_LIMIT_FRAC * hard and kv_low and waiting:
        return "max_concurrent_rollouts_ceiling"
    return "none"


def _concurrency(
    w: Mapping[str, Points], cfg: Mapping[str, int], bottleneck: Diagnosis | None = None
) -> Diagnosis | None:
    """Spec "Concurrency": staleness, vLLM load or max_concurrent_rollouts, whichever binds.

    ``bottleneck`` is this window's bottleneck verdict: the staleness reading follows it (one verdict
    from the same two waits), and the advice says how both cards hold together.
    A missing KV-usage metric (server without /metrics) does not block the ceiling reading: the cap is
    then max_concurrent_rollouts itself.
    """
    names = (ROLLOUT_CONCURRENCY, ROLLOUT_CONCURRENCY_CAP, ROLLOUT_BACKPRESSURE_S)
    if not any(n in w for n in names):
        return None
    step_s = _mean(w[PERF_STEP_S]) if PERF_STEP_S in w else None
    verdict = _concurrency_verdict(w, cfg, step_s, bottleneck)
    ev: dict[str, float] = {}
    for name in (*names, ROLLOUT_VLLM_KV_CACHE_USAGE_FRAC, PERF_ROLLOUT_WAIT_S, PERF_STEP_S):
        if name in w:
            ev[name] = _mean(w[name])
    ev["config/max_concurrent_rollouts"] = float(cfg["max_concurrent_rollouts"])
    title, severity, advice = CONCURRENCY[verdict]
    if bottleneck is not None:
        advice += BOTH_HOLD.get((verdict, bottleneck.verdict), "")
    return Diagnosis("concurrency", verdict, title, severity, ev, advice)


# ==== saturation ======================================================================================
def infer_reward_range(series: Mapping[str, Sequence[tuple[int, float | None]]]) -> tuple[float, float]:
    """[0, 1] when every observed ``reward`` / ``reward_dropped`` lies in it, else observed min..max.

    Reads the whole history, not the window: the range is a property of the reward functions.
    """
    values = [v for name in (REWARD, REWARD_DROPPED) for _, v in _clean(series.get(name, []))]
    if not values or all(0.0 <= v <= 1.0 for v in values):
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if lo == hi:  # one value seen: span it and the [0, 1] default rather than an empty range
        return min(lo, 0.0), max(hi, 1.0)
    return lo, hi


@dataclass(frozen=True)
class _SatState:
    """The words of the spec's saturation table, computed from the window."""

    frac_level: str  # "low" | "moderate" | "high"
    frac_trend: str
    dropped_pos: str | None  # "bottom" | "middle" | "top"; None when reward_dropped is absent
    dropped_trend: str | None
    reward_low: bool | None
    reward_trend: str | None
    reward_top: bool | None = None  # reward near the top of the range (the end state of saturation)


def _position(value: float, lo: float, hi: float) -> float:
    return (value - lo) / (hi - lo)


def _band(pos: float) -> str:
    return "bottom" if pos <= NEAR_BOTTOM else "top" if pos >= NEAR_TOP else "middle"


SATURATION_RULES: tuple[tuple[str, tuple[Callable[[_SatState], bool], ...]], ...] = (
    (
        "saturated_top",
        (
            lambda s: s.frac_trend == "climbing",
            lambda s: s.dropped_pos == "top",
            lambda s: s.reward_trend == "climbing",
        ),
    ),
    (
        # The same case once it has arrived: frac no longer climbs because it is already high, and the
        # reward sits at the top instead of climbing towards it (reward ~ 1, frac_reward_zero_std ~ 1).
        "saturated_top",
        (
            lambda s: s.frac_level == "high",
            lambda s: s.dropped_pos == "top" or (s.dropped_pos is None and s.reward_top is True),
            lambda s: s.reward_top is True,
        ),
    ),
    (
        "stuck_bottom",
        (
            lambda s: s.frac_level == "high",
            lambda s: s.dropped_pos == "bottom",
            lambda s: s.reward_low is True,
            lambda s: s.reward_trend == "flat",
        ),
    ),
    (
        "regression",  # before "mixed": both can hold, and this one needs action
        (
            lambda s: s.frac_trend == "climbing",
            lambda s: s.dropped_trend == "falling",
            lambda s: s.reward_trend == "falling",
        ),
    ),
    (
        "mixed",
        (
            lambda s: s.frac_level == "high",
            lambda s: s.dropped_pos == "middle",
        ),
    ),
)


def _saturation_verdict(state: _SatState) -> tuple[str, bool]:
    """(verdict, exact): healthy, the first rule met in full, else the best partial match, else unclear."""
    if state.frac_level == "low":
        return "healthy", True
    best, best_score = "unclear", 0.0
    for verdict, conditions in SATURATION_RULES:
        met = sum(bool(c(state)) for c in conditions)
        if met == len(conditions):
            return verdict, True
        score = met / len(conditions)
        if met >= 2 and score >= PARTIAL_MATCH_FRAC and score > best_score:
            best, best_score = verdict, score
    return best, best == "unclear"


def _saturation(w: Mapping[str, Points], reward_range: tuple[float, float]) -> Diagnosis | None:
    """Spec "Saturation and duplicates", first table: the three curves against the reward range."""
    if FRAC_REWARD_ZERO_STD not in w:
        return None
    lo, hi = reward_range
    width = hi - lo
    frac = _mean(w[FRAC_REWARD_ZERO_STD])
    frac_change = _change(w[FRAC_REWARD_ZERO_STD])  # frac lives in [0, 1]: no rescaling
    ev = {FRAC_REWARD_ZERO_STD: frac, f"{FRAC_REWARD_ZERO_STD}:change": frac_change}
    ev.update({"reward_range:lo": lo, "reward_range:hi": hi})
    frac_level = "low" if frac <= FRAC_ZERO_STD_LOW else "high" if frac >= FRAC_ZERO_STD_HIGH else "moderate"
    found: dict[str, tuple[float, str]] = {}  # name -> (position, trend)
    for name in (REWARD_DROPPED, REWARD):
        if name in w:
            mean, change = _mean(w[name]), _change(w[name]) / width
            found[name] = (_position(mean, lo, hi), _trend(change))
            ev.update({name: mean, f"{name}:position": found[name][0], f"{name}:change": change})
    dropped, reward = found.get(REWARD_DROPPED), found.get(REWARD)
    state = _SatState(
        frac_level=frac_level,
        frac_trend=_trend(frac_change),
        dropped_pos=_band(dropped[0]) if dropped else None,
        dropped_trend=dropped[1] if dropped else None,
        reward_low=reward[0] <= NEAR_BOTTOM if reward else None,
        reward_trend=reward[1] if reward else None,
        reward_top=reward[0] >= NEAR_TOP if reward else None,
    )
    if _recent(w[FRAC_REWARD_ZERO_STD]) >= ALL_DROPPED_FRAC:
        solved = dropped or reward  # where the groups sit; the kept reward when no dropped mean is logged
        if solved is not None and _band(solved[0]) == "top":
            # The spec's "saturated at the top", in its final state: named as such, not as a stall.
            title, severity, advice = SATURATION["saturated_top_stalled"]
            return Diagnosis("saturation", "saturated_top", title, severity, ev, advice)
        title, severity, advice = SATURATION["all_dropped"]
        return Diagnosis("saturation", "all_dropped", title, severity, ev, advice + _why_all_dropped(dropped))
    verdict, exact = _saturation_verdict(state)
    title, severity, advice = SATURATION[verdict]
    if not exact:
        # No colon after "Partly": the page's strip shows a title up to its first colon.
        title, severity = f"Partly {title[0].lower()}{title[1:]}", "info"
    return Diagnosis("saturation", verdict, title, severity, ev, advice)


def _why_all_dropped(dropped: tuple[float, str] | None) -> str:
    """The likely cause, from where the dropped groups' reward sits in the reward range."""
    if dropped is None:
        return " Check that the reward functions can tell completions apart."
    band = _band(dropped[0])
    if band == "top":
        return " Their reward is at the top: saturated at the top, the prompts are too easy."
    if band == "bottom":
        return " Their reward is at the bottom: the prompts are too hard, or the reward gives no credit."
    return " Their reward sits mid-range: a constant reward cannot tell completions apart; check the reward functions."


# ==== duplicates ======================================================================================
def _duplicates(w: Mapping[str, Points], cfg: Mapping[str, int]) -> Diagnosis | None:
    """Spec "Saturation and duplicates", second table: duplicate_frac (and entropy)."""
    name = COMPLETIONS_DUPLICATE_FRAC
    if name not in w:
        return None
    g = max(cfg["num_generations"], 2)
    ceiling = (g - 1) / g
    recent, change = _recent(w[name]), _change(w[name])
    ev = {name: _mean(w[name]), f"{name}:recent": recent, f"{name}:change": change}
    ev.update({f"{name}:ceiling": ceiling, "config/num_generations": float(g)})
    entropy_falling = False
    if ENTROPY in w:
        entropy = _mean(w[ENTROPY])
        rel = _change(w[ENTROPY]) / abs(entropy) if entropy else 0.0
        entropy_falling = rel <= -ENTROPY_FALL_REL
        ev.update({ENTROPY: entropy, f"{ENTROPY}:change_rel": rel})
    short = _explained_by_short_answers(w, ev, recent, ceiling)
    if recent >= DUP_NOT_RANDOM_OF_CEILING * ceiling:
        verdict = "short_answers" if short else "not_random"
    elif change >= DUP_RISE_OF_CEILING * ceiling and entropy_falling:
        verdict = "collapse"
    elif recent <= DUP_HEALTHY_OF_CEILING * ceiling:
        verdict = "healthy"
    else:
        verdict = "short_answers" if short else "unclear"
    title, severity, advice = DUPLICATES[verdict]
    return Diagnosis("duplicates", verdict, title, severity, ev, advice)


def _explained_by_short_answers(
    w: Mapping[str, Points], ev: dict[str, float], recent: float, ceiling: float
) -> bool:
    """True when a duplicate level is short answers repeating rather than sampling that stopped being
    random: completions/mean_length is short and the level did not jump within the window (a run at
    temperature 0 from its first step cannot be told apart this way; the advice says what to check).
    Adds its numbers to ``ev``. Without completions/mean_length the level alone decides, as the
    spec's table reads.

    Not checked against frac_reward_zero_std: a group of 3 right answers and 1 wrong one holds copies
    and still gives a gradient, so short correct answers repeat in groups that are not dropped too.
    """
    if COMPLETIONS_MEAN_LENGTH not in w:
        return False
    length = _mean(w[COMPLETIONS_MEAN_LENGTH])
    points = w[COMPLETIONS_DUPLICATE_FRAC]
    jump = recent - _mean(points[:RECENT_POINTS]) if len(points) > RECENT_POINTS else 0.0
    ev.update({COMPLETIONS_MEAN_LENGTH: length, f"{COMPLETIONS_DUPLICATE_FRAC}:jump": jump})
    return length <= SHORT_ANSWER_TOKENS and jump < DUP_JUMP_OF_CEILING * ceiling


# ==== clipping ========================================================================================
def _clipping(w: Mapping[str, Points]) -> Diagnosis | None:
    """completions/clipped_ratio: the share of completions cut at max_completion_length without EOS."""
    name = COMPLETIONS_CLIPPED_RATIO
    if name not in w:
        return None
    ratio = _mean(w[name])
    ev = {name: ratio}
    if ratio >= CLIPPED_HIGH:
        title = f"Truncated: {ratio:.0%} of completions hit max_completion_length"
        advice = (
            "Completions are cut at max_completion_length without EOS, and a truncated completion usually "
            "scores 0. Raise max_completion_length or check the stop tokens."
        )
        return Diagnosis("clipping", "truncated", title, "warn", ev, advice)
    return Diagnosis("clipping", "ok", "Completions end on their own", "ok", ev, "Nothing to do.")


# ==== entry point =====================================================================================
def diagnose(
    series: Mapping[str, Sequence[tuple[int, float | None]]],
    *,
    config: Mapping[str, Any] | None = None,
    window: int = DEFAULT_WINDOW_STEPS,
    reward_range: tuple[float, float] | None = None,
) -> list[Diagnosis]:
    """Apply the spec's diagnosis tables to the last ``window`` steps of a run's metrics.

    series: metric name -> [(step, value), ...] ascending by step (None/NaN values ignored).
    config: AsyncGRPOConfig fields (max_staleness, num_generations, max_concurrent_rollouts, ...);
        missing keys use the spec defaults.
    reward_range: (min, max) of the reward; inferred by :func:`infer_reward_range` when None.
    Returns at most one Diagnosis per topic, in :data:`TOPICS` order; a topic whose metrics are absent
    from the window is omitted (no verdict without evidence).
    """
    cleaned = {name: _clean(points) for name, points in series.items()}
    w = _windowed(cleaned, window)
    cfg = _config(config)
    if reward_range is None:
        reward_range = infer_reward_range(series)
    lo, hi = float(reward_range[0]), float(reward_range[1])
    if not hi > lo:
        raise ValueError(f"reward_range={reward_range}: max must exceed min")
    bottleneck = _bottleneck(w, cfg)
    found = [
        bottleneck,
        _concurrency(w, cfg, bottleneck),
        _saturation(w, (lo, hi)),
        _duplicates(w, cfg),
        _clipping(w),
    ]
    found = _cross_read([d for d in found if d is not None])
    return _recommend_retirement(found, w, config)


def _recommend_retirement(
    found: list[Diagnosis], w: Mapping[str, Points], config: Mapping[str, Any] | None
) -> list[Diagnosis]:
    """Where dropped groups dominate (``frac_reward_zero_std`` >= FRAC_ZERO_STD_HIGH) while some still
    train, and ``retire_saturated_prompts`` is off: the saturation card recommends it, with the
    generated tokens a step spends on dropped groups (generation rate x step time x dropped share,
    when both are logged)."""
    if (config or {}).get("retire_saturated_prompts") or FRAC_REWARD_ZERO_STD not in w:
        return found
    frac = _mean(w[FRAC_REWARD_ZERO_STD])
    if not FRAC_ZERO_STD_HIGH <= frac < ALL_DROPPED_FRAC:
        return found
    cost = f"{frac:.0%} of the generation"
    if ROLLOUT_GENERATED_TOKENS_PER_S in w and PERF_STEP_S in w:
        tokens = _mean(w[ROLLOUT_GENERATED_TOKENS_PER_S]) * _mean(w[PERF_STEP_S]) * frac
        cost = f"about {tokens:,.0f} generated tokens a step ({frac:.0%} of the generation)"
    note = SATURATION_RETIRE_ADVICE.format(cost=cost)
    return [
        replace(d, advice=d.advice + note, evidence={**d.evidence, "config/retire_saturated_prompts": 0.0})
        if d.topic == "saturation"
        else d
        for d in found
    ]


def _cross_read(found: list[Diagnosis]) -> list[Diagnosis]:
    """Cards whose cause another card names: copies of one rollout (duplicates "not_random") also drop
    every group, so an "all_dropped" saturation says so instead of blaming the reward."""
    verdicts = {d.topic: d.verdict for d in found}
    if verdicts.get("duplicates") == "not_random" and verdicts.get("saturation") == "all_dropped":
        note = " Here the groups are copies of one rollout (see the duplicates card): fix the sampling first."
        found = [replace(d, advice=d.advice + note) if d.topic == "saturation" else d for d in found]
    return found
