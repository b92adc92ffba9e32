"""A long tail on demand for the spot-trainer tests: on PYTHONPATH with ``TLT_TEST_SLOW_RANK_SECONDS`` set,
rank ``TLT_TEST_SLOW_RANK`` (default 1) of a run holds every rollout that long after its engine is done.

Every other rank then has an idle window at least that long in every step, so whether the spot trainer
trains in it is no longer a wall-clock race between the ranks (its micro-steps of 64 rows take a few ms).
A process imports one ``sitecustomize``: with ``TLT_TEST_DRAFTER_FAULT_AT`` set, this one also loads
``../drafter_fault/sitecustomize.py``. Both need ``helpers/`` on PYTHONPATH too (``patch_on_import``).
"""

import os

_SECONDS = float(os.environ.get("TLT_TEST_SLOW_RANK_SECONDS", "0"))

if _SECONDS > 0:
    import time

    from patch_on_import import patch_after_import

    def _inject(module) -> None:
        original = module.RolloutEngine.generate

        def generate_then_hold(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if os.environ.get("RANK") == os.environ.get("TLT_TEST_SLOW_RANK", "1"):
                time.sleep(_SECONDS)
            return result

        module.RolloutEngine.generate = generate_then_hold

    patch_after_import("megatron_tlt.spec.engine", _inject)

if os.environ.get("TLT_TEST_DRAFTER_FAULT_AT"):
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "drafter_fault" / "sitecustomize.py"))
