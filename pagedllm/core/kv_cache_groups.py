"""KV cache groups (vLLM's hybrid KV cache manager): which layers keep their keys and values in the same blocks.

Every layer of a model whose layers all attend alike (all to everything, or all within a sliding window) reads a
request's history through one block table: one group, and a block holds a block's positions for every layer. A
hybrid model (Gemma 2's alternating local and global layers, Gemma 3's five local to one global) has layers that
need a request's whole history beside layers that never look further back than their window. Through one table the
local layers' old positions stay as long as the global layers' do; so the layers go in groups of one kind each,
every group with its own block table, and a local group's blocks that fall out of its window go back to the pool
while the global groups keep theirs (core/kv_cache_manager.py).

The groups are of equal size (the fewest layers of a kind; a kind with more goes in several groups, the last one
possibly short), and the cache has one tensor (pair) per position in a group: layer j of every group keeps its K/V
in tensor j. A block id then names the same slice of each tensor for whichever group holds it, and a block costs the
bytes of one group's layers, not of every layer's: a request of n tokens holds about n / block_size blocks in each
global group and window / block_size in each local one, against n / block_size blocks of every layer's bytes in one
group.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model-wide indices, in order) whose KV share a request's block table, and their sliding window
    (None: full attention)."""
    layers: tuple[int, ...]
    sliding_window: int | None


def kv_cache_groups(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i has sliding window ``windows[i]``: one group of every layer where all
    attend alike (all to everything, or all within a window: the largest), else a group per kind of layer (full
    attention first, then each window, smallest first), kinds of more layers than the fewest split in groups of
    that many."""
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if None not in kinds or len(kinds) == 1:
        return (KVCacheGroup(tuple(range(len(windows))), None if None in kinds else max(kinds)),)
    layers_of = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in layers_of.values())
    return tuple(KVCacheGroup(tuple(layers[start:start + size]), kind)
                 for kind, layers in layers_of.items() for start in range(0, len(layers), size))


def layer_placement(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Each layer's (group index, place in its group)."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}


def stage_cache_tensors(groups: Sequence[KVCacheGroup], start: int, end: int) -> list[int]:
    """For each layer of ``start .. end - 1`` (a pipeline stage's), the cache tensor (pair) it keeps its K/V in,
    numbered from 0 over the tensors the stage holds: one per layer without groups, else one per place in a group
    (layer j of every group: tensor j)."""
    if not groups:
        return list(range(end - start))
    placement = layer_placement(groups)
    places = [placement[layer][1] for layer in range(start, end)]
    number = {place: i for i, place in enumerate(sorted(set(places)))}
    return [number[place] for place in places]
