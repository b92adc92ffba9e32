"""The rollout engine's agreement with the trainer (``rl/rollout_agreement.py``): figures on hand-computed values,
the label rows the update reads, and when the monitor warns and stops."""

import math

import pytest
import torch

from megatron_tlt.config import ConfigError, RolloutConfig
from megatron_tlt.rl import rollout_agreement
from megatron_tlt.rl.rollout_agreement import AgreementMonitor, RolloutMismatchError
from megatron_tlt.rl.scoring import Sample


def test_token_stats_on_hand_computed_values_leave_masked_positions_out():
    # diffs train - rollout: +ln2, -ln2, 0, and a masked position holding garbage
    train = torch.tensor([[math.log(2.0), -math.log(2.0), -1.0, float("nan")]])
    rollout = torch.tensor([[0.0, 0.0, -1.0, 5.0]])
    valid = torch.tensor([[True, True, True, False]])
    stats = rollout_agreement.token_stats(train, rollout, valid, bound=1.5)
    assert stats["agreement_abs_diff"][0].tolist() == pytest.approx([math.log(2), math.log(2), 0.0, 0.0])
    assert stats["agreement_prob_error"][0].tolist() == pytest.approx([2.0, 2.0, 1.0, 0.0])
    # k3 = r - ln r - 1: r = 2 gives 1 - ln 2, r = 1/2 gives ln 2 - 1/2
    assert stats["agreement_kl"][0].tolist() == pytest.approx([1 - math.log(2), math.log(2) - 0.5, 0.0, 0.0])
    assert stats["agreement_past_bound"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert stats[rollout_agreement.MAX_STAT].item() == pytest.approx(math.log(2))


def test_an_engine_that_agrees_reads_exactly_one_and_zero():
    logprobs = torch.log_softmax(torch.randn(3, 7), dim=-1)
    stats = rollout_agreement.token_stats(logprobs, logprobs.clone(), torch.ones(3, 7), bound=1.05)
    assert stats["agreement_prob_error"].mean().item() == 1.0
    assert stats[rollout_agreement.MAX_STAT].item() == 0.0 and stats["agreement_kl"].abs().max().item() == 0.0


def test_label_row_places_the_rollout_logprobs_at_the_response_positions():
    sample = Sample(prompt_index=0, sample_index=0, prompt_ids=(5, 6, 7), response_ids=[8, 9], finish_reason="stop",
                    reward=0.0, rollout_logprobs=[-0.5, -1.5])
    # prompt 5 6 7, response 8 9: label t predicts token t + 1, so labels 2 (-> 8) and 3 (-> 9) are the response's
    assert rollout_agreement.label_row(sample).tolist() == [0.0, 0.0, -0.5, -1.5]
    assert rollout_agreement.label_row(Sample(0, 0, (5,), [8], "stop", 0.0)) is None
    with pytest.raises(ValueError, match="1 rollout log-probs for a response of 2 tokens"):
        rollout_agreement.label_row(Sample(0, 0, (5,), [8, 9], "stop", 0.0, rollout_logprobs=[-1.0]))


def test_spread_spans_every_group():
    assert rollout_agreement.spread(5, 8) == [0, 1, 2, 3, 4]
    assert rollout_agreement.spread(32, 4) == [0, 8, 16, 24]


def _fields(prob_error: float) -> dict:
    return {"rollout/prob_error": prob_error, "rollout/logprob_diff_mean": math.log(prob_error),
            "rollout/logprob_diff_max": 3.0, "rollout/logprob_kl": 0.1, "rollout/past_bound_share": 0.25,
            "rollout/agreement_tokens": 400.0}


def test_the_monitor_is_quiet_within_the_bound_and_warns_past_it():
    monitor = AgreementMonitor(bound=1.05, stop_level=1.5, stop_after_steps=2)
    assert monitor.check(1, _fields(1.0000002)) is None
    line = monitor.check(2, _fields(1.2))
    assert line.startswith("step 2 rollout: engine and trainer disagree, past the bound: probability error 1.2 ")
    assert "25.0% of 400 tokens past the bound" in line
    assert monitor.check(3, {}) is None  # a step that measured nothing says nothing


def test_the_monitor_stops_after_the_configured_steps_far_past_the_stop_level_in_a_row():
    monitor = AgreementMonitor(bound=1.05, stop_level=1.5, stop_after_steps=2)
    assert "far past the stop level" in monitor.check(1, _fields(40.0))
    assert monitor.check(2, _fields(1.01)) is None  # the streak is broken
    monitor.check(3, _fields(40.0))
    with pytest.raises(RolloutMismatchError, match=r"step 4: the rollout engine does not sample the policy being "
                                                   r"trained, for 2 step\(s\) in a row: probability error inf"):
        monitor.check(4, _fields(float("inf")))


def test_a_stop_after_of_zero_only_warns():
    monitor = AgreementMonitor.from_config(RolloutConfig(agreement_stop_after_steps=0))
    for step in range(1, 6):
        assert "far past the stop level" in monitor.check(step, _fields(100.0))


def test_bad_agreement_settings_are_refused():
    with pytest.raises(ConfigError, match="agreement_bound must be >= 1"):
        RolloutConfig(agreement_bound=0.9)
    with pytest.raises(ConfigError, match="agreement_bound must be >= 1 and <= agreement_stop_level"):
        RolloutConfig(agreement_bound=2.0, agreement_stop_level=1.5)
    with pytest.raises(ConfigError, match="agreement_stop_after_steps >= 0"):
        RolloutConfig(agreement_stop_after_steps=-1)


def test_summary_fields_rename_the_update_figures_and_leave_the_update_its_own():
    metrics = {"pg_loss": 0.1, "num_tokens": 10.0, "agreement_prob_error": 1.0, "agreement_abs_diff": 0.0,
               rollout_agreement.MAX_STAT: 0.0, "agreement_kl": 0.0, "agreement_past_bound": 0.0,
               "agreement_tokens": 10.0}
    assert rollout_agreement.summary_fields(metrics) == {
        "rollout/prob_error": 1.0, "rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0,
        "rollout/logprob_kl": 0.0, "rollout/past_bound_share": 0.0, "rollout/agreement_tokens": 10.0}
    assert rollout_agreement.without_agreement(metrics) == {"pg_loss": 0.1, "num_tokens": 10.0}
    assert rollout_agreement.summary_fields({"agreement_tokens": 0.0}) == {}


def test_several_optimizer_steps_combine_by_their_tokens_and_keep_the_largest_max():
    first = {"agreement_tokens": 300.0, "agreement_prob_error": 1.0, "agreement_abs_diff": 0.0, "agreement_kl": 0.0,
             "agreement_past_bound": 0.0, rollout_agreement.MAX_STAT: 0.5}
    second = {"agreement_tokens": 100.0, "agreement_prob_error": 3.0, "agreement_abs_diff": 0.4, "agreement_kl": 0.8,
              "agreement_past_bound": 1.0, rollout_agreement.MAX_STAT: 2.0}
    combined = rollout_agreement.combine([first, second, {"agreement_tokens": 0.0}])
    assert combined == pytest.approx({"agreement_tokens": 400.0, "agreement_prob_error": 1.5, "agreement_abs_diff": 0.1,
                                      "agreement_kl": 0.2, "agreement_past_bound": 0.25, rollout_agreement.MAX_STAT: 2.0})
    assert rollout_agreement.combine([]) == {"agreement_tokens": 0.0}


def test_the_max_is_said_as_it_is_and_the_means_clamp_an_absurd_token():
    stats = rollout_agreement.token_stats(torch.tensor([[-50.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), bound=1.05)
    assert stats[rollout_agreement.MAX_STAT].item() == 50.0 and stats["agreement_abs_diff"].item() == 20.0
