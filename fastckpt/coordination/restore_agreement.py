"""How the processes of a job agree on what a restore of the latest step reads, and on its
outcome. Pure coordination: the manager passes in what it owns (a fast tier as a
:class:`StepSelector`, coordinator, storage listing, manifest loader).

Call order (every process, SPMD): :func:`choose_latest` -> fill -> :func:`agree_on_outcome`
(True: every process retries with an older step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Protocol

from fastckpt.coordination.distributed import Coordinator
from fastckpt.errors import CheckpointNotFoundError, DistributedError, NoCheckpointError
from fastckpt.format.layout import step_from_manifest_key
from fastckpt.format.manifest import Manifest

__all__ = [
    "SelectedStep",
    "StepSelector",
    "agree_on_outcome",
    "agreed_storage_latest",
    "choose_latest",
    "published_step",
]


class SelectedStep(Protocol):
    """A fast tier's choice of the step to restore."""

    @property
    def manifest(self) -> Manifest | None:
        """Its manifest (None: storage holds the step)."""
        ...


class StepSelector(Protocol):
    """What :func:`choose_latest` asks of a fast tier."""

    def select_step(
        self,
        persistent_latest: Callable[[], int | None],
        *,
        key: str,
        timeout_s: float,
        older_than: int | None,
        wanted: Callable[[Manifest], Mapping[str, str]],
    ) -> SelectedStep | None:
        """Agree with every process (collective) on the newest step of the tier newer than
        ``persistent_latest()`` (called on process 0 only) and older than ``older_than`` from
        which each reaches the chunks it needs (``wanted``: chunk id -> object key); None:
        storage's latest."""
        ...


def published_step(value: str) -> int | None:
    """Process 0's storage latest as published for a restore (``"none"`` or a step)."""
    if value == "none":
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 19:
        raise DistributedError(f"process 0 published a malformed storage step {value[:40]!r}")
    return int(value)


def _read_published(coord: Coordinator, key: str, timeout_s: float) -> int | None:
    """Processes other than 0: the storage latest process 0 published under ``key``."""
    return published_step(coord.get(f"{key}/persistent", timeout_s=timeout_s))


def _publish_latest(coord: Coordinator, key: str, manifest_keys: list[str]) -> int | None:
    """Process 0: storage's latest committed step from its listing, published for the others."""
    steps = [s for s in (step_from_manifest_key(k) for k in manifest_keys) if s is not None]
    latest = max(steps) if steps else None
    if coord.process_count > 1:
        coord.set(f"{key}/persistent", "none" if latest is None else str(latest))
    return latest


def agreed_storage_latest(
    coord: Coordinator,
    *,
    key: str,
    list_manifests: Callable[[], Future[list[str]]],
    timeout_s: float,
) -> int | None:
    """Storage's latest committed step as process 0 lists it; the others read what it
    publishes (a restore without a fast tier): one listing per restore instead of one per
    host, and every process restores the same step even if a commit lands meanwhile."""
    if coord.process_index == 0:
        return _publish_latest(coord, key, list_manifests().result())
    return _read_published(coord, key, timeout_s)


def choose_latest(
    tier: StepSelector,
    coord: Coordinator,
    *,
    key: str,
    older_than: int | None,
    wanted: Callable[[Manifest], dict[str, str]],
    timeout_s: float,
    list_manifests: Callable[[], Future[list[str]]],
    load: Callable[[int], Manifest],
    url: str,
) -> Manifest:
    """The newest step of the fast ``tier`` newer than storage's latest (and older than
    ``older_than``) from which every process reaches the chunks it needs (``wanted``), else
    storage's latest (``load(step)``).

    Only process 0 lists storage (``list_manifests()``, while the tier surveys its steps) and
    publishes its latest step for the others, as :func:`agreed_storage_latest`. Raises
    :class:`NoCheckpointError` on every process when nothing is committed in any tier (and no
    ``older_than``), :class:`CheckpointNotFoundError` when nothing older than ``older_than`` is.
    """
    listed: list[int | None] = []
    listing = list_manifests() if coord.process_index == 0 else None

    def storage_latest() -> int | None:  # process 0, after its survey (the listing ran meanwhile)
        assert listing is not None
        listed.append(_publish_latest(coord, key, listing.result()))
        return listed[0]

    try:
        choice = tier.select_step(
            storage_latest, key=key, timeout_s=timeout_s, older_than=older_than, wanted=wanted
        )
    finally:
        if listing is not None and not listing.done():  # the tier failed before asking
            listing.cancel()
    if choice is not None:
        return choice.manifest  # type: ignore[return-value]
    latest = listed[0] if coord.process_index == 0 else _read_published(coord, key, timeout_s)
    if latest is None:
        if older_than is None:
            raise NoCheckpointError(f"no committed checkpoint in {url} or any fast tier")
        raise CheckpointNotFoundError(
            f"no committed checkpoint in {url} or any fast tier older than step {older_than}"
        )
    return load(latest)


def agree_on_outcome(
    coord: Coordinator | None,
    tag: str,
    failure: BaseException | None,
    *,
    may_retry: bool,
    timeout_s: float,
) -> bool:
    """Exchange every process's fill outcome through ``coord`` (None: this process alone;
    the exchange is also the barrier that keeps peers serving until everyone has read).
    Returns True if all should retry an older step; raises this process's error, or
    :class:`DistributedError` naming another process's."""
    missing = isinstance(failure, CheckpointNotFoundError)
    mine = "ok" if failure is None else ("missing " if missing else "error ") + str(failure)[:500]
    outcomes = (
        [mine] if coord is None else coord.exchange(f"{tag}/outcome", mine, timeout_s=timeout_s)
    )
    if all(o == "ok" for o in outcomes):
        return False
    if may_retry and all(o == "ok" or o.startswith("missing ") for o in outcomes):
        return True
    if failure is not None:
        raise failure
    bad = next(i for i, o in enumerate(outcomes) if o != "ok")
    raise DistributedError(
        f"process {bad} failed its part of the restore: {outcomes[bad].split(' ', 1)[1]}"
    )
