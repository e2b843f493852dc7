"""Project exceptions. Library code raises these; the CLI turns them into one line and an exit code.

Exit codes: 2 for bad input the user can fix before anything runs (options, recipes, files),
1 for a failure while running (a model that does not load, a stage that failed).
"""


class GeminiError(Exception):
    """An error meant for the user: the message says what went wrong and what to change."""

    exit_code = 1


class InputError(GeminiError):
    """Bad input detected before work starts (a typo, a value out of range, a missing file)."""

    exit_code = 2
