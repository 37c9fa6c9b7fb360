"""MTP loss-mask conversion (verl_mtp_plugin.loss_mask) on hand-checked padded and packed layouts,
cross-checked against verl's real packing/mask functions and megatron's real ``roll_tensor``."""

import pytest
import torch

from verl_mtp_plugin.loss_mask import (
    label_to_token_mask,
    pack_token_mask,
    pad_token_mask,
    response_lengths,
    token_mask_from_response_mask,
    token_to_label_mask,
)

# Two samples, verl's left-right padded layout with P=3 prompt slots and R=3 response slots:
#   sample 0: prompt 3 tokens, response 2 tokens (mask 1 1)          -> n0 = 5
#   sample 1: prompt 1 token,  response 3 tokens (mask 1 0 1: a tool output in the middle) -> n1 = 4
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
RESPONSE_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
INPUT_LENGTHS = [5, 4]
TOKEN_0 = [0, 0, 0, 1, 1]
TOKEN_1 = [0, 1, 0, 1]


def _nested(rows, dtype=torch.float32):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _rows(nested):
    return [t.tolist() for t in nested.unbind()]


def test_response_lengths_come_from_the_response_block_of_the_attention_mask():
    assert response_lengths(ATTENTION, 3).tolist() == [2, 3]


def test_token_mask_from_padded_response_mask_hand_checked():
    tm = token_mask_from_response_mask(RESPONSE_MASK, INPUT_LENGTHS, response_lengths(ATTENTION, 3))
    assert tm.is_nested and tm.dtype == torch.float32
    assert _rows(tm) == [TOKEN_0, TOKEN_1]


def test_token_mask_from_nested_response_mask_hand_checked():
    tm = token_mask_from_response_mask(_nested([[1, 1], [1, 0, 1]]), torch.tensor(INPUT_LENGTHS))
    assert _rows(tm) == [TOKEN_0, TOKEN_1]


def test_token_mask_matches_verls_own_mtp_mask_builder():
    """verl's GPTModel path builds the same token-coordinate mask before rolling it into label
    coordinates (verl.models.mcore.model_forward._build_mtp_loss_mask_nested)."""
    from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested

    ours = token_mask_from_response_mask(RESPONSE_MASK, INPUT_LENGTHS, response_lengths(ATTENTION, 3))
    verls = _build_mtp_loss_mask_nested(RESPONSE_MASK, INPUT_LENGTHS, ATTENTION[:, -3:])
    assert _rows(ours) == _rows(verls)


def test_token_mask_rejects_empty_prompt_and_bad_widths():
    with pytest.raises(ValueError, match="prompt"):
        token_mask_from_response_mask(RESPONSE_MASK, [2, 4], [2, 3])  # sample 0: 2 tokens, 2 response
    with pytest.raises(ValueError, match="response_lengths is required"):
        token_mask_from_response_mask(RESPONSE_MASK, INPUT_LENGTHS)
    with pytest.raises(ValueError, match="exceed"):
        token_mask_from_response_mask(RESPONSE_MASK, INPUT_LENGTHS, [2, 4])
    with pytest.raises(ValueError, match="batch sizes"):
        token_mask_from_response_mask(RESPONSE_MASK, [5, 4, 3], [2, 3])


def test_pad_token_mask_hand_checked():
    padded = pad_token_mask(_nested([TOKEN_0, TOKEN_1]), 6)
    assert padded.tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 0]]
    with pytest.raises(ValueError, match="shorter"):
        pad_token_mask(_nested([TOKEN_0, TOKEN_1]), 4)


def test_pack_token_mask_hand_checked():
    # TP=2 alignment pads 5 -> 6 and keeps 4: cu_seqlens_padded = [0, 6, 10]
    packed = pack_token_mask(_nested([TOKEN_0, TOKEN_1]), torch.tensor([0, 6, 10]))
    assert packed.shape == (1, 10)
    assert packed.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 0, 1]]
    with pytest.raises(ValueError, match="do not fit"):
        pack_token_mask(_nested([TOKEN_0, TOKEN_1]), [0, 4, 8])
    with pytest.raises(ValueError, match="b \\+ 1"):
        pack_token_mask(_nested([TOKEN_0, TOKEN_1]), [0, 6])


def test_label_coordinates_hand_checked_and_inverse():
    padded = torch.tensor([[0.0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 0]])
    label = token_to_label_mask(padded)
    # label[j] = token[j + 1]: the position before each response token is the one whose label it is
    assert label.tolist() == [[0, 0, 1, 1, 0, 0], [1, 0, 1, 0, 0, 0]]
    assert torch.equal(label_to_token_mask(label), padded)

    packed = torch.tensor([[0.0, 0, 0, 1, 1, 0, 0, 1, 0, 1]])
    cu = [0, 6, 10]
    label = token_to_label_mask(packed, cu)
    # no shift across the boundary at 6: each sequence's last slot is 0
    assert label.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0, 1, 0]]
    assert torch.equal(label_to_token_mask(label, cu), packed)
    with pytest.raises(ValueError, match="does not cover"):
        token_to_label_mask(packed, [0, 6, 9])


def test_layouts_match_verls_own_packing_of_input_ids(megatron_env):
    """The padded / packed masks line up token for token with verl's BSHD / THD packing of input_ids
    (verl.models.mcore.util.preprocess_{bshd,thd}_engine, the functions the engine uses), and verl's
    label-coordinate mask (need_roll=True) is token_to_label_mask of ours."""
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    token = token_mask_from_response_mask(RESPONSE_MASK, INPUT_LENGTHS, response_lengths(ATTENTION, 3))
    ids = torch.nested.as_nested_tensor([torch.arange(10, 15), torch.arange(20, 24)], layout=torch.jagged)

    ids_thd, psp, _ = preprocess_thd_engine(ids, pre_process=True)
    packed = pack_token_mask(token, psp.cu_seqlens_q_padded)
    assert packed.shape == ids_thd.shape
    verl_packed = preprocess_thd_engine(token, pre_process=True)[0]
    assert torch.equal(packed, verl_packed)
    # response tokens of the packed mask sit exactly on the response token ids
    assert ids_thd[packed.bool()].tolist() == [13, 14, 21, 23]
    verl_label = preprocess_thd_engine(token, pre_process=True, need_roll=True)[0]
    assert torch.equal(token_to_label_mask(packed, psp.cu_seqlens_q_padded), verl_label)

    ids_bshd, valid, _ = preprocess_bshd_engine(ids, pre_process=True)
    padded = pad_token_mask(token, ids_bshd.shape[1])
    assert torch.equal(padded, preprocess_bshd_engine(token, pre_process=True)[0])
    assert ids_bshd[padded.bool()].tolist() == [13, 14, 21, 23]
    assert not padded[~valid].any()


def test_megatron_derived_label_path_counts_exactly_the_response_targets(megatron_env):
    """process_mtp_loss (labels=None) rolls the mask once for the derived labels and once per depth, with
    megatron's roll_tensor. With our token-coordinate mask, depth 1 at position j counts iff token j + 2
    (the token it predicts) is a response token of the same sequence: packed and padded."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
    packed = torch.tensor([[0.0, 0, 0, 1, 1, 0, 0, 1, 0, 1]])
    m, _ = roll_tensor(packed, shifts=-1, dims=-1, packed_seq_params=psp)  # derived labels
    depth1, count = roll_tensor(m, shifts=-1, dims=-1, packed_seq_params=psp)  # depth 1
    # sample 0 tokens 3, 4 are targets of positions 1, 2; sample 1 tokens 1, 3 -> positions -1 (none), 1
    assert depth1.tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 0, 0]]
    assert int(count) == 3

    padded = torch.tensor([[0.0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 0]])
    m, _ = roll_tensor(padded, shifts=-1, dims=-1)
    depth1, count = roll_tensor(m, shifts=-1, dims=-1)
    assert depth1.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]]
    assert int(count) == 3
    # verl's label-coordinate mask (right for explicit labels) is shifted once too often here: depth 1
    # would count position 0 of sample 0, whose target token 2 is a prompt token
    wrong, _ = roll_tensor(token_to_label_mask(padded), shifts=-1, dims=-1)
    wrong, _ = roll_tensor(wrong, shifts=-1, dims=-1)
    assert wrong.tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert padded[0, 0 + 2] == 0 and wrong[0, 0] == 1
