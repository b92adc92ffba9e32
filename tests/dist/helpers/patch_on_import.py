"""How the test helpers change a module of megatron_tlt in every process of a run: their ``sitecustomize``
(helpers/slow_rank, helpers/drafter_fault) runs at interpreter start, before the module exists, and
registers a patch that is applied right after the module is first imported."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def patch_after_import(module_name: str, patch: Callable) -> None:
    """Call ``patch(module)`` right after ``module_name`` is first imported in this process."""

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
