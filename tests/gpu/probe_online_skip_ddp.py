"""Probe (not a test): megatron DDP with overlap_grad_reduce=True in ONLINE mode (MTP trainable) when a
training step skips the MTP forward after a step that ran it. Megatron fixes each bucket's expected
grad-ready counts in the first step; a later step whose MTP params produce no gradient never issues
that bucket's reduction, and ``finish_grad_sync`` is expected to fail its assertion. The plugin's
policy runs the MTP forward on every online training step, so this is the hazard it avoids; the probe
records what megatron-core does. Prints one line; exit code 0 either way.
"""

import gpu_case as G
import torch


def main():
    from verl_mtp_plugin import hybrid_forward
    from verl_mtp_plugin.testing import init_megatron
    from verl_mtp_plugin.testing.gpu import megatron_ddp_and_optimizer
    from verl_mtp_cpu.mamba_triton import install_mamba_ssm_triton

    install_mamba_ssm_triton()
    init_megatron(seed=5)
    m = G.build("online")
    ddp, opt = megatron_ddp_and_optimizer(m, overlap_grad_reduce=True)
    b = G.batch(seed=4)
    outcome = []
    for step, run_mtp in enumerate((True, False, True)):
        try:
            ddp.zero_grad_buffer()
            opt.zero_grad()
            logits = hybrid_forward(ddp, b["input_ids"], b["position_ids"], b["attention_mask"], run_mtp_forward=run_mtp)
            G.rl_loss(logits, b).backward()
            ddp.finish_grad_sync()
            opt.step()
            torch.cuda.synchronize()
            outcome.append(f"step{step}(mtp={run_mtp}): ok")
        except Exception as e:  # the point of the probe
            outcome.append(f"step{step}(mtp={run_mtp}): {type(e).__name__}: {str(e)[:160]}")
            break
    print("[probe online+skip, DDP overlap_grad_reduce=True] " + " | ".join(outcome), flush=True)


if __name__ == "__main__":
    main()
