"""Read and write Hugging Face model directories (config.json + safetensors, sharded or not).

Reading is lazy (tensors are memory-mapped one at a time) and validated up front: every shard the
index names must exist and open, and every tensor the architecture needs must be present, so a
converter fails before it writes anything. Writing goes to a staging directory that is renamed
into place at the end (``atomic_files.atomic_dir``), so a failure never leaves a half-written model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open

from megatron_tlt.atomic_files import atomic_dir

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files that travel with the weights so the output is a complete, loadable model directory: the tokenizer
# (fast, sentencepiece or byte-level BPE), its special tokens, the chat template (inside
# tokenizer_config.json, or its own file since transformers 4.43/5) and the generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(ValueError):
    """A model directory that is missing, incomplete or corrupt."""


class HFCheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._name_to_file = self._index()
        self._handles: dict[Path, object] = {}
        for path in sorted(set(self._name_to_file.values())):
            self._open(path)

    def _index(self) -> dict[str, Path]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index_path}: unreadable index ({err})") from None
            return {name: self.model_dir / fname for name, fname in weight_map.items()}
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            with self._open_file(single) as handle:
                return {name: single for name in handle.keys()}
        raise CheckpointError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")

    @staticmethod
    def _open_file(path: Path):
        if not path.is_file():
            raise CheckpointError(f"{path}: safetensors file is missing")
        try:
            return safe_open(str(path), framework="pt")
        except SafetensorError as err:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({err})") from None

    def _open(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open_file(path).__enter__()
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._name_to_file)

    def require(self, names: Iterable[str]) -> None:
        missing = [n for n in names if n not in self._name_to_file]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise CheckpointError(f"{self.model_dir}: {len(missing)} tensors missing from the checkpoint: {shown}")

    def get(self, name: str) -> torch.Tensor:
        if name not in self._name_to_file:
            raise CheckpointError(f"{self.model_dir}: tensor {name} not found")
        return self._open(self._name_to_file[name]).get_tensor(name)

    def dtype(self) -> torch.dtype:
        first = next(iter(self._name_to_file))
        return self.get(first).dtype


def write_hf_weights(tensors: dict[str, torch.Tensor], out_dir: Path, *, max_shard_size: str = "2GB") -> None:
    """Save tensors as safetensors, sharded with an index when larger than ``max_shard_size``."""
    from safetensors.torch import save_file  # deferred: imports torch (~1.9 s), which validating input needs not

    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(out_dir / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the ``TOKENIZER_FILES`` that ``src_dir`` holds into ``dst_dir``; returns their names."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def check_output_dir(out_dir: str | Path) -> Path:
    """Refuse to overwrite an existing, non-empty output directory."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: output already exists and is not empty; choose a new --out")
    return out


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """A new output directory written atomically: refused if it exists and is not empty
    (``check_output_dir``), staged beside it and renamed into place when the block succeeds."""
    with atomic_dir(check_output_dir(out_dir)) as staging:
        yield staging
