"""vLLM rollout side (as ``verl/workers/rollout/``), in three parts:

* :mod:`~verl_mtp_plugin.rollout.worker`: code that runs inside vLLM's workers: the worker extension
  (``engine_kwargs.vllm.worker_extension_cls``, public path
  :mod:`verl_mtp_plugin.rollout.worker_extension`) and the drafter sync and lookup it runs inside verl's
  weight update (MTP tensors to vLLM's drafter only, in one verified load);
* :mod:`~verl_mtp_plugin.rollout.monitor`: trainer-side monitoring: per-step acceptance metrics from
  vLLM's counters, the drafter-desync guard and its messages, joined as one object the trainer calls.
* :mod:`~verl_mtp_plugin.rollout.checkpoint_worker`: what verl's ``CheckpointEngineWorker`` imports under
  ``separate_async`` (``checkpoint_engine.custom_backend_module``): the weight sender's watch in that process.

Importing this package imports none of them.
"""
