"""The API server, its launcher and the shell (chapter 15)."""

from .args import ServerArgs, parse_args
from .launch import main

__all__ = ["ServerArgs", "main", "parse_args"]
