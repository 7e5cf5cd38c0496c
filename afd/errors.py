"""Errors every layer may raise for a person to read."""


class UserError(Exception):
    """A mistake in the command line or its inputs: `afd` prints it as one line and exits 2."""
