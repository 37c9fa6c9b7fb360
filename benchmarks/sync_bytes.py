"""Bytes the vLLM MTP drafter receives per weight sync, verl 0.9.1 vs the plugin.

verl 0.9.1's ``vLLMColocateWorkerExtension._update_weights`` hands every received bucket to
``load_weights`` of every model in ``_iter_all_models()``: with an MTP drafter, the drafter parses
100% of the payload, once per bucket, then is post-processed. The plugin
(``verl_mtp_plugin.rollout.worker.drafter_sync``) hands it only the ``mtp.*`` tensors, in one call (plus the embedding
and ``lm_head`` only when the drafter does not share them with the target).

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

Run: ``.venv/bin/python benchmarks/sync_bytes.py [--vllm] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", action="store_true", help="also load the tiny model into vLLM's CPU drafter and time it")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
