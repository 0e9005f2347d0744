"""The arguments of a user's own Megatron job, as users keep them: one command line, an argument
file, or a launch script (``torchrun ... pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...``, as Megatron-LM's
``examples/`` scripts are written).

A script is read, never run: its line continuations are joined, comments dropped, its variables
(``NAME=value``, ``export NAME=value``) and bash arrays (``NAME=( ... )``) collected, and the words
after the first ``pretrain_*.py`` (or ``*.py``) it launches expanded with them. A variable neither the
script nor the environment defines (``$1``, ``$CHECKPOINT_PATH``) is kept as a marker: harmless where
the check replaces the value anyway (paths, data), an error where the value would be used.
"""

from __future__ import annotations

import os
import re
import shlex

UNRESOLVED = "<unset:"  # what an undefined shell variable expands to (see unresolved())

_ARRAY_START = re.compile(r"^\s*(?:declare\s+-a\s+|local\s+)?([A-Za-z_]\w*)=\((.*)$")
_ASSIGN = re.compile(r"^\s*(?:export\s+|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_]\w*|\d+)")
_LAUNCHED = re.compile(r"(?:^|/)\w[\w.-]*\.py$")


def from_text(text: str) -> list:
    """Arguments given on the command line (``--megatron-args "..."``), split as a shell splits them."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise ValueError(f"--megatron-args: cannot split {text[:60]!r}: {exc}") from None
    return _expanded(words, {}, os.environ)


def from_file(path: str):
    """(arguments, the script a launch script starts or None) from an argument file (words, ``#``
    comments) or a launch script (module doc)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--megatron-args-file {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    lines = _logical_lines(text)
    arrays, scalars, launch = _read_script(lines, path)
    if launch is None:
        options = _options_kept(arrays, scalars)
        if options:  # a file of variables for a launcher (MODEL_ARGS="--num-layers ..."): their options
            return _expanded(options, arrays, {**os.environ, **scalars}), None
        try:  # an argument file
            words = shlex.split("\n".join(lines), comments=True)
        except ValueError as exc:
            raise ValueError(f"--megatron-args-file {path}: cannot split it: {exc}") from None
        return _expanded(words, arrays, {**os.environ, **scalars}), None
    script, words = launch
    return _expanded(words, arrays, {**os.environ, **scalars}), os.path.basename(script)


def _logical_lines(text: str) -> list:
    """Lines with backslash continuations joined, and a quoted string over several lines made one."""
    lines = []
    for line in re.sub(r"\\\r?\n", " ", text).splitlines():
        if lines and not _balanced(lines[-1]):
            lines[-1] += "\n" + line
        else:
            lines.append(line)
    return lines


def _words(line: str):
    """The line's words as a shell splits them, or None where a quote is still open."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return None


def _balanced(line: str) -> bool:
    return _words(line) is not None


def _read_script(lines, path):
    """(arrays, scalars, the launched script's words or None)."""
    arrays, scalars, launch = {}, {}, None
    i = 0
    while i < len(lines):
        line = lines[i]
        start = _ARRAY_START.match(line)
        if start:
            body = [start.group(2)]
            while not _closes(body[-1]) and i + 1 < len(lines):
                i += 1
                body.append(lines[i])
            text = "\n".join(body)
            text = text[: text.rstrip().rfind(")")] if _closes(body[-1]) else text
            # Expanded where it is set, as bash does (NAME=( "${NAME[@]}" --more ) appends).
            arrays[start.group(1)] = _expanded(_split(text, path), arrays, {**os.environ, **scalars})
        elif launch is None and _launches(line):
            words = _split(line, path)
            at = next(k for k, w in enumerate(words) if _LAUNCHED.search(w))
            launch = (words[at], words[at + 1 :])
        else:
            assign = _ASSIGN.match(line)
            if assign:
                value = _split(assign.group(2), path)
                scalars[assign.group(1)] = (
                    _expanded(value, arrays, {**os.environ, **scalars})[0] if len(value) == 1 else ""
                )
        i += 1
    return arrays, scalars, launch


def _options_kept(arrays, scalars) -> list:
    """The words of every array, then of every variable, whose value is a list of options (a
    variable expanded unquoted is split into words)."""
    words = []
    for name, value in {**arrays, **scalars}.items():
        split = value if name in arrays else shlex.split(value)
        if split and split[0].startswith("--"):
            words += split
    return words


def _closes(line: str) -> bool:
    """Whether an array's line ends it: a ``)`` outside quotes, after comments are dropped."""
    return _balanced(line) and line.split("#")[0].rstrip().endswith(")")


def _launches(line: str) -> bool:
    words = _words(line)
    return bool(words) and any(_LAUNCHED.search(w) for w in words) and not _ASSIGN.match(line)


def _split(text, path):
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise ValueError(f"--megatron-args-file {path}: cannot split {text.strip()[:60]!r}: {exc}") from None


def _expanded(words, arrays, scalars) -> list:
    """``words`` with ``${ARRAY[@]}`` spliced in and ``$VAR`` / ``${VAR:-default}`` substituted."""
    out = []
    for word in words:
        whole = _VAR.fullmatch(word)
        if whole and whole.group(2) and whole.group(1) in arrays:
            out.extend(arrays[whole.group(1)])  # expanded when it was set
            continue
        out.append(_VAR.sub(lambda m: _value(m, arrays, scalars), word))
    return out


def _value(match, arrays, scalars) -> str:
    name = match.group(1) or match.group(4)
    if name in scalars:
        return str(scalars[name])
    if name in arrays:
        return " ".join(arrays[name])
    if match.group(3) is not None:
        return match.group(3)
    return f"{UNRESOLVED}${name}>"


def unresolved(word: str):
    """The shell variable a word still holds unexpanded (``$NAME``), or None."""
    at = word.find(UNRESOLVED)
    return None if at < 0 else word[at + len(UNRESOLVED) : word.find(">", at)]
