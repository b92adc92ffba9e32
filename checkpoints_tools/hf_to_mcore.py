"""HF safetensors (sharded or not) -> Megatron distributed checkpoint at a chosen TP/PP layout.

Every input is validated before any process starts or anything is written: the architecture,
the layout against the head and layer counts, every shard of the checkpoint and every tensor the
model needs. The tp x pp ranks then each fill their Megatron stage and write its shards into a
staging directory, which becomes ``--out`` only when all of them succeeded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_tlt.formats.architecture import load_architecture
from megatron_tlt.formats.hf_io import HFCheckpointReader, atomic_output_dir, check_output_dir, copy_tokenizer_files
from megatron_tlt.formats.policy_meta import FORMAT_VERSION, PolicyCheckpointMeta
from megatron_tlt.launcher import run_on_ranks

logger = logging.getLogger(__name__)


def _convert_on_rank(hf_dir: str, staging: str, tp: int, pp: int, meta: PolicyCheckpointMeta) -> None:
    from megatron_tlt.model import policy
    from megatron_tlt.parallel import ParallelLayout

    with ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp):
        arch = meta.arch
        model = policy.build_policy(arch, dtype=meta.dtype, padded_vocab_size=meta.padded_vocab_size)
        reader = HFCheckpointReader(hf_dir)
        policy.load_hf_weights(model, arch, lambda n: reader.get(n).to(model.config.params_dtype),
                               meta.padded_vocab_size)
        policy.save_policy_checkpoint(model, Path(staging), meta)


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1,
                        dtype: str | None = None) -> Path:
    """Convert and return the output directory. Raises ValueError subclasses on bad input."""
    hf_dir = Path(hf_dir)
    arch = load_architecture(hf_dir)
    arch.validate_layout(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    # deferred: torch (~1.9 s) and Megatron (~3.5 s) to import; a bad config or layout is refused first
    from megatron_tlt.formats import weights
    from megatron_tlt.model.policy import dtype_name

    reader = HFCheckpointReader(hf_dir)
    reader.require(weights.hf_names(arch))
    check_output_dir(out_dir)
    meta = PolicyCheckpointMeta(
        format_version=FORMAT_VERSION,
        hf_config=arch.hf_config,
        padded_vocab_size=arch.padded_vocab_size(tp),
        dtype=dtype or dtype_name(reader.dtype()),
        saved_tensor_parallel_size=tp,
        saved_pipeline_parallel_size=pp,
    )
    with atomic_output_dir(out_dir) as staging:
        logger.info("converting %s -> %s at TP=%d PP=%d (%s)", hf_dir, out_dir, tp, pp, meta.dtype)
        run_on_ranks(_convert_on_rank, tp * pp, str(hf_dir), str(staging), tp, pp, meta)
        copy_tokenizer_files(hf_dir, staging)
    return Path(out_dir)
