"""The errors moestream reports to users, each with the exit code the CLI uses for it."""


class MoeStreamError(Exception):
    """Base class: a problem worth one clear line to the user."""

    exit_code = 1


class InputError(MoeStreamError):
    """A user mistake: bad path, corrupt or truncated file, config that does not add up, bad ids."""

    exit_code = 2


class CheckpointError(InputError):
    """A checkpoint file or directory that cannot be trusted."""


class ConfigError(InputError):
    """A config.json with a missing, unknown or inconsistent key."""


class IntegrityError(MoeStreamError):
    """Data that should be there came back wrong (a failed or short read)."""

    exit_code = 4
