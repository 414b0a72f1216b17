"""Provides what both front-ends show, computed without Textual: view models of rows, run diffs, and the CLI's text tables."""
