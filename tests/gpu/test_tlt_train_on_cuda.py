"""`tlt train` end to end on one GPU: a small tiny default with TLT on (EAGLE speculation and the spot
trainer), one data-parallel rank, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("cuda", "megatron", "vllm")

REPO = Path(__file__).resolve().parents[2]
# tests/dist/test_rl_trainer.py's small variant: a 30-step warm-up and 4 prompts x 4 samples per step
SMALL = [
    # The 4-layer shape of the tiny default before issue 18, with TLT off: fast and well measured; each test
    # turns on what it tests.
    "model.tiny.num_layers=4", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
    "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2", "data.max_solution_steps=20",
    "trainer.micro_batch_size=4", "drafter.speculative_tokens=0", "drafter.spot_training=false",
    "drafter.cold_start=false", "drafter.lr=1e-3", "drafter.spot_lr=null", "speculation.adaptive=false",
    "warmup.steps=30", "warmup.corpus_size=1024", "data.synthetic_prompts=256", "data.held_out_prompts=16",
    "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=48",
    "trainer.eval_every=0",
]


def test_tlt_train_runs_two_speculative_steps_with_the_spot_trainer_on_one_gpu(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "megatron_tlt.cli", "train", *SMALL, "trainer.steps=2",
               "parallel.data_parallel_size=1", "drafter.speculative_tokens=2", "drafter.spot_training=true",
               f"trainer.run_dir={run_dir}"]
    result = subprocess.run(command, cwd=REPO, env=dict(os.environ, TLT_CACHE_DIR=str(tmp_path / "cache")),
                            capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["num_samples"] == 16 and record["rollout_seconds"] > 0
        assert record["spec/mean_acceptance_length"] >= 1.0
        assert record["drafter/failed"] is False
