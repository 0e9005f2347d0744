"""The opcodes of dcp_scan's pickle machine: one short handler each, in a table indexed by opcode.

Only the opcodes of protocol 4 and 5 that DCP's ``.metadata`` uses have a handler; any other ends
the read (:class:`Fallback`: the allow-list unpickler reads the file instead). Globals go through
safe_pickle's allow-list and calls reach only its stand-ins, exactly as with safe_pickle.
"""

from __future__ import annotations

import struct

from . import safe_pickle


class Fallback(Exception):
    """This file is outside what the stream reader handles: use the allow-list unpickler."""


class DcpRecord:
    """A DCP dataclass read by the machine: its class name and pickled state."""

    __slots__ = ("name", "state")

    def __init__(self, name):
        self.name, self.state = name, None


# -- the opcodes -------------------------------------------------------------------------------------
# A handler takes (machine, buffer, position after the opcode, stack, marks) and returns where the
# next opcode starts. STOP has none: the machine's loop ends there (dcp_scan.OpcodeMachine.run).


def _unknown(m, buf, pos, stack, marks):
    raise Fallback(f"opcode {buf[pos - 1]:#x}")


OPS = [_unknown] * 256
_unpack = struct.unpack_from


def _op(*codes):
    def register(handler):
        for code in codes:
            OPS[code] = handler
        return handler

    return register


@_op(0x94)  # MEMOIZE
def _memoize(m, buf, pos, stack, marks):
    m._memoize(stack[-1])
    return pos


@_op(0x68)  # BINGET
def _binget(m, buf, pos, stack, marks):
    return m._fetch(buf[pos], pos - 1, pos + 1, stack)


@_op(0x6A)  # LONG_BINGET
def _long_binget(m, buf, pos, stack, marks):
    return m._fetch(_unpack("<I", buf, pos)[0], pos - 1, pos + 4, stack)


def _sized(width: int, make):
    """An opcode whose operand is a length (1, 4 or 8 bytes) and that many bytes: ``make(bytes)``."""
    fmt = {4: "<I", 8: "<Q"}.get(width)

    def handler(m, buf, pos, stack, marks):
        n = buf[pos] if width == 1 else _unpack(fmt, buf, pos)[0]
        start = pos + width
        stack.append(make(bytes(buf[start : start + n])))
        return start + n

    return handler


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogatepass")


OPS[0x8C] = _sized(1, _text)  # SHORT_BINUNICODE
OPS[0x58] = _sized(4, _text)  # BINUNICODE
OPS[0x8D] = _sized(8, _text)  # BINUNICODE8
OPS[0x43] = _sized(1, bytes)  # SHORT_BINBYTES
OPS[0x42] = _sized(4, bytes)  # BINBYTES
OPS[0x8A] = _sized(1, lambda b: int.from_bytes(b, "little", signed=True))  # LONG1


@_op(0x8B)  # LONG4
def _long4(m, buf, pos, stack, marks):
    n = _unpack("<i", buf, pos)[0]
    if n < 0 or n > 1 << 20:
        raise Fallback("LONG4")
    stack.append(int.from_bytes(buf[pos + 4 : pos + 4 + n], "little", signed=True))
    return pos + 4 + n


@_op(0x4B)  # BININT1
def _binint1(m, buf, pos, stack, marks):
    stack.append(buf[pos])
    return pos + 1


def _fixed(fmt: str):
    """An opcode whose operand is one struct value of ``fmt``."""
    width = struct.calcsize(fmt)

    def handler(m, buf, pos, stack, marks):
        stack.append(_unpack(fmt, buf, pos)[0])
        return pos + width

    return handler


OPS[0x4D] = _fixed("<H")  # BININT2
OPS[0x4A] = _fixed("<i")  # BININT
OPS[0x47] = _fixed(">d")  # BINFLOAT


def _push(make):
    """An opcode without operand that pushes ``make()``."""

    def handler(m, buf, pos, stack, marks):
        stack.append(make())
        return pos

    return handler


OPS[0x4E] = _push(lambda: None)  # NONE
OPS[0x88] = _push(lambda: True)  # NEWTRUE
OPS[0x89] = _push(lambda: False)  # NEWFALSE
OPS[0x7D] = _push(dict)  # EMPTY_DICT
OPS[0x5D] = _push(list)  # EMPTY_LIST
OPS[0x29] = _push(tuple)  # EMPTY_TUPLE
OPS[0x8F] = _push(set)  # EMPTY_SET


@_op(0x28)  # MARK
def _mark(m, buf, pos, stack, marks):
    marks.append(len(stack))
    return pos


@_op(0x85)  # TUPLE1
def _tuple1(m, buf, pos, stack, marks):
    stack[-1] = (stack[-1],)
    return pos


@_op(0x86)  # TUPLE2
def _tuple2(m, buf, pos, stack, marks):
    stack[-2:] = [tuple(stack[-2:])]
    return pos


@_op(0x87)  # TUPLE3
def _tuple3(m, buf, pos, stack, marks):
    stack[-3:] = [tuple(stack[-3:])]
    return pos


@_op(0x74)  # TUPLE
def _tuple(m, buf, pos, stack, marks):
    k = marks.pop()
    stack[k:] = [tuple(stack[k:])]
    return pos


@_op(0x91)  # FROZENSET
def _frozenset(m, buf, pos, stack, marks):
    k = marks.pop()
    stack[k:] = [frozenset(stack[k:])]
    return pos


@_op(0x75)  # SETITEMS
def _setitems(m, buf, pos, stack, marks):
    k = marks.pop()
    d = stack[k - 1]
    items = stack[k:]
    del stack[k:]
    for i in range(0, len(items), 2):
        d[items[i]] = items[i + 1]
    return pos


@_op(0x73)  # SETITEM
def _setitem(m, buf, pos, stack, marks):
    v = stack.pop()
    key = stack.pop()
    stack[-1][key] = v
    return pos


@_op(0x65)  # APPENDS
def _appends(m, buf, pos, stack, marks):
    k = marks.pop()
    stack[k - 1].extend(stack[k:])
    del stack[k:]
    return pos


@_op(0x61)  # APPEND
def _append(m, buf, pos, stack, marks):
    v = stack.pop()
    stack[-1].append(v)
    return pos


@_op(0x90)  # ADDITEMS
def _additems(m, buf, pos, stack, marks):
    k = marks.pop()
    stack[k - 1].update(stack[k:])
    del stack[k:]
    return pos


@_op(0x93)  # STACK_GLOBAL: through the allow-list; nothing else is ever looked up
def _stack_global(m, buf, pos, stack, marks):
    name = stack.pop()
    module = stack.pop()
    if type(module) is not str or type(name) is not str:
        raise Fallback("STACK_GLOBAL of non-strings")
    stack.append(safe_pickle.find_safe_global(module, name))
    if pos < len(buf) and buf[pos] == 0x94:  # memoized next: where later references find it
        m.rev.setdefault(("g", module, name), m.next_memo)
    return pos


@_op(0x52)  # REDUCE
def _reduce(m, buf, pos, stack, marks):
    args = stack.pop()
    func = stack[-1]
    if not callable(func) or type(args) is not tuple:
        raise Fallback("REDUCE")
    if isinstance(func, type) and issubclass(func, safe_pickle.FastStub):
        raise Fallback("REDUCE of a DCP dataclass")
    stack[-1] = func(*args)  # an allow-listed stand-in (safe_pickle), as the C unpickler calls it
    return pos


@_op(0x81)  # NEWOBJ
def _newobj(m, buf, pos, stack, marks):
    args = stack.pop()
    stack[-1] = m._new(stack[-1], args)
    return pos


@_op(0x62)  # BUILD
def _build(m, buf, pos, stack, marks):
    state = stack.pop()
    inst = stack[-1]
    if type(inst) is DcpRecord:
        inst.state = state
        m._learn(inst)
        return pos
    setstate = getattr(inst, "__setstate__", None)
    if setstate is None or not isinstance(inst, safe_pickle.Stub):
        raise Fallback("BUILD of a non-stub")
    setstate(state)
    return pos


@_op(0x30)  # POP
def _pop(m, buf, pos, stack, marks):
    if marks and marks[-1] == len(stack):
        marks.pop()
    else:
        stack.pop()
    return pos


@_op(0x31)  # POP_MARK
def _pop_mark(m, buf, pos, stack, marks):
    k = marks.pop()
    del stack[k:]
    return pos


@_op(0x32)  # DUP
def _dup(m, buf, pos, stack, marks):
    stack.append(stack[-1])
    return pos
