"""kbd: a knowledge-base attachment daemon for Linux execution hosts."""

__version__ = "0.1.0"
