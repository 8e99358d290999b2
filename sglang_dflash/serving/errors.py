"""The start-up refusal of the serving layer: one class, imported by every module that refuses a setup (startup.py's
checks, the worker, the oracle drafts), so none of them has to import another for it."""


class DFlashStartupError(ValueError):
    """A server setup our DFLASH worker cannot run; the message says which flag/value and the fix."""
