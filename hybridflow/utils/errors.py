"""One error type for "the user's input is wrong"."""


class UserError(Exception):
    """The user's input (config, files, paths, functions) cannot be used; the message names the culprit and
    says what to do."""
