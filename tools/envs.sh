#!/usr/bin/env bash
# Build (or reuse) the cached test environments, one per Megatron-Core release line.
#
# Layout, under $MCORE_CKPT_FIXES_ENVS (default ~/.cache/mcore-ckpt-fixes/envs, kept between runs):
#   py3.11/            venv: torch 2.13.0 (CPU wheel on this machine) + test deps
#   py3.12/            venv: torch from PyPI (runs on CPU) + test deps
#   py3.11-torch2.6/   venv: torch 2.6 from PyPI, for 0.12.x's selftest (MCORE_CKPT_FIXES_SWEEP_TORCH=1, tools/sweep.sh)
#   mcore-<release>/   megatron-core <release> installed --no-deps --target, put on PYTHONPATH
#   fw-<name>/         a framework that calls Megatron-Core (tools/frameworks.txt), installed --no-deps
#                      --target from its pinned list tools/frameworks/<name>.txt (what its checkpoint
#                      module imports, transitive deps included; never torch), run on its Megatron line
# Sharing one interpreter venv between release lines keeps the 5.5 GB torch install to one per Python.
#
# Usage: tools/envs.sh [RELEASE | fw-NAME ...]   (default: every release in tools/releases.txt and
#                                                  every framework in tools/frameworks.txt; any release
#                                                  of tools/sweep-releases.txt may be named)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Outside the clone by default, so a fresh clone (CI) on a machine that built them reuses them.
ENVS=${MCORE_CKPT_FIXES_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore-ckpt-fixes/envs}
mkdir -p "$ENVS"

python_for() {  # release -> python minor version it needs (the test matrix, else the sweep list)
  awk -v r="$1" '$1==r {print $2; exit}' tools/releases.txt tools/sweep-releases.txt
}

venv_for() {  # release -> interpreter environment name (py3.11, py3.12, py3.11-torch2.6)
  local v
  v=$(awk -v r="$1" '$1==r && NF>=3 {print $3; exit}' tools/sweep-releases.txt)
  if [ -n "$v" ] && [ "${MCORE_CKPT_FIXES_SWEEP_TORCH:-}" = 1 ]; then echo "$v"; else echo "py$(python_for "$1")"; fi
}

pyenv_python() {  # 3.11 -> interpreter path (pyenv's versions first: its shims may refuse to run)
  local want=$1 root cand
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  cand=$(ls -d "$root"/versions/"$want".* 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$cand" ] && "$cand/bin/python" -c '' 2>/dev/null; then echo "$cand/bin/python"; return; fi
  for cand in "python$want" python3; do
    if "$cand" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$want'" 2>/dev/null; then
      command -v "$cand"; return
    fi
  done
  echo "envs.sh: no Python $want found (pyenv or PATH)" >&2; exit 2
}

base_env() {  # venv name (py3.11, py3.12, py3.11-torch2.6) -> venv built once; re-synced when the requirements change
  local name=$1 py=${1#py} dir="$ENVS/$1" torch_pin=""
  case "$py" in *-torch*) torch_pin=${py#*-torch}; py=${py%%-torch*} ;; esac
  local stamp="$dir/.stamp-$(sha1sum tools/requirements-test.txt | cut -c1-12)"
  if [ -f "$stamp" ]; then return; fi
  if [ ! -x "$dir/bin/python" ]; then
    echo "envs.sh: building $dir" >&2
    rm -rf "$dir"
    "$(pyenv_python "$py")" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
  else
    echo "envs.sh: updating $dir (requirements changed)" >&2
  fi
  local torch_req="torch"
  # On 3.11 this machine carries a local CPU wheel of torch 2.13.0; naming it in the same command
  # keeps pip from resolving a multi-GB CUDA build instead.
  # PyPI's CUDA torch brings triton along; the CPU wheel does not, and 0.16's mamba_mixer imports it.
  local extra=()
  [ "$py" = "3.11" ] && torch_req="torch==2.13.0" && extra=(triton)
  # An older torch for releases whose checkpoint writer needs it (PyPI's CUDA build; runs on CPU).
  [ -n "$torch_pin" ] && torch_req="torch==$torch_pin.*" && extra=()
  "$dir/bin/python" -m pip install -q "$torch_req" "${extra[@]}" -r tools/requirements-test.txt
  rm -f "$dir"/.stamp-*
  touch "$stamp"
}

mcore_env() {  # release -> --target install of that megatron-core
  local rel=$1 py venv dir="$ENVS/mcore-$1"
  py=$(python_for "$rel")
  [ -n "$py" ] || { echo "envs.sh: unknown release $rel (see tools/releases.txt, tools/sweep-releases.txt)" >&2; exit 2; }
  venv=$(venv_for "$rel")
  base_env "$venv"
  if [ -f "$dir/.stamp" ]; then return; fi
  echo "envs.sh: installing megatron-core==$rel into $dir" >&2
  rm -rf "$dir"
  "$ENVS/$venv/bin/python" -m pip install -q --no-deps --target "$dir" "megatron-core==$rel"
  touch "$dir/.stamp"
}

framework_env() {  # fw-NAME -> --target install of that framework's pinned list, on its Megatron line
  local name=${1#fw-} rel req dir="$ENVS/$1" stamp
  rel=$(awk -v n="$name" '$1==n {print $2; exit}' tools/frameworks.txt)
  req="tools/frameworks/$name.txt"
  [ -n "$rel" ] && [ -f "$req" ] || { echo "envs.sh: unknown framework $name (see tools/frameworks.txt)" >&2; exit 2; }
  for r in ${rel//,/ }; do mcore_env "$r"; done
  rel=${rel%%,*}  # the interpreter of its first line installs it (all lines of one framework share one)
  stamp="$dir/.stamp-$(sha1sum "$req" | cut -c1-12)"
  if [ -f "$stamp" ]; then return; fi
  # Fresh every time the list changes: pip --target over an older install leaves two versions'
  # metadata side by side (transformers then refuses to import).
  echo "envs.sh: installing $req into $dir" >&2
  rm -rf "$dir"
  "$ENVS/$(venv_for "$rel")/bin/python" -m pip install -q --no-deps --target "$dir" -r "$req"
  touch "$stamp"
}

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(awk '!/^#/ && NF {print $1}' tools/releases.txt)
  mapfile -t -O ${#targets[@]} targets < <(awk '!/^#/ && NF {print "fw-" $1}' tools/frameworks.txt)
fi
for t in "${targets[@]}"; do
  case "$t" in fw-*) framework_env "$t" ;; *) mcore_env "$t" ;; esac
done
