"""``make demo`` in its short form: it must crash a run mid-upload, resume and summarize.

Runs ``python -m s3ckpt.demo --quick`` as a user would (its own S3 server, its own
training processes), so what is checked is exactly what a newcomer sees.
"""

from __future__ import annotations

import re
import subprocess
import sys


def test_quick_demo_crashes_resumes_and_summarizes():
    done = subprocess.run(
        [sys.executable, "-m", "s3ckpt.demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(
        r"SIGKILL to the trainer \(pid \d+\) during the upload of step-0000000020", out
    ), out
    assert "step-0000000020: the killed save left" in out, out  # not committed
    assert "resumed from step-0000000010" in out, out
    # Training goes on while step 20 uploads, so the kill may land a step or two later.
    redone = re.search(r"steps 11-(\d+) were trained twice .*: losses identical", out)
    assert redone and int(redone.group(1)) >= 20, out
    for label in ("steps ", "checkpoints ", "mean step time ", "blocked per save ", "upload "):
        assert re.search(rf"^  {label}", out, re.MULTILINE), label
    assert "overhead" in out and "MiB/s" in out
    assert "$ s3ckpt ls" in out and "$ s3ckpt prune" in out and "$ s3ckpt gc" in out
    assert "abort upload" in out or "delete uncommitted" in out or "delete unreferenced" in out
    assert "demo finished in" in out
