"""Loading the RL policy: from a policy checkpoint (a run's, or the tiny default's warm-up, which is kept as
an ordinary policy checkpoint in the cache and so also converts with ``tlt convert``) or from an HF model
directory. Which one a run starts from is its task source's answer (``rl/inputs/task.py``).

Either gives a Megatron model at the current layout, built with per-token loss normalisation (what
the RL update needs), plus the metadata a policy checkpoint records.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tlt.config import TLTConfig, build_options
from megatron_tlt.formats import policy_meta
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.hf_io import HFCheckpointReader
from megatron_tlt.model import mcore, policy
from megatron_tlt.model.build_options import BuildOptions


def checkpoint_meta(arch: PolicyArchitecture, dtype: str) -> policy_meta.PolicyCheckpointMeta:
    """What a policy checkpoint written at the current layout records."""
    stage = mcore.stage_info()
    return policy_meta.PolicyCheckpointMeta(
        format_version=policy_meta.FORMAT_VERSION, hf_config=arch.hf_config,
        padded_vocab_size=arch.padded_vocab_size(stage.tp_size), dtype=dtype,
        saved_tensor_parallel_size=stage.tp_size, saved_pipeline_parallel_size=stage.pp_size)


def load_hf_policy(hf_dir: str, arch: PolicyArchitecture, dtype: str,
                   options: BuildOptions = BuildOptions()) -> torch.nn.Module:
    padded = arch.padded_vocab_size(mcore.stage_info().tp_size)
    model = policy.build_policy(arch, dtype=dtype, padded_vocab_size=padded, per_token_loss=True, options=options)
    reader = HFCheckpointReader(hf_dir)
    policy.load_hf_weights(model, arch, lambda n: reader.get(n).to(model.config.params_dtype), padded)
    return model


def load_policy(config: TLTConfig, arch: PolicyArchitecture, source: Path | None) -> torch.nn.Module:
    """The policy from a policy checkpoint directory, or from ``model.hf_dir`` when ``source`` is None."""
    if source is None:
        return load_hf_policy(config.model.hf_dir, arch, config.model.dtype, build_options(config))
    model, _ = policy.load_policy_checkpoint(source, dtype=config.model.dtype, per_token_loss=True,
                                             options=build_options(config))
    return model
