"""The repository's scripts (bench/, docs/: folders that are not packages) imported as modules, for tests of their
functions."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str):
    """``REPO/relative_path`` imported as module ``name`` (registered before it runs: its dataclasses look their
    module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
