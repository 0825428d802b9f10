"""The one base of the GPU code's expected failures, and the errors of the prepare path that reach the user.

The kubelet-facing code (``driver.py``, ``state.py``) shows a :class:`DriverError` as it is, as the claim's
error in the pod's events; anything else that escapes is a bug, answered as an internal error with its stack
logged. The plugin machinery's own expected failures (``LockTimeout``, ``DeadlineExceeded``) are named there
beside it: ``driver.kubeletplugin`` knows nothing of the GPU code, and one bridge naming two errors costs less
than a second hierarchy down there.
"""


class DriverError(Exception):
    """An expected failure whose message is meant for the user, saying what failed and what to do: the pod's
    events for a claim's failure, the operator's log or terminal for the node's. A new error derives from it
    (or from its family's base, e.g. ``MpsError``); tests/unit/gpu/test_errors.py checks that none is missed."""


class NodeBusy(DriverError):
    """The node could not serve the call yet (a GPU another operation holds, an answer still awaited) and
    nothing was changed: the same call later is expected to work."""


class PrepareError(DriverError):
    """A claim cannot be prepared; the message is shown to the user in the pod's events."""
