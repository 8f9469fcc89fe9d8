"""Reads for comparing runs: the runs a user may compare, the metrics to offer, the config diff."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from controlplane.runs.models import (
    Run,
)
from controlplane.runs.selectors.metrics import metric_info, metric_names
from controlplane.runs.selectors.runs import run_list
from trainer.reporting.metrics import LOSS, NAMESPACES, REWARD


def compare_runs_get(*, user: Any, ids: list[int]) -> tuple[list[Run], list[int]]:
    """The runs of ``ids`` that ``user`` may see, in the order asked (duplicates once), and the ids
    that are not among them (absent or someone else's: the same answer, so nothing leaks)."""
    unique = list(dict.fromkeys(ids))
    found = {run.pk: run for run in run_list(user=user).filter(pk__in=unique)}
    return [found[i] for i in unique if i in found], [i for i in unique if i not in found]


def compare_default_metrics(*, names: list[str]) -> list[str]:
    """What the comparison charts when no metric is chosen: ``reward`` and ``loss`` (those of them
    logged, once any is); else the first two names logged; with nothing logged yet, both (a live
    run's first points then land on them)."""
    preferred = [name for name in (REWARD, LOSS) if name in names]
    return preferred or names[:2] or [REWARD, LOSS]


def compare_metric_choices(*, runs: list[Run]) -> list[dict[str, Any]]:
    """Every metric any of ``runs`` logged, grouped for a picker:
    ``[{"namespace": "train", "metrics": [{"name", "namespace", "help"}, ...]}, ...]``, the
    namespaces in the catalogue's reading order (unknown ones after, alphabetically), names sorted."""
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for name in metric_names(runs=runs):
        info = metric_info(name)
        groups[info["namespace"]].append(info)
    order = {namespace: i for i, namespace in enumerate(NAMESPACES)}
    keys = sorted(groups, key=lambda ns: (order.get(ns, len(order)), ns))
    return [{"namespace": ns, "metrics": groups[ns]} for ns in keys]


_MISSING = object()


def config_flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A run document as ``{dotted path: leaf value}``: mappings are walked (``args.learning_rate``);
    lists holding mappings or lists are walked by index (``tools[0].name``); a list of plain values
    (``reward_funcs``), an empty mapping and a scalar are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(config_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        out = {}
        for index, item in enumerate(value):
            out.update(config_flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix or "(config)": value}


def _config_value_key(value: Any) -> str:
    """What two leaves are compared by: their JSON, so ``true`` and ``1`` differ while ``1`` and
    ``1.0`` (one number, as YAML and the trainer read it) do not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True, default=str)


def run_config_diff(*, runs: list[Run]) -> list[dict[str, Any]]:
    """The compared runs' documents key by key: one row per flattened path (:func:`config_flatten`)
    any of them has, sorted by path: ``{"key": "args.learning_rate", "values": [v_run0, v_run1, ...],
    "present": [bool, ...], "differs": bool}``; ``values`` follows ``runs``' order (None where a run
    lacks the key: ``present`` tells that from a null). A key is ``differs`` when the runs do not
    all have it with one value; with fewer than two runs nothing differs."""
    flat = [config_flatten(run.config) for run in runs]
    keys = sorted({key for doc in flat for key in doc})
    rows = []
    for key in keys:
        leaves = [doc.get(key, _MISSING) for doc in flat]
        # None stands for "absent" (a JSON text is never None), so absent differs from null
        distinct = {None if v is _MISSING else _config_value_key(v) for v in leaves}
        rows.append(
            {
                "key": key,
                "values": [None if v is _MISSING else v for v in leaves],
                "present": [v is not _MISSING for v in leaves],
                "differs": len(distinct) > 1,
            }
        )
    return rows
