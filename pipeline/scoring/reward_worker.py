"""The process a user reward function runs in (``pipeline.scoring.rewards.FunctionReward``).

    python -m pipeline.scoring.reward_worker SPEC FD_IN FD_OUT OWNER_PID

It loads SPEC ("package.module:function" or "path/to/file.py:function", through
``pipeline.scoring.rewards.load_function``) and answers ``("ready", None)``, or ``("error", message)``
when the import fails. Then, for every ``("score", [(prompt, response_ids, response_text), ...])``
it reads from FD_IN, it writes one answer per sample, in order, to FD_OUT:
``("ok", float)`` (possibly non-finite: the owner reports that), ``("error", "Type: message")``
for an exception, ``("invalid", message)`` for a value that is not a number. Messages are
``multiprocessing.connection`` frames (pickles), so what the function prints on stdout cannot
corrupt them: stdout and stderr are the owner's (rank 0's console or log).

The owner decides when this process ends: it blocks the stop signals (a SIGTERM or Ctrl-C that
reaches the whole job is the owner's to act on; ``megatron_gspo.lifetime``), dies by SIGKILL
with its owner (PR_SET_PDEATHSIG; it exits at once if the owner is already gone), and is killed,
with its process group, when a call passes ``reward.timeout_s`` or the owner stops.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from megatron_gspo.lifetime import die_with_parent, shield_from_stop_signals
from pipeline.scoring.rewards import RewardError, _as_float, load_function


def main(argv: list[str]) -> int:
    spec, fd_in, fd_out, owner = argv[0], int(argv[1]), int(argv[2]), int(argv[3])

    die_with_parent()
    shield_from_stop_signals()
    if os.getppid() != owner:  # the owner died before the parent-death signal was armed
        return 1
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)

    try:
        fn = load_function(spec)
    except RewardError as err:
        outbox.send(("error", str(err)))
        return 1
    outbox.send(("ready", None))
    while True:
        try:
            kind, payload = inbox.recv()
        except EOFError:  # the owner closed the pipe: done
            return 0
        if kind != "score":
            return 0
        for prompt, response_ids, response_text in payload:
            try:
                value = fn(prompt, response_ids, response_text)
            except Exception as err:  # noqa: BLE001 - the owner applies reward.on_error
                outbox.send(("error", str(err) if isinstance(err, RewardError)
                             else f"{type(err).__name__}: {err}"))
                continue
            try:
                reward = _as_float(value)
            except ValueError as err:
                outbox.send(("invalid", str(err)))
            else:
                outbox.send(("ok", reward))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
