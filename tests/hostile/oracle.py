"""The oracle: run one target on one input and classify what happened.

- ``ok``: the call returned (the CLI exited 0);
- ``error``: the library refused with its own :class:`ckptfmt.CheckpointError` (the CLI exited 1 or 2 with a
  message and no traceback);
- ``violation``, with a reason: any other exception escaped the API (its type, message, and the innermost frame
  of ckptfmt/cli it escaped from), the CLI crashed or exited with another code or printed a traceback, the input
  used more CPU time than the time bound (or ran ``WALL_FACTOR`` bounds on the clock), the Python heap grew more
  than the memory bound (tracemalloc peak; numpy's allocations are traced), something outside the checkpoint root
  or destination was read, written or deleted (see :mod:`.sentinel`), or the process was tampered with (a class
  the DCP unpickler admits changed).

The bound is on the process's CPU time: on CI's 2 cores, shared with multi-process tests, an input that took
1 s alone took 6.9 s on the clock, and failed a wall-clock bound without having done anything wrong. A SIGALRM
watchdog, at ``WALL_FACTOR`` bounds, interrupts a hang in the main thread that uses no CPU (a blocking ``open``
of a FIFO, a sleep) by raising :class:`Timeout`; a watchdog thread unblocks FIFOs if that does not help. While
fuzzing, the process's address space is capped a few GiB above what it uses, so an astronomically large
allocation fails (and is reported) instead of taking the machine's memory.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import ckptfmt

from .sentinel import Sandbox

TIME_BOUND_S = float(os.environ.get("CKPTFMT_FUZZ_TIME_BOUND", "5"))  # CPU-seconds per input
WALL_FACTOR = 4  # the watchdog's wall-clock limit, in time bounds
MEMORY_BOUND = 64 << 20
ADDRESS_SPACE_HEADROOM = 6 << 30

Status = Literal["ok", "error", "violation"]


class Timeout(BaseException):
    """Raised in the main thread by the watchdog: a BaseException, so no ``except Exception`` swallows it."""


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str = ""  # the violation's kind: "exception", "cli", "time", "memory", "sandbox", "tamper"
    detail: str = ""  # exception type and message, where it escaped, what was touched
    seconds: float = 0.0
    peak_bytes: int = 0

    @property
    def signature(self) -> str:
        """What identifies one defect across inputs: the reason, and the exception type and the place it escaped."""
        parts = self.detail.split(" | ")
        where = next((p for p in parts if p.startswith("at ")), "")
        if where:
            head = parts[0].split(": ")
            kind = ": ".join(head[:2]) if head[0] == "traceback" else head[0]
            return f"{self.reason}: {kind} {re.sub(r':[0-9]+ in ', ' in ', where)}"  # line numbers move
        return f"{self.reason}: " + re.sub(r"\d+(\.\d+)?", "N", parts[0])[:90]


def escaped_from(exc: BaseException) -> str:
    """The innermost frame of the library or CLI in the exception's traceback: where it escaped."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/ckptfmt/" in f.filename or "/cli/" in f.filename]
    if not (ours or frames):
        return "?"
    frame = (ours or frames)[-1]
    return f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"


def describe_exception(exc: BaseException) -> str:
    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {message} | at {escaped_from(exc)}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def printed_traceback(text: str) -> str:
    """A printed traceback (a subprocess's stderr) described as describe_exception describes a live one."""
    frames = _FRAME.findall(text)
    ours = [f for f in frames if "/ckptfmt/" in f[0] or "/cli/" in f[0]] or frames
    where = f"{os.path.relpath(ours[-1][0])}:{ours[-1][1]} in {ours[-1][2]}" if ours else "?"
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    last = lines[-1] if lines else "?"
    kind, _, message = last.partition(": ")
    if "." not in kind:
        kind = f"builtins.{kind}"
    return f"{kind}: {message[:200]} | at {where}"


# ---------------------------------------------------------------- watchdog and bounds


def _on_alarm(signum: int, frame: Any) -> None:
    raise Timeout()


@contextlib.contextmanager
def watchdog(seconds: float, sandbox: Sandbox | None) -> Iterator[None]:
    """Raise Timeout in the main thread after ``seconds``; after three times that, unblock the sandbox's FIFOs."""
    in_main = threading.current_thread() is threading.main_thread()
    installed = in_main and signal.getsignal(signal.SIGALRM) is _on_alarm  # fuzzing() installed it
    previous = signal.signal(signal.SIGALRM, _on_alarm) if in_main and not installed else None
    done = threading.Event()
    helper = None
    if sandbox is not None and sandbox.fifos:

        def rescue() -> None:
            while not done.wait(seconds * 3):
                sandbox.unblock_fifos()

        helper = threading.Thread(target=rescue, daemon=True)
        helper.start()
    if in_main:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if in_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if not installed:
                signal.signal(signal.SIGALRM, previous)
        done.set()


class PeakRss:
    """The process's resident-set high-water mark, reset before each example through /proc/self/clear_refs ("5"
    resets it) and read with getrusage: a few microseconds, and it sees the C allocations tracemalloc does not
    (msgpack, safetensors, zstd, torch)."""

    def __init__(self) -> None:
        try:
            self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
        except OSError:
            self._clear = -1

    def reset(self) -> int:
        if self._clear >= 0:
            try:
                os.write(self._clear, b"5")
            except OSError:
                self._clear = -1
        return self.peak()

    def peak(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if self._clear >= 0 else 0


_RSS: PeakRss | None = None


def _vm_size() -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


_WARM = False
WARM_MODULES = (
    "click.testing",
    "torch",
    "torch.distributed.checkpoint",
    "ckptfmt.cli",
    "ckptfmt.convert.dcp",
    "ckptfmt.convert.hf",
    "ckptfmt.convert.torch_pt",
    "ckptfmt.torch",
)


def warm_up() -> None:
    """Import what the targets import lazily, once, before any watchdog runs: a first ``import torch`` takes
    seconds, and a Timeout raised in the middle of it leaves torch half-initialized for the rest of the process."""
    global _WARM
    if _WARM:
        return
    import importlib

    for module in WARM_MODULES:
        importlib.import_module(module)
    _WARM = True


@contextlib.contextmanager
def fuzzing() -> Iterator[None]:
    """The process-wide setting of a fuzz run: the address space capped a few GiB above what is in use, and the
    watchdog's SIGALRM handler installed once (not per example)."""
    warm_up()
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if in_main else None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        if in_main:
            signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- process tampering


def _admitted_classes() -> list[Any]:
    from ckptfmt.convert.dcp_metadata import ALLOWED

    out = []
    for module, names in ALLOWED.items():
        try:
            mod = __import__(module, fromlist=["_"])
        except ImportError:
            continue
        out += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return out


def class_state() -> dict[str, dict[str, int]]:
    """id() of every attribute of every class the DCP unpickler admits: a change means the process was tampered with."""
    out = {}
    for cls in _admitted_classes():
        try:
            attrs = vars(cls)
        except TypeError:
            continue
        out[f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"] = {
            k: id(v) for k, v in attrs.items()
        }
    return out


def tamper_problems(before: dict[str, dict[str, int]]) -> list[str]:
    after = class_state()
    out = []
    for name, attrs in after.items():
        old = before.get(name, {})
        changed = sorted(k for k in set(attrs) | set(old) if attrs.get(k) != old.get(k))
        if changed:
            out.append(f"{name} attributes changed: {', '.join(changed)}")
    return out


def restore_classes(before: dict[str, dict[str, int]], saved: dict[str, dict[str, Any]]) -> None:
    """Undo a tampering, so one violation does not leak into every later example."""
    for cls in _admitted_classes():
        name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"
        if name not in saved:
            continue
        for key in list(vars(cls)):
            if key not in saved[name]:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(cls, key)
        for key, value in saved[name].items():
            if vars(cls).get(key) is not value:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(cls, key, value)


def saved_classes() -> dict[str, dict[str, Any]]:
    out = {}
    for cls in _admitted_classes():
        with contextlib.suppress(TypeError):
            out[f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"] = dict(vars(cls))
    return out


# ---------------------------------------------------------------- running one example


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None


def judge_cli(result: CliResult) -> tuple[Status, str, str]:
    """(status, reason, detail) of one CLI run: exit 0 ok, 1 or 2 with a clean message an error, else a violation."""
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        return "violation", "cli", "traceback: " + describe_exception(exc)
    text = result.stdout + result.stderr
    if "Traceback (most recent call last)" in text:
        return "violation", "cli", "traceback: " + printed_traceback(text[text.index("Traceback") :])
    if result.exit_code not in (0, 1, 2):
        return "violation", "cli", f"exit code {result.exit_code}: {result.stderr[-200:]!r}"
    if result.exit_code == 0:
        return "ok", "", ""
    if not (result.stderr.strip() or result.stdout.strip()):
        return "violation", "cli", f"exit {result.exit_code} with no message at all"
    return "error", "", ""


def run_one(
    call: Callable[[], CliResult | None],
    *,
    sandbox: Sandbox | None = None,
    time_bound: float = TIME_BOUND_S,
    memory_bound: int = MEMORY_BOUND,
    check_tamper: bool = False,
    trace: bool = True,
) -> Outcome:
    """Run ``call`` under the oracle. ``call`` returns a CliResult for CLI targets, None for API targets.

    Memory is the larger of the resident-set growth (always) and the tracemalloc peak (when ``trace``: tracing makes
    pure-Python parsing about seven times slower, so the cheap parser targets trace a sample of their examples).
    """
    global _RSS
    if _RSS is None:
        _RSS = PeakRss()
    rss_base = _RSS.reset()
    before = class_state() if check_tamper else {}
    saved = saved_classes() if check_tamper else {}
    # Traced only while the target runs: making the input is the harness's business, and tracing it costs.
    tracing = trace and not tracemalloc.is_tracing()
    if tracing:
        tracemalloc.start(1)
    status: Status = "ok"
    reason = detail = ""
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        with contextlib.ExitStack() as stack:
            if sandbox is not None:
                stack.enter_context(sandbox)
            stack.enter_context(watchdog(time_bound * WALL_FACTOR, sandbox))
            result = call()
        if result is not None:
            status, reason, detail = judge_cli(result)
    except Timeout:
        status, reason, detail = "violation", "time", f"still running after {time_bound * WALL_FACTOR:g} s"
    except ckptfmt.CheckpointError:
        status = "error"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        status, reason, detail = "violation", "exception", describe_exception(exc)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = tracemalloc.get_traced_memory()[1] if tracing else 0
    if tracing:
        tracemalloc.stop()
    peak = max(peak, _RSS.peak() - rss_base)
    extra: list[tuple[str, str]] = []
    if cpu > time_bound and reason != "time":
        extra.append(("time", f"used {cpu:.2f} CPU-s in {seconds:.2f} s (bound {time_bound:g} CPU-s)"))
    if peak > memory_bound:
        extra.append(
            ("memory", f"memory peaked {peak / 2**20:.0f} MiB above baseline (bound {memory_bound >> 20} MiB)")
        )
    if sandbox is not None:
        extra += [("sandbox", p) for p in sandbox.problems()]
    if check_tamper:
        tampered = tamper_problems(before)
        if tampered:
            restore_classes(before, saved)
        extra += [("tamper", p) for p in tampered]
    if status != "violation" and extra:
        status, (reason, detail) = "violation", extra[0]
    elif extra:
        detail += " | also " + "; ".join(f"{r}: {d}" for r, d in extra)
    return Outcome(status, reason, detail, seconds, max(peak, 0))
