"""Packed (THD) sequences on the Nemotron-3-shaped tiny HybridModel (Mamba + attention + MoE, MTP block ``*E``):
real megatron-core on CPU, fp32, through the plugin's engine forward
(:func:`verl_mtp_plugin.engine.megatron.hybrid_forward_micro_batch`, what ``forward_step`` calls), which packs with
verl's own ``preprocess_thd_engine`` (bucket padding ``pad_to_length_bucket`` as verl's engine passes it), unpacks
with ``postprocess_thd_engine`` and adds Mamba's per-sample index ``seq_idx`` (``with_mamba_seq_idx``).

The reference is every sample alone, unpacked (BSHD, batch 1). A packed batch must give, within fp32 tolerance:
every real token's logits, the MTP loss (megatron's hard cross-entropy and top-1, and the ``soft_ce`` / ``tv``
objectives; ``chained_tv`` over two depths), the in-trainer acceptance estimate, the trunk's gradients (sum over samples) and the MTP block's
gradients (megatron normalises the MTP loss by the counted positions of the whole micro-batch: the per-sample
gradients weighted by their share of those positions). Without ``seq_idx`` Mamba carries state from one packed
sample into the next and the logits differ (checked, so the comparison can fail).

CPU stand-ins used (each names the library line that forces it): :mod:`verl_mtp_cpu._mamba_ref` (Mamba's
GPU kernels, with ``seq_idx`` as mamba_ssm / causal_conv1d take it) and
:class:`verl_mtp_cpu.attention.ThdDotProductAttentionRef` (megatron takes THD attention only through TE).
The same comparison through verl's whole pass (``forward_step``, verl's ppo_loss, DDP) is in ``test_verl_engine.py``.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from verl_mtp_plugin.acceptance.estimate import (
    ACCEPT_LENGTH_KEY,
    ARGMAX_DRAFT_KEY,
    DRAFTED_EXPECTED_KEY,
    DRAFTED_POSITIONS_KEY,
    EXPECTED_KEY,
    GREEDY_KEY,
    POSITIONS_KEY,
    expected_accept_length,
)
from verl_mtp_plugin.metrics import ACC_KEY, LOSS_KEY, collect_mtp_metrics
from verl_mtp_plugin.objective import OBJECTIVE_KEY, collect_objective_metrics, reset_objective_metrics

# (prompt, response) lengths; sample 0 has two tool-output tokens masked out of its response
SAMPLES = [(5, 7), (3, 6), (4, 9)]
#: verl's pad_to_length_bucket: 34 real tokens packed to 48 rows (14 rows of bucket padding on the last sample)
BUCKET = 16
#: fp32 tolerance: packed and unpacked runs sum in different orders (MoE experts see the tokens of all samples
#: at once, the Mamba conv is masked per tap)
RTOL, ATOL = 1e-4, 1e-5


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i, (p, r) in enumerate(SAMPLES):
        ids.append(torch.randint(1, 128, (p + r,), generator=g))
        m = torch.zeros(p + r)
        m[p:] = 1
        if i == 0:
            m[p + 3 : p + 5] = 0
        masks.append(m)
    return ids, masks


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _model(seed=5, pattern="M*-E/*E", **kwargs):
    from verl_mtp_plugin.testing import build_tiny_hybrid

    torch.manual_seed(seed)
    model = build_tiny_hybrid(pattern=pattern, mtp_detach_heads=True, **kwargs)  # online: MTP loss isolated from the trunk
    assert any(type(m).__name__ == "MambaMixer" for m in model.modules())
    return model


def _run(model, ids, masks, *, data_format, objective, bucket=None, depths=1, draft_k=None):
    """One micro-batch through the engine's forward + backward of (main next-token CE summed over real tokens,
    megatron's MTP loss). Returns logits, MTP metrics, acceptance estimate, gradients."""
    from verl_mtp_plugin.engine.megatron import hybrid_forward_micro_batch
    from verl_mtp_plugin.testing import reset_mtp_globals

    reset_mtp_globals(num_depths=depths)
    reset_objective_metrics()
    model.zero_grad(set_to_none=True)
    acceptance: dict = {}
    logits = hybrid_forward_micro_batch(
        model, _nested(ids), run_mtp_forward=True, mtp_token_mask=_nested(masks), data_format=data_format,
        pad_to_length_bucket=bucket, acceptance=acceptance, acceptance_temperature=1.0, objective=objective,
        acceptance_draft_k=draft_k,
    )
    rows = logits.unbind()
    main = sum(F.cross_entropy(lg[:-1], t[1:], reduction="sum") for lg, t in zip(rows, ids))
    main.backward()
    metrics = collect_mtp_metrics(1, reset=True)
    if objective != "hard_ce":
        metrics.update(collect_objective_metrics(objective, 1))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [r.detach() for r in rows], metrics, acceptance, grads


def _mtp_positions(mask):
    # megatron's MTP loss at depth 1 counts position t when token t+2 is a response token (mask rolled twice)
    return float(mask[2:].sum())


@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv"])
def test_packed_batch_equals_each_sample_alone(megatron_env, objective):
    model = _model()
    ids, masks = _batch()
    packed = _run(model, ids, masks, data_format="thd", objective=objective, bucket=BUCKET)
    alone = [_run(model, [i], [m], data_format="bshd", objective=objective) for i, m in zip(ids, masks)]

    # every real token's logits
    for k, (got, (rows, *_)) in enumerate(zip(packed[0], alone)):
        assert got.shape == rows[0].shape == (len(ids[k]), 128)
        torch.testing.assert_close(got, rows[0], rtol=RTOL, atol=ATOL, msg=f"sample {k}")

    # the MTP loss: one micro-batch normalises by all its counted positions
    n = torch.tensor([_mtp_positions(m) for m in masks])
    w = n / n.sum()
    keys = [LOSS_KEY.format(k=1), ACC_KEY.format(k=1)]
    if objective != "hard_ce":
        keys.append(OBJECTIVE_KEY.format(k=1, objective=objective))
    for key in keys:
        want = sum(float(wi) * a[1][key] for wi, a in zip(w, alone))
        assert packed[1][key] == pytest.approx(want, rel=RTOL, abs=ATOL), key
    assert packed[1][LOSS_KEY.format(k=1)] > 0

    # the acceptance estimate: a mean over the counted positions of the micro-batch (all of them: < 128)
    pos = [a[2][POSITIONS_KEY] for a in alone]
    assert packed[2][POSITIONS_KEY] == sum(pos) > 0
    for key in (EXPECTED_KEY, GREEDY_KEY, ARGMAX_DRAFT_KEY):
        want = sum(p * a[2][key] for p, a in zip(pos, alone)) / sum(pos)
        assert packed[2][key] == pytest.approx(want, rel=RTOL, abs=ATOL), key
    alpha = packed[2][EXPECTED_KEY]
    assert packed[2][ACCEPT_LENGTH_KEY.format(k=2)] == pytest.approx(float(expected_accept_length(alpha, 2)), rel=1e-6)

    # gradients: the trunk's are the sum over samples; the MTP block's the per-sample ones weighted by their share
    grads = packed[3]
    mtp = [k for k in grads if k.startswith("mtp.")]
    trunk = [k for k in grads if not k.startswith("mtp.")]
    assert mtp and any("mixer" in k for k in trunk)
    assert all(float(grads[k].abs().sum()) > 0 for k in mtp if "expert_bias" not in k)
    for k in trunk:
        want = sum(a[3][k] for a in alone if k in a[3])
        torch.testing.assert_close(grads[k], want, rtol=RTOL, atol=ATOL, msg=k)
    for k in mtp:
        want = sum(float(wi) * a[3][k] for wi, a in zip(w, alone))
        torch.testing.assert_close(grads[k], want, rtol=RTOL, atol=ATOL, msg=k)


def test_packed_chained_tv_over_two_depths_equals_each_sample_alone(megatron_env):
    """chained_tv on the recipes' MTP shape (one block applied as 2 depths) under THD packing: per depth, the
    value is the samples' own values weighted by their counted positions at that depth (the product of a
    position near a sample's end never takes a factor from the next packed sample; sample 0's masked tool
    output enters as 1), and logits and every gradient equal the same samples padded into one BSHD batch."""
    model = _model(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True)
    ids, masks = _batch()
    run = partial(_run, model, objective="chained_tv", depths=2)
    packed = run(ids, masks, data_format="thd", bucket=BUCKET)
    padded = run(ids, masks, data_format="bshd")
    alone = [run([i], [m], data_format="bshd") for i, m in zip(ids, masks)]
    for d in (1, 2):
        key = OBJECTIVE_KEY.format(k=d, objective="chained_tv")
        n = torch.tensor([float(m[1 + d:].sum()) for m in masks])  # depth d counts t when token t+1+d is a response token
        want = sum(float(ni / n.sum()) * a[1][key] for ni, a in zip(n, alone))
        assert packed[1][key] == pytest.approx(want, rel=RTOL, abs=ATOL), key
        assert packed[1][key] == pytest.approx(padded[1][key], rel=RTOL, abs=ATOL), key
    assert packed[1][OBJECTIVE_KEY.format(k=2, objective="chained_tv")] > packed[1][OBJECTIVE_KEY.format(k=1, objective="chained_tv")] > 0
    for got, want in zip(packed[0], padded[0]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    mtp = [k for k in packed[3] if k.startswith("mtp.") and "expert_bias" not in k]
    assert mtp and all(float(packed[3][k].abs().sum()) > 0 for k in mtp)
    assert set(packed[3]) == set(padded[3])
    for k in packed[3]:
        torch.testing.assert_close(packed[3][k], padded[3][k], rtol=RTOL, atol=ATOL, msg=k)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_micro_batch_drafted_estimate_drafts_vllms_k(megatron_env, data_format):
    """The engine's micro-batch (packed and padded) hands vLLM's k to the drafted estimate: on a one-depth model
    k = 3 drafts further from each start than the depths' schedule (None), and the packed and padded layouts agree."""
    model = _model()
    ids, masks = _batch()
    run = partial(_run, model, ids, masks, data_format=data_format, objective="hard_ce",
                  bucket=BUCKET if data_format == "thd" else None)
    est = {k: run(draft_k=k)[2] for k in (None, 3)}
    padded = {k: _run(model, ids, masks, data_format="bshd", objective="hard_ce", draft_k=k)[2] for k in (None, 3)}
    for k in (None, 3):
        assert est[k][DRAFTED_EXPECTED_KEY] == pytest.approx(padded[k][DRAFTED_EXPECTED_KEY], rel=RTOL, abs=ATOL)
    assert abs(est[3][DRAFTED_EXPECTED_KEY] - est[None][DRAFTED_EXPECTED_KEY]) > 1e-4
    assert est[3][DRAFTED_POSITIONS_KEY] == est[None][DRAFTED_POSITIONS_KEY] > 0


@pytest.mark.parametrize("objective", ["soft_ce", "tv", "chained_tv"])
def test_packed_objectives_in_chunks_of_tokens_equal_one_chunk(megatron_env, monkeypatch, objective):
    """The objectives and the acceptance estimate computed a few packed rows at a time (chunks of 5 tokens of the
    48 packed rows, cut across the packed samples' boundaries) equal the one-chunk computation: every value, the
    estimate and every gradient (chained_tv over 2 depths, the tool-output mask entering as 1)."""
    from verl_mtp_plugin.acceptance import estimate

    depths = 2 if objective == "chained_tv" else 1
    model = _model(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True) if depths == 2 else _model()
    ids, masks = _batch()
    run = partial(_run, model, ids, masks, data_format="thd", objective=objective, bucket=BUCKET, depths=depths)
    one = run()
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 4 * 128 * 5)
    assert estimate.chunk_rows(128) == 5
    chunked = run()
    key = OBJECTIVE_KEY.format(k=depths, objective=objective)
    assert key in chunked[1] and chunked[1][key] > 0
    assert set(chunked[1]) == set(one[1]) and set(chunked[2]) == set(one[2]) and set(chunked[3]) == set(one[3])
    for k, v in chunked[1].items():
        assert v == pytest.approx(one[1][k], rel=1e-6, abs=1e-7), k
    for k, v in chunked[2].items():
        assert v == pytest.approx(one[2][k], rel=1e-6, abs=1e-7), k
    mtp = [k for k in chunked[3] if k.startswith("mtp.") and "expert_bias" not in k]
    assert mtp and all(float(chunked[3][k].abs().sum()) > 0 for k in mtp)
    for k in chunked[3]:
        torch.testing.assert_close(chunked[3][k], one[3][k], rtol=1e-6, atol=1e-8, msg=k)


def test_packed_batch_without_mamba_seq_idx_leaks_state(megatron_env, monkeypatch):
    """The comparison above can fail: with seq_idx dropped (verl 0.9.1's packing alone), Mamba's state flows
    from each packed sample into the next, so every sample but the first gets other logits."""
    import verl_mtp_plugin.engine.megatron as eng

    model = _model()
    ids, masks = _batch()
    alone = [_run(model, [i], [m], data_format="bshd", objective="hard_ce")[0][0] for i, m in zip(ids, masks)]
    monkeypatch.setattr(eng, "with_mamba_seq_idx", lambda psp: psp)
    leaked = _run(model, ids, masks, data_format="thd", objective="hard_ce", bucket=BUCKET)[0]
    torch.testing.assert_close(leaked[0], alone[0], rtol=RTOL, atol=ATOL)  # nothing before the first sample
    for k in (1, 2):
        assert float((leaked[k] - alone[k]).abs().max()) > 1e-3, f"sample {k} did not see the previous sample"


@pytest.mark.parametrize("bucket", [None, 1, 7, 16, 64])
def test_mamba_seq_idx_covers_every_packed_row(megatron_env, bucket):
    """seq_idx has one entry per row of the packed tensor verl builds (bucket padding included) and changes
    exactly at each sample's padded start; the padding rows belong to the last sample."""
    from verl.models.mcore.util import preprocess_thd_engine

    from verl_mtp_plugin.engine.megatron import with_mamba_seq_idx

    ids, _ = _batch()
    packed, psp, _ = preprocess_thd_engine(_nested(ids), pre_process=True, pad_to_length_bucket=bucket)
    seq_idx = with_mamba_seq_idx(psp).seq_idx
    assert packed.dim() == 2 and seq_idx.shape == packed.shape  # [1, T]
    lengths = [len(i) for i in ids]
    want = [0] * lengths[0] + [1] * lengths[1] + [2] * (packed.shape[1] - lengths[0] - lengths[1])
    assert seq_idx[0].tolist() == want


# ---------------------------------------------------------------------------------------------- the stand-ins


def test_reference_mamba_kernels_restart_at_every_packed_sequence():
    """The fused training kernel and the chunked scan with seq_idx equal the sequences run one by one (conv window
    and SSM state never cross a boundary); varlen states are each sequence's last state; a seq_idx that is not
    [batch, seqlen] fails as mamba_ssm's assert does."""
    from verl_mtp_cpu._mamba_ref import mamba_chunk_scan_combined_ref, mamba_split_conv1d_scan_combined_ref

    g = torch.Generator().manual_seed(0)
    h, p, n, ngroups, width = 4, 8, 16, 1, 4
    dim = h * p
    lengths = [5, 1, 9, 3]
    L = sum(lengths)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    zxbcdt = torch.randn(1, L, 2 * dim + 2 * ngroups * n + h, generator=g)
    conv_w, conv_b = torch.randn(dim + 2 * ngroups * n, width, generator=g), torch.randn(dim + 2 * ngroups * n, generator=g)
    dt_bias, A, D = torch.randn(h, generator=g), -torch.rand(h, generator=g) - 0.5, torch.randn(h, generator=g)

    def fused(z, s=None):
        return mamba_split_conv1d_scan_combined_ref(z, conv_w, conv_b, dt_bias, A, D, headdim=p, ngroups=ngroups,
                                                    seq_idx=s)

    packed = fused(zxbcdt, seq_idx)
    alone = torch.cat([fused(c) for c in zxbcdt.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    assert float((fused(zxbcdt) - alone).abs().max()) > 1e-3  # without seq_idx the samples mix
    with pytest.raises(ValueError, match="seq_idx shape"):
        fused(zxbcdt, seq_idx[:, :-1])

    x, dt = torch.randn(1, L, h, p, generator=g), torch.randn(1, L, h, generator=g)
    B, C = torch.randn(1, L, ngroups, n, generator=g), torch.randn(1, L, ngroups, n, generator=g)
    y, varlen = mamba_chunk_scan_combined_ref(x, dt, A, B, C, D=D, dt_softplus=True, seq_idx=seq_idx, cu_seqlens=cu,
                                              return_varlen_states=True)
    parts = [mamba_chunk_scan_combined_ref(*(t.split(lengths, dim=1)[i] for t in (x, dt)), A,
                                           *(t.split(lengths, dim=1)[i] for t in (B, C)), D=D, dt_softplus=True,
                                           return_final_states=True) for i in range(len(lengths))]
    torch.testing.assert_close(y, torch.cat([q[0] for q in parts], dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(varlen, torch.cat([q[1] for q in parts]), rtol=1e-5, atol=1e-6)


def test_thd_attention_reference_matches_megatron_attention_per_sequence(megatron_env):
    """Packed rows (TE's padded layout: padding between sequences) attend causally within their sequence,
    exactly as megatron's DotProductAttention on each sequence alone; padding rows give 0."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from verl_mtp_cpu.attention import ThdDotProductAttentionRef, packed_attention
    from verl_mtp_plugin.testing import build_tiny_hybrid

    config = build_tiny_hybrid(pattern="*").config
    attn = ThdDotProductAttentionRef(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self")
    g = torch.Generator().manual_seed(0)
    lengths, padded = [4, 7, 2], [6, 7, 5]
    T = sum(padded)
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q, k, v = (torch.randn(T, n, d, generator=g) for n in (heads, groups, groups))
    cu = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    cu_pad = torch.tensor([0, 6, 13, 18], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                          cu_seqlens_kv_padded=cu_pad)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    assert out.shape == (T, heads * d)
    # what the trainer workers' stand-in runs on megatron's plain DotProductAttention (Bridge's attention_backend=local)
    plain = packed_attention(partial(DotProductAttention.forward, attn), q, k, v, AttnMaskType.causal, psp)
    assert torch.equal(plain, out)
    for start, n, end in zip(cu_pad[:-1].tolist(), lengths, cu_pad[1:].tolist()):
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        want = attn(q[start : start + n, None], k[start : start + n, None], v[start : start + n, None], mask,
                    attn_mask_type=AttnMaskType.causal)
        torch.testing.assert_close(out[start : start + n], want[:, 0], rtol=1e-6, atol=1e-6)
        assert float(out[start + n : end].abs().sum()) == 0.0
