"""A checkpoint with Nemotron 3 Super's layer widths, pretrained on the GPU in minutes, for verl's trainer.

``python benchmarks/h200_main_ppo/super_assets.py DIR`` (on the GPU machine; ~4-6 min on one H200) writes
``DIR/model`` (HF Nemotron-H ``config.json`` + ``model.safetensors`` in bf16 + the tokenizer), ``DIR/data``
(train/val parquet in verl's RL layout) and ``DIR/assets.json`` (shape, parameter count, pretraining curve).

**Widths: Nemotron 3 Super's** (``SUPER_WIDTHS``): hidden 4096, vocab 131072, 32 attention heads / 2 KV heads of 128,
Mamba 128 heads x 64 with state 128 and 8 groups, latent MoE 1024 with expert intermediate 2688 and a 5376 shared
expert, squared ReLU, untied embeddings, one MTP block ``*E`` trained over 2 repeated depths (as Megatron-Bridge's
Super recipes: ``mtp_num_layers=2``, ``mtp_use_repeated_layer``, loss factor 0.3). **Cut** in depth (``--pattern``,
default ``MEM*EME``: 3 Mamba, 3 MoE, 1 attention of Super's 40 / 40 / 8) and in routed experts (``--experts``,
default 16 top-4 of Super's 512 top-22), so that actor, reference and vLLM fit one H200 with the recipe's offload.

**Task: two rules, long responses of varying length.** A prompt ``count a b``; a response is L digits, L uniform
in ``[--min-len, --max-len]`` (default 256..384, so a rollout has a tail), then ``</s>``. Pretraining rule (the
trunk and the MTP block together, next-token + MTP loss): each next digit repeats the digit two back with
probability 0.7, else counts on by one; then the MTP block alone on the repeat rule without exceptions (its
drafts follow "two back" with a clear margin). The reward (``reward_long.py``) pays for the other rule: the
fraction of the response's steps that count on by one. GRPO moves the policy off the rule the MTP head learned
while the reward rises: a frozen drafter falls behind, an online one can follow.

Built with the testing package's megatron ``HybridModel`` (local layer spec, fp32 weights with TF32 matmuls,
mamba_ssm's Triton kernels); verl's trainer then loads the HF checkpoint through Megatron-Bridge with Transformer
Engine. Seeded (``--seed``): the data and initialisation repeat; GPU kernels are not bit-reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(REPO / "cpu_runtime")):  # the product and its CPU runtime (verl_mtp_cpu)
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: Nemotron 3 Super's layer widths (HF config of NVIDIA-Nemotron-3-Super-120B-A12B; see the reference notes)
SUPER_WIDTHS = dict(vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_query_groups=2,
                    mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8, moe_latent_size=1024,
                    moe_ffn_hidden_size=2688, moe_shared_expert_intermediate_size=5376, ffn_hidden_size=2688)


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for n, p in model.named_parameters() if ".mtp." in f".{n}" or n.startswith("mtp."))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "mtp": mtp, "routed_experts": experts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--pattern", default="MEM*EME", help="main layers (Super: 40 M, 40 E, 8 *)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--steps", type=int, default=160, help="joint pretraining steps (trunk + MTP)")
    ap.add_argument("--mtp-steps", type=int, default=40, help="then MTP block alone on the pure repeat rule")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seconds", type=float, default=420.0,
                    help="time cap of the pretraining (both phases); a phase it ends early gives another checkpoint "
                         "(assets.json: complete false; run.py compare warns)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-rows", type=int, default=2048)
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny widths on CPU: checks the script, not a model")
    a = ap.parse_args(argv)
    widths = dict(SUPER_WIDTHS)
    dev = "cuda"
    if a.cpu_dry_run:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        widths.update(vocab_size=64, hidden_size=64, num_attention_heads=2, num_query_groups=1, mamba_head_dim=16,
                      mamba_state_dim=16, mamba_num_groups=1, moe_latent_size=32, moe_ffn_hidden_size=32,
                      moe_shared_expert_intermediate_size=32, ffn_hidden_size=64)
        dev = "cpu"

    import pandas as pd
    import torch

    from verl_mtp_plugin.control import configure_transformer_config, hybrid_forward
    from verl_mtp_cpu.assets import WARMUP_REPEAT, demo_tokenizer, task_rows, warmup_response
    from verl_mtp_cpu.vllm_engine import write_model_dir
    from verl_mtp_plugin.metrics import collect_mtp_metrics, reset_mtp_metrics
    from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid, causal_mask, init_megatron

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    root = pathlib.Path(a.dir)
    t_all = time.time()
    init_megatron(seed=a.seed)
    spec = TinyHybridSpec(pattern=f"{a.pattern}/*E/*E", num_experts=a.experts, moe_topk=a.topk,
                          max_sequence_length=1024, mtp_use_repeated_layer=True, mtp_loss_scaling_factor=0.3,
                          params_dtype=torch.float32, **widths)
    tok = demo_tokenizer(spec.vocab_size)
    torch.manual_seed(a.seed)
    model = build_tiny_hybrid(spec, device=dev)
    n_params = count_params(model)
    print(f"model built in {time.time() - t_all:.0f} s: {n_params}", flush=True)
    configure_transformer_config(model.config, "joint", mtp_loss_scaling_factor=0.3)

    prompts = []
    for r in task_rows(256, "warmup", a.seed + 1):
        p = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        p = p["input_ids"] if hasattr(p, "keys") else p
        x, y = (int(v) for v in r["prompt"][0]["content"].split()[1:])
        prompts.append((list(p), x, y))
    plen = len(prompts[0][0])
    digit_ids = tok.convert_tokens_to_ids([str(d) for d in range(10)])
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    rng = random.Random(a.seed + 2)

    def batch(repeat: float):
        rows, lens = [], []
        for _ in range(a.batch):
            p, x, y = prompts[rng.randrange(len(prompts))]
            n = rng.randint(a.min_len, a.max_len)
            rows.append(p + [digit_ids[d] for d in warmup_response(x, y, rng, n=n, repeat=repeat)] + [eos])
            lens.append(len(rows[-1]))
        s = max(lens)
        ids = torch.full((a.batch, s), pad, dtype=torch.long)
        mask = torch.zeros(a.batch, s)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, plen : len(r)] = 1.0
        return ids.to(dev), mask.to(dev)

    curve = []
    deadline = time.time() + a.seconds

    def phase(steps: int, repeat: float, params, name: str, lr: float) -> int:
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        warm = max(1, steps // 10)
        done = 0
        t0 = time.time()
        for i in range(steps):
            if time.time() > deadline:
                print(f"{name}: time cap after {i} steps", flush=True)
                break
            for g in opt.param_groups:
                g["lr"] = lr * ((i + 1) / warm if i < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, steps - warm))))
            ids, mask = batch(repeat)
            b, s = ids.shape
            pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s).contiguous()
            opt.zero_grad(set_to_none=True)
            reset_mtp_metrics()
            logits = hybrid_forward(model, ids, pos, causal_mask(s, device=dev), run_mtp_forward=True,
                                    loss_mask=mask)
            logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
            tgt = ids[:, 1:]
            m = mask[:, 1:]
            loss = -(logp.gather(-1, tgt[..., None])[..., 0] * m).sum() / m.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            done = i + 1
            if done % 10 == 0 or done == steps or i == 0:
                mm = collect_mtp_metrics(num_microbatches=1)
                row = {"phase": name, "step": done, "loss": float(loss.detach()), "seconds": round(time.time() - t0, 1),
                       **{k: float(v) for k, v in mm.items() if "mtp_1" in k or "mtp_2" in k}}
                curve.append(row)
                print(json.dumps(row), flush=True)
        return done

    joint_done = phase(a.steps, WARMUP_REPEAT, list(model.parameters()), "joint", a.lr)  # the demo's mixture
    mtp_params = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    assert mtp_params, "no MTP parameters"
    mtp_done = phase(a.mtp_steps, 1.0, mtp_params, "mtp_only", a.lr)
    reset_mtp_metrics()

    model.eval()
    t_w = time.time()
    write_model_dir(root / "model", spec, model=model, dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    tok.save_pretrained(str(root / "model"))
    (root / "data").mkdir(parents=True, exist_ok=True)
    pd.DataFrame(task_rows(a.train_rows, "train", a.seed)).to_parquet(root / "data" / "train.parquet")
    pd.DataFrame(task_rows(16, "test", a.seed + 7)).to_parquet(root / "data" / "val.parquet")
    info = {"spec": {k: str(v) for k, v in dataclasses.asdict(spec).items()}, "params": n_params,
            "args": vars(a), "prompt_len": plen, "answer_len": a.max_len + 1, "joint_steps": joint_done,
            "mtp_steps": mtp_done, "complete": (joint_done, mtp_done) == (a.steps, a.mtp_steps), "curve": curve,
            "write_s": round(time.time() - t_w, 1),
            "seconds": round(time.time() - t_all, 1),
            "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else None}
    (root / "assets.json").write_text(json.dumps(info, indent=1))
    if not info["complete"]:
        print(f"WARNING: the time cap (--seconds {a.seconds:g}) cut the pretraining: joint {joint_done} of {a.steps}, "
              f"MTP-only {mtp_done} of {a.mtp_steps} steps; this checkpoint is not the one a full pretraining gives",
              flush=True)
    print(json.dumps({k: v for k, v in info.items() if k != "curve"}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
