"""Per-call MTP control on a real megatron-core 0.19.2 HybridModel (tiny, Nemotron-3-shaped, CPU, fp32).

Model: main pattern ``M*-E`` (Mamba, attention, MLP, MoE with sigmoid router + expert bias, shared
expert and latent projections) and MTP pattern ``*E`` (Nemotron 3 Super's MTP block).
"""

import pytest
import torch

from verl_mtp_plugin import MTPConfigError, MTPMode, Phase, forward_for_phase, freeze_mtp, hybrid_forward
from verl_mtp_plugin.compat import megatron_mtp_skip
from verl_mtp_plugin.control import (
    UnsupportedMTPModelError,
    configure_transformer_config,
    native_mtp_kwarg,
    validate_model_for_mode,
    validate_pattern,
)
from verl_mtp_plugin.metrics import collect_mtp_metrics
from verl_mtp_plugin.testing import build_tiny_gpt, build_tiny_hybrid, make_batch

pytestmark = pytest.mark.usefixtures("megatron_env")

S, P = 16, 6  # sequence length, prompt length


def _tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    t = MTPLossLoggingHelper.tracker
    return {k: t[k].clone() for k in ("loss_values", "correct_values", "total_values") if t.get(k) is not None}


def _step(model, batch, run, *, labels=None, loss_mask="response", clear=True):
    """One forward + backward of an RL-style loss on the returned logits; returns (out, grads, tracker)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if clear:
        MTPLossLoggingHelper.tracker.clear()
    model.zero_grad(set_to_none=True)
    kw = {}
    if loss_mask == "response":
        kw["loss_mask"] = batch["response_mask"]
    if labels is not None:
        kw["labels"] = labels
    out = hybrid_forward(
        model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=run, **kw
    )
    if out.dim() == 3:  # logits [b, s, V]: a policy-gradient-like loss on the response tokens
        logp = torch.log_softmax(out.float(), -1)
        tgt = torch.roll(batch["input_ids"], -1, 1)
        loss = -(logp.gather(-1, tgt[..., None]).squeeze(-1) * batch["response_mask"]).sum()
    else:  # per-token loss [b, s]
        loss = (out * batch["response_mask"]).sum()
    loss.backward()
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    return out.detach().clone(), grads, _tracker()


def _twin(model, **fields):
    """An identical copy (same build, same weights); deepcopy cannot copy megatron's process groups."""
    twin = build_tiny_hybrid(mtp_detach_heads=model.config.mtp_detach_heads, **fields)
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


def _base(grads):
    return {n: g for n, g in grads.items() if not n.startswith("mtp.")}


def _assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        if a[n] is None or b[n] is None:
            assert a[n] is None and b[n] is None, n
        else:
            assert torch.equal(a[n], b[n]), n


@pytest.fixture
def batch():
    return make_batch(batch=2, seq=S, vocab=128, prompt_len=P, seed=3)


# --------------------------------------------------------------------------- run_mtp_forward=True


def test_true_is_the_library_behaviour_bit_for_bit(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    twin = _twin(model)
    out, grads, tr = _step(model, batch, True)
    # the library called directly, on an identical copy
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    ref = twin(batch["input_ids"], batch["position_ids"], batch["attention_mask"], loss_mask=batch["response_mask"])
    logp = torch.log_softmax(ref.float(), -1)
    tgt = torch.roll(batch["input_ids"], -1, 1)
    (-(logp.gather(-1, tgt[..., None]).squeeze(-1) * batch["response_mask"]).sum()).backward()
    assert torch.equal(out, ref.detach())
    _assert_same_grads(grads, {n: p.grad for n, p in twin.named_parameters()})
    ref_tr = _tracker()
    assert tr.keys() == ref_tr.keys() and all(torch.equal(tr[k], ref_tr[k]) for k in tr)
    assert float(tr["total_values"][0]) > 0  # the MTP loss really ran


# --------------------------------------------------------------------------- run_mtp_forward=False


def _base_only_twin(model):
    """The same weights in a model built without MTP (mtp_num_layers=None, no '/' suffix)."""
    torch.manual_seed(0)
    base = build_tiny_hybrid(pattern="M*-E")
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    base.load_state_dict(sd, strict=True)
    return base


def test_false_returns_the_base_model_output_and_base_gradients(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    base = _base_only_twin(model)
    out, grads, tr = _step(model, batch, False)
    ref_out, ref_grads, ref_tr = _step(base, batch, True)  # nothing to skip on the base model
    assert torch.equal(out, ref_out)
    _assert_same_grads(_base(grads), ref_grads)
    assert all(g is None for n, g in grads.items() if n.startswith("mtp."))  # MTP never ran
    assert tr == {} and ref_tr == {}  # the MTP tracker was not touched


def test_false_with_labels_returns_the_base_per_token_loss(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    base = _base_only_twin(model)
    labels = torch.roll(batch["input_ids"], -1, 1)
    out, _, tr = _step(model, batch, False, labels=labels)
    ref, _, _ = _step(base, batch, True, labels=labels)
    assert out.shape == (2, S) and torch.equal(out, ref)
    assert tr == {}


def test_false_keeps_module_parameters_and_state_dict_keys_and_restores_the_flag(batch):
    model = build_tiny_hybrid()
    keys = list(model.state_dict().keys())
    params = {n: p for n, p in model.named_parameters()}
    assert model.mtp_process is True
    seen = []
    h = model.register_forward_pre_hook(lambda m, a: seen.append(m.mtp_process))
    _step(model, batch, False)
    h.remove()
    assert seen == [False]  # skipped during the call ...
    assert model.mtp_process is True  # ... and restored after it
    assert list(model.state_dict().keys()) == keys
    assert {n: p for n, p in model.named_parameters()} == params
    assert any(k.startswith("mtp.layers.0.") for k in keys)


def test_skip_and_run_alternate_across_steps(batch):
    model = build_tiny_hybrid()
    for run in (True, False, True, False):
        _, grads, tr = _step(model, batch, run)
        mtp_grads = [g for n, g in grads.items() if n.startswith("mtp.")]
        assert all(g is not None for g in mtp_grads) is run
        assert (tr != {}) is run


def test_restores_the_flag_when_the_forward_raises(batch):
    model = build_tiny_hybrid()

    def boom(module, args):
        raise RuntimeError("boom inside the forward")

    h = model.decoder.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=False)
    h.remove()
    assert model.mtp_process is True
    _, grads, tr = _step(model, batch, True)  # the model still runs MTP normally
    assert tr and float(tr["total_values"][0]) > 0


def test_wrapped_model_megatron_ddp(batch):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    model = build_tiny_hybrid()
    ref = _twin(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    out = hybrid_forward(ddp, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=False)
    assert model.mtp_process is True
    base = _base_only_twin(ref)
    ref_out = base(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert torch.equal(out, ref_out)


def test_intermediate_pipeline_stage_returns_base_hidden_states(batch):
    """post_process=False (a stage that returns hidden states): the base part comes back unchanged."""
    model = build_tiny_hybrid(post_process=False)
    assert model.mtp_process is True
    args = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    with_mtp = hybrid_forward(model, *args, run_mtp_forward=True)
    without = hybrid_forward(model, *args, run_mtp_forward=False)
    assert with_mtp.shape == (2 * S, 2, 64)  # [(1 + depths) * s, b, h]: MTP hidden states appended
    assert without.shape == (S, 2, 64)
    assert torch.equal(without, with_mtp[:S])
    assert model.mtp_process is True


def test_rank_without_mtp_module_is_unaffected(batch):
    """A rank that owns no MTP module (mtp_process False): the call is the plain call, nothing touched."""
    model = build_tiny_hybrid(pattern="M*-E")
    assert model.mtp_process is False or model.mtp_process is None
    before = dict(model.__dict__)
    a = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=False)
    b = hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=True)
    assert torch.equal(a, b)
    assert dict(model.__dict__).keys() == before.keys() and model.mtp_process == before["mtp_process"]


def test_inference_mode_path_is_never_changed(batch):
    from megatron.core.inference.utils import InferenceMode

    model = build_tiny_hybrid()
    model.eval()
    seen = []
    h = model.register_forward_pre_hook(lambda m, a: seen.append(m.mtp_process))
    args = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad(), InferenceMode.active():
        a = hybrid_forward(model, *args, run_mtp_forward=False, runtime_gather_output=True)
        b = hybrid_forward(model, *args, run_mtp_forward=True, runtime_gather_output=True)
    h.remove()
    assert seen == [True, True]  # the compat path did not touch the model under inference
    assert torch.equal(a, b)
    assert _tracker() == {}


def test_inference_context_path_is_never_changed(batch):
    from megatron.core.inference.contexts import StaticInferenceContext

    model = build_tiny_hybrid()
    model.eval()
    seen = []
    h = model.register_forward_pre_hook(lambda m, a: seen.append(m.mtp_process))
    ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=64)
    try:
        with torch.no_grad():
            hybrid_forward(
                model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=False,
                inference_context=ctx,
            )
    except Exception:
        pass  # whatever megatron's static inference path does on CPU, the flag must not be touched
    h.remove()
    assert seen == [True]
    assert model.mtp_process is True


# --------------------------------------------------------------------------- native kwarg path


def _native_subclass(kwarg):
    """A HybridModel subclass whose forward has upstream's keyword-only MTP control signature.

    Its body implements upstream's semantics (skip MTP forward + loss when false) and records what it
    received, so the test can tell the plugin passed the kwarg instead of using the compat path.
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    ns = {}
    src = f"""
def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
            inference_context=None, runtime_gather_output=None, *, inference_params=None, loss_mask=None,
            packed_seq_params=None, padding_mask=None, {kwarg}: bool = True):
    self.received.append(({kwarg}, self.mtp_process))
    saved = self.mtp_process
    self.mtp_process = saved and {kwarg}
    try:
        return HybridModel.forward(self, input_ids, position_ids, attention_mask, decoder_input, labels,
                                   inference_context, runtime_gather_output, inference_params=inference_params,
                                   loss_mask=loss_mask, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)
    finally:
        self.mtp_process = saved
"""
    exec(src, {"HybridModel": HybridModel}, ns)
    return type(f"NativeHybrid_{kwarg}", (HybridModel,), {"forward": ns["forward"]})


@pytest.mark.parametrize("kwarg", ["run_mtp_forward", "compute_mtp_loss"])
def test_native_kwarg_is_detected_and_passed_through(batch, kwarg):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    compat_model = _twin(model)
    model.__class__ = _native_subclass(kwarg)
    model.received = []
    assert native_mtp_kwarg(model) == kwarg
    assert native_mtp_kwarg(compat_model) is None  # megatron-core 0.19.2 has neither kwarg
    for run in (False, True):
        out, grads, tr = _step(model, batch, run)
        ref, ref_grads, ref_tr = _step(compat_model, batch, run)
        assert model.received[-1] == (run, True)  # kwarg received; mtp_process untouched by the plugin
        assert torch.equal(out, ref)
        _assert_same_grads(grads, ref_grads)
        assert (tr != {}) is run


def test_native_path_never_imports_the_compat_toggle(batch, monkeypatch):
    model = build_tiny_hybrid()
    model.__class__ = _native_subclass("compute_mtp_loss")
    model.received = []

    def forbidden(*a, **k):
        raise AssertionError("compat path used although the native kwarg exists")

    monkeypatch.setattr(megatron_mtp_skip, "skip_mtp_forward", forbidden)
    hybrid_forward(model, batch["input_ids"], batch["position_ids"], batch["attention_mask"], run_mtp_forward=False)
    assert model.received == [(False, True)]


# --------------------------------------------------------------------------- GPTModel


def test_gpt_model_with_mtp_is_supported(batch):
    torch.manual_seed(0)
    model = build_tiny_gpt(mtp_num_layers=1)
    out_skip, grads_skip, tr_skip = _step(model, batch, False)
    out_run, grads_run, tr_run = _step(model, batch, True)
    assert torch.equal(out_skip, out_run)  # MTP never changes the returned logits
    assert tr_skip == {} and float(tr_run["total_values"][0]) > 0
    assert all(g is None for n, g in grads_skip.items() if n.startswith("mtp."))
    assert model.config.mtp_num_layers == 1 and model.mtp_process is True  # both restored


# --------------------------------------------------------------------------- modes


def test_online_mode_isolates_the_mtp_gradient_bit_for_bit(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    configure_transformer_config(model.config, "online", mtp_loss_scaling_factor=0.1)
    assert validate_model_for_mode(model, "online") is MTPMode.ONLINE
    _, skip_grads, _ = _step(model, batch, False)
    out, grads, tr = _step(model, batch, True)
    # trunk, shared embedding and output layer: bit-identical in fp32 to the skipped step
    _assert_same_grads(_base(grads), _base(skip_grads))
    assert "embedding.word_embeddings.weight" in grads and "output_layer.weight" in grads
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.")}
    assert mtp and all(g is not None and g.abs().sum() > 0 for g in mtp.values()), [
        n for n, g in mtp.items() if g is None or g.abs().sum() == 0
    ]
    assert out.shape == (2, S, 128)  # main logits returned for the external RL loss


def test_online_mtp_loss_uses_only_response_tokens(batch):
    model = build_tiny_hybrid(mtp_detach_heads=True)
    _, _, tr = _step(model, batch, True)
    # labels derived from input_ids: depth-1 MTP at position t predicts token t+2, counted when t+2 is a
    # response token inside the window: positions P-2 .. S-3 -> S-P per row
    assert float(tr["total_values"][0]) == 2 * (S - P)
    _, _, tr_all = _step(model, batch, True, loss_mask=None)
    assert float(tr_all["total_values"][0]) == 2 * (S - 2)


def test_mtp_loss_scaling_factor_scales_the_mtp_gradient(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid(mtp_detach_heads=True)
    configure_transformer_config(model.config, "online", mtp_loss_scaling_factor=0.1)
    _, g1, _ = _step(model, batch, True)
    configure_transformer_config(model.config, "online", mtp_loss_scaling_factor=0.3)
    _, g3, _ = _step(model, batch, True)
    n = "mtp.layers.0.eh_proj.weight"
    torch.testing.assert_close(g3[n], 3 * g1[n], rtol=1e-5, atol=1e-7)
    _assert_same_grads(_base(g1), _base(g3))  # still isolated


def test_joint_mode_lets_the_mtp_loss_train_the_trunk(batch):
    torch.manual_seed(0)
    model = build_tiny_hybrid()
    configure_transformer_config(model.config, "joint")
    validate_model_for_mode(model, "joint")
    _, skip_grads, _ = _step(model, batch, False)
    _, grads, _ = _step(model, batch, True)
    differ = [n for n, g in _base(grads).items() if g is not None and not torch.equal(g, skip_grads[n])]
    assert "embedding.word_embeddings.weight" in differ and any(n.startswith("decoder.") for n in differ)


def _megatron_adam(ddp):
    """megatron's own parameter grouping (it skips requires_grad=False) fed to torch's AdamW.

    megatron's optimizer wrapper allocates on CUDA unconditionally (FP32Optimizer), so on CPU the
    optimizer itself is torch's; on GPU tests/gpu runs megatron's distributed optimizer.
    """
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([ddp], OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1), None)
    return torch.optim.AdamW([{"params": g["params"], "weight_decay": g["wd_mult"] * 0.1} for g in groups], lr=1e-2)


def test_frozen_mode_pre_wrap_hook_leaves_no_optimizer_state_and_no_change(batch):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    model = build_tiny_hybrid()
    keys = list(model.state_dict().keys())
    frozen = freeze_mtp(model)  # pre-wrap hook: before DDP and optimizer
    assert frozen and all(n.startswith("mtp.") for n in frozen)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("mtp."))
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("mtp."))
    validate_model_for_mode(model, "frozen")
    mtp_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    buffered = {n for n, p in model.named_parameters() if p in ddp.param_to_bucket_group}
    assert buffered and not any(n.startswith("mtp.") for n in buffered)  # no grad buffer for MTP
    opt = _megatron_adam(ddp)
    for _ in range(2):
        ddp.zero_grad_buffer()
        out = forward_for_phase(
            ddp, "frozen", Phase.TRAIN, batch["input_ids"], batch["position_ids"], batch["attention_mask"]
        )
        out.float().logsumexp(-1).mean().backward()
        # world size 1: the data-parallel reduction is the identity (finish_grad_sync needs CUDA streams;
        # tests/gpu runs it with overlap_grad_reduce=True and megatron's distributed optimizer)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = p.main_grad.to(p.dtype)
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state_names = [names[id(p)] for p in opt.state]
    assert state_names and not any(n.startswith("mtp.") for n in state_names)
    for n, p in model.named_parameters():
        if n.startswith("mtp."):
            assert torch.equal(p, mtp_before[n]), n  # frozen: never changed (no weight decay either)
    assert list(model.state_dict().keys()) == keys  # checkpoint keys unchanged
    fresh = build_tiny_hybrid()
    fresh.load_state_dict(model.state_dict(), strict=True)  # strict load works


# --------------------------------------------------------------------------- validation


def test_mtp_requested_on_a_model_without_mtp_layers():
    model = build_tiny_hybrid(pattern="M*-E")
    validate_model_for_mode(model, "off")
    with pytest.raises(MTPConfigError, match=r"no MTP layers .*mtp_num_layers=None"):
        validate_model_for_mode(model, "frozen")


def test_off_mode_on_a_model_built_with_mtp():
    with pytest.raises(MTPConfigError, match="mode 'off' but the model was built with MTP"):
        validate_model_for_mode(build_tiny_hybrid(), "off")


def test_off_mode_config_builds_no_mtp():
    cfg = {"mtp_num_layers": 1}
    assert configure_transformer_config(cfg, "off") == {"mtp_num_layers": None}
    assert configure_transformer_config({}, "online", mtp_loss_scaling_factor=0.3) == {
        "mtp_detach_heads": True,
        "mtp_loss_scaling_factor": 0.3,
    }


def test_pattern_depth_must_equal_mtp_num_layers():
    assert validate_pattern("M*-E/*E/*E", 2) == []
    (err,) = validate_pattern("M*-E/*E", 2)
    assert "1 MTP depth" in err and "mtp_num_layers=2" in err
    model = build_tiny_hybrid(config_overrides={"mtp_num_layers": 2})  # megatron builds this silently
    with pytest.raises(MTPConfigError, match="mtp_num_layers=2"):
        validate_model_for_mode(model, "online")


def test_frozen_with_freeze_base_is_a_contradiction():
    with pytest.raises(MTPConfigError, match="frozen.*freeze_base"):
        validate_model_for_mode(build_tiny_hybrid(), "frozen", freeze_base=True)


@pytest.mark.parametrize("mode", ["online", "joint"])
def test_training_modes_reject_frozen_mtp_params(mode):
    model = build_tiny_hybrid(mtp_detach_heads=(mode == "online"))
    freeze_mtp(model)
    with pytest.raises(MTPConfigError, match="requires_grad=False"):
        validate_model_for_mode(model, mode)


def test_online_needs_detach_and_joint_forbids_it():
    with pytest.raises(MTPConfigError, match="mtp_detach_heads=True"):
        validate_model_for_mode(build_tiny_hybrid(mtp_detach_heads=False), "online")
    with pytest.raises(MTPConfigError, match="detach_encoder=false"):
        validate_model_for_mode(build_tiny_hybrid(mtp_detach_heads=True), "joint")


def test_validation_collects_every_error_in_one_message():
    model = build_tiny_hybrid(mtp_detach_heads=False)
    freeze_mtp(model)
    with pytest.raises(MTPConfigError) as e:
        validate_model_for_mode(model, "online")
    assert "requires_grad=False" in str(e.value) and "mtp_detach_heads=True" in str(e.value)


def test_unknown_mode_string():
    with pytest.raises(MTPConfigError, match="allowed: off, frozen, online, joint"):
        validate_model_for_mode(build_tiny_hybrid(), "sometimes")


def test_unsupported_mtp_bearing_model_fails_explicitly(batch):
    class OtherLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mtp = torch.nn.Linear(4, 4)

        def forward(self, *a, **k):
            return a[0]

    with pytest.raises(UnsupportedMTPModelError, match="unsupported MTP-bearing model"):
        hybrid_forward(OtherLM(), batch["input_ids"], batch["position_ids"], None, run_mtp_forward=False)
    with pytest.raises(UnsupportedMTPModelError, match="unsupported MTP-bearing model"):
        validate_model_for_mode(OtherLM(), "frozen")


# --------------------------------------------------------------------------- metrics


def test_metrics_read_megatrons_tracker_and_reset_every_step(batch):
    model = build_tiny_hybrid(mtp_detach_heads=True)
    _, _, tr = _step(model, batch, True)
    m = collect_mtp_metrics(num_microbatches=1)
    assert set(m) == {"mtp_losses/mtp_1_loss", "mtp_accuracy/mtp_1_top1"}
    assert m["mtp_losses/mtp_1_loss"] == pytest.approx(float(tr["loss_values"][0]))
    assert m["mtp_accuracy/mtp_1_top1"] == pytest.approx(float(tr["correct_values"][0] / tr["total_values"][0]))
    assert collect_mtp_metrics() == {}  # reset after reading
    _step(model, batch, True)
    _step(model, batch, True, clear=False)
    two = collect_mtp_metrics(num_microbatches=2)  # two micro-batches accumulate; mean reported
    assert two["mtp_losses/mtp_1_loss"] == pytest.approx(m["mtp_losses/mtp_1_loss"], rel=1e-5)
    _step(model, batch, False)
    assert collect_mtp_metrics() == {}  # MTP skipped: nothing to report
