"""How to install one of s3ckpt's extras, as every message that asks for one words it.

s3ckpt installs from a checkout (README's install section): ``pip install 's3ckpt[extra]'``
finds nothing on the package index."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The commands that install ``extra`` from a checkout of s3ckpt."""
    return (
        f"s3ckpt's '{extra}' extra: pip install './s3ckpt[{extra}]' (./s3ckpt: the "
        f"checkout's folder; inside it: pip install -e '.[{extra}]')"
    )
