"""Replace Megatron's ``compute_language_model_loss`` on one model instance for the duration of a block.

``HybridModel`` (megatron-core 0.19.x, through ``LanguageModule``) computes each MTP depth's loss by calling
``self.compute_language_model_loss(labels, logits)`` inside its forward (``process_mtp_loss``); the soft_ce / tv /
chained_tv objectives (:mod:`verl_mtp_plugin.objective`) swap in their own loss there. The replacement is an instance
attribute that shadows the class method; it is removed on exit, exception or not. The probed name is in
:data:`verl_mtp_plugin.compat.probes.JOINTS`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

__all__ = ["ATTRIBUTE", "replace_language_model_loss"]

#: The model method this module shadows per instance.
ATTRIBUTE = "compute_language_model_loss"


@contextlib.contextmanager
def replace_language_model_loss(model: Any, loss: Callable):
    """Within the block ``model.compute_language_model_loss`` is ``loss``; yields the original bound method."""
    original = getattr(model, ATTRIBUTE)
    setattr(model, ATTRIBUTE, loss)
    try:
        yield original
    finally:
        model.__dict__.pop(ATTRIBUTE, None)
