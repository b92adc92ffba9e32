"""Fault injection for the spot-trainer test: on PYTHONPATH, every process of the run makes its drafter's
micro-step number ``TLT_TEST_DRAFTER_FAULT_AT`` raise, as a bug in drafter training would."""

import os

_FAULT_AT = int(os.environ.get("TLT_TEST_DRAFTER_FAULT_AT", "0"))

if _FAULT_AT > 0:
    import importlib.abc
    import sys

    def _inject(module) -> None:
        original = module.DrafterTrainer.micro_step
        calls = {"n": 0}

        def failing_micro_step(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == _FAULT_AT:
                raise RuntimeError("injected drafter training failure")
            return original(self, *args, **kwargs)

        module.DrafterTrainer.micro_step = failing_micro_step

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        """Patches megatron_tlt.drafter.trainer right after it is first imported."""

        def find_spec(self, name, path, target=None):
            if name != "megatron_tlt.drafter.trainer":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _inject(module)

            loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
