"""vLLM rollout side (as ``verl/workers/rollout/``): drafter sync, speculative-decoding metrics, desync guard.

* :mod:`~verl_mtp_plugin.rollout.drafter_sync`: MTP tensors to vLLM's drafter only, in one verified load;
* :mod:`~verl_mtp_plugin.rollout.worker_extension`: the vLLM worker extension that runs it inside
  verl's weight update (``engine_kwargs.vllm.worker_extension_cls``);
* :mod:`~verl_mtp_plugin.rollout.spec_metrics`: per-step acceptance metrics from vLLM's counters;
* :mod:`~verl_mtp_plugin.rollout.desync_guard` (rules) and
  :mod:`~verl_mtp_plugin.rollout.desync_messages` (what a user reads): the drafter-desync guard;
* :mod:`~verl_mtp_plugin.rollout.monitor`: counters -> per-step metrics -> guard, as one object.

Importing this package imports none of them.
"""
