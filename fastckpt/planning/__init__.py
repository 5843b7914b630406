"""Pure planning: box arithmetic, save plans and restore (resharding) plans. No I/O."""

from fastckpt.planning.boxes import (
    box_from_index as box_from_index,
    box_shape as box_shape,
    box_to_slices as box_to_slices,
    box_volume as box_volume,
    contiguous_span as contiguous_span,
    element_runs as element_runs,
    full_box as full_box,
    intersect as intersect,
    is_inside as is_inside,
    relative_to as relative_to,
    split_box as split_box,
)
from fastckpt.planning.load_plan import (
    ChunkIndex as ChunkIndex,
    FetchRange as FetchRange,
    GridIndex as GridIndex,
    ReadItem as ReadItem,
    coalesce_fetches as coalesce_fetches,
    leaf_index as leaf_index,
    needed_chunks as needed_chunks,
    plan_leaf_reads as plan_leaf_reads,
)
from fastckpt.planning.save_plan import (
    ShardInfo as ShardInfo,
    WriteItem as WriteItem,
    plan_leaf_writes as plan_leaf_writes,
)
