"""`python -m gpupipe_schemas.codegen [--check]`: regenerate the contract's code, or check it."""

from __future__ import annotations

import argparse
import sys

from gpupipe_schemas.codegen import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpupipe_schemas.codegen", description="Generate code from schemas/*.avsc."
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming each stale generated file"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = run.stale()
            for path in stale:
                print(f"{path}: stale, regenerate with {run.REGENERATE}", file=sys.stderr)
            return 1 if stale else 0
        for path in run.write():
            print(f"wrote {path}")
    except (ValueError, OSError) as exc:  # a schema the emitters refuse, an unreadable file
        print(f"codegen: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
