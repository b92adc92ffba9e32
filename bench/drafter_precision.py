"""The EAGLE drafter's training in bf16 against FP8 (each backend there is), eager and compiled, side by side:
tokens/s and loss.

    python bench/drafter_precision.py --out fp8.json --record       # a GPU, 70B drafter dims; rows into the table
    python bench/drafter_precision.py --merge fp8.json              # a saved run's rows into the table
    python bench/drafter_precision.py --device cpu --small          # a rehearsal anywhere (FP8 arms skipped)
    python bench/drafter_precision.py --device cpu --small --compile-backend aot_eager   # no C++ compiler needed

Arms (``--arms``, ``--no-compile``): ``bf16``, ``fp8-te`` (Transformer Engine), ``fp8-torchao`` eager, and
``bf16-compiled``, ``fp8-torchao-compiled``: the trainer's heavy regions under ``torch.compile``
(``DrafterTrainer.compile``: the drafter's fc and decoder layer, where every linear and its FP8 casts live, and the
loss with the frozen LM head's GEMMs and the softmax over the vocabulary, forward and backward), not the whole
micro-step, whose preemption points, data-dependent row mask and optimizer step would break the graph anyway.
Eager, torchao's float8 runs its amax, scale and cast as separate kernels around each GEMM (0.48x bf16 on an
H200, 2026-11-28); compiled, they fuse. TE has no compiled arm: it fuses its casts itself and its fp8_autocast
state is not traced. Each FP8 arm is compared with the bf16 arm of its own mode (``vs_bf16``, what
``--record`` writes into ``megatron_tlt/drafter/fp8_measured.json``, which ``drafter.precision=auto`` goes by);
the printout also gives every arm against both bf16 arms.

Each arm builds the project's ``DrafterTrainer`` from the same seed (the same initial weights) and trains it on
the same synthetic packs in the same order: ``--warmup`` untimed micro-steps (TE's delayed scaling and torchao's
first casts settle), then ``--steps`` timed ones; tokens/s counts the packs' own rows (not FP8's padding). The
policy's embedding and LM head are random (N(0, 0.02)) and a row's feature is rmsnorm(embed(token)), so the
next feature follows from the next token, which the drafter reads: a task it can learn, and the loss moves.
A compiled arm's warm-up includes its compilation (``warmup_s``); packs vary in rows, so torch.compile
recompiles once with a dynamic row count: use ``--warmup`` >= 3 for compiled arms.
"loss" is every arm's weights after the same steps, exported as the engines get them (bf16) and evaluated by one
bf16 drafter on the first packs, so the arms are compared on one measure. The target (DESIGN.md section 5):
FP8 >= 1.3x bf16 tokens/s at these dims on Hopper, the same loss within noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import OmegaConf

from megatron_tlt.config import DrafterConfig
from megatron_tlt.drafter import fp8_measured
from megatron_tlt.drafter.fp8_measured import COMPILED, EAGER, MEASURED_DIMS
from megatron_tlt.drafter.precision import (
    TORCHAO,
    TRANSFORMER_ENGINE,
    DrafterPrecision,
    fp8_backend_unavailable_reason,
)
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.architecture import architecture_from_dict, load_architecture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny model shapes
from tiny_models import TINY_LLAMA  # noqa: E402

LLAMA_70B_DIR = Path(__file__).resolve().parents[1] / "launch" / "models" / "llama-3.3-70b"
HF_CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "hf.yaml"
_INIT_STD = 0.02
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    backend: str | None
    """None: bf16; else the FP8 backend."""
    compile: str
    """``fp8_measured.EAGER`` or ``COMPILED``."""

    @property
    def label(self) -> str:
        precision = "bf16" if self.backend is None else f"fp8 ({self.backend})"
        return precision if self.compile == EAGER else f"{precision} compiled"


ARMS = (Arm("bf16", None, EAGER), Arm("fp8-te", TRANSFORMER_ENGINE, EAGER), Arm("fp8-torchao", TORCHAO, EAGER),
        Arm("bf16-compiled", None, COMPILED), Arm("fp8-torchao-compiled", TORCHAO, COMPILED))
_ARMS_BY_NAME = {arm.name: arm for arm in ARMS}


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


def skip_reason(arm: Arm, device: torch.device) -> str | None:
    """Why ``arm`` cannot run on ``device``, or None."""
    if arm.backend is None:
        return None
    if device.type != "cuda":
        return f"--device {device.type}: FP8 runs on a CUDA device of capability 8.9+"
    return fp8_backend_unavailable_reason(arm.backend)


def run_arm(arch, settings, arm: Arm, device: torch.device, data, *, warmup: int, steps: int,
            compile_options: dict) -> tuple[dict, dict]:
    """Train one arm; returns its figures and its exported weights."""
    token_ids, features, heads = data
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()  # no arm reuses another's compiled code or counts against its recompile limit
    trainer = DrafterTrainer(arch, settings, seed=0,
                             precision=DrafterPrecision(device, torch.bfloat16, fp8_backend=arm.backend))
    if arm.compile == COMPILED:
        trainer.compile(**compile_options)
    trainer.set_policy_heads(heads)
    trainer.add_sequences(token_ids, features)
    start = time.perf_counter()
    for _ in range(warmup):
        trainer.micro_step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    trainer.reset_phase_stats()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += trainer.micro_step()
    _sync(device)
    seconds = time.perf_counter() - start
    figures = {"arm": arm.label, "name": arm.name, "backend": arm.backend, "compile": arm.compile,
               "tokens_per_s": tokens / seconds, "ms_per_micro_step": 1e3 * seconds / steps, "warmup_s": warmup_s,
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


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for package, name in (("torchao", TORCHAO), ("transformer_engine", TRANSFORMER_ENGINE)):
        try:
            versions[name] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def compare_arms(arms: list[dict]) -> None:
    """Each arm that ran against each bf16 arm (``vs_bf16_eager``, ``vs_bf16_compiled``) and against the bf16 arm
    of its own mode (``vs_bf16``, with that arm's ``bf16_tokens_per_s``: what the table records)."""
    bf16 = {arm["compile"]: arm for arm in arms if "skipped" not in arm and arm["backend"] is None}
    for arm in arms:
        if "skipped" in arm:
            continue
        for mode, baseline in bf16.items():
            arm[f"vs_bf16_{mode}"] = arm["tokens_per_s"] / baseline["tokens_per_s"]
        if arm["compile"] in bf16:
            arm["vs_bf16"] = arm[f"vs_bf16_{arm['compile']}"]
            arm["bf16_tokens_per_s"] = bf16[arm["compile"]]["tokens_per_s"]


def record(report: dict, table: Path) -> None:
    """Merge the report's FP8 rows into the measured table; a report that cannot give rows (a CPU's, small dims,
    another compile backend) exits saying why."""
    try:
        rows = fp8_measured.rows_from_report(report)
    except ValueError as err:
        raise SystemExit(f"drafter_precision.py: {err}; {table} unchanged") from None
    fp8_measured.write_rows(fp8_measured.merge_rows(fp8_measured.load_rows(table), rows), table)
    for row in rows:
        print(f"recorded in {table}: {row.says()}")
    if not rows:
        print(f"no FP8 arm ran against a bf16 arm of its mode: {table} unchanged")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="the tiny Llama's dims: a smoke run on any device")
    parser.add_argument("--arms", default=",".join(arm.name for arm in ARMS),
                        help=f"comma-separated, of {', '.join(arm.name for arm in ARMS)} (default: all)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="run the compiled arms among --arms (--no-compile: eager arms only)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for the compiled arms (aot_eager: the same graphs, no code "
                             "generation: rehearses the compiled arms' logic without a C++ compiler or the time)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode (e.g. max-autotune-no-cudagraphs)")
    parser.add_argument("--pack-tokens", type=int, default=None, help="rows per pack (default 1024; --small 128)")
    parser.add_argument("--packs", type=int, default=8, help="distinct packs the micro-steps cycle over")
    parser.add_argument("--warmup", type=int, default=5, help="untimed micro-steps per arm (compiled arms compile)")
    parser.add_argument("--steps", type=int, default=30, help="timed micro-steps per arm")
    parser.add_argument("--unroll-steps", type=int, default=1, help="drafter.unroll_steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="drafter.lr (default: launch/configs/hf.yaml's at 70B dims, DrafterConfig's with --small)")
    parser.add_argument("--out", default=None, help="also write the figures here as JSON (what --merge reads)")
    parser.add_argument("--record", action="store_true",
                        help="merge this run's FP8 rows into --table (a GPU run at 70B dims only)")
    parser.add_argument("--merge", default=None, metavar="REPORT",
                        help="merge a saved --out report's FP8 rows into --table and exit (runs nothing)")
    parser.add_argument("--table", type=Path, default=fp8_measured.TABLE,
                        help="the measured table --record and --merge write (default: the shipped one)")
    args = parser.parse_args()
    unknown = set(args.arms.split(",")) - set(_ARMS_BY_NAME)
    if unknown:
        parser.error(f"--arms: unknown {', '.join(sorted(unknown))}; choose among {', '.join(_ARMS_BY_NAME)}")
    if args.lr is None:
        args.lr = DrafterConfig.lr if args.small else pretrained_drafter_lr()
    return args


def main() -> None:
    args = parse_args()
    if args.merge:
        record(json.loads(Path(args.merge).read_text()), args.table)
        return
    chosen = [arm for arm in ARMS if arm.name in args.arms.split(",") and (args.compile or arm.compile == EAGER)]
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = architecture_from_dict(TINY_LLAMA) if args.small else load_architecture(LLAMA_70B_DIR)
    pack_tokens = args.pack_tokens or (128 if args.small else 1024)
    settings = DrafterConfig(lr=args.lr, pack_tokens=pack_tokens, buffer_tokens=pack_tokens * args.packs * 2,
                             unroll_steps=args.unroll_steps)
    data = synthetic_sequences(arch, rows=pack_tokens * args.packs, max_length=pack_tokens, device=device,
                               generator=torch.Generator().manual_seed(0))
    compile_options = {"backend": args.compile_backend, "mode": args.compile_mode}
    arms: list[dict] = []
    weights: dict[str, dict] = {}
    for arm in chosen:
        reason = skip_reason(arm, device)
        if reason is not None:
            arms.append({"arm": arm.label, "name": arm.name, "backend": arm.backend, "compile": arm.compile,
                         "skipped": reason})
            continue
        figures, weights[arm.name] = run_arm(arch, settings, arm, device, data, warmup=args.warmup, steps=args.steps,
                                             compile_options=compile_options)
        arms.append(figures)
    compare_arms(arms)

    # One bf16 drafter evaluates every arm's exported weights on the first packs' sequences.
    judge = DrafterTrainer(arch, settings, seed=0, precision=DrafterPrecision(device, torch.bfloat16))
    judge.set_policy_heads(data[2])
    eval_ids, eval_features = data[0][:max(1, len(data[0]) // args.packs)], data[1][:max(1, len(data[1]) // args.packs)]
    start_loss = judge.evaluate(eval_ids, eval_features)
    for arm in arms:
        if "skipped" not in arm:
            judge.drafter.load_tensors(weights[arm["name"]])
            totals = judge.evaluate(eval_ids, eval_features)
            arm["loss_after"] = totals["loss_sum"] / totals["tokens"]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    capability = ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else None
    ran = [arm for arm in arms if "skipped" not in arm]
    steps_done = args.warmup + args.steps
    params = f", {ran[0]['params'] / 1e9:.3g}B params" if ran else ""
    print(f"EAGLE drafter training, {'tiny' if args.small else 'Llama-3.3-70B'} dims (hidden {arch.hidden_size}, "
          f"FFN {arch.intermediate_size}, vocab {arch.vocab_size}{params}), packs of {pack_tokens} rows, unroll "
          f"{args.unroll_steps}, on {name}: {args.steps} timed micro-steps after {args.warmup}; compiled arms: "
          f"torch.compile(backend={args.compile_backend}, mode={args.compile_mode}); loss before training "
          f"{start_loss['loss_sum'] / start_loss['tokens']:.4f}")
    print(f"{'arm':<28}{'tokens/s':>10}{'vs bf16':>9}{'vs bf16 comp.':>14}{'ms/step':>9}{'warm-up s':>10}"
          f"{'peak GiB':>9}  loss after {steps_done} steps")
    for arm in arms:
        if "skipped" in arm:
            print(f"{arm['arm']:<28}skipped: {arm['skipped']}")
            continue
        ratios = "".join(f"{arm[key]:>{width - 1}.2f}x" if key in arm else f"{'-':>{width}}"
                         for key, width in (("vs_bf16_eager", 9), ("vs_bf16_compiled", 14)))
        peak = f"{arm['peak_gib']:.1f}" if "peak_gib" in arm else "-"
        print(f"{arm['arm']:<28}{arm['tokens_per_s']:>10.0f}{ratios}{arm['ms_per_micro_step']:>9.1f}"
              f"{arm['warmup_s']:>10.1f}{peak:>9}  {arm['loss_after']:.4f}")
    report = {"device": name, "capability": capability, "dims": "tiny" if args.small else MEASURED_DIMS,
              "hidden": arch.hidden_size, "intermediate": arch.intermediate_size, "vocab": arch.vocab_size,
              "pack_tokens": pack_tokens, "warmup": args.warmup, "steps": args.steps,
              "unroll_steps": args.unroll_steps, "lr": args.lr, "compile_backend": args.compile_backend,
              "compile_mode": args.compile_mode, "date": datetime.date.today().isoformat(), "commit": _commit(),
              "versions": _versions(), "loss_before": start_loss["loss_sum"] / start_loss["tokens"], "arms": arms}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.record:
        record(report, args.table)


if __name__ == "__main__":
    main()
