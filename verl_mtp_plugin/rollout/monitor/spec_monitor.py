"""Per-step rollout speculation metrics and the desync guard, as one object a trainer calls.

:class:`RolloutSpecMonitor` joins :mod:`verl_mtp_plugin.rollout.monitor.spec_metrics` (vLLM's counters -> per-step
deltas -> ``rollout/spec_*`` metrics) and :mod:`verl_mtp_plugin.rollout.monitor.desync_guard` (measured vs expected
acceptance). A trainer calls it at four points of its loop; the verl v1 trainers of
:mod:`verl_mtp_plugin.trainer.v1` do::

    on_train_begin     monitor.begin()              baseline: earlier traffic (validation before
                                                    training, warm-up) is not counted
    on_validate_begin  monitor.pause()              counts so far belong to the training step
    on_validate_end    monitor.resume()             validation rollouts are not counted
    _compute_metrics   monitor.step_metrics(m, s)   adds rollout/spec_* and mtp_guard/* to verl's dict

and ``mtp_colocate_async`` also ``on_sample_end -> monitor.close_window()``: there verl pauses generation when it
samples the step's batch and resumes it after the step's weight update, before the step's metrics; closing the
window at the sample makes a step count exactly the generation under one weight version (the one the trainer's
estimate of that step is for), and what the replicas generate after the update counts toward the next step.

``pause``/``resume`` keep validation generations out of the training step's acceptance. Where
training rollouts run during validation (verl's async trainers), set ``exclude_validation=False``:
then everything the servers generated between two steps is counted.

Metrics verl already computed from per-request statistics (``rollout/spec_accept_rate`` and
``rollout/spec_accept_length`` with a vLLM that returns them) are kept; the counters add what is
missing (per-position rates, counts, the reset flag). Nothing here imports verl, torch or vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping
from typing import Any

from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncError, MTPDesyncGuard
from verl_mtp_plugin.rollout.monitor.spec_metrics import (
    SpecDecodeCounterTracker,
    SpecDecodeCounts,
    merge_spec_metrics,
    scrape_spec_counters,
    spec_metrics_from_counts,
)

__all__ = ["RolloutSpecMonitor"]

logger = logging.getLogger(__name__)

Snapshot = Mapping[Hashable, SpecDecodeCounts]


class RolloutSpecMonitor:
    """vLLM speculation counters -> per-step metrics -> desync guard.

    Args:
        addresses: the vLLM servers' ``host:port`` (verl: ``LLMServerManager.server_addresses``), or a
            callable returning them (called at every read, so replicas added later are seen).
        guard (MTPDesyncGuard | None): judges each step; None = metrics only.
        speculation (bool): MTP rollout is on; when False nothing is read and no metric is added.
        exclude_validation (bool): :meth:`pause`/:meth:`resume` drop the traffic in between.
        read_counters: ``addresses -> snapshot``; default :func:`~verl_mtp_plugin.rollout.monitor.spec_metrics.scrape_spec_counters`
            (HTTP ``/metrics``). In-process engines can pass
            ``lambda _: counts_from_vllm_metrics(llm.get_metrics())``.
        depths: the distinct ``k`` vLLM drafts with when it picks ``k`` by batch size
            (:func:`verl_mtp_plugin.verl_config.speculation_depths`); the per-position rates are normalized by the
            verify steps that drafted each position (:func:`~verl_mtp_plugin.rollout.monitor.spec_metrics.per_position_rates`).
            None: a fixed ``k``.

    Attributes:
        pending_error (MTPDesyncError | None): set by :meth:`step_metrics` with ``raise_now=False``.
    """

    def __init__(
        self,
        addresses: Iterable[str] | Callable[[], Iterable[str]],
        guard: MTPDesyncGuard | None = None,
        *,
        speculation: bool = True,
        exclude_validation: bool = True,
        read_counters: Callable[[list[str]], Snapshot] | None = None,
        depths: Iterable[int] | None = None,
    ):
        self._addresses = addresses
        self.guard = guard
        self.speculation = bool(speculation)
        self.exclude_validation = bool(exclude_validation)
        self._read = read_counters or scrape_spec_counters
        self.depths = tuple(depths) if depths is not None else None
        self._tracker = SpecDecodeCounterTracker()
        self._pending = SpecDecodeCounts()
        self._pending_reset = False
        self._paused = False
        self._closed = False
        self.pending_error: MTPDesyncError | None = None

    # ---- reading -----------------------------------------------------------------------------------
    def addresses(self) -> list[str]:
        src = self._addresses() if callable(self._addresses) else self._addresses
        return [str(a) for a in (src or [])]

    def _snapshot(self) -> Snapshot:
        return self._read(self.addresses())

    def _accumulate(self) -> None:
        step = self._tracker.update(self._snapshot())
        self._pending = self._pending + step.counts
        self._pending_reset = self._pending_reset or step.reset

    # ---- the trainer's hooks ------------------------------------------------------------------------
    def begin(self) -> None:
        """Baseline before the first training rollout (earlier traffic is not counted)."""
        if not self.speculation:
            return
        self._tracker.set_baseline(self._snapshot())
        self._pending, self._pending_reset, self._paused = SpecDecodeCounts(), False, False
        self._closed = False

    def close_window(self) -> None:
        """End the step's window now: what was generated so far belongs to the step; what is generated from here
        on counts toward the next step (for trainers that count validation, ``exclude_validation=False``)."""
        if not self.speculation or self._paused:
            return
        self._accumulate()
        self._closed = True

    def pause(self) -> None:
        """Close the training window (before validation generates)."""
        if not self.speculation or not self.exclude_validation or self._paused:
            return
        if not self._closed:
            self._accumulate()
        self._paused = True

    def resume(self) -> None:
        """Reopen it (after validation): what was generated while paused is dropped."""
        if not self.speculation or not self.exclude_validation or not self._paused:
            return
        self._tracker.set_baseline(self._snapshot())
        self._paused = False

    def step_metrics(self, metrics: MutableMapping[str, Any], step: Any = None, *, raise_now: bool = True) -> dict:
        """Add the step's ``rollout/spec_*`` and ``mtp_guard/*`` metrics to ``metrics`` (in place).

        Args:
            metrics: the trainer's metric dict for the step (verl's, with ``actor/mtp_*`` estimates).
            step: the training step, for the guard's messages.
            raise_now (bool): with the guard's ``action=fail``, raise :class:`MTPDesyncError` here;
                otherwise add the step's metrics, keep the error in :attr:`pending_error` and return.

        Returns:
            dict: the entries added.
        """
        if not self.speculation:
            return {}
        if not self._paused and not self._closed:
            self._accumulate()
        self._closed = False  # the tracker's baseline is where the window closed: the next window starts there
        counts, reset = self._pending, self._pending_reset
        self._pending, self._pending_reset = SpecDecodeCounts(), False
        if self._paused:  # step_metrics without resume(): the next window starts now
            self._tracker.set_baseline(self._snapshot())
            self._paused = False
        added = merge_spec_metrics(metrics, spec_metrics_from_counts(counts, reset=reset, depths=self.depths))
        if self.guard is not None:
            try:
                guard_metrics = self.guard.observe(metrics, step)
            except MTPDesyncError as err:
                metrics.update(err.metrics)
                added.update(err.metrics)
                if raise_now:
                    raise
                self.pending_error = err
                return added
            metrics.update(guard_metrics)
            added.update(guard_metrics)
        return added

    def raise_pending(self) -> None:
        """Raise the error :meth:`step_metrics` kept (``raise_now=False``), once."""
        err, self.pending_error = self.pending_error, None
        if err is not None:
            raise err
