"""The patch engine: flags, version detection, patch/rebind/revert primitives and the registry.

Nothing here knows a fix by name; fixes declare themselves with :class:`Fix` in
``mcore_ckpt_fixes.fixes`` and the registry discovers them.
"""
