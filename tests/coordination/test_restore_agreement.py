"""Restore agreement (``coordination.restore_agreement``): what process 0 publishes as
storage's latest step is read back strictly."""

from __future__ import annotations

import pytest

from fastckpt.coordination.restore_agreement import published_step
from fastckpt.errors import DistributedError


@pytest.mark.parametrize(
    # "\uff17" (FULLWIDTH DIGIT SEVEN): str.isdigit() and int() accept it, the format must not
    "value",
    ["", "-1", "1e3", " 7", "\uff17", "12345678901234567890", "none ", "None"],
)
def test_a_malformed_published_storage_step_is_a_distributed_error(value: str) -> None:
    """Process 0 publishes storage's latest step for a restore ("none" or digits); anything
    else read back is refused, typed, rather than restoring some other step."""
    assert (
        published_step("none") is None and published_step("0") == 0 and published_step("42") == 42
    )
    with pytest.raises(DistributedError, match="malformed storage step"):
        published_step(value)
