"""Provides the agent daemon itself: its lifecycle, the socket listener and its connection budget, the request handlers, and the snapshot it serves."""
