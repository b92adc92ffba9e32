"""vLLM's layer-wise weight reload warns "<layer>: Failed to load weights" for a layer that held tensors and got
none. After every policy sync it says so of the rotary embedding: its cos/sin table is computed from the config,
no checkpoint carries it, and vLLM puts the table back as it was. Harmless, but a warning per sync reads as a fault
to a user: it is said once, with what it means, and dropped after. A warning of any other layer passes as it is,
since that one would be a real loss (drafter pushes name only the drafter's own layers: ``engine.py``).
"""

from __future__ import annotations

import logging
import re

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_ROTARY_NOT_LOADED = re.compile(r"\w*RotaryEmbedding$")


class RotaryCacheNotice(logging.Filter):
    """Rewrites the first rotary "Failed to load weights" record into what it means; drops the rest."""

    def __init__(self):
        super().__init__()
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        if not _ROTARY_NOT_LOADED.match(layer):
            return True
        if self.explained:
            return False
        self.explained = True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg = ("%s: vLLM's weight reload found no weights for the rotary embedding. Its cos/sin table is "
                      "computed from the config, never loaded, and vLLM keeps it: harmless. Said once; the same "
                      "warning after later syncs is dropped")
        return True


def explain_rotary_reload_warning() -> None:
    """Install the notice on vLLM's reload logger (once per process)."""
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, RotaryCacheNotice) for f in reload_logger.filters):
        reload_logger.addFilter(RotaryCacheNotice())
