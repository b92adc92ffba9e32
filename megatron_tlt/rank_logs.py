"""Where a rank's output goes: all of it into a log file, and to the console only what a user watches.

With a log directory (``tlt train``: ``RUN_DIR/logs``) each rank appends everything to ``rank{N}.log``:
its Python log records at INFO and above (vLLM's too: ``VLLM_CONFIGURE_LOGGING=0`` leaves its loggers
propagating to ours instead of printing on their own), Python warnings (``logging.captureWarnings``),
and, through its stdout and stderr file descriptors, what never passes through Python logging (C++
warnings such as the NUMA binding notice, prints, libraries' progress bars). The console (``console()``)
keeps rank 0's progress bar and report lines, every rank's ERROR records and our own warnings, one line
each; a traceback goes to the file only. ``tlt -v`` leaves the descriptors alone and shows every record
at INFO on the console, as well as in the file. Records of dependencies known to be no concern of the run
(``_KNOWN_HARMLESS_RECORDS``: vLLM's chat-renderer warm-up traceback in an engine without a tokenizer, torch's
deprecation notices for enums torchao registers as it is imported) go nowhere.

The launching process runs torch's elastic agent, which logs too: while its ranks run with a log directory
(and without ``tlt -v``) those records go to ``launcher.log`` beside the ranks' logs (``launch_records_to_file``).

Without a log directory (the commands that have no run directory) the console shows the records at the
launching process's level, as it always did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_VERBOSE_FORMAT = "%(asctime)s [rank{rank}] %(name)s: %(message)s"  # the console's format before rank logs
_FILE_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"
_CONSOLE_FORMAT = "[rank{rank}] %(levelname)s: %(message)s"
_LAUNCHER_FORMAT = "%(asctime)s [launcher] %(levelname)s %(name)s: %(message)s"
_OWN_LOGGERS = "megatron_tlt"
LAUNCHER_LOG = "launcher.log"


@dataclasses.dataclass(frozen=True)
class RankLogSettings:
    """What the launching process decides about its ranks' output (travels to each rank)."""

    directory: str | None
    """Where each rank writes rank{N}.log; None: no files, the console shows records at ``level``."""
    level: int
    """The launching process's logging level: INFO under ``tlt -v``, which also keeps the full console."""

    @property
    def verbose(self) -> bool:
        return self.level <= logging.INFO


def log_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.log"


# ---------------------------------------------------------------- records of the fork server's imports

_held_records: logging.handlers.MemoryHandler | None = None


def hold_import_records() -> None:
    """Keep in memory, instead of printing them, the records and warnings of the imports that follow.

    Called by the CPU fork server before it imports vLLM and Megatron (``preload_logging.py``): what those
    imports say (vLLM: "Triton is installed, but doesn't include CPU backend") reaches each rank's log
    (``RankOutput.start``) rather than the launching terminal, where no rank's log stands around it.
    """
    global _held_records
    silence_known_harmless_records()  # torch's own handlers print some of them straight to the terminal
    root = logging.getLogger()
    # No target: a MemoryHandler without one never empties its buffer; the ranks read it.
    _held_records = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
    root.addHandler(_held_records)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def _take_held_records() -> list[logging.LogRecord]:
    global _held_records
    if _held_records is None:
        return []
    logging.getLogger().removeHandler(_held_records)
    records, _held_records = list(_held_records.buffer), None
    return records


# ---------------------------------------------------------------- the console

_console: TextIO | None = None


def console() -> TextIO:
    """The stream for rank 0's progress bar and report lines: the terminal, also while the rank's stdout
    and stderr go to its log file."""
    return _console if _console is not None else sys.stderr


class _ConsoleFilter(logging.Filter):
    """Our warnings and everyone's errors: third-party warnings (vLLM's, torch's) are about settings that
    do not apply here, and stay in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == _OWN_LOGGERS or record.name.startswith(_OWN_LOGGERS + ".")
        return record.levelno >= (logging.WARNING if own else logging.ERROR)


class _OneLineFormatter(logging.Formatter):
    """A record with an exception as one line: the exception's type and message (the traceback is in
    the log file)."""

    def format(self, record: logging.LogRecord) -> str:
        err = record.exc_info[1] if record.exc_info else None
        line = super().format(logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                                     "stack_info": None}))
        return f"{line}: {type(err).__name__}: {err}" if err is not None else line


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):  # not a terminal: the line starts after a carriage return all the same
        return 80


class _ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm, which clears this process's progress bar first and redraws it after. Another
    rank's bar (rank 0's) it cannot know of: a rank without one blanks the terminal's line first, so that
    its line does not run on from the end of the bar."""

    def __init__(self, stream: TextIO, *, blank_line_first: bool):
        super().__init__(stream)
        self.blank_line_first = blank_line_first

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            line = self.format(record)
            if self.blank_line_first:
                line = "\r" + " " * (_columns(self.stream) - 1) + "\r" + line
            tqdm.write(line, file=self.stream)
        except Exception:
            self.handleError(record)


# ---------------------------------------------------------------- dependencies' harmless tracebacks

@dataclasses.dataclass(frozen=True)
class _KnownHarmlessRecord:
    """A dependency's log record that is no concern of the run: dropped where it matches in full (logger,
    message, and the exception's type and text where it carries one), so that anything else still shows."""

    logger: str
    message: str
    """The whole message, or with ``message_is_suffix`` its end."""
    exception: type[BaseException] | None = None
    exception_text: str = ""
    message_is_suffix: bool = False

    def matches(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name != self.logger or not (message.endswith(self.message) if self.message_is_suffix
                                              else message == self.message):
            return False
        err = record.exc_info[1] if record.exc_info else None
        if self.exception is None:
            return err is None
        return isinstance(err, self.exception) and self.exception_text in str(err)


_KNOWN_HARMLESS_RECORDS = (
    # LLM() warms up its chat renderer (vLLM 0.32: entrypoints/llm.py -> renderers/base.py ``warmup``) even in an
    # engine started without a tokenizer, as the rollout engines are (token ids in and out); no LLM argument skips it.
    _KnownHarmlessRecord(logger="vllm.renderers.base", message="Chat template warmup failed", exception=ValueError,
                         exception_text="Tokenizer not available when `skip_tokenizer_init=True`"),
    # vLLM imports torchao where it is installed (the FP8 drafter's backend); torchao registers its enums with
    # torch's pytree, which torch 2.13 calls deprecated, once per enum, at import.
    _KnownHarmlessRecord(logger="torch.utils._pytree", message_is_suffix=True,
                         message="is an Enum subclass and is now natively supported by torch.compile as an opaque "
                                 "value type. Calling register_constant() on Enum subclasses is deprecated and will "
                                 "be an error in a future release."),
)


class _HarmlessRecordFilter(logging.Filter):
    """Drops the ``_KNOWN_HARMLESS_RECORDS`` of one logger; set on that logger, so it holds whichever handlers
    (ours, vLLM's own) print its records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(known.matches(record) for known in _KNOWN_HARMLESS_RECORDS)


def silence_known_harmless_records() -> None:
    """Filter the ``_KNOWN_HARMLESS_RECORDS`` in this process (idempotent). Each rank does at its start."""
    for name in {known.logger for known in _KNOWN_HARMLESS_RECORDS}:
        named = logging.getLogger(name)
        if not any(isinstance(f, _HarmlessRecordFilter) for f in named.filters):
            named.addFilter(_HarmlessRecordFilter())


# ---------------------------------------------------------------- the launching process's torch records

_LAUNCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
"""torch's launch machinery, run by the launching process: the elastic agent, which logs a failed rank's error (its
rank log holds it, with the traceback), and torch.multiprocessing's process context, which after a rank fails
names each other rank it still finds alive ("Terminating process N via signal SIGTERM"): whether it finds one is a
matter of timing, so a line the console shows only on a slow machine."""


@contextlib.contextmanager
def launch_records_to_file(settings: RankLogSettings) -> Iterator[None]:
    """While ranks run with a log directory and without ``tlt -v``, what torch's launch machinery logs in this
    process goes to ``launcher.log`` in that directory (created at its first record), never to the console.

    The records stop at the ``_LAUNCH_LOGGERS`` (propagation off) whatever level torch's modules set on their
    own loggers: torch's own handler, on the ``torch`` logger above them, prints to stderr."""
    if settings.directory is None or settings.verbose:
        yield
        return
    path = Path(settings.directory) / LAUNCHER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter(_LAUNCHER_FORMAT))
    saved = [(logger, logger.propagate) for logger in map(logging.getLogger, _LAUNCH_LOGGERS)]
    for logger, _ in saved:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


# ---------------------------------------------------------------- a rank's output

class RankOutput:
    """One rank's logging and standard streams, as ``RankLogSettings`` asks; ``start`` then ``stop``
    (a launched rank never stops: what it prints until it exits belongs to its log)."""

    def __init__(self, settings: RankLogSettings, rank: int):
        self.settings, self.rank = settings, rank
        self.path = log_path(settings.directory, rank) if settings.directory is not None else None
        self._file_handler: logging.Handler | None = None
        self._handlers: list[logging.Handler] = []
        self._saved_root: tuple[int, list[logging.Handler]] | None = None
        self._saved_fds: tuple[int, int] | None = None

    def start(self) -> None:
        global _console
        root = logging.getLogger()
        held = _take_held_records()
        silence_known_harmless_records()
        self._saved_root = (root.level, root.handlers[:])
        for handler in self._saved_root[1]:
            root.removeHandler(handler)
        logging.captureWarnings(True)
        if self.path is None:
            console_handler = logging.StreamHandler(sys.stderr)
            console_handler.setFormatter(logging.Formatter(_VERBOSE_FORMAT.format(rank=self.rank)))
            root.setLevel(self.settings.level)
            self._handlers = [console_handler]
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # read when an engine starts, after this
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file_handler = logging.FileHandler(self.path, mode="a", encoding="utf-8")
            self._file_handler.setFormatter(logging.Formatter(_FILE_FORMAT.format(rank=self.rank)))
            root.setLevel(min(self.settings.level, logging.INFO))
            if self.settings.verbose:
                console_handler = logging.StreamHandler(sys.stderr)
                console_handler.setFormatter(logging.Formatter(_VERBOSE_FORMAT.format(rank=self.rank)))
            else:
                _console = self._redirect_std_streams()
                console_handler = _ConsoleHandler(_console, blank_line_first=self.rank != 0)
                console_handler.addFilter(_ConsoleFilter())
                console_handler.setFormatter(_OneLineFormatter(_CONSOLE_FORMAT.format(rank=self.rank)))
            self._handlers = [self._file_handler, console_handler]
        for handler in self._handlers:
            root.addHandler(handler)
        if self.path is not None:
            logging.getLogger(__name__).info("rank %d started (pid %d)%s", self.rank, os.getpid(),
                                             "; what its imports logged before it forked follows" if held else "")
        self._replay(held)

    def _redirect_std_streams(self) -> TextIO:
        """Point file descriptors 1 and 2 at the log file (appending, beside the FileHandler); returns a
        stream on the terminal they pointed at. torch's elastic ``redirects`` would truncate the file
        and need one file per stream."""
        terminal = os.dup(2)
        self._saved_fds = (os.dup(1), os.dup(2))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        log = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)  # prints in order with the records around them
        return os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",
                         errors="backslashreplace")

    def _replay(self, held: list[logging.LogRecord]) -> None:
        """The fork server's records, alike in every rank: into every rank's file, to the console once. Without a
        log directory only those at the console's level (``Logger.handle`` itself checks no level: the INFO
        records of Megatron-FSDP's import reached the console of ``tlt warmup-drafter``)."""
        root = logging.getLogger()
        for record in held:
            if self.rank == 0 and record.levelno >= root.getEffectiveLevel():
                root.handle(record)
            elif self._file_handler is not None and record.levelno >= logging.INFO:
                self._file_handler.handle(record)

    def log_failure(self) -> None:
        """The exception being handled, with its traceback, into the rank log only (the launching process
        reports it on the console, naming the file). Without a log there is nothing to add: the launching
        process reports it."""
        if self._file_handler is None:
            return
        record = logging.getLogger(__name__).makeRecord(
            __name__, logging.ERROR, __file__, 0, "rank %d failed", (self.rank,), sys.exc_info())
        self._file_handler.handle(record)

    def stop(self) -> None:
        """Back to the output the process had before ``start`` (a rank run in place, under torchrun)."""
        global _console
        root = logging.getLogger()
        for handler in self._handlers:
            root.removeHandler(handler)
            handler.close()
        if self._saved_fds is not None:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            for fd, saved in zip((1, 2), self._saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            self._saved_fds = None
        if _console is not None:
            _console.close()
            _console = None
        if self._saved_root is not None:
            level, handlers = self._saved_root
            root.setLevel(level)
            for handler in handlers:
                root.addHandler(handler)
        logging.captureWarnings(False)
