"""forkq's exception types: what a user may catch, each named for what went wrong."""


class ForkqError(Exception):
    """Base class of forkq's own errors."""


class RedisUnavailable(ForkqError):
    """Redis could not be reached, so nothing was pushed."""


class ConfigError(ForkqError):
    """A setting has a value forkq cannot use; the message names it."""


class MalformedPayload(ValueError):
    """A queued entry is not a usable Sidekiq job; the message says why."""


class UnknownJob(ForkqError):
    """A payload names a job that no required module registered."""
