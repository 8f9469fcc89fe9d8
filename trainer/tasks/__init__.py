"""Built-in procedural tasks (no downloads): datasets the embedded tiny model is trained on."""

from trainer.tasks.arithmetic import arithmetic_rows

__all__ = ["arithmetic_rows"]
