"""The EAGLE drafter's training in bf16 against FP8 (each backend there is), side by side: tokens/s and loss.

    python bench/drafter_precision.py --out drafter_precision.json        # a GPU; Llama-3.3-70B's drafter dims
    python bench/drafter_precision.py --device cpu --small                # a smoke run anywhere (FP8 arms skipped)

Each arm builds the project's ``DrafterTrainer`` from the same seed (the same initial weights) and trains it on
the same synthetic packs in the same order: ``--warmup`` untimed micro-steps (TE's delayed scaling and torchao's
first casts settle), then ``--steps`` timed ones; tokens/s counts the packs' own rows (not FP8's padding). The
policy's embedding and LM head are random (N(0, 0.02)) and a row's feature is rmsnorm(embed(token)), so the
next feature follows from the next token, which the drafter reads: a task it can learn, and the loss moves.
"loss" is every arm's weights after the same steps, exported as the engines get them (bf16) and evaluated by one
bf16 drafter on the first packs, so the arms are compared on one measure. The target (DESIGN.md section 5):
FP8 >= 1.3x bf16 tokens/s at these dims on Hopper, the same loss within noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from megatron_tlt.config import DrafterConfig
from megatron_tlt.drafter.precision import FP8_BACKENDS, DrafterPrecision, fp8_backend_unavailable_reason
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.architecture import architecture_from_dict, load_architecture
from megatron_tlt.model.tiny_models import TINY_LLAMA

LLAMA_70B_DIR = Path(__file__).resolve().parents[1] / "launch" / "models" / "llama-3.3-70b"
HF_CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "hf.yaml"
_INIT_STD = 0.02


def synthetic_sequences(arch, *, rows: int, max_length: int, device, generator: torch.Generator):
    """Token ids and post-norm features (bf16, on ``device``) of sequences of ~``rows`` rows in all, and the
    policy heads they come from: feature = rmsnorm(embed(token))."""
    on_device = torch.Generator(device).manual_seed(int(torch.randint(1 << 30, (), generator=generator)))

    def policy_head() -> torch.Tensor:  # made on the device: 128256 x 8192 at 70B dims
        shape = (arch.vocab_size, arch.hidden_size)
        return (torch.randn(shape, generator=on_device, device=device) * _INIT_STD).to(torch.bfloat16)

    embed, lm_head = policy_head(), policy_head()
    token_ids, features, total = [], [], 0
    while total < rows:
        length = int(torch.randint(max_length // 4, max_length + 1, (), generator=generator))
        tokens = torch.randint(0, arch.vocab_size, (length,), generator=generator)
        e = embed[tokens[:-1].to(device)].float()
        features.append((e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps)).to(torch.bfloat16))
        token_ids.append(tokens.tolist())
        total += length - 2  # the EAGLE rows a sequence of this length gives
    return token_ids, features, {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(arch, settings, precision: DrafterPrecision, data, *, warmup: int, steps: int) -> tuple[dict, dict]:
    """Train one arm; returns its figures and its exported weights."""
    token_ids, features, heads = data
    device = precision.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = DrafterTrainer(arch, settings, seed=0, precision=precision)
    trainer.set_policy_heads(heads)
    trainer.add_sequences(token_ids, features)
    for _ in range(warmup):
        trainer.micro_step()
    _sync(device)
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += trainer.micro_step()
    _sync(device)
    seconds = time.perf_counter() - start
    figures = {"arm": precision.label, "tokens_per_s": tokens / seconds, "ms_per_micro_step": 1e3 * seconds / steps,
               "train_loss_timed_steps": trainer.phase_stats()["loss"],
               "params": sum(p.numel() for p in trainer.drafter.parameters())}
    if device.type == "cuda":
        figures["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    exported = trainer.export_tensors()
    del trainer
    return figures, exported


def pretrained_drafter_lr() -> float:
    """The drafter lr of the config for pretrained models: at 70B dims the default's 1e-3 diverged on an H200
    (the loss rose from 11.6 to 917 in 35 micro-steps, bench/RESULTS.md), so the arms are compared at that one."""
    return float(OmegaConf.load(HF_CONFIG).drafter.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="the tiny Llama's dims: a smoke run on any device")
    parser.add_argument("--pack-tokens", type=int, default=None, help="rows per pack (default 1024; --small 128)")
    parser.add_argument("--packs", type=int, default=8, help="distinct packs the micro-steps cycle over")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed micro-steps per arm")
    parser.add_argument("--unroll-steps", type=int, default=1, help="drafter.unroll_steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="drafter.lr (default: launch/configs/hf.yaml's at 70B dims, DrafterConfig's with --small)")
    parser.add_argument("--out", default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    if args.lr is None:
        args.lr = DrafterConfig.lr if args.small else pretrained_drafter_lr()

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = architecture_from_dict(TINY_LLAMA) if args.small else load_architecture(LLAMA_70B_DIR)
    pack_tokens = args.pack_tokens or (128 if args.small else 1024)
    settings = DrafterConfig(lr=args.lr, pack_tokens=pack_tokens, buffer_tokens=pack_tokens * args.packs * 2,
                             unroll_steps=args.unroll_steps)
    data = synthetic_sequences(arch, rows=pack_tokens * args.packs, max_length=pack_tokens, device=device,
                               generator=torch.Generator().manual_seed(0))
    arms: list[dict] = []
    weights: dict[str, dict] = {}
    for backend in (None, *FP8_BACKENDS):
        reason = None if backend is None else fp8_backend_unavailable_reason(backend)
        if reason is None and backend is not None and device.type != "cuda":
            reason = f"--device {device.type}: FP8 runs on a CUDA device of capability 8.9+"
        if reason is not None:
            arms.append({"arm": f"fp8 ({backend})", "skipped": reason})
            continue
        precision = DrafterPrecision(device, torch.bfloat16, fp8_backend=backend)
        figures, weights[precision.label] = run_arm(arch, settings, precision, data, warmup=args.warmup,
                                                    steps=args.steps)
        arms.append(figures)

    # One bf16 drafter evaluates every arm's exported weights on the first packs' sequences.
    judge = DrafterTrainer(arch, settings, seed=0, precision=DrafterPrecision(device, torch.bfloat16))
    judge.set_policy_heads(data[2])
    eval_ids, eval_features = data[0][:max(1, len(data[0]) // args.packs)], data[1][:max(1, len(data[1]) // args.packs)]
    start_loss = judge.evaluate(eval_ids, eval_features)
    bf16 = next(a for a in arms if a["arm"] == "bf16")
    for arm in arms:
        if "skipped" in arm:
            continue
        judge.drafter.load_tensors(weights[arm["arm"]])
        totals = judge.evaluate(eval_ids, eval_features)
        arm["loss_after"] = totals["loss_sum"] / totals["tokens"]
        arm["tokens_per_s_vs_bf16"] = arm["tokens_per_s"] / bf16["tokens_per_s"]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    steps_done = args.warmup + args.steps
    print(f"EAGLE drafter training, {'tiny' if args.small else 'Llama-3.3-70B'} dims (hidden {arch.hidden_size}, "
          f"{bf16['params'] / 1e9:.3g}B params), packs of {pack_tokens} rows, unroll {args.unroll_steps}, on {name}: "
          f"{args.steps} timed micro-steps after {args.warmup}; loss before training "
          f"{start_loss['loss_sum'] / start_loss['tokens']:.4f}")
    print(f"{'arm':<26}{'tokens/s':>10}{'vs bf16':>9}{'ms/step':>9}{'peak GiB':>10}  loss after {steps_done} steps")
    for arm in arms:
        if "skipped" in arm:
            print(f"{arm['arm']:<26}skipped: {arm['skipped']}")
            continue
        peak = f"{arm['peak_gib']:.1f}" if "peak_gib" in arm else "-"
        print(f"{arm['arm']:<26}{arm['tokens_per_s']:>10.0f}{arm['tokens_per_s_vs_bf16']:>8.2f}x"
              f"{arm['ms_per_micro_step']:>9.1f}{peak:>10}  {arm['loss_after']:.4f}")
    if args.out:
        report = {"device": name, "dims": "tiny" if args.small else "llama-3.3-70b", "hidden": arch.hidden_size,
                  "pack_tokens": pack_tokens, "warmup": args.warmup, "steps": args.steps,
                  "unroll_steps": args.unroll_steps, "lr": args.lr,
                  "loss_before": start_loss["loss_sum"] / start_loss["tokens"], "arms": arms}
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
