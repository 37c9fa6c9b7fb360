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
