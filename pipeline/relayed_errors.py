"""Errors that cross ranks as types: what failed on rank 0 is re-raised on every rank as a
:class:`RelayedError` that keeps the original error's type name, its message, the phase and the
step, and whether it is an input error (bad data, a failing reward function, a damaged checkpoint:
exit status 2 and one line) or a crash (exit 1 with the traceback).

Rank 0 describes the error (:func:`describe`: plain strings and a bool, which the control group's
``broadcast_object_list`` carries); every rank raises :class:`RelayedError` from that description.
The launcher (``launch/cli.py``) decides the exit status with :func:`is_input_error`, never by
matching the message.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["INPUT_ERRORS", "RelayedError", "describe", "is_input_error"]

INPUT_ERRORS = frozenset({"DataError", "RewardError", "CheckpointError", "HFConfigError",
                          "WeightSyncError", "RunDirLocked", "ConfigError"})
"""Names of the error classes that mean bad input (their messages name the file / field / rank).
Matched against the class and its bases, so a subclass of one is one too."""


def _names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def is_input_error(err: BaseException) -> bool:
    """True for an input error, raised here or relayed from another rank."""
    if isinstance(err, RelayedError):
        return err.input_error
    return bool(_names(err) & INPUT_ERRORS)


def describe(err: BaseException) -> dict:
    """What a rank broadcasts of an error (plain data)."""
    return {"type": type(err).__name__, "message": str(err), "input_error": is_input_error(err)}


class RelayedError(RuntimeError):
    """An error of another rank (rank 0's phase), re-raised on this one.

    ``str()``: ``"step N: <phase>: <Type>: <message>"`` (the phase omitted when there is none)."""

    def __init__(self, *, step: int, phase: Optional[str], type: str, message: str,
                 input_error: bool):
        self.step, self.phase, self.type_name, self.message = step, phase, type, message
        self.input_error = bool(input_error)
        where = f"step {step}: {phase}: " if phase else f"step {step}: "
        super().__init__(f"{where}{type}: {message}")
