"""A scripted job on simulated hosts (``cross_workers.scripted``), driven command by command
from the test, and the check that every process's command succeeded."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastckpt.testing.gcs_emulator import GcsEmulator
from fastckpt_examples.cluster.hosts import Host, SimulatedHosts
from fastckpt_examples.cluster.multiprocess import ProcessOutcome, run_processes

WORKERS = str(Path(__file__).with_name("cross_workers.py"))


class Job:
    """A scripted job (``cross_workers.scripted``) on some hosts, driven command by command."""

    def __init__(
        self,
        hosts: SimulatedHosts,
        on: list[Host],
        name: str,
        emulator: GcsEmulator,
        *,
        prefix: str,
        barrier_s: float = 30.0,
        per_process: list[dict[str, Any]] | None = None,
        timeout_s: float = 240,
    ) -> None:
        self.control = hosts.shared_dir / name
        self.control.mkdir()
        self.n = 0
        self.size = len(on)
        kwargs = [
            {
                "control": str(self.control),
                "endpoint": emulator.endpoint,
                "prefix": prefix,
                "ram_root": f"/dev/shm/fastckpt/{prefix}",
                "member": h.name,
                "barrier_s": barrier_s,
                **(per_process[i] if per_process else {}),
            }
            for i, h in enumerate(on)
        ]
        self._pool = ThreadPoolExecutor(1)
        self.future: Future[list[ProcessOutcome]] = self._pool.submit(
            run_processes,
            f"{WORKERS}:scripted",
            num_processes=len(on),
            devices_per_process=2,
            kwargs=kwargs,
            hosts=on,
            timeout_s=timeout_s,
            check=False,
        )

    def send(self, op: str, **args: Any) -> int:
        n, self.n = self.n, self.n + 1
        tmp = self.control / f"cmd-{n}.tmp"  # published whole: a worker may read it at once
        tmp.write_text(json.dumps({"op": op, **args}))
        tmp.replace(self.control / f"cmd-{n}.json")
        return n

    def results(self, n: int, timeout_s: float = 90) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        paths = [self.control / f"res-{n}-{i}.json" for i in range(self.size)]
        while not all(p.exists() for p in paths):
            if self.future.done() or time.monotonic() > deadline:
                raise AssertionError(
                    f"command {n}: results {[p.exists() for p in paths]}\n{self._describe()}"
                    f"{self._stderr_tails()}"
                )
            time.sleep(0.02)
        return [json.loads(p.read_text()) for p in paths]

    def do(self, op: str, timeout_s: float = 90, **args: Any) -> list[dict[str, Any]]:
        return self.results(self.send(op, **args), timeout_s)

    def finish(self) -> list[ProcessOutcome]:
        self.send("exit")
        outcomes = self.future.result(timeout=120)
        self._pool.shutdown()
        assert all(o.ok for o in outcomes), self._describe(outcomes)
        return outcomes

    def _stderr_tails(self) -> str:
        """The running children's stderr (run_processes keeps it under the shared directory)."""
        tails = []
        for err in sorted(self.control.parent.glob("fastckpt-mp-*/err*")):
            text = err.read_bytes()[-3000:].decode(errors="replace")
            if text.strip():
                tails.append(f"--- {err.parent.name}/{err.name}:\n{text}")
        return "\n" + "\n".join(tails)

    def _describe(self, outcomes: list[ProcessOutcome] | None = None) -> str:
        if outcomes is None and self.future.done():
            outcomes = self.future.result()
        return "\n".join(
            f"p{o.process_id} rc={o.returncode} error={o.error}\n{o.stderr[-3000:]}"
            for o in outcomes or []
        )


def ok(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    bad = [
        (i, r.get("error"), r.get("message"), r.get("traceback", "")[-1500:])
        for i, r in enumerate(results)
        if not r.get("ok")
    ]
    assert not bad, "\n".join(map(str, bad))
    return results
