"""What TLT buys at the flagship's shape: a PROJECTION (not a measurement) from measured step kernels.

    python bench/flagship_projection.py --step-costs costs.json            # bench/gpu_step_cost.py --out costs.json
    python bench/flagship_projection.py --step-costs costs.json --trace trace.json   # acceptance, lengths of a run
    python bench/flagship_projection.py --step-costs costs.json --acceptance-per-position 0.8,0.6,0.4 --out p.json

The model, written down. One engine decodes --requests requests, all admitted at once (a GRPO rollout), whose
response lengths are drawn from a distribution with a long tail. At every engine step the B live requests are
verified together at depth K (0: plain decoding); each advances 1 + a tokens, a its accepted drafts, drawn from
the per-position acceptance p_1 >= p_2 >= ... (vLLM's metric: the share of drafts at position i accepted, so
position i is accepted only if 1..i-1 were: one uniform draw u per request and step, a = #{i <= K: u < p_i}).
The step takes t(B, K): the measured kernels (piecewise linear between the measured batches and depths) plus, for
a tensor-parallel shard's rows, a model of its collectives (``comm_seconds``). Policies:
  * no speculation (K = 0 at every step), every fixed depth of --depths and the best of them;
  * the best depth per batch-size bucket (the buckets of ``speculation.bucket_bounds``, BEG-MAB's), found by
    coordinate descent from the best fixed depth, in-sample: a ceiling of any choice by batch size that pays
    nothing to explore (as ``bench/depth_ceilings.py``'s, but simulated rather than on equal work).
End to end (Amdahl): a TLT-off step is rollout (share s) and the rest; TLT speeds the rollout r times and puts
c of a TLT-off step of drafter training on the critical path: speedup = 1 / ((1 - s) + s / r + c).
Not modelled: prefill, the KV context growing through the rollout (the kernels' --context is fixed), admission
of new requests mid-rollout, acceptance streaks (draws are independent across steps), the sampler, the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from megatron_tlt.config import SpeculationConfig
from megatron_tlt.spec.bandit import BucketedEpsilonGreedy

# vLLM's per-position acceptance of our default's drafter at depth 16 (bench/RESULTS.md, depth headroom, 2026-11-28 at
# deca8d0; CPU, tiny default); positions 11-16 (0.27 down to 0.14) are not all recorded and are left out.
# The rollout share default, 0.78: a TLT-off step of the tiny default at depth 8 (bench/RESULTS.md, 2026-11-26 at e9765d3: 78.1%).
OUR_ACCEPTANCE = (0.89, 0.80, 0.71, 0.66, 0.58, 0.53, 0.45, 0.31, 0.29, 0.27)
# Response lengths of the tiny default (bench/RESULTS.md): per-step max / median 13.9-14.4 over 128 samples (a
# lognormal's sigma = ln 14 / 2.55, the median max of 128 normals), capped at 768 tokens; the median, 20 tokens, is
# an earlier default's (medians 15-25) and barely matters: the speedup depends on the shape, not the scale.
OUR_LENGTHS = (20.0, 1.03, 768)


@dataclasses.dataclass(frozen=True)
class Rollout:
    steps: int
    seconds: float
    tokens: int


def simulate_rollout(lengths: Sequence[int], acceptance: Sequence[float], depth_of_batch: Callable[[int], int],
                     step_seconds: Callable[[int, int], float], seed: int) -> Rollout:
    """Decode ``lengths`` tokens per request in engine steps of all live requests (module docstring); pure and
    deterministic for a seed. ``acceptance``: p_i of positions 1.. (made non-increasing; beyond it, 0)."""
    remaining = np.asarray(lengths, dtype=np.int64).copy()
    p = np.minimum.accumulate(np.clip(np.asarray(acceptance, dtype=np.float64), 0.0, 1.0))
    rng = np.random.default_rng(seed)
    steps, seconds = 0, 0.0
    while (live := np.flatnonzero(remaining > 0)).size:
        batch = live.size
        depth = depth_of_batch(batch)
        u = rng.random(batch)
        accepted = (u[:, None] < p[None, :depth]).sum(axis=1) if depth else 0
        remaining[live] -= np.minimum(1 + accepted, remaining[live])
        seconds += step_seconds(batch, depth)
        steps += 1
    return Rollout(steps, seconds, int(np.sum(lengths)))


def end_to_end_speedup(rollout_share: float, rollout_speedup: float, critical_path_share: float = 0.0) -> float:
    """Step time TLT off / on when a TLT-off step spends ``rollout_share`` in the rollout (Amdahl)."""
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_speedup + critical_path_share)


def comm_seconds(shape: dict, batch: int, depth: int, latency_s: float, bus_bytes_per_s: float) -> float:
    """The TP collectives one rank's kernel timing leaves out (gpu_step_cost.py): per forward over T tokens, an
    all-reduce of [T, hidden] after the embedding and after attention and the MLP of each layer, and the gather
    of [T, vocab shard] logits; the verify pass has T = B (K + 1) and the layers of the target, each of the K
    draft steps T = B and one layer. Ring costs: all-reduce 2 (n-1)/n bytes, gather (n-1)/n; bf16."""
    n = shape.get("tp", 1)
    if n <= 1:
        return 0.0

    def forward(tokens: int, layers: int) -> float:
        reduce = (2 * layers + 1) * (latency_s + 2 * (n - 1) / n * tokens * shape["hidden"] * 2 / bus_bytes_per_s)
        return reduce + latency_s + (n - 1) * tokens * shape["vocab"] * 2 / bus_bytes_per_s
    return forward(batch * (depth + 1), shape["layers"]) + depth * forward(batch, 1)


def step_cost_table(rows: Sequence[Sequence[float]]) -> Callable[[int, int], float]:
    """t(B, K) from (batch, depth, seconds) rows on a full grid: linear in K at each measured batch, then in B."""
    cells = {(int(b), int(k)): s for b, k, s in rows}
    batches, depths = sorted({b for b, _ in cells}), sorted({k for _, k in cells})
    missing = [(b, k) for b in batches for k in depths if (b, k) not in cells]
    if missing:
        raise ValueError(f"step costs miss (batch, depth) cells {missing[:4]}: the table must be a full grid")
    grid = np.array([[cells[(b, k)] for k in depths] for b in batches])

    @lru_cache(maxsize=None)
    def seconds(batch: int, depth: int) -> float:
        if not (batches[0] <= batch <= batches[-1] and depths[0] <= depth <= depths[-1]):
            raise ValueError(f"(batch {batch}, depth {depth}) lies outside the measured {batches} x {depths}")
        at_depth = [np.interp(depth, depths, line) for line in grid]
        return float(np.interp(batch, batches, at_depth))
    return seconds


def project(lengths_of: Callable[[int], np.ndarray], rollouts: int, acceptance: Sequence[float],
            depths: Sequence[int], step_seconds: Callable[[int, int], float], bucket_of: Callable[[int], int],
            num_buckets: int, seed: int) -> dict:
    """Summed seconds over ``rollouts`` rollouts (the i-th: lengths_of(i), seed + i) per policy."""
    def total(depth_of_batch: Callable[[int], int]) -> float:
        return sum(simulate_rollout(lengths_of(i), acceptance, depth_of_batch, step_seconds, seed + i).seconds
                   for i in range(rollouts))
    plain = total(lambda b: 0)
    fixed = {k: total(lambda b, k=k: k) for k in depths}
    best = min(fixed, key=lambda k: (fixed[k], k))
    per_bucket, per_bucket_seconds = [best] * num_buckets, fixed[best]
    for bucket in range(num_buckets):  # one pass of coordinate descent, from the best fixed depth everywhere
        for k in depths:
            trial = per_bucket[:bucket] + [k] + per_bucket[bucket + 1:]
            seconds = total(lambda b, t=trial: t[bucket_of(b)])
            if seconds < per_bucket_seconds - 1e-12:
                per_bucket, per_bucket_seconds = trial, seconds
    return {"no_speculation": plain, "fixed": fixed, "best_fixed_depth": best,
            "per_bucket_depths": per_bucket, "per_bucket": per_bucket_seconds}


def _from_trace(path: str) -> tuple[list[float], list[int]]:
    """Per-position acceptance and response lengths (the decoded tokens: sum of 1 + accepted over a request's
    steps) of a ``bench/depth_headroom.py --save-trace`` file."""
    record = json.loads(Path(path).read_text())
    counts = [min(a, record["depth"]) for steps in record["rollouts"] for step in steps for _, a in step]
    acceptance = [float(np.mean([a >= i for a in counts])) for i in range(1, record["depth"] + 1)]
    lengths = []
    for steps in record["rollouts"]:
        made: dict[str, int] = {}
        for step in steps:
            for request, a in step:
                made[request] = made.get(request, 0) + 1 + min(a, record["depth"])
        lengths += made.values()
    return acceptance, lengths


def _lognormal_from_summary(path: str, cap: int) -> tuple[float, float, int]:
    """(median, sigma, cap) from a run's summary.json: the median of the steps' median lengths, and sigma from
    each step's max / median over its samples (a lognormal's median max of n is its median x exp(sigma z_n))."""
    records = json.loads(Path(path).read_text())  # a list: one record per RL step
    sigmas = [np.log(r["response_length_max"] / r["response_length_median"])
              / statistics.NormalDist().inv_cdf(0.5 ** (1 / r["num_samples"])) for r in records]
    return statistics.median(r["response_length_median"] for r in records), statistics.median(sigmas), cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-costs", required=True, help="rows (batch, depth, seconds): gpu_step_cost.py --out")
    parser.add_argument("--trace", help="a depth_headroom.py --save-trace file: its acceptance and lengths")
    parser.add_argument("--acceptance-per-position", help="p_1,p_2,...: default ours, " + str(OUR_ACCEPTANCE))
    parser.add_argument("--lognormal", help="MEDIAN,SIGMA,CAP response lengths; default ours: %s" % (OUR_LENGTHS,))
    parser.add_argument("--summary", help="fit the lognormal's median and sigma to a run's summary.json")
    parser.add_argument("--requests", type=int, default=128, help="requests per engine (default: 128)")
    parser.add_argument("--depths", default="0,1,2,3,4,5,6,7,8", help="the depths to choose among")
    parser.add_argument("--bucket-bounds", default=",".join(map(str, SpeculationConfig().bucket_bounds)))
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts simulated, summed (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollout-share", type=float, default=0.78, help="of a TLT-off step (default: ours, 0.78)")
    parser.add_argument("--critical-path-share", type=float, default=0.0,
                        help="drafter training on the critical path, of a TLT-off step (default: 0)")
    parser.add_argument("--comm-latency-us", type=float, default=10.0, help="per TP collective (default: 10)")
    parser.add_argument("--bus-gbps", type=float, default=360.0, help="TP collective bus GB/s (default: 360)")
    parser.add_argument("--out", help="write the projection as JSON")
    args = parser.parse_args()
    record = json.loads(Path(args.step_costs).read_text())
    shape = record["shape"]
    depths = sorted({int(k) for k in args.depths.split(",")})
    bounds = [int(b) for b in args.bucket_bounds.split(",")]
    acceptance, traced_lengths = _from_trace(args.trace) if args.trace else (list(OUR_ACCEPTANCE), None)
    if args.acceptance_per_position:
        acceptance = [float(p) for p in args.acceptance_per_position.split(",")]
    median, sigma, cap = OUR_LENGTHS
    if args.lognormal:
        median, sigma, cap = (float(x) for x in args.lognormal.split(","))
    if args.summary:
        median, sigma, cap = _lognormal_from_summary(args.summary, cap)
    resample = traced_lengths is not None and not (args.lognormal or args.summary)
    lengths_from = (f"{len(traced_lengths)} traced lengths of {args.trace}, resampled" if resample
                    else f"lognormal median {median:g}, sigma {sigma:.3g}, cap {cap:g}")
    if not (0 < args.rollout_share <= 1 and args.requests >= 1 and args.rollouts >= 1 and depths[0] >= 0):
        parser.error("--rollout-share in (0, 1], --requests and --rollouts >= 1, --depths >= 0")

    def lengths_of(i: int) -> np.ndarray:
        rng = np.random.default_rng([args.seed, i])
        if resample:
            return rng.choice(traced_lengths, size=args.requests)
        return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(args.requests))), 1, cap).astype(int)

    kernels = step_cost_table(record["rows"])
    buckets = BucketedEpsilonGreedy(SpeculationConfig(bucket_bounds=bounds), max_depth=max(depths))
    latency, bus = args.comm_latency_us * 1e-6, args.bus_gbps * 1e9

    def run(with_comm: bool) -> dict:
        def cost(b: int, k: int) -> float:
            return kernels(b, k) + (comm_seconds(shape, b, k, latency, bus) if with_comm else 0.0)
        return project(lengths_of, args.rollouts, acceptance, depths, cost, buckets.bucket_of,
                       buckets.num_buckets, args.seed)

    tp = shape.get("tp", 1)
    print("PROJECTION (not a measurement). Assumptions:")
    print(f"  step kernels: {args.step_costs} ({record['device']}, {record.get('shape_name', 'shape')} {shape}, "
          f"context {record['context']}), piecewise linear in batch and depth")
    print("  TP collectives: " + (f"TP={tp}, {args.comm_latency_us:g} us each + bytes at {args.bus_gbps:g} GB/s "
                                   "bus bandwidth (a model, not measured)" if tp > 1 else "none (one GPU's rows)"))
    print(f"  acceptance per position: {', '.join(f'{p:.2f}' for p in acceptance)} (independent across steps)")
    print(f"  {args.requests} requests per engine, all at once; lengths: {lengths_from}; "
          f"{args.rollouts} rollouts, seed {args.seed}")
    print(f"  depths {depths}; buckets {[buckets.bucket_label(b) for b in range(buckets.num_buckets)]}; the best "
          "depths are chosen in-sample and pay nothing to explore (ceilings)")
    print(f"  rollout share of a TLT-off step {args.rollout_share:g}; drafter training on the critical path "
          f"{args.critical_path_share:g} of a step; not modelled: prefill, context growth, streaks, scheduler")
    result = run(with_comm=True)
    plain = result["no_speculation"]
    k = result["best_fixed_depth"]
    rows = [("no speculation", "0", plain), ("best fixed depth", str(k), result["fixed"][k]),
            ("best depth per bucket", "/".join(map(str, result["per_bucket_depths"])), result["per_bucket"])]
    print(f"\n{'policy':<24}{'depth':>20}{'rollout time':>14}{'speedup':>9}{'end to end':>12}")
    for name, depth, seconds in rows:
        speedup = plain / seconds
        e2e = end_to_end_speedup(args.rollout_share, speedup, args.critical_path_share)
        print(f"{name:<24}{depth:>20}{seconds / plain:>14.3f}{speedup:>8.2f}x{e2e:>11.2f}x")
    print("fixed depths, rollout time / no speculation: "
          + ", ".join(f"{d}: {t / plain:.3f}" for d, t in result["fixed"].items()))
    rollout_speedup = plain / result["per_bucket"]
    print(f"PROJECTION (not a measurement): TLT rollout {rollout_speedup:.2f}x, end to end "
          f"{end_to_end_speedup(args.rollout_share, rollout_speedup, args.critical_path_share):.2f}x; at rollout "
          "shares " + ", ".join(f"{s:g}: {end_to_end_speedup(s, rollout_speedup, args.critical_path_share):.2f}x"
                                for s in (0.7, 0.78, 0.85, 0.9)))
    bare = run(with_comm=False) if tp > 1 else None
    if bare:
        print(f"  the kernels alone (no TP collectives): rollout {bare['no_speculation'] / bare['per_bucket']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"label": "PROJECTION (not a measurement)", "args": vars(args),
                                              "acceptance": acceptance, "result": result, "kernels_only": bare,
                                              "rollout_speedup": rollout_speedup}, indent=1))


if __name__ == "__main__":
    main()
