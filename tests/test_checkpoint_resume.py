"""Resuming a checkpoint (possibly saved in another MTP mode): the compat of
:mod:`verl_mtp_plugin.compat.checkpoint_resume` with real megatron-core objects.

The model-only load (``actor_rollout_ref.actor.checkpoint.load_contents`` without ``optimizer``) is checked on
megatron's real ``DistributedOptimizer`` (bf16 model, fp32 master shards, DDP grad buffers) built by megatron's own
``get_megatron_optimizer``, in a process of its own with the CPU runtime's trainer-worker stand-ins
(:func:`verl_mtp_cpu.workers.install_trainer_worker_standins`: megatron's optimizer allocates on ``"cuda"`` by
name), as in verl's trainer workers. The verl trainer resume across modes is ``frozen_resumed`` in
``tests/test_main_ppo.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from verl_mtp_plugin.compat import checkpoint_resume as cr

pytest.importorskip("megatron.core")

#: the process: a tiny HybridModel in bf16 under megatron's DDP + DistributedOptimizer (torch Adam inside, the CPU
#: runtime's); the weights are replaced as verl's model-only load does (``load_state_dict``), then one optimizer step
#: with zero gradients and no weight decay (Adam moves nothing) shows what the step copies back from the masters
_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from verl_mtp_cpu.tiny import init_megatron, build_tiny_hybrid
    from verl_mtp_cpu.workers import install_trainer_worker_standins
    from verl_mtp_plugin.compat import checkpoint_resume as cr

    variant = sys.argv[1]
    refresh = variant == "refresh"
    install_trainer_worker_standins()
    init_megatron(seed=3)
    cr.probe()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    torch.manual_seed(0)
    model = build_tiny_hybrid(device="cpu", config_overrides={"bf16": True, "params_dtype": torch.bfloat16})
    model = model.to(torch.bfloat16)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=True,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    assert isinstance(inner, DistributedOptimizer), type(inner)
    before = {k: v.detach().clone() for k, v in ddp.module.state_dict().items() if isinstance(v, torch.Tensor)}
    # verl's model-only load: the checkpoint's weights into the model (here: the same model, every weight + 0.25)
    loaded = {k: (v + 0.25 if v.is_floating_point() and not k.endswith("_extra_state") else v) for k, v in before.items()}
    if variant.startswith("offload"):
        # param_offload=true, the shipped recipes': the plugin engine's real load_checkpoint over verl's real
        # MegatronEngine.load_checkpoint (load the model to the device, the manager's load, offload it again)
        import os, tempfile
        from verl.workers.engine.megatron import transformer_impl as ti
        from verl_mtp_plugin.engine.megatron import NemotronHMTPMegatronEngine
        from verl_mtp_plugin.policy import MTPMode

        def offload(models):  # verl's offload_megatron_model_to_cpu, its storage effect; CPU torch cannot pin
            for m in models:   # (verl/utils/megatron_utils.py: torch.empty(..., pin_memory=True) needs a GPU)
                for b in list(m.buffers) + list(m.expert_parallel_buffers):
                    if b.param_data.storage().size() > 0:
                        b.param_data.cpu_data = b.param_data.detach().clone()
                        b.param_data_size = b.param_data.storage().size()
                        b.param_data.storage().resize_(0)

        def onload(models, load_grad=True, load_frozen_params=True):  # verl's load_megatron_model_to_gpu's effect
            for m in models:
                for b in list(m.buffers) + list(m.expert_parallel_buffers):
                    if b.param_data.storage().size() == 0:
                        b.param_data.storage().resize_(b.param_data_size)
                        b.param_data.copy_(b.param_data.cpu_data)

        ti.offload_megatron_model_to_cpu, ti.load_megatron_model_to_gpu = offload, onload

        class Manager:  # verl's MegatronCheckpointManager with load_contents=[model,extra]
            should_load_model, should_load_hf_model, should_load_optimizer = True, False, False

            def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
                ddp.module.load_state_dict(loaded, strict=False)

        eng = NemotronHMTPMegatronEngine.__new__(NemotronHMTPMegatronEngine)
        eng.module, eng.optimizer, eng.checkpoint_mananager = [ddp], opt, Manager()
        eng._is_offload_param, eng._is_offload_optimizer = True, False
        eng.mtp_mode = MTPMode.ONLINE
        offload([ddp])  # the engine's state after init with param_offload
        ckpt = tempfile.mkdtemp()
        try:
            if variant == "offload-refresh-after":  # the plugin's order before: verl's whole load, then the refresh
                ti.MegatronEngine.load_checkpoint(eng, ckpt)
                cr.refresh_main_params(opt)
            else:
                eng.load_checkpoint(ckpt)
        except Exception as e:
            print("RESULT " + json.dumps({"raised": f"{type(e).__name__}: {e}"[:300]}))
            sys.exit(0)
        onload([ddp])  # verl's train_mode before the step
    else:
        ddp.module.load_state_dict(loaded, strict=False)
    if refresh:
        cr.refresh_main_params(opt)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ok, _, _ = opt.step()
    after = {k: v.detach() for k, v in ddp.module.state_dict().items() if isinstance(v, torch.Tensor)}
    names = [k for k, p in ddp.module.named_parameters() if p.requires_grad]
    res = {"step_ok": bool(ok), "n": len(names),
           "at_loaded": sum(bool(torch.equal(after[k], loaded[k])) for k in names),
           "at_before": sum(bool(torch.equal(after[k], before[k])) for k in names),
           "dtypes": sorted({str(p.dtype) for p in ddp.module.parameters()})}
    print("RESULT " + json.dumps(res))
""")


def _run(variant: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, variant], capture_output=True, text=True, env=env,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.timeout(900)
def test_model_only_load_refreshes_the_distributed_optimizers_fp32_masters():
    """After a model-only load, megatron's step copies the fp32 masters back into the model: without the refresh
    every trained weight is back at its value before the load (what verl's model-only resume did); with it the
    weights stay the loaded ones (the step's Adam update is 0 here)."""
    stale = _run("plain")
    assert stale["step_ok"] and stale["dtypes"] == ["torch.bfloat16"], stale
    assert stale["at_before"] == stale["n"] > 0 and stale["at_loaded"] == 0, stale  # the bug the refresh fixes
    fixed = _run("refresh")
    assert fixed["step_ok"] and fixed["at_loaded"] == fixed["n"] and fixed["at_before"] == 0, fixed


@pytest.mark.timeout(900)
def test_model_only_resume_with_param_offload_refreshes_before_verl_offloads_the_model():
    """The shipped recipes offload parameters: verl's load_checkpoint offloads the model again as it ends, freeing
    the DDP buffers the refresh reads. After verl's whole load the refresh failed (every model-only resume, the
    route the mode-change refusal recommends); the engine's load refreshes between verl's load and its offload,
    and the next step keeps the loaded weights."""
    late = _run("offload-refresh-after")
    assert "out of bounds for storage of size 0" in late.get("raised", ""), late
    fixed = _run("offload")
    assert "raised" not in fixed, fixed
    assert fixed["step_ok"] and fixed["at_loaded"] == fixed["n"] > 0 and fixed["at_before"] == 0, fixed


# ---------------------------------------------------------------------------------------------- the refusals


def test_mode_record_round_trips(tmp_path):
    assert cr.read_checkpoint_mode(str(tmp_path)) is None
    cr.write_checkpoint_mode(str(tmp_path), "frozen")
    assert cr.read_checkpoint_mode(str(tmp_path)) == "frozen"


@pytest.mark.parametrize("saved,mode", [("frozen", "online"), ("online", "frozen"), ("off", "joint"),
                                        ("joint", "off")])
def test_optimizer_of_another_parameter_set_is_refused_naming_load_contents(saved, mode):
    with pytest.raises(cr.ResumeRefused, match=r"actor_rollout_ref\.actor\.checkpoint\.load_contents=\[model,extra\]"):
        cr.check_resume(saved_mode=saved, mode=mode, load_model=saved != "off", load_optimizer=True, where="ckpt")


@pytest.mark.parametrize("saved,mode", [("frozen", "online"), ("online", "frozen"), ("online", "joint"),
                                        ("joint", "online"), ("frozen", "off"), ("online", "off"),
                                        ("online", "online"), ("frozen", "frozen"), (None, "online")])
def test_supported_resumes_pass(saved, mode):
    # the weights alone: every mode with MTP weights in the checkpoint
    cr.check_resume(saved_mode=saved, mode=mode, load_model=True, load_optimizer=False, where="ckpt")
    if saved is None or (saved in ("online", "joint")) == (mode in ("online", "joint")):
        # with the optimizer: the same parameter set in the optimizer
        cr.check_resume(saved_mode=saved, mode=mode, load_model=True, load_optimizer=True, where="ckpt")


@pytest.mark.parametrize("mode", ["online", "frozen", "joint"])
def test_checkpoint_without_mtp_weights_is_refused_for_a_mode_with_mtp(mode):
    with pytest.raises(cr.ResumeRefused, match="saved in MTP mode off: it holds no MTP weights"):
        cr.check_resume(saved_mode="off", mode=mode, load_model=True, load_optimizer=False, where="ckpt")


def test_probe_finds_the_names_it_relies_on():
    cr.probe()


@pytest.mark.parametrize("contents", [["model", "optimizer", "extra"], ["model", "extra"], ["model"], ["hf_model"],
                                      ["optimizer"], ["extra"], []])
@pytest.mark.parametrize("dist", [True, False])
def test_load_flags_from_contents_match_verls_checkpoint_manager(contents, dist):
    """Parity with the properties of verl's MegatronCheckpointManager the engine reads at load time."""
    from types import SimpleNamespace

    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager as M

    manager = SimpleNamespace(checkpoint_load_contents=contents, use_dist_checkpointing=dist)
    verl_model = M.should_load_model.fget(manager) or M.should_load_hf_model.fget(manager)
    assert cr.load_flags_from_contents(contents) == (verl_model, M.should_load_optimizer.fget(manager))


def _checkpoint(root, step, mode):
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    if mode is not None:
        cr.write_checkpoint_mode(str(actor), mode)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return actor


def _config(recipe, root, *overrides):
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe

    return compose_recipe(str(CONFIG_DIR), recipe, [f"trainer.default_local_dir={root}", *overrides])


@pytest.mark.parametrize("overrides", [(), ("trainer.resume_mode=resume_path",)])
def test_start_up_check_refuses_an_optimizer_resume_across_modes(tmp_path, overrides):
    """The start-up check finds the checkpoint verl will resume and refuses the optimizer load of a frozen run in
    mode online, naming load_contents; [model,extra] passes; resume_mode=disable is not checked."""
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.trainer.config import validate_verl_config

    actor = _checkpoint(tmp_path, 4, "frozen")
    extra = [f"trainer.resume_from_path={actor.parent}"] if overrides else []
    cfg = _config("grpo_online", tmp_path, *overrides, *extra)
    with pytest.raises(MTPConfigError, match=r"saved in MTP mode frozen.*load_contents=\[model,extra\]"):
        validate_verl_config(cfg)
    assert validate_verl_config(_config("grpo_online", tmp_path, *overrides, *extra,
                                        "actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]")).mode.value == "online"
    assert validate_verl_config(_config("grpo_frozen", tmp_path, *overrides, *extra)).mode.value == "frozen"
    validate_verl_config(_config("grpo_online", tmp_path, "trainer.resume_mode=disable"))
    # verl's v1 trainer resumes locally with default_hdfs_dir set too (the legacy trainer raises): checked all the same
    with pytest.raises(MTPConfigError, match=r"saved in MTP mode frozen"):
        validate_verl_config(_config("grpo_online", tmp_path, *overrides, *extra, "trainer.default_hdfs_dir=hdfs://x"))


def test_start_up_check_refuses_a_critic_resume_without_its_optimizer(tmp_path):
    """PPO resumed with the critic's weights but not its optimizer: verl's engine would put the critic back at its
    base weights on the first update (the actor's engine refreshes them, verl's value-model engine does not), so the
    start-up check refuses it naming the critic's key; verl's default (optimizer loaded) passes, and so do a
    checkpoint without a critic folder (one saved without a critic: the critic starts afresh), a fresh critic
    ([extra]) and resume_mode=disable."""
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.trainer.config import validate_verl_config

    model_only = "critic.checkpoint.load_contents=[model,extra]"
    _checkpoint(tmp_path, 2, "online")
    assert validate_verl_config(_config("ppo_online", tmp_path, model_only)).mode.value == "online"  # no critic/
    (tmp_path / "global_step_2" / "critic").mkdir()
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(_config("ppo_online", tmp_path, model_only))
    assert "critic.checkpoint.load_contents=[model,extra] loads the critic's weights" in str(e.value)
    assert "keep optimizer in critic.checkpoint.load_contents" in str(e.value)
    assert "actor_rollout_ref" not in str(e.value)  # the actor's resume is fine: one error, the critic's
    assert "critic.checkpoint.load_contents=[extra] starts a fresh one" in str(e.value)
    assert validate_verl_config(_config("ppo_online", tmp_path)).mode.value == "online"  # verl's default contents
    validate_verl_config(_config("ppo_online", tmp_path, "critic.checkpoint.load_contents=[extra]"))
    validate_verl_config(_config("ppo_online", tmp_path, model_only, "trainer.resume_mode=disable"))
    # the actor's and the critic's problems are named together
    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(_config("ppo_frozen", tmp_path, model_only))
    assert "saved in MTP mode online" in str(e.value) and "critic.checkpoint.load_contents" in str(e.value)


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.resume_mode=latest"], "trainer.resume_mode='latest': allowed values are auto, disable, resume_path"),
    (["trainer.resume_mode=null"], "trainer.resume_mode=None: allowed values are auto, disable, resume_path"),
    (["trainer.resume_mode="], "trainer.resume_mode='': allowed values are auto, disable, resume_path"),
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpts/run1"],
     "trainer.resume_from_path='/ckpts/run1' with trainer.resume_mode=resume_path: must be the path of a "
     "global_step_<N> folder"),
])
def test_resume_settings_verl_fails_on_after_start_up_are_refused_naming_the_key(tmp_path, overrides, needle):
    """An unknown resume mode fails verl's v1 trainer with an UnboundLocalError, a path without global_step_N with
    an assert, both after every worker was built."""
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.trainer.config import validate_verl_config

    with pytest.raises(MTPConfigError) as e:
        validate_verl_config(_config("grpo_online", tmp_path, *overrides))
    assert needle in str(e.value)
