"""Keeper process of one simulated host, or of the switch (run by :mod:`.hosts`).

A standalone script (standard library only; started as ``python -I -S _hosts_keeper.py JSON``
so it imports nothing of fastckpt). It creates the namespaces it holds, reports
``ready <netns id>`` on stdout (or ``error <message>``), then waits until its stdin reaches
EOF, its parent process is gone, or it gets SIGTERM/SIGHUP. Then it SIGKILLs every other
process in its network namespace, removes the cluster's shared directory if it was told to,
and exits: whatever becomes of the controlling process, a host does not outlive it by more
than a moment.

Configuration (JSON object):
    kind: ``"switch"`` (a network namespace for the bridge) or ``"host"`` (network, mount and
        UTS namespaces, private tmpfs on /dev/shm and /tmp, /etc/hosts bound from a file).
    userns: ``"create"`` (switch only: a new user namespace mapping root to the caller),
        ``"join"`` (enter the user namespace of process ``userns_pid``) or ``null``.
    userns_pid, hostname, hosts_file: for ``"join"`` and hosts.
    keep: (hosts) paths under /tmp or /dev/shm bound into the private tmpfs, so that the
        caller's checkout or virtualenv there stays visible.
    remove_on_exit: a directory to remove after the sweep (the switch keeper), or ``null``.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import sys
import time
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
O_PATH = 0o10000000


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter(libc: ctypes.CDLL, cfg: dict[str, Any]) -> None:
    if cfg["userns"] == "join":
        fd = os.open(f"/proc/{cfg['userns_pid']}/ns/user", os.O_RDONLY)
        _check(libc.setns(fd, CLONE_NEWUSER), "setns(user)")
        os.close(fd)
    if cfg["kind"] == "switch":
        flags = CLONE_NEWNET | (CLONE_NEWUSER if cfg["userns"] == "create" else 0)
        uid, gid = os.getuid(), os.getgid()
        _check(libc.unshare(flags), "unshare(switch)")
        if cfg["userns"] == "create":
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
    else:
        _check(libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWUTS), "unshare(host)")
        _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        for where in ("/dev/shm", "/tmp"):
            below = os.open(where, O_PATH | os.O_DIRECTORY)  # the caller's, hidden by the tmpfs
            rc = libc.mount(b"tmpfs", where.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777")
            _check(rc, f"mount tmpfs on {where}")
            for path in cfg.get("keep", []):  # a checkout or venv of the caller under it
                if path.startswith(where + "/"):
                    os.makedirs(path, exist_ok=True)
                    source = f"/proc/self/fd/{below}/{os.path.relpath(path, where)}".encode()
                    _check(
                        libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None),
                        f"bind {path}",
                    )
            os.close(below)
        hosts_file = cfg["hosts_file"].encode()
        _check(libc.mount(hosts_file, b"/etc/hosts", None, MS_BIND, None), "bind /etc/hosts")
        name = cfg["hostname"].encode()
        _check(libc.sethostname(name, len(name)), "sethostname")
    for which in ("all", "default"):  # no IPv6 inside: IPv4 addresses only, as planned
        path = f"/proc/sys/net/ipv6/conf/{which}/disable_ipv6"
        if os.path.exists(path):
            _write(path, "1")


def _others_in(netns: str) -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == netns:
                    found.append(int(entry))
            except OSError:
                pass  # gone, a zombie, or not ours to look at
    return found


def _sweep(netns: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        pids = _others_in(netns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _remove(path: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while os.path.lexists(path) and time.monotonic() < deadline:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            time.sleep(0.05)  # a dying process may still be writing into it


class _Stop(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def main() -> None:
    cfg = json.loads(sys.argv[1])
    parent = os.getppid()
    os.chdir("/")  # pin no directory of the caller's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides, not a stray Ctrl-C
    try:
        _enter(_libc(), cfg)
        netns = os.readlink("/proc/self/ns/net")
    except Exception as exc:  # reported to the controller, which raises it
        sys.stdout.write(f"error {exc}\n")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write(f"ready {netns}\n")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    try:
        while os.getppid() == parent:  # the parent process, not the thread that started us
            readable, _, _ = select.select([0], [], [], 0.5)
            if readable and not os.read(0, 4096):
                break
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _sweep(netns, 10.0)
    if cfg.get("remove_on_exit"):
        _remove(cfg["remove_on_exit"], 5.0)
    os._exit(0)


if __name__ == "__main__":
    main()
