"""TP/EP-sharded MTP export (issue 8) on CPU: two gloo processes, real megatron-core tensor and expert
parallelism.

Each process builds the unsharded reference model (TP=EP=1) from one seed, then re-initialises
megatron's parallel state as TP=2 (experts expert-tensor-parallel, ETP=2) or TP=2 + EP=2 (ETP=1),
builds the sharded model and copies its shard of every reference tensor into it
(``tests/gpu/pp2_tp2_common.py``: megatron's ``partition_dim`` / ``partition_sizes`` attributes and
global expert ``r * E_local + e``). The sharded model's forward must equal the reference's (so the
shards are megatron's own layout), and ``export_mtp_weights`` on every rank must give exactly the
reference's HF tensors.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))

import pp2_tp2_common as C  # noqa: E402

WORLD = 2
SEED = 1234
#: vocab 100 padded to 128 (Megatron padding; 64 rows per TP rank), 2 query groups and 2 Mamba groups
#: (one per TP rank), 4 experts (2 per EP rank).
SPEC = dict(vocab_size=100, make_vocab_size_divisible_by=64, mamba_num_groups=2, num_attention_heads=4,
            num_query_groups=2, num_experts=4)
CASES = {
    "tp2": dict(tp=2, ep=1, etp=2),
    "tp2_ep2": dict(tp=2, ep=2, etp=1),
}
#: fp32 logits/loss: the sharded forward sums the same products in another order (row-parallel
#: all-reduce, vocab-parallel softmax), so it differs from TP=1 by rounding only.
FWD_RTOL = 1e-5
TIMEOUT_S = 240


def _batch():
    from verl_mtp_plugin.testing import make_batch

    return make_batch(batch=2, seq=16, vocab=100, prompt_len=4, seed=3, device="cpu")


def _forward(model):
    """Logits ``[b, s, V]`` (gathered over TP) and the MTP block's output hidden states of one forward.

    Eval mode: megatron refuses MoE + TP *training* forwards without sequence parallelism, which
    megatron's local (non-TE) norms do not support; the weights and the math are the same.
    """
    from verl_mtp_plugin import hybrid_forward

    seen = []
    hook = model.mtp.register_forward_hook(lambda mod, args, out: seen.append(out.detach().float()))
    model.eval()
    b = _batch()
    try:
        with torch.no_grad():
            logits = hybrid_forward(model, b["input_ids"], b["position_ids"], b["attention_mask"],
                                    run_mtp_forward=True, runtime_gather_output=True)
    finally:
        hook.remove()
        model.train()
    assert len(seen) == 1, "the MTP block did not run"
    s = b["input_ids"].shape[1]
    return logits.float(), seen[0][s:]  # [main | depth 1] along the sequence: the MTP depth's hidden states


def _export(model):
    from verl_mtp_plugin.export import export_mtp_weights

    mtp = dict(export_mtp_weights(model))
    shared = dict(export_mtp_weights(model, vocab_size=100, include_shared=True))
    full = dict(export_mtp_weights(model, vocab_size=100, include_backbone=True))
    return mtp, shared, full


def _assert_same_export(got, ref, tag):
    for g, r, kind in zip(got, ref, ("mtp", "shared", "backbone")):
        assert set(g) == set(r), f"{tag}/{kind}: names differ: {sorted(set(g) ^ set(r))[:8]}"
        for n in r:
            assert g[n].dtype == r[n].dtype and g[n].shape == r[n].shape, f"{tag}/{kind}: {n}"
            assert torch.equal(g[n], r[n]), f"{tag}/{kind}: {n} differs (max {float((g[n] - r[n]).abs().max())})"


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    C.set_dist_env(rank, WORLD, port)
    from megatron.core import parallel_state as ps

    from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron

    log = []
    try:
        init_megatron(seed=SEED)  # TP=1 (data-parallel 2): the reference, identical on both ranks
        ref = build_tiny_hybrid(**SPEC)
        reference = C.full_copy(ref)
        ref_logits, ref_mtp = _forward(ref)
        ref_export = _export(ref)
        assert ref_logits.shape == (2, 16, 128) and ref_mtp.shape == (16, 2, 64)
        for tag, case in CASES.items():
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=case["tp"], expert_model_parallel_size=case["ep"],
                                         expert_tensor_parallel_size=case["etp"])
            init_megatron(seed=SEED)  # groups exist: only the RNG is re-seeded
            model = build_tiny_hybrid(**SPEC, config_overrides=dict(
                tensor_model_parallel_size=case["tp"], expert_model_parallel_size=case["ep"],
                expert_tensor_parallel_size=case["etp"]))
            qkv = model.mtp.layers[0].mtp_model_layer.layers[0].self_attention.linear_qkv.weight
            assert qkv.shape[0] == (4 + 2 * 2) * 16 // 2  # one query group [q, q, k, v] per rank
            assert model.embedding.word_embeddings.weight.shape[0] == 64
            assert len(model.mtp.layers[0].mtp_model_layer.layers[1].mlp.experts.local_experts) == 4 // case["ep"]
            n = C.load_shards(model, reference, num_experts=4)
            logits, mtp = _forward(model)
            e_logits, e_mtp = C.rel_err(logits, ref_logits), C.rel_err(mtp, ref_mtp)
            log.append(f"{tag}: {n} tensors sharded; logits rel err {e_logits:.2e}, MTP hidden rel err {e_mtp:.2e}")
            assert e_logits < FWD_RTOL and e_mtp < FWD_RTOL, log[-1]
            got = _export(model)
            _assert_same_export(got, ref_export, tag)
            log.append(f"{tag}: export equal ({len(got[0])} MTP, {len(got[2])} full HF tensors)")
        with open(os.path.join(out_dir, f"rank{rank}.ok"), "w") as f:
            f.write("\n".join(log))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        from verl_mtp_plugin.testing import destroy_megatron

        destroy_megatron()


def test_tp2_and_ep2_export_equals_unsharded(tmp_path):
    """TP=2 (ETP=2) and TP=2+EP=2 (ETP=1), two gloo ranks: the sharded forward equals the unsharded one
    (fp32, rel <= 1e-5), and every rank's export (MTP, MTP + shared, full backbone; vocab padding
    trimmed) is bit-identical to the TP=1 export: QKV per query group, vocab-parallel rows,
    column/row-parallel linears, Mamba block-interleaved in_proj/conv1d, replicated router and
    expert bias, experts gathered over EP with global indices."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(C.free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"two-rank export did not finish in {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    logs = [(tmp_path / f"rank{r}.ok").read_text() for r in range(WORLD)]
    print("\n" + logs[0])
    assert all("tp2_ep2: export equal" in x for x in logs)
