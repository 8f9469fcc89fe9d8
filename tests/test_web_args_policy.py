"""What a web-launched run may set in ``args``: nothing that makes the worker fetch or import code.

``model_init_kwargs.attn_implementation`` takes, in transformers, a hub kernel repo
(``org/repo@rev:fn``) that ``kernels`` downloads and imports; the web accepts local implementations
only, plus the operator's ``GRPO_ALLOWED_ATTN_IMPLEMENTATIONS``. ``torch_compile_backend`` is limited
to torch's own backends. The CLI (an engineer's own machine) keeps accepting anything.
"""

from __future__ import annotations

import pytest

from controlplane.runs.validation import run_document_validate
from trainer.config.run_config import RunConfigError


def _doc(**args) -> dict:
    return {
        "model": "tiny",
        "train_dataset": "arithmetic-small",
        "reward_funcs": ["trainer.rewards.accuracy_reward"],
        "args": {"max_steps": 2, **args},
    }


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex_attention"])
def test_local_attention_implementations_are_accepted(impl):
    run_document_validate(document=_doc(model_init_kwargs={"attn_implementation": impl}))


@pytest.mark.parametrize(
    "impl", ["kernels-community/flash-attn@main:flash_attention", "acme/evil", "flash_attention_2", ""]
)
def test_hub_kernels_and_unlisted_implementations_are_refused_naming_the_setting(impl):
    with pytest.raises(RunConfigError) as refused:
        run_document_validate(document=_doc(model_init_kwargs={"attn_implementation": impl}))
    message = refused.value.errors["args.model_init_kwargs.attn_implementation"]
    assert "GRPO_ALLOWED_ATTN_IMPLEMENTATIONS" in message, message


def test_an_operator_allows_an_installed_implementation(settings):
    settings.GRPO_ALLOWED_ATTN_IMPLEMENTATIONS = ["flash_attention_2"]
    run_document_validate(document=_doc(model_init_kwargs={"attn_implementation": "flash_attention_2"}))
    with pytest.raises(RunConfigError):
        run_document_validate(document=_doc(model_init_kwargs={"attn_implementation": "acme/evil@v1:fn"}))


def test_the_json_string_form_of_model_init_kwargs_is_checked_too():
    with pytest.raises(RunConfigError) as refused:
        run_document_validate(document=_doc(model_init_kwargs='{"attn_implementation": "acme/evil"}'))
    assert "args.model_init_kwargs.attn_implementation" in refused.value.errors


def test_compile_backends_are_torchs_own():
    run_document_validate(document=_doc(torch_compile=True, torch_compile_backend="inductor"))
    with pytest.raises(RunConfigError) as refused:
        run_document_validate(document=_doc(torch_compile=True, torch_compile_backend="acme_backend"))
    assert "args.torch_compile_backend" in refused.value.errors


SSTI = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chat_template": SSTI}, "chat_template"),  # issue 29 item 4: a template from the web
        ({"tools": [{"name": "x"}]}, "tools"),
        ({"enable_thinking": SSTI}, "enable_thinking"),
        ({"enable_thinking": {"nested": True}}, "enable_thinking"),
        ({"bad key": True}, "bad key"),
        ({"note": "x" * 257}, "note"),
    ],
)
def test_chat_template_kwargs_carry_only_flags_the_template_reads(kwargs, field):
    for form in (kwargs, __import__("json").dumps(kwargs)):  # the JSON-string form too
        with pytest.raises(RunConfigError) as refused:
            run_document_validate(document=_doc(chat_template_kwargs=form))
        assert f"args.chat_template_kwargs.{field}" in refused.value.errors, refused.value.errors


def test_plain_chat_template_flags_are_accepted():
    flags = {"enable_thinking": False, "reasoning_effort": "low", "budget": 2, "x": None}
    run_document_validate(document=_doc(chat_template_kwargs=flags))
