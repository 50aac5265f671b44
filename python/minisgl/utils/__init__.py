"""Small shared utilities: the name registry (chapter 5), the device abstraction (chapter 6)."""
