"""Command line: ``python -m trainer {tiny,serve,train} ...``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m trainer COMMAND ...

commands:
  tiny OUTDIR [--seed N] [--force]   write the embedded default model (no network)
  serve MODEL [--port N] [...]        start a vLLM server set up for training
  train --config RUN.yaml [--resume latest|PATH]
                                      run async GRPO training against a running server
"""


def _tiny(argv: list[str]) -> int:
    import argparse
    import json

    from trainer.tiny.build import build_tiny

    parser = argparse.ArgumentParser(
        prog="python -m trainer tiny", description="Write the embedded tiny model."
    )
    parser.add_argument("outdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if OUTDIR holds this build")
    args = parser.parse_args(argv)
    report = build_tiny(args.outdir, seed=args.seed, force=args.force)
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "tiny":
        return _tiny(rest)
    if command == "serve":
        from trainer.processes.serve import main as serve_main

        return serve_main(rest)
    if command == "train":
        from trainer.processes.cli import train_main

        return train_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
