"""A rollout process that dies while starting up says why, with the fix (issue 23 item 7).

Real processes: a training script is run as ``__main__``; the spawned rollout process re-imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO

WATCH = """
import time
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.process import start_rollout_process

{before}
handle = start_rollout_process(AsyncRolloutLoop)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        handle.check_health()
    except RuntimeError as exc:
        print("FAILURE:", exc)
        break
    time.sleep(0.2)
handle.stop(grace_s=1)
"""


def _run(tmp_path, before: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(WATCH.format(before=before)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert "FAILURE:" in done.stdout, (done.stdout, done.stderr[-2000:])
    return done.stdout.split("FAILURE:", 1)[1]


def test_a_script_without_a_main_guard_is_named_with_the_fix(tmp_path):
    failure = _run(tmp_path, before="")
    assert "died at start-up (exit code 1)" in failure
    assert 'if __name__ == "__main__":' in failure and "bootstrapping phase" in failure
    assert "without reporting an error" not in failure


def test_any_start_up_error_of_the_child_is_reported(tmp_path):
    failure = _run(
        tmp_path, before='if __name__ == "__mp_main__":\n    raise ValueError("cannot load the rewards")'
    )
    assert "died at start-up" in failure and "ValueError: cannot load the rewards" in failure
    assert "__main__" not in failure.split("error while starting", 1)[0]  # no guard advice here


# Issue 35 item 5: a script fed on standard input (``python - < train.py``) has ``__main__.__file__ ==
# "<stdin>"``, which spawn re-ran in the child and died on (FileNotFoundError) before any of ours ran:
# "died unexpectedly ... without reporting an error".
STDIN_SCRIPT = """
import time
from trainer.config.async_grpo_config import AsyncGRPOConfig
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.process import start_rollout_process
{reward}
config = AsyncGRPOConfig(output_dir="out", use_cpu=True, vllm_server_base_url="http://127.0.0.1:9")
try:
    handle = start_rollout_process(
        AsyncRolloutLoop, config=config, model_name="m", dataset=[{{"prompt": "hi"}}],
        reward_funcs=[reward], processing_class=None, eos_token_ids=[0],
    )
except RuntimeError as exc:
    print("REFUSED:", exc)
    raise SystemExit(0)
started = handle.channels.heartbeat_value.value
deadline = time.monotonic() + 120  # a hang guard: the child's imports take a few seconds
while time.monotonic() < deadline and handle.channels.heartbeat_value.value <= started:
    try:
        handle.check_health()
    except RuntimeError as exc:
        print("FAILURE:", exc)
        break
    time.sleep(0.2)
else:
    print("RUNNING" if handle.channels.heartbeat_value.value > started else "HANG")
handle.stop(grace_s=1)
"""


def _run_from_stdin(tmp_path, reward: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(STDIN_SCRIPT.format(reward=reward)),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done.stdout + done.stderr[-2000:]


def test_a_reward_defined_in_a_stdin_script_is_refused_before_spawning_with_the_fix(tmp_path):
    out = _run_from_stdin(tmp_path, "def reward(completions, **kwargs):\n    return [0.0] * len(completions)")
    assert "REFUSED: reward is defined in a script read from '<stdin>'" in out, out
    assert "save the script to a file" in out and 'if __name__ == "__main__":' in out


def test_a_stdin_script_whose_callables_live_in_modules_starts_its_rollout_process(tmp_path):
    out = _run_from_stdin(tmp_path, "from trainer.rewards import accuracy_reward as reward")
    assert "RUNNING" in out and "FAILURE" not in out, out
