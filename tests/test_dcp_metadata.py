"""mcore_ckpt_fixes.dcp_metadata: inside a scope a load reads ``.metadata`` once, however many parts
of it ask (the fixes' layout decisions, 0.19's common-state load, the torch_dist strategy).

Real Megatron-Core ``dist_checkpointing`` save and load, one gloo rank in a subprocess; every open of
a ``.metadata`` file is counted (``builtins.open``: what torch's FileSystemReader opens it with).
"""

from __future__ import annotations

import json

from conftest import check_py, megatron_version

CODE = r"""
import builtins, io, json, os, tempfile
import torch, torch.distributed as dist

def main():
    # One rank: a file rendezvous, no port another process could hold (a random one collided in CI).
    store = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from mcore_ckpt_fixes.testing import _cpu_shims as cpu_shims
    cpu_shims.install()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from mcore_ckpt_fixes import dcp_metadata
    from mcore_ckpt_fixes.engine.patching import Patcher

    parallel_state.initialize_model_parallel()
    d = tempfile.mkdtemp()

    def request():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(4, 4)),
                "rng": ShardedObject("rng_state", {"a": 1}, (1, 1), (0, 0), replica_id=0), "plain": 5}

    dist_checkpointing.save(request(), d)
    opened = []
    real_open = builtins.open

    def counting(path, *a, **k):
        if str(path).endswith(".metadata"):
            opened.append(str(path))
        return real_open(path, *a, **k)

    def reads(fn):
        opened.clear()
        builtins.open = io.open = counting
        try:
            out = fn()
        finally:
            builtins.open = io.open = real_open
        return len(opened), out

    def load():
        return dist_checkpointing.load(request(), d)

    def decide_and_load():  # what a fix's wrapper does: read the layout, then load
        names = set(dcp_metadata.read_metadata(d).state_dict_metadata)
        return names, load()

    out = {"unpatched_load": reads(load)[0]}
    patcher = Patcher("test")
    dcp_metadata.install(patcher)
    out["patched_outside_scope"] = reads(decide_and_load)[0]

    def in_scope():
        with dcp_metadata.shared_metadata():
            return decide_and_load()

    n, (names, loaded) = reads(in_scope)
    out["patched_in_scope"] = n
    out["loaded_exact"] = bool(torch.equal(loaded["w"], torch.arange(16.0).reshape(4, 4))) and loaded["rng"] == {"a": 1}
    out["names_has_rng"] = any(k.startswith("rng_state/") for k in names)
    # A second load in a new scope reads again (nothing cached across loads).
    out["second_scope"] = reads(in_scope)[0]
    patcher.revert()
    from megatron.core.dist_checkpointing.strategies import torch as strategy
    out["reverted"] = strategy._get_filesystem_reader is not dcp_metadata.get_filesystem_reader
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def test_a_load_reads_metadata_once_inside_a_scope():
    out = check_py(CODE, timeout=300)
    got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    # 0.19 reads .metadata twice unpatched (common state, then the tensors); 0.16-0.18 once.
    unpatched = 2 if megatron_version().release[:2] >= (0, 19) else 1
    assert got["unpatched_load"] == unpatched, got
    # A fix's own read outside a scope is one more; inside, the decision and the load share one.
    assert got["patched_outside_scope"] == unpatched + 1, got
    assert got["patched_in_scope"] == 1 and got["second_scope"] == 1, got
    assert got["loaded_exact"] and got["names_has_rng"] and got["reverted"], got
