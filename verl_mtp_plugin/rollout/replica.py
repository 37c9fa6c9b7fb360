"""verl's rollout registry hands out the plugin's vLLM replica, whose server asks vLLM only for what verl reads.

verl 0.9.1 resolves its rollout replica class by name through ``RolloutReplicaRegistry`` (``rollout.name: vllm``),
and its ``vLLMReplica`` starts each server as ``ray.remote(vLLMHttpServer)`` (``self.server_class``). verl has no
key for the fields of the ``SamplingParams`` its server builds, so :func:`install` registers, under verl's own name
``vllm``, a loader of :class:`verl_mtp_plugin.rollout.server.MTPvLLMReplica`, whose server passes every request
through :func:`verl_mtp_plugin.rollout.request.lean_request` (``detokenize=False``, ``flat_logprobs=True``) before
verl's ``generate`` builds it: verl's server returns the same token ids and log-probabilities, and vLLM's front end
does not detokenize them. Everything else is verl's (:mod:`verl_mtp_plugin.rollout.server`).

Installed where verl's trainer resolves the replica class, its task runner, before the trainer builds the rollout:
by :mod:`verl_mtp_plugin.trainer.v1` on import (the plugin's entry point imports it there, verl's entry point with
``VERL_USE_EXTERNAL_MODULES``) and by the package ``__init__`` in a process that imported verl first (verl's entry
point with ``actor_rollout_ref.model.external_lib``). Idempotent. Not covered: verl's PD-disaggregated replicas
(``rollout.disaggregation``), which verl resolves outside the registry.

Private joints (listed in :mod:`verl_mtp_plugin.compat.probes`, as the engine registry's are):
``RolloutReplicaRegistry._registry`` and verl's own loader ``_load_vllm`` (read, to leave a loader another package
registered under ``vllm`` in place), ``vLLMReplica.server_class``, ``vLLMHttpServer.generate``'s parameters, and
vLLM's ``SamplingParams.flat_logprobs`` (feature-detected).
"""

from __future__ import annotations

import logging

__all__ = ["ROLLOUT_NAME", "install", "installed"]

logger = logging.getLogger(__name__)

#: verl's ``actor_rollout_ref.rollout.name`` the plugin's replica is registered under.
ROLLOUT_NAME = "vllm"
_BUILTIN_LOADER = "_load_vllm"  # verl's own loader's name (verl/workers/rollout/replica.py)


def _plugin_loader():
    """verl's registry calls it where the trainer builds its rollout (imports verl's vLLM server, and vLLM)."""
    from verl_mtp_plugin.rollout.server import MTPvLLMReplica

    return MTPvLLMReplica


def installed() -> bool:
    """True when verl's registry resolves ``vllm`` to the plugin's replica loader."""
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        return False
    return RolloutReplicaRegistry._registry.get(ROLLOUT_NAME) is _plugin_loader


def install() -> bool:
    """Register :class:`MTPvLLMReplica` under ``vllm`` in verl's ``RolloutReplicaRegistry`` in place of verl's own
    loader. Returns True when registered (now or before); False, with a warning, when another package put its own
    loader there (left in place), or when verl's rollout registry is not importable."""
    try:
        from verl.workers.rollout import replica as verl_replica
    except ImportError:
        return False
    registry = verl_replica.RolloutReplicaRegistry
    have = registry._registry.get(ROLLOUT_NAME)
    if have is _plugin_loader:
        return True
    if have is not None and have is not getattr(verl_replica, _BUILTIN_LOADER, None):
        logger.warning("verl_mtp_plugin: verl's rollout registry holds %s.%s under %r, not verl's own loader: "
                       "left in place, so rollout requests keep vLLM's defaults (detokenized, per-token dicts)",
                       getattr(have, "__module__", "?"), getattr(have, "__qualname__", have), ROLLOUT_NAME)
        return False
    registry.register(ROLLOUT_NAME, _plugin_loader)
    return True
