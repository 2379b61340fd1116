"""A multi-rank load never assembles one state from two checkpoints.

Ranks load a DTensor-sharded checkpoint in rounds while this process overwrites it and runs
``gc`` with no grace after every overwrite (each save fills its tensors with its own
number). In some rounds the last rank's data reads are held back until an overwrite and
its ``gc`` are done. Without a group that rank meets vanished objects while the others
have read the older save, and every rank must fail with ``CheckpointReplacedError``; with
the group it may have nothing to fetch itself (others own its ranges and pass them on).
Every load that returns holds one version on every rank.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _dist_worker as worker
import _replaced_load_worker as load_worker
import pytest
import reliability_report as report
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3StorageWriter, catalog
from s3ckpt.config import S3Config
from s3ckpt.testing.local_s3 import LocalS3Server

pytestmark = [pytest.mark.distributed]

ROUNDS = 6
FORCED = [1, 4]  # one with the reader given the group, one without


class _Overwriter(threading.Thread):
    """Overwrites the checkpoint and collects the replaced save, over and over; answers a
    stalled rank's signal with one overwrite and gc before letting it go on."""

    def __init__(self, uri: str, s3: dict[str, Any], signals: Path) -> None:
        super().__init__(daemon=True)
        self.uri, self.s3, self.signals = uri, s3, signals
        self.version = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def overwrite(self, *, until_collected: bool = False) -> None:
        """One overwrite and gc with no grace; ``until_collected``: gc again until it has
        removed the replaced save (ages have a resolution of one second)."""
        self.version += 1
        writer = S3StorageWriter(self.uri, overwrite=True, **self.s3)
        dcp.save(load_worker.version_state(self.version), storage_writer=writer, no_dist=True)
        config = S3Config(
            endpoint_url=self.s3["endpoint_url"],
            access_key_id=self.s3["access_key_id"],
            secret_access_key=self.s3["secret_access_key"],
            region=self.s3["region"],
        )
        for _ in range(40):
            catalog.collect_garbage(self.uri, grace=0, config=config)
            if not until_collected or self._only_the_committed_save_left():
                return
            time.sleep(0.25)
        raise TimeoutError("gc never removed the replaced saves")

    def _only_the_committed_save_left(self) -> bool:
        import boto3

        bucket, _, prefix = self.uri.removeprefix("s3://").partition("/")
        client = boto3.client(
            "s3",
            endpoint_url=self.s3["endpoint_url"],
            aws_access_key_id=self.s3["access_key_id"],
            aws_secret_access_key=self.s3["secret_access_key"],
            region_name=self.s3["region"],
        )
        manifest = client.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read()
        save_id = json.loads(manifest)["save_id"]
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/data/")
        return all(save_id in o["Key"] for o in listed.get("Contents", []))

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                stalled = [
                    p for p in self.signals.glob("stalled-*")
                    if not (self.signals / p.name.replace("stalled", "overwritten")).exists()
                ]  # fmt: skip
                self.overwrite(until_collected=bool(stalled))
                for signal in stalled:
                    (self.signals / signal.name.replace("stalled", "overwritten")).touch()
        except BaseException as exc:
            self.error = exc


@pytest.fixture(scope="module")
def matrix() -> Iterator[report.Suite]:
    """Rows of the fault matrix (``make reliability-report`` renders them)."""
    yield from report.filled(
        "replaced",
        2,
        notes=[
            f"Each row: {ROUNDS} rounds of a sharded load on every rank while this process "
            "overwrites the checkpoint and runs gc with no grace after each overwrite; in "
            f"{len(FORCED)} of them the last rank's reads wait for an overwrite. Survived: "
            "one version on every rank; failed cleanly: CheckpointReplacedError on every rank.",
        ],
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_load_returns_one_save_on_every_rank_or_fails_on_all(
    world_size: int, seaweedfs_s3: LocalS3Server, tmp_path: Path, matrix: report.Suite
):
    uri = f"s3://{seaweedfs_s3.bucket}/replaced-during-load-{secrets.token_hex(4)}"
    s3 = worker.server_options(seaweedfs_s3)
    dcp.save(load_worker.version_state(0), storage_writer=S3StorageWriter(uri, **s3), no_dist=True)
    overwriter = _Overwriter(uri, s3, tmp_path)
    overwriter.start()
    try:
        worker.run_ranks(
            load_worker.loading_main,
            world_size,
            s3,
            uri,
            str(tmp_path),
            ROUNDS,
            FORCED,
            timeout=300,
        )
    finally:
        overwriter.stop.set()
        overwriter.join(timeout=120)
    assert overwriter.error is None, overwriter.error
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    for round_ in range(ROUNDS):
        outcomes = [report["outcomes"][round_] for report in reports]
        kinds = {kind for kind, _ in outcomes}
        assert len(kinds) == 1, f"round {round_}: ranks disagree: {outcomes}"
        if kinds == {"loaded"}:
            versions = {tuple(values) for _, values in outcomes}
            assert len(versions) == 1 and len(next(iter(versions))) == 1, (
                f"round {round_}: a state mixing saves: {outcomes}"
            )
        if round_ in FORCED and round_ % 2 == 0:
            # Without a group, the held-back rank reads the replaced save's objects itself,
            # after they are gone. With the group (odd rounds) it may fetch nothing: the
            # ranks that own its ranges read them in time, and every rank loads that save.
            assert kinds == {"replaced"}, f"round {round_}: {outcomes}"
            assert "load again" in outcomes[-1][1]
    assert overwriter.version >= len(FORCED)
    kinds = [reports[0]["outcomes"][r][0] for r in range(ROUNDS)]
    matrix.add(
        report.Row(
            f"{world_size} gloo ranks loading while the checkpoint is overwritten and collected",
            {"overwrite+gc": overwriter.version},
            operations=ROUNDS * world_size,
            survived=kinds.count("loaded") * world_size,
            failed_cleanly=kinds.count("replaced") * world_size,
        )
    )
