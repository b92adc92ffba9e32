"""A wrong engine on purpose: on PYTHONPATH with ``TLT_TEST_CORRUPT_SYNC=NAME:FACTOR``, every process of the run
scales the HF tensor NAME by FACTOR on its way into the rollout engine, at every weight sync, as a mis-mapped
or lost weight would. The trainer's policy is untouched: only the engine disagrees with it."""

import os

_CORRUPT = os.environ.get("TLT_TEST_CORRUPT_SYNC")

if _CORRUPT:
    from patch_on_import import patch_after_import

    _NAME, _FACTOR = _CORRUPT.rsplit(":", 1)

    def _scale_one_tensor(module) -> None:
        original = module.RolloutEngine.load_weights

        def corrupted_load_weights(self, hf_tensors):
            return original(self, ((name, t * float(_FACTOR) if name == _NAME else t) for name, t in hf_tensors))

        module.RolloutEngine.load_weights = corrupted_load_weights

    patch_after_import("megatron_tlt.spec.engine", _scale_one_tensor)
