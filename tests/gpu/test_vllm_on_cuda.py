"""The rollout engine on GPU vLLM: after a weight sync its greedy output with EAGLE on equals Megatron's;
speculative sampling at temperature 1 keeps the target's distribution; a drafter pushed through vLLM's
draft-weight API is accepted and read back intact (the integrity check), and its acceptance is what it was
before after each hand-over peers lost drafters to: a policy sync, sleep level 1 and wake, sleep level 2 and
wake (vLLM #52487, #55013; NeMo-RL #2646), and another push.

Each scenario runs in its own process: vLLM keeps process-global state, and its sleep mode allows one
engine per process.
"""

import numpy as np
import pytest

from megatron_tlt.launcher import run_on_ranks

pytestmark = pytest.mark.needs("cuda", "megatron", "vllm")

K = 3
# The last prompt is longer than a KV-cache block: its first block, cached before the sync, must not be reused.
SYNC_PROMPTS = [[1, 5, 7, 9], [3, 4, 100, 22, 17], [200, 13], [(7 * i) % 250 + 1 for i in range(150)]]
NEW_TOKENS = 16
PROBE_PROMPTS = [[i, i + 1] for i in range(1, 9)]


def _sync_with_eagle_on_rank(ckpt_dir: str, workdir: str) -> dict:
    from megatron_tlt.model import policy
    from tiny_models import next_token_fixture
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.weight_sync import sync_policy_to_engine
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings, SpeculativeSettings

    greedy = SamplingSettings(temperature=0.0, max_tokens=NEW_TOKENS)
    with ParallelLayout() as layout:
        model, meta = policy.load_policy_checkpoint(ckpt_dir)
        megatron_greedy = [policy.greedy_generate(model, p, NEW_TOKENS, meta.arch.vocab_size) for p in SYNC_PROMPTS]
        # a drafter that knows nothing of this policy: speculation may only cost speed
        engine = RolloutEngine(meta.arch, RolloutEngineConfig(max_model_len=256), workdir=workdir, rank=layout.rank,
                               speculative=SpeculativeSettings(num_speculative_tokens=K),
                               drafter=next_token_fixture(meta.arch)["good_drafter"])
        try:
            before = engine.generate(SYNC_PROMPTS, greedy)
            sync_policy_to_engine(model, meta.arch, engine, padded_vocab_size=meta.padded_vocab_size)
            after = engine.generate(SYNC_PROMPTS, greedy)
        finally:
            engine.close()
    return {"megatron": megatron_greedy, "before": [r[0] for r in before.token_ids],
            "after": [r[0] for r in after.token_ids], "drafts": after.spec.num_drafts}


def test_vllm_greedy_with_eagle_equals_megatron_greedy_after_a_weight_sync(rollout_llama_mcore_tp1, tmp_path):
    result = run_on_ranks(_sync_with_eagle_on_rank, 1, str(rollout_llama_mcore_tp1), str(tmp_path), isolated=True)[0]
    assert result["drafts"] > 0  # speculation really ran
    assert result["before"] != result["megatron"]  # dummy weights: the sync is what makes them agree
    assert result["after"] == result["megatron"]


def _fixture_engine_on_rank(workdir: str, sampled_prompt: list[int], num_samples: int) -> dict:
    from megatron_tlt.formats.architecture import architecture_from_dict
    from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.spec.drafter_integrity import checksum_mismatches, expected_checksums
    from megatron_tlt.spec.engine import (
        EngineError,
        RolloutEngine,
        RolloutEngineConfig,
        SamplingSettings,
        SpeculativeSettings,
    )

    arch = architecture_from_dict(TINY_LLAMA_ROLLOUT)
    fixture = next_token_fixture(arch)
    greedy = SamplingSettings(temperature=0.0, max_tokens=24)
    results = {}
    with ParallelLayout():
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=64, seed=0), workdir=workdir, rank=0,
                               speculative=SpeculativeSettings(num_speculative_tokens=K),
                               drafter=fixture["bad_drafter"])  # the push below must replace it
        try:
            engine.load_weights(fixture["target"].items())
            results["bad_probe"] = engine.probe_acceptance(PROBE_PROMPTS)
            engine.load_drafter(fixture["good_drafter"])
            results["good_probe"] = engine.probe_acceptance(PROBE_PROMPTS)
            # GPU vLLM keeps the drafter's parameters as they are: the integrity check reads them back directly
            held = engine.drafter_checksums()
            results["readback_problems"] = checksum_mismatches(expected_checksums(fixture["good_drafter"], held), held)
            sampled = engine.generate([sampled_prompt], SamplingSettings(n=num_samples, temperature=1.0, max_tokens=4))
            results["samples"] = np.array(sampled.token_ids[0])
            results["greedy_before_sleep"] = [r[0] for r in engine.generate(PROBE_PROMPTS, greedy).token_ids]
            engine.release_memory()
            engine.resume_memory()
            results["probe_after_wake"] = engine.probe_acceptance(PROBE_PROMPTS)
            results["greedy_after_wake"] = [r[0] for r in engine.generate(PROBE_PROMPTS, greedy).token_ids]
            engine.load_weights(fixture["target"].items())
            results["probe_after_policy_sync"] = engine.probe_acceptance(PROBE_PROMPTS)
            engine.release_memory(level=2)
            engine.resume_memory()
            try:
                engine.generate(PROBE_PROMPTS, greedy)
            except EngineError as err:  # the weights were dropped: refused, never generated from garbage
                results["refused_after_level_2"] = str(err)
            engine.load_weights(fixture["target"].items())
            engine.load_drafter(fixture["good_drafter"])
            results["probe_after_level_2"] = engine.probe_acceptance(PROBE_PROMPTS)
            results["greedy_after_level_2"] = [r[0] for r in engine.generate(PROBE_PROMPTS, greedy).token_ids]
            engine.load_drafter(fixture["good_drafter"])
            results["probe_after_push"] = engine.probe_acceptance(PROBE_PROMPTS)
            results["alarms"] = engine.acceptance_alarms
        finally:
            engine.close()
    return results


@pytest.fixture(scope="module")
def fixture_engine(tmp_path_factory, lossless_sampling):
    return run_on_ranks(_fixture_engine_on_rank, 1, str(tmp_path_factory.mktemp("gpu-spec")), lossless_sampling.PROMPT,
                        lossless_sampling.NUM_SAMPLES, isolated=True)[0]


def test_a_drafter_pushed_through_the_draft_weight_api_is_accepted_at_every_position(fixture_engine):
    assert fixture_engine["bad_probe"].acceptance_rate < 0.05  # the drafter the engine started with
    assert fixture_engine["good_probe"].mean_acceptance_length > K + 0.5


def test_the_drafter_read_back_from_the_gpu_engine_is_the_one_pushed(fixture_engine):
    assert fixture_engine["readback_problems"] == []


def test_sampling_with_speculation_on_cuda_keeps_the_targets_distribution(fixture_engine, lossless_sampling):
    from megatron_tlt.formats.architecture import architecture_from_dict
    from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture

    exact = next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))["next_probs"]
    p_values = lossless_sampling.goodness_of_fit_p_values(fixture_engine["samples"], exact)
    assert min(p_values) > lossless_sampling.SIGNIFICANCE, p_values


def test_the_pushed_drafter_and_the_policy_survive_sleep_and_wake(fixture_engine):
    assert fixture_engine["probe_after_wake"].mean_acceptance_length > K + 0.5
    assert fixture_engine["greedy_after_wake"] == fixture_engine["greedy_before_sleep"]
    assert fixture_engine["alarms"] == 1  # the bad drafter's probe only


@pytest.mark.parametrize("hand_over", ["wake", "policy_sync", "level_2", "push"])
def test_the_drafters_acceptance_after_each_hand_over_is_what_it_was_before(fixture_engine, hand_over):
    before = fixture_engine["good_probe"].mean_acceptance_length
    assert fixture_engine[f"probe_after_{hand_over}"].mean_acceptance_length == pytest.approx(before, rel=0.02)


def test_after_a_level_2_sleep_the_engine_refuses_to_generate_until_its_weights_are_loaded(fixture_engine):
    assert "slept at level 2" in fixture_engine["refused_after_level_2"]
    assert "drafter and the policy" in fixture_engine["refused_after_level_2"]
    assert fixture_engine["greedy_after_level_2"] == fixture_engine["greedy_before_sleep"]
