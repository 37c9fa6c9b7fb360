"""``python -m verl_mtp_cpu``: build the assets, or run a recipe through verl's real
trainer on CPU.

    python -m verl_mtp_cpu assets DIR [--mamba-num-groups 2] [--moe]
    python -m verl_mtp_cpu run grpo_online WORKDIR [--entry verl] [--steps 2]
        [--resume] [--reward zero_score] [--break-sync swap-eh] [--tp 2] [--ep 2] [--drafter-dump]
        [-- HYDRA_OVERRIDES...]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_mtp_cpu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assets", help="build the tiny checkpoint, tokenizer and data")
    a.add_argument("root")
    a.add_argument("--mamba-num-groups", type=int, default=1,
                   help="Mamba B/C groups (2 for a run at tensor-parallel size 2)")
    a.add_argument("--moe", action="store_true", help="the MoE model (trunk MoE layer, MTP block *E)")
    r = sub.add_parser("run", help="run a recipe")
    r.add_argument("recipe")
    r.add_argument("workdir")
    r.add_argument("--entry", default="plugin", choices=["plugin", "verl"])
    r.add_argument("--steps", type=int, default=2)
    r.add_argument("--resume", action="store_true")
    r.add_argument("--reward", default="compute_score")
    r.add_argument("--break-sync", default="none")
    r.add_argument("--timeout", type=float, default=600.0)
    r.add_argument("--echo", action="store_true")
    r.add_argument("--tp", type=int, default=1, help="ranks: Megatron TP (+SP) and vLLM TP")
    r.add_argument("--ep", type=int, default=1, help="expert parallelism: Megatron EP (ETP=1) and vLLM EP")
    r.add_argument("--drafter-dump", action="store_true")
    r.add_argument("overrides", nargs="*", help="Hydra overrides (key=value), before the options or after --")
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``run RECIPE WORKDIR [options] -- OVERRIDES``: argparse does not give a positional list back once options
    # followed it, so what follows ``--`` is taken here
    cut = argv.index("--") if "--" in argv else len(argv)
    args, after = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if after:
        if args.cmd != "run":
            ap.error("overrides after -- are for the run command")
        args.overrides = [*args.overrides, *after]
    if args.cmd == "assets":
        from verl_mtp_cpu.assets import build_assets

        assets = build_assets(args.root, mamba_num_groups=args.mamba_num_groups, moe=args.moe)
        print(json.dumps({"root": str(assets.root), **assets.info()}))
        return 0
    from verl_mtp_cpu.harness import run_recipe

    res = run_recipe(args.recipe, args.workdir, entry=args.entry, steps=args.steps, resume=args.resume,
                     reward=args.reward, break_sync=args.break_sync, extra_overrides=args.overrides,
                     timeout_s=args.timeout, echo=args.echo, tp=args.tp, ep=args.ep, drafter_dump=args.drafter_dump)
    print(json.dumps({"rc": res.rc, "wall_s": round(res.wall_s, 1), "stopped": res.stopped, "log": str(res.log_path),
                      "steps": sorted(res.metrics), "checkpoints": {k: str(v) for k, v in res.checkpoints.items()}}))
    if not res.ok:
        print(res.describe_failure(), file=sys.stderr)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
