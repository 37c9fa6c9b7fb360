"""The MTP objectives (``VERL_MTP_OBJECTIVE``): their math, the position each depth
targets, tensor-parallel exactness, the repeated MTP block, and the trunk's isolation on a real tiny
megatron-core HybridModel (CPU, fp32). The engine-level checks (verl's pass, THD packing) are in
``test_verl_engine.py``; verl's real trainer runs ``tv`` in ``test_main_ppo.py`` (``online_resumed``)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from verl_mtp_plugin.objective import (
    OBJECTIVE_KEY,
    chained_tv_per_token,
    collect_objective_metrics,
    mtp_objective_scope,
    objective_per_token,
    reset_objective_metrics,
    soft_ce_per_token,
    tv_per_token,
)
from verl_mtp_plugin.policy import MTPConfigError, MTPObjective

S, P = 16, 6  # sequence length, prompt length


def _dense(objective, q_logits, p_logits, t):
    """The textbook formulas on the full vocabulary, differentiated by autograd."""
    log_q, log_p = torch.log_softmax(q_logits / t, -1), torch.log_softmax(p_logits / t, -1)
    if objective == "soft_ce":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return 1.0 - torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


# --------------------------------------------------------------------------------------------------
# the math


@pytest.mark.parametrize("objective", ["soft_ce", "tv"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_values_and_gradients_match_the_formulas(objective, temperature):
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(6, 4, 19, generator=g) * 2).requires_grad_()
    p = torch.randn(6, 4, 19, generator=g) * 2
    w = torch.randn(6, 4, generator=g)
    got = objective_per_token(objective, q, p, temperature)
    (got * w).sum().backward()
    q_ref = q.detach().clone().requires_grad_()
    want = _dense(objective, q_ref, p, temperature)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-5, atol=1e-7)
    assert float(q.grad.abs().sum()) > 0


def test_edge_cases_and_target_is_detached():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, generator=g)
    assert float(soft_ce_per_token(q, q).abs().max()) < 1e-6  # the drafter is the policy
    assert float(tv_per_token(q, q).abs().max()) < 1e-6
    p = torch.full((1, 8), -1e4)
    p[0, 0] = 0.0
    d = torch.full((1, 8), -1e4)
    d[0, 7] = 0.0
    assert float(tv_per_token(d, p)) == pytest.approx(1.0)  # disjoint: nothing accepted
    # only q gets a gradient: the policy's distribution is a detached target
    p_req = torch.randn(3, 8, generator=g).requires_grad_()
    q_req = torch.randn(3, 8, generator=g).requires_grad_()
    soft_ce_per_token(q_req, p_req).sum().backward()
    assert p_req.grad is None and q_req.grad is not None
    # gradient of soft CE is (q - p) / T
    torch.testing.assert_close(q_req.grad, torch.softmax(q_req, -1) - torch.softmax(p_req, -1), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="temperature > 0"):
        tv_per_token(q, q, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        soft_ce_per_token(q, q[:, :4])
    with pytest.raises(MTPConfigError, match="VERL_MTP_OBJECTIVE='kl'; allowed: hard_ce, soft_ce, tv, chained_tv"):
        objective_per_token("kl", q, q)


def _chained_reference(q, p, t, counted):
    """chained_tv written out: alpha_i = sum_v min(p_i, q_i); depth d = 1 - prod_{i<=d, counted} alpha_i."""
    alphas = [torch.minimum(torch.softmax(qi / t, -1), torch.softmax(pi / t, -1)).sum(-1) for qi, pi in zip(q, p)]
    values = []
    for d in range(len(q)):
        prod = torch.ones_like(alphas[0])
        for i in range(d + 1):
            prod = prod * torch.where(counted[i], alphas[i], torch.ones_like(alphas[i]))
        values.append(1.0 - prod)
    return torch.stack(values)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chained_tv_values_and_gradients_match_the_formula(temperature):
    """chained_tv: value and gradient (every depth's logits) equal autograd of the written-out product; the
    last depth's term reaches the first depth's logits (the chain), never an uncounted depth's."""
    g = torch.Generator().manual_seed(4)
    q = [(torch.randn(5, 3, 17, generator=g) * 2).requires_grad_() for _ in range(3)]
    p = [torch.randn(5, 3, 17, generator=g) * 2 for _ in range(3)]
    counted = [torch.rand(5, 3, generator=g) > 0.25 for _ in range(3)]
    w = torch.randn(3, 5, 3, generator=g)
    got = chained_tv_per_token(q, p, temperature, counted=counted)
    (got * w).sum().backward()
    q_ref = [x.detach().clone().requires_grad_() for x in q]
    want = _chained_reference(q_ref, p, temperature, counted)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(q, q_ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert bool((got[1:] >= got[:-1] - 1e-7).all())  # a longer chain is accepted less often
    torch.testing.assert_close(got[0], torch.where(counted[0], tv_per_token(q[0], p[0], temperature), 0.0))
    # the last depth's term alone: a gradient for depth 1 where it is counted, none where it is not
    q1 = [x.detach().clone().requires_grad_() for x in q]
    chained_tv_per_token(q1, p, temperature, counted=counted)[2].sum().backward()
    row = q1[0].grad.abs().sum(-1)
    assert bool((row[counted[0] & counted[2]] > 0).all()) and float(row[~counted[0]].sum()) == 0.0
    with pytest.raises(ValueError, match="chained_tv_per_token"):
        objective_per_token("chained_tv", q[0], p[0])


# --------------------------------------------------------------------------------------------------
# in chunks of tokens: the same values and gradients, a chunk's memory


def _objective_rows(objective, q, p, t, counted):
    """soft_ce / tv on depth 0 alone, chained_tv over all depths: one ``[...]`` or ``[D, ...]`` value."""
    if objective == "chained_tv":
        return chained_tv_per_token(q, p, t, counted=counted)
    return objective_per_token(objective, q[0], p[0], t)


def _value_and_grads(objective, q, p, t, counted, w):
    q = [x.detach().clone().requires_grad_() for x in q]
    value = _objective_rows(objective, q, p, t, counted)
    (value * w.reshape(value.shape)).sum().backward()
    return value.detach(), [x.grad for x in q]


@pytest.mark.parametrize("objective", ["soft_ce", "tv", "chained_tv"])
@pytest.mark.parametrize("rows", [1, 4, 7, 1000])
def test_chunked_equals_one_chunk_and_the_formula(monkeypatch, objective, rows):
    """Chunks of ``rows`` tokens (7 does not divide the 39 rows; 1000 is one chunk) give the one-chunk value and
    gradient (bitwise: each row is computed on its own) and the textbook formula; chained_tv over 2 depths with
    masks, the depths cut at the same rows."""
    from verl_mtp_plugin.acceptance import estimate

    v, t = 23, 0.7
    g = torch.Generator().manual_seed(11)
    q = [torch.randn(13, 3, v, generator=g) * 2 for _ in range(2)]
    p = [torch.randn(13, 3, v, generator=g) * 2 for _ in range(2)]
    p[0][0, 0] = q[0][0, 0]  # an identical row
    counted = [torch.rand(13, 3, generator=g) > 0.3 for _ in range(2)]
    w = torch.randn(2 if objective == "chained_tv" else 1, 13, 3, generator=g)
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 2**40)
    one, one_grads = _value_and_grads(objective, q, p, t, counted, w)
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 4 * v * rows)
    assert estimate.chunk_rows(v) == rows
    got, got_grads = _value_and_grads(objective, q, p, t, counted, w)
    torch.testing.assert_close(got, one, rtol=0, atol=0)
    for a, b in zip(got_grads, one_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the formula (autograd of the written-out objective)
    q_ref = [x.detach().clone().requires_grad_() for x in q]
    if objective == "chained_tv":
        want = _chained_reference(q_ref, p, t, counted)
    else:
        want = _dense(objective, q_ref[0], p[0], t)
    (want * w.reshape(want.shape)).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, q_ref):
        if b.grad is not None:
            # float32 gradients of size ~1 (the softmaxes' difference): atol 1e-6, one ulp of 1 is 1.2e-7 (an AVX2-only
            # CPU rounds the softmax differently from AVX-512 ones)
            torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-6)
    assert float(got_grads[0].abs().sum()) > 0


@pytest.mark.parametrize("given", [False, True], ids=["computed", "given_logits"])
@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv"])
@pytest.mark.parametrize("rows", [4, 1000])
def test_head_read_from_hidden_states_equals_its_logits(monkeypatch, objective, rows, given):
    """An MTP depth's logits read chunk by chunk from its hidden states (``HeadLogits``: ``F.linear(h, W)`` per chunk,
    forward and backward) give the values and hidden-state gradients of the whole logits: ``hard_ce`` against
    torch's cross-entropy (megatron's layout: labels ``[b, s]``, logits ``[s, b, V]``, loss ``[b, s]``), ``soft_ce``
    / ``tv`` against the same objective on the whole logits; in chunks of 4 of the 39 rows and in one; the forward
    computing each chunk's logits or reading them from logits given without autograd (backward computes them)."""
    from verl_mtp_plugin.acceptance import estimate
    from verl_mtp_plugin.objective import HeadLogits, hard_ce_per_token

    v, h, t = 23, 16, 0.7
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 3, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 2
    p = torch.randn(13, 3, v, generator=g) * 2
    labels = torch.randint(0, v, (3, 13), generator=g)  # [b, s]
    w = torch.randn(3, 13, generator=g)
    monkeypatch.setattr(estimate, "CHUNK_BYTES", 4 * v * rows)
    got_h = hidden.clone().requires_grad_()
    ref_h = hidden.clone().requires_grad_()
    logits = torch.nn.functional.linear(ref_h, weight)  # [s, b, V]
    head = HeadLogits(got_h, weight, logits.detach().clone() if given else None)
    if objective == "hard_ce":
        got = hard_ce_per_token(head, labels)  # [b, s]
        want = torch.nn.functional.cross_entropy(logits.transpose(0, 1).reshape(-1, v), labels.reshape(-1),
                                                 reduction="none").reshape(3, 13)
    else:
        got = objective_per_token(objective, head, p, t).transpose(0, 1)
        want = objective_per_token(objective, logits, p, t).transpose(0, 1)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    assert float(got_h.grad.abs().sum()) > 0 and weight.grad is None


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the block and alive after an operation (deterministic,
    on CPU): every op's outputs are tracked by a weak reference to their storage, except views of ``inputs``."""

    def __init__(self, inputs=()):
        super().__init__()
        self.live, self.peak, self.inputs = {}, 0, set(inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.untyped_storage().data_ptr() not in self.inputs:
                st = x.untyped_storage()
                self.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.live = {k: r for k, r in self.live.items() if not r[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("objective", ["soft_ce", "tv", "chained_tv"])
def test_chunked_memory_is_one_chunk_not_tokens_times_vocabulary(monkeypatch, objective):
    """Memory, measured deterministically on CPU: (1) nothing of the size [tokens, vocab] is saved for backward
    but the two logits tensors the caller holds anyway (saved_tensors_hooks); (2) the peak of the tensors alive
    during forward + backward is the gradient ([tokens, vocab], what any loss returns) plus about a chunk, where
    the objective on one chunk of all the tokens keeps several [tokens, vocab] float32 tensors alive."""
    from verl_mtp_plugin.acceptance import estimate

    n, v, rows, depths = 512, 1024, 32, 2
    full = 4 * n * v  # one float32 [tokens, vocab]
    g = torch.Generator().manual_seed(2)
    q = [torch.randn(n, v, generator=g) for _ in range(depths)]
    p = [torch.randn(n, v, generator=g) for _ in range(depths)]
    counted = [torch.rand(n, generator=g) > 0.2 for _ in range(depths)]
    inputs = {x.untyped_storage().data_ptr() for x in q + p}

    def run(chunk_bytes):
        monkeypatch.setattr(estimate, "CHUNK_BYTES", chunk_bytes, raising=False)
        leaves = [x.clone().requires_grad_() for x in q]
        inputs.update(x.untyped_storage().data_ptr() for x in leaves)
        saved = []

        def pack(x):
            if x.untyped_storage().data_ptr() not in inputs:
                saved.append(x.numel())
            return x

        meter = _LiveBytes(inputs)
        with meter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                value = _objective_rows(objective, leaves, p, 1.0, counted)
            value.sum().backward()
            grads = [x.grad for x in leaves]
        return max(saved, default=0), meter.peak, grads

    saved, peak, grads = run(4 * v * rows)
    assert saved <= rows * v  # per-row numbers only (here: far less than a chunk)
    per_depth = depths if objective == "chained_tv" else 1
    assert peak <= per_depth * full + 8 * 4 * rows * v, (peak / full)  # the gradients + a few chunks
    saved_one, peak_one, grads_one = run(2**40)  # one chunk: the unchunked computation
    assert peak_one >= per_depth * full + 2 * full, (peak_one / full)
    for a, b in zip(grads, grads_one):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


_TP2_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def work(rank, init_method):
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", VERL_MTP_TEST_INIT_METHOD=init_method)
        from verl_mtp_plugin.objective import objective_per_token, mtp_objective_scope, collect_objective_metrics
        from verl_mtp_plugin.objective import chained_tv_per_token, reset_objective_metrics

        # 1. the functions: vocabulary shards (TP=2) against the whole vocabulary (TP=1), values and gradients
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 7, 10, generator=g) * 3
        p = torch.randn(2, 7, 10, generator=g) * 3
        p[0, 1] = q[0, 1]                                    # identical row
        p[0, 2, :5] = -1e4; q[0, 2, 5:] = -1e4               # supports on different shards
        w = torch.randn(2, 7, generator=g)
        sl = slice(rank * 5, rank * 5 + 5)
        from verl_mtp_plugin.acceptance import estimate
        one_chunk = estimate.CHUNK_BYTES
        for objective in ("soft_ce", "tv"):
            for t in (1.0, 0.7):
                full = q.clone().requires_grad_()
                ref = objective_per_token(objective, full, p, t)
                (ref * w).sum().backward()
                for chunk_bytes in (one_chunk, 4 * 5 * 3):  # shards in chunks of 3 of the 14 rows
                    estimate.CHUNK_BYTES = chunk_bytes
                    shard = q[..., sl].clone().requires_grad_()
                    got = objective_per_token(objective, shard, p[..., sl], t, group=dist.group.WORLD)
                    (got * w).sum().backward()
                    estimate.CHUNK_BYTES = one_chunk
                    assert torch.allclose(got, ref, atol=1e-6), (objective, t, got, ref)
                    assert torch.allclose(shard.grad, full.grad[..., sl], atol=1e-7), (objective, t)
        # chained_tv: two depths, the product of the all-reduced overlaps; gradients reach both depths' shards
        q2 = torch.randn(2, 7, 10, generator=g) * 3
        p2 = torch.randn(2, 7, 10, generator=g) * 3
        counted = [torch.rand(2, 7, generator=g) > 0.2 for _ in range(2)]
        w2 = torch.randn(2, 2, 7, generator=g)
        full = [q.clone().requires_grad_(), q2.clone().requires_grad_()]
        ref = chained_tv_per_token(full, [p, p2], 0.7, counted=counted)
        (ref * w2).sum().backward()
        shard = [q[..., sl].clone().requires_grad_(), q2[..., sl].clone().requires_grad_()]
        estimate.CHUNK_BYTES = 4 * 5 * 4  # chunks of 4 of the 14 rows, the same cuts at both depths and ranks
        got = chained_tv_per_token(shard, [p[..., sl], p2[..., sl]], 0.7, counted=counted, group=dist.group.WORLD)
        (got * w2).sum().backward()
        assert torch.allclose(got, ref, atol=1e-6), (got, ref)
        for a, b in zip(shard, full):
            assert torch.allclose(a.grad, b.grad[..., sl], atol=1e-7)
        dist.destroy_process_group()

        # 2. the tiny HybridModel at TP=2: the objective of the forward equals the TP=1 formula on the
        #    gathered main and MTP logits (depth 1 at t against the main head at t+1)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        from verl_mtp_plugin.acceptance import AcceptanceProbe
        from verl_mtp_plugin.control import hybrid_forward
        from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron, make_batch, reset_mtp_globals

        init_megatron(seed=5, tp=2)
        estimate.CHUNK_BYTES = 4 * 64 * 5  # the model's 64-token vocabulary shards in chunks of 5 tokens
        reset_mtp_globals()
        model = build_tiny_hybrid(pattern="*-/*-", mtp_detach_heads=True,
                                  config_overrides=dict(tensor_model_parallel_size=2))
        batch = make_batch(batch=2, seq=16, vocab=128, prompt_len=6, seed=1)
        mask = batch["response_mask"]
        for objective in ("soft_ce", "tv"):
            reset_objective_metrics()
            model.zero_grad(set_to_none=True)
            with AcceptanceProbe(model) as probe, mtp_objective_scope(model, objective, temperature=0.8, loss_mask=mask):
                out = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                     run_mtp_forward=True, loss_mask=mask)
                q_full = gather_from_tensor_model_parallel_region(probe.mtp_logits(1), group=model.tp_group)
            (out * 0).sum().backward()
            got = collect_objective_metrics(objective)[f"mtp_objective/mtp_1_{objective}"]
            main = gather_from_tensor_model_parallel_region(out.detach(), group=model.tp_group)
            per = objective_per_token(objective, q_full[:, :-1], main[:, 1:], 0.8)      # [b, s-1]
            m = torch.zeros_like(mask); m[:, :-2] = mask[:, 2:]                        # token t+2 is a response token
            want = float((per * m[:, :-1]).sum() / m.sum())
            assert abs(got - want) < 1e-5, (objective, got, want)
            grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None]
            assert grads and all(torch.isfinite(x).all() for x in grads)
            both = [None, None]
            dist.all_gather_object(both, got)
            assert both[0] == both[1], both  # every TP rank computes the same value

        # 2b. sequence parallelism: the target reads the main hidden states gathered over the TP ranks; the same
        #     weights give the objective value and MTP gradients they give without it. Each MTP depth's logits are
        #     read in chunks from its hidden states (gathered under SP, in the TP region otherwise), hard_ce
        #     included: equal to megatron's whole vocabulary-parallel logits (the switch off), with and without SP
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        from verl_mtp_plugin import objective as obj

        #     Joint mode too (the output weight trains, its gradient computed chunk by chunk by the loss): every
        #     gradient, the trunk's and the output weight's shard included, equals megatron's whole logits'
        weights = model.state_dict()
        for objective, detach in (("hard_ce", True), ("soft_ce", True), ("tv", True), ("hard_ce", False),
                                  ("tv", False)):
            values, mtp_grads = {}, {}
            for sp, chunked in ((False, True), (True, True), (False, False), (True, False)):
                obj.CHUNKED_MTP_HEAD = chunked
                reset_mtp_globals()
                m_sp = build_tiny_hybrid(pattern="*-/*-", mtp_detach_heads=detach,
                                         config_overrides=dict(tensor_model_parallel_size=2, sequence_parallel=sp))
                m_sp.load_state_dict(weights)
                reset_objective_metrics()
                with mtp_objective_scope(m_sp, objective, temperature=0.8, loss_mask=mask):
                    out = hybrid_forward(m_sp, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                         run_mtp_forward=True, loss_mask=mask)
                (out * 0).sum().backward()
                obj.CHUNKED_MTP_HEAD = True
                for p in m_sp.parameters():  # norms under SP hold their sequence shard's part (megatron all-reduces)
                    if sp and getattr(p, "sequence_parallel", False) and p.grad is not None:
                        dist.all_reduce(p.grad, group=m_sp.tp_group)
                values[sp, chunked] = [float(MTPLossLoggingHelper.tracker["loss_values"][0])]  # megatron's hard CE
                if objective != "hard_ce":
                    values[sp, chunked].append(collect_objective_metrics(objective)[f"mtp_objective/mtp_1_{objective}"])
                mtp_grads[sp, chunked] = {n: p.grad for n, p in m_sp.named_parameters()
                                          if (n.startswith("mtp.") or not detach) and p.grad is not None}
            ref = (False, False)
            assert mtp_grads[ref] and values[ref][0] > 0
            assert ("output_layer.weight" in mtp_grads[ref]) == (not detach), objective  # joint: the weight trains
            if not detach:
                assert float(mtp_grads[ref]["output_layer.weight"].abs().sum()) > 0
            for key in values:
                assert all(abs(a - b) < 1e-5 for a, b in zip(values[key], values[ref])), (objective, key, values)
                assert mtp_grads[key].keys() == mtp_grads[ref].keys(), (objective, key)
                for n, g in mtp_grads[ref].items():
                    assert torch.allclose(mtp_grads[key][n], g, atol=1e-6), (objective, key, n)

        # 3. chained_tv on the recipes' MTP shape (one block applied as 2 depths) at TP=2: each depth's value
        #    equals the TP=1 chain on the gathered logits (depth d at t against the main head at t+d)
        reset_mtp_globals()
        model = build_tiny_hybrid(pattern="*-/*-/*-", mtp_use_repeated_layer=True, mtp_detach_heads=True,
                                  config_overrides=dict(tensor_model_parallel_size=2))
        reset_objective_metrics()
        with AcceptanceProbe(model) as probe, mtp_objective_scope(model, "chained_tv", temperature=0.8, loss_mask=mask):
            out = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                 run_mtp_forward=True, loss_mask=mask)
            qs = [gather_from_tensor_model_parallel_region(probe.mtp_logits(d), group=model.tp_group) for d in (1, 2)]
        (out * 0).sum().backward()
        got = collect_objective_metrics("chained_tv")
        main = gather_from_tensor_model_parallel_region(out.detach(), group=model.tp_group)
        s = main.shape[1]
        ms = []
        for d in (1, 2):
            m = torch.zeros_like(mask); m[:, : s - 1 - d] = mask[:, 1 + d:]
            ms.append(m[:, : s - 2].bool())
        per = chained_tv_per_token([qs[0][:, : s - 2], qs[1][:, : s - 2]], [main[:, 1: s - 1], main[:, 2:]], 0.8,
                                   counted=ms)
        for d in (1, 2):
            want = float((per[d - 1] * ms[d - 1]).sum() / ms[d - 1].sum())
            value = got[f"mtp_objective/mtp_{d}_chained_tv"]
            assert abs(value - want) < 1e-5, (d, value, want)
            both = [None, None]
            dist.all_gather_object(both, value)
            assert both[0] == both[1], both
        grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None]
        assert grads and all(torch.isfinite(x).all() for x in grads)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(sys.argv[1],), nprocs=2, join=True)
        print("TP2_OK")
    """
)


def test_tensor_parallel_two_ranks_equal_one(tmp_path):
    """TP=2 (gloo, 2 processes): values and gradients on vocabulary shards, in one chunk and in chunks of tokens,
    equal the whole-vocabulary ones; the objective of a TP=2 HybridModel forward (in chunks) equals the TP=1
    formula on its gathered logits."""
    from verl_mtp_plugin.testing import rendezvous

    script = tmp_path / "tp2_objective.py"
    script.write_text(_TP2_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), rendezvous()], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and "TP2_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# on the tiny HybridModel


@pytest.fixture
def batch():
    from verl_mtp_plugin.testing import make_batch

    return make_batch(batch=2, seq=S, vocab=128, prompt_len=P, seed=3)


def _forward(model, batch, objective, temperature=1.0, probe=None):
    from verl_mtp_plugin.control import hybrid_forward

    mask = batch["response_mask"]
    with mtp_objective_scope(model, objective, temperature=temperature, loss_mask=mask):
        return hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                              run_mtp_forward=True, loss_mask=mask)


def _mtp_only_grads(model, batch, objective, temperature=1.0):
    """Backward of 0 x the main logits: every gradient comes from the MTP loss alone."""
    from verl_mtp_plugin.testing import reset_mtp_globals

    reset_mtp_globals()
    reset_objective_metrics()
    model.zero_grad(set_to_none=True)
    out = _forward(model, batch, objective, temperature)
    (out * 0).sum().backward()
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("repeated", [False, True], ids=["two_mtp_layers", "repeated_mtp_block"])
@pytest.mark.parametrize("objective", ["soft_ce", "tv"])
def test_depth_d_targets_the_main_head_for_the_same_token(batch, objective, repeated):
    """Depth d at position t predicts token t+1+d; its target is the main head at position t+d (which
    predicts the same token), counted where token t+1+d is a response token; not t+d-1, not t+d+1."""
    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.testing import build_tiny_hybrid, reset_mtp_globals

    torch.manual_seed(1)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E", mtp_use_repeated_layer=repeated, mtp_detach_heads=True)
    if repeated:
        assert len(model.mtp.layers) == 1 and model.config.mtp_num_layers == 2  # one block applied twice
    reset_mtp_globals()
    reset_objective_metrics()
    t = 0.7
    with AcceptanceProbe(model) as probe:
        out = _forward(model, batch, objective, t)
        q = {d: probe.mtp_logits(d) for d in (1, 2)}
    got = collect_objective_metrics(objective)
    assert set(got) == {OBJECTIVE_KEY.format(k=d, objective=objective) for d in (1, 2)}
    mask = batch["response_mask"]
    for d in (1, 2):
        m = torch.zeros_like(mask)
        m[:, : S - 1 - d] = mask[:, 1 + d :]  # token t+1+d is a response token

        def mean_with_main_at(shift):
            per = torch.zeros(2, S)
            n = S - shift
            per[:, :n] = objective_per_token(objective, q[d][:, :n], out.detach()[:, shift:], t)
            return float((per * m).sum() / m.sum())

        value = got[f"mtp_objective/mtp_{d}_{objective}"]
        assert value == pytest.approx(mean_with_main_at(d), rel=1e-5, abs=1e-6)
        for wrong in (d - 1, d + 1):
            assert value != pytest.approx(mean_with_main_at(wrong), rel=1e-3)


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("repeated", [False, True], ids=["two_mtp_layers", "repeated_mtp_block"])
def test_chained_tv_on_the_model_equals_the_reference_value_and_gradient(batch, repeated):
    """chained_tv through megatron's MTP loss: per depth, the logged value is the masked mean of 1 - prod_{i<=d}
    alpha_i (depth i at t against the main head at t+i; a depth megatron does not count at t, here the prompt's
    last tokens, enters as 1); the MTP block's gradient is autograd's of megatron's weighting of that reference
    (factor / D x the per-depth masked means) on the MTP logits of the same forward."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from verl_mtp_plugin.compat.megatron_loss import replace_language_model_loss
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import build_tiny_hybrid, reset_mtp_globals

    torch.manual_seed(1)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E", mtp_use_repeated_layer=repeated, mtp_detach_heads=True)
    t, mask = 0.7, batch["response_mask"]
    grads = _mtp_only_grads(model, batch, "chained_tv", t)
    got = collect_objective_metrics("chained_tv")

    # the reference: the same forward, megatron's MTP loss replaced by one that keeps each depth's logits
    reset_mtp_globals()
    model.zero_grad(set_to_none=True)
    kept = []

    def keep(labels, logits):
        kept.append(logits.transpose(0, 1))  # [b, s, V], in the graph
        return torch.zeros(labels.shape, dtype=torch.float32)

    with replace_language_model_loss(model, keep):
        main = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                              run_mtp_forward=True, loss_mask=mask).detach()
    assert len(kept) == 2
    q, p, counted = [], [], []
    n = S - 2  # the chain's positions t: depth d's rows past S-1-d are never counted
    for d in (1, 2):
        q.append(kept[d - 1][:, :n])
        p.append(main[:, d : d + n])
        m = torch.zeros_like(mask)
        m[:, : S - 1 - d] = mask[:, 1 + d :]  # token t+1+d is a response token
        counted.append(m[:, :n].bool())
    assert bool((counted[1] & ~counted[0]).any())  # the prompt's end: depth 2 counted, depth 1 not
    want = _chained_reference(q, p, t, counted)  # [2, b, n]
    means = [(want[d] * counted[d]).sum() / counted[d].sum() for d in (0, 1)]
    for d in (1, 2):
        assert got[f"mtp_objective/mtp_{d}_chained_tv"] == pytest.approx(float(means[d - 1]), rel=1e-5, abs=1e-6)
    assert got["mtp_objective/mtp_2_chained_tv"] > got["mtp_objective/mtp_1_chained_tv"] > 0
    scale = model.config.mtp_loss_scaling_factor / 2 * float(MTPLossAutoScaler.main_loss_backward_scale)
    (scale * sum(means)).backward()
    names = [n for n, x in model.named_parameters() if n.startswith("mtp.") and x.grad is not None]
    assert "mtp.layers.0.eh_proj.weight" in names
    for n in names:
        torch.testing.assert_close(grads[n], model.get_parameter(n).grad, rtol=1e-4, atol=1e-7, msg=n)
    tv = _mtp_only_grads(model, batch, "tv", t)  # the chain is not the depths on their own
    assert not torch.allclose(grads["mtp.layers.0.eh_proj.weight"], tv["mtp.layers.0.eh_proj.weight"], rtol=1e-3)


def _saved_bytes_grads_and_values(model, batch, objective):
    """One forward + backward of the MTP loss alone: the bytes autograd saved for backward (distinct storages),
    every parameter's gradient and the logged objective values."""
    from verl_mtp_plugin.testing import reset_mtp_globals

    reset_mtp_globals()
    reset_objective_metrics()
    model.zero_grad(set_to_none=True)
    saved = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = _forward(model, batch, objective)
    (out * 0).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    values = collect_objective_metrics(objective) if objective != "hard_ce" else {}
    return sum(saved.values()), grads, values


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("objective", ["soft_ce", "tv", "chained_tv"])
def test_the_target_is_read_in_chunks_equal_to_the_whole_and_no_logits_copy_is_kept(batch, objective, monkeypatch):
    """The main head's target is computed chunk by chunk from the main hidden states (``TargetLogits``), in forward
    and again in backward, never whole: the MTP gradients and logged values equal those of the whole target (the
    output layer's logits, what the scope computed before), and backward keeps no more than ``hard_ce``'s forward
    does, where the whole target kept one more [tokens, vocab] tensor."""
    from verl_mtp_plugin import objective as obj
    from verl_mtp_plugin.testing import build_tiny_hybrid

    torch.manual_seed(0)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True, mtp_detach_heads=True)
    saved, grads, values = _saved_bytes_grads_and_values(model, batch, objective)
    hard_saved, _, _ = _saved_bytes_grads_and_values(model, batch, "hard_ce")
    monkeypatch.setattr(obj.TargetLogits, "of", classmethod(lambda cls, inner, hidden: None))  # the whole target
    whole_saved, whole_grads, whole_values = _saved_bytes_grads_and_values(model, batch, objective)
    assert set(grads) == set(whole_grads) and any(n.startswith("mtp.") for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, whole_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    assert values.keys() == whole_values.keys() and values
    for k, v in values.items():
        assert v == pytest.approx(whole_values[k], rel=1e-6, abs=1e-7)
    tokens_x_vocab = batch["input_ids"].numel() * model.output_layer.weight.shape[0] * 4  # one float32 [tokens, V]
    assert whole_saved - saved >= 0.9 * tokens_x_vocab  # the whole target (its storage) was kept for backward
    assert saved <= hard_saved + tokens_x_vocab // 8  # per-row numbers only beyond hard_ce


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("mode", ["online", "joint"])
@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv", "chained_tv"])
def test_the_mtp_logits_are_read_in_chunks_equal_to_megatrons_whole_and_not_kept(batch, objective, mode, monkeypatch):
    """Each MTP depth's loss reads its logits chunk by chunk from the depth's hidden states (``_MTPHead``, handed to
    megatron's ``process_mtp_loss``), megatron's own ``hard_ce`` included: every gradient, megatron's tracked loss and
    top-1 accuracy, and the objective's logged values equal those of megatron's whole logits (the switch off), and
    backward keeps one ``[tokens, vocab]`` tensor less per depth. Joint mode too, where the output weight trains:
    its gradient (computed chunk by chunk by the loss) and the trunk's equal megatron's."""
    from megatron.core.models.hybrid import hybrid_model
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from verl_mtp_plugin import objective as obj
    from verl_mtp_plugin.testing import build_tiny_hybrid

    torch.manual_seed(0)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True, mtp_detach_heads=mode == "online")
    original = hybrid_model.process_mtp_loss

    def run():
        saved, grads, values = _saved_bytes_grads_and_values(model, batch, objective)
        tracked = {k: MTPLossLoggingHelper.tracker[k].clone() for k in ("loss_values", "correct_values")}
        assert hybrid_model.process_mtp_loss is original  # restored on exit
        return saved, grads, values, tracked

    saved, grads, values, tracked = run()
    monkeypatch.setattr(obj, "CHUNKED_MTP_HEAD", False)  # megatron's output layer computes each depth's logits whole
    whole_saved, whole_grads, whole_values, whole_tracked = run()
    assert set(grads) == set(whole_grads) and any(n.startswith("mtp.") for n in grads)
    trained = float(grads["output_layer.weight"].abs().sum()) if "output_layer.weight" in grads else 0.0
    assert (trained > 0) == (mode == "joint")  # the output weight trains in joint mode only
    for n, g in grads.items():
        torch.testing.assert_close(g, whole_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    assert values.keys() == whole_values.keys() and (values or objective == "hard_ce")
    for k, v in values.items():
        assert v == pytest.approx(whole_values[k], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(tracked["loss_values"], whole_tracked["loss_values"], rtol=1e-6, atol=1e-6)
    assert float(tracked["loss_values"].abs().sum()) > 0
    torch.testing.assert_close(tracked["correct_values"], whole_tracked["correct_values"], rtol=0, atol=0)
    tokens_x_vocab = batch["input_ids"].numel() * model.output_layer.weight.shape[0] * 4  # one float32 [tokens, V]
    assert whole_saved - saved >= 2 * 0.9 * tokens_x_vocab, (whole_saved - saved) / tokens_x_vocab  # 2 depths


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv", "chained_tv"])
def test_online_every_objective_leaves_trunk_embedding_and_output_layer_untouched(batch, objective):
    from verl_mtp_plugin.testing import build_tiny_hybrid

    torch.manual_seed(0)
    model = build_tiny_hybrid(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True, mtp_detach_heads=True)
    grads = _mtp_only_grads(model, batch, objective)
    base = {n: g for n, g in grads.items() if not n.startswith("mtp.")}
    assert "embedding.word_embeddings.weight" in base and "output_layer.weight" in base
    touched = [n for n, g in base.items() if g is not None and float(g.abs().sum()) != 0.0]
    assert touched == []
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.") and "expert_bias" not in n}
    assert mtp and all(g is not None and float(g.abs().sum()) > 0 for g in mtp.values())
    if objective != "hard_ce":  # a different gradient from megatron's own loss
        hard = _mtp_only_grads(model, batch, "hard_ce")
        assert not torch.allclose(grads["mtp.layers.0.eh_proj.weight"], hard["mtp.layers.0.eh_proj.weight"])


@pytest.mark.usefixtures("megatron_env")
@pytest.mark.parametrize("objective", ["soft_ce", "tv", "chained_tv"])
def test_joint_objective_reaches_the_trunk_and_output_layer(batch, objective):
    """The same check fails where it should: joint (no mtp_detach_heads) sends the objective's gradient into
    the trunk and output layer (through q; the policy's target stays detached)."""
    from verl_mtp_plugin.testing import build_tiny_hybrid

    torch.manual_seed(0)
    model = build_tiny_hybrid(mtp_detach_heads=False)
    grads = _mtp_only_grads(model, batch, objective)
    for name in ("output_layer.weight", "embedding.word_embeddings.weight", "decoder.final_norm.weight"):
        assert grads[name] is not None and float(grads[name].abs().sum()) > 0, name


@pytest.mark.usefixtures("megatron_env")
def test_whole_mtp_logits_are_announced_once_with_their_size(batch, monkeypatch, caplog):
    """Where the MTP logits must be whole (here: joint mode with an output layer whose weight gradient megatron
    delivers otherwise), the first forward says so with the size kept per depth, once per process; online and plain
    joint say nothing."""
    import logging

    from verl_mtp_plugin import objective as obj
    from verl_mtp_plugin.testing import build_tiny_hybrid

    monkeypatch.setattr(obj, "_WARNED", set())
    torch.manual_seed(0)
    online = build_tiny_hybrid(mtp_detach_heads=True)
    joint = build_tiny_hybrid(mtp_detach_heads=False)
    with caplog.at_level(logging.WARNING, logger="verl_mtp_plugin.objective"):
        _mtp_only_grads(online, batch, "hard_ce")
        _mtp_only_grads(joint, batch, "hard_ce")
        assert [r for r in caplog.records if "logits whole" in r.getMessage()] == []
        monkeypatch.setattr(obj, "weight_grad_unsupported", lambda layer, weight: "a test's reason")
        for _ in range(2):
            _mtp_only_grads(joint, batch, "hard_ce")
    said = [r.getMessage() for r in caplog.records if "logits whole" in r.getMessage()]
    assert len(said) == 1 and "the output weight trains (joint mode) and a test's reason" in said[0], said
    size = batch["input_ids"].numel() * joint.output_layer.weight.shape[0] * 4  # one fp32 [tokens, V]
    assert f"({size} bytes)" in said[0], said


@pytest.mark.usefixtures("megatron_env")
def test_megatron_tracker_keeps_the_hard_cross_entropy_and_the_scope_leaves_no_trace(batch):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from verl_mtp_plugin.testing import build_tiny_hybrid, reset_mtp_globals

    torch.manual_seed(2)
    model = build_tiny_hybrid(mtp_detach_heads=True)
    losses = {}
    for objective in ("hard_ce", "soft_ce", "tv"):
        reset_mtp_globals()
        with torch.no_grad():
            _forward(model, batch, objective)
        losses[objective] = MTPLossLoggingHelper.tracker["loss_values"].clone()
        assert "compute_language_model_loss" not in model.__dict__  # the instance attribute is gone
        assert not model.mtp._forward_hooks  # and so is the hook
    torch.testing.assert_close(losses["soft_ce"], losses["hard_ce"])
    torch.testing.assert_close(losses["tv"], losses["hard_ce"])
    with pytest.raises(ValueError, match="temperature > 0"):
        with mtp_objective_scope(model, "tv", temperature=0.0, loss_mask=None):
            pass
    assert "compute_language_model_loss" not in model.__dict__
    assert MTPObjective.parse("TV") is MTPObjective.TV


@pytest.mark.parametrize("objective", ["hard_ce", "soft_ce", "tv"])
def test_joint_weight_gradient_goes_where_megatrons_output_layer_puts_its_own(objective):
    """Joint mode: the chunked loss computes the output weight's gradient itself. With megatron's gradient-
    accumulation fusion the layer adds its own into ``weight.main_grad`` and sets ``grad_added_to_main_grad``, after
    which megatron DDP's hook ignores ``param.grad``: so the loss adds there too (and sets the flag), returning no
    ``param.grad``; without the fusion it returns the gradient through autograd. Both equal autograd's through the
    whole logits (several chunks: a small chunk size)."""
    from verl_mtp_plugin import objective as obj
    from verl_mtp_plugin.acceptance import estimate as est
    from verl_mtp_plugin.compat.megatron_mtp_head import weight_grad_buffer, weight_grad_unsupported

    torch.manual_seed(0)
    s, b, h, v = 5, 2, 8, 32
    hidden = torch.randn(s, b, h, dtype=torch.float32, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(v, h, dtype=torch.float32) / 3)
    labels = torch.randint(0, v, (b, s))
    target = torch.randn(s, b, v, dtype=torch.float32)

    def loss(q):
        if objective == "hard_ce":
            return (obj.hard_ce_per_token(q, labels) * torch.rand(b, s, generator=torch.Generator().manual_seed(1),
                                                                  dtype=torch.float32)).sum()
        return obj.objective_per_token(objective, q, target, 1.0).sum()

    # the reference: whole logits through autograd
    z = torch.nn.functional.linear(hidden, weight)
    ref = loss(z) if objective != "hard_ce" else (torch.nn.functional.cross_entropy(
        z.transpose(0, 1).reshape(-1, v), labels.reshape(-1), reduction="none").reshape(b, s) * torch.rand(
        b, s, generator=torch.Generator().manual_seed(1), dtype=torch.float32)).sum()
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(est, "CHUNK_BYTES", 3 * v * 4)  # 3 rows per chunk: several chunks
        layer = type("Layer", (), {"gradient_accumulation_fusion": False, "config": None})()
        assert weight_grad_unsupported(layer, weight) is None and weight_grad_buffer(layer, weight) is None
        value = loss(obj.HeadLogits(hidden, weight))
        value.backward()
        torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weight.grad, ref_w, rtol=1e-5, atol=1e-6)

        hidden.grad, weight.grad = None, None  # megatron's fused path: into main_grad, the flag set, no param.grad
        layer.gradient_accumulation_fusion = True
        assert weight_grad_unsupported(layer, weight) is not None  # no buffer yet: the logits would stay whole
        weight.main_grad = torch.full_like(weight, 0.5)  # what earlier micro-batches accumulated
        weight.grad_added_to_main_grad = False
        assert weight_grad_unsupported(layer, weight) is None and weight_grad_buffer(layer, weight) is weight.main_grad
        loss(obj.HeadLogits(hidden, weight, main_grad=weight_grad_buffer(layer, weight))).backward()
        assert weight.grad_added_to_main_grad is True  # DDP's hook skips param.grad: megatron's placeholder
        assert weight.grad is not None and weight.grad.shape == weight.shape
        torch.testing.assert_close(weight.main_grad, ref_w + 0.5, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-6)

        hidden.grad, weight.grad = None, None  # zero_out_wgrad (tied embeddings): DDP adds param.grad: zeros
        weight.zero_out_wgrad, weight.grad_added_to_main_grad = True, False
        weight.main_grad = torch.zeros_like(weight, dtype=torch.bfloat16)  # a half buffer: summed in fp32, added once
        loss(obj.HeadLogits(hidden, weight, main_grad=weight_grad_buffer(layer, weight))).backward()
        assert float(weight.grad.abs().sum()) == 0.0
        err = (weight.main_grad.float() - ref_w).abs()
        assert bool((err <= ref_w.abs() * 2**-8 + 1e-6).all()), float(err.max())  # one bf16 rounding of the sum

        hidden.grad, weight.grad = None, None  # no DDP (no flag): no placeholder, the gradient only in main_grad
        del weight.grad_added_to_main_grad, weight.zero_out_wgrad
        weight.main_grad = torch.zeros_like(weight)
        loss(obj.HeadLogits(hidden, weight, main_grad=weight_grad_buffer(layer, weight))).backward()
        assert weight.grad is None
        torch.testing.assert_close(weight.main_grad, ref_w, rtol=1e-5, atol=1e-6)

    layer.config = type("Config", (), {"defer_embedding_wgrad_compute": True})()
    assert "defer_embedding_wgrad_compute" in weight_grad_unsupported(layer, weight)
