"""The drafter sync reads vLLM's loaded layout through registered readers: none on CUDA (the parameters are read
directly), the CPU runtime's on vLLM's CPU build (its repacked linear weights read back through their kernels).
The product holds no CPU-kernel code; the CPU runtime registers its reader when it installs itself in a vLLM
process (:func:`verl_mtp_cpu.vllm_drafter.install_cpu_workarounds`)."""

from __future__ import annotations

import pytest
import torch

from verl_mtp_plugin.rollout.worker import drafter_sync as ds


class _Drafter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mtp = torch.nn.ModuleDict({"eh_proj": torch.nn.Linear(4, 3, bias=False)})


@pytest.fixture
def no_readers(monkeypatch):
    monkeypatch.setattr(ds, "_LOADED_LAYOUT_READERS", [])


def test_without_readers_the_parameters_are_read_directly(no_readers):
    d = _Drafter()
    (name, t), = ds.drafter_tensors(d).items()
    assert t is d.mtp["eh_proj"].weight


def test_an_emptied_weight_no_reader_reads_back_is_refused(no_readers):
    d = _Drafter()
    d.mtp["eh_proj"].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(ds.MTPSyncError, match="no loaded-layout reader reads it back"):
        ds.drafter_tensors(d)


def test_the_first_reader_that_answers_counts(no_readers):
    d = _Drafter()
    seen = []
    ds.register_loaded_layout_reader(lambda m, attr, p, name: seen.append(name))  # not its kind: None
    ds.register_loaded_layout_reader(lambda m, attr, p, name: torch.full_like(p, 7.0))
    ds.register_loaded_layout_reader(lambda m, attr, p, name: pytest.fail("asked after an answer"))
    (t,) = ds.drafter_tensors(d).values()
    assert seen == ["mtp.eh_proj.weight"] and torch.equal(t, torch.full((3, 4), 7.0))
    n = len(ds.loaded_layout_readers())
    ds.register_loaded_layout_reader(ds.loaded_layout_readers()[0])  # registering again is a no-op
    assert len(ds.loaded_layout_readers()) == n == 3


def test_the_cpu_runtime_reads_a_repacked_weight_back_through_its_kernel_and_registers_itself(no_readers):
    from verl_mtp_cpu.vllm_drafter import install_cpu_workarounds, read_cpu_loaded_layout

    w = torch.randn(3, 4, dtype=torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    layer.input_size, layer.output_size = 4, 3
    packed = w.clone()  # what vLLM's CPU GEMM dispatch keeps (the parameter is emptied)
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed)
    assert torch.equal(read_cpu_loaded_layout(layer, "weight", layer.weight, "w"), w)
    assert read_cpu_loaded_layout(layer, "bias", layer.weight, "b") is None
    layer.output_size = 5
    with pytest.raises(ds.MTPSyncError, match="read back .* through the CPU kernel"):
        read_cpu_loaded_layout(layer, "weight", layer.weight, "w")
    if torch.cuda.is_available():
        pytest.skip("CUDA: the CPU runtime installs nothing")
    install_cpu_workarounds()
    assert read_cpu_loaded_layout in ds.loaded_layout_readers()
