"""Workarounds of dependencies' bugs and gaps, one module each: its docstring says what it works
around, and when it can go; a test of its own shows the behaviour it restores."""
