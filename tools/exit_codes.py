"""Run a command N times and count how its runs end: the measurement behind the reliability
page's "clean exit" figures (a finished run must exit 0, never abort in teardown).

    python tools/exit_codes.py --runs 200 -- torchrun --nproc-per-node 2 -m mfsdp.examples

Prints one line per run that did not exit 0 (its code and the last line of its stderr) and a
summary; with --json PATH it writes the counts there. Each run gets its own rendezvous port.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Run the command ``--runs`` times; exit 1 when any run did not exit 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--json", help="write the counts here")
    p.add_argument("--port", type=int, default=29600, help="first rendezvous port")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    codes: collections.Counter = collections.Counter()
    aborts = 0
    t0 = time.perf_counter()
    for i in range(args.runs):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(args.port + i % 200))
        cmd = [c.replace("{port}", str(args.port + i % 200)) for c in command]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        codes[proc.returncode] += 1
        aborted = "terminate called" in proc.stderr
        aborts += aborted
        if proc.returncode != 0 or aborted:
            tail = (proc.stderr.strip().splitlines() or [""])[-1]
            print(f"run {i + 1}: exit {proc.returncode}: {tail}", flush=True)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{args.runs} runs, exits {dict(codes)}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    result = {"command": " ".join(command), "runs": args.runs,
              "exit_codes": {str(k): v for k, v in sorted(codes.items())},
              "teardown_aborts": aborts, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if codes.get(0, 0) == args.runs and not aborts else 1


if __name__ == "__main__":
    sys.exit(main())
