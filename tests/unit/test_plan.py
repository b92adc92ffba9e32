"""``tlt plan``: layout checks, the per-GPU memory estimate, the layout search, the config route and exit codes.

The activation formula is checked against measurements in ``tests/dist/test_plan_vs_measured.py``; here
against hand-counted tensors, the H100 figures in ``../shared/DESIGN.md`` and its own structure."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.plan import cli as plan_cli
from megatron_tlt.plan import memory as M
from megatron_tlt.plan import search as P
from megatron_tlt.plan.model import MODELS_DIR, PlanError, count_parameters, resolve_model, stage_parameters

LLAMA_70B = "llama-3.3-70b"
FLAGSHIP = dict(sequence_parallel=True, recompute="full", distributed_optimizer=True, seq_len=9216,
                gpu_memory_utilization=0.35)
MIB = 2**20
GIB = 2**30


@pytest.fixture(scope="module")
def llama70b():
    arch, _ = resolve_model(LLAMA_70B)
    return arch


@pytest.fixture(scope="module")
def qwen7b():
    arch, _ = resolve_model("qwen2.5-7b")
    return arch


def _llama(**dims):
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=131072,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    return architecture_from_dict({**config, **dims})


SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, vocab_size=500)
# Llama-3.2-1B's dimensions: the 1.24B model measured on an H100 (DESIGN.md section 3)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)


def run_main(capsys, *args):
    rc = plan_cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- the model files


def test_model_is_found_by_name_directory_or_config_path(llama70b, tmp_path):
    by_dir, _ = resolve_model(MODELS_DIR / LLAMA_70B)
    by_file, name = resolve_model(MODELS_DIR / LLAMA_70B / "config.json")
    assert by_dir == by_file == llama70b and name == LLAMA_70B
    assert (llama70b.num_layers, llama70b.num_attention_heads, llama70b.num_kv_heads) == (80, 64, 8)
    with pytest.raises(PlanError, match="shipped configs: .*llama-3.3-70b"):
        resolve_model("no-such-model")
    other = tmp_path / "my-llama.json"
    other.write_text((MODELS_DIR / LLAMA_70B / "config.json").read_text())
    assert resolve_model(other) == (llama70b, "my-llama")
    other.write_text("{not json")
    with pytest.raises(PlanError, match="not a readable JSON config"):
        resolve_model(other)


def test_parameter_counts_match_the_published_sizes(llama70b, qwen7b):
    """Llama-3.3-70B: 70,553,706,496 parameters (the total of its safetensors index, "70.6B" on the Hub);
    Qwen2.5-7B model card: "Number of Parameters: 7.61B; Number of Parameters (Non-Embedding): 6.53B"."""
    assert count_parameters(llama70b) == 70_553_706_496
    total = count_parameters(qwen7b)
    non_embedding = total - 2 * qwen7b.vocab_size * qwen7b.hidden_size
    assert total / 1e9 == pytest.approx(7.61, abs=0.01)  # 7,615,616,512: the card truncates
    assert non_embedding / 1e9 == pytest.approx(6.53, abs=0.005)
    # Megatron's shards add up to the model (plus the padded vocabulary rows)
    for tp, pp in [(1, 1), (8, 4), (2, 5)]:
        shards = sum(stage_parameters(llama70b, tp, pp)) * tp
        padding = 2 * (llama70b.padded_vocab_size(tp) - llama70b.vocab_size) * llama70b.hidden_size
        norms = (2 * llama70b.num_layers + 1) * llama70b.hidden_size * (tp - 1)  # replicated on every TP rank
        assert shards == count_parameters(llama70b) + padding + norms


# ----------------------------------------------------------------------------- model state


def test_model_state_matches_megatron_distributed_optimizer_table():
    """NVIDIA/Megatron-LM, docs/source/api-guide/dist_optimizer.md, theoretical bytes per parameter
    (d = data-parallel size): float16 param + float16 grads 20 vs 4 + 16/d; float16 param + fp32 grads
    18 vs 6 + 12/d; fp32 param + fp32 grads 16 vs 8 + 8/d (non-distributed vs distributed optimizer)."""
    table = {(2, 2): (20, lambda d: 4 + 16 / d), (2, 4): (18, lambda d: 6 + 12 / d), (4, 4): (16, lambda d: 8 + 8 / d)}
    for (param_bytes, grad_bytes), (plain, distributed) in table.items():
        for d in (1, 2, 8, 64):
            assert M.model_state_bytes_per_param(param_bytes=param_bytes, grad_bytes=grad_bytes, data_parallel_size=d,
                                                 distributed_optimizer=False) == plain
            assert M.model_state_bytes_per_param(param_bytes=param_bytes, grad_bytes=grad_bytes, data_parallel_size=d,
                                                 distributed_optimizer=True) == pytest.approx(distributed(d))


def test_model_state_within_15_percent_of_the_zero_paper():
    """Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and Fig. 1: mixed-precision Adam holds 16 bytes per parameter,
    120 GB for 7.5B parameters with plain data parallelism and 31.4 GB with the optimizer state partitioned
    over 64 GPUs. Megatron's fp32 main grads add 2 bytes (135 GB, +12.5%); ZeRO's P_os is Megatron's
    distributed optimizer with 16-bit grads (31.9 GB, +1.5%)."""
    psi = 7.5e9
    assert M.model_state_bytes(psi) / 1e9 == pytest.approx(120, rel=0.15)
    partitioned = M.model_state_bytes(psi, param_bytes=2, grad_bytes=2, data_parallel_size=64,
                                      distributed_optimizer=True)
    assert partitioned / 1e9 == pytest.approx(31.4, rel=0.15)


# ----------------------------------------------------------------------------- activations


def test_layer_terms_are_the_tensors_the_layer_saves():
    """Hand-counted from the tensors autograd saves in one layer of the small CPU model (4 B, s = 1024, in
    MiB = s h 4 B): two fp32 norms of 2 x [s, h] + rstd each; the qkv and fc1 inputs; 4 cos/sin [s, d];
    SDPA's q (1), k (0.5), the fused qkv output (2), log-sum-exp; the proj input; fc1 out (2f), SiLU,
    x_linear + 0, product."""
    arch = _llama(**SMALL)
    terms = M.layer_saved_terms(arch, M.ActivationSetting(seq_len=1024, param_bytes=4))
    expected = {"norms": 2 * (2 + 1 / 256), "linear_inputs": 2, "rotary": 0.5, "attention": 1 + 0.5 + 2 + 1 / 32,
                "attention_output": 1, "mlp": 5 * 688 / 256}
    assert {k: v / MIB for k, v in terms.items()} == pytest.approx(expected)
    local = M.layer_saved_terms(arch, M.ActivationSetting(seq_len=1024, param_bytes=2, attention="local"))
    # q, k and v repeated to 8 heads, the fp32 softmax [8, s, s] and bf16 probabilities
    assert local["attention"] / MIB == pytest.approx(3 * 0.5 + 8 * 1024 * (4 + 2) / (256 * 4))
    full = M.layer_saved_terms(arch, M.ActivationSetting(seq_len=1024, param_bytes=2, recompute="full"))
    assert full == {"layer_input": 2 * 256 * 1024}


def test_sequence_parallelism_divides_all_but_the_rotary_tables_by_tp(llama70b):
    kw = dict(seq_len=9216, tensor_parallel_size=8, param_bytes=2)
    without = M.layer_saved_terms(llama70b, M.ActivationSetting(**kw))
    with_sp = M.layer_saved_terms(llama70b, M.ActivationSetting(**kw, sequence_parallel=True))
    assert with_sp["norms"] == without["norms"] / 8 and with_sp["linear_inputs"] == without["linear_inputs"] / 8
    for key in ("rotary", "attention", "attention_output", "mlp"):  # already split by heads / FFN (or not at all)
        assert with_sp[key] == without[key]


def test_sdpa_grows_linearly_and_local_attention_quadratically_with_the_sequence():
    arch = _llama(**LLAMA_1B)

    def peak(s, attention):
        st = M.ActivationSetting(seq_len=s, attention=attention)
        return M.stage_activations(arch, st, num_layers=16, in_flight=1, first_stage=True, last_stage=True,
                                   padded_vocab_size=arch.padded_vocab_size(1)).peak_bytes

    assert peak(4096, "sdpa") / peak(2048, "sdpa") == pytest.approx(2, rel=0.01)
    assert peak(4096, "local") / peak(2048, "local") > 3
    assert peak(4096, "sdpa") <= peak(4096, "local") / 2


def test_the_old_local_spec_matches_what_an_h100_measured():
    """DESIGN.md section 3, one H100, 1.24B Llama in bf16, local spec, TP=1, micro-batch 1: activations
    5.9 GiB at 1024 tokens, 17.9 at 2048; 4096 ran out of 79 GiB; model state 21.0 GiB."""
    arch = _llama(**LLAMA_1B)
    state = M.model_state_bytes(count_parameters(arch))
    assert state / GIB == pytest.approx(21.0, rel=0.03)
    for s, measured_gib in ((1024, 5.9), (2048, 17.9), (4096, None)):
        st = M.ActivationSetting(seq_len=s, attention="local")
        peak = M.stage_activations(arch, st, num_layers=16, in_flight=1, first_stage=True, last_stage=True,
                                   padded_vocab_size=arch.padded_vocab_size(1)).peak_bytes
        if measured_gib:
            assert peak / GIB == pytest.approx(measured_gib, rel=0.05)
        else:
            assert (peak + state) / GIB > 79


def test_full_recompute_keeps_layer_inputs_and_one_layer_at_a_time(llama70b):
    kw = dict(num_layers=20, in_flight=4, first_stage=True, last_stage=False, padded_vocab_size=129024)
    st = M.ActivationSetting(seq_len=9216, tensor_parallel_size=8, sequence_parallel=True)
    none = M.stage_activations(llama70b, st, **kw)
    full = M.stage_activations(llama70b, dataclasses.replace(st, recompute="full"), **kw)
    one_layer = sum(M.layer_saved_terms(llama70b, st).values())
    layer_input = 2 * 8192 * 9216 / 8
    # 4 micro-batches x (20 layer inputs + the stage output kept for the next stage + input ids and TP's mask),
    # then the rotary frequencies and sequence parallelism's all-gather buffer, once
    per_micro_batch = 21 * layer_input + 9 * 9216
    assert full.kept_bytes == pytest.approx(4 * per_micro_batch + 4 * 9216 * 128 + 2 * 8192 * 9216, rel=1e-9)
    assert full.working_bytes > one_layer and full.peak_bytes < none.peak_bytes / 10


def test_the_loss_counts_the_fp32_copies_our_cross_entropy_makes():
    st = M.ActivationSetting(seq_len=1000, param_bytes=2)
    padded = M.logits_working_bytes(st=st, vocab_size=500, padded_vocab_size=512, hidden_size=64)
    assert padded == 1000 * 512 * (2 + 4 + 4)  # bf16 logits, .float(), masked_fill (contiguous: a view at b = 1)
    unpadded_fp32 = M.logits_working_bytes(st=M.ActivationSetting(seq_len=1000, param_bytes=4), vocab_size=512,
                                           padded_vocab_size=512, hidden_size=64)
    assert unpadded_fp32 == 1000 * 512 * 4 + 4 * 64 * (1000 + 512)  # no copy: the backward through the head


# ----------------------------------------------------------------------------- Llama-3.3-70B on 8 x 8 H100


def test_llama70b_on_8x8_chooses_a_fitting_layout(llama70b):
    options = P.PlanOptions(**FLAGSHIP)
    chosen, alternatives = P.search_layouts(llama70b, nodes=8, gpus_per_node=8, options=options, model_name=LLAMA_70B)
    assert chosen.fits and chosen.peak_gib <= 80
    assert (chosen.tp, chosen.pp, chosen.dp) == (8, 4, 2)
    assert chosen.engines_per_node == 8 // chosen.engine_tp and chosen.layers_per_stage * chosen.pp == 80
    assert all(a.fits and a.tp * a.pp >= chosen.tp * chosen.pp for a in alternatives)
    smaller = [(t, p) for t, p in P.valid_layouts(llama70b, nodes=8, gpus_per_node=8) if t * p < chosen.tp * chosen.pp]
    for t, p in smaller:
        with pytest.raises(PlanError):  # too big, or sequence parallelism at TP=1
            P.require_fit(P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=t, pp=p, options=options))
    parts = {p.key: p for p in chosen.parts}
    assert parts["activations"].gib["training"] > 0 and parts["activations"].gib["rollout"] == 0
    assert parts["kv_cache"].gib["training"] == 0 and parts["kv_cache"].gib["rollout"] > 0
    for key in ("weights", "grads", "optimizer", "drafter_state"):  # resident in every phase
        assert parts[key].gib["training"] == parts[key].gib["rollout"] == parts[key].gib["sync"] > 0
    assert chosen.peak_gib == max(chosen.phase_gib(ph) for ph in P.PHASES)


def test_without_full_recompute_or_the_distributed_optimizer_70b_does_not_fit(llama70b):
    for change in (dict(recompute="none"), dict(recompute="selective"), dict(distributed_optimizer=False)):
        options = P.PlanOptions(**{**FLAGSHIP, **change})
        assert not P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=options).fits, change


def test_flagship_config_fits_as_the_slurm_script_plans_it(capsys):
    rc, out, err = run_main(capsys, "--config", "llama3_70b_8x8", "--nodes", "8", "--gpus-per-node", "8")
    assert rc == 0 and err == "", err
    assert "sized from launch/models/llama-3.3-70b/config.json" in out  # model.hf_dir is not on this machine
    assert "layout: TP=8 PP=4 DP=2" in out and "micro-batch 1 x 9216 tokens, bfloat16, attention=sdpa" in out
    assert "recompute=full, sequence parallel on, distributed optimizer on" in out
    assert "fits" in out and "note:" not in out and "assume" not in out
    for text in ("memory per GPU (GiB)", "policy weights (bfloat16)", "policy grads", "optimizer (fp32 master + Adam",
                 "activations kept", "working set at the peak", "vLLM weights", "vLLM KV cache", "EAGLE drafter",
                 "CUDA context", "total", "peak:", "how the phases share the GPU", "resident in every phase"):
        assert text in out, text


def test_flags_and_overrides_change_the_config_and_refusals_use_tlt_trains_words(capsys, tmp_path):
    base = ("--config", "llama3_70b_8x8", "--nodes", "8", "--gpus-per-node", "8")
    rc, out, err = run_main(capsys, *base, "--recompute", "none")
    assert rc == 2 and "recompute=none" in out and "activations kept" in err and err.count("\n") == 1
    rc, _, err = run_main(capsys, *base, "trainer.recompute=none")
    assert rc == 2 and "activations kept" in err
    rc, _, err = run_main(capsys, *base, "--tp", "1", "--pp", "8")
    assert rc == 2 and "parallel.sequence_parallel needs parallel.tensor_parallel_size > 1" in err
    rc, _, err = run_main(capsys, "--config", "llama3_70b_8x8", "--nodes", "4", "--gpus-per-node", "8")
    assert rc == 2 and "config needs tensor x pipeline x data parallel = 64" in err
    rc, out, _ = run_main(capsys, *base, "--pp", "8")  # DP follows a TP/PP flag, as the Slurm script's overrides do
    assert rc == 0 and "layout: TP=8 PP=8 DP=1" in out
    rc, _, err = run_main(capsys, *base, "trainer.recompte=full")
    assert rc == 2 and "unknown config key 'trainer.recompte'" in err
    hf_dir = tmp_path / "my-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({**SMALL, "architectures": ["LlamaForCausalLM"],
                                                    "model_type": "llama", "max_position_embeddings": 4096}))
    rc, out, _ = run_main(capsys, "--config", "tiny", "--nodes", "1", "--gpus-per-node", "2", f"model.hf_dir={hf_dir}")
    assert rc == 0 and "model: my-model" in out and "layout: TP=1 PP=1 DP=2" in out and "float32" in out
    rc, _, err = run_main(capsys, "--config", "tiny", "--nodes", "1", "--gpus-per-node", "2")
    assert rc == 2 and "model.hf_dir is None" in err


def test_main_without_a_config_searches_from_flags(capsys):
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--sequence-parallel",
                            "--recompute", "full", "--distributed-optimizer")
    assert rc == 0 and err == ""
    assert "layout: TP=8 PP=4 DP=2  (chosen" in out and "other layouts that fit" in out
    rc, _, err = run_main(capsys, "--nodes", "8", "--gpus-per-node", "8")
    assert rc == 2 and "--config" in err and "--model" in err
    rc, _, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "trainer.steps=3")
    assert rc == 2 and "overrides need --config" in err


def test_tp_3_is_refused_for_its_heads(capsys, llama70b):
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--tp", "3")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tlt plan: error: ")
    assert "num_attention_heads 64" in err and "3" in err
    with pytest.raises(PlanError, match="does not divide num_attention_heads 64"):
        P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=3, pp=1)


def test_pp_3_is_refused_for_its_layers(capsys, llama70b):
    rc, _, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--pp", "3")
    assert rc == 2 and "num_hidden_layers 80" in err and err.count("\n") == 1
    with pytest.raises(PlanError, match="pipeline parallel size 3 does not divide num_hidden_layers 80"):
        P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=3)


def test_a_layout_that_does_not_fit_is_refused_naming_the_biggest_part(capsys, llama70b):
    plan = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=1, pp=1)
    assert not plan.fits and plan.peak_gib > 80
    biggest = plan.biggest_part
    assert biggest.gib[plan.peak_phase] == max(p.gib[plan.peak_phase] for p in plan.parts)
    with pytest.raises(PlanError) as info:
        P.require_fit(plan)
    message = str(info.value)
    assert biggest.label in message and "80 GiB" in message
    rc, out, err = run_main(capsys, "--model", LLAMA_70B, "--nodes", "8", "--gpus-per-node", "8", "--tp", "1",
                            "--pp", "1")
    assert rc == 2 and err.count("\n") == 1 and biggest.label in err
    assert "DOES NOT FIT" in out  # the table that explains the refusal


def test_world_not_divisible_and_tp_across_nodes_are_refused(llama70b, qwen7b):
    with pytest.raises(PlanError, match="TP x PP = 16 does not divide the 24 GPUs"):
        P.plan_layout(llama70b, nodes=3, gpus_per_node=8, tp=8, pp=2)
    with pytest.raises(PlanError, match="within one node"):
        P.plan_layout(qwen7b, nodes=4, gpus_per_node=2, tp=4, pp=1)
    with pytest.raises(PlanError, match="span two nodes"):
        P.plan_layout(llama70b, nodes=2, gpus_per_node=6, tp=4, pp=1)


def test_no_fitting_layout_names_the_closest(llama70b):
    with pytest.raises(PlanError, match="no layout of 8 GPUs fits in 80 GiB; the closest: TP=8"):
        P.search_layouts(llama70b, nodes=1, gpus_per_node=8, options=P.PlanOptions(**FLAGSHIP))


def test_engine_without_room_for_a_kv_cache_is_refused(llama70b):
    options = P.PlanOptions(**{**FLAGSHIP, "gpu_memory_utilization": 0.2})
    plan = P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=options)
    assert plan.fits_memory and not plan.fits
    with pytest.raises(PlanError, match="gpu_memory_utilization"):
        P.require_fit(plan)


def test_options_move_the_estimate_the_right_way(llama70b):
    def plan(**change):
        return P.plan_layout(llama70b, nodes=8, gpus_per_node=8, tp=8, pp=4, options=P.PlanOptions(**{**FLAGSHIP,
                                                                                                       **change}))

    def part(p, key, phase="training"):
        return next(x for x in p.parts if x.key == key).gib[phase]

    base = plan()
    assert part(plan(distributed_optimizer=False), "optimizer") == pytest.approx(base.dp * part(base, "optimizer"))
    awake = plan(sleep_level=0)
    assert part(awake, "engine_weights") + part(awake, "kv_cache") == pytest.approx(0.35 * 80)
    assert part(base, "engine_weights") == part(base, "kv_cache") == 0
    activations = lambda p: part(p, "activations") + part(p, "working")  # noqa: E731
    assert activations(plan(recompute="none")) > 5 * activations(base)
    assert activations(plan(attention="local")) > activations(base)
    assert activations(plan(sequence_parallel=False)) > activations(base)
    assert part(plan(dtype="float32"), "weights") == 2 * part(base, "weights")
    assert not any(p.key.startswith("drafter") for p in plan(drafter=False).parts)


def test_tiny_model_fits_trivially(capsys, tmp_path):
    from tiny_models import TINY_LLAMA

    arch = architecture_from_dict(TINY_LLAMA)
    chosen, _ = P.search_layouts(arch, nodes=1, gpus_per_node=2, options=P.PlanOptions(seq_len=256))
    assert (chosen.tp, chosen.pp, chosen.dp) == (1, 1, 2)
    assert chosen.fits and chosen.phase_gib("training") < P.PlanOptions().overhead_gib + 0.1
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, out, _ = run_main(capsys, "--model", str(tmp_path / "config.json"), "--nodes", "1", "--gpus-per-node", "2",
                          "--seq-len", "256")
    assert rc == 0 and "layout: TP=1 PP=1 DP=2" in out
