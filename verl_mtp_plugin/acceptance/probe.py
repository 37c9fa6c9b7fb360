"""The in-trainer acceptance probe: a forward hook on the MTP block and the estimate from what it captured.

:class:`AcceptanceProbe` is a public torch forward hook (no patching) that keeps the MTP hidden states
of one forward; :meth:`AcceptanceProbe.estimate` turns them and the main logits into the metrics of
:mod:`verl_mtp_plugin.acceptance.estimate` on a subsample of response positions, under ``no_grad``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_mtp_plugin.acceptance.estimate import (
    ACCEPT_LENGTH_KEY,
    ARGMAX_DRAFT_KEY,
    DEPTH_EXPECTED_KEY,
    DEPTH_GREEDY_KEY,
    DRAFTED_ARGMAX_KEY,
    DRAFTED_EXPECTED_KEY,
    DRAFTED_POSITIONS_KEY,
    DRAFTED_SUMS,
    ELIGIBLE_KEY,
    EXPECTED_KEY,
    GREEDY_KEY,
    POSITIONS_KEY,
    ACCEPT_LENGTH_KS,
    acceptance_positions,
    acceptance_stats,
    check_temperature,
    draft_schedule,
    expected_accept_length,
    group_size,
    response_runs,
    rows_at,
    select_positions,
)
from verl_mtp_plugin.control import model_has_mtp, unwrap_model
from verl_mtp_plugin.policy import MTPConfigError

__all__ = ["AcceptanceProbe", "DRAFTED_POSITIONS", "DraftedBudget", "MEAN_POSITIONS"]

#: The drafted estimate's budget: drafting positions of whole responses per forward, and the engine's per pass,
#: shared among the pass's micro-batches by their response tokens (:class:`DraftedBudget`), so the probed responses
#: spread over the whole batch, not the responses of one micro-batch. Cost: per depth, about this many rows of MTP and
#: of main logits per pass (at Super's widths ~2 x 16,384 x 4,096 x 131,072 x 2 FLOP = 35 TFLOP per depth, not
#: measured on a GPU) and the schedule's loop over each probed micro-batch's longest probed response on the host
DRAFTED_POSITIONS = 16384
#: Rows (positions) whose main and MTP logits are computed at once
DRAFTED_CHUNK = 256
#: The means over positions' budget per pass (``max_positions`` of :meth:`AcceptanceProbe.estimate`), shared among
#: the pass's micro-batches by their response tokens (:meth:`DraftedBudget.mean_positions`: at least one each)
MEAN_POSITIONS = 128


class DraftedBudget:
    """The acceptance estimate's budget of one pass, shared among its micro-batches in proportion to their response
    tokens. Drafted form: every micro-batch adds ``budget / pass tokens`` of its tokens to a credit and, once the
    credit covers the pass's average response (at most the budget), probes whole responses (evenly spaced, at least
    one) for about the credit, which the positions it used then pay off; so a pass probes about ``budget`` drafting
    positions (over by what the last probed responses exceed the credit) spread over its micro-batches whatever their
    response lengths, and every response when the pass has no more tokens than the budget. Means over positions:
    each micro-batch its share of :data:`MEAN_POSITIONS` (:meth:`mean_positions`).

    Args:
        pass_tokens (float): the pass's response tokens on this rank (verl's ``loss_mask``).
        budget (int): drafting positions per pass (default :data:`DRAFTED_POSITIONS`).
        pass_sequences (int | None): the pass's sequences on this rank; None: each micro-batch's own average
            response is the threshold.
    """

    def __init__(self, pass_tokens: float, budget: int = DRAFTED_POSITIONS, pass_sequences: int | None = None):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an int >= 1, got {budget!r}")
        self.budget = budget
        total = max(float(pass_tokens), 0.0)
        self.pass_tokens = total
        self.fraction = 1.0 if total <= budget else budget / total
        self.threshold = None if not pass_sequences else min(max(total / int(pass_sequences), 1.0), float(budget))
        self.credit = 0.0

    def take(self, tokens: float, sequences: int) -> int:
        """Before a micro-batch's forward: the drafting positions it may probe (``max_drafted_positions`` of
        :meth:`AcceptanceProbe.estimate`; 0: none) for its ``tokens`` response tokens in ``sequences`` sequences."""
        if self.fraction >= 1.0:
            return self.budget  # the whole pass fits: every response of every micro-batch
        self.credit += self.fraction * max(float(tokens), 0.0)
        threshold = self.threshold
        if threshold is None:
            threshold = min(max(max(float(tokens), 0.0) / max(int(sequences), 1), 1.0), float(self.budget))
        return max(1, int(self.credit)) if self.credit >= threshold * (1 - 1e-9) else 0

    def mean_positions(self, tokens: float) -> int:
        """The positions a micro-batch of ``tokens`` response tokens gives the means over positions: its share of
        :data:`MEAN_POSITIONS` by tokens, rounded up (at least 1; a pass of n micro-batches uses at most 128 + n)."""
        if self.pass_tokens <= 0:
            return MEAN_POSITIONS
        share = math.ceil(MEAN_POSITIONS * max(float(tokens), 0.0) / self.pass_tokens)
        return max(1, min(MEAN_POSITIONS, share))

    def spent(self, positions: float) -> None:
        """After that forward: the drafting positions it used (the estimate's ``mtp_drafted_num_positions``)."""
        if self.fraction < 1.0:
            self.credit -= float(positions)


class AcceptanceProbe:
    """Estimate MTP acceptance from a training forward of a megatron ``HybridModel`` (or ``GPTModel``).

    Attaches two hooks through torch's public hook API (no library class is changed):

    * a forward hook on the model's ``mtp`` block that keeps a *detached* reference to its output,
      the concatenated hidden states ``[(1+D)*s, b, h]`` (main chunk first, then one chunk per
      depth; ``s`` is the local sequence length under sequence parallelism);
    * a forward pre-hook on the (unwrapped) model that drops any earlier capture, so a forward that
      skips MTP (``hybrid_forward(..., run_mtp_forward=False)``, inference) leaves nothing behind.

    Hooks return ``None``: the forward's outputs and the autograd graph are untouched. :meth:`estimate`
    works under ``torch.no_grad`` on at most ``max_positions`` positions, computing the MTP logits
    with the model's own output-layer weight (the shared embedding when tied) and MuP scaling; it
    does not call the ``output_layer`` module, so its hooks and deferred-wgrad buffers are untouched.

    Use one probe per model chunk that owns the MTP block; call :meth:`estimate` right after the
    forward (e.g. in the logits processor): the capture is released by :meth:`estimate`,
    :meth:`release`, the next forward or :meth:`close`. On a pipeline stage without the MTP block,
    :meth:`estimate` returns ``{}``.

    Parallelism: data and expert parallelism need nothing (each rank estimates its own micro-batches;
    average across DP like other metrics). Tensor parallelism: vocabulary-sharded logits (the
    forward's default) or gathered ones; softmaxes, argmaxes and sums are reduced over the TP group,
    so every TP rank returns the same numbers (tested with TP=2 on gloo). Sequence parallelism: the
    captured hidden states are sequence shards and the selected rows are completed by a sum over the
    TP group (the row logic is tested on 2 ranks; a whole-model SP run needs Transformer Engine's
    norms and was not run here). Pipeline parallelism: the probe is inactive on stages without the
    MTP block. Packed (THD) sequences: pass ``response_mask`` in the packed layout; every packed
    sequence must begin with a prompt token so no counted position crosses a boundary. Context
    parallelism: not supported (raises).

    Args:
        model: the (possibly DDP/Float16Module-wrapped) model.
        temperature (float): default sampling temperature for both distributions (``0`` = greedy).

    Attributes:
        active (bool): False on a rank whose model chunk has no MTP block (or no output layer):
            no hook is attached and :meth:`estimate` returns ``{}``.

    Raises:
        MTPConfigError: the model has no MTP layers (``config.mtp_num_layers`` unset).
        NotImplementedError: context parallelism (CP > 1).
    """

    def __init__(self, model, *, temperature: float = 1.0):
        inner = unwrap_model(model)
        if not model_has_mtp(inner):
            raise MTPConfigError(
                f"AcceptanceProbe needs a model with MTP layers; {type(inner).__qualname__} has "
                f"config.mtp_num_layers={getattr(getattr(inner, 'config', None), 'mtp_num_layers', None)}"
            )
        self._temperature = check_temperature(temperature)
        self._inner = inner
        pgc = getattr(inner, "pg_collection", None)
        cp = getattr(pgc, "cp", None)
        if cp is not None and group_size(cp) > 1:
            raise NotImplementedError(
                f"AcceptanceProbe does not support context parallelism (cp size {group_size(cp)}): "
                "positions t and t+1 may live on different CP ranks"
            )
        tp_group = getattr(inner, "tp_group", None)
        self._tp_group = tp_group if tp_group is not None else getattr(pgc, "tp", None)
        self._captured: torch.Tensor | None = None
        self._handles: list[Any] = []
        mtp = getattr(inner, "mtp", None)
        self.active = mtp is not None and bool(getattr(inner, "post_process", True))
        if self.active:
            self._handles.append(inner.register_forward_pre_hook(self._on_model_forward))
            self._handles.append(mtp.register_forward_hook(self._on_mtp_output))

    # hooks ----------------------------------------------------------------------------------------
    def _on_model_forward(self, module, args):
        self._captured = None

    def _on_mtp_output(self, module, args, output):
        if isinstance(output, torch.Tensor):
            self._captured = output.detach()

    # lifecycle ------------------------------------------------------------------------------------
    @property
    def has_capture(self) -> bool:
        """True when the last forward ran the MTP block and its output has not been released."""
        return self._captured is not None

    @property
    def captured(self) -> torch.Tensor | None:
        """The captured MTP block output ``[(1+D)*s, b, h]`` (detached), or ``None``."""
        return self._captured

    def release(self) -> None:
        """Drop the captured hidden states."""
        self._captured = None

    def close(self) -> None:
        """Remove the hooks and drop the capture. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._captured = None

    def __enter__(self) -> "AcceptanceProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # internals ------------------------------------------------------------------------------------
    def _num_depths(self) -> int:
        return int(self._inner.config.mtp_num_layers)

    def _sequence_parallel(self) -> bool:
        return bool(getattr(self._inner.config, "sequence_parallel", False)) and group_size(self._tp_group) > 1

    def _chunks(self) -> list[torch.Tensor]:
        cap = self._captured
        n = 1 + self._num_depths()
        if cap is None or cap.dim() != 3 or cap.shape[0] % n:
            raise RuntimeError(
                f"captured MTP output has shape {None if cap is None else tuple(cap.shape)}, expected "
                f"[(1+{n - 1})*s, b, h]"
            )
        return list(cap.chunk(n, dim=0))

    def _output_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        inner = self._inner
        if getattr(inner, "share_embeddings_and_output_weights", False):
            weight = inner.shared_embedding_or_output_weight()
        else:
            weight = inner.output_layer.weight
        layer = inner.output_layer
        bias = getattr(layer, "bias", None)
        if bias is not None and getattr(layer, "skip_bias_add", False):
            bias = None  # the forward drops it from the returned logits as well
        return weight, bias

    def _rows(self, chunk: torch.Tensor, bi: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
        """Hidden rows ``chunk[t, b]`` for global positions ``ti`` -> ``[n, h]``."""
        return rows_at(chunk, bi, ti, self._tp_group if self._sequence_parallel() else None)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W^T (+ b)`` with the model's output weight (local vocab shard), MuP-scaled -> ``[n, V_local]``."""
        weight, bias = self._output_weight()
        out = torch.matmul(rows.to(weight.dtype), weight.t())
        if bias is not None:
            out = out + bias
        scale = getattr(self._inner, "_scale_logits", None)
        return scale(out) if callable(scale) else out

    def _global_seq_len(self, chunk: torch.Tensor) -> int:
        s_local = chunk.shape[0]
        return s_local * group_size(self._tp_group) if self._sequence_parallel() else s_local

    def _main_rows(self, main_logits: torch.Tensor, bi, ti, v_local: int):
        """Main logits rows ``[n, V_local]`` and the group their last dim is sharded over."""
        rows = main_logits[bi, ti]
        tp = group_size(self._tp_group)
        if rows.shape[-1] == v_local:
            return rows, (self._tp_group if tp > 1 else None)
        if tp > 1 and rows.shape[-1] == v_local * tp:  # gathered logits: use this rank's shard
            r = torch.distributed.get_rank(group=self._tp_group)
            return rows[:, r * v_local : (r + 1) * v_local], self._tp_group
        raise ValueError(
            f"main_logits vocabulary dim {rows.shape[-1]} matches neither the output layer's local shard "
            f"({v_local}) nor the full vocabulary ({v_local * tp})"
        )

    def _stats(self, chunks, main_logits, d: int, bi: torch.Tensor, ti: torch.Tensor, t: float):
        """(overlap, greedy agreement, argmax-draft acceptance) ``[n]`` for MTP depth ``d`` at positions ``(bi, ti)``
        against the main logits at ``ti + d``, :data:`DRAFTED_CHUNK` rows at a time (bounded logits memory)."""
        out: list[list[torch.Tensor]] = [[], [], []]
        bi, ti = bi.to(chunks[d].device), ti.to(chunks[d].device)
        mdev = None if main_logits is None else main_logits.device
        for i in range(0, bi.numel(), DRAFTED_CHUNK):
            b, s = bi[i : i + DRAFTED_CHUNK], ti[i : i + DRAFTED_CHUNK]
            q = self._logits(self._rows(chunks[d], b, s))
            if main_logits is None:
                p, group = self._logits(self._rows(chunks[0], b, s + d)), self._tp_group
            else:
                p, group = self._main_rows(main_logits, b.to(mdev), (s + d).to(mdev), q.shape[-1])
                p = p.to(q.device)
            if group_size(group) == 1:
                group = None
            for o, x in zip(out, acceptance_stats(p, q, t, group)):
                o.append(x.float())
        return tuple(torch.cat(o) for o in out)

    def _drafted(self, chunks, main_logits, response_mask, t: float, budget: int, k: int | None = None) -> dict[str, float]:
        """The first-draft acceptance over the positions vLLM drafts at: whole responses (evenly spaced, about
        ``budget`` drafting positions), every depth's acceptance at each of their positions, the expected verify
        steps along each (:func:`~verl_mtp_plugin.acceptance.estimate.draft_schedule` with ``k`` drafts per verify
        step; None: the model's MTP depths, as the recipes draft), for probabilistic and greedy drafting. Drafts
        beyond the trained depths (vLLM chains the last MTP layer again) take the deepest depth's acceptance at the
        same start: an approximation, only where ``k`` exceeds the depths."""
        runs = response_runs(acceptance_positions(response_mask, 1))
        if not runs:
            return {}
        total = sum(n for *_, n in runs)
        if total > budget:  # about budget positions: that share of the responses, evenly spaced (at least one)
            keep = max(1, int(len(runs) * budget // total))
            runs = [runs[int((i + 0.5) * len(runs) / keep)] for i in range(keep)]
        depths, longest = self._num_depths(), max(n for *_, n in runs)
        k = depths if k is None else int(k)
        alpha = torch.zeros(len(runs), longest, k)
        argmax = torch.zeros(len(runs), longest, k)
        for d in range(1, k + 1):
            valid = acceptance_positions(response_mask, d).cpu()
            bi, ti, ri, rj = [], [], [], []
            for i, (row, first, n) in enumerate(runs):
                pos = torch.arange(first, first + n)
                ok = valid[row, pos]
                bi.append(torch.full((int(ok.sum()),), row, dtype=torch.int64))
                ti.append(pos[ok])
                ri.append(torch.full((int(ok.sum()),), i, dtype=torch.int64))
                rj.append(torch.arange(n)[ok])
            bi, ti, ri, rj = (torch.cat(x) for x in (bi, ti, ri, rj))
            if bi.numel() == 0:
                continue
            if d > depths:  # a subset of the deepest depth's positions (further from the response's end)
                alpha[ri, rj, d - 1] = alpha[ri, rj, depths - 1]
                argmax[ri, rj, d - 1] = argmax[ri, rj, depths - 1]
                continue
            over, _, draft = self._stats(chunks, main_logits, d, bi, ti, t)
            alpha[ri, rj, d - 1] = over.cpu()
            argmax[ri, rj, d - 1] = draft.cpu()
        lengths = torch.tensor([n for *_, n in runs])
        # both drafting methods in one pass of the schedule: the responses twice, once per method
        starts, accepted = draft_schedule(torch.cat([alpha, argmax]), torch.cat([lengths, lengths]))
        r = len(runs)
        out = {DRAFTED_POSITIONS_KEY: float(lengths.sum())}
        for key, part in ((DRAFTED_EXPECTED_KEY, slice(0, r)), (DRAFTED_ARGMAX_KEY, slice(r, 2 * r))):
            hits, steps = float(accepted[part, :, 0].sum()), float(starts[part].sum())
            out[key] = hits / steps
            out.update(dict(zip(DRAFTED_SUMS[key], (hits, steps))))  # for pool_drafted over data-parallel ranks
        return out

    # public ---------------------------------------------------------------------------------------
    def mtp_logits(self, depth: int = 1) -> torch.Tensor:
        """Dense MTP logits of the captured forward (for checks; costs a full output-layer product).

        Args:
            depth (int): MTP depth ``1..D``.

        Returns:
            Tensor: ``[b, s, V_local]``; position ``t`` predicts token ``t+1+depth``. Not available
            under sequence parallelism.
        """
        if not self.has_capture:
            raise RuntimeError("no MTP hidden states captured: run a forward with the MTP block first")
        if not 1 <= depth <= self._num_depths():
            raise ValueError(f"depth must be in 1..{self._num_depths()}, got {depth}")
        if self._sequence_parallel():
            raise NotImplementedError("mtp_logits() is not available under sequence parallelism")
        with torch.no_grad():
            return self._logits(self._chunks()[depth]).transpose(0, 1).contiguous()

    def estimate(
        self,
        main_logits: torch.Tensor | None,
        response_mask: torch.Tensor,
        max_positions: int = 256,
        generator: torch.Generator | None = None,
        *,
        temperature: float | None = None,
        release: bool = True,
        max_drafted_positions: int = DRAFTED_POSITIONS,
        draft_k: int | None = None,
    ) -> dict[str, float]:
        """Estimate acceptance for the forward just run, on a subsample of counted positions.

        Args:
            main_logits (Tensor | None): ``[b, s, V]`` (or the local vocab shard ``[b, s, V/tp]``) logits
                the forward returned (``labels=None``). ``None``: recompute the needed rows from the
                captured main hidden states (for forwards that returned a loss).
            response_mask (Tensor): ``[b, s]`` token coordinates, nonzero on response tokens (zero on
                prompt and padding), in the same layout as the forward's ``input_ids``.
            max_positions (int): at most this many positions per depth (see :func:`select_positions`).
            generator (torch.Generator | None): random subsample; ``None`` = evenly spaced.
            temperature (float | None): overrides the probe's temperature for this call.
            max_drafted_positions (int): the drafted estimate's budget: whole responses, evenly spaced, of about
                this many drafting positions in all (at least one response; :meth:`_drafted`); 0: not computed.
            draft_k (int | None): drafts per verify step in the drafted estimate's schedule (vLLM's
                ``num_speculative_tokens``); None: the model's MTP depths.
            release (bool): drop the capture afterwards (default). ``False`` keeps it for another
                call on the same forward (e.g. another temperature); the next forward drops it anyway.

        Returns:
            dict[str, float]: :data:`EXPECTED_KEY`, :data:`GREEDY_KEY`, :data:`ARGMAX_DRAFT_KEY`,
            ``mtp_expected_accept_length_k{1,2,3}``, :data:`POSITIONS_KEY` (and the positions that counted before
            the subsample, :data:`~verl_mtp_plugin.acceptance.estimate.ELIGIBLE_KEY`: not a metric), per-depth rates for
            depths ``>= 2``, and the first-draft rates over the positions vLLM drafts at
            (:data:`DRAFTED_EXPECTED_KEY`, :data:`DRAFTED_ARGMAX_KEY`, :data:`DRAFTED_POSITIONS_KEY`) with their
            sums (:data:`~verl_mtp_plugin.acceptance.estimate.DRAFTED_SUMS`: not metrics, what
            :func:`~verl_mtp_plugin.acceptance.estimate.pool_drafted` adds over data-parallel ranks). ``{}`` when
            nothing can be estimated: this rank owns no MTP block, the last forward skipped MTP (or the capture was
            already used/released), or no position counts (no two consecutive response tokens).

        Raises:
            ValueError: ``response_mask`` / ``main_logits`` shapes do not match the captured forward.
        """
        if not self.active or self._captured is None:
            return {}
        if draft_k is not None and (isinstance(draft_k, bool) or not isinstance(draft_k, int) or draft_k < 1):
            raise ValueError(f"draft_k must be an int >= 1 (vLLM's num_speculative_tokens) or None, got {draft_k!r}")
        t = self._temperature if temperature is None else check_temperature(temperature)
        try:
            chunks = self._chunks()
            b = chunks[0].shape[1]
            s = self._global_seq_len(chunks[0])
            if tuple(response_mask.shape) != (b, s):
                raise ValueError(
                    f"response_mask shape {tuple(response_mask.shape)} does not match the captured forward "
                    f"[b, s] = {(b, s)} (token coordinates, same layout as input_ids)"
                )
            if main_logits is not None and (main_logits.dim() != 3 or tuple(main_logits.shape[:2]) != (b, s)):
                raise ValueError(
                    f"main_logits shape {tuple(main_logits.shape)} does not match the captured forward "
                    f"[b, s, V] with [b, s] = {(b, s)}"
                )
            out: dict[str, float] = {}
            with torch.no_grad():
                for d in range(1, self._num_depths() + 1):
                    valid = acceptance_positions(response_mask, d)
                    bi, ti = select_positions(valid, max_positions, generator)
                    if bi.numel() == 0:
                        if d == 1:
                            return {}
                        continue
                    stats = torch.stack([x.mean() for x in self._stats(chunks, main_logits, d, bi, ti, t)]).tolist()
                    alpha, greedy, argmax_draft = min(max(stats[0], 0.0), 1.0), stats[1], stats[2]
                    if d == 1:
                        out[EXPECTED_KEY] = alpha
                        out[GREEDY_KEY] = greedy
                        out[ARGMAX_DRAFT_KEY] = argmax_draft
                        for k in ACCEPT_LENGTH_KS:
                            out[ACCEPT_LENGTH_KEY.format(k=k)] = expected_accept_length(alpha, k)
                        out[POSITIONS_KEY] = float(bi.numel())
                        out[ELIGIBLE_KEY] = float(valid.sum())
                    else:
                        out[DEPTH_EXPECTED_KEY.format(d=d)] = alpha
                        out[DEPTH_GREEDY_KEY.format(d=d)] = greedy
                if max_drafted_positions > 0:
                    out.update(self._drafted(chunks, main_logits, response_mask, t, max_drafted_positions, draft_k))
            return out
        finally:
            if release:
                self._captured = None
