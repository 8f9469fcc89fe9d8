"""The trainer log's "log" events: whole records, tracebacks kept whole, httpx request lines left out.

Unit tests of worker.log_records on log text as trainer/processes/cli.py's format writes it, and the supervisor's
log event over a real child process that logs like the trainer (real Postgres).
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.runs import services
from controlplane.runs.models import Run, RunEvent, RunEventKind
from worker.log_records import TAIL_LINES, cut_records, event_message, failure_sentence, log_tail
from worker.processes import ManagedProcess
from worker.supervisor import RunSupervisor

HTTPX = '2026-12-02 16:34:52,237 INFO httpx: HTTP Request: POST http://127.0.0.1:8100/pause?mode=keep "HTTP/1.1 200 OK"'
STEP = "2026-12-02 16:34:52,300 INFO trainer.trainer: step 3: loss 0.47"
ERROR = "2026-12-02 16:34:53,000 ERROR trainer.rollout: reward function failed"
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/work/trainer/rewards.py", line 12, in accuracy_reward',
    "    return float(parse(completion) == answer)",
    "ValueError: could not convert string to float: 'x'",
]


def text(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def test_records_keep_a_logged_traceback_with_its_record_and_drop_httpx_lines():
    cut = cut_records(text(HTTPX, STEP, ERROR, *TRACEBACK, HTTPX, STEP))
    assert cut.records == [[HTTPX], [STEP], [ERROR, *TRACEBACK], [HTTPX], [STEP]]
    assert event_message(cut.records) == "\n".join([STEP, ERROR, *TRACEBACK, STEP])


def test_a_partial_line_and_an_open_traceback_wait_for_the_next_read():
    data = text(STEP, ERROR, *TRACEBACK[:2])  # the frames so far, not the exception line
    cut = cut_records(data + b"2026-12-02 16:34:54,000 INFO tr")
    assert cut.records == [[STEP]]
    assert cut.used_bytes == len(text(STEP))  # the next read starts at the ERROR record
    rest = data[cut.used_bytes :] + text(*TRACEBACK[2:], STEP)
    assert cut_records(rest).records == [[ERROR, *TRACEBACK], [STEP]]
    # the trainer exited: what is there is all there will be
    assert cut_records(data, final=True).records == [[STEP], [ERROR, *TRACEBACK[:2]]]


def test_chained_tracebacks_and_uncaught_ones_are_one_record():
    chained = [
        *TRACEBACK,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *TRACEBACK,
    ]
    cut = cut_records(text(STEP, *chained, "plain print line"))
    # after an INFO record the traceback is the process's own (uncaught), a record of its own
    assert cut.records == [[STEP], [line for line in chained if line], ["plain print line"]]


def test_event_keeps_the_latest_whole_records_and_every_traceback():
    steps = [f"2026-12-02 16:35:{i:02d},000 INFO trainer.trainer: step {i}" for i in range(40)]
    records = cut_records(text(ERROR, *TRACEBACK, *steps)).records
    message = event_message(records).split("\n")
    assert message[: 1 + len(TRACEBACK)] == [ERROR, *TRACEBACK]  # older, but a traceback: kept whole
    assert message[-1] == steps[-1] and len(message) == 1 + len(TRACEBACK) + 20
    assert event_message([[HTTPX], [HTTPX]]) == ""  # only noise: no event


def test_non_utf8_bytes_do_not_shift_the_offset():
    data = b"2026-12-02 16:34:52,300 INFO trainer.trainer: caf\xe9\n" + b"partial \xff"
    cut = cut_records(data)
    assert cut.records == [["2026-12-02 16:34:52,300 INFO trainer.trainer: caf\ufffd"]]
    assert data[cut.used_bytes :] == b"partial \xff"


def test_log_tail_for_failure_reasons_ends_on_the_whole_traceback_without_httpx_lines():
    uncaught = [*TRACEBACK[:-1], "RuntimeError: boom"]
    steps = [f"2026-12-02 16:35:{i:02d},000 INFO trainer.trainer: step {i}" for i in range(30)]
    data = text(ERROR, *TRACEBACK, *[line for step in steps for line in (step, HTTPX)], *uncaught)
    tail = log_tail(data, max_lines=10).split("\n")
    assert tail[-len(uncaught) :] == uncaught and HTTPX not in tail
    assert tail[: 10 - len(uncaught)] == steps[-(10 - len(uncaught)) :]  # whole records up to 10 lines
    assert ERROR not in tail  # an older traceback is not what ended the process


# ==== one sentence for failure_reason ==============================================================
RECORDED = Path(__file__).resolve().parent / "data" / "vllm_max_tokens_refused.log"


def test_a_recorded_vllm_max_tokens_refusal_becomes_one_sentence_naming_the_field_and_the_limit(tmp_path):
    """Issue 28: the README's old REST example on the tiny model (max_completion_length left at 2048,
    the server at --max-model-len 1024) failed after ~90 s with a 40-line traceback as its reason.
    The trainer log recorded by tests/data/record_vllm_refusal.py (the real rollout process and
    client, vLLM's own 400) read as the supervisor reads it becomes one line naming the field to
    change and the server's limit."""
    log = tmp_path / "trainer.attempt-1.log"
    log.write_bytes(RECORDED.read_bytes())
    tail = ManagedProcess("trainer", ["true"], log_path=log).log_tail(TAIL_LINES)  # as _watch reads it
    assert "Traceback (most recent call last):" in tail  # what the events keep
    reason = failure_sentence(process="trainer", status="1", log_text=tail)
    assert "\n" not in reason and "Traceback" not in reason and len(reason) < 400, reason
    assert reason.startswith("trainer exited with status 1: vLLM refused a request for max_tokens 2048")
    assert "args.max_completion_length" in reason and "max_model_len of 1024 tokens" in reason, reason
    assert "resources.vllm.max_model_len" in reason, reason


def test_failure_sentences_name_the_cause_or_the_last_exception():
    older = (
        'HTTP 400: {"object":"error","message":"\'max_tokens\' or \'max_completion_tokens\' is too large: '
        "2048. This model's maximum context length is 1024 tokens and your request has 20 input tokens "
        '(2048 > 1024 - 20). None"}'
    )
    reason = failure_sentence(process="trainer", status="1", log_text=older)
    assert "with a prompt of 20 tokens" in reason and "to at most 1004" in reason, reason
    prompt = (
        "This model's maximum context length is 256 tokens. However, your prompt contains 300 input tokens"
    )
    reason = failure_sentence(process="trainer", status="1", log_text=prompt)
    assert "a prompt of 300 tokens" in reason and "resources.vllm.max_model_len" in reason, reason
    kv = "ValueError: To serve at least one request with the model's max seq len (32768), (4.0 GiB KV cache"
    reason = failure_sentence(process="vLLM server", status="1", log_text=kv)
    assert reason.startswith("vLLM server exited") and "resources.vllm.gpu_memory_utilization" in reason
    reason = failure_sentence(process="trainer", status="1", log_text=text(STEP, *TRACEBACK).decode())
    assert reason.endswith(
        "ValueError: could not convert string to float: 'x' (the traceback is in the run's events)"
    )
    killed = failure_sentence(process="trainer", status="137 (SIGKILL)", log_text=STEP)
    assert killed.startswith("trainer exited with status 137 (SIGKILL) without reporting an error"), killed
    hung = (
        "RuntimeError: rollout process (pid 7) is hung: no heartbeat for 301 s (rollout_worker_timeout=300 s)"
    )
    assert "args.rollout_worker_timeout" in failure_sentence(process="trainer", status="1", log_text=hung)


# ==== the supervisor's log event over a real child process =========================================
TRAINER_LIKE = textwrap.dedent(
    """
    import logging, os, sys, time
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1:8100/update_weights "HTTP/1.1 200 OK"')
    logging.getLogger("trainer.trainer").info("step 1: loss 0.51")
    try:
        float("x")
    except ValueError:
        logging.getLogger("trainer.rollout").exception("reward function failed")
    sys.stdout.write("2026-12-02 16:34:54,000 INFO trainer.trainer: step 2: lo")  # a record half written
    sys.stdout.flush()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sys.stdout.write("ss 0.47\\n")
    logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1:8100/resume "HTTP/1.1 200 OK"')
    """
)


@pytest.mark.django_db(transaction=True)
def test_supervisor_log_events_are_whole_records_without_httpx_lines(tmp_path):
    owner = get_user_model().objects.create_user(username="logs")
    doc = {
        "model": "tiny",
        "train_dataset": "arithmetic",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_completion_length": 128},
    }
    run, _ = services.run_create(owner=owner, name="logs", config=doc, launch=False)
    Run.objects.filter(pk=run.pk).update(celery_task_id="logs", launched_at=timezone.now())
    run = services.run_claim(run_id=run.pk, task_id="logs", worker_host="logs-host")
    supervisor = RunSupervisor(run)
    supervisor.out = tmp_path
    go = tmp_path / "go"
    log = tmp_path / "trainer.attempt-1.log"
    trainer = ManagedProcess("trainer", [sys.executable, "-c", TRAINER_LIKE, str(go)], log_path=log).start()
    supervisor.trainer = trainer
    try:
        deadline = time.monotonic() + 30
        while b"step 2: lo" not in log.read_bytes():
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.05)
        supervisor._next_log_event = 0.0
        supervisor._maybe_log_event()
        first = RunEvent.objects.get(run_id=run.pk, kind=RunEventKind.LOG).message
        assert "HTTP Request" not in first  # still in the log file
        assert "HTTP Request" in log.read_text()
        assert first.split("\n")[0].endswith("INFO trainer.trainer: step 1: loss 0.51")
        assert first.split("\n")[1].endswith("ERROR trainer.rollout: reward function failed")
        assert first.split("\n")[2] == "Traceback (most recent call last):"
        assert first.split("\n")[-1] == "ValueError: could not convert string to float: 'x'"
        assert "step 2" not in first  # half a record waits

        go.touch()
        assert trainer.proc.wait(timeout=30) == 0
        supervisor._next_log_event = 0.0
        supervisor._maybe_log_event()
        events = [
            e.message for e in RunEvent.objects.filter(run_id=run.pk, kind=RunEventKind.LOG).order_by("id")
        ]
        assert len(events) == 2
        assert events[1] == "2026-12-02 16:34:54,000 INFO trainer.trainer: step 2: loss 0.47"
        supervisor._next_log_event = 0.0
        supervisor._maybe_log_event()  # only an httpx line was left: nothing new to say
        assert RunEvent.objects.filter(run_id=run.pk, kind=RunEventKind.LOG).count() == 2
        # the exit event's and failure reason's tail: whole records, no httpx line
        tail = trainer.log_tail(40)
        assert "HTTP Request" not in tail and tail.endswith("step 2: loss 0.47")
        assert "Traceback (most recent call last):" in tail
    finally:
        trainer.stop()
