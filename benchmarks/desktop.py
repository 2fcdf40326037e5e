"""What a desktop app that embeds tierflow pays: the import, the event loop's pauses, what a close leaves.

    python -m benchmarks.desktop [--repeats 5] [--cycles 10] [--threads 2] [--json]

Everything is measured in child processes (a fresh interpreter, as an app starts), each figure
against its baseline measured in the same run, and printed with its ratio to issue 50's target:
- import: `from tierflow import Engine`, its seconds and the peak RSS it adds to a bare interpreter
  (one that only reports its own peak), the median of --repeats each, and whether torch, llama.cpp
  or Triton came with it (none may); targets 0.5 s and 80 MiB. The children's wall times, bare and
  importing, are printed beside;
- pauses: the event loop's longest pause during each async call on the bundled model
  (tests/support/loop_lag.py: a task that sleeps 1 ms at a time), against its longest pause while
  idle for a second; target 20 ms. In a process that imported torch and llama.cpp first, as an app
  that minds a pause imports them at start-up; and the first aload of a process that had not, which
  imports them on its worker thread while Python holds its lock (a C extension initialising);
- threads: the threads and child processes still running a second after aclose, of an engine that
  loaded, chatted and embedded asynchronously, against those before its load; target none;
- memory: the RSS after each of --cycles load, chat and close cycles of the bundled model at its
  trained context (a KV cache of about 190 MB), against the first cycle's; target within 5 MiB.
"""

import argparse
import json
import statistics
import sys
import time

from tests.support.peak_memory import in_child

IMPORT_S, IMPORT_MIB, PAUSE_S, CYCLE_MIB = 0.5, 80, 0.020, 5
HEAVY = ("torch", "llama_cpp", "triton")
MIB = 1 << 20
TIMEOUT_S = 900

IMPORTING = f'''
import sys, time
started = time.perf_counter()
from tierflow import Engine
seconds = time.perf_counter() - started
report(seconds=seconds, peak=peak_rss(), heavy=[name for name in {HEAVY!r} if name in sys.modules])
'''

PAUSES = '''
import asyncio
if {imported_first}:
    import llama_cpp, torch
from tests.support.loop_lag import LoopLag, async_call_pauses

async def idle():
    async with LoopLag() as lag:
        await asyncio.sleep(1)
    return lag.longest_s

report(idle=asyncio.run(idle()), **asyncio.run(async_call_pauses(threads={threads}, context_length=512)))
'''

THREADS = '''
import asyncio, threading, time
import psutil
from tests.support.loop_lag import CHAT
from tierflow import Engine

before = set(threading.enumerate())

async def main():
    engine = await Engine.aload(threads={threads}, context_length=512)
    async for _ in engine.achat_stream(CHAT, max_tokens=8):
        pass
    await engine.aembed("a sentence")
    await engine.aclose()

asyncio.run(main())
time.sleep(1)
report(before=len(before), threads=[t.name for t in threading.enumerate() if t not in before],
       processes=len(psutil.Process().children()))
'''

CYCLES = '''
from tests.support.loop_lag import CHAT
from tierflow import Engine

closed = []
for _ in range({cycles}):
    with Engine.load(threads={threads}) as engine:
        engine.chat(CHAT, max_tokens=8)
    closed.append(rss())
report(closed=closed)
'''


def timed_child(body: str) -> tuple[dict, float]:
    """What the child reported, and its wall time in seconds."""
    started = time.perf_counter()
    reported = in_child(body, timeout=TIMEOUT_S)
    return reported, time.perf_counter() - started


def import_figures(repeats: int) -> dict:
    bare = [timed_child("report(peak=peak_rss())") for _ in range(repeats)]
    ours = [timed_child(IMPORTING) for _ in range(repeats)]
    peak = statistics.median(run["peak"] for run, _ in ours)
    added = peak - statistics.median(run["peak"] for run, _ in bare)
    seconds = statistics.median(run["seconds"] for run, _ in ours)
    heavy = sorted({name for run, _ in ours for name in run["heavy"]})
    return {"seconds": seconds, "added_bytes": added, "heavy": heavy,
            "bare_process_s": statistics.median(wall for _, wall in bare),
            "importing_process_s": statistics.median(wall for _, wall in ours),
            "seconds_ratio": seconds / IMPORT_S, "bytes_ratio": added / (IMPORT_MIB * MIB)}


def pause_figures(threads: int) -> dict:
    warm = in_child(PAUSES.format(imported_first=True, threads=threads), timeout=TIMEOUT_S)
    cold = in_child(PAUSES.format(imported_first=False, threads=threads), timeout=TIMEOUT_S)
    idle = warm.pop("idle")
    cold.pop("idle")
    return {"idle_s": idle, "calls_s": warm, "first_aload_s": cold["aload"],
            "ratios": {call: pause / PAUSE_S for call, pause in warm.items()}}


def memory_figures(cycles: int, threads: int) -> dict:
    closed = in_child(CYCLES.format(cycles=cycles, threads=threads), timeout=TIMEOUT_S)["closed"]
    grown = max(closed[1:], default=closed[0]) - closed[0]
    return {"closed_bytes": closed, "grown_bytes": grown, "ratio": grown / (CYCLE_MIB * MIB)}


def print_report(report: dict) -> None:
    imported = report["import"]
    print(f"from tierflow import Engine: {imported['seconds']:.3f} s ({imported['seconds_ratio']:.2f}x the "
          f"{IMPORT_S} s target), +{imported['added_bytes'] / MIB:.1f} MiB peak RSS over a bare interpreter "
          f"({imported['bytes_ratio']:.2f}x the {IMPORT_MIB} MiB target); heavy modules imported: "
          f"{', '.join(imported['heavy']) or 'none'}; process {imported['importing_process_s']:.2f} s "
          f"against {imported['bare_process_s']:.2f} s bare")
    pauses = report["pauses"]
    print(f"event loop's longest pause (idle: {pauses['idle_s'] * 1e3:.1f} ms; target {PAUSE_S * 1e3:.0f} "
          f"ms), torch and llama.cpp imported first:")
    for call, pause in pauses["calls_s"].items():
        print(f"  {call:<13}{pause * 1e3:>8.1f} ms {pauses['ratios'][call]:>6.2f}x the target")
    print(f"  the first aload of a process that had not imported them: "
          f"{pauses['first_aload_s'] * 1e3:.1f} ms")
    left = report["threads"]
    print(f"after aclose: {len(left['threads'])} threads left {left['threads']} (before the load: "
          f"{left['before']}), {left['processes']} child processes")
    memory = report["memory"]
    cycles = ", ".join(f"{rss / MIB:.1f}" for rss in memory["closed_bytes"])
    print(f"RSS after each load/close cycle, MiB: {cycles}; the most above the first: "
          f"{memory['grown_bytes'] / MIB:.1f} MiB ({memory['ratio']:.2f}x the {CYCLE_MIB} MiB target)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="imports timed, each way")
    parser.add_argument("--cycles", type=int, default=10, help="load/close cycles")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = {"import": import_figures(args.repeats), "pauses": pause_figures(args.threads),
              "threads": in_child(THREADS.format(threads=args.threads), timeout=TIMEOUT_S),
              "memory": memory_figures(args.cycles, args.threads)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    sys.exit(main())
