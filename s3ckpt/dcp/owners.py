"""From a DCP ``MetadataIndex`` to the rank that stored it, through :class:`ItemOwners`.

Format 2 keeps no per-item storage record in DCP's metadata, only which rank stored each
chunk (:class:`~s3ckpt.format.rank_index.ItemOwners`, by the chunk's position in
``TensorStorageMetadata.chunks``). DCP names a stored chunk by its FQN and offsets, and
usually also by that position (the ``index`` hint its planners set); the hint is used
when it agrees with the offsets, and the offsets are searched otherwise.
"""

from __future__ import annotations

from s3ckpt.dcp.compat import Metadata, MetadataIndex


class ChunkPositions:
    """Positions of stored chunks in DCP's metadata, looked up by ``MetadataIndex``."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self._by_offsets: dict[str, dict[tuple[int, ...], int]] = {}

    def of(self, index: MetadataIndex) -> int:
        """The position of ``index``'s chunk (0 for a non-tensor item); KeyError if the
        metadata has no such chunk."""
        md = self.metadata.state_dict_metadata[index.fqn]
        chunks = getattr(md, "chunks", None)
        if chunks is None:
            return 0
        offsets = tuple(index.offset or ())
        hint = index.index
        if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
            return hint
        table = self._by_offsets.get(index.fqn)
        if table is None:
            table = {tuple(c.offsets): i for i, c in enumerate(chunks)}
            self._by_offsets[index.fqn] = table
        return table[offsets]
