"""The in-trainer acceptance estimate (:class:`verl_mtp_plugin.acceptance.AcceptanceProbe`) under the production
layouts on two gloo ranks: Megatron TP=2 with sequence parallelism (experts ETP=2), and TP=2 + SP with the MoE MTP
block's experts over EP=2 (ETP=1), each equal to the TP=1 estimate on the same model and batch.

Each rank builds the unsharded reference (TP=EP=1; MTP block ``*E``: attention + MoE, as Nemotron 3's) from one
seed and computes the probe's estimate on a batch; then builds each sharded layout, copies its shard of every
reference tensor in (``tests/gpu/pp2_tp2_common.py``) and runs the same training-mode forward with the probe. Under
sequence parallelism every rank holds ``s / tp`` positions of the hidden states the probe captures; the estimate
gathers them (``acceptance/estimate.py``). Tolerance: :data:`TOL` absolute on each rate (fp32; the sharded forward
sums the same products in another order).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
#: absolute tolerance on every estimated rate (fp32 rounding of a forward summed in another order)
TOL = 1e-6

_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[2])
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    SPEC = dict(vocab_size=100, make_vocab_size_divisible_by=64, mamba_num_groups=2, num_attention_heads=4,
                num_query_groups=2, num_experts=4)
    KEYS = ("mtp_expected_accept_rate", "mtp_greedy_accept_rate", "mtp_argmax_draft_accept_rate",
            "mtp_drafted_expected_accept_rate", "mtp_drafted_argmax_draft_accept_rate")
    CASES = {"tp2_sp": (2, 1, 2), "tp2_sp_ep2": (2, 2, 1)}

    def estimate(model, batch):
        import verl_mtp_plugin.acceptance.probe as P
        from verl_mtp_plugin.acceptance import AcceptanceProbe
        from verl_mtp_plugin.control import hybrid_forward

        P.DRAFTED_CHUNK = 5  # several chunks of rows: every rank must run the same collectives in the same order
        mask = batch["response_mask"]
        model.train()
        with AcceptanceProbe(model) as probe, torch.no_grad():
            out = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                 run_mtp_forward=True, loss_mask=mask)
            a = probe.estimate(out, mask, max_positions=1000, release=False)  # from the (vocab-sharded) logits
            b = probe.estimate(None, mask, max_positions=1000)  # recomputed from the captured hidden states
        return [a[k] for k in KEYS], [b[k] for k in KEYS], int(a["mtp_accept_num_positions"])

    def work(rank, init_method, out):
        import pp2_tp2_common as C
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), VERL_MTP_TEST_INIT_METHOD=init_method)
        torch.set_num_threads(1)
        from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron, make_batch, reset_mtp_globals

        init_megatron(seed=5)
        batch = make_batch(batch=2, seq=16, vocab=100, prompt_len=4, seed=1)
        build = lambda over: build_tiny_hybrid(**SPEC, device="cpu", config_overrides=over)
        C.reinit_parallel(5)
        reset_mtp_globals()
        ref = build({})
        with torch.no_grad():  # peakier distributions: acceptance away from the uniform-logits regime
            ref.output_layer.weight.mul_(6.0)
        C.broadcast_weights(ref)
        reference = C.full_copy(ref)
        want, want_hidden, n = estimate(ref, batch)
        assert all(abs(x - y) < 1e-6 for x, y in zip(want, want_hidden)), (want, want_hidden)
        assert 0.0 < want[0] < 1.0 and n > 0, (want, n)
        lines = [f"tp1: {want} over {n} positions"]
        for tag, (tp, ep, etp) in CASES.items():
            C.reinit_parallel(5, tp=tp, ep=ep, etp=etp)
            reset_mtp_globals()
            model = build(dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp, sequence_parallel=True))
            assert model.config.sequence_parallel
            C.load_shards(model, reference, num_experts=4)
            got, got_hidden, m = estimate(model, batch)
            diff = max(abs(x - y) for x, y in zip(got + got_hidden, want + want))
            lines.append(f"{tag}: {got} (from hidden states {got_hidden}) over {m} positions; "
                         f"max |diff| vs TP=1 {diff:.2e}")
            assert m == n and diff <= float(os.environ["TOL"]), lines[-1]
            both = [None, None]
            dist.all_gather_object(both, got)
            assert both[0] == both[1], both  # every rank reports the same numbers
            del model
        with open(os.path.join(out, f"rank{rank}.ok"), "w") as f:
            f.write("\\n".join(lines))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(sys.argv[1], sys.argv[3]), nprocs=2, join=True)
        print("TP2_SP_OK")
    """
)


def test_probe_estimate_under_tp2_sequence_parallel_and_ep2_equals_tp1(tmp_path):
    """TP=2 + SP (ETP=2) and TP=2 + SP + EP=2 (ETP=1), MoE MTP block: the estimate equals TP=1's
    (|diff| <= TOL; measured 0)
    from the vocabulary-sharded logits and from the captured hidden states, on the same positions."""
    from verl_mtp_plugin.testing import rendezvous

    script = tmp_path / "tp2_sp.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), rendezvous(), os.path.join(HERE, "gpu"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "TOL": str(TOL)})
    assert proc.returncode == 0 and "TP2_SP_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = (tmp_path / "rank0.ok").read_text().splitlines()
    print("\n".join(lines))
    assert [x.split(":")[0] for x in lines] == ["tp1", "tp2_sp", "tp2_sp_ep2"]
