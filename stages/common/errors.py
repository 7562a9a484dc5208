"""Errors a stage raises for bad user input (a file, a line, a key): printed as one line."""


class StageInputError(ValueError):
    """Bad input to a stage; the message names the file, line, key or parameter."""
