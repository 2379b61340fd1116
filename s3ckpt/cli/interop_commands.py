"""The subcommands that move checkpoints in and out: cp, export, import.

Wired into :data:`s3ckpt.cli.main.COMMANDS` like the catalog's. ``cp`` runs without torch;
``export`` and ``import`` need it, and import :mod:`s3ckpt.interop.export` and
:mod:`s3ckpt.interop.imports` inside their ``run_*`` only, so ``s3ckpt ls`` and
``s3ckpt --help`` never pay for torch (the one exception ``pyproject.toml`` grants the
CLI's no-torch contract).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import re
import sys
from collections.abc import Iterator

from s3ckpt.cli.commands import common_arguments, config_from, emit
from s3ckpt.cli.humanize import human_bytes
from s3ckpt.cli.progress import Progress
from s3ckpt.config import S3Config
from s3ckpt.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` (10^9), ``512MiB`` (2^20), ``1000000`` (bytes) as a number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB)")
    number, unit, binary = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    size = int(float(number) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


# Copies of multi-GiB objects and 64 MiB parts are not the small requests the catalog
# commands make: a server may stay silent for a long while before answering a CopyObject.
TRANSFER_READ_TIMEOUT_S = 120.0


def _transfer_arguments(parser: argparse.ArgumentParser, uri_help: str) -> None:
    """The common options, with a request timeout suited to moving whole checkpoints."""
    common_arguments(parser, uri_help)
    parser.set_defaults(read_timeout=TRANSFER_READ_TIMEOUT_S)
    for action in parser._actions:  # argparse offers no other way to amend a help text
        if action.dest == "read_timeout":
            action.help = (
                "a request silent for longer fails and is retried "
                f"(default {TRANSFER_READ_TIMEOUT_S:g}s: large copies and parts take a while)"
            )


def _destination_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    group = parser.add_argument_group(
        f"{what} endpoint (default: the same connection as the source)"
    )
    group.add_argument("--to-endpoint-url", metavar="URL", help=f"S3 endpoint of the {what}")
    group.add_argument("--to-profile", help=f"AWS profile for the {what}")
    group.add_argument("--to-region", help=f"region of the {what}")


def _destination_config(args: argparse.Namespace) -> S3Config | None:
    """The source's connection with the ``--to-*`` options applied, or None if none given."""
    changes = {
        "endpoint_url": args.to_endpoint_url,
        "profile": args.to_profile,
        "region": args.to_region,
    }
    given = {k: v for k, v in changes.items() if v is not None}
    return config_from(args).replace(**given) if given else None


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """Keep the engine's log records (a re-read after a bad checksum, a fallback) off
    stderr, where logging's last-resort handler would print them: the command ends with
    its own one line. Handlers the caller configured still receive them."""
    logger, handler = logging.getLogger("s3ckpt"), logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _report_json(report: object) -> dict[str, object]:
    return dataclasses.asdict(report)  # type: ignore[call-overload,no-any-return]


# -- cp -------------------------------------------------------------------------------------


def cp_arguments(parser: argparse.ArgumentParser) -> None:
    _transfer_arguments(parser, "committed checkpoint to copy, s3://bucket/prefix/name")
    parser.add_argument("destination", metavar="DST", help="where the copy goes, s3://...")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint committed at DST"
    )
    _destination_arguments(parser, "destination")


def run_cp(args: argparse.Namespace) -> int:
    from s3ckpt.interop.copy import copy_checkpoint

    with _one_line_errors():
        report = copy_checkpoint(
            args.uri,
            args.destination,
            overwrite=args.overwrite,
            config=config_from(args),
            destination_config=_destination_config(args),
            progress=Progress(),
        )
    how = "server-side" if report.server_side else "streamed"
    human = (
        f"copied {report.source} to {report.destination} ({report.objects} objects, "
        f"{human_bytes(report.bytes)}, {how}; verified {human_bytes(report.verified_bytes)})"
    )
    emit(args, _report_json(report), human)
    return 0


# -- export ---------------------------------------------------------------------------------


def export_arguments(parser: argparse.ArgumentParser) -> None:
    _transfer_arguments(parser, "committed checkpoint to export, s3://bucket/prefix/name")
    parser.add_argument("out", metavar="OUT", help="local folder or s3:// prefix to write")
    parser.add_argument(
        "--format",
        default="safetensors",
        help="safetensors (default: shards plus model.safetensors.index.json) or torch "
        "(one pytorch_model.bin for torch.load)",
    )
    parser.add_argument(
        "--only",
        metavar="PREFIX",
        help="export only the tensors under this name (e.g. model), named without it",
    )
    parser.add_argument("--dtype", help="convert floating-point tensors: bf16, fp16 or fp32")
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        metavar="SIZE",
        help="largest safetensors shard (default 5GB)",
    )
    parser.add_argument(
        "--window",
        type=parse_size,
        default="256MiB",
        metavar="SIZE",
        help="tensors read at a time, in bytes (default 256MiB; at least the largest tensor): "
        "what the export's memory follows",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into an OUT that already holds files"
    )
    _destination_arguments(parser, "s3:// OUT")


def run_export(args: argparse.Namespace) -> int:
    from s3ckpt.interop.export import export_checkpoint

    with _one_line_errors():
        report = export_checkpoint(
            args.uri,
            args.out,
            format=args.format,
            only=args.only,
            dtype=args.dtype,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            window=args.window,
            config=config_from(args),
            output_config=_destination_config(args),
            progress=Progress(),
        )
    human = (
        f"exported {report.source} to {report.output}: {report.tensors} tensors, "
        f"{human_bytes(report.bytes)} in {len(report.files)} file(s) ({report.format})"
    )
    emit(args, _report_json(report), human)
    if report.left_out:
        names = ", ".join(report.left_out[:5]) + (" ..." if len(report.left_out) > 5 else "")
        print(
            f"s3ckpt export: note: {len(report.left_out)} non-tensor item(s) not exported: {names}",
            file=sys.stderr,
        )
    if report.overflowed:
        print(
            f"s3ckpt export: warning: {args.dtype} cannot hold values of "
            f"{len(report.overflowed)} tensor(s) (first: {report.overflowed[0]}); "
            "they became inf",
            file=sys.stderr,
        )
    return 0


# -- import ---------------------------------------------------------------------------------


def import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SRC",
        help="a DCP checkpoint folder, safetensors file(s) or index, or a torch.save file",
    )
    _transfer_arguments(parser, "where the checkpoint goes, s3://bucket/prefix/name")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint committed there"
    )


def run_import(args: argparse.Namespace) -> int:
    from s3ckpt.interop.imports import import_checkpoint

    if args.source.startswith("s3://"):
        raise ConfigError("SRC must be a local path (to copy between stores: s3ckpt cp)")
    with _one_line_errors():
        report = import_checkpoint(
            args.source, args.uri, overwrite=args.overwrite, config=config_from(args)
        )
    human = (
        f"imported {report.source} ({report.format}: {report.tensors} tensors, "
        f"{human_bytes(report.bytes)}, {report.others} other item(s)) as {report.destination}"
    )
    emit(args, _report_json(report), human)
    return 0
