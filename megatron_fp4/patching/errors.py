"""The one error of `megatron-fp4 patch`: why the command cannot proceed."""


class PatchError(Exception):
    """Why the command cannot proceed (exit status 2): one or two plain sentences."""
