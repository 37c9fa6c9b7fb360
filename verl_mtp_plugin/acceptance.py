"""In-trainer estimate of the acceptance rate MTP speculative decoding would see for the current policy.

The estimate uses only logits the trainer can compute cheaply during a forward in which MTP runs:
the policy's next-token distribution ``p_main`` (the logits the forward returns) and the MTP head's
distribution ``q_mtp`` (computed here, on a subsample of response positions, from the MTP hidden
states captured by a forward hook).

Alignment (megatron-core 0.19.2, ``hybrid_model.py`` / ``multi_token_prediction.py``):

* main logits at position ``t`` predict token ``t+1``;
* MTP depth ``d`` (1-based) at position ``t`` combines the main hidden state ``h_t`` (depth 1) or the
  previous depth's hidden state with the embedding of token ``t+d`` and predicts token ``t+1+d``
  (``process_mtp_loss`` rolls the labels ``d+1`` times);
* vLLM's MTP drafter, after the target produced token ``t+1``, proposes token ``t+2`` from
  ``q_mtp1[t]``; the target verifies it with ``p_main[t+1]``.

So the per-position acceptance probability of speculative sampling (Leviathan et al. 2023; Chen et
al. 2023) is ``alpha_t = sum_v min(p_main[t+1, v], q_mtp1[t, v])``, and in general, for depth ``d``,
``alpha_t = sum_v min(p_main[t+d, v], q_mtp_d[t, v])``. A position ``t`` is counted when the tokens
``t+1 .. t+1+d`` are all response tokens (``response_mask != 0``, token coordinates): prompt and
padding are excluded. The first drafting position is the last prompt position (after the prefill
produced the first response token, the drafter proposes the second); the first response token itself
is never a draft target.

Temperature: both distributions use the same temperature ``T`` (``softmax(logits / T)``), as vLLM's
rejection sampler applies the request's temperature to the target logits and (with
``draft_sample_method="probabilistic"``) to the draft logits. ``T == 0`` is the greedy limit: the
acceptance is 1 where both argmaxes agree, else 0. top-p / top-k are not modelled.

What vLLM actually does (0.31): by default ``speculative_config.draft_sample_method="greedy"``: the
drafter proposes ``argmax q`` and the rejection sampler treats ``q`` as one-hot, so a draft is
accepted with probability ``p_main[argmax q]`` (:func:`argmax_draft_acceptance`), not with the
overlap. Both are reported; with greedy target sampling (temperature 0) both reduce to
:func:`greedy_agreement`.

Accepted length: with ``k`` draft tokens, each accepted independently with probability ``alpha``,
a verification step yields ``E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)``
tokens (``k+1`` at ``alpha = 1``). vLLM reuses one MTP layer for ``k > 1``; the depth-1 ``alpha`` is
then an optimistic stand-in for the later positions (models with several MTP depths also get a
per-depth rate).

Cost: one ``[n, h] x [h, V]`` product per MTP depth (``n <= max_positions``, default 256) plus two
softmaxes over ``[n, V]``, under ``torch.no_grad``; see ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_mtp_plugin.control import model_has_mtp, unwrap_model
from verl_mtp_plugin.policy import MTPConfigError

__all__ = [
    "ACCEPT_LENGTH_KEY",
    "ARGMAX_DRAFT_KEY",
    "DEPTH_EXPECTED_KEY",
    "DEPTH_GREEDY_KEY",
    "EXPECTED_KEY",
    "GREEDY_KEY",
    "POSITIONS_KEY",
    "AcceptanceProbe",
    "acceptance_positions",
    "argmax_draft_acceptance",
    "expected_accept_length",
    "expected_speedup",
    "greedy_agreement",
    "per_position_acceptance",
    "select_positions",
    "speculative_overlap",
]

#: Mean speculative-sampling acceptance probability (depth 1). verl logs it as ``actor/<key>``.
EXPECTED_KEY = "mtp_expected_accept_rate"
#: Fraction of positions where ``argmax p_main == argmax q_mtp`` (greedy target sampling).
GREEDY_KEY = "mtp_greedy_accept_rate"
#: Mean ``p_main[argmax q_mtp]``: vLLM's default greedy drafting with a sampled target.
ARGMAX_DRAFT_KEY = "mtp_argmax_draft_accept_rate"
#: ``E`` for ``k`` draft tokens from :data:`EXPECTED_KEY`.
ACCEPT_LENGTH_KEY = "mtp_expected_accept_length_k{k}"
#: Number of positions the estimate used (after subsampling).
POSITIONS_KEY = "mtp_accept_num_positions"
#: Per-depth rates for models with more than one MTP depth (``d >= 2``).
DEPTH_EXPECTED_KEY = "mtp_expected_accept_rate_depth{d}"
DEPTH_GREEDY_KEY = "mtp_greedy_accept_rate_depth{d}"

_ACCEPT_LENGTH_KS = (1, 2, 3)


# --------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------


def _check_pair(p: torch.Tensor, q: torch.Tensor) -> None:
    if p.shape != q.shape:
        raise ValueError(
            f"p_main_logits and q_mtp_logits must have the same shape [..., V]; got {tuple(p.shape)} "
            f"and {tuple(q.shape)} (align the positions first: p_main[t+d] with q_mtp_d[t])"
        )
    if p.dim() < 1 or p.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty vocabulary dimension, got shape {tuple(p.shape)}")


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    return t


def _group_size(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=op, group=group)
    return t


def _probs(logits: torch.Tensor, temperature: float, group) -> torch.Tensor:
    """``softmax(logits / T)`` in float32; with ``group`` the last dim is a vocabulary shard."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if _group_size(group) == 1:
        return torch.softmax(x, dim=-1)
    m = _all_reduce(x.amax(dim=-1, keepdim=True), torch.distributed.ReduceOp.MAX, group)
    e = torch.exp(x - m)
    z = _all_reduce(e.sum(dim=-1, keepdim=True), torch.distributed.ReduceOp.SUM, group)
    return e / z


def _argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Global argmax (first maximal index, as ``torch.argmax``) over a possibly vocab-sharded last dim."""
    if _group_size(group) == 1:
        return logits.max(dim=-1).indices  # same first-index tie rule as argmax; faster on CPU
    x = logits.float()
    local_max, local_idx = x.max(dim=-1)
    offset = torch.distributed.get_rank(group=group) * x.shape[-1]
    global_max = _all_reduce(local_max.clone(), torch.distributed.ReduceOp.MAX, group)
    big = torch.iinfo(torch.int64).max
    cand = torch.where(local_max == global_max, local_idx + offset, torch.full_like(local_idx, big))
    return _all_reduce(cand, torch.distributed.ReduceOp.MIN, group)


@torch.no_grad()
def _acceptance_stats(
    p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(overlap, greedy agreement, argmax-draft acceptance), each ``[...]`` float32, sharing the softmaxes."""
    p_arg, q_arg = _argmax(p_logits, group), _argmax(q_logits, group)
    greedy = (p_arg == q_arg).float()
    if temperature == 0.0:
        return greedy, greedy, greedy
    p = _probs(p_logits, temperature, group)
    draft = _pick(p, q_arg, group)
    q = _probs(q_logits, temperature, group)
    overlap = torch.minimum(p, q, out=q).sum(dim=-1)
    if _group_size(group) > 1:
        overlap = _all_reduce(overlap, torch.distributed.ReduceOp.SUM, group)
    return overlap.clamp_(0.0, 1.0), greedy, draft


def _pick(p: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """``p[..., index]`` for a global vocabulary ``index`` over a possibly vocab-sharded last dim."""
    if _group_size(group) == 1:
        return p.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    v_local = p.shape[-1]
    local = index - torch.distributed.get_rank(group=group) * v_local
    owned = (local >= 0) & (local < v_local)
    picked = p.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * owned
    return _all_reduce(picked, torch.distributed.ReduceOp.SUM, group)


def greedy_agreement(p_main_logits: torch.Tensor, q_mtp_logits: torch.Tensor, *, group=None) -> torch.Tensor:
    """1.0 where ``argmax p_main == argmax q_mtp``, else 0.0 (acceptance under greedy sampling).

    Args:
        p_main_logits (Tensor): ``[..., V]`` target logits at the verifying positions (``t+d``).
        q_mtp_logits (Tensor): ``[..., V]`` MTP depth-``d`` logits at the drafting positions (``t``),
            row-aligned with ``p_main_logits``.
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard
            (megatron's contiguous split, rank ``r`` holds ``[r*V/tp, (r+1)*V/tp)``).

    Returns:
        Tensor: ``[...]`` float32 of 0.0 / 1.0.
    """
    _check_pair(p_main_logits, q_mtp_logits)
    return (_argmax(p_main_logits, group) == _argmax(q_mtp_logits, group)).float()


def speculative_overlap(
    p_main_logits: torch.Tensor, q_mtp_logits: torch.Tensor, temperature: float = 1.0, *, group=None
) -> torch.Tensor:
    """Speculative-sampling acceptance probability ``sum_v min(p_main[v], q_mtp[v])`` per row.

    Both distributions are ``softmax(logits / temperature)`` (computed in float32).
    ``temperature == 0`` is the greedy limit and returns :func:`greedy_agreement`.

    Args:
        p_main_logits (Tensor): ``[..., V]`` target logits at the verifying positions (``t+d``).
        q_mtp_logits (Tensor): ``[..., V]`` MTP depth-``d`` logits at the drafting positions (``t``),
            row-aligned with ``p_main_logits``.
        temperature (float): sampling temperature ``>= 0``, the same for both.
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard.

    Returns:
        Tensor: ``[...]`` float32 in ``[0, 1]``.
    """
    _check_pair(p_main_logits, q_mtp_logits)
    t = _check_temperature(temperature)
    if t == 0.0:
        return greedy_agreement(p_main_logits, q_mtp_logits, group=group)
    p = _probs(p_main_logits, t, group)
    q = _probs(q_mtp_logits, t, group)
    overlap = torch.minimum(p, q).sum(dim=-1)
    if _group_size(group) > 1:
        overlap = _all_reduce(overlap, torch.distributed.ReduceOp.SUM, group)
    return overlap.clamp_(0.0, 1.0)


def argmax_draft_acceptance(
    p_main_logits: torch.Tensor, q_mtp_logits: torch.Tensor, temperature: float = 1.0, *, group=None
) -> torch.Tensor:
    """Acceptance probability of a greedy draft: ``p_main[argmax q_mtp]`` per row.

    This is vLLM's default (``draft_sample_method="greedy"``): the draft token is ``argmax q`` and
    ``q`` counts as one-hot in the rejection test, so the draft is accepted with probability
    ``min(1, p/1) = p_main[draft]``. ``temperature == 0`` returns :func:`greedy_agreement`.

    Args:
        p_main_logits (Tensor): ``[..., V]`` target logits at the verifying positions.
        q_mtp_logits (Tensor): ``[..., V]`` MTP logits at the drafting positions, row-aligned.
        temperature (float): target sampling temperature ``>= 0``.
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard.

    Returns:
        Tensor: ``[...]`` float32 in ``[0, 1]``.
    """
    _check_pair(p_main_logits, q_mtp_logits)
    t = _check_temperature(temperature)
    if t == 0.0:
        return greedy_agreement(p_main_logits, q_mtp_logits, group=group)
    return _pick(_probs(p_main_logits, t, group), _argmax(q_mtp_logits, group), group)


def expected_accept_length(alpha, k: int):
    """Mean tokens per verification step with ``k`` draft tokens: ``(1 - alpha^(k+1)) / (1 - alpha)``.

    Computed as ``1 + alpha + ... + alpha^k`` so ``alpha = 1`` gives ``k + 1`` exactly.

    Args:
        alpha (float | Tensor): per-draft acceptance probability (or probabilities) in ``[0, 1]``.
        k (int): number of draft tokens, ``>= 0``.

    Returns:
        float | Tensor: same type as ``alpha``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (number of draft tokens) must be an int >= 0, got {k!r}")
    if isinstance(alpha, torch.Tensor):
        a = alpha.float()
        if bool(((a < 0) | (a > 1) | torch.isnan(a)).any()):
            raise ValueError("alpha must lie in [0, 1]")
        out = torch.ones_like(a)
        term = torch.ones_like(a)
        for _ in range(k):
            term = term * a
            out = out + term
        return out
    a = float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    return float(sum(a**i for i in range(k + 1)))


def expected_speedup(alpha, k: int, draft_cost: float):
    """Expected wall-clock speedup of speculative decoding: ``E / (1 + k * c)``.

    Args:
        alpha (float | Tensor): per-draft acceptance probability in ``[0, 1]``.
        k (int): number of draft tokens, ``>= 0``.
        draft_cost (float): cost ``c`` of one draft step relative to one target step, ``>= 0``.

    Returns:
        float | Tensor: ``expected_accept_length(alpha, k) / (1 + k * draft_cost)``.
    """
    c = float(draft_cost)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"draft_cost must be a finite number >= 0, got {draft_cost!r}")
    return expected_accept_length(alpha, k) / (1.0 + k * c)


def acceptance_positions(response_mask: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """Drafting positions ``t`` that count for MTP depth ``depth``.

    Position ``t`` counts when tokens ``t+1 .. t+1+depth`` are all response tokens: token ``t+1`` was
    produced by the target (so the drafter at ``t`` runs in the rollout) and the drafted tokens
    ``t+2 .. t+1+depth`` were sampled by the policy.

    Args:
        response_mask (Tensor): ``[b, s]`` in token coordinates, nonzero on response tokens (zero on
            prompt and padding).
        depth (int): MTP depth ``d >= 1``.

    Returns:
        Tensor: ``[b, s]`` bool, True at counted positions (always False for ``t >= s - 1 - d``).
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [b, s] (token coordinates), got shape {tuple(response_mask.shape)}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    m = response_mask != 0
    b, s = m.shape
    valid = torch.zeros_like(m)
    n = s - 1 - depth  # number of t with t+1+depth <= s-1
    if n <= 0:
        return valid
    ok = m[:, 1 : 1 + n].clone()
    for j in range(2, depth + 2):
        ok &= m[:, j : j + n]
    valid[:, :n] = ok
    return valid


def per_position_acceptance(
    main_logits: torch.Tensor,
    mtp_logits: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    depth: int = 1,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Aligned acceptance quantities for every position (the dense reference the probe subsamples).

    Args:
        main_logits (Tensor): ``[b, s, V]`` policy logits (position ``t`` predicts token ``t+1``).
        mtp_logits (Tensor): ``[b, s, V]`` MTP depth-``depth`` logits (position ``t`` predicts token
            ``t+1+depth``).
        response_mask (Tensor): ``[b, s]`` token coordinates, nonzero on response tokens.
        depth (int): MTP depth ``d >= 1``.
        temperature (float): sampling temperature for both distributions.

    Returns:
        dict: ``alpha``, ``greedy``, ``argmax_draft`` (``[b, s]`` float32, value at ``t`` compares
        ``main_logits[:, t+d]`` with ``mtp_logits[:, t]``; 0 where not counted) and ``valid``
        (``[b, s]`` bool, :func:`acceptance_positions`).
    """
    if main_logits.dim() != 3 or main_logits.shape != mtp_logits.shape:
        raise ValueError(
            f"main_logits and mtp_logits must both be [b, s, V]; got {tuple(main_logits.shape)} and "
            f"{tuple(mtp_logits.shape)}"
        )
    if tuple(response_mask.shape) != tuple(main_logits.shape[:2]):
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != logits [b, s] {tuple(main_logits.shape[:2])}"
        )
    valid = acceptance_positions(response_mask, depth)
    b, s, _ = main_logits.shape
    keys = ("alpha", "greedy", "argmax_draft")
    out = {k: torch.zeros(b, s, dtype=torch.float32, device=main_logits.device) for k in keys}
    n = s - depth
    if n > 0:
        p, q = main_logits[:, depth:], mtp_logits[:, :n]
        out["alpha"][:, :n] = speculative_overlap(p, q, temperature)
        out["greedy"][:, :n] = greedy_agreement(p, q)
        out["argmax_draft"][:, :n] = argmax_draft_acceptance(p, q, temperature)
    for k in keys:
        out[k] = out[k] * valid
    out["valid"] = valid
    return out


def select_positions(
    valid: torch.Tensor, max_positions: int = 256, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick at most ``max_positions`` counted positions.

    Without ``generator`` the choice is deterministic (evenly spaced over the counted positions in
    row-major order), so every tensor-parallel rank picks the same positions. With ``generator`` it
    is uniform without replacement; under tensor parallelism seed it identically on all TP ranks.

    Args:
        valid (Tensor): ``[b, s]`` bool, counted positions.
        max_positions (int): upper bound ``>= 1``.
        generator (torch.Generator | None): source of randomness.

    Returns:
        tuple[Tensor, Tensor]: ``(batch_idx [n], pos_idx [n])`` int64 on ``valid``'s device, sorted.
    """
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be an int >= 1, got {max_positions!r}")
    idx = valid.nonzero()  # [N, 2]
    total = idx.shape[0]
    if total > max_positions:
        if generator is None:
            sel = torch.arange(max_positions, dtype=torch.int64) * total // max_positions
        else:
            sel = torch.randperm(total, generator=generator, device=generator.device)[:max_positions].sort().values
        idx = idx[sel.to(idx.device)]
    return idx[:, 0], idx[:, 1]


def _rows_at(chunk: torch.Tensor, bi: torch.Tensor, ti: torch.Tensor, seq_group=None) -> torch.Tensor:
    """Rows ``chunk[ti, bi]`` -> ``[n, h]`` of a ``[s, b, h]`` hidden state.

    With ``seq_group`` (sequence parallelism) ``chunk`` is this rank's contiguous sequence shard
    ``[s/tp, b, h]`` (megatron's ``scatter_to_sequence_parallel_region``: rank ``r`` holds positions
    ``[r*s/tp, (r+1)*s/tp)``); each rank fills the rows it owns and a sum over the group completes
    them, so every rank returns all ``n`` rows.
    """
    if seq_group is None or _group_size(seq_group) == 1:
        return chunk[ti, bi]
    s_local = chunk.shape[0]
    local = ti - torch.distributed.get_rank(group=seq_group) * s_local
    owned = (local >= 0) & (local < s_local)
    rows = chunk[local.clamp(0, s_local - 1), bi] * owned.unsqueeze(-1).to(chunk.dtype)
    return _all_reduce(rows.contiguous(), torch.distributed.ReduceOp.SUM, seq_group)


# --------------------------------------------------------------------------------------------------
# Probe on a megatron HybridModel
# --------------------------------------------------------------------------------------------------


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

    Parallelism: data and expert parallelism need nothing (each rank estimates its own micro-batch;
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
        self._temperature = _check_temperature(temperature)
        self._inner = inner
        pgc = getattr(inner, "pg_collection", None)
        cp = getattr(pgc, "cp", None)
        if cp is not None and _group_size(cp) > 1:
            raise NotImplementedError(
                f"AcceptanceProbe does not support context parallelism (cp size {_group_size(cp)}): "
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
        return bool(getattr(self._inner.config, "sequence_parallel", False)) and _group_size(self._tp_group) > 1

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
        return _rows_at(chunk, bi, ti, self._tp_group if self._sequence_parallel() else None)

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
        return s_local * _group_size(self._tp_group) if self._sequence_parallel() else s_local

    def _main_rows(self, main_logits: torch.Tensor, bi, ti, v_local: int):
        """Main logits rows ``[n, V_local]`` and the group their last dim is sharded over."""
        rows = main_logits[bi, ti]
        tp = _group_size(self._tp_group)
        if rows.shape[-1] == v_local:
            return rows, (self._tp_group if tp > 1 else None)
        if tp > 1 and rows.shape[-1] == v_local * tp:  # gathered logits: use this rank's shard
            r = torch.distributed.get_rank(group=self._tp_group)
            return rows[:, r * v_local : (r + 1) * v_local], self._tp_group
        raise ValueError(
            f"main_logits vocabulary dim {rows.shape[-1]} matches neither the output layer's local shard "
            f"({v_local}) nor the full vocabulary ({v_local * tp})"
        )

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
            release (bool): drop the capture afterwards (default). ``False`` keeps it for another
                call on the same forward (e.g. another temperature); the next forward drops it anyway.

        Returns:
            dict[str, float]: :data:`EXPECTED_KEY`, :data:`GREEDY_KEY`, :data:`ARGMAX_DRAFT_KEY`,
            ``mtp_expected_accept_length_k{1,2,3}``, :data:`POSITIONS_KEY`, and per-depth rates for
            depths ``>= 2``. ``{}`` when nothing can be estimated: this rank owns no MTP block, the
            last forward skipped MTP (or the capture was already used/released), or no position
            counts (no two consecutive response tokens).

        Raises:
            ValueError: ``response_mask`` / ``main_logits`` shapes do not match the captured forward.
        """
        if not self.active or self._captured is None:
            return {}
        t = self._temperature if temperature is None else _check_temperature(temperature)
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
                    dev = chunks[d].device
                    bi, ti = bi.to(dev), ti.to(dev)
                    q = self._logits(self._rows(chunks[d], bi, ti))
                    if main_logits is None:
                        p, group = self._logits(self._rows(chunks[0], bi, ti + d)), self._tp_group
                    else:
                        mdev = main_logits.device
                        p, group = self._main_rows(main_logits, bi.to(mdev), (ti + d).to(mdev), q.shape[-1])
                        p = p.to(q.device)
                    if _group_size(group) == 1:
                        group = None
                    stats = torch.stack([x.mean() for x in _acceptance_stats(p, q, t, group)]).tolist()
                    alpha, greedy, argmax_draft = min(max(stats[0], 0.0), 1.0), stats[1], stats[2]
                    if d == 1:
                        out[EXPECTED_KEY] = alpha
                        out[GREEDY_KEY] = greedy
                        out[ARGMAX_DRAFT_KEY] = argmax_draft
                        for k in _ACCEPT_LENGTH_KS:
                            out[ACCEPT_LENGTH_KEY.format(k=k)] = expected_accept_length(alpha, k)
                        out[POSITIONS_KEY] = float(bi.numel())
                    else:
                        out[DEPTH_EXPECTED_KEY.format(d=d)] = alpha
                        out[DEPTH_GREEDY_KEY.format(d=d)] = greedy
            return out
        finally:
            if release:
                self._captured = None
