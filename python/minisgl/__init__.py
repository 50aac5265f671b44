"""minisgl: the package this book rebuilds, one chapter at a time (chapter 1)."""
