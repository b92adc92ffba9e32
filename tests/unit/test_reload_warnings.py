"""vLLM's "Failed to load weights" after a policy sync: said once with its meaning for the rotary cache, passed as
it is for any other layer (``spec/reload_warnings.py``)."""

import logging

from megatron_tlt.spec.reload_warnings import RotaryCacheNotice


def _record(layer: str) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", (layer,), None)


def test_the_rotary_warning_is_explained_once_then_dropped():
    notice = RotaryCacheNotice()
    first = _record("Llama3RotaryEmbedding")
    assert notice.filter(first)
    assert first.levelno == logging.INFO and "harmless" in first.getMessage()
    assert first.getMessage().startswith("Llama3RotaryEmbedding: ")
    assert not notice.filter(_record("RotaryEmbedding"))  # a later sync's, any rope variant


def test_any_other_layer_that_failed_to_load_stays_a_warning():
    notice = RotaryCacheNotice()
    for layer in ("VocabParallelEmbedding", "ParallelLMHead", "QKVParallelLinear"):
        record = _record(layer)
        assert notice.filter(record) and record.levelno == logging.WARNING
        assert record.getMessage() == f"{layer}: Failed to load weights"
    other = logging.LogRecord("vllm", logging.WARNING, "x.py", 1, "Reloading weights inplace...", (), None)
    assert notice.filter(other) and other.levelno == logging.WARNING
