"""The example plugin registered without packaging: ``GRPO_PLUGIN_MODULES=acme_grpo.plugin`` with the
package importable (README, "Your own rewards, data and models"; tests/test_doc_examples.py)."""


def register(add) -> None:
    """The names the package's entry points declare, through the registry's ``add``."""
    add("reward_func", "acme_grpo.rewards:exact_answer")
    add("dataset", "acme_grpo.data:sums", name="acme-sums")
