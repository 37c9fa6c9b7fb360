"""The plugin's vLLM rollout requests: verl's server asks vLLM for token ids and log-probabilities only.

Mirrors ``verl_mtp_plugin/rollout/request.py`` (the rule), ``rollout/server.py`` (verl's server and replica with it)
and ``rollout/replica.py`` (verl's rollout registry hands out the plugin's replica). In verl's real trainer the
requests are checked in ``tests/test_main_ppo.py`` (the servers' line, verl's rollout-vs-actor log-probability
metrics).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from verl_mtp_plugin.rollout.request import lean_request


def test_lean_request_drops_detokenization_and_asks_for_flat_log_probabilities():
    verls = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    lean = lean_request(verls)
    assert lean == {**verls, "detokenize": False, "flat_logprobs": True}
    assert "detokenize" not in verls  # the caller's dict is left as it was
    # without flat lists in the installed vLLM: detokenization still goes
    assert lean_request(verls, flat_supported=False) == {**verls, "detokenize": False}


def test_lean_request_keeps_what_a_request_needs():
    # stop strings are matched on the text: vLLM refuses them without detokenization
    assert lean_request({"stop": ["</answer>"]}) == {"stop": ["</answer>"], "flat_logprobs": True}
    assert lean_request({"stop": []})["detokenize"] is False  # no stop string: nothing needs the text
    # verl's reader of prompt log-probabilities walks vLLM's per-position dicts
    assert lean_request({"prompt_logprobs": 0}) == {"prompt_logprobs": 0, "detokenize": False}
    # a request that chose either keeps its choice
    assert lean_request({"detokenize": True, "flat_logprobs": False}) == {"detokenize": True, "flat_logprobs": False}


def test_vllm_builds_the_lean_request_as_verls_server_builds_it():
    """verl's ``vLLMHttpServer.generate`` turns ``logprobs`` into 0 / None and builds ``SamplingParams(max_tokens,
    **sampling_params)``: vLLM takes the two added fields."""
    vllm = pytest.importorskip("vllm")
    lean = lean_request({"temperature": 1.0, "top_k": -1, "logprobs": True})
    lean["logprobs"] = 0 if lean.pop("logprobs", False) else None
    sp = vllm.SamplingParams(max_tokens=8, **lean)
    assert (sp.detokenize, sp.flat_logprobs, sp.logprobs) == (False, True, 0)


def test_the_plugins_server_hands_verls_generate_the_lean_request(monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("verl")
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from verl_mtp_plugin.rollout import server

    assert issubclass(server.MTPvLLMHttpServer, vLLMHttpServer) and issubclass(server.MTPvLLMReplica, vLLMReplica)
    assert server.flat_logprobs_supported()
    seen = []

    async def verls_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        seen.append((prompt_ids, sampling_params, request_id, args, kwargs))
        return "token output"

    monkeypatch.setattr(vLLMHttpServer, "generate", verls_generate)
    srv = object.__new__(server.MTPvLLMHttpServer)  # no engine: only the request's path is under test
    params = {"temperature": 0.7, "logprobs": True}
    out = asyncio.run(srv.generate([1, 2], params, "r0", image_data=None, priority=3))
    assert out == "token output"
    assert seen == [([1, 2], {**params, "detokenize": False, "flat_logprobs": True}, "r0", (),
                     {"image_data": None, "priority": 3})]
    assert params == {"temperature": 0.7, "logprobs": True}


def _in_fresh_process(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_importing_the_plugin_after_verl_registers_its_replica_under_vllm():
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    code = """
import verl
from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class
assert RolloutReplicaRegistry._registry["vllm"].__name__ == "_load_vllm"   # verl's own loader before
import verl_mtp_plugin
from verl_mtp_plugin.rollout import replica
cls = get_rollout_replica_class("vllm")
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica
assert cls.__module__ == "verl_mtp_plugin.rollout.server" and cls.__name__ == "MTPvLLMReplica", cls
assert issubclass(cls, vLLMReplica) and replica.installed() and replica.install()   # idempotent
# PD-disaggregated rollouts are verl's own (resolved outside the registry)
assert get_rollout_replica_class("vllm", disaggregation_enabled=True).__module__.startswith("verl.")
print("ok")
"""
    r = _in_fresh_process(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_plugins_task_runner_registers_its_replica_where_the_plugin_came_before_verl():
    """The plugin's entry point: its task runner imports the package before verl (the package ``__init__`` then
    registers nothing) and its trainers module next, which registers the replica."""
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    code = """
import sys
import verl_mtp_plugin
assert "verl" not in sys.modules
import verl_mtp_plugin.trainer.v1
from verl.workers.rollout.replica import get_rollout_replica_class
assert get_rollout_replica_class("vllm").__name__ == "MTPvLLMReplica"
print("ok")
"""
    r = _in_fresh_process(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_another_packages_vllm_replica_is_left_in_place_with_a_warning():
    pytest.importorskip("verl")
    code = """
import logging
logging.basicConfig(level=logging.WARNING)
import verl
from verl.workers.rollout.replica import RolloutReplicaRegistry
def theirs():
    raise AssertionError("not called")
RolloutReplicaRegistry.register("vllm", theirs)
import verl_mtp_plugin
from verl_mtp_plugin.rollout import replica
assert RolloutReplicaRegistry._registry["vllm"] is theirs and not replica.installed() and not replica.install()
print("ok")
"""
    r = _in_fresh_process(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "holds __main__.theirs under 'vllm', not verl's own loader: left in place" in r.stderr

