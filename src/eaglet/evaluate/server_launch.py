"""A serving engine eaglet starts for one evaluation role and stops after it: its own process group, its output
in a log file, ready when /health and /v1/models answer. A server that exits or stays silent past the start-up
timeout ends in one error with the command and the last lines of its log."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections import deque
from pathlib import Path
from types import TracebackType

from eaglet.errors import ConfigError
from eaglet.evaluate.server_client import ServerClient

_TAIL_LINES = 30
_STOP_GRACE_S = 30.0


def log_tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines)).rstrip() or "(empty)"
    except OSError:
        return "(no log)"


class LaunchedServer:
    """`with LaunchedServer(...) as client:` starts the server, waits until it answers, and stops it on exit."""

    def __init__(
        self, command: list[str], client: ServerClient, *, role: str, log_path: Path, startup_timeout_s: float
    ) -> None:
        self.command, self.client, self.role = command, client, role
        self.log_path, self.startup_timeout_s = log_path, startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerClient:
        if self.client.ready():
            raise ConfigError(
                f"a server already answers at {self.client.base}, where eaglet would start the {self.role} "
                "server; stop it, choose another eval.server.port, or measure it with eval.server.url="
                f"{self.client.base}"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"starting the {self.role} server (log: {self.log_path}):\n  {shlex.join(self.command)}")
        with open(self.log_path, "wb") as log:
            try:
                # Its own session: stopping it reaches the engine's worker processes too.
                self.process = subprocess.Popen(
                    self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot start the {self.role} server: {shlex.join(self.command)}: {exc.strerror or exc}; "
                    "install the engine on this machine (pip install -e .[vllm], or SGLang) or set "
                    "eval.server.executable to the program that starts it"
                ) from None
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.client

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        start = time.monotonic()
        pause = 0.2
        while True:
            code = self.process.poll() if self.process else None
            if code is not None:
                raise ConfigError(self._failure(f"exited with status {code} before it answered"))
            if self.client.ready():
                print(
                    f"the {self.role} server answers at {self.client.base} ({time.monotonic() - start:.0f} s)"
                )
                return
            if time.monotonic() - start > self.startup_timeout_s:
                raise ConfigError(
                    self._failure(
                        f"did not answer {self.client.base}/health within eval.server.startup_timeout_s="
                        f"{self.startup_timeout_s:g} s (raise it for a large target)"
                    )
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 5.0)

    def _failure(self, what: str) -> str:
        return (
            f"the {self.role} server {what}; command: {shlex.join(self.command)}\n"
            f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after a grace period; the port is free after."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, _STOP_GRACE_S)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
