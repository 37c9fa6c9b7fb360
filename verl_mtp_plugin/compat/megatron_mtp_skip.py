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

This module is the only place in the package that changes a library object's attribute at call
time. When the installed megatron-core has the native kwarg, :mod:`verl_mtp_plugin.control` passes
the kwarg through and never imports this module; deleting this file (and its one import) is the
whole clean-up once every supported release has the kwarg.
"""

from __future__ import annotations

import contextlib

__all__ = ["ATTRIBUTE", "skip_mtp_forward"]

#: The one attribute this module touches.
ATTRIBUTE = "mtp_process"


@contextlib.contextmanager
def skip_mtp_forward(model):
    """Within the block, ``model``'s forward skips the MTP block and its loss.

    Args:
        model: the unwrapped ``HybridModel`` (or ``GPTModel``) instance.

    Yields:
        the same model. Its ``mtp_process`` attribute is restored on exit, exception or not.
    """
    saved = model.__dict__.get(ATTRIBUTE, _MISSING)
    if saved is _MISSING or not saved:
        # Ranks that own no MTP module: nothing to skip, nothing to touch.
        yield model
        return
    model.mtp_process = False
    try:
        yield model
    finally:
        model.mtp_process = saved


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
