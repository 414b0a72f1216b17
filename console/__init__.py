"""Provides the gpudeck console: the CLI, the Textual app and `gpudeck watch` over the fleet."""

import warnings

# asyncssh (2.24) names cryptography's DSA classes when it is imported, and cryptography 51 deprecates DSA with a
# warning at each of those names: five lines on the stderr of every gpudeck command, which no operator can act on
# (they are about asyncssh's source, not about a key in use) and which scripts reading stderr take for an error.
# Only that warning, only from asyncssh, and before any module here imports it.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
