"""What one EAGLE speculative decode step costs on a GPU, by batch size and depth: the kernels of the step, timed.

    python bench/gpu_step_cost.py --out costs.json                 # Llama-3.1-8B shapes, bf16, CUDA graphs
    python bench/gpu_step_cost.py --out costs.json --batches 1,8,64 --depths 0,4,8
    python bench/depth_headroom.py --trace trace.json --step-costs costs.json   # price a traced rollout with them

These kernels need no vLLM, so they time a step where `tlt bench rollout` cannot run, and on this
project's CPU a draft costs about as much of a step at every batch size, so the best speculation depth does not
move with the batch (bench/RESULTS.md). Whether it moves on a GPU depends on what a step costs there: this times
the work of a step of a speculating engine at batch B and depth K, with random bf16 weights of the given shapes
(nothing is loaded), each (B, K) captured in a CUDA graph as vLLM runs decode steps:
  * verify: the target's forward over B sequences x (K + 1) new tokens against a KV cache of --context tokens
    (fused QKV, SDPA over the cache with grouped KV heads, SwiGLU MLP, final norm, LM head and argmax over every
    position, as rejection sampling needs every position's logits);
  * draft: K steps of the EAGLE drafter over B tokens: fc over [embedding, feature], one decoder layer against
    its own cache, the target's LM head and argmax.
t(B, K) = verify(B, K) + K x draft(B); K = 0 is plain decoding (no drafter). Left out: rotary embeddings, the
sampler's random draws, the scheduler and paged-cache bookkeeping, which vLLM's step also runs. Writes rows of
(batch, depth, seconds) for ``depth_headroom.py --step-costs`` and ``flagship_projection.py --step-costs``.

``--shape llama-3.3-70b-tp8`` times one tensor-parallel rank of Llama-3.3-70B at TP=8
(launch/models/llama-3.3-70b/config.json), as vLLM runs it on 8 GPUs: hidden 8192 (the residual stream is whole
on every rank), 80 layers, 64/8 = 8 query heads and 8/8 = 1 KV head of dim 128 per rank, FFN 28672/8 = 3584,
and a vocabulary shard of 128256/8 = 16032 rows for the embedding and the LM head. vLLM runs the EAGLE drafter at
the target's TP, so its layer is sharded the same way; its fc ([embedding, feature] -> hidden) is a
ReplicatedLinear in vLLM (llama_eagle.py) and stays whole here. The rows are ONE RANK'S KERNELS ONLY. Left out,
and not measured on one GPU: the collectives of TP=8 - an all-reduce of [tokens, 8192] after attention and after
the MLP of every layer (2 x 80 per verify pass, 2 per draft step), one after the vocab-parallel embedding, and the
gather of the LM head's logits shards ([tokens, 16032] from each rank) - on NVLink, a large part of a decode step.
``bench/flagship_projection.py`` adds them from a stated bandwidth-and-latency model; the file says ``tp`` in its
shape so that it knows to. The argmax here runs over the rank's own vocabulary shard.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

# Per rank: heads, kv_heads, ffn and vocab are the rank's shard of them; hidden is whole (the residual stream).
SHAPES = {
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, tp=1),
    "llama-3.3-70b-tp8": dict(hidden=8192, layers=80, heads=64 // 8, kv_heads=8 // 8, head_dim=128, ffn=28672 // 8,
                              vocab=128256 // 8, tp=8),
    "tiny": dict(hidden=256, layers=2, heads=8, kv_heads=4, head_dim=32, ffn=512, vocab=1000, tp=1),  # any device
}


class Layer:
    """One decoder layer's weights and its KV cache (for the widest batch; narrower ones use its first rows)."""

    def __init__(self, shape: dict, max_batch: int, cache_len: int, device, dtype):
        h, d = shape["hidden"], shape["head_dim"]
        self.heads, self.kv_heads, self.head_dim = shape["heads"], shape["kv_heads"], d
        def weight(*size):
            return torch.randn(*size, device=device, dtype=dtype) * 0.02
        self.qkv = weight(h, (shape["heads"] + 2 * shape["kv_heads"]) * d)
        self.out = weight(shape["heads"] * d, h)
        self.gate_up = weight(h, 2 * shape["ffn"])
        self.down = weight(shape["ffn"], h)
        self.norms = torch.ones(2, h, device=device, dtype=dtype)
        self.cache = torch.randn(2, max_batch, shape["kv_heads"], cache_len, d, device=device, dtype=dtype) * 0.02

    def __call__(self, x: torch.Tensor, context: int) -> torch.Tensor:
        """x [B, T, H]: T new tokens per sequence after ``context`` cached ones (their keys written in place)."""
        b, t, _ = x.shape
        q, k, v = (F.rms_norm(x, x.shape[-1:], self.norms[0]) @ self.qkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        keys, values = self.cache[0, :b], self.cache[1, :b]
        keys[:, :, context:context + t] = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        values[:, :, context:context + t] = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # Every new token sees every cached one (the causal order among the few new ones does not change the
        # cost). A KV head's query heads are folded into the query length, so the flash kernel reads each cached
        # head once: with enable_gqa, 2+ new tokens per sequence fell back to a kernel that copies the heads.
        group = self.heads // self.kv_heads
        folded = q.view(b, t, self.kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4).reshape(
            b, self.kv_heads, group * t, self.head_dim)
        attended = F.scaled_dot_product_attention(folded, keys[:, :, :context + t], values[:, :, :context + t])
        attended = attended.view(b, self.kv_heads, group, t, self.head_dim).permute(0, 3, 1, 2, 4)
        x = x + attended.reshape(b, t, -1) @ self.out
        gate, up = (F.rms_norm(x, x.shape[-1:], self.norms[1]) @ self.gate_up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down


class SpeculatingEngineKernels:
    """The target (``layers`` decoder layers, LM head) and an EAGLE drafter (fc, one layer) sharing its heads."""

    def __init__(self, shape: dict, max_batch: int, max_depth: int, context: int, device, dtype):
        h = shape["hidden"]
        self.context = context
        cache_len = context + max_depth + 1
        self.layers = [Layer(shape, max_batch, cache_len, device, dtype) for _ in range(shape["layers"])]
        self.drafter_layer = Layer(shape, max_batch, cache_len, device, dtype)
        self.embedding = torch.randn(shape["vocab"], h, device=device, dtype=dtype) * 0.02
        self.lm_head = torch.randn(h, shape["vocab"], device=device, dtype=dtype) * 0.02
        self.fc = torch.randn(2 * h, h, device=device, dtype=dtype) * 0.02
        self.final_norm = torch.ones(h, device=device, dtype=dtype)

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, K + 1]: the last accepted token and K drafts; the target's choice at every position."""
        x = self.embedding[tokens]
        for layer in self.layers:
            x = layer(x, self.context)
        return (F.rms_norm(x, x.shape[-1:], self.final_norm) @ self.lm_head).argmax(-1)

    def draft(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One draft step: tokens [B, 1] and the features [B, 1, H] before them; the next draft token."""
        x = torch.cat([self.embedding[tokens], features], dim=-1) @ self.fc
        return (self.drafter_layer(x, self.context) @ self.lm_head).argmax(-1)


def _seconds(step, repeats: int, use_graph: bool) -> float:
    """Median seconds of ``step()``: replays of its CUDA graph on a GPU, plain calls elsewhere."""
    if use_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph, as capture requires
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        del graph
        return statistics.median(times)
    import time

    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--depths", default="0,2,4,8,12,16")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (default: 1024)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                        help="model shapes (default: llama-3.1-8b; llama-3.3-70b-tp8: one rank of 8, module doc)")
    parser.add_argument("--tiny", action="store_true", help="the same as --shape tiny: a quick check on any device")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA (bf16, CUDA graphs) where there is one, else the CPU (eager, fp32)")
    parser.add_argument("--out", required=True, help="JSON rows (batch, depth, seconds) for depth_headroom.py")
    args = parser.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")})
    depths = sorted({int(k) for k in args.depths.split(",")})
    if batches[0] < 1 or depths[0] < 0 or args.context < 1 or args.repeats < 1:
        parser.error("--batches >= 1, --depths >= 0, --context and --repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape_name = "tiny" if args.tiny else args.shape
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    with torch.inference_mode():
        kernels = SpeculatingEngineKernels(shape, max(batches), max(depths), args.context, device, dtype)
        rows, table = [], {}
        for batch in batches:
            features = torch.randn(batch, 1, shape["hidden"], device=device, dtype=dtype)
            draft_tokens = torch.randint(0, shape["vocab"], (batch, 1), device=device)
            draft = _seconds(lambda: kernels.draft(draft_tokens, features), args.repeats, cuda)
            for depth in depths:
                tokens = torch.randint(0, shape["vocab"], (batch, depth + 1), device=device)
                verify = _seconds(lambda: kernels.verify(tokens), args.repeats, cuda)
                table[(batch, depth)] = seconds = verify + depth * draft
                rows.append([batch, depth, seconds])
    where = torch.cuda.get_device_name() if cuda else "CPU (eager, fp32)"
    print(f"one speculative decode step, {shape_name} shapes{' (one TP rank)' if shape['tp'] > 1 else ''}, {where}, "
          f"context {args.context}: ms, and in plain steps of the same batch")
    print(f"{'batch':>6}" + "".join(f"{'K=' + str(k):>16}" for k in depths))
    for batch in batches:
        plain = table[(batch, 0)] if 0 in depths else table[(batch, depths[0])]
        print(f"{batch:>6}" + "".join(f"{1000 * table[(batch, k)]:>9.3f} ({table[(batch, k)] / plain:.2f})"
                                      for k in depths))
    with open(args.out, "w") as f:
        json.dump({"device": where, "shape_name": shape_name, "shape": shape, "context": args.context, "rows": rows}, f)


if __name__ == "__main__":
    main()
