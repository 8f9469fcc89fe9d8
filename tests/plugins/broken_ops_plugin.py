"""A GRPO_PLUGIN_MODULES module whose register() fails (tests: listed as broken, nothing else lost)."""


def register(add) -> None:
    raise RuntimeError("the licence server is down")
