"""Rollout-side MTP speculative-decoding metrics from vLLM's own statistics.

Every step the user sees how well speculation paid off in the rollout: the acceptance rate, the mean
accepted length and the acceptance per draft position, under verl's metric names where verl has them.

Sources in vLLM 0.31.0 (checked in ``vllm/v1/spec_decode/metrics.py``, ``vllm/v1/metrics/reader.py``,
``vllm/v1/metrics/stats.py``, ``vllm/outputs.py``):

* **Cumulative Prometheus counters** kept by the process that runs vLLM's front end (in verl the
  ``vLLMHttpServer`` Ray actor of each rollout replica), one series per engine (labels
  ``model_name``, ``engine``): ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
  ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``
  (label ``position``). In-process they are read with ``vllm.v1.metrics.reader.get_metrics_snapshot()``
  (``LLM.get_metrics()``), which returns ``Counter`` objects and one ``Vector`` for the per-position
  counter (:func:`counts_from_vllm_metrics`); over HTTP they are on the replica's ``/metrics``
  (:func:`counts_from_prometheus_text`, :func:`scrape_spec_counters`). They exist only with log stats on:
  verl 0.9.1 defaults ``actor_rollout_ref.rollout.disable_log_stats: True`` — set it to ``false``.
  They are cumulative: :class:`SpecDecodeCounterTracker` turns snapshots into per-step deltas. A counter
  that goes backwards (engine restart, a new front-end process) makes that series' delta its new value
  and flags the step (``rollout/spec_counter_reset``).
* **Per-request statistics**: ``CompletionOutput.spec_decode_metrics`` (``RequestSpecDecodeMetrics``:
  ``histogram[j]`` = verify steps that accepted ``j`` drafts, ``num_draft_tokens``), filled when the
  engine argument ``per_request_spec_decode_metrics`` is ``summary`` or ``detailed``
  (``actor_rollout_ref.rollout.engine_kwargs.vllm.per_request_spec_decode_metrics``). verl 0.9.1's
  server reads ``final_res.metrics.request_spec_decode_stats`` (``num_draft_tokens``,
  ``num_accepted_tokens``, ``num_verify_steps``), which vLLM 0.31.0 does not have: verl logs
  "vLLM MTP rollout metrics do not include request_spec_decode_stats" once and emits no spec metrics.
  :func:`verl_spec_fields` converts vLLM 0.31.0's object into the ``extra_fields`` verl expects and
  :func:`spec_metrics_from_requests` aggregates them exactly like verl.
* ``SpecDecodingStats`` (per scheduler step, what the counters are incremented by):
  :meth:`SpecDecodeCounts.from_stats`.

Metrics (``k`` = draft position, 0-based like vLLM's ``position`` label; position 0 is the first draft
token, the one vLLM's MTP drafter proposes with the MTP block's depth-1 prediction):

==================================  ===========================================================
``rollout/spec_accept_rate``        accepted draft tokens / proposed draft tokens (verl's name).
``rollout/spec_accept_length``      1 + accepted draft tokens / verify steps ("drafts"): tokens
                                    emitted per target forward, bonus token included (verl's name).
``rollout/spec_accept_rate_pos_{k}`` verify steps whose draft ``k`` was accepted / verify steps that
                                    drafted position ``k``. With a fixed ``k`` every verify step drafts
                                    every position: vLLM's per-position rate (unconditional, so it
                                    decreases with ``k`` and ``1 + sum_k rate_pos_k ==
                                    spec_accept_length``). With ``k`` chosen by batch size
                                    (``num_speculative_tokens_per_batch_size``) a step at a small ``k``
                                    does not draft the later positions and must not count against them:
                                    the denominator is the exact per-position count where vLLM gives it
                                    (its per-step ``SpecDecodingStats``, per-request ``detailed``
                                    statistics), else what the totals and the schedule's depths determine
                                    (:func:`verl_mtp_plugin.spec_schedule.drafted_per_position`); a
                                    position they cannot determine gets no key.
``rollout/spec_mean_draft_tokens``  draft tokens / verify steps: the ``k`` the step drafted with on
                                    average (a fixed ``k``, or the schedule's mix).
``rollout/spec_num_drafts``         verify steps with at least one draft token this step.
``rollout/spec_num_draft_tokens``   draft tokens proposed this step.
``rollout/spec_num_accepted_tokens`` draft tokens accepted this step.
``rollout/spec_counter_reset``      1.0 when a vLLM counter went backwards this step, else 0.0
                                    (counter path only).
==================================  ===========================================================

Aggregation: verl averages ``rate`` and ``length`` **per request** (each request weighs the same,
zero denominators count as 0.0); :func:`spec_metrics_from_requests` does exactly that. Counters carry
no request boundaries, so :func:`spec_metrics_from_counts` reports the token-weighted ratios of the
step (vLLM's own "Avg Draft acceptance rate" / "Mean acceptance length"), which is what verl's
``compute_spec_decode_metrics`` returns for the step's totals given as one request. Per-position rates
are always token-weighted (verl has no per-position metric). A step without any draft (speculation
off, or no statistics) has no rate keys at all rather than a misleading 0.

This module imports nothing heavy: vLLM objects are read by attribute, ``prometheus_client`` is
imported only to parse ``/metrics`` text.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Hashable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = [
    "ACCEPT_LENGTH_KEY",
    "ACCEPT_RATE_KEY",
    "ACCEPT_RATE_POS_KEY",
    "COUNTER_RESET_KEY",
    "NUM_ACCEPTED_KEY",
    "NUM_DRAFTS_KEY",
    "NUM_DRAFT_TOKENS_KEY",
    "MEAN_DRAFT_TOKENS_KEY",
    "VLLM_ACCEPTED_PER_POS",
    "VLLM_NUM_ACCEPTED",
    "VLLM_NUM_DRAFTS",
    "VLLM_NUM_DRAFT_TOKENS",
    "SpecDecodeCounterTracker",
    "SpecDecodeCounts",
    "SpecDecodeStep",
    "counts_from_prometheus_text",
    "counts_from_vllm_metrics",
    "drafted_counts",
    "merge_spec_metrics",
    "per_position_rates",
    "position_rates_from_metrics",
    "scalar_metric",
    "scrape_spec_counters",
    "spec_metrics_from_counts",
    "spec_metrics_from_requests",
    "total_counts",
    "verl_spec_fields",
]

logger = logging.getLogger(__name__)

#: verl's names (``verl.trainer.ppo.ray_trainer.compute_spec_decode_metrics``).
ACCEPT_RATE_KEY = "rollout/spec_accept_rate"
ACCEPT_LENGTH_KEY = "rollout/spec_accept_length"
#: Plugin names (verl has none for these).
ACCEPT_RATE_POS_KEY = "rollout/spec_accept_rate_pos_{k}"
NUM_DRAFTS_KEY = "rollout/spec_num_drafts"
NUM_DRAFT_TOKENS_KEY = "rollout/spec_num_draft_tokens"
NUM_ACCEPTED_KEY = "rollout/spec_num_accepted_tokens"
COUNTER_RESET_KEY = "rollout/spec_counter_reset"
MEAN_DRAFT_TOKENS_KEY = "rollout/spec_mean_draft_tokens"

#: vLLM 0.31.0 Prometheus metric names (``SpecDecodingProm``; exposed with a ``_total`` suffix).
VLLM_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_SCALAR_FIELDS = {
    VLLM_NUM_DRAFTS: "num_drafts",
    VLLM_NUM_DRAFT_TOKENS: "num_draft_tokens",
    VLLM_NUM_ACCEPTED: "num_accepted_tokens",
}

#: A series key: the sorted ``(label, value)`` pairs of one counter series (plus ``("server", addr)``
#: for scraped replicas).
SeriesKey = tuple


# --------------------------------------------------------------------------------------------------
# counts


def _as_count(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a count, got {value!r}")
    f = float(value)
    if not math.isfinite(f) or f < 0 or f != int(f):
        raise ValueError(f"{what} must be a non-negative integer count, got {value!r}")
    return int(f)


@dataclasses.dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative-decoding totals over some span (one step, one request, one engine's lifetime).

    Attributes:
        num_drafts (int): verify steps with at least one draft token (vLLM ``num_drafts``; verl's
            ``spec_num_verify_steps``).
        num_draft_tokens (int): draft tokens proposed.
        num_accepted_tokens (int): draft tokens accepted.
        accepted_per_pos (tuple[int, ...]): verify steps whose draft at position ``k`` was accepted,
            ``k = 0 .. num_speculative_tokens - 1`` (accepted drafts are a prefix, so this is
            non-increasing and sums to ``num_accepted_tokens``).
        drafted_per_pos (tuple[int, ...]): verify steps that drafted position ``k`` (sums to
            ``num_draft_tokens``); ``()`` when the source does not say (vLLM's Prometheus counters, per-request
            ``summary`` statistics of steps with different ``k``). Not part of equality: two sources of the same
            drafts compare equal whether or not they carry it.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    drafted_per_pos: tuple[int, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self):
        for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            object.__setattr__(self, f, _as_count(getattr(self, f), f))
        for f in ("accepted_per_pos", "drafted_per_pos"):
            object.__setattr__(
                self, f, tuple(_as_count(v, f"{f}[{i}]") for i, v in enumerate(getattr(self, f)))
            )

    # ---- construction from vLLM objects -----------------------------------------------------------
    @classmethod
    def from_stats(cls, stats: Any) -> "SpecDecodeCounts":
        """From a ``vllm.v1.spec_decode.metrics.SpecDecodingStats`` (one scheduler step, all requests)."""
        return cls(
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            accepted_per_pos=tuple(stats.num_accepted_tokens_per_pos),
            drafted_per_pos=tuple(getattr(stats, "num_draft_tokens_per_pos", None) or ()),
        )

    @classmethod
    def from_request(cls, obj: Any) -> "SpecDecodeCounts | None":
        """From one request's statistics.

        Args:
            obj: a ``vllm.v1.metrics.stats.RequestSpecDecodeMetrics`` (``histogram``,
                ``num_draft_tokens``), a ``vllm.outputs.CompletionOutput`` carrying one in
                ``spec_decode_metrics`` (or a single-output ``RequestOutput``), a
                :class:`SpecDecodeCounts`, or a verl ``extra_fields`` dict with ``spec_num_draft_tokens``,
                ``spec_num_accepted_tokens``, ``spec_num_verify_steps`` (no per-position data).

        Returns:
            SpecDecodeCounts, or None when ``obj`` carries no speculative-decoding statistics (vLLM
            leaves ``spec_decode_metrics`` None unless ``per_request_spec_decode_metrics`` is on).
        """
        if isinstance(obj, SpecDecodeCounts):
            return obj
        if isinstance(obj, Mapping):
            if "spec_num_draft_tokens" not in obj:
                return None
            return cls(
                num_drafts=obj["spec_num_verify_steps"],
                num_draft_tokens=obj["spec_num_draft_tokens"],
                num_accepted_tokens=obj["spec_num_accepted_tokens"],
            )
        if hasattr(obj, "outputs") and hasattr(obj, "request_id"):  # RequestOutput
            if len(obj.outputs) != 1:
                raise ValueError(
                    f"RequestOutput {obj.request_id!r} has {len(obj.outputs)} outputs; pass each CompletionOutput"
                )
            obj = obj.outputs[0]
        if hasattr(obj, "spec_decode_metrics") and not hasattr(obj, "histogram"):
            obj = obj.spec_decode_metrics  # CompletionOutput
            if obj is None:
                return None
        hist = list(obj.histogram)
        num_spec = len(hist) - 1
        per_pos = tuple(sum(hist[j] for j in range(k + 1, len(hist))) for k in range(num_spec))
        steps = list(getattr(obj, "per_step_drafted", None) or ())  # vLLM's "detailed" level
        if steps:
            drafted = tuple(sum(1 for d in steps if d > k) for k in range(num_spec))
        elif obj.num_draft_tokens == sum(hist) * num_spec:  # every verify step drafted every position
            drafted = (sum(hist),) * num_spec
        else:
            drafted = ()
        return cls(
            num_drafts=sum(hist),
            num_draft_tokens=obj.num_draft_tokens,
            num_accepted_tokens=sum(j * c for j, c in enumerate(hist)),
            accepted_per_pos=per_pos,
            drafted_per_pos=drafted,
        )

    # ---- arithmetic ----------------------------------------------------------------------------------
    def __add__(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        if not isinstance(other, SpecDecodeCounts):
            return NotImplemented
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0,) * (n - len(other.accepted_per_pos))
        return SpecDecodeCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b)),
            _sum_drafted(self, other),
        )

    def went_backwards_from(self, previous: "SpecDecodeCounts") -> bool:
        """True when any counter of this snapshot is below ``previous`` (a counter reset)."""
        if (
            self.num_drafts < previous.num_drafts
            or self.num_draft_tokens < previous.num_draft_tokens
            or self.num_accepted_tokens < previous.num_accepted_tokens
        ):
            return True
        n = max(len(self.accepted_per_pos), len(previous.accepted_per_pos))
        cur = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        prev = previous.accepted_per_pos + (0,) * (n - len(previous.accepted_per_pos))
        return any(c < p for c, p in zip(cur, prev))

    def minus(self, previous: "SpecDecodeCounts") -> "SpecDecodeCounts":
        """``self - previous`` for a counter that did not go backwards (see :meth:`went_backwards_from`)."""
        pad = max(0, len(self.accepted_per_pos) - len(previous.accepted_per_pos))
        prev_pos = previous.accepted_per_pos + (0,) * pad
        drafted = ()
        if self.drafted_per_pos and (previous.drafted_per_pos or not previous.num_drafts):
            prev_d = previous.drafted_per_pos + (0,) * max(0, len(self.drafted_per_pos) - len(previous.drafted_per_pos))
            drafted = tuple(c - p for c, p in zip(self.drafted_per_pos, prev_d))
        return SpecDecodeCounts(
            self.num_drafts - previous.num_drafts,
            self.num_draft_tokens - previous.num_draft_tokens,
            self.num_accepted_tokens - previous.num_accepted_tokens,
            tuple(c - p for c, p in zip(self.accepted_per_pos, prev_pos)),
            drafted,
        )

    # ---- ratios -----------------------------------------------------------------------------------------
    @property
    def accept_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None without draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def accept_length(self) -> float | None:
        """``1 + accepted / verify steps`` (bonus token included); None without verify steps."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def _sum_drafted(a: SpecDecodeCounts, b: SpecDecodeCounts) -> tuple[int, ...]:
    """Per-position drafted counts of ``a + b``: known when both know them (a span without drafts is neutral)."""
    if (a.num_drafts and not a.drafted_per_pos) or (b.num_drafts and not b.drafted_per_pos):
        return ()
    n = max(len(a.drafted_per_pos), len(b.drafted_per_pos))
    x = a.drafted_per_pos + (0,) * (n - len(a.drafted_per_pos))
    y = b.drafted_per_pos + (0,) * (n - len(b.drafted_per_pos))
    return tuple(i + j for i, j in zip(x, y))


def drafted_counts(counts: SpecDecodeCounts, depths: Sequence[int] | None = None) -> list[float | None]:
    """Verify steps that drafted each position: the counts' own ``drafted_per_pos`` when known; else, with the
    schedule's ``depths`` (:func:`verl_mtp_plugin.spec_schedule.schedule_depths`), what vLLM's totals determine
    (:func:`~verl_mtp_plugin.spec_schedule.drafted_per_position`, ``None`` where they cannot); else (a fixed
    ``k``) every verify step. A schedule whose only ``k`` is below ``num_speculative_tokens`` drafts none of the
    positions past it (no rate, no key, for them)."""
    n = len(counts.accepted_per_pos)
    if counts.drafted_per_pos:
        return [float(d) for d in (counts.drafted_per_pos + (0,) * n)[:n]]
    if depths and (len(set(depths)) > 1 or max(depths) < n):
        from verl_mtp_plugin.spec_schedule import drafted_per_position

        return list(drafted_per_position(counts.num_drafts, counts.num_draft_tokens, n, depths))
    return [float(counts.num_drafts)] * n


def per_position_rates(counts: SpecDecodeCounts, depths: Sequence[int] | None = None) -> list[float]:
    """Per-position acceptance: ``accepted_per_pos[k] /`` verify steps that drafted position ``k``
    (:func:`drafted_counts`); up to the first position whose drafted count is unknown or zero (empty without
    drafts). With a fixed ``k`` this is vLLM's ``accepted_per_pos[k] / num_drafts``."""
    if not counts.num_drafts:
        return []
    out: list[float] = []
    for acc, drafted in zip(counts.accepted_per_pos, drafted_counts(counts, depths)):
        if not drafted:
            break
        out.append(min(acc / drafted, 1.0))
    return out


def total_counts(counts: Iterable[SpecDecodeCounts]) -> SpecDecodeCounts:
    """Sum of several counts (engines, replicas or requests); per-position vectors are zero-padded."""
    out = SpecDecodeCounts()
    for c in counts:
        out = out + c
    return out


# --------------------------------------------------------------------------------------------------
# reading vLLM's counters


def _labels_key(labels: Mapping[str, str], drop: str | None = None) -> SeriesKey:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items() if k != drop))


def _base_name(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


def _assemble(scalars: dict, per_pos: dict) -> dict[SeriesKey, SpecDecodeCounts]:
    out: dict[SeriesKey, SpecDecodeCounts] = {}
    for key in sorted(set(scalars) | set(per_pos)):
        fields = scalars.get(key, {})
        pos = per_pos.get(key, {})
        vec = tuple(pos.get(i, 0) for i in range(max(pos) + 1)) if pos else ()
        out[key] = SpecDecodeCounts(accepted_per_pos=vec, **fields)
    return out


def counts_from_vllm_metrics(metrics: Iterable[Any]) -> dict[SeriesKey, SpecDecodeCounts]:
    """Speculative-decoding counters from vLLM's metric reader objects.

    Args:
        metrics: what ``vllm.v1.metrics.reader.get_metrics_snapshot()`` / ``LLM.get_metrics()``
            return (``Counter`` with ``name``, ``labels``, ``value``; ``Vector`` with ``values`` for
            ``vllm:spec_decode_num_accepted_tokens_per_pos``); other metrics are ignored.

    Returns:
        dict: series key (sorted label pairs, one per engine) -> cumulative :class:`SpecDecodeCounts`.
        Empty when vLLM runs without log stats (no spec-decode series registered).
    """
    scalars: dict[SeriesKey, dict[str, int]] = {}
    per_pos: dict[SeriesKey, dict[int, int]] = {}
    for m in metrics:
        name = _base_name(str(getattr(m, "name", "")))
        if name in _SCALAR_FIELDS:
            key = _labels_key(m.labels)
            scalars.setdefault(key, {})[_SCALAR_FIELDS[name]] = _as_count(m.value, name)
        elif name == VLLM_ACCEPTED_PER_POS:
            key = _labels_key(m.labels)
            per_pos[key] = {i: _as_count(v, f"{name}[{i}]") for i, v in enumerate(m.values)}
    return _assemble(scalars, per_pos)


def counts_from_prometheus_text(text: str) -> dict[SeriesKey, SpecDecodeCounts]:
    """Speculative-decoding counters from Prometheus exposition text (a vLLM server's ``/metrics``).

    Same result as :func:`counts_from_vllm_metrics` on the same registry (``_total`` samples are read,
    ``_created`` ignored; the ``position`` label becomes the per-position index).

    Args:
        text (str): exposition text.

    Returns:
        dict: series key -> cumulative :class:`SpecDecodeCounts`.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as e:  # pragma: no cover - a vLLM dependency
        raise ImportError("parsing /metrics needs prometheus_client (installed with vLLM)") from e

    scalars: dict[SeriesKey, dict[str, int]] = {}
    per_pos: dict[SeriesKey, dict[int, int]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:  # ``*_created`` gauges and other metrics fall through
            name = _base_name(s.name)
            if name in _SCALAR_FIELDS:
                scalars.setdefault(_labels_key(s.labels), {})[_SCALAR_FIELDS[name]] = _as_count(s.value, name)
            elif name == VLLM_ACCEPTED_PER_POS:
                if "position" not in s.labels:
                    raise ValueError(f"{s.name} sample without a 'position' label: {s.labels}")
                pos = int(s.labels["position"])
                per_pos.setdefault(_labels_key(s.labels, drop="position"), {})[pos] = _as_count(s.value, name)
    return _assemble(scalars, per_pos)


def scrape_spec_counters(
    addresses: Iterable[str], *, timeout: float = 5.0, strict: bool = False
) -> dict[SeriesKey, SpecDecodeCounts]:
    """Read the counters of several vLLM servers over HTTP (``GET http://<address>/metrics``).

    Args:
        addresses: ``host:port`` (verl's ``llm_server_manager.server_addresses``, ``[v6]:port`` too)
            or full URLs.
        timeout (float): seconds per request.
        strict (bool): raise on an unreachable server; otherwise log a warning and skip it (its series
            then reappear later with a two-step delta, never a negative one).

    Returns:
        dict: ``(("server", address), *labels)`` -> cumulative :class:`SpecDecodeCounts`.
    """
    import urllib.request

    out: dict[SeriesKey, SpecDecodeCounts] = {}
    for addr in addresses:
        url = addr if "://" in addr else f"http://{addr}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - cluster-internal
                text = resp.read().decode("utf-8")
        except OSError as e:
            if strict:
                raise RuntimeError(f"cannot read vLLM metrics from {url}: {e}") from e
            logger.warning("cannot read vLLM metrics from %s (%s); skipped this step", url, e)
            continue
        for key, counts in counts_from_prometheus_text(text).items():
            out[(("server", addr),) + key] = counts
    return out


# --------------------------------------------------------------------------------------------------
# per-step deltas


@dataclasses.dataclass(frozen=True)
class SpecDecodeStep:
    """One step's speculative-decoding totals, from counter deltas.

    Attributes:
        counts (SpecDecodeCounts): summed over every series (engines, replicas).
        reset (bool): some series went backwards (engine restart / new front end); its delta is its
            new value.
        reset_series (tuple): the series keys that went backwards.
        new_series (tuple): series seen for the first time (their delta is their whole value).
    """

    counts: SpecDecodeCounts
    reset: bool = False
    reset_series: tuple = ()
    new_series: tuple = ()

    def metrics(self) -> dict[str, float]:
        """The step's metric dict (:func:`spec_metrics_from_counts` with the reset flag)."""
        return spec_metrics_from_counts(self.counts, reset=self.reset)


class SpecDecodeCounterTracker:
    """Per-step deltas of vLLM's cumulative speculative-decoding counters.

    Call :meth:`update` once per training step with a snapshot of every series (all engines of all
    replicas). Per series: delta = current - previous; a series whose counter went backwards (engine
    restart, a new front-end process; verl's sleep/wake keeps the process and the counters) takes its
    current value as the delta and flags the step; a series seen for the first time contributes its
    whole value (call :meth:`set_baseline` before the first training rollout to exclude earlier
    traffic such as validation before training). A series missing from a snapshot (a server that could
not be read) keeps its last value: when it is back, its delta covers the steps it missed, never its
whole history.
    """

    def __init__(self) -> None:
        self._last: dict[Hashable, SpecDecodeCounts] = {}

    def set_baseline(self, snapshot: Mapping[Hashable, SpecDecodeCounts]) -> None:
        """Remember ``snapshot`` without producing a step (series missing from it keep their last value)."""
        self._last.update(snapshot)

    def update(self, snapshot: Mapping[Hashable, SpecDecodeCounts]) -> SpecDecodeStep:
        """Deltas since the previous snapshot.

        Args:
            snapshot: series key -> cumulative counts (:func:`counts_from_vllm_metrics`,
                :func:`counts_from_prometheus_text`, :func:`scrape_spec_counters`).

        Returns:
            SpecDecodeStep.
        """
        total = SpecDecodeCounts()
        resets, new = [], []
        for key, cur in snapshot.items():
            prev = self._last.get(key)
            if prev is None:
                delta = cur
                new.append(key)
            elif cur.went_backwards_from(prev):
                delta = cur
                resets.append(key)
                logger.warning(
                    "vLLM speculative-decoding counters went backwards for %s (engine restart?): "
                    "%s -> %s; using the new values as this step's delta",
                    key,
                    prev,
                    cur,
                )
            else:
                delta = cur.minus(prev)
            total = total + delta
        self._last.update(snapshot)
        return SpecDecodeStep(total, bool(resets), tuple(resets), tuple(new))


# --------------------------------------------------------------------------------------------------
# metric dicts


def spec_metrics_from_counts(counts: SpecDecodeCounts, *, reset: bool | None = None,
                             depths: Sequence[int] | None = None) -> dict[str, float]:
    """Metric dict of one step's totals (token-weighted, vLLM's own aggregation).

    Args:
        counts (SpecDecodeCounts): the step's totals.
        reset (bool | None): the step's counter-reset flag (``rollout/spec_counter_reset``); None
            leaves the key out.
        depths: the distinct ``k`` vLLM drafts with (a batch-size schedule; None: a fixed ``k``), for the
            per-position denominators (:func:`per_position_rates`).

    Returns:
        dict[str, float]: counts always; ``rollout/spec_accept_rate``, ``rollout/spec_accept_length``
        and ``rollout/spec_accept_rate_pos_{k}`` only when the step had drafts.
    """
    out: dict[str, float] = {
        NUM_DRAFTS_KEY: float(counts.num_drafts),
        NUM_DRAFT_TOKENS_KEY: float(counts.num_draft_tokens),
        NUM_ACCEPTED_KEY: float(counts.num_accepted_tokens),
    }
    if reset is not None:
        out[COUNTER_RESET_KEY] = 1.0 if reset else 0.0
    if counts.num_drafts and counts.num_draft_tokens:
        out[ACCEPT_RATE_KEY] = float(counts.accept_rate)
        out[ACCEPT_LENGTH_KEY] = float(counts.accept_length)
        out[MEAN_DRAFT_TOKENS_KEY] = counts.num_draft_tokens / counts.num_drafts
        for k, r in enumerate(per_position_rates(counts, depths)):
            out[ACCEPT_RATE_POS_KEY.format(k=k)] = r
    return out


def verl_spec_fields(obj: Any) -> dict[str, int]:
    """The ``extra_fields`` verl's vLLM server would write for one request (``spec_num_draft_tokens``,
    ``spec_num_accepted_tokens``, ``spec_num_verify_steps``), from vLLM 0.31.0's per-request object.

    Args:
        obj: ``CompletionOutput`` or ``RequestSpecDecodeMetrics`` (see :meth:`SpecDecodeCounts.from_request`).

    Returns:
        dict[str, int]: empty when the request carries no statistics.
    """
    c = SpecDecodeCounts.from_request(obj)
    if c is None:
        return {}
    return {
        "spec_num_draft_tokens": c.num_draft_tokens,
        "spec_num_accepted_tokens": c.num_accepted_tokens,
        "spec_num_verify_steps": c.num_drafts,
    }


def spec_metrics_from_requests(requests: Iterable[Any], *, depths: Sequence[int] | None = None) -> dict[str, float]:
    """Metric dict from per-request statistics, with verl's per-request aggregation.

    ``rollout/spec_accept_rate`` = mean over requests of ``accepted / draft_tokens`` and
    ``rollout/spec_accept_length`` = mean of ``1 + accepted / verify_steps``, zero denominators
    counting as 0.0 (verl 0.9.1 ``compute_spec_decode_metrics``); per-position rates and counts are
    summed over requests.

    Args:
        requests: per request a ``CompletionOutput``, ``RequestSpecDecodeMetrics``, verl
            ``extra_fields`` dict or :class:`SpecDecodeCounts`.

    Returns:
        dict[str, float]: empty when no request carries statistics.

    Raises:
        ValueError: some requests carry statistics and others do not (verl rejects mixed input too).
    """
    items = [SpecDecodeCounts.from_request(r) for r in requests]
    present = [c for c in items if c is not None]
    if not present:
        return {}
    if len(present) != len(items):
        raise ValueError(
            f"{len(items) - len(present)} of {len(items)} requests carry no speculative-decoding statistics; "
            "per-request metrics need them on every request (vLLM per_request_spec_decode_metrics)"
        )
    n = len(present)
    total = total_counts(present)
    out = spec_metrics_from_counts(total, depths=depths)
    rates = [c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0 for c in present]
    lengths = [1.0 + c.num_accepted_tokens / c.num_drafts if c.num_drafts else 0.0 for c in present]
    out[ACCEPT_RATE_KEY] = sum(rates) / n
    out[ACCEPT_LENGTH_KEY] = sum(lengths) / n
    if not any(c.accepted_per_pos for c in present):
        for k in [k for k in out if k.startswith("rollout/spec_accept_rate_pos_")]:
            del out[k]
    return out


def merge_spec_metrics(metrics: MutableMapping[str, Any], new: Mapping[str, float]) -> dict[str, float]:
    """Add ``new`` to verl's step metrics without overwriting keys verl already set (verl's own
    per-request ``rollout/spec_accept_rate`` / ``rollout/spec_accept_length`` win when present).

    Returns:
        dict[str, float]: the entries actually added.
    """
    added = {k: v for k, v in new.items() if k not in metrics}
    metrics.update(added)
    return added


def position_rates_from_metrics(metrics: Mapping[str, Any]) -> list[float]:
    """``[rollout/spec_accept_rate_pos_0, ..._1, ...]`` as present (stops at the first missing)."""
    out: list[float] = []
    while ACCEPT_RATE_POS_KEY.format(k=len(out)) in metrics:
        out.append(float(metrics[ACCEPT_RATE_POS_KEY.format(k=len(out))]))
    return out


def _is_number(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def scalar_metric(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a float (lists / arrays of per-micro-batch values are averaged); None when
    absent or not finite."""
    if key not in metrics:
        return None
    v = metrics[key]
    if isinstance(v, (list, tuple)) or (hasattr(v, "tolist") and not isinstance(v, (int, float))):
        seq: Sequence = v.tolist() if hasattr(v, "tolist") else v
        if not isinstance(seq, (list, tuple)):
            seq = [seq]
        vals = [float(x) for x in seq if _is_number(x)]
        return sum(vals) / len(vals) if vals else None
    return float(v) if _is_number(v) else None
