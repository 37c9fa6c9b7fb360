"""Cost of one MTP weight sync to the vLLM drafter: bytes it receives, memory it adds on a rollout worker,
GPU throughput. ``throughput`` writes a JSON to ``$OUT`` (or ``benchmarks/results/``); ``BENCH_TINY=1``
shrinks its shape so it runs on a CPU (timings then mean nothing).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import common as C
import torch


# bytes --------------------------------------------------------------------------------------------


BUCKET_MB = 2048  # verl's default actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes

SUPER_CONFIG = {
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4096,
    "num_hidden_layers": 88,
    "layer_counts": {"M": 40, "E": 40, "*": 8},
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "n_groups": 8,
    "n_routed_experts": 512,
    "n_shared_experts": 1,
    "moe_latent_size": 1024,
    "moe_intermediate_size": 2688,
    "moe_shared_expert_intermediate_size": 5376,
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
}


def _layer_shapes(prefix: str, ch: str, c: dict) -> dict[str, tuple[tuple[int, ...], int]]:
    """HF tensor name -> (shape, bytes per element) of one Nemotron-H layer."""
    H, bf, f32 = c["hidden_size"], 2, 4
    out = {f"{prefix}.norm.weight": ((H,), bf)}
    if ch == "M":
        d_inner = c["mamba_num_heads"] * c["mamba_head_dim"]
        gs = c["n_groups"] * c["ssm_state_size"]
        nh = c["mamba_num_heads"]
        conv = d_inner + 2 * gs
        out.update({
            f"{prefix}.mixer.in_proj.weight": ((2 * d_inner + 2 * gs + nh, H), bf),
            f"{prefix}.mixer.conv1d.weight": ((conv, 1, c["conv_kernel"]), bf),
            f"{prefix}.mixer.conv1d.bias": ((conv,), bf),
            f"{prefix}.mixer.dt_bias": ((nh,), bf),
            f"{prefix}.mixer.A_log": ((nh,), bf),
            f"{prefix}.mixer.D": ((nh,), bf),
            f"{prefix}.mixer.norm.weight": ((d_inner,), bf),
            f"{prefix}.mixer.out_proj.weight": ((H, d_inner), bf),
        })
    elif ch == "*":
        q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        out.update({
            f"{prefix}.mixer.q_proj.weight": ((q, H), bf),
            f"{prefix}.mixer.k_proj.weight": ((kv, H), bf),
            f"{prefix}.mixer.v_proj.weight": ((kv, H), bf),
            f"{prefix}.mixer.o_proj.weight": ((H, q), bf),
        })
    elif ch == "E":
        E, lat = c["n_routed_experts"], c["moe_latent_size"] or H
        MI, SI = c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
        out.update({
            f"{prefix}.mixer.gate.weight": ((E, H), bf),
            f"{prefix}.mixer.gate.e_score_correction_bias": ((E,), f32),
            f"{prefix}.mixer.shared_experts.up_proj.weight": ((SI, H), bf),
            f"{prefix}.mixer.shared_experts.down_proj.weight": ((H, SI), bf),
        })
        if c["moe_latent_size"]:
            out[f"{prefix}.mixer.fc1_latent_proj.weight"] = ((lat, H), bf)
            out[f"{prefix}.mixer.fc2_latent_proj.weight"] = ((H, lat), bf)
        for e in range(E):
            out[f"{prefix}.mixer.experts.{e}.up_proj.weight"] = ((MI, lat), bf)
            out[f"{prefix}.mixer.experts.{e}.down_proj.weight"] = ((lat, MI), bf)
    else:
        raise ValueError(ch)
    return out


def super_hf_tensors(c: dict = SUPER_CONFIG) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every HF tensor of Nemotron 3 Super (base + MTP): name -> (shape, element bytes)."""
    V, H = c["vocab_size"], c["hidden_size"]
    out = {"backbone.embeddings.weight": ((V, H), 2), "backbone.norm_f.weight": ((H,), 2), "lm_head.weight": ((V, H), 2)}
    i = 0
    for ch, n in c["layer_counts"].items():
        for _ in range(n):
            out.update(_layer_shapes(f"backbone.layers.{i}", ch, c))
            i += 1
    pat = c["mtp_hybrid_override_pattern"]
    for j, ch in enumerate(pat):
        p = f"mtp.layers.{j}"
        out.update(_layer_shapes(p, ch, c))
        if j == 0:
            out.update({f"{p}.enorm.weight": ((H,), 2), f"{p}.hnorm.weight": ((H,), 2), f"{p}.eh_proj.weight": ((H, 2 * H), 2)})
        if j == len(pat) - 1:
            out[f"{p}.final_layernorm.weight"] = ((H,), 2)
    return out


def _row(name, sizes: dict[str, int], shared_embed_head: bool = True):
    """sizes: HF name -> bytes."""
    from verl_mtp_plugin.rollout.worker.drafter_sync import is_mtp_name

    total = sum(sizes.values())
    mtp = sum(b for n, b in sizes.items() if is_mtp_name(n))
    n_mtp = sum(1 for n in sizes if is_mtp_name(n))
    extra = sizes["backbone.embeddings.weight"] + sizes["lm_head.weight"]
    buckets = max(1, -(-total // (BUCKET_MB << 20)))
    return {
        "model": name,
        "tensors": len(sizes),
        "payload_bytes": total,
        "mtp_tensors": n_mtp,
        "mtp_bytes": mtp,
        "verl_drafter_bytes": total,  # every bucket to the drafter
        "verl_drafter_load_calls": buckets,
        "plugin_drafter_bytes": mtp,
        "plugin_drafter_bytes_unshared_embed_head": mtp + extra,
        "plugin_drafter_load_calls": 1,
        "plugin_share": mtp / total,
        "plugin_share_unshared": (mtp + extra) / total,
    }


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.1f} {unit}" if unit != "B" else f"{int(b):,} B"
        b /= 1024
    return str(b)


def tiny_row(use_vllm: bool, rounds: int) -> tuple[dict, dict]:
    from verl_mtp_plugin.export import export_mtp_weights
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid, init_megatron
    from verl_mtp_plugin.rollout.worker.drafter_sync import route_weights

    init_megatron(seed=0)
    spec = TinyHybridSpec(make_vocab_size_divisible_by=48)
    model = build_tiny_hybrid(spec)
    full = list(export_mtp_weights(model, include_backbone=True, vocab_size=spec.vocab_size))
    sizes = {n: t.numel() * t.element_size() for n, t in full}
    row = _row("tiny (M*-E/*E, fp32)", sizes)
    _, to_drafter = route_weights(full)
    row["plugin_drafter_bytes_measured"] = int(sum(t.numel() * t.element_size() for _, t in to_drafter))
    timing = {}
    if use_vllm:
        timing = _time_tiny(spec, full, rounds, row)
    return row, timing


def _time_tiny(spec, full, rounds, row) -> dict:
    """Drafter share of one sync on vLLM's CPU models, verl 0.9.1's path vs the plugin's, alternating."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from verl_mtp_cpu.vllm_drafter import build_drafter_for_spec
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync

    vm = build_drafter_for_spec(spec, workdir=tempfile.mkdtemp(prefix="sync_bytes_"))
    sync = MTPDrafterSync(vm.target, vm.drafter, vm.draft_model_config, vllm_config=vm.vllm_config)
    bucket = [(n, t.clone()) for n, t in full]
    verl_s, plugin_s = [], []

    def verl_path():  # verl 0.9.1 _update_weights + step 3, drafter part only
        t = time.perf_counter()
        with set_current_vllm_config(vm.vllm_config):
            vm.drafter.load_weights(bucket)
            process_weights_after_loading(vm.drafter, vm.draft_model_config, torch.device("cpu"))
        return time.perf_counter() - t

    def plugin_path():
        m = sync.sync(bucket, load_target=None)
        row["plugin_drafter_bytes_measured"] = int(m["sync/bytes_drafter"])
        return m["sync/drafter_seconds"]

    for _ in range(2):  # warm-up
        plugin_path(), verl_path()
    for _ in range(rounds):
        plugin_s.append(plugin_path())
        verl_s.append(verl_path())
    return {
        "rounds": rounds,
        "verl_drafter_ms_median": 1e3 * statistics.median(verl_s),
        "plugin_drafter_ms_median": 1e3 * statistics.median(plugin_s),
        "verl_drafter_ms_min": 1e3 * min(verl_s),
        "plugin_drafter_ms_min": 1e3 * min(plugin_s),
    }


def _bytes_arguments(ap):
    ap.add_argument("--vllm", action="store_true", help="also load the tiny model into vLLM's CPU drafter and time it")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the results here")


def sync_bytes(args) -> int:
    """Bytes the vLLM MTP drafter receives per weight sync, verl 0.9.1 vs the plugin.

    verl 0.9.1's ``vLLMColocateWorkerExtension._update_weights`` hands every received bucket to
    ``load_weights`` of every model in ``_iter_all_models()``: with an MTP drafter, the drafter parses
    100% of the payload, once per bucket, then is post-processed. The plugin
    (``verl_mtp_plugin.rollout.worker.drafter_sync``) hands it only the ``mtp.*`` tensors, in one call (plus the
    embedding and ``lm_head`` only when the drafter does not share them with the target).

    Rows:

    * ``tiny``: the test model (megatron-core ``HybridModel`` ``M*-E/*E``: Mamba, attention, MLP, MoE
      with latent projections and a shared expert; MTP ``*E``), exported for real with
      ``export_mtp_weights(include_backbone=True)``; the plugin's bytes are the ones its routing code
      reports (``MTPDrafterSync`` metrics with ``--vllm``, ``route_weights`` otherwise).
    * ``Nemotron 3 Super``: every HF tensor shape computed from its ``config.json`` (88 layers: 40 Mamba,
      40 MoE, 8 attention; 512 experts, latent 1024; MTP ``*E``), bf16 except the fp32
      ``e_score_correction_bias``. Layer order does not change byte counts.

    With ``--vllm`` the tiny model is also loaded into vLLM 0.31's real CPU target + drafter, and the
    drafter's share of the sync is timed both ways in alternating rounds (CPU, tiny: a ratio, not a
    GPU figure).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    tiny, timing = tiny_row(args.vllm, args.rounds)
    from verl_mtp_plugin.export import expected_hf_mtp_keys

    sup = super_hf_tensors()
    assert {n for n in sup if n.startswith("mtp.")} == expected_hf_mtp_keys(SUPER_CONFIG)  # the 1040 HF MTP keys
    sup_row = _row("Nemotron 3 Super (bf16, from config)", {n: int(torch.Size(s).numel()) * b for n, (s, b) in sup.items()})
    rows = [tiny, sup_row]

    print("\nBytes handed to the vLLM MTP drafter per weight sync (drafter shares embedding/lm_head with the target)")
    head = ["model", "tensors", "payload", "MTP tensors", "MTP bytes", "drafter: verl 0.9.1", "drafter: plugin",
            "plugin share", "load calls verl/plugin", "plugin, unshared emb/head"]
    table = [head]
    for r in rows:
        table.append([
            r["model"], f"{r['tensors']:,}", _fmt_bytes(r["payload_bytes"]), f"{r['mtp_tensors']:,}",
            _fmt_bytes(r["mtp_bytes"]), f"{_fmt_bytes(r['verl_drafter_bytes'])} (100%)",
            _fmt_bytes(r["plugin_drafter_bytes"]), f"{100 * r['plugin_share']:.2f}%",
            f"{r['verl_drafter_load_calls']}/{r['plugin_drafter_load_calls']}",
            f"{_fmt_bytes(r['plugin_drafter_bytes_unshared_embed_head'])} ({100 * r['plugin_share_unshared']:.2f}%)",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    assert tiny["plugin_drafter_bytes_measured"] == tiny["plugin_drafter_bytes"], tiny
    print(f"\ntiny: plugin routing code measured {tiny['plugin_drafter_bytes_measured']:,} B to the drafter "
          f"(= MTP bytes); verl bucket size {BUCKET_MB} MiB -> drafter load_weights calls per sync: verl = #buckets, plugin = 1")
    if timing:
        print(f"tiny on vLLM CPU, drafter part of one sync, {timing['rounds']} alternating rounds: "
              f"verl path median {timing['verl_drafter_ms_median']:.1f} ms (min {timing['verl_drafter_ms_min']:.1f}), "
              f"plugin median {timing['plugin_drafter_ms_median']:.1f} ms (min {timing['plugin_drafter_ms_min']:.1f}); "
              f"ratio plugin/verl {timing['plugin_drafter_ms_median'] / timing['verl_drafter_ms_median']:.2f} "
              "(plugin includes the name checks and the layerwise reload)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "tiny_timing": timing, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


# memory -------------------------------------------------------------------------------------------


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.peak = max(self.peak, rss())
        self._stop.set()
        self._t.join()

    @property
    def added(self) -> int:
        return self.peak - self.base


def _old_sync_class():
    """The previous MTPDrafterSync behaviour (whole stream listed; staged tensors kept through the load)."""
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync

    class BeforeSync(MTPDrafterSync):
        def sync(self, weights, *, load_target=None, bucket_tensors=None):
            self.begin()
            try:
                pairs = list(weights)
                step = bucket_tensors or max(len(pairs), 1)
                for i in range(0, len(pairs), step):
                    part = self.route(pairs[i : i + step])
                    if load_target is not None and part:
                        load_target(part)
            except BaseException:
                self.abort()
                raise
            return self.finish()

        def _load_drafter(self, pending):
            keep = list(pending)  # the previous code passed iter(pending): every tensor stayed referenced
            self.verify_checksums, saved = True, self.verify_checksums
            try:
                # verify_checksums=True makes the current code feed iter(pending) (no release); the
                # digest comparison itself is skipped below
                self._verify_digests = lambda _p: None
                return super()._load_drafter(keep)
            finally:
                self.verify_checksums = saved

    return BeforeSync


def child(variant: str, path: str, args) -> dict:
    import torch

    from verl_mtp_plugin.export import export_mtp_weights
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid, init_megatron
    from verl_mtp_cpu.vllm_drafter import build_drafter_for_spec
    from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync

    init_megatron(seed=0)
    spec = TinyHybridSpec(
        pattern="M*-E/*E", hidden_size=args.hidden, vocab_size=args.vocab, num_experts=args.experts,
        moe_ffn_hidden_size=args.moe_ffn, moe_latent_size=args.latent, moe_shared_expert_intermediate_size=args.moe_ffn,
        ffn_hidden_size=2 * args.hidden, num_attention_heads=8, num_query_groups=2, mamba_head_dim=32,
    )
    models = build_drafter_for_spec(spec, workdir=f"/tmp/sync_memory_{os.getpid()}")
    model = build_tiny_hybrid(spec, device="cpu")
    source = [(n, t.detach().clone()) for n, t in export_mtp_weights(model, include_backbone=True)]
    del model
    payload = sum(t.numel() * t.element_size() for _, t in source)
    mtp = sum(t.numel() * t.element_size() for n, t in source if n.startswith("mtp."))
    cls = _old_sync_class() if variant == "before" else MTPDrafterSync
    sync = cls(models.target, models.drafter, models.draft_model_config, vllm_config=models.vllm_config, mode="online")
    bucket = args.bucket_tensors
    for _ in range(args.warmup):  # first load allocates vLLM's reload metadata
        sync.sync(iter(source), bucket_tensors=bucket)

    if path == "worker":
        buf = torch.empty(max(t.numel() for _, t in source) * bucket, dtype=torch.float32)

        def run():
            sync.begin()
            for i in range(0, len(source), bucket):
                views, off = [], 0
                for n, t in source[i : i + bucket]:
                    v = buf[off : off + t.numel()].view(t.shape)
                    v.copy_(t)
                    views.append((n, v))
                    off += t.numel()
                sync.route(views)
            sync.finish()
    else:

        def produce():
            for n, t in source:
                yield n, t.clone()  # an export generator materialises each tensor on demand

        def run():
            sync.sync(produce(), bucket_tensors=bucket)

    import gc

    gc.collect()
    samples = []
    for _ in range(args.repeats):
        with PeakSampler() as s:
            run()
        samples.append(s.added)
        gc.collect()
    return {"variant": variant, "path": path, "payload_bytes": payload, "mtp_bytes": mtp, "added_bytes": min(samples)}


def _memory_arguments(p):
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--latent", type=int, default=256)
    p.add_argument("--bucket-tensors", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"))


def memory(args):
    """Peak memory one online drafter sync adds on a rollout worker: before vs after, side by side (CPU).

    A rollout worker receives one weight update as buckets and hands each to ``MTPDrafterSync.route``
    (``rollout/worker/drafter_sync.py``), then ``finish`` loads the MTP part into vLLM's real ``NemotronHMTP``
    drafter (layerwise reload). ``MTPDrafterSync.sync`` does the same from a stream. Two implementations are
    measured, each in a fresh process, on the same model and stream:

    * ``before``: the previous code, kept here for the comparison: ``sync`` materialised the whole
      stream (``list(weights)``) before routing it, and ``finish`` kept every staged MTP tensor alive
      until the drafter load had finished;
    * ``after``: the current ``MTPDrafterSync``: ``sync`` holds one bucket at a time and ``finish``
      releases each staged tensor as soon as vLLM has consumed it.

    Both keep the copy of the MTP part that verify-before-load needs (see ``MTPDrafterSync.route``).

    Two paths per implementation: ``worker`` (buckets copied out of one reused transfer buffer, as verl's
    IPC receive does, routed with ``route``; the buffer itself is not counted), ``stream`` (``sync`` over
    a generator that produces each tensor on demand, as an export generator does). The figure is the peak
    resident memory during the sync minus the resident memory just before it (a 0.5 ms sampler over
    ``/proc/self/statm``; glibc's mmap threshold is fixed so freed tensors leave the resident set at
    once), with the payload sizes for scale.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args)), flush=True)
        return
    results = {}
    for path in ("worker", "stream"):
        for variant in ("before", "after"):
            cmd = [sys.executable, __file__, "memory", "--child", variant, path] + args.argv
            # fixed mmap threshold: glibc then returns every freed large tensor to the OS at once, so the
            # resident size follows live memory (the dynamic threshold would keep freed memory resident)
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(out.stderr[-3000:])
                raise SystemExit(f"child {variant} {path} failed")
            results[(path, variant)] = json.loads(line[len("RESULT "):])
    mib = 1 << 20
    first = next(iter(results.values()))
    print(f"payload {first['payload_bytes'] / mib:.1f} MiB, of which MTP {first['mtp_bytes'] / mib:.1f} MiB; "
          f"bucket = {args.bucket_tensors} tensors; peak RSS added by one online sync (min of {args.repeats})")
    print(f"{'path':8} {'before MiB':>11} {'after MiB':>10} {'after/before':>13} {'before/MTP':>11} {'after/MTP':>10}")
    for path in ("worker", "stream"):
        b, a = results[(path, "before")]["added_bytes"], results[(path, "after")]["added_bytes"]
        m = first["mtp_bytes"]
        print(f"{path:8} {b / mib:11.1f} {a / mib:10.1f} {a / b if b else float('nan'):13.2f} {b / m:11.2f} {a / m:10.2f}")


# throughput ---------------------------------------------------------------------------------------


class _DrafterBuffers:
    """Destination tensors in vLLM's drafter layout, preallocated from one export; ``load`` copies."""

    def __init__(self, pairs, dev):
        self.plan = []  # (hf_name, destination view)
        qkv, experts = {}, {}
        for n, t in pairs:
            if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                qkv.setdefault(n.rsplit(".", 2)[0], {})[n.rsplit(".", 2)[1][0]] = t
            elif ".experts." in n and ".shared_experts." not in n:
                pre, e, kind = re.match(r"(.*\.experts)\.(\d+)\.(up|down)_proj\.weight", n).groups()
                experts.setdefault((pre, kind), {})[int(e)] = t
        self.owned = []
        for pre, d in qkv.items():
            rows = [d["q"].shape[0], d["k"].shape[0], d["v"].shape[0]]
            buf = torch.empty(sum(rows), d["q"].shape[1], dtype=d["q"].dtype, device=dev)
            self.owned.append(buf)
            off = 0
            for k, r in zip("qkv", rows):
                self.plan_add(f"{pre}.{k}_proj.weight", buf[off:off + r])
                off += r
        for (pre, kind), d in experts.items():
            n_e = max(d) + 1
            t0 = d[0]
            buf = torch.empty(n_e, *t0.shape, dtype=t0.dtype, device=dev)  # w13 [E, I, H] / w2 [E, H, I]
            self.owned.append(buf)
            for e in range(n_e):
                self.plan_add(f"{pre}.{e}.{kind}_proj.weight", buf[e])
        have = {n for n, _ in self.plan}
        for n, t in pairs:
            if n in have:
                continue
            dtype = torch.float32 if n.endswith(("gate.weight", "e_score_correction_bias")) else t.dtype
            buf = torch.empty(t.shape, dtype=dtype, device=dev)
            self.owned.append(buf)
            self.plan_add(n, buf)
        self.dest = dict(self.plan)

    def plan_add(self, name, view):
        self.plan.append((name, view))

    def load(self, pairs):
        missing = []
        for n, t in pairs:
            d = self.dest.get(n)
            if d is None:
                missing.append(n)
                continue
            d.copy_(t)
        if missing:
            raise KeyError(f"drafter has no destination for {missing[:5]}")


def throughput(model=None, reps: int = 10):
    """MTP weight sync throughput on the GPU vs the device's copy bandwidth.

    Measured per sync, on the same GPU, CUDA events, several repetitions:

    * ``export``: Megatron MTP parameters -> HF-layout ``(name, tensor)`` pairs with
      ``verl_mtp_plugin.export.export_mtp_weights(model, vocab_size=...)`` (the result's ``export_impl``).
    * ``load``: the tensor copies a vLLM drafter load does with those tensors: ``q/k/v`` into the
      packed ``qkv_proj`` rows, per-expert ``up_proj`` / ``down_proj`` into the stacked
      ``w13_weight [E, I, H]`` / ``w2_weight [E, H, I]``, the router into its fp32 ``gate.weight``,
      everything else ``copy_`` into a parameter of the same shape (buffers preallocated once, like
      the drafter's parameters).
    * ``d2d``: one ``copy_`` of the same number of bytes, and of 1 GiB (the device's copy bandwidth).

    GB/s = bytes of MTP weights delivered / time (payload, counted once; a copy reads and writes each
    byte, so the DRAM traffic is twice that). Builds the benchmark model; ``phase_cost.py gpu-all`` reuses
    its ``train`` online model. Writes ``gpu_sync_throughput.json``.
    """
    if model is None:
        C.setup()
        from verl_mtp_plugin import configure_transformer_config

        model = C.build(C.bench_spec(), config_overrides=configure_transformer_config({}, "online"))
    spec_vocab = model.vocab_size if hasattr(model, "vocab_size") else None
    from verl_mtp_plugin.export import export_mtp_weights

    how = "verl_mtp_plugin.export.export_mtp_weights"

    def export():
        return list(export_mtp_weights(model, vocab_size=spec_vocab))

    pairs = export()
    if not pairs:
        raise RuntimeError("export_mtp_weights yielded nothing")
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    mtp_param_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("mtp."))
    dev = C.device()
    bufs = _DrafterBuffers(pairs, dev)
    # exactness of the load (values land where vLLM's loader would put them)
    bufs.load(pairs)
    C.sync()
    exact = all(torch.equal(bufs.dest[n].to(t.dtype), t) for n, t in pairs)

    def t_export():
        return export()

    def t_load():
        bufs.load(pairs)

    def t_sync():
        bufs.load(export())

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    big = 1 << 30 if C.CUDA else 1 << 24
    src1 = torch.empty(big, dtype=torch.uint8, device=dev)
    dst1 = torch.empty_like(src1)
    res = C.time_variants(
        {
            "export": t_export,
            "load": t_load,
            "export_plus_load": t_sync,
            "d2d_same_bytes": lambda: dst.copy_(src),
            "d2d_1GiB": lambda: dst1.copy_(src1),
        },
        rounds=3, warmup=2, iters=reps,
    )
    gbps = {k: nbytes / (res[k]["min"] * 1e-3) / 1e9 for k in ("export", "load", "export_plus_load", "d2d_same_bytes")}
    gbps["d2d_1GiB"] = big / (res["d2d_1GiB"]["min"] * 1e-3) / 1e9
    kinds = {}
    for n, t in pairs:
        k = "experts" if (".experts." in n and ".shared_experts." not in n) else n.split(".", 3)[3]
        kinds[k] = kinds.get(k, 0) + 1
    out = {
        "env": C.env_info(),
        "export_impl": how,
        "tensors": len(pairs),
        "tensor_kinds": kinds,
        "bytes": nbytes,
        "mtp_param_bytes": mtp_param_bytes,
        "load_exact": exact,
        "timings_ms": res,
        "payload_GBps_at_min": gbps,
        "sync_over_d2d_1GiB": gbps["export_plus_load"] / gbps["d2d_1GiB"],
    }
    path = C.write_json("gpu_sync_throughput.json", out)
    print(
        f"[P4] export: {how} | {len(pairs)} tensors, {nbytes / 2**20:.1f} MiB (MTP params {mtp_param_bytes / 2**20:.1f} MiB) "
        f"| ms min/median: export {C.fmt_ms(res['export'])}, load {C.fmt_ms(res['load'])}, export+load "
        f"{C.fmt_ms(res['export_plus_load'])}, d2d same bytes {C.fmt_ms(res['d2d_same_bytes'])}, d2d 1GiB "
        f"{C.fmt_ms(res['d2d_1GiB'])} | payload GB/s: export+load {gbps['export_plus_load']:.0f}, load {gbps['load']:.0f}, "
        f"d2d same bytes {gbps['d2d_same_bytes']:.0f}, d2d 1GiB {gbps['d2d_1GiB']:.0f} | exact {exact}",
        flush=True,
    )
    print("[P4] wrote", path, flush=True)
    return out


COMMANDS = {
    "bytes": (sync_bytes, _bytes_arguments, None),
    "memory": (memory, _memory_arguments, None),
    "throughput": (throughput, None, lambda args: throughput()),
}


def main(argv=None):
    return C.run_subcommands(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    main()
