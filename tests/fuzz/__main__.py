"""The fuzzer from the command line: rerun one case, or a long run for release checks.

    python -m tests.fuzz --seed 1234                  # rerun case 1234, print it and its outcome
    python -m tests.fuzz --case duplicated_token      # a named case (tests/fuzz/corpus.py)
    python -m tests.fuzz --seed 1234 --write x.gguf   # only write the case's file
    python -m tests.fuzz --cases 20000 --jobs 2       # cases from a random start, failures printed

Run from the repository root. Exits with status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.cases import random_case
from tests.fuzz.corpus import NAMED_CASES
from tests.fuzz.harness import DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S, ForkServer, Result, case_call
from tests.fuzz.seeds import load_seeds
from tests.support.test_cache import use_test_cache


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, action="append", default=[], help="run this case (repeatable)")
    parser.add_argument("--case", action="append", default=[], choices=sorted(NAMED_CASES),
                        help="run this named case (repeatable)")
    parser.add_argument("--cases", type=int, default=0, help="run this many cases, numbered from --start")
    parser.add_argument("--start", type=int, help="the first case's number (default: random)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case")
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_BYTES,
                        help="address-space bytes per case")
    parser.add_argument("--write", type=Path, help="write the one case's file here instead of running it")
    return parser.parse_args(argv)


def _cases(args: argparse.Namespace) -> list[int | str]:
    start = args.start if args.start is not None else random.randrange(2**32)
    if args.cases:
        print(f"cases {start}..{start + args.cases - 1}")
    return [*args.seed, *args.case, *range(start, start + args.cases)]


def _write(case: int | str, path: Path, seeds_folder: str) -> None:
    seeds = load_seeds(seeds_folder)
    chosen = random_case(case, seeds) if isinstance(case, int) else NAMED_CASES[case]
    path.write_bytes(chosen.build(seeds))
    print(f"{path}: {chosen}")


def _run(cases: list[int | str], args: argparse.Namespace, seeds_folder: str, work: str) -> list[Result]:
    failures, started, verbose = [], time.monotonic(), not args.cases
    with ForkServer(seeds_folder, work) as server:
        calls = [case_call(seeds_folder, case) for case in cases]
        for done, result in enumerate(server.run(calls, jobs=args.jobs, timeout_s=args.timeout,
                                                 memory_bytes=args.memory), 1):
            if result.failed or verbose:
                print(result.report(), flush=True)
            failures += [result] if result.failed else []
            if done % 500 == 0:
                print(f"{done} cases, {len(failures)} failed, {time.monotonic() - started:.0f} s", flush=True)
    print(f"{len(cases)} cases in {time.monotonic() - started:.1f} s: {len(failures)} failed"
          + "".join(f"\n  {failure.label}: {failure.status}" for failure in failures))
    return failures


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    use_test_cache()  # no case measures the machine, nor writes in the user's cache
    cases = _cases(args)
    if not cases:
        sys.exit("give --seed, --case or --cases")
    with tempfile.TemporaryDirectory(prefix="tierflow-fuzz-") as folder:
        seeds_folder, work = f"{folder}/seeds", f"{folder}/work"
        Path(seeds_folder).mkdir()
        Path(work).mkdir()
        if args.write:
            if len(cases) != 1:
                sys.exit("--write takes one --seed or --case")
            _write(cases[0], args.write, seeds_folder)
            return
        if _run(cases, args, seeds_folder, work):
            sys.exit(1)


if __name__ == "__main__":
    main()
