"""The model, batch and comparisons shared by the GPU tests and the probe (not collected by pytest).

Shape: a small Nemotron-3-like hybrid (Mamba ``M``, attention ``*``, MoE ``E`` with sigmoid router,
expert bias, shared expert and latent projections) with MTP ``*E``, bf16, sequences of 1024 tokens.
The Mamba sizes (head dim 64, state 128, 8 groups) are Nemotron 3's, so the real Mamba-2 Triton
kernels run at production tile shapes. On a CPU (``VERL_MTP_GPU_TESTS_ON_CPU=1``, plumbing only)
every size shrinks and the CPU Mamba reference runs.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CUDA = torch.cuda.is_available()
MAIN = "MEM*EME"
FULL = MAIN + "/*E"

#: Relative L2 tolerance for bf16 comparisons (see ``assert_close``).
REL_TOL = 1e-2


def spec(**fields):
    from verl_mtp_plugin.testing import TinyHybridSpec

    if CUDA:
        base = dict(
            pattern=FULL, vocab_size=32768, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=4,
            num_query_groups=2, num_experts=8, moe_topk=2, moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512, moe_latent_size=256, mamba_state_dim=128,
            mamba_head_dim=64, mamba_num_groups=8, max_sequence_length=1024, params_dtype=torch.bfloat16,
            mtp_loss_scaling_factor=1.0,
        )
    else:
        base = dict(pattern=FULL, vocab_size=256, max_sequence_length=64, params_dtype=torch.float32,
                    mtp_loss_scaling_factor=1.0)
    base.update(fields)
    return TinyHybridSpec(**base)


def seq_len() -> int:
    return 1024 if CUDA else 32


def build(mode: str, pattern: str = FULL):
    """A model configured for ``mode`` through the plugin's ``configure_transformer_config``."""
    from verl_mtp_plugin import configure_transformer_config

    overrides = configure_transformer_config({}, mode)
    s = spec(pattern=pattern)
    if CUDA:
        from verl_mtp_plugin.testing.gpu import build_gpu_hybrid

        return build_gpu_hybrid(s, config_overrides=overrides)
    from verl_mtp_plugin.testing import build_tiny_hybrid

    return build_tiny_hybrid(s, config_overrides=overrides)


def batch(seed: int = 1):
    from verl_mtp_plugin.testing import make_batch

    s = seq_len()
    return make_batch(batch=2, seq=s, vocab=spec().vocab_size, prompt_len=s // 4, seed=seed)


def rl_loss(logits, b):
    """Policy-gradient style loss over response tokens: ``-mean(logp(token_{t+1}) * A)`` (fixed A)."""
    ids = b["input_ids"]
    labels = torch.roll(ids, -1, dims=1)
    mask = b["response_mask"].clone()
    mask[:, -1] = 0
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(ids.shape, generator=g).to(ids.device)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return -(logp * adv * mask).sum() / mask.sum()


def fwd_bwd(model, b, run_mtp: bool):
    """One forward (``hybrid_forward``) + backward. Returns (logits fp32, {name: grad fp32 | None})."""
    from verl_mtp_plugin import hybrid_forward

    model.zero_grad(set_to_none=True)
    logits = hybrid_forward(model, b["input_ids"], b["position_ids"], b["attention_mask"], run_mtp_forward=run_mtp)
    rl_loss(logits, b).backward()
    grads = {n: (None if p.grad is None else p.grad.detach().float().clone()) for n, p in model.named_parameters()}
    return logits.detach().float(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tolerance(noise: float) -> float:
    """``max(REL_TOL, 4 x run-to-run noise)`` for one tensor."""
    return max(REL_TOL, 4.0 * noise)


def copy_trunk(src, dst) -> None:
    """Load ``src``'s non-MTP weights into ``dst`` (a model built without MTP)."""
    sd = {k: v for k, v in src.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = dst.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
