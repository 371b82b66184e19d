"""Constrained decoding: grammar compilation (xgrammar) and per-sample grammar matchers."""
