"""Peak memory of one export, measured in a fresh process (``python _export_memory.py``).

Prints one JSON line: the resident set before the export (torch and s3ckpt imported) and
its peak during the export (``VmHWM``, reset first through ``/proc/self/clear_refs``).
Arguments: checkpoint URI, output, window in bytes; the S3 endpoint and credentials come
from the ``AWS_*`` environment.
"""

from __future__ import annotations

import json
import sys
import warnings


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(uri: str, out: str, window: int) -> None:
    warnings.filterwarnings("ignore")
    import torch  # noqa: F401 - imported before the baseline is taken

    from s3ckpt.interop.export import export_checkpoint

    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM, the peak resident set, to the current one
    report = export_checkpoint(uri, out, window=window)
    print(json.dumps({"baseline": baseline, "peak": _status("VmHWM"), "bytes": report.bytes}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
