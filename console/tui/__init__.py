"""Provides the Textual console: the app, its screens and widgets; ``compat`` holds every reach into a library's private names."""
