"""The MTP block's training objective in online and joint modes.

Chosen in the recipe with ``ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_OBJECTIVE: hard_ce | soft_ce | tv |
chained_tv``
(:data:`~verl_mtp_plugin.config_keys.OBJECTIVE_CONFIG_KEY`; checked at start-up, read by the plugin engine in every
worker; why not under ``actor_rollout_ref.model.mtp``: see :data:`~verl_mtp_plugin.config_keys.OBJECTIVE_ENV`).

Alignment (megatron-core 0.19.2, as in :mod:`verl_mtp_plugin.acceptance`): MTP depth ``d`` (1-based) at
position ``t`` predicts token ``t+1+d``; the main head at position ``t+d`` predicts that same token. So
depth ``d``'s target at position ``t`` is the policy's distribution ``p = softmax(z_main[t+d] / T)``,
detached, from the same train forward, and the drafter's is ``q = softmax(z_mtp_d[t] / T)``, with ``T``
the rollout temperature (vLLM's probabilistic drafting applies it to both). Positions count exactly where
megatron's own MTP loss counts them: the predicted token ``t+1+d`` is a response token (megatron rolls
the token-coordinate loss mask ``d+1`` times, within each packed sequence under THD).

Objectives, per counted position:

* ``hard_ce``: megatron's own ``-log q_1[x_{t+1+d}]`` on the sampled token (megatron's loss; only its logits are
  read in chunks, see Memory).
* ``soft_ce``: forward ``KL(p || q) = sum_v p_v (log p_v - log q_v)``; its gradient is that of the soft
  cross-entropy ``-sum_v p_v log q_v``: ``dL/dz_mtp = (q - p) / T``. The logged value is the KL (0 for a
  drafter that matches the policy), not the cross-entropy (which adds the policy's entropy).
* ``tv``: ``1 - sum_v min(p_v, q_v)``, one minus the acceptance probability of probabilistic drafting
  (:func:`verl_mtp_plugin.acceptance.speculative_overlap`); ``dL/dz_mtp_w = (q_w / T) (S - [q_w < p_w])``
  with ``S = sum_v q_v [q_v < p_v]``. Each depth on its own.
* ``chained_tv`` (end-to-end TV): the chain vLLM's accepted length rewards, where the ``d``-th draft counts only
  if the earlier ones were accepted. With ``alpha_i = sum_v min(p_i, q_i)`` the acceptance at depth ``i`` (same
  position ``t``), depth ``d``'s term is ``1 - prod_{i<=d} alpha_i`` (one minus the probability that the first
  ``d`` drafts are all accepted), counted where megatron counts depth ``d``; megatron's mean over the depths
  makes the loss ``1 - (1/D) sum_d E[prod_{i<=d} alpha_i]``, i.e. ``1 - E[accepted drafts] / D``. The gradient
  reaches every depth ``i <= d`` through the product (:func:`chained_tv_per_token`). A depth whose target
  token megatron does not count at ``t`` (a prompt token, a masked tool output) is not drafted by the rollout:
  it enters the product as 1 (accepted). A counted depth ``d`` at ``t`` has token ``t+1+d`` in ``t``'s own
  sequence (megatron's roll within each packed sequence), so the product never chains across sequences.

All are exact under tensor parallelism: the softmaxes and the sums over the vocabulary are reduced over
the tensor-parallel group (vocabulary shards, megatron's contiguous split), and each rank's gradient is
that of the full-vocabulary loss with respect to its own shard.

Memory: ``soft_ce`` / ``tv`` (and so ``chained_tv``, whose chain is a product of per-row numbers) run on
:func:`~verl_mtp_plugin.acceptance.estimate.chunk_rows` tokens at a time, forward and backward (backward recomputes
each chunk's softmaxes from per-row numbers the forward kept), so their float32 intermediates are one chunk's
``[rows, V/tp]`` (:data:`~verl_mtp_plugin.acceptance.estimate.CHUNK_BYTES`, 256 MiB), not several
``[tokens, V/tp]``. The policy's target logits are never whole either (:class:`TargetLogits`): each chunk's rows
are the output layer's product of that chunk of the main hidden states, in forward and again in backward. What stays
alive until backward beyond ``hard_ce``: a few float32 numbers per token (measured on CPU: the bytes saved for
backward equal ``hard_ce``'s; the whole target kept one ``[tokens, V/tp]`` tensor more, 4.5 GiB in bf16 at 18,432
tokens x 131072 at TP 1). Every tensor-parallel rank cuts the same chunks, so the vocabulary reductions pair up
chunk by chunk. The logged hard cross-entropy runs in the same chunks (:func:`_chunked_hard_ce`).

The MTP depths' own logits are never whole for the loss either, for every objective, ``hard_ce`` included: megatron's
``process_mtp_loss`` receives the plugin's MTP output layer (:class:`_MTPHead`, through
:func:`~verl_mtp_plugin.compat.megatron_mtp_head.replace_mtp_output_layer`), which returns the depth's logits
computed without autograd (megatron's top-1 accuracy reads them; released when the next depth's are computed) and
keeps the depth's :class:`HeadLogits` (hidden states x detached output weight); the loss's forward reads those logits
chunk by chunk and keeps none of them, its backward computes each chunk again from the hidden states (:class:`_HardCE`;
the objectives' ``q``): one output-layer product per depth more than megatron's, in backward. Measured on CPU: what any objective saves for backward
over MTP skipped no longer depends on the vocabulary. Joint mode (the output weight trains) reads them in chunks too:
the backward also sums the output weight's gradient ``dz^T h`` chunk by chunk (:class:`_WeightGrad`) and delivers it
as megatron's layer delivers its own (into ``main_grad`` under gradient-accumulation fusion, else through autograd;
:mod:`verl_mtp_plugin.compat.megatron_mtp_head`). An output layer that is more than a matmul, or whose weight
gradient megatron delivers otherwise, keeps megatron's whole-logits path.

How it reaches megatron: HybridModel's forward hands its bound ``compute_language_model_loss`` to
``process_mtp_loss``, which calls it once per depth (``labels [b, s]``, MTP logits ``[s, b, V/tp]``),
masks the result and attaches its gradient through ``MTPLossAutoScaler`` (``chained_tv``: depth ``d``'s
value depends on the logits of depths ``1..d``, so its backward reaches the earlier depths too).
:func:`mtp_objective_scope` shadows that method on the model instance for one forward and returns ``objective + (hard_ce -
objective).detach()``: the gradient is the objective's, the value megatron's tracker records stays the
hard cross-entropy, so ``mtp_losses/mtp_{k}_loss`` keeps verl's meaning for every objective; the
objective's own value is logged as ``mtp_objective/mtp_{k}_{objective}`` (:data:`OBJECTIVE_KEY`). The
target logits cost output-layer products of the main hidden states (per depth, once in forward and once in
backward: 2 per depth instead of one whole product per micro-batch), under ``no_grad`` with the output weight
detached: the policy's target never sends a gradient anywhere, so what
the MTP gradient reaches is what megatron's own loss reaches (online: the MTP block only, with
``mtp_detach_heads``; joint: the trunk and output layer too, through ``q``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from functools import partial

import torch

from verl_mtp_plugin.acceptance.estimate import _all_reduce, check_temperature, chunk_rows, group_size
from verl_mtp_plugin.compat.megatron_loss import replace_language_model_loss
from verl_mtp_plugin.compat.megatron_mtp_head import (
    accumulate_weight_grad,
    mark_weight_grad_added,
    replace_mtp_output_layer,
    weight_grad_buffer,
    weight_grad_unsupported,
)
from verl_mtp_plugin.config_keys import OBJECTIVE_CONFIG_KEY
from verl_mtp_plugin.policy import MTPObjective

__all__ = [
    "OBJECTIVE_KEY",
    "collect_objective_metrics",
    "mtp_objective_scope",
    "objective_per_token",
    "reset_objective_metrics",
    "chained_tv_per_token",
    "soft_ce_per_token",
    "tv_per_token",
]

logger = logging.getLogger(__name__)

#: The objective's value at depth ``k`` (verl logs it as ``actor/mtp_objective/mtp_{k}_{objective}``).
OBJECTIVE_KEY = "mtp_objective/mtp_{k}_{objective}"


# --------------------------------------------------------------------------------------------------
# the math on logits


def _sum_vocab(x: torch.Tensor, group) -> torch.Tensor:
    s = x.sum(dim=-1)
    return _all_reduce(s, torch.distributed.ReduceOp.SUM, group) if group_size(group) > 1 else s


def _softmax_rows(logits: torch.Tensor, temperature: float, group, stats=None):
    """``(x - m, softmax(x), (m, z))`` in float32 for ``x = logits / T`` over the (possibly vocab-sharded) rows:
    ``m`` the row max, ``z`` the row sum of ``exp(x - m)``. With ``stats`` (a forward's ``(m, z)``) no collective
    runs and the result is bitwise the forward's (the same element-wise operations on the same inputs)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if stats is None:
        m = x.amax(dim=-1, keepdim=True)
        if group_size(group) > 1:
            m = _all_reduce(m, torch.distributed.ReduceOp.MAX, group)
    else:
        m = stats[0]
    x = x - m
    e = torch.exp(x)
    if stats is None:
        z = e.sum(dim=-1, keepdim=True)
        if group_size(group) > 1:
            z = _all_reduce(z, torch.distributed.ReduceOp.SUM, group)
    else:
        z = stats[1]
    return x, e.div_(z), (m, z)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` as ``[N, V]`` (a view when contiguous)."""
    return x.reshape(-1, x.shape[-1])


class TargetLogits:
    """The main head's logits ``[s, b, V/tp]`` as a source of row chunks, never whole: each read is the output
    layer's product of a chunk of the main hidden states (``F.linear`` with the output weight, as megatron's
    ``ColumnParallelLinear`` computes its vocabulary shard), then ``_scale_logits``; detached. Under sequence
    parallelism the hidden states are gathered first (``[s, b, h]``: small). Index the first dimension with a slice
    to shift it (``target[d:]``: positions ``t + d``)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, scale):
        self.hidden, self.weight, self.scale = hidden, weight, scale
        self.shape = (*hidden.shape[:-1], weight.shape[0])

    @classmethod
    def of(cls, inner, main_hidden: torch.Tensor):
        """For HybridModel ``inner``'s output layer, or ``None`` where it does more than a matmul (a bias, a
        gathered vocabulary): the caller then computes the whole logits."""
        layer = inner.output_layer
        if getattr(layer, "bias", None) is not None or getattr(layer, "gather_output", False):
            return None
        weight = inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights else layer.weight
        with torch.no_grad():
            hidden = main_hidden.detach()
            if getattr(layer, "sequence_parallel", False):
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                              group=layer.tp_group)
        return cls(hidden, weight.detach(), inner._scale_logits)

    def __getitem__(self, index) -> "TargetLogits":
        if not isinstance(index, slice):
            raise TypeError("TargetLogits is indexed by a slice of its first dimension")
        return TargetLogits(self.hidden[index], self.weight, self.scale)

    def rows(self, chunk: slice) -> torch.Tensor:
        """Rows ``chunk`` of the ``[N, V/tp]`` view (``N = s * b``, position-major as ``_rows``)."""
        with torch.no_grad():
            h = self.hidden.reshape(-1, self.hidden.shape[-1])[chunk]
            return self.scale(torch.nn.functional.linear(h, self.weight))


def _row_reader(p):
    """``chunk -> [rows, V]`` for a logits tensor or a :class:`TargetLogits`."""
    if isinstance(p, TargetLogits):
        return p.rows
    p2 = _rows(p)
    return lambda chunk: p2[chunk]


def _q_reader(q_in: torch.Tensor, weight: torch.Tensor | None, logits: torch.Tensor | None = None):
    """``(chunk -> [rows, V/tp] logits, rows N, V/tp)`` for MTP logits, or for MTP hidden states times ``weight``
    (rows of ``logits``, that product already computed without autograd, where given: the forward reads them)."""
    if weight is None:
        q2 = _rows(q_in)
        return (lambda chunk: q2[chunk]), q2.shape[0], q2.shape[-1]
    h2 = _rows(q_in)
    if logits is not None:
        z2 = _rows(logits)
        return (lambda chunk: z2[chunk]), h2.shape[0], weight.shape[0]
    return (lambda chunk: torch.nn.functional.linear(h2[chunk], weight)), h2.shape[0], weight.shape[0]


class HeadLogits:
    """An MTP depth's logits ``[s, b, V/tp]`` as a source of row chunks, never whole: the output layer's product of
    the depth's hidden states (in the autograd graph, entered into the vocabulary-parallel region as megatron's
    ``ColumnParallelLinear`` enters it) and the output weight (detached: online's ``mtp_detach_heads``). The
    objectives (and ``hard_ce``, :class:`_HardCE`) differentiate through it to the hidden states, chunk by chunk.
    Index the first dimension with a slice (``q[: s - d]``). ``logits``: the same product already computed without
    autograd (megatron's accuracy reads it), read by the forward instead of a second product; never saved for
    backward, which computes each chunk again from the hidden states."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor | None = None,
                 main_grad: torch.Tensor | None = None):
        self.hidden, self.weight, self.logits, self.main_grad = hidden, weight, logits, main_grad
        self.shape = (*hidden.shape[:-1], weight.shape[0])
        if logits is not None and tuple(logits.shape) != self.shape:
            raise ValueError(f"HeadLogits: logits {tuple(logits.shape)} are not hidden x weight {self.shape}")

    def __getitem__(self, index) -> "HeadLogits":
        if not isinstance(index, slice):
            raise TypeError("HeadLogits is indexed by a slice of its first dimension")
        return HeadLogits(self.hidden[index], self.weight, None if self.logits is None else self.logits[index],
                          self.main_grad)

    def with_logits(self, logits: torch.Tensor) -> "HeadLogits":
        return HeadLogits(self.hidden, self.weight, logits.detach(), self.main_grad)


class _WeightGrad:
    """The output weight's gradient of one MTP depth's chunked loss (joint mode: the weight trains), summed chunk by
    chunk: ``dz^T @ h`` per chunk of rows, the inputs in the weight's dtype (half on the GPU: the GEMM runs as
    megatron's own weight gradient does), summed in float32. Straight into ``main_grad`` where megatron's output layer
    adds its own there (gradient-accumulation fusion, :func:`~verl_mtp_plugin.compat.megatron_mtp_head.
    weight_grad_buffer`) and that buffer is float32; into one float32 buffer otherwise, added to a half ``main_grad``
    once, or returned to autograd in the weight's dtype (megatron DDP's hook adds ``param.grad``)."""

    def __init__(self, weight: torch.Tensor, main_grad: torch.Tensor | None):
        self.weight, self.main_grad = weight, main_grad
        if main_grad is not None and main_grad.dtype == torch.float32:
            self.buf = main_grad
        else:
            self.buf = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                   device=weight.device)

    def add(self, dz: torch.Tensor, h: torch.Tensor) -> None:
        """``dz`` [rows, V/tp] and ``h`` [rows, h], both in the weight's dtype."""
        accumulate_weight_grad(self.buf, h, dz)

    def result(self) -> torch.Tensor | None:
        """What the autograd Function returns for the weight."""
        if self.main_grad is not None:
            if self.buf is not self.main_grad:
                self.main_grad.add_(self.buf)
            return mark_weight_grad_added(self.weight)  # megatron's placeholder (or None without DDP's flag)
        return self.buf if self.buf.dtype == self.weight.dtype else self.buf.to(self.weight.dtype)


class _HardCE(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy ``log sum_v exp(z_v) - z_label`` per row, of the logits ``z =
    F.linear(hidden, weight)``, computed :func:`chunk_rows` rows at a time in forward and again in backward: no
    ``[rows, V/tp]`` tensor outlives its chunk. Saved for backward: the hidden states (held anyway), the detached
    weight and two float32 numbers per row. Gradient to the hidden states only (``(softmax(z) - onehot) @ W``)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, logits=None, main_grad=None):
        h2 = _rows(hidden)
        n, v = h2.shape[0], weight.shape[0]
        z_rows, _, _ = _q_reader(hidden, weight, logits)
        start = torch.distributed.get_rank(group) * v if group_size(group) > 1 else 0  # megatron's contiguous split
        local = labels.reshape(-1) - start
        inside = (local >= 0) & (local < v)
        local = torch.where(inside, local, torch.zeros_like(local))
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        stats = torch.empty(2, n, 1, dtype=torch.float32, device=hidden.device)  # row max, row sum of exp
        step = chunk_rows(v)
        for i in range(0, n, step):
            c = slice(i, i + step)
            x, p, (m, z) = _softmax_rows(z_rows(c), 1.0, group)
            del p
            picked = torch.where(inside[c], x.gather(1, local[c, None]).squeeze(1), torch.zeros_like(x[:, 0]))
            if group_size(group) > 1:
                picked = _all_reduce(picked, torch.distributed.ReduceOp.SUM, group)
            loss[c] = z.squeeze(1).log() - picked  # log sum exp(z - m) - (z_label - m)
            stats[0, c], stats[1, c] = m, z
            del x
        ctx.save_for_backward(hidden, weight, local, inside, stats)
        ctx.main_grad = main_grad
        return loss

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, local, inside, stats = ctx.saved_tensors
        h2, grad = _rows(hidden), grad.reshape(-1, 1).float()
        n, step = h2.shape[0], chunk_rows(weight.shape[0])
        out = torch.empty_like(h2)
        wgrad = _WeightGrad(weight, ctx.main_grad) if ctx.needs_input_grad[1] else None  # joint: the weight trains
        for i in range(0, n, step):
            c = slice(i, i + step)
            _, p, _ = _softmax_rows(torch.nn.functional.linear(h2[c], weight), 1.0, None, (stats[0, c], stats[1, c]))
            rows = torch.arange(p.shape[0], device=p.device)
            p[rows, local[c]] -= inside[c].to(p.dtype)
            dz = p.mul_(grad[c]).to(weight.dtype)
            out[c] = dz @ weight
            if wgrad is not None:
                wgrad.add(dz, h2[c])
            del p, dz
        return (out.reshape(hidden.shape), None if wgrad is None else wgrad.result(), None, None, None, None)


def hard_ce_per_token(q: HeadLogits, labels: torch.Tensor, *, group=None) -> torch.Tensor:
    """Megatron's MTP cross-entropy ``[b, s]`` (``compute_language_model_loss``: labels ``[b, s]``, logits ``[s, b,
    V/tp]``) of an MTP depth's :class:`HeadLogits`, read in chunks (:class:`_HardCE`); exact under tensor
    parallelism (vocabulary shards, megatron's contiguous split)."""
    s, b = q.shape[0], q.shape[1]
    value = _HardCE.apply(q.hidden, q.weight, labels.transpose(0, 1).reshape(-1), group, q.logits, q.main_grad)
    return value.reshape(s, b).transpose(0, 1)


def _detached(p):
    return p if isinstance(p, TargetLogits) else p.detach()


class _ChunkedObjective(torch.autograd.Function):
    """A per-row objective of ``(q_logits, p_logits)`` computed :func:`chunk_rows` rows at a time, in forward and in
    backward: only one chunk's float32 ``[rows, V/tp]`` intermediates are alive at once. Saved for backward: the
    two logits tensors the caller holds anyway (no copy) and a few float32 numbers per row (softmax max and sum,
    the objective's row sums); backward recomputes each chunk's softmaxes from them, bitwise the forward's, with no
    collective. Under tensor parallelism every rank cuts the same chunks (same rows, same shard width), so the
    per-chunk vocabulary reductions pair up across ranks. Subclasses give ``_forward_rows`` / ``_grad_rows``."""

    @staticmethod
    def _forward_rows(q, log_q, p, log_p, group):  # -> (value [n], extra row stats [n] or None)
        raise NotImplementedError

    @staticmethod
    def _grad_rows(q, p, extra, temperature):  # -> dL/dz_q of the value, [n, V/tp] float32
        raise NotImplementedError

    @classmethod
    def forward(cls, ctx, q_in, p_logits, temperature, group, q_weight=None, q_logits=None, q_main_grad=None):
        # q_in: the MTP logits [..., V/tp], or (q_weight given) the MTP hidden states [..., h] whose logits are
        # F.linear(hidden, q_weight), read from q_logits (computed without autograd) or computed chunk by chunk in
        # forward, and computed again in backward (HeadLogits)
        q_rows, n, v = _q_reader(q_in, q_weight, q_logits)
        p_rows, step = _row_reader(p_logits), chunk_rows(v)
        value = torch.empty(n, dtype=torch.float32, device=q_in.device)
        stats = torch.empty(5, n, 1, dtype=torch.float32, device=q_in.device)  # m_q, z_q, m_p, z_p, extra
        for i in range(0, n, step):
            xq, q, (mq, zq) = _softmax_rows(q_rows(slice(i, i + step)), temperature, group)
            xp, p, (mp, zp) = _softmax_rows(p_rows(slice(i, i + step)), temperature, group)
            v, extra = cls._forward_rows(q, xq.sub_(zq.log()), p, xp.sub_(zp.log()), group)
            value[i : i + step] = v
            for j, t in enumerate((mq, zq, mp, zp)):
                stats[j, i : i + step] = t
            if extra is not None:
                stats[4, i : i + step, 0] = extra
            del xq, q, xp, p
        # what backward reads: q's source (the logits or the hidden states + weight, held by the caller anyway),
        # the per-row numbers, and p whole only where it was given whole (a TargetLogits is read again in chunks)
        ctx.p_source = p_logits if isinstance(p_logits, TargetLogits) else None
        ctx.has_weight = q_weight is not None
        ctx.save_for_backward(q_in, stats, *(() if q_weight is None else (q_weight,)),
                              *(() if ctx.p_source is not None else (p_logits,)))
        ctx.temperature = temperature
        ctx.main_grad = q_main_grad
        shape = q_in.shape[:-1]
        return value.reshape(shape)

    @classmethod
    def backward(cls, ctx, grad):
        saved = list(ctx.saved_tensors)
        q_in, stats = saved[0], saved[1]
        q_weight = saved[2] if ctx.has_weight else None
        p_logits = ctx.p_source if ctx.p_source is not None else saved[-1]
        t = ctx.temperature
        q_rows, n, v = _q_reader(q_in, q_weight)
        p_rows, grad = _row_reader(p_logits), grad.reshape(-1, 1).float()
        step = chunk_rows(v)
        h2 = _rows(q_in)
        out = torch.empty_like(h2)
        # joint mode: the output weight trains (its gradient dz^T @ h, chunk by chunk)
        wgrad = _WeightGrad(q_weight, ctx.main_grad) if q_weight is not None and ctx.needs_input_grad[4] else None
        for i in range(0, n, step):
            c = slice(i, i + step)
            _, q, _ = _softmax_rows(q_rows(c), t, None, (stats[0, c], stats[1, c]))
            _, p, _ = _softmax_rows(p_rows(c), t, None, (stats[2, c], stats[3, c]))
            dz = cls._grad_rows(q, p, stats[4, c], t).mul_(grad[c])
            del q, p
            if q_weight is None:
                out[c] = dz
            else:  # through the output layer
                dz = dz.to(q_weight.dtype)
                out[c] = dz @ q_weight
                if wgrad is not None:
                    wgrad.add(dz, h2[c])
            del dz
        return (out.reshape(q_in.shape), None, None, None, None if wgrad is None else wgrad.result(), None, None)


class _SoftCE(_ChunkedObjective):
    @staticmethod
    def _forward_rows(q, log_q, p, log_p, group):
        kl = _sum_vocab(torch.where(p > 0, p * log_p.sub_(log_q), torch.zeros_like(p)), group)
        return kl, None

    @staticmethod
    def _grad_rows(q, p, extra, temperature):
        return q.sub_(p).div_(temperature)


class _TV(_ChunkedObjective):
    @staticmethod
    def _forward_rows(q, log_q, p, log_p, group):
        below = q < p
        s = _sum_vocab(q * below, group)
        overlap = _sum_vocab(torch.minimum(p, q), group)
        return (1.0 - overlap).clamp_(0.0, 1.0), s

    @staticmethod
    def _grad_rows(q, p, extra, temperature):  # extra: S = sum_v q_v [q_v < p_v]
        below = q < p
        return q.mul_(extra - below.float()).div_(temperature)


def _check(q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float) -> float:
    if tuple(q_logits.shape) != tuple(p_logits.shape):
        raise ValueError(
            f"MTP logits {tuple(q_logits.shape)} and the policy's target logits {tuple(p_logits.shape)} must have the "
            "same shape [..., V] (align them first: q at t, p at t+d)"
        )
    t = check_temperature(temperature)
    if t == 0.0:
        raise ValueError(f"{OBJECTIVE_CONFIG_KEY} soft_ce / tv / chained_tv need a rollout temperature > 0 (got 0: "
                         "greedy rollout)")
    return t


def _apply(fn, q_logits, p_logits, temperature: float, group):
    if isinstance(q_logits, HeadLogits):  # differentiable in the hidden states (autograd sees tensors only)
        return fn.apply(q_logits.hidden, _detached(p_logits), temperature, group, q_logits.weight, q_logits.logits,
                        q_logits.main_grad)
    return fn.apply(q_logits, _detached(p_logits), temperature, group)


def soft_ce_per_token(q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float = 1.0, *, group=None):
    """Forward ``KL(p || q)`` per row, differentiable in ``q_logits`` only (``p`` is the detached target).

    Args:
        q_logits (Tensor | HeadLogits): ``[..., V]`` (or the vocab shard ``[..., V/tp]``) MTP logits (a
            :class:`HeadLogits` is read chunk by chunk from the hidden states, never whole).
        p_logits (Tensor | TargetLogits): same shape, the policy's (main head's) logits for the same tokens (a
            :class:`TargetLogits` is read chunk by chunk, never whole).
        temperature (float): ``T > 0`` for both distributions.
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard.

    Returns:
        Tensor: ``[...]`` float32, ``>= 0``; backward gives ``(q - p) / T`` per logit.
    """
    return _apply(_SoftCE, q_logits, p_logits, _check(q_logits, p_logits, temperature), group)


def tv_per_token(q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float = 1.0, *, group=None):
    """``1 - sum_v min(p_v, q_v)`` per row (one minus the probabilistic-drafting acceptance), differentiable in
    ``q_logits`` only. Args as :func:`soft_ce_per_token`.

    Returns:
        Tensor: ``[...]`` float32 in ``[0, 1]``.
    """
    return _apply(_TV, q_logits, p_logits, _check(q_logits, p_logits, temperature), group)


def _chain_step(chain: torch.Tensor | None, alpha: torch.Tensor, counted: torch.Tensor | None):
    """One depth of the chain: ``alpha`` (acceptance at this depth) enters the product where ``counted``, else 1.
    Returns ``(1 - product, product)``."""
    factor = alpha if counted is None else torch.where(counted.bool(), alpha, torch.ones_like(alpha))
    chain = factor if chain is None else chain * factor
    return 1.0 - chain, chain


def chained_tv_per_token(q_logits, p_logits, temperature: float = 1.0, *, counted=None, group=None) -> torch.Tensor:
    """``chained_tv`` per row and depth: depth ``d``'s value ``1 - prod_{i<=d} alpha_i`` with ``alpha_i =
    sum_v min(p_i, q_i)``, differentiable in every depth's ``q_logits`` (the product's gradient reaches every
    earlier depth); the ``p`` are detached targets.

    Args:
        q_logits (Sequence[Tensor]): per depth ``d = 1..D``, ``[..., V]`` (or the vocab shard ``[..., V/tp]``) MTP
            logits at the chain's positions (depth ``d`` at position ``t``, aligned with the other depths).
        p_logits (Sequence[Tensor]): per depth, the same shape: the policy's logits for the same tokens.
        temperature (float): ``T > 0`` for every distribution.
        counted (Sequence[Tensor] | None): per depth, ``[...]`` whether megatron counts depth ``d`` there; an
            uncounted depth enters the product as 1 (None: every depth counts).
        group (ProcessGroup | None): tensor-parallel group when the last dim is a vocabulary shard.

    Returns:
        Tensor: ``[D, ...]`` float32 in ``[0, 1]``, non-decreasing in ``d``.
    """
    if len(q_logits) != len(p_logits) or not len(q_logits) or (counted is not None and len(counted) != len(q_logits)):
        raise ValueError("chained_tv needs one q, one p (and one counted mask) per depth, at least one depth")
    chain, values = None, []
    for d, (q, p) in enumerate(zip(q_logits, p_logits)):
        value, chain = _chain_step(chain, 1.0 - tv_per_token(q, p, temperature, group=group),
                                   None if counted is None else counted[d])
        values.append(value)
    return torch.stack(values)


_PER_TOKEN = {MTPObjective.SOFT_CE: soft_ce_per_token, MTPObjective.TV: tv_per_token}


def objective_per_token(objective, q_logits, p_logits, temperature: float = 1.0, *, group=None) -> torch.Tensor:
    """The ``soft_ce`` or ``tv`` objective per row (``hard_ce`` is megatron's own and has no target;
    ``chained_tv`` spans the depths: :func:`chained_tv_per_token`)."""
    objective = MTPObjective.parse(objective, OBJECTIVE_CONFIG_KEY)
    if objective is MTPObjective.CHAINED_TV:
        raise ValueError("chained_tv couples the depths: use chained_tv_per_token (one q and p per depth)")
    if objective not in _PER_TOKEN:
        raise ValueError(f"{objective} is megatron's own loss: it has no per-token target form here")
    return _PER_TOKEN[objective](q_logits, p_logits, temperature, group=group)


# --------------------------------------------------------------------------------------------------
# the objective's value per depth, accumulated over the micro-batches of one pass

_TRACKER: dict[str, torch.Tensor] = {}


def reset_objective_metrics() -> None:
    """Forget the values accumulated so far (start of a pass)."""
    _TRACKER.clear()


def _track(depth: int, num_depths: int, value: torch.Tensor) -> None:
    values = _TRACKER.get("values")
    if values is None or values.numel() != num_depths:
        values = _TRACKER["values"] = torch.zeros(num_depths, dtype=torch.float64, device=value.device)
    values[depth - 1] += value.detach().to(torch.float64)


def collect_objective_metrics(objective, num_microbatches: int = 1, *, group=None, reset: bool = True) -> dict[str, float]:
    """``mtp_objective/mtp_{k}_{objective}``: the mean over micro-batches of each micro-batch's masked mean,
    averaged over ``group`` (the data-parallel group; every rank of it must call), like megatron's MTP loss.

    Returns:
        dict[str, float]: empty when nothing was tracked since the last reset.
    """
    objective = MTPObjective.parse(objective, OBJECTIVE_CONFIG_KEY)
    values = _TRACKER.get("values")
    if reset:
        reset_objective_metrics()
    if values is None:
        return {}
    if group_size(group) > 1:
        values = _all_reduce(values.clone(), torch.distributed.ReduceOp.SUM, group) / group_size(group)
    n = max(int(num_microbatches), 1)
    return {OBJECTIVE_KEY.format(k=i + 1, objective=objective.value): float(v) / n for i, v in enumerate(values)}


# --------------------------------------------------------------------------------------------------
# one forward of the model


def _chunked_hard_ce(hard_ce, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``hard_ce(labels [b, s], logits [s, b, V/tp]) -> [b, s]`` (megatron's per-token cross-entropy) on
    :func:`chunk_rows` tokens at a time, each chunk a copy: megatron's vocab-parallel cross-entropy rewrites float32
    logits in place (``exp(x - max)``), and the objective's backward reads the logits again; its float32 copy of the
    whole ``[s, b, V/tp]`` is one chunk's instead. Exact: the loss is per token, and every tensor-parallel rank cuts
    the same chunks."""
    s, b = logits.shape[0], logits.shape[1]
    step = max(1, chunk_rows(logits.shape[-1]) // max(b, 1))
    if s <= step:
        return hard_ce(labels, logits.clone())
    return torch.cat([hard_ce(labels[:, i : i + step], logits[i : i + step].clone()) for i in range(0, s, step)], dim=1)


def _target_logits(inner, main_hidden: torch.Tensor) -> torch.Tensor:
    """The main head's logits ``[s, b, V/tp]`` from the main hidden states, exactly as HybridModel's forward
    computes them (output layer, shared weight when tied, ``_scale_logits``), detached."""
    weight = inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights else None
    with torch.no_grad():
        logits, _ = inner.output_layer(main_hidden.detach(), weight=None if weight is None else weight.detach())
        return inner._scale_logits(logits)


#: Whether the MTP depths' loss reads their logits chunk by chunk from the hidden states (:class:`_MTPHead`); off
#: only in tests that compare against megatron's whole logits.
CHUNKED_MTP_HEAD = True
_WARNED: set[str] = set()  # the reasons already logged (once per process)


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(getattr(nn_module, "_global_forward_pre_hooks", None) or getattr(nn_module, "_global_forward_hooks", None))


class _MTPHead:
    """The output layer as megatron's ``process_mtp_loss`` calls it for the MTP depths (handed in by
    :func:`~verl_mtp_plugin.compat.megatron_mtp_head.replace_mtp_output_layer`; the main head's call does not come
    here). Where the layer is a plain matmul (no bias, no gathered output, no MuP scale, no hooks on the module, e.g.
    megatron DDP's ``overlap_param_gather``; online's weight is detached, ``mtp_detach_heads``) it returns
    the logits computed under ``no_grad`` (megatron's top-1 accuracy reads them; the loss does not) and keeps the
    depth's :class:`HeadLogits` for the loss to read in chunks; the previous depth's logits are released when the next
    depth's are computed (megatron reads them no more). In joint mode (the weight trains) the chunked loss computes the
    weight's gradient too and delivers it as megatron's layer does (:class:`_WeightGrad`). Elsewhere (a bias, a
    gathered output, MuP, hooks, a weight gradient megatron delivers otherwise) it calls the layer."""

    def __init__(self, layer, inner, state: dict):
        self._layer, self._inner, self._state = layer, inner, state

    def __getattr__(self, name):  # megatron reads the layer's attributes (weight, gather_output, ...)
        return getattr(self._layer, name)

    def _whole_because(self, weight, runtime_gather_output) -> str | None:
        """Why this depth's logits must be computed whole by the layer (None: they are read in chunks)."""
        layer = self._layer
        wgrad_why = weight_grad_unsupported(layer, weight) if weight is not None and weight.requires_grad else None
        reasons = (
            (not CHUNKED_MTP_HEAD, "switched off"),
            (weight is None, "the output layer has no weight"),
            (wgrad_why is not None, f"the output weight trains (joint mode) and {wgrad_why}"),
            (getattr(layer, "bias", None) is not None, "the output layer has a bias"),
            (getattr(layer, "gather_output", False) or runtime_gather_output, "the output layer gathers its output"),
            (getattr(layer, "explicit_expert_comm", False) or getattr(layer, "disable_grad_reduce", False),
             "the output layer skips its tensor-parallel region"),
            (getattr(self._inner.config, "use_mup", False), "MuP scales the MTP logits"),
            (bool(getattr(layer, "_forward_pre_hooks", None) or getattr(layer, "_forward_hooks", None))
             or _global_hooks(), "the output layer has forward hooks (e.g. megatron DDP's overlap_param_gather)"),
        )
        return next((why for hit, why in reasons if hit), None)

    def __call__(self, hidden, weight=None, runtime_gather_output=None):
        layer = self._layer
        prev = self._state.pop("head", None)
        prev = None if prev is None else prev[0]()
        if prev is not None and prev._base is None:
            prev.untyped_storage().resize_(0)  # the previous depth's logits: megatron has read them
        w = weight if weight is not None else getattr(layer, "weight", None)
        why = self._whole_because(w, runtime_gather_output)
        if why is not None:
            if why not in _WARNED and why != "switched off":
                _WARNED.add(why)
                tokens = hidden.shape[0] * hidden.shape[1] * (
                    group_size(getattr(layer, "tp_group", None)) if getattr(layer, "sequence_parallel", False) else 1)
                size = tokens * (w.shape[0] if w is not None else 0) * hidden.element_size()
                logger.warning(
                    "verl_mtp_plugin: the MTP loss computes each depth's logits whole, as megatron does (%s): one "
                    "[tokens, vocab/tp] tensor per depth is kept for backward, %.2f GiB (%d bytes) in this micro-batch",
                    why, size / 2**30, size)
            return layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
        group = getattr(layer, "tp_group", None)
        full = hidden
        if group_size(group) > 1:  # as ColumnParallelLinear enters its region (forward and backward)
            from megatron.core.tensor_parallel import mappings

            if getattr(layer, "sequence_parallel", False):
                full = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                                     group=group)
            else:
                full = mappings.copy_to_tensor_model_parallel_region(hidden, group=group)
        with torch.no_grad():
            logits = torch.nn.functional.linear(full.detach(), w)
        # joint: the loss computes the weight's gradient and delivers it as the layer would
        main_grad = weight_grad_buffer(layer, w) if w.requires_grad else None
        # the logits die with megatron's reference
        self._state["head"] = (weakref.ref(logits), HeadLogits(full, w, main_grad=main_grad))
        return logits, None


@contextlib.contextmanager
def mtp_objective_scope(model, objective, *, temperature: float, loss_mask: torch.Tensor | None,
                        packed_seq_params=None):
    """Within the block, ``model``'s MTP loss is ``objective``, and each MTP depth's loss reads its logits in chunks
    of tokens from the depth's hidden states (:class:`HeadLogits`) where the output layer allows it (:class:`_MTPHead`).

    Args:
        model: a HybridModel (possibly DDP/Float16Module-wrapped) about to run one forward with its MTP block.
        objective (MTPObjective | str): ``hard_ce``, ``soft_ce``, ``tv`` or ``chained_tv``.
        temperature (float): the rollout temperature ``T > 0`` (both distributions; not read for ``hard_ce``).
        loss_mask (Tensor | None): the token-coordinate MTP loss mask the forward receives (``[b, s]``;
            ``[1, T]`` packed; None: every token, as megatron); used to log the objective's masked mean per depth
            and, for ``chained_tv``, to know which depths megatron counts at each position.
        packed_seq_params (PackedSeqParams | None): the forward's THD packing (megatron rolls the mask within
            each packed sequence; so does the logged mean).

    Yields:
        the model. The instance attribute, the hook and megatron's ``process_mtp_loss`` are restored on exit,
        exception or not.
    """
    from verl_mtp_plugin.control import unwrap_model

    objective = MTPObjective.parse(objective, OBJECTIVE_CONFIG_KEY)
    inner = unwrap_model(model)
    mtp = getattr(inner, "mtp", None)
    if mtp is None or not getattr(inner, "post_process", True):
        yield model
        return
    tp_group = getattr(inner, "tp_group", None)
    group = tp_group if group_size(tp_group) > 1 else None
    hard_ce = inner.compute_language_model_loss  # the bound method (what megatron would call)
    state: dict = {}

    def head_of(logits):
        """The depth's HeadLogits where these logits came from :class:`_MTPHead`'s chunked path, else None."""
        head = state.get("head")
        return head[1].with_logits(logits) if head is not None and head[0]() is logits else None

    if objective is MTPObjective.HARD_CE:
        def hard_ce_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            q = head_of(logits)
            return hard_ce(labels, logits) if q is None else hard_ce_per_token(q, labels, group=group)

        with _mtp_head(inner, state), replace_language_model_loss(inner, hard_ce_loss):
            yield model
        return

    t = check_temperature(temperature)
    if t == 0.0:
        raise ValueError(f"{OBJECTIVE_CONFIG_KEY}={objective} needs a rollout temperature > 0 (got 0: greedy rollout)")
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    num_depths = int(inner.config.mtp_num_layers)
    cp_group = getattr(getattr(inner, "pg_collection", None), "cp", None)

    def on_mtp_output(module, args, output):  # [(1+D)*s, b, h]: main hidden states first
        state.clear()
        state["main"] = output.detach().chunk(1 + num_depths, dim=0)[0]
        state["depth"] = 0
        state["mask"] = loss_mask
        state["chain"] = None

    def objective_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # labels [b, s] (token t+1+d at t); logits [s, b, V/tp] of depth d = number of calls so far
        if "main" not in state:
            raise RuntimeError("the MTP loss ran without the MTP block's output (HybridModel forward order changed?)")
        d = state["depth"] = state["depth"] + 1
        if "target" not in state:  # read chunk by chunk; whole only where the output layer does more than a matmul
            state["target"] = TargetLogits.of(inner, state["main"])
            if state["target"] is None:
                state["target"] = _target_logits(inner, state["main"])
        target = state["target"]
        if tuple(target.shape) != tuple(logits.shape):
            raise RuntimeError(f"MTP logits {tuple(logits.shape)} vs main logits {tuple(target.shape)}: gathered "
                               "(runtime_gather_output) MTP logits are not supported by soft_ce / tv / chained_tv")
        q = head_of(logits)
        q = logits if q is None else q  # the depth's logits read in chunks from its hidden states, else whole
        s = logits.shape[0]
        chained = objective is MTPObjective.CHAINED_TV
        mask = state["mask"]
        if mask is None and chained:  # megatron's default: every token
            mask = torch.ones_like(labels)
        if mask is not None:  # depth d's counted positions [b, s], exactly as megatron rolls them
            for _ in range(2 if d == 1 else 1):  # megatron: once for the derived labels, then once per depth
                mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
            state["mask"] = mask
        per_token = tv_per_token if chained else partial(objective_per_token, objective)  # chained: 1 - alpha_d
        value = logits.new_zeros(logits.shape[:2], dtype=torch.float32)  # [s, b]
        if s > d:  # q at t, p at t+d (the same token t+1+d); the last d rows are masked by megatron
            value = torch.cat([per_token(q[: s - d], target[d:], t, group=group), value[s - d:]], dim=0)
        value = value.transpose(0, 1)  # [b, s]
        if chained:  # value was 1 - alpha_d; the chain's term at this depth (alpha_d enters where megatron counts d)
            value, state["chain"] = _chain_step(state["chain"], 1.0 - value, mask)
        with torch.no_grad():  # megatron's cross-entropy per token, a chunk of positions at a time, on a copy
            ce = _chunked_hard_ce(hard_ce, labels, logits)  # [b, s]
        if inner.training and loss_mask is not None:
            n = mask.sum()
            _track(d, num_depths, (value.detach() * mask).sum() * (n > 0) / n.clamp(min=1))
        return value + (ce.to(value.dtype) - value).detach()

    handle = mtp.register_forward_hook(on_mtp_output)
    try:
        with _mtp_head(inner, state), replace_language_model_loss(inner, objective_loss):  # Megatron patches: compat
            yield model
    finally:
        handle.remove()
        state.clear()


@contextlib.contextmanager
def _mtp_head(inner, state: dict):
    """Megatron's MTP loss computes the depths' logits with :class:`_MTPHead` for ``inner`` within the block."""

    def wrap(layer):
        return _MTPHead(layer, inner, state) if layer is getattr(inner, "output_layer", None) else layer

    try:
        with replace_mtp_output_layer(wrap):
            yield
    finally:
        state.pop("head", None)
