"""The parameters of each S3 request the engine sends, as the aiobotocore client's method
for it takes them (``Bucket`` aside), built from the typed arguments of the transport seam
(:mod:`s3ckpt.s3.transport`) in this one place: the client sends them
(:mod:`s3ckpt.s3.aiobotocore_transport`), and so does the data plane, through the client's
own serializer (:class:`s3ckpt.s3.wire.data_plane.SignedCalls`), so both send the same
request.

A parameter given as None is left out, as a caller that does not pass it to the client.
"""

from __future__ import annotations

from typing import Any

Params = dict[str, Any]  # an operation's parameters as the client's method takes them
Parsed = dict[str, Any]  # an answer as the client's method returns it
CompletedParts = list[dict[str, Any]]  # CompleteMultipartUpload's parts, as the client takes them
ObjectIds = list[dict[str, str]]  # DeleteObjects' objects: each a ``Key``, maybe a ``VersionId``


def _given(**params: Any) -> Params:
    return {name: value for name, value in params.items() if value is not None}


def head_object(key: str) -> Params:
    return {"Key": key}


def create_multipart_upload(key: str, *, checksum: bool) -> Params:
    """``checksum``: the parts carry a CRC32C, so the object gets a composite one."""
    return _given(Key=key, ChecksumAlgorithm="CRC32C" if checksum else None)


def complete_multipart_upload(
    key: str, upload_id: str, parts: CompletedParts, *, create: bool
) -> Params:
    """``create``: only where ``key`` does not exist yet (``If-None-Match: *``)."""
    return _given(
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": parts},
        IfNoneMatch="*" if create else None,
    )


def abort_multipart_upload(key: str, upload_id: str) -> Params:
    return {"Key": key, "UploadId": upload_id}


def list_objects(
    prefix: str,
    *,
    delimiter: str | None = None,
    continuation_token: str | None = None,
    start_after: str | None = None,
) -> Params:
    return _given(
        Prefix=prefix,
        Delimiter=delimiter or None,
        ContinuationToken=continuation_token,
        StartAfter=start_after,
    )


def list_multipart_uploads(
    prefix: str, *, key_marker: str | None = None, upload_id_marker: str | None = None
) -> Params:
    return _given(Prefix=prefix, KeyMarker=key_marker, UploadIdMarker=upload_id_marker)


def list_object_versions(
    prefix: str, *, key_marker: str | None = None, version_id_marker: str | None = None
) -> Params:
    return _given(Prefix=prefix, KeyMarker=key_marker, VersionIdMarker=version_id_marker)


def copy_object(key: str, source_bucket: str, source_key: str) -> Params:
    return {"Key": key, "CopySource": {"Bucket": source_bucket, "Key": source_key}}


def upload_part_copy(
    key: str, upload_id: str, part_number: int, source: tuple[str, str, int, int]
) -> Params:
    """``source``: bytes ``[start, end)`` of ``(bucket, key, start, end)``."""
    source_bucket, source_key, start, end = source
    return {
        "Key": key,
        "UploadId": upload_id,
        "PartNumber": part_number,
        "CopySource": {"Bucket": source_bucket, "Key": source_key},
        "CopySourceRange": f"bytes={start}-{end - 1}",
    }


def delete_object(key: str, *, if_match: str | None = None) -> Params:
    return _given(Key=key, IfMatch=if_match)


def delete_objects(objects: ObjectIds) -> Params:
    """A quiet batch delete: only the objects that failed are answered."""
    return {"Delete": {"Objects": objects, "Quiet": True}}
