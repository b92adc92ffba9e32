"""spec/ceiling.py: what speculation can buy at most with a drafter, from its acceptance and its cost."""

import pytest

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.spec.ceiling import drafter_cost_share, speculation_ceiling

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def test_a_drafter_that_is_always_right_and_free_pays_its_full_depth():
    ceiling = speculation_ceiling([1.0, 1.0, 1.0, 1.0], 0.0)
    assert (ceiling.speedup, ceiling.depth) == (5.0, 4)


def test_a_drafter_never_accepted_pays_nothing_at_any_depth():
    ceiling = speculation_ceiling([0.0, 0.0], 0.1)
    assert (ceiling.speedup, ceiling.depth) == (1.0, 0)
    assert "no depth pays" in ceiling.describe()


def test_the_best_depth_weighs_the_next_tokens_against_their_drafts():
    # depth 1: 1.5 / 1.1; depth 2: (1.5 + 0.25) / 1.2; depth 3: (1.75 + 0.025) / 1.3
    ceiling = speculation_ceiling([0.5, 0.5, 0.1], 0.1)
    assert ceiling.depth == 2 and ceiling.speedup == pytest.approx(1.75 / 1.2)


def test_smollm2_135m_with_its_measured_cold_start_can_gain_four_percent_at_most():
    # its tied 49152 x 576 LM head runs once per draft token: a draft token is ~24% of a policy token, where the
    # tiny default's is 1/40.8 (bench/default_shape.py). Acceptance per draft step of hf.yaml's cold start
    # (held out, teacher-forced, 2026-12-07): 0.292, 0.183, 0.138, 0.121.
    share = drafter_cost_share(architecture_from_dict(SMOLLM2_135M))
    assert share == pytest.approx(0.2417, abs=1e-3)
    ceiling = speculation_ceiling([0.292, 0.183, 0.138, 0.121], share)
    assert ceiling.depth == 1 and ceiling.speedup == pytest.approx(1.292 / (1 + share))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="acceptance at draft step 2 must be in"):
        speculation_ceiling([0.5, 1.5], 0.1)
    with pytest.raises(ValueError, match="cost_share must be >= 0"):
        speculation_ceiling([0.5], -0.1)
