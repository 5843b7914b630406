"""A jax-free stand-in worker that speaks the supervisor protocol (environment in; heartbeat
files, a stop-request file and exit codes out), so supervisor policy tests take
milliseconds per generation. argv[1] is a JSON spec:

``{"total": N, "step_s": s, "every": k, "faults": [{"kind": "crash"|"freeze"|"stall",
"host": h, "step": s, "generation": g | null}]}``

"Checkpoints" are one file (``fake_ckpt``: the committed step, written by rank 0).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


def env(name: str) -> str:
    return os.environ["FASTCKPT_ELASTIC_" + name]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> int:
    spec = json.loads(sys.argv[1])
    gen, host, rank = int(env("GENERATION")), int(env("HOST_ID")), int(env("PROCESS_ID"))
    run, local = Path(env("RUN_DIR")), Path(env("LOCAL_DIR"))
    with open(run / "local_seen", "a") as f:
        f.write(
            json.dumps({"generation": gen, "host": host, "marker": (local / "marker").exists()})
            + "\n"
        )
    (local / "marker").write_text(str(gen))
    ckpt = run / "fake_ckpt"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    (run / f"ready-g{gen}-h{host}").touch()  # a barrier: nobody commits before all have read
    while len(list(run.glob(f"ready-g{gen}-h*"))) < int(env("NUM_PROCESSES")):
        time.sleep(0.01)
    live = {"step": start, "beating": True}

    def beat() -> None:
        while True:
            if live["beating"]:
                hb = {"t": time.time(), "step": live["step"], "phase": "train", "pid": os.getpid()}
                write_atomic(run / "hb" / f"g{gen}-h{host}.json", json.dumps(hb))
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    for step in range(start, spec["total"]):
        for fault in spec.get("faults", []):
            if (
                fault["host"] == host
                and fault["step"] == step
                and fault.get("generation") in (None, gen)
            ):
                if fault["kind"] == "crash":
                    return 3
                live["beating"] = fault["kind"] != "freeze"
                time.sleep(600)
        if (run / "control" / f"stop-g{gen}").exists():
            if rank == 0:
                write_atomic(ckpt, str(step))
            return 75
        time.sleep(spec.get("step_s", 0.02))
        live["step"] = step + 1
        if rank == 0 and (step + 1) % spec.get("every", 2) == 0:
            write_atomic(ckpt, str(step + 1))
    if rank == 0:
        write_atomic(ckpt, str(spec["total"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
