"""Names the plugin shares with verl configs, and readers for verl's config trees.

A leaf module (imports nothing of the plugin, verl or vLLM): the engine side, the trainer side and the
start-up check all read these, so none of them has to import another for a constant.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "ACTOR",
    "ACTOR_MEGATRON",
    "ARGMAX_DRAFT_METRIC",
    "BACKEND",
    "CRITIC",
    "CRITIC_MEGATRON",
    "DRAFT_METHOD_ESTIMATE_METRIC",
    "DRAFTED_ARGMAX_METRIC",
    "DRAFTED_EXPECTED_METRIC",
    "DRAFT_SAMPLE_METHOD_KEY",
    "ENV_DRAFTER_SYNC",
    "ENV_SYNC_CHECKSUM",
    "ENV_SYNC_RECV_TIMEOUT",
    "ENV_SYNC_STAGE",
    "EXPECTED_METRIC",
    "GUARD_CONFIG_PATH",
    "MODEL",
    "MODEL_TYPE",
    "MTP",
    "OBJECTIVE_CONFIG_KEY",
    "OBJECTIVE_ENV",
    "PLUGIN_LIB",
    "RAY_ENV_VARS",
    "ROLLOUT",
    "SPEC_SCHEDULE_KEY",
    "SPEC_TUNING_KEYS",
    "TRAINER_MODES",
    "VLLM_KWARGS",
    "WORKER_EXTENSION_CLS",
    "as_bool",
    "as_list",
    "get_key",
    "to_plain",
]

#: Value of ``actor_rollout_ref.model.external_lib`` that loads the plugin.
PLUGIN_LIB = "verl_mtp_plugin"
#: ``actor_rollout_ref.model.model_type`` that selects the plugin engine.
MODEL_TYPE = "nemotron_h_mtp"
#: verl strategy/backend of the plugin engine.
BACKEND = "megatron"
#: ``trainer.v1.trainer_mode`` values the plugin registers (:mod:`verl_mtp_plugin.trainer.v1`, verl's
#: ``register_trainer``) -> the verl trainer mode each behaves as.
TRAINER_MODES = {"mtp_sync": "sync", "mtp_colocate_async": "colocate_async", "mtp_separate_async": "separate_async"}
#: Where the drafter-desync guard's config block lives in a verl trainer config.
GUARD_CONFIG_PATH = "verl_mtp_plugin.mtp_guard"
#: The engine's in-trainer acceptance estimates as verl logs them (``actor/`` + the probe's keys).
EXPECTED_METRIC = "actor/mtp_expected_accept_rate"
ARGMAX_DRAFT_METRIC = "actor/mtp_argmax_draft_accept_rate"
#: The same two over the positions vLLM drafts at (expected verify steps along whole responses): what vLLM's
#: ``rollout/spec_accept_rate_pos_0`` measures (the means over positions above overstate it where hard positions
#: cluster)
DRAFTED_EXPECTED_METRIC = "actor/mtp_drafted_expected_accept_rate"
DRAFTED_ARGMAX_METRIC = "actor/mtp_drafted_argmax_draft_accept_rate"
#: vLLM ``draft_sample_method`` -> the estimate of what it accepts (greedy: ``p[argmax q]``; probabilistic:
#: the overlap ``sum min(p, q)``).
DRAFT_METHOD_ESTIMATE_METRIC = {"greedy": ARGMAX_DRAFT_METRIC, "probabilistic": EXPECTED_METRIC}
#: Where a recipe chooses vLLM's drafting method (verl merges ``speculative_config`` into the MTP speculative
#: config it gives vLLM); the allowed values are the keys of :data:`DRAFT_METHOD_ESTIMATE_METRIC`.
DRAFT_SAMPLE_METHOD_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.draft_sample_method"
#: Keys of ``engine_kwargs.vllm.speculative_config`` that only tune the MTP speculation verl switches on (they
#: enable nothing by themselves); with verl's speculation off the start-up check asks to drop the whole key.
SPEC_TUNING_KEYS = ("draft_sample_method", "num_speculative_tokens_per_batch_size")
#: Where a recipe lets vLLM choose the speculation depth k from the number of running requests (vLLM's
#: ``SpeculativeConfig.num_speculative_tokens_per_batch_size``, ``[[lo, hi, k], ...]``; :mod:`verl_mtp_plugin.spec_schedule`).
SPEC_SCHEDULE_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens_per_batch_size"
#: The MTP objective of online / joint (:mod:`verl_mtp_plugin.objective`): an environment variable of every Ray
#: worker, set in the recipe's ``ray_kwargs.ray_init.runtime_env.env_vars`` (:data:`OBJECTIVE_CONFIG_KEY`). verl 0.9.1
#: cannot carry it in ``actor_rollout_ref.model.mtp``: its vLLM server builds the model config by merging into
#: the structured ``HFModelConfig`` (``omega_conf_to_dataclass(..., dataclass_type=HFModelConfig)``), whose
#: ``MtpConfig`` node refuses any key verl does not define.
OBJECTIVE_ENV = "VERL_MTP_OBJECTIVE"
OBJECTIVE_CONFIG_KEY = f"ray_kwargs.ray_init.runtime_env.env_vars.{OBJECTIVE_ENV}"
#: ``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls`` of the plugin's vLLM worker extension.
WORKER_EXTENSION_CLS = "verl_mtp_plugin.rollout.worker_extension.MTPColocateWorkerExtension"

#: The verl config sections the plugin reads (dotted paths for :func:`get_key` and for error messages).
MODEL = "actor_rollout_ref.model"
MTP = "actor_rollout_ref.model.mtp"
ACTOR = "actor_rollout_ref.actor"
ACTOR_MEGATRON = "actor_rollout_ref.actor.megatron"
ROLLOUT = "actor_rollout_ref.rollout"
VLLM_KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm"
CRITIC = "critic"
CRITIC_MEGATRON = "critic.megatron"
#: Where a verl config sets the environment of its Ray workers (the vLLM workers read the variables below).
RAY_ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"
#: Environment variables the plugin's vLLM worker extension reads (documented in
#: :mod:`verl_mtp_plugin.rollout.worker.extension`).
ENV_DRAFTER_SYNC = "VERL_MTP_DRAFTER_SYNC"
ENV_SYNC_CHECKSUM = "VERL_MTP_SYNC_CHECKSUM"
ENV_SYNC_STAGE = "VERL_MTP_SYNC_STAGE"
ENV_SYNC_RECV_TIMEOUT = "VERL_MTP_SYNC_RECV_TIMEOUT_S"

def get_key(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for DictConfig / dict / dataclass trees; ``default`` when any part is missing."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "keys") and hasattr(node, "get"):
            try:
                if part not in node:
                    return default
                node = node[part]
            except Exception:  # omegaconf raises on missing keys in struct mode
                return default
        else:
            if not hasattr(node, part):
                return default
            node = getattr(node, part)
    return node


def to_plain(value: Any) -> Any:
    """DictConfig/ListConfig -> dict/list (resolved); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def as_bool(value: Any) -> bool:
    """A boolean setting that may arrive as a string (``"1"``, ``"true"``, ``"yes"``, ``"on"``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def as_list(value: Any) -> list[str]:
    """A string or list setting (e.g. ``external_lib``) as a list of strings; [] for None."""
    value = to_plain(value)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]
