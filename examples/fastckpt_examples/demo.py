"""``fastckpt demo``: lose a node of a local multi-node Ray cluster mid-training, keep going.

STUB while the demo moves onto Ray (issue #25): the scenario (4 nodes x 2 devices on the
namespaced multi-node harness ``fastckpt.testing.ray_cluster``, SIGKILL of a node, resume
on 3, grow back to 4, timeline + loss plot + final JSON line with ``"engine": "ray"``) is
built on :func:`fastckpt.elastic.run_elastic` with :mod:`fastckpt_examples.elastic_train`
and a ``monitor`` that kills and revives nodes, as ``tests/elastic/test_ray_job.py`` does
on ``ray.cluster_utils.Cluster``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Explain that the Ray demo is not there yet; exit status 2."""
    del argv
    sys.stderr.write(
        "fastckpt demo: the elastic demo is being rebuilt on Ray (issue #25) and is not "
        "available in this build; tests/elastic/test_ray_job.py runs the same scenario on a "
        "local Ray cluster.\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
