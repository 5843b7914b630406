"""The versioned JSON manifest format and the object key layout."""

from fastckpt.format.codec import decode_manifest as decode_manifest
from fastckpt.format.codec import encode_manifest as encode_manifest
from fastckpt.format.dtypes import dtype_from_name as dtype_from_name
from fastckpt.format.dtypes import dtype_name as dtype_name
from fastckpt.format.manifest import FORMAT_VERSION as FORMAT_VERSION
from fastckpt.format.manifest import ArrayLeaf as ArrayLeaf
from fastckpt.format.manifest import Box as Box
from fastckpt.format.manifest import ChunkEntry as ChunkEntry
from fastckpt.format.manifest import ChunkTable as ChunkTable
from fastckpt.format.manifest import KeyPath as KeyPath
from fastckpt.format.manifest import Leaf as Leaf
from fastckpt.format.manifest import Manifest as Manifest
from fastckpt.format.manifest import ShardingSpec as ShardingSpec
from fastckpt.format.manifest import ValueLeaf as ValueLeaf
from fastckpt.format.manifest import chunk_id as chunk_id
from fastckpt.format.manifest import chunk_ids as chunk_ids
from fastckpt.format.manifest import keypath_str as keypath_str
