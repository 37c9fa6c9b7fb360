"""The plugin's verl v1 trainers: rollout speculation metrics and the desync guard in verl's step loop.

Real pieces: verl 0.9.1's trainer classes built by their own ``__init__`` from a Hydra-composed
``ppo_trainer`` config (``trainer.v1.trainer_mode=mtp_sync``, found through verl's
``get_trainer_cls``), verl's ``LLMServerManager`` (``create_empty``; the replica address it would
hold is the test's server), TransferQueue on a local Ray cluster holding rollouts written the way
verl's agent loop writes them (``AgentLoopOutput.as_dict`` + ``list_of_dict_to_tensordict`` +
``kv_batch_put``), verl's own ``_compute_advantage`` (GRPO) and ``_compute_metrics``; on the vLLM
side, vLLM 0.31.0's ``SpecDecodingProm`` counters fed with ``SpecDecodingStats`` and served by vLLM's
own ``/metrics`` router (``vllm.entrypoints.serve.instrumentator.metrics.attach_router``) over HTTP.
What is not run: rollout generation itself (the counters are fed with the scheduler statistics a
rollout would produce) and the GPU workers (``trainer.init()``).
"""

import asyncio
import random
import socket
import threading
import time
import warnings

import pytest

pytestmark = pytest.mark.vllm

K = 3  # num_speculative_tokens


# --------------------------------------------------------------------------------------------------
# fixtures: Ray + TransferQueue, one vLLM /metrics server


def _overrides(extra=(), **guard):
    base = [
        "model_engine=megatron",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.mtp.enable=true",
        "actor_rollout_ref.model.mtp.enable_rollout=true",
        f"actor_rollout_ref.model.mtp.num_speculative_tokens={K}",
        "actor_rollout_ref.rollout.disable_log_stats=false",
        "actor_rollout_ref.rollout.n=2",
        "trainer.v1.trainer_mode=mtp_sync",
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "trainer.logger=[console]",
    ]
    return base + list(extra) + [f"+verl_mtp_plugin.mtp_guard.{k}={v}" for k, v in guard.items()]


def _compose(extra=(), **guard):
    from omegaconf import OmegaConf

    from verl_mtp_plugin.trainer.config import compose_ppo_trainer

    cfg = compose_ppo_trainer(_overrides(extra, **guard))
    OmegaConf.resolve(cfg)
    return cfg


class VllmMetricsServer:
    """vLLM's /metrics router on a FastAPI app (uvicorn thread), with vLLM's spec-decode counters."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI
        from vllm.config import SpeculativeConfig
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics
        from vllm.v1.spec_decode.metrics import SpecDecodingProm

        unregister_vllm_metrics()
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_max=4, prompt_lookup_min=2)
        self.prom = SpecDecodingProm(spec, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
        app = FastAPI()
        attach_router(app)
        # the socket is bound here and handed to uvicorn: no port picked now and bound later
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 120  # only a server that never starts fails
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def rollout(self, rng, n_verify, p_accept, engine=0):
        """Feed the counters one rollout's worth of scheduler stats; return the stats objects."""
        from vllm.v1.spec_decode.metrics import SpecDecodingStats

        out = []
        for _ in range(4):
            s = SpecDecodingStats.new(K)
            for _ in range(n_verify // 4):
                a = 0
                while a < K and rng.random() < p_accept:
                    a += 1
                s.observe_draft(num_draft_tokens=K, num_accepted_tokens=a)
            self.prom.observe(s, engine_idx=engine)
            out.append(s)
        return out

    def close(self):
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()
        unregister_vllm_metrics()


def _vllm_numbers(stats):
    """vLLM's own acceptance arithmetic (SpecDecodingLogging) for these scheduler steps."""
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    lg = SpecDecodingLogging()
    for s in stats:
        lg.observe(s)
    got = {}
    lg.log(log_fn=lambda fmt, *args: got.setdefault("args", args))
    mean_len, _a, _d, accepted, drafted, per_pos, rate_pct = got["args"]
    return {
        "length": float(mean_len),
        "rate": float(rate_pct) / 100.0,
        "accepted": int(accepted),
        "drafted": int(drafted),
        "per_pos": [float(x) for x in str(per_pos).split(", ")],
    }


@pytest.fixture(scope="module")
def cluster():
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    server = VllmMetricsServer()
    yield server
    server.close()
    tq.close()
    if started:
        ray.shutdown()


def _trainer(server, extra=(), **guard):
    """A verl v1 trainer as verl's TaskRunnerV1 makes it, with one rollout replica address."""
    import verl_mtp_plugin.trainer.v1  # noqa: F401 - registers the plugin trainers
    from verl.trainer.ppo.v1 import get_trainer_cls
    from omegaconf import open_dict
    from verl.workers.rollout.llm_server import LLMServerManager

    cfg = _compose(extra, **guard)
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    trainer._init_resource_pool_mgr()
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.nnodes = 1  # create_empty is verl's standalone-replica path
    manager = LLMServerManager.create_empty(config=cfg)
    if asyncio.iscoroutine(manager):
        manager = asyncio.run(manager)
    manager.server_addresses = [server.address]  # what _initialize_llm_servers records per replica
    trainer.llm_server_manager = manager
    trainer.total_training_steps = 100
    return trainer


_KEY = [0]


def _put_rollouts(step, *, spec_fields=None, n_prompts=2, n=2):
    """Rollouts in TransferQueue exactly as verl's AgentLoopWorkerTQ writes them."""
    import transfer_queue as tq
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags = [], [], []
    for p in range(n_prompts):
        _KEY[0] += 1
        uid = f"u{_KEY[0]}"
        for j in range(n):
            i = p * n + j
            plen, rlen = 3 + i, 5 + 2 * i
            extra = {"min_global_steps": step - 1, "max_global_steps": step - 1}
            if spec_fields is not None:
                extra.update(spec_fields[i])
            out = AgentLoopOutput(
                prompt_ids=list(range(plen)),
                response_ids=list(range(rlen)),
                response_mask=[1] * rlen,
                reward_score=float(j),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields=extra,
            )
            field = out.as_dict()
            field.update({"uid": uid, "session_id": j, "global_steps": step})
            keys.append(f"{uid}_{j}_0")
            fields.append(field)
            tags.append(
                {
                    "status": "success",
                    "prompt_len": plen,
                    "response_len": rlen,
                    "seq_len": plen + rlen,
                    "global_steps": step,
                    "min_global_steps": step - 1,
                    "max_global_steps": step - 1,
                }
            )
    return tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id="train")


def _finish_step(trainer, step, batch, metrics):
    """verl's tail of a step: advantage (GRPO), then the step's metrics, as fit() calls them."""
    import transfer_queue as tq

    batch = trainer._compute_advantage(batch, metrics)
    trainer._compute_metrics(batch, metrics, {"step": 1.0, "gen": 0.5}, global_steps=step, epoch=0)
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    return metrics


# --------------------------------------------------------------------------------------------------
# registration and verl's mode-dependent behaviour


def test_plugin_trainer_modes_resolve_in_verl_and_behave_as_verls(cluster):
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    import verl_mtp_plugin.trainer.v1 as vt
    from verl_mtp_plugin.config_keys import TRAINER_MODES

    assert get_trainer_cls("mtp_sync") is vt.MTPPPOTrainerSync
    for mode, base in {"mtp_sync": PPOTrainerSync, "mtp_colocate_async": PPOTrainerColocateAsync,
                       "mtp_separate_async": PPOTrainerSeparateAsync}.items():
        cls = get_trainer_cls(mode)
        assert issubclass(cls, base) and cls.mtp_base_mode == TRAINER_MODES[mode]

    trainer = _trainer(cluster, extra=["+trainer.v1.sync.parameter_sync_step=2"])
    # verl's mode-dependent code sees "sync": the synchronous replay buffer, trainer.v1.sync.* settings
    assert trainer.config.trainer.v1.trainer_mode == "mtp_sync" and trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer and not isinstance(trainer.replay_buffer, ReplayBufferAsync)
    assert trainer.parameter_sync_step == 2
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode='colocate_async'"):
        trainer.trainer_mode = "colocate_async"
    assert trainer._mtp_server_addresses() == [cluster.address]

    # the async plugin mode gets verl's async replay buffer and keeps counting through validation
    trainer = get_trainer_cls("mtp_colocate_async")(_compose(extra=["trainer.v1.trainer_mode=mtp_colocate_async"]))
    assert trainer.trainer_mode == "colocate_async" and isinstance(trainer.replay_buffer, ReplayBufferAsync)
    assert not trainer.mtp_monitor.exclude_validation


def test_plugin_trainers_check_for_finished_rollouts_every_50_ms_not_every_2_s(cluster, monkeypatch):
    # verl's replay buffer sleeps poll_interval (2 s, no config key) between checks for a step's finished samples:
    # timing_s/gen came in 2-s multiples on the H200 and each step waited ~1 s after its rollout
    import verl.trainer.ppo.v1.replay_buffer as rb
    from verl.trainer.ppo.v1 import get_trainer_cls

    slept = []
    monkeypatch.setattr(rb.time, "sleep", slept.append)
    trainer = _trainer(cluster)
    trainer.replay_buffer._wait_for_next_poll("train", time.time())  # verl's own wait between two checks
    assert slept == [0.05]
    trainer = get_trainer_cls("mtp_colocate_async")(
        _compose(extra=["trainer.v1.trainer_mode=mtp_colocate_async", "+verl_mtp_plugin.sample_poll_s=0.5"]))
    trainer.replay_buffer._wait_for_next_poll("train", time.time())
    assert slept == [0.05, 0.5]


# --------------------------------------------------------------------------------------------------
# the step loop


def test_rollout_metrics_reach_verls_metric_dict_and_exclude_validation(cluster):
    rng = random.Random(0)
    trainer = _trainer(cluster, min_drafts=1)
    cluster.rollout(rng, 64, 0.9)  # before training (validation before train): not counted
    trainer.on_train_begin()

    for step, p in [(1, 0.8), (2, 0.5)]:
        metrics = {"actor/mtp_argmax_draft_accept_rate": 0.8}
        trainer.on_step_begin()
        train_stats = cluster.rollout(rng, 200, p, engine=step % 2)  # the step's rollout
        batch = _put_rollouts(step)
        trainer.on_validate_begin()
        cluster.rollout(rng, 200, 0.05)  # validation generations: not counted
        trainer.on_validate_end()
        _finish_step(trainer, step, batch, metrics)

        want = _vllm_numbers(train_stats)
        assert metrics["rollout/spec_num_draft_tokens"] == want["drafted"]
        assert metrics["rollout/spec_num_accepted_tokens"] == want["accepted"]
        assert metrics["rollout/spec_accept_rate"] == pytest.approx(want["rate"])
        assert metrics["rollout/spec_accept_length"] == pytest.approx(want["length"], abs=1e-2)
        for k in range(K):
            assert metrics[f"rollout/spec_accept_rate_pos_{k}"] == pytest.approx(want["per_pos"][k], abs=1e-3)
        assert metrics["rollout/spec_counter_reset"] == 0.0
        # verl's own metrics of the same step are all still there
        assert metrics["training/global_step"] == step and "critic/advantages/mean" in metrics
        assert "response_length/mean" in metrics and "perf/throughput" in metrics
        # and the guard judged the step against the trainer's estimate
        assert metrics["mtp_guard/expected_accept_rate"] == 0.8
        assert metrics["mtp_guard/accept_ratio"] == pytest.approx(want["per_pos"][0] / 0.8, abs=1e-3)
        assert metrics["mtp_guard/desync"] == 0.0


def test_colocate_async_step_counts_the_generation_of_one_weight_version(cluster):
    """mtp_colocate_async: verl pauses generation when it samples the step's batch (``on_sample_end``: abort, sleep)
    and resumes it after the step's weight update (``on_step_end``), before the step's metrics. A step counts what
    the replicas generated up to its sample (under the weights the trainer's estimate of the step is for); what they
    generate after the update, under the next weights, counts toward the next step."""
    from types import SimpleNamespace

    rng = random.Random(2)
    trainer = _trainer(cluster, ["trainer.v1.trainer_mode=mtp_colocate_async",
                                 "trainer.v1.colocate_async.num_warmup_batches=0"], min_drafts=1)
    calls = []
    # verl's on_sample_end drives the replicas through the checkpoint manager (no replicas here)
    trainer.checkpoint_manager = SimpleNamespace(abort_replicas=lambda: calls.append("abort"),
                                                 sleep_replicas=lambda: calls.append("sleep"))
    trainer.curr_step_profile = False
    trainer.on_train_begin()
    carried = []  # generated after the previous step's weight update
    for step, (p_before, p_after) in [(1, (0.8, 0.6)), (2, (0.6, 0.9)), (3, (0.9, 0.7))]:
        metrics = {"actor/mtp_argmax_draft_accept_rate": 0.8}
        trainer.on_step_begin()
        before = cluster.rollout(rng, 200, p_before)  # the step's rollout, up to verl's sample
        trainer.on_sample_end()
        assert calls[-2:] == ["abort", "sleep"]  # verl's own on_sample_end ran after the window closed
        batch = _put_rollouts(step)
        after = cluster.rollout(rng, 120, p_after, engine=1)  # resumed after the weight update at the step's end
        _finish_step(trainer, step, batch, metrics)
        want = _vllm_numbers(carried + before)
        assert metrics["rollout/spec_num_draft_tokens"] == want["drafted"], (step, metrics, want)
        assert metrics["rollout/spec_num_accepted_tokens"] == want["accepted"], step
        assert metrics["rollout/spec_accept_rate_pos_0"] == pytest.approx(want["per_pos"][0], abs=1e-3)
        carried = after


def test_verls_per_request_metrics_are_kept_and_counters_add_positions(cluster):
    from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics

    rng = random.Random(1)
    trainer = _trainer(cluster, min_drafts=1)
    trainer.on_train_begin()
    stats = cluster.rollout(rng, 120, 0.7)
    # a vLLM that returns per-request statistics: verl's server writes spec_* extra fields
    per_req = [
        {"spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 3, "spec_num_verify_steps": 10},
        {"spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 27, "spec_num_verify_steps": 10},
        {"spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 6, "spec_num_verify_steps": 2},
        {"spec_num_draft_tokens": 54, "spec_num_accepted_tokens": 18, "spec_num_verify_steps": 18},
    ]
    metrics = {}
    _finish_step(trainer, 1, _put_rollouts(1, spec_fields=per_req), metrics)

    verl_own = compute_spec_decode_metrics(
        [r["spec_num_draft_tokens"] for r in per_req],
        [r["spec_num_accepted_tokens"] for r in per_req],
        [r["spec_num_verify_steps"] for r in per_req],
    )
    assert metrics["rollout/spec_accept_rate"] == pytest.approx(verl_own["rollout/spec_accept_rate"])
    assert metrics["rollout/spec_accept_length"] == pytest.approx(verl_own["rollout/spec_accept_length"])
    want = _vllm_numbers(stats)
    assert abs(metrics["rollout/spec_accept_rate"] - want["rate"]) > 0.01  # really verl's, not the counters'
    assert metrics["rollout/spec_accept_rate_pos_0"] == pytest.approx(want["per_pos"][0], abs=1e-3)
    assert metrics["rollout/spec_num_draft_tokens"] == want["drafted"]


def test_desync_guard_warns_in_the_loop_when_acceptance_collapses(cluster, caplog):
    from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncWarning

    rng = random.Random(2)
    trainer = _trainer(cluster, min_drafts=1, zero_patience=2, patience=3)
    trainer.on_train_begin()
    seen = []
    for step, p in [(1, 0.8), (2, 0.0), (3, 0.0), (4, 0.8)]:
        metrics = {"actor/mtp_argmax_draft_accept_rate": 0.8}
        trainer.on_step_begin()
        cluster.rollout(rng, 200, p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _finish_step(trainer, step, _put_rollouts(step), metrics)
        seen.append((metrics["mtp_guard/desync"], [w for w in caught if issubclass(w.category, MTPDesyncWarning)]))
    assert [d for d, _ in seen] == [0.0, 0.0, 1.0, 0.0]
    assert [len(w) for _, w in seen] == [0, 0, 1, 0]
    text = str(seen[2][1][0].message)
    assert text.startswith("MTP drafter desync suspected at step 3")
    assert "actor/mtp_argmax_draft_accept_rate=0.8000" in text  # the trainer's estimate of the same step
    # names the config keys involved
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls" in text
    assert "actor_rollout_ref.rollout.free_cache_engine" in text


def test_fail_action_stops_after_the_step_is_logged(cluster):
    from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncError

    rng = random.Random(3)
    trainer = _trainer(cluster, min_drafts=1, zero_patience=1, action="fail")
    trainer.on_train_begin()
    metrics = {"actor/mtp_argmax_draft_accept_rate": 0.8}
    trainer.on_step_begin()
    cluster.rollout(rng, 200, 0.0)
    _finish_step(trainer, 1, _put_rollouts(1), metrics)  # does not raise: fit() logs this dict next
    assert metrics["mtp_guard/desync"] == 1.0 and metrics["rollout/spec_accept_rate"] == 0.0
    with pytest.raises(MTPDesyncError, match="step 1"):
        trainer.on_step_begin()  # the next step does not start
    trainer.on_step_begin()  # raised once

    # the last step: nothing follows it inside verl's loop, so verl's fit() returns normally (after
    # logging the step) and the plugin's fit() raises then. Here verl's real fit() runs with its loop
    # already exhausted (what _init_dataloader / _load_checkpoint would have set).
    trainer = _trainer(cluster, ["trainer.val_before_train=false"], min_drafts=1, zero_patience=1, action="fail")
    trainer.on_train_begin()
    cluster.rollout(rng, 200, 0.0)
    metrics = {"actor/mtp_argmax_draft_accept_rate": 0.8}
    _finish_step(trainer, 1, _put_rollouts(1), metrics)
    assert metrics["mtp_guard/desync"] == 1.0 and trainer.mtp_monitor.pending_error is not None
    trainer.global_steps, trainer.steps_per_epoch, trainer.total_training_steps = 1, 1, 1
    trainer._init_dump_executor()
    with pytest.raises(MTPDesyncError, match="step 1"):
        trainer.fit(agent_loop_manager=None)


def test_invalid_guard_block_fails_when_the_trainer_is_built(cluster):
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_mtp_plugin.policy import MTPConfigError

    cfg = _compose(action="explode")
    with pytest.raises(MTPConfigError, match="verl_mtp_plugin.mtp_guard.action"):
        get_trainer_cls("mtp_sync")(cfg)  # before trainer.init() would place any GPU worker


def test_rollout_skip_cache_reads_the_base_modes_settings(cluster):
    """verl's rollout skip cache reads trainer.v1.<trainer_mode>.parameter_sync_step from the config."""
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.skip.rollout_skip import RolloutTqSkip

    cfg = _compose(extra=["trainer.v1.trainer_mode=mtp_separate_async", "data.train_batch_size=8",
                          "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                          "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
                          "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module="
                          "verl_mtp_plugin.rollout.checkpoint_worker"])
    trainer = get_trainer_cls("mtp_separate_async")(cfg)
    assert trainer.parameter_sync_step == 4  # verl's separate_async default, through the mode property
    skip = RolloutTqSkip(cfg.skip.rollout_tq, cfg)
    assert skip.parameter_sync_step == 4


# --------------------------------------------------------------------------------------------------
# the entry point's task runner (last in this module: verl's TaskRunnerV1.run closes TransferQueue)


def test_plugin_task_runner_resolves_plugin_modes_in_its_ray_actor(cluster):
    """``python -m verl_mtp_plugin.main_ppo`` runs this actor class: verl's TaskRunnerV1 looks the
    trainer mode up in the actor's own process, where only the plugin's runner has registered it."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    from verl_mtp_plugin.trainer.main_ppo import MTPTaskRunner, MTPTaskRunnerV1

    assert issubclass(MTPTaskRunner, TaskRunnerV1.__ray_actor_class__)
    # separate_async checks train_batch_size == parameter_sync_step (4) * ppo_mini_batch_size (2) in its
    # constructor: reaching that check proves the lookup found the plugin class (a verl subclass)
    # (a checkpoint engine separate_async accepts: the plugin's trainer refuses naive there itself)
    cfg = _compose(extra=["trainer.v1.trainer_mode=mtp_separate_async",
                          "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
                          "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module="
                          "verl_mtp_plugin.rollout.checkpoint_worker"])
    with pytest.raises(ray.exceptions.RayTaskError, match="Unknown trainer 'mtp_separate_async'"):
        ray.get(TaskRunnerV1.remote().run.remote(cfg))
    with pytest.raises(ray.exceptions.RayTaskError, match="train_batch_size must equal parameter_sync_step"):
        ray.get(MTPTaskRunnerV1.remote().run.remote(cfg))
