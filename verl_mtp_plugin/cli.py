"""``verl-mtp``: the plugin's command line.

Subcommands:
  demo     verl's own trainer runs the shipped recipes on a tiny Nemotron-H (CPU), online vs frozen
           (needs the CPU runtime: pip install ./cpu_runtime)
  phases   print the per-phase MTP table
  check    validate a verl recipe YAML and print the table it resolves to
  keys     print the HF MTP tensor names the export produces for an HF config.json
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["build_parser", "check_recipe_file", "main"]


def _cmd_phases(args) -> int:
    from verl_mtp_plugin.policy import format_table

    print(format_table([args.mode] if args.mode else None))
    return 0


#: what ``verl-mtp demo`` imports that the product does not install: the CPU runtime (``verl_mtp_cpu``, the
#: repository's second distribution ``verl-mtp-cpu`` in ``cpu_runtime/``) and the demo's own dependencies
DEMO_PACKAGES = ("verl_mtp_cpu", "matplotlib", "tqdm", "safetensors")
DEMO_INSTALL = "pip install ./cpu_runtime  (the distribution verl-mtp-cpu, from the repository)"


def _cmd_demo(args) -> int:
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ImportError:
            return True

    # all of them before anything starts (matplotlib is first imported after the runs, for the plot)
    missing = [m for m in DEMO_PACKAGES if absent(m)]
    if missing:
        print(f"verl-mtp demo: needs the CPU runtime and its dependencies (missing: {', '.join(missing)}): "
              f"{DEMO_INSTALL}", file=sys.stderr)
        return 1
    from verl_mtp_cpu.demo import main_cli

    return main_cli(args)


def check_recipe_file(path: str, overrides: list[str] | None = None, *, strict: bool = False) -> str:
    """Compose a recipe YAML on top of verl's config, validate it, and describe what it resolves to
    (settings that run but cost rollout speed or training memory first, as warnings).

    Raises:
        MTPConfigError: every problem found, each naming its keys (with ``strict``, the warnings too).
    """
    import dataclasses
    import os

    from verl_mtp_plugin.policy import format_table
    from verl_mtp_plugin.recipe_paths import CONFIG_DIR, resolve_path, shipped
    from verl_mtp_plugin.trainer.config import compose_recipe, startup_check

    # a relative path as main_ppo resolves one (verl/trainer's, the working directory's, else the installed
    # package's: the documented recipes/... path); a shipped recipe's name (grpo_online) when no such file is here
    path = resolve_path(path, directory=False)
    if shipped(os.path.basename(path)) and not os.path.isfile(path) and not os.path.isfile(path + ".yaml"):
        path = str(CONFIG_DIR / (os.path.basename(path).removesuffix(".yaml") + ".yaml"))
    path = os.path.abspath(path)
    name = os.path.basename(path)
    cfg = compose_recipe(os.path.dirname(path), name[:-5] if name.endswith(".yaml") else name, overrides)
    settings = startup_check(cfg)  # the check both training entry points run
    if strict and settings.warnings:
        from verl_mtp_plugin.policy import MTPConfigError

        raise MTPConfigError("settings that cost speed or memory (--strict):\n  - " + "\n  - ".join(settings.warnings))
    lines = [f"{path}: OK" + (f", {len(settings.warnings)} warning(s)" if settings.warnings else "")]
    lines += [f"WARNING: {w}" for w in settings.warnings]
    lines += ["", format_table([settings.mode]), ""]
    for f in dataclasses.fields(settings):
        if f.name not in ("run_mtp_forward", "warnings"):
            lines.append(f"{f.name}: {getattr(settings, f.name)}")
    return "\n".join(lines)


def _cmd_check(args) -> int:
    from verl_mtp_plugin.policy import MTPConfigError

    try:
        report = check_recipe_file(args.config, overrides=args.overrides, strict=args.strict)
    except MTPConfigError as e:
        print(f"{args.config}: INVALID\n{e}", file=sys.stderr)
        return 2
    print(report)
    return 0


def _cmd_keys(args) -> int:
    from verl_mtp_plugin.export import expected_hf_mtp_keys

    with open(args.hf_config) as f:
        cfg = json.load(f)
    keys = sorted(expected_hf_mtp_keys(cfg))
    for k in keys:
        print(k)
    print(f"# {len(keys)} MTP tensors", file=sys.stderr)
    return 0


def _demo_modes(text: str) -> str:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("off", "frozen", "online", "joint")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: modes are off, frozen, online, joint (comma-separated)")
    return ",".join(modes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-mtp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="verl's own trainer runs the shipped recipes on a tiny Nemotron-H (CPU)")
    d.add_argument("--mode", default="online,frozen", type=_demo_modes,
                   help="one mode or a comma list of off, frozen, online, joint (default: online,frozen)")
    d.add_argument("--steps", type=int, default=10,
                   help="training steps per mode (default 10); the online-vs-frozen story is checked (exit 2 when "
                        "broken) only when both modes run >= 6 steps (2 x demo.STORY_WINDOW); shorter runs check "
                        "that verl's trainer runs and the invariants hold")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    d.add_argument("--out", default="demo_out", help="directory for metrics.jsonl, demo.png and each run's log")
    d.add_argument("--no-progress", action="store_true",
                   help="show nothing while verl's trainer runs (no phases, step lines or bar); the table at the end "
                        "stays")
    d.add_argument("--sequential", action="store_true",
                   help="run the modes one after the other (default: side by side, each its own Ray cluster; "
                        "7-9 GiB of memory per run, measured; side by side only where that much is free)")
    d.add_argument("--break-sync", default="none", choices=["none", "skip-drafter", "swap-eh"],
                   help="break the drafter sync on purpose: the desync guard must stop the run (exit 2)")
    d.set_defaults(fn=_cmd_demo)

    t = sub.add_parser("phases", help="print the per-phase run_mtp_forward table")
    t.add_argument("--mode", choices=["off", "frozen", "online", "joint"])
    t.set_defaults(fn=_cmd_phases)

    c = sub.add_parser("check", help="validate a verl recipe YAML with the plugin's rules")
    c.add_argument("config", help="a recipe YAML (composed on top of verl's ppo_trainer), or a shipped recipe's name "
                                  "(grpo_online)")
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor_rollout_ref.model.mtp.enable=false")
    c.add_argument("--strict", action="store_true", help="refuse (exit 2) settings that only cost rollout speed")
    c.set_defaults(fn=_cmd_check)

    k = sub.add_parser("keys", help="print the HF MTP tensor names for an HF config.json")
    k.add_argument("--hf-config", required=True)
    k.set_defaults(fn=_cmd_keys)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
