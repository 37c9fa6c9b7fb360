"""hybrid_forward + the policy table on a tiny Nemotron-3-shaped HybridModel (CPU or GPU).

./run python examples/phase_forward.py
"""

from verl_mtp_plugin import Phase, collect_mtp_metrics, configure_transformer_config, hybrid_forward, run_mtp_forward
from verl_mtp_plugin.testing import build_tiny_hybrid, init_megatron, make_batch

init_megatron()
model = build_tiny_hybrid()  # main "M*-E" + MTP "*E"
configure_transformer_config(model.config, "online", mtp_loss_scaling_factor=0.3)
b = make_batch(batch=2, seq=16, prompt_len=6)

for phase in (Phase.LOGPROB, Phase.TRAIN):
    run = run_mtp_forward("online", phase)
    logits = hybrid_forward(model, b["input_ids"], b["position_ids"], b["attention_mask"],
                            run_mtp_forward=run, loss_mask=b["response_mask"])
    logits.float().logsumexp(-1).mean().backward()
    mtp_grads = sum(1 for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None)
    print(f"{phase.value:8s} run_mtp_forward={run!s:5s} logits {tuple(logits.shape)} "
          f"MTP params with grad: {mtp_grads}  metrics: {collect_mtp_metrics()}")
    model.zero_grad(set_to_none=True)
