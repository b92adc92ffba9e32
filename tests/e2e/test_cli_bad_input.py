"""`tlt` on bad input: one 'tlt: error:' line naming the problem, exit 2, nothing in --out.

Every refusal comes before any rank starts, so they run in this process through the entry point's
``cli.main`` (the ``tlt_in_process`` fixture); the round trip at the end runs the installed `tlt` command as a
user does."""

import json
import shutil
import subprocess

import pytest
from hang_guard import HANG_GUARD_S

from tiny_models import TINY_LLAMA


def _assert_clean_failure(result, out_dir, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tlt: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert not out_dir.exists()
    assert not list(out_dir.parent.glob(f".{out_dir.name}.partial-*"))


@pytest.fixture
def llama_copy(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "llama")


@pytest.mark.parametrize(
    "tp, pp, fragments",
    [
        ("3", "1", ("tensor parallel size 3", "num_attention_heads 8")),
        ("8", "1", ("tensor parallel size 8", "num_key_value_heads 4")),
        ("1", "5", ("pipeline parallel size 5", "larger than num_hidden_layers 4")),
    ],
    ids=["tp-not-dividing-heads", "tp-not-dividing-kv-heads", "pp-larger-than-layers"],
)
def test_impossible_layout_is_refused(tlt_in_process, tp, pp, fragments, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    result = tlt_in_process("convert", "hf-to-mcore", "--hf", tiny_llama_dir, "--out", out, "--tp", tp, "--pp", pp)
    _assert_clean_failure(result, out, *fragments)


def test_missing_safetensors_shard_is_named(tlt_in_process, tiny_qwen2_dir, tmp_path):
    model = shutil.copytree(tiny_qwen2_dir, tmp_path / "qwen2")
    victim = sorted(model.glob("model-*.safetensors"))[1]
    victim.unlink()
    out = tmp_path / "out"
    result = tlt_in_process("convert", "hf-to-mcore", "--hf", str(model), "--out", str(out))
    _assert_clean_failure(result, out, victim.name, "missing")


def test_truncated_safetensors_file_is_named(tlt_in_process, llama_copy, tmp_path):
    weights_file = llama_copy / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    result = tlt_in_process("convert", "hf-to-mcore", "--hf", str(llama_copy), "--out", str(out), "--tp", "2")
    _assert_clean_failure(result, out, "model.safetensors", "truncated")


def test_unsupported_architecture_is_named(tlt_in_process, llama_copy, tmp_path):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = tlt_in_process("convert", "hf-to-mcore", "--hf", str(llama_copy), "--out", str(out))
    _assert_clean_failure(result, out, "unsupported architecture", "MistralForCausalLM")


def test_missing_megatron_checkpoint_is_named(tlt_in_process, tmp_path):
    out = tmp_path / "out"
    result = tlt_in_process("convert", "mcore-to-hf", "--ckpt", str(tmp_path / "nowhere"), "--out", str(out))
    _assert_clean_failure(result, out, "not a megatron-tlt checkpoint")


def test_existing_output_directory_is_never_overwritten(tlt_in_process, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = tlt_in_process("convert", "hf-to-mcore", "--hf", str(tiny_llama_dir), "--out", str(out))
    assert result.returncode == 2 and "already exists" in result.stderr
    assert (out / "precious.txt").read_text() == "keep me"


def _tlt_command(*args):
    return subprocess.run(["tlt", *args], capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_cli_conversion_round_trip_succeeds(tiny_llama_dir, tmp_path):
    """The commands' wiring, through the installed `tlt` entry point as a user runs it; the sharded layouts are
    checked bit for bit in dist/test_checkpoint_round_trip (here TP2 only: a TP2 x PP2 conversion starts 4 ranks
    on a 2-core machine for no more coverage)."""
    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    first = _tlt_command("convert", "hf-to-mcore", "--hf", str(tiny_llama_dir), "--out", str(ckpt), "--tp", "2")
    assert first.returncode == 0, first.stderr
    second = _tlt_command("convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back))
    assert second.returncode == 0, second.stderr
    assert json.loads((ckpt / "tlt_checkpoint.json").read_text())["saved_tensor_parallel_size"] == 2
    assert (back / "model.safetensors").is_file() and (back / "config.json").is_file()
    assert json.loads((back / "config.json").read_text())["num_key_value_heads"] == TINY_LLAMA["num_key_value_heads"]


# ----------------------------------------------------------------------------- tlt train

def _assert_one_error_line(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tlt: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_train_unknown_config_key_names_the_nearest_valid_keys(tlt_in_process, tmp_path):
    result = tlt_in_process("train", "trainer.stepz=3", f"trainer.run_dir={tmp_path / 'run'}")
    _assert_one_error_line(result, "unknown config key 'trainer.stepz'", "trainer.steps")
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_run_dir_that_holds_a_run(tlt_in_process, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer: {steps: 1}\n")
    result = tlt_in_process("train", f"trainer.run_dir={run_dir}")
    _assert_one_error_line(result, "already holds a run", "--resume")


def test_train_resume_needs_a_run_with_a_checkpoint(tlt_in_process, tmp_path):
    _assert_one_error_line(tlt_in_process("train", "--resume", str(tmp_path)), "not a run directory")
    (tmp_path / "config.yaml").write_text("trainer: {steps: 1}\n")
    _assert_one_error_line(tlt_in_process("train", "--resume", str(tmp_path)), "no complete checkpoint")


def test_train_impossible_layout_is_refused_before_any_rank_starts(tlt_in_process, tmp_path):
    result = tlt_in_process("train", "trainer.prompts_per_step=5", f"trainer.run_dir={tmp_path / 'run'}")
    _assert_one_error_line(result, "prompts_per_step 5 is not divisible by parallel.data_parallel_size 2")


def test_train_tensor_parallel_not_dividing_heads_is_refused(tlt_in_process, tmp_path):
    result = tlt_in_process("train", "parallel.tensor_parallel_size=3", "parallel.data_parallel_size=1",
                            "trainer.prompts_per_step=3", f"trainer.run_dir={tmp_path / 'run'}")
    _assert_one_error_line(result, "tensor parallel size 3 does not divide num_attention_heads 2")
    assert not (tmp_path / "run").exists()


def test_export_drafter_refuses_what_is_not_a_drafter_or_a_run(tlt_in_process, tmp_path):
    out = tmp_path / "out"
    result = tlt_in_process("export-drafter", "--ckpt", tmp_path / "missing", "--out", out)
    _assert_clean_failure(result, out, "neither a drafter directory", "nor a run with drafter checkpoints")


def test_plan_refuses_an_impossible_layout_through_the_cli(tlt_in_process):
    result = tlt_in_process("plan", "--model", "llama-3.3-70b", "--nodes", "8", "--gpus-per-node", "8", "--tp", "3")
    assert result.returncode == 2 and "tlt plan: error: TP=3 refused" in result.stderr
    assert "does not divide num_attention_heads 64" in result.stderr
