"""``llmd stop``: ask the daemon to stop (in-flight requests finish first), or with ``--force``
signal it, kill it if need be, and remove what it left."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from llmd.commands.daemon_process import exited, running_daemon, signal_pid, wait_exit
from llmd.commands.flags import add_settings_flags, non_negative_float
from llmd.errors import LlmdError

STOP_TIMEOUT_S = 60.0
FORCE_STOP_TIMEOUT_S = 15.0  # SIGTERM lets in-flight requests finish for up to 10 s (the daemon's drain)
KILL_WAIT_S = 10.0


def register(sub: argparse._SubParsersAction) -> None:
    stop = sub.add_parser("stop", help="stop the daemon (in-flight requests finish first)",
                          description="Ask the daemon to stop: it refuses new requests, lets the running ones finish "
                                      "(up to 10 s, then cancels them) and exits. --force also ends a daemon that "
                                      "does not answer or does not exit in time.")
    add_settings_flags(stop, ["socket_dir"])
    stop.add_argument("--timeout", type=non_negative_float, default=None, metavar="S",
                      help=f"seconds to wait for it to answer and exit (default: {STOP_TIMEOUT_S:g}; with "
                           f"--force {FORCE_STOP_TIMEOUT_S:g}, then SIGKILL)")
    stop.add_argument("--force", action="store_true",
                      help="signal it instead of asking (SIGTERM, and SIGCONT in case it is stopped), SIGKILL it if "
                           "it has not exited within --timeout, and remove the files it left; without a daemon, "
                           "remove the files a dead one left")
    stop.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmd.client import SILENCE_TIMEOUT_S, Client, DaemonNotRunningError
    from llmd.config import runtime_dir

    run_dir = runtime_dir(args.socket_dir, create=False)
    connection = running_daemon(run_dir)
    if connection is None:
        if args.force and run_dir.is_dir() and remove_leftovers(run_dir):
            print(f"llmd: not running; removed the files a dead daemon left in {run_dir}")
            return 0
        raise DaemonNotRunningError("no llmd daemon is running; start one with `llmd start`")
    pid = int(connection["pid"])
    if args.force:
        return _force_stop(pid, run_dir, FORCE_STOP_TIMEOUT_S if args.timeout is None else args.timeout)
    timeout = STOP_TIMEOUT_S if args.timeout is None else args.timeout
    # A daemon answers at once unless it is hung: a shorter --timeout gives up on it sooner (not at
    # once: the message needs a moment to be read).
    answer_s = max(1.0, min(SILENCE_TIMEOUT_S, timeout))
    try:
        with Client(connection=connection) as client:
            client.shutdown(timeout=answer_s)
    except DaemonNotRunningError:
        if not exited(pid, run_dir):
            raise LlmdError(f"the daemon (pid {pid}) did not answer within {answer_s:g}s; "
                            "`llmd stop --force` ends it (in-flight requests are lost)") from None
    if wait_exit(pid, run_dir, timeout):  # at once if it died before it could answer
        print(f"llmd: stopped (pid {pid})")
        return 0
    raise LlmdError(f"the daemon (pid {pid}) is still running {timeout:g}s after it was asked to stop; "
                    "`llmd stop --force` ends it (in-flight requests are lost)")


def _force_stop(pid: int, run_dir: Path, timeout: float) -> int:
    """SIGTERM (the same graceful stop as the shutdown message), SIGKILL after ``timeout``, then
    remove whatever the daemon left."""
    import signal

    signal_pid(pid, signal.SIGTERM)
    # NOTE: a stopped process (SIGSTOP, Ctrl-Z) acts on SIGTERM only once continued; systemd
    # follows its SIGTERM with SIGCONT for the same reason.
    signal_pid(pid, signal.SIGCONT)
    if wait_exit(pid, run_dir, timeout):
        done = f"llmd: stopped (pid {pid})"
    else:
        signal_pid(pid, signal.SIGKILL)
        if not wait_exit(pid, run_dir, KILL_WAIT_S):
            raise LlmdError(f"the daemon (pid {pid}) is still there {KILL_WAIT_S:g}s after SIGKILL: it is stuck "
                            f"in the kernel (e.g. a GPU driver call); `ps -o stat,wchan -p {pid}` shows where")
        done = f"llmd: killed (pid {pid}) after it did not exit within {timeout:g}s of SIGTERM"
    remove_leftovers(run_dir)
    print(done)
    return 0


def remove_leftovers(run_dir: Path) -> bool:
    """Remove the connection file and sockets a dead daemon left in ``run_dir``; whether there
    were any (none are touched if a daemon holds the lock again)."""
    from llmd.daemon.runtime_files import AlreadyRunningError, RuntimeFiles
    from llmd.paths import CONNECTION_FILE

    if not any(os.path.lexists(p) for p in (run_dir / CONNECTION_FILE, *run_dir.glob("*.sock"))):
        return False
    files = RuntimeFiles(run_dir)
    try:
        files.acquire()  # takes the dead daemon's lock and deletes what it left
    except AlreadyRunningError:
        return False  # a new daemon started meanwhile: its files are not leftovers
    files.release()
    return True
