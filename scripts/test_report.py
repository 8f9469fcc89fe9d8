"""The end of ``make test``: the slowest tests of every pytest phase and the test time, read from the
phases' JUnit XML files (``--junitxml``), so one list covers the xdist phase and the faults phase.

    python scripts/test_report.py var/test-report --slowest 15
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read_cases(folder: Path) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome) of every test case in ``folder/*.xml`` (setup + call + teardown)."""
    cases = []
    for path in sorted(folder.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[child.tag]
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases.append((float(case.get("time") or 0.0), name, outcome))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    args = parser.parse_args(argv)
    cases = read_cases(args.folder)
    if not cases:
        print(f"test report: no JUnit XML in {args.folder}")
        return 0
    print(f"===== {args.slowest} slowest tests (setup + call + teardown, all phases) =====")
    for seconds, name, outcome in sorted(cases, reverse=True)[: args.slowest]:
        print(f"{seconds:8.1f}s  {name}  [{outcome}]")
    counts = Counter(outcome for _, _, outcome in cases)
    total = sum(s for s, _, _ in cases)
    print(
        f"{len(cases)} tests ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}); {total:.0f} s of test time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
