"""vLLM rollout side (as ``verl/workers/rollout/``), in two parts:

* :mod:`~verl_mtp_plugin.rollout.worker`: code that runs inside vLLM's workers: the worker extension
  (``engine_kwargs.vllm.worker_extension_cls``, public path
  :mod:`verl_mtp_plugin.rollout.worker_extension`) and the drafter sync and lookup it runs inside verl's
  weight update (MTP tensors to vLLM's drafter only, in one verified load);
* :mod:`~verl_mtp_plugin.rollout.monitor`: trainer-side monitoring: per-step acceptance metrics from
  vLLM's counters, the drafter-desync guard and its messages, joined as one object the trainer calls.

Importing this package imports none of them.
"""
