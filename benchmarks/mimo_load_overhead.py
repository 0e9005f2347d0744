"""mimo-optimizer: what the ``dist_checkpointing.load`` wrapper costs, as ratios to the unwrapped load.

One process (a gloo world of 1, CPU, the harness's CPU shims), real ``dist_checkpointing.save`` and
``load``, N small tensors. Three requests; for each, Megatron's own ``load`` (best of REPEAT) and, timed apart,
what the fix's wrapper adds around it (best of 4 x REPEAT); ratio = (load + added) / load:

* ``plain``: no MIMO optimizer key (what every non-MIMO load pays: one scan of the request's keys);
* ``mimo-current``: every key under ``mimo.language.`` and stored so (adds one metadata read);
* ``mimo-old``: every key requested as ``mimo.language.<key>``, stored as ``<key>`` (the old layout:
  metadata read, renamed request; Megatron's own load cannot read this one, so its base is the
  unwrapped load of the same keys under their stored names).

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python benchmarks/mimo_load_overhead.py [N]
"""

import json
import os
import sys
import tempfile
import time
import warnings

N, REPEAT = 2000, 5


def _request(n, prefix):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        f"t{i}": ShardedTensor.from_rank_offsets(f"{prefix}optimizer.state.t{i}", torch.zeros(16)) for i in range(n)
    }


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(n: int) -> int:
    import torch.distributed as dist

    from mcore_ckpt_fixes.testing import _cpu_shims as cpu_shims

    cpu_shims.install()
    work = tempfile.mkdtemp(prefix="mimo-load-bench-")
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    from mcore_ckpt_fixes.engine.version import detect
    from mcore_ckpt_fixes.fixes.mimo_optimizer.runtime import old_layouts

    upstream = serialization.load  # MCORE_CKPT_FIXES=off is expected: nothing wrapped it
    assert not getattr(upstream, "__mcore_ckpt_fix__", None), "run with MCORE_CKPT_FIXES=off"
    old_dir, new_dir = os.path.join(work, "old"), os.path.join(work, "new")
    for path, prefix in ((old_dir, ""), (new_dir, "mimo.language.")):
        os.makedirs(path)
        dist_checkpointing.save(_request(n, prefix), path)

    def added(request, path):
        # All the wrapper adds around Megatron's load: the request scan (plus, for MIMO keys, the
        # metadata read and renaming) and the completion of the loaded dict.
        _, finish = old_layouts.align_mimo_optimizer_request(request, path)
        finish({})

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case, path, request_prefix, baseline_prefix in (
            ("plain", old_dir, "", ""),
            ("mimo-current", new_dir, "mimo.language.", "mimo.language."),
            ("mimo-old", old_dir, "mimo.language.", ""),
        ):
            # Timed apart (a whole load varies by more than the wrapper costs on this machine),
            # each on a request built outside the timing.
            base = _best(lambda: upstream(_request(n, baseline_prefix), path), REPEAT)
            request = _request(n, request_prefix)
            extra = _best(lambda: added(request, path), 4 * REPEAT)
            rows.append(
                {
                    "case": case,
                    "keys": n,
                    "upstream_load_s": round(base, 4),
                    "wrapper_adds_s": round(extra, 5),
                    "ratio": round((base + extra) / base, 4),
                }
            )
    dist.destroy_process_group()
    print(json.dumps({"megatron_core": str(detect().version), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MCORE_CKPT_FIXES", "off")
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else N))
