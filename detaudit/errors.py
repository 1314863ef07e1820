"""User-facing errors: the CLI prints the message on one line and exits with code 2."""


class DetauditError(Exception):
    """Bad input or an unusable environment. The message is shown to the user as is (the CLI exits 2)."""


class CellFailed(Exception):
    """A single cell could not be computed (worker crash, hang, OOM); the sweep goes on."""
