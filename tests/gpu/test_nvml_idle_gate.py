"""The spot trainer's NVML gate: the device reads busy while work runs on it and quiet once it stops.

NVML's utilisation is the share of its last sample period (200 ms on an H100) in which a kernel ran;
measured on an H100: busy on 93% of 100-ms polls under load, quiet 0.3 s after the work stopped. How soon
it reads quiet is a figure of the device (and of whoever else shares it), not asserted: QUIET_LIMIT_S
only ends the wait, 50x the 0.3 s measured.
"""

import time

import pytest
import torch

pytestmark = pytest.mark.needs("cuda", "nvml")

LOAD_S = 3.0
POLL_S = 0.1
QUIET_LIMIT_S = 15.0


def test_idle_probe_reads_busy_under_a_matmul_loop_and_quiet_after_it_stops():
    from megatron_tlt.drafter.spot import DeviceIdleProbe

    probe = DeviceIdleProbe(torch.cuda.current_device())  # the index the RL trainer gives it
    a_hh = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    quiet_readings = []
    started = time.monotonic()
    next_poll = started + 0.5  # past the first sample periods, which still cover the idle start
    while time.monotonic() - started < LOAD_S:
        for _ in range(4):
            torch.mm(a_hh, a_hh)
        torch.cuda.synchronize()  # a short queue: the device stops when the loop does
        if time.monotonic() >= next_poll:
            quiet_readings.append(probe.device_quiet())
            next_poll += POLL_S
    stopped = time.monotonic()
    while not probe.device_quiet() and time.monotonic() - stopped < QUIET_LIMIT_S:
        time.sleep(0.02)
    quiet_after_s = time.monotonic() - stopped
    assert quiet_readings.count(False) >= 0.8 * len(quiet_readings), quiet_readings
    assert probe.device_quiet(), f"still busy {quiet_after_s:.1f} s after the work stopped"
