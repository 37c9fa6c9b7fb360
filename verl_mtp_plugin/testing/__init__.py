"""What the tests use and the product does not: the tiny builders re-exported from :mod:`verl_mtp_cpu.tiny`
(the CPU runtime the demo runs on), megatron teardown and globals reset, random batches, a tiny ``GPTModel``.
:mod:`.gpu` builds the GPU variants, :mod:`.rl_loop` is the hand-written RL loop. Not shipped in the wheel.
"""

from __future__ import annotations

import torch

from verl_mtp_cpu.tiny import (
    ENV_INIT_METHOD,
    LatentLinearRef,
    TinyHybridSpec,
    _install_cpu_current_device,
    build_tiny_hybrid,
    causal_mask,
    init_megatron,
    make_config,
    rendezvous,
)

__all__ = [
    "config_with",
    "ENV_INIT_METHOD",
    "LatentLinearRef",
    "TinyHybridSpec",
    "build_tiny_gpt",
    "build_tiny_hybrid",
    "causal_mask",
    "destroy_megatron",
    "init_megatron",
    "make_batch",
    "make_config",
    "rendezvous",
    "reset_mtp_globals",
]


def config_with(cfg, **updates):
    """A copy of an omegaconf config with dotted-key updates (``a__b__c=v`` sets ``a.b.c``; new keys allowed)."""
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(cfg):
        for k, v in updates.items():
            OmegaConf.update(cfg, k.replace("__", "."), v, force_add=True)
    return cfg


def destroy_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def reset_mtp_globals(num_depths: int | None = None) -> None:
    """Clear megatron's class-level MTP state (the loss tracker and the backward scale).

    The tracker is sized by the first model that writes to it; a test with another depth count
    would hit an IndexError, so tests start from a clean tracker. When ``num_depths`` is given the
    tracker is pre-seeded on the model's device (megatron would allocate on CUDA).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.main_loss_backward_scale = None
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    if num_depths:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for k in ("loss_values", "correct_values", "total_values"):
            MTPLossLoggingHelper.tracker[k] = torch.zeros(num_depths, device=dev)


def make_batch(batch: int = 2, seq: int = 16, vocab: int = 128, prompt_len: int = 6, seed: int = 0, device=None):
    """Random tokens, positions, causal mask and a response mask (token coordinates: 1 on response tokens)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    response_mask = torch.zeros(batch, seq)
    response_mask[:, prompt_len:] = 1.0
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return dict(
        input_ids=input_ids.to(dev),
        position_ids=position_ids.to(dev),
        attention_mask=causal_mask(seq, dev),
        response_mask=response_mask.to(dev),
    )


def build_tiny_gpt(mtp_num_layers: int | None = 1, vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2,
                   mtp_detach_heads: bool = False, device=None):
    """A tiny megatron ``GPTModel`` with MTP from megatron's own local spec (the other model type
    :func:`verl_mtp_plugin.hybrid_forward` supports)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _install_cpu_current_device()
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=2 * hidden_size, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", add_bias_linear=False, mtp_num_layers=mtp_num_layers,
        mtp_detach_heads=mtp_detach_heads,
    )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if mtp_num_layers else None
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=vocab_size, max_sequence_length=256,
        position_embedding_type="none", share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec,
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    model.train()
    return model
