"""The suite's runs of verl's trainer, started together at the beginning of the session and read by the tests.

A run of verl's trainer on 2 cores is mostly start-up and waiting between processes (Ray, the task runner, the
workers, vLLM's three processes): one run keeps about one core busy. So the runs the collected tests need start
in the background as soon as the session starts, as many at a time as the memory holds (:func:`slots`; the demo
counts two: it runs online and frozen side by side), while the rest of the suite runs in the foreground (conftest orders the tests
that read runs last). Ray runs its workers at nice 15, so the foreground tests keep their cores.

Every run is still one real start of verl's trainer (``python -m verl_mtp_plugin.main_ppo`` or ``python -m
verl.trainer.main_ppo``) with real vLLM generation; a test asks for a run by name (:meth:`Runs.result`) and
fails with the run's own error if it failed.

The runs (what each carries is in ``tests/test_main_ppo.py``'s docstring):

* ``assets``: the demo's tiny checkpoint, tokenizer and data (built once; every run starts from them);
* ``demo``: ``python -m verl_mtp_plugin demo --out DIR`` as a user runs it (grpo_online and grpo_frozen, 10 steps);
* ``online_resumed`` / ``frozen_resumed``: verl's entry / the plugin's entry resume the demo's runs (the frozen one in
  mode online, from the checkpoint's weights, for :data:`FROZEN_RESUMED_STEPS` steps of verl's colocated
  asynchronous trainer, ``mtp_colocate_async``);
* ``joint``, ``ppo_online``: the other recipes, 2 steps each (``joint`` with packed THD sequences);
* ``assets_tp2``: the same checkpoint built with 2 Mamba groups (megatron splits them over TP ranks);
* ``assets_moe``: the MoE checkpoint (a trunk MoE layer and the MTP block ``*E``, as Nemotron 3 Super's), 2 Mamba
  groups;
* ``online_tp2`` (grpo_online on the MoE checkpoint, 3 steps; Megatron TP=2 + SP + EP=2 with ETP=1, vLLM TP=2 +
  EP=2) and ``ppo_frozen`` (2 steps, dense; Megatron TP=2 + SP, vLLM TP=2): on 2 ranks
  (``tests/test_main_ppo_tp2.py``); each takes :data:`TP2_SLOTS` slots (its measured memory, see there);
* ``online_dp2`` (grpo_online, 2 steps, data parallelism 2: two Megatron ranks with half the batch each, two vLLM
  replicas; ``tests/test_main_ppo_dp2.py``): :data:`TP2_SLOTS` slots.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

# bound once, when the session's runs start: a test that monkeypatches the CPU runtime's functions (the demo's and
# the CLI's tests stand in for run_recipe) must not reach the runs going on in the background meanwhile
from verl_mtp_cpu.harness import ensure_assets, private_tmp_prefix, run_recipe

from verl_mtp_plugin.config_keys import OBJECTIVE_CONFIG_KEY

NO_KL = "actor_rollout_ref.actor.use_kl_loss=false"
GUARD_FAIL = ("verl_mtp_plugin.mtp_guard.action=fail", "verl_mtp_plugin.mtp_guard.patience=1")
#: packed (THD) sequences with verl's bucket padding in the actor and reference engines (the harness's default is
#: padded BSHD); the joint run trains with them
PACKED = (
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.megatron.pad_to_length=true",
    "actor_rollout_ref.actor.megatron.pad_to_length_bucket=64",
)
#: the seed the demo runs with by default (the demo run passes none)
DEMO_SEED = 0
#: the resumed online run trains the MTP block with a non-default objective (the demo's run used hard_ce)
RESUMED_OBJECTIVE = "tv"
#: wall-clock limit of the demo (both modes, side by side); a run past it is a hang
DEMO_TIMEOUT_S = 2400
#: wall-clock limit of one 2-step run of verl's trainer while others share the cores; past it, a hang
RUN_TIMEOUT_S = 1500
#: steps of the 2-rank online run; its weight update N+1 (after the last step) fails on vLLM rank 1
TP2_STEPS = 3
TP2_FAIL_UPDATE = TP2_STEPS + 1


def _tp2_slots() -> int:
    """Slots a 2-rank run takes: its measured memory in units of a 1-rank run's (2 on the 8 GiB budget: like the
    demo, it runs beside no other run of verl's trainer on a 24 GiB machine)."""
    import math

    from verl_mtp_cpu.harness import RUN_MEMORY_GIB, RUN_MEMORY_GIB_TP2

    return math.ceil(RUN_MEMORY_GIB_TP2 / RUN_MEMORY_GIB)


#: slots a 2-rank run takes (see :func:`slots`)
TP2_SLOTS = _tp2_slots()
#: memory kept for the foreground tests (the pytest process, its in-process vLLM engines and Megatron models)
FOREGROUND_GIB = 5.0


def slots() -> int:
    """Runs of verl's trainer at once (the demo's two modes count two): as many as the available memory holds
    beside the foreground tests (2 on a 24 GiB machine); ``VERL_MTP_TEST_TRAINER_SLOTS`` overrides it."""
    if os.environ.get("VERL_MTP_TEST_TRAINER_SLOTS"):
        return max(1, int(os.environ["VERL_MTP_TEST_TRAINER_SLOTS"]))
    from verl_mtp_cpu.harness import runs_side_by_side

    return runs_side_by_side(reserve_gib=FOREGROUND_GIB)


#: the environment every run starts from: this process's when the session starts (tests change os.environ while
#: the runs start in other threads)
ENV: dict[str, str] = {}


def _demo(root: pathlib.Path, deps) -> SimpleNamespace:
    out = root / "demo"
    env = dict(ENV, VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, "-m", "verl_mtp_plugin", "demo", "--out", str(out)]
    if RUNS["demo"][2] < 2:
        cmd.append("--sequential")  # one slot: the demo's modes one after the other
    t0 = time.perf_counter()
    with open(root / "demo.stdout", "w") as so, open(root / "demo.stderr", "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, env=env, start_new_session=True)
        _PROCS.append(proc)
        try:
            proc.wait(timeout=DEMO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop_demo(proc)
        finally:
            _PROCS.remove(proc)
    return SimpleNamespace(out=out, rc=proc.returncode, stdout=(root / "demo.stdout").read_text(),
                           stderr=(root / "demo.stderr").read_text(), cmd=cmd, wall_s=time.perf_counter() - t0)


def _stop_demo(proc: subprocess.Popen) -> None:
    """The demo stops the runs of verl's trainer it has in flight on SIGTERM; SIGKILL to its group after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def demo_result(demo, mode: str):
    """The demo's run of ``mode`` (checked: exited 0)."""
    from verl_mtp_cpu.demo import mode_overrides
    from verl_mtp_cpu import load_result

    recipe, _ = mode_overrides(mode, seed=DEMO_SEED)
    for path in sorted((demo.out / mode).glob(f"{recipe}.plugin.step*.result.json")):
        if ".resume." in path.name:
            continue
        steps = int(path.name.split(".step")[1].split(".")[0])
        return load_result(demo.out / mode, recipe, steps=steps).check()
    raise AssertionError(f"the demo left no {mode} run in {demo.out} (rc {demo.rc}):\n{demo.stderr[-3000:]}")


def _assets(root: pathlib.Path, deps):
    return ensure_assets(root / "demo" / "assets", base_env=ENV)  # where the demo looks for them (and reuses them)


def _assets_tp2(root: pathlib.Path, deps):
    """The demo's checkpoint built with 2 Mamba groups (megatron splits them over TP ranks): same names."""
    return ensure_assets(root / "assets_tp2", base_env=ENV, mamba_num_groups=2)


def _assets_moe(root: pathlib.Path, deps):
    """The MoE checkpoint (trunk MoE layer, MTP block ``*E``) with 2 Mamba groups, for the run with expert
    parallelism."""
    return ensure_assets(root / "assets_moe", base_env=ENV, mamba_num_groups=2, moe=True)


def _run(recipe, workdir, assets, **kwargs):
    # runs side by side each get a /tmp of their own (verl's weight-transfer socket is named after the Ray job id,
    # the same in every fresh cluster: harness.private_tmp_prefix); without one, slots() is 1
    return run_recipe(recipe, workdir, assets=assets, timeout_s=RUN_TIMEOUT_S, base_env=ENV,
                      private_tmp=private_tmp_prefix() is not None, **kwargs)


def _online_resumed(root, deps):
    from verl_mtp_cpu.demo import mode_overrides

    online = demo_result(deps["demo"], "online")
    recipe, extra = mode_overrides("online", seed=DEMO_SEED)
    return _run(recipe, online.workdir, deps["assets"], entry="verl", steps=max(online.metrics) + 2, resume=True,
                reward="zero_score", break_sync="swap-eh@2",
                extra_overrides=[*extra, NO_KL, "trainer.save_freq=1", *GUARD_FAIL, f"{OBJECTIVE_CONFIG_KEY}={RESUMED_OBJECTIVE}"])


#: a resume in another MTP mode loads the weights only (the optimizer state of a frozen run holds no MTP block)
MODEL_ONLY = "actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]"


#: the frozen run resumed online runs verl's colocated asynchronous trainer (the plugin's mode)
COLOCATE_ASYNC = "trainer.v1.trainer_mode=mtp_colocate_async"
#: its steps: the first trains on rollouts of the checkpoint's weights, the later ones on rollouts of weights the run
#: trained and synced (the async trainer's first two batches, the warm-up's and step 1's, both start under the
#: checkpoint's weights)
FROZEN_RESUMED_STEPS = 5


def _frozen_resumed(root, deps):
    """The demo's frozen run resumed in mode online (grpo_online) from its checkpoint's weights, in verl's colocated
    asynchronous trainer (``mtp_colocate_async``), a checkpoint every step, the drafter written after each update."""
    from verl_mtp_cpu.demo import mode_overrides

    frozen = demo_result(deps["demo"], "frozen")
    recipe, extra = mode_overrides("online", seed=DEMO_SEED)
    return _run(recipe, frozen.workdir, deps["assets"], steps=max(frozen.metrics) + FROZEN_RESUMED_STEPS, resume=True,
                drafter_dump=True, extra_overrides=[*extra, MODEL_ONLY, COLOCATE_ASYNC, "trainer.save_freq=1"],
                check=True)


def _joint(root, deps):
    return _run("grpo_joint", root / "joint", deps["assets"], steps=2, reward="zero_score",
                extra_overrides=[NO_KL, *PACKED], check=True)


def _ppo(recipe, tp=1):
    def run(root, deps):
        if tp == 1:
            return _run(recipe, root / recipe, deps["assets"], steps=2, check=True)
        return _run(recipe, root / recipe, deps["assets_tp2"], steps=2, check=True, tp=tp, drafter_dump=True)

    return run


def _online_tp2(root, deps):
    """grpo_online on 2 ranks with the MoE checkpoint, as the recipes parallelize it (Megatron TP=2 + SP + EP=2
    with ETP=1; vLLM TP=2 + EP=2), zero advantages and no KL loss (the MTP loss is the only loss with a gradient),
    a checkpoint every step, every rank's drafter written after each update; the drafter load fails on vLLM rank 1
    only at the update after the last step (:data:`TP2_FAIL_UPDATE`)."""
    return _run("grpo_online", root / "online_tp2", deps["assets_moe"], steps=TP2_STEPS, reward="zero_score",
                break_sync=f"truncate-eh-rank1@{TP2_FAIL_UPDATE}", tp=2, ep=2, drafter_dump=True,
                extra_overrides=[NO_KL, "trainer.save_freq=1"])


#: steps of the data-parallel run, and its prompts per step (each of its 2 ranks trains on half)
DP2_STEPS = 2
DP2_PROMPTS = 4


def _online_dp2(root, deps):
    """grpo_online with data parallelism 2 (Megatron DP=2, two vLLM replicas of TP=1), zero advantages and no KL
    loss, a checkpoint every step, every replica's drafter written after each update."""
    return _run("grpo_online", root / "online_dp2", deps["assets"], steps=DP2_STEPS, reward="zero_score", dp=2,
                drafter_dump=True, extra_overrides=[NO_KL, "trainer.save_freq=1", f"data.train_batch_size={DP2_PROMPTS}",
                                                    f"actor_rollout_ref.actor.ppo_mini_batch_size={DP2_PROMPTS}"])


#: name -> (function(root, deps), dependencies, slots it takes); in priority order (the longest chain first)
RUNS = {
    "assets": (_assets, (), 1),
    "demo": (_demo, ("assets",), 2),
    "online_resumed": (_online_resumed, ("demo", "assets"), 1),
    "frozen_resumed": (_frozen_resumed, ("demo", "assets"), 1),
    "joint": (_joint, ("assets",), 1),
    "ppo_online": (_ppo("ppo_online"), ("assets",), 1),
    # a model build (~1 GiB, well under a slot): built beside the demo, once the demo's own assets are done (so that
    # the demo, first in the longest chain, gets both slots as soon as they are)
    "assets_tp2": (_assets_tp2, ("assets",), 0),
    # after assets_tp2, not beside it: two model builds at once beside the demo's two Ray start-ups overloaded 2 cores
    # (the demo's online run once timed out starting Ray)
    "assets_moe": (_assets_moe, ("assets_tp2",), 0),
    "online_tp2": (_online_tp2, ("assets_moe",), TP2_SLOTS),
    "ppo_frozen": (_ppo("ppo_frozen", tp=2), ("assets_tp2",), TP2_SLOTS),
    "online_dp2": (_online_dp2, ("assets",), TP2_SLOTS),
}

def load_safetensors(folder: pathlib.Path) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (a saved step's HF model folder), as stored."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no safetensors in {folder}"
    return out


#: the demo processes in flight (stopped at the session's end)
_PROCS: list[subprocess.Popen] = []


def closure(names) -> list[str]:
    """``names`` and every run they depend on, in :data:`RUNS` order."""
    need, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(RUNS[n][1])
    return [n for n in RUNS if n in need]


class Runs:
    """Starts the runs in :data:`RUNS` order as their dependencies finish and slots free up (one scheduler
    thread), and hands each test the result it asks for."""

    def __init__(self, root: pathlib.Path, names, n_slots: int | None = None):
        ENV.clear()
        ENV.update(os.environ)
        self.root = pathlib.Path(root)
        self.names = closure(names)
        self.slots = slots() if n_slots is None else n_slots
        for name, (fn, deps, cost) in list(RUNS.items()):
            if cost > self.slots:  # one slot: the demo's modes one after the other, a 2-rank run on its own
                RUNS[name] = (fn, deps, self.slots)
        self.done: dict[str, tuple[bool, object]] = {}
        self.started: dict[str, float] = {}
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._schedule, name="trainer-runs", daemon=True)
        self.thread.start()

    def _schedule(self) -> None:
        busy = 0
        with self.cv:
            while len(self.done) < len(self.names):
                for name in self.names:
                    fn, deps, cost = RUNS[name]
                    if name in self.started or not all(d in self.done for d in deps) or busy + cost > self.slots:
                        continue
                    failed = {d: self.done[d][1] for d in deps if not self.done[d][0]}
                    self.started[name] = time.perf_counter()
                    if failed:
                        why = "; ".join(f"{d}: {type(e).__name__}: {str(e)[-2000:]}" for d, e in failed.items())
                        self.done[name] = (False, RuntimeError(f"run {name!r} not started: {why}"))
                        continue
                    busy += cost
                    args = {d: self.done[d][1] for d in deps}
                    threading.Thread(target=self._one, args=(name, fn, args, cost), name=f"run-{name}",
                                     daemon=True).start()
                self.cv.wait(timeout=5.0)
                busy = sum(RUNS[n][2] for n in self.started if n not in self.done)

    def _one(self, name, fn, deps, cost) -> None:
        try:
            outcome = (True, fn(self.root, deps))
        except BaseException as e:  # noqa: BLE001 - handed to the test that asks
            outcome = (False, e)
        with self.cv:
            self.done[name] = outcome
            self.cv.notify_all()

    def result(self, name: str, timeout: float | None = None):
        """The run's result; its exception if it failed (or a dependency did)."""
        if name not in self.names:
            raise KeyError(f"run {name!r} was not scheduled (collected tests did not ask for it)")
        with self.cv:
            if not self.cv.wait_for(lambda: name in self.done, timeout=timeout):
                raise TimeoutError(f"run {name!r} did not finish in {timeout} s")
            ok, value = self.done[name]
        if not ok:
            raise value
        return value

    def walls(self) -> dict[str, float]:
        """Wall seconds of each finished run, from its start (for the suite's report)."""
        return {n: round(getattr(v, "wall_s", 0.0), 1) for n, (ok, v) in self.done.items() if ok}

    def stop(self) -> None:
        """Stop every run still in flight (the session is over)."""
        from verl_mtp_cpu.harness import stop_active_runs

        for proc in list(_PROCS):
            _stop_demo(proc)
        stop_active_runs()
