"""Deterministic train/eval split and eval-timestep buckets, by source id.

The split of a row depends only on its source id and the split seed (a SHA-256 hash), never on
the order rows arrive in, the runner, or the other rows; so reruns and other runners put every
row in the same split and the two splits never overlap.

Eval rows get a fixed timestep from ``timesteps_list`` (MaxDiffusion's eval scheme): the eval ids
are ranked by a second hash and dealt round-robin, so the buckets differ in size by at most one.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence

TRAIN, EVAL = "train", "eval"


def unit_hash(source_id: str, seed: int, purpose: str) -> float:
    """A uniform number in [0, 1) from ``(purpose, seed, source_id)``; stable across machines."""
    digest = hashlib.sha256(f"{purpose}:{seed}:{source_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_split(source_id: str, eval_fraction: float, seed: int = 0) -> str:
    """``"eval"`` for about ``eval_fraction`` of ids, ``"train"`` for the rest."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    return EVAL if unit_hash(source_id, seed, "split") < eval_fraction else TRAIN


def shard_key(source_id: str, seed: int = 0) -> tuple[float, str]:
    """Where a record sorts among its split's records: by a hash of its id (so shards mix
    whatever order the ids have), then by the id. Shards are contiguous runs of this order
    and hold their records in it, so their bytes do not depend on the runner's scheduling."""
    return (unit_hash(source_id, seed, "shard"), source_id)


def shard_boundaries(
    source_ids: Iterable[str], records_per_shard: int, seed: int = 0
) -> tuple[tuple[float, str], ...]:
    """The first key of each shard when the ids, in :func:`shard_key` order, are cut every
    ``records_per_shard`` (rows dropped later only make shards smaller)."""
    keys = sorted(shard_key(sid, seed) for sid in set(source_ids))
    return tuple(keys[::records_per_shard])


def shard_index(key: tuple[float, str], boundaries: Sequence[tuple[float, str]]) -> int:
    """The shard a record with this key goes to (0 when there are no boundaries)."""
    return max(0, bisect.bisect_right(boundaries, tuple(key)) - 1)


def assign_timesteps(
    eval_ids: Iterable[str], timesteps_list: Sequence[int], seed: int = 0, first_bucket: int = 0
) -> dict[str, int]:
    """source id -> timestep: ids ranked by hash, dealt round-robin over ``timesteps_list``
    starting at bucket ``first_bucket``.

    Bucket sizes differ by at most one; the result depends only on the set of ids. An
    incremental convert deals its new eval ids from where its base stopped (``first_bucket``
    = the base's eval count), so the union stays balanced and no earlier row changes bucket.
    """
    if not timesteps_list:
        raise ValueError("timesteps_list is empty")
    ranked = sorted(set(eval_ids), key=lambda i: (unit_hash(i, seed, "timestep"), i))
    count = len(timesteps_list)
    return {sid: int(timesteps_list[(first_bucket + k) % count]) for k, sid in enumerate(ranked)}


def bucket_counts(timesteps: Iterable[int], timesteps_list: Sequence[int]) -> dict[str, int]:
    """Records per eval timestep, every listed timestep present (0 when empty)."""
    counts = Counter(int(t) for t in timesteps)
    return {str(t): counts.get(int(t), 0) for t in timesteps_list}
