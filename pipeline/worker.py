"""Run a backend session in a worker process, so that a segfault, abort, hang or
out-of-memory in a runtime becomes a ``BackendCrashed`` error instead of killing the run.

Protocol: one request at a time over a Pipe to a child forked from a fork server
(multiprocessing's "forkserver", Linux and macOS; spawned elsewhere). The server is a fresh
interpreter that imported numpy, this module and parity's backend modules (PRELOAD) and no runtime: parity's own
process is never forked (the runtimes start threads, and a fork of a threaded process can
deadlock), and a worker starts without paying for the interpreter and those imports again
(0.65 s of CPU per worker before, most of it that; numpy's OpenBLAS threads are made
fork-safe by OpenBLAS itself). The child points
fd 1 and fd 2 at a log file (so what C/C++ code prints, e.g. "terminate called after
throwing ...", is kept), sets the memory limit, imports the backend module, then

    child -> ("ok", (inputs, outputs))       after module.load(artifact_dir, settings)
    parent -> (method, args)                  getattr(session, method)(*args) in the child
    child -> ("ok", result)                   or ("error", kind, "TypeName: first line")
    parent -> None                            the child exits

``__latency__``, ``__throughput__`` and ``__startup__`` run pipeline.verification.metrics.latency /
throughput / startup in the child (no pickling in the timings; startup loads new sessions
of the same artifact with other settings). ``__memory__`` answers the child's peak resident
memory (docs/verify.md, "Memory"): read right after the load (``load_peak_mb``; then, on Linux,
reset through /proc/self/clear_refs) and when asked (``run_peak_mb``: the peak since, e.g. over
the validation samples verify ran). The child holds only this artifact's session, the
interpreter and the runtime's libraries.
The parent waits at most ``timeout_s`` for each answer, then kills the child ("hung");
EOF on the pipe means the child died ("crashed": signal or exit status, last log lines).
A Python exception is sent back ("error", "memory" for a MemoryError); after one in a
method the child keeps serving, after one in ``load`` it ends.

Memory limit: RLIMIT_DATA on Linux (private writable memory, mmap'd included since Linux
4.7), else RLIMIT_AS. RLIMIT_AS also counts address space only reserved, which grows per
thread (glibc: a 64 MiB malloc arena + 8 MiB of stack each). Smallest limits (MB) under
which a small CNN loads and runs, measured on 2 cores, AS / DATA: ONNX Runtime, 2 threads
222 / 127, 32 threads 1429 / 381; OpenVINO 413 / 159 (peak RSS ~110). AS costs ~40 MB a
thread, DATA ~8.5, so a 4096 MB AS limit would refuse sessions on a many-core machine
that the same DATA limit allows. Just too low a limit can make ONNX Runtime deadlock in
its session constructor (a thread fails to start): the timeout reports that as "hung".
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from pipeline.errors import BackendCrashed, meaningful_line

_LATENCY = "__latency__"
_THROUGHPUT = "__throughput__"
_STARTUP = "__startup__"
_STREAM_LOAD = "__stream_load__"
_STREAM = "__stream__"
_MEMORY = "__memory__"
_RUN_BATCH = "__run_batch__"
_JOIN_S = 5.0


def peak_rss_mb() -> Tuple[Optional[float], str]:
    """(this process's peak resident set in MB, where it was read): VmHWM from
    /proc/self/status (Linux), else getrusage's ru_maxrss (bytes on macOS, KiB elsewhere);
    (None, why) where neither exists."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0, "VmHWM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), "ru_maxrss"
    except (ImportError, AttributeError, OSError):
        return None, f"not measured: no /proc/self/status and no resource.getrusage on {sys.platform}"


def reset_peak_rss() -> bool:
    """Linux: writing 5 to /proc/self/clear_refs sets VmHWM back to the current resident set."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _limit_memory(memory_mb: int) -> None:
    try:
        import resource

        which = resource.RLIMIT_DATA if sys.platform.startswith("linux") else resource.RLIMIT_AS
        _, hard = resource.getrlimit(which)
        limit = memory_mb << 20
        resource.setrlimit(which, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (ImportError, AttributeError, ValueError, OSError):
        pass  # no such limit on this platform


MEMORY_SIGNS = ("bad_alloc", "failed to map segment", "Cannot allocate memory")


def _failure(err: BaseException) -> tuple:
    """("error", kind, "TypeName: meaningful line"): the runtime's line naming the op or node,
    OpenVINO's "Exception from file:line:" plumbing skipped (errors.meaningful_line)."""
    traceback.print_exc()  # into the log
    message = meaningful_line(err)
    # the memory limit also shows as a shared library that cannot be mapped while importing
    memory = isinstance(err, MemoryError) or any(sign in message for sign in MEMORY_SIGNS)
    name = "MemoryError" if isinstance(err, MemoryError) else type(err).__name__
    return ("error", "memory" if memory else "error", f"{name}: {message}")


def _restorable_start_method() -> None:
    """A spawned child restores its parent's global start method by name; inside a joblib
    (loky) sweep job that name is "loky", which the child cannot find, so it dies before
    running anything. Such a process gets the stdlib "spawn" as its global method."""
    if multiprocessing.get_start_method(allow_none=True) not in (None, *multiprocessing.get_all_start_methods()):
        multiprocessing.set_start_method("spawn", force=True)


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn re-runs the parent's __main__ in the child unless it has no file or module
    name. The child needs nothing from it: for the `parity` console script it only
    imports the CLI (Hydra, rich), 0.13 s of every worker's start."""
    main = sys.modules.get("__main__")
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if main and name in main.__dict__}
    if "__file__" in saved:
        del main.__file__
    if "__spec__" in saved:
        main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


# what a worker imports before its runtime, imported once by the fork server: parity's
# backend modules (each imports its runtime only in load) and what their sessions use
# (0.15-0.25 s of every worker's CPU before); never a runtime
PRELOAD = ["numpy", "pipeline.worker", "pipeline.verification.metrics", "pipeline.release.compile_cache",
           "pipeline.backends.onnxruntime", "pipeline.backends.openvino", "pipeline.backends.ncnn",
           "pipeline.backends.mnn"]


def _context():
    """The fork server's context (started on first use, one per parity process), or spawn
    where the platform has none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _short_socket_folder()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


# the fork server listens on an AF_UNIX socket in multiprocessing's temp folder ("pymp-" and 8
# random characters, in it "listener-" and 8 more), a path Linux ends at 107 bytes: under a long
# TMPDIR every worker failed ("AF_UNIX path too long")
SOCKET_NAME_BYTES = len("/pymp-") + 8 + len("/listener-") + 8
SOCKET_PATH_MAX = 107


def _short_socket_folder() -> None:
    """Where TMPDIR is too long for the fork server's socket, multiprocessing's own temp
    folder (its socket and nothing else) is made in the system's short one instead, and
    removed at exit as multiprocessing removes its own."""
    import shutil
    from multiprocessing import process, util

    config = process.current_process()._config  # multiprocessing.util.get_temp_dir's cache
    if config.get("tempdir") is not None or len(tempfile.gettempdir()) + SOCKET_NAME_BYTES < SOCKET_PATH_MAX:
        return
    base = next((d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.access(d, os.W_OK)), None)
    if base is None:
        return  # nowhere shorter: the fork server reports the path itself
    folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
    util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    config["tempdir"] = folder


def start_process(target, args: tuple, name: str):
    """A daemon process running ``target(*args)``, started as the workers are."""
    _restorable_start_method()
    process = _context().Process(target=target, args=args, name=name, daemon=True)
    with _main_module_hidden():
        process.start()
    return process


def _send(conn, reply: tuple) -> None:
    try:
        conn.send(reply)
    except Exception as err:  # e.g. a result that cannot be pickled
        conn.send(_failure(err))


def _child(conn, module: str, artifact_dir: str, settings: dict, log_path: str, memory_mb: Optional[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    if memory_mb:
        _limit_memory(memory_mb)
    try:
        session = importlib.import_module(module).load(Path(artifact_dir), settings)
        reply: tuple = ("ok", (list(session.inputs), list(session.outputs)))
    except BaseException as err:
        _send(conn, _failure(err))
        return
    load_peak, source = peak_rss_mb()  # before anything else runs in this process
    memory = {"load_peak_mb": load_peak, "source": source, "reset": source == "VmHWM" and reset_peak_rss()}
    _send(conn, reply)
    stream: list = []  # the samples of the stream timing, sent once (_STREAM_LOAD), run every round (_STREAM)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent has gone
            request = None
        if request is None:
            _exit_now(session)
        method, args = request
        try:
            if method == _LATENCY:
                from pipeline.verification.metrics import latency

                reply = ("ok", latency(session.run, *args))
            elif method == _THROUGHPUT:
                from pipeline.verification.metrics import throughput

                parallel = importlib.import_module(module).CAPABILITIES.parallel_runners
                reply = ("ok", throughput(session.parallel_runners() if parallel else [session.run], *args))
            elif method == _MEMORY:
                reply = ("ok", {**memory, "run_peak_mb": peak_rss_mb()[0]})
            elif method == _RUN_BATCH:
                reply = ("ok", _run_each(session, args[0]))
            elif method == _STREAM_LOAD:
                stream = list(args[0])
                reply = ("ok", len(stream))
            elif method == _STREAM:
                from pipeline.verification.metrics import stream_pass

                reply = ("ok", stream_pass(session.run, stream))
            elif method == _STARTUP:  # new sessions of the same artifact, timed from load to first output
                from pipeline.verification.metrics import startup

                load = importlib.import_module(module).load
                reply = ("ok", startup(lambda settings: load(Path(artifact_dir), settings), *args))
            else:
                reply = ("ok", getattr(session, method)(*args))
        except Exception as err:
            reply = _failure(err)
        _send(conn, reply)


def _run_each(session, batch: list) -> tuple:
    """(outputs of each feeds in ``batch``, in order, up to the first that raised; that
    one's _failure tuple, or None): the samples before a failure keep their answers."""
    outputs = []
    for feeds in batch:
        try:
            outputs.append(session.run(feeds))
        except Exception as err:  # noqa: BLE001 - sent back, as a run() request's would be
            return outputs, _failure(err)
    return outputs, None


def _exit_now(session) -> None:
    """End the child without the interpreter's teardown: destroying a runtime's sessions and
    modules took 0.2-0.7 s a worker, paid by the parent's close(). What the teardown would
    have removed is removed here: the session's scratch folder (``remove_scratch``: ONNX
    Runtime's optimized graph, MNN's cache copy), which os._exit would leave in the temp
    folder (a test session left 18 000 of them, GBs). The log is line-buffered, flushed here."""
    remove_scratch = getattr(session, "remove_scratch", None)
    if remove_scratch is not None:
        remove_scratch()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


class BackendWorker:
    """A backend session in a child process; ``label`` names it in errors, e.g. "openvino (target)"."""

    def __init__(self, module: str, artifact_dir, settings: dict, *, label: str, timeout_s: float = 600.0,
                 memory_mb: Optional[int] = None, log_path: Optional[Path] = None):
        self.module, self.artifact_dir, self.settings, self.label = module, str(artifact_dir), settings, label
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.log_path, self._own_log = (Path(log_path) if log_path else None), log_path is None
        self.inputs: List[str] = []
        self.outputs: List[str] = []
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn = None
        self._dead: Optional[Exception] = None
        self._paused = False

    def __enter__(self) -> "BackendWorker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the child and load the session (again, after a crash or close)."""
        self.launch()
        self.wait_loaded()

    def launch(self) -> None:
        """Start the child without waiting for its load (start several, then wait)."""
        if self._process is not None:
            self.close()
        self._dead = None
        if self._own_log:
            fd, name = tempfile.mkstemp(prefix="parity-worker-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_bytes(b"")
        _restorable_start_method()
        context = _context()
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child, daemon=True, name=f"parity-worker {self.label}", args=(
            child_conn, self.module, self.artifact_dir, self.settings, str(self.log_path), self.memory_mb))
        with _main_module_hidden():
            self._process.start()
        child_conn.close()

    def wait_loaded(self) -> None:
        """Wait for the child's load; on failure the worker is closed and the error raised."""
        try:
            self.inputs, self.outputs = self._request("load()", None, self.timeout_s)
        except BaseException:
            self.close()  # a with block does not call __exit__ when __enter__ raises
            raise

    def call(self, method: str, *args, timeout_s: Optional[float] = None) -> Any:
        what = {_LATENCY: "latency()", _THROUGHPUT: "throughput()", _STARTUP: "startup()",
                _STREAM_LOAD: "stream_load()", _STREAM: "stream()", _MEMORY: "memory()"}.get(method, f"{method}()")
        return self._request(what, (method, args), self.timeout_s if timeout_s is None else timeout_s)

    def run(self, feeds: dict) -> dict:
        return self.call("run", feeds)

    def run_each(self, batch: list) -> list:
        """run() of each feeds in ``batch`` in one request: their outputs in order, the
        BackendCrashed of the first that raised in its place, nothing after it."""
        outputs, failure = self._request("run()", (_RUN_BATCH, (batch,)), self.timeout_s)
        if failure is None:
            return outputs
        return [*outputs, BackendCrashed(failure[1], f"{self.label} run() raised {failure[2]}", worker=self.label)]

    def effective(self) -> dict:
        return self.call("effective")

    def memory(self) -> dict:
        """The child's peak resident memory: {"load_peak_mb" (after the load), "run_peak_mb"
        (since the load, or since the start where the peak could not be reset: "reset"),
        "source"}; the MB are None where the platform has no way to read them."""
        return self.call(_MEMORY)

    def latency(self, feeds: dict, warmup: int = 3, repeats: int = 20, min_ms: float = 0.0, *,
                timeout_s: Optional[float] = None) -> dict:
        """``repeats`` timed runs after ``warmup``, and more until ``min_ms`` passed
        (pipeline.verification.metrics.latency)."""
        return self.call(_LATENCY, feeds, warmup, repeats, min_ms, timeout_s=timeout_s)

    def stream_load(self, samples: list) -> int:
        """Keep ``samples`` (feeds dicts, in the order a service would see them) in the child."""
        return self.call(_STREAM_LOAD, samples)

    def stream(self, *, timeout_s: Optional[float] = None) -> dict:
        """One pass over the loaded samples, one call per sample at its own shape
        (pipeline.verification.metrics.stream_pass)."""
        return self.call(_STREAM, timeout_s=timeout_s)

    def throughput(self, feeds: dict, warmup: int = 3, repeats: int = 20, *, timeout_s: Optional[float] = None) -> dict:
        return self.call(_THROUGHPUT, feeds, warmup, repeats, timeout_s=timeout_s)

    def startup(self, variants: dict, feeds: dict, rounds: int = 3, *, timeout_s: Optional[float] = None) -> dict:
        """Load-to-first-output seconds of each settings variant (pipeline.verification.metrics.startup)."""
        return self.call(_STARTUP, variants, feeds, rounds, timeout_s=timeout_s)

    def pause(self) -> None:
        """Stop the child (SIGSTOP) while another build is timed (speed._turn); its next
        request resumes it. A no-op where the platform cannot stop a process."""
        if not self._paused and self.alive and hasattr(signal, "SIGSTOP"):
            os.kill(self._process.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._process is not None and self._process.is_alive():
                os.kill(self._process.pid, signal.SIGCONT)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process is not None and self._process.is_alive()

    def stderr_tail(self, lines: int = 8) -> List[str]:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
                text = log.read().decode(errors="replace")
        except (OSError, TypeError):
            return []
        return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]

    def close(self) -> None:
        self.resume()  # a stopped child would not read the message that ends it
        if self._process is not None:
            if self._process.is_alive():
                try:
                    self._conn.send(None)
                    self._process.join(_JOIN_S)
                except OSError:
                    pass
            self._kill()
            self._process = None
            self._conn.close()
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        self._dead = self._dead or RuntimeError(f"the worker for {self.label} is closed")

    def _request(self, what: str, message, timeout_s: float, wait: bool = True) -> Any:
        if self._dead is not None:
            raise self._dead.with_traceback(None)
        if self._process is None:
            raise RuntimeError(f"the worker for {self.label} is not started")
        self.resume()
        limit = f" (memory limit {self.memory_mb} MB)" if self.memory_mb else ""
        try:
            if message is not None:
                self._conn.send(message)
            if not wait:
                return None
            reply = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError):
            raise self._fail("crashed", f"{self.label} crashed ({self._exit_status()}) in {what}{limit}") from None
        if reply is None:
            self._kill()
            raise self._fail("hung", f"{self.label} hung: no answer in {timeout_s:g} s to {what}, killed{limit}")
        if reply[0] == "ok":
            return reply[1]
        if what != "load()":  # the child carries on; the traceback is in the log
            raise BackendCrashed(reply[1], f"{self.label} {what} raised {reply[2]}", worker=self.label)
        self._process.join(_JOIN_S)  # the child has ended
        self._dead = BackendCrashed(reply[1], f"{self.label} {what} raised {reply[2]}{limit}", worker=self.label)
        raise self._dead

    def _fail(self, kind: str, detail: str) -> BackendCrashed:
        tail = self.stderr_tail()
        if kind == "crashed" and any("bad_alloc" in line or "MemoryError" in line for line in tail):
            kind = "memory"
        self._dead = BackendCrashed(kind, detail, tail, worker=self.label)
        return self._dead

    def _exit_status(self) -> str:
        self._process.join(_JOIN_S)
        code = self._process.exitcode
        if code is None:
            self._kill()
            return "closed its pipe"
        if code >= 0:
            return f"exit status {code}"
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(_JOIN_S)


def answered(run: Callable[[], Any]) -> Any:
    """``run()``'s outputs, or the BackendCrashed it raised."""
    try:
        return run()
    except BackendCrashed as err:
        return err


# side_by_side gives a worker consecutive samples in one request (run_each), as many as the
# slowest worker answers in about BATCH_S (one at first, at most MAX_BATCH): a small model's
# run is shorter than a request's round trip (the default model's 200 samples on three
# workers: 0.6 s a sample at a time, 0.16 s in batches; docs/verify.md). A batch also holds
# at most BATCH_BYTES of inputs and outputs a sample, so that what a worker keeps for one
# request does not show in the peak memory verify reads from it.
BATCH_S = 0.02
MAX_BATCH = 32
BATCH_BYTES = 1 << 20


def side_by_side(workers: Dict[str, Any], samples: Iterable, ahead: int = 4, max_batch: int = MAX_BATCH,
                 batch_s: float = BATCH_S) -> Iterator[tuple]:
    """Every sample run by every worker, each from a thread of its own and at its own pace,
    at least ``ahead`` samples (and two batches) past the one being yielded: yields
    ``(sample, {name: outputs, or the BackendCrashed that worker's run raised})`` in the
    samples' order. In lockstep (every worker waiting for the slowest on each sample) three
    workers on two cores took 14.1 s for 200 PP-OCRv4 rec lines; each at its own pace 9.5 s
    (docs/time.md). Samples go in batches (``batch_s``, ``max_batch``: see BATCH_S).
    A worker is a BackendWorker, or a function of (sample index, feeds) that answers like
    one (verify's reference, read from its store where it can). A worker once failed is
    not given more samples. When the loop ends, early or not, every run in flight is
    awaited: no answer is left in a worker's pipe."""
    failed: set = set()
    per_sample: Dict[str, float] = {}  # each worker's seconds a sample, in its last batch
    sample_bytes = [0]  # the most a sample's inputs and outputs took

    def run(name: str, first: int, batch: list) -> list:
        if name in failed:
            return [None] * len(batch)
        started = time.perf_counter()
        answers = _answers(workers[name], first, batch)
        per_sample[name] = (time.perf_counter() - started) / len(batch)
        sample_bytes[0] = max([sample_bytes[0], *(_nbytes(sample.feeds) + _nbytes(answer)
                                                  for sample, answer in zip(batch, answers))])
        if answers and isinstance(answers[-1], BackendCrashed):
            failed.add(name)
        return answers + [None] * (len(batch) - len(answers))

    threads = {name: ThreadPoolExecutor(1, thread_name_prefix=f"parity-feed-{name}") for name in workers}
    pending: deque = deque()
    stream = enumerate(samples)

    def give_next() -> None:
        batch = list(itertools.islice(stream, _batch_size(per_sample, sample_bytes[0], max_batch, batch_s)))
        if batch:
            given = [sample for _, sample in batch]
            pending.append((given, {name: pool.submit(run, name, batch[0][0], given)
                                    for name, pool in threads.items()}))

    def in_flight() -> int:
        return sum(len(given) for given, _ in pending)

    try:
        give_next()
        while pending:
            while len(pending) < 2 or in_flight() < ahead:
                before = len(pending)
                give_next()
                if len(pending) == before:
                    break
            given, runs = pending.popleft()
            answers = {name: run.result() for name, run in runs.items()}
            for index, sample in enumerate(given):
                yield sample, {name: each[index] for name, each in answers.items()}
    finally:
        for _, runs in pending:
            for run in runs.values():
                run.cancel()
        for pool in threads.values():
            pool.shutdown(wait=True)


def _batch_size(per_sample: Dict[str, float], sample_bytes: int, max_batch: int, batch_s: float) -> int:
    """Samples the next request carries: one until a batch was timed, then as many as the
    slowest worker answers in ``batch_s`` and BATCH_BYTES holds, at most ``max_batch``."""
    slowest = max(per_sample.values(), default=None)
    if not slowest:
        return 1
    return max(1, min(max_batch, int(batch_s / slowest), BATCH_BYTES // max(1, sample_bytes)))


def _nbytes(arrays) -> int:
    """Bytes of a dict of arrays (0 for anything else: a crash, no answer)."""
    return sum(getattr(value, "nbytes", 0) for value in arrays.values()) if isinstance(arrays, dict) else 0


def _answers(worker, first: int, batch: list) -> list:
    """A worker's answers to the samples of ``batch`` (``first``: the first one's index), up
    to and with the first BackendCrashed."""
    if isinstance(worker, BackendWorker):
        answer = answered(lambda: worker.run_each([sample.feeds for sample in batch]))
        return [answer] if isinstance(answer, BackendCrashed) else answer
    answers: list = []
    for offset, sample in enumerate(batch):
        answers.append(answered(lambda: worker(first + offset, sample.feeds)))
        if isinstance(answers[-1], BackendCrashed):
            break
    return answers
