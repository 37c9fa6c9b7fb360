"""What verl's ``CheckpointEngineWorker`` imports under ``separate_async``: the weight sender's watch there.

With ``trainer.v1.trainer_mode: separate_async`` (or the plugin's ``mtp_separate_async``) the standalone rollout
replicas are updated by verl's ``CheckpointEngineWorker`` (``verl/checkpoint_engine/base.py``), a Ray actor of its
own beside the vLLM server: it receives the trainer's weights over the checkpoint engine (``nccl``, ``nixl``, ...)
and sends them on to the vLLM workers with verl's ``BucketedWeightSender``. That process imports neither the model
config's ``external_lib`` nor the plugin, so the sender's watch (a vLLM worker that dies mid-update, or never
connects, fails the update in seconds: :mod:`verl_mtp_plugin.compat.verl_weight_sender`) would not be installed
there and a dead worker would hang the update for good.

verl imports ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module`` in that process before it builds
its checkpoint engine (and in the trainer's workers and driver, where importing it installs the same watch): set it
to this module's path, :data:`MODULE`. The start-up check refuses ``separate_async`` with any checkpoint engine but
``naive`` (which it refuses anyway) without it, naming the key, unless ``VERL_USE_EXTERNAL_MODULES`` (the job's
runtime env, else the driver's) already imports the plugin in every verl process; the shipped recipes set it.
Importing the plugin where verl is loaded also registers its engine with verl (megatron-core and verl's engine
modules are imported: ~5 s once per worker on a 2-core CPU host), as in the trainer's workers.
"""

from __future__ import annotations

from verl_mtp_plugin.compat.verl_weight_sender import install

__all__ = ["MODULE"]

#: the value of ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``
MODULE = __name__

install()
