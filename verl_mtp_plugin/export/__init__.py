"""Trainer side of the MTP weight sync: Megatron MTP weights as Hugging Face Nemotron-H tensors.

* :mod:`~verl_mtp_plugin.export.names`: the Megatron -> HF name map and the HF MTP key set a
  ``config.json`` implies;
* :mod:`~verl_mtp_plugin.export.gather`: :func:`export_mtp_weights`, which walks the model and
  gathers tensor-/expert-parallel shards into full HF tensors;
* :mod:`~verl_mtp_plugin.export.drafter`: HF tensors in vLLM's drafter layout and their digests
  (the sync's checksum mode).

Imports torch only (no verl, no vLLM).
"""

from verl_mtp_plugin.export.drafter import canonical_drafter_name, drafter_layout, hf_mtp_digests, tensor_digest
from verl_mtp_plugin.export.gather import export_mtp_weights
from verl_mtp_plugin.export.names import (
    MTPExportError,
    expected_hf_mtp_keys,
    fuse_qkv,
    hf_mtp_pattern,
    megatron_to_hf_name,
    split_fused_qkv,
)

__all__ = [
    "MTPExportError",
    "canonical_drafter_name",
    "drafter_layout",
    "expected_hf_mtp_keys",
    "export_mtp_weights",
    "fuse_qkv",
    "hf_mtp_digests",
    "hf_mtp_pattern",
    "megatron_to_hf_name",
    "split_fused_qkv",
    "tensor_digest",
]
