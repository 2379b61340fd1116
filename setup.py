"""Builds the optional C helpers; everything else is in pyproject.toml.

``s3ckpt.format._byteplanes`` (byte grouping for compressed checkpoints) and
``s3ckpt.transfer._gather`` (parts joined from small items without holding the GIL) and
``s3ckpt.s3.wire._sender`` (a batch of part uploads sent and answered without the GIL). All
are optional: without a C compiler the package installs and uses its Python fallbacks
(slower, same bytes).
"""

import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = [] if sys.platform == "win32" else ["-O3"]


class AtomicBuildExt(build_ext):
    """Copies each built helper into place by rename, never over the file in place: an
    editable install copies the helpers into the source tree, and processes already running
    from that tree (another environment's tests) keep the file they mapped."""

    def copy_file(
        self, infile: str, outfile: str, *args: object, **kwargs: object
    ) -> tuple[str, int]:
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        partial = f"{outfile}.{os.getpid()}.partial"
        shutil.copyfile(infile, partial)
        shutil.copymode(infile, partial)
        os.replace(partial, outfile)
        return outfile, 1


setup(
    cmdclass={"build_ext": AtomicBuildExt},
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
    ],
)
