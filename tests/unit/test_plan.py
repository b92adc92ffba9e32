"""``tlt plan``: layout checks, the per-GPU memory estimate, the layout search and the command's exit codes."""

from __future__ import annotations

import pytest

from megatron_tlt import plan as P
from megatron_tlt.model_config import architecture_from_dict

LLAMA_70B = "llama-3.3-70b"


@pytest.fixture(scope="module")
def llama70b():
    arch, _ = P.resolve_model(LLAMA_70B)
    return arch


@pytest.fixture(scope="module")
def qwen7b():
    arch, _ = P.resolve_model("qwen2.5-7b")
    return arch


def run_main(capsys, *args):
    rc = P.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- the model files


def test_model_is_found_by_name_directory_or_config_path(llama70b, tmp_path):
    by_dir, _ = P.resolve_model(P.MODELS_DIR / LLAMA_70B)
    by_file, name = P.resolve_model(P.MODELS_DIR / LLAMA_70B / "config.json")
    assert by_dir == by_file == llama70b and name == LLAMA_70B
    assert (llama70b.num_layers, llama70b.num_attention_heads, llama70b.num_kv_heads) == (80, 64, 8)
    with pytest.raises(P.PlanError, match="shipped configs: .*llama-3.3-70b"):
        P.resolve_model("no-such-model")
    other = tmp_path / "my-llama.json"
    other.write_text((P.MODELS_DIR / LLAMA_70B / "config.json").read_text())
    assert P.resolve_model(other) == (llama70b, "my-llama")
    other.write_text("{not json")
    with pytest.raises(P.PlanError, match="not a readable JSON config"):
        P.resolve_model(other)


def test_parameter_counts_match_the_published_sizes(llama70b, qwen7b):
    """Llama-3.3-70B: 70,553,706,496 parameters (the total of its safetensors index, "70.6B" on the Hub);
    Qwen2.5-7B model card: "Number of Parameters: 7.61B; Number of Parameters (Non-Embedding): 6.53B"."""
    assert P.count_parameters(llama70b) == 70_553_706_496
    total = P.count_parameters(qwen7b)
    non_embedding = total - 2 * qwen7b.vocab_size * qwen7b.hidden_size
    assert total / 1e9 == pytest.approx(7.61, abs=0.01)  # 7,615,616,512: the card truncates
    assert non_embedding / 1e9 == pytest.approx(6.53, abs=0.005)
    # Megatron's shards add up to the model (plus the padded vocabulary rows)
    for tp, pp in [(1, 1), (8, 4), (2, 5)]:
        shards = sum(P.stage_parameters(llama70b, tp, pp)) * tp
        padding = 2 * (llama70b.padded_vocab_size(tp) - llama70b.vocab_size) * llama70b.hidden_size
        norms = (2 * llama70b.num_layers + 1) * llama70b.hidden_size * (tp - 1)  # replicated on every TP rank
        assert shards == P.count_parameters(llama70b) + padding + norms


# ----------------------------------------------------------------------------- validation against published figures


def test_model_state_matches_megatron_distributed_optimizer_table():
    """NVIDIA/Megatron-LM, docs/source/api-guide/dist_optimizer.md, theoretical bytes per parameter
    (d = data-parallel size): float16 param + float16 grads 20 vs 4 + 16/d; float16 param + fp32 grads
    18 vs 6 + 12/d; fp32 param + fp32 grads 16 vs 8 + 8/d (non-distributed vs distributed optimizer)."""
    table = {(2, 2): (20, lambda d: 4 + 16 / d), (2, 4): (18, lambda d: 6 + 12 / d), (4, 4): (16, lambda d: 8 + 8 / d)}
    for (param_bytes, grad_bytes), (plain, distributed) in table.items():
        for d in (1, 2, 8, 64):
            assert P.model_state_bytes_per_param(param_bytes=param_bytes, grad_bytes=grad_bytes, data_parallel_size=d,
                                                 distributed_optimizer=False) == plain
            assert P.model_state_bytes_per_param(param_bytes=param_bytes, grad_bytes=grad_bytes, data_parallel_size=d,
                                                 distributed_optimizer=True) == pytest.approx(distributed(d))


def test_model_state_within_15_percent_of_the_zero_paper():
    """Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    Sec. 3.1 and Fig. 1: mixed-precision Adam holds 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes of model states, so a
    7.5B-parameter model needs 120 GB per GPU with plain data parallelism, and 31.4 GB with the optimizer
    state partitioned over Nd = 64 GPUs (P_os).

    The planner's default (Megatron: bf16 params, fp32 main grads) counts 2 more bytes per parameter for
    the fp32 gradient, 18Ψ = 135 GB (+12.5%). ZeRO's P_os case matches Megatron's distributed optimizer with
    16-bit grads (4 + 16/d bytes, d = 64): 31.9 GB (+1.5%)."""
    psi = 7.5e9
    baseline = P.model_state_bytes(psi, data_parallel_size=1, distributed_optimizer=False)  # planner defaults
    assert baseline / 1e9 == pytest.approx(120, rel=0.15)
    partitioned = P.model_state_bytes(psi, param_bytes=2, grad_bytes=2, data_parallel_size=64,
                                      distributed_optimizer=True)
    assert partitioned / 1e9 == pytest.approx(31.4, rel=0.15)


def test_activation_formulas_are_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B, the paper's running example
    kw = {"seq_len": s, "micro_batch_size": b, "hidden_size": h, "num_attention_heads": a, "tensor_parallel_size": t}
    assert P.activation_bytes_per_layer(**kw, sequence_parallel=True, recompute="selective") == 34 * s * b * h / t
    assert P.activation_bytes_per_layer(**kw, sequence_parallel=True, recompute="none") == pytest.approx(
        s * b * h / t * (34 + 5 * a * s / h))
    assert P.activation_bytes_per_layer(**kw, sequence_parallel=False, recompute="none") == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert P.activation_bytes_per_layer(**kw, sequence_parallel=False, recompute="selective") == pytest.approx(
        s * b * h * (10 + 24 / t))
    assert P.activation_bytes_per_layer(**kw, sequence_parallel=False, recompute="full") == 2 * s * b * h
    with pytest.raises(P.PlanError, match="recompute"):
        P.activation_bytes_per_layer(**kw, sequence_parallel=True, recompute="some")


# ----------------------------------------------------------------------------- Llama-3.3-70B on 8 x 8 H100


def test_llama70b_on_8x8_chooses_a_fitting_layout(llama70b):
    chosen, alternatives = P.search_layouts(llama70b, nodes=8, gpus_per_node=8, model_name=LLAMA_70B)
    assert chosen.fits and chosen.peak_gib <= 80
    assert chosen.tp == 8 and chosen.tp <= chosen.gpus_per_node and 8 % chosen.tp == 0
    assert chosen.tp * chosen.pp * chosen.dp == 64
    assert chosen.engines_per_node == 8 // chosen.engine_tp
    assert chosen.layers_per_stage * chosen.pp == 80
    # smallest TP x PP first, every alternative fits and is not smaller
    assert all(a.fits and a.tp * a.pp >= chosen.tp * chosen.pp for a in alternatives)
    smaller = [(t, p) for t, p in P.valid_layouts(llama70b, nodes=8, gpus_per_node=8) if t * p < chosen.tp * chosen.pp]
    for t, p in smaller:
        assert not P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=t, pp=p).fits
    # the worst stage of a pipeline is the first (PP micro-batches in flight) and it is what the table shows
    assert chosen.stage == "first"
    parts = {p.key: p for p in chosen.parts}
    assert parts["activations"].gib["training"] > 0 and parts["activations"].gib["rollout"] == 0
    assert parts["kv_cache"].gib["training"] == 0 and parts["kv_cache"].gib["rollout"] > 0
    assert parts["drafter_state"].gib["training"] == parts["drafter_state"].gib["rollout"] > 0
    assert chosen.peak_gib == max(chosen.phase_gib(ph) for ph in P.PHASES)


def test_main_prints_the_layout_and_the_memory_table(capsys):
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8")
    assert rc == 0 and err == ""
    assert "layout: TP=8 PP=" in out and "DP=" in out
    assert "layers per stage" in out and "per node" in out
    for text in ("memory per GPU (GiB)", "training", "rollout", "policy weights (bf16)", "policy grads",
                 "optimizer (fp32 master + Adam m, v)", "activations", "vLLM weights", "vLLM KV cache",
                 "EAGLE drafter", "CUDA context", "total", "peak:", "fits", "how the phases share the GPU",
                 "other layouts that fit"):
        assert text in out, text


def test_tp_3_is_refused_for_its_heads(capsys, llama70b):
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--tp", "3")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tlt plan: error: ")
    assert "num_attention_heads 64" in err and "3" in err
    with pytest.raises(P.PlanError, match="does not divide num_attention_heads 64"):
        P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=3, pp=1)


def test_pp_3_is_refused_for_its_layers(capsys, llama70b):
    rc, _, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--pp", "3")
    assert rc == 2 and "num_hidden_layers 80" in err and err.count("\n") == 1
    with pytest.raises(P.PlanError, match="pipeline parallel size 3 does not divide num_hidden_layers 80"):
        P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=3)


def test_a_layout_that_does_not_fit_is_refused_naming_the_biggest_part(capsys, llama70b):
    plan = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=1, pp=1)
    assert not plan.fits and plan.peak_gib > 80
    biggest = plan.biggest_part
    assert biggest.gib[plan.peak_phase] == max(p.gib[plan.peak_phase] for p in plan.parts)
    with pytest.raises(P.PlanError) as info:
        P.require_fit(plan)
    message = str(info.value)
    assert biggest.label in message and "raise TP or PP" in message and "80 GiB" in message
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--tp", "1",
                            "--pp", "1")
    assert rc == 2 and err.count("\n") == 1 and biggest.label in err
    assert "DOES NOT FIT" in out  # the table that explains the refusal


def test_world_not_divisible_and_tp_across_nodes_are_refused(llama70b, qwen7b):
    with pytest.raises(P.PlanError, match="TP x PP = 16 does not divide the 24 GPUs"):
        P.plan_layout(llama70b, nodes=3, gpus_per_node=8, tp=8, pp=2)
    with pytest.raises(P.PlanError, match="within one node"):
        P.plan_layout(qwen7b, nodes=4, gpus_per_node=2, tp=4, pp=1)
    with pytest.raises(P.PlanError, match="span two nodes"):
        P.plan_layout(llama70b, nodes=2, gpus_per_node=6, tp=4, pp=1)


def test_no_fitting_layout_names_the_closest(llama70b):
    with pytest.raises(P.PlanError, match="no layout of 8 GPUs fits in 80 GiB; the closest: TP=8"):
        P.search_layouts(llama70b, nodes=1, gpus_per_node=8)


def test_engine_without_room_for_a_kv_cache_is_refused(llama70b):
    plan = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4,
                         options=P.PlanOptions(gpu_memory_utilization=0.2))
    assert plan.fits_memory and not plan.fits
    with pytest.raises(P.PlanError, match="gpu_memory_utilization"):
        P.require_fit(plan)


def test_options_move_the_estimate_the_right_way(llama70b):
    base = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4)
    part = lambda plan, key, phase="training": next(p for p in plan.parts if p.key == key).gib[phase]
    dist_opt = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4,
                             options=P.PlanOptions(distributed_optimizer=True))
    assert part(base, "optimizer") == pytest.approx(base.dp * part(dist_opt, "optimizer"))
    awake = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=P.PlanOptions(sleep_level=0))
    assert awake.phase_gib("training") == pytest.approx(base.phase_gib("training") + 0.4 * 80)
    resident = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4,
                             options=P.PlanOptions(offload_training_state=False))
    assert part(resident, "optimizer", "rollout") == part(resident, "optimizer") > 0
    full = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=P.PlanOptions(recompute="full"))
    assert part(full, "activations") < part(base, "activations")
    no_drafter = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=P.PlanOptions(drafter=False))
    assert not any(p.key.startswith("drafter") for p in no_drafter.parts)


def test_tiny_model_fits_trivially(capsys, tmp_path):
    from megatron_tlt.tiny_models import TINY_LLAMA

    arch = architecture_from_dict(TINY_LLAMA)
    chosen, _ = P.search_layouts(arch, nodes=1, gpus_per_node=2, options=P.PlanOptions(seq_len=256))
    assert (chosen.tp, chosen.pp, chosen.dp) == (1, 1, 2)
    assert chosen.fits and chosen.peak_gib < P.PlanOptions().overhead_gib + 0.5 * 80
    assert chosen.phase_gib("training") < P.PlanOptions().overhead_gib + 0.1
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, out, _ = run_main(capsys, "--model", str(tmp_path / "config.json"), "--nodes", "1", "--gpus-per-node", "2",
                          "--seq-len", "256")
    assert rc == 0 and "layout: TP=1 PP=1 DP=2" in out
