"""Hub models and datasets: a repo id and revision resolved to a commit and a local snapshot.

The worker resolves what a run names before anything starts (``worker/supervisor.py``), so vLLM and
the trainer get a local directory and the run records the exact commit it trained on. Credentials
are the worker's own (``HF_TOKEN`` in its environment); a run document never carries one.
``HF_HUB_OFFLINE=1`` resolves from the local hub cache (``HF_HUB_CACHE``) only.

Failures come back as :class:`HubError` whose message says what happened in words (not found,
gated, offline and not cached, unknown revision), never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HubError",
    "Snapshot",
    "Sources",
    "cached_snapshot",
    "is_hub_id",
    "resolve_snapshot",
    "resolve_sources",
    "valid_revision",
]

# "org/name", the hub's own rule (huggingface_hub's validate_repo_id): letters, digits, "-", "_", "."
# with no "--" or "..", a part neither starting nor ending with "-" or "."; no path, no scheme. Whole
# strings only (fullmatch: "$" would let a trailing newline through).
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_REVISION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,198}[A-Za-z0-9_])?")


def is_hub_id(value: object) -> bool:
    """Whether ``value`` reads as a hub repo id (``org/name``), not a path or a URL."""
    return (
        isinstance(value, str)
        and _REPO_ID.fullmatch(value) is not None
        and ".." not in value
        and "--" not in value
    )


def valid_revision(value: object) -> bool:
    """A branch, tag or commit hash (no ``..`` or ``//``, no leading or trailing separator)."""
    return (
        isinstance(value, str)
        and _REVISION.fullmatch(value) is not None
        and ".." not in value
        and "//" not in value
    )


class HubError(RuntimeError):
    """Resolving a hub repo failed; the message is for people."""


@dataclass(frozen=True)
class Snapshot:
    """A resolved repo: the local directory of its files and the commit they are."""

    repo_id: str
    repo_type: str  # "model" or "dataset"
    revision: str  # as asked
    commit: str  # 40-hex commit hash
    path: Path

    def as_dict(self) -> dict[str, str]:
        return {
            "id": self.repo_id,
            "type": self.repo_type,
            "revision": self.revision,
            "commit": self.commit,
            "path": str(self.path),
        }


def resolve_snapshot(
    repo_id: str,
    *,
    repo_type: str = "model",
    revision: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Snapshot:
    """Download (or find in the cache, offline) ``repo_id`` at ``revision`` (default ``main``).

    ``progress`` gets human-readable lines as files arrive (throttled by the caller if it wishes).
    """
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    revision = revision or "main"
    what = f"{repo_type} {repo_id!r} at revision {revision!r}"
    kwargs = {"repo_id": repo_id, "repo_type": repo_type, "revision": revision}
    if progress is not None:
        kwargs["tqdm_class"] = _progress_tqdm(progress, what)
    try:
        path = Path(snapshot_download(**kwargs))
    except hub_errors.GatedRepoError:
        raise HubError(
            f"{what} is gated: accept its terms on the hub with the account whose token the worker has "
            "(HF_TOKEN in the worker's environment)"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise HubError(f"{what}: the revision does not exist (a branch, tag or commit of the repo)") from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(
            f"{what} was not found on the hub (404): check the id; a private repo needs HF_TOKEN in the "
            "worker's environment"
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        raise HubError(
            f"{what} is not in the worker's hub cache and the worker is offline (HF_HUB_OFFLINE=1 or no "
            "network); download it on the worker or allow it network access"
        ) from None
    except (hub_errors.HfHubHTTPError, OSError) as exc:
        raise HubError(
            f"{what} could not be fetched: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from None
    commit = path.name  # snapshots/<commit hash>
    if progress is not None:
        progress(f"{what} resolved to commit {commit} ({path})")
    return Snapshot(repo_id=repo_id, repo_type=repo_type, revision=revision, commit=commit, path=path)


def cached_snapshot(repo_id: str, *, repo_type: str = "model", revision: str | None = None) -> Path | None:
    """The local directory of ``repo_id`` at ``revision`` (default ``main``) from the hub cache alone,
    or None when it is not cached: nothing is fetched (the control plane's preflight reads what is
    there; the worker downloads what is not, later, with its own credentials)."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id=repo_id, repo_type=repo_type, revision=revision or "main", local_files_only=True
        )
    except Exception:  # not cached (LocalEntryNotFoundError), or an unreadable cache: not known here
        return None
    return Path(path)


def _progress_tqdm(report: Callable[[str], None], what: str):
    """A tqdm class that reports byte progress of the snapshot download as lines (at most every 5 s)."""
    import time

    from tqdm.auto import tqdm

    class ReportingTqdm(tqdm):
        _last = 0.0

        def update(self, n=1):
            out = super().update(n)
            now = time.monotonic()
            if now - ReportingTqdm._last >= 5 or (self.total and self.n >= self.total):
                ReportingTqdm._last = now
                total = f" of {self.total / 1e6:.1f} MB" if self.total else ""
                report(f"downloading {what}: {self.n / 1e6:.1f} MB{total}")
            return out

    return ReportingTqdm


@dataclass(frozen=True)
class Sources:
    """What a run's ``model``, ``train_dataset`` and ``eval_dataset`` name once hub ids are resolved:
    local snapshot directories in place of hub ids, and ``resolved`` =
    ``{"model"|"dataset"|"eval_dataset": Snapshot.as_dict()}``."""

    model: str
    dataset: str | None
    resolved: dict[str, dict[str, str]]
    eval_dataset: str | None = None


def resolve_sources(
    *,
    model: str,
    dataset: str | None,
    model_revision: str | None = None,
    dataset_revision: str | None = None,
    progress: Callable[[str], None] | None = None,
    eval_dataset: str | None = None,
    eval_dataset_revision: str | None = None,
) -> Sources:
    """Resolve whichever of ``model`` / ``dataset`` is a hub id (not a registered name, not an
    existing local path) to its snapshot; the rest pass through unchanged. Raises :class:`HubError`."""
    from trainer.plugins.registry import is_registered

    def is_remote(value: str | None, kind: str) -> bool:
        return is_hub_id(value) and not is_registered(kind, value) and not Path(value).exists()

    resolved: dict[str, dict[str, str]] = {}
    if is_remote(model, "model"):
        snapshot = resolve_snapshot(model, revision=model_revision, progress=progress)
        resolved["model"], model = snapshot.as_dict(), str(snapshot.path)
    if is_remote(dataset, "dataset"):
        snapshot = resolve_snapshot(
            dataset, repo_type="dataset", revision=dataset_revision, progress=progress
        )
        resolved["dataset"], dataset = snapshot.as_dict(), str(snapshot.path)
    if is_remote(eval_dataset, "dataset"):
        snapshot = resolve_snapshot(
            eval_dataset, repo_type="dataset", revision=eval_dataset_revision, progress=progress
        )
        resolved["eval_dataset"], eval_dataset = snapshot.as_dict(), str(snapshot.path)
    return Sources(model=model, dataset=dataset, resolved=resolved, eval_dataset=eval_dataset)
