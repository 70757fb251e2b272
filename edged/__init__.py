"""edged: the daemon and the edgectl CLI, composed from `backends` and `sysconf`."""

__version__ = "0.1.0"
