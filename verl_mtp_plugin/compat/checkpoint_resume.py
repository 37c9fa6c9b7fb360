"""Compat for resuming a verl Megatron checkpoint, possibly saved in another MTP mode.

What verl 0.9.1 does on resume (``verl/utils/checkpoint/megatron_checkpoint_manager.py``, ``load_checkpoint``):
it loads ``model/dist_ckpt`` into the model (``load_state_dict``, strict, with the sharded state dict of the model
as built now) and, when ``actor_rollout_ref.actor.checkpoint.load_contents`` holds ``optimizer``, the optimizer's
state (fp32 master weights and Adam moments) from ``optimizer/dist_ckpt``. With ``load_contents`` without
``optimizer`` it never tells the optimizer that the weights changed: megatron's mixed-precision optimizers keep
their fp32 master weights at the values they copied when built (from the HF base checkpoint), and the first
``optimizer.step()`` copies them back over the loaded weights (the run silently restarts from the base
checkpoint). megatron-core's own fix for that is ``MegatronOptimizer.reload_model_params()`` (public; megatron's
trainer calls it after a model-only load): :func:`refresh_main_params` calls it.

A run's MTP mode decides which parameters the optimizer holds: online and joint train the MTP block (its fp32
masters and Adam state are in the optimizer and in ``optimizer/dist_ckpt``), frozen freezes it before DDP and the
optimizer exist and off does not build it (neither has MTP optimizer state; off has no MTP weights either). The
checkpoint does not say which mode wrote it, so the plugin's engine writes :data:`MODE_FILE` beside verl's
subfolders at every save (:func:`write_checkpoint_mode`) and checks a resume against it
(:func:`check_resume`): an optimizer state of another parameter set cannot be loaded (refused, naming
``load_contents`` and the supported way); model weights without the MTP block (mode off) cannot give an MTP
mode its block (refused).

The refresh runs inside verl's ``MegatronEngine.load_checkpoint``, right after its checkpoint manager loaded the
weights (:func:`refresh_after_model_load`): with ``param_offload`` verl offloads the model again as that method
ends, freeing the DDP buffers' storage that megatron's refresh reads (after it, the refresh failed with
``setStorage: ... out of bounds for storage of size 0``, on every model-only resume of the shipped recipes).

verl's private names this module relies on: the engine's ``checkpoint_mananager`` attribute (verl's spelling), its
manager's ``should_load_model`` / ``should_load_hf_model`` / ``should_load_optimizer`` properties and its
``load_checkpoint`` (called by the engine's ``load_checkpoint`` before the offload); megatron-core's public
``reload_model_params(state_dict=None)``. :func:`probe` checks all of them at start-up (the engine's constructor).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os

__all__ = [
    "LOAD_CONTENTS_KEY",
    "MODE_FILE",
    "ResumeRefused",
    "check_resume",
    "load_flags",
    "load_flags_from_contents",
    "probe",
    "read_checkpoint_mode",
    "refresh_after_model_load",
    "refresh_main_params",
    "resume_errors",
    "resume_folder",
    "write_checkpoint_mode",
]

#: the verl key that decides what a resume loads
LOAD_CONTENTS_KEY = "actor_rollout_ref.actor.checkpoint.load_contents"
#: the file the plugin's engine writes into each actor checkpoint folder (``global_step_N/actor/``)
MODE_FILE = "verl_mtp_plugin.json"
#: verl's attribute holding the engine's checkpoint manager (its spelling)
MANAGER_ATTR = "checkpoint_mananager"
#: the manager's properties read here
MANAGER_FLAGS = ("should_load_model", "should_load_hf_model", "should_load_optimizer")
#: modes whose optimizer holds the MTP block
_TRAINED = ("online", "joint")


class ResumeRefused(ValueError):
    """A resume that cannot continue the checkpoint's training; the message names the keys and the fix."""


def probe() -> None:
    """Check the verl / megatron-core names this module relies on (raises ``RuntimeError`` naming what changed)."""
    from megatron.core.optimizer import MegatronOptimizer
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.workers.engine.megatron import transformer_impl

    problems = []
    reload = getattr(MegatronOptimizer, "reload_model_params", None)
    if reload is None or "state_dict" not in inspect.signature(reload).parameters:
        problems.append("megatron.core.optimizer.MegatronOptimizer.reload_model_params(state_dict=None)")
    for flag in MANAGER_FLAGS:
        if not isinstance(getattr(MegatronCheckpointManager, flag, None), property):
            problems.append(f"verl MegatronCheckpointManager.{flag} (property)")
    if f"self.{MANAGER_ATTR} = MegatronCheckpointManager(" not in inspect.getsource(transformer_impl.MegatronEngine):
        problems.append(f"verl MegatronEngine.{MANAGER_ATTR} (the engine's checkpoint manager)")
    load_src = inspect.getsource(transformer_impl.MegatronEngine.load_checkpoint)
    call, offload = load_src.find(f"self.{MANAGER_ATTR}.load_checkpoint("), load_src.find("offload_megatron_model_to_cpu")
    if call < 0 or (offload >= 0 and offload < call):
        problems.append(f"verl MegatronEngine.load_checkpoint calling self.{MANAGER_ATTR}.load_checkpoint(...) "
                        "before it offloads the model")
    if problems:
        raise RuntimeError(
            "verl_mtp_plugin's checkpoint-resume compat (verl_mtp_plugin/compat/checkpoint_resume.py) needs: "
            + "; ".join(problems) + " — not found in the installed verl / megatron-core")


def load_flags(engine) -> tuple[bool, bool]:
    """(loads model weights, loads optimizer state) for the engine's resume, from verl's checkpoint manager."""
    manager = getattr(engine, MANAGER_ATTR)
    # ``hf_model`` alone loads the weights too (through the bridge, from ``actor/huggingface``)
    return bool(manager.should_load_model or manager.should_load_hf_model), bool(manager.should_load_optimizer)


def load_flags_from_contents(load_contents) -> tuple[bool, bool]:
    """(loads model weights, loads optimizer state) for a ``load_contents`` list, as verl's checkpoint manager
    decides them (``should_load_model`` / ``should_load_hf_model`` / ``should_load_optimizer``; parity test in
    ``tests/test_checkpoint_resume.py``)."""
    contents = [str(c) for c in (load_contents or ())]
    return ("model" in contents or "hf_model" in contents), "optimizer" in contents


#: ``trainer.resume_mode`` values verl's trainers know (another one: the v1 trainer fails after its start-up)
RESUME_MODES = ("auto", "disable", "resume_path")


def resume_errors(*, resume_mode, resume_from_path=None) -> list[str]:
    """``trainer.resume_mode`` / ``trainer.resume_from_path`` values verl's trainer fails on only after every worker
    is built (an unknown mode: ``UnboundLocalError`` in the v1 trainer; a path that is not a string or names no
    ``global_step_N``: an assert), each naming its key. ``None`` is a key set to null (verl's trainer knows no such
    mode); the caller passes ``auto`` for a config without the key."""
    mode = resume_mode
    if mode not in RESUME_MODES:
        return [f"trainer.resume_mode={resume_mode!r}: allowed values are {', '.join(RESUME_MODES)}"]
    if mode == "resume_path" and not (isinstance(resume_from_path, str) and "global_step_" in resume_from_path):
        return [f"trainer.resume_from_path={resume_from_path!r} with trainer.resume_mode=resume_path: must be the "
                "path of a global_step_<N> folder (verl reads the step from its name)"]
    return []


def resume_folder(*, resume_mode, default_local_dir, resume_from_path=None, default_hdfs_dir=None,
                  use_v1: bool = True) -> str | None:
    """The ``global_step_N`` folder verl's trainer resumes from (``_load_checkpoint`` of the v1 trainer and of the
    legacy ``RayPPOTrainer``, from the ``trainer.*`` keys of the same names: ``resume_mode`` auto: the latest under
    ``default_local_dir``; ``resume_path``: ``resume_from_path``), or None (no resume, or nothing there yet). The
    legacy trainer does not resume with ``default_hdfs_dir`` set (it raises); the v1 trainer ignores that key. Paths
    relative to this process's working directory, as verl's trainer resolves them."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    mode = "auto" if resume_mode is None else str(resume_mode)
    if mode not in RESUME_MODES or mode == "disable" or (default_hdfs_dir is not None and not use_v1):
        return None
    if mode == "resume_path":
        path = resume_from_path
        return os.path.abspath(str(path)) if isinstance(path, str) and os.path.isdir(path) else None
    folder = default_local_dir
    if folder is None:
        return None
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints when there is no tracker file
        return find_latest_ckpt_path(os.path.abspath(str(folder)))


def write_checkpoint_mode(local_path: str, mode: str) -> None:
    """Record the MTP mode that wrote the actor checkpoint in ``local_path`` (rank 0 calls it after verl's save)."""
    with open(os.path.join(local_path, MODE_FILE), "w") as f:
        json.dump({"mtp_mode": str(mode)}, f)


def read_checkpoint_mode(local_path: str) -> str | None:
    """The MTP mode recorded in the actor checkpoint ``local_path``; None for a checkpoint without the record
    (written before the plugin recorded it, or by another engine)."""
    path = os.path.join(local_path, MODE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return str(json.load(f)["mtp_mode"])


def check_resume(*, saved_mode: str | None, mode: str, load_model: bool, load_optimizer: bool, where: str) -> None:
    """Refuse a resume that cannot continue the checkpoint's training (raises :class:`ResumeRefused`).

    Args:
        saved_mode: the mode recorded in the checkpoint (:func:`read_checkpoint_mode`); None: unknown (no check).
        mode: the run's MTP mode.
        load_model / load_optimizer: what ``load_contents`` loads (:func:`load_flags`).
        where: the checkpoint folder (for the message).
    """
    if saved_mode is None or saved_mode == str(mode):
        return
    mode = str(mode)
    if load_model and saved_mode == "off" and mode != "off":
        raise ResumeRefused(
            f"the checkpoint {where} was saved in MTP mode off: it holds no MTP weights, so this run in mode {mode} "
            f"cannot resume it (verl loads the model strictly). Resume it in mode off, or start a new run in mode "
            f"{mode} from an HF checkpoint that has both the trained trunk and MTP weights.")
    if load_optimizer and ((saved_mode in _TRAINED) != (mode in _TRAINED)):
        held = "holds" if saved_mode in _TRAINED else "holds no"
        raise ResumeRefused(
            f"the checkpoint {where} was saved in MTP mode {saved_mode}: its optimizer state {held} MTP state, "
            f"the optimizer of this run in mode {mode} {'holds' if mode in _TRAINED else 'holds no'} MTP "
            f"parameters, so {LOAD_CONTENTS_KEY} cannot load 'optimizer'. Set {LOAD_CONTENTS_KEY}=[model,extra]: "
            f"the weights (trunk and MTP block) come from the checkpoint, the optimizer starts afresh from them "
            f"(fresh Adam moments, learning-rate schedule from step 0).")


@contextlib.contextmanager
def refresh_after_model_load(engine):
    """While verl's ``engine.load_checkpoint`` runs: :func:`refresh_main_params` right after the engine's checkpoint
    manager loaded the weights, while they are on the device (module docstring). Raises ``RuntimeError`` when the
    manager's load did not run inside (verl changed the method: the refresh would be lost)."""
    manager = getattr(engine, MANAGER_ATTR)
    load = manager.load_checkpoint
    done = []

    def load_then_refresh(*args, **kwargs):
        out = load(*args, **kwargs)
        refresh_main_params(engine.optimizer)
        done.append(True)
        return out

    manager.load_checkpoint = load_then_refresh  # this instance only, for this call
    try:
        yield
    finally:
        if manager.__dict__.get("load_checkpoint") is load_then_refresh:
            del manager.load_checkpoint
    if not done:
        raise RuntimeError(f"verl_mtp_plugin: verl's engine.load_checkpoint did not call its {MANAGER_ATTR}."
                           "load_checkpoint: the optimizer's fp32 master weights were not refreshed from the loaded "
                           "weights (the first step would undo the resume); see compat/checkpoint_resume.py")


def refresh_main_params(optimizer) -> None:
    """After a model-only load: the optimizer's fp32 master weights from the model's (loaded) weights
    (megatron-core's ``reload_model_params``; a no-op for an fp32 optimizer without masters)."""
    optimizer.reload_model_params()
