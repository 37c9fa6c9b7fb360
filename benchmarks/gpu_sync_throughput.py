"""P4: MTP weight sync throughput on the GPU vs the device's copy bandwidth.

Measured per sync, on the same GPU, CUDA events, several repetitions:

* ``export``: Megatron MTP parameters -> HF-layout ``(name, tensor)`` pairs. Uses
  ``verl_mtp_plugin.export.export_mtp_weights(model, vocab_size=...)`` when that module exists;
  otherwise the equivalent done here (``_equivalent_export``: Megatron -> HF renames, the fused
  ``linear_qkv`` split into ``q/k/v`` with copies, experts as separate ``up_proj/down_proj``
  tensors), and the result says which ran.
* ``load``: the tensor copies a vLLM drafter load does with those tensors: ``q/k/v`` into the
  packed ``qkv_proj`` rows, per-expert ``up_proj`` / ``down_proj`` into the stacked
  ``w13_weight [E, I, H]`` / ``w2_weight [E, H, I]``, the router into its fp32 ``gate.weight``,
  everything else ``copy_`` into a parameter of the same shape (buffers preallocated once, like
  the drafter's parameters).
* ``d2d``: one ``copy_`` of the same number of bytes, and of 1 GiB (the device's copy bandwidth).

GB/s = bytes of MTP weights delivered / time (payload, counted once; a copy reads and writes each
byte, so the DRAM traffic is twice that).

Run: ``python benchmarks/gpu_sync_throughput.py`` (builds the benchmark model) or from
``gpu_bench_all.py`` (reuses P2's online model).
"""

from __future__ import annotations

import re

import gpu_common as C
import torch


def _equivalent_export(model):
    """Yield ``(hf_name, tensor)`` for the MTP block of a local-spec HybridModel (HF Nemotron-H names,
    MTP pattern ``*E``: inner layer ``i`` -> HF ``mtp.layers.{d*L+i}``)."""
    from verl_mtp_plugin.control import unwrap_model

    inner = unwrap_model(model)
    cfg = inner.config
    pattern_len = len(inner.hybrid_layer_pattern.split("/")[1])
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    hd = cfg.kv_channels or cfg.hidden_size // heads
    per = heads // groups
    sd = dict(inner.named_parameters())
    sd.update({n: b for n, b in inner.named_buffers() if n.startswith("mtp.")})
    pat = re.compile(r"mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\.(.*)")
    for name, t in sd.items():
        if not name.startswith("mtp."):
            continue
        m = pat.match(name)
        if m is None:
            d, rest = name.split(".")[2], name.split(".", 3)[3]
            i = pattern_len - 1 if rest.startswith("final_layernorm") else 0
            yield f"mtp.layers.{int(d) * pattern_len + i}.{rest}", t
            continue
        d, i, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        pre = f"mtp.layers.{d * pattern_len + i}"
        if rest in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
            yield f"{pre}.norm.weight", t
        elif rest == "self_attention.linear_qkv.weight":
            w = t.view(groups, per + 2, hd, -1)
            yield f"{pre}.mixer.q_proj.weight", w[:, :per].reshape(heads * hd, -1).contiguous()
            yield f"{pre}.mixer.k_proj.weight", w[:, per].reshape(groups * hd, -1).contiguous()
            yield f"{pre}.mixer.v_proj.weight", w[:, per + 1].reshape(groups * hd, -1).contiguous()
        elif rest == "self_attention.linear_proj.weight":
            yield f"{pre}.mixer.o_proj.weight", t
        elif rest == "mlp.router.weight":
            yield f"{pre}.mixer.gate.weight", t
        elif rest == "mlp.router.expert_bias":
            yield f"{pre}.mixer.gate.e_score_correction_bias", t
        elif rest.startswith("mlp.shared_experts.linear_fc"):
            yield f"{pre}.mixer.shared_experts.{'up' if 'fc1' in rest else 'down'}_proj.weight", t
        elif rest.startswith("mlp.experts.local_experts."):
            e = int(rest.split(".")[3])
            yield f"{pre}.mixer.experts.{e}.{'up' if 'fc1' in rest else 'down'}_proj.weight", t
        elif rest.startswith("mlp.fc1_latent_proj") or rest.startswith("mlp.fc2_latent_proj"):
            yield f"{pre}.mixer.{rest.split('.')[1]}.weight", t
        else:
            raise KeyError(f"no HF name for MTP parameter {name}")


def _exporter(model, vocab):
    """(callable returning the list of (hf_name, tensor), description)."""
    try:
        from verl_mtp_plugin.export import export_mtp_weights  # issue's API, if present
    except Exception as e:  # module absent or not importable: measure the equivalent
        return (lambda: list(_equivalent_export(model))), f"equivalent in benchmarks/gpu_sync_throughput.py ({e!r})"
    try:
        pairs = list(export_mtp_weights(model, vocab_size=vocab))
        if not pairs:
            raise ValueError("export_mtp_weights yielded nothing")
    except Exception as e:
        return (lambda: list(_equivalent_export(model))), f"equivalent (export_mtp_weights failed: {e!r})"
    return (lambda: list(export_mtp_weights(model, vocab_size=vocab))), "verl_mtp_plugin.export.export_mtp_weights"


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


def main(model=None, reps: int = 10):
    if model is None:
        C.setup()
        from verl_mtp_plugin import configure_transformer_config

        model = C.build(C.bench_spec(), config_overrides=configure_transformer_config({}, "online"))
    spec_vocab = model.vocab_size if hasattr(model, "vocab_size") else None
    export, how = _exporter(model, spec_vocab)
    pairs = export()
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


if __name__ == "__main__":
    main()
