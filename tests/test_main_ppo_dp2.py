"""verl 0.9.1's real trainer with data parallelism, as clusters run it: ``python -m verl_mtp_plugin.main_ppo`` with
``trainer.n_gpus_per_node=2`` and every model parallelism at 1, so Megatron runs two data-parallel ranks, each with
half of the batch, and verl starts two vLLM replicas (a server, engine and worker each), on CPU (gloo).

The run ``online_dp2`` (``tests/trainer_runs.py``): grpo_online, 2 steps, zero-advantage reward and no KL loss, a
checkpoint every step; after every weight update each replica writes what it received and its drafter's tensors.
Every replica's drafter must hold the trainer's MTP export after every update, and the trainer's drafted estimate
must count and pool both ranks' responses, as vLLM's rate pools both replicas' drafts.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("verl")
pytest.importorskip("vllm")

from trainer_runs import DP2_STEPS, load_safetensors  # noqa: E402

#: vLLM's first-draft acceptance (pooled over the steps' drafts) vs the trainer's drafted estimate: within this plus
#: 3 binomial standard errors of the pooled rate (as the other runs' tests)
TRACKING = 0.1


@pytest.fixture(scope="module")
def online_dp2(trainer_runs):
    return trainer_runs.result("online_dp2")


def test_dp2_every_vllm_replica_holds_the_trainers_mtp_export_after_every_update(online_dp2):
    import torch

    from verl_mtp_plugin.export.drafter import drafter_layout

    online_dp2.check()
    syncs = [e for e in online_dp2.events if e["event"] == "sync"]
    by_pid: dict[int, list[dict]] = {}
    for e in syncs:
        by_pid.setdefault(e["pid"], []).append(e)
    assert len(by_pid) == 2, sorted(by_pid)  # two replicas, each synced: the load and one update per step
    for pid, evs in by_pid.items():
        assert [e["update"] for e in evs] == list(range(1, DP2_STEPS + 2)), (pid, evs)
        assert all(e["metrics"]["sync/drafter_loaded"] == 1.0 and e["metrics"]["sync/bytes_drafter"] > 0 for e in evs)
    dump = online_dp2.workdir / f"{online_dp2.log_path.name.removesuffix('.log')}.drafter"
    exports = {}
    for update in range(2, DP2_STEPS + 2):
        want = exports[update] = {k: v for k, v in load_safetensors(online_dp2.hf_checkpoint(update - 1)).items()
                                  if k.startswith("mtp.")}
        full = drafter_layout(want)
        records = [torch.load(p) for p in sorted(dump.glob(f"rank0.update{update}*.pt"))]
        assert sorted(r["pid"] for r in records) == sorted(by_pid), (update, [r["pid"] for r in records])
        for r in records:
            assert set(r["received"]) == set(want), (r["pid"], update)
            for k, v in want.items():
                assert torch.equal(r["received"][k], v), (r["pid"], update, k)  # the trainer's export, exactly
            compared = [k for k in r["drafter"] if k in full]
            assert compared, sorted(r["drafter"])
            for k in compared:  # the drafter as loaded (read back through vLLM's CPU kernels)
                assert torch.equal(r["drafter"][k].float(), full[k].float()), (r["pid"], update, k)
    # each update carried newly trained MTP weights
    assert any(not torch.equal(exports[2][k], exports[3][k]) for k in exports[2])


def test_dp2_drafted_estimate_pools_both_ranks_responses_and_tracks_vllm(online_dp2):
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe
    from verl_mtp_plugin.verl_config import draft_estimate_metric

    # the drafted estimate for the recipe's drafting method (the one pooled over the ranks)
    estimate = draft_estimate_metric(compose_recipe(str(CONFIG_DIR), "grpo_online")).replace("/mtp_", "/mtp_drafted_")
    assert estimate in online_dp2.metrics[1], sorted(online_dp2.metrics[1])
    steps = [online_dp2.metrics[s] for s in range(1, DP2_STEPS + 1)]
    for m in steps:
        # every response of the batch, both ranks': each drafts at every response position but its last (the
        # probe's budget holds them all at this size); one rank's count would be half
        responses = m["perf/total_num_tokens"] / (m["prompt_length/mean"] + m["response_length/mean"])
        assert responses == round(responses) and responses >= 8, m["perf/total_num_tokens"]
        assert m["actor/mtp_drafted_num_positions"] == responses * (m["response_length/mean"] - 1), m
    drafts = [m["rollout/spec_num_drafts"] for m in steps]
    total = sum(drafts)
    assert total > 0, drafts
    measured = sum(m["rollout/spec_accept_rate_pos_0"] * d for m, d in zip(steps, drafts)) / total
    expected = sum(m[estimate] * d for m, d in zip(steps, drafts)) / total
    bound = TRACKING + 3 * math.sqrt(max(measured * (1 - measured), 1e-4) / total)
    assert abs(measured - expected) <= bound, (measured, expected, bound, drafts)
