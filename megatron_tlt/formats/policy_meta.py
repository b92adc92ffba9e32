"""What a policy checkpoint directory says about itself (``tlt_checkpoint.json``), and reading it back.

Free of torch and Megatron so that ``tlt`` checks a checkpoint before it starts any rank; building,
saving and loading the policy itself is ``model/policy.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_tlt.formats.architecture import PolicyArchitecture, architecture_from_dict
from megatron_tlt.formats.hf_io import CheckpointError

META_FILE = "tlt_checkpoint.json"
MODEL_SUBDIR = "model"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyCheckpointMeta:
    """Contents of ``tlt_checkpoint.json``."""

    format_version: int
    hf_config: dict[str, Any]
    padded_vocab_size: int
    dtype: str
    saved_tensor_parallel_size: int
    saved_pipeline_parallel_size: int

    @property
    def arch(self) -> PolicyArchitecture:
        return architecture_from_dict(self.hf_config, source=META_FILE)

    def write(self, ckpt_dir: Path) -> None:
        (ckpt_dir / META_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> "PolicyCheckpointMeta":
        ckpt_dir = Path(ckpt_dir)
        path = ckpt_dir / META_FILE
        if not path.is_file():
            raise CheckpointError(f"{ckpt_dir}: not a megatron-tlt checkpoint ({META_FILE} missing)")
        if not (ckpt_dir / MODEL_SUBDIR / "metadata.json").is_file():
            raise CheckpointError(f"{ckpt_dir}: distributed checkpoint '{MODEL_SUBDIR}/' is missing or incomplete")
        try:
            raw = json.loads(path.read_text())
            meta = cls(**raw)
        except (json.JSONDecodeError, TypeError) as err:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({err})") from None
        if meta.format_version != FORMAT_VERSION:
            raise CheckpointError(f"{path}: format version {meta.format_version}, expected {FORMAT_VERSION}")
        return meta
