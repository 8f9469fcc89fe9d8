"""The CPU trainer's share of a host it shares with a local vLLM server (``trainer/processes/host.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from trainer.processes.host import THREADS_ENV, share_cpu_with_local_server


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    yield
    torch.set_num_threads(before)


def test_local_server_on_cpu_takes_half_the_cores():
    torch.set_num_threads(os.cpu_count() or 1)
    expected = max(1, (os.cpu_count() or 1) // 2)
    assert share_cpu_with_local_server("http://127.0.0.1:8000", uses_cuda=False) == expected
    assert torch.get_num_threads() == expected
    assert share_cpu_with_local_server("http://localhost:9/v1", uses_cuda=False) == expected


@pytest.mark.parametrize(
    "url, cuda", [("http://vllm.internal:8000", False), ("http://127.0.0.1:8000", True), (None, False)]
)
def test_remote_server_gpu_trainer_or_no_server_is_left_alone(url, cuda):
    torch.set_num_threads(2)
    assert share_cpu_with_local_server(url, uses_cuda=cuda) is None
    assert torch.get_num_threads() == 2


def test_an_explicit_choice_wins(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert share_cpu_with_local_server("http://127.0.0.1:8000", uses_cuda=False) is None
    monkeypatch.setenv(THREADS_ENV, "2")
    assert share_cpu_with_local_server("http://127.0.0.1:8000", uses_cuda=False) == 2
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_thread_count_names_the_setting(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match=THREADS_ENV):
        share_cpu_with_local_server("http://127.0.0.1:8000", uses_cuda=False)
