"""The versioned JSON manifest format and the object key layout."""

from fastckpt.format.codec import decode_manifest as decode_manifest, encode_manifest as encode_manifest
from fastckpt.format.dtypes import dtype_from_name as dtype_from_name, dtype_name as dtype_name
from fastckpt.format.manifest import (
    FORMAT_VERSION as FORMAT_VERSION,
    ArrayLeaf as ArrayLeaf,
    Box as Box,
    ChunkEntry as ChunkEntry,
    ChunkTable as ChunkTable,
    KeyPath as KeyPath,
    Leaf as Leaf,
    Manifest as Manifest,
    ShardingSpec as ShardingSpec,
    ValueLeaf as ValueLeaf,
    chunk_id as chunk_id,
    chunk_ids as chunk_ids,
    keypath_str as keypath_str,
)
