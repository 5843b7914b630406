"""What a multi-host job sets up before its first RAM step: the peer address it binds and
advertises, the secret it reads, the tier directory it claims, and the start-up check that
every host reaches the peers it pushes to. (Across real network namespaces: tests/hosts.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fastckpt
from fastckpt.errors import ConfigError, PeersUnreachableError
from fastckpt.options import RamOptions
from fastckpt.replicas import RamReplication
from fastckpt.replicas._ram import RamTier
from fastckpt.replicas._secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    new_peer_secret,
    peer_secret_from_env,
)
from fastckpt.replicas._startup import (
    peer_address,
    route_source_address,
    split_host_port,
)
from fastckpt.replicas._tier_dir import claim_tier_dir
from fastckpt.storage import MemoryStore
from tests.support.threaded_job import ThreadedJob

from .conftest import SECRET

NOBODY = 65534

# ------------------------------------------------------------------ the peer address


def test_split_host_port() -> None:
    assert split_host_port("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert split_host_port("[fd00::1]:80") == ("fd00::1", 80)
    assert split_host_port("coord.example:8476") == ("coord.example", 8476)
    for bad in ("10.0.0.1", "fd00::1:80", "h:0", "h:x", ":80", "h:70000"):
        with pytest.raises(ConfigError):
            split_host_port(bad)


def test_the_default_address_is_the_route_to_the_coordinator() -> None:
    assert route_source_address("127.0.0.1", 9) == "127.0.0.1"
    assert route_source_address("::1", 9) == "::1"
    # A coordinator on loopback: the job runs on one host, so loopback is reachable by all.
    assert peer_address(None, service_address="127.0.0.1:9", process_count=4) == (
        "127.0.0.1",
        "127.0.0.1",
    )
    assert peer_address(None, service_address="[::1]:9", process_count=4) == ("::1", "::1")
    # Alone and without a coordination service: loopback.
    assert peer_address(None, service_address=None, process_count=1) == ("127.0.0.1", "127.0.0.1")


def test_an_explicit_address_wins_and_a_wildcard_binds_all_but_advertises_the_route() -> None:
    assert peer_address("10.9.8.7", service_address="127.0.0.1:9", process_count=4) == (
        "10.9.8.7",
        "10.9.8.7",
    )
    assert peer_address("0.0.0.0", service_address="127.0.0.1:9", process_count=4) == (
        "0.0.0.0",
        "127.0.0.1",
    )
    assert peer_address("::", service_address="[::1]:9", process_count=4) == ("::", "::1")


def test_a_multi_process_job_without_a_coordinator_address_must_say_where() -> None:
    with pytest.raises(ConfigError, match=r"RamOptions\.host"):
        peer_address(None, service_address=None, process_count=2)
    with pytest.raises(ConfigError, match="resolve"):
        peer_address(None, service_address="no-such-host.invalid:9", process_count=2)


# ------------------------------------------------------------------ the secret


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    secret = new_peer_secret()
    assert len(secret) == 64 and len(bytes.fromhex(secret)) == 32 and secret != new_peer_secret()
    assert peer_secret_from_env({SECRET_ENV: secret}) == secret.encode()
    f = tmp_path / "secret"
    f.write_bytes(b"0123456789abcdef-binary\x00\xff\n")
    assert peer_secret_from_env({SECRET_FILE_ENV: str(f)}) == b"0123456789abcdef-binary\x00\xff"
    assert fastckpt.peer_secret_from_env is peer_secret_from_env  # the documented top-level name


@pytest.mark.parametrize(
    "env, match",
    [
        ({}, "no peer secret"),
        ({SECRET_ENV: "too-short"}, "9 bytes"),
        ({SECRET_ENV: "x" * 32, SECRET_FILE_ENV: "/nonexistent"}, "both"),
        ({SECRET_FILE_ENV: "/nonexistent/secret"}, "cannot read"),
    ],
)
def test_a_missing_or_short_secret_is_refused_without_showing_it(
    env: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        peer_secret_from_env(env)
    assert "too-short" not in str(info.value) and "x" * 16 not in str(info.value)


def test_a_short_secret_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(b"short-secret\n")
    with pytest.raises(ConfigError, match="12 bytes") as info:
        peer_secret_from_env({SECRET_FILE_ENV: str(tmp_path / "s")})
    assert "short-secret" not in str(info.value)


def test_the_secret_never_shows_in_the_options_repr() -> None:
    options = RamOptions(root="/dev/shm/x", secret=b"do-not-print-this-secret")
    assert "do-not-print" not in repr(options) and "do-not-print" not in repr(
        fastckpt.ManagerOptions(ram=options)
    )


def test_a_multi_process_job_with_replicas_needs_a_secret(shm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="peer_secret_from_env"):
        RamReplication(
            RamOptions(root=str(shm_dir / "h0")),
            coordinator=ThreadedJob.of(2)[0],
            store=MemoryStore(),
            namespace="t",
            run=lambda c: None,
        )
    assert not (shm_dir / "h0").exists()  # refused before the tier was made


# ------------------------------------------------------------------ the tier directory


def test_a_new_tier_directory_is_private(shm_dir: Path) -> None:
    with RamTier(shm_dir / "a" / "tier", budget_bytes=1 << 20) as tier:
        assert stat.S_IMODE(os.stat(tier.root).st_mode) == 0o700


def test_a_symlinked_tier_directory_is_refused(shm_dir: Path) -> None:
    (shm_dir / "real").mkdir(mode=0o700)
    (shm_dir / "link").symlink_to(shm_dir / "real")
    with pytest.raises(ConfigError, match="symlink"):
        RamTier(shm_dir / "link", budget_bytes=1 << 20)
    assert not (shm_dir / "real" / ".lock").exists()


def test_a_tier_directory_others_can_write_is_refused(shm_dir: Path) -> None:
    d = shm_dir / "open"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(ConfigError, match="writable by group or others"):
        RamTier(d, budget_bytes=1 << 20)
    d.chmod(0o755)  # readable is the owner's choice; writable by others is refused
    RamTier(d, budget_bytes=1 << 20).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_tier_directory_of_another_user_is_refused(shm_dir: Path) -> None:
    d = shm_dir / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"uid {NOBODY}"):
        claim_tier_dir(d)
    parent = shm_dir / "their-parent"  # an ancestor another user owns could swap the tier away
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="ancestor"):
        claim_tier_dir(parent / "tier")
    shared = shm_dir / "shared"  # writable by all and not sticky: anyone could rename the tier
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="not sticky"):
        claim_tier_dir(shared / "tier")
    shared.chmod(0o1777)  # as /dev/shm and /tmp are
    assert claim_tier_dir(shared / "tier") == shared / "tier"


_CLAIM = """
import importlib.util, json, os, sys
path = sys.argv[1] + "/fastckpt/replicas/_tier_dir.py"
spec = importlib.util.spec_from_file_location("_td", path)
sys.path.insert(0, sys.argv[1])
td = importlib.util.module_from_spec(spec)
sys.modules["_td"] = td
spec.loader.exec_module(td)
claimed = td.claim_tier_dir(sys.argv[2])
print(json.dumps({"root_uid": os.stat("/").st_uid, "euid": os.geteuid(), "claimed": str(claimed)}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_user_namespace_that_leaves_root_unmapped_can_claim_a_tier() -> None:
    """An unprivileged user's namespace (a simulated host, a rootless container) maps only that
    user; the real root's files show the overflow uid there and count as root's."""
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    python = next(
        p
        for p in (sys.executable, "/usr/bin/python3")
        if subprocess.run(
            [*user, "unshare", "-Ur", p, "-I", "-c", ""], capture_output=True
        ).returncode
        == 0
    )
    repo = str(Path(__file__).resolve().parents[2])
    where = Path(f"/dev/shm/fastckpt-userns-{os.getpid()}")
    try:
        done = subprocess.run(
            [*user, "unshare", "-Ur", python, "-I", "-c", _CLAIM, repo, str(where / "tier")],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["euid"] == 0 and seen["root_uid"] == int(
            Path("/proc/sys/kernel/overflowuid").read_text()
        )
        assert seen["claimed"] == str(where / "tier")
    finally:
        shutil.rmtree(where, ignore_errors=True)


# ------------------------------------------------------------------ the start-up check


def _start(shm_dir: Path, secrets: list[bytes], host: str = "127.0.0.1") -> list[RamReplication]:
    coords = ThreadedJob.of(len(secrets))

    def start(i: int) -> RamReplication:
        options = RamOptions(
            root=str(shm_dir / f"h{i}"),
            member_id=f"h{i}",
            secret=secrets[i],
            host=host,
            peer_connect_timeout_s=2.0,
            discovery_timeout_s=10.0,
        )
        return RamReplication(
            options, coordinator=coords[i], store=MemoryStore(), namespace="t", run=lambda c: None
        )

    with ThreadPoolExecutor(len(secrets)) as pool:
        futures = [pool.submit(start, i) for i in range(len(secrets))]
    return [f.result() for f in futures]  # type: ignore[misc]


def test_peers_that_reach_each_other_start(shm_dir: Path) -> None:
    reps = _start(shm_dir, [SECRET] * 3)
    try:
        assert all(r.advertised is not None and r.advertised[0] == "127.0.0.1" for r in reps)
    finally:
        for r in reps:
            r.close()


def test_every_process_fails_at_start_when_a_host_cannot_be_reached(shm_dir: Path) -> None:
    """h1 has another secret: h0 cannot authenticate to it (and h1 not to h2); every process
    raises the same typed error naming the members and addresses, and keeps nothing running."""
    wrong = b"another-secret-0123456789abcdef"
    coords = ThreadedJob.of(3)
    options = [
        RamOptions(
            root=str(shm_dir / f"h{i}"),
            member_id=f"h{i}",
            secret=wrong if i == 1 else SECRET,
            host="127.0.0.1",
            peer_connect_timeout_s=2.0,
            discovery_timeout_s=10.0,
        )
        for i in range(3)
    ]

    def start(i: int) -> BaseException | None:
        try:
            RamReplication(
                options[i],
                coordinator=coords[i],
                store=MemoryStore(),
                namespace="t",
                run=lambda c: None,
            ).close()
        except BaseException as e:
            return e
        return None

    with ThreadPoolExecutor(3) as pool:
        errors = list(pool.map(start, range(3)))
    assert all(isinstance(e, PeersUnreachableError) for e in errors), errors
    message = str(errors[2])
    assert str(errors[0]) == message
    assert "h0 (127.0.0.1:" in message and "cannot reach h1 at 127.0.0.1:" in message, message
    assert "h1 (127.0.0.1:" in message and "cannot reach h2" in message, message
    # The tiers were closed: their directories can be claimed again at once.
    for i in range(3):
        RamTier(shm_dir / f"h{i}", budget_bytes=1 << 20).close()


def test_a_server_on_an_ipv6_address(shm_dir: Path) -> None:
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6 loopback")
    reps = _start(shm_dir, [SECRET] * 2, host="::1")
    try:
        assert [r.advertised[0] for r in reps if r.advertised] == ["::1", "::1"]
    finally:
        for r in reps:
            r.close()
