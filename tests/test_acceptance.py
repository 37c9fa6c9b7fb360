"""In-trainer MTP acceptance estimate: pure math, alignment, and the probe on a real HybridModel."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_mtp_plugin.acceptance import (
    ARGMAX_DRAFT_KEY,
    EXPECTED_KEY,
    GREEDY_KEY,
    POSITIONS_KEY,
    AcceptanceProbe,
    acceptance_positions,
    argmax_draft_acceptance,
    expected_accept_length,
    expected_speedup,
    greedy_agreement,
    per_position_acceptance,
    select_positions,
    speculative_overlap,
)
from verl_mtp_plugin.acceptance.estimate import (
    DRAFTED_ARGMAX_KEY,
    DRAFTED_EXPECTED_KEY,
    DRAFTED_POSITIONS_KEY,
    DRAFTED_SUMS,
    combine_estimates,
    draft_schedule,
    pool_drafted,
    response_runs,
)

NEG = float("-inf")


# --------------------------------------------------------------------------------------------------
# brute-force references (python loops over positions and vocabulary)
# --------------------------------------------------------------------------------------------------


def _softmax_list(row, temperature):
    xs = [float(x) / temperature for x in row]
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    z = sum(es)
    return [e / z for e in es]


def _argmax_list(row):
    best = 0
    for i, x in enumerate(row):
        if float(x) > float(row[best]):
            best = i
    return best


def _brute_force(main, mtp, mask, temperature, depth=1):
    """Mean overlap / greedy / argmax-draft over positions t with tokens t+1..t+1+depth in the response."""
    b, s, v = main.shape
    alphas, greedy, argmax_draft, positions = [], [], [], []
    for bi in range(b):
        for t in range(s):
            if t + 1 + depth >= s:
                continue
            if not all(mask[bi, t + j] != 0 for j in range(1, depth + 2)):
                continue
            p = _softmax_list(main[bi, t + depth].tolist(), temperature)
            q = _softmax_list(mtp[bi, t].tolist(), temperature)
            alphas.append(sum(min(p[i], q[i]) for i in range(v)))
            gp, gq = _argmax_list(main[bi, t + depth].tolist()), _argmax_list(mtp[bi, t].tolist())
            greedy.append(1.0 if gp == gq else 0.0)
            argmax_draft.append(p[gq])
            positions.append((bi, t))
    n = len(alphas)
    return sum(alphas) / n, sum(greedy) / n, sum(argmax_draft) / n, positions


def _means(res):
    n = res["valid"].sum()
    return (res["alpha"].sum() / n).item(), (res["greedy"].sum() / n).item(), (res["argmax_draft"].sum() / n).item()


# --------------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("depth", [1, 2])
def test_per_position_acceptance_equals_brute_force(temperature, depth):
    g = torch.Generator().manual_seed(3)
    b, s, v = 3, 9, 5
    main = torch.randn(b, s, v, generator=g) * 2
    mtp = torch.randn(b, s, v, generator=g) * 2
    mask = torch.zeros(b, s)
    mask[0, 2:] = 1
    mask[1, 4:8] = 1  # right padding after the response
    mask[2, 1:] = 1
    mask[2, 5] = 0  # a hole (e.g. a tool-output token)
    res = per_position_acceptance(main, mtp, mask, depth=depth, temperature=temperature)
    a, gr, ad, positions = _brute_force(main, mtp, mask, temperature, depth)
    assert sorted(map(tuple, res["valid"].nonzero().tolist())) == sorted(positions)
    ra, rg, rad = _means(res)
    assert ra == pytest.approx(a, abs=1e-6)
    assert rg == pytest.approx(gr, abs=1e-6)
    assert rad == pytest.approx(ad, abs=1e-6)
    assert 0.0 < ra < 1.0


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 11, generator=g)
    for t in (1.0, 0.3):
        assert torch.allclose(speculative_overlap(x, x.clone(), t), torch.ones(4, 7), atol=1e-6)
    assert torch.equal(greedy_agreement(x, x.clone()), torch.ones(4, 7))
    # Same logits up to a per-row constant: same distribution.
    assert torch.allclose(speculative_overlap(x, x + 5.0), torch.ones(4, 7), atol=1e-6)


def test_disjoint_supports_accept_nothing():
    p = torch.full((3, 6), NEG)
    q = torch.full((3, 6), NEG)
    p[:, :3] = torch.randn(3, 3)
    q[:, 3:] = torch.randn(3, 3)
    assert torch.equal(speculative_overlap(p, q), torch.zeros(3))
    assert torch.equal(greedy_agreement(p, q), torch.zeros(3))
    assert torch.equal(argmax_draft_acceptance(p, q), torch.zeros(3))


def test_temperature_zero_is_greedy_and_temperature_matters():
    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    greedy = greedy_agreement(p, q)
    assert torch.equal(greedy, (p.argmax(-1) == q.argmax(-1)).float())
    assert 0 < greedy.sum() < 50  # both outcomes occur: the equalities below are not between constants
    assert torch.equal(speculative_overlap(p, q, 0.0), greedy)
    assert torch.equal(argmax_draft_acceptance(p, q, 0.0), greedy)
    assert not torch.allclose(speculative_overlap(p, q, 1.0), speculative_overlap(p, q, 0.5))
    # Hand-computed: p = (.5, .3, .2), q = (.2, .3, .5): the overlap is sum min = .7; at temperature 0.5 each is
    # p^2 / sum p^2 (sum .38), so the overlap is (.04 + .09 + .04) / .38.
    lp, lq = torch.tensor([0.5, 0.3, 0.2]).log(), torch.tensor([0.2, 0.3, 0.5]).log()
    assert speculative_overlap(lp, lq, 1.0).item() == pytest.approx(0.7, abs=1e-6)
    assert speculative_overlap(lp, lq, 0.5).item() == pytest.approx(0.17 / 0.38, abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        speculative_overlap(p, q, -1.0)
    with pytest.raises(ValueError, match="same shape"):
        speculative_overlap(p, q[:, :4])


def _hand_built(s=12, v=16):
    """p_main[u] puts mass c_u = 0.5 + 0.03*u on token u and the rest on sink token v-1;
    q_mtp[t] is one-hot on token t+1. Only the correct alignment (q[t] vs p[t+1]) overlaps, with
    value c_{t+1}; q[t] vs p[t] or p[t+2] overlaps nowhere (q has no sink mass)."""
    main = torch.full((1, s, v), NEG)
    for u in range(s):
        c = 0.5 + 0.03 * u
        main[0, u, u] = math.log(c)
        main[0, u, v - 1] = math.log(1 - c)
    mtp = torch.full((1, s, v), NEG)
    for t in range(s):
        mtp[0, t, (t + 1) % (v - 1)] = 0.0
    return main, mtp


def test_alignment_on_hand_built_case():
    s = 12
    main, mtp = _hand_built(s)
    prompt_len = 4
    mask = torch.zeros(1, s)
    mask[0, prompt_len:] = 1
    res = per_position_acceptance(main, mtp, mask)
    # Counted: tokens t+1 and t+2 are response tokens -> t = prompt_len-1 .. s-3.
    expected_t = list(range(prompt_len - 1, s - 2))
    assert res["valid"][0].nonzero().flatten().tolist() == expected_t
    for t in range(s):
        want = (0.5 + 0.03 * (t + 1)) if t in expected_t else 0.0
        assert res["alpha"][0, t].item() == pytest.approx(want, abs=1e-6)
    mean = _means(res)[0]
    assert mean == pytest.approx(sum(0.5 + 0.03 * (t + 1) for t in expected_t) / len(expected_t), abs=1e-6)
    # greedy: argmax p[t+1] = t+1 = argmax q[t] (c_u > 0.5 beats the sink) everywhere counted.
    assert _means(res)[1] == 1.0
    # Off-by-one alignments give other values: q[t] vs p[t] and q[t] vs p[t+2] never overlap.
    q = mtp[0, : s - 2]
    assert torch.equal(speculative_overlap(main[0, : s - 2], q), torch.zeros(s - 2))
    assert torch.equal(speculative_overlap(main[0, 2:], q), torch.zeros(s - 2))
    assert torch.equal(greedy_agreement(main[0, 2:], q), torch.zeros(s - 2))
    # A mask shifted by one (label coordinates instead of token coordinates) changes the counted set.
    shifted = torch.roll(mask, -1, dims=1)
    shifted[0, -1] = 0
    assert _means(per_position_acceptance(main, mtp, shifted))[0] != pytest.approx(mean, abs=1e-4)


def test_acceptance_positions_depths_and_edges():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]])
    assert acceptance_positions(mask, 1)[0].nonzero().flatten().tolist() == [1, 2, 3]
    assert acceptance_positions(mask, 2)[0].nonzero().flatten().tolist() == [1, 2]
    assert acceptance_positions(mask, 3)[0].nonzero().flatten().tolist() == [1]
    assert not acceptance_positions(torch.ones(2, 2), 1).any()  # too short for t, t+1, t+2
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        acceptance_positions(torch.ones(8), 1)
    with pytest.raises(ValueError, match="depth"):
        acceptance_positions(mask, 0)


def test_expected_accept_length_and_speedup():
    for k in (1, 2, 3, 5):
        assert expected_accept_length(0.0, k) == 1.0
        assert expected_accept_length(1.0, k) == k + 1
        assert expected_accept_length(1.0 - 1e-9, k) == pytest.approx(k + 1, abs=1e-6)
        a = 0.37
        assert expected_accept_length(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=1e-12)
    assert expected_accept_length(0.8, 3) == pytest.approx(2.952, abs=1e-12)
    assert expected_accept_length(0.5, 0) == 1.0
    t = expected_accept_length(torch.tensor([0.0, 0.8, 1.0]), 3)
    assert torch.allclose(t, torch.tensor([1.0, 2.952, 4.0]))
    assert expected_speedup(0.8, 3, 0.1) == pytest.approx(2.952 / 1.3, rel=1e-12)
    assert expected_speedup(1.0, 2, 0.0) == 3.0
    with pytest.raises(ValueError, match="alpha"):
        expected_accept_length(1.5, 2)
    with pytest.raises(ValueError, match="k"):
        expected_accept_length(0.5, -1)
    with pytest.raises(ValueError, match="draft_cost"):
        expected_speedup(0.5, 2, -0.1)


def test_select_positions():
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[:, 5:35] = True
    bi, ti = select_positions(valid, 10)
    assert bi.numel() == 10 and len(set(zip(bi.tolist(), ti.tolist()))) == 10
    assert bool(valid[bi, ti].all())
    assert torch.equal(torch.stack(select_positions(valid, 10)), torch.stack((bi, ti)))  # deterministic
    # Evenly spaced: rows 0, 1 and 2 are all represented.
    assert set(bi.tolist()) == {0, 1, 2}
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    r1, r2 = select_positions(valid, 10, g1), select_positions(valid, 10, g2)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1]) and bool(valid[r1].all())
    allb, allt = select_positions(valid, 1000)
    assert allb.numel() == 90
    with pytest.raises(ValueError, match="max_positions"):
        select_positions(valid, 0)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_acceptance_stats_in_chunks_of_rows_equal_one_chunk(monkeypatch, temperature):
    """The estimate's softmaxes run a chunk of rows at a time (estimate.CHUNK_BYTES): chunks of 4 of 2 x 9 rows (not
    a divisor) give the one-chunk numbers exactly, in the input's shape, and the dense functions' values."""
    from verl_mtp_plugin.acceptance import estimate

    g = torch.Generator().manual_seed(4)
    p, q = torch.randn(2, 9, 31, generator=g) * 2, torch.randn(2, 9, 31, generator=g) * 2
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 2**40)
    one = estimate.acceptance_stats(p, q, temperature, None)
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 4 * 31 * 4)
    assert estimate.chunk_rows(31) == 4
    got = estimate.acceptance_stats(p, q, temperature, None)
    for a, b in zip(got, one):
        assert a.shape == (2, 9) and torch.equal(a, b)
    torch.testing.assert_close(got[0], speculative_overlap(p, q, temperature), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2], argmax_draft_acceptance(p, q, temperature), rtol=1e-6, atol=1e-7)


_SHARDED_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from verl_mtp_plugin.acceptance import speculative_overlap, greedy_agreement, argmax_draft_acceptance
    from verl_mtp_plugin.acceptance.estimate import acceptance_stats as _acceptance_stats, rows_at as _rows_at

    def work(rank, init_method):
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        g = torch.Generator().manual_seed(11)
        p = torch.randn(7, 10, generator=g) * 3
        q = torch.randn(7, 10, generator=g) * 3
        q[0] = 0.0; q[0, 2] = 5.0; q[0, 7] = 5.0     # tie across shards: first index (2) wins
        p[1] = q[1]                                  # identical row
        p[2, :5] = float("-inf"); q[2, 5:] = float("-inf")  # disjoint supports across shards
        sl = slice(rank * 5, rank * 5 + 5)
        grp = dist.group.WORLD
        for t in (1.0, 0.7, 0.0):
            a = speculative_overlap(p[:, sl], q[:, sl], t, group=grp)
            assert torch.allclose(a, speculative_overlap(p, q, t), atol=1e-6), (t, a)
            d = argmax_draft_acceptance(p[:, sl], q[:, sl], t, group=grp)
            assert torch.allclose(d, argmax_draft_acceptance(p, q, t), atol=1e-6), (t, d)
            fused = _acceptance_stats(p[:, sl], q[:, sl], t, grp)  # the probe's path
            for got, want in zip(fused, _acceptance_stats(p, q, t, None)):
                assert torch.allclose(got, want, atol=1e-6), (t, got, want)
            assert torch.allclose(fused[0], speculative_overlap(p, q, t), atol=1e-6)
            import verl_mtp_plugin.acceptance.estimate as estimate
            one_chunk, estimate.CHUNK_BYTES = estimate.CHUNK_BYTES, 4 * 5 * 3  # the 7 rows in chunks of 3
            for got, want in zip(_acceptance_stats(p[:, sl], q[:, sl], t, grp), fused):
                assert torch.equal(got, want), (t, got, want)
            estimate.CHUNK_BYTES = one_chunk
        # Sequence parallelism: rank r holds positions [r*s/2, (r+1)*s/2) of a [s, b, h] hidden state.
        hid = torch.randn(8, 3, 4, generator=g)
        bi, ti = torch.tensor([0, 2, 1, 1, 0]), torch.tensor([7, 0, 3, 4, 5])
        rows = _rows_at(hid[rank * 4 : rank * 4 + 4], bi, ti, grp)
        assert torch.equal(rows, hid[ti, bi]), rows
        gr = greedy_agreement(p[:, sl], q[:, sl], group=grp)
        assert torch.equal(gr, greedy_agreement(p, q)), gr
        assert abs(float(speculative_overlap(p[:, sl], q[:, sl], group=grp)[1]) - 1) < 1e-6
        assert float(speculative_overlap(p[:, sl], q[:, sl], group=grp)[2]) == 0.0
        # Data parallelism: the drafted estimate pooled over the ranks' responses (accepted over verify steps, each
        # summed), not the mean of the ranks' rates (0.475 here); a rank's other metrics stay its own
        from verl_mtp_plugin.acceptance.estimate import DRAFTED_ARGMAX_KEY as DA, DRAFTED_EXPECTED_KEY as DE
        from verl_mtp_plugin.acceptance.estimate import DRAFTED_POSITIONS_KEY as DP, DRAFTED_SUMS, pool_drafted
        def rank_est(hits, arg_hits, steps, positions):
            est = {DE: hits / steps, DA: arg_hits / steps, DP: positions, "mtp_expected_accept_rate": 0.1 * rank}
            est.update(zip(DRAFTED_SUMS[DE], (hits, steps)))
            est.update(zip(DRAFTED_SUMS[DA], (arg_hits, steps)))
            return est
        mine = rank_est(30.0, 10.0, 40.0, 100.0) if rank == 0 else rank_est(2.0, 5.0, 10.0, 20.0)
        got = pool_drafted(mine, group=grp)
        assert (got[DE], got[DA], got[DP]) == (32 / 50, 15 / 50, 120.0), got
        assert got["mtp_expected_accept_rate"] == 0.1 * rank and len(got) == 4, got
        # a rank without drafted positions adds nothing; none anywhere: no drafted rate at all
        got = pool_drafted(mine if rank == 0 else {"mtp_expected_accept_rate": 0.3}, group=grp)
        assert (got[DE], got[DA], got[DP]) == (0.75, 0.25, 100.0), got
        assert pool_drafted({}, group=grp) == {}
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(sys.argv[1],), nprocs=2, join=True)
        print("SHARDED_OK")
    """
)


def test_vocab_sharded_reductions_match_full_vocab(tmp_path):
    """Tensor parallelism: a 2-rank gloo group, each rank holding half the vocabulary."""
    from verl_mtp_plugin.testing import rendezvous

    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), rendezvous()], capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


_TP2_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def work(rank, init_method):
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", VERL_MTP_TEST_INIT_METHOD=init_method)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        from verl_mtp_plugin.acceptance import AcceptanceProbe, per_position_acceptance
        from verl_mtp_plugin.control import hybrid_forward
        from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron, make_batch, reset_mtp_globals

        init_megatron(seed=5, tp=2)
        reset_mtp_globals()
        model = build_tiny_hybrid(pattern="*-/*-", config_overrides=dict(tensor_model_parallel_size=2))
        with torch.no_grad():
            model.output_layer.weight.mul_(6.0)
        batch = make_batch(batch=2, seq=16, vocab=128, prompt_len=6, seed=1)
        mask = batch["response_mask"]
        with AcceptanceProbe(model) as probe, torch.no_grad():
            out = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                 run_mtp_forward=True, loss_mask=mask)
            assert out.shape == (2, 16, 64), out.shape  # vocabulary-sharded logits
            full_main = gather_from_tensor_model_parallel_region(out, group=model.tp_group)
            mtp_full = gather_from_tensor_model_parallel_region(probe.mtp_logits(1), group=model.tp_group)
            ref = per_position_acceptance(full_main, mtp_full, mask)
            n = ref["valid"].sum()
            want = [(ref[k].sum() / n).item() for k in ("alpha", "greedy", "argmax_draft")]
            results = []
            for main in (out, full_main, None):  # sharded, gathered, recomputed from hidden states
                est = probe.estimate(main, mask, max_positions=1000, release=False)
                got = [est["mtp_expected_accept_rate"], est["mtp_greedy_accept_rate"],
                       est["mtp_argmax_draft_accept_rate"]]
                assert all(abs(a - b) < 1e-6 for a, b in zip(got, want)), (got, want)
                results.append(got)
        assert 0.0 < want[0] < 1.0, want
        both = [None, None]
        dist.all_gather_object(both, results[0])
        assert both[0] == both[1], both  # every TP rank reports the same numbers
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(sys.argv[1],), nprocs=2, join=True)
        print("TP2_OK")
    """
)


def test_probe_under_tensor_parallelism(tmp_path):
    """TP=2 (gloo, 2 processes): the probe's estimate from vocabulary-sharded logits, from gathered
    logits and from the captured main hidden states all equal the full-vocabulary reference."""
    from verl_mtp_plugin.testing import rendezvous

    script = tmp_path / "tp2.py"
    script.write_text(_TP2_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), rendezvous()], capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0 and "TP2_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# probe on the real tiny HybridModel
# --------------------------------------------------------------------------------------------------

SEQ, BATCH, PROMPT = 16, 2, 6


@pytest.fixture(scope="module")
def tiny(megatron_env):
    from verl_mtp_plugin.testing import build_tiny_hybrid, make_batch

    torch.manual_seed(0)
    model = build_tiny_hybrid()
    with torch.no_grad():  # peakier distributions: acceptance away from the uniform-logits regime
        model.output_layer.weight.mul_(6.0)
    batch = make_batch(batch=BATCH, seq=SEQ, vocab=128, prompt_len=PROMPT, seed=1)
    return model, batch


def _forward(model, batch, *, run_mtp=True, loss_mask="response"):
    from verl_mtp_plugin.control import hybrid_forward

    kw = {}
    if loss_mask == "response":
        kw["loss_mask"] = batch["response_mask"]
    elif loss_mask == "ones":
        kw["loss_mask"] = torch.ones_like(batch["response_mask"])
    return hybrid_forward(
        model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=run_mtp, **kw
    )


def _tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    t = MTPLossLoggingHelper.tracker
    return {k: t[k].clone() for k in ("loss_values", "correct_values", "total_values")}


def _ce_from_probe(logits, input_ids, mask, shift):
    """Megatron's normalisation: sum(mask * CE) / sum(mask), labels = input_ids rolled by -shift
    (zero-filled), mask rolled by -shift (zero-filled)."""
    lab = torch.roll(input_ids, -shift, dims=1)
    lab[:, -shift:] = 0
    m = torch.roll(mask, -shift, dims=1)
    m[:, -shift:] = 0
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), reduction="none")
    ce = ce.view_as(m)
    correct = ((logits.argmax(-1) == lab).float() * m).sum()
    return (ce * m).sum() / m.sum(), correct, m.sum()


@pytest.mark.parametrize("loss_mask", ["response", "ones"])
def test_probe_mtp_logits_match_megatron_internal_loss(tiny, loss_mask):
    """The probe's MTP logits are megatron's: its MTP loss equals CE(probe logits, input_ids rolled by 2)."""
    from verl_mtp_plugin.testing import reset_mtp_globals

    model, batch = tiny
    reset_mtp_globals()
    mask = batch["response_mask"] if loss_mask == "response" else torch.ones_like(batch["response_mask"])
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            _forward(model, batch, loss_mask=loss_mask)
        tracked = _tracker()
        logits = probe.mtp_logits(1)
    assert logits.shape == (BATCH, SEQ, 128)
    loss, correct, total = _ce_from_probe(logits, batch["input_ids"], mask, shift=2)
    assert tracked["total_values"][0].item() == total.item()
    assert tracked["loss_values"][0].item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert tracked["correct_values"][0].item() == correct.item()
    # The neighbouring alignments give a different loss: the match pins the shift.
    for wrong in (1, 3):
        assert _ce_from_probe(logits, batch["input_ids"], mask, shift=wrong)[0].item() != pytest.approx(
            loss.item(), rel=1e-3
        )


def test_probe_two_depths_match_megatron(megatron_env):
    """Depth d's logits predict token t+1+d (loss against input_ids rolled by d+1); per-depth keys."""
    from verl_mtp_plugin.testing import build_tiny_hybrid, make_batch, reset_mtp_globals

    torch.manual_seed(1)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E")
    batch = make_batch(batch=BATCH, seq=SEQ, vocab=128, prompt_len=PROMPT, seed=2)
    reset_mtp_globals()
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch)
        tracked = _tracker()
        for d in (1, 2):
            loss, _, total = _ce_from_probe(probe.mtp_logits(d), batch["input_ids"], batch["response_mask"], d + 1)
            assert tracked["total_values"][d - 1].item() == total.item()
            assert tracked["loss_values"][d - 1].item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        dense2 = per_position_acceptance(out, probe.mtp_logits(2), batch["response_mask"], depth=2)
        est = probe.estimate(out, batch["response_mask"], max_positions=10_000)
    assert est["mtp_expected_accept_rate_depth2"] == pytest.approx(_means(dense2)[0], abs=1e-6)
    assert est["mtp_greedy_accept_rate_depth2"] == pytest.approx(_means(dense2)[1], abs=1e-6)


def test_estimate_equals_dense_reference_on_real_model(tiny):
    model, batch = tiny
    mask = batch["response_mask"]
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch)
        dense = per_position_acceptance(out, probe.mtp_logits(1), mask)
        a, gr, ad = _means(dense)
        est = probe.estimate(out, mask, max_positions=10_000)
        assert not probe.has_capture  # estimate releases the capture
    assert est[POSITIONS_KEY] == dense["valid"].sum().item() == BATCH * (SEQ - PROMPT - 1)
    assert est[EXPECTED_KEY] == pytest.approx(a, abs=1e-6)
    assert est[GREEDY_KEY] == pytest.approx(gr, abs=1e-6)
    assert est[ARGMAX_DRAFT_KEY] == pytest.approx(ad, abs=1e-6)
    assert 0.0 < est[EXPECTED_KEY] < 1.0  # not a degenerate model (all or nothing accepted)
    for k in (1, 2, 3):
        assert est[f"mtp_expected_accept_length_k{k}"] == pytest.approx(expected_accept_length(a, k), abs=1e-5)
    assert all(not key.startswith("actor/") for key in est)


def test_estimate_subsample_and_options(tiny):
    model, batch = tiny
    mask = batch["response_mask"]
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch)
        dense = per_position_acceptance(out, probe.mtp_logits(1), mask)
        est5 = probe.estimate(out, mask, max_positions=5, generator=torch.Generator().manual_seed(4), release=False)
        bi, ti = select_positions(dense["valid"], 5, torch.Generator().manual_seed(4))
        assert est5[POSITIONS_KEY] == 5
        assert est5[EXPECTED_KEY] == pytest.approx(dense["alpha"][bi, ti].mean().item(), abs=1e-6)
        # Main logits recomputed from the captured main hidden states (forwards that return a loss).
        no_main = probe.estimate(None, mask, max_positions=10_000, release=False)
        full = probe.estimate(out, mask, max_positions=10_000, release=False)
        for key in full:
            assert no_main[key] == pytest.approx(full[key], abs=1e-5)
        # Temperature: 0 is greedy; another temperature changes the overlap.
        t0 = probe.estimate(out, mask, max_positions=10_000, temperature=0.0, release=False)
        assert t0[EXPECTED_KEY] == t0[GREEDY_KEY] == full[GREEDY_KEY]
        t05 = probe.estimate(out, mask, max_positions=10_000, temperature=0.5, release=False)
        assert t05[EXPECTED_KEY] != pytest.approx(full[EXPECTED_KEY], abs=1e-4)
        # Bad shapes name what is wrong.
        with pytest.raises(ValueError, match="response_mask"):
            probe.estimate(out, mask[:, :-1], release=False)
        with pytest.raises(ValueError, match="main_logits"):
            probe.estimate(out[:1], mask, release=False)
        # No counted position (prompt only) -> {}; the capture is then released.
        assert probe.estimate(out, torch.zeros_like(mask)) == {}
        assert not probe.has_capture


def _train_step(model, batch, probe=None):
    from verl_mtp_plugin.testing import reset_mtp_globals

    for p in model.parameters():
        p.grad = None
    reset_mtp_globals()
    logits = _forward(model, batch)
    est = ref = None
    if probe is not None:  # the estimate in a training step, and the dense reference from the same capture
        with torch.no_grad():
            ref = _means(per_position_acceptance(logits.detach(), probe.mtp_logits(1), batch["response_mask"]))
        est = probe.estimate(logits, batch["response_mask"])
    labels = torch.roll(batch["input_ids"], -1, dims=1)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    loss = -(logp * batch["response_mask"]).sum() / batch["response_mask"].sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().clone(), grads, _tracker(), est, ref


def test_probe_leaves_logits_and_grads_bit_identical(tiny):
    model, batch = tiny
    logits0, grads0, tracker0, _, _ = _train_step(model, batch)
    with AcceptanceProbe(model) as probe:
        logits1, grads1, tracker1, est, ref = _train_step(model, batch, probe)
    logits2, grads2, _, _, _ = _train_step(model, batch)
    assert est[POSITIONS_KEY] == BATCH * (SEQ - PROMPT - 1)  # every counted position (< max_positions)
    assert [est[EXPECTED_KEY], est[GREEDY_KEY], est[ARGMAX_DRAFT_KEY]] == pytest.approx(ref, abs=1e-6)
    assert any(n.startswith("mtp.") for n in grads0)  # the MTP loss reached the MTP parameters
    for other_logits, other_grads in ((logits1, grads1), (logits2, grads2)):
        assert torch.equal(logits0, other_logits)
        assert grads0.keys() == other_grads.keys()
        for n in grads0:
            assert torch.equal(grads0[n], other_grads[n]), n
    for k in tracker0:
        assert torch.equal(tracker0[k], tracker1[k])


def test_capture_is_detached_and_released(tiny):
    model, batch = tiny
    with AcceptanceProbe(model) as probe:
        out = _forward(model, batch)  # with grad: a real training forward
        cap = probe.captured
        assert cap is not None and cap.grad_fn is None and not cap.requires_grad
        d = model.config.mtp_num_layers
        assert cap.shape == ((1 + d) * SEQ, BATCH, model.config.hidden_size)
        assert out.requires_grad  # the forward's own output still carries the graph
        probe.release()
        assert not probe.has_capture and probe.estimate(out, batch["response_mask"]) == {}


def test_hooks_removed_on_close(tiny):
    model, batch = tiny
    pre_before = dict(model._forward_pre_hooks)
    mtp_before = dict(model.mtp._forward_hooks)
    probe = AcceptanceProbe(model)
    assert len(model._forward_pre_hooks) == len(pre_before) + 1
    assert len(model.mtp._forward_hooks) == len(mtp_before) + 1
    with probe:
        pass
    assert dict(model._forward_pre_hooks) == pre_before
    assert dict(model.mtp._forward_hooks) == mtp_before
    with torch.no_grad():
        _forward(model, batch)
    assert not probe.has_capture and probe.estimate(None, batch["response_mask"]) == {}
    probe.close()  # idempotent


def test_nothing_captured_when_mtp_is_skipped(tiny):
    """Choice: estimate() returns {} (no metric logged) when the forward skipped MTP; it never
    reuses an earlier forward's capture."""
    model, batch = tiny
    mask = batch["response_mask"]
    with AcceptanceProbe(model) as probe, torch.no_grad():
        out = _forward(model, batch, run_mtp=False)
        assert not probe.has_capture
        assert probe.estimate(out, mask) == {}
        _forward(model, batch, run_mtp=True)
        assert probe.has_capture
        out = _forward(model, batch, run_mtp=False)  # a later skipped forward drops the stale capture
        assert not probe.has_capture and probe.estimate(out, mask) == {}
        out = _forward(model, batch, run_mtp=True)
        assert probe.estimate(out, mask) != {}
        assert probe.estimate(out, mask) == {}  # the capture was used once


def test_probe_on_wrapped_model(tiny):
    from verl_mtp_plugin.control import hybrid_forward

    model, batch = tiny

    class Wrapper(torch.nn.Module):  # DDP / Float16Module keep the model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    wrapped = Wrapper(model)
    with AcceptanceProbe(wrapped) as probe, torch.no_grad():
        out = hybrid_forward(
            wrapped, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=True,
            loss_mask=batch["response_mask"],
        )
        est = probe.estimate(out, batch["response_mask"], max_positions=10_000)
        out_inner = _forward(model, batch)
        est_inner = probe.estimate(out_inner, batch["response_mask"], max_positions=10_000)
    assert est and est == est_inner


def test_probe_rejects_model_without_mtp(megatron_env):
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.testing import build_tiny_hybrid

    model = build_tiny_hybrid(pattern="M*-E")
    with pytest.raises(MTPConfigError, match="mtp_num_layers"):
        AcceptanceProbe(model)
    with pytest.raises(ValueError, match="temperature"):
        AcceptanceProbe(build_tiny_hybrid(pattern="*-/*-"), temperature=-1)


# --------------------------------------------------------------------------------------------------
# the drafted estimate: acceptance over the positions vLLM drafts at
# --------------------------------------------------------------------------------------------------


def _replay(accepted: list[list[bool]], k: int) -> list[int]:
    """vLLM's schedule on one response with known outcomes: the starts it verifies from."""
    starts, j = [], 0
    while j < len(accepted):
        starts.append(j)
        m = 0
        while m < k and accepted[j][m]:
            m += 1
        j += m + 1
    return starts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_draft_schedule_replays_known_outcomes(k):
    """With 0/1 acceptance the schedule is a replay: a start where vLLM starts a verify step, 0 elsewhere; the
    accepted drafts are those of the starts."""
    g = torch.Generator().manual_seed(k)
    outcome = torch.rand(3, 40, k, generator=g) < 0.6
    lengths = torch.tensor([40, 33, 7])
    starts, accepted = draft_schedule(outcome.float(), lengths)
    for r in range(3):
        n = int(lengths[r])
        want = _replay(outcome[r, :n].tolist(), k)
        assert starts[r].nonzero().flatten().tolist() == want
        assert torch.equal(starts[r, want], torch.ones(len(want)))
        got = accepted[r, want]
        assert torch.equal(got, torch.cumprod(outcome[r, want].float(), dim=-1))
        assert float(accepted[r, n:].abs().sum()) == 0.0


def test_draft_schedule_matches_sampled_schedules():
    """Random per-start probabilities (k=2): the expected starts and accepted drafts equal the means of 4000
    sampled schedules within 5 standard errors; vLLM's rate (accepted at the first draft over starts) then differs
    from the mean over positions where hard positions cluster."""
    g = torch.Generator().manual_seed(0)
    n, k, reps = 24, 2, 4000
    hard = (torch.arange(n) // 6) % 2 == 1  # blocks of hard positions
    accept = torch.where(hard.unsqueeze(-1), torch.full((n, k), 0.2), torch.full((n, k), 0.95)).unsqueeze(0)
    starts, accepted = draft_schedule(accept, torch.tensor([n]))
    s_sum, a_sum = torch.zeros(n), torch.zeros(n, k)
    for _ in range(reps):
        out = (torch.rand(n, k, generator=g) < accept[0]).tolist()
        for j in _replay(out, k):
            s_sum[j] += 1
            m = 0
            while m < k and out[j][m]:
                a_sum[j, m] += 1
                m += 1
    se = torch.sqrt(torch.clamp(starts[0] * (1 - starts[0]), min=1e-4) / reps)
    assert bool(((s_sum / reps - starts[0]).abs() <= 5 * se).all()), (s_sum / reps, starts[0])
    rate = float(accepted[0, :, 0].sum() / starts[0].sum())
    sampled = float(a_sum[:, 0].sum() / s_sum.sum())
    assert rate == pytest.approx(sampled, abs=0.01)
    assert float(accept[0, :, 0].mean()) - rate > 0.1  # the mean over positions overstates vLLM's rate


def test_draft_schedule_edges():
    ones, zeros = torch.ones(1, 12, 2), torch.zeros(1, 12, 2)
    starts, _ = draft_schedule(ones, torch.tensor([12]))
    assert starts[0].nonzero().flatten().tolist() == [0, 3, 6, 9]  # k + 1 tokens per verify step
    starts, accepted = draft_schedule(zeros, torch.tensor([12]))
    assert torch.equal(starts[0], torch.ones(12)) and float(accepted.sum()) == 0.0
    with pytest.raises(ValueError, match="responses, positions, k"):
        draft_schedule(torch.ones(3, 4), torch.tensor([4, 4, 4]))


def test_response_runs():
    valid = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert response_runs(valid) == [(0, 1, 2), (0, 5, 3), (1, 0, 2), (1, 7, 1)]
    assert response_runs(torch.zeros(2, 5, dtype=torch.bool)) == []


def _two_depths(model_seed: int, **batch_kwargs):
    """A model with two MTP depths (its output layer sharpened so acceptance varies), a batch and its response mask."""
    from verl_mtp_plugin.testing import build_tiny_hybrid, make_batch

    torch.manual_seed(model_seed)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E")
    with torch.no_grad():
        model.output_layer.weight.mul_(6.0)
    batch = make_batch(seq=SEQ, vocab=128, prompt_len=PROMPT, **batch_kwargs)
    return model, batch, batch["response_mask"]


def test_drafted_estimate_is_the_schedule_over_dense_acceptance(megatron_env):
    """The probe's drafted keys: every depth's acceptance at every drafting position of whole responses (a model
    with two MTP depths, so k = 2), weighted by the expected verify steps; a budget below the batch takes whole
    responses, evenly spaced."""
    model, batch, mask = _two_depths(1, batch=4, seed=2)
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch)
        dense = [per_position_acceptance(out, probe.mtp_logits(d), mask, depth=d) for d in (1, 2)]
        full = probe.estimate(out, mask, release=False)
        one = probe.estimate(out, mask, max_drafted_positions=10, release=False)
        none = probe.estimate(out, mask, max_drafted_positions=0, release=False)
    first, n = PROMPT - 1, SEQ - PROMPT - 1  # drafting positions: the last prompt token's onwards
    for key, name in ((DRAFTED_EXPECTED_KEY, "alpha"), (DRAFTED_ARGMAX_KEY, "argmax_draft")):
        acc = torch.stack([x[name][:, first : first + n] for x in dense], dim=-1)
        starts, accepted = draft_schedule(acc, torch.full((4,), n))
        assert full[key] == pytest.approx(float(accepted[..., 0].sum() / starts.sum()), abs=1e-5)
        s1, a1 = draft_schedule(acc[2:3], torch.tensor([n]))  # budget 10 < 9 x 4: one response, the middle one
        assert one[key] == pytest.approx(float(a1[..., 0].sum() / s1.sum()), abs=1e-5)
    assert full[DRAFTED_POSITIONS_KEY] == 4 * n and one[DRAFTED_POSITIONS_KEY] == n
    assert not any(key.startswith("mtp_drafted") for key in none) and none[EXPECTED_KEY] == full[EXPECTED_KEY]
    assert 0.0 < full[DRAFTED_EXPECTED_KEY] < 1.0


def test_drafted_estimate_drafts_vllms_k(megatron_env):
    """``draft_k`` sets the schedule's drafts per verify step: k = 1 on a two-depth model uses depth 1 alone; k = 3
    drafts a third time from the deepest depth's acceptance at the same start (where that draft can be verified)."""
    model, batch, mask = _two_depths(5, batch=3, seed=6)
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch)
        dense = [per_position_acceptance(out, probe.mtp_logits(d), mask, depth=d) for d in (1, 2)]
        est = {k: probe.estimate(out, mask, draft_k=k, release=False) for k in (None, 1, 2, 3)}
        for bad in (0, 2.5, "3", True):
            with pytest.raises(ValueError, match="draft_k"):
                probe.estimate(out, mask, draft_k=bad, release=False)
    first, n = PROMPT - 1, SEQ - PROMPT - 1
    want = {}
    for key, name in ((DRAFTED_EXPECTED_KEY, "alpha"), (DRAFTED_ARGMAX_KEY, "argmax_draft")):
        acc = torch.stack([x[name][:, first : first + n] for x in dense], dim=-1)  # [3, n, 2]
        third = acc[..., 1].clone()
        third[:, n - 2 :] = 0.0  # a third draft from the last two starts would pass the response's end
        for k, a in ((1, acc[..., :1]), (2, acc), (3, torch.cat([acc, third.unsqueeze(-1)], dim=-1))):
            starts, accepted = draft_schedule(a, torch.full((3,), n))
            want[key, k] = float(accepted[..., 0].sum() / starts.sum())
            assert est[k][key] == pytest.approx(want[key, k], abs=1e-5), (key, k)
        assert est[None][key] == est[2][key]  # None: the model's two depths
    assert len({round(want[DRAFTED_EXPECTED_KEY, k], 4) for k in (1, 2, 3)}) == 3  # k moves where verify steps start


def test_drafted_estimate_on_a_packed_row_of_unequal_responses(megatron_env):
    """A packed (THD-like) row holds two sequences, prompt then response each, of unequal lengths: the drafted form
    runs the schedule on each response apart (a start right after each prefill), as :func:`response_runs` splits."""
    from verl_mtp_plugin.testing import build_tiny_hybrid, make_batch

    torch.manual_seed(3)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E")
    with torch.no_grad():
        model.output_layer.weight.mul_(6.0)
    batch = make_batch(batch=1, seq=32, vocab=128, prompt_len=0, seed=4)
    mask = torch.zeros(1, 32)
    mask[0, 4:14] = 1.0  # sequence A: prompt 0-3, response 4-13
    mask[0, 17:32] = 1.0  # sequence B: prompt 14-16, response 17-31
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            out = _forward(model, batch, loss_mask="ones")
        dense = [per_position_acceptance(out, probe.mtp_logits(d), mask, depth=d) for d in (1, 2)]
        est = probe.estimate(out, mask, release=False)
    runs = response_runs(acceptance_positions(mask, 1))
    assert runs == [(0, 3, 9), (0, 16, 14)]  # drafting positions: the last prompt token's on, to the 2nd last token
    acc = torch.zeros(2, 14, 2)
    for i, (_, first, n) in enumerate(runs):
        acc[i, :n] = torch.stack([x["alpha"][0, first : first + n] for x in dense], dim=-1)
    starts, accepted = draft_schedule(acc, torch.tensor([9, 14]))
    assert est[DRAFTED_EXPECTED_KEY] == pytest.approx(float(accepted[..., 0].sum() / starts.sum()), abs=1e-5)
    assert est[DRAFTED_POSITIONS_KEY] == 23
    assert float(starts[1, 0]) == 1.0  # B's first drafting position always starts a verify step
    # the sums data-parallel ranks pool: this rank's accepted first drafts and verify steps
    hits, steps = (est[n] for n in DRAFTED_SUMS[DRAFTED_EXPECTED_KEY])
    assert (hits, steps) == (pytest.approx(float(accepted[:, :, 0].sum()), abs=1e-4), float(starts.sum()))
    alone = pool_drafted(est)  # one rank: its own rates, the sums left out of the metrics
    assert alone[DRAFTED_EXPECTED_KEY] == pytest.approx(est[DRAFTED_EXPECTED_KEY], abs=1e-12)
    assert not any(n in alone for pair in DRAFTED_SUMS.values() for n in pair)
    assert pool_drafted({DRAFTED_EXPECTED_KEY: 0.4}) == {DRAFTED_EXPECTED_KEY: 0.4}  # no sums: left as it is


def test_micro_batches_combined_are_the_whole_batchs_estimate(megatron_env):
    """The engine probes every micro-batch of a pass and combines them (:func:`combine_estimates`): two
    micro-batches of two responses each give the drafted rates and positions of the four responses probed at once
    (accepted first drafts over verify steps of all of them, not the mean of the two rates) and, where every position
    is probed, the means over positions of the whole batch."""
    model, batch, mask = _two_depths(7, batch=4, seed=9)
    halves = [{k: (v[rows] if k != "attention_mask" else v) for k, v in batch.items()} for rows in (slice(0, 2),
                                                                                                    slice(2, 4))]
    probe_all = dict(max_positions=1000, max_drafted_positions=10**6)
    with AcceptanceProbe(model) as probe:
        with torch.no_grad():
            whole = probe.estimate(_forward(model, batch), mask, **probe_all)
            parts = []
            for half in halves:
                parts.append(probe.estimate(_forward(model, half), half["response_mask"], **probe_all))
    got = combine_estimates([parts[0], {}, parts[1]])  # a micro-batch without an estimate adds nothing
    for key in (DRAFTED_EXPECTED_KEY, DRAFTED_ARGMAX_KEY, EXPECTED_KEY, GREEDY_KEY, ARGMAX_DRAFT_KEY,
                "mtp_expected_accept_rate_depth2", "mtp_expected_accept_length_k2"):
        assert got[key] == pytest.approx(whole[key], abs=1e-5), key
    assert got[DRAFTED_POSITIONS_KEY] == whole[DRAFTED_POSITIONS_KEY] == 4 * (SEQ - PROMPT - 1)
    assert got[POSITIONS_KEY] == whole[POSITIONS_KEY]
    for pair in DRAFTED_SUMS.values():
        assert [got[n] for n in pair] == pytest.approx([whole[n] for n in pair], abs=1e-4)
    # the halves differ, so the pooled rate is not the mean of theirs unless their verify steps are equal
    rates = [p[DRAFTED_EXPECTED_KEY] for p in parts]
    assert abs(rates[0] - rates[1]) > 1e-3
    assert pool_drafted(got)[DRAFTED_EXPECTED_KEY] == pytest.approx(whole[DRAFTED_EXPECTED_KEY], abs=1e-5)


def test_combine_estimates_pools_sums_and_weights_means_by_positions():
    hits, steps = DRAFTED_SUMS[DRAFTED_EXPECTED_KEY]
    a = {EXPECTED_KEY: 0.8, POSITIONS_KEY: 100.0, hits: 9.0, steps: 10.0, DRAFTED_EXPECTED_KEY: 0.9,
         DRAFTED_POSITIONS_KEY: 30.0, "mtp_expected_accept_length_k1": 1.8}
    b = {EXPECTED_KEY: 0.2, POSITIONS_KEY: 300.0, hits: 10.0, steps: 40.0, DRAFTED_EXPECTED_KEY: 0.25,
         DRAFTED_POSITIONS_KEY: 50.0, "mtp_expected_accept_length_k1": 1.2}
    got = combine_estimates([a, b])
    assert got[EXPECTED_KEY] == pytest.approx(0.35)  # (0.8 x 100 + 0.2 x 300) / 400
    assert got[POSITIONS_KEY] == 400.0 and got[DRAFTED_POSITIONS_KEY] == 80.0
    assert (got[hits], got[steps], got[DRAFTED_EXPECTED_KEY]) == (19.0, 50.0, pytest.approx(0.38))  # not 0.575
    for k in (1, 2, 3):  # from the combined rate, not averaged
        assert got[f"mtp_expected_accept_length_k{k}"] == pytest.approx(expected_accept_length(0.35, k))
    assert DRAFTED_ARGMAX_KEY not in got  # no part had it
    assert combine_estimates([]) == combine_estimates([{}, {}]) == {}
    alone = combine_estimates([{}, a])
    assert {k: alone[k] for k in a} == pytest.approx(a) and combine_estimates([a]) is not a
    # weighted by the positions each micro-batch counted before its subsample, where the probe says them
    from verl_mtp_plugin.acceptance.estimate import ELIGIBLE_KEY

    got = combine_estimates([{**a, ELIGIBLE_KEY: 900.0}, {**b, ELIGIBLE_KEY: 100.0}])
    assert got[EXPECTED_KEY] == pytest.approx(0.74) and got[ELIGIBLE_KEY] == 1000.0  # (0.8 x 900 + 0.2 x 100) / 1000
    # a drafted rate without its sums is weighted like a mean, with one part or several
    bare = [{EXPECTED_KEY: 0.5, POSITIONS_KEY: 10.0, DRAFTED_ARGMAX_KEY: 0.6},
            {EXPECTED_KEY: 0.5, POSITIONS_KEY: 30.0, DRAFTED_ARGMAX_KEY: 0.2}]
    assert combine_estimates(bare)[DRAFTED_ARGMAX_KEY] == pytest.approx(0.3)
    assert combine_estimates(bare[:1])[DRAFTED_ARGMAX_KEY] == pytest.approx(0.6)


def _probe_pass(budget, micro_batches):
    """Run a pass's micro-batches ``[(responses, tokens per response)]`` through :class:`DraftedBudget` with the
    probe's rule for whole responses (``_drafted``: about the share, evenly spaced, at least one when the share is
    above 0); return the positions each micro-batch probed."""
    used = []
    for responses, length in micro_batches:
        tokens = responses * length
        share = budget.take(tokens, responses)
        keep = 0 if share == 0 else min(responses, max(1, responses * share // tokens))
        used.append(keep * length)
        budget.spent(used[-1])
    return used


def test_drafted_budget_shares_the_pass_among_its_micro_batches():
    from verl_mtp_plugin.acceptance.probe import DRAFTED_POSITIONS, DraftedBudget

    assert DRAFTED_POSITIONS == 16384
    # a pass within the budget: every response of every micro-batch
    assert _probe_pass(DraftedBudget(12 * 400), [(4, 400)] * 3) == [1600] * 3
    # 12 micro-batches of 8 responses of 400 tokens (38,400 tokens): about the budget, from every micro-batch
    used = _probe_pass(DraftedBudget(96 * 400), [(8, 400)] * 12)
    assert all(u > 0 for u in used) and abs(sum(used) - 16384) <= 400
    # 8 micro-batches of 2 responses of 8,192 tokens: the shares accrue until they cover a response, so the pass
    # probes two responses (16,384 positions), not one per micro-batch (65,536)
    for seqs in (16, None):  # the pass's average response as the threshold, or each micro-batch's
        used = _probe_pass(DraftedBudget(16 * 8192, pass_sequences=seqs), [(2, 8192)] * 8)
        assert sum(used) == 16384 and used.count(8192) == 2 and used[3] == used[7] == 8192
    # responses longer than the budget: the pass still probes one (the threshold is at most the budget)
    used = _probe_pass(DraftedBudget(4 * 20000, pass_sequences=4), [(1, 20000)] * 4)
    assert used == [0, 0, 0, 20000]
    # long- and short-response micro-batches in turn: both kinds probed (one threshold for the pass)
    pass_ = [(1, 4000), (8, 100)] * 4
    used = _probe_pass(DraftedBudget(4 * 4800, budget=9600, pass_sequences=36), pass_)
    assert used == [4000, 0, 0, 800, 4000, 0, 0, 800]  # 9,600: the budget
    # uneven micro-batches: within one response of the budget
    used = _probe_pass(DraftedBudget(20000, budget=5000), [(10, 100), (1, 3000), (40, 200), (5, 1000)])
    assert abs(sum(used) - 5000) <= 3000 and used[0] > 0 and used[2] > 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="budget"):
            DraftedBudget(100, budget=bad)
    # the means' 128 positions per pass, shared by tokens too (at least 16 per micro-batch)
    from verl_mtp_plugin.acceptance.probe import MEAN_POSITIONS

    b = DraftedBudget(12 * 3200)
    assert MEAN_POSITIONS == 128 and b.mean_positions(3200) == 11 and b.mean_positions(12 * 3200) == 128
    assert [DraftedBudget(1000).mean_positions(t) for t in (500, 250, 100, 1)] == [64, 32, 13, 1]
    assert DraftedBudget(0).mean_positions(0) == 128
