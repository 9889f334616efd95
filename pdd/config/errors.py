"""ConfigError: a setting pdd cannot use, the key it names."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value pdd cannot use; the message names the key."""
