"""A Python interpreter that has imported torch (and nothing of Megatron-Core) and runs each script
it is sent in a forked child: what ``conftest.run_py`` does, without paying torch's import per
script (seconds each; tests/patches runs one script per fix and release line).

Each child gets the environment and ``sys.path`` a fresh interpreter started with that environment
would have (its PYTHONPATH first: a patched Megatron-Core tree shadows the installed one, which the
server never imported), runs the script as ``__main__`` and exits; its stdout and stderr go to a
file. The protocol is one JSON line per request on the server's stdin and one per answer on its
stdout. Run as a script; under ``if __name__ == "__main__"`` so that a ``spawn`` child of a script
(Megatron's checkpoint writer) that imports this module again starts no server.
"""

import json
import os
import sys
import traceback
import types


def _child(request):
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    # The path a fresh interpreter with this PYTHONPATH gets: its entries, then the server's own
    # (standard library, site-packages) minus the server's PYTHONPATH entries.
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    started_with = set(request["server_pythonpath"])
    rest = [p for p in sys.path if p not in started_with and p != request["server_dir"]]
    sys.path[:] = [os.path.dirname(request["script"])] + ours + rest
    try:
        with open(request["script"]) as f:
            code = compile(f.read(), request["script"], "exec")
        sys.argv = [request["script"]]
        # A __main__ of the script's own (spawn children of the script re-import it by __file__).
        main = types.ModuleType("__main__")
        main.__file__ = request["script"]
        sys.modules["__main__"] = main
        exec(code, main.__dict__)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def serve():
    import torch  # noqa: F401  (the import every script would pay)
    import torch.distributed  # noqa: F401

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
