"""The phase -> ``run_mtp_forward`` table. Pure Python: no torch, Megatron, verl or vLLM import.

Read the table below top to bottom; everything else in the package asks this module.

====================  =====  =====  =======  ===  ====  =======
mode \\ phase          load   train  logprob  ref  sync  rollout
====================  =====  =====  =======  ===  ====  =======
off                   no     no     no       no   no    --
frozen                no     no     no       no   no    --
online                no     YES    no       no   no    --
joint                 no     YES    no       no   no    --
====================  =====  =====  =======  ===  ====  =======

``--`` (rollout): the Megatron MTP forward is never touched during rollout; speculative decoding
is the rollout engine's (vLLM drafts with its own copy of the MTP block). ``run_mtp_forward``
answers ``False`` there, and :func:`rollout_may_speculate` says whether the drafter may be used.
"""

from __future__ import annotations

import enum

__all__ = [
    "MTPConfigError",
    "MTPMode",
    "MTPObjective",
    "Phase",
    "RUN_MTP_FORWARD",
    "format_table",
    "mode_from_verl_mtp",
    "rollout_may_speculate",
    "run_mtp_forward",
    "trains_mtp",
    "trains_trunk_with_mtp",
]


class MTPConfigError(ValueError):
    """A contradictory or unsupported MTP setting. The message names the keys involved."""


class _StrEnum(str, enum.Enum):
    @classmethod
    def parse(cls, value: "str | _StrEnum", key: str | None = None):
        """Parse ``value`` (case-insensitive) or raise :class:`MTPConfigError` naming ``key``."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            where = f"{key}=" if key else ""
            raise MTPConfigError(
                f"unknown {cls.__name__} {where}{value!r}; allowed: {allowed}"
            ) from None

    def __str__(self) -> str:  # "online", not "MTPMode.ONLINE"
        return self.value


class Phase(_StrEnum):
    """Where in an RL step a forward pass happens."""

    LOAD = "load"  # building the model / loading the checkpoint
    TRAIN = "train"  # actor update (forward + backward)
    LOGPROB = "logprob"  # actor log-prob recompute (forward only)
    REF = "ref"  # reference-policy log-probs
    SYNC = "sync"  # exporting weights to the rollout engine
    ROLLOUT = "rollout"  # generation; speculation belongs to the rollout engine


class MTPMode(_StrEnum):
    """What the user wants the MTP layers to do."""

    OFF = "off"  # MTP layers not built or loaded
    FROZEN = "frozen"  # loaded, checkpointed, synced to the drafter; never trained
    ONLINE = "online"  # MTP loss on rollout tokens, isolated from trunk/embedding/output
    JOINT = "joint"  # MTP loss also trains the trunk (library default; opt-in)


class MTPObjective(_StrEnum):
    """What the MTP block is trained to match in online and joint modes
    (``ray_kwargs.ray_init.runtime_env.env_vars.VERL_MTP_OBJECTIVE``; :mod:`verl_mtp_plugin.objective` has the math)."""

    HARD_CE = "hard_ce"  # Megatron's own cross-entropy on the sampled token (default)
    SOFT_CE = "soft_ce"  # forward KL to the policy's detached distribution at the rollout temperature
    TV = "tv"  # 1 - sum min(p, q): one minus the acceptance of probabilistic drafting
    CHAINED_TV = "chained_tv"  # 1 - prod_{i<=d} sum min(p_i, q_i): the chain of drafts vLLM accepts (end-to-end TV)


_N, _Y = False, True

#: (mode, phase) -> run_mtp_forward. Rollout is False everywhere: see module docstring.
RUN_MTP_FORWARD: dict[MTPMode, dict[Phase, bool]] = {
    #                load     train    logprob    ref     sync   rollout
    MTPMode.OFF: dict(zip(Phase, (_N, _N, _N, _N, _N, _N))),
    MTPMode.FROZEN: dict(zip(Phase, (_N, _N, _N, _N, _N, _N))),
    MTPMode.ONLINE: dict(zip(Phase, (_N, _Y, _N, _N, _N, _N))),
    MTPMode.JOINT: dict(zip(Phase, (_N, _Y, _N, _N, _N, _N))),
}


def run_mtp_forward(mode: "MTPMode | str", phase: "Phase | str") -> bool:
    """Whether the Megatron MTP forward (and its loss) runs for ``mode`` in ``phase``.

    Args:
        mode (MTPMode | str): ``off``, ``frozen``, ``online`` or ``joint``.
        phase (Phase | str): ``load``, ``train``, ``logprob``, ``ref``, ``sync`` or ``rollout``.

    Returns:
        bool: the value to pass as ``run_mtp_forward`` to :func:`verl_mtp_plugin.hybrid_forward`.

    Raises:
        MTPConfigError: unknown mode or phase string.
    """
    return RUN_MTP_FORWARD[MTPMode.parse(mode, "mode")][Phase.parse(phase, "phase")]


def trains_mtp(mode: "MTPMode | str") -> bool:
    """True when MTP parameters receive gradients (online, joint)."""
    return MTPMode.parse(mode, "mode") in (MTPMode.ONLINE, MTPMode.JOINT)


def trains_trunk_with_mtp(mode: "MTPMode | str") -> bool:
    """True when the MTP loss may reach the trunk, shared embedding and output layer (joint)."""
    return MTPMode.parse(mode, "mode") is MTPMode.JOINT


def rollout_may_speculate(mode: "MTPMode | str") -> bool:
    """True when the rollout engine may draft with the MTP block (every mode but off)."""
    return MTPMode.parse(mode, "mode") is not MTPMode.OFF


def mode_from_verl_mtp(enable: bool, enable_train: bool = False, detach_encoder: bool = False) -> MTPMode:
    """Map verl's ``actor_rollout_ref.model.mtp`` keys onto a mode.

    ``enable=false`` -> off; ``enable_train=false`` -> frozen; ``enable_train=true`` with
    ``detach_encoder=true`` -> online, with ``detach_encoder=false`` -> joint.

    Raises:
        MTPConfigError: ``enable_train=true`` while ``enable=false``.
    """
    if not enable:
        if enable_train:
            raise MTPConfigError(
                "actor_rollout_ref.model.mtp.enable_train=true needs "
                "actor_rollout_ref.model.mtp.enable=true (MTP layers are not built when enable=false)"
            )
        return MTPMode.OFF
    if not enable_train:
        return MTPMode.FROZEN
    return MTPMode.ONLINE if detach_encoder else MTPMode.JOINT


def format_table(modes=None) -> str:
    """The table as aligned text, for the CLI and the README."""
    modes = [MTPMode.parse(m, "mode") for m in (modes or list(MTPMode))]
    head = ["mode \\ phase"] + [p.value for p in Phase]
    rows = [head]
    for m in modes:
        cells = []
        for p in Phase:
            if p is Phase.ROLLOUT:
                cells.append("drafter" if rollout_may_speculate(m) else "-")
            else:
                cells.append("MTP" if RUN_MTP_FORWARD[m][p] else "skip")
        rows.append([m.value] + cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
