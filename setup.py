"""Builds the optional C helper ``s3ckpt.format._byteplanes``; everything else is in pyproject.toml.

The extension is optional: without a C compiler the package installs and uses its numpy
fallback (slower byte grouping for compressed checkpoints, same format).
"""

import sys

from setuptools import Extension, setup

_FLAGS = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(
            "s3ckpt.format._byteplanes",
            sources=["s3ckpt/format/_byteplanes.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        )
    ]
)
