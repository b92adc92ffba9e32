"""Activation memory of a training step: the default policy spec (SDPA attention, no recompute) beside
Megatron's local attention spec and SDPA with full recompute, measured in one run, with ``tlt plan``'s
estimate of each.

    python bench/activation_memory.py                       # 4096 tokens, 4 layers, hidden 256, fp32
    python bench/activation_memory.py --seq-len 2048 --layers 8
    python bench/activation_memory.py --dtype bfloat16      # on a GPU: the dtype a GPU trains in

One rank, micro-batch 1, a randomly initialised Llama (8 heads, 4 KV heads, head_dim 32, FFN 688, vocabulary
500). Each spec is built in its own parallel layout (Megatron's global buffers start empty), takes a
32-token step (Adam's state, so it is not counted), then the measured step at full length; its peak
(``memory_meter.PeakMemoryMeter``) is what the step adds on top of the model state: activations, the
loss, Megatron's buffers for this length and backward temporaries. Acceptance (issue 16): the default
spec's peak is at most half of the local spec's.
"""

from __future__ import annotations

import argparse

from megatron_tlt.launcher import run_on_ranks

SPECS = (("sdpa", "none"), ("local", "none"), ("sdpa", "full"))


def _model(args: argparse.Namespace) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=args.hidden,
                intermediate_size=688 * args.hidden // 256, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=500,
                max_position_embeddings=max(4096, args.seq_len), rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False)


def _measure(args: argparse.Namespace) -> list[int]:
    import torch

    from megatron_tlt.formats.architecture import architecture_from_dict
    from megatron_tlt.model import mcore
    from megatron_tlt.model.build_options import BuildOptions
    from megatron_tlt.model.lm_training import LMMicroBatch, lm_train_step
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.plan.memory_meter import PeakMemoryMeter

    arch = architecture_from_dict(_model(args))
    peaks = []
    for attention, recompute in SPECS:
        g = torch.Generator().manual_seed(0)
        short, full = (torch.randint(0, arch.vocab_size, (1, n + 1), generator=g) for n in (32, args.seq_len))
        with ParallelLayout():
            model = mcore.build_gpt_model(arch, dtype=args.dtype, padded_vocab_size=arch.padded_vocab_size(1),
                                          per_token_loss=True,
                                          options=BuildOptions(attention=attention, recompute=recompute))
            model = mcore.wrap_ddp(model)
            optimizer = mcore.build_optimizer(model, lr=1e-4)
            lm_train_step(model, optimizer, [LMMicroBatch(short, torch.ones_like(short))], vocab_size=arch.vocab_size)
            with PeakMemoryMeter() as meter:
                lm_train_step(model, optimizer, [LMMicroBatch(full, torch.ones_like(full))], vocab_size=arch.vocab_size)
            peaks.append(meter.peak_bytes)
    return peaks


def _planned(args: argparse.Namespace) -> list[float]:
    from megatron_tlt.formats.architecture import architecture_from_dict
    from megatron_tlt.plan.memory import DTYPE_BYTES, ActivationSetting, stage_activations

    arch = architecture_from_dict(_model(args))
    return [stage_activations(arch, ActivationSetting(seq_len=args.seq_len, attention=a, recompute=r,
                                                                param_bytes=DTYPE_BYTES[args.dtype]),
                              num_layers=args.layers, in_flight=1, first_stage=True, last_stage=True,
                              padded_vocab_size=arch.padded_vocab_size(1)).peak_bytes for a, r in SPECS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 256 (8 heads)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    measured = run_on_ranks(_measure, 1, args)[0]
    planned = _planned(args)
    mib = 2**20
    names = [f"{a}, recompute {r}" for a, r in SPECS]
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"step peak above the model state, {args.layers} layers, hidden {args.hidden}, {args.seq_len} tokens, "
          f"{args.dtype}, one rank, micro-batch 1, {where}")
    print(f"{'':22}" + "".join(f"{n:>24}" for n in names))
    print(f"{'measured (MiB)':22}" + "".join(f"{m / mib:>24.1f}" for m in measured))
    print(f"{'tlt plan (MiB)':22}" + "".join(f"{p / mib:>24.1f}" for p in planned))
    print(f"{'plan / measured':22}" + "".join(f"{p / m:>24.3f}" for p, m in zip(planned, measured)))
    print(f"{'/ local spec':22}" + "".join(f"{m / measured[1]:>24.3f}" for m in measured))
    ratio = measured[0] / measured[1]
    verdict = "met" if ratio <= 0.5 else "NOT met"
    print(f"acceptance: the default spec (sdpa, no recompute) at most half of the local spec's: {ratio:.3f}, {verdict}")


if __name__ == "__main__":
    main()
