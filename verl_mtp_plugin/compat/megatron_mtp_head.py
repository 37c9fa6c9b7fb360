"""Hand Megatron's MTP loss an output layer of the plugin's own for the MTP depths, for the duration of a block.

``HybridModel.forward`` (megatron-core 0.19.x) calls the module-level ``process_mtp_loss(..., output_layer=
self.output_layer, ...)`` of ``megatron.core.models.hybrid.hybrid_model``, which computes each depth's logits with
``output_layer(hidden, weight=..., runtime_gather_output=...)`` and hands them to ``compute_language_model_loss``. The
main head's logits are computed afterwards by ``self.output_layer`` itself, not through ``process_mtp_loss``, so a
replacement passed as that argument sees the MTP depths' calls and nothing else. :func:`replace_mtp_output_layer`
rebinds the module's ``process_mtp_loss`` to a wrapper that passes ``wrap(output_layer)`` instead, and restores it on
exit, exception or not. Used by :func:`verl_mtp_plugin.objective.mtp_objective_scope` (the MTP loss read from the
MTP hidden states chunk by chunk). The probed names are in :data:`verl_mtp_plugin.compat.probes.JOINTS`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

__all__ = ["MODULE", "replace_mtp_output_layer"]

#: The module whose ``process_mtp_loss`` global HybridModel's forward calls.
MODULE = "megatron.core.models.hybrid.hybrid_model"


@contextlib.contextmanager
def replace_mtp_output_layer(wrap: Callable[[Any], Any]):
    """Within the block, every ``process_mtp_loss`` call HybridModel makes gets ``output_layer=wrap(output_layer)``
    (a call that passes it positionally is left as it is: it then computes the whole logits, as without the block)."""
    import importlib

    module = importlib.import_module(MODULE)
    original = module.process_mtp_loss

    @functools.wraps(original)
    def process_mtp_loss(*args, **kwargs):
        if "output_layer" in kwargs:
            kwargs["output_layer"] = wrap(kwargs["output_layer"])
        return original(*args, **kwargs)

    module.process_mtp_loss = process_mtp_loss
    try:
        yield original
    finally:
        module.process_mtp_loss = original
