"""Where the RL policy starts from: an HF model directory, or the tiny default warmed up (cached).

Both give a Megatron model at the current layout, built with per-token loss normalisation (what
the RL update needs), plus the metadata a policy checkpoint records. The warmed-up tiny policy is
kept as an ordinary policy checkpoint in the cache, so it also converts with ``tlt convert``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_tlt import atomic_files, mcore, policy, policy_meta
from megatron_tlt.build_options import BuildOptions
from megatron_tlt.config import TLTConfig, build_options
from megatron_tlt.hf_io import HFCheckpointReader
from megatron_tlt.model_config import PolicyArchitecture
from megatron_tlt.rl import checkpoint, shipped_start, tiny_default
from megatron_tlt.rl.warmup import WarmupSchedule, run_warmup
from megatron_tlt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def checkpoint_meta(arch: PolicyArchitecture, dtype: str) -> policy_meta.PolicyCheckpointMeta:
    """What a policy checkpoint written at the current layout records."""
    stage = mcore.stage_info()
    return policy_meta.PolicyCheckpointMeta(
        format_version=policy_meta.FORMAT_VERSION, hf_config=arch.hf_config,
        padded_vocab_size=arch.padded_vocab_size(stage.tp_size), dtype=dtype,
        saved_tensor_parallel_size=stage.tp_size, saved_pipeline_parallel_size=stage.pp_size)


def warmed_up_dir(config: TLTConfig, tokenizer: Tokenizer) -> Path:
    """The cache entry of the warmed-up tiny policy for this config (it may not exist yet)."""
    warmup = tiny_default.warmup_recipe(config)
    shape = tiny_default.TaskShape.of(config)
    # The default task shape keeps the key it had before the shape was configurable: cached entries stay valid.
    task = {} if shape == tiny_default.TaskShape() else dict(task=dataclasses.asdict(shape))
    key = tiny_default.cache_key(kind="warmup", policy=tiny_default.policy_config(config), vocab=tokenizer.vocab_size,
                                 warmup=warmup, seed=config.trainer.seed, dtype=config.model.dtype,
                                 attention=config.model.attention, **task)
    return tiny_default.cache_root(config.warmup.cache_dir) / f"policy-{key}"


def _warm_up_tiny_policy(config: TLTConfig, tokenizer: Tokenizer, arch: PolicyArchitecture, final: Path,
                         show_progress: bool) -> None:
    """Build the tiny policy from Megatron's initialisation, warm it up and publish it at ``final``."""
    model = policy.build_policy(arch, dtype=config.model.dtype, padded_vocab_size=arch.padded_vocab_size(
        mcore.stage_info().tp_size), per_token_loss=True, options=build_options(config))
    ddp = mcore.wrap_ddp(model)
    optimizer = mcore.build_optimizer(ddp, lr=config.warmup.lr, weight_decay=0.0, clip_grad=1.0)
    schedule = WarmupSchedule(steps=config.warmup.steps, sequences_per_step=config.warmup.sequences_per_step,
                              micro_batch_size=config.warmup.micro_batch_size, lr=config.warmup.lr,
                              seed=config.trainer.seed)
    corpus = tiny_default.warmup_sequences(tokenizer, config.warmup.corpus_size,
                                           config.warmup.other_answer_format_share, tiny_default.TaskShape.of(config),
                                           check_share=config.warmup.check_share,
                                           max_solution_tokens=config.rollout.max_response_tokens)
    progress = None
    if show_progress:
        from tqdm.auto import tqdm

        from megatron_tlt.rank_logs import console

        # leave=False: once the warm-up is done the RL steps' bar is the console's only one
        progress = tqdm(total=schedule.steps, desc="supervised warm-up (cached for later runs)", unit="step",
                        dynamic_ncols=True, file=console(), leave=False)

    def on_step(step: int, loss: float | None) -> None:
        if progress is not None:
            progress.update(1)
            if loss is not None:
                progress.set_postfix(loss=f"{loss:.3f}", refresh=False)

    run_warmup(ddp, optimizer, corpus, schedule, vocab_size=arch.vocab_size, pad_id=tokenizer.pad_id,
               dp_rank=mcore.data_parallel_rank(), dp_size=mcore.data_parallel_size(), on_step=on_step)
    if progress is not None:
        progress.close()
    # Same staging name on every rank (the save is collective), unique to this cache entry.
    staging = atomic_files.staging_path(final)
    if dist.get_rank() == 0:
        atomic_files.remove(staging)
    dist.barrier()
    policy.save_policy_checkpoint(ddp, staging, checkpoint_meta(arch, config.model.dtype))
    # Kept so RL can continue this optimizer (see RLTrainer): its second moments scale RL's first steps.
    checkpoint.save_optimizer_state(staging, optimizer, mcore.data_parallel_rank())
    dist.barrier()
    if dist.get_rank() == 0:
        atomic_files.publish(staging, final, if_exists="keep")  # another process made it first: keep theirs
    dist.barrier()


def initial_policy_dir(config: TLTConfig, tokenizer: Tokenizer, arch: PolicyArchitecture, *,
                       show_progress: bool) -> Path | None:
    """For the tiny default: the warmed-up policy checkpoint, made now if not cached (collective).
    None for an HF policy (loaded with ``load_hf_policy``)."""
    if config.model.hf_dir is not None:
        return None
    final = warmed_up_dir(config, tokenizer)
    if not (final / policy_meta.META_FILE).is_file():
        if not (config.warmup.use_shipped and shipped_start.install(final)):
            _warm_up_tiny_policy(config, tokenizer, arch, final, show_progress)
    elif show_progress:
        logger.info("using the cached warmed-up policy %s", final)
    return final


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
