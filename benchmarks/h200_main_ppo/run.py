"""verl 0.9.1's real trainer on GPUs: ``python -m verl_mtp_plugin.main_ppo`` with the shipped recipes
(``grpo_online``, ``grpo_frozen``, and mode off = ``grpo_online`` with ``mtp.enable=false``), sizes
overridden, on a small Nemotron-H with Mamba, attention, MoE and an MTP block ``*E`` (real, warmed-up
weights), vLLM on the V2 model runner with CUDA graphs and sleep mode (``free_cache_engine: true``),
colocated (``trainer.v1.trainer_mode=mtp_sync``, the recipes' own).

Sub-commands (``table``, ``plot`` and ``compare`` read the ``summary.json`` files ``run`` writes: the per-step
markdown tables, the modes' picture, and the modes' last steps side by side with each done-criterion judged):

* ``assets DIR`` (any machine; CPU is fine, ~1-2 min): the tiny MoE checkpoint + tokenizer + parquet files,
  built from the CPU harness's pieces (:mod:`verl_mtp_cpu.assets`: its tokenizer,
  count-on task and reward) with a longer answer, so a rollout has enough decode steps to time.
* ``run`` (the GPU machine): one ``main_ppo`` run per ``--modes`` entry (``online``, ``frozen``, ``off``,
  ``break``: ``grpo_online`` with the drafter sync broken on purpose, ``swap-eh``, and
  ``verl_mtp_plugin.mtp_guard.action=fail``), each through the CPU harness's run loop
  (:func:`verl_mtp_cpu.harness.run_trainer`: its own process group, wall-clock and silence limits); after
  each run ``<out>/summary.json`` is rewritten (per-step metrics from verl's file logger, the vLLM worker
  extension's per-update events, the table of :func:`step_table`), so a cut call keeps what finished.

What the overrides change, and why (everything else is the recipe's):

* sizes: model path, data, batch (``--prompts`` x ``rollout.n``), prompt/response lengths, parallelism
  (``--tp``/``--ep``/``--gpus``; the recipe's 64-GPU layout cannot run on one GPU), vLLM memory share,
  ``max_num_seqs`` and the CUDA-graph ceiling ``max_seqs x (k+1)``, step count, Ray's logical CPUs and
  worker counts, no checkpoint save (Megatron-Bridge's HF save imports ``modelopt``, not carried),
  no recompute (the model is tiny); on an 80 GB card ``--tokens-per-gpu`` (the recipe's tokens per update
  micro-batch, the log-prob passes twice that, as the recipe sets them: 18,432 / 36,864);
* forced by the image (no Transformer Engine, no apex, no ``causal_conv1d``): ``attention_backend=local``,
  the CPU harness's fusion/kernel choices (``verl_mtp_cpu.bridge.CPU_PROVIDER_OVERRIDES``; the
  MoE dispatcher ``allgather`` is the combination those runs proved), ``use_mamba_mem_eff_path=false``
  (megatron's fused Mamba path needs ``causal_conv1d``), ``model.use_remove_padding=false`` (packed THD
  sequences need TE attention), the stand-ins of ``pythonpath/verl_h200_standins.py``;
* benchmark instruments: the worker extension ``pythonpath/verl_h200_ext.py`` (the plugin's, plus
  per-update digests/bytes/time and the break switch), verl's file logger, the guard judging every step
  (``mtp_guard.min_drafts=1``), a learnable reward (the CPU harness's ``compute_score``).

Staging and the exact device calls: ``benchmarks/h200_main_ppo/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
# the product, its CPU runtime (verl_mtp_cpu), the benchmarks' shared task module (task.py) and proc_cpu.py
for _p in (str(REPO), str(REPO / "cpu_runtime"), str(REPO / "benchmarks"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from proc_cpu import step_range  # noqa: E402
from task import task_rows  # noqa: E402
from verl_mtp_cpu.events import ENV_BREAK_SYNC  # noqa: E402
from verl_mtp_cpu.harness import RECIPE_DIR, provider_overrides, run_trainer  # noqa: E402
from verl_mtp_plugin.rollout.request import LEAN_LINE  # noqa: E402

#: the start of the line the plugin's vLLM server prints once (its requests without detokenization)
LEAN_MARK = LEAN_LINE.split(" (")[0]

PYTHONPATH_DIR = HERE / "pythonpath"
EXTENSION = "verl_h200_ext.H200MTPColocateWorkerExtension"

#: mode -> (recipe, extra overrides, break switch)
MODES = {
    "online": ("grpo_online", [], "none"),
    "frozen": ("grpo_frozen", [], "none"),
    "off": ("grpo_online", ["actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.enable_train=false",
                            "actor_rollout_ref.model.mtp.enable_rollout=false",
                            # the recipes' drafting method only tunes verl's speculation: mode off drops it
                            "~actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"], "none"),
    "break": ("grpo_online", ["verl_mtp_plugin.mtp_guard.action=fail", "verl_mtp_plugin.mtp_guard.patience=1"],
              "swap-eh"),
    # grpo_online for --steps healthy steps, then one more whose drafter sync is broken (swap-eh from that
    # step's weight update on); the guard set to fail must stop verl's trainer there and nowhere before
    "online-break": ("grpo_online", ["verl_mtp_plugin.mtp_guard.action=fail",
                                     "verl_mtp_plugin.mtp_guard.patience=1"], "swap-eh@{last}"),
}
FATAL = (
    re.compile(r"Error executing job with overrides"),
    re.compile(r"MTPDesyncError|MTPSyncError|MTPConfigError"),
    re.compile(r"RayTaskError|ActorDiedError|RaySystemError"),
)
GRACE_S = 40.0

# -------------------------------------------------------------------------------------------- assets

#: the GPU model: Nemotron-3-like layer types (Mamba M, MoE E, attention *), MTP block "*E" as in Super;
#: attention head_dim 64 (FlashAttention 3 sizes), Mamba head_dim 64; 2 Mamba groups, 2 query groups and 4 experts
#: so that TP=2 / EP=2 runs build the same checkpoint
SPEC = dict(pattern="MEM*EME/*E", vocab_size=64, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
            num_query_groups=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=128,
            moe_shared_expert_intermediate_size=128, moe_latent_size=None, mamba_head_dim=64, mamba_state_dim=64,
            mamba_num_groups=2, max_sequence_length=256, mtp_loss_scaling_factor=0.3)


def build_assets(root: pathlib.Path, *, answer_len: int, warmup_steps: int, lr: float, seed: int = 0,
                 train_rows: int = 512, device: str = "cpu") -> dict:
    if device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import pandas as pd
    import torch

    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.metrics import reset_mtp_metrics
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid, causal_mask, init_megatron
    from verl_mtp_cpu.assets import demo_tokenizer
    from verl_mtp_cpu.vllm_engine import write_model_dir

    init_megatron(seed=seed)
    spec = TinyHybridSpec(**SPEC)
    tok = demo_tokenizer(spec.vocab_size)
    torch.manual_seed(seed)
    model = build_tiny_hybrid(spec, device=device)  # on CUDA: mamba_ssm's Triton kernels (bare package)
    rows = task_rows(512, "warmup", seed + 1, answer_len)
    seqs = []
    for r in rows:
        p = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        p = p["input_ids"] if hasattr(p, "keys") else p
        seqs.append(list(p) + tok.convert_tokens_to_ids(r["reward_model"]["ground_truth"].split()))
    ids_all = torch.tensor(seqs, device=device)
    prompt_len = ids_all.shape[1] - answer_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator(device=device).manual_seed(seed)
    t0, losses = time.time(), []
    for step in range(warmup_steps):
        ids = ids_all[torch.randint(0, len(seqs), (32,), generator=g, device=device)]
        b, s = ids.shape
        loss_mask = torch.zeros(b, s, device=device)
        loss_mask[:, prompt_len:] = 1.0
        pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()
        opt.zero_grad(set_to_none=True)
        logits = hybrid_forward(model, ids, pos, causal_mask(s, device=device), run_mtp_forward=True,
                                loss_mask=loss_mask)
        logp = torch.log_softmax(logits.float(), dim=-1)[:, prompt_len - 1 : s - 1]
        loss = -logp.gather(-1, ids[:, prompt_len:, None]).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == warmup_steps - 1:
            print(f"warm-up step {step}: loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)", flush=True)
    reset_mtp_metrics()
    write_model_dir(root / "model", spec, model=model, dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    tok.save_pretrained(str(root / "model"))
    (root / "data").mkdir(parents=True, exist_ok=True)
    pd.DataFrame(task_rows(train_rows, "train", seed, answer_len)).to_parquet(root / "data" / "train.parquet")
    pd.DataFrame(task_rows(8, "test", seed + 7, answer_len)).to_parquet(root / "data" / "val.parquet")
    info = {"spec": {k: str(v) for k, v in dataclasses.asdict(spec).items()}, "answer_len": answer_len,
            "prompt_len": prompt_len, "warmup_steps": warmup_steps, "lr": lr, "loss_first": losses[0],
            "loss_last": losses[-1], "seconds": time.time() - t0, "device": device}
    (root / "assets.json").write_text(json.dumps(info, indent=1))
    return info


# -------------------------------------------------------------------------------------------- runs


RECIPE_K = 2  # the recipe's num_speculative_tokens and mtp_num_layers (super_mtp_common.yaml)


def overrides(recipe: str, assets: pathlib.Path, workdir: pathlib.Path, a) -> list[str]:
    """Hydra overrides for one run: sizes, what the image forces, instruments (module docstring)."""
    info = json.loads((assets / "assets.json").read_text())
    resp = int(info["answer_len"])
    k = int(getattr(a, "k", None) or RECIPE_K)
    seqs = a.prompts * a.n
    ar = "actor_rollout_ref"
    otc = f"{ar}.actor.megatron.override_transformer_config"
    te = getattr(a, "stack", "standins") == "te"
    resp = int(getattr(a, "response_len", 0) or resp)
    plen = 16
    reward = pathlib.Path(a.reward).resolve() if getattr(a, "reward", None) else REPO / "cpu_runtime/verl_mtp_cpu/reward.py"
    out = [
        f"{ar}.model.path={assets / 'model'}",
        f"data.train_files={assets / 'data' / 'train.parquet'}",
        f"data.val_files={assets / 'data' / 'val.parquet'}",
        f"data.train_batch_size={a.prompts}",
        f"data.max_prompt_length={plen}",
        f"data.max_response_length={resp}",
        "data.dataloader_num_workers=0",
        f"data.seed={a.seed}",
        f"{ar}.rollout.n={a.n}",
        f"{ar}.actor.ppo_mini_batch_size={a.prompts}",
        f"{ar}.actor.optim.lr={a.lr}",
        # parallelism (sizes)
        f"{ar}.actor.megatron.tensor_model_parallel_size={a.tp}",
        f"{ar}.actor.megatron.expert_model_parallel_size={a.ep}",
        f"{ar}.actor.megatron.sequence_parallel={'true' if a.tp > 1 else 'false'}",
        f"{ar}.rollout.tensor_model_parallel_size={a.rollout_tp}",
        f"{ar}.rollout.expert_parallel_size={a.rollout_ep}",
        # vLLM sizes
        f"actor_rollout_ref.rollout.max_model_len={plen + resp if te else 64}",
        f"{ar}.rollout.max_num_seqs={seqs}",
        f"{ar}.rollout.gpu_memory_utilization={a.gpu_mem}",
        f"{ar}.rollout.engine_kwargs.vllm.compilation_config.max_cudagraph_capture_size={seqs * (k + 1)}",
        f"{ar}.rollout.engine_kwargs.vllm.worker_extension_cls={EXTENSION}",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={a.gpus}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={a.steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        "trainer.resume_mode=disable",
        "ray_kwargs.ray_init.num_cpus=32",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "+verl_mtp_plugin.mtp_guard.min_drafts=1",
    ]
    # verl's host-side workers (its defaults unless asked): the rollout's agent loops, the reward loop, the
    # TransferQueue's storage units; each response's reward call and puts run on an agent loop after vLLM's last step
    for name, value in (("agent", a.agent_workers), ("reward", a.reward_workers), ("storage", a.storage_units)):
        if value is not None:
            out.append(f"{HOST_WORKER_KEYS[name]}={value}")
    if not te:
        out += [
            # forced: packed (THD) sequences need TE attention (megatron's local attention asserts on them)
            f"{ar}.model.use_remove_padding=false",
            # forced: no Transformer Engine (attention), no causal_conv1d (Mamba's fused path)
            f"{otc}.attention_backend=local",
            f"+{otc}.use_mamba_mem_eff_path=false",
            # tiny model: no activation recompute
            f"{otc}.recompute_granularity=null",
            f"{otc}.recompute_method=null",
            f"{otc}.recompute_num_layers=null",
            f"{ar}.rollout.max_num_batched_tokens={max(2048, seqs * 16)}",
        ]
    if a.tp > 1 or a.ep > 1:
        out.append(f"{ar}.ref.megatron.tensor_model_parallel_size={a.tp}")
        out.append(f"{ar}.ref.megatron.expert_model_parallel_size={a.ep}")
    if getattr(a, "tokens_per_gpu", None):
        # the reference's log-prob pass follows the actor's value (verl's ref.yaml); the old log-probs' the rollout's
        out += [f"{ar}.actor.ppo_max_token_len_per_gpu={a.tokens_per_gpu}",
                f"{ar}.rollout.log_prob_max_token_len_per_gpu={2 * a.tokens_per_gpu}"]
    if a.no_offload:
        out += [f"{ar}.actor.megatron.param_offload=false", f"{ar}.actor.megatron.optimizer_offload=false",
                f"{ar}.ref.megatron.param_offload=false"]
    if not te:
        out += provider_overrides(otc)
    if k != RECIPE_K:
        # drafts past the trained depth come from an untrained head (the start-up check refuses that for online):
        # vLLM's k and the MTP depths Megatron trains move together
        out += [f"{ar}.model.mtp.num_speculative_tokens={k}", f"{otc}.mtp_num_layers={k}"]
    return out + list(a.override or [])


def run_env() -> dict:
    """The environment of every run (and of the import check): the stand-ins module, vLLM's V2 runner, NVLink
    multicast off, offline Hugging Face, the benchmark's ``pythonpath`` and this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update({
        "VERL_USE_EXTERNAL_MODULES": "verl_h200_standins",
        "VERL_H200_STACK": os.environ.get("VERL_H200_STACK", "standins"),
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
        "TRITON_CACHE_AUTOTUNING": "1",
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PYTHONPATH_DIR), str(REPO), str(REPO / "cpu_runtime"),
                                                    os.environ.get("PYTHONPATH")])),
    })
    if env.get("VERL_H200_STACK") == "te":
        # verl sets VLLM_DISABLE_COMPILE_CACHE=1 unless the launching shell sets it (verl/trainer/constants_ppo.py:
        # get_ppo_ray_runtime_env drops keys already in os.environ; verl's reason: vLLM #31199, cache corruption).
        # Runs one mode per lease follow verl (until 2026-12-05 they kept vLLM's cache on, for several modes in one
        # lease): with it off vLLM leaves Triton's one cache (~/.triton/cache) and inductor's own
        # (/tmp/torchinductor_<user>) where they are, so a cache carried from an earlier lease (super_session.sh
        # cache / restore) serves this run's Mamba2 SSD autotuning and compile; with it on, vLLM moves both into the
        # directory of the engine config's hash, which no earlier run at another batch or k shares.
        env.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
        # Triton's cache named, so that vLLM's worker writes where the trainer does: unset, torch inductor sets it
        # process-wide to /tmp/torchinductor_<user>/triton/<device> the first time a compiled graph's kernel loads
        # (torch/_inductor/runtime/triton_heuristics.py, CachingAutotuner), before vLLM's profiling run builds the
        # Mamba2 SSD and fused-MoE kernels (py-spy: ~83 s of Triton compiling there on a fresh H100), and
        # super_session.sh cache keeps ~/.triton/cache only
        env.setdefault("TRITON_CACHE_DIR", str(pathlib.Path.home() / ".triton" / "cache"))
    return env


def mode_overrides(mode: str, a, workdir: pathlib.Path) -> tuple[str, int, list[str]]:
    """One mode's recipe, steps and Hydra overrides: what :func:`run_mode` launches and :func:`preflight` checks."""
    recipe, extra, _ = MODES[mode]
    steps = a.break_steps if mode == "break" else a.steps + 1 if mode == "online-break" else a.steps
    ns = argparse.Namespace(**{**vars(a), "steps": steps})
    return recipe, steps, [*overrides(recipe, pathlib.Path(a.assets).resolve(), workdir, ns), *extra]


def run_mode(mode: str, a, out: pathlib.Path, timeout_s: float) -> dict:
    """One ``main_ppo`` run of ``mode`` through the CPU harness's run loop (:func:`verl_mtp_cpu.harness.run_trainer`):
    its own process group, the wall-clock and silence limits, stopped ``GRACE_S`` after a fatal log line."""
    workdir = pathlib.Path(a.workdir) / mode
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    recipe, steps, ovr = mode_overrides(mode, a, workdir)
    brk = MODES[mode][2].format(last=steps)  # weight update N precedes step N's rollout (update 1 at start-up)
    cmd = [sys.executable, "-m", "verl_mtp_plugin.main_ppo", "--config-path", str(RECIPE_DIR), "--config-name", recipe,
           *ovr]
    log_path = out / f"{mode}.log"
    print(f"=== {mode}: {recipe}, {steps} steps, limit {timeout_s:.0f} s", flush=True)

    def show(t: float, line: str) -> None:
        if a.echo or re.search(r"step:\d+ -|Traceback|Error|error:|MTPDesync|guard", line):
            sys.stdout.write(f"[{mode} {t:5.0f}s] {line[:400]}" + ("" if line.endswith("\n") else "\n"))

    run = run_trainer(cmd, cwd=workdir, env={**run_env(), ENV_BREAK_SYNC: brk}, log_path=log_path,
                      metrics_path=workdir / "metrics.jsonl", events_path=workdir / "events.jsonl",
                      timeout_s=timeout_s, silence_s=a.silence_s, fatal=FATAL, grace_s=GRACE_S, on_line=show,
                      label="h200 driver")
    rc, stopped, wall, metrics, events = run.rc, run.stopped, run.wall_s, run.metrics, run.events
    text = log_path.read_text(errors="replace")
    res = {"mode": mode, "recipe": recipe, "rc": rc, "stopped": stopped, "wall_s": round(wall, 1),
           "steps_logged": sorted(metrics), "metrics": metrics, "events": events, "cmd": cmd,
           "desync_error": bool(re.search(r"MTPDesyncError", text)),
           # the plugin's vLLM server (token ids and log-probabilities only) or verl's (every run before it existed)
           "rollout_requests": "lean" if LEAN_MARK in text else "verl",
           "guard_lines": [ln[:600] for ln in text.splitlines() if "desync guard" in ln or "MTPDesyncError" in ln][:6],
           "table": step_table(metrics, events, a.prompts * a.n)}
    if rc != 0 or stopped:
        print(f"--- {mode}: last lines of {log_path.name}:\n" + "\n".join(line[:300] for line in text.splitlines()[-40:]))
    print(f"=== {mode}: rc {rc} stopped {stopped} wall {wall:.0f} s steps {sorted(metrics)}", flush=True)
    return res


#: per-step columns: (label, metric key or callable)
def step_table(metrics: dict, events: list[dict], seqs: int) -> list[dict]:
    syncs = [e for e in events if e.get("event") == "sync"]
    rows = []
    for i, (step, m) in enumerate(sorted(metrics.items())):
        row = {"step": step}
        for key in ("critic/score/mean", "response_length/mean", "actor/grad_norm", "actor/pg_loss"):
            if key in m:
                row[key] = m[key]
        for key, v in m.items():
            if key.startswith(("timing_s/", "perf/", "mtp_guard/", "rollout/spec_", "actor/mtp_", "actor/perf/")):
                row[key] = v
        gen = m.get("timing_s/gen")
        if gen and "response_length/mean" in m:
            row["gen_tokens_per_s"] = m["response_length/mean"] * seqs / gen
        rows.append(row)
    # the vLLM side: update i+1 is the sync before step i+1's rollout (update 1 at start-up)
    for r in rows:
        ev = next((e for e in syncs if e.get("update") == r["step"]), None)
        if ev:
            met = ev.get("metrics", {})
            r["sync/bytes_drafter"] = met.get("sync/bytes_drafter")
            r["sync/bytes_target"] = met.get("sync/bytes_target")
            r["sync/drafter_seconds"] = met.get("sync/drafter_seconds")
            r["sync/update_wall_s"] = ev.get("wall_s")
            r["drafter_pre"] = (ev.get("pre") or {}).get("digest")
            r["drafter_post"] = (ev.get("post") or {}).get("digest")
    return rows


def digest_check(events: list[dict]) -> dict:
    """Each update's pre-digest (after the wake-up) against the previous update's post-digest."""
    syncs = sorted((e for e in events if e.get("event") == "sync"), key=lambda e: e.get("update", 0))
    pairs = []
    for prev, cur in zip(syncs, syncs[1:]):
        if (prev.get("post") or {}).get("digest") is None:  # no drafter (speculation off): nothing to compare
            continue
        pairs.append({"update": cur.get("update"), "prev_post": (prev.get("post") or {}).get("digest"),
                      "pre": (cur.get("pre") or {}).get("digest"),
                      "equal": (prev.get("post") or {}).get("digest") == (cur.get("pre") or {}).get("digest")})
    loads = [float((e.get("metrics") or {}).get("sync/bytes_drafter", 0) or 0) > 0 for e in syncs]
    return {"updates": len(syncs), "pairs": pairs, "all_equal": bool(pairs) and all(p["equal"] for p in pairs),
            "drafter_loaded_in_updates": [i + 1 for i, x in enumerate(loads) if x]}


def preflight(a) -> int:
    """Each mode's recipe composed with this run's overrides, through the plugin's start-up check (the one
    ``main_ppo`` runs first), here, without a trainer or a GPU. ``stage.sh`` runs it against the staged vLLM: a
    refusal there would otherwise cost a lease its staging, install and pretraining."""
    from verl_mtp_plugin.policy import MTPConfigError
    from verl_mtp_plugin.trainer.config import compose_recipe, startup_check

    refused = 0
    for mode in a.modes.split(","):
        recipe, _, ovr = mode_overrides(mode, a, pathlib.Path(a.workdir) / mode)
        try:
            settings = startup_check(compose_recipe(str(RECIPE_DIR), recipe, ovr))
        except MTPConfigError as e:
            print(f"=== {mode} ({recipe}): the start-up check refuses it:\n{e}", flush=True)
            refused += 1
            continue
        print(f"=== {mode} ({recipe}): start-up check passed, {len(settings.warnings)} warning(s)", flush=True)
    return 1 if refused else 0


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> dict | None:
    """The host's CPU as the results name it: model, logical cores, its AVX-512 and AMX flags (``None`` without
    ``/proc/cpuinfo``)."""
    try:
        text = pathlib.Path(cpuinfo).read_text()
    except OSError:
        return None
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"model": model, "cores": sum(1 for line in text.splitlines() if line.startswith("processor")),
            "flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}


def _pace_work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) % 1_000_003
    return acc


def host_pace(calls: int = 5, n: int = 5_000_000) -> dict:
    """The host's single-thread pace: seconds of one fixed pure-Python loop (the kind of work vLLM's front end, its
    worker's step loop and verl's agent loop do between GPU calls), ``calls`` times; the least is the pace, the spread
    says how steady the host was. A lease's slower host shows here before any GPU work (the modes' leases differed
    1.3-1.9x in their host-bound phases with the same GPU pace)."""
    each = []
    for _ in range(calls):
        t0 = time.perf_counter()
        _pace_work(n)
        each.append(time.perf_counter() - t0)
    return {"seconds": min(each), "each": [round(x, 4) for x in each], "loop": n}


#: seconds a mode stops before the lease's end (``--end``): the last poll's call that brings its results back
END_MARGIN_S = 75.0


def mode_time_left(budget_left: float, run_timeout: float, end: float, now: float) -> float:
    """One mode's time limit: the least of the call's budget left, the mode's own limit (``--run-timeout``) and,
    with ``end`` (the lease's end in epoch seconds; 0: unknown), the lease's time left at ``now`` less
    :data:`END_MARGIN_S`: a mode cut there keeps its finished steps and its results still come back; a limit
    beyond the lease ran into the lease's end and lost the run."""
    left = min(budget_left, run_timeout)
    if end > 0:
        left = min(left, end - now - END_MARGIN_S)
    return left


def cmd_run(a) -> int:
    if a.preflight:
        return preflight(a)
    os.environ["VERL_H200_STACK"] = a.stack
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary = {"args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": {}}
    try:
        summary["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                                "--format=csv,noheader"], capture_output=True, text=True).stdout
    except OSError:
        pass
    summary["host_cpu"] = host_cpu()
    summary["host_pace"] = host_pace()
    summary["pretraining"] = pretraining(pathlib.Path(a.assets) / "assets.json")
    if a.import_check:
        rc = subprocess.run([sys.executable, str(HERE / "import_check.py"), "--no-walk", "--json",
                             str(out / "import_check.json")], env=run_env(), timeout=300).returncode
        summary["import_check_rc"] = rc
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        if rc != 0:
            print("=== import check failed: no run started (import_check.json lists what is missing)", flush=True)
            return 1
    for mode in a.modes.split(","):
        budget_left = a.budget - (time.perf_counter() - t_start)
        left = mode_time_left(budget_left, a.run_timeout, a.end, time.time())
        if left < a.min_run_s:
            why = "budget" if left == budget_left else "lease end" if a.end > 0 and left < a.run_timeout else "limit"
            summary["runs"][mode] = {"skipped": f"{why}: {left:.0f} s left"}
            print(f"=== {mode}: skipped ({left:.0f} s left)", flush=True)
            continue
        res = run_mode(mode, a, out, left)
        res["digests"] = digest_check(res["events"])
        summary["runs"][mode] = res
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_md(summary, str(out / "summary.json"))
    return 0


#: the markdown table of ``run.py table``: (header, row key, format)
MD_COLS = [
    ("gen s", "timing_s/gen", "{:.2f}"), ("sync s", "timing_s/update_weights", "{:.3f}"),
    ("logp s", "timing_s/old_log_prob", "{:.2f}"), ("ref s", "timing_s/ref", "{:.2f}"),
    ("update s", "timing_s/update_actor", "{:.2f}"), ("step s", "timing_s/step", "{:.2f}"),
    ("gen tok/s", "gen_tokens_per_s", "{:.0f}"),
    ("vLLM acc pos 0", "rollout/spec_accept_rate_pos_0", "{:.3f}"),
    ("vLLM acc pos 1", "rollout/spec_accept_rate_pos_1", "{:.3f}"),
    ("vLLM acc pos 2", "rollout/spec_accept_rate_pos_2", "{:.3f}"),
    ("vLLM accept len", "rollout/spec_accept_length", "{:.2f}"),
    ("trainer est. (argmax draft)", "actor/mtp_argmax_draft_accept_rate", "{:.3f}"),
    ("trainer est. (overlap)", "actor/mtp_expected_accept_rate", "{:.3f}"),
    ("trainer E[len] k=2", "actor/mtp_expected_accept_length_k2", "{:.2f}"),
    ("trainer E[len] k=3", "actor/mtp_expected_accept_length_k3", "{:.2f}"),
    ("guard", "mtp_guard/desync", "{:.0f}"),
    ("drafter bytes", "sync/bytes_drafter", "{:.0f}"), ("drafter load s", "sync/drafter_seconds", "{:.4f}"),
    ("vLLM update s", "sync/update_wall_s", "{:.3f}"),
    ("drafter digest after wake", "drafter_pre", "{}"), ("after sync", "drafter_post", "{}"),
    ("peak alloc GiB", "actor/perf/max_memory_allocated_gb", "{:.1f}"),
    ("score", "critic/score/mean", "{:.3f}"),
]


def print_md(summary: dict, source: str) -> None:
    """The markdown per-step table of each mode of ``summary`` (read from ``source``)."""
    for mode, r in summary["runs"].items():
        if "table" not in r:
            print(f"**{mode}** ({source}): {r}\n")
            continue
        d = digest_check(r.get("events", []))
        loads = f"drafter loaded in updates {d['drafter_loaded_in_updates']}, "
        if d["pairs"]:
            drafter = loads + f"every digest after wake-up equal to the previous sync's: {d['all_equal']}"
        elif d["drafter_loaded_in_updates"]:
            drafter = loads + "no later update to compare its digest with"
        else:
            drafter = "no drafter (no speculation)"
        print(f"**{mode}** ({source}): rc {r['rc']}{', ' + r['stopped'] if r.get('stopped') else ''}, wall "
              f"{r['wall_s']} s, steps {r['steps_logged']}; weight updates {d['updates']}, {drafter}\n")
        # rebuilt from the run's metrics and events, so a summary written before a column was added shows it too
        args = summary.get("args") or {}
        table = step_table({int(k): v for k, v in r.get("metrics", {}).items()}, r.get("events", []),
                           args.get("prompts", 16) * args.get("n", 8))
        if not table:
            continue
        cols = [c for c in MD_COLS if any(row.get(c[1]) is not None for row in table)]
        print("| step | " + " | ".join(c[0] for c in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for row in table:
            vals = []
            for _, key, fmt in cols:
                v = row.get(key)
                vals.append("-" if v is None else fmt.format(v))
            print(f"| {row['step']} | " + " | ".join(vals) + " |")
        print()


def cmd_table(a) -> int:
    """Markdown per-step tables from ``summary.json`` files (``run.py table SUMMARY [SUMMARY ...]``)."""
    for path in a.summaries:
        print_md(json.loads(pathlib.Path(path).read_text()), path)
    return 0


def pretraining(assets_json: pathlib.Path) -> dict | None:
    """The steps ``super_assets.py`` pretrained the checkpoint for, against the steps asked: its time cap
    (``--seconds``) ends a phase early, and a checkpoint cut short is another checkpoint (``None`` without the file,
    e.g. ``run.py assets``' tiny model, which writes no steps)."""
    try:
        info = json.loads(assets_json.read_text())
    except (OSError, ValueError):
        return None
    if "joint_steps" not in info:
        return None
    args = info.get("args") or {}
    asked = (args.get("steps"), args.get("mtp_steps"))
    done = (info["joint_steps"], info.get("mtp_steps"))
    return {"joint_steps": done[0], "mtp_steps": done[1], "asked": list(asked), "complete": tuple(asked) == done}


#: verl 0.9.1's defaults for its host-side workers: ``rollout.agent.num_workers``, ``reward.num_workers``,
#: ``transfer_queue.backend.SimpleStorage.num_data_storage_units`` (``verl/trainer/config``; a test checks them)
VERL_HOST_WORKERS = {"agent": 8, "reward": 8, "storage": 8}
#: what every run before ``run --reward-workers`` / ``--storage-units`` existed set (with its ``--agent-workers`` 2)
LEGACY_HOST_WORKERS = {"agent": 2, "reward": 2, "storage": 1}


#: the Hydra key each of :func:`host_workers`' counts sets (``run`` appends ``--override`` after them: those win)
HOST_WORKER_KEYS = {"agent": "actor_rollout_ref.rollout.agent.num_workers", "reward": "reward.num_workers",
                    "storage": "transfer_queue.backend.SimpleStorage.num_data_storage_units"}


def host_workers(args: dict) -> str:
    """A run's agent-loop / reward / storage workers as ``"A/R/S"``, from its summary's ``args``: verl's defaults
    where an option was left unset, the fixed 2/2/1 of the runs before the options existed; an ``--override`` of the
    same key wins, as it does in the run's Hydra list."""
    if "reward_workers" not in args:
        vals = {**LEGACY_HOST_WORKERS, "agent": args.get("agent_workers") or LEGACY_HOST_WORKERS["agent"]}
    else:
        vals = {k: args.get(name) or VERL_HOST_WORKERS[k]
                for k, name in (("agent", "agent_workers"), ("reward", "reward_workers"), ("storage", "storage_units"))}
    for item in args.get("override") or []:
        key, _, value = str(item).lstrip("+").partition("=")
        for name, full in HOST_WORKER_KEYS.items():
            if key == full:
                vals[name] = value
    return "{agent}/{reward}/{storage}".format(**vals)


def _runs_in(paths: list[str]) -> list[tuple[str, str, dict]]:
    """``(mode, summary path, run)`` of every run with metrics in these ``summary.json`` files, in order; each run
    with ``k``, the drafts per verify step it ran with (``run --k``; the recipe's before the option existed), and
    ``pretraining``, its checkpoint's steps (:func:`pretraining`; summaries written before ``run`` recorded them:
    the ``assets.json`` beside the summary's ``run/`` folder, as the results keep it)."""
    out = []
    for path in paths:
        summary = json.loads(pathlib.Path(path).read_text())
        k = int((summary.get("args") or {}).get("k") or RECIPE_K)
        p = pathlib.Path(path).resolve().parent
        pre = summary.get("pretraining") or pretraining((p.parent if p.name == "run" else p) / "assets.json")
        pace = (summary.get("host_pace") or {}).get("seconds")
        extra = list((summary.get("args") or {}).get("override") or [])
        workers = host_workers(summary.get("args") or {})
        out += [(mode, path, {**r, "k": k, "pretraining": pre, "host_pace_s": pace, "overrides": extra,
                              "requests": r.get("rollout_requests") or "verl", "host_workers": workers})
                for mode, r in summary.get("runs", {}).items() if r.get("metrics")]
    return out


def runs_by_mode(paths: list[str]) -> dict[str, tuple[str, dict]]:
    """``{mode: (summary path, run)}`` of the runs with metrics in these ``summary.json`` files (a mode found in
    several: the last one given), what ``plot`` reads."""
    return {mode: (path, r) for mode, path, r in _runs_in(paths)}


#: the done-criteria of the modes' comparison over the last steps (``run.py compare``)
GEN_RATIO_MAX = 0.6  # online's generation time per step at most this share of mode off's
ACCEPT_GAIN_MIN = 0.15  # online's first-draft acceptance at least frozen's plus this
#: the trainer's estimate over the positions vLLM drafts at (the plugin logs it since 2026-12-07)
DRAFTED_ESTIMATE = "actor/mtp_drafted_expected_accept_rate"
ESTIMATE_DIFF_MAX = 0.03  # vLLM's first-draft acceptance within this of the trainer's estimate, every step


def _mean(xs: list) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def window(metrics: dict, events: list[dict], last: int, steps_range: tuple[int, int] | None = None) -> dict:
    """One mode's last ``last`` logged steps, from verl's own metrics (and the worker extension's sync events):
    the means the comparison reads, and an estimate of the rollout's sequential verify steps,
    ``response_length/max`` over ``rollout/spec_accept_length`` (1 token per step in a mode without any
    ``rollout/spec_*`` key): the rollout ends with its longest response, so ``timing_s/gen`` = those steps x the
    seconds each took (the verify step, the host between). vLLM's accept length is the mean over every request's
    verify steps; the longest response may accept less, so the estimate can undercount its steps and the seconds per
    step, ``timing_s/gen`` over the estimate, carry that error. A speculating mode's step without the key is left
    out of the estimate. ``steps_range`` (first, last): those logged steps instead of the last ``last``."""
    steps = sorted(int(k) for k in metrics)
    steps = [s for s in steps if steps_range[0] <= s <= steps_range[1]] if steps_range else steps[-last:]
    ms = [metrics.get(s, metrics.get(str(s))) for s in steps]

    def col(key):
        return [m.get(key) for m in ms]

    speculating = any(k.startswith("rollout/spec_") for m in ms for k in m)
    seq_steps = []
    each = []  # the steps the per-token model reads: generation s, estimated engine steps, tokens per step, sequences
    for m in ms:
        acc = m.get("rollout/spec_accept_length") if speculating else 1.0
        gen, rmax, rmean, tok_ms = (m.get(k) for k in ("timing_s/gen", "response_length/max",
                                                        "response_length/mean", "timing_per_token_ms/gen"))
        if rmax and acc:
            seq_steps.append(rmax / acc)
            if gen and rmean and tok_ms:
                each.append({"gen_s": gen, "seq_steps": rmax / acc, "resp_max": rmax,
                             "sequences": gen * 1000.0 / tok_ms / rmean})  # verl's ms per token: gen / (seqs x mean)
    # the trainer's estimate of vLLM's first-draft rate: its drafted form where logged (over the positions vLLM
    # drafts at), else the mean over positions (runs before it), which overstates vLLM's rate where hard positions
    # cluster
    est_key = DRAFTED_ESTIMATE if ms and all(DRAFTED_ESTIMATE in m for m in ms) else "actor/mtp_expected_accept_rate"
    est = [(m.get("rollout/spec_accept_rate_pos_0"), m.get(est_key)) for m in ms]
    diffs = [abs(v - e) for v, e in est if v is not None and e is not None]
    gens = col("timing_s/gen")
    per_tok = [x * 1000.0 for x in col("timing_per_token_ms/gen") if x is not None]  # verl's: gen s / response token
    syncs = {e.get("update"): e for e in events if e.get("event") == "sync"}
    drafter = [((syncs.get(s) or {}).get("metrics") or {}).get("sync/bytes_drafter") for s in steps]
    out = {"steps": steps, "speculating": speculating, "gen_s": _mean(gens), "gen_s_each": gens, "model_steps": each,
           "step_s": _mean(col("timing_s/step")),
           "sync_s": _mean(col("timing_s/update_weights")), "score": _mean(col("critic/score/mean")),
           "response_len_mean": _mean(col("response_length/mean")),
           "response_len_max": _mean(col("response_length/max")),
           "accept_len": _mean(col("rollout/spec_accept_length")),
           "accept_pos0": _mean(col("rollout/spec_accept_rate_pos_0")),
           "accept_pos1": _mean(col("rollout/spec_accept_rate_pos_1")),
           "accept_pos2": _mean(col("rollout/spec_accept_rate_pos_2")),
           "estimate": _mean(col(est_key)), "estimate_key": est_key,
           "estimate_mean_over_positions": _mean(col("actor/mtp_expected_accept_rate")),
           "estimate_diff_mean": _mean(diffs), "estimate_diff_max": max(diffs) if diffs else None,
           "estimate_steps_judged": len(diffs),
           "seq_verify_steps": _mean(seq_steps),
           "gen_us_per_token": _mean(per_tok), "gen_us_per_token_min": min(per_tok, default=None),
           "gen_us_per_token_max": max(per_tok, default=None),
           "peak_alloc_gib": max((x for x in col("actor/perf/max_memory_allocated_gb") if x is not None), default=None),
           "peak_reserved_gib": max((x for x in col("actor/perf/max_memory_reserved_gb") if x is not None),
                                    default=None),
           "drafter_bytes": _mean(drafter),
           # the lease's pace: the reference's and the actor's log-prob passes do the same work in every mode when
           # the responses have the same lengths (no MTP forward in either, the plugin's phase table)
           "ref_s": _mean(col("timing_s/ref")), "logp_s": _mean(col("timing_s/old_log_prob"))}
    out["gen_s_per_seq_step"] = (out["gen_s"] / out["seq_verify_steps"]
                                 if out["gen_s"] and out["seq_verify_steps"] else None)
    return out


def _split(x: dict, off: dict) -> dict:
    """A speculating mode's generation time over off's, in :func:`compare`'s estimated factors, and the ratio of
    verl's seconds per generated response token (``timing_per_token_ms/gen``; ``None`` without it)."""
    per_tok = (x["gen_us_per_token"] / off["gen_us_per_token"]
               if x["gen_us_per_token"] and off["gen_us_per_token"] else None)
    return {"seq_verify_steps": x["seq_verify_steps"] / off["seq_verify_steps"],
            "s_per_seq_step": x["gen_s_per_seq_step"] / off["gen_s_per_seq_step"],
            "response_len_max": x["response_len_max"] / off["response_len_max"], "s_per_token": per_tok}


WITHIN_MIN_SPAN = 0.25  # tokens per verify step a run's steps must span for its within-run line (within_run)
PACE_TOLERANCE = 0.10  # a mode's log-prob passes this much slower or faster than off's: another machine's pace
#: what :func:`compare` checks against off's for a run's pace: (window key, what it is, format, the warning's end)
PACE_CHECKS = (
    ("host_pace_s", "host's pure-Python loop", "{:.3f}", "): another host pace, its host-bound phases carry it"),
    ("ref_s", "reference log-prob pass", "{:.2f}",
     "; the same work at equal response lengths): another pace, its time ratios to off carry it"),
    ("logp_s", "actor log-prob pass", "{:.2f}",
     "; the same work at equal response lengths): another pace, its time ratios to off carry it"),
)
BOOTSTRAP_ROUNDS = 2000


def ratio_interval(num: list, den: list, rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> tuple[float, float] | None:
    """A 95 % interval of ``mean(num) / mean(den)`` by resampling each list's steps (a seeded bootstrap): the
    spread of the steps within the runs, not the spread between leases."""
    num, den = [float(x) for x in num if x is not None], [float(x) for x in den if x is not None]
    if len(num) < 2 or len(den) < 2:
        return None
    rng = random.Random(seed)
    rs = sorted((sum(rng.choices(num, k=len(num))) / len(num)) / (sum(rng.choices(den, k=len(den))) / len(den))
                for _ in range(rounds))
    return rs[int(0.025 * rounds)], rs[int(0.975 * rounds) - 1]


def labelled_runs(paths: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Every run with metrics in these ``summary.json`` files, labelled: its mode, or ``mode@<folder>`` (the folder
    holding the summary's ``run/``) when several summaries hold that mode; and, per mode, the label of the last one
    given (the run :func:`compare` judges)."""
    found = _runs_in(paths)
    count: dict[str, int] = {}
    for mode, _, _ in found:
        count[mode] = count.get(mode, 0) + 1
    runs, judged = {}, {}
    for mode, path, r in found:
        p = pathlib.Path(path).resolve()
        label = mode if count[mode] == 1 else f"{mode}@{(p.parent.parent if p.parent.name == 'run' else p.parent).name}"
        while label in runs:
            label += "'"
        runs[label], judged[mode] = r, label
    return runs, judged


def _point(rows: list[dict]) -> tuple[float, float, float]:
    """One mode's (tokens per engine step per sequence, ms per engine step, sequences) over its steps: the window's
    estimates (:func:`window`), means over the steps."""
    seq = sum(r["seq_steps"] for r in rows) / len(rows)
    return (sum(r["resp_max"] for r in rows) / len(rows) / seq, sum(r["gen_s"] for r in rows) / len(rows) / seq * 1e3,
            sum(r["sequences"] for r in rows) / len(rows))


def _fit(points) -> dict | None:
    (l0, s0, n0), (l1, s1, n1), (l2, s2, n2) = points
    if abs(l2 - l1) < 0.05:
        return None
    t = (s2 - s1) / (l2 - l1)  # ms per engine step per token each sequence emits in it
    n = (n0 + n1 + n2) / 3
    return {"us_per_token": t / n * 1e3, "fixed_plain_ms": s0 - t * l0, "fixed_verify_ms": s1 - t * l1,
            "fixed_diff_ms": (s1 - t * l1) - (s0 - t * l0), "floor": t / s0 * l0}


def token_model(off: dict, fr: dict, on: dict, rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> dict | None:
    """A fixed cost per engine step (one for a plain step, one for a verify step at the speculating modes' k) plus a
    cost per emitted token, fitted exactly to off's, frozen's and online's (tokens per step, ms per step): three
    points, three unknowns, so the fit is a model and not a test of it. With 95 % intervals from resampling each
    mode's steps (seeded), and, as a check inside one run, the slope of online's ms per verify step over its tokens
    per step, step by step (with the correlation)."""
    rows = [x.get("model_steps") or [] for x in (off, fr, on)]
    if min(map(len, rows)) < 2:
        return None
    res = _fit([_point(r) for r in rows])
    if res is None:
        return None
    rng = random.Random(seed)
    draws = [f for f in (_fit([_point(rng.choices(r, k=len(r))) for r in rows]) for _ in range(rounds)) if f]
    for key in ("us_per_token", "fixed_diff_ms", "floor"):
        v = sorted(d[key] for d in draws)
        res[key + "_interval"] = (v[int(0.025 * len(v))], v[int(0.975 * len(v)) - 1])
    within = within_run(rows[2])
    if within:
        res["online_slope_us_per_token"], res["online_slope_r"] = within["us_per_token"], within["r"]
    return res


def within_run(rows: list[dict]) -> dict | None:
    """Inside one speculating run, step by step: the ms per estimated engine step against the tokens each sequence
    emits per step (vLLM's accept length), a least-squares line: its intercept (ms per step at no token) and its
    slope per generated token (over the mean running sequences), with the correlation. ``None`` below 3 steps or
    where the accept lengths span less than ``WITHIN_MIN_SPAN`` tokens per step (a slope over noise)."""
    if len(rows) < 3:
        return None
    xs = [r["resp_max"] / r["seq_steps"] for r in rows]
    if max(xs) - min(xs) < WITHIN_MIN_SPAN:
        return None
    ys = [r["gen_s"] / r["seq_steps"] * 1e3 for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    n = sum(r["sequences"] for r in rows) / len(rows)
    slope = sxy / sxx
    # the slope's 95 % interval (least squares, Student's t with len - 2 degrees of freedom)
    half = T95[min(len(xs) - 2, len(T95) - 1)] * (max(syy - slope * sxy, 0.0) / (len(xs) - 2) / sxx) ** 0.5
    return {"intercept_ms": my - slope * mx, "us_per_token": slope / n * 1e3, "r": sxy / (sxx * syy) ** 0.5,
            "us_per_token_interval": ((slope - half) / n * 1e3, (slope + half) / n * 1e3)}


#: Student's t at 97.5 % by degrees of freedom (index), 1..30; beyond 30 the last
T95 = (float("nan"), 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def compare(runs: dict[str, dict], last: int, judged: dict[str, str] | None = None,
            steps_range: tuple[int, int] | None = None) -> dict:
    """The modes side by side over their last ``last`` steps, each criterion with its verdict (or why it was not
    judged), the windows' problems, and the generation-time ratio split in two estimated factors: ``gen_online /
    gen_off`` = (sequential verify steps, online / off: the tokens per verify step and the tail) x (seconds per
    sequential step, online / off: the verify step's cost with k drafts and the host between steps; it takes up
    the first factor's estimation error, :func:`window`); frozen's over off's alike, and for each both modes'
    seconds per generated token (verl's ``timing_per_token_ms/gen``)."""
    w = {mode: window(r["metrics"], r.get("events", []), last, steps_range) for mode, r in runs.items()}
    if steps_range:  # every mode over the same steps: "last" is the window's length
        last = steps_range[1] - steps_range[0] + 1
    for mode, x in w.items():
        x["k"] = int(runs[mode].get("k") or RECIPE_K) if x["speculating"] else None
        x["pretraining"] = runs[mode].get("pretraining")
        x["host_pace_s"] = runs[mode].get("host_pace_s")
        x["overrides"] = list(runs[mode].get("overrides") or [])
        x["requests"] = runs[mode].get("requests") or "verl"
        x["host_workers"] = runs[mode].get("host_workers")
    res: dict = {"last": last, "modes": w, "criteria": {}, "not_judged": {}, "factors": {}, "warnings": []}
    for mode, x in w.items():
        if len(x["steps"]) < last:
            asked = f"--steps {steps_range[0]}-{steps_range[1]}" if steps_range else f"--last {last}"
            res["warnings"].append(f"{mode}: {len(x['steps'])} steps logged, fewer than {asked}")
    if len({(x["steps"][0], x["steps"][-1]) for x in w.values() if x["steps"]}) > 1:
        res["warnings"].append("the modes' windows differ: " + ", ".join(
            f"{m} {x['steps'][0]}-{x['steps'][-1]}" for m, x in w.items() if x["steps"]))
    judged = judged or {mode: mode for mode in w}
    res["judged"] = judged
    # run.py run --override: a ratio between two modes run with different extra settings compares two settings too
    sets = {m: sorted(w[m]["overrides"]) for m in judged.values() if m in w}
    if len({tuple(v) for v in sets.values()}) > 1:
        res["warnings"].append("the judged modes ran with different --override settings (" + "; ".join(
            f"{m}: {', '.join(v) or 'none'}" for m, v in sets.items()) + "): their ratios compare those settings too")
    reqs = {m: w[m]["requests"] for m in judged.values() if m in w}
    if len(set(reqs.values())) > 1:
        res["warnings"].append("the judged modes' vLLM servers built different requests (" + "; ".join(
            f"{m}: {v}" for m, v in reqs.items()) + "; 'lean': the plugin's, without detokenization): their ratios "
            "compare those requests too")
    hw = {m: w[m]["host_workers"] for m in judged.values() if m in w}
    if len(set(hw.values())) > 1:
        res["warnings"].append("the judged modes ran with different agent-loop / reward / storage workers (" + "; ".join(
            f"{m}: {v}" for m, v in hw.items()) + "): verl's per-response work after vLLM's last step is spread over "
            "the agent loops, so their ratios compare those settings too")
    # the same checkpoint for every mode: a time cap that ended a pretraining phase early made another one
    ref_mode = judged.get("off", "off") if judged.get("off", "off") in w else next(iter(w), None)
    ref = (w[ref_mode]["pretraining"] or {}) if ref_mode else {}
    for mode, x in w.items():
        pre = x["pretraining"]
        if not pre:
            continue
        steps = f"{pre['joint_steps']} joint + {pre['mtp_steps']} MTP-only steps"
        if not pre["complete"]:
            res["warnings"].append(f"{mode}: its checkpoint was pretrained {steps} of the {pre['asked'][0]} + "
                                   f"{pre['asked'][1]} asked (super_assets.py's time cap): another checkpoint than a "
                                   "full pretraining gives; its acceptance is not the others' starting point")
        elif ref and mode != ref_mode and (pre["joint_steps"], pre["mtp_steps"]) != (ref["joint_steps"],
                                                                                    ref["mtp_steps"]):
            res["warnings"].append(f"{mode}: its checkpoint was pretrained {steps}, {ref_mode}'s "
                                   f"{ref['joint_steps']} + {ref['mtp_steps']}: another checkpoint")
    on, off, fr = (w.get(judged.get(m, m)) for m in ("online", "off", "frozen"))
    c, nj = res["criteria"], res["not_judged"]
    if off:
        for mode, x in w.items():
            for key, what, fmt, why in PACE_CHECKS:
                if x is not off and x[key] and off[key] and abs(x[key] / off[key] - 1) > PACE_TOLERANCE:
                    res["warnings"].append(f"{mode}: its {what} took {fmt.format(x[key])} s, off's "
                                           f"{fmt.format(off[key])} s ({x[key] / off[key]:.2f}x{why}")

    def missing(*names):
        return "missing: " + ", ".join(n for n in names if judged.get(n, n) not in w)

    if on and off and on["gen_s"] and off["gen_s"]:
        ratio = on["gen_s"] / off["gen_s"]
        c["gen_ratio_online_off"] = {"value": ratio, "max": GEN_RATIO_MAX, "met": ratio <= GEN_RATIO_MAX,
                                     "interval": ratio_interval(on["gen_s_each"], off["gen_s_each"])}
        if on["seq_verify_steps"] and off["seq_verify_steps"]:
            res["factors"]["online_off"] = _split(on, off)
    else:
        nj["gen_ratio_online_off"] = missing("online", "off") if not (on and off) else "no timing_s/gen"
    if fr and off and fr["gen_s"] and off["gen_s"]:
        res["factors"]["frozen_off"] = {"gen_ratio": fr["gen_s"] / off["gen_s"]}
        if fr["seq_verify_steps"] and off["seq_verify_steps"]:
            res["factors"]["frozen_off"].update(_split(fr, off))
    if on and off and fr and on["k"] != fr["k"]:
        res["warnings"].append(f"no per-token model: frozen drafted k={fr['k']}, online k={on['k']} (the model has "
                               "one fixed cost per verify step, at one k)")
    elif on and off and fr:
        model = token_model(off, fr, on)
        if model:
            res["token_model"] = model
    res["within"] = {mode: fit for mode, x in w.items() if x["speculating"]
                     for fit in [within_run(x["model_steps"])] if fit}
    if on and fr and on["accept_pos0"] is not None and fr["accept_pos0"] is not None:
        gain = on["accept_pos0"] - fr["accept_pos0"]
        c["accept_gain_online_frozen"] = {"value": gain, "min": ACCEPT_GAIN_MIN, "met": gain >= ACCEPT_GAIN_MIN}
    else:
        nj["accept_gain_online_frozen"] = (missing("online", "frozen") if not (on and fr)
                                           else "no rollout/spec_accept_rate_pos_0")
    if on and on["estimate_diff_max"] is not None:
        judged, steps = on["estimate_steps_judged"], len(on["steps"])
        c["estimate_diff_online"] = {"value": on["estimate_diff_max"], "mean": on["estimate_diff_mean"],
                                     "max": ESTIMATE_DIFF_MAX, "steps_judged": judged,
                                     "met": on["estimate_diff_max"] <= ESTIMATE_DIFF_MAX and judged == steps,
                                     "estimate_key": on["estimate_key"]}
    else:
        nj["estimate_diff_online"] = missing("online") if not on else "no step with both acceptance and estimate"
    return res


#: ``run.py compare``'s markdown columns: (header, window key, format)
CMP_COLS = [("steps", "steps", None), ("gen s", "gen_s", "{:.2f}"), ("step s", "step_s", "{:.2f}"),
            ("sync s", "sync_s", "{:.3f}"), ("response mean / max", None, None),
            ("tokens per verify step", "accept_len", "{:.2f}"), ("vLLM acc pos 0", "accept_pos0", "{:.3f}"),
            ("trainer est.", "estimate", "{:.3f}"), ("est. diff mean / max", None, None),
            ("sequential verify steps", "seq_verify_steps", "{:.0f}"), ("s per step", "gen_s_per_seq_step",
                                                                        "{:.4f}"),
            ("gen us per token (min-max)", None, None), ("ref / log-prob s", None, None),
            ("peak alloc / reserved GiB", None, None), ("drafter bytes", "drafter_bytes", "{:.0f}"),
            ("score", "score", "{:.3f}"), ("k", "k", "{}"), ("vLLM acc pos 1 / 2", None, None),
            ("host loop s", "host_pace_s", "{:.3f}"), ("requests", "requests", "{}"),
            ("agent / reward / storage workers", "host_workers", "{}"), ("more overrides", None, None)]


def cmd_compare(a) -> int:
    """The modes' runs over their last ``--last`` steps, or the same steps of each (``--steps FIRST-LAST``, for runs
    of unequal length) (``run.py compare SUMMARY [SUMMARY ...]``; a mode found in
    several summaries: a row for each, labelled ``mode@<folder>``, the criteria judged on the last one given): a
    markdown table, each done-criterion with its verdict, the factors of the generation-time ratio; ``--json``
    writes it all."""
    runs, judged = labelled_runs(a.summaries)
    res = compare(runs, a.last, judged, a.steps)

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    print("| mode | " + " | ".join(h for h, _, _ in CMP_COLS) + " |")
    print("|---|" + "---|" * len(CMP_COLS))
    for mode, w in res["modes"].items():
        cells = []
        for h, key, fmt in CMP_COLS:
            if key == "steps":
                cells.append(f"{w['steps'][0]}-{w['steps'][-1]}" if w["steps"] else "-")
            elif h.startswith("response"):
                cells.append(f"{f(w['response_len_mean'], '{:.0f}')} / {f(w['response_len_max'], '{:.0f}')}")
            elif h.startswith("vLLM acc pos 1"):
                cells.append(f"{f(w['accept_pos1'], '{:.3f}')} / {f(w['accept_pos2'], '{:.3f}')}")
            elif h.startswith("est. diff"):
                cells.append(f"{f(w['estimate_diff_mean'], '{:.3f}')} / {f(w['estimate_diff_max'], '{:.3f}')}")
            elif h.startswith("gen us per token"):
                cells.append(f"{f(w['gen_us_per_token'], '{:.1f}')} ({f(w['gen_us_per_token_min'], '{:.1f}')}-"
                             f"{f(w['gen_us_per_token_max'], '{:.1f}')})")
            elif h.startswith("ref / log-prob"):
                cells.append(f"{f(w['ref_s'], '{:.2f}')} / {f(w['logp_s'], '{:.2f}')}")
            elif h.startswith("peak"):
                cells.append(f"{f(w['peak_alloc_gib'], '{:.1f}')} / {f(w['peak_reserved_gib'], '{:.1f}')}")
            elif h == "more overrides":
                cells.append(", ".join(f"`{o}`" for o in w.get("overrides") or []) or "-")
            else:
                cells.append(f(w[key], fmt))
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print()
    for name, crit in res["criteria"].items():
        bound = f"<= {crit['max']}" if "max" in crit else f">= {crit['min']}"
        online = res["modes"][res["judged"]["online"]] if "steps_judged" in crit else None
        judged = f", {crit['steps_judged']} of {len(online['steps'])} steps judged" if online else ""
        ci = (f"; 95 % interval over the steps {crit['interval'][0]:.3f}-{crit['interval'][1]:.3f}"
              if crit.get("interval") else "")
        key = f"; against {crit['estimate_key']}" if crit.get("estimate_key") else ""
        print(f"- {name}: {crit['value']:.3f} ({bound}{judged}{key}: {'met' if crit['met'] else 'NOT met'}{ci})")
    for name, why in res["not_judged"].items():
        print(f"- {name}: not judged ({why})")
    for name, fac in res["factors"].items():
        print(f"- factors {name} (estimates): " + ", ".join(f"{k} {v:.3f}" for k, v in fac.items() if v is not None))
    tm = res.get("token_model")
    if tm:
        print(f"- per-token model (off, frozen, online fitted exactly: a model): {tm['us_per_token']:.1f} us per "
              f"generated token ({tm['us_per_token_interval'][0]:.1f}-{tm['us_per_token_interval'][1]:.1f} resampled), "
              f"fixed ms per plain / verify step {tm['fixed_plain_ms']:.2f} / {tm['fixed_verify_ms']:.2f} (difference "
              f"{tm['fixed_diff_ms_interval'][0]:+.2f} to {tm['fixed_diff_ms_interval'][1]:+.2f}), per-token share of "
              f"off's step {tm['floor']:.2f} ({tm['floor_interval'][0]:.2f}-{tm['floor_interval'][1]:.2f})"
              + (f"; within online: {tm['online_slope_us_per_token']:.1f} us per token accepted "
                 f"(r {tm['online_slope_r']:.2f})" if "online_slope_us_per_token" in tm else ""))
    for mode, fit in res["within"].items():
        lo, hi = fit["us_per_token_interval"]
        print(f"- within {mode} (k={res['modes'][mode]['k']}), step by step: ms per engine step "
              f"{fit['intercept_ms']:.1f} + {fit['us_per_token']:.1f} us per generated token (95 % interval "
              f"{lo:.1f} to {hi:.1f}; r {fit['r']:.2f})")
    for line in res["warnings"]:
        print(f"- warning: {line}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


def plot_cards(paths: list[str]) -> str:
    """The cards the summaries ran on, from their ``nvidia_smi`` line (its name field, "NVIDIA " dropped), joined
    with " and " when they differ; "a GPU" when none is named."""
    cards = []
    for path in paths:
        line = json.loads(pathlib.Path(path).read_text()).get("nvidia_smi") or ""
        name = line.strip().split(",")[0].strip().removeprefix("NVIDIA ")
        if name and name not in cards:
            cards.append(name)
    return " and ".join(f"an {c}" if c[:1] in "AEFHILMNORSX" else f"a {c}" for c in cards) or "a GPU"


def cmd_plot(a) -> int:
    """The picture of the modes' runs (``run.py plot OUT.png SUMMARY [SUMMARY ...]``), one line per mode (a mode
    found in several summaries: the last one given): the reward, vLLM's first-draft acceptance (dotted: the
    trainer's overlap estimate) and verl's ``timing_s/gen`` per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {mode: (path, {int(k): v for k, v in r["metrics"].items()})
            for mode, (path, r) in runs_by_mode(a.summaries).items()}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("critic/score/mean", "reward (mean score)"),
              ("rollout/spec_accept_rate_pos_0", "vLLM first-draft acceptance"),
              ("timing_s/gen", "verl timing_s/gen (s)")]
    colors = {"online": "tab:blue", "frozen": "tab:orange", "off": "tab:gray"}
    for ax, (key, title) in zip(axes, panels):
        for mode, (_, m) in runs.items():
            steps = [s for s in sorted(m) if key in m[s]]
            if not steps:
                continue
            ax.plot(steps, [m[s][key] for s in steps], marker="o", ms=3, label=mode, color=colors.get(mode))
            if key == "rollout/spec_accept_rate_pos_0":
                est = [s for s in steps if "actor/mtp_expected_accept_rate" in m[s]]
                if est:
                    ax.plot(est, [m[s]["actor/mtp_expected_accept_rate"] for s in est], ls=":",
                            color=colors.get(mode), label=f"{mode}: trainer's estimate")
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(a.title or f"verl's trainer on {plot_cards(a.summaries)}, Nemotron 3 Super's widths (2.07 B)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out} ({', '.join(f'{k}: {v[0]}' for k, v in runs.items())})")
    return 0


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("assets", help="build the checkpoint, tokenizer and data")
    p.add_argument("dir")
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (Triton Mamba kernels; warms Triton's cache)")
    r = sub.add_parser("run", help="run the modes on this machine's GPUs")
    r.add_argument("--assets", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default="/tmp/h200_main_ppo")
    r.add_argument("--modes", default="online,frozen,off,break")
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--break-steps", type=int, default=3)
    r.add_argument("--prompts", type=int, default=16, help="data.train_batch_size (prompts per step)")
    r.add_argument("--n", type=int, default=8, help="rollout.n (the recipe's)")
    r.add_argument("--lr", type=float, default=1e-4)
    r.add_argument("--gpus", type=int, default=1)
    r.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size (actor and ref)")
    r.add_argument("--ep", type=int, default=1, help="Megatron expert parallel size (actor and ref)")
    r.add_argument("--rollout-tp", type=int, default=1)
    r.add_argument("--rollout-ep", type=int, default=1)
    r.add_argument("--gpu-mem", type=float, default=0.3, help="rollout.gpu_memory_utilization")
    r.add_argument("--agent-workers", type=_positive, default=None,
                   help="rollout.agent.num_workers (verl's default 8; the runs before 2026-12-07 set 2)")
    r.add_argument("--reward-workers", type=_positive, default=None,
                   help="reward.num_workers (verl's default 8; the runs before 2026-12-07 set 2)")
    r.add_argument("--storage-units", type=_positive, default=None,
                   help="transfer_queue.backend.SimpleStorage.num_data_storage_units (verl's default 8; the runs "
                        "before 2026-12-07 set 1)")
    r.add_argument("--no-offload", action="store_true", help="actor/ref param and optimizer offload off")
    r.add_argument("--tokens-per-gpu", type=int, default=None,
                   help="actor.ppo_max_token_len_per_gpu (log-prob passes: twice it); default the recipe's 18432, "
                        "9216 on an 80 GB card (README: the modes on an H100)")
    r.add_argument("--budget", type=float, default=560.0, help="seconds for all modes of this call")
    r.add_argument("--run-timeout", type=float, default=420.0, help="seconds for one mode")
    r.add_argument("--min-run-s", type=float, default=90.0, help="skip a mode with less time left")
    r.add_argument("--end", type=float, default=0.0,
                   help="the lease's end (epoch seconds; super_session.sh start passes it): each mode stops "
                        f"{END_MARGIN_S:.0f} s before it; 0: unknown")
    r.add_argument("--k", type=_positive, default=RECIPE_K,
                   help="drafts per verify step (mtp.num_speculative_tokens), the MTP depths trained with it "
                        "(mtp_num_layers) and the CUDA-graph ceiling (max_seqs x (k+1)); the recipe's 2 by default")
    r.add_argument("--override", action="append", help="one more Hydra override (repeatable)")
    r.add_argument("--silence-s", type=float, default=200.0, help="stop a run that prints nothing this long")
    r.add_argument("--echo", action="store_true")
    r.add_argument("--stack", choices=("standins", "te"), default="standins",
                   help="te: Transformer Engine, causal_conv1d and the recipe's packed batches, fused attention, "
                        "recompute and vLLM batch sizes (../shared/tools/h200-te); standins: the TE-free set-up")
    r.add_argument("--reward", help="reward file (default: the CPU harness's count-on reward)")
    r.add_argument("--response-len", type=int, help="data.max_response_length (default: assets.json answer_len)")
    r.add_argument("--seed", type=int, default=0, help="data.seed (the data order; same for every mode)")
    r.add_argument("--preflight", action="store_true",
                   help="only the plugin's start-up check of each mode with these overrides, here (no GPU), then exit")
    r.add_argument("--import-check", action="store_true",
                   help="run import_check.py first (report in <out>/import_check.json); no run if a module is missing")
    t = sub.add_parser("table", help="markdown per-step tables from summary.json files")
    t.add_argument("summaries", nargs="+")
    t = sub.add_parser("plot", help="reward, first-draft acceptance and gen time per step of the modes' runs")
    t.add_argument("out")
    t.add_argument("summaries", nargs="+")
    t.add_argument("--title", default=None, help="default: the cards the summaries name (nvidia-smi), Super's widths")
    t = sub.add_parser("compare", help="the modes over their last steps: table, done-criteria, gen-time factors")
    t.add_argument("summaries", nargs="+")
    t.add_argument("--last", type=_positive, default=10, help="the last N logged steps of each mode")
    t.add_argument("--steps", type=step_range, default=None,
                   help="FIRST-LAST: these steps of every mode instead of the last N (runs of unequal length)")
    t.add_argument("--json", help="write the comparison here")
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        return cmd_compare(a)
    if a.cmd == "plot":
        return cmd_plot(a)
    if a.cmd == "table":
        return cmd_table(a)
    if a.cmd == "assets":
        print(json.dumps(build_assets(pathlib.Path(a.dir), answer_len=a.answer_len, warmup_steps=a.warmup_steps,
                                      lr=a.lr, device=a.device), indent=1))
        return 0
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
