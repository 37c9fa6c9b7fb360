"""HF MTP tensors in the layout vLLM's drafter stores them, and their digests (the sync's checksum mode).

Pure torch (no vLLM import): :func:`drafter_layout` recomposes HF tensors the way vLLM's ``NemotronHMTP``
stores them (``qkv = cat(q, k, v)``, ``w13 = stack(up_proj)``, ``w2 = stack(down_proj)``);
:func:`hf_mtp_digests` / :func:`tensor_digest` digest them so a drafter's own parameters can be
compared with what the trainer sent; :func:`canonical_drafter_name` removes vLLM-version infixes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["canonical_drafter_name", "drafter_layout", "hf_mtp_digests", "tensor_digest"]


_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight")
_QKV_RE = re.compile(r"(model\.layers\.\d+\.mixer)\.([qkv])_proj\.(weight|bias)")
_SHARED_HF_TO_DRAFTER = {"backbone.embeddings.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def canonical_drafter_name(name: str) -> str:
    """vLLM drafter parameter name without version-dependent infixes (``experts.routed_experts.w13_weight``
    in vLLM 0.31/0.33 and ``experts.w13_weight`` in other revisions both become the latter)."""
    return name.replace(".experts.routed_experts.", ".experts.")


def _drafter_groups(names: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """Canonical drafter name -> ordered HF names whose concatenation (dim 0) it stores."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for hf in names:
        if hf in _SHARED_HF_TO_DRAFTER:
            groups.setdefault(_SHARED_HF_TO_DRAFTER[hf], []).append((0, hf))
            continue
        if not hf.startswith("mtp.layers."):
            continue
        n = "model.layers." + hf[len("mtp.layers.") :]
        m = _QKV_RE.fullmatch(n)
        if m:
            groups.setdefault(f"{m.group(1)}.qkv_proj.{m.group(3)}", []).append(("qkv".index(m.group(2)), hf))
            continue
        m = _EXPERT_RE.fullmatch(n)
        if m:
            w = "w13_weight" if m.group(3) == "up" else "w2_weight"
            groups.setdefault(f"{m.group(1)}.{w}", []).append((int(m.group(2)), hf))
            continue
        groups.setdefault(n, []).append((0, hf))
    for v in groups.values():
        v.sort()
    return groups


def drafter_layout(hf_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF MTP tensors recomposed the way vLLM's ``NemotronHMTP`` stores them (TP=EP=1).

    ``mtp.layers.{i}.X`` -> ``model.layers.{i}.X``; ``qkv_proj = cat(q, k, v)``;
    ``experts.w13_weight = stack(up_proj over experts)`` ``[E, I, H]`` (non-gated: up only),
    ``experts.w2_weight = stack(down_proj)`` ``[E, H, I]``; ``backbone.embeddings.weight`` ->
    ``model.embed_tokens.weight``, ``lm_head.weight`` unchanged. Names are canonical
    (:func:`canonical_drafter_name`); other ``backbone.*`` names are ignored.
    """
    out: dict[str, torch.Tensor] = {}
    for name, parts in _drafter_groups(hf_tensors).items():
        ts = [hf_tensors[hf] for _, hf in parts]
        if name.endswith((".w13_weight", ".w2_weight")):
            out[name] = torch.stack(ts)
        elif len(ts) > 1:
            out[name] = torch.cat(ts)
        else:
            out[name] = ts[0]
    return out


_P = 2_147_483_647  # 2**31 - 1
_DIGEST_CHUNK = 1 << 22


class _Digest:
    """Position-weighted modular hash of float32 bit patterns, streamed over concatenated pieces."""

    def __init__(self) -> None:
        self.offset = 0
        self.h1 = 0
        self.h2 = 0

    def update(self, t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        for s in range(0, flat.numel(), _DIGEST_CHUNK):
            x = flat[s : s + _DIGEST_CHUNK].to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
            x = torch.remainder(x, _P)
            idx = torch.arange(self.offset + s, self.offset + s + x.numel(), device=x.device, dtype=torch.int64)
            w1 = torch.remainder(idx * 48271 + 11, _P)
            w2 = torch.remainder(torch.remainder(idx, 65521) * 69621 + 7 + idx // 65521, _P)
            self.h1 = (self.h1 + int(torch.remainder(x * w1, _P).sum())) % _P
            self.h2 = (self.h2 + int(torch.remainder(x * w2, _P).sum())) % _P
        self.offset += flat.numel()

    def hexdigest(self) -> str:
        return f"{self.offset}:{self.h1:08x}{self.h2:08x}"


def tensor_digest(t: torch.Tensor) -> str:
    """Exact-value digest of a tensor (its values as float32 bit patterns, position-weighted).

    Equal digests <=> equal float32 values (up to ~2^-62 collisions) regardless of the source dtype
    (bf16/fp16 upcast exactly) or device; computed on the tensor's device in 4M-element chunks.
    """
    d = _Digest()
    d.update(t)
    return d.hexdigest()


def hf_mtp_digests(hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Trainer-side digests of the drafter tensors these HF tensors produce (see :func:`drafter_layout`),
    without materialising the stacked/concatenated tensors.

    Returns:
        dict[str, str]: canonical drafter parameter name -> :func:`tensor_digest` value.
    """
    tensors = dict(hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors)
    out: dict[str, str] = {}
    for name, parts in _drafter_groups(tensors).items():
        d = _Digest()
        for _, hf in parts:
            d.update(tensors[hf])
        out[name] = d.hexdigest()
    return out
