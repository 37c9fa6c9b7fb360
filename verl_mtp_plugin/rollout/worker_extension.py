"""The public path of the plugin's vLLM worker extension, what recipes and users write:
``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls:
verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension``.

The code runs inside vLLM's workers and lives in :mod:`verl_mtp_plugin.rollout.worker.extension`; this
module hands its names out on first access, so importing it imports neither verl nor vLLM.
"""

from __future__ import annotations

__all__ = ["MTPColocateWorkerExtension"]  # noqa: F822 - handed out on first access (__getattr__)


def __getattr__(name: str):
    from verl_mtp_plugin.rollout.worker import extension

    return getattr(extension, name)
