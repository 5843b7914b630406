"""The demo's own bookkeeping (the scenario itself runs in test_elastic_run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastckpt.elastic import demo
from fastckpt.elastic.supervisor import ElasticRunError


def test_run_demo_removes_host_local_dirs_even_when_the_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []

    class FailingSupervisor:
        def __init__(self, worker: Any, *, local_root: Path, **kwargs: Any) -> None:
            self.local_root = Path(local_root)

        def run(self) -> Any:
            (self.local_root / "host0").mkdir()
            (self.local_root / "host0" / "segment").write_bytes(b"x" * 1024)  # a RAM-tier segment
            seen.append(self.local_root)
            raise ElasticRunError("restarts exhausted")

    monkeypatch.setattr(demo, "Supervisor", FailingSupervisor)
    args = demo.build_parser().parse_args(["--workdir", str(tmp_path / "work"), "--quiet"])
    with pytest.raises(ElasticRunError):
        demo.run_demo(args)
    [local_root] = seen
    assert not local_root.exists()
