"""The acceptance arithmetic of the in-trainer estimate: per-position acceptance from two sets of logits.

Pure torch on tensors (vocab-parallel aware through an optional process group): speculative-sampling
overlap, greedy agreement and argmax-draft acceptance (:func:`speculative_overlap`,
:func:`greedy_agreement`, :func:`argmax_draft_acceptance`), accepted length and speedup
(:func:`expected_accept_length`, :func:`expected_speedup`), which positions count
(:func:`acceptance_positions`, :func:`select_positions`) and the metric keys. The model-facing part,
the forward hook that captures the MTP hidden states, is :mod:`verl_mtp_plugin.acceptance.probe`;
the alignment and temperature rules both follow are in :mod:`verl_mtp_plugin.acceptance`.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ACCEPT_LENGTH_KEY",
    "ACCEPT_LENGTH_KS",
    "ARGMAX_DRAFT_KEY",
    "CHUNK_BYTES",
    "DEPTH_EXPECTED_KEY",
    "DEPTH_GREEDY_KEY",
    "ELIGIBLE_KEY",
    "EXPECTED_KEY",
    "GREEDY_KEY",
    "POSITIONS_KEY",
    "acceptance_positions",
    "acceptance_stats",
    "argmax_draft_acceptance",
    "check_temperature",
    "chunk_rows",
    "combine_estimates",
    "draft_schedule",
    "DRAFTED_ARGMAX_KEY",
    "DRAFTED_EXPECTED_KEY",
    "DRAFTED_POSITIONS_KEY",
    "DRAFTED_SUMS",
    "pool_drafted",
    "response_runs",
    "expected_accept_length",
    "expected_speedup",
    "greedy_agreement",
    "group_size",
    "per_position_acceptance",
    "rows_at",
    "select_positions",
    "speculative_overlap",
    "vocab_parallel_log_softmax",
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
#: Number of positions that counted before subsampling (not logged): what :func:`combine_estimates` weighs a
#: micro-batch's means by.
ELIGIBLE_KEY = "_accept_eligible_positions"
#: Per-depth rates for models with more than one MTP depth (``d >= 2``).
DEPTH_EXPECTED_KEY = "mtp_expected_accept_rate_depth{d}"
DEPTH_GREEDY_KEY = "mtp_greedy_accept_rate_depth{d}"

#: The first-draft acceptance over the positions vLLM drafts at (:func:`draft_schedule` on whole responses): what
#: vLLM's ``spec_accept_rate_pos_0`` measures, for probabilistic (overlap) and greedy (``p[argmax q]``) drafting.
DRAFTED_EXPECTED_KEY = "mtp_drafted_expected_accept_rate"
DRAFTED_ARGMAX_KEY = "mtp_drafted_argmax_draft_accept_rate"
#: Number of response positions the drafted estimate used (whole responses; after :func:`pool_drafted`, over the
#: data-parallel ranks).
DRAFTED_POSITIONS_KEY = "mtp_drafted_num_positions"
#: Each drafted rate's sums, not logged: expected accepted first drafts and expected verify steps of the rank's
#: responses, which :func:`pool_drafted` adds over the data-parallel ranks.
DRAFTED_SUMS = {DRAFTED_EXPECTED_KEY: ("_drafted_expected_accepted", "_drafted_expected_verify_steps"),
                DRAFTED_ARGMAX_KEY: ("_drafted_argmax_accepted", "_drafted_argmax_verify_steps")}

#: The ``k`` values :data:`ACCEPT_LENGTH_KEY` is logged for.
ACCEPT_LENGTH_KS = (1, 2, 3)

#: Size of one chunk's float32 ``[rows, vocab shard]`` intermediate: the acceptance estimate and the soft_ce / tv /
#: chained_tv objectives (:mod:`verl_mtp_plugin.objective`) work on this many rows (tokens) at a time
#: (:func:`chunk_rows`), so their memory is a few such tensors, not a few ``[tokens, vocab]`` ones. 256 MiB: 512
#: tokens at a 131072-token vocabulary shard (TP 1), 4096 at TP 8. Every rank of a tensor-parallel group holds the
#: same shard width, so all ranks cut the same chunks and run the same collectives.
CHUNK_BYTES = 256 * 2**20


def chunk_rows(v_local: int) -> int:
    """Rows per chunk so that one float32 ``[rows, v_local]`` tensor is at most :data:`CHUNK_BYTES` (at least 1)."""
    return max(1, int(CHUNK_BYTES) // (4 * max(int(v_local), 1)))


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


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; ValueError unless finite and >= 0 (0 = greedy)."""
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    return t


def group_size(group) -> int:
    """World size of ``group`` (1 without one or without torch.distributed)."""
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=op, group=group)
    return t


def combine_estimates(parts) -> dict:
    """One rank's estimate of a pass from its micro-batches' (each :meth:`AcceptanceProbe.estimate`'s dict; ``{}``
    where a micro-batch had nothing to estimate): the drafted sums and positions added (so the drafted rates are
    accepted first drafts over verify steps of every probed response, as vLLM's rate pools its rollout's), the means
    over positions weighted by each micro-batch's counted positions (:data:`ELIGIBLE_KEY`, else the positions it
    used), the per-depth rates too, and the expected accept lengths taken from the combined rate. A drafted rate
    that comes without its sums is weighted like a mean. :func:`pool_drafted` then pools the drafted sums over the
    data-parallel ranks.

    Args:
        parts: the micro-batches' estimates, in any order.

    Returns:
        dict: the combined estimate with the sums of :data:`DRAFTED_SUMS` (``{}`` when no part has any).
    """
    parts = [p for p in parts if p]
    if not parts:
        return {}
    sum_names = {n for pair in DRAFTED_SUMS.values() for n in pair} | {DRAFTED_POSITIONS_KEY, POSITIONS_KEY,
                                                                        ELIGIBLE_KEY}
    lengths = {ACCEPT_LENGTH_KEY.format(k=k) for k in ACCEPT_LENGTH_KS}
    out: dict = {}
    for name in sum_names:
        if any(name in p for p in parts):
            out[name] = float(sum(float(p.get(name, 0.0)) for p in parts))
    pooled = set()
    for key, (accepted, steps) in DRAFTED_SUMS.items():
        if out.get(steps, 0.0) > 0:
            out[key] = out[accepted] / out[steps]
            pooled.add(key)
    means = {k for p in parts for k in p} - sum_names - lengths - pooled

    def weight(p: dict) -> float:
        return float(p.get(ELIGIBLE_KEY, p.get(POSITIONS_KEY, 0.0)))

    for key in sorted(means):
        pairs = [(float(p[key]), weight(p)) for p in parts if key in p]
        total = sum(w for _, w in pairs)
        out[key] = sum(v * w for v, w in pairs) / total if total > 0 else sum(v for v, _ in pairs) / len(pairs)
    if EXPECTED_KEY in out:
        for k in ACCEPT_LENGTH_KS:
            out[ACCEPT_LENGTH_KEY.format(k=k)] = expected_accept_length(out[EXPECTED_KEY], k)
    return out


def pool_drafted(acc: dict, group=None) -> dict:
    """The drafted estimate over every rank of ``group`` (the data-parallel group): accepted first drafts over verify
    steps, each summed over the ranks' responses, as vLLM's rate pools its rollout's verify steps (each rank's rate
    averaged instead would weigh a rank of few verify steps as much as one of many); the drafted positions summed.
    Every rank of ``group`` must call (a rank without drafted positions adds zeros).

    Args:
        acc (dict): one rank's estimate (:class:`~verl_mtp_plugin.acceptance.AcceptanceProbe`), with the sums of
            :data:`DRAFTED_SUMS`.
        group: the process group (None, or a group of one: this rank's own sums).

    Returns:
        dict: ``acc`` without the sums, its drafted rates and positions over the group (left out where the group
        has no verify step).
    """
    sum_names = [n for pair in DRAFTED_SUMS.values() for n in pair]
    # a rate without its sums (not the probe's) stays as it is
    keep = {key for key, pair in DRAFTED_SUMS.items() if key in acc and not all(n in acc for n in pair)}
    out = {k: v for k, v in acc.items() if k not in sum_names}
    sums = torch.tensor([float(acc.get(n, 0.0)) for n in [*sum_names, DRAFTED_POSITIONS_KEY]], dtype=torch.float64)
    if group_size(group) > 1:
        # a group without a CPU backend (NCCL alone) reduces device tensors; verl's "cpu:gloo,cuda:nccl" takes these
        if "gloo" not in str(torch.distributed.get_backend(group)):
            sums = sums.to(torch.device("cuda", torch.cuda.current_device()))
        sums = _all_reduce(sums, torch.distributed.ReduceOp.SUM, group).cpu()
    for i, key in enumerate(DRAFTED_SUMS):
        accepted, steps = float(sums[2 * i]), float(sums[2 * i + 1])
        if key in keep:
            continue
        if steps > 0:
            out[key] = accepted / steps
        else:
            out.pop(key, None)
    if float(sums[-1]) > 0:
        out[DRAFTED_POSITIONS_KEY] = float(sums[-1])
    return out


def _shifted_exp(logits: torch.Tensor, temperature: float, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x - m, exp(x - m), z)`` for ``x = logits / T`` in float32, ``m`` the row max and ``z`` the row sum of
    ``exp(x - m)`` over the whole (possibly vocab-sharded, reduced over ``group``) vocabulary."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    m = x.amax(dim=-1, keepdim=True)
    if group_size(group) > 1:
        m = _all_reduce(m, torch.distributed.ReduceOp.MAX, group)
    x = x - m
    e = torch.exp(x)
    z = e.sum(dim=-1, keepdim=True)
    if group_size(group) > 1:
        z = _all_reduce(z, torch.distributed.ReduceOp.SUM, group)
    return x, e, z


def _probs(logits: torch.Tensor, temperature: float, group) -> torch.Tensor:
    """``softmax(logits / T)`` in float32; with ``group`` the last dim is a vocabulary shard."""
    if group_size(group) == 1:
        x = logits.float()
        return torch.softmax(x / temperature if temperature != 1.0 else x, dim=-1)
    _, e, z = _shifted_exp(logits, temperature, group)
    return e / z


def vocab_parallel_log_softmax(logits: torch.Tensor, temperature: float, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(logits / T), softmax(logits / T))`` in float32 over a possibly vocab-sharded last dim.

    Args:
        logits (Tensor): ``[..., V]`` or this rank's shard ``[..., V/tp]`` (megatron's contiguous split).
        temperature (float): ``T > 0``.
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard.

    Returns:
        tuple[Tensor, Tensor]: both ``[..., V/tp]`` float32, normalised over the whole vocabulary.
    """
    x, e, z = _shifted_exp(logits, temperature, group)
    return x - torch.log(z), e / z


def _argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Global argmax (first maximal index, as ``torch.argmax``) over a possibly vocab-sharded last dim."""
    if group_size(group) == 1:
        return logits.max(dim=-1).indices  # same first-index tie rule as argmax; faster on CPU
    x = logits.float()
    local_max, local_idx = x.max(dim=-1)
    offset = torch.distributed.get_rank(group=group) * x.shape[-1]
    global_max = _all_reduce(local_max.clone(), torch.distributed.ReduceOp.MAX, group)
    big = torch.iinfo(torch.int64).max
    cand = torch.where(local_max == global_max, local_idx + offset, torch.full_like(local_idx, big))
    return _all_reduce(cand, torch.distributed.ReduceOp.MIN, group)


@torch.no_grad()
def acceptance_stats(
    p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(overlap, greedy agreement, argmax-draft acceptance), each ``[...]`` float32, sharing the softmaxes; computed
    :func:`chunk_rows` rows at a time (each row on its own, so the result does not depend on the chunking)."""
    shape, v = p_logits.shape[:-1], p_logits.shape[-1]
    p2, q2 = p_logits.reshape(-1, v), q_logits.reshape(-1, v)
    n, step = p2.shape[0], chunk_rows(v)
    out = [torch.empty(n, dtype=torch.float32, device=p_logits.device) for _ in range(3)]
    for i in range(0, n, step):
        for o, x in zip(out, _acceptance_stats_rows(p2[i : i + step], q2[i : i + step], temperature, group)):
            o[i : i + step] = x
    return tuple(o.reshape(shape) for o in out)


def _acceptance_stats_rows(p_logits, q_logits, temperature, group):
    p_arg, q_arg = _argmax(p_logits, group), _argmax(q_logits, group)
    greedy = (p_arg == q_arg).float()
    if temperature == 0.0:
        return greedy, greedy, greedy
    p = _probs(p_logits, temperature, group)
    draft = _pick(p, q_arg, group)
    q = _probs(q_logits, temperature, group)
    overlap = torch.minimum(p, q, out=q).sum(dim=-1)
    if group_size(group) > 1:
        overlap = _all_reduce(overlap, torch.distributed.ReduceOp.SUM, group)
    return overlap.clamp_(0.0, 1.0), greedy, draft


def _pick(p: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """``p[..., index]`` for a global vocabulary ``index`` over a possibly vocab-sharded last dim."""
    if group_size(group) == 1:
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
    t = check_temperature(temperature)
    if t == 0.0:
        return greedy_agreement(p_main_logits, q_mtp_logits, group=group)
    p = _probs(p_main_logits, t, group)
    q = _probs(q_mtp_logits, t, group)
    overlap = torch.minimum(p, q).sum(dim=-1)
    if group_size(group) > 1:
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
    t = check_temperature(temperature)
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


def rows_at(chunk: torch.Tensor, bi: torch.Tensor, ti: torch.Tensor, seq_group=None) -> torch.Tensor:
    """Rows ``chunk[ti, bi]`` -> ``[n, h]`` of a ``[s, b, h]`` hidden state.

    With ``seq_group`` (sequence parallelism) ``chunk`` is this rank's contiguous sequence shard
    ``[s/tp, b, h]`` (megatron's ``scatter_to_sequence_parallel_region``: rank ``r`` holds positions
    ``[r*s/tp, (r+1)*s/tp)``); each rank fills the rows it owns and a sum over the group completes
    them, so every rank returns all ``n`` rows.
    """
    if seq_group is None or group_size(seq_group) == 1:
        return chunk[ti, bi]
    s_local = chunk.shape[0]
    local = ti - torch.distributed.get_rank(group=seq_group) * s_local
    owned = (local >= 0) & (local < s_local)
    rows = chunk[local.clamp(0, s_local - 1), bi] * owned.unsqueeze(-1).to(chunk.dtype)
    return _all_reduce(rows.contiguous(), torch.distributed.ReduceOp.SUM, seq_group)


def draft_schedule(accept: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected verify steps of speculative decoding along responses, and the drafts they accept.

    vLLM drafts ``k`` tokens from each verify step's start: a response's first start is the position after the
    prefill produced its first token; from a start ``j`` the ``d``-th draft is accepted (the ones before it
    accepted) with probability ``accept[j, d-1]``; ``m < k`` accepted drafts move the next start ``m + 1``
    positions on (the target's own token follows the first rejection), all ``k`` accepted move it ``k + 1``
    (the bonus token). So a position where drafts fail is a start more often than one where they pass, and
    vLLM's per-draft rates average over starts, not over positions: the mean of ``accept`` over all positions
    overstates them wherever hard positions cluster. Exact in expectation given these per-start probabilities; the
    trainer's depth ``d >= 2`` values condition on the response's own token after an accepted draft, which is the
    draft's token but drawn from ``p``, not from the accepted drafts' ``min(p, q) / alpha``: an approximation there.

    Args:
        accept (Tensor): ``[R, L, k]`` in ``[0, 1]``: response ``r``'s draft ``d`` from start ``j`` accepted given
            the drafts before it were (the trainer's depth-``d`` acceptance at that start, on the response's own
            tokens, which are the drafts wherever they were accepted); 0 where the draft cannot be verified.
        lengths (Tensor): ``[R]`` starts each response has (drafting positions, :func:`response_runs`); positions
            ``>= lengths[r]`` are padding.

    Returns:
        tuple[Tensor, Tensor]: ``starts [R, L]`` (expected verify steps starting at each position, float32) and
        ``accepted [R, L, k]`` (expected accepted drafts of index ``d`` from each start). vLLM's rate at draft
        index ``d``: ``accepted[..., d].sum() / starts.sum()``.
    """
    if accept.dim() != 3:
        raise ValueError(f"accept must be [responses, positions, k], got shape {tuple(accept.shape)}")
    import numpy as np

    a = accept.detach().float().clamp(0.0, 1.0).cpu()
    r, n, k = a.shape
    live = torch.arange(n).unsqueeze(0) < lengths.cpu().unsqueeze(1)
    passed = torch.cumprod(a, dim=-1) * live.unsqueeze(-1)  # [R, L, k]: drafts 1..d all accepted
    # P(advance m): m = 1..k after the (m)-th draft fails (the earlier ones passed), k + 1 after all pass
    before = torch.cat([torch.ones_like(passed[..., :1]), passed[..., :-1]], dim=-1)
    advance = torch.cat([before - passed, passed[..., -1:]], dim=-1).numpy()  # [R, L, k + 1]
    mask = live.numpy().astype(np.float32)
    v = np.zeros((r, n + k + 1), dtype=np.float32)
    v[:, 0] = 1.0
    for j in range(n):  # sequential along the response; numpy keeps a step to a few microseconds
        vj = v[:, j] * mask[:, j]
        v[:, j] = vj
        v[:, j + 1 : j + k + 2] += vj[:, None] * advance[:, j]
    starts = torch.from_numpy(v[:, :n].copy()).to(accept.device)
    return starts, starts.unsqueeze(-1) * passed.to(accept.device)


def response_runs(valid: torch.Tensor) -> list[tuple[int, int, int]]:
    """The responses of a ``[b, s]`` layout as runs of drafting positions: ``(row, first, length)`` per maximal
    run of ``valid`` (:func:`acceptance_positions` at depth 1), in row-major order. A packed (THD) row holds one
    run per sequence (every sequence begins with a prompt token, so runs never join)."""
    if valid.dim() != 2:
        raise ValueError(f"valid must be [b, s], got shape {tuple(valid.shape)}")
    m = valid.bool().cpu()
    edges = torch.diff(m.to(torch.int8), dim=1, prepend=torch.zeros(m.shape[0], 1, dtype=torch.int8))
    out = []
    for row in range(m.shape[0]):
        firsts = (edges[row] == 1).nonzero().flatten().tolist()
        lasts = (edges[row] == -1).nonzero().flatten().tolist()
        ends = lasts + ([m.shape[1]] if len(lasts) < len(firsts) else [])
        out += [(row, f, e - f) for f, e in zip(firsts, ends)]
    return out
