"""What kind of failure an error is, by its type: bad input, an explained failure, or a crash.

An **input error** (:class:`InputError`) is a problem with what the run was given: its data, a
reward function that fails, a damaged checkpoint, a bad config, a run directory another run
holds. Its message names the file / field / rank, so the launcher (``launch/cli.py``) prints that
one line and exits with status 2. An **explained failure** (:class:`ExplainedError`) is one the
run detected and described itself, not a problem of its input (a non-finite loss or gradient:
``megatron_gspo.train.finite_check``): exit status 1 and its one line, as for an input error; its
traceback would only show where the check sits, so it goes to the rank's log, not the console.
Anything else is a crash: exit status 1 with the traceback.
Every input-error class inherits the marker :class:`InputError` besides its own base (e.g.
``class DataError(ValueError, InputError)``, so that ``except ValueError`` still catches it);
nothing is recognised by its text or its class name.

An error of another rank crosses ranks as itself when it can (``megatron_gspo.collectives.on_rank0``
ships the exception object). One that does not survive the trip (its class is not importable on
this rank, or it does not unpickle) arrives as a :class:`RemoteError`, which keeps the original
type's name, its message and whether it was an input error.

Standard library only: the config and the RL dataflow (``pipeline/``) import this module.
"""

from __future__ import annotations

__all__ = ["ExplainedError", "InputError", "RemoteError", "RemoteInputError", "is_explained",
           "is_input_error", "kind_of", "one_line"]


class InputError(Exception):
    """Marker base class: bad input, not a bug (exit status 2 and one line naming the cause)."""


class ExplainedError(Exception):
    """Marker base class: a failure of the run that its message fully explains (exit status 1
    and that one line; the traceback only in the rank's log)."""


class RemoteError(RuntimeError):
    """An error raised on another rank that could not be re-raised here as its own type.

    ``kind``: the original class's name; ``message``: its ``str()``; ``input_error``: whether it
    was an :class:`InputError` (then this is a :class:`RemoteInputError`, see :meth:`of`)."""

    input_error = False

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message

    def __reduce__(self):
        return type(self), (self.kind, self.message), self.__dict__

    @staticmethod
    def of(kind: str, message: str, input_error: bool) -> "RemoteError":
        """The remote error of class ``kind``: a :class:`RemoteInputError` for an input error."""
        return (RemoteInputError if input_error else RemoteError)(kind, message)


class RemoteInputError(RemoteError, InputError):
    """A :class:`RemoteError` whose original was an input error."""

    input_error = True


def is_input_error(err: BaseException) -> bool:
    """True for an input error, raised here or on another rank."""
    return isinstance(err, InputError)


def is_explained(err: BaseException) -> bool:
    """True for an :class:`ExplainedError`: one line on the console, no traceback."""
    return isinstance(err, ExplainedError)


def kind_of(err: BaseException) -> str:
    """The error's class name (for a :class:`RemoteError`, the original's)."""
    return err.kind if isinstance(err, RemoteError) else type(err).__name__


def one_line(err: BaseException) -> str:
    """``"<note>: ... <Type>: <message>"``: the error's notes, the last added first (where it
    happened, e.g. ``step 3: evaluation``, added by whoever re-raised it), then its type and its
    message."""
    where = "".join(f"{note}: " for note in reversed(getattr(err, "__notes__", ())))
    return f"{where}{kind_of(err)}: {err}"
