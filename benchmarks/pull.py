"""`tierflow pull` against a plain download of the same bytes from the same local hub.

A pull hashes every byte (SHA-256), appends to a resumable `.incomplete` file and renames it into the
Hugging Face cache; the baseline is one streamed GET written to a file, nothing else. Both read from
tests/support/fake_hub.py on 127.0.0.1, so the ratio is pull's own cost, not the network's.

    python -m benchmarks.pull [--model FILE] [--repeats 3]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.fake_hub import FakeHub
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.offload.store.pull import pull


def plain_download(url: str, dest: Path) -> float:
    start = time.perf_counter()
    with httpx.stream("GET", url, timeout=60) as response, open(dest, "wb") as out:
        for chunk in response.iter_bytes():
            out.write(chunk)
    return time.perf_counter() - start


def pulled(name: str, cache: Path) -> float:
    start = time.perf_counter()
    pull(name, cache=cache)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=bundled_model_path())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = args.model.stat().st_size
    with FakeHub() as hub, tempfile.TemporaryDirectory() as folder:
        hub.add_repo("Bench/Model-GGUF", {"model-Q4_K_M.gguf": args.model})
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ.pop("TIERFLOW_OFFLINE", None)
        url = f"{hub.url}/Bench/Model-GGUF/resolve/main/model-Q4_K_M.gguf"
        plain, ours = [], []
        for repeat in range(args.repeats):
            plain.append(plain_download(url, Path(folder) / f"plain-{repeat}"))
            ours.append(pulled("Bench/Model-GGUF", Path(folder) / f"cache-{repeat}"))
    mb = size / 1e6
    plain_s, ours_s = statistics.median(plain), statistics.median(ours)
    print(f"{args.model.name}: {mb:.0f} MB from a local hub, median of {args.repeats}")
    print(f"  plain GET to a file   {plain_s:6.2f} s  {mb / plain_s:7.0f} MB/s")
    print(f"  tierflow pull         {ours_s:6.2f} s  {mb / ours_s:7.0f} MB/s  "
          f"({plain_s / ours_s:.2f}x the plain download's rate)")


if __name__ == "__main__":
    main()
