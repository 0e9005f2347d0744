"""Exception and warning types users may catch or filter."""


class MegatronPatchWarning(UserWarning):
    """A fix could not be applied (or was applied outside its known range); training goes on."""


class FlagError(ValueError):
    """An ``MCORE_CKPT_FIX*`` environment variable holds something we do not accept.

    The message is one line naming the variable and the accepted values.
    """


class FixRequiredError(RuntimeError):
    """A fix set to ``require`` could not be applied."""
