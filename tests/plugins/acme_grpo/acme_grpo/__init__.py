"""Example GRPO plugin (tests)."""
