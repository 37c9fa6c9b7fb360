"""The pure phase -> run_mtp_forward table and the package's import boundaries."""

import json
import subprocess
import sys

import pytest

from verl_mtp_plugin import MTPConfigError, MTPMode, Phase, mode_from_verl_mtp, rollout_may_speculate, run_mtp_forward
from verl_mtp_plugin.policy import RUN_MTP_FORWARD, format_table, trains_mtp, trains_trunk_with_mtp


@pytest.mark.parametrize("mode", list(MTPMode))
def test_train_runs_mtp_only_for_online_and_joint(mode):
    assert run_mtp_forward(mode, Phase.TRAIN) is (mode in (MTPMode.ONLINE, MTPMode.JOINT))


@pytest.mark.parametrize("mode", list(MTPMode))
@pytest.mark.parametrize("phase", [Phase.LOAD, Phase.LOGPROB, Phase.REF, Phase.SYNC, Phase.ROLLOUT])
def test_every_other_phase_skips_the_megatron_mtp_forward(mode, phase):
    assert run_mtp_forward(mode, phase) is False


def test_table_covers_every_mode_and_phase_with_bools():
    assert set(RUN_MTP_FORWARD) == set(MTPMode)
    for row in RUN_MTP_FORWARD.values():
        assert set(row) == set(Phase)
        assert all(isinstance(v, bool) for v in row.values())


def test_strings_are_accepted_case_insensitively():
    assert run_mtp_forward("Online", "TRAIN") is True
    assert run_mtp_forward("frozen", "train") is False


@pytest.mark.parametrize("mode,phase,bad", [("onlin", "train", "onlin"), ("online", "training", "training")])
def test_unknown_strings_fail_naming_the_allowed_values(mode, phase, bad):
    with pytest.raises(MTPConfigError) as e:
        run_mtp_forward(mode, phase)
    msg = str(e.value)
    assert repr(bad) in msg and "allowed" in msg


def test_rollout_speculation_is_the_engines_and_off_has_none():
    assert [rollout_may_speculate(m) for m in MTPMode] == [False, True, True, True]
    assert trains_mtp("online") and trains_mtp("joint") and not trains_mtp("frozen")
    assert trains_trunk_with_mtp("joint") and not trains_trunk_with_mtp("online")


@pytest.mark.parametrize(
    "enable,enable_train,detach,mode",
    [
        (False, False, False, MTPMode.OFF),
        (False, False, True, MTPMode.OFF),
        (True, False, False, MTPMode.FROZEN),
        (True, False, True, MTPMode.FROZEN),
        (True, True, True, MTPMode.ONLINE),
        (True, True, False, MTPMode.JOINT),
    ],
)
def test_verl_mtp_keys_map_onto_modes(enable, enable_train, detach, mode):
    assert mode_from_verl_mtp(enable, enable_train, detach) is mode


def test_enable_train_without_enable_is_a_contradiction_naming_both_keys():
    with pytest.raises(MTPConfigError) as e:
        mode_from_verl_mtp(False, True, True)
    assert "mtp.enable_train" in str(e.value) and "mtp.enable=true" in str(e.value)


def test_formatted_table_matches_the_table():
    lines = format_table().splitlines()
    assert lines[0].split()[-6:] == [p.value for p in Phase]
    online = dict(zip([p.value for p in Phase], lines[3].split()[1:]))
    assert lines[3].split()[0] == "online" and online["train"] == "MTP" and online["logprob"] == "skip"


def _modules_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_policy_module_and_package_import_pull_in_no_heavy_library():
    heavy = ("torch", "megatron", "verl", "vllm")
    for code in ("import verl_mtp_plugin.policy", "import verl_mtp_plugin; verl_mtp_plugin.run_mtp_forward('online','train')"):
        mods = _modules_after(code)
        loaded = [m for m in mods if m.split(".")[0] in heavy]
        assert loaded == [], (code, loaded[:5])


def test_lazy_public_names_resolve():
    import verl_mtp_plugin

    assert callable(verl_mtp_plugin.hybrid_forward) and callable(verl_mtp_plugin.freeze_mtp)
    with pytest.raises(AttributeError):
        verl_mtp_plugin.no_such_name  # noqa: B018
