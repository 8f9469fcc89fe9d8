"""Server-rendered pages: run list, the run form, the run dashboard, run comparison (login required)."""

from __future__ import annotations

import json
import re

import yaml
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST, require_safe

from controlplane.runs import downloads, presets, selectors, services
from controlplane.runs.api import RunCreateThrottle
from controlplane.runs.forms import RunForm
from controlplane.runs.models import RunStatus
from controlplane.runs.serializers import CompareQuerySerializer, RunListQuerySerializer
from trainer.config.run_config import RunConfigError

# The run list's sortable columns: (?ordering= key, header).
RUN_LIST_COLUMNS = (
    ("id", "#"),
    ("name", "name"),
    ("status", "status"),
    ("step", "progress"),
    ("owner", "owner"),
    ("model", "model"),
    ("dataset", "dataset"),
    ("created", "created"),
    ("finished", "finished"),
)


@login_required
def run_list_view(request: HttpRequest) -> HttpResponse:
    """Runs filtered, searched, sorted and paginated on the server with the API's parameters
    (``?status=&owner=&model=&dataset=&tag=&q=&ordering=&page=``), so a filtered list is a link;
    its script polls its rows (``?id=``) on ``GET /api/v1/runs/`` for status and progress."""
    services.runs_fail_stale()
    query = RunListQuerySerializer(data=request.GET)
    valid = query.is_valid()
    filters = query.filters() if valid else {"ordering": "-created"}
    runs = selectors.run_list_search(user=request.user, **filters)
    page = Paginator(runs, settings.GRPO_RUN_LIST_PAGE_SIZE).get_page(request.GET.get("page"))
    shown = list(page.object_list)
    for run in shown:
        run.max_steps = selectors.run_max_steps(run=run)
    ordering = filters["ordering"]
    # The script polls the rows shown by id, not the filters: a run that leaves the filter (a
    # status filter and a run that finishes) is updated in place rather than frozen.
    poll = QueryDict(mutable=True)
    poll["id"], poll["page_size"] = ",".join(str(run.pk) for run in shown), str(len(shown))
    columns = [
        {
            "key": key,
            "label": label,
            # a click on the sorted column reverses it; on another, sorts by it ascending
            "next": "-" + key if ordering == key else key,
            "arrow": "▲" if ordering == key else "▼" if ordering == "-" + key else "",
        }
        for key, label in RUN_LIST_COLUMNS
    ]
    context = {
        "page": page,
        "runs": shown,
        "columns": columns,
        "query": request.GET,
        "query_errors": {} if valid else query.errors,
        "statuses": RunStatus.values,
        "poll_url": reverse("runs-api:run-list") + "?" + poll.urlencode() if shown else "",
        "filtered": any(v for k, v in filters.items() if k != "ordering"),
    }
    return render(request, "runs/run_list.html", context, status=200 if valid else 400)


@login_required
def run_compare_view(request: HttpRequest) -> HttpResponse:
    """Runs side by side (``?runs=3,5,8&metrics=reward,loss``; the run list's ``?run=3&run=5`` and
    the older ``?metric=reward`` too): one chart per metric overlaying the runs, the config keys that
    differ, and, while a run is active, its new points over its websocket (the page's script)."""
    query = CompareQuerySerializer(
        data={
            "runs": ",".join(request.GET.getlist("runs") + request.GET.getlist("run")),
            "metrics": ",".join(request.GET.getlist("metrics") + request.GET.getlist("metric")),
        }
    )
    valid = query.is_valid()
    ids = query.validated_data.get("runs", []) if valid else []
    runs, missing = selectors.compare_runs_get(user=request.user, ids=ids)
    names = selectors.metric_names(runs=runs)
    chosen = (query.validated_data.get("metrics") if valid else None) or selectors.compare_default_metrics(
        names=names
    )
    diff = selectors.run_config_diff(runs=runs)
    differing = [row for row in diff if row["differs"]]
    page = {  # what compare.js draws and subscribes to (json_script: no HTML is built from it)
        "runs": [
            {
                "id": run.pk,
                "label": f"#{run.pk} {run.name}".strip(),
                "status": run.status,
                "api": reverse("runs-api:run-detail", args=[run.pk]),
                "ws": f"/ws/runs/{run.pk}/",
            }
            for run in runs
        ],
        "metrics": [selectors.metric_info(name) for name in chosen],
    }
    context = {
        "runs": runs,
        "missing": missing,
        "query_errors": {} if valid else query.errors,
        "chosen": chosen,
        "metrics_param": ",".join(chosen),
        "run_ids": ",".join(str(run.pk) for run in runs),
        "choices": selectors.compare_metric_choices(runs=runs),
        "unlogged": [name for name in chosen if name not in names],
        "page": page,
        "diff_rows": [_diff_row(row) for row in diff],
        "diff_keys": len(diff),
        "diff_differing": len(differing),
        "max_runs": settings.GRPO_COMPARE_MAX_RUNS,
    }
    return render(request, "runs/run_compare.html", context, status=200 if valid else 400)


def _diff_row(row: dict) -> dict:
    """A config diff row as the page shows it: each cell's text (strings bare, the rest as JSON)
    or "absent"."""
    cells = [
        {
            "text": (value if isinstance(value, str) else json.dumps(value)) if present else "absent",
            "present": present,
        }
        for value, present in zip(row["values"], row["present"], strict=True)
    ]
    return {"key": row["key"], "differs": row["differs"], "cells": cells}


@login_required
def run_create_view(request: HttpRequest) -> HttpResponse:
    """The run form: prefilled from the chosen model's preset, or from a run the user may see
    (``?clone=<id>``, else 404); a POST with errors re-renders what was typed with every error."""
    posted = request.method == "POST"
    prefill = presets.RunFormPrefill(initial={}) if posted else _run_form_prefill(request)
    form = RunForm(request.POST or None, initial=prefill.initial)
    status = 400
    throttle = RunCreateThrottle()
    if posted and not throttle.allow_request(request, None):
        form.is_valid()  # keep what was typed, with its errors
        form.add_error(None, f"Too many runs created; try again in {int(throttle.wait() or 1)} s.")
        status = 429
    elif posted and form.is_valid():
        try:
            run, _ = services.run_create(
                owner=request.user, name=form.cleaned_data.get("name") or "", config=form.document()
            )
        except RunConfigError as exc:
            form.add_config_errors(exc.errors)
        except (services.QueuedRunsLimit, services.RunCreateRateLimit) as exc:
            form.add_error(None, str(exc))
            status = 429
        else:
            messages.success(request, f"Run {run.pk} queued.")
            return redirect("runs:detail", run_id=run.pk)
    elif posted:
        # Some fields did not clean: nothing is created, but the rest of the document is checked so
        # that every error shows at once (each beside its field).
        try:
            services.run_config_validate(config=form.draft_document(), owner=request.user)
        except RunConfigError as exc:
            form.add_config_errors(exc.errors)
    context = {
        "form": form,
        "main_fields": [form[name] for name in form.main_arg_names],
        "eval_fields": [form[name] for name in form.eval_names],
        # the evaluation section opens when the run names an eval set or one of its fields has an error
        "eval_open": bool(form["eval_dataset"].value()) or any(form[name].errors for name in form.eval_names),
        "presets": presets.form_presets(),
        "prefill": prefill,
        "vllm_servers": sorted(settings.GRPO_VLLM_SERVERS),
        "run_pools": settings.GRPO_RUN_POOLS,
    }
    return render(request, "runs/run_form.html", context, status=status if posted else 200)


def _run_form_prefill(request: HttpRequest) -> presets.RunFormPrefill:
    """``?clone=<id>``: that run's config (404 unless the user may see it); with ``&checkpoint=<step>``
    its checkpoint of that step as the model (404 when the run has none); else the default preset."""
    clone = request.GET.get("clone")
    checkpoint = request.GET.get("checkpoint")
    if clone is None:
        if checkpoint is not None:
            raise Http404("checkpoint goes with clone=<run id>")
        return presets.run_new_prefill()
    if not re.fullmatch(r"[0-9]{1,18}", clone):
        raise Http404("clone must be a run id")
    run = selectors.run_get(user=request.user, run_id=int(clone))
    if checkpoint is None:
        return presets.run_clone_prefill(run=run)
    if not re.fullmatch(r"[0-9]{1,9}", checkpoint):
        raise Http404("checkpoint must be a step")
    saved = selectors.run_checkpoint_get(run_id=run.pk, step=int(checkpoint))
    if saved is None:
        raise Http404(f"run {run.pk} has no checkpoint at step {checkpoint}")
    return presets.run_checkpoint_prefill(run=run, checkpoint=saved, user=request.user)


@login_required
def run_detail_view(request: HttpRequest, run_id: int) -> HttpResponse:
    services.runs_fail_stale()
    run = selectors.run_get(user=request.user, run_id=run_id)
    # The dashboard script loads metrics, completions, events and the diagnosis over REST and then
    # follows the run's websocket; the page itself carries only what does not change while it runs.
    context = {
        "run": run,
        "max_steps": selectors.run_max_steps(run=run),
        "config_yaml": yaml.safe_dump(run.config, sort_keys=False),
        "checkpoints": selectors.run_checkpoint_list(run=run),
        # tags and note: the owner edits them (PATCH /api/v1/runs/<id>/); staff only read others'
        "can_edit": run.owner_id == request.user.pk,
        "max_tags": settings.GRPO_RUN_MAX_TAGS,
        "max_note_chars": settings.GRPO_RUN_NOTE_MAX_CHARS,
        "compare_max_runs": settings.GRPO_COMPARE_MAX_RUNS,  # "compare with…": this run + the others
        # the completions table: its search box's limit and groups per page (static/runs/completion_panel.js)
        "completion_search_max": settings.GRPO_COMPLETION_SEARCH_MAX_CHARS,
        "completion_groups_page": settings.GRPO_COMPLETION_GROUPS_PAGE_SIZE,
        # an eval_dataset or eval completions: the Training/Eval switch, the eval charts pinned by default
        "has_eval": selectors.run_has_eval(run=run),
    }
    return render(request, "runs/run_detail.html", context)


@login_required
@require_safe
def run_checkpoint_download_view(request: HttpRequest, run_id: int, step: int) -> HttpResponseBase:
    """The checkpoint folder as a streamed tar, for the run's owner only (404 for anyone else). A
    folder not on this host (a worker elsewhere), or outside the run's output directory, is a 404
    that says so."""
    return downloads.checkpoint_owned_response(request=request, user=request.user, run_id=run_id, step=step)


@login_required
@require_POST
def run_stop_view(request: HttpRequest, run_id: int) -> HttpResponse:
    run = selectors.run_get(user=request.user, run_id=run_id)
    try:
        services.run_stop(run=run)
        messages.info(request, "Stop requested.")
    except services.RunStateError as exc:
        messages.error(request, str(exc))
    return redirect("runs:detail", run_id=run.pk)


@login_required
@require_POST
def run_resume_view(request: HttpRequest, run_id: int) -> HttpResponse:
    run = selectors.run_get(user=request.user, run_id=run_id)
    try:
        services.run_resume(run=run)
        messages.info(request, "Resume queued.")
    except services.RunStateError as exc:
        messages.error(request, str(exc))
    return redirect("runs:detail", run_id=run.pk)
