"""Python processes forked from a server that has already imported keras_dist,
Keras and the backend: what the suite's jobs and docs blocks start.

A process started this way runs its script as `python script.py ARGS...`
does: in a new process, as `__main__`, with its own `sys.argv` and
`sys.path[0]`, from the directory and with the environment it is given, stdin
empty, its output to the files it is given, its uncaught exception printed and
its exit code (or signal) returned, and the interpreter's normal end (threads
joined, `atexit`). What it does not pay is the imports: `import keras` with its
backend takes 6 to 8 s of CPU on the CI machine, more than many of the suite's
jobs take to train. The server imports only; nothing has run: no backend has
made a device or a thread pool (JAX's client, a TensorFlow context, torch's
intra-op threads), so the fork starts from the state a fresh `import` leaves.
Simulated devices (`KERAS_DIST_CPU_DEVICES`) are set up in the child, from its
own environment, as `import keras_dist` sets them up in a new process.

Only what a process reads at its start could differ from a fresh one. So a
process forks only when the variables read at a process' start
(`_READ_AT_START`: the interpreter's, the backend's, XLA's, the thread
libraries', Keras' backend) are the server's; any difference there (another
backend, XLA or thread settings) starts it with `subprocess.Popen`, as before.
`KERAS_DIST_TESTS_FORK=0` starts every process that way.

One server per test process, started at its first process, ended with the
test process (`start_python`); the docs blocks have one of their own
(`run_script`).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

# The server: reads one request per line (JSON) and forks a child per request,
# says the child's pid, and says each child's exit code when it ends. On the
# end of its input it kills the children still running and exits.
SERVER = r"""
import json, os, select, signal, sys

saved = os.environ.pop("KERAS_DIST_CPU_DEVICES", None)
import keras_dist  # without simulated devices: each child sets up its own
import keras  # and its backend
import numpy

keras_dist.DataParallel  # the public API, and keras_dist's patches of Keras
if saved is not None:
    os.environ["KERAS_DIST_CPU_DEVICES"] = saved

out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # only the protocol on `out`
print(json.dumps({"ready": os.getpid()}), file=out)
children = set()
requests = os.fdopen(os.dup(0), "rb", buffering=0)
pending = b""
while True:
    ready, _, _ = select.select([requests], [], [], 0.05 if children else None)
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            print(json.dumps({"exit": [pid, exit_code]}), file=out)
    if not ready:
        continue
    chunk = os.read(requests.fileno(), 65536)
    if not chunk:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(0)
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own process group: a kill reaches what it started
            out.close()
            requests.close()
            os.chdir(request["cwd"])
            stdin = os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            flags = os.O_WRONLY | os.O_CREAT
            flags |= os.O_APPEND if request["append"] else os.O_TRUNC
            os.dup2(os.open(request["stdout"], flags), 1)
            if request["stderr"] == request["stdout"]:
                os.dup2(1, 2)
            else:
                os.dup2(os.open(request["stderr"], flags), 2)
            sys.stdin = open(stdin, closefd=False)
            # Its PYTHONPATH's folders where a new interpreter puts them:
            # after the script's, before the installed packages.
            for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep):
                if folder and os.path.abspath(folder) in sys.path:
                    sys.path.remove(os.path.abspath(folder))
            os.environ.clear()
            os.environ.update(request["env"])
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            sys.path[1:1] = [os.path.abspath(p) for p in paths if p]
            import tempfile

            tempfile.tempdir = None  # from this environment's TMPDIR
            from keras_dist.runtime import device_simulation

            device_simulation.apply_from_environment()
            script = request["argv"][0]
            sys.argv = list(request["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            del request, line, out, pending, chunk, children, requests
            import runpy

            # An uncaught exception or SystemExit ends this process the way it
            # ends `python script.py`: traceback, exit code, atexit.
            runpy.run_path(script, run_name="__main__")
            sys.exit(0)
        children.add(pid)
        print(json.dumps({"pid": pid}), file=out)
"""

STARTUP_TIMEOUT_S = 300  # the imports, on a busy machine

# Variables a process reads after its start (keras_dist's own, the job's
# address and rank, TensorFlow's cluster), or that the child applies itself
# (PYTHONPATH, simulated devices): the server starts without them.
_READ_LATER = re.compile(
    r"^(KERAS_DIST|KERAS_DISTRIBUTION_|TF_CONFIG$|TMPDIR$|PYTHONPATH$)"
)
# Variables read when a process starts (the interpreter's, the backend's and
# its libraries', Keras' backend and home): a child forks only when these are
# the server's. The rest are read when used, from the child's own environment:
# a job's own, or one that an import or a test set in the test process
# (TensorFlow's TPU_ML_PLATFORM, torch's TORCH_FR_BUFFER_SIZE, torchrun's or
# Ray's), and the TPU runtime's, read when JAX's backend starts in the child.
_READ_AT_START = re.compile(
    r"^(KERAS_BACKEND|KERAS_HOME|XLA_FLAGS|JAX_.*|TF_(?!CONFIG$).*|OMP_.*|MKL_.*"
    r"|OPENBLAS_.*|KMP_.*|CUDA_.*|TORCH(?!_FR_).*|PYTORCH_.*|LD_.*"
    r"|PYTHON(?!PATH$).*|MPLBACKEND)$"
)


class ForkServer:
    """A server process (started with `env`) and the processes forked from
    it. `log`: where the server's own output goes (its imports' warnings).

    Safe to use from several threads (a test that runs two jobs at once):
    one thread reads the server's messages and keeps them; requests are
    written one at a time, and the server answers them in order."""

    def __init__(self, env: dict[str, str], log: pathlib.Path) -> None:
        self.env = dict(env)
        self._log = log
        with open(log, "w") as output:
            self._process = subprocess.Popen(
                [sys.executable, "-c", SERVER],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=output,
                start_new_session=True,
            )
        self._changed = threading.Condition()
        self._requesting = threading.Lock()  # one request and its answer
        self._ready = False
        self._pids: collections.deque[int] = collections.deque()
        self._exits: dict[int, int] = {}
        self._ended: str | None = None
        self._reader = threading.Thread(
            target=self._read, name="fork-server-reader", daemon=True
        )
        self._reader.start()
        self._wait_for(lambda: self._ready, STARTUP_TIMEOUT_S, "start")

    def _read(self) -> None:
        """The reader thread: every message of the server, kept, until its
        output ends."""
        for line in self._process.stdout:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "pid" in message:
                    self._pids.append(message["pid"])
                elif "exit" in message:
                    pid, code = message["exit"]
                    self._exits[pid] = code
                self._changed.notify_all()
        try:
            code = self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        with self._changed:
            self._ended = f"the fork server ended with {code}"
            self._changed.notify_all()

    def _wait_for(self, condition, timeout: float | None, what: str) -> bool:
        """Wait up to `timeout` s for `condition()` (under the lock); False
        past it; an error if the server ended (its log's end in it)."""
        with self._changed:
            self._changed.wait_for(
                lambda: condition() or self._ended is not None, timeout
            )
            if condition():
                return True
            if self._ended is not None:
                raise RuntimeError(
                    f"{self._ended} (waiting for {what}):\n"
                    + self._log.read_text(errors="replace")[-6000:]
                )
            return False

    def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: pathlib.Path | str,
        stdout: pathlib.Path,
        stderr: pathlib.Path | None = None,
        append: bool = False,
    ) -> ForkedProcess:
        """`python *argv` (a script and its arguments) from `cwd` with `env`,
        its output to `stdout` (and `stderr`, else the same file), appended to
        what the files hold with `append`."""
        request = {
            "argv": [str(part) for part in argv],
            "env": env,
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr or stdout),
            "append": append,
        }
        with self._requesting:
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
            if not self._wait_for(lambda: bool(self._pids), 60, "a child's pid"):
                raise RuntimeError("the fork server did not start the process in 60 s")
            with self._changed:
                pid = self._pids.popleft()
        return ForkedProcess(self, pid, [sys.executable, *request["argv"]])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of child `pid`, waiting up to `timeout` s for it
        (None: still running)."""
        self._wait_for(lambda: pid in self._exits, timeout, f"process {pid}")
        with self._changed:
            return self._exits.get(pid)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()  # the server kills what still runs
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=30)
        self._reader.join(timeout=60)
        self._process.stdout.close()


class ForkedProcess:
    """A process forked by a `ForkServer`, used as a `subprocess.Popen`:
    `pid`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`
    (which reaches the processes it started, its process group)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_SERVERS: list[ForkServer] = []
_FOLDERS: list[pathlib.Path] = []  # the servers' logs, removed at the end
_STARTING = threading.Lock()


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if _READ_AT_START.match(name)}


def start_python(
    argv: list[str],
    *,
    env: dict[str, str],
    output: pathlib.Path,
    cwd: pathlib.Path | str | None = None,
    append: bool = False,
) -> subprocess.Popen | ForkedProcess:
    """`python *argv` (a script and its arguments) with `env`, its stdout and
    stderr to `output` (appended with `append`): forked from this test
    process' server when `env` has the server's variables read at a process'
    start (`_READ_AT_START`), else a new interpreter (`subprocess.Popen`), in
    a session of its own either way."""
    cwd = cwd or os.getcwd()
    # The server starts with this process' environment (less `_READ_LATER`).
    server_env = (
        _SERVERS[0].env
        if _SERVERS
        else {k: v for k, v in os.environ.items() if not _READ_LATER.match(k)}
    )
    forking = os.environ.get("KERAS_DIST_TESTS_FORK", "1") != "0"
    if forking and _read_at_start(env) == _read_at_start(server_env):
        with _STARTING:  # one server, whichever thread comes first
            if not _SERVERS:
                atexit.register(stop_all)
                _FOLDERS.append(
                    pathlib.Path(tempfile.mkdtemp(prefix="keras-dist-fork-server-"))
                )
                _SERVERS.append(ForkServer(server_env, _FOLDERS[-1] / "server.log"))
        return _SERVERS[0].spawn(argv, env=env, cwd=cwd, stdout=output, append=append)
    with open(output, "a" if append else "w") as log:
        return subprocess.Popen(
            [sys.executable, *map(str, argv)],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=log,
            start_new_session=True,  # as a forked one: its own process group
        )


def run_script(
    server: ForkServer, script: pathlib.Path, cwd: pathlib.Path, timeout: float
) -> subprocess.CompletedProcess:
    """`python script` from `cwd` with the server's environment, forked from
    `server`, its output captured; past `timeout` s it is killed and
    `subprocess.TimeoutExpired` raised, as `subprocess.run(timeout=...)`
    does."""
    stdout, stderr = cwd / ".script.stdout", cwd / ".script.stderr"
    child = server.spawn(
        [str(script)], env=server.env, cwd=cwd, stdout=stdout, stderr=stderr
    )
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(60)
        raise
    return subprocess.CompletedProcess(
        child.args,
        code,
        stdout.read_text(errors="replace"),
        stderr.read_text(errors="replace"),
    )


def stop_all() -> None:
    for server in _SERVERS:
        server.stop()
    _SERVERS.clear()
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
    _FOLDERS.clear()
