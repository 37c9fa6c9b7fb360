"""The plugin's vLLM rollout server and replica: verl's own, with every request asking vLLM only for what verl
reads (:func:`verl_mtp_plugin.rollout.request.lean_request`).

:class:`MTPvLLMHttpServer` is verl 0.9.1's ``vLLMHttpServer`` whose ``generate`` passes the agent loop's sampling
parameters through :func:`lean_request` before verl builds vLLM's ``SamplingParams`` from them; verl returns the
same token ids and log-probabilities. :class:`MTPvLLMReplica` is verl's ``vLLMReplica`` starting that server.
Nothing else differs. verl's registry hands out the replica (:mod:`verl_mtp_plugin.rollout.replica`).

Imports verl's vLLM server module, and so vLLM: imported only where verl builds its rollout.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_mtp_plugin.rollout.request import LEAN_LINE, lean_request

__all__ = ["MTPvLLMHttpServer", "MTPvLLMReplica", "flat_logprobs_supported"]


def flat_logprobs_supported() -> bool:
    """Whether the installed vLLM's ``SamplingParams`` has ``flat_logprobs`` (vLLM 0.26 and 0.31 do)."""
    from vllm import SamplingParams

    return "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())


class MTPvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server; each request through :func:`lean_request` first (prints :data:`LEAN_LINE` once)."""

    _lean_flat: bool | None = None

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id, *args, **kwargs):
        if self._lean_flat is None:
            self._lean_flat = flat_logprobs_supported()
            print(LEAN_LINE.format(flat=self._lean_flat), flush=True)
        lean = lean_request(sampling_params, flat_supported=self._lean_flat)
        return await super().generate(prompt_ids, lean, request_id, *args, **kwargs)


class MTPvLLMReplica(vLLMReplica):
    """verl's vLLM replica, starting :class:`MTPvLLMHttpServer` instead of verl's server."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(MTPvLLMHttpServer)
