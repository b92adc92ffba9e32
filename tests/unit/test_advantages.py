import math

import pytest
import torch

from megatron_tlt.rl.advantages import (
    equal_reward_group_mask,
    get_advantage_fn,
    grpo_advantages,
    known_advantage_names,
    register_advantage,
    rloo_advantages,
)

EPS = 1e-6  # grpo's default; hand values below ignore it, hence the tolerances


def test_grpo_centres_each_group_and_divides_by_its_population_std():
    rewards_g = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 4.0]])
    # row 0: mean 0.5, deviations [.5, -.5, -.5, .5], population var = 4 * .25 / 4 = .25, std .5
    #        -> [1, -1, -1, 1]   (the unbiased std would be sqrt(1/3) = .577 and give +-0.866)
    # row 1: mean 1, deviations [-1, -1, -1, 3], population var = (1 + 1 + 1 + 9) / 4 = 3, std sqrt(3)
    #        -> [-1/sqrt3, -1/sqrt3, -1/sqrt3, 3/sqrt3]
    s = 1 / math.sqrt(3)
    expected_g = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-s, -s, -s, 3 * s]])
    torch.testing.assert_close(grpo_advantages(rewards_g), expected_g, atol=1e-5, rtol=0)


def test_grpo_without_std_normalisation_only_subtracts_the_group_mean():
    rewards_g = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 4.0]])
    expected_g = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.0, -1.0, -1.0, 3.0]])
    torch.testing.assert_close(grpo_advantages(rewards_g, normalize_by_std=False), expected_g)


def test_grpo_gives_zero_not_nan_for_equal_reward_groups_and_single_sample_groups():
    torch.testing.assert_close(grpo_advantages(torch.tensor([[0.7, 0.7, 0.7]])), torch.zeros(1, 3))
    torch.testing.assert_close(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


def test_grpo_accepts_bool_and_integer_rewards_and_returns_floats():
    advantages_g = grpo_advantages(torch.tensor([[True, False]]))
    assert advantages_g.dtype == torch.float32
    torch.testing.assert_close(advantages_g, torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(grpo_advantages(torch.tensor([[3, 1]])), torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)


def test_grpo_rejects_flat_rewards_and_a_non_positive_eps():
    with pytest.raises(ValueError, match=r"\[num_prompts, n\]"):
        grpo_advantages(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(torch.tensor([[1.0, 0.0]]), eps=0.0)


def test_rloo_subtracts_the_mean_of_the_other_samples_without_std_scaling():
    rewards_g = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 0.0, 2.0]])
    # row 0: a 1 sees others {0, 0, 1} -> baseline 1/3 -> 2/3; a 0 sees {1, 0, 1} -> 2/3 -> -2/3
    # row 1: 2 vs mean(4, 0, 2) = 2 -> 0; 4 vs mean(2, 0, 2) = 4/3 -> 8/3; 0 vs mean(2, 4, 2) = 8/3 -> -8/3
    expected_g = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 8 / 3, -8 / 3, 0.0]])
    torch.testing.assert_close(rloo_advantages(rewards_g), expected_g)


def test_rloo_refuses_groups_of_one_sample():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_equal_reward_group_mask_marks_groups_without_learning_signal():
    rewards_g = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert equal_reward_group_mask(rewards_g).tolist() == [True, False, True, False]


def test_registry_returns_the_registered_estimators_by_name():
    assert get_advantage_fn("grpo") is grpo_advantages
    assert get_advantage_fn("rloo") is rloo_advantages
    assert {"grpo", "rloo"} <= set(known_advantage_names())


def test_unknown_advantage_name_raises_value_error_listing_the_known_names():
    with pytest.raises(ValueError, match=r"'gae'.*grpo.*rloo"):
        get_advantage_fn("gae")


def test_registering_a_taken_name_raises_instead_of_replacing_it():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda rewards_g: rewards_g)
    assert get_advantage_fn("grpo") is grpo_advantages
