"""Provides the console's reach to its hosts: the links to agents (local socket or SSH), the Fleet over them, and multi-node runs."""
