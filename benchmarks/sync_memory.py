"""Peak memory one online drafter sync adds on a rollout worker: before vs after, side by side (CPU).

A rollout worker receives one weight update as buckets and hands each to
``MTPDrafterSync.route`` (``rollout/worker/drafter_sync.py``), then ``finish`` loads the MTP part into vLLM's real
``NemotronHMTP`` drafter (layerwise reload). ``MTPDrafterSync.sync`` does the same from a stream.
Two implementations are measured, each in a fresh process, on the same model and stream:

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

    .venv/bin/python benchmarks/sync_memory.py            # or ./run python benchmarks/sync_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

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
    import itertools  # noqa: F401

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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--latent", type=int, default=256)
    p.add_argument("--bucket-tensors", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"))
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args)), flush=True)
        return
    results = {}
    for path in ("worker", "stream"):
        for variant in ("before", "after"):
            cmd = [sys.executable, __file__, "--child", variant, path] + [
                a for a in sys.argv[1:]
            ]
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


if __name__ == "__main__":
    main()
