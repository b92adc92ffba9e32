"""A rank's output with a log directory: everything in rank{N}.log, on the console only what a user watches
(``rank_logs.RankOutput``), and the step's console lines of ``tlt train`` (``rl/run/run_dir.py``)."""

import logging
import math
import os
import sys
import warnings

from megatron_tlt.rank_logs import (
    LAUNCHER_LOG,
    RankLogSettings,
    RankOutput,
    console,
    hold_import_records,
    launch_records_to_file,
    silence_known_harmless_records,
)
from megatron_tlt.rl.run.run_dir import eval_line, tlt_line


def test_the_log_holds_every_record_warning_and_raw_write_and_the_console_our_warnings_and_all_errors(
        tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")  # restored after the test: start() sets it to 0
    # As in a rank, where vLLM is imported after that: in this process an earlier test may have imported
    # it with its own handler on a logger that does not propagate.
    vllm_logger = logging.getLogger("vllm")
    for name, value in (("propagate", True), ("level", logging.NOTSET), ("handlers", []), ("disabled", False)):
        monkeypatch.setattr(vllm_logger, name, value)
    output = RankOutput(RankLogSettings(directory=str(tmp_path / "logs"), level=logging.WARNING), rank=1)
    output.start()
    try:
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
        logging.getLogger("vllm.engine").info("engine ready")
        logging.getLogger("vllm.engine").warning("a vllm warning")
        logging.getLogger("megatron_tlt.rl.inputs.data").warning("skipped bad prompt rows")
        logging.getLogger("vllm.engine").error("a vllm error")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecated call", FutureWarning)
        os.write(2, b"a C++ notice\n")  # what bypasses Python: straight to file descriptors 2 and 1
        os.write(1, b"a C printf\n")
        try:
            raise RuntimeError("injected")
        except RuntimeError:
            logging.getLogger("megatron_tlt.drafter.spot").exception("drafter training failed")
        print("a progress line", file=console())
    finally:
        output.stop()
    terminal = capfd.readouterr()
    log = (tmp_path / "logs" / "rank1.log").read_text()

    for text in ("INFO vllm.engine: engine ready", "WARNING vllm.engine: a vllm warning", "FutureWarning: a deprecated",
                 "a C++ notice", "a C printf", "skipped bad prompt rows", "ERROR vllm.engine: a vllm error",
                 "Traceback (most recent call last):"):
        assert text in log, text
    assert terminal.out == ""
    # a rank other than 0 blanks the terminal's line (where rank 0's bar may be) before each of its lines
    assert terminal.err.startswith("\r" + " " * 79 + "\r[rank1] WARNING: ")
    assert [line for line in terminal.err.splitlines() if line.strip()] == [
        "[rank1] WARNING: skipped bad prompt rows",
        "[rank1] ERROR: a vllm error",
        "[rank1] ERROR: drafter training failed: RuntimeError: injected",  # the traceback stays in the file
        "a progress line",
    ]
    assert console() is sys.stderr  # stop() gave the process its streams back


def test_what_torchs_launcher_logs_while_ranks_run_with_logs_goes_to_the_launcher_log_and_not_the_console(
        tmp_path, monkeypatch):
    import torch.distributed.launcher.api  # noqa: F401  torch's loggers, as the launching process has them
    import torch.multiprocessing.spawn  # noqa: F401

    class Console(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    # Every way a record reaches the terminal: torch's own handler on the "torch" logger (which does not
    # propagate), the root's handlers, and Python's last resort where a record finds no handler at all.
    console_seen = Console()
    monkeypatch.setattr(logging.getLogger("torch"), "handlers", [console_seen])
    monkeypatch.setattr(logging.getLogger(), "handlers", [console_seen])
    monkeypatch.setattr(logging, "lastResort", console_seen)
    # Where torch logs them (torch 2.13): a rank still alive after another failed, terminated by
    # torch/multiprocessing/spawn.py's process context, and the agent, whose module sets its logger's own level.
    spawn, agent = (logging.getLogger("torch.multiprocessing.spawn"),
                    logging.getLogger("torch.distributed.elastic.agent.server.api"))
    logs = tmp_path / "logs"
    with launch_records_to_file(RankLogSettings(directory=str(logs), level=logging.WARNING)):
        spawn.warning("Terminating process %s via signal SIGTERM", 4242)
        agent.error("worker group FAILED")
    with launch_records_to_file(RankLogSettings(directory=str(tmp_path / "verbose"), level=logging.INFO)):
        spawn.warning("Terminating process %s via signal SIGTERM", 4343)  # tlt -v: the console shows it
    spawn.warning("Terminating process %s via signal SIGTERM", 4444)  # after the launch: as torch had it

    launcher_log = (logs / LAUNCHER_LOG).read_text()
    assert "WARNING torch.multiprocessing.spawn: Terminating process 4242 via signal SIGTERM" in launcher_log
    assert "ERROR torch.distributed.elastic.agent.server.api: worker group FAILED" in launcher_log
    assert console_seen.lines == ["Terminating process 4343 via signal SIGTERM",
                                  "Terminating process 4444 via signal SIGTERM"]
    assert not (tmp_path / "verbose").exists()


def test_eval_and_tlt_lines_name_the_step_and_its_figures():
    assert eval_line(4, {"reward_mean": 0.5, "eval/greedy_accuracy": 0.4219, "eval/sampled_accuracy": 0.3}) == (
        "step 4: eval/greedy_accuracy 0.422, eval/sampled_accuracy 0.300")
    assert eval_line(3, {"reward_mean": 0.5}) is None
    plain = {"step": 2, "rollout_idle_seconds": [1.0, 0.0], "rollout_training_seconds": [0.0, 0.0]}
    assert tlt_line(plain) is None  # TLT off: no line
    record = {**plain, "spec/mean_acceptance_length": 1.84, "spec/acceptance_rate": 0.42,
              "rollout_training_seconds": [0.25, 0.0], "drafter/loss": 2.3125, "spec/acceptance_alarms": 0}
    assert tlt_line(record) == ("step 2 TLT: acceptance length 1.84 (42% of draft tokens), idle share trained 25%, "
                                "drafter loss 2.312")
    estimated = {**record, "spec/rollout_speedup_vs_depth0": 1.4567}
    assert tlt_line(estimated) == ("step 2 TLT: acceptance length 1.84 (42% of draft tokens), rollout ~1.46x its "
                                   "speed at depth 0 (estimated), idle share trained 25%, drafter loss 2.312")
    untrained = {**plain, "drafter/loss": math.nan, "spec/acceptance_alarms": 1}
    assert tlt_line(untrained) == "step 2 TLT: idle share trained 0%, drafter loss -, acceptance alarms 1"


def test_vllms_chat_template_warmup_in_an_engine_without_a_tokenizer_leaves_no_traceback_and_other_failures_do(
        tmp_path, monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    for name, value in (("propagate", True), ("level", logging.NOTSET), ("handlers", []), ("disabled", False)):
        monkeypatch.setattr(vllm_logger, name, value)
    renderer = logging.getLogger("vllm.renderers.base")
    monkeypatch.setattr(renderer, "filters", [])
    output = RankOutput(RankLogSettings(directory=str(tmp_path / "logs"), level=logging.WARNING), rank=0)
    output.start()
    try:
        # what vLLM 0.32's renderers/base.py warmup logs when LLM(..., skip_tokenizer_init=True) starts
        for err in (ValueError("Tokenizer not available when `skip_tokenizer_init=True`"),  # harmless: dropped
                    ValueError("chat template is not valid Jinja"),  # another failure of the same warm-up: kept
                    RuntimeError("Tokenizer not available when `skip_tokenizer_init=True`")):
            try:
                raise err
            except Exception:
                renderer.warning("Chat template warmup failed", exc_info=True)
        try:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        except ValueError:
            renderer.warning("Chat template warmup failed for another reason", exc_info=True)
        silence_known_harmless_records()  # again, as a rank run in place twice does: still one filter
    finally:
        output.stop()
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert log.count("Traceback (most recent call last):") == 3
    assert "ValueError: chat template is not valid Jinja" in log and "RuntimeError: Tokenizer not available" in log
    assert "ValueError: Tokenizer not available" in log and "for another reason" in log
    assert len(renderer.filters) == 1


def test_torchs_deprecation_notice_for_enums_torchao_registers_is_dropped_and_other_pytree_records_are_not(
        monkeypatch):
    pytree = logging.getLogger("torch.utils._pytree")
    monkeypatch.setattr(pytree, "filters", [])
    silence_known_harmless_records()
    notice = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
              "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error "
              "in a future release.")
    kept = [r for r in (logging.LogRecord(pytree.name, logging.WARNING, __file__, 1, message, None, None)
                        for message in (notice, "some other pytree warning")) if pytree.filter(r)]
    assert [r.getMessage() for r in kept] == ["some other pytree warning"]


# What a rank of `tlt warmup-drafter` printed on a 2-core machine before its ranks had logs (2026-11-29): the first
# five records as the fork server's imports log them (held for the ranks), the rest as the rank itself does.
_IMPORT_NOTICES = (
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", logging.INFO,
     "Using Megatron-FSDP without Transformer Engine."),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp", logging.INFO,
     "Detected Megatron Core, using Megatron-FSDP with Megatron."),
    ("torchao", logging.WARNING, "Failed to load /site-packages/torchao/_C_mxfp8.so: Could not load this library"),
    ("vllm.triton_utils.importing", logging.WARNING, "Triton is installed, but doesn't include CPU backend. "
     "Disabling Triton."),
    ("vllm.triton_utils.importing", logging.INFO, "Triton not installed or not compatible; certain GPU-related "
     "functions will not be available."),
)
_NUMA_NOTICE = (b"[rank0]:[W1129 06:10:01.468051007 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for "
                b"memory allocation on the NUMA nodes (0). (function init_cpu_memory_env)\n")


def _start_up_of_a_rank(tmp_path, monkeypatch, directory):
    """A rank's start-up as the fork server and the rank log it, through ``RankOutput`` at the console's default
    level; returns the rank's log (or None without a directory)."""
    vllm_logger = logging.getLogger("vllm")  # as in a rank, where vLLM is imported after RankOutput.start
    for name, value in (("propagate", True), ("level", logging.NOTSET), ("handlers", []), ("disabled", False)):
        monkeypatch.setattr(vllm_logger, name, value)
    root = logging.getLogger()
    saved_level = root.level
    hold_import_records()  # what preload_logging does in the fork server
    output = None
    try:
        for name, level, message in _IMPORT_NOTICES:
            logging.getLogger(name).log(level, message)
        output = RankOutput(RankLogSettings(directory=directory, level=logging.WARNING), rank=0)
        output.start()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
                          "instead", FutureWarning)
        os.write(2, _NUMA_NOTICE)
        logging.getLogger("megatron_tlt.commands.warmup_drafter").warning(
            "the dataset has 18 prompts to train on, fewer than the 512 asked for")
        logging.getLogger("vllm.engine").error("an engine error")
    finally:
        if output is not None:
            output.stop()
        else:  # hold_import_records' handler, had start() not taken it
            from megatron_tlt import rank_logs

            rank_logs._take_held_records()
        root.setLevel(saved_level)
        logging.captureWarnings(False)
    return (tmp_path / "logs" / "rank0.log").read_text() if directory is not None else None


def test_the_start_up_notices_of_megatron_fsdp_torchao_triton_torch_and_numa_stay_in_the_rank_log(
        tmp_path, capfd, monkeypatch):
    """`tlt train` and `tlt warmup-drafter` (the cold start included) run their ranks with logs: other libraries'
    start-up page goes to the rank's log, and the console keeps our own warnings and everyone's errors."""
    log = _start_up_of_a_rank(tmp_path, monkeypatch, str(tmp_path / "logs"))
    console_lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert console_lines == ["[rank0] WARNING: the dataset has 18 prompts to train on, fewer than the 512 asked for",
                             "[rank0] ERROR: an engine error"]
    for _, _, message in _IMPORT_NOTICES:
        assert message in log, message
    assert "FutureWarning: `torch.distributed.reduce_op` is deprecated" in log and "NUMA binding" in log


def test_without_a_log_directory_the_fork_servers_info_records_stay_below_the_consoles_level(
        tmp_path, capfd, monkeypatch):
    """A command without rank logs shows records at the launching process's level (WARNING): the held INFO records
    of the fork server's imports (Megatron-FSDP's) used to be replayed onto it all the same."""
    _start_up_of_a_rank(tmp_path, monkeypatch, None)
    terminal = capfd.readouterr().err
    assert "Detected Megatron Core" not in terminal and "Megatron-FSDP" not in terminal
    assert "Triton is installed, but doesn't include CPU backend" in terminal  # a WARNING: at the console's level
    assert "fewer than the 512 asked for" in terminal and "an engine error" in terminal
