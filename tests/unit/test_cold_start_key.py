"""Where ``drafter.cold_start.enabled`` and the benchmarks find their drafter: a cache entry keyed by what the cold
start reads, shared by runs that differ only in RL-side drafter settings."""

import pytest

from megatron_tlt.commands.start import cold_start_dir, cold_start_drafter
from megatron_tlt.config import load_config


def _entry(tmp_path, *overrides: str) -> str:
    return str(cold_start_dir(load_config("tiny", [f"warmup.cache_dir={tmp_path}", *overrides])))


def test_tlt_on_and_off_share_the_cold_start_drafter(tmp_path):
    off = _entry(tmp_path)
    # the online rate is not the cold start's (drafter.cold_start.lr)
    on = _entry(tmp_path, "drafter.depth=4", "drafter.spot_training=true", "drafter.cold_start.enabled=true",
                "drafter.lr=1e-2", "speculation.adaptive=true", "drafter.probe_prompts=2")
    # nor does how rewards are scored: the cold start scores nothing
    pooled = _entry(tmp_path, "data.reward_workers=2", "data.reward_timeout_s=5", "data.ray_address=auto")
    assert pooled == off
    # nor how the run checks its engine against the trainer
    assert _entry(tmp_path, "rollout.agreement_bound=1.2", "rollout.agreement_stop_level=2") == off
    assert off == on and off.startswith(str(tmp_path / "drafter-"))
    # a cold-start cap at or above the rollout's caps nothing (a run's config.yaml writes the rollout's for null)
    assert _entry(tmp_path, "drafter.cold_start.max_response_tokens=768") == off
    assert _entry(tmp_path, "drafter.cold_start.max_response_tokens=1000") == off
    # not shipped, not made: under torchrun it must exist beforehand
    with pytest.raises(FileNotFoundError, match="drafter.cold_start.enabled: no cold-start drafter cached at") as err:
        cold_start_drafter("tiny", [f"warmup.cache_dir={tmp_path}", "warmup.use_shipped=false"], make=False)
    assert str(err.value).split(" cached at ")[1].split(";")[0] == off


@pytest.mark.parametrize("override", ["rollout.temperature=0.6", "rollout.max_response_tokens=64",
                                      "drafter.cold_start.lr=1e-2", "drafter.cold_start.epochs=2",
                                      "drafter.cold_start.eval_depth=4", "drafter.cold_start.max_response_tokens=32",
                                      "model.tiny.num_layers=2", "data.max_solution_steps=8", "trainer.seed=7",
                                      "parallel.data_parallel_size=1", "drafter.unroll_steps=2",
                                      "data.curriculum_steps=5 data.curriculum_max_prompt_tokens=15"])
def test_what_the_cold_start_reads_changes_the_entry(tmp_path, override):
    assert _entry(tmp_path, *override.split()) != _entry(tmp_path)


def test_a_held_out_file_changes_the_entry_and_none_keeps_it(tmp_path):
    # the cold start evaluates on the held-out file where there is one, else on the dataset's tail, which it then
    # does not train on: two different drafters
    on_file = _entry(tmp_path, f"model.hf_dir={tmp_path}", "data.path=train.jsonl")
    assert _entry(tmp_path, f"model.hf_dir={tmp_path}", "data.path=train.jsonl",
                  "data.held_out_path=held_out.jsonl") != on_file
    assert _entry(tmp_path, f"model.hf_dir={tmp_path}", "data.path=train.jsonl", "data.held_out_path=null") == on_file
