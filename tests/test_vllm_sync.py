"""MTP weight sync into vLLM 0.31's real Nemotron-H MTP drafter, on CPU.

A tiny megatron-core HybridModel (main ``M*-E``, MTP ``*E`` with latent MoE and a shared expert,
vocab 128 padded by Megatron to 144 rows) is exported to HF names and loaded through the plugin's
sync code into vLLM's own ``NemotronHForCausalLM`` target and ``NemotronHMTP`` drafter, built for the
same config through vLLM's ``get_model`` (drafter: ``get_draft_load_config``) and wired to the
target's embedding/lm_head by vLLM's own proposer methods. CPU workarounds:
:mod:`verl_mtp_cpu.vllm_drafter`. Models are built once per module.
"""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from verl_mtp_plugin.export import canonical_drafter_name, export_mtp_weights, hf_mtp_digests
from verl_mtp_plugin.testing import TinyHybridSpec, build_tiny_hybrid, make_batch
from verl_mtp_plugin.rollout.worker.drafter_sync import MTPDrafterSync, MTPSyncError, drafter_digests, drafter_tensors

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("megatron_env")]

SPEC = TinyHybridSpec(make_vocab_size_divisible_by=48)  # HF vocab 128, megatron rows 144
VOCAB = SPEC.vocab_size
E = SPEC.num_experts


@pytest.fixture(scope="module")
def env(megatron_env, tmp_path_factory):
    """megatron model + vLLM target and drafter (wired) for the same tiny config, in one process."""
    from verl_mtp_cpu.vllm_drafter import build_vllm_models, hf_config_for_tiny, init_vllm_distributed
    from verl_mtp_cpu.vllm_engine import install_engine_workarounds

    install_engine_workarounds()  # incl. CPU linear weights kept in their parameters (verl reloads the target in place)
    init_vllm_distributed()  # reuses megatron's gloo world (size 1) as vLLM's default group
    cfg = hf_config_for_tiny(SPEC)
    vm = build_vllm_models(cfg, tmp_path_factory.mktemp("tiny_nemotron_h"))
    return SimpleNamespace(megatron=build_tiny_hybrid(SPEC), cfg=cfg, vllm=vm, tmp=tmp_path_factory)


def _new_sync(env, **kw):
    vm = env.vllm
    return MTPDrafterSync(vm.target, vm.drafter, vm.draft_model_config, vllm_config=vm.vllm_config, **kw)


def _train_step(model, seed):
    """Stand-in for an optimizer step: new values for every megatron weight (and the expert bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.add_(0.05 * torch.randn(b.shape, generator=g, dtype=b.dtype))


def _buckets(pairs, n):
    pairs = list(pairs)
    return [pairs[i : i + n] for i in range(0, len(pairs), n)]


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _expected_drafter(hf):
    """What vLLM's NemotronHMTP must hold after loading the HF MTP tensors ``hf`` (canonical names)."""
    out = {}
    for n, t in hf.items():
        if not n.startswith("mtp.layers.") or re.search(r"\.([qkv]_proj|experts\.\d+\.\w+)\.weight$", n):
            continue
        out["model.layers." + n[len("mtp.layers.") :]] = t
    out["model.layers.0.mixer.qkv_proj.weight"] = torch.cat([hf[f"mtp.layers.0.mixer.{x}_proj.weight"] for x in "qkv"])
    for w, proj in (("w13_weight", "up"), ("w2_weight", "down")):
        out[f"model.layers.1.mixer.experts.{w}"] = torch.stack(
            [hf[f"mtp.layers.1.mixer.experts.{e}.{proj}_proj.weight"] for e in range(E)]
        )
    return out


def _expected_target(full):
    """What vLLM's NemotronHForCausalLM must hold after loading the HF base tensors (canonical names)."""
    out, qkv, experts = {}, {}, {}
    for n, t in full.items():
        if n.startswith("mtp."):
            continue
        v = n.replace("backbone.", "model.", 1).replace("embeddings", "embed_tokens")
        if m := re.fullmatch(r"(.*\.mixer)\.([qkv])_proj\.weight", v):
            qkv.setdefault(m.group(1), {})[m.group(2)] = t
        elif m := re.fullmatch(r"(.*\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight", v):
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        elif v.endswith(".A_log"):
            out[v[: -len("A_log")] + "A"] = -torch.exp(t.float())
        else:
            out[v] = t
    for p, d in qkv.items():
        out[f"{p}.qkv_proj.weight"] = torch.cat([d["q"], d["k"], d["v"]])
    for (p, proj), d in experts.items():
        out[f"{p}.{'w13' if proj == 'up' else 'w2'}_weight"] = torch.stack([d[e] for e in sorted(d)])
    return out


def _own(drafter, target):
    """The drafter's own tensors now, in vLLM's loaded layout (vLLM's CPU build moves linear weights
    into its GEMM kernels after loading and leaves the parameter empty: read back through the kernel)."""
    return drafter_tensors(drafter, target)


def _ptrs(model):
    """Storage of every parameter vLLM kept in place (the emptied CPU linear weights have none)."""
    return {n: p.data_ptr() for n, p in model.named_parameters() if p.numel()}


def _snapshot(named):
    return {n: p.detach().clone() for n, p in named.items()}


@pytest.fixture
def post_processing(monkeypatch, env):
    """Records every vLLM post-processing step applied to a drafter module (real calls, counted)."""
    import vllm.model_executor.model_loader.reload.layerwise as lw
    import vllm.model_executor.model_loader.utils as lu

    drafter = env.vllm.drafter
    target_ids = {id(m) for m in env.vllm.target.modules()}
    drafter_ids = {id(m) for m in drafter.modules()} - target_ids

    class Calls(list):
        drafter_param_modules: set

    calls = Calls()
    real_process, real_attn, real_pwal = lw._layerwise_process, lw._finalize_attention_layer, lu.process_weights_after_loading

    def process(layer, info):
        if id(layer) in drafter_ids:
            calls.append(("layerwise", id(layer)))
        return real_process(layer, info)

    def attn(layer, info, model_config):
        if id(layer) in drafter_ids:
            calls.append(("attention", id(layer)))
        return real_attn(layer, info, model_config)

    def pwal(model, *a, **k):
        if model is drafter:
            calls.append(("whole_model", id(model)))
        return real_pwal(model, *a, **k)

    monkeypatch.setattr(lw, "_layerwise_process", process)
    monkeypatch.setattr(lw, "_finalize_attention_layer", attn)
    monkeypatch.setattr(lu, "process_weights_after_loading", pwal)
    calls.drafter_param_modules = {
        id(m) for m in drafter.modules() if id(m) in drafter_ids and list(m.parameters(recurse=False))
    }
    return calls


# ---------------------------------------------------------------------------------------------


def test_megatron_and_vllm_share_one_process(env):
    """vLLM's distributed init reused megatron's gloo world; both stacks work side by side."""
    from megatron.core import parallel_state
    from vllm.distributed import get_tp_group, get_world_group

    from verl_mtp_plugin.control import hybrid_forward

    assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
    assert get_world_group().world_size == 1 and get_tp_group().world_size == 1
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    b = make_batch(batch=1, seq=8, vocab=VOCAB)
    with torch.no_grad():
        logits = hybrid_forward(
            env.megatron, b["input_ids"], b["position_ids"], b["attention_mask"], run_mtp_forward=False
        )
    assert logits.shape == (1, 8, 144) and torch.isfinite(logits).all()


@pytest.mark.parametrize("stage", ["device", "host"])
def test_drafter_refits_are_exact_and_in_place(env, post_processing, monkeypatch, stage):
    """Two refits (megatron weights changed between them), MTP tensors in several buckets whose
    transfer buffer is overwritten after each bucket: every drafter parameter equals the trained value (qkv = cat(q,k,v), w13/w2 = stacked up/down
    projections), storage is kept, one load_weights call and one post-processing per module per
    update, the target and the shared embedding/lm_head untouched."""
    vm = env.vllm
    sync = _new_sync(env, stage=stage)
    own, shared, extra = sync.drafter_structure()
    assert shared == {"model.embed_tokens.weight", "lm_head.weight"} and extra == {} and len(own) == 16
    ptrs = _ptrs(vm.drafter)
    target_before = _snapshot(drafter_tensors(vm.target))
    calls = []
    real_load = vm.drafter.load_weights
    monkeypatch.setattr(vm.drafter, "load_weights", lambda w: real_load(calls.append(list(w)) or calls[-1]))
    for update, seed in enumerate((1, 2), start=1):
        _train_step(env.megatron, seed)
        hf = dict(export_mtp_weights(env.megatron))
        before = _snapshot(_own(vm.drafter, vm.target))
        post_processing.clear()
        sync.begin()
        for bucket in _buckets(hf.items(), 5):
            staged = [(n, t.clone()) for n, t in bucket]  # the transfer buffer of one bucket
            assert sync.route(staged) == []  # nothing for the target
            for _, t in staged:  # the next bucket overwrites the reused buffer
                t.fill_(float("nan"))
        metrics = sync.finish()
        assert len(calls) == update and {n for n, _ in calls[-1]} == set(hf)  # one call, all MTP tensors
        expected = _expected_drafter(hf)
        now = _own(vm.drafter, vm.target)
        assert {canonical_drafter_name(n) for n in own} == set(expected) == set(now)
        for n in now:
            assert torch.equal(now[n], expected[n]), n
            assert not torch.equal(now[n], before[n]), n
        assert _ptrs(vm.drafter) == ptrs
        for n, p in drafter_tensors(vm.target).items():
            assert torch.equal(p, target_before[n]), n
        # post-processing: exactly once for every drafter module that holds weights, never whole-model
        layerwise = [i for kind, i in post_processing if kind in ("layerwise", "attention")]
        assert len(layerwise) == len(set(layerwise))
        assert post_processing.drafter_param_modules <= set(layerwise)
        assert not [c for c in post_processing if c[0] == "whole_model"]
        assert sync.post_process_count == update
        assert metrics["sync/bytes_drafter"] == _nbytes(hf.values()) and metrics["sync/bytes_target"] == 0
        assert metrics["sync/tensors_drafter"] == len(hf) and metrics["sync/drafter_loaded"] == 1.0
        assert metrics["sync/drafter_seconds"] > 0 and metrics["sync/count"] == update


def test_unknown_staging_place_is_refused(env):
    with pytest.raises(ValueError, match=r"VERL_MTP_SYNC_STAGE/stage='gpu'; allowed: \['device', 'host'\]"):
        _new_sync(env, stage="gpu")


def test_wrong_or_missing_names_raise(env):
    """vLLM drops unknown names silently: the sync names them and loads nothing; a parameter the
    loader did not fill is reported after loading; a wrong shape leaves the drafter materialised."""
    vm = env.vllm
    hf = dict(export_mtp_weights(env.megatron))
    sync = _new_sync(env)
    own = _own(vm.drafter, vm.target)
    keep = _snapshot(own)

    missing = {k: v for k, v in hf.items() if k != "mtp.layers.1.mixer.experts.3.down_proj.weight"}
    with pytest.raises(MTPSyncError, match=r"1 missing \['mtp\.layers\.1\.mixer\.experts\.3\.down_proj\.weight'\]"):
        sync.sync(missing.items())
    second_depth = {**hf, "mtp.layers.2.enorm.weight": hf["mtp.layers.0.enorm.weight"]}
    with pytest.raises(MTPSyncError, match=r"1 unexpected \['mtp\.layers\.2\.enorm\.weight'\]"):
        sync.sync(second_depth.items())
    native = {k: v for k, v in hf.items() if not re.search(r"mtp\.layers\.0\.mixer\.[qkv]_proj", k)}
    native["mtp.layers.0.mixer.linear_qkv.weight"] = torch.cat([hf[f"mtp.layers.0.mixer.{x}_proj.weight"] for x in "qkv"])
    with pytest.raises(MTPSyncError, match=r"3 missing .*1 unexpected \['mtp\.layers\.0\.mixer\.linear_qkv\.weight'\]"):
        sync.sync(native.items())
    for n, p in _own(vm.drafter, vm.target).items():  # nothing was loaded
        assert torch.equal(p, keep[n]), n
    assert sync.post_process_count == 0

    # second safety net: a key the checks expect nothing for is reported as a parameter not loaded
    sync.expected_mtp_keys = sync.expected_mtp_keys - {"mtp.layers.0.enorm.weight"}
    no_enorm = {k: v for k, v in hf.items() if k != "mtp.layers.0.enorm.weight"}
    with pytest.raises(MTPSyncError, match=r"missing \['model\.layers\.0\.enorm\.weight'\]"):
        sync.sync(no_enorm.items())

    bad = {**hf, "mtp.layers.0.eh_proj.weight": torch.zeros(SPEC.hidden_size, SPEC.hidden_size)}
    with pytest.raises(Exception):
        _new_sync(env).sync(bad.items())
    assert not any(p.is_meta for p in vm.drafter.parameters())
    _new_sync(env).sync(hf.items())  # a correct update still loads afterwards
    assert torch.equal(_own(vm.drafter, vm.target)["model.layers.0.enorm.weight"], hf["mtp.layers.0.enorm.weight"])


def test_worker_extension_splits_full_stream(env, monkeypatch):
    """verl's per-bucket _update_weights path through the extension: the target gets exactly the
    non-MTP names, the drafter exactly the MTP names (one call), verl's post-processing sees the
    target only, and the drafter reads the refreshed shared embedding / lm_head."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from verl_mtp_plugin.rollout.worker.extension import MTPColocateWorkerExtension

    vm = env.vllm
    ext = object.__new__(MTPColocateWorkerExtension)  # no GPU worker: the runner holds the real models
    ext.model_runner = SimpleNamespace(model=vm.target, drafter=SimpleNamespace(model=vm.drafter), vllm_config=vm.vllm_config)
    ext.device = torch.device("cpu")
    seen = {"target": [], "drafter": []}
    for role, model in (("target", vm.target), ("drafter", vm.drafter)):
        real = model.load_weights
        monkeypatch.setattr(model, "load_weights", lambda w, real=real, role=role: real(seen[role].append(list(w)) or seen[role][-1]))
    previous_embed = None
    for seed in (3, 4):
        _train_step(env.megatron, seed)
        full = dict(export_mtp_weights(env.megatron, include_backbone=True, vocab_size=VOCAB))
        mtp = {n for n in full if n.startswith("mtp.")}
        seen["target"].clear(), seen["drafter"].clear()
        ext._mtp_begin_update()
        for bucket in _buckets(full.items(), 7):  # what BucketedWeightReceiver hands over
            ext._update_weights(bucket, peft_config=None, base_sync_done=False)
        post = list(ext._iter_all_models_with_config())  # verl's step 3 ...
        assert [m for m, _ in post] == [vm.target]
        for model, model_config in post:
            process_weights_after_loading(model, model_config, ext.device)
        metrics = ext._mtp_finish_update()

        target_names = [n for call in seen["target"] for n, _ in call]
        assert sorted(target_names) == sorted(set(full) - mtp)
        assert len(seen["drafter"]) == 1 and {n for n, _ in seen["drafter"][0]} == mtp
        expected_t = _expected_target(full)
        target_params = drafter_tensors(vm.target)  # loaded layout (CPU kernel repacks read back)
        assert set(target_params) == set(expected_t)
        for n, p in target_params.items():
            assert torch.equal(p, expected_t[n]), n
        expected_d = _expected_drafter(full)
        for n, p in _own(vm.drafter, vm.target).items():
            assert torch.equal(p, expected_d[canonical_drafter_name(n)]), n
        # the drafter reads the target's refreshed embedding and lm_head (shared modules)
        assert torch.equal(vm.drafter.model.embed_tokens.weight, full["backbone.embeddings.weight"])
        assert torch.equal(vm.drafter.lm_head.weight, full["lm_head.weight"])
        assert previous_embed is None or not torch.equal(previous_embed, full["backbone.embeddings.weight"])
        previous_embed = full["backbone.embeddings.weight"].clone()
        assert metrics == ext.mtp_sync_metrics()
        assert metrics["sync/bytes_drafter"] == _nbytes(full[n] for n in mtp)
        assert metrics["sync/bytes_target"] == _nbytes(full[n] for n in set(full) - mtp)
        drafter_bytes, all_bytes = _nbytes(full[n] for n in mtp), _nbytes(full.values())
        assert metrics["sync/drafter_share"] == pytest.approx(drafter_bytes / all_bytes, rel=1e-12)


def test_drafter_with_own_embedding_and_head_gets_them(env):
    """Routing by module identity: a drafter that does not share the embedding/lm_head with the
    target (vLLM 0.31 before the proposer wires them) also receives them, trimmed to the HF vocab."""
    from verl_mtp_cpu.vllm_drafter import build_vllm_models

    vm = env.vllm
    lone = build_vllm_models(env.cfg, env.tmp.mktemp("unwired"), build_target=False, wire=False)
    sync = MTPDrafterSync(vm.target, lone.drafter, lone.draft_model_config, vllm_config=lone.vllm_config)
    own, shared, extra = sync.drafter_structure()
    assert shared == set() and extra == {"backbone.embeddings.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
    _train_step(env.megatron, 5)
    full = dict(export_mtp_weights(env.megatron, include_backbone=True, vocab_size=VOCAB))
    sync.begin()
    target_part = sync.route(full.items())
    sync.finish()
    assert {"backbone.embeddings.weight", "lm_head.weight"} <= {n for n, _ in target_part}  # both models get them
    assert not any(n.startswith("mtp.") for n, _ in target_part)
    assert torch.equal(lone.drafter.model.embed_tokens.weight, full["backbone.embeddings.weight"])
    assert torch.equal(lone.drafter.lm_head.weight, full["lm_head.weight"])
    mtp_only = {n: t for n, t in full.items() if n.startswith("mtp.")}
    with pytest.raises(MTPSyncError, match=r"2 missing \['backbone\.embeddings\.weight', 'lm_head\.weight'\]"):
        sync.sync(mtp_only.items())


def test_frozen_mode_loads_once_then_skips(env, post_processing):
    """frozen: the first sync loads the dummy-initialised drafter; later syncs skip it: weights
    unchanged, no post-processing rerun, no bytes to the drafter. A checkpoint-loaded drafter is
    never touched."""
    vm = env.vllm
    sync = _new_sync(env, mode="frozen", drafter_loaded=False)
    _train_step(env.megatron, 6)
    hf1 = dict(export_mtp_weights(env.megatron))
    m1 = sync.sync(hf1.items())
    own = _own(vm.drafter, vm.target)
    loaded = _snapshot(own)
    n_post = len(post_processing)
    assert m1["sync/drafter_loaded"] == 1.0 and n_post > 0 and sync.post_process_count == 1
    for n, p in own.items():
        assert torch.equal(p, _expected_drafter(hf1)[canonical_drafter_name(n)]), n

    _train_step(env.megatron, 7)
    hf2 = dict(export_mtp_weights(env.megatron))
    m2 = sync.sync(hf2.items())
    assert m2["sync/drafter_loaded"] == 0.0 and m2["sync/bytes_drafter"] == 0
    assert m2["sync/bytes_drafter_skipped"] == _nbytes(hf2.values())
    assert len(post_processing) == n_post and sync.post_process_count == 1
    own = _own(vm.drafter, vm.target)
    for n, p in own.items():
        assert torch.equal(p, loaded[n]), n
    assert not torch.equal(own["model.layers.0.eh_proj.weight"], hf2["mtp.layers.0.eh_proj.weight"])

    # vLLM loaded real weights at start-up (load_format not dummy): frozen still loads the trainer's block on its
    # first update (a resumed trainer's frozen block need not be the HF checkpoint's), then never again
    from_ckpt = _new_sync(env, mode="frozen", drafter_loaded=True)
    assert from_ckpt.sync(hf2.items())["sync/drafter_loaded"] == 1.0
    for n, p in _own(vm.drafter, vm.target).items():
        assert torch.equal(p, _expected_drafter(hf2)[canonical_drafter_name(n)]), n
    assert from_ckpt.sync(hf1.items())["sync/drafter_loaded"] == 0.0
    assert torch.equal(_own(vm.drafter, vm.target)["model.layers.0.eh_proj.weight"], hf2["mtp.layers.0.eh_proj.weight"])


def test_checksum_mode_catches_corrupting_post_processing(env, monkeypatch):
    """Checksum mode: drafter digests equal the trainer's (recomposed) digests; a post-processing
    step that alters a weight, which the name checks cannot see, is reported by name."""
    import vllm.model_executor.model_loader.reload.layerwise as lw

    vm = env.vllm
    _train_step(env.megatron, 8)
    hf = dict(export_mtp_weights(env.megatron))
    _new_sync(env, verify_checksums=True).sync(hf.items())
    assert drafter_digests(vm.drafter, vm.target) == hf_mtp_digests(hf)  # trainer-side comparison

    real = lw._layerwise_process

    def corrupting(layer, info):
        real(layer, info)
        if any(p is getattr(layer, "w2_weight", None) for p in vm.drafter.parameters()):
            layer.w2_weight.data[0, 0, 0] += 1.0  # e.g. a repack applied to already-processed weights

    monkeypatch.setattr(lw, "_layerwise_process", corrupting)
    _new_sync(env).sync(hf.items())  # names all fine: without checksums this passes silently
    assert drafter_digests(vm.drafter, vm.target) != hf_mtp_digests(hf)
    with pytest.raises(MTPSyncError, match=r"checksum mismatch for 1 tensor.*experts\.w2_weight"):
        _new_sync(env, verify_checksums=True).sync(hf.items())
    monkeypatch.setattr(lw, "_layerwise_process", real)
    _new_sync(env, verify_checksums=True).sync(hf.items())


def test_worker_extension_class_contract():
    """The extension subclasses verl's, adds no attribute vLLM's GPU worker already has (vLLM asserts
    that when injecting it), and importing the module alone pulls in neither vLLM, verl nor megatron."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.v1.worker.gpu_worker import Worker

    from verl_mtp_plugin.rollout.worker_extension import MTPColocateWorkerExtension as Ext  # the public path

    from vllm.utils.import_utils import resolve_obj_by_qualname

    from verl_mtp_plugin.config_keys import WORKER_EXTENSION_CLS

    assert issubclass(Ext, vLLMColocateWorkerExtension)
    assert resolve_obj_by_qualname(WORKER_EXTENSION_CLS) is Ext  # how vLLM resolves worker_extension_cls
    assert Ext.__module__ == "verl_mtp_plugin.rollout.worker.extension" and Ext.__qualname__ == "MTPColocateWorkerExtension"
    assert [a for a in dir(Ext) if not a.startswith("__") and hasattr(Worker, a)] == []
    for rpc in ("mtp_sync_metrics", "mtp_configure_sync", "mtp_drafter_digests", "mtp_mark_drafter_stale"):
        assert callable(getattr(Ext, rpc))
    code = (
        "import sys, verl_mtp_plugin.rollout.worker_extension, verl_mtp_plugin.rollout.worker.drafter_sync, verl_mtp_plugin.export; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'verl', 'megatron'}); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
