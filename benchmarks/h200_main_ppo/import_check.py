"""Pre-flight import check for ``run.py run``: imports every module that verl's trainer, its vLLM HTTP server,
the vLLM engine and the plugin load on the path the H200 runs take, and reports **all** missing modules at
once (a missing module otherwise surfaces one per device call, deep in a Ray actor).

Run it here against the staged tree before spending device time (a Python with only the image's packages plus
the staged site on ``PYTHONPATH``), and on the device at the start of each run call (``run.py run`` does, unless
``--no-import-check``)::

    python benchmarks/h200_main_ppo/import_check.py [--json OUT]

Exit status 0 when no module of :data:`MODULES` misses one; 1 with the list otherwise. Modules missing only
under the walked packages (:data:`WALK`: parsers for other model families, loaded on demand) are listed apart. Failures other than a missing module (an
``ImportError`` of a name, a CUDA-only extension on a machine without a GPU) are listed apart and do not fail
the check.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import time
import traceback

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "verl_h200_standins")

#: the modules the runs import (verl 0.9.1, vLLM 0.26, Megatron-Bridge 0.6.2, megatron-core 0.19.2), in the order
#: the processes meet them: driver, task runner, trainer workers, rollout server, engine core / GPU worker
MODULES = [
    "verl_h200_standins",
    "verl_mtp_plugin.main_ppo",
    "verl_mtp_plugin.trainer.main_ppo",
    "verl_mtp_plugin.trainer.v1",
    "verl.trainer.main_ppo",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.ray_trainer",
    "verl.trainer.ppo.v1.agent_loop_tq",
    "verl.workers.engine_workers",
    "verl.workers.engine.megatron.transformer_impl",
    "verl.workers.rollout.llm_server",
    "verl.workers.rollout.replica",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.vllm_rollout.utils",
    "verl.experimental.agent_loop",
    "verl.experimental.agent_loop.single_turn_agent_loop",
    "verl.experimental.reward_loop",
    "verl.utils.reward_score",
    "verl.checkpoint_engine",
    "transfer_queue",
    "megatron.bridge",
    "megatron.bridge.training.config",
    "megatron.bridge.models.nemotronh",
    "megatron.core.ssm.mamba_mixer",
    "megatron.core.models.hybrid.hybrid_model",
    "mamba_ssm.ops.triton.ssd_combined",
    "verl_mtp_cpu.bridge",
    "verl_mtp_cpu.mamba_triton",
    "verl_mtp_cpu.reward",
    "verl_mtp_plugin.rollout.worker_extension",
    "verl_h200_ext",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.spec_decode.mtp",
    "vllm.v1.spec_decode.eagle",
    "vllm.model_executor.models.nemotron_h",
    "vllm.model_executor.models.nemotron_h_mtp",
    "vllm.model_executor.model_loader.reload",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.mamba.mamba_mixer2",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.mamba2_attn",
    "vllm.compilation.backends",
    "ray.util.placement_group",
    "ray.util.scheduling_strategies",
]
#: packages whose every submodule is imported too (vLLM's HTTP server builds its routers from these)
WALK = ["vllm.entrypoints.openai", "vllm.entrypoints.serve", "vllm.entrypoints.chat_utils", "vllm.tokenizers",
        "vllm.reasoning", "vllm.tool_parsers", "verl.experimental.agent_loop"]


def _try(name: str, missing: dict, other: dict) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing.setdefault(e.name or str(e), []).append(name)
    except BaseException as e:  # noqa: BLE001 - a report, never fatal
        other[name] = f"{type(e).__name__}: {str(e)[:300]}"
        if os.environ.get("IMPORT_CHECK_TRACE"):
            traceback.print_exc()


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--no-walk", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.time()
    missing: dict[str, list[str]] = {}
    walk_missing: dict[str, list[str]] = {}
    other: dict[str, str] = {}
    try:  # what a trainer worker installs before it builds (the TE placeholder first of all)
        import verl_h200_standins

        verl_h200_standins.install_trainer_worker_standins()
    except BaseException as e:  # noqa: BLE001
        other["verl_h200_standins.install_trainer_worker_standins"] = f"{type(e).__name__}: {str(e)[:300]}"
    for m in MODULES:
        _try(m, missing, other)
    if not a.no_walk:
        for pkg in WALK:
            try:
                p = importlib.import_module(pkg)
            except BaseException:  # noqa: BLE001
                continue
            for info in pkgutil.walk_packages(getattr(p, "__path__", []), prefix=pkg + "."):
                if ".tests" in info.name or info.name.endswith("__main__"):
                    continue
                _try(info.name, walk_missing, other)
    report = {"missing": missing, "walk_missing": walk_missing, "other_errors": other, "seconds": round(time.time() - t0, 1),
              "python": sys.version.split()[0], "path": sys.path[:6]}
    for top, by in sorted(missing.items()):
        print(f"MISSING {top}: imported by {', '.join(by[:4])}{' ...' if len(by) > 4 else ''}")
    for top, by in sorted(walk_missing.items()):
        print(f"missing (walked submodules only, not on the run's path) {top}: {', '.join(by[:4])}")
    for m, err in sorted(other.items()):
        print(f"other   {m}: {err}")
    print(f"import check: {len(missing)} missing, {len(walk_missing)} missing under walked packages, {len(other)} other errors, {report['seconds']} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
