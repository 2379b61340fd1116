"""Rendering catalog results for the CLI: JSON documents and human tables.

JSON field names are a stable interface (documented in ``docs/cli.md``): sizes in bytes,
ages in seconds, times as UTC ISO 8601 plus a ``*_timestamp`` in seconds since the epoch.
Human output uses :mod:`s3ckpt.cli.humanize`. Catalog types are imported for type checking
only, so importing this module stays cheap.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from s3ckpt.cli import states
from s3ckpt.cli.humanize import format_time, human_bytes, human_duration, iso_time, table

if TYPE_CHECKING:
    from s3ckpt.catalog import CheckpointInfo, PruneReport, Removed
    from s3ckpt.catalog.doctor import Diagnosis
    from s3ckpt.catalog.gc import GcReport
    from s3ckpt.catalog.verify import VerifyReport
    from s3ckpt.format.layout import StoredItem
    from s3ckpt.format.manifest import Manifest


def _status(info: CheckpointInfo, now: float) -> str:
    return states.status(info, now)  # the states: s3ckpt.cli.states


# -- ls -------------------------------------------------------------------------------------


def info_json(info: CheckpointInfo, now: float) -> dict[str, Any]:
    return {
        "name": info.name,
        "uri": info.uri,
        "status": _status(info, now),
        "time": iso_time(info.time),
        "timestamp": info.time,
        "age_seconds": round(now - info.time, 3),
        "bytes": info.bytes,
        "objects": info.objects,
        "ranks": info.ranks,
        "items": info.items,
        "save_id": info.save_id,
        "open_uploads": info.uploads,
        "in_flight": info.in_flight,
        "superseded_by": info.superseded_by,
        "damaged": info.damaged,
        "foreign": info.foreign,
        "silent_seconds": None if info.silent is None else round(info.silent, 3),
        "left_objects": info.left,
        "gc_after": None if info.gc_after is None else iso_time(info.gc_after),
    }


def info_table(infos: list[CheckpointInfo], now: float, *, status: bool, items: bool) -> str:
    if not infos:
        return ""
    headers = ["NAME", "STATUS", "TIME", "AGE", "SIZE", "RANKS", "ITEMS"]
    rows = [
        [
            info.name or ".",
            _status(info, now),
            format_time(info.time),
            human_duration(now - info.time),
            human_bytes(info.bytes),
            info.ranks,
            info.items,
        ]
        for info in infos
    ]
    # Damaged and superseded checkpoints are worth a status column even without --all.
    status = status or any(i.damaged or i.superseded_by or i.gc_after for i in infos)
    keep = [
        i for i, h in enumerate(headers) if (h != "STATUS" or status) and (h != "ITEMS" or items)
    ]
    return table(
        [headers[i] for i in keep],
        [[row[i] for i in keep] for row in rows],
        right=[n for n, i in enumerate(keep) if headers[i] in ("SIZE", "RANKS", "ITEMS")],
    )


# -- show -----------------------------------------------------------------------------------


def manifest_json(uri: str, manifest: Manifest) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(manifest.to_json())
    body["items"] = [item.to_dict() for item in manifest.items]
    return {"uri": uri, "created_time": iso_time(manifest.created), **body}


def _crc(item: StoredItem) -> str:
    first = f"{item.crc32c[0]:08x}" if item.crc32c else "-"
    return first if len(item.crc32c) <= 1 else f"{first} (+{len(item.crc32c) - 1} blocks)"


def _objects(manifest: Manifest) -> str:
    indexes = f"{len(manifest.indexes)} index, " if manifest.indexes else ""
    return f"{len(manifest.objects)} data, {indexes}1 metadata"


def manifest_text(uri: str, manifest: Manifest) -> str:
    summary = table(
        ["", ""],
        [
            ["save id", manifest.save_id],
            ["committed", format_time(manifest.created)],
            ["ranks", manifest.world_size],
            ["items", manifest.item_count],
            ["objects", _objects(manifest)],
            ["size", f"{human_bytes(manifest.total_bytes)} ({manifest.total_bytes} bytes)"],
            ["written by", f"torch {manifest.torch_version}, s3ckpt {manifest.s3ckpt_version}"],
        ],
    ).splitlines()[1:]
    rows = [
        [
            item.fqn,
            list(item.chunk_offsets) if any(item.chunk_offsets) else "",
            item.dtype if item.kind == "tensor" else "(bytes)",
            list(item.shape) if item.shape is not None else "",
            human_bytes(item.stored.length),
            item.stored.codec,
            _crc(item.stored),
        ]
        for item in manifest.items
    ]
    items = table(["FQN", "CHUNK", "DTYPE", "SHAPE", "SIZE", "CODEC", "CRC32C"], rows, right=[4])
    return "\n".join([uri, *summary, "", items])


# -- verify ---------------------------------------------------------------------------------


def verify_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "uri": report.uri,
        "save_id": report.save_id,
        "ok": report.ok,
        "items": report.items,
        "objects": report.objects,
        "bytes_checked": report.bytes,
        "problems": [{"item": p.what, "key": p.key, "problem": p.message} for p in report.problems],
    }


def verify_text(report: VerifyReport) -> str:
    checked = f"{report.items} items, {report.objects} objects, {human_bytes(report.bytes)} read"
    if report.ok:
        return f"ok  {report.uri}  ({checked})"
    rows = [[p.what, p.key, p.message] for p in report.problems]
    return "\n".join(
        [table(["ITEM", "OBJECT", "PROBLEM"], rows), "", f"DAMAGED  {report.uri}  ({checked})"]
    )


# -- prune and rm ---------------------------------------------------------------------------


def removed_json(removed: Removed) -> dict[str, Any]:
    return {
        "name": removed.name,
        "uri": removed.uri,
        "objects": removed.objects,
        "bytes": removed.bytes,
        **_versions(removed.versions, removed.version_bytes),
    }


def prune_json(report: PruneReport) -> dict[str, Any]:
    return {
        "dry_run": report.dry_run,
        "deleted": [removed_json(r) for r in report.removed],
        "kept": [{"name": d.name, "reason": d.reason} for d in report.decisions if not d.delete],
        "changed": report.changed,
        "why_changed": report.why_changed,
        "foreign": report.foreign,
        "bytes": sum(r.bytes for r in report.removed),
    }


def prune_text(report: PruneReport) -> str:
    verb = "would delete" if report.dry_run else "deleted"
    sizes = {r.name: r.bytes for r in report.removed}
    rows = [
        [
            d.name or ".",
            format_time(d.time),
            human_bytes(sizes[d.name]) if d.name in sizes else "",
            verb if d.delete and d.name not in report.changed else f"keep ({_why(d, report)})",
        ]
        for d in report.decisions
    ]
    total = sum(sizes.values())
    summary = f"{verb} {len(report.removed)} checkpoint(s), {human_bytes(total)}"
    parts = [table(["NAME", "COMMITTED", "SIZE", "ACTION"], rows, right=[2])] if rows else []
    return "\n".join([*parts, summary])


def _why(decision: Any, report: PruneReport) -> str:
    if decision.name in report.changed:
        return report.why_changed.get(decision.name, "recommitted meanwhile")
    return decision.reason


# -- gc -------------------------------------------------------------------------------------


def gc_json(report: GcReport) -> dict[str, Any]:
    return {
        "dry_run": report.dry_run,
        "grace_seconds": report.grace,
        "aborted_uploads": [
            {"key": u.key, "upload_id": u.upload_id, "age_seconds": round(u.age, 3)}
            for u in report.uploads
        ],
        "deleted": [
            {
                "name": g.name,
                "reason": g.reason,
                "objects": len(g.keys),
                "bytes": g.bytes,
                "age_seconds": round(g.age, 3),
                "keys": list(g.keys),
            }
            for g in report.garbage
        ],
        "objects": report.objects,
        "bytes": report.bytes,
        "in_flight": report.in_flight,
        "problems": report.problems,
        **_versions(report.versions, report.version_bytes),
    }


def _versions(versions: int, nbytes: int) -> dict[str, int]:
    """Versions deleted by id on a bucket with versioning on (none: no keys)."""
    return {"versions": versions, "version_bytes": nbytes} if versions else {}


def gc_text(report: GcReport) -> str:
    rows = [["abort upload", u.key, "", "", human_duration(u.age)] for u in report.uploads]
    rows += [
        [
            f"delete {g.reason}",
            g.name or ".",
            len(g.keys),
            human_bytes(g.bytes),
            human_duration(g.age),
        ]
        for g in report.garbage
    ]
    rows += [["leave (save in flight)", name or ".", "", "", ""] for name in report.in_flight]
    verb = "would remove" if report.dry_run else "removed"
    summary = (
        f"{verb} {report.objects} object(s), {human_bytes(report.bytes)}, and "
        f"{len(report.uploads)} upload(s) (grace {human_duration(report.grace)})"
    )
    if report.versions:  # a bucket with versioning on
        summary += f"; {report.versions} old version(s), {human_bytes(report.version_bytes)}"
    parts = (
        [table(["ACTION", "WHAT", "OBJECTS", "SIZE", "AGE"], rows, right=[2, 3])] if rows else []
    )
    return "\n".join([*parts, summary])


# -- doctor ---------------------------------------------------------------------------------


def doctor_json(diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "uri": diagnosis.uri,
        "endpoint": diagnosis.endpoint,
        "endpoint_source": diagnosis.endpoint_source,
        "checks": [
            {"check": c.name, "status": c.status, "detail": c.detail} for c in diagnosis.checks
        ],
        "plan": diagnosis.plan,
        "exit_status": diagnosis.exit_status,
    }


def doctor_text(diagnosis: Diagnosis) -> str:
    marks = {"ok": "ok  ", "degraded": "WARN", "failed": "FAIL"}
    lines = [f"{marks[c.status]}  {c.name}: {c.detail}" for c in diagnosis.checks]
    lines += [f"plan  {step}" for step in diagnosis.plan]
    verdict = {
        0: "s3ckpt will work here",
        1: "s3ckpt will work here, with the fallbacks above",
        2: "s3ckpt cannot work here",
    }[diagnosis.exit_status]
    return "\n".join([*lines, verdict])
