"""Errors of the prepare path that reach the user."""


class PrepareError(Exception):
    """A claim cannot be prepared; the message is shown to the user in the pod's events."""
