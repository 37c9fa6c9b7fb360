"""vLLM rollout side (as ``verl/workers/rollout/``):

* :mod:`~verl_mtp_plugin.rollout.worker`: code that runs inside vLLM's workers: the worker extension
  (``engine_kwargs.vllm.worker_extension_cls``, public path
  :mod:`verl_mtp_plugin.rollout.worker_extension`) and the drafter sync and lookup it runs inside verl's
  weight update (MTP tensors to vLLM's drafter only, in one verified load);
* :mod:`~verl_mtp_plugin.rollout.monitor`: trainer-side monitoring: per-step acceptance metrics from
  vLLM's counters, the drafter-desync guard and its messages, joined as one object the trainer calls.
* :mod:`~verl_mtp_plugin.rollout.checkpoint_worker`: what verl's ``CheckpointEngineWorker`` imports under
  ``separate_async`` (``checkpoint_engine.custom_backend_module``): the weight sender's watch in that process.

* :mod:`~verl_mtp_plugin.rollout.replica` (registered with verl's rollout registry on import of the plugin) and
  :mod:`~verl_mtp_plugin.rollout.server`: verl's vLLM replica and server, each request asking vLLM only for what
  verl reads (:mod:`~verl_mtp_plugin.rollout.request`).

Importing this package imports none of them.
"""
