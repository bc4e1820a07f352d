"""Server-side message filters beyond tags: RocketMQ's SQL92 property filter (``sql92``).

Sans-IO and pure: an expression's text in, a compiled selector out, a message's properties in, a
verdict out. Imports only the standard library (and may import ``chronomq.message``).
"""

from .sql92 import FilterSyntaxError, Selector, compile_sql92

__all__ = ["FilterSyntaxError", "Selector", "compile_sql92"]
