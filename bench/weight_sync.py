"""Weight-sync throughput: Megatron shards -> HF tensors -> each rank's vLLM engine, in GB/s,
printed beside a plain memory copy of the same bytes measured in the same run.

    python bench/weight_sync.py                 # world of one
    python bench/weight_sync.py --tp 2          # two gloo ranks, TP shards all-gathered
    python bench/weight_sync.py --hidden 1024 --layers 8 --repeats 3

The policy is a randomly initialised Llama (no checkpoint needed); the engine starts with dummy
weights. "sync" times the full path (gather, un-fuse, vLLM's in-place loader); "copy" is
``dst.copy_(src)`` over the same HF tensors, the floor any sync is compared against.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from megatron_tlt.launcher import run_on_ranks


def _bench_on_rank(args: argparse.Namespace, workdir: str) -> dict:
    from megatron_tlt.config import RolloutEngineConfig
    from megatron_tlt.formats.architecture import architecture_from_dict
    from megatron_tlt.model import policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl import weight_sync
    from megatron_tlt.spec.engine import RolloutEngine

    config = dict(architectures=["LlamaForCausalLM"], vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(2, args.hidden // 256),
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    arch = architecture_from_dict(config)
    with ParallelLayout(tensor_parallel_size=args.tp) as layout:
        padded = arch.padded_vocab_size(args.tp)
        model = policy.build_policy(arch, dtype="float32", padded_vocab_size=padded)
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=256), workdir=workdir, rank=layout.rank)
        try:
            syncs = [weight_sync.sync_policy_to_engine(model, arch, engine, padded_vocab_size=padded,
                                                       bucket_bytes=args.bucket_mib << 20)
                     for _ in range(args.repeats)]
        finally:
            engine.close()
        tensors = list(weight_sync.iter_hf_tensors(model, arch, padded_vocab_size=padded))
        destinations = [torch.empty_like(t) for _, t in tensors]
        copies = []
        on_gpu = tensors[0][1].is_cuda  # a device-to-device copy there: time it finished, not queued
        for _ in range(args.repeats):
            if on_gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for dst, (_, src) in zip(destinations, tensors):
                dst.copy_(src)
            if on_gpu:
                torch.cuda.synchronize()
            copies.append(time.perf_counter() - started)
    best = min(syncs, key=lambda s: s.seconds)
    return {"bytes": best.num_bytes, "sync_s": best.seconds, "copy_s": min(copies), "buckets": best.num_buckets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        per_rank = run_on_ranks(_bench_on_rank, args.tp, args, workdir, isolated=True)
    for rank, r in sorted(per_rank.items()):
        sync_gbps, copy_gbps = r["bytes"] / r["sync_s"] / 1e9, r["bytes"] / r["copy_s"] / 1e9
        print(f"rank {rank}: {r['bytes'] / 1e6:.1f} MB in {r['buckets']} buckets | sync {r['sync_s']:.3f}s "
              f"= {sync_gbps:.2f} GB/s | memory copy {r['copy_s']:.3f}s = {copy_gbps:.2f} GB/s | "
              f"sync/copy throughput ratio {sync_gbps / copy_gbps:.2f}")


if __name__ == "__main__":
    main()
