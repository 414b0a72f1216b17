"""Provides the only place the console touches a library's private names; README.md here lists each one."""
