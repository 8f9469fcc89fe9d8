"""What users write on their runs besides the config: tags and a free-text note (editable at any
time, also while the run is live; the serializer validated them against the settings' limits)."""

from __future__ import annotations

from controlplane.runs.models import Run


def run_annotations_update(*, run: Run, tags: list[str] | None = None, note: str | None = None) -> Run:
    """Replace the run's ``tags`` (list of short strings, order kept) and/or ``note`` (text); a
    ``None`` argument leaves that field as it is. Only these columns are written, so a supervisor
    saving the same row at the same time keeps its status and heartbeat."""
    fields = []
    if tags is not None:
        run.tags = list(tags)
        fields.append("tags")
    if note is not None:
        run.note = note
        fields.append("note")
    if fields:
        run.save(update_fields=fields)
    return run
