"""How speculation's gain grows with the policy's depth, at equal outputs.

    python bench/policy_depth.py                       # the default's policy, and with each layer doubled
    python bench/policy_depth.py --copies 1,2,3 --prompts 8 --samples 8 --rounds 2
    python bench/policy_depth.py --temperature 0 --prompts 64 --samples 1   # greedy: every engine's outputs equal
    python bench/policy_depth.py model.tiny.num_layers=16                     # a 16-layer policy (made if not cached)

The drafter is one layer whatever the policy's depth, so a deeper policy makes each draft token cheaper
beside the verify pass it saves. To measure that alone, this deepens the configured policy without
changing what it computes: after each layer come copies of it whose attention and MLP output projections
are zero (identity blocks, as LLaMA Pro expands a model), so the residual stream, the final hidden state
the drafter reads, and every logit are the same; only the cost of a forward grows. For each depth, one
process, one core (as rank 0 of `tlt train` runs), a plain engine and a speculating engine at fixed depth
with the config's cold-start drafter sample the same prompts at the RL temperature (or --temperature),
alternating; it prints tokens per second, the cost of a speculative step in plain steps, the acceptance
length, and the speedup. Greedy outputs are checked equal across depths and engines first.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only after the process is pinned like a rank
    import torch

CONFIG = "tiny"
ZEROED_IN_COPIES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # a block adds nothing to its input


def deepen(hf_tensors: list[tuple[str, "torch.Tensor"]], copies: int) -> list[tuple[str, "torch.Tensor"]]:
    """The HF tensors of the same policy with ``copies - 1`` identity blocks after each layer."""
    import torch

    out = []
    for name, tensor in hf_tensors:
        layer = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if layer is None:
            out.append((name, tensor))
            continue
        index, rest = int(layer.group(1)), layer.group(2)
        for copy in range(copies):
            zeroed = copy > 0 and rest.endswith(ZEROED_IN_COPIES)
            out.append((f"model.layers.{index * copies + copy}.{rest}", torch.zeros_like(tensor) if zeroed else tensor))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", default="1,2", help="depth multipliers to compare (default: 1,2)")
    parser.add_argument("--depth", type=int, default=4, help="speculation depth K (default: 4)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default: 8, a rank's share)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (default: 8)")
    parser.add_argument("--rounds", type=int, default=2, help="rollouts per engine and depth (default: 2)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the config's rollout.temperature; 0: greedy)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    copies = [int(c) for c in args.copies.split(",")]
    if min(copies) < 1 or args.rounds < 1 or args.prompts < 1 or args.samples < 1:
        parser.error("--copies, --rounds, --prompts and --samples must be >= 1")
    if args.temperature is not None and args.temperature < 0:
        parser.error("--temperature must be >= 0")

    from megatron_tlt.launcher import run_like_rank_zero_of

    run_like_rank_zero_of(2)  # before torch starts its threads: the core and threads of a tlt train rank
    from megatron_tlt.commands.start import cold_start_drafter
    from megatron_tlt.config import load_config
    from megatron_tlt.drafter import store
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.rank_session import RankSession
    from megatron_tlt.rl.weight_sync import iter_hf_tensors
    from megatron_tlt.spec.engine import RolloutEngine, SpeculativeSettings
    from megatron_tlt.spec.metrics import SpecDecodeStats

    config = load_config(CONFIG, args.overrides)
    drafter_dir = cold_start_drafter(CONFIG, args.overrides)  # made and cached on first use
    with ParallelLayout(seed=0), tempfile.TemporaryDirectory() as workdir:
        session = RankSession(config, show_progress=True)
        drafter = store.read_drafter_tensors(drafter_dir, session.arch)
        policy = [(name, tensor.detach().clone()) for name, tensor in
                  iter_hf_tensors(session.model, session.arch, padded_vocab_size=session.padded_vocab)]
        examples = session.task.held_out or session.task.dataset.examples
        needed = 4 + args.rounds * args.prompts
        if len(examples) < needed:
            parser.error(f"{needed} prompts needed, the task has {len(examples)}")
        prompts = [e.prompt_ids for e in examples]
        greedy = session.sampling(n=1, temperature=0.0, seed=None)
        # not a config override: the cold-start drafter's cache key holds the rollout temperature
        temperature = config.rollout.temperature if args.temperature is None else args.temperature
        sampled = session.sampling(n=args.samples, temperature=temperature, seed=None)
        speculative = SpeculativeSettings(num_speculative_tokens=args.depth, adaptive=None, seed=0,
                                          draft_sampling=config.speculation.draft_sampling)
        reference = None
        print(f"{args.prompts} prompts x {args.samples} samples at temperature {temperature}, "
              f"K={args.depth}, {args.rounds} rounds per engine")
        for multiple in copies:
            layers = session.arch.num_layers * multiple
            arch = dataclasses.replace(session.arch, num_layers=layers,
                                       hf_config=dict(session.arch.hf_config, num_hidden_layers=layers))
            tensors = deepen(policy, multiple)
            plain = RolloutEngine(arch, session.engine_config, workdir=Path(workdir) / f"plain{layers}", rank=0)
            spec = RolloutEngine(arch, session.engine_config, workdir=Path(workdir) / f"spec{layers}", rank=0,
                                 speculative=speculative, drafter=drafter)
            for engine in (plain, spec):
                engine.load_weights(iter(tensors))
            spec.load_drafter(drafter)  # the reload replaced the drafter's shared heads with dummies
            outputs = [engine.generate(prompts[:4], greedy).token_ids for engine in (plain, spec)]
            reference = reference or outputs[0]
            if outputs != [reference, reference]:
                raise SystemExit(f"{layers} layers: greedy outputs differ from the undeepened plain engine's")
            totals = {"plain": [0, 0.0, 0], "spec": [0, 0.0, 0]}
            acceptance = SpecDecodeStats()  # pooled over all rounds
            for round_index in range(args.rounds):
                batch = prompts[4 + round_index * args.prompts: 4 + (round_index + 1) * args.prompts]
                for name, engine in (("plain", plain), ("spec", spec)):
                    result = engine.generate(batch, sampled)
                    total = totals[name]
                    total[0] += result.num_generated_tokens
                    total[1] += result.seconds
                    total[2] += len(result.step_seconds)
                    if name == "spec":
                        acceptance += result.spec
            (plain_tokens, plain_seconds, plain_steps), (spec_tokens, spec_seconds, spec_steps) = totals.values()
            plain_rate, spec_rate = plain_tokens / plain_seconds, spec_tokens / spec_seconds
            step_cost = (spec_seconds / spec_steps) / (plain_seconds / plain_steps)
            plain_ms = 1000 * plain_seconds / plain_steps
            print(f"{layers:3d} layers: plain {plain_rate:6.0f} tok/s, {plain_ms:5.2f} ms/step | "
                  f"K={args.depth} {spec_rate:6.0f} tok/s, a step costs {step_cost:.2f} plain steps, acceptance length "
                  f"{acceptance.mean_acceptance_length:.2f} | speedup {spec_rate / plain_rate:.2f}x", flush=True)
            plain.close()
            spec.close()
        session.close()


if __name__ == "__main__":
    main()
