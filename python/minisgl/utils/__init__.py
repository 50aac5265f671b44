"""Small shared utilities (chapter 5): the name registry, the device abstraction."""
