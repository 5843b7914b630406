"""Pure planning: box arithmetic, save plans and restore (resharding) plans. No I/O."""

from fastckpt.planning.boxes import box_from_index as box_from_index
from fastckpt.planning.boxes import box_to_slices as box_to_slices
from fastckpt.planning.boxes import box_volume as box_volume
from fastckpt.planning.boxes import contiguous_span as contiguous_span
from fastckpt.planning.boxes import element_runs as element_runs
from fastckpt.planning.boxes import full_box as full_box
from fastckpt.planning.boxes import intersect as intersect
from fastckpt.planning.boxes import is_inside as is_inside
from fastckpt.planning.boxes import relative_to as relative_to
from fastckpt.planning.boxes import split_box as split_box
from fastckpt.planning.load_plan import ChunkIndex as ChunkIndex
from fastckpt.planning.load_plan import FetchRange as FetchRange
from fastckpt.planning.load_plan import GridIndex as GridIndex
from fastckpt.planning.load_plan import ReadItem as ReadItem
from fastckpt.planning.load_plan import coalesce_fetches as coalesce_fetches
from fastckpt.planning.load_plan import leaf_index as leaf_index
from fastckpt.planning.load_plan import needed_chunks as needed_chunks
from fastckpt.planning.load_plan import plan_leaf_reads as plan_leaf_reads
from fastckpt.planning.save_plan import ShardInfo as ShardInfo
from fastckpt.planning.save_plan import WriteItem as WriteItem
from fastckpt.planning.save_plan import plan_leaf_writes as plan_leaf_writes
