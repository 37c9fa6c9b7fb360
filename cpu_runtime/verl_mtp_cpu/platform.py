"""A CPU platform for verl 0.9.1, registered through verl's own ``PlatformRegistry`` (CPU-only).

verl has no CPU platform: its detection falls back to ``nvidia`` (``verl/plugin/platform/
platform_manager.py:_detect_platform_name``). verl loads this module in every process that imports
verl through ``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` (``verl/__init__.py:49-52``; the
top-level loader in ``pythonpath/verl_cpu_platform.py`` says why it is not named directly);
``VERL_PLATFORM=cpu`` selects the platform registered here (``platform_manager.py:92-95``); it is
registered only in such processes, so that elsewhere verl's auto-detection (which probes every registered
platform) is unchanged and :class:`PlatformCPU` can serve as a plain host platform object (the rollout
harness's weight-transfer platform, ``cpu.vllm_engine._verl_platform``). This module imports nothing of
``verl_mtp_plugin`` at import time. What the platform answers and why:

* ``ray_resource_name() == "GPU"``: verl's resource pools ask Ray for this resource and count only
  ``GPU``/``NPU`` (``verl/single_controller/ray/base.py:146, 230``); the harness starts Ray with
  logical GPUs (``+ray_kwargs.ray_init.num_gpus``).
* ``current_device()`` is :data:`CPU_DEVICE`, a ``str`` that reads ``"cpu"`` for torch
  (``tensor.to(dev)``, ``device=dev``) and ``"0"`` inside f-strings, because verl also builds
  ``f"{get_device_name()}:{get_device_id()}"`` (``verl/utils/megatron_utils.py:233``,
  ``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py:183``) -> ``"cpu:0"``.
* ``device_module`` (verl's ``get_torch_device()``, ``torch.cuda``'s role): host no-ops for
  synchronisation, caches, streams and events; host memory figures.
* ``communication_backend_name() == "gloo"``, ``is_ipc_supported() == False`` (verl then picks its
  shared-memory weight transport, as for any device without CUDA IPC).

With ``VERL_PLATFORM=cpu`` this module also wraps verl's ``initialize_global_process_group_ray``
(:func:`_trainer_worker_entry`): verl's trainer workers call it first thing
(``verl/workers/engine_workers.py:89``), which is where the worker stand-ins of
:mod:`verl_mtp_cpu.workers` are installed. Nothing else is changed at import.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["CPU_DEVICE", "PLATFORM_NAME", "PlatformCPU", "active"]

PLATFORM_NAME = "cpu"


class _CPUDevice(str):
    """``"cpu"`` for torch, ``"0"`` in f-strings (``f"{name}:{id}"`` -> ``"cpu:0"``)."""

    def __format__(self, spec):
        return "0"


CPU_DEVICE = _CPUDevice("cpu")


def _noop(*_a, **_k):
    return None


class _HostStream:
    """``torch.cuda.Stream`` for host work: nothing to order."""

    def __init__(self, *_a, **_k):
        pass

    def synchronize(self):
        return None

    def wait_stream(self, *_a, **_k):
        return None

    def wait_event(self, *_a, **_k):
        return None

    def record_event(self, *_a, **_k):
        return _HostEvent()

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False


class _HostEvent:
    """``torch.cuda.Event`` timing on the host clock (verl's timers call ``elapsed_time``)."""

    def __init__(self, *_a, **_k):
        self._t = None

    def record(self, *_a, **_k):
        self._t = time.perf_counter()

    def synchronize(self):
        return None

    def wait(self, *_a, **_k):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return (other._t - self._t) * 1000.0


def _mem_get_info(*_a, **_k):
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


#: verl's ``get_torch_device()`` on this platform.
device_module = types.SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: CPU_DEVICE,
    device_count=lambda: 1,
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda *_a, **_k: torch.get_rng_state(),
    set_rng_state=lambda state, *_a, **_k: torch.set_rng_state(state),
    memory_allocated=lambda *_a, **_k: 0,
    memory_reserved=lambda *_a, **_k: 0,
    max_memory_allocated=lambda *_a, **_k: 0,
    max_memory_reserved=lambda *_a, **_k: 0,
    reset_peak_memory_stats=_noop,
    mem_get_info=_mem_get_info,
    set_per_process_memory_fraction=_noop,
    get_device_name=lambda *_a, **_k: "cpu",
    Stream=_HostStream,
    Event=_HostEvent,
    stream=lambda _s=None: contextlib.nullcontext(),
    current_stream=lambda *_a, **_k: _HostStream(),
)


class PlatformCPU(PlatformBase):
    """verl platform for a machine without an accelerator (CPU-only; see the module docstring)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = device_module

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return not torch.cuda.is_available()

    def current_device(self):
        return CPU_DEVICE

    def device_count(self):
        return 1

    def set_device(self, device_index):
        return None

    def synchronize(self, device_index=None):
        return None

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        return None

    def empty_cache(self):
        return None

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        return None

    def profiler_stop(self):
        return None

    def ray_resource_name(self):
        return "GPU"  # verl counts GPU/NPU only (single_controller/ray/base.py:146, 230)

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def active() -> bool:
    """True when this process runs verl on :class:`PlatformCPU` (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def _trainer_worker_entry():
    """Wrap ``verl.utils.distributed.initialize_global_process_group_ray``: the first call without a
    backend (a trainer worker's ``TrainingWorker.__init__``, ``engine_workers.py:89``) installs the
    worker stand-ins, then initialises the process group with ``gloo``.

    verl's default backend is ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``
    (``verl/utils/distributed.py:89``), ``"cpu:gloo,cpu:gloo"`` here, which torch rejects (one device
    type twice); ``"gloo"`` is the same world with gloo for every tensor (all are on the host).
    Explicit backends (verl's checkpoint engine passes ``"cpu:gloo"``) are left alone.
    """
    import verl.utils.distributed as vd

    real = vd.initialize_global_process_group_ray
    if getattr(real, "_verl_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None:
            from verl_mtp_cpu.workers import install_trainer_worker_standins

            install_trainer_worker_standins()
            backend = "gloo"
        return real(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._verl_cpu = True
    initialize_global_process_group_ray.__wrapped__ = real
    vd.initialize_global_process_group_ray = initialize_global_process_group_ray


if active():  # registered only where it is selected: verl's auto-detection elsewhere stays as it was
    PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    _trainer_worker_entry()
