"""`fedhead` commands as processes of their own, forked from one interpreter that has imported fedhead and torch.

The tests of signals, locks, resumes and exit codes run a command as a separate process (its own pid, signal
handlers, exit status, file descriptors), but a fresh ``python -m cli`` spends two to four seconds of CPU importing
torch and fedhead before it does anything: across the suite that was most of the CPU its subprocesses used.
:func:`fedhead_popen` forks the command from a multiprocessing *forkserver* that imported ``cli`` once (per test
worker): the child sets the environment, working folder and ``sys.argv`` it is given, points file descriptors 1
and 2 at files, and runs ``cli.main()`` as ``python -m cli`` would. Its exit status is the command's (a signal's
death is ``-signum``, as for :class:`subprocess.Popen`). A test that needs a fresh interpreter (start-up itself,
``FEDHEAD_PLUGINS`` read at import, resource limits set before the start) keeps :mod:`subprocess`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        import cli  # its command modules load in the forkserver, once: a command run from the shell imports its own

        _ctx.set_forkserver_preload(["cli", *dict.fromkeys(module for module, *_ in cli.COMMANDS)])
    return _ctx


def _command(argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """The child: what ``python -m cli ARGV`` does, in the forked interpreter, in a process group of its own."""
    os.setpgid(0, 0)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["cli", *argv]
    import cli

    cli.main()


class _Output:
    """``proc.stderr.read()`` / ``proc.stdout.read()`` of a running or finished command: its file so far."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""


class FedheadProcess:
    """The part of :class:`subprocess.Popen` (``text=True``, stdout and stderr piped) that the tests use."""

    def __init__(self, args: list[str], env: dict, cwd: str | os.PathLike):
        self.args = args
        self._dir = Path(tempfile.mkdtemp(prefix="fedhead-proc-"))
        self.stdout, self.stderr = _Output(self._dir / "out"), _Output(self._dir / "err")
        self._p = _context().Process(
            target=_command, args=(list(args), dict(env), str(cwd), str(self.stdout.path), str(self.stderr.path))
        )
        self._reaped = False
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self._p.exitcode
        if code is not None and not self._reaped:
            self._reaped = True
            self._kill_leftovers()
        return code

    def _kill_leftovers(self) -> None:
        """Kill what the command left in its process group. A forkserver's child inherits "forkserver" as its
        start method, so a command's DataLoader workers are children of a forkserver of their own: when a test
        kills the command (SIGKILL, as a crash), torch's watchdog never sees their parent die and, unlike under
        ``python -m cli`` (fork), they would outlive the suite (about 550 MB each)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            import subprocess

            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._p.terminate()

    def kill(self) -> None:
        self._p.kill()


def fedhead_popen(args: list[str], env: dict, cwd: str | os.PathLike) -> FedheadProcess:
    """``subprocess.Popen([python, '-m', 'cli', *args], env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True)``
    without the interpreter's start-up."""
    return FedheadProcess(args, env, cwd)


def fedhead_run(args: list[str], env: dict, cwd: str | os.PathLike, timeout: float = 600) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of one command (:func:`fedhead_popen`, waited for)."""
    p = fedhead_popen(args, env, cwd)
    t = time.monotonic()
    out, err = p.communicate(timeout=timeout)
    assert p.returncode is not None, f"{args} did not finish within {time.monotonic() - t:.0f} s"
    return p.returncode, out, err
