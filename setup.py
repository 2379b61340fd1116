"""Builds the optional C helpers; everything else is in pyproject.toml.

``s3ckpt.format._byteplanes`` (byte grouping for compressed checkpoints) and
``s3ckpt.transfer._gather`` (parts joined from small items without holding the GIL) and
``s3ckpt.s3.wire._sender`` (a batch of part uploads sent and answered without the GIL). All
are optional: without a C compiler the package installs and uses its Python fallbacks
(slower, same bytes).
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
        ),
        Extension(
            "s3ckpt.transfer._gather",
            sources=["s3ckpt/transfer/_gather.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        ),
        Extension(
            "s3ckpt.s3.wire._sender",
            sources=["s3ckpt/s3/wire/_sender.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        ),
    ]
)
