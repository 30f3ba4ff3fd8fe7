"""What converting a GGUF model costs: SmolLM2's file dequantised into a fresh cache folder, as its
first load does (``catalog.convert_gguf``), each repeat in a process of its own.

    python benchmarks/gguf_convert.py [--model smollm2] [--repeats 3]

Prints each repeat's process CPU (``time.process_time``, the conversion alone: imports before it)
and their median, and the SHA-256 of the converted weights (``model.safetensors``), which a change
to the conversion must leave as it was. Run it on two trees in turn through ``PYTHONPATH`` to
compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, os, sys, tempfile, time
from pathlib import Path
os.environ["HEADATLAS_CACHE"] = tempfile.mkdtemp(prefix="headatlas-convert-")
import gguf, torch, transformers  # noqa: F401 - imported before the clock starts
from headatlas.service.engine import catalog
path = catalog.NAMED_MODELS[sys.argv[1]].require()
out = Path(tempfile.mkdtemp(prefix="headatlas-converted-")) / "model"
started = time.process_time()
catalog.convert_gguf(path, out, sys.argv[1])
cpu = time.process_time() - started
digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
print(json.dumps({"cpu_s": cpu, "sha256": digest, "module": catalog.__file__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a named GGUF model (default: smollm2)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    runs = []
    for _ in range(args.repeats):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, args.model], capture_output=True, text=True, env=env, check=False
        )
        if done.returncode != 0:
            sys.exit(f"the conversion failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"converted by {runs[0]['module']}")
    for run in runs:
        print(f"  {run['cpu_s']:.2f} s of CPU  model.safetensors sha256 {run['sha256'][:16]}")
    digests = {run["sha256"] for run in runs}
    print(f"median {statistics.median(r['cpu_s'] for r in runs):.2f} s of CPU over {len(runs)} conversions")
    if len(digests) != 1:
        sys.exit(f"the conversions differ: {sorted(digests)}")


if __name__ == "__main__":
    main()
