"""Facts about the system and changes to it. Knows nothing of inference.

Every read goes through a `SysRoot` so the same code runs on the live system (`/`) and on an
image or fixture folder.
"""

from sysconf.sysroot import SysRoot

__all__ = ["SysRoot"]
