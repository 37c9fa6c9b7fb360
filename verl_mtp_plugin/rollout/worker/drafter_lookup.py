"""Where a vLLM model runner keeps its MTP drafter: one lookup for every runner vLLM ships.

vLLM has two GPU model runners, and they keep the speculative drafter in different places:

* **V1** (``vllm/v1/worker/gpu_model_runner.py``; also the CPU runner, ``CPUModelRunner``, its subclass):
  the proposer is ``model_runner.drafter`` (``EagleProposer`` for ``method: mtp``) and its model
  ``.drafter.model``. V1 also has ``get_draft_model()`` (vLLM 0.26 ``gpu_model_runner.py:3298``, 0.31
  ``:3302``): ``.drafter.model`` with a CUDA-graph wrapper taken off, which is what is used when it is there.
* **V2** (``vllm/v1/worker/gpu/model_runner.py``): the speculator is ``model_runner.speculator``
  (``MTPSpeculator``) and its model ``.speculator.model``, returned by ``model_runner.get_draft_model()``;
  there is no ``model_runner.drafter``. vLLM 0.31 runs Nemotron-H with MTP on V2 by default on CUDA
  (``VllmConfig.use_v2_model_runner``: V2 whenever Triton is importable), vLLM 0.26 with
  ``VLLM_USE_V2_MODEL_RUNNER=1``. A V2 runner is recognised by its ``speculator`` slot (V1 has none).

verl 0.9.1 looks only at ``model_runner.drafter`` (``vLLMColocateWorkerExtension._get_drafter_model``),
so on V2 it finds no drafter and its drafter sync is skipped without a word. The plugin's worker
extension overrides that method with :func:`find_drafter_model`, so verl's own code paths
(``_use_mtp_drafter_weight_sync``, ``_iter_all_models``, ``monkey_patch_model``) see the drafter on both
runners, and an engine started with MTP speculation whose drafter cannot be found fails its first
weight update with :class:`DrafterNotFoundError` (never a silent skip).

Pure Python: no torch, no vLLM import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DRAFTER_PLACES", "DrafterNotFoundError", "find_drafter_model", "not_found_message", "runner_kind"]

#: Where a runner keeps its drafter, in the order tried; the first that yields a module wins (on a V1
#: runner with ``get_draft_model()`` the module comes through it and the place is ``.drafter.model``).
DRAFTER_PLACES: tuple[str, ...] = (
    "model_runner.get_draft_model()",  # V2's accessor (vllm/v1/worker/gpu/model_runner.py)
    "model_runner.speculator.model",  # V2's attribute behind it (MTPSpeculator)
    "model_runner.drafter.model",  # V1 GPU runner and the CPU runner (EagleProposer)
)


class DrafterNotFoundError(RuntimeError):
    """vLLM speculates with MTP but the plugin cannot find the drafter model (its weights would never
    be synced)."""


def runner_kind(model_runner: Any) -> str:
    """``"v2"`` for vLLM's V2 model runner (it has a ``speculator`` slot), ``"v1"`` otherwise (V1 runners
    have ``get_draft_model()`` too, so that accessor does not tell them apart)."""
    return "v2" if hasattr(model_runner, "speculator") else "v1"


def _model_of(holder: Any) -> Any:
    return getattr(holder, "model", None) if holder is not None else None


def find_drafter_model(model_runner: Any) -> tuple[Any, str] | tuple[None, None]:
    """The drafter model of ``model_runner`` and the place it was found, or ``(None, None)``.

    Tries :data:`DRAFTER_PLACES` in order. ``get_draft_model()`` raising ``AttributeError`` (V2 without a
    speculator) counts as not found there; on a V1 runner its module (``.drafter.model`` unwrapped) is
    reported at ``model_runner.drafter.model``.
    """
    get = getattr(model_runner, "get_draft_model", None)
    if callable(get):
        try:
            model = get()
        except AttributeError:
            model = None
        if model is not None:
            return model, DRAFTER_PLACES[0] if runner_kind(model_runner) == "v2" else DRAFTER_PLACES[2]
    model = _model_of(getattr(model_runner, "speculator", None))
    if model is not None:
        return model, DRAFTER_PLACES[1]
    model = _model_of(getattr(model_runner, "drafter", None))
    if model is not None:
        return model, DRAFTER_PLACES[2]
    return None, None


def not_found_message(model_runner: Any, method: str | None) -> str:
    """The error text for an engine that speculates with ``method`` but has no drafter we can find."""
    return (
        f"vLLM speculates with method {method!r} but no drafter model was found on "
        f"{type(model_runner).__module__}.{type(model_runner).__qualname__} (runner {runner_kind(model_runner)}); "
        f"looked for {', '.join(DRAFTER_PLACES)}. The MTP weights would never reach the drafter, which would "
        "keep its start-up weights; nothing was loaded. This vLLM keeps its drafter somewhere else: the plugin "
        "needs to learn that place (verl_mtp_plugin.rollout.worker.drafter_lookup.DRAFTER_PLACES)."
    )
