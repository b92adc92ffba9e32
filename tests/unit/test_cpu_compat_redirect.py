"""The CUDA-redirecting mode of the CPU compatibility layer, and the block that runs without it (vLLM's engine
steps: no CUDA calls there, and the mode costs every torch call). Run in a child process: the mode is
process-wide and this test process must stay as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import torch
    from megatron_tlt import cpu_compat

    def lands_on_cpu():
        try:
            return torch.zeros(2, device="cuda").device.type == "cpu"
        except (RuntimeError, AssertionError):  # torch without CUDA refuses a cuda tensor
            return False

    assert cpu_compat.enable()
    assert lands_on_cpu()
    with cpu_compat.redirect_suspended():
        assert not lands_on_cpu()
        assert torch._C._len_torch_function_stack() == 0
    assert lands_on_cpu()  # back in place after the block
    try:
        with cpu_compat.redirect_suspended():
            raise KeyError("inside")
    except KeyError:
        pass
    assert lands_on_cpu()  # and after a block that raised
    print("ok")
""")


def test_the_mode_redirects_cuda_and_a_suspended_block_runs_without_it():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
