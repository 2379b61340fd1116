"""One ``s3ckpt doctor`` run: the store, the scratch prefix
(``<prefix>/.s3ckpt-doctor-<hex>/``, removed at the end), each check in turn, and the
clean-up."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from s3ckpt.catalog.doctor.bucket_versioning import versioning
from s3ckpt.catalog.doctor.endpoint import reach
from s3ckpt.catalog.doctor.features import (
    MiB,
    access,
    checksums,
    conditional,
    conditional_deletes,
    multipart,
    ranges,
    throughput,
    uploads_listing,
)
from s3ckpt.catalog.doctor.report import Check, Diagnosis, Status
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.errors import S3CkptError
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.versions import delete_versions, list_versions


class Probe:
    """One doctor run: the store, the scratch prefix, and the checks so far."""

    def __init__(self, store: ObjectStore, location: S3URI, sample: int) -> None:
        self.store, self.location, self.sample = store, location, sample
        self.scratch = location.key(f".s3ckpt-doctor-{secrets.token_hex(6)}")
        self.versioned = False  # deletes keep versions: the clean-up deletes them by id
        self.diagnosis = Diagnosis(str(location), store.config.endpoint_url or "(unresolved)")

    def key(self, name: str) -> str:
        return f"{self.scratch}/{name}"

    def add(self, name: str, status: Status, detail: str) -> None:
        self.diagnosis.checks.append(Check(name, status, detail))

    async def run(self) -> Diagnosis:
        try:
            if await reach(self):
                for check in (
                    access,
                    versioning,
                    conditional,
                    conditional_deletes,
                    checksums,
                    multipart,
                    ranges,
                    uploads_listing,
                    throughput,
                ):
                    await self._guarded(check)
        finally:
            await self._clean_up()
        return self.diagnosis

    async def _guarded(self, check: Callable[[Probe], Awaitable[None]]) -> None:
        name = check.__name__.strip("_").replace("_", " ")
        try:
            await check(self)
        except S3CkptError as exc:
            self.add(name, "failed", str(exc))

    async def _clean_up(self) -> None:
        try:
            keys = [m.key async for m in self.store.list(self.scratch + "/")]
            if keys:
                await self.store.delete_many(keys)
            if self.versioned:  # every version under the scratch prefix is the doctor's
                left = [v async for v in list_versions(self.store, self.scratch + "/")]
                await delete_versions(self.store, left)
            async for upload in self.store.list_multipart_uploads(self.scratch + "/"):
                await self.store.abort_multipart(upload.key, upload.upload_id)
        except S3CkptError:
            pass  # nothing more to do: the scratch prefix is named in every check's detail


def diagnose(
    uri: str | S3URI,
    *,
    sample_mib: int = 8,
    config: S3Config | None = None,
    **options: Any,
) -> Diagnosis:
    """Probe the store behind ``uri`` (see :mod:`s3ckpt.catalog.doctor`)."""
    location = uri if isinstance(uri, S3URI) else S3URI.parse(uri, require_prefix=False)
    probing = replace(make_config(config, **options), max_attempts=1)
    store = ObjectStore(probing, location.bucket)
    return io_loop().run(Probe(store, location, sample_mib * MiB).run())
