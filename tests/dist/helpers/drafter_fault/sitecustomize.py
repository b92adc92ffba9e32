"""Fault injection for the spot-trainer test: on PYTHONPATH, every process of the run makes its drafter's
micro-step number ``TLT_TEST_DRAFTER_FAULT_AT`` raise, as a bug in drafter training would."""

import os

_FAULT_AT = int(os.environ.get("TLT_TEST_DRAFTER_FAULT_AT", "0"))

if _FAULT_AT > 0:
    from patch_on_import import patch_after_import

    def _inject(module) -> None:
        original = module.DrafterTrainer.micro_step
        calls = {"n": 0}

        def failing_micro_step(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == _FAULT_AT:
                raise RuntimeError("injected drafter training failure")
            return original(self, *args, **kwargs)

        module.DrafterTrainer.micro_step = failing_micro_step

    patch_after_import("megatron_tlt.drafter.trainer", _inject)
