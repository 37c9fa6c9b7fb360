"""Megatron HybridModel MTP -> Hugging Face Nemotron-H export, on real megatron-core models (CPU).

The expected HF structure is Nemotron 3 Super's checkpoint (1040 MTP keys for 512 experts; vLLM
reference §9), generated from the structure at the test's expert count.
"""

import re

import pytest
import torch

from verl_mtp_plugin.export import (
    MTPExportError,
    drafter_layout,
    expected_hf_mtp_keys,
    export_mtp_weights,
    fuse_qkv,
    hf_mtp_digests,
    hf_mtp_pattern,
    megatron_to_hf_name,
    split_fused_qkv,
    tensor_digest,
)
from verl_mtp_plugin.testing import build_tiny_hybrid

pytestmark = pytest.mark.usefixtures("megatron_env")

# Nemotron 3 Super config.json fields that shape the MTP block (vllm.md §9).
SUPER_CONFIG = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 88,
    "hidden_size": 4096,
    "vocab_size": 131072,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_latent_size": 1024,
    "moe_intermediate_size": 2688,
    "moe_shared_expert_intermediate_size": 5376,
    "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
}

# Super's MTP structure at a small scale: one physical "*E" block applied twice
# (mtp_num_layers=2, mtp_use_repeated_layer=True), latent MoE, one shared expert.
SUPER_LIKE = dict(pattern="M*-E/*E/*E", mtp_use_repeated_layer=True, num_experts=8)


def _super_hf_keys(num_experts: int) -> set[str]:
    """Super's HF MTP key structure written out (independently of expected_hf_mtp_keys)."""
    keys = {f"mtp.layers.0.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "norm")}
    keys |= {f"mtp.layers.0.mixer.{x}_proj.weight" for x in "qkvo"}
    keys |= {f"mtp.layers.1.{n}" for n in ("norm.weight", "final_layernorm.weight", "mixer.gate.weight")}
    keys |= {"mtp.layers.1.mixer.gate.e_score_correction_bias"}
    keys |= {f"mtp.layers.1.mixer.{n}_latent_proj.weight" for n in ("fc1", "fc2")}
    keys |= {f"mtp.layers.1.mixer.shared_experts.{n}_proj.weight" for n in ("up", "down")}
    keys |= {f"mtp.layers.1.mixer.experts.{e}.{n}_proj.weight" for e in range(num_experts) for n in ("up", "down")}
    return keys


def _megatron_source(model, hf_name: str, L: int):
    """The megatron tensor an HF MTP tensor comes from, written out per Megatron-Bridge's table."""
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", hf_name)
    flat, rest = int(m.group(1)), m.group(2)
    d, i = divmod(flat, L)
    block = model.mtp.layers[d]
    layer = block.mtp_model_layer.layers[i]
    if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
        return getattr(block, rest.split(".")[0]).weight
    if rest == "norm.weight":
        norm = layer.pre_mlp_layernorm if hasattr(layer.pre_mlp_layernorm, "weight") else layer.input_layernorm
        return norm.weight
    if rest == "mixer.o_proj.weight":
        return layer.self_attention.linear_proj.weight
    mlp = layer.mlp
    table = {
        "mixer.gate.weight": lambda: mlp.router.weight,
        "mixer.gate.e_score_correction_bias": lambda: mlp.router.expert_bias,
        "mixer.fc1_latent_proj.weight": lambda: mlp.fc1_latent_proj.weight,
        "mixer.fc2_latent_proj.weight": lambda: mlp.fc2_latent_proj.weight,
        "mixer.shared_experts.up_proj.weight": lambda: mlp.shared_experts.linear_fc1.weight,
        "mixer.shared_experts.down_proj.weight": lambda: mlp.shared_experts.linear_fc2.weight,
    }
    if rest in table:
        return table[rest]()
    e, kind = re.fullmatch(r"mixer\.experts\.(\d+)\.(up|down)_proj\.weight", rest).groups()
    expert = mlp.experts.local_experts[int(e)]
    return (expert.linear_fc1 if kind == "up" else expert.linear_fc2).weight


def test_super_structure_exports_hf_checkpoint_keys():
    """Super-like MTP (repeated "*E" block, latent MoE, shared expert) exports exactly the HF
    checkpoint's MTP key set, once (one physical block, num_nextn_predict_layers=1)."""
    model = build_tiny_hybrid(**SUPER_LIKE)
    assert model.config.mtp_num_layers == 2 and len(model.mtp.layers) == 1
    exported = dict(export_mtp_weights(model))
    assert set(exported) == _super_hf_keys(8)
    assert len(exported) == 16 + 2 * 8
    # the config-derived helper gives the same structure, and 1040 keys for Super itself
    assert expected_hf_mtp_keys({**SUPER_CONFIG, "n_routed_experts": 8}) == set(exported)
    assert expected_hf_mtp_keys(SUPER_CONFIG) == _super_hf_keys(512)
    assert len(expected_hf_mtp_keys(SUPER_CONFIG)) == 1040


def test_exported_values_round_trip_exactly():
    """Every exported tensor is the megatron tensor it comes from (bit-exact); q/k/v recompose the
    fused QKV in megatron's per-group layout; nothing is exported twice."""
    model = build_tiny_hybrid(**SUPER_LIKE, num_attention_heads=8, num_query_groups=2)
    cfg = model.config
    pairs = list(export_mtp_weights(model))
    assert len({n for n, _ in pairs}) == len(pairs)
    hf = dict(pairs)
    for name, t in hf.items():
        if re.search(r"\.[qkv]_proj\.weight$", name):
            continue
        src = _megatron_source(model, name, L=2)
        assert t.dtype == src.dtype and torch.equal(t, src), name
    fused = model.mtp.layers[0].mtp_model_layer.layers[0].self_attention.linear_qkv.weight
    q, k, v = (hf[f"mtp.layers.0.mixer.{x}_proj.weight"] for x in "qkv")
    hd = cfg.kv_channels
    assert q.shape == (8 * hd, cfg.hidden_size) and k.shape == v.shape == (2 * hd, cfg.hidden_size)
    assert torch.equal(fuse_qkv(q, k, v, num_query_groups=2), fused)
    assert sum(t.numel() for t in (q, k, v)) == fused.numel()
    # round trip of the helpers themselves on a bias-shaped (1-D) tensor
    b = torch.arange(2 * (4 + 2) * 3, dtype=torch.float32)
    assert torch.equal(fuse_qkv(*split_fused_qkv(b, 8, 2, 3), num_query_groups=2), b)


def test_qkv_split_matches_megatron_attention_forward():
    """The split is the one megatron's attention uses: x @ q_proj^T equals the query heads megatron's
    own get_query_key_value_tensors computes from x (same for keys and values)."""
    model = build_tiny_hybrid(**SUPER_LIKE, num_attention_heads=8, num_query_groups=2)
    attn = model.mtp.layers[0].mtp_model_layer.layers[0].self_attention
    hf = dict(export_mtp_weights(model))
    s, b, h = 5, 2, model.config.hidden_size
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        query, key, value = attn.get_query_key_value_tensors(x)[:3]
    hd = model.config.kv_channels
    for got, hf_name, heads in ((query, "q", 8), (key, "k", 2), (value, "v", 2)):
        ref = torch.nn.functional.linear(x, hf[f"mtp.layers.0.mixer.{hf_name}_proj.weight"]).view(s, b, heads, hd)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_non_repeated_depths_flatten_to_hf_indices():
    """Two physical MTP depths: megatron mtp.layers.{d}.mtp_model_layer.layers.{i} -> HF
    mtp.layers.{d*L+i}; enorm/hnorm/eh_proj on d*L, final_layernorm on d*L+L-1."""
    model = build_tiny_hybrid(pattern="*E/*E/*E", mtp_use_repeated_layer=False)
    assert len(model.mtp.layers) == 2
    hf = dict(export_mtp_weights(model))
    cfg = {**SUPER_CONFIG, "n_routed_experts": 4, "moe_latent_size": 32, "num_nextn_predict_layers": 2}
    assert set(hf) == expected_hf_mtp_keys(cfg)
    assert torch.equal(hf["mtp.layers.2.enorm.weight"], model.mtp.layers[1].enorm.weight)
    assert torch.equal(hf["mtp.layers.3.final_layernorm.weight"], model.mtp.layers[1].final_layernorm.weight)
    assert torch.equal(
        hf["mtp.layers.3.mixer.experts.1.down_proj.weight"],
        model.mtp.layers[1].mtp_model_layer.layers[1].mlp.experts.local_experts[1].linear_fc2.weight,
    )
    assert not torch.equal(hf["mtp.layers.2.eh_proj.weight"], hf["mtp.layers.0.eh_proj.weight"])


def test_vocab_padding_is_trimmed():
    """A Megatron-padded vocab (make_vocab_size_divisible_by) is trimmed to the HF vocab size."""
    model = build_tiny_hybrid(vocab_size=100, make_vocab_size_divisible_by=64)
    emb, out = model.embedding.word_embeddings.weight, model.output_layer.weight
    assert emb.shape[0] == 128
    shared = dict(export_mtp_weights(model, vocab_size=100, include_shared=True))
    assert shared["backbone.embeddings.weight"].shape == (100, emb.shape[1])
    assert torch.equal(shared["backbone.embeddings.weight"], emb[:100])
    assert torch.equal(shared["lm_head.weight"], out[:100])
    assert not any(n.startswith("backbone.layers.") for n in shared)  # MTP + shared only
    assert dict(export_mtp_weights(model, include_shared=True))["lm_head.weight"].shape[0] == 128
    with pytest.raises(MTPExportError, match="vocab_size=200"):
        dict(export_mtp_weights(model, vocab_size=200, include_shared=True))


def test_full_backbone_names():
    """include_backbone yields the whole HF model: Mamba, attention, MLP, MoE, final norm, lm_head."""
    model = build_tiny_hybrid()
    full = dict(export_mtp_weights(model, include_backbone=True, vocab_size=128))
    base = {n for n in full if not n.startswith("mtp.")}
    for n in (
        "backbone.embeddings.weight",
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.0.norm.weight",
        "backbone.layers.1.mixer.k_proj.weight",
        "backbone.layers.2.mixer.up_proj.weight",
        "backbone.layers.3.mixer.gate.e_score_correction_bias",
        "backbone.layers.3.mixer.experts.3.down_proj.weight",
        "backbone.norm_f.weight",
        "lm_head.weight",
    ):
        assert n in base, n
    n_megatron = sum(1 for n, _ in model.named_parameters() if not n.startswith("mtp."))
    n_megatron += 1  # expert_bias buffer of the backbone MoE layer
    n_megatron += 2  # the fused QKV weight becomes three tensors
    assert len(base) == n_megatron
    assert torch.equal(full["backbone.layers.0.mixer.conv1d.weight"], model.decoder.layers[0].mixer.conv1d_weight)


def test_dtype_is_preserved_bias_stays_fp32():
    """bf16 model: every tensor bf16 except e_score_correction_bias (fp32, also after Float16Module)."""
    from megatron.core.transformer.module import Float16Module

    model = build_tiny_hybrid(**SUPER_LIKE, params_dtype=torch.bfloat16)
    hf = dict(export_mtp_weights(model))
    fp32 = {n for n, t in hf.items() if t.dtype == torch.float32}
    assert fp32 == {"mtp.layers.1.mixer.gate.e_score_correction_bias"}
    assert all(t.dtype == torch.bfloat16 for n, t in hf.items() if n not in fp32)
    # a wrapped model (Float16Module casts buffers to bf16 until megatron's next routing step)
    wrapped = Float16Module(model.config, model)
    hf2 = dict(export_mtp_weights([wrapped]))
    assert set(hf2) == set(hf)
    bias = hf2["mtp.layers.1.mixer.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, model.mtp.layers[0].mtp_model_layer.layers[1].mlp.router.expert_bias.float())


def test_transformer_engine_names_map_like_local_names():
    """Production (Transformer-Engine spec) names map to the same HF names as the local spec's."""
    L = 2
    pre = "mtp.layers.0.mtp_model_layer.layers"
    te_to_hf = {
        f"{pre}.0.self_attention.linear_qkv.layer_norm_weight": "mtp.layers.0.norm.weight",
        f"{pre}.0.input_layernorm.weight": "mtp.layers.0.norm.weight",
        f"{pre}.1.pre_mlp_layernorm.weight": "mtp.layers.1.norm.weight",
        f"{pre}.1.mlp.linear_fc1.layer_norm_weight": "mtp.layers.1.norm.weight",
        f"{pre}.1.mlp.experts.linear_fc1.weight7": "mtp.layers.1.mixer.experts.7.up_proj.weight",
        f"{pre}.1.mlp.experts.linear_fc2.weight511": "mtp.layers.1.mixer.experts.511.down_proj.weight",
        f"{pre}.1.mlp.experts.local_experts.7.linear_fc1.weight": "mtp.layers.1.mixer.experts.7.up_proj.weight",
        f"{pre}.1.mlp.router.expert_bias": "mtp.layers.1.mixer.gate.e_score_correction_bias",
        "mtp.layers.1.eh_proj.weight": "mtp.layers.2.eh_proj.weight",
        "mtp.layers.1.final_layernorm.weight": "mtp.layers.3.final_layernorm.weight",
        "decoder.layers.4.mixer.in_proj.layer_norm_weight": "backbone.layers.4.norm.weight",
        "decoder.layers.5.mixer.conv1d.weight": "backbone.layers.5.mixer.conv1d.weight",
        "decoder.final_norm.weight": "backbone.norm_f.weight",
        "embedding.word_embeddings.weight": "backbone.embeddings.weight",
        "output_layer.weight": "lm_head.weight",
    }
    for mname, hname in te_to_hf.items():
        assert megatron_to_hf_name(mname, L) == hname, mname
    assert megatron_to_hf_name(f"{pre}.0.self_attention.linear_qkv.weight", L) == tuple(
        f"mtp.layers.0.mixer.{x}_proj.weight" for x in "qkv"
    )
    # Mamba inside MTP and unknown modules have no HF name
    assert megatron_to_hf_name(f"{pre}.0.mixer.in_proj.weight", L) is None
    assert megatron_to_hf_name(f"{pre}.1.mlp.router.bogus", L) is None


def test_unknown_mtp_tensor_raises_before_yielding():
    """An MTP parameter without an HF name is an error that names it (never dropped silently)."""
    model = build_tiny_hybrid()
    router = model.mtp.layers[0].mtp_model_layer.layers[1].mlp.router
    router.register_parameter("bogus", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(MTPExportError, match=r"mtp\.layers\.0\.mtp_model_layer\.layers\.1\.mlp\.router\.bogus"):
        export_mtp_weights(model)


def test_config_parallel_sizes_disagreeing_with_the_model_groups_are_refused():
    model = build_tiny_hybrid()
    model.config.tensor_model_parallel_size = 2
    try:
        with pytest.raises(NotImplementedError, match="tensor_model_parallel_size"):
            export_mtp_weights(model)
    finally:
        model.config.tensor_model_parallel_size = 1


def test_expected_keys_from_config_variants():
    tf5 = {k: v for k, v in SUPER_CONFIG.items() if k != "mtp_hybrid_override_pattern"}
    tf5["mtp_layers_block_type"] = ["attention", "moe"]
    assert hf_mtp_pattern(tf5) == "*E"
    assert expected_hf_mtp_keys(tf5) == expected_hf_mtp_keys(SUPER_CONFIG)
    assert expected_hf_mtp_keys({**SUPER_CONFIG, "num_nextn_predict_layers": 0}) == set()
    no_latent = expected_hf_mtp_keys({**SUPER_CONFIG, "moe_latent_size": None, "n_shared_experts": 0})
    assert len(no_latent) == 1040 - 4
    with pytest.raises(MTPExportError, match="unsupported layer types"):
        expected_hf_mtp_keys({**SUPER_CONFIG, "mtp_hybrid_override_pattern": "M*"})


def test_drafter_layout_and_digests():
    """HF tensors recomposed like vLLM stores them (qkv = cat, w13/w2 = stacked experts); digests of
    the streamed pieces equal digests of the recomposed tensors and detect a one-element change."""
    model = build_tiny_hybrid(**SUPER_LIKE)
    hf = dict(export_mtp_weights(model))
    lay = drafter_layout(hf)
    qkv = lay["model.layers.0.mixer.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([hf[f"mtp.layers.0.mixer.{x}_proj.weight"] for x in "qkv"]))
    w13 = lay["model.layers.1.mixer.experts.w13_weight"]
    assert torch.equal(w13, torch.stack([hf[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] for e in range(8)]))
    w2 = lay["model.layers.1.mixer.experts.w2_weight"]
    assert w2.shape == (8, 32, 32) and torch.equal(w2[3], hf["mtp.layers.1.mixer.experts.3.down_proj.weight"])
    assert len(lay) == 16  # vLLM NemotronHMTP "*E" with latent MoE: 16 own parameters
    dig = hf_mtp_digests(hf)
    assert dig == {n: tensor_digest(t) for n, t in lay.items()}
    w13b = w13.clone()
    w13b.view(-1)[1234] = w13b.view(-1)[1234] + 1e-3
    assert tensor_digest(w13b) != dig["model.layers.1.mixer.experts.w13_weight"]
    swapped = torch.stack([w13[1], w13[0], *w13[2:]])  # same values, other positions
    assert tensor_digest(swapped) != dig["model.layers.1.mixer.experts.w13_weight"]
    bf = hf["mtp.layers.0.eh_proj.weight"].to(torch.bfloat16)
    assert tensor_digest(bf) == tensor_digest(bf.float())


def test_megatron_bridge_mapping_agrees_with_the_export_names(megatron_env):
    """Megatron-Bridge's own NemotronHBridge mapping (built from the checkpoint's HF config, as verl's
    AutoBridge builds it) maps every MTP parameter to the HF name ``export_mtp_weights`` uses. Without
    ``hf_config`` the Bridge builds no MTP mappings at all. The end-to-end check (the Bridge's
    ``export_hf_weights`` stream == ``expected_hf_mtp_keys`` == vLLM's drafter, through the strict sync
    check) is in tests/test_bridge_build.py."""
    from transformers import AutoConfig

    from verl_mtp_cpu.bridge import install_te_import_placeholder
    from verl_mtp_cpu.vllm_drafter import hf_config_for_tiny

    install_te_import_placeholder()
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge

    hf = AutoConfig.for_model(**hf_config_for_tiny(**SUPER_LIKE))
    assert hf.num_nextn_predict_layers == 1 and hf.mtp_hybrid_override_pattern == "*E"
    bridge = NemotronHBridge()
    bridge.hf_config = hf
    registry = bridge.mapping_registry()
    model = build_tiny_hybrid(**SUPER_LIKE)
    checked = 0
    for name, _ in model.named_parameters():
        # the local spec's separate attention norm: production (TE) fuses it into linear_qkv, which the
        # Bridge maps; tests/test_bridge_build.py builds that layout
        if not name.startswith("mtp.") or "input_layernorm" in name:
            continue
        mapping = registry.megatron_to_hf_lookup(name)
        assert mapping is not None, name
        ours = megatron_to_hf_name(name, 2)
        theirs = mapping.hf_param
        theirs = tuple(theirs[x] for x in "qkv") if isinstance(theirs, dict) else theirs
        assert ours == theirs, name
        checked += 1
    assert checked >= 20
    # what verl would get from a Bridge without the checkpoint's config: no MTP mapping at all
    nomtp = NemotronHBridge()
    nomtp.hf_config = AutoConfig.for_model(**{**hf_config_for_tiny(**SUPER_LIKE), "num_nextn_predict_layers": 0})
    assert nomtp.mapping_registry().megatron_to_hf_lookup("mtp.layers.0.eh_proj.weight") is None
