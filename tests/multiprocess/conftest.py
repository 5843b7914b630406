"""Many-trial fault tests (``@pytest.mark.nightly``) run only when ``-m`` asks for them."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "nightly" in (config.option.markexpr or ""):
        return
    mine = [
        it
        for it in items
        if it.get_closest_marker("nightly") and _HERE in Path(str(it.path)).parents
    ]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [it for it in items if it not in mine]
