"""MTP loss masks from verl's batch layout, in the coordinates megatron's derived-label path expects.

Pure torch: no verl, megatron or vLLM import.

Two coordinate systems appear around an MTP loss mask:

* **token coordinates** (what this module builds): ``mask[j] = 1`` when token ``j`` of the sequence is
  a response token that should count (prompt tokens, padding and tool-output tokens are 0). Megatron's
  ``HybridModel`` RL path passes ``labels=None`` and ``loss_mask`` in these coordinates:
  ``process_mtp_loss`` derives ``labels = roll(input_ids, -1)`` and rolls ``loss_mask`` by -1 itself,
  then rolls both once more per MTP depth. After depth ``d`` the position ``j`` predicts token
  ``j + 1 + d`` and is counted iff ``mask[j + 1 + d] = 1``.
* **label coordinates** (verl's ``label_mask`` on the GPTModel path, which passes explicit rolled
  labels): ``label_mask[j] = mask[j + 1]`` within a sequence, 0 on the last position.
  :func:`token_to_label_mask` and :func:`label_to_token_mask` convert between the two.

verl's engine batch (``left_right_2_no_padding``) carries, per sample ``i`` of a micro-batch of ``b``:

* ``input_ids``: nested (jagged) ``[b, j1]``, prompt + response tokens, padding removed,
  ``n_i = len(input_ids[i])``;
* ``loss_mask`` (= ``response_mask``): padded ``[b, R]`` over the response slots only (right padded,
  0 on tool outputs), or nested ``[b, r_i]``;
* ``attention_mask``: padded ``[b, P + R]`` (left-padded prompt, right-padded response); its last ``R``
  columns give the real response lengths ``r_i``.

Layouts produced for the model:

* padded (BSHD): :func:`pad_token_mask` -> ``[b, s]`` (``s >= max n_i``, zeros after ``n_i``);
* packed (THD): :func:`pack_token_mask` -> ``[1, T]`` laid out by ``cu_seqlens_padded`` exactly like
  verl's ``preprocess_thd_engine`` packs ``input_ids`` (context parallel size 1).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "label_to_token_mask",
    "pack_token_mask",
    "pad_token_mask",
    "response_lengths",
    "token_mask_from_response_mask",
    "token_to_label_mask",
]


def _lengths(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _rows(masks) -> list[torch.Tensor]:
    """A nested jagged tensor, a list of 1-D tensors or a 2-D tensor -> list of 1-D tensors."""
    if isinstance(masks, torch.Tensor) and masks.is_nested:
        return list(masks.unbind())
    if isinstance(masks, torch.Tensor):
        if masks.dim() != 2:
            raise ValueError(f"expected a [b, s] mask, got shape {tuple(masks.shape)}")
        return list(masks.unbind(0))
    return list(masks)


def response_lengths(attention_mask: torch.Tensor, max_response_len: int) -> torch.Tensor:
    """Real response lengths from verl's left-right padded attention mask.

    Args:
        attention_mask (Tensor): ``[b, P + R]``, 1 on real tokens (left-padded prompt, right-padded
            response).
        max_response_len (int): ``R``, the width of the padded response block.

    Returns:
        Tensor: ``[b]`` int64, ``r_i``.
    """
    if attention_mask.dim() != 2 or attention_mask.shape[1] < max_response_len:
        raise ValueError(
            f"attention_mask must be [b, P + R] with R={max_response_len}, got {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, attention_mask.shape[1] - max_response_len :].to(torch.int64).sum(-1)


def token_mask_from_response_mask(
    response_mask: torch.Tensor,
    input_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Token-coordinate MTP loss mask for ``input_ids = [prompt; response]`` of each sample.

    Args:
        response_mask (Tensor): verl's response mask (the engine batch's ``loss_mask``): padded
            ``[b, R]`` (then ``response_lengths`` is required) or nested jagged ``[b, r_i]``.
            Values other than 0/1 are kept (cast to ``dtype``).
        input_lengths: ``[b]`` ``n_i``, tokens of sample ``i`` without padding (the nested
            ``input_ids`` lengths, ``input_ids.offsets().diff()``).
        response_lengths: ``[b]`` ``r_i`` real response lengths (:func:`response_lengths`); ignored
            for a nested ``response_mask`` (its own lengths are used).
        dtype (torch.dtype): dtype of the result (megatron multiplies it into a float loss).

    Returns:
        Tensor: nested jagged ``[b, n_i]``; sample ``i`` is ``[0] * (n_i - r_i) + response_mask[i, :r_i]``.

    Raises:
        ValueError: a response longer than its sequence, an empty prompt (token 0 is never a target),
            or mismatching batch sizes.
    """
    n = _lengths(input_lengths)
    if response_mask.is_nested:
        pieces = list(response_mask.unbind())
        r = [int(p.shape[0]) for p in pieces]
    else:
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be [b, R] or nested, got shape {tuple(response_mask.shape)}")
        if response_lengths is None:
            raise ValueError("response_lengths is required for a padded [b, R] response_mask")
        r = _lengths(response_lengths)
        if any(ri > response_mask.shape[1] for ri in r):
            raise ValueError(f"response_lengths {r} exceed the response_mask width {response_mask.shape[1]}")
        pieces = [response_mask[i, : r[i]] for i in range(response_mask.shape[0])]
    if not (len(pieces) == len(n) == len(r)):
        raise ValueError(f"batch sizes differ: response_mask {len(pieces)}, input_lengths {len(n)}")
    out = []
    for i, (ni, ri, piece) in enumerate(zip(n, r, pieces)):
        prompt = ni - ri
        if prompt < 1:
            raise ValueError(
                f"sample {i}: response length {ri} leaves {prompt} prompt tokens in a sequence of {ni}; "
                "verl sequences need a non-empty prompt"
            )
        zeros = torch.zeros(prompt, dtype=dtype, device=piece.device)
        out.append(torch.cat([zeros, piece.to(dtype)]))
    return torch.nested.as_nested_tensor(out, layout=torch.jagged)


def pad_token_mask(token_mask, seq_len: int) -> torch.Tensor:
    """Right-pad per-sample token masks to ``[b, seq_len]`` (the BSHD layout of ``input_ids``).

    Args:
        token_mask: nested jagged ``[b, n_i]`` (or a list of 1-D tensors).
        seq_len (int): padded length ``s >= max n_i`` (the model input's sequence length).

    Returns:
        Tensor: ``[b, s]``, zeros after ``n_i``.
    """
    rows = _rows(token_mask)
    if not rows:
        raise ValueError("empty token mask")
    longest = max(int(r.shape[0]) for r in rows)
    if seq_len < longest:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest sample ({longest})")
    out = torch.zeros(len(rows), seq_len, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def pack_token_mask(token_mask, cu_seqlens_padded: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Pack per-sample token masks into the THD layout ``[1, T]`` (context parallel size 1).

    Sample ``i`` occupies ``[cu[i], cu[i] + n_i)``; the alignment padding up to ``cu[i + 1]`` is 0.
    This is the layout verl's ``preprocess_thd_engine`` gives ``input_ids`` (``cu`` is its
    ``packed_seq_params.cu_seqlens_q_padded``).

    Args:
        token_mask: nested jagged ``[b, n_i]`` (or a list of 1-D tensors).
        cu_seqlens_padded: ``[b + 1]`` cumulative padded lengths, ``T = cu[-1]``.

    Returns:
        Tensor: ``[1, T]``.
    """
    rows = _rows(token_mask)
    cu = _lengths(cu_seqlens_padded)
    if len(cu) != len(rows) + 1:
        raise ValueError(f"cu_seqlens_padded has {len(cu)} entries for {len(rows)} samples (need b + 1)")
    out = torch.zeros(1, cu[-1], dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        n = int(r.shape[0])
        if cu[i + 1] - cu[i] < n:
            raise ValueError(f"sample {i}: {n} tokens do not fit its packed slot [{cu[i]}, {cu[i + 1]})")
        out[0, cu[i] : cu[i] + n] = r
    return out


def _segments(length: int, cu_seqlens) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, length)]
    cu = _lengths(cu_seqlens)
    if cu[0] != 0 or cu[-1] != length:
        raise ValueError(f"cu_seqlens {cu} does not cover a sequence of length {length}")
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def token_to_label_mask(mask: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Token coordinates -> label coordinates: ``label[j] = mask[j + 1]``, 0 on each sequence's last slot.

    Args:
        mask (Tensor): ``[b, s]`` (each row one sequence) or packed ``[1, T]`` with ``cu_seqlens``.
        cu_seqlens: ``[k + 1]`` segment boundaries of a packed row (padded cu_seqlens); None for rows.

    Returns:
        Tensor: same shape and dtype.
    """
    out = torch.zeros_like(mask)
    for a, b in _segments(mask.shape[-1], cu_seqlens):
        if b - a > 1:
            out[..., a : b - 1] = mask[..., a + 1 : b]
    return out


def label_to_token_mask(mask: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Label coordinates -> token coordinates: ``token[j] = label[j - 1]``, 0 on each sequence's first slot.

    The inverse of :func:`token_to_label_mask` for masks whose first token is not a target (always
    true for verl: the prompt is non-empty).

    Args:
        mask (Tensor): ``[b, s]`` or packed ``[1, T]`` with ``cu_seqlens``.
        cu_seqlens: ``[k + 1]`` segment boundaries of a packed row; None for rows.

    Returns:
        Tensor: same shape and dtype.
    """
    out = torch.zeros_like(mask)
    for a, b in _segments(mask.shape[-1], cu_seqlens):
        if b - a > 1:
            out[..., a + 1 : b] = mask[..., a : b - 1]
    return out
