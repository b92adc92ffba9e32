import pytest
import torch

# GPU-only paths (NCCL, CUDA graphs, Transformer Engine FP8) live under tests/gpu and are skipped here.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
