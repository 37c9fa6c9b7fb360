"""The one reader of the verl config settings the plugin depends on.

Every part of the plugin that asks "does verl speculate?", "what speculative config does vLLM get?", "what is
``compilation_config``?", "at which level does verl put vLLM to sleep?" or "what is the plugin's environment
setting X?" asks this module (the start-up check, the desync guard, the drafting-method estimate).

* :func:`speculative_config` is verl's own ``build_mtp_speculative_config``
  (``verl/workers/rollout/vllm_rollout/utils.py``, what ``vLLMHttpServer`` hands vLLM when
  ``mtp.enable and mtp.enable_rollout``), imported only when verl speculates (it imports vLLM).
* :func:`sleep_level` is verl's ``vLLMHttpServer._resolve_sleep_level`` rule (level 1 for MTP rollout or a LoRA
  adapter, else 2; none when ``rollout.free_cache_engine`` is false); ``tests/test_verl_config.py`` checks it
  against verl's method.
* A drafting-method-only ``speculative_config`` (only :data:`~verl_mtp_plugin.config_keys.SPEC_TUNING_KEYS`)
  does NOT switch speculation on: it only tunes the speculation verl switches on.

Bad values raise :class:`~verl_mtp_plugin.policy.MTPConfigError` naming the key. Core module: imports verl
only inside functions.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from verl_mtp_plugin.config_keys import (
    ACTOR_MEGATRON,
    CRITIC,
    CRITIC_MEGATRON,
    DRAFT_METHOD_ESTIMATE_METRIC,
    ENV_DRAFTER_SYNC,
    ENV_SYNC_CHECKSUM,
    ENV_SYNC_RECV_TIMEOUT,
    ENV_SYNC_STAGE,
    MODEL,
    MTP,
    OBJECTIVE_ENV,
    RAY_ENV_VARS,
    ROLLOUT,
    SPEC_TUNING_KEYS,
    VLLM_KWARGS,
    as_bool,
    get_key,
    to_plain,
)
from verl_mtp_plugin.policy import MTPConfigError

__all__ = [
    "BOOL_WORDS",
    "VALUE_KEYS",
    "PLUGIN_ENV_VARS",
    "EnvSetting",
    "compilation_config",
    "draft_estimate_metric",
    "env_setting",
    "env_settings",
    "json_block",
    "max_num_seqs",
    "max_num_seqs_setting",
    "sleep_level",
    "speculation_depths",
    "speculation_schedule",
    "speculation_on",
    "speculative_config",
    "user_speculative_config",
    "value_errors",
    "verl_speculates",
]

#: Words a boolean environment setting may take (what :func:`~verl_mtp_plugin.config_keys.as_bool` reads).
BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")
#: Every environment variable the plugin reads outside its CPU runtime and test helpers.
PLUGIN_ENV_VARS = (OBJECTIVE_ENV, ENV_DRAFTER_SYNC, ENV_SYNC_CHECKSUM, ENV_SYNC_STAGE, ENV_SYNC_RECV_TIMEOUT)


def json_block(config: Any, key: str) -> dict | None:
    """A mapping setting that verl's command line also accepts as a JSON string (``speculative_config``,
    ``compilation_config``): a plain dict, None when unset; MTPConfigError naming ``key`` otherwise."""
    raw = to_plain(get_key(config, key))
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else None
        except ValueError as e:
            raise MTPConfigError(f"{key}={raw!r} is not valid JSON ({e}); give a mapping") from None
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise MTPConfigError(f"{key}={raw!r}: must be a mapping (got {type(value).__name__})")
    return dict(value)


def user_speculative_config(config: Any) -> dict | None:
    """The user's ``...engine_kwargs.vllm.speculative_config`` as a dict (JSON string decoded); None when unset."""
    return json_block(config, f"{VLLM_KWARGS}.speculative_config")


def compilation_config(config: Any) -> dict:
    """``...engine_kwargs.vllm.compilation_config`` as a dict ({} when unset)."""
    return json_block(config, f"{VLLM_KWARGS}.compilation_config") or {}


def verl_speculates(config: Any) -> bool:
    """verl's condition (``vllm_async_server``): ``mtp.enable and mtp.enable_rollout``."""
    return as_bool(get_key(config, f"{MTP}.enable", False)) and as_bool(get_key(config, f"{MTP}.enable_rollout", False))


def tuning_only(spec: Mapping | None) -> bool:
    """``spec`` sets only keys that tune speculation (the drafting method) and switches nothing on."""
    return bool(spec) and all(k in SPEC_TUNING_KEYS or v is None for k, v in spec.items())


def speculation_on(config: Any) -> bool:
    """vLLM drafts: verl speculates, or a user ``speculative_config`` that is more than tuning switches it on
    behind verl's back (refused by the start-up check)."""
    spec = user_speculative_config(config)
    return verl_speculates(config) or (bool(spec) and not tuning_only(spec))


def speculative_config(config: Any) -> dict | None:
    """The ``speculative_config`` vLLM gets: verl's ``build_mtp_speculative_config`` when verl speculates, the
    user's block when it alone switches speculation on, None otherwise."""
    spec = user_speculative_config(config)
    if verl_speculates(config):
        from verl.workers.rollout.vllm_rollout.utils import build_mtp_speculative_config

        return build_mtp_speculative_config(
            get_key(config, f"{MTP}.method", "mtp"), int(get_key(config, f"{MTP}.num_speculative_tokens", 1)), spec
        )
    if spec and not tuning_only(spec):
        return {k: v for k, v in spec.items() if v is not None}
    return None


def max_num_seqs(config: Any) -> int:
    """The largest batch vLLM schedules: ``...engine_kwargs.vllm.max_num_seqs`` (verl spreads engine_kwargs over
    its own arguments) else ``actor_rollout_ref.rollout.max_num_seqs`` (verl's default 256)."""
    return max_num_seqs_setting(config)[0]


def max_num_seqs_setting(config: Any) -> tuple[int, str]:
    """:func:`max_num_seqs` and the key that sets it (for messages): verl 0.9.1's vLLM server builds its arguments as
    ``{"max_num_seqs": rollout.max_num_seqs, ..., **engine_kwargs.vllm}`` (vllm_async_server.py, engine_kwargs'
    ``None`` values dropped), so a set ``engine_kwargs.vllm.max_num_seqs`` wins."""
    key = f"{VLLM_KWARGS}.max_num_seqs"
    value = get_key(config, key)
    if value is None:
        key = f"{ROLLOUT}.max_num_seqs"
        value = get_key(config, key, 256)
    return int(value or 256), key


def speculation_depths(config: Any) -> tuple[int, ...]:
    """The distinct numbers of drafts per verify step vLLM uses (ascending): ``(k,)`` for a fixed ``k``; with
    ``...speculative_config.num_speculative_tokens_per_batch_size`` the ``k > 0`` of its ranges
    (:func:`verl_mtp_plugin.spec_schedule.schedule_depths`); ``()`` without speculation. MTPConfigError naming the
    key for a schedule the start-up check refuses."""
    from verl_mtp_plugin import spec_schedule

    spec = speculative_config(config)
    if not spec:
        return ()
    k = int(spec.get("num_speculative_tokens") or 1)
    return spec_schedule.schedule_depths(speculation_schedule(config), max_num_seqs(config), k)


def speculation_schedule(config: Any):
    """The parsed ``...speculative_config.num_speculative_tokens_per_batch_size`` vLLM gets
    (:data:`verl_mtp_plugin.spec_schedule.Schedule`); None without speculation or without a schedule.
    MTPConfigError naming the key for a schedule the start-up check refuses."""
    from verl_mtp_plugin import spec_schedule

    spec = speculative_config(config)
    raw = spec.get("num_speculative_tokens_per_batch_size") if spec else None
    return spec_schedule.parse_schedule(raw) if raw is not None else None


def _lora_as_adapter(config: Any) -> bool:
    """verl's ``vLLMHttpServer.lora_as_adapter`` on the model config."""
    lora = to_plain(get_key(config, f"{MODEL}.lora", {})) or {}
    rank = int(get_key(config, f"{MODEL}.lora_rank", 0) or 0)
    return (rank > 0 or int(lora.get("rank", 0) or 0) > 0) and not lora.get("merge", False)


def sleep_level(config: Any) -> int | None:
    """The vLLM sleep level verl uses (``vLLMHttpServer._resolve_sleep_level``); None when it never sleeps
    (``rollout.free_cache_engine=false``). NPU hosts (always 1 in verl) are not supported by the plugin."""
    if not as_bool(get_key(config, f"{ROLLOUT}.free_cache_engine", True)):
        return None
    return 1 if verl_speculates(config) or _lora_as_adapter(config) else 2


class EnvSetting(tuple):
    """``(value, key)``: a plugin environment setting's raw value and where it was set (for messages)."""

    __slots__ = ()

    def __new__(cls, value: str | None, key: str):
        return super().__new__(cls, (value, key))

    @property
    def value(self) -> str | None:
        return self[0]

    @property
    def key(self) -> str:
        return self[1]


def env_setting(config: Any, name: str, environ: Mapping[str, str] | None = None) -> EnvSetting:
    """A plugin environment setting as its Ray workers see it: the recipe's
    ``ray_kwargs.ray_init.runtime_env.env_vars.<name>`` (Ray gives it precedence), else the driver's environment
    (Ray workers inherit it); ``value`` None when set in neither."""
    environ = os.environ if environ is None else environ
    key = f"{RAY_ENV_VARS}.{name}"
    value = get_key(config, key)
    if value is not None:
        return EnvSetting(str(value), key)
    if environ.get(name) is not None:
        return EnvSetting(str(environ[name]), f"{name} (this process's environment)")
    return EnvSetting(None, key)


def env_settings(config: Any, environ: Mapping[str, str] | None = None) -> dict[str, EnvSetting]:
    """:func:`env_setting` for every name in :data:`PLUGIN_ENV_VARS`."""
    return {name: env_setting(config, name, environ) for name in PLUGIN_ENV_VARS}


def draft_estimate_metric(config: Any) -> str | None:
    """The trainer's acceptance estimate that matches the drafting method a verl config gives vLLM.

    ``...engine_kwargs.vllm.speculative_config.draft_sample_method`` (:data:`DRAFT_SAMPLE_METHOD_KEY`; vLLM's
    default ``greedy`` when unset) -> :data:`DRAFT_METHOD_ESTIMATE_METRIC` (probabilistic:
    ``actor/mtp_expected_accept_rate``; greedy: ``actor/mtp_argmax_draft_accept_rate``), as the desync guard
    judges. None when verl does not speculate (``mtp.enable`` and ``mtp.enable_rollout`` not both true).
    """
    if not verl_speculates(config):
        return None
    method = (user_speculative_config(config) or {}).get("draft_sample_method")
    return DRAFT_METHOD_ESTIMATE_METRIC[str(method or "greedy")]


# ----------------------------------------------------------------------------------- typed values


#: The numeric and boolean verl keys the plugin reads, each with its kind: ``("int", minimum)``, ``("float",
#: minimum)``, ``("bool", None)``, ``("ints", minimum)`` (a list of ints). Unset / null keys are left to verl's
#: defaults, except the ones in :data:`_NOT_NULL` (the plugin or verl turns them into numbers as they are).
VALUE_KEYS: dict[str, tuple[str, float | None]] = {
    f"{MTP}.num_speculative_tokens": ("int", 1),
    f"{MTP}.mtp_loss_scaling_factor": ("float", 0),
    **{f"{MTP}.{k}": ("bool", None) for k in ("enable", "enable_train", "enable_rollout", "detach_encoder")},
    f"{MODEL}.lora_rank": ("int", 0),
    f"{MODEL}.lora.rank": ("int", 0),
    f"{MODEL}.lora.merge": ("bool", None),
    f"{MODEL}.use_fused_kernels": ("bool", None),
    f"{MODEL}.trust_remote_code": ("bool", None),
    f"{ACTOR_MEGATRON}.context_parallel_size": ("int", 1),
    f"{ACTOR_MEGATRON}.virtual_pipeline_model_parallel_size": ("int", 1),
    f"{ACTOR_MEGATRON}.override_transformer_config.mtp_num_layers": ("int", 1),
    **{f"{ACTOR_MEGATRON}.{k}": ("bool", None) for k in ("vanilla_mbridge", "dynamic_context_parallel", "qat.enable")},
    f"{ROLLOUT}.temperature": ("float", 0),
    f"{ROLLOUT}.tensor_model_parallel_size": ("int", 1),
    f"{ROLLOUT}.expert_parallel_size": ("int", 1),
    f"{ROLLOUT}.max_num_seqs": ("int", 1),
    f"{ROLLOUT}.max_num_batched_tokens": ("int", 1),
    f"{ROLLOUT}.cudagraph_capture_sizes": ("ints", 1),
    **{f"{ROLLOUT}.{k}": ("bool", None) for k in ("free_cache_engine", "enable_sleep_mode", "enable_prefix_caching",
                                                    "enforce_eager")},
    f"{VLLM_KWARGS}.enable_prefix_caching": ("bool", None),
    "trainer.use_v1": ("bool", None),
    f"{CRITIC}.enable": ("bool", None),
    f"{CRITIC}.model.mtp.enable": ("bool", None),
    f"{CRITIC}.model.trust_remote_code": ("bool", None),
    f"{CRITIC_MEGATRON}.vanilla_mbridge": ("bool", None),
    f"{CRITIC_MEGATRON}.virtual_pipeline_model_parallel_size": ("int", 1),
}
_NOT_NULL = (f"{MTP}.num_speculative_tokens",)


def _int_value(raw: Any) -> int | None:
    """``raw`` as an int when it is one (an int, not a bool, or a string of digits); None otherwise."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and raw.strip().lstrip("+-").isdigit():
        return int(raw.strip())
    return None


def _float_value(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            return None
    return None


def value_error(key: str, raw: Any, kind: str, minimum: float | None = None) -> str | None:
    """Why ``raw`` is not a valid ``kind`` value for ``key`` (None when it is), naming the key."""
    if raw is None:
        return f"{key}=null: give a value (or drop the override for verl's default)" if key in _NOT_NULL else None
    if kind == "bool":
        if isinstance(raw, bool) or (isinstance(raw, int) and raw in (0, 1)):
            return None
        if isinstance(raw, str) and raw.strip().lower() in BOOL_WORDS:
            return None
        return f"{key}={raw!r}: must be a boolean (true or false)"
    if kind == "ints":
        items = to_plain(raw)
        if not isinstance(items, (list, tuple)):
            return f"{key}={raw!r}: must be a list of integers"
        bad = [x for x in items if _int_value(x) is None or (minimum is not None and _int_value(x) < minimum)]
        return f"{key}={items!r}: every entry must be an integer >= {minimum:g} (got {bad!r})" if bad else None
    value = _int_value(raw) if kind == "int" else _float_value(raw)
    what = "an integer" if kind == "int" else "a number"
    if value is None:
        return f"{key}={raw!r}: must be {what}" + (f" >= {minimum:g}" if minimum is not None else "")
    if minimum is not None and value < minimum:
        return f"{key}={raw!r}: must be {what} >= {minimum:g}"
    return None


def value_errors(config: Any) -> list[str]:
    """Every key of :data:`VALUE_KEYS` whose value is not of its kind (or below its minimum), naming the key; and
    ``mtp.method`` when verl speculates with a method that is not one of vLLM's MTP methods."""
    errors = [e for key, (kind, minimum) in VALUE_KEYS.items()
              if (e := value_error(key, get_key(config, key), kind, minimum)) is not None]
    method = get_key(config, f"{MTP}.method")
    if method is not None and not isinstance(method, str):
        errors.append(f"{MTP}.method={method!r}: must be a string (mtp)")
    elif method is not None and not errors and verl_speculates(config):
        try:
            from typing import get_args

            from vllm.config.speculative import MTPModelTypes
        except ImportError:  # a trainer-only host: vLLM checks it where it runs
            return errors
        allowed = get_args(MTPModelTypes)
        if method not in allowed:
            errors.append(f"{MTP}.method={method!r} is not one of vLLM's MTP methods ({', '.join(allowed)}): the "
                          "plugin syncs the trained MTP block into vLLM's MTP drafter; use mtp")
    return errors
