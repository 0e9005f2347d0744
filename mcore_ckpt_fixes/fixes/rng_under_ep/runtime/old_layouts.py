"""rng-under-ep, load side: which RNG shard to ask a checkpoint for, given the layout it was written in.

A checkpoint holds the ``torch_dist`` RNG state in one of two layouts:

* per rank, ``(pp, tp, dp_cp)``: written with this fix (or by upstream main). Read as it is, also
  after a data-parallel growth while this rank's dp_cp index exists in it; a rank beyond the stored
  extent keeps its current RNG state, with a warning. After a data-parallel shrink every rank keeps
  its current RNG state, with a warning: ``dist_checkpointing`` loads a ShardedObject only whole.
* the old 2-D ``(pp, tp)`` layout of an unfixed release: one copy per (pp, tp), written by a single
  data-parallel rank. Read (it is the best state there is) with a warning that names the old layout,
  on every rank whose restored state is not its own (:func:`restores_own_copy`); on the others the
  same text is logged (INFO on global rank 0, DEBUG elsewhere).

Only the checkpoint's metadata is read here; :func:`.core.load_global_dist_base_checkpoint` emits
the warning and loads what :func:`align_rng_request` asks for.
"""

from __future__ import annotations

import dataclasses

from .. import ID


def stored_rng_shards(checkpoint_dir, key):
    """[(global_offset, global_shape)] of the shards the checkpoint holds for ``key``.

    Reads the checkpoint's metadata only (what ``load_sharded_metadata`` reads), through Megatron's
    own reader so that MSC URLs work as they do for the load itself.
    """
    try:
        from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

        reader = _get_filesystem_reader(checkpoint_dir)
    except ImportError:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(str(checkpoint_dir))
    prefix = f"{key}/shard_"
    shards = []
    for name in reader.read_metadata().state_dict_metadata:
        if not name.startswith(prefix):
            continue
        offset, _, shape = name[len(prefix) :].partition("_")
        try:
            shards.append((tuple(map(int, offset.split("."))), tuple(map(int, shape.split(".")))))
        except ValueError:
            continue
    return shards


def align_rng_request(template, checkpoint_dir):
    """(what to request instead of ``template`` or None for nothing, warning text or None).

    ``template``: the per-rank (pp, tp, dp_cp) object ``get_rng_state`` described for this rank.
    """
    shards = stored_rng_shards(checkpoint_dir, template.key)
    pp_tp_shape, pp_tp_offset = template.global_shape[:2], template.global_offset[:2]
    dp_cp_rank, dp_cp_size = template.global_offset[2], template.global_shape[2]
    where = f"(pp {pp_tp_offset[0]}, tp {pp_tp_offset[1]}, dp_cp {dp_cp_rank})"
    per_rank = [(o, s) for o, s in shards if len(s) == 3 and s[:2] == pp_tp_shape and o[:2] == pp_tp_offset]
    if per_rank:
        stored_dp_cp = per_rank[0][1][2]
        if stored_dp_cp == dp_cp_size:
            return template, None
        if stored_dp_cp > dp_cp_size:
            # dist_checkpointing loads a ShardedObject only whole (every stored shard requested by
            # some rank): fewer ranks cannot ask for their own entries. The release, too, restores
            # no per-rank RNG state where the layout changed (TP or PP); nor does this rank.
            return None, (
                f"mcore_ckpt_fixes: {ID}: {checkpoint_dir} holds RNG states for {stored_dp_cp} dp_cp ranks "
                f"(saved with a larger data-parallel size than this run's {dp_cp_size}); this rank {where} "
                f"keeps its current RNG state"
            )
        if dp_cp_rank < stored_dp_cp:
            return dataclasses.replace(template, global_shape=(*pp_tp_shape, stored_dp_cp)), None
        return None, (
            f"mcore_ckpt_fixes: {ID}: {checkpoint_dir} holds RNG states for dp_cp ranks "
            f"0..{stored_dp_cp - 1} only (saved with a smaller data-parallel size); this rank {where} "
            f"keeps its current RNG state"
        )
    legacy = [(o, s) for o, s in shards if len(s) == 2 and s == pp_tp_shape and o == pp_tp_offset]
    if legacy:
        request = dataclasses.replace(
            template, global_shape=pp_tp_shape, global_offset=pp_tp_offset, replica_id=dp_cp_rank
        )
        return request, (
            f"mcore_ckpt_fixes: {ID}: {checkpoint_dir} stores the RNG state in the old 2-D (pp, tp) "
            f"layout of an unfixed Megatron-Core (one copy per (pp, tp), written by a single "
            f"data-parallel rank); this rank {where} restores that copy, which is another rank's "
            f"state unless it was saved by this rank or with --data-parallel-random-init; the next "
            f"save writes every rank's own state"
        )
    return template, None  # nothing recognisable: let Megatron report it as it would


def restores_own_copy(dp_cp_rank, copy, data_parallel_random_init, dp_rank, dp_size, cp_size) -> bool:
    """Is the old layout's one (pp, tp) copy, as ``load_checkpoint`` restores it, this rank's own state?

    ``copy``: the list loaded from it. The unfixed save lets data-parallel rank 0 of the (pp, tp)
    write (``replica_id = dp_cp rank``): the list holds that rank's state, or with
    ``--data-parallel-random-init`` every data-parallel rank's (gathered over the data-parallel group,
    without context parallelism). ``load_checkpoint`` restores entry ``[dp_rank]`` with that flag and
    ``[0]`` without it."""
    gathered = isinstance(copy, list) and len(copy) == dp_size > 1
    if data_parallel_random_init:
        # Each data-parallel rank's own entry, where the save gathered them; with context parallelism
        # the entry is the state of context-parallel rank 0 of that data-parallel rank only.
        return (gathered and cp_size == 1) or (dp_cp_rank == 0 and dp_rank == 0)
    return dp_cp_rank == 0  # entry [0]: the writer's own state
