"""What a committed checkpoint holds, read with a plain boto3 client (tests look at the
stored objects directly, independently of the catalog)."""

from __future__ import annotations

import dataclasses
from typing import Any

from s3ckpt.config import S3URI
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.format.rank_index import RankIndex


def stored_manifest(client: Any, uri: str) -> Manifest:
    """The manifest at ``uri``, with :attr:`Manifest.items` filled in from the index
    objects when the checkpoint keeps them there (format 2)."""
    location = S3URI.parse(uri)

    def get(key: str) -> bytes:
        return client.get_object(Bucket=location.bucket, Key=location.key(key))["Body"].read()

    manifest = Manifest.from_json(get(MANIFEST_NAME), uri)
    if manifest.items_listed:
        return manifest
    etags = manifest.etags()
    items = tuple(
        item
        for ref in manifest.indexes
        for item in RankIndex.from_json(get(ref.key), ref.key, etags).items
    )
    return dataclasses.replace(manifest, items=items)
