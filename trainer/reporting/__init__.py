"""What a run reports: its metrics, where they go, and how they are read.

- :mod:`.metrics`: the metric catalogue (every metric declared once) and the window that reduces them;
- :mod:`.sinks`: where the trainer's records go (:class:`~trainer.reporting.sinks.Sink`, ``JsonlSink``);
- :mod:`.perf`: FLOPs estimates and MFU for the ``perf/*_mfu`` metrics;
- :mod:`.progress`: the terminal progress bar;
- :mod:`.diagnosis`: the spec's diagnosis tables applied to a run's live metrics, with
  :mod:`.diagnosis_words` (each verdict's title, severity and advice).
"""
