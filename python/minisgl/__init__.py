"""minisgl: the package the book builds; empty until chapter 1 adds modules (chapter 0)."""
