"""Provides gpudeck's reusable widgets and cell renderers."""
