"""Checkpoints in and out of s3ckpt: export to inference formats, import, copy.

A layer between the ``s3ckpt`` command and the parts it combines: export and import go
through the DCP adapters (:mod:`s3ckpt.dcp`, so they need torch), the copy through the
transfer engine and the catalog's verifier (no torch). One module per job:

* :mod:`~s3ckpt.interop.export`: a checkpoint of any world size to safetensors shards or
  one ``torch.save`` file, streamed tensor by tensor (torch);
* :mod:`~s3ckpt.interop.formats`: writing those files into a local folder or an S3 prefix
  as tensors arrive (torch);
* :mod:`~s3ckpt.interop.imports`: a DCP folder, safetensors files or a ``torch.save`` file
  saved as an s3ckpt checkpoint (torch);
* :mod:`~s3ckpt.interop.copy`: a checkpoint copied between prefixes, buckets or
  endpoints, verified, committed last (no torch);
* :mod:`~s3ckpt.interop.objects`: one object copied server-side or streamed (no torch).
"""

from typing import TYPE_CHECKING

from s3ckpt._lazy import lazy_attributes

if TYPE_CHECKING:
    from s3ckpt.interop.copy import CopyReport, copy_checkpoint
    from s3ckpt.interop.export import ExportReport, export_checkpoint
    from s3ckpt.interop.imports import ImportReport, import_checkpoint

# Resolved on first use: export and import import torch, and `s3ckpt cp` must not.
_LAZY = {
    "CopyReport": "s3ckpt.interop.copy",
    "copy_checkpoint": "s3ckpt.interop.copy",
    "ExportReport": "s3ckpt.interop.export",
    "export_checkpoint": "s3ckpt.interop.export",
    "ImportReport": "s3ckpt.interop.imports",
    "import_checkpoint": "s3ckpt.interop.imports",
}

__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "CopyReport",
    "ExportReport",
    "ImportReport",
    "copy_checkpoint",
    "export_checkpoint",
    "import_checkpoint",
]
