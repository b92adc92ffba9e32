"""A drafter on disk, in the EAGLE layout vLLM serves: ``config.json`` + ``model.safetensors`` (+ our notes).

    config.json          the policy's config as a one-layer Llama (spec/eagle.eagle_drafter_config)
    model.safetensors    fc.weight, layers.0.* under vLLM's names: no embedding, no LM head
    tlt_drafter.json     what megatron-tlt knows about it: RL step, tokens trained, where it came from

The same directory is a drafter checkpoint of a run, the output of ``tlt warmup-drafter`` and what
``drafter.init_dir`` starts a run from. Its writers call ``write_drafter_files`` on a staging directory
that is renamed when complete (``atomic_files.atomic_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.hf_io import CheckpointError
from megatron_tlt.spec.eagle import DrafterMismatch, eagle_drafter_config, validate_drafter

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
INFO_FILE = "tlt_drafter.json"


def write_drafter_files(directory: Path, arch: PolicyArchitecture, tensors: dict[str, torch.Tensor],
                        info: dict) -> None:
    """Write a drafter into an existing (staging) directory; ``info`` goes to tlt_drafter.json."""
    from safetensors.torch import save_file  # deferred: imports torch, which checking a drafter directory needs not

    validate_drafter(arch, tensors)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(eagle_drafter_config(arch), indent=2, sort_keys=True))
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))


def read_drafter_info(directory: Path) -> dict:
    path = Path(directory) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def read_drafter_tensors(directory: str | Path, arch: PolicyArchitecture) -> dict[str, torch.Tensor]:
    """The drafter tensors in ``directory``, checked against the policy it is to draft for."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}; not a drafter directory")
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    try:
        validate_drafter(arch, tensors)
    except DrafterMismatch as err:
        raise DrafterMismatch(f"{directory}: {err}") from None
    return tensors
