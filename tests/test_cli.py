"""The `verl-mtp` command line: phases, check, keys (demo is in test_demo.py)."""

import os
import json

import pytest

from verl_mtp_plugin.cli import main

RECIPES = "recipes/nemotron3_super_mtp/config"


def test_phases_prints_the_table(capsys):
    assert main(["phases", "--mode", "frozen"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["frozen", "skip", "skip", "skip", "skip", "skip", "drafter"]


def test_check_accepts_a_shipped_recipe_and_prints_its_table(capsys):
    assert main(["check", f"{RECIPES}/grpo_frozen.yaml"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "frozen        skip  skip" in out and "engine_selected: True" in out


def test_check_shows_the_objective_and_the_drafting_method_with_its_memory(capsys):
    assert main(["check", f"{RECIPES}/grpo_online.yaml",
                 "ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_OBJECTIVE=soft_ce"]) == 0
    out = capsys.readouterr().out
    assert "objective: soft_ce" in out and "draft_sample_method: probabilistic" in out  # the recipes' method
    assert "draft_memory: draft probabilities max_num_seqs 256 x k 2 x vocab" in out
    assert main(["check", f"{RECIPES}/grpo_frozen.yaml"]) == 0
    out = capsys.readouterr().out
    assert "objective: hard_ce" in out and "draft_sample_method: probabilistic" in out
    assert main(["check", f"{RECIPES}/grpo_frozen.yaml",
                 "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method=greedy"]) == 0
    out = capsys.readouterr().out
    assert "draft_sample_method: greedy" in out and "token ids only" in out


def test_check_of_mode_off_needs_the_recipes_drafting_method_dropped(capsys):
    off = ["actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.enable_train=false",
           "actor_rollout_ref.model.mtp.enable_rollout=false"]
    rc = main(["check", f"{RECIPES}/grpo_frozen.yaml", *off])
    err = capsys.readouterr().err
    assert rc == 2 and "draft_sample_method=probabilistic only tunes MTP speculation" in err
    assert "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config" in err
    assert main(["check", f"{RECIPES}/grpo_frozen.yaml", *off,
                 "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "draft_sample_method: None" in out


def test_check_rejects_a_contradiction_naming_the_keys(capsys):
    rc = main(["check", f"{RECIPES}/grpo_online.yaml", "actor_rollout_ref.model.mtp.enable=false",
               "actor_rollout_ref.model.mtp.enable_train=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "INVALID" in err and "actor_rollout_ref.model.mtp.enable_rollout" in err


def test_keys_lists_the_hf_mtp_names(tmp_path, capsys):
    cfg = {"model_type": "nemotron_h", "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
           "n_routed_experts": 512, "moe_latent_size": 1024, "n_shared_experts": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["keys", "--hf-config", str(tmp_path / "config.json")]) == 0
    keys = capsys.readouterr().out.split()
    assert len(keys) == 1040 and "mtp.layers.1.mixer.experts.511.down_proj.weight" in keys
    assert "mtp.layers.0.mixer.q_proj.weight" in keys and "mtp.layers.1.final_layernorm.weight" in keys


def test_unknown_mode_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        main(["demo", "--mode", "sometimes"])


def test_main_ppo_refuses_contradictions_before_starting_ray(tmp_path):
    """python -m verl_mtp_plugin.main_ppo takes verl's main_ppo arguments; the plugin's check runs first."""
    import subprocess
    import sys

    # a relative --config-path means verl/trainer/<path>, as for python -m verl.trainer.main_ppo
    cmd = [sys.executable, "-m", "verl_mtp_plugin.main_ppo", "--config-path=config",
           "--config-name=ppo_megatron_trainer", f"hydra.run.dir={tmp_path}",
           "trainer.use_v1=false", "trainer.v1.trainer_mode=mtp_sync"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "verl_mtp_plugin: invalid verl config" in out.stderr and "trainer.use_v1=false" in out.stderr
    assert "ray init kwargs" not in out.stdout  # verl's run_ppo was never reached


def test_main_ppo_takes_the_deletion_mode_off_needs(tmp_path):
    """Mode off on a shipped recipe through python -m verl_mtp_plugin.main_ppo: Hydra's ``~key`` deletes the recipe's
    speculative_config (without it the start-up check refuses the drafting method: test_check_of_mode_off_...); an
    unknown plugin trainer keeps the run from starting Ray and shows the check ran on the composed config."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "verl_mtp_plugin.main_ppo", "--config-name=grpo_frozen", f"hydra.run.dir={tmp_path}",
           "actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.enable_train=false",
           "actor_rollout_ref.model.mtp.enable_rollout=false",
           "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config", "trainer.v1.trainer_mode=mtp_nope"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "verl_mtp_plugin: invalid verl config" in out.stderr and "trainer.v1.trainer_mode='mtp_nope'" in out.stderr
    assert "speculative_config" not in out.stderr, out.stderr[-2000:]  # deleted: nothing left to refuse
    assert "ray init kwargs" not in out.stdout


def test_main_ppo_finds_the_shipped_recipes_through_the_package(tmp_path, monkeypatch):
    """No --config-path: a shipped recipe name reads the package's folder; the documented relative
    --config-path means the shipped folder from any working directory; verl's own relative paths keep
    meaning verl/trainer/<path>."""
    import os

    import verl.trainer.main_ppo as verl_main

    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.main_ppo import verl_relative_config_path

    monkeypatch.chdir(tmp_path)  # outside the checkout
    assert verl_relative_config_path(["--config-name", "grpo_online", "x=1"]) == [
        "--config-path", str(CONFIG_DIR), "--config-name", "grpo_online", "x=1"]
    assert verl_relative_config_path(["--config-name=ppo_trainer"]) == ["--config-name=ppo_trainer"]
    documented = verl_relative_config_path(["--config-path", "recipes/nemotron3_super_mtp/config", "-cn", "grpo_online"])
    assert documented == ["--config-path", str(CONFIG_DIR), "-cn", "grpo_online"]
    verl_dir = os.path.dirname(os.path.abspath(verl_main.__file__))
    assert verl_relative_config_path(["--config-path=config"]) == [f"--config-path={os.path.join(verl_dir, 'config')}"]
    (tmp_path / "mine").mkdir()  # a folder of the user's own, relative to the working directory
    assert verl_relative_config_path(["-cp", "mine"]) == ["-cp", str(tmp_path / "mine")]



def test_the_checks_find_the_documented_recipe_path_outside_the_checkout(tmp_path, monkeypatch, capsys):
    """`verl-mtp check recipes/.../grpo_online.yaml` and `python -m verl_mtp_plugin.trainer.config --config-path
    recipes/...` resolve a relative path as main_ppo does (verl/trainer's, the working directory's, the package's)."""
    from verl_mtp_plugin.cli import check_recipe_file
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR, resolve_path
    from verl_mtp_plugin.trainer.config import main as config_main

    monkeypatch.chdir(tmp_path)  # outside the checkout: only the package has recipes/
    documented = "recipes/nemotron3_super_mtp/config"
    report = check_recipe_file(f"{documented}/grpo_online.yaml")
    assert report.splitlines()[0].startswith(f"{CONFIG_DIR / 'grpo_online.yaml'}: OK"), report[:300]
    assert resolve_path(f"{documented}/grpo_online", directory=False) == str(CONFIG_DIR / "grpo_online")
    assert config_main(["--config-path", documented, "--config-name", "grpo_frozen"]) == 0
    assert "mode: frozen" in capsys.readouterr().out
    assert check_recipe_file("grpo_frozen").startswith(f"{CONFIG_DIR / 'grpo_frozen.yaml'}: OK")  # a shipped name
    (tmp_path / "grpo_frozen").mkdir()  # a folder of that name (an output folder, say) is not a recipe file
    assert check_recipe_file("grpo_frozen").startswith(f"{CONFIG_DIR / 'grpo_frozen.yaml'}: OK")
    # a recipe that is nowhere: refused naming the path and the shipped names, no Hydra traceback
    with pytest.raises(MTPConfigError, match=r"no recipe nope\.yaml in .*grpo_online"):
        check_recipe_file("nope.yaml")
    capsys.readouterr()
    assert config_main(["--config-path", "nowhere", "--config-name", "grpo_online"]) == 1
    assert f"no recipe grpo_online.yaml in {tmp_path / 'nowhere'}" in capsys.readouterr().err
    (tmp_path / documented).mkdir(parents=True)  # a folder of the user's own at that path wins
    assert resolve_path(documented) == str(tmp_path / documented)
    assert resolve_path("/abs/x") == "/abs/x"
    # verl's own relative paths keep meaning verl/trainer/<path> for the checks as for main_ppo, a file there does
    # not stand for a folder, and a path that is nowhere is the working directory's (Hydra names it)
    import verl.trainer.main_ppo as verl_main

    verl_dir = os.path.dirname(os.path.abspath(verl_main.__file__))
    (tmp_path / "config").mkdir()
    assert resolve_path("config") == os.path.join(verl_dir, "config")
    assert resolve_path("main_ppo.py") == str(tmp_path / "main_ppo.py")  # verl/trainer/main_ppo.py: a file
    assert resolve_path("main_ppo.py", directory=False) == os.path.join(verl_dir, "main_ppo.py")

SHIPPED = ["grpo_frozen", "grpo_online", "grpo_joint", "ppo_frozen", "ppo_online"]
SUPER = "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
# (recipe, overrides, keys the error must name): what would fail at model build or be silently dropped
BROKEN = [
    ("ppo_online", ["critic.megatron.override_transformer_config.mtp_hybrid_override_pattern=*E"],
     ["critic.megatron.override_transformer_config.mtp_hybrid_override_pattern"]),
    ("ppo_frozen", ["critic.megatron.override_transformer_config.mtp_hybrid_override_pattern=*E",
                    "critic.megatron.virtual_pipeline_model_parallel_size=2"],
     ["critic.megatron.override_transformer_config.mtp_hybrid_override_pattern",
      "critic.megatron.virtual_pipeline_model_parallel_size=2"]),
    ("grpo_online", ["critic.enable=true", f"critic.model.path={SUPER}"],
     ["critic.megatron.override_transformer_config.mtp_hybrid_override_pattern"]),
    ("grpo_frozen", ["+actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode=align"],
     ["actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_cache_mode='align'",
      "actor_rollout_ref.rollout.enable_prefix_caching=false"]),
    ("grpo_joint", ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"]),
    ("ppo_online", ["actor_rollout_ref.rollout.quantization=fp8"],
     ["actor_rollout_ref.rollout.quantization='fp8'", "worker_extension_cls"]),
]


@pytest.mark.parametrize("name", SHIPPED)
def test_check_passes_every_shipped_recipe(name, capsys):
    assert main(["check", f"{RECIPES}/{name}.yaml"]) == 0
    assert f"{name}.yaml: OK" in capsys.readouterr().out


@pytest.mark.parametrize("name,overrides,keys", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_check_refuses_broken_variants_naming_the_keys(name, overrides, keys, capsys):
    assert main(["check", f"{RECIPES}/{name}.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert "INVALID" in err
    for key in keys:
        assert key in err, (key, err)


# --------------------------------------------------------------------------- rollout settings that cost speed

_CAP = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.max_cudagraph_capture_size"


@pytest.mark.parametrize("recipe", ["grpo_frozen", "grpo_online", "grpo_joint", "ppo_frozen", "ppo_online"])
def test_shipped_recipes_pass_the_strict_speed_check(recipe, capsys):
    """Every recipe captures its full speculative decode step (256 sequences x (k+1) = 768 tokens)."""
    assert main(["check", "--strict", f"{RECIPES}/{recipe}.yaml"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "WARNING" not in out


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # vLLM's default capture ceiling on Hopper is 512 tokens: below 256 x 3
        ([f"~{_CAP}"], ["CUDA-graph capture ceiling 512 tokens", "max_num_seqs=256 x (k+1)=3 = 768", _CAP]),
        (["actor_rollout_ref.rollout.max_num_seqs=512"], ["ceiling 768 tokens", "= 1536", f"{_CAP}: 1536"]),
        (["actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,2,4,8,256]"],
         ["ceiling 256 tokens (actor_rollout_ref.rollout.cudagraph_capture_sizes)"]),
        (["actor_rollout_ref.rollout.max_num_batched_tokens=512"],
         ["ceiling 512 tokens (actor_rollout_ref.rollout.max_num_batched_tokens)"]),
        (["actor_rollout_ref.rollout.enforce_eager=true"],
         ["actor_rollout_ref.rollout.enforce_eager=true while vLLM speculates with k=2", "61.6 ms vs 29.6 ms"]),
        (["+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=NONE"],
         ["compilation_config.cudagraph_mode=NONE while vLLM speculates"]),
        # online trains mtp_num_layers=2 (the repeated block); k=3 drafts past it
        (["actor_rollout_ref.model.mtp.num_speculative_tokens=3", f"{_CAP}=1024"],
         ["num_speculative_tokens=3 is larger than the MTP depth the trainer trains (2", "0.08"]),
    ],
)
def test_check_warns_on_rollout_settings_that_cost_speed_and_strict_refuses(overrides, expected, capsys):
    assert main(["check", f"{RECIPES}/grpo_online.yaml", *overrides]) == 0
    out = capsys.readouterr().out
    assert "1 warning(s)" in out, out[:2000]
    for text in expected:
        assert text in out, (text, out[:2000])
    assert main(["check", "--strict", f"{RECIPES}/grpo_online.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert "INVALID" in err and expected[0] in err


_OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"


@pytest.mark.parametrize("overrides, expected", [
    # the recipes recompute every layer, the MTP layer's too; without it the MTP layer's activations stay
    ([f"{_OTC}.recompute_granularity=null", f"{_OTC}.recompute_method=null", f"{_OTC}.recompute_num_layers=null"],
     [f"{_OTC}.recompute_granularity=None while the MTP layer trains", "3.22 GiB saved for backward",
      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]),
])
def test_check_warns_on_training_settings_that_keep_more_memory_and_strict_refuses(overrides, expected, capsys):
    """Measured on the H200: the MTP loss keeps no [tokens, V] tensor in online mode, and the MTP layer's
    activations are 3.22 GiB at hidden 1024 x 18,432 tokens without recompute. A config that leaves either path is
    said at start-up with its keys."""
    argv = [f"{RECIPES}/grpo_online.yaml", *overrides]
    assert main(["check", *argv]) == 0
    out = capsys.readouterr().out
    assert "1 warning(s)" in out, out[:3000]
    for text in expected:
        assert text in out, (text, out[:3000])
    assert main(["check", "--strict", *argv]) == 2
    err = capsys.readouterr().err
    assert "INVALID" in err and "settings that cost speed or memory (--strict)" in err


def test_joint_modes_whole_logits_are_said_at_start_up_in_bytes_at_this_configs_tokens_vocabulary_and_tp(caplog):
    """Joint mode reads the MTP logits in chunks (it computes the output weight's gradient itself), except where
    megatron defers that gradient (defer_embedding_wgrad_compute): then megatron's whole logits, their cost logged at
    start-up in bytes (not a setting to fix: --strict passes it); the shipped joint recipe says nothing."""
    from verl_mtp_plugin.policy import MTPMode
    from verl_mtp_plugin.trainer.config import compose_recipe, whole_logits_note

    defer = "actor_rollout_ref.actor.megatron.override_transformer_config.defer_embedding_wgrad_compute=true"
    cfg = compose_recipe(os.path.abspath(RECIPES), "grpo_online", ["actor_rollout_ref.model.mtp.detach_encoder=false",
                                                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert whole_logits_note(cfg, mode=MTPMode.JOINT, trained_depth=2, vocab_size=131072) is None
    cfg = compose_recipe(os.path.abspath(RECIPES), "grpo_online", ["actor_rollout_ref.model.mtp.detach_encoder=false",
                                                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                                  f"+{defer}"])
    w = whole_logits_note(cfg, mode=MTPMode.JOINT, trained_depth=2, vocab_size=131072)
    # 2 depths x 18432 tokens x 65536 columns x 2 B = 4.5 GiB
    assert "2 x [18432 tokens (actor_rollout_ref.actor.ppo_max_token_len_per_gpu), 131072/2" in w and "= 4.5 GiB" in w
    assert "defer_embedding_wgrad_compute=true" in w
    cfg = compose_recipe(os.path.abspath(RECIPES), "grpo_online", ["actor_rollout_ref.actor.use_dynamic_bsz=false",
                                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                                  "data.max_prompt_length=1024", "data.max_response_length=3072",
                                                  f"+{defer}"])
    w = whole_logits_note(cfg, mode=MTPMode.JOINT, trained_depth=1, vocab_size=131072)
    assert "1 x [16384 tokens (actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu x" in w and "= 2.0 GiB" in w  # TP 2
    assert whole_logits_note(cfg, mode=MTPMode.ONLINE, trained_depth=2, vocab_size=131072) is None
    with caplog.at_level("WARNING", logger="verl_mtp_plugin.trainer.config"):
        assert main(["check", "--strict", f"{RECIPES}/grpo_joint.yaml"]) == 0
    assert not any("detach_encoder=false (mode joint)" in r.getMessage() for r in caplog.records)


def test_k_beyond_the_checkpoint_depth_is_no_warning_when_mtp_is_frozen(capsys):
    """Frozen mode trains nothing: the drafter is what the checkpoint gives, whatever k."""
    assert main(["check", "--strict", f"{RECIPES}/grpo_frozen.yaml",
                 "actor_rollout_ref.model.mtp.num_speculative_tokens=3", f"{_CAP}=1024"]) == 0


@pytest.mark.parametrize("argv", [
    ["run", "grpo_online", "W", "trainer.total_training_steps=3", "--steps", "2", "--tp", "2"],
    ["run", "grpo_online", "W", "--steps", "2", "--tp", "2", "--", "trainer.total_training_steps=3"],
])
def test_cpu_run_takes_hydra_overrides_before_the_options_or_after_double_dash(argv, monkeypatch, capsys):
    """``python -m verl_mtp_cpu run RECIPE WORKDIR [options] -- OVERRIDES`` (the documented form) hands the
    overrides to the harness as the form with the overrides before the options does."""
    import verl_mtp_cpu.harness as harness
    from verl_mtp_cpu.__main__ import main as cpu_main

    seen = {}

    def record(recipe, workdir, **kw):
        seen.update(recipe=recipe, workdir=workdir, **kw)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run_recipe", record)
    with pytest.raises(SystemExit):
        cpu_main(argv)
    assert seen["recipe"] == "grpo_online" and seen["workdir"] == "W"
    assert seen["extra_overrides"] == ["trainer.total_training_steps=3"]
    assert seen["steps"] == 2 and seen["tp"] == 2


def test_cpu_assets_refuses_overrides_after_double_dash(capsys):
    from verl_mtp_cpu.__main__ import main as cpu_main

    with pytest.raises(SystemExit) as e:
        cpu_main(["assets", "/nonexistent", "--", "a=b"])
    assert e.value.code == 2 and "overrides after --" in capsys.readouterr().err
