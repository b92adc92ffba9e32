"""Megatron distributed checkpoint (any TP/PP) -> HF safetensors + config.json + the tokenizer files.

The checkpoint is loaded on one rank at TP=1/PP=1 (Megatron's dist_checkpointing reshards on load),
converted tensor by tensor and written into a staging directory that becomes ``--out`` at the end. The
tokenizer files (and chat template) are those the checkpoint holds: ``tlt convert hf-to-mcore`` copies them from
the HF model, a training run from the policy it trains (``rl/run/checkpoint.py``), so the output serves as it is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megatron_tlt.formats.hf_io import atomic_output_dir, check_output_dir, copy_tokenizer_files, write_hf_weights
from megatron_tlt.formats.policy_meta import PolicyCheckpointMeta
from megatron_tlt.launcher import run_on_ranks

logger = logging.getLogger(__name__)


def _export_on_rank(ckpt_dir: str, staging: str, max_shard_size: str) -> None:
    from megatron_tlt.model import policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.weight_sync import iter_hf_tensors

    with ParallelLayout():
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        # the same Megatron -> HF path as the weight sync; copies, since safetensors refuses shared storage
        tensors = {name: tensor.clone() for name, tensor in
                   iter_hf_tensors(model, meta.arch, padded_vocab_size=meta.padded_vocab_size)}
        write_hf_weights(tensors, Path(staging), max_shard_size=max_shard_size)


def convert_mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, max_shard_size: str = "2GB") -> Path:
    ckpt_dir = Path(ckpt_dir)
    meta = PolicyCheckpointMeta.read(ckpt_dir)
    arch = meta.arch  # validates the stored config
    check_output_dir(out_dir)
    with atomic_output_dir(out_dir) as staging:
        logger.info("exporting %s (%s, saved at TP=%d PP=%d) -> %s", ckpt_dir, arch.architecture,
                    meta.saved_tensor_parallel_size, meta.saved_pipeline_parallel_size, out_dir)
        run_on_ranks(_export_on_rank, 1, str(ckpt_dir), str(staging), max_shard_size)
        config = dict(meta.hf_config)
        config["architectures"] = [arch.architecture]
        config.setdefault("model_type", arch.family)  # transformers' AutoConfig needs it (the tiny default's has none)
        config["torch_dtype"] = meta.dtype
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if not copy_tokenizer_files(ckpt_dir, staging):  # a checkpoint of a run from before they were kept
            logger.warning("%s holds no tokenizer files: copy those of the policy it came from (tokenizer.json or "
                           "tokenizer.model, tokenizer_config.json, ...) into %s before serving it", ckpt_dir, out_dir)
    return Path(out_dir)
