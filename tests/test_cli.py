"""The `verl-mtp` command line: phases, check, keys (demo is in test_demo.py)."""

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
