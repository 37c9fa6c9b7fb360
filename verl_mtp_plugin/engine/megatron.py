"""verl Megatron engine that drives a Megatron-Core ``HybridModel`` (Nemotron 3) per phase.

:class:`NemotronHMTPMegatronEngine` is a verl ``MegatronEngineWithLMHead`` registered as
``model_type="nemotron_h_mtp"``, ``backend="megatron"`` (:mod:`verl_mtp_plugin.engine.registry`).
It changes five things and inherits everything else (optimizer, checkpoint formats, offload, weight
export, micro-batching, loss post-processing) from verl:

* **Build**: before verl builds the Megatron-Bridge provider it writes the mode's Megatron fields into
  ``override_transformer_config`` (online: ``mtp_detach_heads=True``; off: ``mtp_num_layers=None``;
  ``mtp_loss_scaling_factor``) and registers :func:`make_mtp_pre_wrap_hook` as a Bridge pre-wrap hook,
  which freezes the MTP parameters in frozen mode before DDP and the optimizer exist and validates
  every model chunk for its mode.
* **Forward**: :meth:`~NemotronHMTPMegatronEngine.forward_step` calls :func:`forward_micro_batch`, which
  runs the model through :func:`verl_mtp_plugin.control.hybrid_forward` with
  ``run_mtp_forward = policy.run_mtp_forward(mode, phase)``, ``labels=None`` (logits come back) and,
  when MTP runs, a token-coordinate MTP loss mask built from verl's response mask
  (:mod:`verl_mtp_plugin.loss_mask`). Phase: actor update -> ``train``; actor forward-only
  (log-prob recompute) -> ``logprob``; forward-only engine (verl's reference model) -> ``ref``.
  Packed (THD) batches also get ``PackedSeqParams.seq_idx`` so Mamba state is reset between packed
  samples.
* **Metrics**: after a pass that ran MTP, ``mtp_losses/mtp_{k}_loss`` and ``mtp_accuracy/mtp_{k}_top1``
  (averaged over data-parallel ranks) are added to the engine's metrics; verl logs them as
  ``actor/mtp_losses/...`` and ``actor/mtp_accuracy/...``. ``mtp_losses`` is the hard cross-entropy on the
  sampled token whatever the objective; ``mtp_objective/mtp_{k}_{objective}`` is the value of the objective the
  MTP block trains with (``VERL_MTP_OBJECTIVE``, :mod:`verl_mtp_plugin.objective`; for
  ``hard_ce`` the same number as ``mtp_losses``). After each optimizer step the MTP block's
  own gradient norm is added as ``mtp_grad_norm`` (verl logs ``actor/mtp_grad_norm``) beside verl's
  ``grad_norm``: with ``mtp_detach_heads`` (online) megatron tags the MTP parameters
  ``grad_norm_group='mtp'``, clips them by their own norm and leaves them out of ``grad_norm``
  (:func:`mtp_group_grad_norm`). Absent where there is no such group (frozen: no MTP parameter is
  trained; joint: the MTP gradients are part of ``grad_norm``) or when clipping is off
  (``optim.clip_grad=0``: megatron computes no group norm).
* **Checkpoints**: each save records the MTP mode beside verl's subfolders; a load is refused before anything is
  read when the checkpoint's mode cannot continue in this run's with ``load_contents``, and a load of the weights
  without the optimizer refreshes the optimizer's fp32 master weights from them
  (:mod:`verl_mtp_plugin.compat.checkpoint_resume`).
* **verl's GPTModel MTP code stays off**: the engine keeps a private shallow copy of ``HFModelConfig``
  whose ``mtp`` block reads ``enable=false`` everywhere except inside verl's ``_build_tf_config`` (where
  ``check_mtp_config`` must see the user's block to keep the MTP layers). So verl never applies
  ``patch_engine_mtp`` to the HybridModel, never passes rolled ``labels`` (which would make
  HybridModel return a loss instead of logits) and never reads the MTP tracker itself.

Importing this module imports verl's Megatron engine (and megatron-core).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from functools import partial
from typing import Any, Iterator

import torch
from megatron.core import parallel_state as mpu
from tensordict import TensorDict

import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id
from verl.workers.engine.base import BaseEngine
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from verl_mtp_plugin.acceptance.estimate import DRAFTED_POSITIONS_KEY, combine_estimates, pool_drafted
from verl_mtp_plugin.acceptance.probe import DRAFTED_POSITIONS, MEAN_POSITIONS, DraftedBudget
from verl_mtp_plugin.compat import checkpoint_resume as resume_compat
from verl_mtp_plugin.control import freeze_mtp, hybrid_forward, unwrap_model, validate_model_for_mode
from verl_mtp_plugin.loss_mask import pack_token_mask, pad_token_mask, response_lengths, token_mask_from_response_mask
from verl_mtp_plugin.metrics import LOSS_KEY, collect_mtp_metrics, reset_mtp_metrics
from verl_mtp_plugin.objective import (
    OBJECTIVE_KEY,
    collect_objective_metrics,
    mtp_objective_scope,
    reset_objective_metrics,
)
from verl_mtp_plugin.policy import MTPConfigError, MTPMode, MTPObjective, Phase, run_mtp_forward
from verl_mtp_plugin.engine.settings import EngineMTPSettings, apply_mtp_overrides, resolve_engine_settings, strategy_error

logger = logging.getLogger(__name__)

#: In-trainer acceptance metrics the engine logs (verl prefixes ``actor/``).
ACCEPTANCE_METRICS = (
    "mtp_expected_accept_rate",
    "mtp_greedy_accept_rate",
    "mtp_argmax_draft_accept_rate",
    "mtp_expected_accept_length_k1",
    "mtp_expected_accept_length_k2",
    "mtp_expected_accept_length_k3",
    "mtp_drafted_expected_accept_rate",
    "mtp_drafted_argmax_draft_accept_rate",
    "mtp_drafted_num_positions",
)


def _response_tokens(data) -> float:
    """Response tokens of a verl batch or micro-batch (its ``loss_mask``, nested or padded); 0 without one."""
    mask = data.get("loss_mask", None) if data is not None else None
    if mask is None:
        return 0.0
    return float((mask.values() if mask.is_nested else mask).sum())


def _first_float(value) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0]) if value.numel() else 1.0
    return float(value)


__all__ = [
    "MTP_GRAD_NORM_GROUP",
    "NemotronHMTPMegatronEngine",
    "UnsupportedStrategyEngine",
    "forward_micro_batch",
    "hybrid_forward_micro_batch",
    "make_mtp_pre_wrap_hook",
    "mtp_group_grad_norm",
    "mtp_token_mask",
    "phase_for_pass",
    "with_mamba_seq_idx",
]


# --------------------------------------------------------------------------------------------------
# phase and masks


def phase_for_pass(*, forward_only: bool, engine_forward_only: bool) -> Phase:
    """The policy phase of one ``forward_backward_batch`` call.

    Args:
        forward_only (bool): the call's ``forward_only`` (False: actor update).
        engine_forward_only (bool): the engine was built forward-only (``engine.forward_only=true``:
            verl's reference model).

    Returns:
        Phase: ``train``, ``logprob`` or ``ref``.
    """
    if not forward_only:
        if engine_forward_only:
            raise RuntimeError("a forward-only engine (reference model) cannot run a training pass")
        return Phase.TRAIN
    return Phase.REF if engine_forward_only else Phase.LOGPROB


def mtp_token_mask(batch: TensorDict) -> torch.Tensor:
    """Token-coordinate MTP loss mask for a verl micro-batch (``left_right_2_no_padding`` layout).

    Args:
        batch (TensorDict): ``input_ids`` nested ``[b, n_i]``; ``loss_mask`` (verl's response mask)
            padded ``[b, R]`` with ``attention_mask`` ``[b, P + R]``, or nested ``[b, r_i]``.

    Returns:
        Tensor: nested ``[b, n_i]`` float32, 0 on prompt tokens, the response mask on response tokens.
    """
    input_ids = batch["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("mtp_token_mask expects verl's no-padding batch (nested input_ids)")
    lengths = input_ids.offsets().diff()
    loss_mask = batch["loss_mask"]
    if loss_mask.is_nested:
        return token_mask_from_response_mask(loss_mask, lengths)
    attention_mask = batch.get("attention_mask", None)
    if attention_mask is None:
        raise ValueError("a padded loss_mask [b, R] needs the padded attention_mask to find response lengths")
    return token_mask_from_response_mask(loss_mask, lengths, response_lengths(attention_mask, loss_mask.shape[-1]))


def with_mamba_seq_idx(packed_seq_params):
    """``PackedSeqParams`` with ``total_tokens`` set, so megatron computes ``seq_idx`` ``[1, T]`` and the
    Mamba scan restarts at every packed sample (verl 0.9.1's ``preprocess_thd_engine`` leaves it unset,
    which carries SSM state from one sample into the next). ``seq_idx`` has one entry per packed row: verl adds
    its ``pad_to_length_bucket`` / fp8 / ``min_local_rows`` padding to the last sample's end of
    ``cu_seqlens_q_padded``, so its last entry is the packed length (``tests/test_thd_hybrid.py``)."""
    if packed_seq_params is None or getattr(packed_seq_params, "seq_idx", None) is not None:
        return packed_seq_params
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return dataclasses.replace(packed_seq_params, total_tokens=int(cu[-1]))


def _bshd_attention_mask(seq_len: int, device) -> torch.Tensor | None:
    # Right-padded rows + causal attention: padding never reaches a real token, so the causal mask is
    # the whole mask. On CUDA, TE / megatron apply the causal mask type themselves (None); megatron's
    # own default mask is allocated on CUDA, so on CPU the [1, 1, s, s] mask (True = masked) is explicit.
    if torch.device(device).type == "cuda":
        return None
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


# --------------------------------------------------------------------------------------------------
# the per-micro-batch forward


@contextlib.contextmanager
def _maybe_probe(model, sink: dict | None, token_mask: torch.Tensor | None, temperature: float,
                 draft_k: int | None = None, budget: tuple[int, int] | None = None):
    """Around one forward: capture the MTP block's output and write the acceptance estimate to ``sink``."""
    if sink is None or token_mask is None:
        yield
        return
    from verl_mtp_plugin.acceptance import AcceptanceProbe

    positions, drafted = (MEAN_POSITIONS, DRAFTED_POSITIONS) if budget is None else budget
    with AcceptanceProbe(model, temperature=temperature) as probe:
        yield
        sink.update(probe.estimate(None, token_mask, max_positions=positions, draft_k=draft_k,
                                   max_drafted_positions=drafted))


def hybrid_forward_micro_batch(
    model,
    input_ids: torch.Tensor,
    *,
    run_mtp_forward: bool,
    mtp_token_mask: torch.Tensor | None = None,
    logits_processor=None,
    logits_processor_args: dict | None = None,
    data_format: str = "thd",
    pad_to_length_bucket: int | None = None,
    forced_max_seqlen: int | None = None,
    acceptance: dict | None = None,
    acceptance_temperature: float = 1.0,
    acceptance_draft_k: int | None = None,
    objective: str = "hard_ce",
    acceptance_budget: tuple[int, int] | None = None,
):
    """One micro-batch through a (wrapped) HybridModel in verl's engine layout.

    Mirrors verl's ``gptmodel_forward_model_engine`` (same packing/padding helpers from
    ``verl.models.mcore.util``) but never passes ``labels`` (HybridModel then returns logits) and
    passes the MTP loss mask in token coordinates, which megatron's derived-label path rolls itself.

    Args:
        model: megatron ``HybridModel`` (DDP/Float16Module-wrapped or not).
        input_ids (Tensor): nested jagged ``[b, n_i]`` token ids.
        run_mtp_forward (bool): run the MTP block and its loss in this forward.
        mtp_token_mask (Tensor | None): nested ``[b, n_i]`` token-coordinate mask (:func:`mtp_token_mask`);
            required when ``run_mtp_forward``.
        logits_processor: ``f(logits, **args) -> dict[str, Tensor]`` (verl's
            ``_lm_head_logits_processor``), applied on the last pipeline stage; None returns logits.
        logits_processor_args (dict | None): nested ``[b, n_i]`` tensors (``label``, ``temperature``);
            ``label`` is rolled like verl does (position ``j`` scores token ``j + 1``).
        data_format (str): ``"thd"`` (packed, ``use_remove_padding=true``) or ``"bshd"`` (padded).
        pad_to_length_bucket (int | None): verl's ``pad_to_length`` bucket (THD only).
        forced_max_seqlen (int | None): verl's BSHD padding target.
        acceptance (dict | None): when given and MTP runs here, the in-trainer acceptance estimate
            (:class:`verl_mtp_plugin.acceptance.AcceptanceProbe`: the means over at most ``acceptance_budget[0]``
            response positions, the drafted form over whole responses of about ``acceptance_budget[1]`` positions,
            under no_grad) of this micro-batch is written into it.
        acceptance_temperature (float): the rollout temperature the estimate (and the ``soft_ce`` / ``tv`` /
            ``chained_tv`` objective) assumes.
        acceptance_draft_k (int | None): vLLM's drafts per verify step, the drafted estimate's ``k``; None: the
            model's MTP depths.
        objective (str): the MTP loss when MTP runs here (:func:`verl_mtp_plugin.objective.mtp_objective_scope`).
        acceptance_budget (tuple[int, int] | None): this micro-batch's ``(positions of the means, drafting
            positions)`` (:class:`~verl_mtp_plugin.acceptance.probe.DraftedBudget`; 0 drafting positions: no drafted
            estimate); None: ``(128, 16384)``.

    Returns:
        dict[str, Tensor] of nested ``[b, n_i]`` tensors (``log_probs``, ``entropy``, ...) when a
        ``logits_processor`` is given, else nested logits ``[b, n_i, V/tp]``; on an intermediate
        pipeline stage, the stage's hidden states.
    """
    from verl.models.mcore.util import (
        postprocess_bshd_engine,
        postprocess_thd_engine,
        preprocess_bshd_engine,
        preprocess_thd_engine,
    )

    if data_format not in ("thd", "bshd"):
        raise ValueError(f"data_format must be 'thd' or 'bshd', got {data_format!r}")
    inner = unwrap_model(model)
    pre_process, post_process = inner.pre_process, inner.post_process
    use_fp8_padding = getattr(inner.config, "fp8", None) in ("e4m3", "hybrid")
    mtp_here = bool(run_mtp_forward) and post_process
    if mtp_here and mtp_token_mask is None:
        raise ValueError("run_mtp_forward=True needs mtp_token_mask (token-coordinate MTP loss mask)")
    batch_size = input_ids.shape[0]
    logits_processor_args = dict(logits_processor_args or {})

    if data_format == "thd":
        ids, psp, position_ids = preprocess_thd_engine(
            input_ids,
            pre_process=pre_process or mtp_here,
            use_fp8_padding=use_fp8_padding,
            pad_to_length_bucket=pad_to_length_bucket,
        )
        psp = with_mamba_seq_idx(psp)
        kwargs: dict[str, Any] = {"packed_seq_params": psp}
        if mtp_here:
            kwargs["loss_mask"] = pack_token_mask(mtp_token_mask, psp.cu_seqlens_q_padded).to(ids.device)
        with (
            _maybe_probe(model, acceptance if mtp_here else None, kwargs.get("loss_mask"), acceptance_temperature,
                         acceptance_draft_k, acceptance_budget),
            mtp_objective_scope(model, objective if mtp_here else "hard_ce", temperature=acceptance_temperature,
                                loss_mask=kwargs.get("loss_mask"), packed_seq_params=psp),
        ):
            output = hybrid_forward(
                model, ids.contiguous(), position_ids, None, run_mtp_forward=bool(run_mtp_forward), **kwargs
            )
        if not post_process:
            return output
        if logits_processor is None:
            return postprocess_thd_engine(output, psp, input_ids, batch_size, post_process=True)
        args = {
            k: preprocess_thd_engine(
                v,
                pre_process=True,
                need_roll=(k == "label"),
                use_fp8_padding=use_fp8_padding,
                pad_to_length_bucket=pad_to_length_bucket,
            )[0]
            for k, v in logits_processor_args.items()
        }
        out = logits_processor(output, **args)
        return {k: postprocess_thd_engine(v, psp, input_ids, batch_size, post_process=True) for k, v in out.items()}

    ids, valid, position_ids = preprocess_bshd_engine(
        input_ids,
        pre_process=pre_process or mtp_here,
        use_fp8_padding=use_fp8_padding,
        forced_max_seqlen=forced_max_seqlen,
    )
    kwargs = {}
    if mtp_here:
        kwargs["loss_mask"] = pad_token_mask(mtp_token_mask, ids.shape[1]).to(ids.device)
    with (
        _maybe_probe(model, acceptance if mtp_here else None, kwargs.get("loss_mask"), acceptance_temperature,
                     acceptance_draft_k, acceptance_budget),
        mtp_objective_scope(model, objective if mtp_here else "hard_ce", temperature=acceptance_temperature,
                            loss_mask=kwargs.get("loss_mask")),
    ):
        output = hybrid_forward(
            model,
            ids,
            position_ids,
            _bshd_attention_mask(ids.shape[1], ids.device),
            run_mtp_forward=bool(run_mtp_forward),
            **kwargs,
        )
    if not post_process:
        return output
    if logits_processor is None:
        return postprocess_bshd_engine(output, valid, post_process=True)
    args = {
        k: preprocess_bshd_engine(
            v,
            pre_process=True,
            need_roll=(k == "label"),
            use_fp8_padding=use_fp8_padding,
            forced_max_seqlen=forced_max_seqlen,
        )[0]
        for k, v in logits_processor_args.items()
    }
    out = logits_processor(output, **args)
    return {k: postprocess_bshd_engine(v, valid, post_process=True) for k, v in out.items()}


def forward_micro_batch(
    model,
    batch: TensorDict,
    *,
    phase: "Phase | str",
    mode: "MTPMode | str",
    logits_processor=None,
    logits_processor_args: dict | None = None,
    data_format: str = "thd",
    pad_to_length_bucket: int | None = None,
    acceptance: dict | None = None,
    acceptance_temperature: float = 1.0,
    acceptance_draft_k: int | None = None,
    objective: str = "hard_ce",
    acceptance_budget: tuple[int, int] | None = None,
):
    """The engine's per-micro-batch forward: phase + mode -> ``run_mtp_forward`` -> model.

    Args:
        model: the (wrapped) HybridModel chunk megatron's schedule hands to ``forward_step``.
        batch (TensorDict): one verl micro-batch (``input_ids`` nested ``[b, n_i]``, ``loss_mask``,
            ``attention_mask``; optional non-tensor ``forced_max_seqlen``).
        phase: ``train``, ``logprob`` or ``ref``.
        mode: ``off``, ``frozen``, ``online`` or ``joint``.
        logits_processor, logits_processor_args, data_format, pad_to_length_bucket, acceptance,
            acceptance_temperature, acceptance_draft_k, objective, acceptance_budget: see
            :func:`hybrid_forward_micro_batch`.

    Returns:
        what :func:`hybrid_forward_micro_batch` returns.
    """
    run = run_mtp_forward(mode, phase)
    return hybrid_forward_micro_batch(
        model,
        batch["input_ids"],
        run_mtp_forward=run,
        mtp_token_mask=mtp_token_mask(batch) if run else None,
        logits_processor=logits_processor,
        logits_processor_args=logits_processor_args,
        data_format=data_format,
        pad_to_length_bucket=pad_to_length_bucket,
        forced_max_seqlen=tu.get_non_tensor_data(batch, key="forced_max_seqlen", default=None),
        acceptance=acceptance,
        acceptance_temperature=acceptance_temperature,
        acceptance_draft_k=acceptance_draft_k,
        objective=objective,
        acceptance_budget=acceptance_budget,
    )


# --------------------------------------------------------------------------------------------------
# build time


def make_mtp_pre_wrap_hook(mode: "MTPMode | str"):
    """Megatron-Bridge pre-wrap hook for ``mode`` (runs on the model chunks before DDP and the optimizer).

    frozen: ``requires_grad=False`` on every MTP parameter (no gradient buffer, no optimizer state;
    checkpoint keys unchanged). Every mode: :func:`verl_mtp_plugin.control.validate_model_for_mode`
    on each chunk (e.g. online needs ``mtp_detach_heads``; MTP layers must exist unless off).

    Returns:
        ``hook(list[MegatronModule]) -> list[MegatronModule]``.
    """
    mode = MTPMode.parse(mode, "mode")

    def mtp_pre_wrap_hook(model):
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if mode is MTPMode.FROZEN:
            freeze_mtp(chunks)
        for chunk in chunks:
            validate_model_for_mode(chunk, mode)
        return model

    mtp_pre_wrap_hook.mode = mode
    return mtp_pre_wrap_hook


#: the override that turns Megatron's gradient-accumulation fusion off
WGRAD_FUSION_KEY = "gradient_accumulation_fusion"


def wgrad_fusion_override(overrides) -> dict:
    """``{"gradient_accumulation_fusion": False}`` when this process cannot run the fusion on every layer, else
    ``{}`` (also when the user set the key: theirs stands).

    Megatron-Bridge turns the fusion on whenever Transformer Engine imports
    (``megatron/bridge/utils/fusions.py: can_enable_gradient_accumulation_fusion``), but megatron-core's own
    ``ColumnParallelLinear`` — the output layer of every ``HybridModel``, TE spec or not — then needs apex's
    ``fused_weight_gradient_mlp_cuda`` and raises at construction without it
    (``megatron/core/tensor_parallel/layers.py``). Seen on the H200 with pip's Transformer Engine and no apex:
    verl's workers failed at model build."""
    import importlib.util

    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        return {}
    if WGRAD_FUSION_KEY in (overrides or {}):
        if overrides[WGRAD_FUSION_KEY]:
            raise MTPConfigError(
                f"actor_rollout_ref.actor.megatron.override_transformer_config.{WGRAD_FUSION_KEY}="
                f"{overrides[WGRAD_FUSION_KEY]}: apex's fused_weight_gradient_mlp_cuda is not installed on this worker, "
                "and megatron-core's ColumnParallelLinear (HybridModel's output layer) needs it for the fusion; remove "
                "the override (the plugin turns the fusion off) or install apex with its CUDA extensions"
            )
        return {}
    logger.warning(
        "actor_rollout_ref.actor.megatron.override_transformer_config.%s=false: apex's fused_weight_gradient_mlp_cuda "
        "is not installed, which megatron-core's ColumnParallelLinear (the output layer) needs for the fusion "
        "Megatron-Bridge turns on with Transformer Engine; install apex with its CUDA extensions to keep it",
        WGRAD_FUSION_KEY,
    )
    return {WGRAD_FUSION_KEY: False}


def _set_items(target, updates: dict) -> None:
    """``target[k] = v`` for a dict or an omegaconf DictConfig (struct mode opened for new keys)."""
    try:
        from omegaconf import DictConfig, open_dict
    except ImportError:  # pragma: no cover
        DictConfig = ()  # type: ignore[assignment]
    if isinstance(target, DictConfig):
        with open_dict(target):
            for k, v in updates.items():
                target[k] = v
    else:
        for k, v in updates.items():
            target[k] = v


# --------------------------------------------------------------------------------------------------
# the MTP block's gradient norm

#: megatron-core's gradient-norm group of the MTP parameters under ``mtp_detach_heads``
#: (``transformer/multi_token_prediction.py``: ``param.grad_norm_group = 'mtp'``)
MTP_GRAD_NORM_GROUP = "mtp"


def mtp_group_grad_norm(optimizer) -> float | None:
    """The MTP group's gradient norm of the optimizer's last ``step()``, or None.

    megatron-core 0.19.2 computes the norm of every separate gradient-norm group while clipping
    (``MegatronOptimizer.clip_grad_norm`` / ``ChainedOptimizer.step``: ``grad_norms_by_group``,
    reduced over the optimizer's grad-stats group like ``grad_norm``) and returns only the main norm.
    """
    norms = getattr(optimizer, "grad_norms_by_group", None) or {}
    value = norms.get(MTP_GRAD_NORM_GROUP)
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


# --------------------------------------------------------------------------------------------------
# the engines


class NemotronHMTPMegatronEngine(MegatronEngineWithLMHead):
    """verl Megatron engine for Nemotron 3 (HybridModel) with per-phase MTP control.

    Selected by ``actor_rollout_ref.model.model_type: nemotron_h_mtp``; the MTP mode comes from verl's
    ``actor_rollout_ref.model.mtp`` block (``policy.mode_from_verl_mtp``). verl's reference model
    uses this engine too (same ``model_type``) with MTP off.
    """

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.mtp_settings: EngineMTPSettings = resolve_engine_settings(model_config, engine_config)
        super().__init__(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=checkpoint_config,
        )
        self.mtp_mode: MTPMode = self.mtp_settings.mode
        self._user_mtp = model_config.mtp
        # verl's own MTP paths (patch_engine_mtp, labels in the forward, get_megatron_mtp_loss) read
        # self.model_config.mtp: give the engine a private copy that reads "off" (see module docstring).
        self._verl_mtp_view = dataclasses.replace(model_config.mtp, enable=False, enable_train=False)
        view = copy.copy(model_config)
        view.mtp = self._verl_mtp_view
        self.model_config = view
        self._mtp_phase: Phase | None = None
        resume_compat.probe()  # the verl / megatron names the checkpoint overrides below rely on

    # ---- build -----------------------------------------------------------------------------------
    def apply_mtp_overrides(self) -> dict:
        """Write the mode's Megatron fields into ``engine_config.override_transformer_config``."""
        updates = apply_mtp_overrides({}, self.mtp_settings)
        _set_items(self.engine_config.override_transformer_config, updates)
        return updates

    def apply_kernel_overrides(self) -> dict:
        """Kernel choices this worker's libraries force, written into ``override_transformer_config`` unless the
        user set the key (:func:`wgrad_fusion_override`)."""
        updates = wgrad_fusion_override(self.engine_config.override_transformer_config)
        _set_items(self.engine_config.override_transformer_config, updates)
        return updates

    def _build_tf_config(self):
        self.apply_mtp_overrides()
        self.apply_kernel_overrides()
        self.model_config.mtp = self._user_mtp  # check_mtp_config must keep the MTP layers
        try:
            super()._build_tf_config()
        finally:
            self.model_config.mtp = self._verl_mtp_view
        if self.provider is None:
            raise MTPConfigError(
                "actor_rollout_ref.actor.megatron.vanilla_mbridge=true: the plugin engine needs the "
                "Megatron-Bridge provider to register its pre-wrap hook; set vanilla_mbridge=false"
            )
        self.provider.register_pre_wrap_hook(make_mtp_pre_wrap_hook(self.mtp_mode))

    # ---- one pass ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def mtp_pass(self, forward_only: bool, data: TensorDict | None = None):
        """Scope of one ``forward_backward_batch``: sets the phase ``forward_step`` reads and starts the
        MTP tracker clean when this phase runs MTP; with ``data`` (the pass's batch on this rank), the acceptance
        estimate's budget is shared among its micro-batches by their response tokens (:class:`DraftedBudget`).

        Yields:
            Phase: the phase of this pass.
        """
        if self._mtp_phase is not None:
            raise RuntimeError(f"nested forward_backward_batch (phase {self._mtp_phase} is active)")
        phase = phase_for_pass(forward_only=forward_only, engine_forward_only=bool(self.engine_config.forward_only))
        runs = run_mtp_forward(self.mtp_mode, phase)
        if runs:
            reset_mtp_metrics()
            reset_objective_metrics()
        self._mtp_phase = phase
        # the in-trainer acceptance estimate of a pass that runs MTP: one dict per micro-batch, combined after it
        self._mtp_acceptance = [] if runs else None
        self._mtp_budget = (DraftedBudget(_response_tokens(data), pass_sequences=int(data["input_ids"].shape[0]))
                            if runs and data is not None else None)
        try:
            yield phase
        finally:
            self._mtp_phase = None

    def add_mtp_metrics(self, output: dict, data: TensorDict, phase: "Phase | str") -> dict[str, float]:
        """After a pass: reduce megatron's MTP tracker over data-parallel ranks and add
        ``mtp_losses/mtp_{k}_loss``, ``mtp_accuracy/mtp_{k}_top1`` and ``mtp_objective/mtp_{k}_{objective}`` to
        ``output["metrics"]`` (on the rank verl collects from). Runs on every rank of the last pipeline stage (collectives).

        Returns:
            dict[str, float]: the metrics (empty when this phase did not run MTP).
        """
        if not run_mtp_forward(self.mtp_mode, phase) or not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        n_micro = tu.get_non_tensor_data(data, key="num_micro_batch", default=None)
        if n_micro is None:
            raise RuntimeError("num_micro_batch missing from the batch (set by verl's forward_backward_batch)")
        # every rank of the stage joins the reduction (collect_mtp_metrics reduces before deciding)
        metrics = collect_mtp_metrics(int(n_micro), reset=True)
        objective = self.mtp_settings.objective
        if objective is MTPObjective.HARD_CE:  # the objective is megatron's own loss
            k = 1
            while LOSS_KEY.format(k=k) in metrics:
                metrics[OBJECTIVE_KEY.format(k=k, objective=objective)] = metrics[LOSS_KEY.format(k=k)]
                k += 1
        else:
            metrics.update(collect_objective_metrics(
                objective, int(n_micro), group=mpu.get_data_parallel_group(with_context_parallel=True)))
        # the drafted estimate over the data-parallel ranks' responses, as vLLM's rate pools its rollout's (verl then
        # averages equal values); every rank of the stage calls, as above
        acc = pool_drafted(combine_estimates(getattr(self, "_mtp_acceptance", None) or ()),
                           group=mpu.get_data_parallel_group(with_context_parallel=True))
        metrics.update({k: v for k, v in acc.items() if k in ACCEPTANCE_METRICS})
        if metrics and self.is_mp_src_rank_with_outputs() and isinstance(output, dict):
            output.setdefault("metrics", {}).update({k: [v] for k, v in metrics.items()})
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs) -> None:
        """verl's save, then the MTP mode that wrote it beside verl's subfolders (read back on resume)."""
        super().save_checkpoint(local_path, hdfs_path=hdfs_path, global_step=global_step,
                                max_ckpt_to_keep=max_ckpt_to_keep, **kwargs)
        if torch.distributed.get_rank() == 0:
            resume_compat.write_checkpoint_mode(local_path, self.mtp_mode.value)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs) -> None:
        """verl's load, refused before anything is read when the checkpoint's MTP mode cannot continue in this
        run's mode with ``load_contents`` (:func:`~verl_mtp_plugin.compat.checkpoint_resume.check_resume`); after a
        load of the weights without the optimizer, the optimizer's fp32 master weights are refreshed from the loaded
        weights (verl leaves them at the base checkpoint's: the first step would undo the resume), right after the
        load and before verl offloads the model again (``param_offload``)."""
        load_model, load_optimizer = resume_compat.load_flags(self)
        resume_compat.check_resume(saved_mode=resume_compat.read_checkpoint_mode(local_path),
                                   mode=self.mtp_mode.value, load_model=load_model, load_optimizer=load_optimizer,
                                   where=local_path)
        refresh = load_model and not load_optimizer and self.optimizer is not None
        with resume_compat.refresh_after_model_load(self) if refresh else contextlib.nullcontext():
            super().load_checkpoint(local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load,
                                    **kwargs)

    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        self._mtp_grad_norm = mtp_group_grad_norm(self.optimizer)
        return grad_norm

    def train_batch(self, data: TensorDict, loss_function) -> Any:
        """verl's ``train_batch`` + ``mtp_grad_norm`` (the MTP group's norm of this step) in the metrics."""
        self._mtp_grad_norm = None
        outputs = super().train_batch(data, loss_function)
        norm = self._mtp_grad_norm
        if norm is not None and self.is_mp_src_rank_with_outputs() and isinstance(outputs, dict):
            # a list, like the engine's other metrics (verl gathers them over data-parallel ranks and
            # flattens per micro-batch lists, engine_workers.py:327-331)
            outputs.setdefault("metrics", {})["mtp_grad_norm"] = [norm]
        return outputs

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False) -> Any:
        with self.mtp_pass(forward_only, data) as phase:
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            self.add_mtp_metrics(output, data, phase)
        return output

    def _next_acceptance_sink(self, batch: TensorDict) -> tuple[dict | None, tuple[int, int] | None]:
        """The dict the next micro-batch writes its acceptance estimate to (None in a pass without MTP) and its share
        of the pass's budget (positions of the means, drafting positions): every micro-batch of the pass gets its own
        dict, :func:`combine_estimates` joins them after the pass. The micro-batch before pays its drafted share with
        the positions it used."""
        sinks = getattr(self, "_mtp_acceptance", None)
        if sinks is None:
            return None, None
        budget = getattr(self, "_mtp_budget", None)
        if budget is not None and sinks:
            budget.spent(sinks[-1].get(DRAFTED_POSITIONS_KEY, 0.0))
        sinks.append({})
        if budget is None:  # a pass entered without its batch: every micro-batch at the whole budget
            return sinks[-1], None
        tokens = _response_tokens(batch)
        return sinks[-1], (budget.mean_positions(tokens), budget.take(tokens, int(batch["input_ids"].shape[0])))

    # ---- one micro-batch -----------------------------------------------------------------------------
    def forward_step(
        self, batch_iter: Iterator[TensorDict], model, logits_processor_func, postprocess_micro_batch_func
    ):
        """Megatron ``forward_step_func`` for one micro-batch (called by megatron's schedule)."""
        if self._mtp_phase is None:
            raise RuntimeError("forward_step outside forward_backward_batch / mtp_pass: the MTP phase is unknown")
        batch: TensorDict = next(batch_iter)
        batch = batch.to(get_device_id())
        if bool(tu.get_non_tensor_data(batch, key="use_fused_kernels", default=False)):
            raise MTPConfigError(
                "use_fused_kernels=true is not supported by model_type=nemotron_h_mtp "
                "(actor_rollout_ref.model.use_fused_kernels)"
            )
        if tu.get_non_tensor_data(batch, key="local_cp_size", default=None) is not None:
            raise MTPConfigError("dynamic context parallel is not supported by model_type=nemotron_h_mtp")
        pad_mode = tu.get_non_tensor_data(batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise NotImplementedError(f"Pad mode {pad_mode} is not supported for megatron engine")
        multi_modal = batch.get("multi_modal_inputs", None)
        if multi_modal is not None:
            from verl.utils.model import extract_multi_modal_inputs

            if extract_multi_modal_inputs(multi_modal):
                raise MTPConfigError("multi-modal inputs are not supported by model_type=nemotron_h_mtp")

        input_ids = batch["input_ids"]
        sink, share = self._next_acceptance_sink(batch)
        temperature = batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.tensor([temperature] * input_ids.shape[0], device=input_ids.device)
        temperature = verl_F.expand_as_nested(temperature.to(torch.float32), input_ids)
        data_format = "thd" if self.engine_config.use_remove_padding else "bshd"
        pad_to_length_bucket = (
            self.engine_config.pad_to_length_bucket
            if self.engine_config.pad_to_length and self.engine_config.use_remove_padding
            else None
        )
        logits_processor = partial(
            self._lm_head_logits_processor,
            calculate_sum_pi_squared=tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False),
            calculate_entropy=tu.get_non_tensor_data(batch, key="calculate_entropy", default=False),
            distillation_use_topk=tu.get_non_tensor_data(batch, key="distillation_use_topk", default=False),
            distillation_only=tu.get_non_tensor_data(batch, key="distillation_only", default=False),
            logits_processor_func=logits_processor_func,
            batch=batch,
            data_format=data_format,
        )
        output = forward_micro_batch(
            model,
            batch,
            phase=self._mtp_phase,
            mode=self.mtp_mode,
            logits_processor=logits_processor,
            logits_processor_args={"label": input_ids.clone(), "temperature": temperature},
            data_format=data_format,
            pad_to_length_bucket=pad_to_length_bucket,
            acceptance=sink,
            acceptance_temperature=_first_float(batch["temperature"]),
            acceptance_draft_k=self.mtp_settings.draft_k,
            objective=self.mtp_settings.objective,
            acceptance_budget=share,
        )
        return output, partial(postprocess_micro_batch_func, data=batch)


class UnsupportedStrategyEngine(BaseEngine):
    """Registered under ``model_type="nemotron_h_mtp"`` for verl's non-Megatron backends: constructing it
    raises :class:`MTPConfigError` naming the keys (verl's own error would be ``Unknown backend``)."""

    def __init__(self, model_config=None, engine_config=None, *args, **kwargs):
        raise MTPConfigError(strategy_error(getattr(engine_config, "strategy", "?")))
