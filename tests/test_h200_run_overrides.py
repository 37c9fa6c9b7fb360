"""``benchmarks/h200_main_ppo/run.py``: the overrides of the Super-widths runs compose with the shipped recipes.

``--tokens-per-gpu`` (the modes on an 80 GB card) sets the update's tokens per micro-batch and the log-prob passes'
at twice that, as the recipe relates them; the reference's pass follows the actor's value through verl's own
``ref.yaml`` interpolation. Without it every value is the recipe's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("h200_main_ppo_run", ROOT / "benchmarks" / "h200_main_ppo" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _composed(tmp_path, monkeypatch, *extra):
    from verl_mtp_plugin.trainer.config import compose_recipe

    assets = tmp_path / "assets"
    assets.mkdir(exist_ok=True)
    (assets / "assets.json").write_text(json.dumps({"answer_len": 400}))
    seen = {}

    def capture(a: argparse.Namespace) -> int:
        recipe, _, ovr = run.mode_overrides("online", a, tmp_path / "w")
        seen["cfg"] = compose_recipe(str(run.RECIPE_DIR), recipe, ovr).actor_rollout_ref
        return 0

    monkeypatch.setattr(run, "preflight", capture)
    assert run.main(["run", "--preflight", "--stack", "te", "--assets", str(assets), "--out", str(tmp_path / "o"),
                     "--modes", "online", "--response-len", "400", *extra]) == 0
    c = seen["cfg"]
    return (c.actor.ppo_max_token_len_per_gpu, c.rollout.log_prob_max_token_len_per_gpu,
            c.ref.log_prob_max_token_len_per_gpu)


def test_tokens_per_gpu_sets_the_update_and_both_log_prob_passes(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch, "--tokens-per-gpu", "9216") == (9216, 18432, 9216)


def test_without_it_the_recipes_tokens_per_gpu_stand(tmp_path, monkeypatch):
    assert _composed(tmp_path, monkeypatch) == (18432, 36864, 18432)
