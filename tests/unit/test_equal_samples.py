"""bench/equal_samples.py: an arm's seconds a step over another's at equal draws, on synthetic runs whose true
effect is known, where the draws alone would rank the arms the wrong way."""

import random
import sys

import pytest

from script_modules import REPO, load_script


def _equal_samples():
    return load_script("bench/equal_samples.py", "equal_samples_bench")


def _runs(effect: float, *, longer: float, repeats: int = 3, steps: int = 20, noise: float = 0.05, seed: int = 0):
    """Per repeat, a run's records: 0.01 s per generated token, 0.02 s per token of the longest response, 1 ms per
    update token, a step's own prompts' cost and a repeat's machine, plus ``effect`` s; ``longer`` scales the
    responses this arm happened to draw."""
    rng = random.Random(seed)
    prompts = [random.Random(step).uniform(0.0, 2.0) for step in range(steps + 1)]
    runs = []
    for repeat in range(repeats):
        machine = 0.3 * repeat
        records = []
        for step in range(1, steps + 1):
            mean_len, max_len = rng.uniform(30, 60) * longer, rng.uniform(150, 400) * longer
            update_tokens = rng.uniform(3000, 6000) * longer
            rollout = 0.01 * mean_len * 128 / 64 + 0.02 * max_len + prompts[step] + machine
            update = 0.001 * update_tokens + rng.gauss(0, noise)
            rollout += effect + rng.gauss(0, noise)
            records.append({"step": step, "response_length_mean": mean_len, "num_samples": 128,
                            "response_length_max": max_len, "update/num_tokens": update_tokens,
                            "rollout_seconds": rollout, "update_seconds": update, "sync_seconds": 0.5,
                            "step_seconds": rollout + update + 0.5})
        runs.append(records)
    return runs


def test_the_fit_recovers_the_arms_effect_where_the_draws_alone_would_rank_them_the_wrong_way():
    module = _equal_samples()
    base = _runs(0.0, longer=1.0, seed=1)
    arm = _runs(0.2, longer=0.85, seed=2)  # 0.2 s a step slower, but its draws were shorter: it looks faster
    plain = sum(r["step_seconds"] for run in base for r in run[1:]) / sum(r["step_seconds"] for run in arm for r in run[1:])
    assert plain > 1.0
    effect = module.arm_effect(base, arm, "step_seconds")
    assert effect.seconds == pytest.approx(0.2, abs=3 * effect.standard_error)
    assert 0 < effect.standard_error < 0.05
    assert effect.rows == 2 * 3 * 19  # step 1 left out
    assert effect.ratio < 1.0  # base / arm at equal draws: the arm is slower
    assert effect.ratio == pytest.approx(effect.base_mean_seconds / (effect.base_mean_seconds + effect.seconds))


def test_a_phase_is_fitted_on_its_own_draws_and_an_arm_equal_to_its_base_shows_no_effect():
    module = _equal_samples()
    base, arm = _runs(0.0, longer=1.0, seed=3), _runs(0.0, longer=1.2, seed=4)
    update = module.arm_effect(base, arm, "update_seconds")
    assert update.seconds == pytest.approx(0.0, abs=3 * update.standard_error)
    sync = module.arm_effect(base, arm, "sync_seconds")
    assert sync.seconds == pytest.approx(0.0, abs=1e-9) and sync.ratio == pytest.approx(1.0)


def test_bad_input_is_refused_with_what_was_wrong():
    module = _equal_samples()
    runs = _runs(0.0, longer=1.0, repeats=1, steps=3)
    with pytest.raises(ValueError, match="phase must be one of"):
        module.arm_effect(runs, runs, "reward_seconds")
    with pytest.raises(ValueError, match="same number of repeats"):
        module.arm_effect(runs, runs + runs)
    with pytest.raises(ValueError, match="cannot fit"):  # 4 rows, 6 effects
        module.arm_effect(runs, _runs(0.0, longer=1.0, repeats=1, steps=3, seed=5), "step_seconds")


def _on_a_machine(runs, slower: list[float]):
    """The same runs as if each had run on a machine ``slower[i]`` times slower: every phase's seconds scaled."""
    keys = ("rollout_seconds", "update_seconds", "sync_seconds", "step_seconds")
    return [[dict(r, **{k: r[k] * factor for k in keys}) for r in run] for run, factor in zip(runs, slower)]


def test_at_machine_speed_each_run_is_read_at_its_own_speed_and_repeats_give_the_error():
    module = _equal_samples()
    # the arm is 0.2 s a step slower, but its runs met a machine 5-15% faster than the base's
    base = _on_a_machine(_runs(0.0, longer=1.0, repeats=4, seed=6), [1.10, 1.05, 1.15, 1.10])
    arm = _on_a_machine(_runs(0.2, longer=1.0, repeats=4, seed=7), [1.0, 0.95, 1.0, 1.0])
    assert module.arm_effect(base, arm).seconds < 0  # the machine, not the arm, decides the plain fit
    effect = module.arm_effect(base, arm, at_machine_speed=True)
    assert effect.seconds == pytest.approx(0.2 * 1.04, abs=3 * effect.standard_error)  # at the runs' mean speed
    repeats = module.repeat_effects(base, arm, at_machine_speed=True)
    assert len(repeats) == 4 and all(e.rows == 2 * 19 for e in repeats)
    mean, se = module.mean_ratio(repeats)
    assert mean < 1.0 and se is not None and mean + 3 * se < 1.0
    assert module.mean_ratio(repeats[:1])[1] is None
    assert module.speed_index(base[0]) == pytest.approx(
        sum(r["update_seconds"] for r in base[0][1:]) / sum(r["update/num_tokens"] for r in base[0][1:]))


def test_the_bench_reprints_a_kept_directory_with_the_fit_at_equal_draws(tmp_path):
    """``bench/tlt_end_to_end.py --reprint DIR`` reads the runs a bench kept (``--keep DIR``) and prints again."""
    import json
    import subprocess

    for arm, effect, seed in (("on", 0.2, 8), ("frozen", 0.0, 9)):
        for repeat, records in enumerate(_runs(effect, longer=1.0, repeats=2, seed=seed), start=1):
            for r in records:
                r.update({"reward_mean": 0.5, "spec/mean_acceptance_length": 5.0,
                          "drafter/tokens_trained": [100, 0] if arm == "on" else [0, 0]})
            (tmp_path / f"{arm}-{repeat}").mkdir()
            (tmp_path / f"{arm}-{repeat}" / "summary.json").write_text(json.dumps(records))
    bench = REPO / "bench" / "tlt_end_to_end.py"
    done = subprocess.run([sys.executable, str(bench), "--reprint", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "on against frozen at equal draws" in done.stdout
    assert "at each run's machine speed, per repeat" in done.stdout
    (tmp_path / "on-2" / "summary.json").unlink()  # an interrupted bench: its arms ran unequal repeats
    done = subprocess.run([sys.executable, str(bench), "--reprint", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "different numbers of repeats" in done.stderr
