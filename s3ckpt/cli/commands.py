"""The catalog subcommands of ``s3ckpt``: ls, show, verify, prune, gc, rm.

Each is an ``*_arguments`` function and a ``run_*`` function, wired into
:data:`s3ckpt.cli.main.COMMANDS`. They only parse options, call :mod:`s3ckpt.catalog` and
render its dataclasses, as an aligned table or, with ``--json``, one JSON document on
stdout (field names documented in ``docs/cli.md``). The catalog is imported inside each
``run_*`` so that ``s3ckpt --help`` stays instant; nothing here imports torch.

Exit statuses are decided in :func:`s3ckpt.cli.main.main` from the exception raised, except
"problem found" results (verify; prune leaving a checkpoint that changed since its
listing), which return 1 here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from s3ckpt.catalog.grace import DEFAULT_GRACE, MIN_SAFE_GRACE
from s3ckpt.cli import output
from s3ckpt.cli.humanize import human_bytes, human_duration, parse_duration
from s3ckpt.cli.progress import Progress
from s3ckpt.config import S3Config
from s3ckpt.errors import ConfigError
from s3ckpt.format.layout import LEASE_S

# The CLI's requests are small (listings, manifests, bounded ranged reads): timeouts suited
# to them, not to multi-GiB parts, so that a silent endpoint fails a command in under a
# minute (3 attempts of 15 s, plus backoff) instead of the engine's 4 x 120 s.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0
ATTEMPTS = 3


def common_arguments(parser: argparse.ArgumentParser, uri_help: str) -> None:
    parser.add_argument("uri", metavar="S3_URI", help=uri_help)
    group = parser.add_argument_group("connection (default: the standard AWS configuration)")
    group.add_argument(
        "--endpoint-url", metavar="URL", help="S3 endpoint, e.g. https://fb.example.com"
    )
    group.add_argument("--profile", help="AWS profile to take credentials and settings from")
    group.add_argument("--region", help="region to sign requests for")
    group.add_argument("--ca-bundle", metavar="PATH", help="CA bundle to verify TLS with")
    group.add_argument(
        "--no-verify-ssl", action="store_true", help="do not verify TLS certificates"
    )
    group.add_argument(
        "--read-timeout",
        type=_duration,
        default=READ_TIMEOUT_S,
        metavar="AGE",
        help=f"a request silent for longer fails and is retried (default {READ_TIMEOUT_S:g}s; "
        f"{ATTEMPTS} attempts, so a silent endpoint fails the command within a minute)",
    )
    group.add_argument(
        "--timeout",
        type=_duration,
        default=None,
        metavar="AGE",
        help="give up on the whole command after AGE (default: no bound beyond the requests')",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def config_from(args: argparse.Namespace) -> S3Config:
    """The connection options; anything not given falls through to the AWS chain."""
    if args.no_verify_ssl and args.ca_bundle:
        raise ConfigError("--ca-bundle and --no-verify-ssl contradict each other")
    if args.ca_bundle and not os.path.isfile(args.ca_bundle):
        raise ConfigError(f"--ca-bundle {args.ca_bundle!r}: no such file")
    verify: bool | str | None = False if args.no_verify_ssl else args.ca_bundle  # None: AWS chain
    return S3Config(
        endpoint_url=args.endpoint_url,
        profile=args.profile,
        region=args.region,
        verify=verify,
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=args.read_timeout,
        max_attempts=ATTEMPTS,
    )


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def emit(args: argparse.Namespace, document: Any, human: str) -> None:
    if args.json:
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif human:
        print(human)


# -- ls -------------------------------------------------------------------------------------


def ls_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "prefix to list, s3://bucket[/prefix]")
    parser.add_argument(
        "--all", action="store_true", help="include uncommitted (in-flight or abandoned) saves"
    )
    parser.add_argument(
        "--details",
        action="store_true",
        help="read every manifest (one GET each) for exact ranks, items and save ids",
    )


def run_ls(args: argparse.Namespace) -> int:
    """Exit 1 when a manifest could not be read (``--details``); the rest is listed. A
    directory whose manifest is not s3ckpt's is no problem of s3ckpt's (exit 0): with
    ``--all`` it is listed as ``foreign``, without it a warning says so."""
    from s3ckpt.catalog import list_checkpoints

    problems: list[str] = []
    infos = list_checkpoints(
        args.uri,
        include_uncommitted=args.all,
        details=args.details,
        problems=problems,
        config=config_from(args),
    )
    now = time.time()
    emit(
        args,
        [output.info_json(i, now) for i in infos],
        output.info_table(infos, now, status=args.all, items=args.details),
    )
    if not infos and not args.json:
        what = "checkpoints or uncommitted saves" if args.all else "committed checkpoints"
        print(f"no {what} under {args.uri}", file=sys.stderr)
    for problem in problems:
        print(f"s3ckpt: ls: warning: {problem}", file=sys.stderr)
    for info in infos:
        if info.damaged:
            print(f"s3ckpt: ls: {info.uri}: {info.damaged}", file=sys.stderr)
        if info.foreign:
            print(f"s3ckpt: ls: note: {info.foreign}", file=sys.stderr)
    return 1 if any(i.damaged for i in infos) else 0


# -- show -----------------------------------------------------------------------------------


def show_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "checkpoint, s3://bucket/prefix/name")


def run_show(args: argparse.Namespace) -> int:
    from s3ckpt.catalog import show_checkpoint

    manifest = show_checkpoint(args.uri, config=config_from(args))
    emit(args, output.manifest_json(args.uri, manifest), output.manifest_text(args.uri, manifest))
    return 0


# -- verify ---------------------------------------------------------------------------------


def verify_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "checkpoint, s3://bucket/prefix/name")
    parser.add_argument(
        "--max-buffer",
        type=int,
        default=256,
        metavar="MIB",
        help="memory for bytes being checked, in MiB (default 256)",
    )


def run_verify(args: argparse.Namespace) -> int:
    from s3ckpt.catalog import verify_checkpoint

    if args.max_buffer < 1:
        raise ConfigError("--max-buffer must be at least 1 (MiB)")
    report = verify_checkpoint(
        args.uri, max_buffer=args.max_buffer << 20, progress=Progress(), config=config_from(args)
    )
    emit(args, output.verify_json(report), output.verify_text(report))
    if not report.ok:
        print(f"s3ckpt: verify: {len(report.problems)} problem(s) in {report.uri}", file=sys.stderr)
        return 1
    return 0


# -- prune ----------------------------------------------------------------------------------


def prune_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "prefix holding the checkpoints, s3://bucket/prefix")
    parser.add_argument(
        "--keep-last", type=int, required=True, metavar="N", help="keep the newest N checkpoints"
    )
    parser.add_argument(
        "--keep-every",
        type=int,
        metavar="K",
        help="also keep checkpoints whose step (last number in the name) is a multiple of K",
    )
    parser.add_argument(
        "--older-than",
        type=_duration,
        metavar="AGE",
        help="only delete checkpoints committed more than AGE ago (30s, 15m, 1h, 7d, 2w)",
    )
    parser.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    parser.add_argument("--force", action="store_true", help="allow deleting the newest checkpoint")


def run_prune(args: argparse.Namespace) -> int:
    from s3ckpt.catalog import prune

    report = prune(
        args.uri,
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        older_than=args.older_than,
        force=args.force,
        dry_run=args.dry_run,
        progress=Progress(),
        config=config_from(args),
    )
    emit(args, output.prune_json(report), output.prune_text(report))
    for foreign in report.foreign:  # never candidates: said, not an error
        print(f"s3ckpt: prune: note: {foreign}", file=sys.stderr)
    for name in report.changed:  # the policy was not carried out for these: say so, exit 1
        why = report.why_changed.get(name, "changed since the listing")
        print(f"s3ckpt: prune: {name or '.'}: {why}; kept", file=sys.stderr)
    return 1 if report.changed else 0


# -- gc -------------------------------------------------------------------------------------


def gc_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "prefix to clean, s3://bucket[/prefix]")
    parser.add_argument(
        "--older-than",
        type=_duration,
        default=DEFAULT_GRACE,
        metavar="AGE",
        help="grace period: touch nothing written less than AGE ago (default 1h, at least "
        f"{human_duration(MIN_SAFE_GRACE)} unless --force); saves in flight are always left alone",
    )
    parser.add_argument("--dry-run", action="store_true", help="show what would be removed")
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"allow a grace under {human_duration(MIN_SAFE_GRACE)}: loads reading a "
        "checkpoint an overwrite just replaced may then fail",
    )
    parser.add_argument(
        "--in-flight-lease",
        type=_duration,
        default=LEASE_S,
        metavar="AGE",
        help="a save whose in-flight record was refreshed less than AGE ago is running and "
        f"left alone (default {human_duration(LEASE_S)}); shorten it only for saves known dead",
    )


def run_gc(args: argparse.Namespace) -> int:
    from s3ckpt.catalog import collect_garbage

    if args.older_than < MIN_SAFE_GRACE and not args.force:
        raise ConfigError(
            f"--older-than {human_duration(args.older_than)} is under the safe minimum of "
            f"{human_duration(MIN_SAFE_GRACE)}: objects of an overwritten checkpoint that a "
            "load is still reading could go; pass --force to do it anyway"
        )
    report = collect_garbage(
        args.uri,
        grace=args.older_than,
        dry_run=args.dry_run,
        lease=args.in_flight_lease,
        progress=Progress(),
        config=config_from(args),
    )
    emit(args, output.gc_json(report), output.gc_text(report))
    for problem in report.problems:
        print(f"s3ckpt: gc: {problem}", file=sys.stderr)
    return 0


# -- rm -------------------------------------------------------------------------------------


def rm_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "checkpoint to delete, s3://bucket/prefix/name")


def run_rm(args: argparse.Namespace) -> int:
    from s3ckpt.catalog import remove_checkpoint

    removed = remove_checkpoint(args.uri, progress=Progress(), config=config_from(args))
    human = f"removed {removed.uri} ({removed.objects} objects, {human_bytes(removed.bytes)})"
    emit(args, output.removed_json(removed), human)
    return 0


# -- doctor ---------------------------------------------------------------------------------


def doctor_arguments(parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "where checkpoints will go, s3://bucket[/prefix]")
    parser.add_argument(
        "--sample-mib",
        type=int,
        default=8,
        metavar="MIB",
        help="size of the PUT and GET throughput sample (default 8)",
    )


def run_doctor(args: argparse.Namespace) -> int:
    """Exit 0: s3ckpt will work; 1: it will, with a degraded feature; 2: it cannot."""
    from s3ckpt.catalog.doctor import diagnose

    if not 1 <= args.sample_mib <= 1024:
        raise ConfigError("--sample-mib must be between 1 and 1024")
    diagnosis = diagnose(args.uri, sample_mib=args.sample_mib, config=config_from(args))
    emit(args, output.doctor_json(diagnosis), output.doctor_text(diagnosis))
    return diagnosis.exit_status
