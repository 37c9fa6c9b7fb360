"""Compat for megatron-core releases whose ``HybridModel.forward`` has no MTP control kwarg.

megatron-core 0.19.x has neither ``run_mtp_forward`` (Megatron-LM PR #6084, closed) nor
``compute_mtp_loss`` (PR #6119, merged on main after 0.19). Upstream's semantics for
``compute_mtp_loss=False``: skip the MTP forward and the MTP loss; keep the MTP module, its
parameters and state-dict keys; return the ordinary base output; ignore it on ranks without an
MTP module; never change inference / speculative-decoding paths.

On 0.19.x both the MTP block call and ``process_mtp_loss`` are gated at call time on the instance
attribute ``mtp_process`` (``hybrid_model.py``: ``mtp_forward_ran = self.mtp_process and ...`` and
``if self.config.mtp_num_layers is not None and self.mtp_process``). Clearing that one attribute for
the duration of the call gives exactly upstream's semantics; it is restored in ``finally``, so an
exception inside the forward leaves the model as it was.

``GPTModel`` (0.19.x) gates only the MTP block on ``mtp_process`` and runs ``process_mtp_loss``
whenever ``config.mtp_num_layers`` is set, so for a ``GPTModel`` the config field is cleared for the
call as well (read at call time only in that forward; restored the same way).

This module is the only place in the package that changes a library object's attribute at call
time. When the installed megatron-core has the native kwarg, :mod:`verl_mtp_plugin.control` passes
the kwarg through and never imports this module; deleting this file (and its one import) is the
whole clean-up once every supported release has the kwarg.
"""

from __future__ import annotations

import contextlib

__all__ = ["ATTRIBUTE", "CONFIG_FIELD", "skip_mtp_forward"]

#: The model attribute this module touches.
ATTRIBUTE = "mtp_process"
#: The config field it also touches, on GPTModel only.
CONFIG_FIELD = "mtp_num_layers"


def _is_gpt_model(model) -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return isinstance(model, GPTModel)


@contextlib.contextmanager
def skip_mtp_forward(model):
    """Within the block, ``model``'s forward skips the MTP block and its loss.

    Args:
        model: the unwrapped ``HybridModel`` (or ``GPTModel``) instance.

    Yields:
        the same model. ``mtp_process`` (and, on GPTModel, ``config.mtp_num_layers``) are restored on
        exit, exception or not.
    """
    saved = model.__dict__.get(ATTRIBUTE, _MISSING)
    if saved is _MISSING or not saved:
        # Ranks that own no MTP module: nothing to skip, nothing to touch.
        yield model
        return
    config = model.config if _is_gpt_model(model) else None
    saved_layers = getattr(config, CONFIG_FIELD, None)
    model.mtp_process = False
    try:
        if config is not None:
            setattr(config, CONFIG_FIELD, None)
        yield model
    finally:
        model.mtp_process = saved
        if config is not None:
            setattr(config, CONFIG_FIELD, saved_layers)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
