"""The ``fastckpt`` command line: ``ls``, ``inspect``, ``verify``, ``gc``, ``convert``, ``demo``.

Run as ``fastckpt ...`` (console script) or ``python -m fastckpt ...``. Exit status: 0 ok,
1 damage or failure (corrupt chunk, missing step, storage error), 2 usage error, 130
interrupted, 141 (128 + SIGPIPE) stdout closed early (``fastckpt inspect ROOT | head``).
``gs://`` roots use ``--gcs-endpoint`` if given, else ``STORAGE_EMULATOR_HOST`` if set (as
every GCS client does), else Google; the CLI also points tensorstore (Orbax reads) at it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_DESCRIPTION = "Inspect, verify, clean up and convert fastckpt checkpoints."
#: Exit status when the reader of stdout went away (a shell's status for death by SIGPIPE).
_EXIT_BROKEN_PIPE = 128 + int(getattr(signal, "SIGPIPE", 13))


def _common(p: argparse.ArgumentParser, *, json_flag: bool = True, progress: bool = False) -> None:
    p.add_argument(
        "--gcs-endpoint",
        metavar="URL",
        help="GCS endpoint for gs:// roots (default: $STORAGE_EMULATOR_HOST, else Google)",
    )
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _step(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(prog="fastckpt", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", help="list steps: committed (sizes) and uncommitted leftovers")
    p.add_argument("root", help="checkpoint root: gs://bucket/prefix, path, file:// URL")
    _common(p)

    p = sub.add_parser("inspect", help="one step's tree: shapes, dtypes, shardings, sizes")
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=_step, help="step (default: latest committed)")
    _common(p)

    p = sub.add_parser(
        "verify", help="re-read every chunk; check crc32c and decode (exit 1 on damage)"
    )
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=_step, help="step (default: latest committed)")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument(
        "--threads", type=_positive, default=4, help="checksum/decode threads (default 4)"
    )
    _common(p, progress=True)

    p = sub.add_parser("gc", help="remove uncommitted leftovers; optionally apply retention")
    p.add_argument("root")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument(
        "--grace",
        default="1h",
        metavar="DURATION",
        help="keep uncommitted data younger than this (e.g. 30m, 2h; default 1h)",
    )
    p.add_argument(
        "--keep-last",
        type=_positive,
        metavar="N",
        help="also delete committed steps except the newest N (and --keep-every ones)",
    )
    p.add_argument(
        "--keep-every",
        type=_positive,
        metavar="K",
        help="with retention: keep every step divisible by K",
    )
    _common(p)

    p = sub.add_parser("convert", help="convert Orbax <-> fastckpt (direction detected from SRC)")
    p.add_argument(
        "src", help="an Orbax checkpoint (item dir, step dir or manager root) or a fastckpt root"
    )
    p.add_argument("dst", help="the fastckpt root or Orbax directory to write")
    p.add_argument("--step", type=_step, help="source step (default: latest)")
    p.add_argument(
        "--to-step", type=_step, help="Orbax->fastckpt: step to write (default: source step)"
    )
    p.add_argument(
        "--item", help="Orbax item name in a step dir (default: 'default' or the only one)"
    )
    p.add_argument(
        "--layout",
        choices=("manager", "item"),
        default="manager",
        help="fastckpt->Orbax: a CheckpointManager dir (DST/<step>/default) or a bare item dir",
    )
    _common(p, json_flag=False)

    sub.add_parser(
        "demo", help="run the elastic training demo (arguments pass through)", add_help=False
    )
    return parser


def _missing_local_root(root: str) -> bool:
    path = root.removeprefix("file://")
    return "://" not in path and not os.path.isdir(path)


def _dispatch(args: argparse.Namespace) -> int:
    from fastckpt.cli import _commands, _verify
    from fastckpt.cli._util import parse_duration, run_on_root
    from fastckpt.errors import ConfigError

    cmd = args.command
    if cmd == "convert":
        return _commands.cmd_convert(
            args.src,
            args.dst,
            step=args.step,
            to_step=args.to_step,
            item=args.item,
            layout=args.layout,
            gcs_endpoint=args.gcs_endpoint,
        )
    if _missing_local_root(args.root):
        sys.stderr.write(f"fastckpt {cmd}: no such directory: {args.root}\n")
        return 1
    ep = args.gcs_endpoint
    if cmd == "ls":
        return run_on_root(_commands.cmd_ls, args.root, ep, as_json=args.json)
    if cmd == "inspect":
        return run_on_root(_commands.cmd_inspect, args.root, ep, step=args.step, as_json=args.json)
    if cmd == "verify":
        return run_on_root(
            _verify.cmd_verify,
            args.root,
            ep,
            step=args.step,
            all_steps=args.all,
            as_json=args.json,
            progress=not args.no_progress and not args.json,
            threads=args.threads,
        )
    assert cmd == "gc", cmd
    if args.keep_every is not None and args.keep_last is None:
        raise ConfigError(
            "--keep-every needs --keep-last (retention keeps the newest N plus every K-th)"
        )
    return run_on_root(
        _commands.cmd_gc,
        args.root,
        ep,
        grace_s=parse_duration(args.grace),
        dry_run=args.dry_run,
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        as_json=args.json,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":  # every argument belongs to the demo, including -h
        from fastckpt.cli._commands import cmd_demo

        return cmd_demo(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else 2
    from fastckpt.errors import ConfigError, FastckptError

    try:
        rc = _dispatch(args)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except ConfigError as e:  # a usage error
        sys.stderr.write(f"fastckpt {args.command}: error: {e}\n")
        return 2
    except FastckptError as e:
        sys.stderr.write(f"fastckpt {args.command}: {type(e).__name__}: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def _stdout_closed() -> int:
    """Stop writing quietly after the reader of stdout went away (``| head``); the exit status.
    stdout is pointed at ``/dev/null``: flushing at interpreter exit cannot raise again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no file descriptor behind sys.stdout (captured)
        return _EXIT_BROKEN_PIPE
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError):
        os.dup2(devnull, fd)
    os.close(devnull)
    return _EXIT_BROKEN_PIPE
