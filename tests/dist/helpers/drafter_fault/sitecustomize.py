"""Fault injection for the spot-trainer test: on PYTHONPATH with ``TLT_TEST_DRAFTER_FAULT_AT=S:N``, every
process of the run makes its drafter's N-th micro-step within its S-th rollout's idle time raise, as a bug in
drafter training would. Counting within one rollout keeps the fault where the test wants it: how many
micro-steps fit in a step's idle window depends on the machine's speed."""

import os

_FAULT_AT = os.environ.get("TLT_TEST_DRAFTER_FAULT_AT")

if _FAULT_AT:
    from patch_on_import import patch_after_import

    _STEP, _MICRO_STEP = (int(n) for n in _FAULT_AT.split(":"))
    _count = {"rollouts": 0, "micro_steps": 0}

    def _count_rollouts(module) -> None:
        original = module.SpotTrainer.wait_for_rollout_end

        def counting_wait(self, *args, **kwargs):
            _count["rollouts"] += 1
            _count["micro_steps"] = 0
            return original(self, *args, **kwargs)

        module.SpotTrainer.wait_for_rollout_end = counting_wait

    def _inject(module) -> None:
        original = module.DrafterTrainer.micro_step

        def failing_micro_step(self, *args, **kwargs):
            _count["micro_steps"] += 1
            if (_count["rollouts"], _count["micro_steps"]) == (_STEP, _MICRO_STEP):
                raise RuntimeError("injected drafter training failure")
            return original(self, *args, **kwargs)

        module.DrafterTrainer.micro_step = failing_micro_step

    patch_after_import("megatron_tlt.drafter.spot", _count_rollouts)
    patch_after_import("megatron_tlt.drafter.trainer", _inject)
