"""TP/EP-sharded MTP export on CPU: two gloo processes, real megatron-core tensor and expert
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

from verl_mtp_plugin.testing import ENV_INIT_METHOD, rendezvous  # noqa: E402

WORLD = 2
SEED = 1234
#: vocab 100 padded to 128 (Megatron padding; 64 rows per TP rank), 2 query groups and 2 Mamba groups
#: (one per TP rank), 4 experts (2 per EP rank).
SPEC = dict(vocab_size=100, make_vocab_size_divisible_by=64, mamba_num_groups=2, num_attention_heads=4,
            num_query_groups=2, num_experts=4)
#: fp32 logits / MTP hidden states, relative L2: the sharded forward sums the same products in another
#: order (row-parallel all-reduce, vocab-parallel output), so it differs from TP=1 by rounding only.
FWD_RTOL = 1e-5
TIMEOUT_S = 240


def _build(fields, overrides):
    from verl_mtp_plugin.testing import build_tiny_hybrid

    return build_tiny_hybrid(**fields, device="cpu", config_overrides=overrides)


def _worker(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    C.set_dist_env(rank, WORLD, 0)
    os.environ[ENV_INIT_METHOD] = init_method
    from verl_mtp_plugin.testing import destroy_megatron, init_megatron, make_batch

    try:
        init_megatron(seed=SEED)
        batch = make_batch(batch=2, seq=16, vocab=100, prompt_len=4, seed=3, device="cpu")
        log = C.tp_export_check(_build, SPEC, batch, vocab_size=100, seed=SEED, fwd_rtol=FWD_RTOL)
        log += C.tp_export_check(_build, SPEC, batch, vocab_size=100, seed=SEED, fwd_rtol=FWD_RTOL,
                                 dtypes=(torch.bfloat16,), cases={"tp2_ep2": C.TP_CASES["tp2_ep2"]})
        with open(os.path.join(out_dir, f"rank{rank}.ok"), "w") as f:
            f.write("\n".join(log))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        destroy_megatron()


def test_tp2_and_ep2_export_equals_unsharded(tmp_path):
    """TP=2 (experts ETP=2) and TP=2 + EP=2 (ETP=1) on two gloo ranks.

    fp32: the sharded forward (logits and MTP hidden states) equals the unsharded one (rel <= 1e-5),
    so the shards are megatron's layout. fp32 (both layouts) and bf16 (TP=2 + EP=2): every rank's export (MTP; MTP + shared with
    vocab padding trimmed; full backbone) is bit-identical to the TP=1 export: fused QKV per query
    group, vocab-parallel embedding/output rows, column/row-parallel linears (eh_proj, linear_proj,
    shared experts), Mamba block-interleaved in_proj/conv1d, replicated router / expert bias (fp32),
    experts gathered over ETP and over EP with global indices r * E_local + e.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(rendezvous(), str(tmp_path)), nprocs=WORLD, join=False,
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
    logs = [(tmp_path / f"rank{r}.ok").read_text().splitlines() for r in range(WORLD)]
    print("\n" + "\n".join(logs[0]))
    for lines in logs:
        assert [x.split(":")[0] for x in lines] == ["tp2/float32", "tp2_ep2/float32", "tp2_ep2/bfloat16"]
        assert all("export == TP=1 export bitwise (24 MTP, 26 MTP+shared, 59 full)" in x for x in lines)
        assert all("forward vs TP=1" in x for x in lines[:2])
