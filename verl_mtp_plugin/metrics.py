"""MTP loss / top-1 accuracy for one step, read from megatron's ``MTPLossLoggingHelper`` tracker.

Names follow verl: ``mtp_losses/mtp_{k}_loss`` (verl logs it as ``actor/mtp_losses/mtp_{k}_loss``)
plus the plugin's ``mtp_accuracy/mtp_{k}_top1`` (fraction of MTP positions whose argmax equals the
target token). The tracker is class-level and accumulates across forwards until it is cleaned:
:func:`collect_mtp_metrics` reads and (by default) resets it, once per step.
"""

from __future__ import annotations

__all__ = ["collect_mtp_metrics", "reset_mtp_metrics", "LOSS_KEY", "ACC_KEY"]

LOSS_KEY = "mtp_losses/mtp_{k}_loss"
ACC_KEY = "mtp_accuracy/mtp_{k}_top1"


def reset_mtp_metrics() -> None:
    """Zero megatron's MTP tracker (start of a step)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.clean_metrics_in_tracker()


def collect_mtp_metrics(num_microbatches: int = 1, *, reset: bool = True, reduce: bool = True) -> dict[str, float]:
    """MTP metrics of the current step.

    Args:
        num_microbatches (int): megatron accumulates one normalised loss per micro-batch; the mean is
            ``loss_sum / num_microbatches`` (what verl's ``get_megatron_mtp_loss`` reports).
        reset (bool): zero the tracker afterwards, so the next step starts clean.
        reduce (bool): all-reduce over the groups megatron recorded (as ``track_mtp_metrics`` does).

    Returns:
        dict[str, float]: empty when no MTP loss was computed since the last reset (MTP skipped).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    loss = tracker.get("loss_values")
    total = tracker.get("total_values")
    if loss is None or total is None:
        if reset:
            reset_mtp_metrics()
        return {}
    if reduce:  # before any early return: every rank must join the same collectives
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
    if float(total.sum()) == 0.0:  # after the reduction: the same answer on every rank
        if reset:
            reset_mtp_metrics()
        return {}
    correct = tracker.get("correct_values")
    out: dict[str, float] = {}
    for i in range(loss.shape[0]):
        k = i + 1
        out[LOSS_KEY.format(k=k)] = float(loss[i]) / max(int(num_microbatches), 1)
        if correct is not None:
            out[ACC_KEY.format(k=k)] = float(correct[i]) / max(float(total[i]), 1.0)
    if reset:
        reset_mtp_metrics()
    return out
