"""The policy on this rank: build it, fill it from HF tensors, save/load Megatron checkpoints.

A Megatron checkpoint directory written by megatron-tlt holds
  ``model/``            the Megatron distributed checkpoint (loadable at any TP/PP layout);
  ``tlt_checkpoint.json`` what is needed to rebuild the model: the HF config, the padded
                        vocabulary size, the dtype and the layout it was written from;
  tokenizer files       copied from the source model so the directory is self-contained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tlt.device import module_device, to_device
from megatron_tlt.formats import weights
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.formats.hf_io import CheckpointError
from megatron_tlt.formats.policy_meta import MODEL_SUBDIR, PolicyCheckpointMeta
from megatron_tlt.model import mcore
from megatron_tlt.model.build_options import BuildOptions
from megatron_tlt.model.lm_training import token_width


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in mcore.DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(mcore.DTYPES)}")


def _local_parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name in mcore.unwrap(model).state_dict() if not name.endswith("_extra_state")]


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, arch: PolicyArchitecture, get_hf: weights.TensorGetter,
                    padded_vocab_size: int) -> None:
    """Copy HF tensors into this rank's (TP slice, PP stage) of the Megatron model."""
    stage = mcore.stage_info()
    layers_per_stage = arch.num_layers // stage.pp_size
    state = mcore.unwrap(model).state_dict()
    for name in _local_parameter_names(model):
        full_name = weights.global_name(name, stage.pp_rank, layers_per_stage)
        full = weights.to_megatron_full(arch, full_name, get_hf, padded_vocab_size)
        shard = weights.shard_for_tp(full_name, full, stage.tp_rank, stage.tp_size)
        target = state[name]
        if shard.shape != target.shape:
            raise CheckpointError(f"{name}: checkpoint gives shape {tuple(shard.shape)}, model expects {tuple(target.shape)}")
        target.copy_(shard)


def build_policy(arch: PolicyArchitecture, *, dtype: str, padded_vocab_size: int, per_token_loss: bool = False,
                 options: BuildOptions = BuildOptions()) -> torch.nn.Module:
    return mcore.build_gpt_model(arch, dtype=dtype, padded_vocab_size=padded_vocab_size,
                                 per_token_loss=per_token_loss, options=options)


def save_policy_checkpoint(model: torch.nn.Module, ckpt_dir: Path, meta: PolicyCheckpointMeta) -> None:
    """Collective: every rank writes its shards; rank 0 writes the metadata."""
    mcore.save_distributed(model, ckpt_dir / MODEL_SUBDIR)
    if torch.distributed.get_rank() == 0:
        meta.write(ckpt_dir)


def load_policy_checkpoint(ckpt_dir: str | Path, *, dtype: str | None = None, per_token_loss: bool = False,
                           options: BuildOptions = BuildOptions()) -> tuple[torch.nn.Module, PolicyCheckpointMeta]:
    """Build this rank's policy stage at the current layout and fill it from ``ckpt_dir``."""
    meta = PolicyCheckpointMeta.read(ckpt_dir)
    arch = meta.arch
    stage = mcore.stage_info()
    arch.validate_layout(tensor_parallel_size=stage.tp_size, pipeline_parallel_size=stage.pp_size)
    if meta.padded_vocab_size % stage.tp_size:
        raise CheckpointError(
            f"{ckpt_dir}: padded vocabulary {meta.padded_vocab_size} is not divisible by tensor parallel size {stage.tp_size}"
        )
    model = build_policy(arch, dtype=dtype or meta.dtype, padded_vocab_size=meta.padded_vocab_size,
                         per_token_loss=per_token_loss, options=options)
    mcore.load_distributed(model, Path(ckpt_dir) / MODEL_SUBDIR)
    return model, meta


@torch.no_grad()
def forward_logits(model: torch.nn.Module, input_ids_bs: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, vocab] of the policy, through Megatron's pipeline schedule.

    Collective over the model-parallel ranks; ``input_ids_bs`` may sit on any device (they move to the
    model's). Returns the logits, on the model's device, on the last pipeline stage and None on the others.
    With sequence parallelism the ids are right-padded to a multiple of the TP size (causal attention hides
    the padding) and the logits cut back to ``s``.
    """
    model.eval()
    b, s = input_ids_bs.shape
    # Every id is model input here: no label column, hence the - 1 around the token-row rule.
    width = token_width(s + 1, mcore.sequence_multiple(model)) - 1
    padded_bs = torch.nn.functional.pad(input_ids_bs, (0, width - s))
    padded_bs = to_device(padded_bs, module_device(model))
    collected: list[torch.Tensor] = []

    def loss_fn(output_bsv: torch.Tensor):
        collected.append(mcore.gather_vocab_logits(output_bsv, vocab_size)[:, :s])
        return output_bsv.new_zeros(()), {}

    def forward_step(data_iterator, stage_model):
        input_ids = next(data_iterator)
        output = stage_model(input_ids, mcore.position_ids_like(input_ids), None)
        return output, loss_fn

    mcore.run_schedule(model, forward_step, [padded_bs], seq_length=padded_bs.shape[1], micro_batch_size=b,
                       forward_only=True)
    return collected[0] if collected else None


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, vocab_size: int) -> list[int]:
    """Greedy continuation computed by Megatron itself (full recompute per token; for checks).

    Collective over the model-parallel ranks; every rank returns the same tokens.
    """
    device = module_device(model)  # the broadcast below runs on the model's backend (NCCL on GPU)
    ids = to_device(torch.tensor([prompt_ids]), device)
    for _ in range(max_new_tokens):
        logits = forward_logits(model, ids, vocab_size)
        next_token = (logits[:, -1].argmax(-1, keepdim=True) if logits is not None
                      else torch.zeros(1, 1, dtype=torch.long, device=device))
        mcore.broadcast_from_last_stage(next_token)
        ids = torch.cat([ids, next_token], dim=1)
    return ids[0, len(prompt_ids):].tolist()
