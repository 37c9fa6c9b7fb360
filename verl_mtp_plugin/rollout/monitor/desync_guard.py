"""Drafter-desync guard: tell the user at once when vLLM's MTP drafter has fallen out of sync.

The most reported MTP-in-RL failure is a drafter that silently stops matching the policy: trained MTP
weights never reach vLLM's drafter, a sleep at level 2 discards them, a refit drops names, and
acceptance collapses to ~0 with no error. :class:`MTPDesyncGuard` watches, once per training step,
the rollout acceptance vLLM measured (:mod:`verl_mtp_plugin.rollout.monitor.spec_metrics`: ``rollout/spec_accept_rate``,
``rollout/spec_accept_rate_pos_0``, ``rollout/spec_accept_length``) next to the trainer's estimate for
the same policy version (:mod:`verl_mtp_plugin.acceptance`, logged by the engine as
``actor/mtp_expected_accept_rate`` / ``actor/mtp_argmax_draft_accept_rate``), and

* **desync, ratio rule**: measured < ``threshold`` x expected for ``patience`` consecutive steps
  (defaults 0.5 and 3); only while the estimate itself is above ``zero_rate`` (a useless MTP head is
  not a desync);
* **desync, zero rule**: measured acceptance <= ``zero_rate`` (default 0.01) for ``zero_patience``
  consecutive steps (default 2) while MTP rollout is on; this also covers ``frozen`` mode, where the
  trainer never runs the MTP forward and there is no estimate;

warns (:class:`MTPDesyncWarning` through :mod:`warnings` with the full text, plus a one-line log
record on this module's logger) or, with ``action="fail"``, raises :class:`MTPDesyncError`. Both rules
feed one incident: it is reported on the step it starts and again every ``patience`` steps while it
lasts; the per-step metrics ``mtp_guard/desync`` (0/1), ``mtp_guard/low_accept_streak``,
``mtp_guard/zero_accept_streak``, ``mtp_guard/accept_ratio``, ``mtp_guard/est_speedup`` show it on
every step. The message lists the measured and expected numbers
and the likely causes with the config keys involved. It also warns (never raises) when speculation is
**slower than no speculation**: a verify step with ``k`` drafts costs ``c_k`` plain decode steps and yields
``L`` = ``rollout/spec_accept_length`` tokens, so

    speedup ~= L / c_k(batch)          (break-even accepted length: L = c_k)

(``mtp_guard/est_speedup``, ``mtp_guard/breakeven_accept_length``, ``mtp_guard/verify_cost`` = the ``c_k`` used).
The message shows the numbers and, from the measured per-position rates, the speedup each smaller ``k`` would give
(``L_k' = 1 + sum_{i<k'} rate_pos_i``, over ``c_k'`` at the same batch).

**Verify-step cost** ``c_k`` (:func:`verify_step_cost`): a table of rows ``(batch, [c_1, c_2, ...])``. Between two
rows ``c_k`` is interpolated **linearly in the batch size**; below the first row / above the last the nearest row
holds (no extrapolation in batch). In ``k`` the table is interpolated linearly from ``c_0 = 1`` (a fractional ``k``
is the step's mean drafts with ``k`` chosen by batch size) and extended past its last ``k`` by its last step
``c_K - c_{K-1}``. The default table (:data:`DEFAULT_VERIFY_COST`, one per drafting method) is **measured**: one
NVIDIA H200, vLLM 0.26 on the V2 model runner with CUDA graphs, the Nemotron 3 Lightning 30B-A3B shape
(``benchmarks/RESULTS.md``, "Step cost by size", table "c_k for k = 1, 2, 3 x greedy / probabilistic x 64 / 256
sequences", made by ``benchmarks/speculation.py step-cost --shapes nano30b --ks 0,1,2,3 --batches 64,256
--rounds 2``):

    sequences   greedy c_1 / c_2 / c_3     probabilistic c_1 / c_2 / c_3
    64          1.184 / 1.325 / 1.457      1.183 / 1.346 / 1.467
    256         1.284 / 1.639 / 2.543      1.290 / 1.662 / 2.566

Other models and machines cost differently (a 31-layer slice of Super's layers at 64 sequences: ~0.28 of a plain
step per draft, i.e. ``c_k ~= 1 + 0.28 k``): set ``verify_cost`` from your own measurement. The **batch** is the
running batch of one vLLM engine: :func:`guard_from_verl_config` takes ``min(max_num_seqs, data.train_batch_size x
rollout.n / engines)`` with ``engines = trainer.n_gpus_per_node x trainer.nnodes / (rollout tensor x pipeline
parallel size)`` (one engine per data-parallel rank; verl's colocated layout; the rollout's own GPUs with
standalone rollout servers, :func:`engine_batch_size`). That is the batch a rollout starts
with; its tail runs fewer sequences, so at large batches ``c_k`` is an upper estimate there. Without a verl config
(a guard built directly with ``batch_size=None``) the 64-sequence row is used.

``verify_cost`` in the guard block overrides the table: a list ``[c_1, c_2, ...]`` (every batch size) or rows
``[[batch, [c_1, c_2, ...]], ...]`` (batches increasing, rows of one length); every ``c_k`` a finite number ``>= 1``
and not decreasing in ``k``, else refused at start-up naming the key. The older ``draft_cost`` (``c``, cost of one
draft relative to a target step) still works: set, it makes ``c_k = 1 + k c`` at every batch (the earlier
``speedup ~= L / (1 + k c)``); setting both ``draft_cost`` and ``verify_cost`` is refused naming both keys.

**Which estimate is compared.** vLLM 0.31 drafts greedily by default
(``speculative_config.draft_sample_method="greedy"``): a draft is accepted with probability
``p_main[argmax q]``, the probe's ``mtp_argmax_draft_accept_rate``, which at high entropy is far below
the speculative-sampling overlap ``mtp_expected_accept_rate`` (uniform p = q over 10 tokens: overlap
1.0, greedy draft 0.1). ``expected_key=None`` (default) therefore compares with
``actor/mtp_argmax_draft_accept_rate`` for greedy drafting when the metrics have it, and with
``actor/mtp_expected_accept_rate`` otherwise, each in its drafted form where the metrics have it
(``actor/mtp_drafted_argmax_draft_accept_rate``, ``actor/mtp_drafted_expected_accept_rate``: the rate over the
positions vLLM drafts at, which the means over positions overstate where hard positions cluster). The estimate is
the depth-1 rate, compared with ``rollout/spec_accept_rate_pos_0`` (first draft position); without per-position
data it is turned into the all-position rate ``(E(alpha, k) - 1) / k`` first.

**Drafting-method advice.** The trainer's two estimates also say which of vLLM's drafting methods accepts
more for this policy: greedy drafting accepts ``p[argmax q]`` (``actor/mtp_argmax_draft_accept_rate``),
probabilistic drafting (``draft_sample_method: probabilistic``) the overlap ``sum min(p, q)``
(``actor/mtp_expected_accept_rate``). When the other method's estimate exceeds the configured one's by at
least ``draft_method_margin`` for ``patience`` consecutive steps the guard warns
(:class:`MTPDraftMethodWarning`, never raises; not while a desync is reported) naming
``actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method``; the per-step metric
``mtp_guard/draft_method_gain`` is that difference. A high-entropy policy is where greedy drafting loses: on
the H200 a 2.2 B policy at 2.0 nats accepted 0.25 of greedy drafts where the overlap was 0.80, and on CPU
switching to probabilistic drafting took first-draft acceptance from 0.20 to 0.67 as the overlap (0.60)
predicted (``benchmarks/RESULTS.md``, "Step cost by size"). Probabilistic drafting keeps the draft
probabilities (more device memory).

**Parameter-count draft cost** ``c = 0.064`` (:data:`DEFAULT_DRAFT_COST`, Nemotron 3 Super, per-token active
parameters, memory-bound decode; no longer the guard's default): the MTP block ``*E`` (``eh_proj`` 8192x4096 = 33.6M,
attention 35.7M, MoE with 22 of 512 latent experts + shared expert + router 175.6M) plus the drafter's LM head
(131072x4096 = 536.9M) is 0.78B against the target's 12.23B (40 Mamba x 109.6M + 40 MoE x 175.6M + 8 attention x
35.7M + LM head): 0.78 / 12.23 = 0.064. Measured on the H200 a draft costs more than this count says (0.18 of a plain
decode step at 64 sequences, 0.33 at 256 at the 30B-A3B shape; the (k+1)-token verify stops being bound by reading
weights), which is why the guard now uses the measured table above.

Config block (top-level plugin namespace; verl's ``RolloutConfig`` rejects unknown keys, so the block
cannot live under ``actor_rollout_ref.rollout``)::

    verl_mtp_plugin:
      mtp_guard:
        threshold: 0.5        # ratio rule: measured < threshold * expected
        patience: 3           # ... for this many consecutive steps (also: slow-speculation rule)
        zero_patience: 2      # zero rule: measured <= zero_rate for this many consecutive steps
        zero_rate: 0.01
        action: warn          # warn | fail | off
        verify_cost: null     # null = measured H200 30B-A3B table; [c1, c2, ...] or [[batch, [c1, c2, ...]], ...]
        draft_cost: null      # legacy: c_k = 1 + k * draft_cost (not with verify_cost)
        min_speedup: 1.0      # slow-speculation rule: warn below this estimated speedup
        min_drafts: 100       # steps with fewer verify steps are not judged
        expected_key: null    # null = auto (see above)
        draft_method_margin: 0.15  # drafting-method advice (null = off)

On the command line the block needs Hydra's ``+``: ``+verl_mtp_plugin.mtp_guard.action=fail``.
The guard's rules are here; the text of its messages (what a user reads when it fires) is in
:mod:`verl_mtp_plugin.rollout.monitor.desync_messages`. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

from verl_mtp_plugin.config_keys import as_bool as _truthy
from verl_mtp_plugin.config_keys import get_key as _get
from verl_mtp_plugin.config_keys import ROLLOUT as _RO
from verl_mtp_plugin.config_keys import (
    ARGMAX_DRAFT_METRIC,
    DRAFT_METHOD_ESTIMATE_METRIC,
    DRAFTED_ARGMAX_METRIC,
    DRAFTED_EXPECTED_METRIC,
    EXPECTED_METRIC,
    GUARD_CONFIG_PATH,
)
from verl_mtp_plugin.policy import MTPConfigError
from verl_mtp_plugin.rollout.monitor.desync_messages import (
    desync_message,
    draft_method_message,
    missing_message,
    slow_message,
)
from verl_mtp_plugin.rollout.monitor.spec_metrics import (
    ACCEPT_LENGTH_KEY,
    ACCEPT_RATE_KEY,
    COUNTER_RESET_KEY,
    MEAN_DRAFT_TOKENS_KEY,
    NUM_DRAFTS_KEY,
    position_rates_from_metrics,
    scalar_metric,
)
from verl_mtp_plugin.spec_schedule import depth_batches, depth_shares

__all__ = [
    "ACTIONS",
    "ARGMAX_DRAFT_METRIC",
    "DEFAULT_DRAFT_COST",
    "DEFAULT_VERIFY_BATCH",
    "DEFAULT_VERIFY_COST",
    "EXPECTED_METRIC",
    "GUARD_CONFIG_PATH",
    "MTPDesyncError",
    "MTPDesyncGuard",
    "MTPDesyncWarning",
    "MTPDraftMethodWarning",
    "MTPGuardConfig",
    "MTPSlowSpeculationWarning",
    "MTPSpecStatsMissingWarning",
    "breakeven_accept_length",
    "expected_all_position_rate",
    "engine_batch_size",
    "guard_from_verl_config",
    "speedup_from_accept_length",
    "verify_cost_errors",
    "verify_cost_table",
    "verify_step_cost",
]

logger = logging.getLogger(__name__)

#: Allowed ``action`` values.
ACTIONS = ("warn", "fail", "off")
#: Draft cost relative to one target decode step for Nemotron 3 Super's MTP block by parameter count (module
#: docstring); what ``draft_cost`` meant by default before the measured table. Not the guard's default any more.
DEFAULT_DRAFT_COST = 0.064
#: Measured verify-step cost ``c_k`` (decode step with ``k`` MTP drafts / plain decode step) by drafting method, as
#: rows ``(sequences, (c_1, c_2, c_3))``: one H200, vLLM 0.26 V2 model runner, CUDA graphs, Nemotron 3
#: Lightning 30B-A3B shape (``benchmarks/RESULTS.md``, "Step cost by size", the mirrored-rounds c_k table).
DEFAULT_VERIFY_COST: dict[str, tuple[tuple[int, tuple[float, ...]], ...]] = {
    "greedy": ((64, (1.184, 1.325, 1.457)), (256, (1.284, 1.639, 2.543))),
    "probabilistic": ((64, (1.183, 1.346, 1.467)), (256, (1.290, 1.662, 2.566))),
}
#: Batch (sequences per vLLM engine) the guard assumes when it is not told one: the table's 64-sequence row.
DEFAULT_VERIFY_BATCH = 64

CostTable = tuple[tuple[int, tuple[float, ...]], ...]

_GUARD_PREFIX = "mtp_guard/"


class MTPDesyncError(RuntimeError):
    """Raised by the guard with ``action="fail"``; the message names the likely causes and keys.

    Attributes:
        metrics (dict[str, float]): the ``mtp_guard/*`` metrics of the step that raised (so a trainer
            can still log the step before stopping).
    """

    def __init__(self, message: str, metrics: Mapping[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})


class MTPDesyncWarning(UserWarning):
    """Measured rollout acceptance far below the trainer's estimate, or ~0, for several steps."""


class MTPSlowSpeculationWarning(UserWarning):
    """Speculation is estimated to make the rollout slower than no speculation."""


class MTPDraftMethodWarning(UserWarning):
    """The trainer estimates that vLLM's other drafting method would accept clearly more drafts."""


class MTPSpecStatsMissingWarning(UserWarning):
    """MTP rollout is on but no speculative-decoding statistics reached the step metrics."""


# --------------------------------------------------------------------------------------------------
# arithmetic


def speedup_from_accept_length(accept_length: float, k: int, draft_cost: float) -> float:
    """Estimated decode speedup ``L / (1 + k * c)`` of speculation over plain decoding.

    Args:
        accept_length (float): measured tokens per verify step ``L`` (bonus token included).
        k (float): draft tokens per verify step (``num_speculative_tokens``; with ``k`` chosen by batch size the
            step's mean, ``rollout/spec_mean_draft_tokens``).
        draft_cost (float): cost ``c`` of one draft step relative to one target step.

    Returns:
        float: the speedup (``< 1`` means speculation slows decoding down).
    """
    return float(accept_length) / (1.0 + float(k) * float(draft_cost))


def breakeven_accept_length(k: float, draft_cost: float) -> float:
    """Accepted length at which speculation with ``k`` drafts breaks even: ``1 + k * c``."""
    return 1.0 + float(k) * float(draft_cost)


def verify_cost_errors(raw: Any, key: str) -> list[str]:
    """Problems of a ``verify_cost`` value (``[c_1, ...]`` or ``[[batch, [c_1, ...]], ...]``), each naming ``key``."""
    if raw is None:
        return []
    form = "a list [c_1, c_2, ...] or rows [[batch, [c_1, c_2, ...]], ...]"
    if not isinstance(raw, (list, tuple)) or not raw:
        return [f"{key}={raw!r}: must be {form}"]
    flat = all(not isinstance(v, (list, tuple)) for v in raw)
    if not flat and not all(isinstance(v, (list, tuple)) for v in raw):
        return [f"{key}={raw!r}: must be {form}, not a mix of numbers and rows"]
    errs: list[str] = []
    last_batch, width = 0, None
    for i, row in enumerate([(None, raw)] if flat else raw):
        where = key if flat else f"{key}[{i}]"
        if not flat:
            if len(row) != 2 or not isinstance(row[1], (list, tuple)):
                errs.append(f"{where}={list(row)!r}: a row is [batch, [c_1, c_2, ...]]")
                continue
            if not (_is_int(row[0]) and row[0] > last_batch):
                errs.append(f"{where}: batch {row[0]!r} must be an integer >= 1, larger than the previous row's")
            else:
                last_batch = row[0]
        costs = list(row[1])
        if not costs or not all(_is_real(c) for c in costs):
            errs.append(f"{where}: costs {costs!r} must be a non-empty list of finite numbers (c_1, c_2, ...)")
            continue
        if min(costs) < 1:
            errs.append(f"{where}: costs {costs!r}: c_k < 1 (a verify step costs at least a plain decode step)")
        if any(b < a for a, b in zip(costs, costs[1:])):
            errs.append(f"{where}: costs {costs!r} decrease with k (more drafts cannot make a verify step cheaper)")
        if width is not None and len(costs) != width:
            errs.append(f"{where}: {len(costs)} costs where an earlier row has {width} (one per k, every row)")
        width = len(costs) if width is None else width
    return errs


def verify_cost_table(raw: Any) -> CostTable:
    """A validated ``verify_cost`` value as rows ``((batch, (c_1, ...)), ...)``; a flat list is one row for every batch."""
    if all(not isinstance(v, (list, tuple)) for v in raw):
        return ((1, tuple(float(c) for c in raw)),)
    return tuple((int(b), tuple(float(c) for c in costs)) for b, costs in raw)


def _cost_at_k(costs: tuple[float, ...], k: float) -> float:
    """``c_k`` from ``(c_1, ..., c_K)``: linear between integer ``k`` from ``c_0 = 1``, past ``K`` by the last step."""
    full = (1.0,) + tuple(costs)
    top = len(full) - 1
    if k >= top:
        return full[top] + (k - top) * (full[top] - full[top - 1])
    lo = int(math.floor(k))
    return full[lo] + (k - lo) * (full[lo + 1] - full[lo])


def verify_step_cost(table: CostTable, k: float, batch: float | None = None) -> float:
    """Verify-step cost ``c_k`` (plain decode steps) of ``k`` drafts at ``batch`` sequences (module docstring).

    Args:
        table: rows ``((batch, (c_1, ..., c_K)), ...)``, batches increasing.
        k (float): drafts per verify step (fractional: a mean); ``0`` gives 1.
        batch (float | None): running sequences per engine; None = :data:`DEFAULT_VERIFY_BATCH`. Linear
            interpolation between rows, the nearest row outside them.

    Returns:
        float: ``c_k``.
    """
    k = max(float(k), 0.0)
    n = float(DEFAULT_VERIFY_BATCH if batch is None else batch)
    if n <= table[0][0]:
        return _cost_at_k(table[0][1], k)
    for (b0, c0), (b1, c1) in zip(table, table[1:]):
        if n <= b1:
            w = (n - b0) / (b1 - b0)
            return (1 - w) * _cost_at_k(c0, k) + w * _cost_at_k(c1, k)
    return _cost_at_k(table[-1][1], k)


def expected_all_position_rate(alpha: float, k: int) -> float:
    """All-position acceptance rate (``accepted / draft tokens``) expected from a per-draft rate ``alpha``
    with ``k`` drafts: ``(alpha + ... + alpha^k) / k = (E(alpha, k) - 1) / k`` (``alpha`` for ``k = 1``)."""
    k = max(int(k), 1)
    return sum(float(alpha) ** i for i in range(1, k + 1)) / k


# --------------------------------------------------------------------------------------------------
# config


def _due(streak: int, patience: int) -> bool:
    """A repeating report is due: at ``patience`` consecutive steps and every ``patience`` steps after."""
    return streak >= patience and (streak - patience) % patience == 0


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _config_errors(values: Mapping[str, Any], path: str) -> list[str]:
    errs: list[str] = []

    def bad(name: str, rule: str) -> None:
        errs.append(f"{path}.{name}={values[name]!r}: {rule}")

    if "threshold" in values and not (_is_real(values["threshold"]) and 0 < values["threshold"] <= 1):
        bad("threshold", "must be a number in (0, 1] (warn when measured < threshold x expected)")
    for name in ("patience", "zero_patience"):
        if name in values and not (_is_int(values[name]) and values[name] >= 1):
            bad(name, "must be an integer >= 1 (consecutive steps)")
    if "zero_rate" in values and not (_is_real(values["zero_rate"]) and 0 <= values["zero_rate"] < 1):
        bad("zero_rate", "must be a number in [0, 1)")
    if "action" in values and values["action"] not in ACTIONS:
        bad("action", f"allowed values: {list(ACTIONS)}")
    if values.get("draft_cost") is not None and not (_is_real(values["draft_cost"]) and values["draft_cost"] >= 0):
        bad("draft_cost", "must be a finite number >= 0 (draft step cost relative to a target step) or null")
    errs += verify_cost_errors(values.get("verify_cost"), f"{path}.verify_cost")
    if values.get("draft_cost") is not None and values.get("verify_cost") is not None:
        errs.append(
            f"{path}.draft_cost and {path}.verify_cost are both set: verify_cost is the verify-step cost c_k by k (and "
            f"batch), draft_cost the older c_k = 1 + k * draft_cost; keep one"
        )
    if "min_speedup" in values and not (_is_real(values["min_speedup"]) and values["min_speedup"] > 0):
        bad("min_speedup", "must be a finite number > 0")
    if "min_drafts" in values and not (_is_int(values["min_drafts"]) and values["min_drafts"] >= 0):
        bad("min_drafts", "must be an integer >= 0")
    if "expected_key" in values and values["expected_key"] is not None and not (
        isinstance(values["expected_key"], str) and values["expected_key"]
    ):
        bad("expected_key", "must be a metric name (e.g. actor/mtp_expected_accept_rate) or null for auto")
    margin = values.get("draft_method_margin")
    if margin is not None and not (_is_real(margin) and 0 < margin <= 1):
        bad("draft_method_margin", "must be a number in (0, 1] (estimated acceptance gained) or null for off")
    return errs


@dataclasses.dataclass(frozen=True)
class MTPGuardConfig:
    """Settings of :class:`MTPDesyncGuard` (block ``verl_mtp_plugin.mtp_guard``).

    Attributes:
        threshold (float): ratio rule: measured acceptance < ``threshold`` x expected. Default 0.5.
        patience (int): consecutive steps for the ratio rule and the slow-speculation rule. Default 3.
        zero_patience (int): consecutive steps for the zero rule. Default 2.
        zero_rate (float): acceptance at or below this counts as zero. Default 0.01.
        action (str): ``warn`` (default), ``fail`` (raise :class:`MTPDesyncError` on desync; the
            slow-speculation rule only warns) or ``off``.
        verify_cost (list | None): verify-step cost ``c_k`` in ``speedup ~= L / c_k``: ``[c_1, c_2, ...]`` or rows
            ``[[batch, [c_1, ...]], ...]``. None (default): the measured H200 30B-A3B table for the drafting method
            (:data:`DEFAULT_VERIFY_COST`).
        draft_cost (float | None): legacy: ``c_k = 1 + k * draft_cost`` at every batch. None (default): unused.
            Not together with ``verify_cost``.
        min_speedup (float): slow-speculation rule: warn when the estimated speedup is below. Default 1.0.
        min_drafts (int): steps with fewer verify steps (``rollout/spec_num_drafts``) are not judged.
            Default 100.
        expected_key (str | None): metric holding the trainer's estimate; None = auto (module docstring).
        draft_method_margin (float | None): drafting-method advice: warn when the other drafting method's
            estimated first-draft acceptance exceeds the configured one's by at least this much for
            ``patience`` steps. Default 0.15; None = off.

    Raises:
        MTPConfigError: invalid values, all listed, each with its full key.
    """

    threshold: float = 0.5
    patience: int = 3
    zero_patience: int = 2
    zero_rate: float = 0.01
    action: str = "warn"
    verify_cost: Any = None
    draft_cost: float | None = None
    min_speedup: float = 1.0
    min_drafts: int = 100
    expected_key: str | None = None
    draft_method_margin: float | None = 0.15

    def __post_init__(self):
        errs = _config_errors(dataclasses.asdict(self), GUARD_CONFIG_PATH)
        if errs:
            raise MTPConfigError("invalid MTP desync guard config:\n  - " + "\n  - ".join(errs))
        if self.verify_cost is not None:  # one canonical (hashable) form
            object.__setattr__(self, "verify_cost", verify_cost_table(self.verify_cost))

    def cost_table(self, draft_sample_method: str = "greedy") -> tuple[CostTable, str]:
        """The ``c_k`` table in force and where it comes from (for messages)."""
        if self.verify_cost is not None:
            return self.verify_cost, f"{GUARD_CONFIG_PATH}.verify_cost"
        if self.draft_cost is not None:
            c = float(self.draft_cost)
            return ((1, tuple(1.0 + k * c for k in (1, 2))),), f"1 + k * {GUARD_CONFIG_PATH}.draft_cost ({c})"
        method = "probabilistic" if draft_sample_method == "probabilistic" else "greedy"
        return DEFAULT_VERIFY_COST[method], (
            f"the default, measured on an H200 at the 30B-A3B shape, {method} drafting; {GUARD_CONFIG_PATH}.verify_cost "
            "overrides it"
        )

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None, *, path: str = GUARD_CONFIG_PATH) -> "MTPGuardConfig":
        """Build from a config block (dict or omegaconf ``DictConfig``); missing keys keep their defaults.

        Args:
            block: ``{threshold, patience, zero_patience, zero_rate, action, verify_cost, draft_cost, min_speedup,
                min_drafts, expected_key, draft_method_margin}`` (any subset) or None.
            path (str): the block's key path, used in error messages.

        Raises:
            MTPConfigError: unknown keys and invalid values, all in one message naming ``path.<key>``.
        """
        values = dict(_plain(block) or {})
        allowed = [f.name for f in dataclasses.fields(cls)]
        errs = [
            f"{path}.{k}: unknown key; allowed keys: {allowed}" for k in values if k not in allowed
        ]
        if isinstance(values.get("action"), str):
            values["action"] = values["action"].strip().lower()
        errs += _config_errors({k: v for k, v in values.items() if k in allowed}, path)
        if errs:
            raise MTPConfigError("invalid MTP desync guard config:\n  - " + "\n  - ".join(errs))
        return cls(**values)

    @classmethod
    def from_verl_config(cls, config: Any) -> "MTPGuardConfig":
        """Read ``verl_mtp_plugin.mtp_guard`` from a composed verl trainer config (defaults when absent).

        Raises:
            MTPConfigError: invalid block, or a block placed under ``actor_rollout_ref.rollout.mtp_guard``
                (verl 0.9.1 builds ``RolloutConfig`` from that node and fails on the unknown key).
        """
        misplaced = _get(config, f"{_RO}.mtp_guard")
        if misplaced is not None:
            raise MTPConfigError(
                f"{_RO}.mtp_guard is not a verl key: verl instantiates RolloutConfig from {_RO} and fails with "
                f"\"unexpected keyword argument 'mtp_guard'\"; move the block to {GUARD_CONFIG_PATH} "
                f"(+{GUARD_CONFIG_PATH}.<key>=... on the command line)"
            )
        return cls.from_dict(_get(config, GUARD_CONFIG_PATH))


# --------------------------------------------------------------------------------------------------
# the guard


class MTPDesyncGuard:
    """Per-step check of rollout acceptance against the trainer's estimate (see the module docstring).

    Args:
        config (MTPGuardConfig | Mapping | None): settings (a mapping goes through
            :meth:`MTPGuardConfig.from_dict`); None = defaults.
        num_speculative_tokens (int | None): ``k``; used when the metrics carry no per-position rates.
        speculation (bool): MTP rollout is on; when False the guard does nothing.
        draft_sample_method (str): vLLM ``speculative_config.draft_sample_method`` (``greedy``, vLLM's
            default, or ``probabilistic``); selects the estimate when ``expected_key`` is None.
        variable_k (bool): vLLM picks ``k`` by batch size (``num_speculative_tokens_per_batch_size``): the speed-up
            estimate costs a verify step at the step's mean drafts ``rollout/spec_mean_draft_tokens`` instead of
            ``k`` (``num_speculative_tokens``, the largest).
        batch_size (int | None): running sequences per vLLM engine, for the verify-step cost ``c_k`` (module
            docstring); None: the cost table's 64-sequence row.
        depth_batches (Mapping[int, int] | None): with a schedule, each ``k`` it drafts with and the batch its
            verify steps run at (:func:`verl_mtp_plugin.spec_schedule.depth_batches`: the large-``k`` steps are
            the small-batch ones); the cost is then ``sum_k share_k * c(k, batch_k)``, the shares from the step's
            mean drafts (:func:`~verl_mtp_plugin.spec_schedule.depth_shares`; with three or more ``k``, ``c`` at
            the mean drafts and the batch of the ``k`` nearest it). Implies ``variable_k``.

    Attributes:
        last_message (str | None): the last warning/error text.
    """

    def __init__(
        self,
        config: "MTPGuardConfig | Mapping[str, Any] | None" = None,
        *,
        num_speculative_tokens: int | None = None,
        speculation: bool = True,
        draft_sample_method: str = "greedy",
        variable_k: bool = False,
        batch_size: int | None = None,
        depth_batches: Mapping[int, int] | None = None,
    ):
        if config is None:
            config = MTPGuardConfig()
        elif not isinstance(config, MTPGuardConfig):
            config = MTPGuardConfig.from_dict(config)
        if num_speculative_tokens is not None and not (_is_int(num_speculative_tokens) and num_speculative_tokens >= 1):
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        self.speculation = bool(speculation)
        self.draft_sample_method = str(draft_sample_method or "greedy")
        if batch_size is not None and not (_is_int(batch_size) and batch_size >= 1):
            raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
        self.batch_size = batch_size
        if depth_batches is not None and not (depth_batches and all(
                _is_int(d) and d >= 1 and _is_int(b) and b >= 1 for d, b in depth_batches.items())):
            raise ValueError(f"depth_batches must map drafts k >= 1 to batches >= 1, got {depth_batches!r}")
        self.depth_batches = dict(depth_batches) if depth_batches else None
        self.variable_k = bool(variable_k) or self.depth_batches is not None
        self.cost_table, self.cost_source = config.cost_table(self.draft_sample_method)
        self.last_message: str | None = None
        self.reset()

    def reset(self) -> None:
        """Forget all streaks (e.g. after a deliberate drafter change)."""
        self.low_streak = 0
        self.zero_streak = 0
        self.slow_streak = 0
        self.method_streak = 0
        self.desync_streak = 0
        self.missing_streak = 0
        self._warned_missing = False
        self._steps = 0
        self._reset_steps: list[Any] = []

    # ---- helpers -----------------------------------------------------------------------------------
    def _expected(self, metrics: Mapping[str, Any]) -> tuple[float | None, str | None]:
        if self.config.expected_key is not None:
            return scalar_metric(metrics, self.config.expected_key), self.config.expected_key
        keys = [DRAFTED_EXPECTED_METRIC, EXPECTED_METRIC]
        if self.draft_sample_method == "greedy":
            keys = [DRAFTED_ARGMAX_METRIC, ARGMAX_DRAFT_METRIC, EXPECTED_METRIC]
        for key in keys:
            v = scalar_metric(metrics, key)
            if v is not None:
                return v, key
        return None, None

    def _act(
        self, message: str, category: type[Warning], *, may_fail: bool, metrics: Mapping[str, float] | None = None
    ) -> None:
        # Full text in the warning / exception, the headline in the log (no double-printed essay).
        self.last_message = message
        headline = message.splitlines()[0]
        if may_fail and self.config.action == "fail":
            logger.error("%s (raising MTPDesyncError)", headline)
            raise MTPDesyncError(message, metrics)
        logger.warning("%s (details in %s)", headline, category.__name__)
        warnings.warn(message, category, stacklevel=3)

    # ---- the step ----------------------------------------------------------------------------------------
    def observe(self, metrics: Mapping[str, Any], step: Any = None) -> dict[str, float]:
        """Judge one training step.

        Args:
            metrics: the step's metric dict (verl's, with :mod:`verl_mtp_plugin.rollout.monitor.spec_metrics` merged in):
                ``rollout/spec_accept_rate``, ``rollout/spec_accept_length``,
                ``rollout/spec_accept_rate_pos_{k}``, ``rollout/spec_num_drafts``,
                ``rollout/spec_counter_reset`` and the trainer estimate (``actor/mtp_*_accept_rate``).
            step: the training step (for messages); default: the number of calls so far.

        Returns:
            dict[str, float]: ``mtp_guard/*`` metrics for the step (empty when the guard is off or MTP
            rollout is off).

        Raises:
            MTPDesyncError: ``action="fail"`` and a desync rule fired.
        """
        cfg = self.config
        if cfg.action == "off" or not self.speculation:
            return {}
        self._steps += 1
        step = self._steps if step is None else step

        rate = scalar_metric(metrics, ACCEPT_RATE_KEY)
        length = scalar_metric(metrics, ACCEPT_LENGTH_KEY)
        pos = position_rates_from_metrics(metrics)
        drafts = scalar_metric(metrics, NUM_DRAFTS_KEY)
        if (scalar_metric(metrics, COUNTER_RESET_KEY) or 0.0) > 0:
            self._reset_steps.append(step)
        out: dict[str, float] = {}

        if rate is None or (drafts is not None and drafts < max(cfg.min_drafts, 1)):
            self.missing_streak += 1
            if self.missing_streak >= cfg.patience and not self._warned_missing:
                self._warned_missing = True
                self._act(self._missing_message(step, drafts), MTPSpecStatsMissingWarning, may_fail=False)
            out[_GUARD_PREFIX + "low_accept_streak"] = float(self.low_streak)
            out[_GUARD_PREFIX + "zero_accept_streak"] = float(self.zero_streak)
            return out
        self.missing_streak = 0

        k = len(pos) or self.num_speculative_tokens or 1
        mean_k = scalar_metric(metrics, MEAN_DRAFT_TOKENS_KEY)
        cost_k: float = k
        c_k: float | None = None
        if self.variable_k and mean_k is not None and mean_k > 0:
            # k chosen by batch size: a verify step drafts num_draft_tokens / num_drafts on average, each k at the
            # batches its range covers, and the per-position rates stop where vLLM's totals cannot say how many
            # steps drafted a position
            cost_k = mean_k
            k = max(self.depth_batches) if self.depth_batches else (self.num_speculative_tokens or k)
            c_k = self.schedule_cost(mean_k)
        alpha, key = self._expected(metrics)
        if pos:
            measured, expected, basis = pos[0], alpha, "first draft position (rollout/spec_accept_rate_pos_0)"
        else:
            measured = rate
            expected = None if alpha is None else expected_all_position_rate(alpha, k)
            basis = f"all {k} draft positions (rollout/spec_accept_rate; estimate mapped to (E(alpha,k)-1)/k)"
        usable = expected is not None and expected > cfg.zero_rate

        # ratio rule
        if usable:
            self.low_streak = self.low_streak + 1 if measured < cfg.threshold * expected else 0
            out[_GUARD_PREFIX + "expected_accept_rate"] = float(expected)
            out[_GUARD_PREFIX + "accept_ratio"] = measured / expected
        # zero rule (not when the estimate itself says the head is useless)
        if rate <= cfg.zero_rate and (expected is None or usable):
            self.zero_streak += 1
        else:
            self.zero_streak = 0
        out[_GUARD_PREFIX + "measured_accept_rate"] = float(measured)

        # One incident, one report: the two rules share the episode; it is reported when it starts and
        # every `patience` steps while it lasts.
        low_holds = self.low_streak >= cfg.patience
        desync = low_holds or self.zero_streak >= cfg.zero_patience
        self.desync_streak = self.desync_streak + 1 if desync else 0
        fire = desync and (self.desync_streak - 1) % cfg.patience == 0
        out[_GUARD_PREFIX + "low_accept_streak"] = float(self.low_streak)
        out[_GUARD_PREFIX + "zero_accept_streak"] = float(self.zero_streak)
        out[_GUARD_PREFIX + "desync"] = 1.0 if desync else 0.0

        # slow-speculation rule
        slow_msg = None
        if length is not None:
            c_k = self.verify_cost(cost_k) if c_k is None else c_k
            speedup = length / c_k
            out[_GUARD_PREFIX + "est_speedup"] = speedup
            out[_GUARD_PREFIX + "breakeven_accept_length"] = c_k  # L at which L / c_k = 1
            out[_GUARD_PREFIX + "verify_cost"] = c_k
            self.slow_streak = self.slow_streak + 1 if speedup < cfg.min_speedup else 0
            if _due(self.slow_streak, cfg.patience) and not desync:  # a desync report already explains a slow rollout
                slow_msg = self._slow_message(step, length, cost_k, pos, speedup, c_k)

        method_msg = self._draft_method_step(metrics, step, measured, desync, out)

        if fire:
            self._act(
                self._desync_message(
                    step, rate=rate, length=length, pos=pos, drafts=drafts, measured=measured, expected=expected,
                    alpha=alpha, key=key, basis=basis, zero=not low_holds,
                ),
                MTPDesyncWarning,
                may_fail=True,
                metrics=out,
            )
        if slow_msg is not None:
            self._act(slow_msg, MTPSlowSpeculationWarning, may_fail=False)
        if method_msg is not None:
            self._act(method_msg, MTPDraftMethodWarning, may_fail=False)
        return out

    def _draft_method_step(self, metrics, step, measured: float, desync: bool, out: dict) -> str | None:
        """The drafting-method advice for one step (module docstring); the message when it is due."""
        margin = self.config.draft_method_margin
        est = {m: scalar_metric(metrics, key) for m, key in DRAFT_METHOD_ESTIMATE_METRIC.items()}
        if margin is None or None in est.values():
            self.method_streak = 0
            return None
        current, other = ("greedy", "probabilistic") if self.draft_sample_method == "greedy" else (
            "probabilistic", "greedy")
        gain = est[other] - est[current]
        out[_GUARD_PREFIX + "draft_method_gain"] = float(gain)
        self.method_streak = self.method_streak + 1 if gain >= margin else 0
        if not _due(self.method_streak, self.config.patience) or desync:
            return None
        return draft_method_message(
            self.config, step, current=current, other=other, estimates=est, measured=measured,
            streak=self.method_streak,
        )

    # ---- messages (text in :mod:`verl_mtp_plugin.rollout.monitor.desync_messages`) ----------------------------
    def _desync_message(self, step, *, rate, length, pos, drafts, measured, expected, alpha, key, basis, zero) -> str:
        return desync_message(
            self.config, step, rate=rate, length=length, pos=pos, drafts=drafts, measured=measured,
            expected=expected, alpha=alpha, key=key, basis=basis, zero=zero, low_streak=self.low_streak,
            zero_streak=self.zero_streak, reset_steps=self._reset_steps,
        )

    def verify_cost(self, k: float) -> float:
        """``c_k`` of ``k`` drafts at this guard's batch (:func:`verify_step_cost` on the table in force)."""
        return verify_step_cost(self.cost_table, k, self.batch_size)

    def schedule_cost(self, mean_drafts: float) -> float:
        """``c`` of a step whose verify steps drafted ``mean_drafts`` on average: with ``depth_batches`` each ``k``
        at its own batch, weighted by its share of the verify steps (class docstring); else :meth:`verify_cost`."""
        if not self.depth_batches:
            return self.verify_cost(mean_drafts)
        shares = depth_shares(mean_drafts, list(self.depth_batches))
        if shares is None:  # three or more k: the mean drafts at the batch of the k nearest them
            near = min(self.depth_batches, key=lambda d: (abs(d - mean_drafts), -d))
            return verify_step_cost(self.cost_table, mean_drafts, self.depth_batches[near])
        return sum(w * verify_step_cost(self.cost_table, d, self.depth_batches[d]) for d, w in shares.items())

    def _slow_message(self, step, length: float, k: float, pos: list[float], speedup: float, c_k: float) -> str:
        options = [(0, 1.0)] + [
            (kk, (1.0 + sum(pos[:kk])) / self.verify_cost(kk)) for kk in range(1, len(pos) + 1)
        ]
        return slow_message(
            self.config, step, length=length, k=k, speedup=speedup, verify_cost=c_k,
            cost_source=self.cost_source, batch=self.batch_size, options=options if pos else [],
            slow_streak=self.slow_streak,
        )

    def _missing_message(self, step, drafts) -> str:
        return missing_message(self.config, step, drafts=drafts, missing_streak=self.missing_streak)


# --------------------------------------------------------------------------------------------------
# verl config


def _plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl/hydra
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def engine_batch_size(config: Any) -> int:
    """Running sequences per vLLM engine at the start of a rollout: ``min(max_num_seqs, data.train_batch_size x
    rollout.n / engines)``, ``engines = trainer.n_gpus_per_node x trainer.nnodes / (rollout tensor x pipeline
    parallel size)`` (verl's colocated layout, one engine per data-parallel rank), with ``rollout.n_gpus_per_node x
    rollout.nnodes`` instead when ``rollout.nnodes > 0`` (standalone rollout servers; hybrid replicas serving too
    make the real batch smaller); ``max_num_seqs`` alone when a key is missing or not a positive integer (values
    are checked at start-up by the plugin's check)."""
    from verl_mtp_plugin import verl_config

    cap = verl_config.max_num_seqs(config)

    def pos_int(key: str, default: Any = None) -> int | None:
        v = _get(config, key, default)
        try:
            v = int(v)
        except (TypeError, ValueError):
            return None
        return v if v >= 1 else None

    standalone = pos_int(f"{_RO}.nnodes", 0) is not None  # separate async: rollout servers on their own GPUs
    where = _RO if standalone else "trainer"
    parts = [pos_int("data.train_batch_size"), pos_int(f"{where}.n_gpus_per_node")]
    parts += [pos_int(f"{_RO}.n", 1), pos_int(f"{where}.nnodes", 1)]
    parts += [pos_int(f"{_RO}.tensor_model_parallel_size", 1), pos_int(f"{_RO}.pipeline_model_parallel_size", 1)]
    if None in parts:
        return cap
    batch, gpus, n, nodes, tp, pp = parts
    engines = max((gpus * nodes) // (tp * pp), 1)
    return max(1, min(cap, math.ceil(batch * n / engines)))


def guard_from_verl_config(config: Any) -> MTPDesyncGuard:
    """A guard set up from a composed verl trainer config.

    Reads ``verl_mtp_plugin.mtp_guard`` (:meth:`MTPGuardConfig.from_verl_config`); speculation is on when
    ``actor_rollout_ref.model.mtp.enable`` and ``.enable_rollout`` are true (verl's condition) or
    ``actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config`` is set; ``k`` and the draft
    method come from the speculative config verl builds (``engine_kwargs`` win, as in verl's
    ``build_mtp_speculative_config``); the batch for the verify-step cost is :func:`engine_batch_size`. Logs a warning when speculation is on while
    ``actor_rollout_ref.rollout.disable_log_stats`` is true (verl's default): vLLM then keeps no counters.
    """
    from verl_mtp_plugin import verl_config

    cfg = MTPGuardConfig.from_verl_config(config)
    # the one reader: a drafting-method-only speculative_config does not switch speculation on
    spec = verl_config.speculative_config(config) or {}
    k = spec.get("num_speculative_tokens")
    speculation = verl_config.speculation_on(config)
    user_spec = verl_config.user_speculative_config(config) or {}
    schedule = verl_config.speculation_schedule(config) if speculation else None
    batch = engine_batch_size(config)
    if speculation and cfg.action != "off" and _truthy(_get(config, f"{_RO}.disable_log_stats", True)):
        logger.warning(
            "%s.disable_log_stats=true: vLLM keeps no speculative-decoding counters, so rollout acceptance "
            "metrics and the MTP desync guard get no data from them; set it to false",
            _RO,
        )
    return MTPDesyncGuard(
        cfg,
        num_speculative_tokens=int(k) if k is not None else None,
        speculation=speculation,
        draft_sample_method=str(user_spec.get("draft_sample_method") or "greedy"),
        batch_size=batch,
        depth_batches=depth_batches(schedule, verl_config.max_num_seqs(config), int(k or 1), batch) if schedule else None,
    )
