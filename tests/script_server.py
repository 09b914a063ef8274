"""Run Python scripts each in a process of its own, forked from a server that
has already imported keras_dist, Keras and the backend.

A script run this way runs as `python script.py` runs it: in a new process,
as `__main__`, from the directory and with the environment it is given (the
server's, which the test sets), `sys.argv[0]` and `sys.path[0]` its own, stdin
empty, its uncaught exception printed and its exit code (or signal) returned,
and the interpreter's normal end (threads joined, `atexit`). What it does not
pay is the imports: `import keras` with its backend takes 6 to 10 s of CPU on
the CI machine, more than many of the docs' blocks take to run. The server
imports only; nothing has run: no backend has made a device or a thread pool
(JAX's client, a TensorFlow context, torch's intra-op threads), so the fork
starts from the state a fresh `import` leaves.

One server per test process, started at its first script and ended with the
test session (`stop`).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

# The server: reads one request per line (JSON), forks a child per request,
# says the child's pid, waits for it and says its exit code.
SERVER = r"""
import json, os, sys

import keras_dist  # applies KERAS_DIST_CPU_DEVICES, as a script's import does
import keras  # and its backend
import numpy

out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # only the protocol on `out`
print(json.dumps({"ready": os.getpid()}), file=out)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()  # its own process group: a timeout kills what it started
        out.close()
        os.chdir(request["cwd"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.stdin = open(stdin, closefd=False)
        script = request["script"]
        sys.argv = [script]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        del request, line, out
        import runpy

        # An uncaught exception or SystemExit ends this process the way it
        # ends `python script.py`: traceback, exit code, atexit.
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    print(json.dumps({"pid": pid}), file=out)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), file=out)
"""

STARTUP_TIMEOUT_S = 300  # the imports, on a busy machine


class ScriptServer:
    """A server process and the scripts it runs, one at a time. `log`: where
    the server's own output goes (its imports' warnings)."""

    def __init__(self, env: dict[str, str], log: pathlib.Path) -> None:
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
        self._pending = b""
        self._read(STARTUP_TIMEOUT_S, "ready")

    def _read(self, timeout: float, key: str) -> int:
        """The value of the next message (`{key: value}`), within `timeout` s."""
        deadline = time.monotonic() + timeout
        descriptor = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([descriptor], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(key)
            chunk = os.read(descriptor, 4096)
            if not chunk:
                self._process.wait(timeout=30)
                raise RuntimeError(
                    f"the script server ended with {self._process.returncode}:\n"
                    + self._log.read_text(errors="replace")[-6000:]
                )
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)[key]

    def run(
        self, script: pathlib.Path, cwd: pathlib.Path, timeout: float
    ) -> subprocess.CompletedProcess:
        """`python script` from `cwd`, its output captured; past `timeout` s it
        is killed and `subprocess.TimeoutExpired` raised, as
        `subprocess.run(timeout=...)` does."""
        command = [sys.executable, str(script)]
        stdout, stderr = cwd / ".script.stdout", cwd / ".script.stderr"
        request = {
            "script": str(script),
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        self._process.stdin.write(json.dumps(request).encode() + b"\n")
        self._process.stdin.flush()
        pid = self._read(60, "pid")
        try:
            code = self._read(timeout, "exit")
        except TimeoutError:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            self._read(60, "exit")
            raise subprocess.TimeoutExpired(command, timeout) from None
        return subprocess.CompletedProcess(
            command,
            code,
            stdout.read_text(errors="replace"),
            stderr.read_text(errors="replace"),
        )

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=30)
        self._process.stdout.close()
