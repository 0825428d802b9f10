"""The one base of the GPU code's expected failures, and the errors of the prepare path that reach the user.

The kubelet-facing code (driver.py, state.py) catches the base and names beside it the plugin machinery's
``LockTimeout`` and ``DeadlineExceeded``: driver.kubeletplugin knows nothing of the GPU code, and one bridge
naming two errors costs less than a second hierarchy down there."""


class DriverError(Exception):
    """An expected failure whose message is meant for the user, saying what failed and what to do: the pod's
    events for a claim's failure, the operator's log or terminal for the node's. Anything else is a bug."""


class NodeBusy(DriverError):
    """The node was busy (a GPU another operation holds, an answer still awaited) and nothing was changed."""


class PrepareError(DriverError):
    """A claim cannot be prepared; the message is shown to the user in the pod's events."""
