"""The CPU suite's MTP invariants on a GPU: real Mamba-2 Triton kernels, MoE, bf16, megatron DDP
(``overlap_grad_reduce=True``) with the distributed optimizer.

Run on a CUDA machine: ``python tests/gpu/run_all.py`` (or ``pytest -q tests/gpu``). Not collected
without CUDA (``tests/gpu/conftest.py``).

Tolerance (bf16): relative L2 error ``|a - b| / |b| <= max(1e-2, 4 x run-to-run noise)`` per tensor.
Identical computations need not be bitwise reproducible on CUDA: MoE token combine (``scatter_add``),
the embedding backward and Triton's Mamba backward may accumulate with atomics in a varying order,
a changed sum can flip a top-k routing decision, and one bf16 rounding is worth up to 2**-8 = 3.9e-3
relative. Each test measures the noise by running the reference twice and prints it (H200, this
shape: logits bitwise, gradients <= 3.2e-7; at the larger benchmark MoE shape the same model's
logits differ 2.5% run to run). A negative control (the MTP loss reaching the trunk in joint mode,
relative change 0.7-0.9) shows that a real difference is far above the tolerance.
"""

from __future__ import annotations

import faulthandler
import math

import gpu_case as G
import pytest
import torch


def _report(tag, errs):
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    print(f"\n[{tag}] max rel err {max(errs.values()):.3e}; worst: " + ", ".join(f"{n}={e:.2e}" for n, e in worst))


def _compare(got, ref, ref2, tag):
    """Assert logits and every base gradient of ``got`` match ``ref`` within the noise-aware tolerance."""
    logits, grads = got
    rlogits, rgrads = ref
    noise_l = G.rel_err(ref2[0], rlogits)
    e = G.rel_err(logits, rlogits)
    print(f"\n[{tag}] logits rel err {e:.3e} (noise {noise_l:.3e}, bitwise {torch.equal(logits, rlogits)})")
    assert e <= G.tolerance(noise_l), f"logits differ: rel err {e:.3e}"
    errs, noise = {}, {}
    for n, g in rgrads.items():
        assert g is not None, f"reference has no grad for {n}"
        assert grads.get(n) is not None, f"{n}: no gradient"
        errs[n] = G.rel_err(grads[n], g)
        noise[n] = G.rel_err(ref2[1][n], g)
    _report(tag, errs)
    print(f"[{tag}] max run-to-run noise {max(noise.values()):.3e}")
    bad = {n: (errs[n], noise[n]) for n in errs if errs[n] > G.tolerance(noise[n])}
    assert not bad, f"base gradients differ beyond tolerance: {bad}"


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run instead of blocking it
    yield
    faulthandler.cancel_dump_traceback_later()


def test_skip_parity_logits_and_base_grads_bf16(megatron_env):
    """run_mtp_forward=False == a model built without MTP: logits and every base gradient (bf16,
    Mamba Triton kernels); MTP params get no gradient. Built in joint mode (mtp_detach_heads=False),
    so a leaked MTP forward would change the base gradients (negative control below)."""
    m = G.build("joint")
    base = G.build("off", pattern=G.MAIN)
    assert getattr(base, "mtp", None) is None and m.mtp is not None
    G.copy_trunk(m, base)
    b = G.batch()
    ref = G.fwd_bwd(base, b, run_mtp=False)
    ref2 = G.fwd_bwd(base, b, run_mtp=False)
    got = G.fwd_bwd(m, b, run_mtp=False)
    mtp_names = [n for n in got[1] if n.startswith("mtp.")]
    assert mtp_names and all(got[1][n] is None for n in mtp_names)
    got_base = (got[0], {n: g for n, g in got[1].items() if not n.startswith("mtp.")})
    assert set(got_base[1]) == set(ref[1])
    _compare(got_base, ref, ref2, "skip parity")

    # Negative control: running the MTP forward in joint mode leaves the logits alone but changes
    # the base gradients far beyond the tolerance.
    on = G.fwd_bwd(m, b, run_mtp=True)
    assert G.rel_err(on[0], ref[0]) <= G.tolerance(G.rel_err(ref2[0], ref[0]))
    e_out = G.rel_err(on[1]["output_layer.weight"], ref[1]["output_layer.weight"])
    e_emb = G.rel_err(on[1]["embedding.word_embeddings.weight"], ref[1]["embedding.word_embeddings.weight"])
    print(f"\n[joint control] output_layer rel diff {e_out:.3e}, embedding rel diff {e_emb:.3e}")
    assert e_out > 10 * G.REL_TOL and e_emb > 10 * G.REL_TOL


def test_online_isolation_bf16(megatron_env):
    """Online mode (mtp_detach_heads=True): with the MTP forward and loss on, every base gradient
    (trunk, embedding, output layer) equals the one with MTP skipped; every MTP parameter gets a
    finite, nonzero gradient; the MTP metrics appear only when MTP ran."""
    from verl_mtp_plugin import collect_mtp_metrics, validate_model_for_mode

    m = G.build("online")
    validate_model_for_mode(m, "online")
    assert m.config.mtp_detach_heads is True
    b = G.batch(seed=2)
    collect_mtp_metrics()
    off = G.fwd_bwd(m, b, run_mtp=False)
    assert collect_mtp_metrics() == {}
    off2 = G.fwd_bwd(m, b, run_mtp=False)
    on = G.fwd_bwd(m, b, run_mtp=True)
    metrics = collect_mtp_metrics()
    assert "mtp_losses/mtp_1_loss" in metrics and math.isfinite(metrics["mtp_losses/mtp_1_loss"]), metrics
    assert 0.0 <= metrics["mtp_accuracy/mtp_1_top1"] <= 1.0
    mtp = {n: g for n, g in on[1].items() if n.startswith("mtp.")}
    assert mtp
    no_grad = [n for n, g in mtp.items() if g is None or not torch.isfinite(g).all() or float(g.abs().max()) == 0.0]
    assert not no_grad, f"MTP params without a finite nonzero gradient: {no_grad}"
    assert all(off[1][n] is None for n in mtp)
    base_on = (on[0], {n: g for n, g in on[1].items() if not n.startswith("mtp.")})
    base_off = (off[0], {n: g for n, g in off[1].items() if not n.startswith("mtp.")})
    base_off2 = (off2[0], {n: g for n, g in off2[1].items() if not n.startswith("mtp.")})
    _compare(base_on, base_off, base_off2, "online isolation")


@pytest.mark.parametrize("schedule", [(True, False, False, True, True, False), (False, True, False, True)],
                         ids=["first-step-mtp-on", "first-step-mtp-off"])
def test_frozen_mtp_megatron_ddp_overlap_and_distributed_optimizer(megatron_env, schedule):
    """Frozen mode under megatron DDP (overlap_grad_reduce=True) + DistributedOptimizer: no grad buffer
    and no optimizer state for MTP parameters; steps where the MTP forward runs and steps where it is
    skipped alternate (in both orders of the first step, which fixes DDP's expected grad-ready counts)
    with no hang or assertion; MTP weights stay bitwise unchanged while the base trains."""
    if not G.CUDA:
        pytest.skip("megatron's DDP grad sync and optimizers need CUDA (CPU plumbing run)")
    from verl_mtp_plugin import collect_mtp_metrics, freeze_mtp, hybrid_forward, mtp_parameters, validate_model_for_mode
    from verl_mtp_plugin.testing.gpu import megatron_ddp_and_optimizer, optimizer_model_params

    m = G.build("frozen")
    frozen = freeze_mtp(m)
    validate_model_for_mode(m, "frozen")
    assert frozen and all(n.startswith("mtp.") for n in frozen)
    mtp_snap = {n: p.detach().clone() for n, p in mtp_parameters(m)}
    base_names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.mixer.in_proj.weight"]
    params = dict(m.named_parameters())
    base_snap = {n: params[n].detach().clone() for n in base_names}
    ddp, opt = megatron_ddp_and_optimizer(m, lr=1e-3, overlap_grad_reduce=True, use_distributed_optimizer=True)

    mtp_ids = {id(p) for _, p in mtp_parameters(m)}
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert not any(id(p) in mtp_ids for p in ddp.param_to_bucket_group), "MTP param has a DDP grad buffer"
    in_opt = optimizer_model_params(opt)
    assert not any(id(p) in mtp_ids for p in in_opt), "MTP param is managed by the optimizer"
    assert {id(p) for p in in_opt} == {id(p) for p in trainable}

    b = G.batch(seed=3)
    for step, run_mtp in enumerate(schedule):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = hybrid_forward(ddp, b["input_ids"], b["position_ids"], b["attention_mask"], run_mtp_forward=run_mtp)
        loss = G.rl_loss(logits, b)
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok, f"step {step}: optimizer step skipped"
        assert grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 0, (step, grad_norm)
        assert math.isfinite(float(loss))
        assert bool(collect_mtp_metrics()) == run_mtp, f"step {step}: MTP metrics vs run_mtp_forward={run_mtp}"
    torch.cuda.synchronize()

    # optimizer state only for the trainable (non-MTP) parameters: Adam moments sized to them
    opts = getattr(opt, "chained_optimizers", None) or [opt]
    moment_numel = sum(st["exp_avg"].numel() for o in opts for st in o.optimizer.state.values() if "exp_avg" in st)
    assert moment_numel == sum(p.numel() for p in trainable), (moment_numel, sum(p.numel() for p in trainable))
    for n, p in mtp_parameters(m):
        assert torch.equal(p.detach(), mtp_snap[n]), f"frozen MTP param {n} changed"
    changed = [n for n in base_names if not torch.equal(params[n].detach(), base_snap[n])]
    assert changed == base_names, f"base params that did not train: {set(base_names) - set(changed)}"


def _fused_wgrad_installed() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (apex: what megatron's gradient-accumulation fusion runs)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("fusion", [False, True], ids=["autograd_wgrad", "fused_wgrad"])
def test_joint_chunked_mtp_loss_under_megatron_ddp_equals_whole_logits(megatron_env, fusion):
    """Joint mode (the MTP loss trains the output layer) under megatron DDP with ``overlap_grad_reduce=True``: the
    plugin's chunked MTP loss computes the output weight's gradient itself and delivers it as megatron's output layer
    does (``param.grad`` through DDP's hook; with gradient-accumulation fusion straight into ``main_grad``). Every
    parameter's reduced gradient (``main_grad``), the output layer's included, equals the one megatron's own
    whole-logits MTP loss gives, within the bf16 run-to-run noise; a run without MTP differs (negative control)."""
    if not G.CUDA:
        pytest.skip("megatron's DDP grad buffers need CUDA (CPU plumbing run)")
    if fusion and not _fused_wgrad_installed():
        pytest.skip("gradient-accumulation fusion needs apex's fused_weight_gradient_mlp_cuda (not installed)")
    from verl_mtp_plugin import configure_transformer_config, hybrid_forward
    from verl_mtp_plugin import objective as obj
    from verl_mtp_plugin.objective import mtp_objective_scope
    from verl_mtp_plugin.testing import reset_mtp_globals
    from verl_mtp_plugin.testing.gpu import build_gpu_hybrid, megatron_ddp_and_optimizer

    overrides = dict(configure_transformer_config({}, "joint"), gradient_accumulation_fusion=fusion)
    torch.manual_seed(0)
    weights = build_gpu_hybrid(G.spec(), config_overrides=overrides).state_dict()
    b = G.batch(seed=5)
    mask = b["response_mask"]

    def main_grads(chunked: bool, run_mtp: bool = True) -> dict:
        reset_mtp_globals()
        m = build_gpu_hybrid(G.spec(), config_overrides=overrides)
        m.load_state_dict(weights)
        # without MTP the MTP parameters get no gradient: overlapped buckets would wait for them (control only)
        ddp, _ = megatron_ddp_and_optimizer(m, overlap_grad_reduce=run_mtp, use_distributed_optimizer=False)
        ddp.zero_grad_buffer()
        obj.CHUNKED_MTP_HEAD = chunked
        try:
            with mtp_objective_scope(m, "hard_ce", temperature=1.0, loss_mask=mask):
                logits = hybrid_forward(ddp, b["input_ids"], b["position_ids"], b["attention_mask"],
                                        run_mtp_forward=run_mtp, loss_mask=mask)
            G.rl_loss(logits, b).backward()
        finally:
            obj.CHUNKED_MTP_HEAD = True
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        return {n: p.main_grad.detach().float().clone() for n, p in m.named_parameters() if p.requires_grad}

    chunked, whole, whole2 = main_grads(True), main_grads(False), main_grads(False)
    no_mtp = main_grads(True, run_mtp=False)
    assert float(chunked["output_layer.weight"].norm()) > 0
    errs, noise = {}, {}
    for n, g in whole.items():
        errs[n], noise[n] = G.rel_err(chunked[n], g), G.rel_err(whole2[n], g)
    _report(f"joint ddp {'fused' if fusion else 'autograd'} wgrad", errs)
    bad = {n: (errs[n], noise[n]) for n in errs if errs[n] > G.tolerance(noise[n])}
    assert not bad, f"main_grad differs from megatron's whole logits beyond tolerance: {bad}"
    control = G.rel_err(no_mtp["output_layer.weight"], whole["output_layer.weight"])
    assert control > G.tolerance(noise["output_layer.weight"]), control  # the MTP loss's share is visible


def test_drafted_estimate_on_the_gpu(megatron_env):
    """The probe's drafted estimate (first-draft acceptance over the positions vLLM drafts at) on this device's
    tensors: equal to the schedule over the dense per-position acceptance of the same forward (the device paths of
    the probe's response selection, its chunked rows and the schedule)."""
    from verl_mtp_plugin import hybrid_forward
    from verl_mtp_plugin.acceptance import AcceptanceProbe, acceptance_positions, per_position_acceptance
    from verl_mtp_plugin.acceptance.estimate import DRAFTED_EXPECTED_KEY, draft_schedule, response_runs

    m = G.build("online")
    b = G.batch()
    mask = b["response_mask"]
    with torch.no_grad(), AcceptanceProbe(m) as probe:
        logits = hybrid_forward(m, b["input_ids"], b["position_ids"], b["attention_mask"], run_mtp_forward=True)
        dense = per_position_acceptance(logits.float(), probe.mtp_logits(1).float(), mask)
        est = probe.estimate(logits, mask, release=False)
    runs = response_runs(acceptance_positions(mask, 1))
    acc = torch.stack([dense["alpha"][r, f : f + n] for r, f, n in runs]).unsqueeze(-1)
    starts, accepted = draft_schedule(acc, torch.tensor([n for *_, n in runs]))
    want = float(accepted[..., 0].sum() / starts.sum())
    print(f"\n[drafted estimate] {est[DRAFTED_EXPECTED_KEY]:.5f} vs dense {want:.5f} on {logits.device}")
    assert abs(est[DRAFTED_EXPECTED_KEY] - want) < 2e-3 and 0.0 <= want <= 1.0
